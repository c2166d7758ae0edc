//! Geometry of host <-> device copies, without any device: a strided device view as a few
//! 2-D / 3-D pitched copies, and a box cut into slabs that fit a staging buffer.
//!
//! The host side of every copy is a contiguous C-order block (a staging buffer); the device
//! side is a strided view (a sub-region or column strip of a larger tensor). Trailing axes
//! that are contiguous on the device merge into one run; the next two axes become the rows
//! and slices of one pitched copy; any axes further out are enumerated.

use crate::model::{Region, usize_of};

/// One pitched copy between a contiguous host block and a strided device view:
/// `depth` slices of `height` rows of `width` bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Pitched {
    /// Byte offset of the first row in the host block.
    pub host_offset: usize,
    /// Bytes between rows on the host.
    pub host_pitch: usize,
    /// Bytes between slices on the host.
    pub host_slice_pitch: usize,
    /// Device address of the first row.
    pub device: u64,
    /// Bytes between rows on the device.
    pub device_pitch: u64,
    /// Bytes between slices on the device.
    pub device_slice_pitch: u64,
    /// Bytes per row.
    pub width: usize,
    /// Rows per slice.
    pub height: usize,
    /// Slices.
    pub depth: usize,
}

impl Pitched {
    /// One contiguous run of `len` bytes between host offset `host_offset` and device address
    /// `device`.
    #[must_use]
    pub fn linear(host_offset: usize, device: u64, len: usize) -> Pitched {
        Pitched {
            host_offset,
            host_pitch: len,
            host_slice_pitch: len,
            device,
            device_pitch: len as u64,
            device_slice_pitch: len as u64,
            width: len,
            height: 1,
            depth: 1,
        }
    }

    /// Bytes moved.
    #[must_use]
    pub fn bytes(&self) -> usize {
        self.width * self.height * self.depth
    }

    /// Whether the copy is one contiguous run on both sides.
    #[must_use]
    pub fn is_linear(&self) -> bool {
        (self.height == 1 || self.device_pitch == self.width as u64)
            && (self.depth == 1 || self.device_slice_pitch == (self.width * self.height) as u64)
    }
}

/// Why a view cannot be copied.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ViewError {
    /// Strides and shape disagree in length.
    #[error("view has {strides} strides for a {dims}-dimensional box")]
    Rank {
        /// Number of strides given.
        strides: usize,
        /// Dimensions of the box.
        dims: usize,
    },
    /// Two elements of the view share device memory (a stride of 0, or axes that overlap):
    /// a load would race with itself.
    #[error("view with shape {shape:?} and strides {strides:?} overlaps itself")]
    Overlapping {
        /// The view's shape.
        shape: Vec<u64>,
        /// Its strides, in elements.
        strides: Vec<u64>,
    },
    /// The view's byte extent does not fit the address space.
    #[error("view with shape {shape:?} and strides {strides:?} overflows the address space")]
    Overflow {
        /// The view's shape.
        shape: Vec<u64>,
        /// Its strides, in elements.
        strides: Vec<u64>,
    },
}

/// C-order (contiguous) strides of `shape`, in elements.
#[must_use]
pub fn contiguous_strides(shape: &[u64]) -> Vec<u64> {
    let mut s = vec![1u64; shape.len()];
    for d in (0..shape.len().saturating_sub(1)).rev() {
        s[d] = s[d + 1].saturating_mul(shape[d + 1]);
    }
    s
}

/// Bytes from the view's first element to one past its last (0 for an empty view).
///
/// # Errors
/// [`ViewError`] when lengths disagree or the extent overflows.
pub fn view_extent(shape: &[u64], strides: &[u64], elem: usize) -> Result<u64, ViewError> {
    check_rank(shape, strides)?;
    if shape.contains(&0) {
        return Ok(0);
    }
    let overflow = || ViewError::Overflow {
        shape: shape.to_vec(),
        strides: strides.to_vec(),
    };
    let mut last = 0u64;
    for (n, s) in shape.iter().zip(strides) {
        last = (n - 1)
            .checked_mul(*s)
            .and_then(|x| x.checked_add(last))
            .ok_or_else(overflow)?;
    }
    last.checked_add(1)
        .and_then(|x| x.checked_mul(elem as u64))
        .ok_or_else(overflow)
}

fn check_rank(shape: &[u64], strides: &[u64]) -> Result<(), ViewError> {
    if shape.len() == strides.len() {
        Ok(())
    } else {
        Err(ViewError::Rank {
            strides: strides.len(),
            dims: shape.len(),
        })
    }
}

/// Checks that no two elements of the view share memory (required of load targets): with
/// the axes of extent > 1 sorted by stride, each stride must step over everything the
/// smaller ones span.
///
/// # Errors
/// [`ViewError::Overlapping`] otherwise (for example a stride of 0 over an extent > 1).
pub fn check_disjoint(shape: &[u64], strides: &[u64]) -> Result<(), ViewError> {
    check_rank(shape, strides)?;
    if shape.contains(&0) {
        return Ok(());
    }
    let mut axes: Vec<(u64, u64)> = shape
        .iter()
        .zip(strides)
        .filter(|(n, _)| **n > 1)
        .map(|(n, s)| (*s, *n))
        .collect();
    axes.sort_unstable();
    let mut span = 1u64; // elements covered by the smaller axes, plus one
    for (stride, n) in axes {
        if stride < span {
            return Err(ViewError::Overlapping {
                shape: shape.to_vec(),
                strides: strides.to_vec(),
            });
        }
        span = stride
            .checked_mul(n - 1)
            .and_then(|x| x.checked_add(span))
            .ok_or_else(|| ViewError::Overflow {
                shape: shape.to_vec(),
                strides: strides.to_vec(),
            })?;
    }
    Ok(())
}

/// The pitched copies moving a contiguous C-order host block of `shape` (starting at
/// `host_offset`) to or from the device view at `base` with `strides` (in elements).
/// Empty for an empty box; one linear copy for a contiguous view.
///
/// # Errors
/// [`ViewError`] when strides and shape disagree in length or the view overflows.
pub fn pitched_copies(
    shape: &[u64],
    strides: &[u64],
    elem: usize,
    base: u64,
    host_offset: usize,
) -> Result<Vec<Pitched>, ViewError> {
    view_extent(shape, strides, elem)?;
    if shape.contains(&0) {
        return Ok(Vec::new());
    }
    // Drop axes of extent 1: they move nothing.
    let axes: Vec<(u64, u64)> = shape
        .iter()
        .zip(strides)
        .filter(|(n, _)| **n > 1)
        .map(|(n, s)| (*n, *s))
        .collect();
    let elem64 = elem as u64;
    // Merge the trailing axes that are contiguous on the device into one run.
    let mut run = elem64;
    let mut outer = axes.len();
    while outer > 0 && axes[outer - 1].1 * elem64 == run {
        run *= axes[outer - 1].0;
        outer -= 1;
    }
    // Lossless (64-bit targets only); products below are of the host block's own sizes.
    let width = usize_of(run);
    let rest = &axes[..outer];
    let (rows, slices, enumerated) = match rest {
        [] => ((1, 0), (1, 0), &rest[..0]),
        [r] => ((r.0, r.1), (1, 0), &rest[..0]),
        [.., s, r] => ((r.0, r.1), (s.0, s.1), &rest[..rest.len() - 2]),
    };
    let height = usize_of(rows.0);
    let depth = usize_of(slices.0);
    let host_pitch = width;
    let host_slice_pitch = width * height;
    let block = host_slice_pitch * depth;
    let mut out = Vec::new();
    // Enumerate the outer axes in C order: the host block advances by `block` each time.
    let count: u64 = enumerated.iter().map(|a| a.0).product();
    let mut index = vec![0u64; enumerated.len()];
    for k in 0..count {
        let device_off: u64 = index
            .iter()
            .zip(enumerated)
            .map(|(i, a)| i * a.1 * elem64)
            .sum();
        out.push(Pitched {
            host_offset: host_offset + usize_of(k) * block,
            host_pitch,
            host_slice_pitch,
            device: base + device_off,
            device_pitch: rows.1 * elem64,
            device_slice_pitch: slices.1 * elem64,
            width,
            height,
            depth,
        });
        for d in (0..index.len()).rev() {
            index[d] += 1;
            if index[d] < enumerated[d].0 {
                break;
            }
            index[d] = 0;
        }
    }
    Ok(out)
}

/// Cuts `region` into slabs of at most `max_bytes` each (at least one element each),
/// splitting the outermost axis whose slices are too large, in C order, so that the slabs
/// cover the region exactly once and each is one contiguous block of the region's C order
/// when it spans the inner axes whole.
#[must_use]
pub fn slabs(region: &Region, elem: usize, max_bytes: usize) -> Vec<Region> {
    let total = region
        .shape()
        .iter()
        .try_fold(elem as u64, |a, n| a.checked_mul(*n));
    if region.shape().is_empty() || total.is_some_and(|t| t <= max_bytes as u64) {
        return vec![region.clone()];
    }
    let mut out = Vec::new();
    split_axis(region, 0, elem, max_bytes.max(elem), &mut out);
    out
}

fn split_axis(region: &Region, axis: usize, elem: usize, max: usize, out: &mut Vec<Region>) {
    if axis == region.shape().len() {
        out.push(region.clone());
        return;
    }
    // Bytes of one index along `axis` (the inner axes whole).
    let inner = region.shape()[axis + 1..]
        .iter()
        .try_fold(elem as u64, |a, n| a.checked_mul(*n));
    // A size beyond u64 is beyond any cap too.
    let Some(inner) = inner.filter(|&b| b <= max as u64) else {
        // One index of this axis is already too big: go one axis deeper for each index.
        for i in 0..region.shape()[axis] {
            let r = region.slice_axis(axis, i, 1);
            split_axis(&r, axis + 1, elem, max, out);
        }
        return;
    };
    let per = (max as u64 / inner).max(1);
    let mut start = 0;
    while start < region.shape()[axis] {
        let n = per.min(region.shape()[axis] - start);
        out.push(region.slice_axis(axis, start, n));
        start += n;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// Applies copies from a host block into a simulated device memory (bytes at addresses).
    fn apply(copies: &[Pitched], host: &[u8], device: &mut [u8]) {
        for c in copies {
            for z in 0..c.depth {
                for y in 0..c.height {
                    let h = c.host_offset + z * c.host_slice_pitch + y * c.host_pitch;
                    let d = usize::try_from(
                        c.device + z as u64 * c.device_slice_pitch + y as u64 * c.device_pitch,
                    )
                    .unwrap();
                    device[d..d + c.width].copy_from_slice(&host[h..h + c.width]);
                }
            }
        }
    }

    /// The reference: element by element, host C order to device strides.
    fn reference(
        shape: &[u64],
        strides: &[u64],
        elem: usize,
        base: u64,
        host: &[u8],
        device: &mut [u8],
    ) {
        let n: u64 = shape.iter().product();
        let mut idx = vec![0u64; shape.len()];
        for k in 0..n {
            let off: u64 = idx.iter().zip(strides).map(|(i, s)| i * s).sum();
            let d = usize::try_from(base + off * elem as u64).unwrap();
            let h = usize::try_from(k).unwrap() * elem;
            device[d..d + elem].copy_from_slice(&host[h..h + elem]);
            for a in (0..idx.len()).rev() {
                idx[a] += 1;
                if idx[a] < shape[a] {
                    break;
                }
                idx[a] = 0;
            }
        }
    }

    /// A view: a box inside a larger C-order tensor, with axes maybe permuted (a transpose).
    fn view() -> impl Strategy<Value = (Vec<u64>, Vec<u64>, Vec<u64>, usize)> {
        (1usize..=4)
            .prop_flat_map(|dims| {
                (
                    proptest::collection::vec(1u64..5, dims),
                    proptest::collection::vec(0u64..3, dims),
                    Just((0..dims).collect::<Vec<_>>()).prop_shuffle(),
                    prop_oneof![Just(1usize), Just(2), Just(4)],
                )
            })
            .prop_map(|(shape, pad, perm, elem)| {
                // The enclosing tensor is `shape + pad`, C order, then axes permuted.
                let full: Vec<u64> = shape.iter().zip(&pad).map(|(s, p)| s + p).collect();
                let cs = contiguous_strides(&full);
                let strides: Vec<u64> = perm.iter().map(|&p| cs[p]).collect();
                let vshape: Vec<u64> = perm.iter().map(|&p| shape[p]).collect();
                (vshape, strides, full, elem)
            })
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(256))]
        #[test]
        fn pitched_copies_equal_elementwise((shape, strides, full, elem) in view(), base in 0u64..8) {
            let n: u64 = shape.iter().product();
            let host: Vec<u8> = (0..n as usize * elem).map(|i| (i % 251) as u8).collect();
            let size = usize::try_from((full.iter().product::<u64>() + base) * elem as u64).unwrap();
            let mut want = vec![0u8; size];
            let mut got = vec![0u8; size];
            reference(&shape, &strides, elem, base * elem as u64, &host, &mut want);
            let copies = pitched_copies(&shape, &strides, elem, base * elem as u64, 0).unwrap();
            apply(&copies, &host, &mut got);
            prop_assert_eq!(copies.iter().map(Pitched::bytes).sum::<usize>(), host.len());
            prop_assert_eq!(want, got);
            prop_assert!(check_disjoint(&shape, &strides).is_ok());
        }

        #[test]
        fn slabs_cover_once_within_the_cap(shape in proptest::collection::vec(1u64..7, 0..4),
                                           off in proptest::collection::vec(0u64..3, 4),
                                           elem in prop_oneof![Just(1usize), Just(2), Just(8)],
                                           max in 1usize..300) {
            let region = Region::new(off[..shape.len()].to_vec(), shape.clone()).unwrap();
            let parts = slabs(&region, elem, max);
            let mut seen = std::collections::HashSet::new();
            let mut count = 0u64;
            for p in &parts {
                let bytes = p.num_elements().unwrap() * elem as u64;
                prop_assert!(bytes <= max.max(elem) as u64 || region.shape().is_empty());
                let n = p.num_elements().unwrap();
                count += n;
                // Enumerate the slab's elements.
                let mut idx = p.offset().to_vec();
                for _ in 0..n {
                    prop_assert!(seen.insert(idx.clone()));
                    for a in (0..idx.len()).rev() {
                        idx[a] += 1;
                        if idx[a] < p.offset()[a] + p.shape()[a] { break; }
                        idx[a] = p.offset()[a];
                    }
                }
            }
            prop_assert_eq!(count, region.num_elements().unwrap());
        }
    }

    #[test]
    fn contiguous_view_is_one_linear_copy() {
        let c = pitched_copies(&[4, 8], &[8, 1], 2, 1000, 16).unwrap();
        assert_eq!(c.len(), 1);
        assert!(c[0].is_linear());
        assert_eq!((c[0].width, c[0].device, c[0].host_offset), (64, 1000, 16));
    }

    #[test]
    fn column_strip_is_one_2d_copy() {
        // Columns 2..5 of a 6 x 10 matrix of f32.
        let c = pitched_copies(&[6, 3], &[10, 1], 4, 8, 0).unwrap();
        assert_eq!(c.len(), 1);
        assert_eq!((c[0].width, c[0].height, c[0].depth), (12, 6, 1));
        assert_eq!((c[0].device_pitch, c[0].host_pitch), (40, 12));
    }

    #[test]
    fn overlapping_views_are_refused() {
        assert!(matches!(
            check_disjoint(&[3, 4], &[0, 1]),
            Err(ViewError::Overlapping { .. })
        ));
        assert!(matches!(
            check_disjoint(&[3, 4], &[2, 1]),
            Err(ViewError::Overlapping { .. })
        ));
        assert!(check_disjoint(&[3, 4], &[4, 1]).is_ok());
        assert!(check_disjoint(&[1, 4], &[0, 1]).is_ok());
        assert!(matches!(
            pitched_copies(&[3], &[1, 1], 4, 0, 0),
            Err(ViewError::Rank { .. })
        ));
    }
}
