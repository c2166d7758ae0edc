//! `zarrckpt diff A B`: compare two checkpoints tensor by tensor, whatever their layouts.
//!
//! Both sides are read by the same boxes through [`Checkpoint::read_region`], so the two
//! checkpoints may have been saved by different numbers of ranks, with different chunks and
//! subchunks. The boxes are slices in C order of at most `--memory-mib` / 2 bytes per side,
//! so the memory used for tensor data stays within that budget whatever the tensor's size.
//!
//! Two elements of the same data type differ when their bytes differ (so `-0.0` differs from
//! `0.0`, and two NaNs with the same bits are equal); elements of different data types are
//! compared by value (NaN equal to NaN). The largest absolute difference is taken over the
//! differing elements where neither side is NaN; those involving a NaN are counted apart.
//!
//! Objects (common, per-rank, sharded) are compared value by value (each read whole, one at a
//! time): JSON values by value (their canonical text), bytes by bytes; an object whose scope,
//! encoding, world size or grid differs is reported as such.
//!
//! With `--json`, the report also gives the process's peak resident memory
//! (`peak_rss_bytes`, mapped file pages included).
//!
//! Exit status, as `diff(1)`: 0 when the checkpoints hold the same tensors with equal
//! elements, 1 when anything differs, 2 on an error.

use std::collections::BTreeSet;
use std::path::PathBuf;
use std::process::ExitCode;

use serde_json::json;
use zarrckpt::model::dtype::float8_value;
use zarrckpt::storage::object::StoredScope;
use zarrckpt::{Checkpoint, DType, ObjectInfo, ObjectSlot, Region, TensorKey};

use crate::progress;

/// Arguments of `zarrckpt diff`.
#[derive(clap::Args)]
pub struct Args {
    /// The first checkpoint.
    a: PathBuf,
    /// The second checkpoint.
    b: PathBuf,
    /// Print one JSON object instead of lines.
    #[arg(long)]
    json: bool,
    /// Memory for tensor data, in MiB (half for each side).
    #[arg(long, default_value_t = 32)]
    memory_mib: u64,
}

/// What the comparison of one tensor found.
#[derive(Debug, Default)]
struct TensorDiff {
    /// "equal", "differ", "dtype", "shape", "only_a", "only_b".
    status: &'static str,
    dtypes: Option<(DType, DType)>,
    shapes: Option<(Vec<u64>, Vec<u64>)>,
    elements: u64,
    differing: u64,
    with_nan: u64,
    max_abs_diff: f64,
}

/// What the comparison of one object found.
#[derive(Debug, Default)]
struct ObjectDiff {
    /// "equal", "differ", "layout", "only_a", "only_b".
    status: &'static str,
    /// For "layout": what each side stores.
    layouts: Option<(String, String)>,
    /// Values compared, and the slots whose values differ.
    values: u64,
    differing: Vec<String>,
}

/// An object's stored layout, for reports: scope, encoding and world size or grid.
fn object_layout(o: &ObjectInfo) -> String {
    let mut s = format!("{} {}", o.scope.name(), o.encoding.name());
    if let Some(w) = o.world_size {
        s += &format!(" of {w} ranks");
    }
    if let Some(g) = &o.grid {
        s += &format!(" grid {}", dims(g));
    }
    s
}

/// Every stored value of an object.
fn object_slots(o: &ObjectInfo) -> anyhow::Result<Vec<ObjectSlot>> {
    // The index's validation requires both (world size of per-rank objects, grid of sharded
    // ones, its product bounded); a missing one is refused rather than read as no value.
    let missing = |what: &str| anyhow::anyhow!("object {}: the index has no {what}", o.key);
    Ok(match o.scope {
        StoredScope::PerRank => (0..o.world_size.ok_or_else(|| missing("world_size"))?)
            .map(ObjectSlot::Rank)
            .collect(),
        StoredScope::Sharded => {
            let grid = o.grid.clone().ok_or_else(|| missing("grid"))?;
            let total = grid
                .iter()
                .try_fold(1u64, |a, &g| a.checked_mul(g))
                .ok_or_else(|| missing("grid whose size fits u64"))?;
            (0..total)
                .map(|mut lin| {
                    let mut idx = vec![0u64; grid.len()];
                    for d in (0..grid.len()).rev() {
                        idx[d] = lin % grid[d];
                        lin /= grid[d];
                    }
                    ObjectSlot::Shard(idx)
                })
                .collect()
        }
        _ => vec![ObjectSlot::Common],
    })
}

fn compare_object(
    a: &Checkpoint,
    b: &Checkpoint,
    x: Option<&ObjectInfo>,
    y: Option<&ObjectInfo>,
) -> anyhow::Result<ObjectDiff> {
    let (x, y) = match (x, y) {
        (Some(x), Some(y)) => (x, y),
        (Some(_), None) => {
            return Ok(ObjectDiff {
                status: "only_a",
                ..ObjectDiff::default()
            });
        }
        _ => {
            return Ok(ObjectDiff {
                status: "only_b",
                ..ObjectDiff::default()
            });
        }
    };
    let (lx, ly) = (object_layout(x), object_layout(y));
    if lx != ly {
        return Ok(ObjectDiff {
            status: "layout",
            layouts: Some((lx, ly)),
            ..ObjectDiff::default()
        });
    }
    let mut out = ObjectDiff {
        status: "equal",
        ..ObjectDiff::default()
    };
    for slot in object_slots(x)? {
        let va = a.read_object(&x.key, &slot)?;
        let vb = b.read_object(&y.key, &slot)?;
        out.values += 1;
        if va.to_stored() != vb.to_stored() {
            out.differing.push(slot.to_string());
        }
    }
    if !out.differing.is_empty() {
        out.status = "differ";
    }
    Ok(out)
}

fn describe_object(key: &TensorKey, d: &ObjectDiff) -> String {
    match d.status {
        "equal" => format!("= object {key}"),
        "differ" => {
            let mut shown = d
                .differing
                .iter()
                .take(8)
                .cloned()
                .collect::<Vec<_>>()
                .join(", ");
            if d.differing.len() > 8 {
                shown += ", ...";
            }
            format!(
                "~ object {key}: {} of {} values differ ({shown})",
                d.differing.len(),
                d.values
            )
        }
        "layout" => match &d.layouts {
            Some((x, y)) => format!("! object {key}: {x} vs {y}"),
            None => format!("! object {key}: layouts differ"),
        },
        "only_a" => format!("< object {key}: only in A"),
        _ => format!("> object {key}: only in B"),
    }
}

/// The value of element `i` of `bytes` holding elements of `dtype`, as `f64`.
fn value(dtype: DType, bytes: &[u8], i: usize) -> f64 {
    let n = dtype.size();
    let b = &bytes[i * n..(i + 1) * n];
    let mut w = [0u8; 8];
    w[..n].copy_from_slice(b);
    let u = u64::from_le_bytes(w);
    match dtype {
        DType::Bool | DType::UInt8 | DType::UInt16 | DType::UInt32 | DType::UInt64 => u as f64,
        DType::Int8 => f64::from(b[0] as i8),
        DType::Int16 => f64::from(i16::from_le_bytes([b[0], b[1]])),
        DType::Int32 => f64::from(i32::from_le_bytes([b[0], b[1], b[2], b[3]])),
        DType::Int64 => u as i64 as f64,
        DType::Float16 => half::f16::from_bits(u as u16).to_f64(),
        DType::BFloat16 => half::bf16::from_bits(u as u16).to_f64(),
        DType::Float32 => f64::from(f32::from_bits(u as u32)),
        DType::Float64 => f64::from_bits(u),
        other => float8_value(other, b[0]).unwrap_or(f64::NAN),
    }
}

/// |a - b| for two elements, exact for 64-bit integers too where the result fits an f64.
fn abs_diff(dtype: DType, a: &[u8], b: &[u8], i: usize) -> f64 {
    let n = dtype.size();
    let int = |s: &[u8], signed: bool| -> i128 {
        let mut w = [0u8; 8];
        w[..n].copy_from_slice(&s[i * n..(i + 1) * n]);
        let u = u64::from_le_bytes(w);
        if signed {
            let shift = 64 - 8 * n as u32;
            i128::from(((u << shift) as i64) >> shift)
        } else {
            i128::from(u)
        }
    };
    match dtype {
        DType::Int8 | DType::Int16 | DType::Int32 | DType::Int64 => {
            (int(a, true) - int(b, true)).unsigned_abs() as f64
        }
        DType::UInt8 | DType::UInt16 | DType::UInt32 | DType::UInt64 | DType::Bool => {
            (int(a, false) - int(b, false)).unsigned_abs() as f64
        }
        _ => (value(dtype, a, i) - value(dtype, b, i)).abs(),
    }
}

/// Calls `f` with boxes covering `shape` in C order, each of at most `max_elems` elements
/// (at least one element): whole trailing axes, a run of the first axis that does not fit,
/// single indices of the axes before it.
fn for_each_box(
    shape: &[u64],
    max_elems: u64,
    mut f: impl FnMut(Region) -> anyhow::Result<()>,
) -> anyhow::Result<()> {
    let nd = shape.len();
    if shape.contains(&0) {
        return f(Region::full(shape));
    }
    // The first axis d from which the trailing axes fit the budget whole.
    let mut d = nd;
    let mut inner: u64 = 1;
    while d > 0 && inner.saturating_mul(shape[d - 1]) <= max_elems {
        d -= 1;
        inner *= shape[d];
    }
    if d == 0 {
        return f(Region::full(shape));
    }
    let k = d - 1; // the axis cut into runs
    let run = (max_elems / inner).max(1);
    let mut idx = vec![0u64; k];
    loop {
        let mut j = 0;
        while j < shape[k] {
            let len = run.min(shape[k] - j);
            let mut offset = idx.clone();
            offset.push(j);
            offset.extend(std::iter::repeat_n(0, nd - d));
            let mut s = vec![1; k];
            s.push(len);
            s.extend_from_slice(&shape[d..]);
            f(Region::new(offset, s)?)?;
            j += len;
        }
        // Next index of the axes before k (odometer).
        let mut a = k;
        loop {
            if a == 0 {
                return Ok(());
            }
            a -= 1;
            idx[a] += 1;
            if idx[a] < shape[a] {
                break;
            }
            idx[a] = 0;
        }
    }
}

/// Compares one tensor present on both sides with the same shape, box by box.
fn compare(
    a: &Checkpoint,
    b: &Checkpoint,
    key: &TensorKey,
    (da, db): (DType, DType),
    shape: &[u64],
    side_bytes: u64,
    pb: &indicatif::ProgressBar,
) -> anyhow::Result<TensorDiff> {
    let mut out = TensorDiff {
        status: if da == db { "equal" } else { "dtype" },
        dtypes: (da != db).then_some((da, db)),
        elements: shape.iter().product(),
        ..TensorDiff::default()
    };
    let widest = da.size().max(db.size()) as u64;
    let max_elems = (side_bytes / widest).max(1);
    // At most `side_bytes` elements: a buffer this process allocates.
    let cap = usize::try_from(max_elems.min(out.elements))?;
    let mut buf_a = vec![0u8; cap * da.size()];
    let mut buf_b = vec![0u8; cap * db.size()];
    for_each_box(shape, max_elems, |region| {
        let n = usize::try_from(region.num_elements()?)?;
        if n == 0 {
            return Ok(());
        }
        let (x, y) = (&mut buf_a[..n * da.size()], &mut buf_b[..n * db.size()]);
        a.read_region(key, &region, x)?;
        b.read_region(key, &region, y)?;
        pb.inc((x.len() + y.len()) as u64);
        if da == db && x == y {
            return Ok(());
        }
        for i in 0..n {
            let (same, diff) = if da == db {
                let s = da.size();
                if x[i * s..(i + 1) * s] == y[i * s..(i + 1) * s] {
                    continue;
                }
                (false, abs_diff(da, x, y, i))
            } else {
                let (u, v) = (value(da, x, i), value(db, y, i));
                (u == v || (u.is_nan() && v.is_nan()), (u - v).abs())
            };
            if same {
                continue;
            }
            out.differing += 1;
            if diff.is_nan() {
                out.with_nan += 1;
            } else if diff > out.max_abs_diff {
                out.max_abs_diff = diff;
            }
        }
        Ok(())
    })?;
    if out.differing > 0 && da == db {
        out.status = "differ";
    }
    Ok(out)
}

fn number(x: f64) -> serde_json::Value {
    if x.is_finite() {
        json!(x)
    } else {
        json!(x.to_string())
    }
}

fn dims(v: &[u64]) -> String {
    format!(
        "[{}]",
        v.iter().map(u64::to_string).collect::<Vec<_>>().join(", ")
    )
}

fn describe(key: &TensorKey, d: &TensorDiff) -> String {
    let counts = || {
        let mut s = format!(
            "{} of {} elements differ, max |a - b| = {}",
            d.differing, d.elements, d.max_abs_diff
        );
        if d.with_nan > 0 {
            s += &format!(" ({} involving NaN)", d.with_nan);
        }
        s
    };
    match d.status {
        "equal" => format!("= {key}"),
        "differ" => format!("~ {key}: {}", counts()),
        "dtype" => {
            let (x, y) = d.dtypes.unwrap_or((DType::Bool, DType::Bool));
            let values = if d.differing == 0 {
                "equal values".to_owned()
            } else {
                counts()
            };
            format!("! {key}: data type {x} vs {y}; by value: {values}")
        }
        "shape" => match &d.shapes {
            Some((x, y)) => format!("! {key}: shape {} vs {}", dims(x), dims(y)),
            None => format!("! {key}: shapes differ"),
        },
        "only_a" => format!("< {key}: only in A"),
        _ => format!("> {key}: only in B"),
    }
}

fn diff(a: &Args) -> anyhow::Result<ExitCode> {
    let (la, lb) = (crate::remote::local(&a.a)?, crate::remote::local(&a.b)?);
    let ca = Checkpoint::open(la.path())?;
    let cb = Checkpoint::open(lb.path())?;
    let side_bytes = (a.memory_mib << 20) / 2;
    let ta = ca.tensors();
    let tb = cb.tensors();
    let keys: BTreeSet<&TensorKey> = ta.iter().chain(&tb).map(|t| &t.key).collect();
    let total: u64 =
        ta.iter().map(|t| t.nbytes).sum::<u64>() + tb.iter().map(|t| t.nbytes).sum::<u64>();
    let pb = progress::bytes(total, "diff");
    let mut results: Vec<(&TensorKey, TensorDiff)> = Vec::new();
    for key in keys {
        let x = ta.iter().find(|t| &t.key == key);
        let y = tb.iter().find(|t| &t.key == key);
        let d = match (x, y) {
            (Some(_), None) => TensorDiff {
                status: "only_a",
                ..TensorDiff::default()
            },
            (None, Some(_)) => TensorDiff {
                status: "only_b",
                ..TensorDiff::default()
            },
            (Some(x), Some(y)) if x.shape != y.shape => TensorDiff {
                status: "shape",
                shapes: Some((x.shape.clone(), y.shape.clone())),
                dtypes: (x.dtype != y.dtype).then_some((x.dtype, y.dtype)),
                ..TensorDiff::default()
            },
            (Some(x), Some(y)) => {
                compare(&ca, &cb, key, (x.dtype, y.dtype), &x.shape, side_bytes, &pb)?
            }
            (None, None) => continue,
        };
        if !a.json {
            println!("{}", describe(key, &d));
        }
        results.push((key, d));
    }
    pb.finish_and_clear();
    let (oa, ob) = (ca.objects(), cb.objects());
    let okeys: BTreeSet<&TensorKey> = oa.iter().chain(&ob).map(|o| &o.key).collect();
    let mut objects: Vec<(&TensorKey, ObjectDiff)> = Vec::new();
    for key in okeys {
        let d = compare_object(
            &ca,
            &cb,
            oa.iter().find(|o| &o.key == key),
            ob.iter().find(|o| &o.key == key),
        )?;
        if !a.json {
            println!("{}", describe_object(key, &d));
        }
        objects.push((key, d));
    }
    let differ = results.iter().filter(|(_, d)| d.status != "equal").count();
    let odiffer = objects.iter().filter(|(_, d)| d.status != "equal").count();
    if a.json {
        let list: Vec<_> = results
            .iter()
            .map(|(key, d)| {
                let mut o = json!({ "key": key.as_str(), "status": d.status });
                if let Some((x, y)) = d.dtypes {
                    o["dtype_a"] = json!(x.name());
                    o["dtype_b"] = json!(y.name());
                }
                if let Some((x, y)) = &d.shapes {
                    o["shape_a"] = json!(x);
                    o["shape_b"] = json!(y);
                }
                if matches!(d.status, "equal" | "differ" | "dtype") {
                    o["elements"] = json!(d.elements);
                    o["differing"] = json!(d.differing);
                    o["differing_with_nan"] = json!(d.with_nan);
                    o["max_abs_diff"] = number(d.max_abs_diff);
                }
                o
            })
            .collect();
        let olist: Vec<_> = objects
            .iter()
            .map(|(key, d)| {
                let mut o = json!({ "key": key.as_str(), "status": d.status });
                if let Some((x, y)) = &d.layouts {
                    o["layout_a"] = json!(x);
                    o["layout_b"] = json!(y);
                }
                if matches!(d.status, "equal" | "differ") {
                    o["values"] = json!(d.values);
                    o["differing"] = json!(d.differing);
                }
                o
            })
            .collect();
        let doc = json!({
            "a": a.a.display().to_string(), "b": a.b.display().to_string(),
            "equal": differ + odiffer == 0, "tensors": list,
            "tensors_compared": results.len(), "tensors_differing": differ,
            "objects": olist, "objects_compared": objects.len(), "objects_differing": odiffer,
            "peak_rss_bytes": crate::rss::peak(),
        });
        println!("{}", serde_json::to_string_pretty(&doc)?);
    } else if differ + odiffer == 0 {
        println!(
            "equal: {} tensors, {} objects",
            results.len(),
            objects.len()
        );
    } else {
        println!(
            "differ: {differ} of {} tensors, {odiffer} of {} objects",
            results.len(),
            objects.len()
        );
    }
    Ok(ExitCode::from(u8::from(differ + odiffer > 0)))
}

pub fn run(a: &Args) -> anyhow::Result<ExitCode> {
    match diff(a) {
        Ok(code) => Ok(code),
        Err(e) => {
            eprintln!("error: {e:#}");
            Ok(ExitCode::from(2))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn boxes(shape: &[u64], max: u64) -> Vec<Region> {
        let mut v = Vec::new();
        for_each_box(shape, max, |r| {
            v.push(r);
            Ok(())
        })
        .unwrap();
        v
    }

    #[test]
    fn boxes_tile_the_tensor_within_the_budget() {
        for (shape, max) in [
            (vec![7u64, 5, 3], 20u64),
            (vec![7, 5, 3], 1),
            (vec![7, 5, 3], 1000),
            (vec![2, 1, 9], 4),
            (vec![], 3),
            (vec![4, 0, 3], 2),
            (vec![1, 100], 7),
        ] {
            let n: u64 = shape.iter().product();
            let mut seen = vec![0u32; usize::try_from(n).unwrap()];
            for r in boxes(&shape, max) {
                let e = r.num_elements().unwrap();
                assert!(e <= max.max(1), "{shape:?} {max}: {r}");
                let mut idx = r.offset().to_vec();
                // Mark every element of the box.
                for _ in 0..e {
                    let lin = idx.iter().zip(&shape).fold(0u64, |acc, (i, s)| acc * s + i);
                    seen[usize::try_from(lin).unwrap()] += 1;
                    for d in (0..idx.len()).rev() {
                        idx[d] += 1;
                        if idx[d] < r.offset()[d] + r.shape()[d] {
                            break;
                        }
                        idx[d] = r.offset()[d];
                    }
                }
            }
            assert!(seen.iter().all(|&c| c == 1), "{shape:?} {max}: {seen:?}");
        }
    }
}
