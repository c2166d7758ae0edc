//! The checksum of the format: crc32c (Castagnoli), as Zarr's `crc32c` codec stores it.

/// crc32c (Castagnoli), hardware accelerated.
#[must_use]
pub fn crc32c(data: &[u8]) -> u32 {
    // Crc32Iscsi is CRC-32C; the result fits in 32 bits.
    u32::try_from(crc_fast::checksum(crc_fast::CrcAlgorithm::Crc32Iscsi, data)).unwrap_or(0)
}
