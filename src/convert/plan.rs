//! Conversion plans: per destination tensor (or per rank box), the source boxes that fill
//! it. Built from an expansion and the source's inventory after every check passed. Pure.

use std::collections::BTreeMap;

use super::check::{self, Direction, Inventory};
use super::error::ConvertError;
use super::expand::{CapScope, Env, Expanded, Layout, Link, Pattern, stack_indices};
use super::geom::{Bx, merge_boxes};
use super::table::{Table, ValueOp};
use crate::model::DType;

/// A box of a source tensor copied into a box of a destination buffer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Piece {
    /// Index into [`Plan::sources`].
    pub src: usize,
    /// Box in the source tensor.
    pub sbox: Bx,
    /// Box in the destination buffer (relative to [`Dest::region`]).
    pub dbox: Bx,
    /// Last two axes swapped.
    pub transpose: bool,
    /// The rule (index into the expansion's rules).
    pub rule: usize,
    /// Stack axes of the source (leading axes of extent 1 in `sbox` to drop when copying
    /// into a destination of fewer axes).
    pub src_stack: usize,
    /// Stack axes of the destination box.
    pub dst_stack: usize,
    /// fp8 block dequantisation (import): the scale source and the block shape.
    pub scale: Option<(usize, [u64; 2])>,
}

/// One destination: a tensor (HF, vLLM) or a rank's box of one (Megatron).
#[derive(Debug, Clone)]
pub struct Dest {
    /// Tensor name.
    pub name: String,
    /// Global shape.
    pub shape: Vec<u64>,
    /// The part of the tensor this destination fills (the whole tensor for HF and vLLM).
    pub region: Bx,
    /// Data type.
    pub dtype: DType,
    /// Pieces; elements no piece covers are zero (padding).
    pub pieces: Vec<Piece>,
    /// Output file (HF export), or TP rank (vLLM, Megatron).
    pub group: usize,
    /// Value ops to apply (export: inverted; import: as written).
    pub value: Vec<ValueOp>,
}

impl Dest {
    /// Bytes of the destination buffer.
    #[must_use]
    pub fn nbytes(&self) -> u64 {
        self.region.volume() * self.dtype.size() as u64
    }
}

/// A source tensor.
#[derive(Debug, Clone)]
pub struct Source {
    /// Name (stored key or HF name).
    pub name: String,
    /// Shape.
    pub shape: Vec<u64>,
    /// Data type.
    pub dtype: DType,
}

/// A conversion plan.
#[derive(Debug, Clone)]
pub struct Plan {
    /// Sources.
    pub sources: Vec<Source>,
    /// Destinations in write order.
    pub dests: Vec<Dest>,
    /// Checks passed (for dry runs).
    pub checks: Vec<String>,
    /// The expansion's params (for dry runs).
    pub params: BTreeMap<String, String>,
    /// The expansion (rules, links).
    pub expanded: Expanded,
}

impl Plan {
    /// Batches of consecutive destinations sharing source units (a source tensor at one
    /// stack index): each batch's source boxes are read once, merged.
    #[must_use]
    pub fn batches(&self) -> Vec<std::ops::Range<usize>> {
        let unit = |p: &Piece| (p.src, p.sbox.off[..p.src_stack].to_vec());
        let mut out = Vec::new();
        let mut start = 0;
        let mut units: std::collections::HashSet<(usize, Vec<u64>)> =
            std::collections::HashSet::new();
        for (i, d) in self.dests.iter().enumerate() {
            let mine: Vec<_> = d.pieces.iter().map(unit).collect();
            let shares = mine.iter().any(|u| units.contains(u));
            if i > start && (!shares || d.group != self.dests[start].group) {
                out.push(start..i);
                start = i;
                units.clear();
            }
            units.extend(mine);
        }
        if start < self.dests.len() {
            out.push(start..self.dests.len());
        }
        out
    }

    /// The merged source boxes a batch reads, per source.
    #[must_use]
    pub fn reads(&self, batch: std::ops::Range<usize>) -> Vec<(usize, Bx)> {
        let mut per: BTreeMap<usize, Vec<Bx>> = BTreeMap::new();
        for d in &self.dests[batch] {
            for p in &d.pieces {
                per.entry(p.src).or_default().push(p.sbox.clone());
            }
        }
        per.into_iter()
            .flat_map(|(s, bs)| merge_boxes(bs).into_iter().map(move |b| (s, b)))
            .collect()
    }

    /// The plan as JSON: sources (name, dtype, shape), destinations (name, dtype, shape,
    /// region `[offset, shape]`, group, pieces with `src` index, `sbox` / `dbox` as
    /// `[offset, shape]`, `transpose`), bytes per group, checks passed, params.
    #[must_use]
    pub fn to_json(&self) -> serde_json::Value {
        let bx = |b: &Bx| serde_json::json!([b.off, b.len]);
        serde_json::json!({
            "sources": self.sources.iter().map(|s| serde_json::json!({
                "name": s.name, "dtype": s.dtype.to_string(), "shape": s.shape})).collect::<Vec<_>>(),
            "dests": self.dests.iter().map(|d| serde_json::json!({
                "name": d.name, "dtype": d.dtype.to_string(), "shape": d.shape, "region": bx(&d.region),
                "group": d.group,
                "pieces": d.pieces.iter().map(|p| serde_json::json!({
                    "src": p.src, "sbox": bx(&p.sbox), "dbox": bx(&p.dbox), "transpose": p.transpose,
                    "rule": self.expanded.rules[p.rule].name})).collect::<Vec<_>>()})).collect::<Vec<_>>(),
            "bytes_per_group": self.bytes_per_group().into_iter()
                .map(|(g, (r, w))| serde_json::json!({"group": g, "read": r, "written": w})).collect::<Vec<_>>(),
            "checks": self.checks,
            "params": self.params,
        })
    }

    /// Bytes read from sources and written to destinations, per group (file or rank).
    #[must_use]
    pub fn bytes_per_group(&self) -> BTreeMap<usize, (u64, u64)> {
        let mut out: BTreeMap<usize, (u64, u64)> = BTreeMap::new();
        for b in self.batches() {
            let g = self.dests[b.start].group;
            let read: u64 = self
                .reads(b.clone())
                .iter()
                .map(|(s, bx)| bx.volume() * self.sources[*s].dtype.size() as u64)
                .sum();
            let written: u64 = self.dests[b].iter().map(Dest::nbytes).sum();
            let e = out.entry(g).or_default();
            e.0 += read;
            e.1 += written;
        }
        out
    }
}

fn dtype_of(name: &str, what: &str) -> Result<DType, ConvertError> {
    DType::from_name(name).ok_or_else(|| ConvertError::Table {
        table: what.to_owned(),
        msg: format!("unknown data type `{name}`"),
    })
}

fn map_m_to_h(l: &Link, stack: usize, msub: &Bx) -> Bx {
    let mut rel: Vec<u64> = (stack..msub.off.len())
        .map(|d| msub.off[d] - l.mbox.off[d])
        .collect();
    let mut len: Vec<u64> = msub.len[stack..].to_vec();
    if l.transpose {
        let n = rel.len();
        rel.swap(n - 2, n - 1);
        len.swap(n - 2, n - 1);
    }
    Bx {
        off: l.hbox.off.iter().zip(&rel).map(|(a, b)| a + b).collect(),
        len,
    }
}

fn map_h_to_m(l: &Link, stack: usize, hsub: &Bx) -> Bx {
    let mut rel: Vec<u64> = hsub
        .off
        .iter()
        .zip(&l.hbox.off)
        .map(|(a, b)| a - b)
        .collect();
    let mut len = hsub.len.clone();
    if l.transpose {
        let n = rel.len();
        rel.swap(n - 2, n - 1);
        len.swap(n - 2, n - 1);
    }
    let mut off = l.mbox.off[..stack].to_vec();
    off.extend(l.mbox.off[stack..].iter().zip(&rel).map(|(a, b)| a + b));
    let mut ln = vec![1; stack];
    ln.extend(len);
    Bx { off, len: ln }
}

/// The value ops of the export direction: `add` negated; fp8 dequantisation has no inverse
/// (export writes the Megatron values).
fn invert(value: &[ValueOp]) -> Vec<ValueOp> {
    value
        .iter()
        .map(|v| match v {
            ValueOp::Add(c) => ValueOp::Add(-c),
            ValueOp::DequantFp8Block(_) => ValueOp::Add(0.0),
        })
        .collect()
}

/// An HF tensor of an export, without its pieces: what a vLLM plan needs of it.
struct Head {
    /// Index into the expansion's HF tensors.
    h: usize,
    /// Data type of the exported tensor.
    dtype: DType,
    /// Value ops of the export direction.
    value: Vec<ValueOp>,
}

/// The expansion, the checked sources and the exported HF tensors (in write order, without
/// pieces) of an HF export: every check of [`plan_hf_export`], none of its boxes.
struct Heads {
    ex: Expanded,
    sources: Vec<Source>,
    heads: Vec<Head>,
}

fn hf_heads(
    table: &Table,
    config: &serde_json::Value,
    saved: Layout,
    inv: &Inventory,
) -> Result<Heads, ConvertError> {
    let ex = super::expand::expand(table, config, saved)?;
    check::check_structure(&ex, Direction::Export)?;
    let stored = check::check_megatron_input(&ex, inv)?;
    let sources: Vec<Source> = stored
        .iter()
        .map(|k| {
            let (dt, shape) = &inv[k];
            Ok(Source {
                name: k.clone(),
                shape: shape.clone(),
                dtype: dtype_of(dt, k)?,
            })
        })
        .collect::<Result<_, ConvertError>>()?;
    let aux: std::collections::HashSet<usize> = ex.aux.iter().map(|a| a.1).collect();
    // Per HF tensor, its links as a range of `by_h` (links grouped by HF tensor, in order).
    let mut by_h: Vec<u32> = (0..u32::try_from(ex.links.len()).unwrap_or(u32::MAX)).collect();
    by_h.sort_by_key(|&i| ex.links[i as usize].h);
    let mut order: Vec<usize> = (0..ex.h.len()).filter(|h| !aux.contains(h)).collect();
    order.sort_by(|a, b| ex.h[*a].order.cmp(&ex.h[*b].order));
    let mut heads = Vec::with_capacity(order.len());
    for hi in order {
        let h = &ex.h[hi];
        let lo = by_h.partition_point(|&i| ex.links[i as usize].h < hi);
        let hi_end = by_h.partition_point(|&i| ex.links[i as usize].h <= hi);
        let mut links = by_h[lo..hi_end].iter().map(|&i| &ex.links[i as usize]);
        let first = links.clone().next().ok_or_else(|| ConvertError::Table {
            table: table.name.clone(),
            msg: format!(
                "no rule reads a Megatron tensor into HF tensor `{}`",
                h.name
            ),
        })?;
        let dtype = sources[first.m].dtype;
        if let Some(l) = links.find(|l| sources[l.m].dtype != dtype) {
            return Err(ConvertError::Dtype {
                rule: ex.rules[l.rule].name.clone(),
                side: "megatron",
                key: sources[l.m].name.clone(),
                stored: sources[l.m].dtype.to_string(),
                expected: dtype.to_string(),
            });
        }
        let rule = &ex.rules[first.rule];
        let dtype = match &h.dtype {
            Some(d)
                if !rule
                    .value
                    .iter()
                    .any(|v| matches!(v, ValueOp::DequantFp8Block(_))) =>
            {
                dtype_of(d, &h.name)?
            }
            _ => dtype,
        };
        heads.push(Head {
            h: hi,
            dtype,
            value: invert(&rule.value),
        });
    }
    Ok(Heads { ex, sources, heads })
}

/// The checks passed by an HF export.
fn hf_checks(saved: Layout, dests: usize, sources: usize) -> Vec<String> {
    vec![
        format!("every HF tensor produced exactly once ({dests} tensors)"),
        format!("every Megatron element consumed exactly once, padding aside ({sources} tensors)"),
        "every checkpoint tensor consumed or listed in drop.megatron".into(),
        format!("stored shapes equal config-implied shapes at {saved}"),
        "fused tensors interleaved per unit".into(),
    ]
}

/// Plans an HF export of a Megatron-layout checkpoint whose tensors are `inv` (stored key ->
/// (dtype, shape)). `max_shard_bytes` splits the output into files as HF does.
///
/// # Errors
/// Any check of spec § 19.5.
pub fn plan_hf_export(
    table: &Table,
    config: &serde_json::Value,
    saved: Layout,
    inv: &Inventory,
    max_shard_bytes: u64,
) -> Result<Plan, ConvertError> {
    let Heads { ex, sources, heads } = hf_heads(table, config, saved, inv)?;
    let mut by_h: Vec<Vec<&Link>> = vec![Vec::new(); ex.h.len()];
    for l in &ex.links {
        by_h[l.h].push(l);
    }
    let mut dests = Vec::with_capacity(heads.len());
    for head in heads {
        let h = &ex.h[head.h];
        let pieces = by_h[head.h]
            .iter()
            .map(|l| Piece {
                src: l.m,
                sbox: l.mbox.clone(),
                dbox: l.hbox.clone(),
                transpose: l.transpose,
                rule: l.rule,
                src_stack: ex.m[l.m].stack_axes,
                dst_stack: 0,
                scale: None,
            })
            .collect();
        dests.push(Dest {
            name: h.name.clone(),
            shape: h.shape.clone(),
            region: Bx::full(&h.shape),
            dtype: head.dtype,
            pieces,
            group: 0,
            value: head.value,
        });
    }
    // Files, in order, at most `max_shard_bytes` each (a larger tensor alone).
    let mut file = 0;
    let mut size = 0u64;
    for d in &mut dests {
        let n = d.nbytes();
        if size > 0 && size + n > max_shard_bytes {
            file += 1;
            size = 0;
        }
        d.group = file;
        size += n;
    }
    let checks = hf_checks(saved, dests.len(), sources.len());
    Ok(Plan {
        sources,
        dests,
        checks,
        params: ex.params.clone(),
        expanded: ex,
    })
}

/// Plans an import of HF tensors `inv` (name -> (dtype, shape)) into a Megatron layout:
/// one destination per rank box (a stack index, a TP piece), as Megatron's ranks hold them.
///
/// # Errors
/// Any check of spec § 19.5.
pub fn plan_megatron_import(
    table: &Table,
    config: &serde_json::Value,
    layout: Layout,
    inv: &Inventory,
) -> Result<Plan, ConvertError> {
    let ex = super::expand::expand(table, config, layout)?;
    check::check_structure(&ex, Direction::Import)?;
    check::check_hf_input(&ex, inv)?;
    let sources: Vec<Source> =
        ex.h.iter()
            .map(|h| {
                let (dt, shape) = &inv[&h.name];
                Ok(Source {
                    name: h.name.clone(),
                    shape: shape.clone(),
                    dtype: dtype_of(dt, &h.name)?,
                })
            })
            .collect::<Result<_, ConvertError>>()?;
    let mut by_unit: BTreeMap<(usize, Vec<u64>), Vec<&Link>> = BTreeMap::new();
    for l in &ex.links {
        let st = ex.m[l.m].stack_axes;
        by_unit
            .entry((l.m, l.mbox.off[..st].to_vec()))
            .or_default()
            .push(l);
    }
    let mut dests = Vec::new();
    for (mi, m) in ex.m.iter().enumerate() {
        let st = m.stack_axes;
        let body = &m.shape[st..];
        let rule = &ex.rules[m.rules[0]];
        // Data type: the rule's cast, else the HF tensors' (which must agree).
        let src_dtypes: Vec<DType> = ex
            .links
            .iter()
            .filter(|l| l.m == mi)
            .map(|l| sources[l.h].dtype)
            .collect();
        let dtype = match &m.dtype {
            Some(d) => dtype_of(d, &m.key)?,
            None => {
                let d0 = src_dtypes[0];
                if let Some(bad) = src_dtypes.iter().find(|d| **d != d0) {
                    return Err(ConvertError::Dtype {
                        rule: rule.name.clone(),
                        side: "hf",
                        key: m.key.clone(),
                        stored: bad.to_string(),
                        expected: d0.to_string(),
                    });
                }
                if rule
                    .value
                    .iter()
                    .any(|v| matches!(v, ValueOp::DequantFp8Block(_)))
                {
                    DType::BFloat16
                } else {
                    d0
                }
            }
        };
        let shape_idx: Vec<(String, u64, u64, u64)> = (0..st)
            .map(|d| (String::new(), m.shape[d], 0, m.shape[d]))
            .collect();
        // TP pieces of the body.
        let mut tboxes: Vec<(u64, Bx)> = Vec::new();
        match m.tp {
            Some(tp) => {
                let a = tp.axis - st;
                let seg = body[a] / tp.parts;
                let piece = seg / layout.tp;
                for t in 0..layout.tp {
                    for p in 0..tp.parts {
                        let mut b = Bx::full(body);
                        b.off[a] = p * seg + t * piece;
                        b.len[a] = piece;
                        tboxes.push((t, b));
                    }
                }
            }
            None => tboxes.push((0, Bx::full(body))),
        }
        for idx in stack_indices(&shape_idx) {
            let links = by_unit.get(&(mi, idx.clone()));
            for (t, tb) in &tboxes {
                let region = tb.prepend(&idx);
                let mut pieces = Vec::new();
                for l in links.into_iter().flatten() {
                    if let Some(x) = l.mbox.intersect(&region) {
                        pieces.push(Piece {
                            src: l.h,
                            sbox: map_m_to_h(l, st, &x),
                            dbox: x.relative_to(&region),
                            transpose: l.transpose,
                            rule: l.rule,
                            src_stack: 0,
                            dst_stack: st,
                            scale: l.scale,
                        });
                    }
                }
                dests.push(Dest {
                    name: m.key.clone(),
                    shape: m.shape.clone(),
                    region,
                    dtype,
                    pieces,
                    group: crate::model::usize_of(*t),
                    value: ex.rules[m.rules[0]].value.clone(),
                });
            }
        }
    }
    let checks = vec![
        format!(
            "every Megatron element produced exactly once, padding zero ({} tensors, {} rank boxes)",
            ex.m.len(),
            dests.len()
        ),
        format!(
            "every HF element consumed exactly once ({} tensors)",
            sources.len()
        ),
        "every HF tensor consumed or listed in drop.hf".into(),
        "HF shapes equal config-implied shapes".into(),
        "fused tensors interleaved per unit".into(),
        format!("{layout} divides every split (units, experts, layers)"),
    ];
    Ok(Plan {
        sources: sources.clone(),
        dests,
        checks,
        params: ex.params.clone(),
        expanded: ex,
    })
}

/// Plans vLLM per-rank tensors for TP size `k` straight from a Megatron-layout checkpoint
/// (spec § 19.6): each destination's pieces are boxes of the stored Megatron tensors.
///
/// # Errors
/// Any check of spec § 19.5, and a TP size that does not divide.
pub fn plan_vllm(
    table: &Table,
    config: &serde_json::Value,
    saved: Layout,
    inv: &Inventory,
    k: u64,
) -> Result<Plan, ConvertError> {
    plan_vllm_part(table, config, saved, inv, k, &Part::default())
}

/// The part of a vLLM plan to build ([`plan_vllm_part`]): a live transfer's rank needs only
/// its own TP rank's destinations (engine) or the pieces of the tensors it sends (trainer).
#[derive(Clone, Copy, Default)]
pub struct Part<'a> {
    /// Only these TP ranks' destinations (`None`: every rank).
    pub ranks: Option<&'a [u64]>,
    /// Only pieces of the Megatron keys this accepts, and only destinations left with a
    /// piece (`None`: every piece and every destination).
    pub keep: Option<&'a dyn Fn(&str) -> bool>,
    /// Only pieces whose box of their Megatron tensor (key, box in its global coordinates)
    /// this accepts (`None`: every piece `keep` keeps). Like `keep`, it never changes which
    /// checks run.
    pub boxes: Option<&'a KeepBox<'a>>,
}

/// A predicate on a piece's Megatron key and its box in the tensor's global coordinates.
pub type KeepBox<'a> = dyn Fn(&str, &Bx) -> bool + 'a;

/// [`plan_vllm`] restricted to `part`: the same checks (each of them depends on the TP size
/// and the tensor, never on which TP rank is built, so one rank's part refuses exactly what
/// the whole plan refuses), the same destinations and pieces in the same order, less those
/// left out.
///
/// # Errors
/// As [`plan_vllm`].
pub fn plan_vllm_part(
    table: &Table,
    config: &serde_json::Value,
    saved: Layout,
    inv: &Inventory,
    k: u64,
    part_of: &Part<'_>,
) -> Result<Plan, ConvertError> {
    // The export's checks and HF tensors, without its pieces (the vLLM pieces are cut from
    // the links directly).
    let hf = hf_heads(table, config, saved, inv)?;
    let ex = &hf.ex;
    // A table without a `vllm` section has no vLLM tensors: refused just below.
    let vllm = table.vllm.clone().unwrap_or_default();
    if vllm.tensors.is_empty() {
        return Err(ConvertError::Table {
            table: table.name.clone(),
            msg: "has no `vllm` section".into(),
        });
    }
    let env = Env::new(table, config, saved);
    let h_index: BTreeMap<&str, usize> =
        ex.h.iter()
            .enumerate()
            .map(|(i, h)| (h.name.as_str(), i))
            .collect();
    let mut by_h: Vec<Vec<&Link>> = vec![Vec::new(); ex.h.len()];
    for l in &ex.links {
        by_h[l.h].push(l);
    }
    let mut dests = Vec::new();
    let mut names: BTreeMap<String, usize> = BTreeMap::new();
    // Names and HF tensors resolved once (for rank 0), reused by the other ranks.
    let mut part_cache: std::collections::HashMap<(usize, Vec<u64>, Option<u64>, usize), usize> =
        std::collections::HashMap::new();
    let mut name_cache: std::collections::HashMap<(usize, Vec<u64>), String> =
        std::collections::HashMap::new();
    let mut hdest_of: Vec<Option<&Head>> = vec![None; ex.h.len()];
    for head in &hf.heads {
        hdest_of[head.h] = Some(head);
    }
    let kept: Vec<bool> = hf
        .sources
        .iter()
        .map(|s| part_of.keep.is_none_or(|f| f(&s.name)))
        .collect();
    // Per HF tensor: whether any link reads a kept source.
    let h_kept: Vec<bool> = by_h.iter().map(|ls| ls.iter().any(|l| kept[l.m])).collect();
    // With `keep`, the (tensor, stack index) pairs with a kept piece, found on the first
    // rank built (every check ran there; later ranks skip the others).
    let mut relevant: std::collections::HashSet<(usize, Vec<u64>)> =
        std::collections::HashSet::new();
    let mut first: Option<u64> = None;
    for r in 0..k {
        if part_of.ranks.is_some_and(|rs| !rs.contains(&r)) {
            continue;
        }
        let later = *first.get_or_insert(r) != r;
        for (vti, vt) in vllm.tensors.iter().enumerate() {
            let rname = format!("vllm:{}", vt.name);
            if let Some(w) = &vt.when
                && !env.eval_bool(w, &[]).map_err(|e| e.in_rule(&rname))?
            {
                continue;
            }
            let ranges = crate::convert::expand::stack_ranges(&vt.stack, &env)
                .map_err(|e| e.in_rule(&rname))?;
            let npat = Pattern::parse(&vt.name)?;
            let ppats: Vec<Pattern> = vt
                .parts
                .iter()
                .map(|p| Pattern::parse(&p.hf))
                .collect::<Result<_, _>>()?;
            // The documented default axis.
            let cat = vt.axis.unwrap_or(0);
            let vop = |msg: String| ConvertError::Op {
                rule: rname.clone(),
                op: "vllm".into(),
                msg,
            };
            if vt.parts.is_empty() {
                return Err(vop("a vLLM tensor needs at least one part".into()));
            }
            let cap_value = |name: &str, i: u64| {
                i64::try_from(i).map_err(|_| vop(format!("capture {name} = {i} is beyond i64")))
            };
            for idx in stack_indices(&ranges) {
                if later && part_of.keep.is_some() && !relevant.contains(&(vti, idx.clone())) {
                    continue;
                }
                let caps: Vec<(String, i64)> = ranges
                    .iter()
                    .zip(&idx)
                    .map(|((n, ..), &i)| Ok((n.clone(), cap_value(n, i)?)))
                    .collect::<Result<_, ConvertError>>()?;
                let scope = CapScope {
                    env: &env,
                    caps: &caps,
                };
                let name = match name_cache.get(&(vti, idx.clone())) {
                    Some(n) => n.clone(),
                    None => {
                        let n = npat.render(&scope)?;
                        name_cache.insert((vti, idx.clone()), n.clone());
                        n
                    }
                };
                if !later {
                    *names.entry(name.clone()).or_default() += 1;
                    if names[&name] > 1 {
                        return Err(ConvertError::Duplicate {
                            what: "vllm tensor",
                            name,
                            rules: "two `vllm.tensors` entries".into(),
                        });
                    }
                }
                let inner: Vec<Option<u64>> = match &vt.inner {
                    Some(st) => (0..env
                        .eval_u64(&st.size, &caps)
                        .map_err(|e| e.in_rule(&rname))?)
                        .map(Some)
                        .collect(),
                    None => vec![None],
                };
                let mut all_pieces = Vec::new();
                let mut inner_shape: Option<Vec<u64>> = None;
                let mut dtype = None;
                let mut value = Vec::new();
                let outer_caps = caps.clone();
                for ie in &inner {
                    let mut caps = outer_caps.clone();
                    if let (Some(e), Some(st)) = (ie, &vt.inner) {
                        caps.push((st.capture.clone(), cap_value(&st.capture, *e)?));
                    }
                    let scope = CapScope {
                        env: &env,
                        caps: &caps,
                    };
                    let mut shape: Option<Vec<u64>> = None;
                    let mut pieces = Vec::new();
                    for (pk, (part, pp)) in vt.parts.iter().zip(&ppats).enumerate() {
                        let ckey = (vti, idx.clone(), *ie, pk);
                        let hi = match part_cache.get(&ckey) {
                            Some(&hi) => hi,
                            None => {
                                let hname = pp.render(&scope)?;
                                let hi = *h_index.get(hname.as_str()).ok_or_else(|| {
                                    ConvertError::Missing {
                                        rule: rname.clone(),
                                        side: "hf",
                                        key: hname.clone(),
                                        hint: " (the vLLM tensor's part names an HF tensor no rule produces)"
                                            .into(),
                                    }
                                })?;
                                part_cache.insert(ckey, hi);
                                hi
                            }
                        };
                        let hname = &ex.h[hi].name;
                        let hd = hdest_of[hi].ok_or_else(|| ConvertError::Missing {
                            rule: rname.clone(),
                            side: "hf",
                            key: hname.clone(),
                            hint: " (an fp8 scale is not exported)".into(),
                        })?;
                        dtype.get_or_insert(hd.dtype);
                        value.clone_from(&hd.value);
                        let hs = &ex.h[hi].shape;
                        // This rank's box of the (padded) HF tensor.
                        let mut pbox = Bx::full(hs);
                        if let Some(a) = part.axis {
                            let ext = match &part.pad_to {
                                Some(e) => env.eval_u64(e, &caps).map_err(|e| e.in_rule(&rname))?,
                                None => hs[a],
                            };
                            if ext < hs[a] {
                                return Err(ConvertError::Op {
                                    rule: rname.clone(),
                                    op: "pad_to".into(),
                                    msg: format!(
                                        "pad_to {ext} is less than {hname}'s extent {}",
                                        hs[a]
                                    ),
                                });
                            }
                            let units = match &part.units {
                                Some(e) => env.eval_u64(e, &caps).map_err(|e| e.in_rule(&rname))?,
                                None => ext,
                            };
                            let div = |what: String, value: u64| ConvertError::Divisibility {
                                rule: rname.clone(),
                                key: hname.clone(),
                                what,
                                value,
                                by_name: "vLLM tp".into(),
                                by: k,
                                layout: format!("vLLM TP {k}"),
                            };
                            if units == 0 || ext % units != 0 {
                                return Err(div(format!("extent {ext} in units of {units}"), ext));
                            }
                            let us = ext / units;
                            let (a0, n) = if units % k == 0 {
                                (r * (units / k), units / k)
                            } else if part.replicate && k.is_multiple_of(units) {
                                (r / (k / units), 1)
                            } else {
                                return Err(div(
                                    format!(
                                        "units along axis {a}{}",
                                        if part.replicate {
                                            " (nor does it divide the TP size, for replication)"
                                        } else {
                                            ""
                                        }
                                    ),
                                    units,
                                ));
                            };
                            pbox.off[a] = a0 * us;
                            pbox.len[a] = n * us;
                        }
                        // Position of this part in the destination.
                        let mut at = vec![0u64; hs.len()];
                        if cat >= hs.len() {
                            return Err(vop(format!(
                                "axis {cat} out of range for part {hname} of {} dimensions",
                                hs.len()
                            )));
                        }
                        let s = shape.get_or_insert_with(|| {
                            let mut z = pbox.len.clone();
                            z[cat] = 0;
                            z
                        });
                        at[cat] = s[cat];
                        let mut other = pbox.len.clone();
                        other[cat] = s[cat];
                        if *s != other {
                            return Err(ConvertError::Op {
                                rule: rname.clone(),
                                op: "concat".into(),
                                msg: format!("part {hname} has box {pbox}, other parts {s:?}"),
                            });
                        }
                        s[cat] += pbox.len[cat];
                        // Pieces: the real (unpadded) part of the box, through the links.
                        if !h_kept[hi] {
                            continue;
                        }
                        if !later && part_of.keep.is_some() {
                            relevant.insert((vti, idx.clone()));
                        }
                        if let Some(real) = pbox.intersect(&Bx::full(hs)) {
                            for l in by_h[hi].iter().filter(|l| kept[l.m]) {
                                if let Some(x) = l.hbox.intersect(&real) {
                                    let st = ex.m[l.m].stack_axes;
                                    let mut dbox = x.relative_to(&pbox);
                                    for (d, o) in dbox.off.iter_mut().enumerate() {
                                        *o += at[d];
                                    }
                                    let sbox = map_h_to_m(l, st, &x);
                                    if part_of
                                        .boxes
                                        .is_some_and(|f| !f(&hf.sources[l.m].name, &sbox))
                                    {
                                        continue;
                                    }
                                    pieces.push(Piece {
                                        src: l.m,
                                        sbox,
                                        dbox,
                                        transpose: l.transpose,
                                        rule: l.rule,
                                        src_stack: st,
                                        dst_stack: 0,
                                        scale: None,
                                    });
                                }
                            }
                        }
                    }
                    // Every part sets it (there is at least one, checked above).
                    let shape = shape.ok_or_else(|| vop("no part gave a shape".into()))?;
                    if let Some(e) = ie {
                        for p in &mut pieces {
                            p.dbox = p.dbox.prepend(&[*e]);
                        }
                    }
                    if inner_shape.as_ref().is_some_and(|s| *s != shape) {
                        return Err(ConvertError::Op {
                            rule: rname.clone(),
                            op: "inner".into(),
                            msg: format!(
                                "stacked parts differ in shape: {inner_shape:?} and {shape:?}"
                            ),
                        });
                    }
                    inner_shape = Some(shape);
                    all_pieces.extend(pieces);
                }
                let mut shape = inner_shape.ok_or_else(|| {
                    vop("the `inner` stack is empty: a tensor of no parts".into())
                })?;
                if vt.inner.is_some() {
                    shape.insert(0, inner.len() as u64);
                }
                let pieces = all_pieces;
                if (part_of.keep.is_some() || part_of.boxes.is_some()) && pieces.is_empty() {
                    continue;
                }
                dests.push(Dest {
                    name,
                    region: Bx::full(&shape),
                    shape,
                    dtype: dtype.ok_or_else(|| vop("no part gave a data type".into()))?,
                    pieces,
                    group: crate::model::usize_of(r),
                    value,
                });
            }
        }
    }
    let mut checks = hf_checks(saved, hf.heads.len(), hf.sources.len());
    checks.push(format!(
        "vLLM TP {k} divides every split (heads, kv heads or replication, ffn, padded vocab)"
    ));
    Ok(Plan {
        sources: hf.sources,
        dests,
        checks,
        params: hf.ex.params.clone(),
        expanded: hf.ex,
    })
}
