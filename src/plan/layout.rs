//! Compact layout descriptions: what one rank holds (save) or asks for (load), encoded as
//! bytes for the all-gather, and the de-duplicated global view built from all of them.
//!
//! Ranks with the same layout (data-parallel replicas, most of all) send identical bytes, so
//! ranks first all-gather a 128-bit hash of their description and then only the lowest rank
//! of each distinct hash sends the description itself. Planning then works on the distinct
//! descriptions, whose number grows with the model-parallel size, not the world size.

use std::collections::HashMap;

use crate::model::region::MAX_DIMS;
use crate::model::{DType, Region, TensorKey};

/// One tensor a rank declares: key, data type, global shape.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct TensorDecl {
    /// The tensor's key.
    pub key: TensorKey,
    /// Its data type.
    pub dtype: DType,
    /// Its global shape.
    pub global_shape: Vec<u64>,
}

/// One piece of a declared tensor.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct PieceDecl {
    /// Index into [`RankLayout::tensors`].
    pub tensor: u32,
    /// The box.
    pub region: Region,
    /// True for a main replica (save). For a load request: true when the requesting rank
    /// reads the box itself and shares it with no other rank (it converts the data type).
    pub main: bool,
    /// True for a box declared replicated without an id ([`crate::model::Replica::Auto`]):
    /// identical auto boxes on several ranks form one replica group, stored once. Never
    /// together with `main`.
    pub auto: bool,
}

/// Everything one rank declares: its tensors and the pieces it holds or asks for.
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash)]
pub struct RankLayout {
    /// The tensors, each key at most once.
    pub tensors: Vec<TensorDecl>,
    /// The pieces.
    pub pieces: Vec<PieceDecl>,
}

/// Why a layout description could not be decoded.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("malformed layout description from rank {rank} at byte {at}: {reason}")]
pub struct LayoutDecodeError {
    /// The rank that sent it.
    pub rank: usize,
    /// Byte offset of the problem.
    pub at: usize,
    /// What is wrong.
    pub reason: String,
}

const MAGIC: &[u8; 5] = b"ZCKL1";

/// Appends a box: its offsets, then its extents.
pub(crate) fn put_region(out: &mut Vec<u8>, region: &Region) {
    for &o in region.offset() {
        put_varint(out, o);
    }
    for &s in region.shape() {
        put_varint(out, s);
    }
}

pub(crate) fn put_varint(out: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        out.push((v as u8) | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

impl RankLayout {
    /// Encodes the layout as bytes.
    #[must_use]
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(16 + self.pieces.len() * 8);
        out.extend_from_slice(MAGIC);
        encode_tensors(&mut out, &self.tensors);
        put_varint(&mut out, self.pieces.len() as u64);
        for p in &self.pieces {
            put_varint(&mut out, u64::from(p.tensor));
            out.push(u8::from(p.main) | (u8::from(p.auto) << 1));
            put_region(&mut out, &p.region);
        }
        out
    }

    /// Decodes and validates a layout sent by `rank`: keys, data types, ranks of shapes,
    /// and that every piece lies inside its tensor.
    ///
    /// # Errors
    /// [`LayoutDecodeError`] for anything malformed; never panics on any input.
    pub fn decode(bytes: &[u8], rank: usize) -> Result<Self, LayoutDecodeError> {
        let mut r = Reader::after_magic(bytes, rank, MAGIC, "magic")?;
        let tensors = decode_tensors(&mut r)?;
        let n_pieces = r.count(2)?;
        let mut pieces = Vec::with_capacity(n_pieces);
        for _ in 0..n_pieces {
            let t = r.varint()?;
            let t = u32::try_from(t).map_err(|_| r.err("tensor index too large"))?;
            let decl = tensors
                .get(t as usize)
                .ok_or_else(|| r.err("tensor index out of range"))?;
            let flags = r.take(1)?[0];
            if flags > 2 {
                return Err(r.err("unknown piece flags"));
            }
            let region = r.region_within(&decl.global_shape)?;
            pieces.push(PieceDecl {
                tensor: t,
                region,
                main: flags == 1,
                auto: flags == 2,
            });
        }
        if r.pos != bytes.len() {
            return Err(r.err("trailing bytes"));
        }
        Ok(RankLayout { tensors, pieces })
    }

    /// A 128-bit hash of the encoding, used to de-duplicate identical layouts.
    #[must_use]
    pub fn hash_bytes(encoded: &[u8]) -> [u8; 16] {
        xxhash_rust::xxh3::xxh3_128(encoded).to_le_bytes()
    }
}

/// Appends the tensor declarations (count, then key, data type code and shape of each).
pub(crate) fn encode_tensors(out: &mut Vec<u8>, tensors: &[TensorDecl]) {
    put_varint(out, tensors.len() as u64);
    for t in tensors {
        let k = t.key.as_str().as_bytes();
        put_varint(out, k.len() as u64);
        out.extend_from_slice(k);
        out.push(t.dtype.code());
        put_varint(out, t.global_shape.len() as u64);
        for &d in &t.global_shape {
            put_varint(out, d);
        }
    }
}

/// Reads what [`encode_tensors`] wrote, validating keys, data types and shapes, each key at
/// most once.
pub(crate) fn decode_tensors(r: &mut Reader<'_>) -> Result<Vec<TensorDecl>, LayoutDecodeError> {
    let rank = r.rank;
    let n_tensors = r.count(2)?;
    let mut tensors = Vec::with_capacity(n_tensors);
    let mut seen = HashMap::with_capacity(n_tensors);
    for _ in 0..n_tensors {
        let len = r.count(1)?;
        let at = r.pos;
        let raw = r.take(len)?;
        let s = std::str::from_utf8(raw).map_err(|_| LayoutDecodeError {
            rank,
            at,
            reason: "key is not UTF-8".into(),
        })?;
        let key = TensorKey::new(s).map_err(|e| r.err(&e.to_string()))?;
        let code = r.take(1)?[0];
        let dtype = DType::from_code(code).ok_or_else(|| r.err("unknown dtype code"))?;
        let ndim = r.count(1)?;
        if ndim > MAX_DIMS {
            return Err(r.err("too many dimensions"));
        }
        let global_shape = (0..ndim)
            .map(|_| r.varint())
            .collect::<Result<Vec<_>, _>>()?;
        crate::model::region::num_elements(&global_shape).map_err(|e| r.err(&e.to_string()))?;
        if seen.insert(key.clone(), ()).is_some() {
            return Err(r.err(&format!("key `{key}` declared twice")));
        }
        tensors.push(TensorDecl {
            key,
            dtype,
            global_shape,
        });
    }
    Ok(tensors)
}

pub(crate) struct Reader<'a> {
    pub(crate) bytes: &'a [u8],
    pub(crate) pos: usize,
    pub(crate) rank: usize,
}

impl<'a> Reader<'a> {
    /// A reader of `bytes` sent by `rank`, past `magic` (an error naming `what` when the bytes
    /// do not start with it).
    pub(crate) fn after_magic(
        bytes: &'a [u8],
        rank: usize,
        magic: &[u8],
        what: &str,
    ) -> Result<Self, LayoutDecodeError> {
        let mut r = Reader {
            bytes,
            pos: 0,
            rank,
        };
        if r.take(magic.len())? != magic {
            return Err(r.err(&format!("bad {what}")));
        }
        Ok(r)
    }
    pub(crate) fn err(&self, reason: &str) -> LayoutDecodeError {
        LayoutDecodeError {
            rank: self.rank,
            at: self.pos,
            reason: reason.to_owned(),
        }
    }
    pub(crate) fn take(&mut self, n: usize) -> Result<&[u8], LayoutDecodeError> {
        let end = self.pos.checked_add(n).filter(|&e| e <= self.bytes.len());
        let end = end.ok_or_else(|| self.err("truncated"))?;
        let s = &self.bytes[self.pos..end];
        self.pos = end;
        Ok(s)
    }
    pub(crate) fn varint(&mut self) -> Result<u64, LayoutDecodeError> {
        let mut v: u64 = 0;
        for shift in (0..64).step_by(7) {
            let b = self.take(1)?[0];
            let bits = u64::from(b & 0x7f);
            if shift == 63 && bits > 1 {
                return Err(self.err("varint overflows u64"));
            }
            v |= bits << shift;
            if b & 0x80 == 0 {
                return Ok(v);
            }
        }
        Err(self.err("varint too long"))
    }
    /// A box written by [`put_region`], checked to lie inside a tensor of `shape`.
    pub(crate) fn region_within(&mut self, shape: &[u64]) -> Result<Region, LayoutDecodeError> {
        let nd = shape.len();
        let offset = (0..nd)
            .map(|_| self.varint())
            .collect::<Result<Vec<_>, _>>()?;
        let extent = (0..nd)
            .map(|_| self.varint())
            .collect::<Result<Vec<_>, _>>()?;
        let region = Region::new(offset, extent).map_err(|e| self.err(&e.to_string()))?;
        region
            .check_within(shape)
            .map_err(|e| self.err(&e.to_string()))?;
        Ok(region)
    }

    /// A count of items each at least `min_bytes` long: bounded by what is left, so a
    /// hostile count cannot make us allocate.
    pub(crate) fn count(&mut self, min_bytes: usize) -> Result<usize, LayoutDecodeError> {
        let n = self.varint()?;
        let left = (self.bytes.len() - self.pos) as u64;
        if n > left / min_bytes.max(1) as u64 {
            return Err(self.err("count exceeds the remaining bytes"));
        }
        usize::try_from(n).map_err(|_| self.err("count too large"))
    }
}

/// The distinct layouts of all ranks and which ranks hold each.
#[derive(Debug, Clone)]
pub struct GatheredLayouts {
    /// Distinct layouts, ordered by their lowest rank.
    pub unique: Vec<RankLayout>,
    /// For each distinct layout, the ranks that declared it (ascending).
    pub ranks: Vec<Vec<u32>>,
    /// For each rank, the index of its layout in `unique`.
    pub of_rank: Vec<u32>,
}

impl GatheredLayouts {
    /// Which rank sends its description in the second round: `true` for the lowest rank of
    /// each distinct hash. `hashes[r]` is rank r's hash.
    #[must_use]
    pub fn representatives(hashes: &[[u8; 16]]) -> Vec<bool> {
        let mut seen = HashMap::with_capacity(hashes.len());
        hashes
            .iter()
            .enumerate()
            .map(|(r, h)| seen.insert(*h, r).is_none())
            .collect()
    }

    /// Builds the global view from the first-round hashes and the second-round blobs
    /// (non-empty exactly for representatives).
    ///
    /// # Errors
    /// [`LayoutDecodeError`] if a description is malformed or a representative sent nothing.
    pub fn from_parts(hashes: &[[u8; 16]], blobs: &[Vec<u8>]) -> Result<Self, LayoutDecodeError> {
        let reps = Self::representatives(hashes);
        let mut index_of_hash: HashMap<[u8; 16], u32> = HashMap::new();
        let mut unique = Vec::new();
        let mut ranks: Vec<Vec<u32>> = Vec::new();
        let mut of_rank = Vec::with_capacity(hashes.len());
        for (r, h) in hashes.iter().enumerate() {
            let r32 = u32::try_from(r).unwrap_or(u32::MAX);
            if reps[r] {
                let blob = blobs.get(r).ok_or_else(|| LayoutDecodeError {
                    rank: r,
                    at: 0,
                    reason: "no description received".into(),
                })?;
                if RankLayout::hash_bytes(blob) != *h {
                    return Err(LayoutDecodeError {
                        rank: r,
                        at: 0,
                        reason: "description does not match its hash".into(),
                    });
                }
                let layout = RankLayout::decode(blob, r)?;
                let idx = u32::try_from(unique.len()).unwrap_or(u32::MAX);
                index_of_hash.insert(*h, idx);
                unique.push(layout);
                ranks.push(vec![r32]);
                of_rank.push(idx);
            } else {
                let idx = index_of_hash[h];
                ranks[idx as usize].push(r32);
                of_rank.push(idx);
            }
        }
        Ok(GatheredLayouts {
            unique,
            ranks,
            of_rank,
        })
    }

    /// The view for layouts already at hand (tests, simulations, single process).
    #[must_use]
    pub fn from_layouts(layouts: &[RankLayout]) -> Self {
        let encoded: Vec<Vec<u8>> = layouts.iter().map(RankLayout::encode).collect();
        let hashes: Vec<[u8; 16]> = encoded.iter().map(|e| RankLayout::hash_bytes(e)).collect();
        let reps = Self::representatives(&hashes);
        let blobs: Vec<Vec<u8>> = encoded
            .into_iter()
            .zip(reps)
            .map(|(e, rep)| if rep { e } else { Vec::new() })
            .collect();
        Self::from_parts(&hashes, &blobs).unwrap_or_else(|e| panic!("own layouts must decode: {e}"))
    }

    /// Number of ranks.
    #[must_use]
    pub fn world_size(&self) -> usize {
        self.of_rank.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn layout(main: bool, off: u64) -> RankLayout {
        RankLayout {
            tensors: vec![TensorDecl {
                key: TensorKey::new("w").unwrap(),
                dtype: DType::BFloat16,
                global_shape: vec![8, 300],
            }],
            pieces: vec![PieceDecl {
                tensor: 0,
                region: Region::new(vec![off, 0], vec![4, 300]).unwrap(),
                main,
                auto: false,
            }],
        }
    }

    #[test]
    fn round_trips_and_rejects_garbage() {
        let l = layout(true, 4);
        let enc = l.encode();
        assert_eq!(RankLayout::decode(&enc, 0).unwrap(), l);
        for cut in 0..enc.len() {
            assert!(RankLayout::decode(&enc[..cut], 3).is_err(), "cut {cut}");
        }
        let mut bad = enc.clone();
        *bad.last_mut().unwrap() = 0x7f; // shape 127 rows: out of bounds
        let e = RankLayout::decode(&bad, 5).unwrap_err();
        assert_eq!(e.rank, 5);
        let mut auto = l.clone();
        auto.pieces[0].main = false;
        auto.pieces[0].auto = true;
        assert_eq!(RankLayout::decode(&auto.encode(), 0).unwrap(), auto);
        assert_ne!(auto.encode(), l.encode());
        let mut both = auto.encode();
        // the piece ends with: flags, offsets 0 and 0, extents 4 and 300 (two bytes)
        let flags_at = both.len() - 6;
        assert_eq!(both[flags_at - 1], 0); // tensor index 0
        both[flags_at] = 3;
        assert!(RankLayout::decode(&both, 0).is_err());
        let mut huge = MAGIC.to_vec();
        huge.extend_from_slice(&[0xff, 0xff, 0xff, 0xff, 0x0f]);
        assert!(RankLayout::decode(&huge, 0).is_err());
    }

    #[test]
    fn deduplicates_identical_layouts() {
        let layouts = vec![
            layout(true, 0),
            layout(true, 4),
            layout(false, 0),
            layout(false, 4),
            layout(false, 0),
        ];
        let g = GatheredLayouts::from_layouts(&layouts);
        assert_eq!(g.unique.len(), 4);
        assert_eq!(g.ranks[2], vec![2, 4]);
        assert_eq!(g.of_rank, vec![0, 1, 2, 3, 2]);
    }
}
