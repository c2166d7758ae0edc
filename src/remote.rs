//! Checkpoints on object stores (feature `object-store`). A save goes straight to the store:
//! give [`crate::save()`] (or `save_with_objects`, `Saver::save`) the URL as its path, with
//! [`crate::SaveOptions::remote`]; each rank writes its objects into a fresh generation and
//! rank 0 commits without rename (the object-store profile of the commit in
//! `spec/format.md`). [`save_to_url`] uploads what a local save (or a copy) writes into a
//! staging directory (`zarrckpt cp DIR URL`); a load resolves the pointer, fetches the
//! committed generation's objects (each checked against the manifest's size and crc32c) into a
//! local directory, and opens that with the ordinary local reader.
//!
//! ```no_run
//! # fn main() -> zarrckpt::Result<()> {
//! use zarrckpt::remote::{self, RemoteOptions};
//! let comm = zarrckpt::LocalComm::single();
//! # let pieces: Vec<zarrckpt::ShardedTensor<'_>> = Vec::new();
//! let opts = zarrckpt::SaveOptions {
//!     remote: RemoteOptions::default(),
//!     ..Default::default()
//! };
//! zarrckpt::save(&pieces, "s3://bucket/run/step-100".as_ref(), &comm, &opts)?;
//! let fetched = remote::fetch_url("s3://bucket/run/step-100", &opts.remote, None)?;
//! let ckpt = zarrckpt::Checkpoint::open(fetched.dir())?;
//! # let _ = ckpt; Ok(()) }
//! ```

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::comm::Communicator;
use crate::error::{Error, Result};
use crate::storage::remote::generation::{self, PointerState};
use crate::storage::remote::require_conditional_writes;
pub use crate::storage::remote::{
    Condition, GcOptions, GcReport, ManifestEntry, RemoteError, RemoteOptions, RemoteStore,
    Resolved, gc, gc_with, is_url, probe, resolve,
};

/// Where a save on an object store stages its files and whether it may replace a checkpoint.
#[derive(Clone, Debug, Default)]
pub struct SaveTarget {
    /// Replace the checkpoint committed at the URL (a new generation and a pointer move; the
    /// old generation stays until `gc`). Without it a committed checkpoint is an error.
    pub overwrite: bool,
    /// The local directory the staging folders go into, visible to every rank of the save
    /// (one host, or a shared file system): `$ZARRCKPT_STAGING_DIR`, else the system temporary
    /// directory.
    pub staging_root: Option<PathBuf>,
}

/// What a save on an object store committed.
#[derive(Clone, Debug)]
pub struct RemoteSave<R> {
    /// What the local save returned on this rank.
    pub result: R,
    /// The committed generation.
    pub generation: String,
    /// Objects this rank uploaded.
    pub objects: usize,
    /// Their bytes.
    pub bytes: u64,
}

#[derive(Serialize, Deserialize)]
enum Start {
    Go {
        generation: String,
        previous: Option<(String, Option<String>)>,
    },
    Fail(String),
}

#[derive(Serialize, Deserialize)]
enum Uploaded {
    Ok(Vec<ManifestEntry>),
    Fail(String),
    /// Stopped early by another rank's abort marker (that rank's failure is reported).
    Abandoned(String),
}

fn staging_root(t: &SaveTarget) -> PathBuf {
    t.staging_root
        .clone()
        .or_else(|| std::env::var_os("ZARRCKPT_STAGING_DIR").map(PathBuf::from))
        .unwrap_or_else(std::env::temp_dir)
}

fn rank_failure(rank: usize, message: String) -> Error {
    Error::RemoteFailure { rank, message }
}

/// Saves to an object store. Every rank calls it with the same `url`; `save_local` is the
/// ordinary (collective) local save, given the staging directory. Then each rank uploads its
/// share of the staged files into a fresh generation, the ranks report their objects (sizes
/// and crc32c) to rank 0, which writes the manifest and root with put-if-absent and moves the
/// pointer with put-if-match (spec "Object-store profile of the commit"). The staging
/// directory is removed afterwards. Before anything is written, rank 0 probes once per
/// endpoint that the server honours conditional writes.
///
/// A rank whose upload fails reports it in the gather, so every rank returns an error naming
/// it (no rank waits in a barrier); the failed generation is left for `gc`, never deleted
/// during the save.
///
/// # Errors
/// [`RemoteError::Exists`] (no `overwrite`), [`RemoteError::Unconditional`] (probe),
/// [`RemoteError::Conflict`] (another save committed first), request errors naming the key,
/// [`Error::RemoteFailure`] naming the rank that failed, and whatever `save_local` returns.
pub fn save_to_url<R>(
    url: &str,
    comm: &dyn Communicator,
    ropts: &RemoteOptions,
    target: &SaveTarget,
    save_local: impl FnOnce(&Path) -> Result<R>,
) -> Result<RemoteSave<R>> {
    let rank = comm.rank();
    // Every rank opens the store; rank 0 also probes, reads the pointer and picks the
    // generation. Every rank learns every other's outcome, so all stop together.
    let mut mine = RemoteStore::open(url, ropts).and_then(|store| {
        let start = if rank == 0 {
            start_save(&store, target)?
        } else {
            Start::Fail(String::new())
        };
        Ok((store, start))
    });
    let report = match &mine {
        Ok((_, start)) => serde_json::to_vec(start),
        Err(e) => serde_json::to_vec(&Start::Fail(e.to_string())),
    }
    .expect("serialises");
    let gathered = comm.all_gather(&report)?;
    let mut go = None;
    for (r, g) in gathered.iter().enumerate() {
        let parsed: Start =
            serde_json::from_slice(g).map_err(|e| rank_failure(r, e.to_string()))?;
        match parsed {
            Start::Go {
                generation,
                previous,
            } if r == 0 => go = Some((generation, previous)),
            Start::Fail(m) if !m.is_empty() || r == 0 => {
                return Err(
                    match std::mem::replace(
                        &mut mine,
                        Err(RemoteError::Rank {
                            rank: r,
                            message: String::new(),
                        }),
                    ) {
                        Err(e) if r == rank => e.into(),
                        _ => rank_failure(r, m),
                    },
                );
            }
            _ => {}
        }
    }
    let (generation, previous) =
        go.ok_or_else(|| rank_failure(0, "no generation chosen".into()))?;
    let store = mine.map(|(s, _)| s)?;
    // The local save's lock file goes next to its directory: both inside this folder.
    let staging_parent = staging_root(target).join(format!("zarrckpt-staging-{generation}"));
    let staging = staging_parent.join("checkpoint");
    let result = save_local(&staging);
    let result = match result {
        Ok(r) => r,
        Err(e) => {
            if rank == 0 {
                let _ = std::fs::remove_dir_all(&staging_parent);
            }
            return Err(e);
        }
    };
    // Rank 0 lists the staged files once (so every rank deals from the same list); each rank
    // uploads its share (the root is rank 0's, last).
    let listed = if rank == 0 {
        generation::local_files(&staging).map_err(|e| e.to_string())
    } else {
        Err(String::new())
    };
    let listed: std::result::Result<Vec<String>, String> = serde_json::from_slice(
        &comm.broadcast(0, &serde_json::to_vec(&listed).expect("serialises"))?,
    )
    .map_err(|e| rank_failure(0, e.to_string()))?;
    let files = match listed {
        Ok(f) => f,
        Err(m) => {
            if rank == 0 {
                let _ = std::fs::remove_dir_all(&staging_parent);
            }
            return Err(rank_failure(0, m));
        }
    };
    let world = comm.world_size();
    let share: Vec<String> = files
        .into_iter()
        .filter(|f| f != generation::ROOT)
        .enumerate()
        .filter(|(i, _)| i % world == rank)
        .map(|(_, f)| f)
        .collect();
    let mine = generation::upload_files_as(&store, &generation, Some(rank), &staging, &share);
    let report = match &mine {
        Ok(entries) => Uploaded::Ok(entries.clone()),
        Err(e @ RemoteError::Abandoned { .. }) => Uploaded::Abandoned(e.to_string()),
        Err(e) => Uploaded::Fail(e.to_string()),
    };
    let gathered = comm.all_gather(&serde_json::to_vec(&report).expect("serialises"))?;
    let (objects, bytes) = mine
        .as_ref()
        .map(|m| (m.len(), m.iter().map(|e| e.size).sum()))
        .unwrap_or_default();
    let mut all = Vec::new();
    // The first failure in rank order that is not a stop on another rank's abort marker
    // (that rank's own failure is reported, naming it); else the first such stop.
    let mut failure: Option<(usize, String)> = None;
    let mut abandoned: Option<(usize, String)> = None;
    for (r, g) in gathered.iter().enumerate() {
        match serde_json::from_slice::<Uploaded>(g) {
            Ok(Uploaded::Ok(entries)) => all.extend(entries),
            Ok(Uploaded::Fail(m)) => {
                failure.get_or_insert((r, m));
            }
            Ok(Uploaded::Abandoned(m)) => {
                abandoned.get_or_insert((r, m));
            }
            Err(e) => {
                failure.get_or_insert((r, format!("malformed upload report: {e}")));
            }
        }
    }
    if let Some((r, m)) = failure.or(abandoned) {
        if rank == 0 {
            let _ = std::fs::remove_dir_all(&staging_parent);
        }
        return Err(match mine {
            Err(e) if r == rank => e.into(),
            Err(RemoteError::Abandoned { rank: Some(f), .. }) => rank_failure(f, m),
            _ => rank_failure(r, m),
        });
    }
    // Rank 0 commits and tells the others.
    let outcome = if rank == 0 {
        let previous = previous.map(|(g, etag)| PointerState {
            pointer: generation::Pointer {
                zarrckpt_pointer: 1,
                generation: g,
            },
            etag,
        });
        let root_local = staging.join(generation::ROOT);
        let r = std::fs::read(&root_local)
            .map_err(|e| RemoteError::Io {
                path: root_local.clone(),
                source: e,
            })
            .and_then(|root| {
                generation::commit_generation(&store, &generation, all, root, previous.as_ref())
            });
        let _ = std::fs::remove_dir_all(&staging_parent);
        let msg = r.as_ref().err().map(ToString::to_string);
        comm.broadcast(0, &serde_json::to_vec(&msg).expect("serialises"))?;
        r.map_err(Error::from)
    } else {
        let msg: Option<String> = serde_json::from_slice(&comm.broadcast(0, &[])?)
            .map_err(|e| rank_failure(0, e.to_string()))?;
        msg.map_or(Ok(()), |m| Err(rank_failure(0, m)))
    };
    outcome?;
    Ok(RemoteSave {
        result,
        generation,
        objects,
        bytes,
    })
}

fn start_save(store: &RemoteStore, target: &SaveTarget) -> std::result::Result<Start, RemoteError> {
    require_conditional_writes(store)?;
    let previous = generation::read_pointer(store)?;
    if let Some(p) = &previous
        && !target.overwrite
    {
        return Err(RemoteError::Exists {
            url: store.url().url(),
            generation: p.pointer.generation.clone(),
        });
    }
    Ok(Start::Go {
        generation: generation::new_generation(),
        previous: previous.map(|p| (p.pointer.generation, p.etag)),
    })
}

/// A committed generation fetched into a local directory.
#[derive(Debug)]
pub struct Fetched {
    dir: PathBuf,
    resolved: Resolved,
    temporary: Option<PathBuf>,
}

impl Fetched {
    /// The local checkpoint directory (open it with [`crate::Checkpoint::open`] or load from it).
    #[must_use]
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The generation and its manifest.
    #[must_use]
    pub fn resolved(&self) -> &Resolved {
        &self.resolved
    }
}

impl Drop for Fetched {
    fn drop(&mut self) {
        if let Some(t) = &self.temporary {
            let _ = std::fs::remove_dir_all(t);
        }
    }
}

/// Resolves the checkpoint at `url` and fetches its committed generation into a local
/// directory: under `cache` when given (`<cache>/<generation>`, reused when already there:
/// generations never change; several processes may fetch at once, the first complete copy
/// wins), else into a temporary directory removed when the [`Fetched`] is dropped. Every
/// object is checked against the manifest's size and crc32c as it arrives.
///
/// # Errors
/// [`RemoteError::NotFound`], [`RemoteError::Corrupt`], request and I/O errors.
pub fn fetch_url(url: &str, ropts: &RemoteOptions, cache: Option<&Path>) -> Result<Fetched> {
    let store = RemoteStore::open(url, ropts)?;
    let resolved = generation::resolve(&store)?;
    let (dir, temporary) = match cache {
        Some(c) => (c.join(&resolved.generation), None),
        None => {
            let t = std::env::temp_dir().join(format!(
                "zarrckpt-fetch-{}",
                crate::storage::footer::SaveId::random().hex()
            ));
            (t.join(&resolved.generation), Some(t))
        }
    };
    if !dir.join(generation::ROOT).is_file() {
        match generation::download(&store, &resolved, &dir) {
            Ok(()) => {}
            // Another process completed the same generation first.
            Err(_) if dir.join(generation::ROOT).is_file() => {}
            Err(e) => {
                if let Some(t) = &temporary {
                    let _ = std::fs::remove_dir_all(t);
                }
                return Err(e.into());
            }
        }
    }
    Ok(Fetched {
        dir,
        resolved,
        temporary,
    })
}
