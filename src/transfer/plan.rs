//! The transfer plan: from every rank's declaration, which trainer rank sends which box of
//! which Megatron tensor to which engine rank, into which box of which engine buffer, and in
//! which round. Pure: the same declarations give the same plan on every rank.
//!
//! The destinations are a conversion plan's ([`plan_vllm`] for a vLLM TP layout,
//! [`plan_hf_export`] for whole HF tensors): the same table, the same checks, the same pieces
//! (boxes of Megatron global tensors) as `export --vllm` / `export --hf`. A transfer plan cuts
//! each piece by the trainer boxes that hold it (main replicas, which cover every element
//! exactly once), so each destination byte is sent once, by a rank that holds it, and no
//! tensor is gathered anywhere but at a destination that holds it whole.

use std::collections::{BTreeMap, HashMap};

use super::decl::{Decl, EngineTensor, Holder, Role, SourceBox};
use super::error::TransferError;
use crate::convert::geom::Bx;
use crate::convert::{Dest, Inventory, Layout, Piece, Plan, Table, plan_hf_export, plan_vllm};
use crate::model::DType;

/// The default bucket: the most bytes one rank sends (or receives) in one round.
pub const DEFAULT_BUCKET_BYTES: u64 = 512 << 20;

/// The engine's layout.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum EngineLayout {
    /// vLLM tensor parallelism: engine rank `e` (its index among the engine ranks) is TP rank
    /// `e % tp` and holds that rank's tensors as `export --vllm --tp` writes them; the number
    /// of engine ranks is a multiple of `tp` (several replicas of the engine).
    Vllm {
        /// Tensor parallel size.
        tp: u64,
    },
    /// Whole HF tensors on every engine rank (engines whose `load_weights` takes checkpoint
    /// tensors and slices them itself), as `export --hf` writes them.
    Hf,
}

/// The names the trainer's tensors carry.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
pub enum TrainerNames {
    /// Megatron keys and layout (the table's Megatron side): any engine layout.
    #[default]
    Megatron,
    /// The engine's checkpoint (HF) names, whole tensors cut only into boxes (FSDP / FSDP2
    /// DTensors of a `transformers` model): for an engine holding whole HF tensors.
    Hf,
}

/// What a transfer is: the same on every rank.
#[derive(Debug, Clone)]
pub struct Options {
    /// The conversion table.
    pub table: Table,
    /// The model's HF `config.json`.
    pub config: serde_json::Value,
    /// The trainer's layout (fixes the vocabulary padding and the split checks).
    pub trainer: Layout,
    /// The names the trainer's tensors carry (default: Megatron's).
    pub names: TrainerNames,
    /// The engine's layout.
    pub engine: EngineLayout,
    /// The most bytes one rank sends, and one rank receives, per round.
    pub bucket_bytes: u64,
    /// Accept an engine buffer of another float type than the trainer's (converted, rounded to
    /// nearest even); by default a different type is refused.
    pub cast: bool,
}

impl Options {
    /// Options with the default bucket and no cast.
    #[must_use]
    pub fn new(
        table: Table,
        config: serde_json::Value,
        trainer: Layout,
        engine: EngineLayout,
    ) -> Options {
        Options {
            table,
            config,
            trainer,
            names: TrainerNames::Megatron,
            engine,
            bucket_bytes: DEFAULT_BUCKET_BYTES,
            cast: false,
        }
    }

    /// Fingerprint of everything the plan depends on besides the declarations.
    #[must_use]
    pub fn fingerprint(&self) -> u64 {
        let doc = serde_json::json!({
            "table": self.table,
            "config": self.config,
            "trainer": [self.trainer.tp, self.trainer.pp, self.trainer.ep],
            "names": self.names,
            "engine": self.engine,
            "bucket": self.bucket_bytes,
            "cast": self.cast,
        });
        xxhash_rust::xxh3::xxh3_64(&serde_json::to_vec(&doc).unwrap_or_default())
    }
}

/// One move: a box of a trainer rank's piece into a box of an engine rank's buffer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Move {
    /// Sending rank (in the communicator).
    pub src: usize,
    /// Index of the box piece on the sending rank.
    pub piece: usize,
    /// Receiving rank.
    pub dst: usize,
    /// Index of the tensor in the receiving rank's declaration.
    pub local: usize,
    /// The conversion plan's piece, cut to this move: `sbox` in the Megatron tensor's global
    /// coordinates, `dbox` in the engine buffer.
    pub cut: Piece,
    /// Bytes on the wire (source data type).
    pub bytes: u64,
    /// Round.
    pub round: usize,
}

/// The plan of a whole transfer (every rank's moves).
#[derive(Debug, Clone)]
pub struct GlobalPlan {
    /// The conversion plan whose destinations the engine ranks hold.
    pub conv: Plan,
    /// Role per rank: `Some(true)` trainer, `Some(false)` engine.
    pub trainer: Vec<bool>,
    /// Per rank, its declaration (engine tensors, trainer boxes).
    pub decls: Vec<Decl>,
    /// Per engine rank (global rank), its tensors' conversion destinations (by local index).
    pub dest_of: BTreeMap<usize, Vec<usize>>,
    /// All moves, by round, then sender, receiver and plan order.
    pub moves: Vec<Move>,
    /// Number of rounds.
    pub rounds: usize,
    /// Fingerprint of all declarations.
    pub fingerprint: u64,
}

impl GlobalPlan {
    /// Bytes each rank sends, by rank.
    #[must_use]
    pub fn sent_per_rank(&self) -> Vec<u64> {
        let mut v = vec![0; self.trainer.len()];
        for m in &self.moves {
            v[m.src] += m.bytes;
        }
        v
    }

    /// Bytes each rank receives, by rank.
    #[must_use]
    pub fn received_per_rank(&self) -> Vec<u64> {
        let mut v = vec![0; self.trainer.len()];
        for m in &self.moves {
            v[m.dst] += m.bytes;
        }
        v
    }
}

fn dtype(name: &str, key: &str, rank: usize) -> Result<DType, TransferError> {
    DType::from_name(name).ok_or_else(|| {
        TransferError::Setup(format!(
            "rank {rank}: tensor `{key}`: unknown data type `{name}`"
        ))
    })
}

/// The inventory of the trainer's global tensors, checked for agreement between ranks.
fn inventory(decls: &[Decl]) -> Result<(Inventory, Vec<usize>), TransferError> {
    let mut inv: Inventory = BTreeMap::new();
    let mut first: BTreeMap<String, usize> = BTreeMap::new();
    let mut trainers = Vec::new();
    for (g, d) in decls.iter().enumerate() {
        let Role::Trainer(boxes) = &d.role else {
            continue;
        };
        let t = trainers.len();
        trainers.push(g);
        for b in boxes {
            dtype(&b.dtype, &b.key, g)?;
            match inv.get(&b.key) {
                None => {
                    inv.insert(b.key.clone(), (b.dtype.clone(), b.global_shape.clone()));
                    first.insert(b.key.clone(), g);
                }
                Some((dt, shape)) if *dt != b.dtype || *shape != b.global_shape => {
                    return Err(TransferError::Trainer {
                        rank: t,
                        global: g,
                        key: b.key.clone(),
                        msg: format!(
                            "declared as {} {:?}, but rank {} declared {dt} {shape:?}",
                            b.dtype, b.global_shape, first[&b.key]
                        ),
                    });
                }
                Some(_) => {}
            }
        }
    }
    Ok((inv, trainers))
}

/// Per Megatron key, the boxes that send: main replicas, and one holder of each `Auto` box.
pub(super) struct Senders {
    /// (box, rank, piece index), sorted by the first axis' offset.
    boxes: Vec<(Bx, usize, usize)>,
    /// Prefix maximum of the first axis' end.
    max_end: Vec<u64>,
}

impl Senders {
    fn new(mut boxes: Vec<(Bx, usize, usize)>) -> Senders {
        boxes.sort_by(|a, b| a.0.off.first().cmp(&b.0.off.first()).then(a.1.cmp(&b.1)));
        let mut m = 0;
        let max_end = boxes
            .iter()
            .map(|(b, ..)| {
                m = m.max(b.off.first().map_or(0, |o| o + b.len[0]));
                m
            })
            .collect();
        Senders { boxes, max_end }
    }

    /// The boxes intersecting `q`, with the intersections.
    pub(super) fn hits(&self, q: &Bx) -> Vec<(Bx, usize, usize)> {
        let mut out = Vec::new();
        let Some(&q0) = q.off.first() else {
            // A scalar: every box is the whole of it.
            return self
                .boxes
                .iter()
                .map(|(b, r, p)| (b.clone(), *r, *p))
                .collect();
        };
        let end = self
            .boxes
            .partition_point(|(b, ..)| b.off[0] < q0 + q.len[0]);
        for i in (0..end).rev() {
            if self.max_end[i] <= q0 {
                break;
            }
            let (b, r, p) = &self.boxes[i];
            if let Some(x) = b.intersect(q) {
                out.push((x, *r, *p));
            }
        }
        out.reverse();
        out
    }
}

/// The sending boxes per key: main replicas, and one holder of each `Auto` box, as
/// (box, rank, piece index).
pub(super) type Picked<'d> = BTreeMap<&'d str, Vec<(Bx, usize, usize)>>;

/// Picks the sending boxes per key (every rank picks the same).
pub(super) fn pick(decls: &[Decl]) -> Picked<'_> {
    let mut main: Picked<'_> = BTreeMap::new();
    let mut auto: BTreeMap<(&str, Bx), Vec<(usize, usize)>> = BTreeMap::new();
    for (g, d) in decls.iter().enumerate() {
        let Role::Trainer(sb) = &d.role else {
            continue;
        };
        for (i, s) in sb.iter().enumerate() {
            let b = || Bx {
                off: s.off.clone(),
                len: s.len.clone(),
            };
            match s.holder {
                Holder::Main => main.entry(&s.key).or_default().push((b(), g, i)),
                Holder::Auto => auto.entry((&s.key, b())).or_default().push((g, i)),
                Holder::Copy => {}
            }
        }
    }
    for ((key, b), holders) in auto {
        // Spread over the holders: a hash of the key and the box picks one.
        let h = xxhash_rust::xxh3::xxh3_64(format!("{key}{b}").as_bytes());
        let pick = usize::try_from(h % holders.len() as u64).unwrap_or(0);
        let (g, i) = holders[pick];
        main.entry(key).or_default().push((b, g, i));
    }
    main
}

/// Checks that the picked boxes cover each tensor of `used` exactly once.
pub(super) fn cover(
    mut main: Picked<'_>,
    inv: &Inventory,
    used: &[String],
) -> Result<HashMap<String, Senders>, TransferError> {
    let mut out = HashMap::new();
    for key in used {
        let shape = &inv[key].1;
        let list = main.remove(key.as_str()).unwrap_or_default();
        let total: u64 = shape.iter().product();
        let vol: u64 = list.iter().map(|(b, ..)| b.volume()).sum();
        for (i, (a, ra, _)) in list.iter().enumerate() {
            for (b, rb, _) in &list[i + 1..] {
                if let Some(x) = a.intersect(b) {
                    return Err(TransferError::Coverage {
                        key: key.clone(),
                        msg: format!(
                            "elements {x} are held as main replica by ranks {ra} and {rb} (box {a} and box {b}); mark one copy with a nonzero replica id"
                        ),
                    });
                }
            }
        }
        if vol != total {
            return Err(TransferError::Coverage {
                key: key.clone(),
                msg: format!(
                    "the trainer's main replicas hold {vol} of its {total} elements (shape {shape:?}, {} boxes)",
                    list.len()
                ),
            });
        }
        out.insert(key.clone(), Senders::new(list));
    }
    Ok(out)
}

/// The destination box of the part `s` of piece `p`'s source box (source and destination
/// axes aligned from the right, the last two swapped when transposed).
#[must_use]
pub fn sub_dbox(p: &Piece, s: &Bx) -> Bx {
    let (ns, nd) = (p.sbox.off.len(), p.dbox.off.len());
    let mut d = p.dbox.clone();
    for j in 0..nd {
        let mut k = nd - 1 - j;
        if p.transpose && k < 2 {
            k = 1 - k;
        }
        if k < ns {
            let i = ns - 1 - k;
            d.off[j] = p.dbox.off[j] + (s.off[i] - p.sbox.off[i]);
            d.len[j] = s.len[i];
        }
    }
    d
}

/// Cuts `b` into boxes of at most `limit` bytes (elements of `esize` bytes; `limit >= esize`).
pub(super) fn split(b: &Bx, esize: u64, limit: u64, out: &mut Vec<Bx>) {
    let bytes = b.volume() * esize;
    let Some(a) = b.len.iter().position(|&l| l > 1) else {
        out.push(b.clone());
        return;
    };
    if bytes <= limit {
        out.push(b.clone());
        return;
    }
    let row = bytes / b.len[a];
    let per = (limit / row).max(1);
    let mut at = 0;
    while at < b.len[a] {
        let n = per.min(b.len[a] - at);
        let mut c = b.clone();
        c.off[a] += at;
        c.len[a] = n;
        if row > limit {
            split(&c, esize, limit, out);
        } else {
            out.push(c);
        }
        at += n;
    }
}

/// The conversion destinations engine rank `e` (its index among the engine ranks) holds.
fn expected(conv: &Plan, engine: EngineLayout, e: usize) -> Vec<usize> {
    match engine {
        EngineLayout::Vllm { tp } => {
            let r = usize::try_from(e as u64 % tp).unwrap_or(usize::MAX);
            (0..conv.dests.len())
                .filter(|&i| conv.dests[i].group == r)
                .collect()
        }
        EngineLayout::Hf => (0..conv.dests.len()).collect(),
    }
}

fn float(d: DType) -> bool {
    matches!(
        d,
        DType::Float16 | DType::BFloat16 | DType::Float32 | DType::Float64
    )
}

/// Matches engine rank `g`'s declared tensors with the destinations the table gives it.
pub(super) fn match_engine(
    opts: &Options,
    conv: &Plan,
    g: usize,
    e: usize,
    tensors: &[EngineTensor],
) -> Result<Vec<usize>, TransferError> {
    let err = |key: &str, msg: String| TransferError::Engine {
        rank: e,
        global: g,
        key: key.to_owned(),
        msg,
    };
    let want = expected(conv, opts.engine, e);
    let by_name: HashMap<&str, usize> = want
        .iter()
        .map(|&i| (conv.dests[i].name.as_str(), i))
        .collect();
    let declared: HashMap<&str, usize> = tensors
        .iter()
        .enumerate()
        .map(|(i, t)| (t.name.as_str(), i))
        .collect();
    let where_ = match opts.engine {
        EngineLayout::Vllm { tp } => format!("vLLM TP rank {} of {tp}", e as u64 % tp),
        EngineLayout::Hf => "whole HF tensors".to_owned(),
    };
    let rule_of = |d: &Dest| {
        d.pieces
            .first()
            .map_or_else(String::new, |p| conv.expanded.rules[p.rule].name.clone())
    };
    for &i in &want {
        let d = &conv.dests[i];
        if !declared.contains_key(d.name.as_str()) {
            return Err(err(
                &d.name,
                format!(
                    "table `{}` (rule `{}`) produces it for {where_} ({} {:?}), but the engine declares no buffer for it",
                    conv.expanded.table,
                    rule_of(d),
                    d.dtype,
                    d.shape
                ),
            ));
        }
    }
    let mut dest_of = Vec::with_capacity(tensors.len());
    for t in tensors {
        let Some(&i) = by_name.get(t.name.as_str()) else {
            return Err(err(
                &t.name,
                format!(
                    "no rule of table `{}` produces this tensor for {where_}",
                    conv.expanded.table
                ),
            ));
        };
        if declared[t.name.as_str()] != dest_of.len() {
            return Err(err(&t.name, "declared twice".into()));
        }
        let d = &conv.dests[i];
        if t.shape != d.shape {
            return Err(err(
                &t.name,
                format!(
                    "the buffer has shape {:?}, table `{}` (rule `{}`) produces {:?} for {where_}",
                    t.shape,
                    conv.expanded.table,
                    rule_of(d),
                    d.shape
                ),
            ));
        }
        let bt = dtype(&t.dtype, &t.name, g)?;
        if bt != d.dtype && !(opts.cast && float(bt) && float(d.dtype)) {
            return Err(err(
                &t.name,
                format!(
                    "the buffer is {bt}, the trainer's tensor is {} (rule `{}`); {}",
                    d.dtype,
                    rule_of(d),
                    if float(bt) && float(d.dtype) {
                        "pass cast to convert"
                    } else {
                        "no conversion between these types"
                    }
                ),
            ));
        }
        dest_of.push(i);
    }
    Ok(dest_of)
}

/// The checks every rank makes on the gathered declarations alone (the same on every rank):
/// no local refusal, the same options, a bucket of at least one element, both roles present,
/// trainer tensors agreed. Returns the inventory, the trainer ranks and the engine ranks.
pub(super) fn setup(
    opts: &Options,
    decls: &[Decl],
) -> Result<(Inventory, Vec<usize>, Vec<usize>), TransferError> {
    let want = opts.fingerprint();
    if let Some((g, d)) = decls.iter().enumerate().find(|(_, d)| d.error.is_some()) {
        return Err(TransferError::Peer {
            rank: g,
            msg: d.error.clone().unwrap_or_default(),
        });
    }
    if let Some(g) = decls.iter().position(|d| d.options != want) {
        return Err(TransferError::Setup(format!(
            "rank {g} was given other options (table, config, layouts, bucket size or cast) than rank 0"
        )));
    }
    if opts.bucket_bytes < 8 {
        return Err(TransferError::Setup(format!(
            "bucket of {} bytes: at least 8 (one element)",
            opts.bucket_bytes
        )));
    }
    let (inv, trainers) = inventory(decls)?;
    let engines: Vec<usize> = (0..decls.len())
        .filter(|&g| matches!(decls[g].role, Role::Engine(_)))
        .collect();
    if trainers.is_empty() || engines.is_empty() {
        return Err(TransferError::Setup(format!(
            "{} trainer rank(s) and {} engine rank(s): a transfer needs both",
            trainers.len(),
            engines.len()
        )));
    }
    if let EngineLayout::Vllm { tp } = opts.engine
        && (tp == 0 || !(engines.len() as u64).is_multiple_of(tp))
    {
        return Err(TransferError::Setup(format!(
            "{} engine ranks for vLLM TP {tp}: a multiple of the TP size is needed",
            engines.len()
        )));
    }
    Ok((inv, trainers, engines))
}

/// The refusal of a trainer holding HF-named tensors feeding vLLM TP buffers.
pub(super) fn hf_names_into_vllm(tp: u64) -> TransferError {
    TransferError::Setup(format!(
        "a trainer holding HF-named tensors feeds an engine holding whole HF tensors, not vLLM TP {tp} buffers (declare the trainer's tensors in Megatron names for that)"
    ))
}

/// Builds the plan from every rank's declaration (indexed by rank).
///
/// # Errors
/// The refusals of [`TransferError`], the same on every rank.
pub fn build(opts: &Options, decls: Vec<Decl>) -> Result<GlobalPlan, TransferError> {
    let (inv, _, engines) = setup(opts, &decls)?;
    let conv = match (opts.names, opts.engine) {
        (TrainerNames::Megatron, EngineLayout::Vllm { tp }) => {
            plan_vllm(&opts.table, &opts.config, opts.trainer, &inv, tp)?
        }
        (TrainerNames::Megatron, EngineLayout::Hf) => {
            plan_hf_export(&opts.table, &opts.config, opts.trainer, &inv, u64::MAX)?
        }
        (TrainerNames::Hf, EngineLayout::Hf) => {
            super::identity::plan_hf_identity(&opts.table, &opts.config, &inv)?
        }
        (TrainerNames::Hf, EngineLayout::Vllm { tp }) => return Err(hf_names_into_vllm(tp)),
    };
    let mut dest_of = BTreeMap::new();
    for (e, &g) in engines.iter().enumerate() {
        let Role::Engine(t) = &decls[g].role else {
            continue;
        };
        dest_of.insert(g, match_engine(opts, &conv, g, e, t)?);
    }
    let used: Vec<String> = conv.sources.iter().map(|s| s.name.clone()).collect();
    let send = cover(pick(&decls), &inv, &used)?;
    // Moves, in plan order per engine rank.
    let mut moves = Vec::new();
    for (&g, locals) in &dest_of {
        for (local, &di) in locals.iter().enumerate() {
            let d = &conv.dests[di];
            for p in &d.pieces {
                let src = &conv.sources[p.src];
                let es = src.dtype.size() as u64;
                for (x, r, piece) in send[&src.name].hits(&p.sbox) {
                    let mut cuts = Vec::new();
                    split(&x, es, opts.bucket_bytes, &mut cuts);
                    for c in cuts {
                        let cut = Piece {
                            dbox: sub_dbox(p, &c),
                            sbox: c,
                            ..p.clone()
                        };
                        moves.push(Move {
                            src: r,
                            piece,
                            dst: g,
                            local,
                            bytes: cut.sbox.volume() * es,
                            cut,
                            round: 0,
                        });
                    }
                }
            }
        }
    }
    let rounds = assign_rounds(&mut moves, decls.len(), opts.bucket_bytes);
    moves.sort_by_key(|m| (m.round, m.src, m.dst));
    let fingerprint = xxhash_rust::xxh3::xxh3_64(&serde_json::to_vec(&decls).unwrap_or_default());
    Ok(GlobalPlan {
        conv,
        trainer: decls
            .iter()
            .map(|d| matches!(d.role, Role::Trainer(_)))
            .collect(),
        decls,
        dest_of,
        moves,
        rounds,
        fingerprint,
    })
}

/// First fit: each move into the first round where its sender sends and its receiver
/// receives at most `bucket` bytes. Returns the number of rounds.
fn assign_rounds(moves: &mut [Move], world: usize, bucket: u64) -> usize {
    let mut send: Vec<Vec<u64>> = vec![Vec::new(); world];
    let mut recv: Vec<Vec<u64>> = vec![Vec::new(); world];
    let mut hint_s = vec![0usize; world];
    let mut hint_r = vec![0usize; world];
    let mut rounds = 0;
    for m in moves.iter_mut() {
        let mut r = hint_s[m.src].max(hint_r[m.dst]);
        loop {
            for v in [&mut send[m.src], &mut recv[m.dst]] {
                if v.len() <= r {
                    v.resize(r + 1, 0);
                }
            }
            if send[m.src][r] + m.bytes <= bucket && recv[m.dst][r] + m.bytes <= bucket {
                break;
            }
            r += 1;
        }
        send[m.src][r] += m.bytes;
        recv[m.dst][r] += m.bytes;
        m.round = r;
        rounds = rounds.max(r + 1);
        // The first round with room left (a full round is never looked at again).
        while hint_s[m.src] < send[m.src].len() && send[m.src][hint_s[m.src]] >= bucket {
            hint_s[m.src] += 1;
        }
        while hint_r[m.dst] < recv[m.dst].len() && recv[m.dst][hint_r[m.dst]] >= bucket {
            hint_r[m.dst] += 1;
        }
    }
    rounds
}

/// Checks that `boxes` (one trainer rank's declared boxes) are consistent: each within its
/// tensor, one data type and shape per key.
///
/// # Errors
/// A message naming the key and the numbers.
pub fn check_local(boxes: &[SourceBox]) -> Result<(), String> {
    let mut seen: HashMap<&str, (&str, &[u64])> = HashMap::new();
    for b in boxes {
        if let Some((dt, sh)) = seen.get(b.key.as_str())
            && (*dt != b.dtype || *sh != b.global_shape.as_slice())
        {
            return Err(format!(
                "tensor `{}` given as {} {:?} and as {dt} {sh:?} on this rank",
                b.key, b.dtype, b.global_shape
            ));
        }
        seen.insert(&b.key, (&b.dtype, &b.global_shape));
    }
    Ok(())
}
