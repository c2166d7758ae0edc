//! The save to an object store (feature `object-store`): the same plan and the same writers
//! as a local save, through the storage seam into a fresh generation, committed without
//! rename (spec "Object-store profile of the commit"). A synchronous save
//! ([`crate::save()`], [`crate::Saver::save`]) and an asynchronous one (the background writer
//! of [`crate::Saver::save_async`], so also the checkpoint manager and saves of device pieces)
//! go through the same [`RemoteTarget`]: only where the shard bytes come from differs (the
//! caller's buffers, or the staging arenas).
//!
//! 1. [`RemoteTarget::prepare`]: rank 0 checks the index against the readers' limits, probes
//!    once per endpoint that the server honours conditional writes, reads the pointer
//!    (refusing a committed checkpoint without `overwrite`) and draws the generation and save
//!    id; every rank opens the store; the outcome is agreed on, then the choice broadcast.
//! 2. [`RemoteTarget::write_and_commit`]: every rank writes its shards, array documents and
//!    object values straight into the generation ([`GenerationWriter`]: one PUT below the
//!    multipart threshold, a multipart upload with bounded parts in flight above it,
//!    put-if-absent, size and crc32c recorded); rank 0 also writes the group documents. No
//!    local copy.
//! 3. The outcome is agreed on: a rank whose write failed (or whose deadline passed) makes
//!    every rank return an error naming it, the object and the cause; nothing is committed
//!    and nothing deleted (the generation is left for `gc`).
//! 4. The manifest entries are gathered to rank 0, which writes the manifest and the root
//!    `zarr.json` with put-if-absent and moves the pointer with put-if-match (put-if-absent
//!    for the first commit); the outcome is agreed on.

use std::path::Path;
use std::time::Instant;

use serde::{Deserialize, Serialize};

use super::{SaveOptions, check_user, index_of};
use crate::comm::Communicator;
use crate::coord::agree;
use crate::error::{Error, Result};
use crate::objects::AgreedObjects;
use crate::plan::save::SavePlan;
use crate::storage::footer::SaveId;
use crate::storage::remote::generation::{self, Pointer, PointerState};
use crate::storage::remote::{
    GenerationWriter, ManifestEntry, RemoteError, RemoteStore, is_url, require_conditional_writes,
};
use crate::storage::store::Store;

/// The URL `dir` names, when it names an object store (`s3://`, `gs://`, `az://`,
/// `memory://`).
pub(crate) fn url_of(dir: &Path) -> Option<&str> {
    dir.to_str().filter(|s| is_url(s))
}

/// What rank 0 decided before anything was written.
#[derive(Serialize, Deserialize)]
struct Start {
    generation: String,
    save_id: [u8; 16],
    previous: Option<(String, Option<String>)>,
}

fn start(
    store: &RemoteStore,
    overwrite: bool,
) -> std::result::Result<(String, Option<PointerState>), RemoteError> {
    require_conditional_writes(store)?;
    let previous = generation::read_pointer(store)?;
    if let Some(p) = &previous
        && !overwrite
    {
        return Err(RemoteError::Exists {
            url: store.url().url(),
            generation: p.pointer.generation.clone(),
        });
    }
    Ok((generation::new_generation(), previous))
}

fn malformed(what: &str, e: &serde_json::Error) -> Error {
    Error::RemoteFailure {
        rank: 0,
        message: format!("malformed {what}: {e}"),
    }
}

/// A save's target on an object store, prepared on every rank (step 1 of the module docs):
/// the store, the fresh generation and the save id every rank learned from rank 0.
pub(crate) struct RemoteTarget {
    url: String,
    store: RemoteStore,
    start: Start,
    id: SaveId,
    deadline: Option<Instant>,
}

impl RemoteTarget {
    /// Step 1 (collective): opens the store on every rank; rank 0 checks the index's limits,
    /// probes the server, reads the pointer and draws the generation; every rank learns the
    /// outcome and the choice. The save's deadline counts from here.
    pub(crate) fn prepare(
        url: &str,
        comm: &dyn Communicator,
        plan: &SavePlan,
        objects: Option<&AgreedObjects<'_>>,
        opts: &SaveOptions,
    ) -> Result<Self> {
        let deadline = opts.deadline.map(|d| Instant::now() + d);
        let rank = comm.rank();
        let opened = RemoteStore::open(url, &opts.remote).map_err(Error::from);
        let decided = opened.and_then(|store| {
            if rank != 0 {
                return Ok((store, None));
            }
            check_user(Path::new(url), &opts.user_metadata)?;
            index_of(comm, plan, objects, opts, SaveId([0; 16])).check_writable()?;
            let (generation, previous) = start(&store, opts.overwrite)?;
            Ok((store, Some((generation, previous))))
        });
        let (store, mine) = agree(comm, decided)?;
        let msg = mine.as_ref().map(|(g, p)| {
            serde_json::to_vec(&Start {
                generation: g.clone(),
                save_id: SaveId::random().0,
                previous: p
                    .as_ref()
                    .map(|p| (p.pointer.generation.clone(), p.etag.clone())),
            })
            .unwrap_or_default()
        });
        let got = comm.broadcast(0, msg.as_deref().unwrap_or(&[]))?;
        let start: Start = serde_json::from_slice(&got).map_err(|e| malformed("save start", &e))?;
        if !generation::valid_generation(&start.generation) {
            return Err(Error::RemoteFailure {
                rank: 0,
                message: format!("malformed generation id {:?}", start.generation),
            });
        }
        tracing::info!(rank, url, generation = %start.generation, "save: writing the generation");
        Ok(RemoteTarget {
            url: url.to_owned(),
            id: SaveId(start.save_id),
            store,
            start,
            deadline,
        })
    }

    /// The save id every rank writes into its shard footers.
    pub(crate) fn id(&self) -> SaveId {
        self.id
    }

    /// Steps 2 to 4 (collective): rank 0 writes the group documents, every rank its tensors
    /// (`write_tensors`, given the store seam onto the generation and the name of the
    /// checkpoint's root for messages) and object values, the outcome is agreed on, and rank 0
    /// commits. Returns (tensor bytes, object bytes) this rank wrote.
    pub(crate) fn write_and_commit(
        &self,
        comm: &dyn Communicator,
        plan: &SavePlan,
        objects: Option<&AgreedObjects<'_>>,
        opts: &SaveOptions,
        write_tensors: impl FnOnce(&dyn Store, &Path) -> Result<(u64, u64)>,
    ) -> Result<(u64, u64)> {
        let t0 = Instant::now();
        let (rank, url) = (comm.rank(), self.url.as_str());
        let writer = GenerationWriter::new(&self.store, &self.start.generation, self.deadline)
            .with_rank(rank);
        let written = write_groups(&writer, rank, plan, objects)
            .and_then(|()| write_tensors(&writer, Path::new(url)))
            .and_then(|(data, files)| match objects {
                Some(o) => {
                    let rank32 = u32::try_from(rank).unwrap_or(u32::MAX);
                    Ok((
                        data,
                        files + crate::objects::write_values_to(&writer, rank32, o, self.id)?,
                    ))
                }
                None => Ok((data, files)),
            })
            .and_then(|t| writer.write_tails().map(|()| t).map_err(Into::into));
        if let Err(e) = &written {
            tracing::warn!(rank, url, error = %e, "save: this rank's write failed");
        }
        // Step 3: every rank learns whether every rank's objects are durable.
        let totals = agree(comm, written)?;
        tracing::info!(
            rank,
            url,
            bytes = writer.bytes(),
            secs = t0.elapsed().as_secs_f64(),
            "save: this rank's objects are durable"
        );
        // Step 4: the manifest entries travel to rank 0, which commits.
        let entries = serde_json::to_vec(&writer.take_entries()).unwrap_or_default();
        let gathered = comm.all_gather(&entries)?;
        let committed = if rank == 0 {
            self.commit(comm, &gathered, plan, objects, opts)
        } else {
            Ok(())
        };
        agree(comm, committed)?;
        tracing::info!(rank, url, generation = %self.start.generation, "save: committed");
        Ok(totals)
    }

    /// Rank 0: the manifest, the root `zarr.json` and the pointer move.
    fn commit(
        &self,
        comm: &dyn Communicator,
        gathered: &[Vec<u8>],
        plan: &SavePlan,
        objects: Option<&AgreedObjects<'_>>,
        opts: &SaveOptions,
    ) -> Result<()> {
        let mut all: Vec<ManifestEntry> = Vec::new();
        for (r, g) in gathered.iter().enumerate() {
            let mut e: Vec<ManifestEntry> =
                serde_json::from_slice(g).map_err(|e| Error::RemoteFailure {
                    rank: r,
                    message: format!("malformed manifest entries: {e}"),
                })?;
            all.append(&mut e);
        }
        let root = index_of(comm, plan, objects, opts, self.id).to_root_json();
        let previous = self.start.previous.as_ref().map(|(g, etag)| PointerState {
            pointer: Pointer {
                zarrckpt_pointer: 1,
                generation: g.clone(),
            },
            etag: etag.clone(),
        });
        generation::commit_generation(
            &self.store,
            &self.start.generation,
            all,
            root,
            previous.as_ref(),
        )?;
        Ok(())
    }
}

/// Rank 0's group documents (tensors and objects).
fn write_groups(
    writer: &GenerationWriter<'_>,
    rank: usize,
    plan: &SavePlan,
    objects: Option<&AgreedObjects<'_>>,
) -> Result<()> {
    if rank != 0 {
        return Ok(());
    }
    crate::storage::commit::write_groups_to(writer, plan.tensors.iter().map(|t| &t.key))?;
    if let Some(o) = objects {
        crate::objects::write_groups_to(writer, o)?;
    }
    Ok(())
}
