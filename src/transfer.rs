//! Live weight transfer (spec § 21): from a training job's shards (Megatron names, the
//! trainer's TP x PP x EP boxes) into a rollout engine's layout (HF names, vLLM's TP split or
//! whole tensors), in memory, over a [`Communicator`] spanning both worlds.
//!
//! Every rank of the communicator takes part: trainer ranks call [`Transfer::send`] with their
//! pieces, engine ranks [`Transfer::receive`] with their buffers (or
//! [`Transfer::receive_with`] to get tensors as they complete). The first call gathers each
//! rank's declaration (structure only), and every rank builds the same [`plan::GlobalPlan`]:
//! the conversion plan of `export --vllm` / `export --hf` for the same table (the same checks,
//! refused on every rank before any weight byte moves), each of its pieces cut by the trainer
//! boxes holding it, so each destination byte is sent once, by its main replica, in rounds
//! where no rank sends or receives more than the bucket. Later calls with an unchanged
//! structure reuse the plan after one all-reduce of 9 bytes.

pub mod decl;
pub mod error;
pub mod exec;
pub mod identity;
pub mod plan;
pub mod rank;
mod verdict;

use std::time::{Duration, Instant};

pub use decl::{Decl, EngineTensor, Holder, Role, SourceBox};
pub use error::TransferError;
pub use exec::{Buffers, LocalPlan, Messages, Moved, Sink};
pub use plan::{DEFAULT_BUCKET_BYTES, EngineLayout, GlobalPlan, Options, TrainerNames};
pub use rank::{RankPlan, build_rank};

use crate::comm::Communicator;
use crate::model::{DType, ShardedTensor, usize_of};

/// What one call did on this rank.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Report {
    /// Whether the plan was built (false: the cached plan was reused).
    pub planned: bool,
    /// Time spent agreeing on and (when planned) building the plan.
    pub plan_time: Duration,
    /// Time spent moving bytes.
    pub move_time: Duration,
    /// Rounds.
    pub rounds: usize,
    /// Bytes this rank sent / received.
    pub moved: Moved,
    /// Bytes the busiest sender sends, and all bytes moved (every rank's plan knows them).
    pub busiest_sent: u64,
    /// All bytes moved.
    pub total_bytes: u64,
}

struct Cached {
    local: u64,
    global: u64,
    plan: LocalPlan,
}

/// A transfer, reused step after step: it keeps the plan of the last structure.
pub struct Transfer {
    opts: Options,
    opts_fp: u64,
    cache: Option<Cached>,
}

/// A tensor an engine rank received whole ([`Transfer::receive_with`]).
#[derive(Debug, Clone)]
pub struct Received {
    /// Name in the engine's format.
    pub name: String,
    /// Data type.
    pub dtype: DType,
    /// Shape.
    pub shape: Vec<u64>,
    /// Bytes (C order).
    pub data: Vec<u8>,
}

struct Collect<'f> {
    bufs: Vec<Option<Vec<u8>>>,
    dests: Vec<(String, DType, Vec<u64>, u64)>,
    on_bucket: &'f mut dyn FnMut(Vec<Received>) -> Result<(), TransferError>,
}

// SAFETY: a destination's buffer, allocated once, stays in its slot (the slots are never
// resized) until `complete` takes it out for the callback.
unsafe impl Sink for Collect<'_> {
    fn buffer(&mut self, local: usize) -> &mut [u8] {
        let n = usize_of(self.dests[local].3);
        self.bufs[local].get_or_insert_with(|| vec![0u8; n])
    }

    fn complete(&mut self, locals: &[usize]) -> Result<(), TransferError> {
        if locals.is_empty() {
            return Ok(());
        }
        let mut out = Vec::with_capacity(locals.len());
        for &l in locals {
            let data = match self.bufs[l].take() {
                Some(d) => d,
                None => vec![0u8; usize_of(self.dests[l].3)],
            };
            let (name, dtype, shape, _) = &self.dests[l];
            out.push(Received {
                name: name.clone(),
                dtype: *dtype,
                shape: shape.clone(),
                data,
            });
        }
        (self.on_bucket)(out)
    }
}

impl Transfer {
    /// A transfer with these options (the same on every rank).
    #[must_use]
    pub fn new(opts: Options) -> Transfer {
        let opts_fp = opts.fingerprint();
        Transfer {
            opts,
            opts_fp,
            cache: None,
        }
    }

    /// The options.
    #[must_use]
    pub fn options(&self) -> &Options {
        &self.opts
    }

    /// The cached plan of this rank, if any.
    #[must_use]
    pub fn local_plan(&self) -> Option<&LocalPlan> {
        self.cache.as_ref().map(|c| &c.plan)
    }

    /// Agrees on the plan: the cached one when every rank's structure is unchanged (one
    /// all-reduce of 9 bytes), else gathers the declarations, builds this rank's part and
    /// agrees on every rank's verdict (one all-reduce) before any byte moves.
    fn agree(&mut self, comm: &dyn Communicator, decl: Decl) -> Result<bool, TransferError> {
        let local = decl.fingerprint();
        let mut mine = [0u8; 9];
        if let Some(c) = &self.cache
            && c.local == local
            && decl.error.is_none()
        {
            mine[0] = 1;
            mine[1..].copy_from_slice(&c.global.to_le_bytes());
        }
        let merged = comm.all_reduce(&mine, &|a: &[u8], b: &[u8]| {
            Ok(if a == b { a.to_vec() } else { vec![0u8; 9] })
        })?;
        if merged.first() == Some(&1) && merged == mine {
            return Ok(false);
        }
        self.cache = None;
        let text = serde_json::to_vec(&decl).map_err(|e| TransferError::Setup(e.to_string()))?;
        let all = comm.all_gather(&text)?;
        let mut h = xxhash_rust::xxh3::Xxh3::new();
        for b in &all {
            h.update(&(b.len() as u64).to_le_bytes());
            h.update(b);
        }
        let global = h.digest();
        let me = comm.rank();
        let built = all
            .iter()
            .enumerate()
            .map(|(r, b)| {
                serde_json::from_slice::<Decl>(b).map_err(|e| {
                    TransferError::Setup(format!("rank {r} sent an unreadable declaration: {e}"))
                })
            })
            .collect::<Result<Vec<_>, _>>()
            .and_then(|decls| {
                drop(all);
                rank::build_rank(&self.opts, &decls, me)
            });
        let v = verdict::agree(comm, &built)?;
        let rp = built?;
        if let Some(e) = v.error {
            return Err(e);
        }
        let chunk = self.opts.bucket_bytes / v.fan.max(1);
        let lp = LocalPlan::schedule(&rp, chunk, v.busiest, v.total);
        self.cache = Some(Cached {
            local,
            global,
            plan: lp,
        });
        Ok(true)
    }

    /// The cached plan.
    fn plan(&self) -> Result<&LocalPlan, TransferError> {
        self.cache
            .as_ref()
            .map(|c| &c.plan)
            .ok_or_else(|| TransferError::Setup("no plan".into()))
    }

    fn report(&self, planned: bool, plan_time: Duration, t: Instant, moved: Moved) -> Report {
        let lp = self
            .local_plan()
            .map_or_else(LocalPlan::default, Clone::clone);
        Report {
            planned,
            plan_time,
            move_time: t.elapsed(),
            rounds: lp.rounds,
            moved,
            busiest_sent: lp.busiest_sent,
            total_bytes: lp.total_bytes,
        }
    }

    /// Trainer side: sends this rank's share of `pieces` (Megatron keys, global shapes, boxes
    /// or flat ranges, replica ids as for a save).
    ///
    /// # Errors
    /// A refused plan (on every rank, before any byte moves), communication errors.
    pub fn send(
        &mut self,
        comm: &dyn Communicator,
        pieces: &[ShardedTensor<'_>],
    ) -> Result<Report, TransferError> {
        let t0 = Instant::now();
        let boxes = decl::box_pieces(pieces);
        let sb: Vec<SourceBox> = boxes.iter().map(decl::source_box).collect();
        let error = plan::check_local(&sb).err();
        let d = Decl {
            options: self.opts_fp,
            role: Role::Trainer(sb),
            error,
        };
        let planned = self.agree(comm, d)?;
        let plan_time = t0.elapsed();
        let t = Instant::now();
        let moved = close(comm, exec::run(comm, self.plan()?, &boxes, None))?;
        Ok(self.report(planned, plan_time, t, moved))
    }

    /// Engine side: fills `bufs` in place, one per tensor of `tensors` (the rank's
    /// declaration: names, data types and shapes of its buffers, each buffer exactly that
    /// many bytes). Padding (vocabulary rows past the model's) is zeroed.
    ///
    /// # Errors
    /// As [`Transfer::send`].
    pub fn receive(
        &mut self,
        comm: &dyn Communicator,
        tensors: &[EngineTensor],
        bufs: &mut [&mut [u8]],
    ) -> Result<Report, TransferError> {
        self.receive_into(comm, tensors, Target::Buffers(bufs))
    }

    /// Engine side, checkpoint format: `tensors` are the tensors wanted (names, data types,
    /// shapes); each is allocated when its first bytes arrive and handed to `on_bucket` after
    /// the round in which its last bytes arrive (one call per round that completes any), for
    /// a `load_weights`-style API. Tensors that need no byte at all (padding only) come last.
    ///
    /// # Errors
    /// As [`Transfer::send`], and what `on_bucket` returns.
    pub fn receive_with(
        &mut self,
        comm: &dyn Communicator,
        tensors: &[EngineTensor],
        on_bucket: &mut dyn FnMut(Vec<Received>) -> Result<(), TransferError>,
    ) -> Result<Report, TransferError> {
        self.receive_into(comm, tensors, Target::Collect(on_bucket))
    }

    /// The engine side of both: the declaration, the agreement, then the rounds into the
    /// target.
    fn receive_into(
        &mut self,
        comm: &dyn Communicator,
        tensors: &[EngineTensor],
        target: Target<'_, '_, '_>,
    ) -> Result<Report, TransferError> {
        let t0 = Instant::now();
        let bufs = match &target {
            Target::Buffers(b) => Some(&**b),
            Target::Collect(_) => None,
        };
        let error = check_buffers(tensors, bufs).err();
        let planned = self.agree(comm, engine_decl(self.opts_fp, tensors, error))?;
        let plan_time = t0.elapsed();
        let t = Instant::now();
        let lp = self.plan()?;
        let moved = match target {
            Target::Buffers(bufs) => exec::run(comm, lp, &[], Some(&mut Buffers { bufs })),
            Target::Collect(on_bucket) => {
                let mut sink = Collect {
                    bufs: vec![None; lp.dests.len()],
                    dests: lp
                        .dests
                        .iter()
                        .map(|d| (d.name.clone(), d.dtype, d.shape.clone(), d.nbytes()))
                        .collect(),
                    on_bucket,
                };
                exec::run(comm, lp, &[], Some(&mut sink))
            }
        };
        let moved = close(comm, moved)?;
        Ok(self.report(planned, plan_time, t, moved))
    }
}

/// Ends a transfer on every rank together (a 1-byte all-reduce), so that a rank whose own part
/// finished still learns that a peer failed: a rank that failed returns its error without
/// joining, and its peers get a communication error here (the peer lost, or the timeout),
/// never a silent success.
fn close(
    comm: &dyn Communicator,
    moved: Result<Moved, TransferError>,
) -> Result<Moved, TransferError> {
    let moved = moved?;
    comm.all_reduce(&[1], &|a: &[u8], _: &[u8]| Ok(a.to_vec()))?;
    Ok(moved)
}

/// Where an engine rank's bytes go.
enum Target<'b, 'a, 'f> {
    /// The caller's buffers, filled in place.
    Buffers(&'b mut [&'a mut [u8]]),
    /// Whole tensors handed to a callback as they complete.
    Collect(&'f mut dyn FnMut(Vec<Received>) -> Result<(), TransferError>),
}

fn engine_decl(options: u64, tensors: &[EngineTensor], error: Option<String>) -> Decl {
    Decl {
        options,
        role: Role::Engine(tensors.to_vec()),
        error,
    }
}

/// An engine rank's buffers: known data types, one buffer per tensor of the right size.
fn check_buffers(tensors: &[EngineTensor], bufs: Option<&[&mut [u8]]>) -> Result<(), String> {
    if let Some(b) = bufs
        && b.len() != tensors.len()
    {
        return Err(format!(
            "{} buffers for {} declared tensors",
            b.len(),
            tensors.len()
        ));
    }
    for (i, t) in tensors.iter().enumerate() {
        let dt = DType::from_name(&t.dtype)
            .ok_or_else(|| format!("tensor `{}`: unknown data type `{}`", t.name, t.dtype))?;
        let want = t
            .shape
            .iter()
            .try_fold(dt.size() as u64, |a, &d| a.checked_mul(d))
            .ok_or_else(|| format!("tensor `{}`: shape {:?} overflows", t.name, t.shape))?;
        if let Some(b) = bufs
            && b[i].len() as u64 != want
        {
            return Err(format!(
                "tensor `{}`: buffer of {} bytes, {} {:?} needs {want}",
                t.name,
                b[i].len(),
                t.dtype,
                t.shape
            ));
        }
    }
    Ok(())
}
