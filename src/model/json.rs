//! The JSON every reader of the format parses (spec section 4.1, step 1, and section 16.5):
//! RFC 8259 text in UTF-8 without a byte-order mark, no two members of one object with the
//! same name, numbers within the range of a binary64, and arrays and objects nested at most
//! [`MAX_JSON_DEPTH`] levels deep. The same rules hold for the root and array documents,
//! for `user` inside the root document, and for object values of encoding `json`; writers
//! check them before committing. No I/O.

use serde::de::{self, MapAccess, SeqAccess, Visitor};
use serde_json::Value;

/// The deepest nesting of arrays and objects a document may have, counting its outermost
/// value as level 1 (a scalar document has depth 0). The root `zarr.json` holds `user` at
/// level 4 (`{"attributes": {"zarrckpt": {"user": {…}}}}`), so `user` may nest
/// `MAX_JSON_DEPTH - 3` levels counting itself. (126: the deepest `serde_json` parses.)
pub const MAX_JSON_DEPTH: usize = 126;

/// The depth of `user` inside the root document (its own object is at this level).
pub const USER_LEVEL: usize = 4;

/// Parses `bytes` as the format requires (module documentation).
///
/// # Errors
/// A description of the first violation.
pub fn parse_strict(bytes: &[u8]) -> Result<Value, String> {
    struct Strict(usize);
    impl<'de> de::DeserializeSeed<'de> for Strict {
        type Value = Value;
        fn deserialize<D: de::Deserializer<'de>>(self, d: D) -> Result<Value, D::Error> {
            d.deserialize_any(self)
        }
    }
    impl Strict {
        fn nested<E: de::Error>(&self) -> Result<Strict, E> {
            let level = self.0 + 1;
            if level > MAX_JSON_DEPTH {
                return Err(E::custom(format!(
                    "arrays and objects nested more than {MAX_JSON_DEPTH} levels deep"
                )));
            }
            Ok(Strict(level))
        }
    }
    impl<'de> Visitor<'de> for Strict {
        type Value = Value;
        fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str("a JSON value")
        }
        fn visit_bool<E>(self, v: bool) -> Result<Value, E> {
            Ok(Value::Bool(v))
        }
        fn visit_i64<E>(self, v: i64) -> Result<Value, E> {
            Ok(Value::from(v))
        }
        fn visit_u64<E>(self, v: u64) -> Result<Value, E> {
            Ok(Value::from(v))
        }
        fn visit_f64<E: de::Error>(self, v: f64) -> Result<Value, E> {
            serde_json::Number::from_f64(v)
                .map(Value::Number)
                .ok_or_else(|| E::custom("a number that is not finite"))
        }
        fn visit_str<E>(self, v: &str) -> Result<Value, E> {
            Ok(Value::String(v.to_owned()))
        }
        fn visit_string<E>(self, v: String) -> Result<Value, E> {
            Ok(Value::String(v))
        }
        fn visit_unit<E>(self) -> Result<Value, E> {
            Ok(Value::Null)
        }
        fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Value, A::Error> {
            let inner = self.nested()?;
            let mut out = Vec::new();
            while let Some(v) = seq.next_element_seed(Strict(inner.0))? {
                out.push(v);
            }
            Ok(Value::Array(out))
        }
        fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Value, A::Error> {
            let inner = self.nested()?;
            let mut out = serde_json::Map::new();
            while let Some(k) = map.next_key::<String>()? {
                let v = map.next_value_seed(Strict(inner.0))?;
                if out.contains_key(&k) {
                    return Err(de::Error::custom(format!("duplicate member {k:?}")));
                }
                out.insert(k, v);
            }
            Ok(Value::Object(out))
        }
    }

    if bytes.starts_with(b"\xEF\xBB\xBF") {
        return Err("starts with a byte-order mark (U+FEFF)".into());
    }
    if let Err(e) = std::str::from_utf8(bytes) {
        return Err(format!("not UTF-8: {e}"));
    }
    let mut d = serde_json::Deserializer::from_slice(bytes);
    let v = de::DeserializeSeed::deserialize(Strict(0), &mut d).map_err(|e| e.to_string())?;
    d.end().map_err(|e| e.to_string())?;
    Ok(v)
}

/// The nesting depth of `v`: 0 for a scalar, 1 for an array or object of scalars. Iterative,
/// so a value built deeper than any parser accepts cannot overflow the stack here.
#[must_use]
pub fn depth(v: &Value) -> usize {
    let mut deepest = 0;
    let mut stack: Vec<(&Value, usize)> = vec![(v, 0)];
    while let Some((v, d)) = stack.pop() {
        match v {
            Value::Array(a) => {
                deepest = deepest.max(d + 1);
                stack.extend(a.iter().map(|x| (x, d + 1)));
            }
            Value::Object(o) => {
                deepest = deepest.max(d + 1);
                stack.extend(o.values().map(|x| (x, d + 1)));
            }
            _ => {}
        }
    }
    deepest
}

#[cfg(test)]
mod tests {
    use super::*;

    fn nested(levels: usize) -> String {
        format!("{}{}", "[".repeat(levels), "]".repeat(levels))
    }

    #[test]
    fn depth_limit_is_exact_and_matches_depth() {
        let ok = parse_strict(nested(MAX_JSON_DEPTH).as_bytes()).unwrap();
        assert_eq!(depth(&ok), MAX_JSON_DEPTH);
        let e = parse_strict(nested(MAX_JSON_DEPTH + 1).as_bytes()).unwrap_err();
        assert!(e.contains("nested"), "{e}");
        assert_eq!(depth(&Value::from(1)), 0);
        assert_eq!(depth(&serde_json::json!({"a": [1, {"b": {}}]})), 4);
    }

    #[test]
    fn numbers_duplicates_and_surrogates() {
        assert!(parse_strict(b"1e400").is_err());
        assert!(parse_strict(b"-1e400").is_err());
        assert!(parse_strict(b"1e308").is_ok());
        // Integers beyond 64 bits read as the nearest binary64.
        assert_eq!(
            parse_strict(b"18446744073709551616").unwrap().as_f64(),
            Some(18_446_744_073_709_551_616.0)
        );
        assert!(parse_strict(br#"{"a":1,"\u0061":2}"#).is_err());
        assert!(parse_strict(br#""\uD800""#).is_err());
        assert!(parse_strict(br#""\uD83D\uDE00""#).is_ok());
    }
}
