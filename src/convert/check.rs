//! The checks of spec § 19.5, from metadata alone: coverage of every destination exactly
//! once, consumption of every source, stored shapes against config-implied ones,
//! divisibility for the requested layout, the structure of fused tensors.

use std::collections::BTreeMap;

use super::error::ConvertError;
use super::expand::{Expanded, Layout};
use super::geom::Bx;
use super::table::glob_match;

/// The direction of a conversion (which side is the destination).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Direction {
    /// HF -> Megatron.
    Import,
    /// Megatron -> HF (and vLLM, through HF names).
    Export,
}

/// What a source or destination holds: data type name and shape.
pub type Inventory = BTreeMap<String, (String, Vec<u64>)>;

fn rules_of(ex: &Expanded, ids: impl IntoIterator<Item = usize>) -> String {
    let mut v: Vec<String> = ids
        .into_iter()
        .map(|r| format!("`{}`", ex.rules[r].name))
        .collect();
    v.sort();
    v.dedup();
    if v.is_empty() {
        "none".into()
    } else {
        v.join(", ")
    }
}

/// Checks boxes of one tensor cover it exactly once: returns (gap elements, first gap place,
/// overlap elements, overlapping rules) with boxes grouped by their leading `group_axes`.
fn cover(
    shape: &[u64],
    group_axes: usize,
    boxes: &[(usize, &Bx)],
    npads: usize,
) -> (u64, String, u64, Vec<usize>, String) {
    // The last `npads` boxes are padding: padding overlapping padding is not a conflict
    // (two rules may pad the same rows); counted once.
    let first_pad = boxes.len() - npads;
    let mut seen_pads: Vec<&Bx> = Vec::new();
    let boxes: Vec<(usize, &Bx)> = boxes
        .iter()
        .enumerate()
        .filter(|&(i, &(_, b))| {
            if i < first_pad {
                return true;
            }
            if seen_pads.contains(&b) {
                return false;
            }
            seen_pads.push(b);
            true
        })
        .map(|(_, b)| *b)
        .collect();
    let mut groups: BTreeMap<&[u64], Vec<(usize, &Bx)>> = BTreeMap::new();
    for b in boxes {
        groups.entry(&b.1.off[..group_axes]).or_default().push(b);
    }
    let body: u64 = shape[group_axes..].iter().product();
    let ngroups: u64 = shape[..group_axes].iter().product();
    let mut gap = 0u64;
    let mut gap_at = String::new();
    let mut over = 0u64;
    let mut over_rules = Vec::new();
    let mut over_at = String::new();
    if (groups.len() as u64) < ngroups {
        gap += (ngroups - groups.len() as u64) * body;
        // First missing group.
        let mut idx = vec![0u64; group_axes];
        'find: loop {
            if !groups.contains_key(idx.as_slice()) {
                gap_at = format!(" at stack index {idx:?}");
                break 'find;
            }
            let mut d = group_axes;
            loop {
                if d == 0 {
                    break 'find;
                }
                d -= 1;
                idx[d] += 1;
                if idx[d] < shape[d] {
                    break;
                }
                idx[d] = 0;
            }
        }
    }
    for (g, bs) in &groups {
        let vol: u64 = bs.iter().map(|b| b.1.volume()).sum();
        let mut pair_over = 0u64;
        for i in 0..bs.len() {
            for j in i + 1..bs.len() {
                if let Some(x) = bs[i].1.intersect(bs[j].1) {
                    pair_over += x.volume();
                    over_rules.push(bs[i].0);
                    over_rules.push(bs[j].0);
                    if over_at.is_empty() {
                        over_at = format!(" at {x}");
                    }
                }
            }
        }
        over += pair_over;
        let covered = vol - pair_over.min(vol);
        if covered < body {
            if gap_at.is_empty() {
                // Find an uncovered box along the first body axis for the message.
                let ax = group_axes;
                let mut spans: Vec<(u64, u64)> = bs
                    .iter()
                    .map(|b| (b.1.off[ax], b.1.off[ax] + b.1.len[ax]))
                    .collect();
                spans.sort_unstable();
                let mut pos = 0;
                let mut hole = None;
                for (a, b) in spans {
                    if a > pos {
                        hole = Some((pos, a));
                        break;
                    }
                    pos = pos.max(b);
                }
                let hole = hole.or((pos < shape[ax]).then_some((pos, shape[ax])));
                gap_at = match hole {
                    Some((a, b)) if group_axes > 0 => {
                        format!(" at stack index {g:?}, axis {} [{a}, {b})", ax - group_axes)
                    }
                    Some((a, b)) => format!(" axis 0 [{a}, {b})"),
                    None if group_axes > 0 => format!(" at stack index {g:?}"),
                    None => String::new(),
                };
            }
            gap += body - covered;
        }
    }
    (gap, gap_at, over, over_rules, over_at)
}

/// The structural checks of an expansion, for `dir`: coverage of both sides (exactly once,
/// padding aside), fused-tensor structure (tensor-parallel units holding equal shares of
/// each source), and, for import, divisibility by `ex.layout`.
///
/// # Errors
/// The first violation.
pub fn check_structure(ex: &Expanded, dir: Direction) -> Result<(), ConvertError> {
    // Megatron side.
    let mut mboxes: Vec<Vec<(usize, &Bx)>> = vec![Vec::new(); ex.m.len()];
    for l in &ex.links {
        mboxes[l.m].push((l.rule, &l.mbox));
    }
    let mut pads: Vec<Vec<(usize, &Bx)>> = vec![Vec::new(); ex.m.len()];
    for (r, m, b) in &ex.pads {
        pads[*m].push((*r, b));
    }
    for (mi, m) in ex.m.iter().enumerate() {
        let mut all = std::mem::take(&mut mboxes[mi]);
        all.extend(pads[mi].iter().copied());
        let (gap, gap_at, over, over_rules, over_at) =
            cover(&m.shape, m.stack_axes, &all, pads[mi].len());
        if over > 0 {
            return Err(match dir {
                Direction::Import => ConvertError::Coverage {
                    side: "megatron",
                    key: m.key.clone(),
                    at: over_at,
                    elements: over,
                    times: 2,
                    rules: rules_of(ex, over_rules),
                },
                Direction::Export => ConvertError::ConsumedTwice {
                    side: "megatron",
                    key: m.key.clone(),
                    at: over_at,
                    elements: over,
                    rules: rules_of(ex, over_rules),
                },
            });
        }
        if gap > 0 {
            return Err(match dir {
                Direction::Import => ConvertError::Coverage {
                    side: "megatron",
                    key: m.key.clone(),
                    at: gap_at,
                    elements: gap,
                    times: 0,
                    rules: rules_of(ex, m.rules.iter().copied()),
                },
                Direction::Export => ConvertError::PartlyConsumed {
                    side: "megatron",
                    key: m.key.clone(),
                    at: gap_at,
                    elements: gap,
                    rules: rules_of(ex, m.rules.iter().copied()),
                },
            });
        }
    }
    // HF side.
    drop(mboxes);
    let fulls: Vec<(usize, usize, Bx)> = ex
        .aux
        .iter()
        .map(|&(r, h)| (r, h, Bx::full(&ex.h[h].shape)))
        .collect();
    let mut hboxes: Vec<Vec<(usize, &Bx)>> = vec![Vec::new(); ex.h.len()];
    for l in &ex.links {
        hboxes[l.h].push((l.rule, &l.hbox));
    }
    for (r, h, b) in &fulls {
        hboxes[*h].push((*r, b));
    }
    for (hi, h) in ex.h.iter().enumerate() {
        let (gap, gap_at, over, over_rules, over_at) = cover(&h.shape, 0, &hboxes[hi], 0);
        if over > 0 {
            return Err(match dir {
                Direction::Export => ConvertError::Coverage {
                    side: "hf",
                    key: h.name.clone(),
                    at: over_at,
                    elements: over,
                    times: 2,
                    rules: rules_of(ex, over_rules),
                },
                Direction::Import => ConvertError::ConsumedTwice {
                    side: "hf",
                    key: h.name.clone(),
                    at: over_at,
                    elements: over,
                    rules: rules_of(ex, over_rules),
                },
            });
        }
        if gap > 0 {
            let rules = rules_of(ex, hboxes[hi].iter().map(|b| b.0));
            return Err(match dir {
                Direction::Export => ConvertError::Coverage {
                    side: "hf",
                    key: h.name.clone(),
                    at: gap_at,
                    elements: gap,
                    times: 0,
                    rules,
                },
                Direction::Import => ConvertError::PartlyConsumed {
                    side: "hf",
                    key: h.name.clone(),
                    at: gap_at,
                    elements: gap,
                    rules,
                },
            });
        }
    }
    check_units(ex)?;
    if dir == Direction::Import {
        check_layout(ex, ex.layout)?;
    }
    Ok(())
}

/// Elements per source slot (rule, position of the HF tensor in the rule).
type Composition = BTreeMap<(usize, usize), u64>;

/// Tensor-parallel units of fused tensors hold equal shares of every source: a fused QKV
/// stored as plain [Q; K; V] puts only query rows in the first query group's unit.
fn check_units(ex: &Expanded) -> Result<(), ConvertError> {
    for (mi, m) in ex.m.iter().enumerate() {
        let Some(tp) = m.tp.filter(|t| t.explicit_units) else {
            continue;
        };
        let (axis, parts, units) = (tp.axis, tp.parts, tp.units);
        let extent = m.shape[axis];
        let seg = extent / parts;
        let per_part_units = units;
        if per_part_units == 0 || seg % per_part_units != 0 {
            return Err(ConvertError::Structure {
                rule: ex.rules[m.rules[0]].name.clone(),
                key: m.key.clone(),
                msg: format!("extent {extent} along axis {axis} does not split into {units} units"),
            });
        }
        let usize_ = seg / per_part_units;
        // Only the first stack index: every index has the same structure.
        let first: Vec<&super::expand::Link> = ex
            .links
            .iter()
            .filter(|l| l.m == mi && l.mbox.off[..m.stack_axes].iter().all(|&x| x == 0))
            .collect();
        // Per part, per unit: elements of each source slot (rule, hf position in rule).
        for p in 0..parts {
            let mut reference: Option<(u64, Composition)> = None;
            for u in 0..per_part_units {
                let a = p * seg + u * usize_;
                let b = a + usize_;
                let mut comp: BTreeMap<(usize, usize), u64> = BTreeMap::new();
                for l in &first {
                    let la = l.mbox.off[axis];
                    let lb = la + l.mbox.len[axis];
                    let (x, y) = (la.max(a), lb.min(b));
                    if y > x {
                        let slot = (l.rule, ex.h[l.h].order.2);
                        *comp.entry(slot).or_default() += y - x;
                    }
                }
                match &reference {
                    None => reference = Some((u, comp)),
                    Some((u0, c0)) if *c0 != comp => {
                        let show = |c: &BTreeMap<(usize, usize), u64>| {
                            c.iter()
                                .map(|((r, k), n)| {
                                    let name =
                                        ex.h.iter()
                                            .find(|h| h.order.1 == *r && h.order.2 == *k)
                                            .map_or("?", |h| h.name.as_str());
                                    format!("{n} from `{name}`")
                                })
                                .collect::<Vec<_>>()
                                .join(", ")
                        };
                        return Err(ConvertError::Structure {
                            rule: ex.rules[m.rules[0]].name.clone(),
                            key: m.key.clone(),
                            msg: format!(
                                "tensor-parallel unit {u0} of {per_part_units} along axis {} holds {} but unit {u} holds {}: \
                                 every unit (units = {units}, e.g. one query group) must hold an equal share of each source, \
                                 so that any TP split gives each rank whole groups (a fused QKV must be interleaved per query group, not concatenated)",
                                axis - m.stack_axes,
                                show(c0),
                                show(&comp)
                            ),
                        });
                    }
                    _ => {}
                }
            }
        }
    }
    Ok(())
}

/// Divisibility of a Megatron layout (spec § 19.5, item 5).
///
/// # Errors
/// [`ConvertError::Divisibility`].
pub fn check_layout(ex: &Expanded, layout: Layout) -> Result<(), ConvertError> {
    let lay = layout.to_string();
    for m in &ex.m {
        let rule = ex.rules[m.rules[0]].name.clone();
        if let Some(tp) = m.tp {
            let (axis, parts, per_part_units) = (tp.axis, tp.parts, tp.units);
            let seg = m.shape[axis] / parts.max(1);
            for (what, v) in [
                (
                    format!(
                        "units along axis {} ({per_part_units} per part, e.g. query groups or heads)",
                        axis - m.stack_axes
                    ),
                    per_part_units,
                ),
                (
                    format!(
                        "extent of each of {parts} part(s) along axis {}",
                        axis - m.stack_axes
                    ),
                    seg,
                ),
            ] {
                if v % layout.tp != 0 {
                    return Err(ConvertError::Divisibility {
                        rule,
                        key: m.key.clone(),
                        what,
                        value: v,
                        by_name: "tp".into(),
                        by: layout.tp,
                        layout: lay,
                    });
                }
            }
        }
        if let Some(a) = m.ep_axis
            && m.shape[a] % layout.ep != 0
        {
            return Err(ConvertError::Divisibility {
                rule,
                key: m.key.clone(),
                what: format!("experts (axis {a})"),
                value: m.shape[a],
                by_name: "ep".into(),
                by: layout.ep,
                layout: lay,
            });
        }
        if let Some(a) = m.captures.iter().position(|c| c == "layer")
            && m.shape[a] % layout.pp != 0
        {
            return Err(ConvertError::Divisibility {
                rule,
                key: m.key.clone(),
                what: format!("layers (axis {a})"),
                value: m.shape[a],
                by_name: "pp".into(),
                by: layout.pp,
                layout: lay,
            });
        }
    }
    Ok(())
}

fn hint_glued(name: &str, known: &[&str]) -> String {
    // A known name that is a strict prefix of the unknown one, with the rest not starting a
    // new component: `experts.gate_proj.weight100` vs `...weight`.
    for k in known {
        if name.len() > k.len() && name.starts_with(k) && !name[k.len()..].starts_with('.') {
            return format!(
                " (it starts with the table's tensor `{k}` followed by `{}`: a suffix glued to a name, as in `weight100`, is refused)",
                &name[k.len()..]
            );
        }
    }
    String::new()
}

/// Checks the HF input of an import against the expansion: every tensor the table needs is
/// there with the config-implied shape, every tensor there is needed or dropped.
///
/// # Errors
/// [`ConvertError::Missing`], [`ConvertError::Shape`], [`ConvertError::Unconsumed`].
pub fn check_hf_input(ex: &Expanded, inv: &Inventory) -> Result<(), ConvertError> {
    for h in &ex.h {
        let rule = ex.rules[h.order.1].name.clone();
        match inv.get(&h.name) {
            None => {
                return Err(ConvertError::Missing {
                    rule,
                    side: "hf",
                    key: h.name.clone(),
                    hint: String::new(),
                });
            }
            Some((dt, shape)) => {
                if *shape != h.shape {
                    return Err(ConvertError::Shape {
                        rule,
                        side: "hf",
                        key: h.name.clone(),
                        stored: shape.clone(),
                        expected: h.shape.clone(),
                        hint: String::new(),
                    });
                }
                if let Some(want) = &h.dtype
                    && want != dt
                {
                    return Err(ConvertError::Dtype {
                        rule,
                        side: "hf",
                        key: h.name.clone(),
                        stored: dt.clone(),
                        expected: want.clone(),
                    });
                }
            }
        }
    }
    let known: BTreeMap<&str, ()> = ex.h.iter().map(|h| (h.name.as_str(), ())).collect();
    let names: Vec<&str> = known.keys().copied().collect();
    for (name, (_, shape)) in inv {
        if !known.contains_key(name.as_str()) && !ex.drop_h.iter().any(|g| glob_match(g, name)) {
            return Err(ConvertError::Unconsumed {
                side: "hf",
                key: name.clone(),
                shape: shape.clone(),
                hint: hint_glued(name, &names),
            });
        }
    }
    Ok(())
}

/// Checks a Megatron-layout checkpoint against the expansion for an export: returns, per
/// Megatron tensor of the expansion, the key under which it is stored (the key or an alias).
///
/// # Errors
/// [`ConvertError::Missing`], [`ConvertError::Shape`], [`ConvertError::Unconsumed`].
pub fn check_megatron_input(ex: &Expanded, inv: &Inventory) -> Result<Vec<String>, ConvertError> {
    let mut stored = Vec::new();
    for m in &ex.m {
        let rule = ex.rules[m.rules[0]].name.clone();
        let key = std::iter::once(&m.key)
            .chain(&m.aliases)
            .find(|k| inv.contains_key(*k))
            .ok_or_else(|| ConvertError::Missing {
                rule: rule.clone(),
                side: "megatron",
                key: m.key.clone(),
                hint: if m.aliases.is_empty() {
                    String::new()
                } else {
                    format!(" (nor its other spellings {:?})", m.aliases)
                },
            })?;
        let (_, shape) = &inv[key];
        if *shape != m.shape {
            let hint = if ex.pads.iter().any(|(_, pm, _)| ex.m[*pm].key == m.key)
                || shape.len() == m.shape.len()
            {
                format!(
                    " at {} (a padded vocabulary depends on the saving TP: pass it with --megatron tp=T; padding rows are never written to HF)",
                    ex.layout
                )
            } else {
                String::new()
            };
            return Err(ConvertError::Shape {
                rule,
                side: "megatron",
                key: key.clone(),
                stored: shape.clone(),
                expected: m.shape.clone(),
                hint,
            });
        }
        stored.push(key.clone());
    }
    let known: Vec<&str> = stored.iter().map(String::as_str).collect();
    for (name, (_, shape)) in inv {
        if !known.contains(&name.as_str()) && !ex.drop_m.iter().any(|g| glob_match(g, name)) {
            return Err(ConvertError::Unconsumed {
                side: "megatron",
                key: name.clone(),
                shape: shape.clone(),
                hint: hint_glued(name, &known),
            });
        }
    }
    Ok(stored)
}
