//! The object steps of save and load: agreeing on the objects (digests gathered,
//! de-duplicated), writing the values each rank is assigned, the index entries, and loading
//! requested values back with the key checks of the strict mode.

use std::collections::BTreeMap;
use std::path::Path;

use crate::comm::Communicator;
use crate::coord::agree;
use crate::error::{Error, Result};
use crate::model::TensorKey;
use crate::model::object::{ObjectRequest, ObjectScope, ObjectSlot, ObjectValue, StateObject};
use crate::plan::StrictMode;
use crate::plan::objects::{self, GatheredObjects, ObjectPlan, PlannedScope};
use crate::storage::CheckpointMeta;
use crate::storage::object::{self as store, ObjectEntry, StoredScope};

/// The agreed object plan and this rank's objects with their stored bytes.
pub(crate) struct AgreedObjects<'o> {
    plan: ObjectPlan,
    local: Vec<(std::borrow::Cow<'o, StateObject>, Vec<u8>)>,
    /// Bytes this rank received in the object all-gathers.
    pub(crate) gathered_bytes: u64,
}

impl AgreedObjects<'_> {
    /// The same, owning its objects (an asynchronous save writes them in the background).
    pub(crate) fn into_owned(self) -> AgreedObjects<'static> {
        AgreedObjects {
            plan: self.plan,
            local: self
                .local
                .into_iter()
                .map(|(o, b)| (std::borrow::Cow::Owned(o.into_owned()), b))
                .collect(),
            gathered_bytes: self.gathered_bytes,
        }
    }
}

/// Save step: every rank describes its objects (values replaced by digests), the
/// descriptions are gathered de-duplicated, and every rank checks them and decides who writes
/// what. Identical outcome on every rank.
pub(crate) fn agree_on_objects<'o>(
    objects: &'o [StateObject],
    comm: &dyn Communicator,
) -> Result<AgreedObjects<'o>> {
    let (decls, values) = agree(comm, objects::declare(objects).map_err(Error::from))?;
    let encoded = objects::encode(&decls);
    let hash = objects::hash(&encoded);
    let hashes_raw = comm.all_gather(&hash)?;
    let mut hashes = Vec::with_capacity(hashes_raw.len());
    for (rank, h) in hashes_raw.iter().enumerate() {
        let h: [u8; 16] = h.as_slice().try_into().map_err(|_| {
            Error::ObjectPlan(objects::ObjectPlanError::Decode {
                rank,
                reason: "hash is not 16 bytes".into(),
            })
        })?;
        hashes.push(h);
    }
    let reps = crate::plan::GatheredLayouts::representatives(&hashes);
    let mine: &[u8] = if reps[comm.rank()] { &encoded } else { &[] };
    let blobs = comm.all_gather(mine)?;
    let gathered_bytes = (hashes_raw.len() * 16 + blobs.iter().map(Vec::len).sum::<usize>()) as u64;
    let gathered = GatheredObjects::from_parts(&hashes, &blobs)?;
    let plan = ObjectPlan::build(&gathered)?;
    // `declare` sorted by key; pair each value with its object again.
    let mut sorted: Vec<&StateObject> = objects.iter().collect();
    sorted.sort_by(|a, b| a.key().cmp(b.key()));
    Ok(AgreedObjects {
        plan,
        local: sorted
            .into_iter()
            .map(std::borrow::Cow::Borrowed)
            .zip(values)
            .collect(),
        gathered_bytes,
    })
}

/// The index entries of the agreed objects.
pub(crate) fn index_entries(agreed: &AgreedObjects<'_>) -> BTreeMap<TensorKey, ObjectEntry> {
    agreed
        .plan
        .objects
        .iter()
        .map(|(key, o)| {
            let mut e = ObjectEntry {
                path: store::object_path(key),
                scope: StoredScope::Common,
                encoding: o.encoding,
                size: None,
                world_size: None,
                grid: None,
            };
            match &o.scope {
                PlannedScope::Common { len } => e.size = Some(*len),
                PlannedScope::PerRank { world_size } => {
                    e.scope = StoredScope::PerRank;
                    e.world_size = Some(*world_size);
                }
                PlannedScope::Sharded { grid } => {
                    e.scope = StoredScope::Sharded;
                    e.grid = Some(grid.clone());
                }
            }
            (key.clone(), e)
        })
        .collect()
}

/// Save step (rank 0, with the directory's preparation): the group documents of `objects/`.
pub(crate) fn write_groups(dir: &Path, agreed: &AgreedObjects<'_>) -> Result<()> {
    let entries = index_entries(agreed);
    store::write_groups(dir, entries.iter()).map_err(Error::from)
}

/// [`write_groups`] through the storage seam (a save to an object store).
#[cfg(feature = "object-store")]
pub(crate) fn write_groups_to(
    to: &dyn crate::storage::store::Store,
    agreed: &AgreedObjects<'_>,
) -> Result<()> {
    let entries = index_entries(agreed);
    store::write_groups_to(to, entries.iter()).map_err(Error::from)
}

/// Save step: writes the values this rank was assigned, durably. Returns the file bytes.
pub(crate) fn write_values(
    dir: &Path,
    rank: u32,
    agreed: &AgreedObjects<'_>,
    save_id: crate::storage::footer::SaveId,
) -> Result<u64> {
    write_values_to(
        &crate::storage::store::LocalStore::new(dir),
        rank,
        agreed,
        save_id,
    )
}

/// [`write_values`] through the storage seam (`to` holds the checkpoint at its root).
pub(crate) fn write_values_to(
    to: &dyn crate::storage::store::Store,
    rank: u32,
    agreed: &AgreedObjects<'_>,
    save_id: crate::storage::footer::SaveId,
) -> Result<u64> {
    let entries = index_entries(agreed);
    let mut n = 0;
    for (obj, bytes) in &agreed.local {
        if !agreed.plan.writes(rank, obj) {
            continue;
        }
        let slot = match obj.scope() {
            ObjectScope::Common => ObjectSlot::Common,
            ObjectScope::PerRank => ObjectSlot::Rank(u64::from(rank)),
            ObjectScope::Sharded { index, .. } => ObjectSlot::Shard(index.clone()),
        };
        let Some(entry) = entries.get(obj.key()) else {
            continue;
        };
        n += store::write_value_to(to, obj.key(), entry, &slot, bytes, save_id)?;
    }
    Ok(n)
}

/// Checks one request against the index: the scope matches, the rank or shard exists.
/// `Ok(None)` when the key is absent (an unexpected key).
pub(crate) fn check_request<'m>(
    dir: &Path,
    meta: &'m CheckpointMeta,
    r: &ObjectRequest,
) -> Result<Option<&'m ObjectEntry>> {
    let Some(e) = meta.objects.get(&r.key) else {
        return Ok(None);
    };
    let requested = match r.slot {
        ObjectSlot::Common => StoredScope::Common,
        ObjectSlot::Rank(_) => StoredScope::PerRank,
        ObjectSlot::Shard(_) => StoredScope::Sharded,
    };
    if requested != e.scope {
        return Err(Error::ObjectScopeMismatch {
            key: r.key.clone(),
            path: dir.to_owned(),
            requested: requested.name(),
            stored: e.scope.name(),
        });
    }
    if let (Some(want), Some(have)) = (&r.grid, &e.grid)
        && want != have
    {
        return Err(Error::ObjectGridMismatch {
            key: r.key.clone(),
            path: dir.to_owned(),
            requested: want.clone(),
            stored: have.clone(),
        });
    }
    // Invariant for the fallbacks below: the scopes match (checked above), and a parsed
    // index gives every per-rank object a `world_size` and every sharded one a `grid`
    // (`ObjectEntry::validate`); a common object always has its slot.
    if !e.has_slot(&r.slot) {
        return Err(match &r.slot {
            ObjectSlot::Rank(rank) => Error::ObjectRankMissing {
                key: r.key.clone(),
                path: dir.to_owned(),
                rank: *rank,
                world_size: e.world_size.unwrap_or(0),
            },
            _ => Error::ObjectGridMismatch {
                key: r.key.clone(),
                path: dir.to_owned(),
                requested: match &r.slot {
                    ObjectSlot::Shard(i) => i.clone(),
                    _ => Vec::new(),
                },
                stored: e.grid.clone().unwrap_or_default(),
            },
        });
    }
    Ok(Some(e))
}

/// Reads one checked value.
pub(crate) fn read(
    src: store::ValueSource<'_>,
    meta: &CheckpointMeta,
    e: &ObjectEntry,
    r: &ObjectRequest,
) -> Result<ObjectValue> {
    let bytes = store::read_value_from(src, &r.key, e, &r.slot, meta.object_save_id())?;
    Ok(ObjectValue::from_stored(&r.key, e.encoding, bytes)?)
}

/// What the object step of a load found on this rank.
pub(crate) struct ObjectLoad {
    /// One per request, `None` where the key is absent and the mode skips it.
    pub(crate) values: Vec<Option<ObjectValue>>,
    /// Requested keys the checkpoint lacks.
    pub(crate) unexpected: Vec<TensorKey>,
    /// Object keys no rank requested (when the mode computes them).
    pub(crate) missing: Vec<TensorKey>,
}

/// Load step: checks this rank's requests against the index and reads them, and finds the
/// objects no rank requested (one bit per object gathered) for the modes that report them.
pub(crate) fn load_objects(
    dir: &Path,
    src: crate::storage::object::ValueSource<'_>,
    meta: &CheckpointMeta,
    requests: &[ObjectRequest],
    comm: &dyn Communicator,
    strict: StrictMode,
) -> Result<ObjectLoad> {
    let checked = (|| -> Result<(Vec<Option<&ObjectEntry>>, Vec<TensorKey>)> {
        let mut entries = Vec::with_capacity(requests.len());
        let mut unexpected = Vec::new();
        for r in requests {
            let e = check_request(dir, meta, r)?;
            if e.is_none() {
                unexpected.push(r.key.clone());
            }
            entries.push(e);
        }
        if strict.raises_unexpected() && !unexpected.is_empty() {
            return Err(Error::UnexpectedKeys {
                path: dir.to_owned(),
                keys: unexpected,
                rank: comm.rank(),
            });
        }
        Ok((entries, unexpected))
    })();
    let (entries, unexpected) = agree(comm, checked)?;
    // Gathered whatever the mode (one bit per object), so that ranks called with different
    // strict modes still run the same collectives.
    let keys: Vec<&TensorKey> = meta.objects.keys().collect();
    let mut bits = vec![0u8; keys.len().div_ceil(8)];
    for r in requests {
        if let Ok(i) = keys.binary_search(&&r.key) {
            bits[i / 8] |= 1 << (i % 8);
        }
    }
    let all = comm.all_gather(&bits)?;
    let missing: Vec<TensorKey> = if strict.needs_missing() {
        keys.iter()
            .enumerate()
            .filter(|(i, _)| {
                !all.iter()
                    .any(|b| b.get(i / 8).is_some_and(|b| b & (1 << (i % 8)) != 0))
            })
            .map(|(_, k)| (*k).clone())
            .collect()
    } else {
        Vec::new()
    };
    if matches!(strict, StrictMode::LogUnexpected | StrictMode::LogAll) {
        if !unexpected.is_empty() {
            tracing::warn!(rank = comm.rank(), keys = ?unexpected, "requested objects not in checkpoint {}", dir.display());
        }
        if !missing.is_empty() {
            tracing::warn!(keys = ?missing, "checkpoint objects requested by no rank in {}", dir.display());
        }
    }
    if strict == StrictMode::RaiseAll && !missing.is_empty() {
        return Err(Error::MissingKeys {
            path: dir.to_owned(),
            keys: missing,
        });
    }
    let values = requests
        .iter()
        .zip(&entries)
        .map(|(r, e)| e.map(|e| read(src, meta, e, r)).transpose())
        .collect::<Result<Vec<_>>>();
    let values = agree(comm, values)?;
    Ok(ObjectLoad {
        values,
        unexpected,
        missing,
    })
}
