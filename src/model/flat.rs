//! Flat pieces: a contiguous range `[start, end)` of a tensor's C-order (row-major)
//! flattening, as Megatron's distributed optimizer (`flattened_range`) and FSDP1 flat
//! parameters hold them, and their exact decomposition into boxes.
//!
//! A flat range of a C-order array is the union of at most `2 * ndim - 1` boxes, each of them
//! contiguous in the flattening: going up, a partial run of the last axis, then blocks of
//! growing rank up to the first aligned position; then one block of whole slabs along the
//! outermost axis it needs; going down, blocks of shrinking rank and a partial run at the end.
//! Every box `[1, .., 1, c, S_{k+1}, .., S_{n-1}]` lists its elements in the same order as the
//! flattening, so its data is one contiguous slice of the flat buffer.

use std::ops::Range;

use super::region::{Region, RegionError, num_elements};

/// One box of a flat range's decomposition.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct FlatBox {
    /// The box, in the tensor's index space.
    pub region: Region,
    /// Where the box's first element sits in the flat range, in elements from its start. The
    /// box's elements are the next `region.num_elements()` elements of the range.
    pub start: u64,
}

/// C-order strides of `shape`, in elements (checked: the product fits `u64`).
fn strides(shape: &[u64]) -> Result<Vec<u64>, RegionError> {
    num_elements(shape)?;
    let mut out = vec![1u64; shape.len()];
    for d in (0..shape.len().saturating_sub(1)).rev() {
        // Cannot overflow: bounded by the element count checked above (or a zero extent
        // follows, and then every product is 0 or a factor of a fitting product).
        out[d] = out[d + 1].saturating_mul(shape[d + 1]);
    }
    Ok(out)
}

/// Checks that `range` is a valid flat range of a tensor of `global_shape`: `start <= end <=`
/// the element count.
///
/// # Errors
/// [`RegionError::Overflow`] when the element count overflows, and
/// [`RegionError::FlatOutOfBounds`] for a reversed or out-of-bounds range.
pub fn check_flat_range(global_shape: &[u64], range: &Range<u64>) -> Result<u64, RegionError> {
    let len = num_elements(global_shape)?;
    if range.start > range.end || range.end > len {
        return Err(RegionError::FlatOutOfBounds {
            start: range.start,
            end: range.end,
            len,
        });
    }
    Ok(len)
}

/// The boxes whose union is exactly the flat range `range` of a tensor of `global_shape`, in
/// flattening order, none empty (an empty range gives none), at most `2 * ndim - 1` of them
/// (one for a scalar).
///
/// # Errors
/// As [`check_flat_range`]; never panics.
pub fn flat_boxes(global_shape: &[u64], range: Range<u64>) -> Result<Vec<FlatBox>, RegionError> {
    check_flat_range(global_shape, &range)?;
    let n = global_shape.len();
    let strides = strides(global_shape)?;
    let mut out = Vec::new();
    let mut pos = range.start;
    while pos < range.end {
        let left = range.end - pos;
        // The multi-index of `pos` (extents are all non-zero here: the range is non-empty).
        let mut idx = vec![0u64; n];
        let mut rest = pos;
        for d in 0..n {
            idx[d] = rest / strides[d];
            rest %= strides[d];
        }
        // The outermost axis `k` such that `pos` is aligned to its stride (every index after
        // it is 0) and one step along it still fits in the range. The last axis (stride 1)
        // always qualifies.
        let mut k = n.saturating_sub(1);
        for d in (0..n).rev() {
            if d + 1 < n && idx[d + 1] != 0 {
                break;
            }
            if strides[d] <= left {
                k = d;
            }
        }
        let mut shape = vec![1u64; n];
        let step = if n == 0 {
            1
        } else {
            let c = (global_shape[k] - idx[k]).min(left / strides[k]);
            shape[k] = c;
            shape[k + 1..].copy_from_slice(&global_shape[k + 1..]);
            c * strides[k]
        };
        out.push(FlatBox {
            // Inside the tensor: shape[k] <= global_shape[k] - idx[k], inner axes whole.
            region: Region::from_parts_unchecked(idx, shape),
            start: pos - range.start,
        });
        pos += step;
    }
    Ok(out)
}

/// The flat range `[start, end)` a box covers when it is contiguous in the C-order flattening
/// of a tensor of `global_shape` (after its first extent above 1, it spans whole dimensions),
/// or `None` when it is not (or is empty). The box must lie inside the tensor.
#[must_use]
pub fn box_flat_range(global_shape: &[u64], region: &Region) -> Option<Range<u64>> {
    if region.is_empty() || !super::copy::is_contiguous(region.shape(), global_shape) {
        return None;
    }
    let strides = strides(global_shape).ok()?;
    let start = region
        .offset()
        .iter()
        .zip(&strides)
        .try_fold(0u64, |acc, (o, s)| acc.checked_add(o.checked_mul(*s)?))?;
    let end = start.checked_add(region.num_elements().ok()?)?;
    Some(start..end)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn r(o: &[u64], s: &[u64]) -> Region {
        Region::new(o.to_vec(), s.to_vec()).unwrap()
    }

    #[test]
    fn decomposes_up_and_down() {
        // [3, 4, 5]: 60 elements; range 7..53.
        let b = flat_boxes(&[3, 4, 5], 7..53).unwrap();
        let regions: Vec<Region> = b.iter().map(|x| x.region.clone()).collect();
        assert_eq!(
            regions,
            vec![
                r(&[0, 1, 2], &[1, 1, 3]), // 7..10: rest of a row
                r(&[0, 2, 0], &[1, 2, 5]), // 10..20: rest of the first slab
                r(&[1, 0, 0], &[1, 4, 5]), // 20..40: one whole slab
                r(&[2, 0, 0], &[1, 2, 5]), // 40..50: two rows
                r(&[2, 2, 0], &[1, 1, 3]), // 50..53: a partial row
            ]
        );
        let starts: Vec<u64> = b.iter().map(|x| x.start).collect();
        assert_eq!(starts, vec![0, 3, 13, 33, 43]);
        for x in &b {
            let fr = box_flat_range(&[3, 4, 5], &x.region).unwrap();
            assert_eq!(fr.start, 7 + x.start);
        }
        // aligned ranges give one box
        assert_eq!(
            flat_boxes(&[4, 6], 6..18).unwrap(),
            vec![FlatBox {
                region: r(&[1, 0], &[2, 6]),
                start: 0
            }]
        );
        assert_eq!(flat_boxes(&[4, 6], 0..24).unwrap().len(), 1);
        assert_eq!(flat_boxes(&[4, 6], 5..5).unwrap(), vec![]);
        assert_eq!(flat_boxes(&[], 0..1).unwrap()[0].region, r(&[], &[]));
        assert_eq!(flat_boxes(&[0, 3], 0..0).unwrap(), vec![]);
        assert_eq!(flat_boxes(&[7], 2..5).unwrap()[0].region, r(&[2], &[3]));
    }

    #[test]
    fn rejects_bad_ranges() {
        #[allow(clippy::reversed_empty_ranges)]
        let reversed = 5..3;
        assert!(matches!(
            flat_boxes(&[4, 6], reversed),
            Err(RegionError::FlatOutOfBounds { .. })
        ));
        assert!(matches!(
            flat_boxes(&[4, 6], 0..25),
            Err(RegionError::FlatOutOfBounds { len: 24, .. })
        ));
        assert!(matches!(
            flat_boxes(&[u64::MAX, 2], 0..1),
            Err(RegionError::Overflow { .. })
        ));
        assert!(flat_boxes(&[], 0..2).is_err());
        // Huge but valid: no overflow in the arithmetic.
        let big = [1u64 << 20, 1 << 20, 1 << 23];
        let b = flat_boxes(&big, 3..(1u64 << 63) - 5).unwrap();
        assert!(b.len() <= 5);
        assert_eq!(box_flat_range(&[4, 6], &r(&[1, 2], &[2, 2])), None);
        assert_eq!(box_flat_range(&[4, 6], &r(&[1, 2], &[1, 2])), Some(8..10));
    }
}
