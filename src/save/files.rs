//! Writing a save's files into its destination, the one path every save takes: a local
//! directory (the commit protocol of spec § "Commit protocol") or a fresh generation on an
//! object store (its object-store profile), from the caller's buffers ([`write_files_to`]) or
//! from staging memory (the background writer of [`crate::Saver::save_async`]). Everything
//! goes through the storage seam ([`Store`]) and the one shard writer; on stores with
//! [`crate::storage::store::Capabilities::explicit_sync`] (a file system) shards and their
//! directories are synced once written, elsewhere a completed write is durable.

use std::collections::{BTreeSet, HashMap};
use std::path::Path;

use rayon::prelude::*;

use super::{AgreedLayout, Prepared, SaveOptions, chunk_source, entry_of, full_chunk_box};
use crate::comm::Communicator;
use crate::coord::{agree, io_pool};
use crate::error::Result;
use crate::objects::AgreedObjects;
use crate::plan::save::{ChunkWrite, RankTasks, SavePlan};
use crate::storage::footer::SaveId;
use crate::storage::store::{LocalStore, Store};
use crate::storage::{TensorArray, write};

/// Where a save writes, prepared on every rank (step 2): a local directory or an object
/// store's fresh generation.
pub(crate) enum Destination {
    /// A local directory: the checkpoint's, or its staging sibling.
    Local(Prepared),
    /// A fresh generation on an object store (boxed: it holds the store's client).
    #[cfg(feature = "object-store")]
    Remote(Box<super::remote::RemoteTarget>),
}

impl Destination {
    /// Step 2 (collective): prepares the target `dir` names, a local directory or an
    /// object-store URL (`s3://`, `gs://`, `az://`, `memory://`). On error nothing is left to
    /// clean up.
    pub(crate) fn prepare(
        dir: &Path,
        comm: &dyn Communicator,
        plan: &SavePlan,
        objects: Option<&AgreedObjects<'_>>,
        opts: &SaveOptions,
    ) -> Result<Self> {
        #[cfg(feature = "object-store")]
        if let Some(url) = super::remote::url_of(dir) {
            return super::remote::RemoteTarget::prepare(url, comm, plan, objects, opts)
                .map(|t| Destination::Remote(Box::new(t)));
        }
        super::prepare_directory(dir, comm, plan, objects, opts).map(Destination::Local)
    }

    /// Steps 4 and 5 (collective): `write_tensors` writes this rank's array documents and
    /// shards (given the store holding the checkpoint at its root, the root's name for
    /// messages, and the save id), this rank's object values follow, the outcome is agreed
    /// on, and the save is committed. A failed local save removes what it staged; a failed
    /// save to an object store leaves its generation for `gc` (it never deletes). Returns
    /// (tensor bytes, file bytes) this rank wrote.
    pub(crate) fn write_and_commit(
        &self,
        comm: &dyn Communicator,
        plan: &SavePlan,
        objects: Option<&AgreedObjects<'_>>,
        opts: &SaveOptions,
        write_tensors: impl FnOnce(&dyn Store, &Path, SaveId) -> Result<(u64, u64)>,
    ) -> Result<(u64, u64)> {
        match self {
            #[cfg(feature = "object-store")]
            Destination::Remote(t) => t.write_and_commit(comm, plan, objects, opts, |s, root| {
                write_tensors(s, root, t.id())
            }),
            Destination::Local(prepared) => {
                let outcome =
                    write_and_commit_local(comm, prepared, plan, objects, opts, write_tensors);
                if outcome.is_err() {
                    prepared.abandon();
                }
                outcome
            }
        }
    }
}

fn write_and_commit_local(
    comm: &dyn Communicator,
    prepared: &Prepared,
    plan: &SavePlan,
    objects: Option<&AgreedObjects<'_>>,
    opts: &SaveOptions,
    write_tensors: impl FnOnce(&dyn Store, &Path, SaveId) -> Result<(u64, u64)>,
) -> Result<(u64, u64)> {
    let dir = prepared.dir();
    let store = LocalStore::new(dir);
    let rank = u32::try_from(comm.rank()).unwrap_or(u32::MAX);
    let written = write_tensors(&store, dir, prepared.id).and_then(|(data, files)| match objects {
        Some(o) => Ok((
            data,
            files + crate::objects::write_values(dir, rank, o, prepared.id)?,
        )),
        None => Ok((data, files)),
    });
    let totals = agree(comm, written)?;
    super::commit_index(comm, prepared, plan, objects, opts)?;
    Ok(totals)
}

/// The threads writing this rank's files through `store`: `opts.io_threads` when given; else
/// on a store without local files (an object store, where a writing thread mostly waits for
/// its request) enough for the store's requests in flight
/// ([`crate::storage::remote::RemoteOptions::concurrency`]) and at least one per CPU; else one
/// per CPU (at most 8). Each thread holds at most one object below the multipart threshold
/// in memory, so this is also the save's memory bound on such a store.
pub(crate) fn writer_threads(store: &dyn Store, opts: &SaveOptions) -> usize {
    if opts.io_threads != 0 || store.capabilities().local_files {
        return opts.io_threads;
    }
    #[cfg(feature = "object-store")]
    let requests = opts.remote.concurrency;
    #[cfg(not(feature = "object-store"))]
    let requests = 0;
    crate::coord::default_threads().max(requests)
}

/// The arrays this rank writes documents or chunks of (by tensor index), and their prefixes.
pub(crate) struct Arrays {
    arrays: HashMap<usize, TensorArray>,
    prefixes: BTreeSet<String>,
}

impl Arrays {
    /// Opens the arrays this rank writes into (the checkpoint's root named `root`), writes
    /// the array documents it owns and creates every array prefix it writes into (in the
    /// current thread pool).
    pub(crate) fn start(
        store: &dyn Store,
        root: &Path,
        plan: &SavePlan,
        tasks: &RankTasks,
        opts: &SaveOptions,
        id: SaveId,
    ) -> Result<Self> {
        let mut arrays: HashMap<usize, TensorArray> = HashMap::new();
        for &ti in tasks
            .metadata
            .iter()
            .chain(tasks.writes.iter().map(|w| &w.tensor))
        {
            if let std::collections::hash_map::Entry::Vacant(v) = arrays.entry(ti) {
                let tp = &plan.tensors[ti];
                v.insert(TensorArray::create_for(
                    root,
                    &tp.key,
                    &entry_of(tp, opts.compression),
                    id,
                )?);
            }
        }
        tasks
            .metadata
            .par_iter()
            .try_for_each(|ti| write::write_array_metadata_to(store, &arrays[ti]))?;
        let prefixes: BTreeSet<String> = arrays.values().map(|a| a.entry().path.clone()).collect();
        for p in &prefixes {
            store.create_prefix(p)?;
        }
        Ok(Arrays { arrays, prefixes })
    }

    /// Writes the shard of `w` from `src` (the bytes of `src_box`); returns (tensor bytes,
    /// file bytes), after reporting the tensor bytes to the save's progress callback.
    pub(crate) fn write_chunk(
        &self,
        store: &dyn Store,
        plan: &SavePlan,
        w: &ChunkWrite,
        src: &[u8],
        src_box: &crate::model::Region,
        opts: &SaveOptions,
    ) -> Result<(u64, u64)> {
        let tp = &plan.tensors[w.tensor];
        let arr = &self.arrays[&w.tensor];
        let full = full_chunk_box(tp, &w.chunk);
        let n = write::write_shard_to(store, arr, &w.chunk, src, src_box, &full)?;
        // Invariant: a planned region lies inside its tensor.
        let data = w.region.num_elements().unwrap_or(0) * tp.dtype.size() as u64;
        if let Some(p) = &opts.progress {
            p(data);
        }
        Ok((data, n))
    }

    /// Makes the shards of `writes` durable, where the store needs it (in the current thread
    /// pool).
    pub(crate) fn sync_chunks<'w>(
        &self,
        store: &dyn Store,
        writes: impl IntoParallelIterator<Item = &'w ChunkWrite>,
    ) -> Result<()> {
        if !store.capabilities().explicit_sync {
            return Ok(());
        }
        writes
            .into_par_iter()
            .try_for_each(|w| Ok(store.sync(&self.arrays[&w.tensor].chunk_location(&w.chunk))?))
    }

    /// Makes the array prefixes durable, where the store needs it (in the current thread
    /// pool), once every shard in them is.
    pub(crate) fn sync_prefixes(&self, store: &dyn Store) -> Result<()> {
        if !store.capabilities().explicit_sync {
            return Ok(());
        }
        self.prefixes
            .par_iter()
            .try_for_each(|p| Ok(store.sync_prefix(p)?))
    }
}

/// Step 4 of a save from the caller's buffers: this rank writes its shards (and the array
/// documents it owns) through `store`, which holds the checkpoint at its root (a local
/// directory, or a fresh generation on an object store; `root` names it in messages), in
/// parallel, then makes them durable. Returns (tensor bytes, file bytes) written.
pub(crate) fn write_files_to(
    store: &dyn Store,
    root: &Path,
    agreed: &AgreedLayout<'_, '_>,
    received: &[Vec<Vec<u8>>],
    opts: &SaveOptions,
    id: SaveId,
) -> Result<(u64, u64)> {
    let (plan, tasks) = (&agreed.plan.plan, &agreed.plan.tasks);
    let pool = io_pool(writer_threads(store, opts))?;
    pool.install(|| -> Result<(u64, u64)> {
        let arrays = Arrays::start(store, root, plan, tasks, opts, id)?;
        let totals = tasks
            .writes
            .par_iter()
            .zip(received.par_iter())
            .map(|(w, recv)| {
                let (src, src_box) = chunk_source(&plan.tensors[w.tensor], w, &agreed.local, recv);
                arrays.write_chunk(store, plan, w, &src, &src_box, opts)
            })
            .try_reduce(|| (0, 0), |a, b| Ok((a.0 + b.0, a.1 + b.1)))?;
        arrays.sync_chunks(store, &tasks.writes)?;
        arrays.sync_prefixes(store)?;
        Ok(totals)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn writers_on_object_stores_have_a_thread_per_request_in_flight() {
        let dir = tempfile::tempdir().unwrap();
        let local = LocalStore::new(dir.path());
        let mut opts = SaveOptions::default();
        // Local files: the CPU default (0 asks the pool for one per CPU, at most 8).
        assert_eq!(writer_threads(&local, &opts), 0);
        opts.io_threads = 3;
        assert_eq!(writer_threads(&local, &opts), 3);
        #[cfg(feature = "object-store")]
        {
            let remote = crate::storage::remote::RemoteStore::open(
                "memory://threads/ckpt",
                &crate::storage::remote::RemoteOptions::default(),
            )
            .unwrap();
            assert_eq!(writer_threads(&remote, &opts), 3, "asked for: kept");
            opts.io_threads = 0;
            opts.remote.concurrency = 24;
            assert_eq!(writer_threads(&remote, &opts), 24);
            opts.remote.concurrency = 1;
            assert_eq!(
                writer_threads(&remote, &opts),
                crate::coord::default_threads()
            );
        }
    }
}
