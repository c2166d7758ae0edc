//! Executing a plan: filling destination buffers from source boxes (a checkpoint's
//! read-region API, or caller-provided source bytes), with value ops and casts.

use std::ops::Range;

use super::error::ConvertError;
use super::geom::{Bx, copy_box};
use super::plan::{Dest, Piece, Plan};
use super::table::ValueOp;
use crate::checkpoint::Checkpoint;
use crate::error::Result;
use crate::model::{DType, Region, TensorKey, usize_of};

/// What filling a batch read.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct FillStats {
    /// Bytes read from storage (indexes and subchunks).
    pub bytes_read: u64,
    /// Bytes of source boxes needed.
    pub bytes_needed: u64,
    /// Bytes written into destination buffers.
    pub bytes_filled: u64,
}

fn pad_axes(shape: &[u64], b: &Bx, n: usize) -> (Vec<u64>, Bx) {
    let k = n - shape.len();
    let mut s = vec![1; k];
    s.extend(shape);
    (s, b.prepend(&vec![0; k]))
}

fn to_f64(dtype: DType, src: &[u8]) -> std::result::Result<Vec<f64>, ConvertError> {
    let n = src.len() / dtype.size();
    if matches!(dtype, DType::Float8E4M3FN | DType::Float8E5M2) {
        return Ok(src
            .iter()
            .map(|&b| crate::model::dtype::float8_value(dtype, b).unwrap_or(f64::NAN))
            .collect());
    }
    let mut out = vec![0f64; n];
    crate::model::convert::convert(
        dtype,
        src,
        DType::Float64,
        crate::model::dtype::as_bytes_mut(&mut out),
    )
    .map_err(|e| ConvertError::Unsupported {
        rule: String::new(),
        msg: e.to_string(),
    })?;
    Ok(out)
}

fn from_f64(v: &[f64], dtype: DType) -> std::result::Result<Vec<u8>, ConvertError> {
    let mut out = vec![0u8; v.len() * dtype.size()];
    crate::model::convert::convert(
        DType::Float64,
        crate::model::dtype::as_bytes(v),
        dtype,
        &mut out,
    )
    .map_err(|e| ConvertError::Unsupported {
        rule: String::new(),
        msg: e.to_string(),
    })?;
    Ok(out)
}

/// Copies one piece from `src` (box `src_box` of source tensor data of `src_dtype`) into
/// `dst` (the destination's region buffer), converting data types and applying value ops.
///
/// # Errors
/// [`ConvertError::Unsupported`] for an impossible conversion.
#[allow(clippy::too_many_arguments)]
pub fn copy_piece(
    p: &Piece,
    src: &[u8],
    src_box: &Bx,
    src_dtype: DType,
    dst: &mut [u8],
    d: &Dest,
    value: &[ValueOp],
) -> std::result::Result<(), ConvertError> {
    let sb = p.sbox.relative_to(src_box);
    let n = sb.len.len().max(p.dbox.len.len());
    let (sshape, sb) = pad_axes(&src_box.len, &sb, n);
    let (dshape, db) = pad_axes(&d.region.len, &p.dbox, n);
    let plain = src_dtype == d.dtype
        && value
            .iter()
            .all(|v| matches!(v, ValueOp::Add(c) if *c == 0.0));
    if plain {
        copy_box(
            src,
            &sshape,
            &sb,
            dst,
            &dshape,
            &db,
            src_dtype.size(),
            p.transpose,
        );
        return Ok(());
    }
    // Through a box-shaped temporary: gather, convert, apply, scatter.
    // A box of a source held in memory: its size fits a usize.
    let mut tmp = vec![0u8; usize_of(sb.volume()) * src_dtype.size()];
    copy_box(
        src,
        &sshape,
        &sb,
        &mut tmp,
        &sb.len,
        &Bx::full(&sb.len),
        src_dtype.size(),
        false,
    );
    let mut vals = to_f64(src_dtype, &tmp)?;
    for v in value {
        if let ValueOp::Add(c) = v {
            for x in &mut vals {
                *x += c;
            }
        }
    }
    let out = from_f64(&vals, d.dtype)?;
    copy_box(
        &out,
        &sb.len,
        &Bx::full(&sb.len),
        dst,
        &dshape,
        &db,
        d.dtype.size(),
        p.transpose,
    );
    Ok(())
}

/// fp8 block dequantisation of one piece: `dst = src * scale_inv[i / b0, j / b1]`, rounded
/// once to the destination type.
#[allow(clippy::too_many_arguments)]
fn dequant_piece(
    p: &Piece,
    src: &super::plan::Source,
    data: &[u8],
    scale: &super::plan::Source,
    sdata: &[u8],
    block: [u64; 2],
    dst: &mut [u8],
    d: &Dest,
) -> std::result::Result<(), ConvertError> {
    let unsupported = |msg: String| ConvertError::Unsupported {
        rule: String::new(),
        msg,
    };
    if p.sbox.len.len() != 2 || p.transpose {
        return Err(unsupported(
            "fp8 dequantisation of a non-2-D or transposed piece".into(),
        ));
    }
    if scale.dtype != DType::Float32 {
        return Err(unsupported(format!(
            "scale `{}` is {}, not float32",
            scale.name, scale.dtype
        )));
    }
    // A box of a source held in memory: its size fits a usize.
    let mut tmp = vec![0u8; usize_of(p.sbox.volume()) * src.dtype.size()];
    copy_box(
        data,
        &src.shape,
        &p.sbox,
        &mut tmp,
        &p.sbox.len,
        &Bx::full(&p.sbox.len),
        src.dtype.size(),
        false,
    );
    let mut vals = to_f64(src.dtype, &tmp)?;
    let scales: &[f32] = bytemuck_f32(sdata);
    let cols = scale.shape[1];
    let (r0, c0) = (p.sbox.off[0], p.sbox.off[1]);
    let w = p.sbox.len[1];
    for (k, v) in vals.iter_mut().enumerate() {
        let (i, j) = (r0 + k as u64 / w, c0 + k as u64 % w);
        let at = (i / block[0]) * cols + j / block[1];
        let s = *scales.get(usize_of(at)).ok_or_else(|| {
            unsupported(format!(
                "scale `{}` has {} values, element ({i}, {j}) needs value {at}",
                scale.name,
                scales.len()
            ))
        })?;
        *v *= f64::from(s);
    }
    let out = from_f64(&vals, d.dtype)?;
    let n = p.sbox.len.len().max(p.dbox.len.len());
    let sb = Bx::full(&p.sbox.len);
    let (sshape, sb) = pad_axes(&p.sbox.len, &sb, n);
    let (dshape, db) = pad_axes(&d.region.len, &p.dbox, n);
    copy_box(&out, &sshape, &sb, dst, &dshape, &db, d.dtype.size(), false);
    Ok(())
}

fn bytemuck_f32(b: &[u8]) -> &[f32] {
    // SAFETY: f32 has no invalid bit patterns; the length is rounded down to whole elements
    // and the pointer alignment is checked.
    assert!(
        (b.as_ptr() as usize).is_multiple_of(std::mem::align_of::<f32>()),
        "scale data aligned"
    );
    unsafe { std::slice::from_raw_parts(b.as_ptr().cast::<f32>(), b.len() / 4) }
}

/// Fills the destinations `batch` of `plan` from `ckpt` (a Megatron-layout checkpoint: HF
/// export and vLLM plans) into `bufs` (one per destination, [`Dest::nbytes`] each, zeroed by
/// the caller: padding stays zero). Each merged source box is read once.
///
/// # Errors
/// Storage errors of the reads, conversion errors.
pub fn fill_from_checkpoint(
    ckpt: &Checkpoint,
    plan: &Plan,
    batch: Range<usize>,
    bufs: &mut [&mut [u8]],
) -> Result<FillStats> {
    let reads = plan.reads(batch.clone());
    let dests = &plan.dests[batch];
    // Which (destination, piece) pieces use each read box.
    let mut users: Vec<Vec<(usize, usize)>> = vec![Vec::new(); reads.len()];
    let mut piece_read: Vec<Vec<usize>> = Vec::with_capacity(dests.len());
    for (i, d) in dests.iter().enumerate() {
        let mut v = Vec::with_capacity(d.pieces.len());
        for (j, p) in d.pieces.iter().enumerate() {
            let ri = reads
                .iter()
                .position(|(s, b)| *s == p.src && b.contains(&p.sbox))
                .expect("a merged read box holds every piece");
            users[ri].push((i, j));
            v.push(ri);
        }
        piece_read.push(v);
    }
    // A read box that is exactly one whole destination with nothing to convert is read
    // straight into the destination's buffer (no intermediate copy).
    let direct: Vec<bool> = reads
        .iter()
        .zip(&users)
        .map(|((s, b), u)| {
            let [(i, j)] = u.as_slice() else {
                return false;
            };
            let (d, p) = (&dests[*i], &dests[*i].pieces[*j]);
            p.sbox == *b
                && !p.transpose
                && plan.sources[*s].dtype == d.dtype
                && d.value
                    .iter()
                    .all(|v| matches!(v, ValueOp::Add(c) if *c == 0.0))
                && p.dbox.volume() == d.region.volume()
        })
        .collect();
    let mut stats = FillStats::default();
    let mut data: Vec<Vec<u8>> = Vec::with_capacity(reads.len());
    for (ri, (s, b)) in reads.iter().enumerate() {
        let src = &plan.sources[*s];
        let n = usize_of(b.volume()) * src.dtype.size();
        let key = TensorKey::new(&src.name)?;
        let region = Region::new(b.off.clone(), b.len.clone()).map_err(|source| {
            crate::Error::Tensor(crate::model::TensorError::Region {
                key: src.name.clone(),
                source,
            })
        })?;
        let rep = if direct[ri] {
            let (i, _) = users[ri][0];
            data.push(Vec::new());
            ckpt.read_region(&key, &region, bufs[i])?
        } else {
            let mut buf = vec![0u8; n];
            let rep = ckpt.read_region(&key, &region, &mut buf)?;
            data.push(buf);
            rep
        };
        stats.bytes_read += rep.bytes_read;
        stats.bytes_needed += n as u64;
    }
    for (i, d) in dests.iter().enumerate() {
        for (j, p) in d.pieces.iter().enumerate() {
            let ri = piece_read[i][j];
            if direct[ri] {
                continue;
            }
            let (s, rb) = &reads[ri];
            copy_piece(
                p,
                &data[ri],
                rb,
                plan.sources[*s].dtype,
                bufs[i],
                d,
                &d.value,
            )
            .map_err(|e| e.in_rule(&plan.expanded.rules[p.rule].name))?;
        }
        stats.bytes_filled += d.nbytes();
    }
    Ok(stats)
}

/// Fills one destination from whole source tensors held in memory or mapped (HF import):
/// `source(i)` returns source `i`'s bytes (C order, its full shape).
///
/// # Errors
/// Conversion errors.
pub fn fill_from_sources<'s>(
    plan: &Plan,
    dest: usize,
    source: &dyn Fn(usize) -> &'s [u8],
    buf: &mut [u8],
) -> std::result::Result<(), ConvertError> {
    let d = &plan.dests[dest];
    for p in &d.pieces {
        let src = &plan.sources[p.src];
        let r = match p.scale {
            Some((si, block)) => dequant_piece(
                p,
                src,
                source(p.src),
                &plan.sources[si],
                source(si),
                block,
                buf,
                d,
            ),
            None => copy_piece(
                p,
                source(p.src),
                &Bx::full(&src.shape),
                src.dtype,
                buf,
                d,
                &d.value,
            ),
        };
        r.map_err(|e| e.in_rule(&plan.expanded.rules[p.rule].name))?;
    }
    Ok(())
}

/// When destination `dest` is exactly one contiguous box of one source with nothing to
/// convert, the source index and byte range to borrow instead of copying.
#[must_use]
pub fn borrowable(plan: &Plan, dest: usize) -> Option<(usize, Range<usize>)> {
    let d = &plan.dests[dest];
    if d.pieces.len() != 1 {
        return None;
    }
    let p = &d.pieces[0];
    let src = &plan.sources[p.src];
    let plain = src.dtype == d.dtype
        && d.value
            .iter()
            .all(|v| matches!(v, ValueOp::Add(c) if *c == 0.0));
    if !plain || p.transpose || p.sbox.volume() != d.region.volume() {
        return None;
    }
    if !super::geom::is_contiguous(&p.sbox, &src.shape) {
        return None;
    }
    let es = src.dtype.size() as u64;
    let start = super::geom::byte_offset(&p.sbox, &src.shape, es);
    let end = start + p.sbox.volume() * es;
    Some((
        p.src,
        usize::try_from(start).ok()?..usize::try_from(end).ok()?,
    ))
}
