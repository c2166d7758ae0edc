//! Boxes in a tensor's index space, with checked arithmetic.

use std::fmt;

use serde::{Deserialize, Serialize};

/// The largest number of dimensions a tensor may have.
pub const MAX_DIMS: usize = 32;

/// Why a region is invalid.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum RegionError {
    /// Offset and shape have different lengths, or the region's rank differs from the tensor's.
    #[error("dimension mismatch: {what} has {got} dimensions, expected {expected}")]
    RankMismatch {
        /// What was being compared.
        what: &'static str,
        /// Dimensions found.
        got: usize,
        /// Dimensions expected.
        expected: usize,
    },
    /// More than [`MAX_DIMS`] dimensions.
    #[error("{dims} dimensions exceed the limit of {MAX_DIMS}")]
    TooManyDims {
        /// Dimensions found.
        dims: usize,
    },
    /// The region does not fit in the global shape.
    #[error("region {region} is out of bounds of global shape {shape:?}")]
    OutOfBounds {
        /// The region.
        region: Region,
        /// The global shape.
        shape: Vec<u64>,
    },
    /// A flat range is reversed or reaches past the tensor's element count.
    #[error("flat range {start}..{end} is not within the tensor's {len} elements")]
    FlatOutOfBounds {
        /// Start of the range (elements, C order).
        start: u64,
        /// End of the range (exclusive).
        end: u64,
        /// Elements in the tensor.
        len: u64,
    },
    /// A size computation overflowed.
    #[error("size of {what} overflows: shape {shape:?}")]
    Overflow {
        /// What was being computed.
        what: &'static str,
        /// The shape involved.
        shape: Vec<u64>,
    },
}

/// A box: an offset and a shape, one entry per dimension. A zero-dimensional region (both
/// empty) is the single element of a scalar.
///
/// The fields are private: every region is built by a checked constructor ([`Region::new`],
/// [`Region::within`], [`Region::whole`]), by [`Region::full`] (offset zero, so its end cannot
/// overflow), or inside the crate from regions already valid (intersections, relative
/// offsets). Deserializing goes through [`Region::new`], so a region read from a file or a
/// peer holds the same invariants: offset and shape of one length, at most [`MAX_DIMS`]
/// dimensions, and `offset + shape` fitting `u64` in every dimension.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(try_from = "RegionParts")]
pub struct Region {
    /// Start index in every dimension.
    offset: Vec<u64>,
    /// Extent in every dimension.
    shape: Vec<u64>,
}

/// The unchecked wire form of a [`Region`]; deserializing converts it through [`Region::new`].
#[derive(Deserialize)]
struct RegionParts {
    offset: Vec<u64>,
    shape: Vec<u64>,
}

impl TryFrom<RegionParts> for Region {
    type Error = RegionError;

    fn try_from(p: RegionParts) -> Result<Self, RegionError> {
        Region::new(p.offset, p.shape)
    }
}

impl fmt::Display for Region {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("[")?;
        for (i, (o, s)) in self.offset.iter().zip(&self.shape).enumerate() {
            if i > 0 {
                f.write_str(", ")?;
            }
            write!(f, "{o}..{}", o.saturating_add(*s))?;
        }
        f.write_str("]")
    }
}

/// Number of elements of a shape, checked.
///
/// # Errors
/// [`RegionError::Overflow`] if the product overflows `u64`.
pub fn num_elements(shape: &[u64]) -> Result<u64, RegionError> {
    shape
        .iter()
        .try_fold(1u64, |acc, &d| acc.checked_mul(d))
        .ok_or_else(|| RegionError::Overflow {
            what: "element count",
            shape: shape.to_vec(),
        })
}

/// Number of bytes of a shape of elements of `elem_size` bytes, checked and fitting `usize`.
///
/// # Errors
/// [`RegionError::Overflow`] if the size does not fit in `usize`.
pub fn num_bytes(shape: &[u64], elem_size: usize) -> Result<usize, RegionError> {
    let n = num_elements(shape)?;
    let overflow = || RegionError::Overflow {
        what: "byte size",
        shape: shape.to_vec(),
    };
    let n = usize::try_from(n).map_err(|_| overflow())?;
    n.checked_mul(elem_size).ok_or_else(overflow)
}

impl Region {
    /// A region; checks that offset and shape have the same rank and that the end fits `u64`.
    ///
    /// # Errors
    /// [`RegionError`] on rank mismatch, too many dimensions or overflow.
    pub fn new(offset: Vec<u64>, shape: Vec<u64>) -> Result<Self, RegionError> {
        if offset.len() != shape.len() {
            return Err(RegionError::RankMismatch {
                what: "offset",
                got: offset.len(),
                expected: shape.len(),
            });
        }
        if shape.len() > MAX_DIMS {
            return Err(RegionError::TooManyDims { dims: shape.len() });
        }
        for (o, s) in offset.iter().zip(&shape) {
            if o.checked_add(*s).is_none() {
                return Err(RegionError::Overflow {
                    what: "region end",
                    shape: shape.clone(),
                });
            }
        }
        num_elements(&shape)?;
        Ok(Region { offset, shape })
    }

    /// A region of `offset` and `shape` that must lie inside a tensor of `global_shape`:
    /// [`Region::new`] followed by [`Region::check_within`].
    ///
    /// # Errors
    /// [`RegionError`] as [`Region::new`], or when the region does not fit `global_shape`.
    pub fn within(
        offset: Vec<u64>,
        shape: Vec<u64>,
        global_shape: &[u64],
    ) -> Result<Self, RegionError> {
        let r = Region::new(offset, shape)?;
        r.check_within(global_shape)?;
        Ok(r)
    }

    /// The whole of a tensor of `shape`, checked as [`Region::new`] checks (at most
    /// [`MAX_DIMS`] dimensions, element count fitting `u64`).
    ///
    /// # Errors
    /// [`RegionError`] on too many dimensions or overflow.
    pub fn whole(shape: &[u64]) -> Result<Self, RegionError> {
        Region::new(vec![0; shape.len()], shape.to_vec())
    }

    /// The whole of a tensor of `shape`. Infallible: the offset is zero, so no end overflows;
    /// the rank and element count are those of `shape`, which callers validate with the
    /// tensor (use [`Region::whole`] for a shape not yet checked).
    #[must_use]
    pub fn full(shape: &[u64]) -> Self {
        Region {
            offset: vec![0; shape.len()],
            shape: shape.to_vec(),
        }
    }

    /// A region from parts the caller has already validated (crate-private). Every call site
    /// states why `offset` and `shape` have one length and `offset + shape` fits `u64`
    /// (checked again in debug builds).
    #[must_use]
    pub(crate) fn from_parts_unchecked(offset: Vec<u64>, shape: Vec<u64>) -> Self {
        debug_assert_eq!(offset.len(), shape.len());
        debug_assert!(
            offset
                .iter()
                .zip(&shape)
                .all(|(o, s)| o.checked_add(*s).is_some())
        );
        Region { offset, shape }
    }

    /// This region with dimension `d` replaced by `start..start + len` (absolute indices).
    ///
    /// # Errors
    /// [`RegionError::RankMismatch`] when `d` is not a dimension of the region,
    /// [`RegionError::Overflow`] when `start + len` overflows `u64`.
    pub fn with_axis(&self, d: usize, start: u64, len: u64) -> Result<Region, RegionError> {
        if d >= self.ndim() {
            return Err(RegionError::RankMismatch {
                what: "axis",
                got: d + 1,
                expected: self.ndim(),
            });
        }
        let mut r = self.clone();
        r.offset[d] = start;
        r.shape[d] = len;
        if start.checked_add(len).is_none() {
            return Err(RegionError::Overflow {
                what: "region end",
                shape: r.shape,
            });
        }
        Ok(r)
    }

    /// The part of this region from `start` to `start + len` along dimension `d`, counted
    /// from the region's offset (crate-private). The caller keeps `start + len` within the
    /// region's extent along `d`, so the part is a sub-box of a valid region and valid too.
    #[must_use]
    pub(crate) fn slice_axis(&self, d: usize, start: u64, len: u64) -> Region {
        debug_assert!(start.checked_add(len).is_some_and(|e| e <= self.shape[d]));
        let mut r = self.clone();
        r.offset[d] += start;
        r.shape[d] = len;
        r
    }

    /// Start index in every dimension.
    #[must_use]
    pub fn offset(&self) -> &[u64] {
        &self.offset
    }

    /// Extent in every dimension.
    #[must_use]
    pub fn shape(&self) -> &[u64] {
        &self.shape
    }

    /// The offset and the shape, by value.
    #[must_use]
    pub fn into_parts(self) -> (Vec<u64>, Vec<u64>) {
        (self.offset, self.shape)
    }

    /// Number of dimensions.
    #[must_use]
    pub fn ndim(&self) -> usize {
        self.shape.len()
    }

    /// Number of elements (the product of the shape).
    ///
    /// # Errors
    /// [`RegionError::Overflow`] if it overflows `u64`.
    pub fn num_elements(&self) -> Result<u64, RegionError> {
        num_elements(&self.shape)
    }

    /// True when the region holds no element.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.shape.contains(&0)
    }

    /// Exclusive end in dimension `d` (cannot overflow: checked at construction).
    #[must_use]
    pub fn end(&self, d: usize) -> u64 {
        self.offset[d].saturating_add(self.shape[d])
    }

    /// Checks that the region lies inside a tensor of `global_shape`.
    ///
    /// # Errors
    /// [`RegionError`] on rank mismatch or when the region sticks out.
    pub fn check_within(&self, global_shape: &[u64]) -> Result<(), RegionError> {
        if self.ndim() != global_shape.len() {
            return Err(RegionError::RankMismatch {
                what: "region",
                got: self.ndim(),
                expected: global_shape.len(),
            });
        }
        for d in 0..self.ndim() {
            if self.end(d) > global_shape[d] {
                return Err(RegionError::OutOfBounds {
                    region: self.clone(),
                    shape: global_shape.to_vec(),
                });
            }
        }
        Ok(())
    }

    /// The intersection with `other`, or `None` when it holds no element. Zero-dimensional
    /// regions always intersect.
    #[must_use]
    pub fn intersect(&self, other: &Region) -> Option<Region> {
        debug_assert_eq!(self.ndim(), other.ndim());
        // Disjoint boxes allocate nothing (planning tests many pairs that do not meet).
        if (0..self.ndim())
            .any(|d| self.end(d).min(other.end(d)) <= self.offset[d].max(other.offset[d]))
        {
            return None;
        }
        let offset: Vec<u64> = (0..self.ndim())
            .map(|d| self.offset[d].max(other.offset[d]))
            .collect();
        let shape = (0..self.ndim())
            .map(|d| self.end(d).min(other.end(d)) - offset[d])
            .collect();
        Some(Region { offset, shape })
    }

    /// True when `other` lies entirely inside `self`.
    #[must_use]
    pub fn contains(&self, other: &Region) -> bool {
        (0..self.ndim()).all(|d| other.offset[d] >= self.offset[d] && other.end(d) <= self.end(d))
    }

    /// This region expressed relative to `origin` (which must not exceed the offset).
    #[must_use]
    pub fn relative_to(&self, origin: &[u64]) -> Region {
        Region {
            offset: self.offset.iter().zip(origin).map(|(o, r)| o - r).collect(),
            shape: self.shape.clone(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn r(o: &[u64], s: &[u64]) -> Region {
        Region::new(o.to_vec(), s.to_vec()).unwrap()
    }

    #[test]
    fn checked_construction() {
        assert!(Region::new(vec![0], vec![1, 2]).is_err());
        assert!(Region::new(vec![u64::MAX], vec![2]).is_err());
        assert!(Region::new(vec![0, 0], vec![u64::MAX, 3]).is_err());
        assert!(num_bytes(&[u64::MAX / 2], 4).is_err());
        assert_eq!(num_bytes(&[3, 5], 2).unwrap(), 30);
        assert_eq!(num_elements(&[]).unwrap(), 1);
    }

    #[test]
    fn intersect_and_contains() {
        let a = r(&[0, 0], &[4, 4]);
        let b = r(&[2, 3], &[4, 4]);
        assert_eq!(a.intersect(&b), Some(r(&[2, 3], &[2, 1])));
        assert_eq!(a.intersect(&r(&[4, 0], &[1, 1])), None);
        assert!(a.contains(&r(&[1, 1], &[3, 3])));
        assert!(!a.contains(&b));
        let scalar = r(&[], &[]);
        assert_eq!(scalar.intersect(&scalar), Some(scalar.clone()));
        assert!(r(&[0], &[0]).is_empty());
    }

    #[test]
    fn deserialize_goes_through_the_checked_constructor() {
        let ok: Region = serde_json::from_str(r#"{"offset":[1,2],"shape":[3,4]}"#).unwrap();
        assert_eq!(ok, r(&[1, 2], &[3, 4]));
        assert_eq!(
            serde_json::to_string(&ok).unwrap(),
            r#"{"offset":[1,2],"shape":[3,4]}"#
        );
        for bad in [
            r#"{"offset":[1],"shape":[3,4]}"#,
            r#"{"offset":[18446744073709551615],"shape":[2]}"#,
            r#"{"offset":[0,0],"shape":[18446744073709551615,3]}"#,
        ] {
            let err = serde_json::from_str::<Region>(bad).unwrap_err().to_string();
            assert!(
                err.contains("dimension") || err.contains("overflows"),
                "{bad}: {err}"
            );
        }
        let many = format!(
            r#"{{"offset":{:?},"shape":{:?}}}"#,
            vec![0u64; MAX_DIMS + 1],
            vec![1u64; MAX_DIMS + 1]
        );
        assert!(serde_json::from_str::<Region>(&many).is_err());
    }

    #[test]
    fn checked_constructors() {
        assert_eq!(Region::whole(&[2, 3]).unwrap(), Region::full(&[2, 3]));
        assert!(Region::whole(&[u64::MAX, 2]).is_err());
        assert!(Region::whole(&vec![1; MAX_DIMS + 1]).is_err());
        assert_eq!(
            Region::within(vec![1], vec![2], &[3]).unwrap(),
            r(&[1], &[2])
        );
        assert!(matches!(
            Region::within(vec![2], vec![2], &[3]),
            Err(RegionError::OutOfBounds { .. })
        ));
        assert!(Region::within(vec![0], vec![1, 1], &[3]).is_err());
        let a = r(&[1, 2], &[3, 4]);
        assert_eq!(a.with_axis(1, 5, 1).unwrap(), r(&[1, 5], &[3, 1]));
        assert!(a.with_axis(2, 0, 1).is_err());
        assert!(a.with_axis(0, u64::MAX, 1).is_err());
        assert_eq!(a.slice_axis(0, 1, 2), r(&[2, 2], &[2, 4]));
        assert_eq!(a.offset(), &[1, 2]);
        assert_eq!(a.shape(), &[3, 4]);
        assert_eq!(a.into_parts(), (vec![1, 2], vec![3, 4]));
    }

    #[test]
    fn bounds() {
        r(&[2], &[3]).check_within(&[5]).unwrap();
        assert!(matches!(
            r(&[3], &[3]).check_within(&[5]),
            Err(RegionError::OutOfBounds { .. })
        ));
        assert!(matches!(
            r(&[0], &[1]).check_within(&[5, 1]),
            Err(RegionError::RankMismatch { .. })
        ));
        assert_eq!(r(&[1, 2], &[3, 4]).to_string(), "[1..4, 2..6]");
    }
}
