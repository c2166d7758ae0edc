//! Object-store URLs in a build without the `object-store` feature: refused with how to get
//! them.

use std::path::{Path, PathBuf};

/// A checkpoint argument: a local directory.
pub struct Local {
    path: PathBuf,
}

impl Local {
    /// The local directory.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

/// `p` itself; an object-store URL is an error naming the missing feature.
pub fn local(p: &Path) -> anyhow::Result<Local> {
    let s = p.to_string_lossy();
    if ["s3://", "gs://", "az://", "abfs://", "memory://"]
        .iter()
        .any(|x| s.starts_with(x))
    {
        anyhow::bail!(
            "{s}: this zarrckpt was built without object-store support (cargo feature `s3`, `gcs` or `azure`)"
        );
    }
    Ok(Local {
        path: p.to_path_buf(),
    })
}
