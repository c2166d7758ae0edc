//! Which compressed subchunk payloads a reader accepts (spec section 7.2): the structure of a
//! zstd frame and of a c-blosc 1.x header, checked before anything is decompressed, so that
//! a payload with a valid crc32c but a crafted header cannot make the decoder allocate what it
//! claims, read a dictionary it does not have, or leave bytes unread.

use super::meta::Compression;

/// The magic number that starts a zstd frame (RFC 8878, section 3.1.1), little endian.
const ZSTD_MAGIC: [u8; 4] = [0x28, 0xB5, 0x2F, 0xFD];
/// Length of a c-blosc 1.x header.
pub const BLOSC_HEADER: usize = 16;
/// The c-blosc 1.x format version (`BLOSC_VERSION_FORMAT`); Blosc2 chunks carry 3 or more.
const BLOSC_VERSION: u8 = 2;
/// Header flag: the payload is the uncompressed bytes, copied.
const BLOSC_MEMCPYED: u8 = 0x02;
/// Header flag: bit shuffle applied (never with the `shuffle` configuration).
const BLOSC_BITSHUFFLE: u8 = 0x04;
/// Header flag bit reserved by c-blosc 1.x; always zero.
const BLOSC_RESERVED: u8 = 0x08;
/// Compressor code (flag bits 5 to 7) of LZ4 and LZ4HC.
const BLOSC_LZ4: u8 = 1;

/// Checks that `payload` (a stored subchunk without its crc32c) is a frame this format allows
/// for `compression`, declaring `expected` decompressed bytes of `elem`-byte elements.
///
/// # Errors
/// What is wrong, in words.
pub fn check(
    compression: Compression,
    payload: &[u8],
    expected: u64,
    elem: usize,
) -> Result<(), String> {
    match compression {
        Compression::None => Ok(()),
        Compression::Zstd => check_zstd(payload, expected),
        Compression::Blosc => check_blosc(payload, expected, elem),
    }
}

fn check_zstd(payload: &[u8], expected: u64) -> Result<(), String> {
    if payload.get(..4) != Some(&ZSTD_MAGIC[..]) {
        return Err(
            "not a zstd frame (no zstd magic number; skippable frames are not allowed)".into(),
        );
    }
    let Some(&descriptor) = payload.get(4) else {
        return Err("zstd frame header truncated".into());
    };
    if descriptor & 0x03 != 0 {
        return Err("zstd frame names a dictionary".into());
    }
    if descriptor & 0x08 != 0 {
        return Err("zstd frame header has its reserved bit set".into());
    }
    let declared = match zstd::zstd_safe::get_frame_content_size(payload) {
        Ok(Some(n)) => n,
        Ok(None) => return Err("zstd frame does not declare its content size".into()),
        Err(_) => return Err("zstd frame header is corrupt".into()),
    };
    if declared != expected {
        return Err(format!(
            "zstd frame declares {declared} bytes, expected {expected}"
        ));
    }
    match zstd::zstd_safe::find_frame_compressed_size(payload) {
        Ok(n) if n == payload.len() => Ok(()),
        Ok(n) => Err(format!(
            "{} bytes follow the zstd frame ({n} bytes)",
            payload.len() - n
        )),
        Err(_) => Err("zstd frame is truncated or corrupt".into()),
    }
}

fn check_blosc(payload: &[u8], expected: u64, elem: usize) -> Result<(), String> {
    let Some(h) = payload.get(..BLOSC_HEADER) else {
        return Err(format!(
            "blosc header truncated ({} of {BLOSC_HEADER} bytes)",
            payload.len()
        ));
    };
    let word = |at: usize| u64::from(u32::from_le_bytes([h[at], h[at + 1], h[at + 2], h[at + 3]]));
    let (version, flags, typesize) = (h[0], h[2], h[3]);
    let (nbytes, blocksize, cbytes) = (word(4), word(8), word(12));
    if version != BLOSC_VERSION {
        return Err(format!(
            "blosc format version {version}, expected {BLOSC_VERSION} (c-blosc 1.x)"
        ));
    }
    if flags & (BLOSC_RESERVED | BLOSC_BITSHUFFLE) != 0 {
        return Err(format!(
            "blosc flags {flags:#04x} set the reserved or the bit-shuffle bit"
        ));
    }
    if flags >> 5 != BLOSC_LZ4 {
        return Err(format!(
            "blosc compressor code {}, expected {BLOSC_LZ4} (lz4)",
            flags >> 5
        ));
    }
    if usize::from(typesize) != elem {
        return Err(format!("blosc typesize {typesize}, expected {elem}"));
    }
    if nbytes != expected {
        return Err(format!(
            "blosc header declares {nbytes} bytes, expected {expected}"
        ));
    }
    if cbytes != payload.len() as u64 {
        return Err(format!(
            "blosc header says {cbytes} compressed bytes, the subchunk has {}",
            payload.len()
        ));
    }
    if blocksize == 0 || blocksize > nbytes {
        return Err(format!(
            "blosc blocksize {blocksize} is not between 1 and {nbytes}"
        ));
    }
    if flags & BLOSC_MEMCPYED != 0 && cbytes != nbytes + BLOSC_HEADER as u64 {
        return Err(format!(
            "blosc payload is a copy but holds {cbytes} bytes, expected {}",
            nbytes + BLOSC_HEADER as u64
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn zstd_frame(data: &[u8]) -> Vec<u8> {
        zstd::bulk::compress(data, 3).unwrap()
    }

    #[test]
    fn zstd_frames() {
        let data = vec![7u8; 256];
        let f = zstd_frame(&data);
        check(Compression::Zstd, &f, 256, 1).unwrap();
        assert!(check(Compression::Zstd, &f, 255, 1).is_err(), "size");
        let mut trailing = f.clone();
        trailing.push(0);
        assert!(
            check(Compression::Zstd, &trailing, 256, 1).is_err(),
            "trailing byte"
        );
        let mut two = f.clone();
        two.extend_from_slice(&f);
        assert!(
            check(Compression::Zstd, &two, 256, 1).is_err(),
            "two frames"
        );
        // A skippable frame (magic 0x184D2A50, 4-byte length, content) before the frame.
        let mut skip = vec![0x50, 0x2A, 0x4D, 0x18, 1, 0, 0, 0, 0];
        skip.extend_from_slice(&f);
        assert!(
            check(Compression::Zstd, &skip, 256, 1).is_err(),
            "skippable"
        );
        assert!(
            check(Compression::Zstd, &f[..f.len() - 1], 256, 1).is_err(),
            "truncated"
        );
        // No content size: a streamed frame.
        let mut enc = zstd::stream::Encoder::new(Vec::new(), 3).unwrap();
        enc.include_contentsize(false).unwrap();
        std::io::Write::write_all(&mut enc, &data).unwrap();
        let streamed = enc.finish().unwrap();
        assert!(
            check(Compression::Zstd, &streamed, 256, 1).is_err(),
            "no size"
        );
        // A dictionary id.
        let mut dict = f.clone();
        dict[4] |= 0x01;
        assert!(
            check(Compression::Zstd, &dict, 256, 1).is_err(),
            "dictionary"
        );
    }

    fn blosc_header(version: u8, flags: u8, ts: u8, nbytes: u32, bs: u32, cbytes: u32) -> Vec<u8> {
        let mut h = vec![version, 1, flags, ts];
        for w in [nbytes, bs, cbytes] {
            h.extend_from_slice(&w.to_le_bytes());
        }
        h
    }

    #[test]
    fn blosc_headers() {
        let copy = |h: Vec<u8>| {
            let mut p = h;
            p.resize(16 + 8, 0xAA);
            p
        };
        check(
            Compression::Blosc,
            &copy(blosc_header(2, 0x33, 4, 8, 8, 24)),
            8,
            4,
        )
        .unwrap();
        for (what, h) in [
            ("blosc2", blosc_header(3, 0x33, 4, 8, 8, 24)),
            ("reserved bit", blosc_header(2, 0x3B, 4, 8, 8, 24)),
            ("bitshuffle", blosc_header(2, 0x37, 4, 8, 8, 24)),
            ("zstd compressor", blosc_header(2, 0x93, 4, 8, 8, 24)),
            ("typesize", blosc_header(2, 0x33, 2, 8, 8, 24)),
            ("nbytes", blosc_header(2, 0x33, 4, 9, 8, 24)),
            ("cbytes", blosc_header(2, 0x33, 4, 8, 8, 23)),
            ("blocksize 0", blosc_header(2, 0x33, 4, 8, 0, 24)),
            ("blocksize > nbytes", blosc_header(2, 0x33, 4, 8, 16, 24)),
        ] {
            assert!(check(Compression::Blosc, &copy(h), 8, 4).is_err(), "{what}");
        }
        // A copy must hold exactly nbytes after the header.
        let mut short = blosc_header(2, 0x33, 4, 8, 8, 20);
        short.resize(20, 0);
        assert!(check(Compression::Blosc, &short, 8, 4).is_err());
        assert!(
            check(Compression::Blosc, &[2, 1, 0x33], 8, 4).is_err(),
            "truncated"
        );
    }
}
