//! The shard footer (format 1.1, spec § "Shard footer"): bytes between a shard's last
//! subchunk and its index, referenced by no index entry, that bind the shard to the save that
//! wrote it (save id), to its tensor (key hash) and to its place in the grid (chunk
//! coordinates), and give the crc32c of every subchunk in index order, so that swapped
//! subchunks or shards and mixes of two saves are detected.
//!
//! Layout (little-endian): magic `ZCKPFOOT` (8 bytes), footer version u32 (1), number of
//! dimensions u32, save id (16 bytes), xxh3-64 of the tensor key's UTF-8 bytes u64, subchunk
//! count u64, chunk coordinates (u64 each), one u32 crc32c per subchunk in index order (0 for
//! an absent subchunk), and the crc32c of all the footer's preceding bytes u32. Its size
//! depends only on the geometry: [`footer_len`].

use std::fmt;
use std::str::FromStr;

use super::checksum::crc32c;
use crate::model::TensorKey;

/// The footer's first 8 bytes.
pub const MAGIC: &[u8; 8] = b"ZCKPFOOT";
/// The footer version this crate writes and reads.
pub const FOOTER_VERSION: u32 = 1;
/// Bytes of the footer before the chunk coordinates.
const HEADER: usize = 8 + 4 + 4 + 16 + 8 + 8;

/// A save's random 128-bit identifier (32 lowercase hex digits in JSON).
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SaveId(pub [u8; 16]);

impl SaveId {
    /// A fresh random save id from the operating system's generator (`getrandom`), falling
    /// back to time and process id mixed by xxh3 where that fails.
    #[must_use]
    pub fn random() -> Self {
        let mut b = [0u8; 16];
        // SAFETY: writes at most 16 bytes into `b`.
        let n = unsafe { libc::getrandom(b.as_mut_ptr().cast(), b.len(), 0) };
        if usize::try_from(n).ok() != Some(b.len()) {
            let t = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_nanos());
            let seed = format!("{t}-{}-{:p}", std::process::id(), &b);
            b = xxhash_rust::xxh3::xxh3_128(seed.as_bytes()).to_le_bytes();
        }
        SaveId(b)
    }

    /// The 32 lowercase hex digits.
    #[must_use]
    pub fn hex(&self) -> String {
        self.0.iter().map(|b| format!("{b:02x}")).collect()
    }
}

impl fmt::Display for SaveId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.hex())
    }
}

impl fmt::Debug for SaveId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "SaveId({})", self.hex())
    }
}

impl FromStr for SaveId {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        if s.len() != 32 || !s.bytes().all(|c| matches!(c, b'0'..=b'9' | b'a'..=b'f')) {
            return Err(format!("save id {s:?} is not 32 lowercase hex digits"));
        }
        let mut b = [0u8; 16];
        for (i, out) in b.iter_mut().enumerate() {
            *out = u8::from_str_radix(&s[2 * i..2 * i + 2], 16).map_err(|e| e.to_string())?;
        }
        Ok(SaveId(b))
    }
}

impl serde::Serialize for SaveId {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.hex())
    }
}

impl<'de> serde::Deserialize<'de> for SaveId {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

/// The hash of a tensor key stored in footers: xxh3-64 of its UTF-8 bytes.
#[must_use]
pub fn key_hash(key: &TensorKey) -> u64 {
    xxhash_rust::xxh3::xxh3_64(key.as_str().as_bytes())
}

/// The size in bytes of the footer of a shard with `ndim` dimensions and `n_sub` subchunks,
/// `None` on overflow.
#[must_use]
pub fn footer_len(ndim: usize, n_sub: u64) -> Option<u64> {
    let n = usize::try_from(n_sub).ok()?;
    let len = HEADER
        .checked_add(ndim.checked_mul(8)?)?
        .checked_add(n.checked_mul(4)?)?
        .checked_add(4)?;
    u64::try_from(len).ok()
}

/// Encodes the footer of the shard at grid index `chunk` of tensor `key` written by save
/// `save_id`, with `crcs` the crc32c of each subchunk in index order (0 for absent ones).
#[must_use]
pub fn encode(save_id: SaveId, key: &TensorKey, chunk: &[u64], crcs: &[u32]) -> Vec<u8> {
    let mut out = Vec::with_capacity(HEADER + chunk.len() * 8 + crcs.len() * 4 + 4);
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(&FOOTER_VERSION.to_le_bytes());
    out.extend_from_slice(&u32::try_from(chunk.len()).unwrap_or(u32::MAX).to_le_bytes());
    out.extend_from_slice(&save_id.0);
    out.extend_from_slice(&key_hash(key).to_le_bytes());
    out.extend_from_slice(&(crcs.len() as u64).to_le_bytes());
    for c in chunk {
        out.extend_from_slice(&c.to_le_bytes());
    }
    for c in crcs {
        out.extend_from_slice(&c.to_le_bytes());
    }
    let crc = crc32c(&out);
    out.extend_from_slice(&crc.to_le_bytes());
    out
}

/// Checks a footer read from a shard file against what the index that committed it says:
/// its own crc32c, the magic and version, the save id, the key hash, the chunk coordinates
/// and the subchunk count. Returns the subchunk crcs, in index order.
///
/// # Errors
/// A sentence saying what does not match (the caller names key, chunk and file).
pub fn check(
    bytes: &[u8],
    save_id: SaveId,
    key: &TensorKey,
    chunk: &[u64],
    n_sub: u64,
) -> Result<Vec<u32>, String> {
    let expected_len = footer_len(chunk.len(), n_sub).ok_or("footer size overflows")?;
    if bytes.len() as u64 != expected_len {
        return Err(format!(
            "footer is {} bytes, expected {expected_len}",
            bytes.len()
        ));
    }
    let (body, crc) = bytes.split_at(bytes.len() - 4);
    let u32_at = |b: &[u8], at: usize| u32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]]);
    let u64_at = |at: usize| {
        let mut w = [0u8; 8];
        w.copy_from_slice(&body[at..at + 8]);
        u64::from_le_bytes(w)
    };
    if &body[..8] != MAGIC {
        return Err("no shard footer where the index says it must be (bad magic): the shard was not written by the save this index committed".into());
    }
    let stored_crc = u32_at(crc, 0);
    let computed = crc32c(body);
    if stored_crc != computed {
        return Err(format!(
            "shard footer crc32c mismatch (stored {stored_crc:#010x}, computed {computed:#010x})"
        ));
    }
    let version = u32_at(body, 8);
    if version != FOOTER_VERSION {
        return Err(format!(
            "shard footer version {version} is not supported (this reader supports {FOOTER_VERSION})"
        ));
    }
    let ndim = u32_at(body, 12);
    if usize::try_from(ndim).ok() != Some(chunk.len()) {
        return Err(format!(
            "shard footer has {ndim} dimensions, the array has {}",
            chunk.len()
        ));
    }
    let mut id = [0u8; 16];
    id.copy_from_slice(&body[16..32]);
    let found = SaveId(id);
    if found != save_id {
        return Err(format!(
            "shard written by save {found}, but the index was committed by save {save_id} (a mix of two saves, or a save replaced the checkpoint while it was being read)"
        ));
    }
    if u64_at(32) != key_hash(key) {
        return Err("shard footer names another tensor (key hash mismatch): the file was moved from another array".into());
    }
    if u64_at(40) != n_sub {
        return Err(format!(
            "shard footer counts {} subchunks, the array's geometry has {n_sub}",
            u64_at(40)
        ));
    }
    let coords: Vec<u64> = (0..chunk.len()).map(|d| u64_at(HEADER + 8 * d)).collect();
    if coords != chunk {
        return Err(format!(
            "shard footer says chunk {coords:?}: the file was moved from another position"
        ));
    }
    let start = HEADER + 8 * chunk.len();
    Ok(body[start..]
        .chunks_exact(4)
        .map(|c| u32_at(c, 0))
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_and_every_mismatch() {
        let key = TensorKey::new("a.b").unwrap();
        let id = SaveId([7; 16]);
        let f = encode(id, &key, &[1, 2], &[10, 0, 30]);
        assert_eq!(f.len() as u64, footer_len(2, 3).unwrap());
        assert_eq!(check(&f, id, &key, &[1, 2], 3).unwrap(), vec![10, 0, 30]);
        assert!(
            check(&f, SaveId([8; 16]), &key, &[1, 2], 3)
                .unwrap_err()
                .contains("save")
        );
        let other = TensorKey::new("a.c").unwrap();
        assert!(
            check(&f, id, &other, &[1, 2], 3)
                .unwrap_err()
                .contains("another tensor")
        );
        assert!(
            check(&f, id, &key, &[2, 1], 3)
                .unwrap_err()
                .contains("chunk")
        );
        assert!(check(&f, id, &key, &[1, 2], 4).is_err());
        for i in 0..f.len() {
            let mut g = f.clone();
            g[i] ^= 0x10;
            assert!(check(&g, id, &key, &[1, 2], 3).is_err(), "flip at {i}");
        }
        assert_eq!(id.hex().parse::<SaveId>().unwrap(), id);
        assert!("XYZ".parse::<SaveId>().is_err());
        assert_ne!(SaveId::random(), SaveId::random());
    }
}
