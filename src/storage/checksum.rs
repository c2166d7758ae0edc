//! The checksum of the format: crc32c (Castagnoli), as Zarr's `crc32c` codec stores it.

/// crc32c (Castagnoli), hardware accelerated.
#[must_use]
pub fn crc32c(data: &[u8]) -> u32 {
    // Crc32Iscsi is CRC-32C; the result fits in 32 bits.
    u32::try_from(crc_fast::checksum(crc_fast::CrcAlgorithm::Crc32Iscsi, data)).unwrap_or(0)
}

/// A running crc32c (Castagnoli): feed it with `update`, read it with [`crc32c_value`].
#[must_use]
pub fn crc32c_digest() -> crc_fast::Digest {
    crc_fast::Digest::new(crc_fast::CrcAlgorithm::Crc32Iscsi)
}

/// The crc32c a [`crc32c_digest`] computed. Invariant: a CRC32 digest's value fits 32 bits
/// (`crc_fast` widens it to `u64`), so the cast keeps every bit.
#[must_use]
#[allow(clippy::cast_possible_truncation)]
pub fn crc32c_value(digest: &crc_fast::Digest) -> u32 {
    digest.finalize() as u32
}

/// crc32c of the concatenation of `parts`, without joining them.
#[must_use]
pub fn crc32c_of_parts<'a>(parts: impl IntoIterator<Item = &'a [u8]>) -> u32 {
    let mut d = crc32c_digest();
    for p in parts {
        d.update(p);
    }
    crc32c_value(&d)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parts_give_the_crc_of_their_concatenation() {
        let data: Vec<u8> = (0..10_000u32).map(|i| (i * 31 % 251) as u8).collect();
        let parts = [&data[..1], &data[1..4096], &data[4096..4096], &data[4096..]];
        assert_eq!(crc32c_of_parts(parts), crc32c(&data));
        assert_eq!(crc32c(b"123456789"), 0xE306_9283);
    }
}
