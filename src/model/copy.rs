//! Copying boxes between C-order buffers: the one strided-copy routine every layer uses.

use unsafe_cell_slice::UnsafeCellSlice;

use super::region::Region;
use super::usize_of;

/// True when a box of `box_shape` placed in a C-order buffer of `buf_shape` occupies one
/// contiguous byte range: after the first dimension where the box is longer than 1, it must
/// span the buffer's full extent.
#[must_use]
pub fn is_contiguous(box_shape: &[u64], buf_shape: &[u64]) -> bool {
    match box_shape.iter().position(|&s| s != 1) {
        None => true,
        Some(k) => box_shape[k + 1..] == buf_shape[k + 1..],
    }
}

/// Byte offset of element `index` in a C-order buffer of `shape` with `elem` bytes per element.
/// Callers guarantee `index` lies inside `shape` and the buffer fits in memory.
#[must_use]
pub fn byte_offset(index: &[u64], shape: &[u64], elem: usize) -> usize {
    let mut off: u64 = 0;
    for (i, s) in index.iter().zip(shape) {
        off = off * s + i;
    }
    // Inside a buffer in memory (the caller's guarantee): fits a usize.
    usize_of(off).saturating_mul(elem)
}

/// Copies the box `region` (global coordinates) from `src` to `dst`. `src` holds the box
/// `src_box` and `dst` the box `dst_box`, both in C order; `region` must lie inside both.
/// Works in contiguous runs: one `memcpy` per run of the innermost contiguous dimensions.
///
/// # Panics
/// Panics if the buffers are smaller than their boxes (a caller bug, never input-driven).
pub fn copy_region(
    src: &[u8],
    src_box: &Region,
    dst: &mut [u8],
    dst_box: &Region,
    region: &Region,
    elem: usize,
) {
    for_each_run(src_box, dst_box, region, elem, |s, d, len| {
        dst[d..d + len].copy_from_slice(&src[s..s + len]);
    });
}

/// C-order byte strides of a shape.
fn strides(shape: &[u64], elem: usize) -> Vec<usize> {
    let mut out = vec![0usize; shape.len()];
    let mut acc = elem;
    for d in (0..shape.len()).rev() {
        out[d] = acc;
        acc = acc.saturating_mul(usize_of(shape[d]));
    }
    out
}

/// Calls `f(src_byte_offset, dst_byte_offset, len)` for every contiguous run of `region`
/// copied from a buffer holding `src_box` to one holding `dst_box`, in C order.
pub fn for_each_run(
    src_box: &Region,
    dst_box: &Region,
    region: &Region,
    elem: usize,
    mut f: impl FnMut(usize, usize, usize),
) {
    let nd = region.ndim();
    if region.is_empty() {
        return;
    }
    // Merge trailing dimensions that are full in both source and destination into one run.
    let mut k = nd; // dims k.. form one contiguous run
    let mut run: u64 = 1;
    while k > 0 {
        let d = k - 1;
        run *= region.shape()[d];
        k = d;
        if region.shape()[d] != src_box.shape()[d] || region.shape()[d] != dst_box.shape()[d] {
            break;
        }
    }
    // Sizes and offsets inside both boxes' buffers, which are in memory.
    let run_bytes = usize_of(run) * elem;
    let ss = strides(src_box.shape(), elem);
    let ds = strides(dst_box.shape(), elem);
    let rel = |d: usize, b: &Region| usize_of(region.offset()[d] - b.offset()[d]);
    let mut so: usize = (0..nd).map(|d| rel(d, src_box) * ss[d]).sum();
    let mut dof: usize = (0..nd).map(|d| rel(d, dst_box) * ds[d]).sum();
    if k == 0 {
        f(so, dof, run_bytes);
        return;
    }
    if k == 1 {
        for _ in 0..region.shape()[0] {
            f(so, dof, run_bytes);
            so += ss[0];
            dof += ds[0];
        }
        return;
    }
    // Odometer over the outer dims 0..k with incremental offsets.
    let ext: Vec<usize> = (0..k).map(|d| usize_of(region.shape()[d])).collect();
    let mut idx = vec![0usize; k];
    loop {
        f(so, dof, run_bytes);
        let mut d = k;
        loop {
            if d == 0 {
                return;
            }
            d -= 1;
            idx[d] += 1;
            so += ss[d];
            dof += ds[d];
            if idx[d] < ext[d] {
                break;
            }
            so -= ss[d] * ext[d];
            dof -= ds[d] * ext[d];
            idx[d] = 0;
        }
    }
}

/// A caller's C-order buffer holding the box `region`, shared by threads that each fill (or
/// read) disjoint parts of it.
#[derive(Clone, Copy)]
pub struct DisjointBuf<'a> {
    cells: UnsafeCellSlice<'a, u8>,
    region: &'a Region,
    elem: usize,
}

impl<'a> DisjointBuf<'a> {
    /// Wraps `buf`, which holds `region` in C order.
    pub fn new(buf: &'a mut [u8], region: &'a Region, elem: usize) -> Self {
        DisjointBuf {
            cells: UnsafeCellSlice::new(buf),
            region,
            elem,
        }
    }

    /// The box the buffer holds.
    #[must_use]
    pub fn region(&self) -> &'a Region {
        self.region
    }

    /// Bytes per element.
    #[must_use]
    pub fn elem(&self) -> usize {
        self.elem
    }

    /// The underlying cells (for zarrs views).
    #[must_use]
    pub fn cells(&self) -> UnsafeCellSlice<'a, u8> {
        self.cells
    }

    /// The bytes `[start, start+len)`.
    ///
    /// # Safety
    /// No other thread may access these bytes at the same time.
    #[allow(clippy::mut_from_ref)]
    #[must_use]
    pub unsafe fn slice(&self, start: usize, len: usize) -> &mut [u8] {
        // SAFETY: forwarded to the caller.
        unsafe { self.cells.index_mut(start..start + len) }
    }

    /// Byte offset of a global index inside the buffer.
    #[must_use]
    pub fn offset_of(&self, global_index: &[u64]) -> usize {
        let rel: Vec<u64> = global_index
            .iter()
            .zip(self.region.offset())
            .map(|(a, b)| a - b)
            .collect();
        byte_offset(&rel, self.region.shape(), self.elem)
    }

    /// The byte range of `part` (inside the region) when it is contiguous in the buffer.
    #[must_use]
    pub fn contiguous_range(&self, part: &Region) -> Option<(usize, usize)> {
        if !is_contiguous(part.shape(), self.region.shape()) {
            return None;
        }
        let len = usize_of(part.num_elements().ok()?) * self.elem;
        Some((self.offset_of(part.offset()), len))
    }

    /// Writes zeros over `part` (global coordinates, inside the region).
    ///
    /// # Safety
    /// No other thread may access `part`'s bytes at the same time.
    pub unsafe fn zero(&self, part: &Region) {
        for_each_run(part, self.region, part, self.elem, |_, d, len| {
            // SAFETY: forwarded to the caller.
            unsafe { self.slice(d, len) }.fill(0);
        });
    }

    /// Copies `part` out into `out` (packed in C order).
    ///
    /// # Safety
    /// No other thread may write `part`'s bytes at the same time.
    pub unsafe fn pack(&self, part: &Region, out: &mut Vec<u8>) {
        out.clear();
        for_each_run(self.region, part, part, self.elem, |s, _, len| {
            // SAFETY: forwarded to the caller.
            out.extend_from_slice(unsafe { self.slice(s, len) });
        });
    }

    /// Copies `data` (holding `part` packed in C order) into `part` of the buffer.
    ///
    /// # Safety
    /// No other thread may access `part`'s bytes at the same time.
    pub unsafe fn unpack(&self, part: &Region, data: &[u8]) {
        for_each_run(part, self.region, part, self.elem, |s, d, len| {
            // SAFETY: forwarded to the caller.
            unsafe { self.slice(d, len) }.copy_from_slice(&data[s..s + len]);
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn r(o: &[u64], s: &[u64]) -> Region {
        Region::new(o.to_vec(), s.to_vec()).unwrap()
    }

    #[test]
    fn contiguity() {
        assert!(is_contiguous(&[2, 4], &[5, 4]));
        assert!(!is_contiguous(&[2, 3], &[5, 4]));
        assert!(is_contiguous(&[1, 3], &[5, 4]));
        assert!(is_contiguous(&[1, 1, 3], &[5, 4, 7]));
        assert!(!is_contiguous(&[1, 2, 3], &[5, 4, 7]));
        assert!(is_contiguous(&[1, 1, 7], &[5, 4, 7]));
        assert!(is_contiguous(&[], &[]));
    }

    #[test]
    fn copies_boxes_elementwise() {
        // Global 6x5 tensor with value = row*10+col, as u16.
        let global = r(&[0, 0], &[6, 5]);
        let mut g = Vec::new();
        for i in 0..6u16 {
            for j in 0..5u16 {
                g.extend_from_slice(&(i * 10 + j).to_le_bytes());
            }
        }
        let src_box = r(&[1, 1], &[4, 4]);
        let mut src = vec![0u8; 32];
        copy_region(&g, &global, &mut src, &src_box, &src_box, 2);
        let dst_box = r(&[2, 0], &[3, 5]);
        let mut dst = vec![0u8; 30];
        let region = r(&[2, 2], &[3, 3]);
        copy_region(&src, &src_box, &mut dst, &dst_box, &region, 2);
        for i in 0..3usize {
            for j in 0..5usize {
                let v = u16::from_le_bytes([dst[(i * 5 + j) * 2], dst[(i * 5 + j) * 2 + 1]]);
                let gi = i as u16 + 2;
                let expect = if (2..5).contains(&j) {
                    gi * 10 + j as u16
                } else {
                    0
                };
                assert_eq!(v, expect, "{i},{j}");
            }
        }
        // scalar
        let s = r(&[], &[]);
        let mut out = [0u8; 4];
        copy_region(&[1, 2, 3, 4], &s, &mut out, &s, &s, 4);
        assert_eq!(out, [1, 2, 3, 4]);
    }
}
