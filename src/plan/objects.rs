//! Objects at save time: what each rank declares (a constant-size description per object,
//! with a digest instead of the value), the checks across ranks (common values agree, every
//! rank has its per-rank value, every shard of a grid is there and its replicas agree), and
//! who writes which value. Pure: no I/O, no network.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fmt::Write as _;

use serde::{Deserialize, Serialize};

use crate::model::TensorKey;
use crate::model::object::{
    Encoding, ObjectScope, ObjectSlot, StateObject, check_grid, linear_index,
};

/// How the ranks' object declarations fail to agree.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ObjectPlanError {
    /// Ranks declare a common object (or replicas of one shard) with different values.
    #[error("object `{key}`{}: ranks declare different values: {}", shard_suffix(.shard.as_deref()), fmt_groups(.groups))]
    Disagreement {
        /// The object.
        key: TensorKey,
        /// The shard index, for a sharded object.
        shard: Option<Vec<u64>>,
        /// The ranks grouped by the value they declare (each group ascending, groups by
        /// their lowest rank).
        groups: Vec<Vec<u32>>,
    },
    /// Ranks declare one key with different scopes, encodings or grids.
    #[error("object `{key}`: ranks {} declare it as {first}, ranks {} as {second}", fmt_ranks(.first_ranks), fmt_ranks(.second_ranks))]
    Conflict {
        /// The object.
        key: TensorKey,
        /// One declaration (scope, encoding and grid).
        first: String,
        /// The ranks declaring it.
        first_ranks: Vec<u32>,
        /// Another declaration.
        second: String,
        /// The ranks declaring that.
        second_ranks: Vec<u32>,
    },
    /// A per-rank object some ranks do not declare.
    #[error("per-rank object `{key}`: every rank must declare it; ranks {} do not", fmt_ranks(.missing))]
    PerRankIncomplete {
        /// The object.
        key: TensorKey,
        /// The ranks that do not declare it.
        missing: Vec<u32>,
    },
    /// A shard of a sharded object's grid that no rank declares.
    #[error("sharded object `{key}`: no rank declares shard {index:?} of grid {grid:?}")]
    ShardMissing {
        /// The object.
        key: TensorKey,
        /// The grid.
        grid: Vec<u64>,
        /// The first missing index.
        index: Vec<u64>,
    },
    /// A rank's description does not decode or does not match its hash.
    #[error("rank {rank} sent a malformed object description: {reason}")]
    Decode {
        /// The rank.
        rank: usize,
        /// What is wrong.
        reason: String,
    },
}

fn shard_suffix(shard: Option<&[u64]>) -> String {
    shard.map_or_else(String::new, |s| format!(" shard {s:?}"))
}

/// Ranks as a compact list of ranges, at most 16 ranges shown: `[0-3, 8, 10-11]`.
fn fmt_ranks(r: &[u32]) -> String {
    let mut parts: Vec<String> = Vec::new();
    let mut i = 0;
    while i < r.len() {
        let mut j = i;
        while j + 1 < r.len() && r[j + 1] == r[j] + 1 {
            j += 1;
        }
        parts.push(if i == j {
            r[i].to_string()
        } else {
            format!("{}-{}", r[i], r[j])
        });
        i = j + 1;
    }
    let n = parts.len();
    let mut s = parts.into_iter().take(16).collect::<Vec<_>>().join(", ");
    if n > 16 {
        let _ = write!(s, ", … ({} ranges more)", n - 16);
    }
    format!("[{s}]")
}

fn fmt_groups(g: &[Vec<u32>]) -> String {
    g.iter()
        .enumerate()
        .map(|(i, r)| {
            let which = if i == 0 { "one value" } else { "another" };
            format!("ranks {} {which}", fmt_ranks(r))
        })
        .collect::<Vec<_>>()
        .join(", ")
}

/// The scope as declared, without the value.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(tag = "scope", rename_all = "snake_case")]
pub enum DeclScope {
    /// Common, with the value's digest and stored length.
    Common {
        /// xxh3-128 of the stored bytes, hex.
        digest: String,
        /// Stored length in bytes.
        len: u64,
    },
    /// Per-rank: the value stays on its rank, so the description is the same on every rank.
    PerRank,
    /// One shard of a grid, with the value's digest and length.
    Sharded {
        /// The grid.
        grid: Vec<u64>,
        /// This shard's index.
        index: Vec<u64>,
        /// xxh3-128 of the stored bytes, hex.
        digest: String,
        /// Stored length in bytes.
        len: u64,
    },
}

/// One object as a rank describes it to the others.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct ObjectDecl {
    /// The key.
    pub key: TensorKey,
    /// The encoding.
    pub encoding: Encoding,
    /// The scope, with the value's digest where the value is compared.
    #[serde(flatten)]
    pub scope: DeclScope,
}

fn digest(bytes: &[u8]) -> String {
    format!("{:032x}", xxhash_rust::xxh3::xxh3_128(bytes))
}

/// This rank's declarations, sorted by key, and its stored values in the same order.
///
/// # Errors
/// [`crate::model::ObjectError::Duplicate`] when a key appears twice.
pub fn declare(
    objects: &[StateObject],
) -> Result<(Vec<ObjectDecl>, Vec<Vec<u8>>), crate::model::ObjectError> {
    let mut sorted: Vec<&StateObject> = objects.iter().collect();
    sorted.sort_by(|a, b| a.key().cmp(b.key()));
    for w in sorted.windows(2) {
        if w[0].key() == w[1].key() {
            return Err(crate::model::ObjectError::Duplicate {
                key: w[0].key().clone(),
            });
        }
    }
    let mut decls = Vec::with_capacity(sorted.len());
    let mut values = Vec::with_capacity(sorted.len());
    for o in sorted {
        let stored = o.value().to_stored();
        let len = stored.len() as u64;
        let scope = match o.scope() {
            ObjectScope::Common => DeclScope::Common {
                digest: digest(&stored),
                len,
            },
            ObjectScope::PerRank => DeclScope::PerRank,
            ObjectScope::Sharded { grid, index } => DeclScope::Sharded {
                grid: grid.clone(),
                index: index.clone(),
                digest: digest(&stored),
                len,
            },
        };
        decls.push(ObjectDecl {
            key: o.key().clone(),
            encoding: o.value().encoding(),
            scope,
        });
        values.push(stored);
    }
    Ok((decls, values))
}

/// Encodes a rank's declarations for the all-gather.
#[must_use]
pub fn encode(decls: &[ObjectDecl]) -> Vec<u8> {
    // Invariant: plain structs with string keys always serialize.
    serde_json::to_vec(decls).unwrap_or_default()
}

/// The hash of an encoded description (ranks with equal hashes send it once).
#[must_use]
pub fn hash(encoded: &[u8]) -> [u8; 16] {
    xxhash_rust::xxh3::xxh3_128(encoded).to_le_bytes()
}

/// Everyone's declarations: the distinct descriptions and the ranks that sent each.
#[derive(Debug, Clone, Default)]
pub struct GatheredObjects {
    /// Distinct descriptions, ordered by their lowest rank.
    pub unique: Vec<Vec<ObjectDecl>>,
    /// For each, the ranks that declared it (ascending).
    pub ranks: Vec<Vec<u32>>,
    /// Number of ranks.
    pub world_size: u32,
}

impl GatheredObjects {
    /// Rebuilds the view from the first-round hashes and the second-round blobs (non-empty
    /// for the lowest rank of each distinct hash, see
    /// [`crate::plan::GatheredLayouts::representatives`]).
    ///
    /// # Errors
    /// [`ObjectPlanError::Decode`] when a description is malformed or does not match its hash.
    pub fn from_parts(hashes: &[[u8; 16]], blobs: &[Vec<u8>]) -> Result<Self, ObjectPlanError> {
        let reps = crate::plan::GatheredLayouts::representatives(hashes);
        let mut index_of: HashMap<[u8; 16], usize> = HashMap::new();
        let mut g = GatheredObjects {
            world_size: u32::try_from(hashes.len()).unwrap_or(u32::MAX),
            ..Self::default()
        };
        for (r, h) in hashes.iter().enumerate() {
            let r32 = u32::try_from(r).unwrap_or(u32::MAX);
            if reps[r] {
                let bad = |reason: String| ObjectPlanError::Decode { rank: r, reason };
                let blob = blobs.get(r).ok_or_else(|| bad("nothing received".into()))?;
                if hash(blob) != *h {
                    return Err(bad("description does not match its hash".into()));
                }
                let decls: Vec<ObjectDecl> =
                    serde_json::from_slice(blob).map_err(|e| bad(e.to_string()))?;
                index_of.insert(*h, g.unique.len());
                g.unique.push(decls);
                g.ranks.push(vec![r32]);
            } else {
                let i = *index_of.get(h).ok_or_else(|| ObjectPlanError::Decode {
                    rank: r,
                    reason: "hash of no representative".into(),
                })?;
                g.ranks[i].push(r32);
            }
        }
        Ok(g)
    }

    /// The view for declarations at hand, one list per rank (tests, single process).
    #[must_use]
    pub fn from_ranks(per_rank: &[Vec<ObjectDecl>]) -> Self {
        let hashes: Vec<[u8; 16]> = per_rank.iter().map(|d| hash(&encode(d))).collect();
        let blobs: Vec<Vec<u8>> = per_rank.iter().map(|d| encode(d)).collect();
        // Invariant: each hash is computed here from its own blob, so they match.
        Self::from_parts(&hashes, &blobs).unwrap_or_default()
    }
}

/// How an object is stored, once the ranks agree.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PlannedScope {
    /// One value, of this many bytes.
    Common {
        /// Stored length.
        len: u64,
    },
    /// One value per rank of a job of this size.
    PerRank {
        /// The saving job's world size.
        world_size: u64,
    },
    /// One value per cell of this grid.
    Sharded {
        /// The grid.
        grid: Vec<u64>,
    },
}

/// One object of the checkpoint.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PlannedObject {
    /// How it is stored.
    pub scope: PlannedScope,
    /// Its encoding.
    pub encoding: Encoding,
}

/// The agreed objects and who writes each value.
#[derive(Debug, Clone, Default)]
pub struct ObjectPlan {
    /// Every object, by key.
    pub objects: BTreeMap<TensorKey, PlannedObject>,
    writers: HashMap<(TensorKey, ObjectSlot), u32>,
}

fn describe(d: &ObjectDecl) -> String {
    match &d.scope {
        DeclScope::Common { .. } => format!("common ({})", d.encoding.name()),
        DeclScope::PerRank => format!("per-rank ({})", d.encoding.name()),
        DeclScope::Sharded { grid, .. } => {
            format!("sharded over grid {grid:?} ({})", d.encoding.name())
        }
    }
}

impl ObjectPlan {
    /// Checks the declarations of every rank and decides who writes what. Deterministic:
    /// every rank computes the same plan from the same gathered view.
    ///
    /// # Errors
    /// [`ObjectPlanError`] naming the key and the ranks involved.
    pub fn build(g: &GatheredObjects) -> Result<Self, ObjectPlanError> {
        // key -> declarations (decl, ranks)
        let mut by_key: BTreeMap<&TensorKey, Vec<(&ObjectDecl, &[u32])>> = BTreeMap::new();
        for (decls, ranks) in g.unique.iter().zip(&g.ranks) {
            for d in decls {
                by_key.entry(&d.key).or_default().push((d, ranks));
            }
        }
        let mut plan = ObjectPlan::default();
        for (key, decls) in by_key {
            let (first, first_ranks) = decls[0];
            // Same kind, encoding and grid everywhere.
            for &(d, r) in &decls[1..] {
                if describe(d) != describe(first) {
                    return Err(ObjectPlanError::Conflict {
                        key: key.clone(),
                        first: describe(first),
                        first_ranks: first_ranks.to_vec(),
                        second: describe(d),
                        second_ranks: r.to_vec(),
                    });
                }
            }
            let scope = match &first.scope {
                DeclScope::Common { len, .. } => {
                    let mut by_value: BTreeMap<&str, Vec<u32>> = BTreeMap::new();
                    for (d, r) in &decls {
                        if let DeclScope::Common { digest, .. } = &d.scope {
                            by_value.entry(digest).or_default().extend_from_slice(r);
                        }
                    }
                    let groups = sorted_groups(by_value.into_values());
                    if groups.len() > 1 {
                        return Err(ObjectPlanError::Disagreement {
                            key: key.clone(),
                            shard: None,
                            groups,
                        });
                    }
                    let holders = &groups[0];
                    let pick =
                        xxhash_rust::xxh3::xxh3_64(key.as_str().as_bytes()) % holders.len() as u64;
                    let writer = holders[crate::model::usize_of(pick)];
                    plan.writers
                        .insert((key.clone(), ObjectSlot::Common), writer);
                    PlannedScope::Common { len: *len }
                }
                DeclScope::PerRank => {
                    let present: BTreeSet<u32> =
                        decls.iter().flat_map(|(_, r)| r.iter().copied()).collect();
                    if present.len() != g.world_size as usize {
                        let missing: Vec<u32> =
                            (0..g.world_size).filter(|r| !present.contains(r)).collect();
                        return Err(ObjectPlanError::PerRankIncomplete {
                            key: key.clone(),
                            missing,
                        });
                    }
                    PlannedScope::PerRank {
                        world_size: u64::from(g.world_size),
                    }
                }
                DeclScope::Sharded { grid, .. } => {
                    check_grid(key, grid, None).map_err(|e| ObjectPlanError::Decode {
                        rank: first_ranks[0] as usize,
                        reason: e.to_string(),
                    })?;
                    let mut by_shard: BTreeMap<&[u64], BTreeMap<&str, Vec<u32>>> = BTreeMap::new();
                    for (d, r) in &decls {
                        if let DeclScope::Sharded { index, digest, .. } = &d.scope {
                            check_grid(key, grid, Some(index)).map_err(|e| {
                                ObjectPlanError::Decode {
                                    rank: r[0] as usize,
                                    reason: e.to_string(),
                                }
                            })?;
                            by_shard
                                .entry(index)
                                .or_default()
                                .entry(digest)
                                .or_default()
                                .extend_from_slice(r);
                        }
                    }
                    let cells: u64 = grid.iter().product();
                    if by_shard.len() as u64 != cells {
                        let mut missing = None;
                        crate::plan::grid::for_each_index(&vec![0; grid.len()], grid, |i| {
                            if missing.is_none() && !by_shard.contains_key(i) {
                                missing = Some(i.to_vec());
                            }
                        });
                        return Err(ObjectPlanError::ShardMissing {
                            key: key.clone(),
                            grid: grid.clone(),
                            // Invariant: every key of `by_shard` lies in the grid (checked
                            // above), so fewer keys than cells leave one cell missing.
                            index: missing.unwrap_or_default(),
                        });
                    }
                    for (index, values) in by_shard {
                        let groups = sorted_groups(values.into_values());
                        if groups.len() > 1 {
                            return Err(ObjectPlanError::Disagreement {
                                key: key.clone(),
                                shard: Some(index.to_vec()),
                                groups,
                            });
                        }
                        plan.writers.insert(
                            (key.clone(), ObjectSlot::Shard(index.to_vec())),
                            groups[0][0],
                        );
                    }
                    PlannedScope::Sharded { grid: grid.clone() }
                }
            };
            plan.objects.insert(
                key.clone(),
                PlannedObject {
                    scope,
                    encoding: first.encoding,
                },
            );
        }
        Ok(plan)
    }

    /// True when `rank` writes the value of `obj` it holds: its own per-rank value, a common
    /// value it was picked for, or a shard of which it is the lowest holder.
    #[must_use]
    pub fn writes(&self, rank: u32, obj: &StateObject) -> bool {
        let slot = match obj.scope() {
            ObjectScope::PerRank => return self.objects.contains_key(obj.key()),
            ObjectScope::Common => ObjectSlot::Common,
            ObjectScope::Sharded { index, .. } => ObjectSlot::Shard(index.clone()),
        };
        self.writers.get(&(obj.key().clone(), slot)) == Some(&rank)
    }
}

fn sorted_groups(groups: impl Iterator<Item = Vec<u32>>) -> Vec<Vec<u32>> {
    let mut g: Vec<Vec<u32>> = groups
        .map(|mut r| {
            r.sort_unstable();
            r
        })
        .collect();
    g.sort();
    g
}

/// The linear position of a shard (for names and sizes).
#[must_use]
pub fn shard_position(grid: &[u64], index: &[u64]) -> u64 {
    linear_index(grid, index)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn decls(objs: &[StateObject]) -> Vec<ObjectDecl> {
        declare(objs).unwrap().0
    }

    #[test]
    fn agreeing_ranks_plan_one_writer_each() {
        let ranks: Vec<Vec<ObjectDecl>> = (0..4u64)
            .map(|r| {
                decls(&[
                    StateObject::common("iteration", json!(100)).unwrap(),
                    StateObject::per_rank("rng", vec![u8::try_from(r).unwrap(); 8]).unwrap(),
                    StateObject::sharded("stage", &[2], &[r / 2], json!({"stage": r / 2})).unwrap(),
                ])
            })
            .collect();
        let g = GatheredObjects::from_ranks(&ranks);
        // Ranks 0-1 and 2-3 send the same description: per-rank values are not in it.
        assert_eq!(g.unique.len(), 2);
        let plan = ObjectPlan::build(&g).unwrap();
        assert_eq!(plan.objects.len(), 3);
        let stage = |r: u64| StateObject::sharded("stage", &[2], &[r / 2], json!(0)).unwrap();
        let writers: Vec<u32> = (0..4)
            .filter(|&r| plan.writes(r, &stage(u64::from(r))))
            .collect();
        assert_eq!(writers, vec![0, 2]);
        let it = StateObject::common("iteration", json!(100)).unwrap();
        assert_eq!((0..4).filter(|&r| plan.writes(r, &it)).count(), 1);
    }

    #[test]
    fn disagreements_name_key_and_ranks() {
        let ranks: Vec<Vec<ObjectDecl>> = (0..4)
            .map(|r| {
                decls(&[
                    StateObject::common("cfg", json!({"lr": if r == 2 { 2 } else { 1 }})).unwrap(),
                ])
            })
            .collect();
        let e = ObjectPlan::build(&GatheredObjects::from_ranks(&ranks)).unwrap_err();
        let msg = e.to_string();
        assert!(
            msg.contains("`cfg`") && msg.contains("[0-1, 3]") && msg.contains("[2]"),
            "{msg}"
        );

        let ranks: Vec<Vec<ObjectDecl>> = (0..3)
            .map(|r| {
                if r == 1 {
                    vec![]
                } else {
                    decls(&[StateObject::per_rank("rng", vec![1u8]).unwrap()])
                }
            })
            .collect();
        let e = ObjectPlan::build(&GatheredObjects::from_ranks(&ranks)).unwrap_err();
        assert!(
            matches!(&e, ObjectPlanError::PerRankIncomplete { missing, .. } if missing == &[1]),
            "{e}"
        );

        let ranks = vec![
            decls(&[StateObject::sharded("s", &[3], &[0], vec![1u8]).unwrap()]),
            decls(&[StateObject::sharded("s", &[3], &[2], vec![1u8]).unwrap()]),
        ];
        let e = ObjectPlan::build(&GatheredObjects::from_ranks(&ranks)).unwrap_err();
        assert!(
            matches!(&e, ObjectPlanError::ShardMissing { index, .. } if index == &[1]),
            "{e}"
        );

        let ranks = vec![
            decls(&[StateObject::common("x", vec![1u8]).unwrap()]),
            decls(&[StateObject::per_rank("x", vec![1u8]).unwrap()]),
        ];
        let e = ObjectPlan::build(&GatheredObjects::from_ranks(&ranks)).unwrap_err();
        assert!(matches!(e, ObjectPlanError::Conflict { .. }), "{e}");

        let ranks = vec![
            decls(&[StateObject::sharded("s", &[1], &[0], vec![1u8]).unwrap()]),
            decls(&[StateObject::sharded("s", &[1], &[0], vec![2u8]).unwrap()]),
        ];
        let e = ObjectPlan::build(&GatheredObjects::from_ranks(&ranks)).unwrap_err();
        assert!(
            matches!(&e, ObjectPlanError::Disagreement { shard: Some(s), .. } if s == &[0]),
            "{e}"
        );
        assert!(
            declare(&[
                StateObject::common("d", json!(1)).unwrap(),
                StateObject::per_rank("d", json!(1)).unwrap()
            ])
            .is_err()
        );
    }
}
