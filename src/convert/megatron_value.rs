//! Megatron values without pickle: a value read from a `torch.save` pickle (by the restricted
//! reader of [`super::pickle`], which runs nothing) encoded as zarrckpt's Megatron backend
//! stores objects and the common state (`python/zarrckpt/megatron.py`, `encode_value`), byte
//! for byte: JSON when the value is plain JSON, else `ZCKPTMG\x01`, the length of a JSON
//! header (8 bytes, little endian), the header (`{"value": TREE, "buffers": [[offset,
//! length], ...]}`, written as Python's `json.dumps` writes it, padded with spaces to a
//! multiple of 8) and the raw buffers of tensors, numpy arrays and bytes (each padded with
//! zeros to a multiple of 8).
//!
//! What a pickle can hold here is what the Python encoder accepts and can be read without
//! running code: `None`, `bool`, `int` (64 bits), `float`, `str`, `bytes` / `bytearray`,
//! `list`, `tuple`, `dict` / `OrderedDict` (any of these as keys), `set`, `frozenset`,
//! tensors and `nn.Parameter`s, `torch.Size`, `torch.dtype`, numpy arrays and scalars of
//! numeric dtypes, `argparse.Namespace`, `types.SimpleNamespace` and `io.BytesIO`. Anything
//! else (an enum member, a user's class) is refused, naming the class and where the value is.

use std::fmt::Write as _;
use std::path::Path;

use super::dcp::TorchSave;
use super::error::FormatError;
use super::pickle::{AllowList, Value};
use crate::ObjectValue;

/// The globals a Megatron `torch_dist` object or `common.pt` may name: torch's tensor
/// records, storages and dtypes, numpy's array and scalar records, and the plain classes
/// above. Naming is all they do: the reader calls nothing.
pub const MEGATRON_ALLOW: AllowList<'static> = &[
    ("torch._utils", "_rebuild_tensor_v2"),
    ("torch._utils", "_rebuild_parameter"),
    ("torch", "*"),
    ("collections", "OrderedDict"),
    ("_codecs", "encode"),
    ("builtins", "set"),
    ("builtins", "frozenset"),
    ("builtins", "bytearray"),
    ("__builtin__", "set"),
    ("__builtin__", "frozenset"),
    ("__builtin__", "bytearray"),
    ("argparse", "Namespace"),
    ("types", "SimpleNamespace"),
    ("_io", "BytesIO"),
    ("numpy", "ndarray"),
    ("numpy", "dtype"),
    ("numpy.dtypes", "*"),
    ("numpy.core.multiarray", "_reconstruct"),
    ("numpy.core.multiarray", "scalar"),
    ("numpy._core.multiarray", "_reconstruct"),
    ("numpy._core.multiarray", "scalar"),
];

const MAGIC: &[u8; 8] = b"ZCKPTMG\x01";
const TAG: &str = "__zarrckpt__";

/// torch dtypes by the name they pickle as (the encoder stores the name).
const TORCH_DTYPES: &[&str] = &[
    "bool",
    "int8",
    "int16",
    "int32",
    "int64",
    "uint8",
    "uint16",
    "uint32",
    "uint64",
    "float16",
    "bfloat16",
    "float32",
    "float64",
    "float8_e4m3fn",
    "float8_e5m2",
    "float8_e4m3fnuz",
    "float8_e5m2fnuz",
    "float8_e8m0fnu",
    "complex32",
    "complex64",
    "complex128",
];

/// A JSON tree in insertion order (Python's dict order).
#[derive(Debug, Clone, PartialEq)]
enum Enc {
    Null,
    Bool(bool),
    Int(i64),
    Float(f64),
    Str(String),
    List(Vec<Enc>),
    Obj(Vec<(String, Enc)>),
}

fn tagged(kind: &str, fields: Vec<(&str, Enc)>) -> Enc {
    let mut o = vec![(TAG.to_owned(), Enc::Str(kind.to_owned()))];
    o.extend(fields.into_iter().map(|(k, v)| (k.to_owned(), v)));
    Enc::Obj(o)
}

fn has_tag(e: &Enc) -> bool {
    match e {
        Enc::Obj(o) => o.iter().any(|(k, v)| k == TAG || has_tag(v)),
        Enc::List(l) => l.iter().any(has_tag),
        _ => false,
    }
}

struct Encoder<'s, 'a> {
    src: &'s TorchSave<'a>,
    path: &'s Path,
    item: &'s str,
    buffers: Vec<Vec<u8>>,
}

impl Encoder<'_, '_> {
    fn refuse(&self, at: &str, msg: impl std::fmt::Display) -> FormatError {
        FormatError::Dcp {
            path: self.path.to_owned(),
            item: self.item.to_owned(),
            msg: format!("at `{at}`: {msg}"),
        }
    }

    fn buffer(&mut self, data: Vec<u8>) -> Enc {
        self.buffers.push(data);
        Enc::Int(i64::try_from(self.buffers.len() - 1).unwrap_or(i64::MAX))
    }

    fn all(&mut self, items: &[Value], at: &str) -> Result<Vec<Enc>, FormatError> {
        items
            .iter()
            .enumerate()
            .map(|(i, x)| self.enc(x, &format!("{at}[{i}]")))
            .collect()
    }

    #[allow(clippy::too_many_lines)]
    fn enc(&mut self, v: &Value, at: &str) -> Result<Enc, FormatError> {
        Ok(match v {
            Value::None => Enc::Null,
            Value::Bool(b) => Enc::Bool(*b),
            Value::Int(i) => Enc::Int(*i),
            Value::Float(f) if f.is_finite() => Enc::Float(*f),
            Value::Float(f) => {
                let r = if f.is_nan() {
                    "nan"
                } else if *f > 0.0 {
                    "inf"
                } else {
                    "-inf"
                };
                tagged("float", vec![("v", Enc::Str(r.into()))])
            }
            Value::Str(s) => Enc::Str(s.clone()),
            Value::Bytes(b) => {
                let i = self.buffer(b.clone());
                tagged("bytes", vec![("buf", i)])
            }
            Value::List(items) => Enc::List(self.all(items, at)?),
            Value::Tuple(items) => tagged("tuple", vec![("v", Enc::List(self.all(items, at)?))]),
            Value::Set(items) => self.set("set", items, at)?,
            Value::FrozenSet(items) => self.set("frozenset", items, at)?,
            Value::Dict(items) => self.dict(items, at)?,
            Value::Global { module, name }
                if module == "torch" && TORCH_DTYPES.contains(&name.as_str()) =>
            {
                tagged("torch.dtype", vec![("v", Enc::Str(name.clone()))])
            }
            Value::Object {
                module,
                name,
                args,
                state,
            } => {
                let state = state.as_deref();
                match (module.as_str(), name.as_str()) {
                    ("torch._utils", "_rebuild_tensor_v2") => self.tensor(args, at)?,
                    ("torch._utils", "_rebuild_parameter") => match args.first() {
                        Some(t @ Value::Object { .. }) => self.enc(t, at)?,
                        _ => return Err(self.refuse(at, "a Parameter without its tensor")),
                    },
                    ("torch", "Size") => {
                        let items = match args.first() {
                            None => Vec::new(),
                            Some(Value::List(a) | Value::Tuple(a))
                                if a.iter().all(|x| matches!(x, Value::Int(_))) =>
                            {
                                self.all(a, at)?
                            }
                            Some(_) => return Err(self.refuse(at, "a torch.Size of non-ints")),
                        };
                        tagged("torch.Size", vec![("v", Enc::List(items))])
                    }
                    ("collections", "OrderedDict") if args.is_empty() => match state {
                        None => Enc::Obj(Vec::new()),
                        Some(Value::Dict(items)) => self.dict(items, at)?,
                        Some(_) => return Err(self.refuse(at, "an OrderedDict with odd state")),
                    },
                    ("builtins" | "__builtin__", kind @ ("set" | "frozenset")) => {
                        match args.first() {
                            None => self.set(kind, &[], at)?,
                            Some(Value::List(a) | Value::Tuple(a)) => self.set(kind, a, at)?,
                            Some(_) => return Err(self.refuse(at, format!("a {kind} of odd args"))),
                        }
                    }
                    ("builtins" | "__builtin__", "bytearray") => {
                        let b = match args.as_slice() {
                            [] => Vec::new(),
                            [Value::Bytes(b)] => b.clone(),
                            [Value::Str(s), Value::Str(e)] if e == "latin-1" || e == "latin1" => {
                                latin1(s)
                                    .ok_or_else(|| self.refuse(at, "a bytearray not latin-1"))?
                            }
                            _ => return Err(self.refuse(at, "a bytearray of odd args")),
                        };
                        let i = self.buffer(b);
                        tagged("bytes", vec![("buf", i)])
                    }
                    ("argparse", "Namespace") => self.namespace("Namespace", args, state, at)?,
                    ("types", "SimpleNamespace") => {
                        self.namespace("SimpleNamespace", args, state, at)?
                    }
                    ("_io", "BytesIO") => {
                        let b = match (args.first(), state) {
                            (Some(Value::Bytes(b)), _) => b.clone(),
                            (_, Some(Value::Tuple(t))) => match t.first() {
                                Some(Value::Bytes(b)) => b.clone(),
                                _ => return Err(self.refuse(at, "a BytesIO without its bytes")),
                            },
                            (None, None) => Vec::new(),
                            _ => return Err(self.refuse(at, "a BytesIO without its bytes")),
                        };
                        let i = self.buffer(b);
                        tagged("BytesIO", vec![("buf", i)])
                    }
                    ("numpy.core.multiarray" | "numpy._core.multiarray", "_reconstruct") => {
                        self.ndarray(args, state, at)?
                    }
                    ("numpy.core.multiarray" | "numpy._core.multiarray", "scalar") => {
                        self.npscalar(args, at)?
                    }
                    _ => return Err(self.unknown(v, at)),
                }
            }
            other => return Err(self.unknown(other, at)),
        })
    }

    fn unknown(&self, v: &Value, at: &str) -> FormatError {
        self.refuse(
            at,
            format!(
                "a {} value, which this importer cannot read without running the pickle (it \
                 reads tensors, numpy arrays, plain data, argparse / SimpleNamespace, BytesIO); \
                 the Python package's zarrckpt.dcp.import_megatron(..., weights_only=False) \
                 (python -m zarrckpt.migrate --megatron --trust-pickles) unpickles with torch, \
                 running whatever code the pickle holds",
                v.type_name()
            ),
        )
    }

    fn set(&mut self, kind: &str, items: &[Value], at: &str) -> Result<Enc, FormatError> {
        let items = items
            .iter()
            .map(|x| self.enc(x, &format!("{at}{{}}")))
            .collect::<Result<_, _>>()?;
        Ok(tagged(kind, vec![("v", Enc::List(items))]))
    }

    fn dict(&mut self, items: &[(Value, Value)], at: &str) -> Result<Enc, FormatError> {
        let plain = items
            .iter()
            .all(|(k, _)| matches!(k, Value::Str(s) if s != TAG));
        if plain {
            let mut o = Vec::with_capacity(items.len());
            for (k, x) in items {
                let Value::Str(k) = k else { unreachable!() };
                o.push((k.clone(), self.enc(x, &format!("{at}.{k}"))?));
            }
            return Ok(Enc::Obj(o));
        }
        let mut pairs = Vec::with_capacity(items.len());
        for (k, x) in items {
            let ek = self.enc(k, &format!("{at}<key>"))?;
            let ex = self.enc(x, &format!("{at}[{}]", short(k)))?;
            pairs.push(Enc::List(vec![ek, ex]));
        }
        Ok(tagged("dict", vec![("v", Enc::List(pairs))]))
    }

    fn namespace(
        &mut self,
        kind: &str,
        args: &[Value],
        state: Option<&Value>,
        at: &str,
    ) -> Result<Enc, FormatError> {
        // argparse.Namespace: NEWOBJ(cls, ()) + BUILD(__dict__); SimpleNamespace:
        // REDUCE(cls, ()) + BUILD(__dict__), or its attributes as a dict argument.
        let d = match (args, state) {
            ([], None) => &[][..],
            ([], Some(Value::Dict(d))) | ([Value::Dict(d)], None) => d.as_slice(),
            _ => return Err(self.refuse(at, format!("a {kind} with odd state"))),
        };
        let mut o = Vec::with_capacity(d.len());
        for (k, x) in d {
            let Value::Str(k) = k else {
                return Err(self.refuse(at, format!("a {kind} attribute that is not a str")));
            };
            o.push((k.clone(), self.enc(x, &format!("{at}.{k}"))?));
        }
        Ok(tagged(kind, vec![("v", Enc::Obj(o))]))
    }

    fn tensor(&mut self, args: &[Value], at: &str) -> Result<Enc, FormatError> {
        let (dtype, shape, data) = self.src.tensor(args)?;
        let shape = shape_enc(&shape).ok_or_else(|| self.refuse(at, "a dimension over 2^63"))?;
        let i = self.buffer(data.into_owned());
        Ok(tagged(
            "tensor",
            vec![
                ("dtype", Enc::Str(dtype.name().into())),
                ("shape", shape),
                ("buf", i),
            ],
        ))
    }

    /// `_reconstruct(ndarray, (0,), b"b")` + `BUILD((version, shape, dtype, fortran, raw))`.
    fn ndarray(
        &mut self,
        args: &[Value],
        state: Option<&Value>,
        at: &str,
    ) -> Result<Enc, FormatError> {
        if !matches!(args.first(), Some(Value::Global { module, name }) if module == "numpy" && name == "ndarray")
        {
            return Err(self.refuse(at, "a numpy _reconstruct of something other than ndarray"));
        }
        let Some(Value::Tuple(st)) = state else {
            return Err(self.refuse(at, "a numpy array without its state"));
        };
        let [Value::Int(_), shape, dtype, Value::Bool(fortran), raw] = st.as_slice() else {
            return Err(self.refuse(
                at,
                "a numpy array state that is not (version, shape, dtype, fortran, data)",
            ));
        };
        let shape: Vec<u64> = match shape {
            Value::Tuple(d) | Value::List(d) => d
                .iter()
                .map(|x| match x {
                    Value::Int(i) => u64::try_from(*i).ok(),
                    _ => None,
                })
                .collect::<Option<_>>()
                .ok_or_else(|| self.refuse(at, "a numpy shape of non-negative ints"))?,
            _ => return Err(self.refuse(at, "a numpy array without a shape")),
        };
        let (dstr, size) = self.np_dtype(dtype, at)?;
        let Value::Bytes(raw) = raw else {
            return Err(self.refuse(
                at,
                format!("a numpy array of dtype {dstr} whose data is not raw bytes"),
            ));
        };
        let numel = shape
            .iter()
            .try_fold(1u64, |a, &d| a.checked_mul(d))
            .ok_or_else(|| self.refuse(at, "a numpy shape whose size overflows"))?;
        let want = numel.checked_mul(size as u64);
        if want != Some(raw.len() as u64) {
            return Err(self.refuse(
                at,
                format!(
                    "a numpy array of shape {shape:?} and dtype {dstr} with {} data bytes",
                    raw.len()
                ),
            ));
        }
        let data = if *fortran && shape.len() > 1 {
            fortran_to_c(raw, &shape, size)
        } else {
            raw.clone()
        };
        let shape = shape_enc(&shape).ok_or_else(|| self.refuse(at, "a dimension over 2^63"))?;
        let i = self.buffer(data);
        Ok(tagged(
            "ndarray",
            vec![("dtype", Enc::Str(dstr)), ("shape", shape), ("buf", i)],
        ))
    }

    /// `scalar(dtype, raw)`.
    fn npscalar(&mut self, args: &[Value], at: &str) -> Result<Enc, FormatError> {
        let [dtype, Value::Bytes(raw)] = args else {
            return Err(self.refuse(at, "a numpy scalar that is not (dtype, bytes)"));
        };
        let (dstr, size) = self.np_dtype(dtype, at)?;
        if raw.len() != size {
            return Err(self.refuse(at, format!("a numpy {dstr} scalar of {} bytes", raw.len())));
        }
        let dstr = if dstr.ends_with("b1") {
            "bool".to_owned()
        } else {
            dstr
        };
        let i = self.buffer(raw.clone());
        Ok(tagged(
            "npscalar",
            vec![("dtype", Enc::Str(dstr)), ("buf", i)],
        ))
    }

    /// A numpy dtype record (`dtype("i8", False, True)` + `BUILD((3, "<", ...))`, under
    /// `numpy.dtype` or, since numpy 1.25, `numpy.dtypes.Int64DType` and its siblings): its
    /// type string (`dtype.str`, e.g. `<i8`) and item size. Numeric kinds only.
    fn np_dtype(&self, v: &Value, at: &str) -> Result<(String, usize), FormatError> {
        let Value::Object {
            module,
            args,
            state,
            ..
        } = v
        else {
            return Err(self.refuse(at, format!("a numpy dtype that is a {}", v.type_name())));
        };
        let (Some(Value::Str(code)), true) =
            (args.first(), module == "numpy" || module == "numpy.dtypes")
        else {
            return Err(self.refuse(at, format!("a numpy dtype record {}", v.type_name())));
        };
        let order = match state.as_deref() {
            Some(Value::Tuple(t)) => match t.get(1) {
                Some(Value::Str(o)) => o.clone(),
                _ => return Err(self.refuse(at, "a numpy dtype without its byte order")),
            },
            _ => return Err(self.refuse(at, "a numpy dtype without its state")),
        };
        let (kind, digits) = code.split_at(
            code.find(|c: char| c.is_ascii_digit())
                .unwrap_or(code.len()),
        );
        let size: usize = digits.parse().unwrap_or(0);
        let ok = matches!(
            (kind, size),
            ("b", 1) | ("i" | "u", 1 | 2 | 4 | 8) | ("f", 2 | 4 | 8) | ("c", 8 | 16)
        );
        if !ok {
            return Err(self.refuse(
                at,
                format!(
                    "a numpy array or scalar of dtype {code:?}, which is stored only for \
                     numeric dtypes (bool, int, uint, float, complex)"
                ),
            ));
        }
        let order = match order.as_str() {
            _ if size == 1 => "|",
            "<" | "=" => "<",
            ">" => ">",
            "|" => "|",
            o => return Err(self.refuse(at, format!("a numpy byte order {o:?}"))),
        };
        Ok((format!("{order}{kind}{size}"), size))
    }
}

fn latin1(s: &str) -> Option<Vec<u8>> {
    s.chars().map(|c| u8::try_from(u32::from(c)).ok()).collect()
}

fn short(k: &Value) -> String {
    match k {
        Value::Str(s) => format!("{s:?}"),
        Value::Int(i) => i.to_string(),
        other => other.type_name(),
    }
}

fn shape_enc(shape: &[u64]) -> Option<Enc> {
    shape
        .iter()
        .map(|&d| i64::try_from(d).ok().map(Enc::Int))
        .collect::<Option<Vec<_>>>()
        .map(Enc::List)
}

/// Fortran-ordered bytes of `shape` (elements of `size` bytes) in C order.
fn fortran_to_c(raw: &[u8], shape: &[u64], size: usize) -> Vec<u8> {
    let n = raw.len() / size.max(1);
    let mut out = Vec::with_capacity(raw.len());
    let mut index = vec![0u64; shape.len()];
    for _ in 0..n {
        // Fortran position of the C-order index.
        let mut at = 0u64;
        let mut stride = 1u64;
        for (&i, &d) in index.iter().zip(shape) {
            at += i * stride;
            stride *= d;
        }
        // Inside `raw`: the caller checked the shape's volume against its length.
        let at = usize::try_from(at).unwrap_or(usize::MAX) * size;
        out.extend_from_slice(&raw[at..at + size]);
        for d in (0..shape.len()).rev() {
            index[d] += 1;
            if index[d] < shape[d] {
                break;
            }
            index[d] = 0;
        }
    }
    out
}

/// Python's `repr` of a finite float (shortest round-trip digits; exponent notation when the
/// decimal point lies more than 16 places right or 4 places left of the first digit).
fn py_float(f: f64) -> String {
    if f == 0.0 {
        return if f.is_sign_negative() { "-0.0" } else { "0.0" }.into();
    }
    let e = format!("{f:e}");
    let (mant, exp) = e.split_once('e').unwrap_or((&e, "0"));
    let exp: i64 = exp.parse().unwrap_or(0);
    let neg = mant.starts_with('-');
    let digits: String = mant.chars().filter(char::is_ascii_digit).collect();
    let decpt = exp + 1;
    let nd = i64::try_from(digits.len()).unwrap_or(i64::MAX);
    let mut s = String::new();
    if neg {
        s.push('-');
    }
    if -4 < decpt && decpt <= 16 {
        if decpt <= 0 {
            s.push_str("0.");
            for _ in 0..-decpt {
                s.push('0');
            }
            s.push_str(&digits);
        } else if decpt >= nd {
            s.push_str(&digits);
            for _ in 0..decpt - nd {
                s.push('0');
            }
            s.push_str(".0");
        } else {
            let (a, b) = digits.split_at(usize::try_from(decpt).unwrap_or(0));
            let _ = write!(s, "{a}.{b}");
        }
    } else {
        let (a, b) = digits.split_at(1);
        s.push_str(a);
        if !b.is_empty() {
            let _ = write!(s, ".{b}");
        }
        let x = decpt - 1;
        let _ = write!(s, "e{}{:02}", if x < 0 { '-' } else { '+' }, x.abs());
    }
    s
}

/// A string as Python's `json.dumps` writes it with `ensure_ascii=True`.
fn py_str(out: &mut String, s: &str) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            ' '..='~' => out.push(c),
            c => {
                let mut buf = [0u16; 2];
                for u in c.encode_utf16(&mut buf) {
                    let _ = write!(out, "\\u{u:04x}");
                }
            }
        }
    }
    out.push('"');
}

/// `json.dumps(tree)` with Python's default separators (`", "`, `": "`).
fn py_json(out: &mut String, e: &Enc) {
    match e {
        Enc::Null => out.push_str("null"),
        Enc::Bool(b) => out.push_str(if *b { "true" } else { "false" }),
        Enc::Int(i) => {
            let _ = write!(out, "{i}");
        }
        Enc::Float(f) => out.push_str(&py_float(*f)),
        Enc::Str(s) => py_str(out, s),
        Enc::List(l) => {
            out.push('[');
            for (i, x) in l.iter().enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                py_json(out, x);
            }
            out.push(']');
        }
        Enc::Obj(o) => {
            out.push('{');
            for (i, (k, x)) in o.iter().enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                py_str(out, k);
                out.push_str(": ");
                py_json(out, x);
            }
            out.push('}');
        }
    }
}

fn to_serde(e: Enc) -> serde_json::Value {
    use serde_json::Value as J;
    match e {
        Enc::Null => J::Null,
        Enc::Bool(b) => J::Bool(b),
        Enc::Int(i) => J::from(i),
        // Finite (non-finite floats are tagged, and a tagged tree is not stored as JSON).
        Enc::Float(f) => serde_json::Number::from_f64(f).map_or(J::Null, J::Number),
        Enc::Str(s) => J::String(s),
        Enc::List(l) => J::Array(l.into_iter().map(to_serde).collect()),
        Enc::Obj(o) => J::Object(o.into_iter().map(|(k, v)| (k, to_serde(v))).collect()),
    }
}

/// Encodes `value` (the tree of `src`, or a part of it) as the Megatron backend stores it:
/// [`ObjectValue::Json`] for plain JSON, else [`ObjectValue::Bytes`] in the tagged format.
/// `path` and `item` name the source in errors; `at` names the value's place in messages.
///
/// # Errors
/// [`FormatError::Dcp`] naming `item`, the place in the value and the class of a value that
/// cannot be stored without running the pickle; errors of [`TorchSave::tensor`].
pub fn encode(
    src: &TorchSave<'_>,
    value: &Value,
    path: &Path,
    item: &str,
    at: &str,
) -> Result<ObjectValue, FormatError> {
    let mut e = Encoder {
        src,
        path,
        item,
        buffers: Vec::new(),
    };
    let tree = e.enc(value, at)?;
    if e.buffers.is_empty() && !has_tag(&tree) {
        return Ok(ObjectValue::Json(to_serde(tree)));
    }
    let mut spans = Vec::with_capacity(e.buffers.len());
    let mut offset = 0i64;
    for b in &e.buffers {
        let n = i64::try_from(b.len()).unwrap_or(i64::MAX);
        spans.push(Enc::List(vec![Enc::Int(offset), Enc::Int(n)]));
        offset = offset.saturating_add(n + (-n).rem_euclid(8));
    }
    let mut header = String::new();
    py_json(
        &mut header,
        &Enc::Obj(vec![
            ("value".into(), tree),
            ("buffers".into(), Enc::List(spans)),
        ]),
    );
    while !header.len().is_multiple_of(8) {
        header.push(' ');
    }
    let total: usize = e.buffers.iter().map(|b| b.len().next_multiple_of(8)).sum();
    let mut out = Vec::with_capacity(16 + header.len() + total);
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(&(header.len() as u64).to_le_bytes());
    out.extend_from_slice(header.as_bytes());
    for b in &e.buffers {
        out.extend_from_slice(b);
        out.resize(out.len().next_multiple_of(8), 0);
    }
    Ok(ObjectValue::Bytes(out))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn floats_as_python_writes_them() {
        for (f, want) in [
            (3e-4, "0.0003"),
            (1e-8, "1e-08"),
            (1e-5, "1e-05"),
            (1e-4, "0.0001"),
            (3.0, "3.0"),
            (1.5e18, "1.5e+18"),
            (1e16, "1e+16"),
            (1234567890123456.0, "1234567890123456.0"),
            (0.95, "0.95"),
            (-2.5, "-2.5"),
            (-0.0, "-0.0"),
            (123.456, "123.456"),
            (f64::MAX, "1.7976931348623157e+308"),
            (5e-324, "5e-324"),
        ] {
            assert_eq!(py_float(f), want, "{f}");
        }
    }

    #[test]
    fn strings_as_python_writes_them() {
        let mut s = String::new();
        py_str(&mut s, "a\"b\\c\n\u{1}\u{7f}é😀");
        assert_eq!(s, r#""a\"b\\c\n\u0001\u007f\u00e9\ud83d\ude00""#);
    }

    #[test]
    fn fortran_order_is_transposed() {
        // [[0, 1, 2], [3, 4, 5]] stored column-major: 0 3 1 4 2 5.
        let raw = [0u8, 3, 1, 4, 2, 5];
        assert_eq!(fortran_to_c(&raw, &[2, 3], 1), vec![0, 1, 2, 3, 4, 5]);
    }
}
