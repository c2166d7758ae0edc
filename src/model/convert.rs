//! Converting elements between floating-point data types, only when a load target asks for it
//! ([`Cast::FloatConvert`]). No I/O.
//!
//! Supported: `float16`, `bfloat16`, `float32` and `float64`, each to each.
//!
//! - Finite values: rounded once, to nearest, ties to even (IEEE 754 `roundTiesToEven`),
//!   subnormals included on both sides; a value beyond the target's largest finite value after
//!   rounding becomes an infinity of its sign; one below half the smallest subnormal becomes
//!   a zero of its sign. Converting to a type that holds every value of the source (`float16`
//!   or `bfloat16` to `float32`/`float64`, `float32` to `float64`) is exact.
//! - Infinities and signed zeros keep their sign.
//! - NaN stays NaN with its sign. The payload keeps its high-order bits: shifted up when the
//!   target's mantissa is wider, truncated when narrower. A widening conversion (to a type
//!   with at least as many exponent and mantissa bits) keeps every bit, so a signalling NaN
//!   stays signalling, as numpy, ml_dtypes and PyTorch widen; every other conversion sets the
//!   quiet bit, as x86 and Arm hardware conversions do, so that truncating a payload can
//!   never turn a NaN into an infinity. The usual quiet NaN (`0x7fc00000` in `float32`) maps
//!   to the usual quiet NaN of the target.
//!
//! `float64` to `bfloat16` is rounded once, straight from the `float64` value: ml_dtypes
//! goes through `float32` and so rounds twice, which differs for the rare `float64` values
//! that lie within half a `float32` ulp of a `bfloat16` tie.

use super::dtype::DType;

/// How a load target accepts the data type stored in the checkpoint.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
#[non_exhaustive]
pub enum Cast {
    /// The stored data type must be the target's own (the default): a mismatch is
    /// [`crate::Error::DtypeMismatch`]; nothing is ever cast silently.
    #[default]
    Exact,
    /// A stored `float16`, `bfloat16`, `float32` or `float64` tensor is converted to the
    /// target's data type (also one of these four), rounding to nearest even as the
    /// [module documentation](self) says. Any other pair is still a mismatch.
    FloatConvert,
}

impl Cast {
    /// Whether a target of data type `target` with this cast accepts a stored `stored` tensor.
    #[must_use]
    pub fn accepts(self, stored: DType, target: DType) -> bool {
        stored == target || (self == Cast::FloatConvert && convertible(stored, target))
    }
}

/// What is wrong with a conversion request.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ConvertError {
    /// The pair of data types is not supported.
    #[error("no conversion from {from} to {to}")]
    Unsupported {
        /// Source data type.
        from: DType,
        /// Target data type.
        to: DType,
    },
    /// The buffers do not hold the same number of whole elements.
    #[error("{src} bytes of {from} do not convert into {dst} bytes of {to}")]
    Length {
        /// Source data type.
        from: DType,
        /// Source bytes.
        src: usize,
        /// Target data type.
        to: DType,
        /// Target bytes.
        dst: usize,
    },
}

/// The bit layout of a binary floating-point format.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Fmt {
    exp: u32,
    man: u32,
}

impl Fmt {
    const fn bias(self) -> i32 {
        (1 << (self.exp - 1)) - 1
    }
    const fn of(d: DType) -> Option<Fmt> {
        match d {
            DType::Float16 => Some(Fmt { exp: 5, man: 10 }),
            DType::BFloat16 => Some(Fmt { exp: 8, man: 7 }),
            DType::Float32 => Some(Fmt { exp: 8, man: 23 }),
            DType::Float64 => Some(Fmt { exp: 11, man: 52 }),
            _ => None,
        }
    }
}

/// Whether [`convert`] supports `from` to `to` (any two of the four float types, or the same).
#[must_use]
pub fn convertible(from: DType, to: DType) -> bool {
    Fmt::of(from).is_some() && Fmt::of(to).is_some()
}

/// Converts the bits of one value of format `s` (in the low bits of `x`) to format `d`.
fn convert_bits(x: u64, s: Fmt, d: Fmt) -> u64 {
    let s_width = 1 + s.exp + s.man;
    let sign = ((x >> (s_width - 1)) & 1) << (d.exp + d.man);
    let exp = (x >> s.man) & ((1 << s.exp) - 1);
    let man = x & ((1 << s.man) - 1);
    let d_inf = ((1u64 << d.exp) - 1) << d.man;
    if exp == (1 << s.exp) - 1 {
        if man == 0 {
            return sign | d_inf;
        }
        let payload = if d.man >= s.man {
            man << (d.man - s.man)
        } else {
            man >> (s.man - d.man)
        };
        let widening = d.exp >= s.exp && d.man >= s.man;
        let quiet = if widening { 0 } else { 1 << (d.man - 1) };
        return sign | d_inf | quiet | payload;
    }
    if exp == 0 && man == 0 {
        return sign;
    }
    // The value is m * 2^e with an integer significand m.
    // Field widths (at most 52), the exponent field (below 2^11) and a leading-zero count
    // (at most 64) are small: the casts to i32 are exact.
    let s_man = s.man as i32;
    let d_man = d.man as i32;
    let (m, e) = if exp == 0 {
        (man, 1 - s.bias() - s_man)
    } else {
        (man | (1 << s.man), exp as i32 - s.bias() - s_man)
    };
    let msb = 63 - m.leading_zeros() as i32;
    // Exponent of the result's leading digit, clamped to the subnormal range's, and the
    // exponent of the result's last digit.
    let t = (msb + e).max(1 - d.bias());
    let shift = t - d_man - e;
    let r = if shift <= 0 {
        m << shift.unsigned_abs()
    } else if shift >= 64 {
        0 // m < 2^53: below half the smallest step
    } else {
        let kept = m >> shift;
        let rem = m & ((1u64 << shift) - 1);
        let half = 1u64 << (shift - 1);
        kept + u64::from(rem > half || (rem == half && kept & 1 == 1))
    };
    // Biased exponent t + bias >= 1; a carry out of the significand moves into the exponent
    // field, and a subnormal result (r below the hidden bit, t at its minimum) encodes as r.
    let biased = u64::try_from(t + d.bias()).unwrap_or(1);
    let bits = ((biased - 1) << d.man) + r;
    if bits >= d_inf {
        sign | d_inf
    } else {
        sign | bits
    }
}

/// Applies `f` to each `S`-byte element of `src`, writing `T`-byte elements into `dst`.
#[inline]
fn map<const S: usize, const T: usize>(src: &[u8], dst: &mut [u8], f: impl Fn([u8; S]) -> [u8; T]) {
    for (d, s) in dst.chunks_exact_mut(T).zip(src.chunks_exact(S)) {
        let s: [u8; S] = s.try_into().unwrap_or([0; S]);
        d.copy_from_slice(&f(s));
    }
}

fn generic<const S: usize, const T: usize>(src: &[u8], dst: &mut [u8], s: Fmt, d: Fmt) {
    map::<S, T>(src, dst, |b| {
        let mut wide = [0u8; 8];
        wide[..S].copy_from_slice(&b);
        let out = convert_bits(u64::from_le_bytes(wide), s, d).to_le_bytes();
        let mut o = [0u8; T];
        o.copy_from_slice(&out[..T]);
        o
    });
}

/// Converts packed little-endian elements of `from` in `src` into elements of `to` in `dst`,
/// as the [module documentation](self) says. Equal types copy the bytes unchanged.
///
/// # Errors
/// [`ConvertError::Unsupported`] for a pair of types other than the four float types;
/// [`ConvertError::Length`] when the buffers do not hold the same number of whole elements.
pub fn convert(from: DType, src: &[u8], to: DType, dst: &mut [u8]) -> Result<(), ConvertError> {
    let (Some(s), Some(d)) = (Fmt::of(from), Fmt::of(to)) else {
        return Err(ConvertError::Unsupported { from, to });
    };
    let n = src.len() / from.size();
    if !src.len().is_multiple_of(from.size()) || n.checked_mul(to.size()) != Some(dst.len()) {
        return Err(ConvertError::Length {
            from,
            src: src.len(),
            to,
            dst: dst.len(),
        });
    }
    match (from, to) {
        _ if from == to => dst.copy_from_slice(src),
        (DType::Float32, DType::BFloat16) => map::<4, 2>(src, dst, |b| {
            let x = u32::from_le_bytes(b);
            if x & 0x7FFF_FFFF > 0x7F80_0000 {
                return (((x >> 16) | 0x40) as u16).to_le_bytes();
            }
            // Round to nearest even on the 16 dropped bits; a carry moves into the exponent
            // (up to infinity), which is exactly right since the formats share the exponent.
            let r = x + 0x7FFF + ((x >> 16) & 1);
            ((r >> 16) as u16).to_le_bytes()
        }),
        (DType::BFloat16, DType::Float32) => map::<2, 4>(src, dst, |b| {
            (u32::from(u16::from_le_bytes(b)) << 16).to_le_bytes()
        }),
        (DType::Float32, DType::Float64) => map::<4, 8>(src, dst, |b| {
            let x = f32::from_le_bytes(b);
            if x.is_nan() {
                convert_bits(u64::from(x.to_bits()), s, d).to_le_bytes()
            } else {
                f64::from(x).to_le_bytes()
            }
        }),
        (DType::Float64, DType::Float32) => map::<8, 4>(src, dst, |b| {
            let x = f64::from_le_bytes(b);
            if x.is_nan() {
                let bits = convert_bits(x.to_bits(), s, d);
                // Bits of an f32: the low 32 bits hold them all.
                #[allow(clippy::cast_possible_truncation)]
                (bits as u32).to_le_bytes()
            } else {
                // `as` rounds to nearest, ties to even, with overflow to infinity.
                #[allow(clippy::cast_possible_truncation)]
                (x as f32).to_le_bytes()
            }
        }),
        _ => match (from.size(), to.size()) {
            (2, 2) => generic::<2, 2>(src, dst, s, d),
            (2, 4) => generic::<2, 4>(src, dst, s, d),
            (2, 8) => generic::<2, 8>(src, dst, s, d),
            (4, 2) => generic::<4, 2>(src, dst, s, d),
            (4, 8) => generic::<4, 8>(src, dst, s, d),
            (8, 2) => generic::<8, 2>(src, dst, s, d),
            (8, 4) => generic::<8, 4>(src, dst, s, d),
            _ => return Err(ConvertError::Unsupported { from, to }),
        },
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn one(from: DType, to: DType, bits: u64) -> u64 {
        let src = &bits.to_le_bytes()[..from.size()];
        let mut dst = vec![0u8; to.size()];
        convert(from, src, to, &mut dst).unwrap();
        let mut wide = [0u8; 8];
        wide[..to.size()].copy_from_slice(&dst);
        u64::from_le_bytes(wide)
    }

    const F: [DType; 4] = [
        DType::Float16,
        DType::BFloat16,
        DType::Float32,
        DType::Float64,
    ];

    #[test]
    fn fast_paths_agree_with_the_generic_rule() {
        // Every bf16 / f16 pattern, and a spread of f32 / f64 patterns, through each fast
        // path and through `convert_bits`.
        let mut x = 0x9E37_79B9_7F4A_7C15u64;
        let mut patterns: Vec<u64> = (0..=u64::from(u16::MAX)).map(|b| b << 16).collect();
        for _ in 0..200_000 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            patterns.push(x);
        }
        for (from, to) in [
            (DType::Float32, DType::BFloat16),
            (DType::BFloat16, DType::Float32),
            (DType::Float32, DType::Float64),
            (DType::Float64, DType::Float32),
        ] {
            let (s, d) = (Fmt::of(from).unwrap(), Fmt::of(to).unwrap());
            let mask = if from.size() == 8 {
                u64::MAX
            } else {
                (1u64 << (8 * from.size())) - 1
            };
            for &p in &patterns {
                let p = if from.size() == 2 { p >> 16 } else { p } & mask;
                assert_eq!(
                    one(from, to, p),
                    convert_bits(p, s, d),
                    "{from} -> {to}: {p:#x}"
                );
            }
        }
    }

    #[test]
    fn rounds_ties_to_even_and_overflows_to_infinity() {
        // f32 1 + 2^-8 is a bf16 tie: to even (1.0); 1 + 3 * 2^-8 rounds up to 1 + 2^-6.
        assert_eq!(one(DType::Float32, DType::BFloat16, 0x3F80_8000), 0x3F80);
        assert_eq!(one(DType::Float32, DType::BFloat16, 0x3F81_8000), 0x3F82);
        assert_eq!(one(DType::Float32, DType::BFloat16, 0x3F80_8001), 0x3F81);
        // f64 1 + 2^-8 + 2^-30: just above the tie, rounds up (once, not via f32).
        let v = 1.0f64 + 2f64.powi(-8) + 2f64.powi(-30);
        assert_eq!(one(DType::Float64, DType::BFloat16, v.to_bits()), 0x3F81);
        // f16 max 65504; 65520 is the tie to infinity (rounds to even = infinity).
        assert_eq!(
            one(DType::Float32, DType::Float16, 65519.0f32.to_bits().into()),
            0x7BFF
        );
        assert_eq!(
            one(DType::Float32, DType::Float16, 65520.0f32.to_bits().into()),
            0x7C00
        );
        assert_eq!(one(DType::Float32, DType::BFloat16, 0xFF7F_FFFF), 0xFF80);
        // Smallest f16 subnormal 2^-24; 2^-25 is a tie to zero, just above it rounds up.
        assert_eq!(
            one(
                DType::Float32,
                DType::Float16,
                2f32.powi(-25).to_bits().into()
            ),
            0
        );
        assert_eq!(
            one(
                DType::Float32,
                DType::Float16,
                (2f32.powi(-25) * 1.0001).to_bits().into()
            ),
            1
        );
        // Subnormals widen exactly.
        assert_eq!(
            f32::from_bits(u32::try_from(one(DType::Float16, DType::Float32, 1)).unwrap()),
            2f32.powi(-24)
        );
        assert_eq!(
            f64::from_bits(one(DType::BFloat16, DType::Float64, 0x8001)),
            -(2f64.powi(-133))
        );
    }

    #[test]
    fn nans_stay_nans_with_their_sign() {
        for &from in &F {
            for &to in &F {
                let s = Fmt::of(from).unwrap();
                let d = Fmt::of(to).unwrap();
                let w = 1 + s.exp + s.man;
                let inf = ((1u64 << s.exp) - 1) << s.man;
                for payload in [1u64, 1 << (s.man - 1), (1 << s.man) - 1, 1 << (s.man - 2)] {
                    for sign in [0, 1u64 << (w - 1)] {
                        let out = one(from, to, sign | inf | payload);
                        let dw = 1 + d.exp + d.man;
                        let dinf = ((1u64 << d.exp) - 1) << d.man;
                        assert_eq!(out & dinf, dinf, "{from}->{to} {payload:#x}");
                        assert_ne!(out & ((1 << d.man) - 1), 0, "{from}->{to} NaN kept");
                        assert_eq!(out >> (dw - 1), sign >> (w - 1), "sign");
                    }
                }
            }
        }
        assert_eq!(one(DType::Float32, DType::BFloat16, 0x7FC0_0000), 0x7FC0);
        assert_eq!(one(DType::Float32, DType::Float16, 0xFFC0_0000), 0xFE00);
        assert_eq!(one(DType::Float64, DType::Float16, 0x7FF8 << 48), 0x7E00);
        // Widening keeps a signalling NaN's bits; narrowing quiets.
        assert_eq!(one(DType::BFloat16, DType::Float32, 0x7F81), 0x7F81_0000);
        assert_eq!(one(DType::Float32, DType::BFloat16, 0x7F80_0001), 0x7FC0);
    }

    #[test]
    fn rejects_other_types_and_lengths() {
        let mut d = [0u8; 4];
        assert!(matches!(
            convert(DType::Int32, &[0; 4], DType::Float32, &mut d),
            Err(ConvertError::Unsupported { .. })
        ));
        assert!(matches!(
            convert(DType::Float16, &[0; 4], DType::Float32, &mut d),
            Err(ConvertError::Length { .. })
        ));
        assert!(Cast::FloatConvert.accepts(DType::Float32, DType::BFloat16));
        assert!(!Cast::Exact.accepts(DType::Float32, DType::BFloat16));
        assert!(Cast::Exact.accepts(DType::Int8, DType::Int8));
        assert!(!Cast::FloatConvert.accepts(DType::Int32, DType::Float32));
    }
}
