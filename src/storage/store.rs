//! The storage seam: a small, synchronous trait shaped like the `object_store` crate's
//! `ObjectStore`, holding only what the zarrckpt format needs (put a whole object, put if
//! absent, put if it matches a version, a bounded multipart writer, ranged get of many ranges,
//! head, list a prefix, delete), plus capability methods through which a local file system
//! keeps its fast paths (rename and atomic directory exchange, `flock`-style locks, explicit
//! `fsync`, direct file access for `mmap` / `pread`, vectored writes, writeback).
//!
//! Locations are `/`-separated keys relative to the store's root (`tensors/w/c.0.0`), never
//! absolute, with no empty, `.` or `..` segment ([`check_location`]). A prefix is a location
//! whose objects lie below it; the empty prefix is the whole store.
//!
//! [`LocalStore`] is the one implementation here (a directory of the local file system); the
//! commit protocol ([`super::commit`]) and the shard writer ([`super::shard`]) are written
//! against the trait and use the capabilities where a store has them.

pub mod local;

use std::fmt::Debug;
use std::io::IoSlice;
use std::ops::Range;
use std::path::PathBuf;

use super::error::StorageError;

pub use local::LocalStore;

/// The version a conditional put expects the object to have now (`object_store`'s
/// `UpdateVersion`): its entity tag, and its version where the store keeps versions.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct UpdateVersion {
    /// The entity tag ([`ObjectMeta::e_tag`]).
    pub e_tag: Option<String>,
    /// The version ([`ObjectMeta::version`]).
    pub version: Option<String>,
}

/// How a put treats an object already at the location (`object_store`'s `PutMode`).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum PutMode {
    /// Replace whatever is there.
    #[default]
    Overwrite,
    /// Fail with [`StorageError::ObjectExists`] when an object is there (put if absent).
    Create,
    /// Fail with [`StorageError::Precondition`] unless the object there has this version
    /// (put if match).
    Update(UpdateVersion),
}

/// What a completed put returns: the new object's version.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct PutResult {
    /// The new entity tag.
    pub e_tag: Option<String>,
    /// The new version, where the store keeps versions.
    pub version: Option<String>,
}

impl PutResult {
    /// The version a later [`Store::put_if_match`] of this object expects.
    #[must_use]
    pub fn update_version(&self) -> UpdateVersion {
        UpdateVersion {
            e_tag: self.e_tag.clone(),
            version: self.version.clone(),
        }
    }
}

/// One object's metadata ([`Store::head`], [`Store::list`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ObjectMeta {
    /// Its location in the store.
    pub location: String,
    /// Its size in bytes.
    pub size: u64,
    /// Its entity tag (changes whenever the object is replaced).
    pub e_tag: Option<String>,
    /// Its version, where the store keeps versions.
    pub version: Option<String>,
}

impl ObjectMeta {
    /// The version a [`Store::put_if_match`] replacing this object expects.
    #[must_use]
    pub fn update_version(&self) -> UpdateVersion {
        UpdateVersion {
            e_tag: self.e_tag.clone(),
            version: self.version.clone(),
        }
    }
}

/// The children of a prefix ([`Store::list_with_delimiter`]).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ListResult {
    /// Prefixes directly below (directories), as full locations, sorted.
    pub common_prefixes: Vec<String>,
    /// Objects directly below, sorted by location.
    pub objects: Vec<ObjectMeta>,
}

/// What a store can do beyond the object operations every store has. The commit protocol
/// and the writers pick their path by these.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[allow(clippy::struct_excessive_bools)]
pub struct Capabilities {
    /// [`Store::rename`] moves objects and whole prefixes atomically (a directory rename);
    /// the commit protocol stages a save under a sibling prefix and swaps it in.
    pub rename: bool,
    /// [`Store::try_lock`] gives exclusive advisory locks that the system releases when the
    /// holder dies (`flock`).
    pub lock: bool,
    /// Finished multipart writes are durable only after [`Store::sync`] and the entries
    /// naming them after [`Store::sync_prefix`] (a page cache); false where a completed
    /// write is durable.
    pub explicit_sync: bool,
    /// Objects are files that [`Store::local_path`] names: readers may `mmap` or `pread`
    /// them directly.
    pub local_files: bool,
    /// Multipart writers write vectored (`writev`) straight from the caller's buffers, so
    /// many small slices cost no copy.
    pub vectored_writes: bool,
    /// A finished multipart writer has already started the system's writeback of its data,
    /// so the later [`Store::sync`] waits less.
    pub writeback: bool,
    /// Prefixes are directories that exist on their own ([`Store::create_prefix`]).
    pub directories: bool,
    /// Put if absent and put if match are atomic.
    pub conditional_put: bool,
}

/// How [`Store::rename`] treats the destination.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RenameMode {
    /// Replace what is at the destination (an empty directory, or a file).
    Replace,
    /// Fail with [`StorageError::ObjectExists`] when the destination exists.
    NoReplace,
    /// Exchange source and destination atomically (both must exist):
    /// [`StorageError::Unsupported`] where the file system cannot.
    Exchange,
}

/// Whether [`Store::try_lock`] creates the lock object.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LockMode {
    /// Create it when absent.
    Create,
    /// Lock it only when it exists (returns `None` otherwise).
    Existing,
}

/// The most bytes one range of a [`Store::get_ranges`] should ask for. An object store fetches
/// a range as one request up to this length, and a longer one as pieces of it, fetched at once
/// and joined into one buffer afterwards (a copy into fresh memory).
pub const GET_RANGE_BYTES: u64 = 8 << 20;

/// A held lock ([`Store::try_lock`]); released when dropped.
pub trait StoreLock: Debug + Send + Sync {
    /// The lock object's location.
    fn location(&self) -> &str;
}

/// A streaming writer of one object ([`Store::put_multipart`]), holding at most a bounded
/// part of it in memory. Nothing is visible as complete before [`MultipartWrite::finish`];
/// [`MultipartWrite::abort`] (or dropping it) abandons the upload. On stores with
/// [`Capabilities::explicit_sync`] the finished object is durable after [`Store::sync`].
pub trait MultipartWrite: Send {
    /// Appends all of `parts`, in order.
    ///
    /// # Errors
    /// I/O errors naming the object.
    fn write_vectored(&mut self, parts: &[IoSlice<'_>]) -> Result<(), StorageError>;

    /// Appends `data`.
    ///
    /// # Errors
    /// I/O errors naming the object.
    fn write(&mut self, data: &[u8]) -> Result<(), StorageError> {
        self.write_vectored(&[IoSlice::new(data)])
    }

    /// Bytes appended so far.
    fn written(&self) -> u64;

    /// True when [`MultipartWrite::write_vectored`] now copies the parts it is given into
    /// memory of its own (an object held for one request): a caller may then hand it many
    /// small pieces rather than gathering them into a buffer first. False (the default) where
    /// each part costs a system call or a wait.
    fn copies_parts(&self) -> bool {
        false
    }

    /// A hint that about `additional` more bytes will be appended, so that a writer holding
    /// the object in memory can allocate it once. The default ignores it.
    fn reserve(&mut self, additional: u64) {
        let _ = additional;
    }

    /// Completes the object.
    ///
    /// # Errors
    /// I/O errors naming the object.
    fn finish(self: Box<Self>) -> Result<PutResult, StorageError>;

    /// Abandons the upload (best effort: what was written may remain on a local file
    /// system, where the writer writes in place).
    ///
    /// # Errors
    /// I/O errors naming the object.
    fn abort(self: Box<Self>) -> Result<(), StorageError>;
}

/// A place objects are stored, shaped like `object_store::ObjectStore` (synchronous).
pub trait Store: Debug + Send + Sync {
    /// How `location` is named in messages: a file path, or a URL such as `s3://b/k`.
    fn display_path(&self, location: &str) -> PathBuf;

    /// Writes a whole object, the concatenation of `payload`, as `mode` says. The object
    /// appears whole or not at all, and is durable when this returns.
    ///
    /// # Errors
    /// [`StorageError::ObjectExists`] ([`PutMode::Create`]) and
    /// [`StorageError::Precondition`] ([`PutMode::Update`]) when the condition fails; I/O
    /// errors naming the object.
    fn put_opts(
        &self,
        location: &str,
        payload: &[&[u8]],
        mode: PutMode,
    ) -> Result<PutResult, StorageError>;

    /// Writes a whole object, replacing what is there.
    ///
    /// # Errors
    /// As [`Store::put_opts`].
    fn put(&self, location: &str, payload: &[&[u8]]) -> Result<PutResult, StorageError> {
        self.put_opts(location, payload, PutMode::Overwrite)
    }

    /// Writes a whole object unless one is there.
    ///
    /// # Errors
    /// [`StorageError::ObjectExists`] when one is; as [`Store::put_opts`].
    fn put_if_absent(&self, location: &str, payload: &[&[u8]]) -> Result<PutResult, StorageError> {
        self.put_opts(location, payload, PutMode::Create)
    }

    /// Replaces the object if it still has version `expected`.
    ///
    /// # Errors
    /// [`StorageError::Precondition`] when it does not (or is absent); as
    /// [`Store::put_opts`].
    fn put_if_match(
        &self,
        location: &str,
        payload: &[&[u8]],
        expected: &UpdateVersion,
    ) -> Result<PutResult, StorageError> {
        self.put_opts(location, payload, PutMode::Update(expected.clone()))
    }

    /// Told, once the shard object at `location` is written whole, its tail (footer and
    /// index, its last bytes). A store that keeps copies of shard tails for readers (the
    /// object-store profile's tail copies, spec section 20.7) keeps this one; others ignore it.
    fn shard_tail(&self, location: &str, tail: &[u8]) {
        let _ = (location, tail);
    }

    /// A streaming writer for one object.
    ///
    /// # Errors
    /// I/O errors naming the object.
    fn put_multipart(&self, location: &str) -> Result<Box<dyn MultipartWrite + '_>, StorageError>;

    /// Reads the byte ranges `ranges` of an object, one buffer per range, in order. A store
    /// may fetch a range longer than [`GET_RANGE_BYTES`] in pieces and join them (a copy):
    /// callers that can cut their ranges shorter should.
    ///
    /// # Errors
    /// [`StorageError::NotFound`] when it is absent; [`StorageError::Io`] (unexpected end of
    /// file) when a range ends past its end.
    fn get_ranges(
        &self,
        location: &str,
        ranges: &[Range<u64>],
    ) -> Result<Vec<Vec<u8>>, StorageError>;

    /// Reads a whole object of at most `max_bytes` bytes.
    ///
    /// # Errors
    /// [`StorageError::TooLarge`] when it is larger; as [`Store::get_ranges`].
    fn get(&self, location: &str, max_bytes: u64) -> Result<Vec<u8>, StorageError> {
        let meta = self.head(location)?;
        if meta.size > max_bytes {
            return Err(StorageError::TooLarge {
                key: location.to_owned(),
                path: self.display_path(location),
                bytes: meta.size,
                reason: format!("larger than the limit of {max_bytes} bytes for this object"),
            });
        }
        let whole = 0..meta.size;
        Ok(self
            .get_ranges(location, std::slice::from_ref(&whole))?
            .pop()
            .unwrap_or_default())
    }

    /// An object's metadata.
    ///
    /// # Errors
    /// [`StorageError::NotFound`] when it is absent.
    fn head(&self, location: &str) -> Result<ObjectMeta, StorageError>;

    /// Every object below `prefix` (recursively), sorted by location.
    ///
    /// # Errors
    /// I/O errors naming the prefix. An absent prefix lists nothing.
    fn list(&self, prefix: &str) -> Result<Vec<ObjectMeta>, StorageError>;

    /// The objects and prefixes directly below `prefix`.
    ///
    /// # Errors
    /// I/O errors naming the prefix. An absent prefix lists nothing.
    fn list_with_delimiter(&self, prefix: &str) -> Result<ListResult, StorageError>;

    /// Deletes an object; deleting an absent one is not an error.
    ///
    /// # Errors
    /// I/O errors naming the object.
    fn delete(&self, location: &str) -> Result<(), StorageError>;

    /// Deletes every object below `prefix`.
    ///
    /// # Errors
    /// I/O errors naming the object.
    fn delete_prefix(&self, prefix: &str) -> Result<(), StorageError> {
        for o in self.list(prefix)? {
            self.delete(&o.location)?;
        }
        Ok(())
    }

    /// What this store can do beyond the object operations.
    fn capabilities(&self) -> Capabilities;

    /// Renames an object or a whole prefix ([`Capabilities::rename`]). Not durable until
    /// [`Store::sync_prefix`] of the parents.
    ///
    /// # Errors
    /// [`StorageError::Unsupported`] where the store (or, for [`RenameMode::Exchange`], the
    /// file system) cannot; [`StorageError::ObjectExists`] for [`RenameMode::NoReplace`];
    /// I/O errors naming the source.
    fn rename(&self, from: &str, to: &str, mode: RenameMode) -> Result<(), StorageError> {
        let _ = (to, mode);
        Err(self.unsupported("rename", from))
    }

    /// Takes an exclusive lock on the object `location` without waiting
    /// ([`Capabilities::lock`]). `None` when `mode` is [`LockMode::Existing`] and it is
    /// absent.
    ///
    /// # Errors
    /// [`StorageError::Locked`] when another holder has it; [`StorageError::Unsupported`]
    /// where the store has no locks.
    fn try_lock(
        &self,
        location: &str,
        mode: LockMode,
    ) -> Result<Option<Box<dyn StoreLock>>, StorageError> {
        let _ = mode;
        Err(self.unsupported("lock", location))
    }

    /// Makes a finished object durable (`fsync`); nothing to do where writes are durable
    /// when they complete.
    ///
    /// # Errors
    /// I/O errors naming the object.
    fn sync(&self, location: &str) -> Result<(), StorageError> {
        let _ = location;
        Ok(())
    }

    /// Makes the entries directly below `prefix` durable (`fsync` of a directory).
    ///
    /// # Errors
    /// I/O errors naming the prefix.
    fn sync_prefix(&self, prefix: &str) -> Result<(), StorageError> {
        let _ = prefix;
        Ok(())
    }

    /// Creates `prefix` (and its parents) as directories, durably, where prefixes exist on
    /// their own ([`Capabilities::directories`]); nothing to do elsewhere.
    ///
    /// # Errors
    /// I/O errors naming the prefix.
    fn create_prefix(&self, prefix: &str) -> Result<(), StorageError> {
        let _ = prefix;
        Ok(())
    }

    /// True when `prefix` exists as a directory (stores with [`Capabilities::directories`])
    /// or holds at least one object.
    ///
    /// # Errors
    /// I/O errors naming the prefix.
    fn prefix_exists(&self, prefix: &str) -> Result<bool, StorageError> {
        let l = self.list_with_delimiter(prefix)?;
        Ok(!l.objects.is_empty() || !l.common_prefixes.is_empty())
    }

    /// The file holding `location`, where objects are files ([`Capabilities::local_files`]):
    /// readers `mmap` or `pread` it directly.
    fn local_path(&self, location: &str) -> Option<PathBuf> {
        let _ = location;
        None
    }

    /// The error for an operation this store does not have.
    fn unsupported(&self, op: &'static str, location: &str) -> StorageError {
        StorageError::Unsupported {
            op,
            path: self.display_path(location),
        }
    }
}

/// `prefix` joined with `name` by a `/` (the empty prefix is the root).
#[must_use]
pub fn join(prefix: &str, name: &str) -> String {
    match (prefix.is_empty(), name.is_empty()) {
        (true, _) => name.to_owned(),
        (_, true) => prefix.to_owned(),
        _ => format!("{prefix}/{name}"),
    }
}

/// The last segment of a location.
#[must_use]
pub fn file_name(location: &str) -> &str {
    location.rsplit('/').next().unwrap_or(location)
}

/// The prefix holding a location (`""` for one at the root).
#[must_use]
pub fn parent(location: &str) -> &str {
    location.rsplit_once('/').map_or("", |(p, _)| p)
}

/// Checks that `location` is a valid location (or, empty, the root prefix): relative,
/// `/`-separated, no empty, `.` or `..` segment, no NUL or backslash.
///
/// # Errors
/// [`StorageError::BadLocation`] saying what is wrong.
pub fn check_location(location: &str) -> Result<(), StorageError> {
    let bad = |reason: &str| StorageError::BadLocation {
        location: location.to_owned(),
        reason: reason.to_owned(),
    };
    if location.is_empty() {
        return Ok(());
    }
    if location.contains(['\0', '\\']) {
        return Err(bad("contains a NUL or a backslash"));
    }
    for seg in location.split('/') {
        match seg {
            "" => return Err(bad("has an empty segment (or starts or ends with `/`)")),
            "." | ".." => return Err(bad("has a `.` or `..` segment")),
            _ => {}
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn locations() {
        for ok in ["", "a", "a/b.c", ".hidden/x", "tensors/w/c.0.0"] {
            check_location(ok).unwrap();
        }
        for bad in ["/a", "a/", "a//b", "..", "a/../b", "./a", "a\\b", "a\0"] {
            assert!(check_location(bad).is_err(), "{bad:?}");
        }
        assert_eq!(join("", "a"), "a");
        assert_eq!(join("a", "b"), "a/b");
        assert_eq!(join("a", ""), "a");
        assert_eq!(parent("a/b/c"), "a/b");
        assert_eq!(parent("c"), "");
        assert_eq!(file_name("a/b/c"), "c");
    }
}
