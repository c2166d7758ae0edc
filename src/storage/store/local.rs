//! [`LocalStore`]: a directory of the local file system as a [`Store`], with the fast paths
//! the format has always used on POSIX file systems exposed as capabilities: `renameat2`
//! (exchange, no-replace), `flock`, `fsync` of files and directories, `writev` straight from
//! the caller's buffers, `sync_file_range` writeback, and file paths for `mmap` / `pread`.

use std::fs::{self, File, OpenOptions};
use std::io::{IoSlice, Write};
use std::ops::Range;
use std::os::unix::fs::{FileExt, MetadataExt};
use std::os::unix::io::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use super::{
    Capabilities, ListResult, LockMode, MultipartWrite, ObjectMeta, PutMode, PutResult, RenameMode,
    Store, StoreLock, UpdateVersion, check_location, join,
};
use crate::storage::error::StorageError;
use crate::storage::fsio::{create_dir_durable, fsync_dir};

/// Most slices passed to one `writev`.
const MAX_IOV: usize = 512;

/// A directory of the local file system as a [`Store`]: location `a/b` is the file
/// `<root>/a/b`, a prefix is a directory.
///
/// Puts are atomic and durable (a temporary sibling, fsynced, renamed into place, directory
/// fsynced). Multipart writers write the file in place with `writev` and start its writeback
/// when finished; [`Store::sync`] makes it durable. Put if absent uses
/// `renameat2(RENAME_NOREPLACE)` (or `link`); put if match compares the entity tag (inode,
/// modification time and size, as `object_store`'s local store makes it) under an exclusive
/// `flock` of the parent directory, so that conditional puts through any `LocalStore` exclude
/// each other.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LocalStore {
    root: PathBuf,
}

/// Distinguishes temporary files of concurrent puts in one process.
static TMP_COUNTER: AtomicU64 = AtomicU64::new(0);

impl LocalStore {
    /// The store rooted at directory `root` (not created here: puts create what they need).
    #[must_use]
    pub fn new(root: impl Into<PathBuf>) -> Self {
        LocalStore { root: root.into() }
    }

    /// The store holding directory `dir` and its siblings (rooted at its parent, `.` when it
    /// has none), and `dir`'s name in it.
    #[must_use]
    pub fn around(dir: &Path) -> (Self, String) {
        let parent = match dir.parent() {
            Some(p) if !p.as_os_str().is_empty() => p.to_owned(),
            _ => PathBuf::from("."),
        };
        let name = dir
            .file_name()
            .map_or_else(|| "checkpoint".into(), |n| n.to_string_lossy().into_owned());
        (LocalStore::new(parent), name)
    }

    /// The root directory.
    #[must_use]
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// The file or directory of `location`.
    #[must_use]
    pub fn path(&self, location: &str) -> PathBuf {
        if location.is_empty() {
            self.root.clone()
        } else {
            self.root.join(location)
        }
    }

    fn checked(&self, location: &str) -> Result<PathBuf, StorageError> {
        check_location(location)?;
        Ok(self.path(location))
    }

    /// Writes `payload` to a fresh temporary sibling of `path` and fsyncs it.
    fn write_temp(&self, path: &Path, payload: &[&[u8]]) -> Result<PathBuf, StorageError> {
        let dir = parent_dir(path);
        let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("file");
        let tmp = dir.join(format!(
            ".{name}.tmp-{}-{}",
            std::process::id(),
            TMP_COUNTER.fetch_add(1, Ordering::Relaxed)
        ));
        let mut f = create_file(&tmp)?;
        for p in payload {
            f.write_all(p).map_err(StorageError::io("write", &tmp))?;
        }
        f.sync_data().map_err(StorageError::io("fsync", &tmp))?;
        Ok(tmp)
    }
}

fn parent_dir(path: &Path) -> &Path {
    match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    }
}

/// Creates (or truncates) `path`, creating missing parent directories durably.
fn create_file(path: &Path) -> Result<File, StorageError> {
    let open = || {
        OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .open(path)
    };
    match open() {
        Ok(f) => Ok(f),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            create_dir_durable(parent_dir(path))?;
            open().map_err(StorageError::io("create", path))
        }
        Err(e) => Err(StorageError::io("create", path)(e)),
    }
}

/// The entity tag of a file: inode, modification time (ns) and size, in hex.
fn e_tag(m: &fs::Metadata) -> String {
    let mtime = m
        .mtime()
        .saturating_mul(1_000_000_000)
        .saturating_add(m.mtime_nsec());
    format!("{:x}-{:x}-{:x}", m.ino(), mtime, m.size())
}

fn object_meta(location: String, m: &fs::Metadata) -> ObjectMeta {
    ObjectMeta {
        location,
        size: m.len(),
        e_tag: Some(e_tag(m)),
        version: None,
    }
}

fn put_result(path: &Path) -> Result<PutResult, StorageError> {
    let m = fs::metadata(path).map_err(StorageError::io("stat", path))?;
    Ok(PutResult {
        e_tag: Some(e_tag(&m)),
        version: None,
    })
}

fn renameat2(a: &Path, b: &Path, flags: libc::c_uint) -> std::io::Result<()> {
    use std::os::unix::ffi::OsStrExt;
    let ca = std::ffi::CString::new(a.as_os_str().as_bytes())?;
    let cb = std::ffi::CString::new(b.as_os_str().as_bytes())?;
    // SAFETY: two valid NUL-terminated paths.
    let rc = unsafe {
        libc::renameat2(
            libc::AT_FDCWD,
            ca.as_ptr(),
            libc::AT_FDCWD,
            cb.as_ptr(),
            flags,
        )
    };
    if rc == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

/// True for the errors of a file system (or kernel) without a `renameat2` flag.
fn flag_unsupported(e: &std::io::Error) -> bool {
    matches!(
        e.raw_os_error(),
        Some(libc::EINVAL | libc::ENOSYS | libc::EOPNOTSUPP)
    )
}

/// Renames `from` to `to` unless `to` exists: `renameat2(RENAME_NOREPLACE)`, or, where the
/// file system lacks it, `link` + `unlink` (files only).
fn rename_noreplace(from: &Path, to: &Path) -> Result<(), StorageError> {
    match renameat2(from, to, libc::RENAME_NOREPLACE) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
            Err(StorageError::ObjectExists {
                path: to.to_owned(),
            })
        }
        Err(e) if flag_unsupported(&e) && from.is_file() => match fs::hard_link(from, to) {
            Ok(()) => fs::remove_file(from).map_err(StorageError::io("remove", from)),
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
                Err(StorageError::ObjectExists {
                    path: to.to_owned(),
                })
            }
            Err(e) => Err(StorageError::io("link", to)(e)),
        },
        Err(e) => Err(StorageError::io("rename", from)(e)),
    }
}

/// An exclusive `flock` on an open file (or directory), released when dropped.
#[derive(Debug)]
pub struct LocalLock {
    _file: File,
    location: String,
    path: PathBuf,
}

impl LocalLock {
    /// The lock file.
    #[must_use]
    pub fn path(&self) -> &Path {
        &self.path
    }
}

impl StoreLock for LocalLock {
    fn location(&self) -> &str {
        &self.location
    }
}

/// `flock(LOCK_EX)` on `file`, waiting (`wait`) or not.
fn flock(file: &File, wait: bool) -> std::io::Result<()> {
    let op = if wait {
        libc::LOCK_EX
    } else {
        libc::LOCK_EX | libc::LOCK_NB
    };
    loop {
        // SAFETY: a valid descriptor; flock has no memory effects.
        let rc = unsafe { libc::flock(file.as_raw_fd(), op) };
        if rc == 0 {
            return Ok(());
        }
        let e = std::io::Error::last_os_error();
        if e.kind() != std::io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
}

/// The writer of [`LocalStore::put_multipart`]: the file itself, written in place.
struct LocalWriter {
    file: File,
    path: PathBuf,
    written: u64,
}

impl MultipartWrite for LocalWriter {
    fn write_vectored(&mut self, parts: &[IoSlice<'_>]) -> Result<(), StorageError> {
        let mut owned: Vec<IoSlice<'_>> = parts.iter().filter(|p| !p.is_empty()).copied().collect();
        let total: usize = owned.iter().map(|p| p.len()).sum();
        let mut iov = &mut owned[..];
        while !iov.is_empty() {
            let n = iov.len().min(MAX_IOV);
            match self.file.write_vectored(&iov[..n]) {
                Ok(0) => {
                    return Err(StorageError::io("write", &self.path)(
                        std::io::ErrorKind::WriteZero.into(),
                    ));
                }
                Ok(w) => IoSlice::advance_slices(&mut iov, w),
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return Err(StorageError::io("write", &self.path)(e)),
            }
        }
        self.written += total as u64;
        Ok(())
    }

    fn written(&self) -> u64 {
        self.written
    }

    fn finish(self: Box<Self>) -> Result<PutResult, StorageError> {
        start_writeback(&self.file);
        let m = self
            .file
            .metadata()
            .map_err(StorageError::io("stat", &self.path))?;
        Ok(PutResult {
            e_tag: Some(e_tag(&m)),
            version: None,
        })
    }

    fn abort(self: Box<Self>) -> Result<(), StorageError> {
        drop(self.file);
        match fs::remove_file(&self.path) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(StorageError::io("remove", &self.path)(e)),
        }
    }
}

/// Asks the kernel to start writing the file's dirty pages now (without waiting), so the
/// disk works while later files are produced; the fsync before commit then waits less.
pub fn start_writeback(file: &File) {
    // SAFETY: a valid descriptor; the call only schedules I/O. Failure is harmless (the later
    // fsync does the work), so the result is ignored.
    unsafe {
        libc::sync_file_range(file.as_raw_fd(), 0, 0, libc::SYNC_FILE_RANGE_WRITE);
    }
}

fn not_found_is(e: &std::io::Error) -> bool {
    e.kind() == std::io::ErrorKind::NotFound
}

impl Store for LocalStore {
    fn display_path(&self, location: &str) -> PathBuf {
        self.path(location)
    }

    fn put_opts(
        &self,
        location: &str,
        payload: &[&[u8]],
        mode: PutMode,
    ) -> Result<PutResult, StorageError> {
        let path = self.checked(location)?;
        if location.is_empty() {
            return Err(StorageError::BadLocation {
                location: String::new(),
                reason: "a put needs an object location, not the root".into(),
            });
        }
        let tmp = self.write_temp(&path, payload)?;
        let dir = parent_dir(&path).to_owned();
        let placed = match &mode {
            PutMode::Overwrite => {
                fs::rename(&tmp, &path).map_err(StorageError::io("rename", &path))
            }
            PutMode::Create => rename_noreplace(&tmp, &path),
            PutMode::Update(expected) => {
                let d = File::open(&dir).map_err(StorageError::io("open directory", &dir))?;
                flock(&d, true).map_err(StorageError::io("lock directory", &dir))?;
                let r = check_version(&path, expected).and_then(|()| {
                    fs::rename(&tmp, &path).map_err(StorageError::io("rename", &path))
                });
                drop(d);
                r
            }
        };
        if let Err(e) = placed {
            let _ = fs::remove_file(&tmp);
            return Err(e);
        }
        fsync_dir(&dir)?;
        put_result(&path)
    }

    fn put_multipart(&self, location: &str) -> Result<Box<dyn MultipartWrite + '_>, StorageError> {
        let path = self.checked(location)?;
        let file = create_file(&path)?;
        Ok(Box::new(LocalWriter {
            file,
            path,
            written: 0,
        }))
    }

    fn get_ranges(
        &self,
        location: &str,
        ranges: &[Range<u64>],
    ) -> Result<Vec<Vec<u8>>, StorageError> {
        let path = self.checked(location)?;
        let file = File::open(&path).map_err(|e| {
            if not_found_is(&e) {
                StorageError::NotFound { path: path.clone() }
            } else {
                StorageError::io("open", &path)(e)
            }
        })?;
        ranges
            .iter()
            .map(|r| {
                let n = usize::try_from(r.end.saturating_sub(r.start)).map_err(|_| {
                    StorageError::TooLarge {
                        key: location.to_owned(),
                        path: path.clone(),
                        bytes: r.end - r.start,
                        reason: "larger than this machine's address space".into(),
                    }
                })?;
                let mut buf = vec![0u8; n];
                file.read_exact_at(&mut buf, r.start)
                    .map_err(StorageError::io("read", &path))?;
                Ok(buf)
            })
            .collect()
    }

    fn head(&self, location: &str) -> Result<ObjectMeta, StorageError> {
        let path = self.checked(location)?;
        match fs::metadata(&path) {
            Ok(m) if m.is_file() => Ok(object_meta(location.to_owned(), &m)),
            Ok(_) => Err(StorageError::NotFound { path }),
            Err(e) if not_found_is(&e) => Err(StorageError::NotFound { path }),
            Err(e) => Err(StorageError::io("stat", &path)(e)),
        }
    }

    fn list(&self, prefix: &str) -> Result<Vec<ObjectMeta>, StorageError> {
        let mut out = Vec::new();
        let mut todo = vec![prefix.to_owned()];
        while let Some(p) = todo.pop() {
            let l = self.list_with_delimiter(&p)?;
            out.extend(l.objects);
            todo.extend(l.common_prefixes);
        }
        out.sort_by(|a, b| a.location.cmp(&b.location));
        Ok(out)
    }

    fn list_with_delimiter(&self, prefix: &str) -> Result<ListResult, StorageError> {
        let dir = self.checked(prefix)?;
        let entries = match fs::read_dir(&dir) {
            Ok(e) => e,
            Err(e) if not_found_is(&e) || e.raw_os_error() == Some(libc::ENOTDIR) => {
                return Ok(ListResult::default());
            }
            Err(e) => return Err(StorageError::io("list", &dir)(e)),
        };
        let mut out = ListResult::default();
        for e in entries {
            let e = e.map_err(StorageError::io("list", &dir))?;
            let name = e.file_name().to_string_lossy().into_owned();
            let location = join(prefix, &name);
            // Follows symbolic links, as the file system's readers do; any entry that is not
            // a directory (a dangling link, a special file) is listed as an object, so that a
            // listing never hides an entry.
            let m = match fs::metadata(e.path()) {
                Ok(m) => m,
                Err(err) if not_found_is(&err) => match fs::symlink_metadata(e.path()) {
                    Ok(m) => m,
                    Err(err) if not_found_is(&err) => continue,
                    Err(err) => return Err(StorageError::io("stat", e.path())(err)),
                },
                Err(err) => return Err(StorageError::io("stat", e.path())(err)),
            };
            if m.is_dir() {
                out.common_prefixes.push(location);
            } else {
                out.objects.push(object_meta(location, &m));
            }
        }
        out.common_prefixes.sort();
        out.objects.sort_by(|a, b| a.location.cmp(&b.location));
        Ok(out)
    }

    fn delete(&self, location: &str) -> Result<(), StorageError> {
        let path = self.checked(location)?;
        match fs::remove_file(&path) {
            Ok(()) => Ok(()),
            Err(e) if not_found_is(&e) => Ok(()),
            Err(e) => Err(StorageError::io("remove", &path)(e)),
        }
    }

    fn delete_prefix(&self, prefix: &str) -> Result<(), StorageError> {
        let path = self.checked(prefix)?;
        let r = if path.is_dir() {
            fs::remove_dir_all(&path)
        } else {
            fs::remove_file(&path)
        };
        match r {
            Ok(()) => Ok(()),
            Err(e) if not_found_is(&e) => Ok(()),
            Err(e) => Err(StorageError::io("remove", &path)(e)),
        }
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities {
            rename: true,
            lock: true,
            explicit_sync: true,
            local_files: true,
            vectored_writes: true,
            writeback: true,
            directories: true,
            conditional_put: true,
        }
    }

    fn rename(&self, from: &str, to: &str, mode: RenameMode) -> Result<(), StorageError> {
        let (a, b) = (self.checked(from)?, self.checked(to)?);
        match mode {
            RenameMode::Replace => fs::rename(&a, &b).map_err(StorageError::io("rename", &a)),
            RenameMode::NoReplace => rename_noreplace(&a, &b),
            RenameMode::Exchange => match renameat2(&a, &b, libc::RENAME_EXCHANGE) {
                Ok(()) => Ok(()),
                Err(e) if flag_unsupported(&e) => Err(StorageError::Unsupported {
                    op: "rename (exchange)",
                    path: b,
                }),
                Err(e) => Err(StorageError::io("rename (exchange)", &b)(e)),
            },
        }
    }

    fn try_lock(
        &self,
        location: &str,
        mode: LockMode,
    ) -> Result<Option<Box<dyn StoreLock>>, StorageError> {
        let path = self.checked(location)?;
        let mut o = OpenOptions::new();
        o.read(true).write(true);
        if mode == LockMode::Create {
            if let Some(p) = path.parent()
                && !p.as_os_str().is_empty()
            {
                create_dir_durable(p)?;
            }
            o.create(true).truncate(false);
        }
        let file = match o.open(&path) {
            Ok(f) => f,
            Err(e) if mode == LockMode::Existing && not_found_is(&e) => return Ok(None),
            Err(e) => return Err(StorageError::io("open lock file", &path)(e)),
        };
        match flock(&file, false) {
            Ok(()) => Ok(Some(Box::new(LocalLock {
                _file: file,
                location: location.to_owned(),
                path,
            }))),
            Err(e) if e.raw_os_error() == Some(libc::EWOULDBLOCK) => Err(StorageError::Locked {
                path: path.clone(),
                lock: path,
            }),
            Err(e) => Err(StorageError::io("lock", &path)(e)),
        }
    }

    fn sync(&self, location: &str) -> Result<(), StorageError> {
        let path = self.checked(location)?;
        File::open(&path)
            .and_then(|f| f.sync_data())
            .map_err(StorageError::io("fsync", &path))
    }

    fn sync_prefix(&self, prefix: &str) -> Result<(), StorageError> {
        fsync_dir(&self.checked(prefix)?)
    }

    fn create_prefix(&self, prefix: &str) -> Result<(), StorageError> {
        create_dir_durable(&self.checked(prefix)?)
    }

    fn prefix_exists(&self, prefix: &str) -> Result<bool, StorageError> {
        Ok(self.checked(prefix)?.is_dir())
    }

    fn local_path(&self, location: &str) -> Option<PathBuf> {
        check_location(location).ok()?;
        Some(self.path(location))
    }
}

/// Checks (under the directory lock) that the file at `path` has version `expected`.
fn check_version(path: &Path, expected: &UpdateVersion) -> Result<(), StorageError> {
    let want = expected.e_tag.as_deref().unwrap_or("(no entity tag)");
    let found = match fs::metadata(path) {
        Ok(m) => e_tag(&m),
        Err(e) if not_found_is(&e) => {
            return Err(StorageError::Precondition {
                path: path.to_owned(),
                expected: want.to_owned(),
                found: "no object".into(),
            });
        }
        Err(e) => return Err(StorageError::io("stat", path)(e)),
    };
    if expected.e_tag.as_deref() == Some(found.as_str()) && expected.version.is_none() {
        Ok(())
    } else {
        Err(StorageError::Precondition {
            path: path.to_owned(),
            expected: want.to_owned(),
            found: format!("entity tag {found}"),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn store() -> (tempfile::TempDir, LocalStore) {
        let tmp = tempfile::tempdir().unwrap();
        let s = LocalStore::new(tmp.path());
        (tmp, s)
    }

    #[test]
    fn put_get_head_list_delete() {
        let (_t, s) = store();
        let r = s.put("a/b/x", &[b"hello ", b"world"]).unwrap();
        let m = s.head("a/b/x").unwrap();
        assert_eq!(m.size, 11);
        assert_eq!(m.e_tag, r.e_tag);
        assert_eq!(s.get("a/b/x", 100).unwrap(), b"hello world");
        assert!(matches!(
            s.get("a/b/x", 5),
            Err(StorageError::TooLarge { .. })
        ));
        assert_eq!(
            s.get_ranges("a/b/x", &[6..11, 0..5, 3..3]).unwrap(),
            vec![b"world".to_vec(), b"hello".to_vec(), Vec::new()]
        );
        assert!(s.get_ranges("a/b/x", &[8..12]).is_err(), "past the end");
        assert!(matches!(
            s.head("a/b/y"),
            Err(StorageError::NotFound { .. })
        ));
        assert!(matches!(s.head("a/b"), Err(StorageError::NotFound { .. })));
        assert!(matches!(
            s.get_ranges("nope", &[0..1]),
            Err(StorageError::NotFound { .. })
        ));
        s.put("a/y", &[b"1"]).unwrap();
        s.put("z", &[]).unwrap();
        let all: Vec<String> = s
            .list("")
            .unwrap()
            .into_iter()
            .map(|o| o.location)
            .collect();
        assert_eq!(all, ["a/b/x", "a/y", "z"]);
        let a: Vec<String> = s
            .list("a")
            .unwrap()
            .into_iter()
            .map(|o| o.location)
            .collect();
        assert_eq!(a, ["a/b/x", "a/y"]);
        let d = s.list_with_delimiter("a").unwrap();
        assert_eq!(d.common_prefixes, ["a/b"]);
        assert_eq!(d.objects.len(), 1);
        assert!(s.list("missing").unwrap().is_empty());
        s.delete("a/y").unwrap();
        s.delete("a/y").unwrap();
        s.delete_prefix("a").unwrap();
        assert!(!s.prefix_exists("a").unwrap());
        let left: Vec<String> = s
            .list("")
            .unwrap()
            .into_iter()
            .map(|o| o.location)
            .collect();
        assert_eq!(left, ["z"], "no temporary files are left");
        assert!(matches!(
            s.put("../x", &[b""]),
            Err(StorageError::BadLocation { .. })
        ));
        assert!(matches!(
            s.head("/etc/passwd"),
            Err(StorageError::BadLocation { .. })
        ));
    }

    #[test]
    fn conditional_puts() {
        let (_t, s) = store();
        let first = s.put_if_absent("p", &[b"1"]).unwrap();
        assert!(matches!(
            s.put_if_absent("p", &[b"2"]),
            Err(StorageError::ObjectExists { .. })
        ));
        assert_eq!(s.get("p", 10).unwrap(), b"1");
        let second = s
            .put_if_match("p", &[b"2"], &first.update_version())
            .unwrap();
        assert_ne!(first.e_tag, second.e_tag, "a replaced object has a new tag");
        assert!(matches!(
            s.put_if_match("p", &[b"3"], &first.update_version()),
            Err(StorageError::Precondition { .. })
        ));
        assert_eq!(s.get("p", 10).unwrap(), b"2");
        assert!(matches!(
            s.put_if_match("absent", &[b"3"], &first.update_version()),
            Err(StorageError::Precondition { .. })
        ));
        assert_eq!(
            s.head("p").unwrap().update_version(),
            second.update_version()
        );
        // Racing put-if-match with the same expected version: exactly one wins.
        let v = s.head("p").unwrap().update_version();
        let wins: usize = std::thread::scope(|sc| {
            let hs: Vec<_> = (0..8u8)
                .map(|i| {
                    let (s, v) = (&s, &v);
                    sc.spawn(move || s.put_if_match("p", &[&[i]], v).is_ok() as usize)
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).sum()
        });
        assert_eq!(wins, 1);
        let left: Vec<String> = s
            .list("")
            .unwrap()
            .into_iter()
            .map(|o| o.location)
            .collect();
        assert_eq!(left, ["p"]);
    }

    #[test]
    fn multipart_rename_lock_sync() {
        let (_t, s) = store();
        let mut w = s.put_multipart("d/shard").unwrap();
        w.write_vectored(&[IoSlice::new(b"ab"), IoSlice::new(b""), IoSlice::new(b"cd")])
            .unwrap();
        w.write(b"e").unwrap();
        assert_eq!(w.written(), 5);
        let r = w.finish().unwrap();
        s.sync("d/shard").unwrap();
        s.sync_prefix("d").unwrap();
        assert_eq!(s.head("d/shard").unwrap().e_tag, r.e_tag);
        assert_eq!(s.get("d/shard", 10).unwrap(), b"abcde");
        let w = s.put_multipart("d/gone").unwrap();
        w.abort().unwrap();
        assert!(s.head("d/gone").is_err());
        // Many slices (more than one writev batch).
        let parts: Vec<Vec<u8>> = (0..2000u32).map(|i| i.to_le_bytes().to_vec()).collect();
        let iov: Vec<IoSlice> = parts.iter().map(|p| IoSlice::new(p)).collect();
        let mut w = s.put_multipart("many").unwrap();
        w.write_vectored(&iov).unwrap();
        w.finish().unwrap();
        assert_eq!(s.get("many", 1 << 20).unwrap(), parts.concat());

        s.create_prefix("x/y").unwrap();
        s.put("x/y/f", &[b"1"]).unwrap();
        s.create_prefix("z").unwrap();
        s.put("z/g", &[b"2"]).unwrap();
        s.rename("x", "z", RenameMode::Exchange)
            .or_else(|e| match e {
                StorageError::Unsupported { .. } => {
                    s.rename("z", "w", RenameMode::NoReplace)?;
                    s.rename("x", "z", RenameMode::NoReplace)?;
                    s.rename("w", "x", RenameMode::NoReplace)
                }
                e => Err(e),
            })
            .unwrap();
        assert_eq!(s.get("z/y/f", 10).unwrap(), b"1");
        assert_eq!(s.get("x/g", 10).unwrap(), b"2");
        assert!(matches!(
            s.rename("x", "z", RenameMode::NoReplace),
            Err(StorageError::ObjectExists { .. })
        ));
        s.rename("x/g", "x/h", RenameMode::Replace).unwrap();
        assert!(s.head("x/g").is_err());

        let l = s.try_lock(".lk", LockMode::Create).unwrap().unwrap();
        assert_eq!(l.location(), ".lk");
        assert!(matches!(
            s.try_lock(".lk", LockMode::Create),
            Err(StorageError::Locked { .. })
        ));
        drop(l);
        assert!(s.try_lock(".lk", LockMode::Create).is_ok());
        assert!(s.try_lock(".absent", LockMode::Existing).unwrap().is_none());
        assert!(s.head(".absent").is_err(), "not created");
        assert_eq!(s.local_path("a/b"), Some(s.root().join("a/b")));
        assert!(s.capabilities().rename);
    }
}
