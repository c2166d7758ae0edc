//! Durable file operations: every write that a commit depends on is fsynced, and so is the
//! directory entry that names it.

use std::fs::{self, File, OpenOptions};
use std::io::Write;
use std::path::Path;

use super::error::StorageError;

/// Creates (or truncates) `path`, writes all of `parts` in order and fsyncs the file.
///
/// # Errors
/// [`StorageError::Io`] naming the file.
pub fn write_durable(path: &Path, parts: &[&[u8]]) -> Result<u64, StorageError> {
    let mut f = OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .open(path)
        .map_err(StorageError::io("create", path))?;
    let mut n = 0u64;
    for p in parts {
        f.write_all(p).map_err(StorageError::io("write", path))?;
        n += p.len() as u64;
    }
    f.sync_data().map_err(StorageError::io("fsync", path))?;
    Ok(n)
}

/// Fsyncs a directory so the entries created in it are durable.
///
/// # Errors
/// [`StorageError::Io`] naming the directory.
pub fn fsync_dir(path: &Path) -> Result<(), StorageError> {
    File::open(path)
        .and_then(|d| d.sync_all())
        .map_err(StorageError::io("fsync directory", path))
}

/// Atomically replaces `path` with `data`: writes a temporary sibling, fsyncs it, renames it
/// over `path` and fsyncs the directory. Readers see the old file or the new one, never a
/// part.
///
/// # Errors
/// [`StorageError::Io`] naming the file.
pub fn replace_durable(path: &Path, data: &[u8]) -> Result<(), StorageError> {
    let dir = path.parent().unwrap_or(Path::new("."));
    let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("file");
    let tmp = dir.join(format!(".{name}.tmp-{}", std::process::id()));
    write_durable(&tmp, &[data])?;
    fs::rename(&tmp, path).map_err(StorageError::io("rename", path))?;
    fsync_dir(dir)
}

/// Creates `path` and any missing parents, fsyncing each parent whose entries changed.
///
/// # Errors
/// [`StorageError::Io`] naming the directory.
pub fn create_dir_durable(path: &Path) -> Result<(), StorageError> {
    if path.is_dir() {
        return Ok(());
    }
    if let Some(parent) = path.parent()
        && !parent.as_os_str().is_empty()
    {
        create_dir_durable(parent)?;
    }
    match fs::create_dir(path) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists && path.is_dir() => return Ok(()),
        Err(e) => return Err(StorageError::io("create directory", path)(e)),
    }
    if let Some(parent) = path.parent()
        && !parent.as_os_str().is_empty()
    {
        fsync_dir(parent)?;
    }
    Ok(())
}
