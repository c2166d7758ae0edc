//! Boxes of tensors and copying between them (C-order buffers). Pure.

use std::fmt;

/// A box: offset and extent per axis.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Bx {
    /// Offset.
    pub off: Vec<u64>,
    /// Extent.
    pub len: Vec<u64>,
}

impl fmt::Display for Bx {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let parts: Vec<String> = self
            .off
            .iter()
            .zip(&self.len)
            .map(|(o, l)| format!("{o}:{}", o + l))
            .collect();
        write!(f, "[{}]", parts.join(", "))
    }
}

impl Bx {
    /// The whole of `shape`.
    #[must_use]
    pub fn full(shape: &[u64]) -> Bx {
        Bx {
            off: vec![0; shape.len()],
            len: shape.to_vec(),
        }
    }

    /// Elements.
    #[must_use]
    pub fn volume(&self) -> u64 {
        self.len.iter().product()
    }

    /// `idx` prepended as axes of extent 1.
    #[must_use]
    pub fn prepend(&self, idx: &[u64]) -> Bx {
        let mut off = idx.to_vec();
        off.extend(&self.off);
        let mut len = vec![1; idx.len()];
        len.extend(&self.len);
        Bx { off, len }
    }

    /// The intersection, if not empty.
    #[must_use]
    pub fn intersect(&self, o: &Bx) -> Option<Bx> {
        let mut off = Vec::with_capacity(self.off.len());
        let mut len = Vec::with_capacity(self.off.len());
        for d in 0..self.off.len() {
            let a = self.off[d].max(o.off[d]);
            let b = (self.off[d] + self.len[d]).min(o.off[d] + o.len[d]);
            if b <= a {
                return None;
            }
            off.push(a);
            len.push(b - a);
        }
        Some(Bx { off, len })
    }

    /// Whether `o` lies inside.
    #[must_use]
    pub fn contains(&self, o: &Bx) -> bool {
        (0..self.off.len())
            .all(|d| o.off[d] >= self.off[d] && o.off[d] + o.len[d] <= self.off[d] + self.len[d])
    }

    /// `self` relative to `origin`'s offset.
    #[must_use]
    pub fn relative_to(&self, origin: &Bx) -> Bx {
        Bx {
            off: self
                .off
                .iter()
                .zip(&origin.off)
                .map(|(a, b)| a - b)
                .collect(),
            len: self.len.clone(),
        }
    }

    /// The two last axes swapped.
    #[must_use]
    pub fn transposed(&self) -> Bx {
        let mut b = self.clone();
        let n = b.off.len();
        if n >= 2 {
            b.off.swap(n - 2, n - 1);
            b.len.swap(n - 2, n - 1);
        }
        b
    }

    /// The smallest box holding both.
    #[must_use]
    pub fn hull(&self, o: &Bx) -> Bx {
        let mut off = Vec::new();
        let mut len = Vec::new();
        for d in 0..self.off.len() {
            let a = self.off[d].min(o.off[d]);
            let b = (self.off[d] + self.len[d]).max(o.off[d] + o.len[d]);
            off.push(a);
            len.push(b - a);
        }
        Bx { off, len }
    }

    /// Whether the union of the two boxes is a box (equal off one axis, touching or
    /// overlapping on it).
    #[must_use]
    pub fn mergeable(&self, o: &Bx) -> bool {
        let mut diff = None;
        for d in 0..self.off.len() {
            if self.off[d] != o.off[d] || self.len[d] != o.len[d] {
                if diff.is_some() {
                    return false;
                }
                diff = Some(d);
            }
        }
        match diff {
            None => true,
            Some(d) => self.off[d] <= o.off[d] + o.len[d] && o.off[d] <= self.off[d] + self.len[d],
        }
    }
}

/// Merges boxes whose unions are boxes, until none merge (order-independent result for
/// the boxes conversion plans produce).
#[must_use]
pub fn merge_boxes(mut boxes: Vec<Bx>) -> Vec<Bx> {
    boxes.sort();
    boxes.dedup();
    loop {
        let mut merged = false;
        let mut out: Vec<Bx> = Vec::with_capacity(boxes.len());
        for b in boxes {
            if let Some(last) = out.iter_mut().rev().find(|x| x.mergeable(&b)) {
                *last = last.hull(&b);
                merged = true;
            } else {
                out.push(b);
            }
        }
        boxes = out;
        if !merged {
            return boxes;
        }
        boxes.sort();
    }
}

fn strides(shape: &[u64]) -> Vec<u64> {
    let mut s = vec![1u64; shape.len()];
    for d in (0..shape.len().saturating_sub(1)).rev() {
        s[d] = s[d + 1] * shape[d + 1];
    }
    s
}

/// Whether `b` is one contiguous run of `shape`'s C-order layout.
#[must_use]
pub fn is_contiguous(b: &Bx, shape: &[u64]) -> bool {
    // Past the first axis with extent > 1, every axis is whole.
    let first = b.len.iter().position(|&l| l > 1);
    match first {
        None => true,
        Some(k) => (k + 1..shape.len()).all(|d| b.off[d] == 0 && b.len[d] == shape[d]),
    }
}

/// Byte offset of the box's first element in `shape`.
#[must_use]
pub fn byte_offset(b: &Bx, shape: &[u64], esize: u64) -> u64 {
    let st = strides(shape);
    b.off.iter().zip(&st).map(|(o, s)| o * s).sum::<u64>() * esize
}

/// Copies box `sb` of `src` (a tensor of `sshape`) into box `db` of `dst` (of `dshape`).
/// The boxes have equal extents, or, with `transpose`, `db` is `sb` with its last two axes
/// swapped. `esize` is the element size in bytes.
///
/// # Panics
/// When a box does not fit its buffer (callers plan boxes inside their tensors).
#[allow(clippy::too_many_arguments)]
pub fn copy_box(
    src: &[u8],
    sshape: &[u64],
    sb: &Bx,
    dst: &mut [u8],
    dshape: &[u64],
    db: &Bx,
    esize: usize,
    transpose: bool,
) {
    let e = esize as u64;
    let ss = strides(sshape);
    let ds = strides(dshape);
    let n = sb.len.len();
    if n == 0 {
        dst[..esize].copy_from_slice(&src[..esize]);
        return;
    }
    if !transpose {
        let run = sb.len[n - 1];
        let rb = (run * e) as usize;
        let mut idx = vec![0u64; n - 1];
        loop {
            let so: u64 = (0..n - 1)
                .map(|d| (sb.off[d] + idx[d]) * ss[d])
                .sum::<u64>()
                + sb.off[n - 1];
            let dof: u64 = (0..n - 1)
                .map(|d| (db.off[d] + idx[d]) * ds[d])
                .sum::<u64>()
                + db.off[n - 1];
            let (so, dof) = ((so * e) as usize, (dof * e) as usize);
            dst[dof..dof + rb].copy_from_slice(&src[so..so + rb]);
            // Next index (C order over the leading axes).
            let mut d = n - 1;
            loop {
                if d == 0 {
                    return;
                }
                d -= 1;
                idx[d] += 1;
                if idx[d] < sb.len[d] {
                    break;
                }
                idx[d] = 0;
            }
        }
    }
    // Transposed: the last two axes swap; element by element.
    assert!(n >= 2, "transpose needs two axes");
    let mut idx = vec![0u64; n];
    let total: u64 = sb.volume();
    for _ in 0..total {
        let so: u64 = (0..n).map(|d| (sb.off[d] + idx[d]) * ss[d]).sum();
        let mut didx = idx.clone();
        didx.swap(n - 2, n - 1);
        let dof: u64 = (0..n).map(|d| (db.off[d] + didx[d]) * ds[d]).sum();
        let (so, dof) = ((so * e) as usize, (dof * e) as usize);
        dst[dof..dof + esize].copy_from_slice(&src[so..so + esize]);
        let mut d = n;
        while d > 0 {
            d -= 1;
            idx[d] += 1;
            if idx[d] < sb.len[d] {
                break;
            }
            idx[d] = 0;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn merge_and_copy() {
        let a = Bx {
            off: vec![0, 0],
            len: vec![2, 4],
        };
        let b = Bx {
            off: vec![2, 0],
            len: vec![3, 4],
        };
        let c = Bx {
            off: vec![6, 0],
            len: vec![1, 4],
        };
        let m = merge_boxes(vec![c.clone(), b, a]);
        assert_eq!(
            m,
            vec![
                Bx {
                    off: vec![0, 0],
                    len: vec![5, 4]
                },
                c
            ]
        );
        // copy rows 1..3 of a 4x3 into rows 0..2 of a 2x3
        let src: Vec<u8> = (0..12).collect();
        let mut dst = vec![0u8; 6];
        copy_box(
            &src,
            &[4, 3],
            &Bx {
                off: vec![1, 0],
                len: vec![2, 3],
            },
            &mut dst,
            &[2, 3],
            &Bx::full(&[2, 3]),
            1,
            false,
        );
        assert_eq!(dst, vec![3, 4, 5, 6, 7, 8]);
        // transpose a 2x3 into a 3x2
        let src: Vec<u8> = (0..6).collect();
        let mut dst = vec![0u8; 6];
        copy_box(
            &src,
            &[2, 3],
            &Bx::full(&[2, 3]),
            &mut dst,
            &[3, 2],
            &Bx::full(&[3, 2]),
            1,
            true,
        );
        assert_eq!(dst, vec![0, 3, 1, 4, 2, 5]);
        assert!(is_contiguous(
            &Bx {
                off: vec![3, 1, 0],
                len: vec![1, 2, 5]
            },
            &[4, 4, 5]
        ));
        assert!(!is_contiguous(
            &Bx {
                off: vec![0, 1],
                len: vec![2, 2]
            },
            &[4, 4]
        ));
    }
}
