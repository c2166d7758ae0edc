//! Helpers shared by the integration tests.
#![allow(dead_code)]

use zarrckpt::model::copy::copy_region;
use zarrckpt::{DType, Region};

/// Deterministic bytes of a whole tensor: element i gets bytes derived from (seed, i).
pub fn tensor_bytes(seed: u64, shape: &[u64], dtype: DType) -> Vec<u8> {
    let n: u64 = shape.iter().product();
    let elem = dtype.size();
    let mut out = Vec::with_capacity(n as usize * elem);
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    for _ in 0..n {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let b = x.to_le_bytes();
        if dtype == DType::Bool {
            out.push(b[0] & 1);
        } else {
            out.extend_from_slice(&b[..elem]);
        }
    }
    out
}

/// The bytes of `region` cut from a full tensor.
pub fn cut(full: &[u8], shape: &[u64], region: &Region, elem: usize) -> Vec<u8> {
    let mut out = vec![0u8; region.shape().iter().product::<u64>() as usize * elem];
    copy_region(full, &Region::full(shape), &mut out, region, region, elem);
    out
}

/// Splits `dim` into `n` torch.chunk-style pieces (ceil size; trailing pieces may be short
/// or empty). Returns (offset, len) pairs.
pub fn chunk_split(dim: u64, n: u64) -> Vec<(u64, u64)> {
    let size = dim.div_ceil(n.max(1));
    (0..n)
        .map(|i| {
            let o = (i * size).min(dim);
            (o, size.min(dim - o))
        })
        .collect()
}

/// The region of piece `i` of `n` along `axis`.
pub fn piece(shape: &[u64], axis: usize, n: u64, i: u64) -> Region {
    let (o, l) = chunk_split(shape[axis], n)[i as usize];
    let mut offset = vec![0; shape.len()];
    let mut s = shape.to_vec();
    offset[axis] = o;
    s[axis] = l;
    Region::new(offset, s).unwrap()
}
pub mod r#gen; // `gen` is a reserved keyword in edition 2024
pub mod s3;
pub mod state;
pub mod target;
