//! Element data types of checkpoint tensors.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

/// The element type of a tensor.
///
/// Every variant is a fixed-size type whose bytes are stored little endian. Names follow
/// the Zarr v3 data type registry (`data_type` in an array's `zarr.json`), which is also the
/// name used in the checkpoint's own metadata.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
#[non_exhaustive]
pub enum DType {
    /// `bool`: one byte, 0 or 1.
    Bool,
    /// `int8`.
    Int8,
    /// `int16`.
    Int16,
    /// `int32`.
    Int32,
    /// `int64`.
    Int64,
    /// `uint8`.
    UInt8,
    /// `uint16`.
    UInt16,
    /// `uint32`.
    UInt32,
    /// `uint64`.
    UInt64,
    /// `float16` (IEEE 754 binary16).
    Float16,
    /// `bfloat16` (the upper half of a binary32).
    BFloat16,
    /// `float32`.
    Float32,
    /// `float64`.
    Float64,
    /// `float8_e4m3fn`: 4 exponent bits, 3 mantissa bits, finite only (max 448), as in PyTorch
    /// `torch.float8_e4m3fn` and the OCP FP8 spec. Not the registry's IEEE-like `float8_e4m3`.
    Float8E4M3FN,
    /// `float8_e5m2`: 5 exponent bits, 2 mantissa bits, IEEE-like (with inf and NaN).
    Float8E5M2,
}

impl DType {
    /// Every supported data type, in a stable order.
    pub const ALL: [DType; 15] = [
        DType::Bool,
        DType::Int8,
        DType::Int16,
        DType::Int32,
        DType::Int64,
        DType::UInt8,
        DType::UInt16,
        DType::UInt32,
        DType::UInt64,
        DType::Float16,
        DType::BFloat16,
        DType::Float32,
        DType::Float64,
        DType::Float8E4M3FN,
        DType::Float8E5M2,
    ];

    /// Size of one element in bytes.
    #[must_use]
    pub const fn size(self) -> usize {
        match self {
            DType::Bool | DType::Int8 | DType::UInt8 | DType::Float8E4M3FN | DType::Float8E5M2 => 1,
            DType::Int16 | DType::UInt16 | DType::Float16 | DType::BFloat16 => 2,
            DType::Int32 | DType::UInt32 | DType::Float32 => 4,
            DType::Int64 | DType::UInt64 | DType::Float64 => 8,
        }
    }

    /// The Zarr v3 `data_type` name.
    #[must_use]
    pub const fn name(self) -> &'static str {
        match self {
            DType::Bool => "bool",
            DType::Int8 => "int8",
            DType::Int16 => "int16",
            DType::Int32 => "int32",
            DType::Int64 => "int64",
            DType::UInt8 => "uint8",
            DType::UInt16 => "uint16",
            DType::UInt32 => "uint32",
            DType::UInt64 => "uint64",
            DType::Float16 => "float16",
            DType::BFloat16 => "bfloat16",
            DType::Float32 => "float32",
            DType::Float64 => "float64",
            DType::Float8E4M3FN => "float8_e4m3fn",
            DType::Float8E5M2 => "float8_e5m2",
        }
    }

    /// Parses a Zarr v3 `data_type` name; `None` for names this crate does not support.
    #[must_use]
    pub fn from_name(name: &str) -> Option<DType> {
        DType::ALL.into_iter().find(|d| d.name() == name)
    }

    /// A compact code used in the binary layout descriptions ranks exchange.
    #[must_use]
    pub(crate) fn code(self) -> u8 {
        // The position in `ALL`; `ALL` has 15 entries, so this always fits.
        DType::ALL
            .iter()
            .position(|d| *d == self)
            .and_then(|p| u8::try_from(p).ok())
            .unwrap_or(u8::MAX)
    }

    /// Inverse of [`DType::code`].
    #[must_use]
    pub(crate) fn from_code(code: u8) -> Option<DType> {
        DType::ALL.get(usize::from(code)).copied()
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// The error for a data type name this crate does not support.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unsupported data type `{0}`")]
pub struct UnknownDType(pub String);

impl FromStr for DType {
    type Err = UnknownDType;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        DType::from_name(s).ok_or_else(|| UnknownDType(s.to_owned()))
    }
}

impl TryFrom<String> for DType {
    type Error = UnknownDType;
    fn try_from(s: String) -> Result<Self, Self::Error> {
        s.parse()
    }
}

impl From<DType> for String {
    fn from(d: DType) -> String {
        d.name().to_owned()
    }
}

/// The value of a float8 byte: `float8_e4m3fn` (finite only, NaN = S.1111.111) or
/// `float8_e5m2` (IEEE-like); `None` for other data types.
#[must_use]
pub fn float8_value(dtype: DType, b: u8) -> Option<f64> {
    let sign = if b & 0x80 == 0 { 1.0 } else { -1.0 };
    let (e, m, mbits, bias) = match dtype {
        DType::Float8E4M3FN => {
            let (e, m) = (i32::from((b >> 3) & 0xF), f64::from(b & 7));
            if e == 15 && m == 7.0 {
                return Some(f64::NAN);
            }
            (e, m, 8.0, 7)
        }
        DType::Float8E5M2 => {
            let (e, m) = (i32::from((b >> 2) & 0x1F), f64::from(b & 3));
            if e == 31 {
                return Some(if m == 0.0 {
                    sign * f64::INFINITY
                } else {
                    f64::NAN
                });
            }
            (e, m, 4.0, 15)
        }
        _ => return None,
    };
    Some(if e == 0 {
        sign * m / mbits * 2f64.powi(1 - bias)
    } else {
        sign * (1.0 + m / mbits) * 2f64.powi(e - bias)
    })
}

/// The float8 byte for a Zarr `fill_value` given as a number or `"NaN"` / `"Infinity"` /
/// `"-Infinity"`; `None` when not exactly representable (or not a float8 type).
#[must_use]
pub fn float8_bits(dtype: DType, fill: &serde_json::Value) -> Option<u8> {
    let target = match fill {
        serde_json::Value::Number(n) => n.as_f64()?,
        serde_json::Value::String(s) => match s.as_str() {
            "NaN" => f64::NAN,
            "Infinity" => f64::INFINITY,
            "-Infinity" => f64::NEG_INFINITY,
            _ => return None,
        },
        _ => return None,
    };
    if target.is_nan() {
        // The canonical positive NaN.
        return match dtype {
            DType::Float8E4M3FN => Some(0x7F),
            DType::Float8E5M2 => Some(0x7E),
            _ => None,
        };
    }
    (0..=255u8).find(|&b| {
        float8_value(dtype, b)
            .is_some_and(|v| v == target && v.is_sign_negative() == target.is_sign_negative())
    })
}

/// Rust element types that map to one [`DType`], for typed constructors.
///
/// # Safety
/// Implementors must be plain old data whose size equals `DTYPE.size()` and whose every bit
/// pattern is valid.
pub unsafe trait Element: Copy + Send + Sync + 'static {
    /// The data type of this element.
    const DTYPE: DType;
}

macro_rules! element {
    ($t:ty, $d:expr) => {
        // SAFETY: primitive numeric types are plain old data of the stated size.
        unsafe impl Element for $t {
            const DTYPE: DType = $d;
        }
    };
}
element!(i8, DType::Int8);
element!(i16, DType::Int16);
element!(i32, DType::Int32);
element!(i64, DType::Int64);
element!(u8, DType::UInt8);
element!(u16, DType::UInt16);
element!(u32, DType::UInt32);
element!(u64, DType::UInt64);
element!(half::f16, DType::Float16);
element!(half::bf16, DType::BFloat16);
element!(f32, DType::Float32);
element!(f64, DType::Float64);

/// Views a slice of elements as bytes.
#[must_use]
pub fn as_bytes<T: Element>(data: &[T]) -> &[u8] {
    // SAFETY: `Element` types are plain old data; the byte length is exact.
    unsafe { std::slice::from_raw_parts(data.as_ptr().cast::<u8>(), std::mem::size_of_val(data)) }
}

/// Views a mutable slice of elements as bytes.
#[must_use]
pub fn as_bytes_mut<T: Element>(data: &mut [T]) -> &mut [u8] {
    // SAFETY: `Element` types are plain old data and every bit pattern is valid.
    unsafe {
        std::slice::from_raw_parts_mut(data.as_mut_ptr().cast::<u8>(), std::mem::size_of_val(data))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_and_codes_are_dense() {
        for (i, d) in DType::ALL.iter().enumerate() {
            assert_eq!(DType::from_name(d.name()), Some(*d));
            assert_eq!(usize::from(d.code()), i);
            assert_eq!(DType::from_code(d.code()), Some(*d));
        }
        assert_eq!(
            DType::from_name("float8_e4m3"),
            None,
            "IEEE e4m3 is not e4m3fn"
        );
        assert!("complex64".parse::<DType>().is_err());
    }

    #[test]
    fn serde_uses_registry_names() {
        let json = serde_json::to_string(&DType::Float8E4M3FN).unwrap();
        assert_eq!(json, "\"float8_e4m3fn\"");
        let back: DType = serde_json::from_str("\"bfloat16\"").unwrap();
        assert_eq!(back, DType::BFloat16);
        assert!(serde_json::from_str::<DType>("\"float128\"").is_err());
    }
}
