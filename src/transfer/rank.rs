//! One rank's part of a transfer plan, derived locally from the gathered declarations: an
//! engine rank plans only its own destinations (its TP rank's part of the conversion plan), a
//! trainer rank only the pieces of the tensors it sends, to every engine rank. No rank
//! materialises another pair's routes; both ends of a pair derive the same moves in the same
//! order (the conversion plan's destination order, then its piece order, then the sending
//! boxes' order), which is all the schedule needs ([`super::exec::LocalPlan::schedule`]).
//!
//! The checks are those of the whole plan: every rank runs the conversion checks (each
//! depends on the TP size and the tensor, never on which TP rank is built), the trainer
//! coverage checks on every tensor, and each engine rank checks its own declaration; the
//! verdicts are then agreed collectively ([`super::Transfer`]) before any byte moves.

use std::collections::{BTreeMap, HashMap};

use super::decl::{Decl, Role};
use super::error::TransferError;
use super::plan::{
    EngineLayout, Move, Options, TrainerNames, cover, hf_names_into_vllm, match_engine, pick, setup,
};
use crate::convert::geom::Bx;
use crate::convert::{Dest, Part, Plan, plan_hf_export, plan_vllm_part};
use crate::model::DType;

/// One rank's moves before the schedule.
#[derive(Debug, Clone, Default)]
pub struct RankPlan {
    /// This rank.
    pub me: usize,
    /// Its moves (as sender or receiver), grouped by peer, each pair's in the order both ends
    /// derive, uncut (`round` 0).
    pub moves: Vec<Move>,
    /// Engine: per declared tensor (local index), its destination (no pieces; the data type
    /// of its buffer).
    pub dests: Vec<Dest>,
    /// Engine: declared tensors with padding (elements no piece fills).
    pub zero: Vec<usize>,
    /// Data type of each conversion source, by index.
    pub src_dtypes: Vec<DType>,
    /// Trainer: the number of box pieces it declared.
    pub pieces: usize,
    /// The number of peers it sends to or receives from.
    pub fan: usize,
}

impl RankPlan {
    /// Bytes this rank sends.
    #[must_use]
    pub fn bytes_sent(&self) -> u64 {
        self.moves
            .iter()
            .filter(|m| m.src == self.me)
            .map(|m| m.bytes)
            .sum()
    }
}

/// Builds rank `me`'s part of the plan from every rank's declaration (indexed by rank).
///
/// # Errors
/// The refusals of [`TransferError`] this rank finds: those found from the declarations alone
/// are the same on every rank; an engine rank also refuses its own declaration.
pub fn build_rank(opts: &Options, decls: &[Decl], me: usize) -> Result<RankPlan, TransferError> {
    let (inv, _, engines) = setup(opts, decls)?;
    let engine_index = engines.iter().position(|&g| g == me);
    // A trainer's own sending boxes, per key: it plans only the pieces they intersect. The
    // world's picked boxes are dropped while the conversion plan is built, picked again after.
    let my_boxes: HashMap<&str, Vec<Bx>> = if engine_index.is_none() {
        let mut m: HashMap<&str, Vec<Bx>> = HashMap::new();
        for (k, v) in pick(decls) {
            for (b, r, _) in v {
                if r == me {
                    m.entry(k).or_default().push(b);
                }
            }
        }
        m
    } else {
        HashMap::new()
    };
    let keep = |k: &str| my_boxes.contains_key(k);
    let keep_box = |k: &str, b: &Bx| {
        my_boxes
            .get(k)
            .is_some_and(|v| v.iter().any(|x| x.intersect(b).is_some()))
    };
    let conv = match (opts.names, opts.engine, engine_index) {
        (TrainerNames::Hf, EngineLayout::Hf, _) => {
            super::identity::plan_hf_identity(&opts.table, &opts.config, &inv)?
        }
        (TrainerNames::Hf, EngineLayout::Vllm { tp }, _) => return Err(hf_names_into_vllm(tp)),
        (TrainerNames::Megatron, EngineLayout::Vllm { tp }, e) => {
            let r = e.map(|e| e as u64 % tp.max(1));
            let ranks = r.as_slice();
            let part = Part {
                ranks: r.map(|_| ranks),
                keep: if e.is_none() {
                    Some(&keep as &dyn Fn(&str) -> bool)
                } else {
                    None
                },
                boxes: if e.is_none() {
                    Some(&keep_box as &dyn Fn(&str, &Bx) -> bool)
                } else {
                    None
                },
            };
            plan_vllm_part(&opts.table, &opts.config, opts.trainer, &inv, tp, &part)?
        }
        (TrainerNames::Megatron, EngineLayout::Hf, _) => {
            plan_hf_export(&opts.table, &opts.config, opts.trainer, &inv, u64::MAX)?
        }
    };
    let conv = shed(conv);
    let used: Vec<String> = conv.sources.iter().map(|s| s.name.clone()).collect();
    let send = cover(pick(decls), &inv, &used)?;
    let mut rp = RankPlan {
        me,
        src_dtypes: conv.sources.iter().map(|s| s.dtype).collect(),
        ..RankPlan::default()
    };
    match (&decls[me].role, engine_index) {
        (Role::Engine(tensors), Some(e)) => {
            let dest_of = match_engine(opts, &conv, me, e, tensors)?;
            engine_moves(&conv, &send, me, &dest_of, tensors, &mut rp);
        }
        (Role::Trainer(b), _) => {
            rp.pieces = b.len();
            trainer_moves(opts, &conv, &send, decls, &engines, &mut rp);
        }
        (Role::Engine(_), None) => {}
    }
    let mut peers: Vec<usize> = rp
        .moves
        .iter()
        .map(|m| if m.src == me { m.dst } else { m.src })
        .collect();
    peers.dedup();
    rp.fan = peers.len();
    Ok(rp)
}

/// The conversion plan less its expansion's tensors and links: from here on only the rules'
/// names and the table's are read (refusals name them), and the expansion of a large model is
/// most of a rank's planning memory.
fn shed(mut conv: Plan) -> Plan {
    let ex = &mut conv.expanded;
    ex.m = Vec::new();
    ex.h = Vec::new();
    ex.links = Vec::new();
    ex.pads = Vec::new();
    ex.aux = Vec::new();
    conv
}

/// The moves of one destination's pieces sent by `only` (or by anyone), in piece order.
fn dest_moves(
    conv: &Plan,
    send: &HashMap<String, super::plan::Senders>,
    d: &Dest,
    dst: usize,
    local: usize,
    only: Option<usize>,
    out: &mut Vec<Move>,
) {
    for p in &d.pieces {
        let src = &conv.sources[p.src];
        let es = src.dtype.size() as u64;
        for (x, r, piece) in send[&src.name].hits(&p.sbox) {
            if only.is_some_and(|o| o != r) {
                continue;
            }
            let cut = crate::convert::Piece {
                dbox: super::plan::sub_dbox(p, &x),
                sbox: x,
                ..p.clone()
            };
            out.push(Move {
                src: r,
                piece,
                dst,
                local,
                bytes: cut.sbox.volume() * es,
                cut,
                round: 0,
            });
        }
    }
}

fn engine_moves(
    conv: &Plan,
    send: &HashMap<String, super::plan::Senders>,
    me: usize,
    dest_of: &[usize],
    tensors: &[super::decl::EngineTensor],
    rp: &mut RankPlan,
) {
    let mut order: Vec<(usize, usize)> = dest_of
        .iter()
        .enumerate()
        .map(|(local, &di)| (di, local))
        .collect();
    order.sort_unstable();
    for &(di, local) in &order {
        dest_moves(conv, send, &conv.dests[di], me, local, None, &mut rp.moves);
    }
    // Grouped by sender, each sender's in plan order.
    rp.moves.sort_by_key(|m| m.src);
    for (local, &di) in dest_of.iter().enumerate() {
        let d = &conv.dests[di];
        let mut mine = Dest {
            pieces: Vec::new(),
            ..d.clone()
        };
        mine.dtype = DType::from_name(&tensors[local].dtype).unwrap_or(d.dtype);
        let covered: u64 = d.pieces.iter().map(|p| p.sbox.volume()).sum();
        if covered < d.region.volume() {
            rp.zero.push(local);
        }
        rp.dests.push(mine);
    }
}

fn trainer_moves(
    opts: &Options,
    conv: &Plan,
    send: &HashMap<String, super::plan::Senders>,
    decls: &[Decl],
    engines: &[usize],
    rp: &mut RankPlan,
) {
    // Per TP group (vLLM) or for all (HF): this rank's moves, computed once, copied to each
    // engine rank of the group with its local indices.
    let mut by_group: BTreeMap<Option<usize>, Vec<(usize, Move)>> = BTreeMap::new();
    for (e, &g) in engines.iter().enumerate() {
        let group = match opts.engine {
            EngineLayout::Vllm { tp } => {
                Some(usize::try_from(e as u64 % tp.max(1)).unwrap_or(usize::MAX))
            }
            EngineLayout::Hf => None,
        };
        let proto = by_group.entry(group).or_insert_with(|| {
            let mut out = Vec::new();
            for (di, d) in conv.dests.iter().enumerate() {
                if group.is_some_and(|r| d.group != r) {
                    continue;
                }
                let mut v = Vec::new();
                dest_moves(conv, send, d, 0, 0, Some(rp.me), &mut v);
                out.extend(v.into_iter().map(|m| (di, m)));
            }
            out
        });
        let Role::Engine(tensors) = &decls[g].role else {
            continue;
        };
        let local: HashMap<&str, usize> = tensors
            .iter()
            .enumerate()
            .map(|(i, t)| (t.name.as_str(), i))
            .collect();
        for (di, m) in proto.iter() {
            let l = local
                .get(conv.dests[*di].name.as_str())
                .copied()
                .unwrap_or(usize::MAX);
            rp.moves.push(Move {
                dst: g,
                local: l,
                ..m.clone()
            });
        }
    }
}
