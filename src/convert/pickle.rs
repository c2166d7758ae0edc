//! A Python pickle reader that never executes anything: a restricted opcode interpreter that
//! builds a value tree.
//!
//! Why not a crate: `serde-pickle` refuses class instances (or turns them into `None`), has no
//! hook for persistent ids (`BINPERSID`, which every `torch.save` uses for its storages) and
//! none for `BUILD` state; DCP's `.metadata` is made of class instances. The candle and
//! `repugnant-pickle` readers come with a whole tensor framework or are unmaintained. So this
//! is a small interpreter of its own: `GLOBAL` / `STACK_GLOBAL` only *name* a class or a
//! function, and are accepted only from the caller's allow-list (anything else is
//! [`PickleError::Forbidden`] before any later opcode is looked at); `REDUCE`, `NEWOBJ` and
//! `BUILD` never call anything, they record the callable's name, its arguments and its state
//! as an [`Value::Object`]. The one exception is `_codecs.encode(str, "latin1")`, how protocol
//! 2 spells `bytes`, evaluated here as the pure function it is.
//!
//! Limits: the input size ([`MAX_PICKLE_BYTES`]), the number of values built
//! ([`MAX_NODES`], which also bounds the stack, the marks and the memo), and the nesting of the
//! tree handed out ([`MAX_DEPTH`]; a self-referencing pickle ends there). Every failure is a
//! typed [`PickleError`] naming the byte position.

use std::collections::HashMap;

/// The largest pickle read, in bytes.
pub const MAX_PICKLE_BYTES: usize = 1 << 30;
/// The most values (containers, scalars, objects) one pickle may build.
pub const MAX_NODES: usize = 1 << 24;
/// The deepest nesting of the tree handed out.
pub const MAX_DEPTH: usize = 256;

/// A value of a pickle, as a tree. Nothing in it was executed.
#[derive(Debug, Clone, PartialEq)]
pub enum Value {
    /// `None`.
    None,
    /// `True` / `False`.
    Bool(bool),
    /// An integer that fits an `i64`.
    Int(i64),
    /// A float.
    Float(f64),
    /// A `str`.
    Str(String),
    /// `bytes` or `bytearray`.
    Bytes(Vec<u8>),
    /// A `list`.
    List(Vec<Value>),
    /// A `tuple`.
    Tuple(Vec<Value>),
    /// A `dict`, in insertion order.
    Dict(Vec<(Value, Value)>),
    /// A `set`.
    Set(Vec<Value>),
    /// A `frozenset` (the `FROZENSET` opcode).
    FrozenSet(Vec<Value>),
    /// A global the pickle named (a class or a function), not resolved.
    Global {
        /// The module.
        module: String,
        /// The qualified name.
        name: String,
    },
    /// What `REDUCE` / `NEWOBJ` of an allowed global with these arguments, then `BUILD` with
    /// this state, would have made: recorded, not made.
    Object {
        /// The callable's module.
        module: String,
        /// The callable's name.
        name: String,
        /// The arguments.
        args: Vec<Value>,
        /// The `BUILD` state, if any.
        state: Option<Box<Value>>,
    },
    /// A persistent id (`torch.save`'s reference to a storage record).
    PersId(Box<Value>),
}

impl Value {
    /// The attribute `name` of an object built from a dict state (`BUILD` with a dict, or with
    /// a `(dict, slots)` pair).
    #[must_use]
    pub fn attr(&self, name: &str) -> Option<&Value> {
        let Value::Object {
            state: Some(state), ..
        } = self
        else {
            return None;
        };
        fn find<'v>(d: &'v Value, name: &str) -> Option<&'v Value> {
            match d {
                Value::Dict(items) => items
                    .iter()
                    .find(|(k, _)| matches!(k, Value::Str(s) if s == name))
                    .map(|(_, v)| v),
                _ => None,
            }
        }
        match state.as_ref() {
            Value::Tuple(pair) if pair.len() == 2 => {
                find(&pair[0], name).or_else(|| find(&pair[1], name))
            }
            d => find(d, name),
        }
    }

    /// `module.name` of an object or a global.
    #[must_use]
    pub fn class(&self) -> Option<String> {
        match self {
            Value::Object { module, name, .. } | Value::Global { module, name } => {
                Some(format!("{module}.{name}"))
            }
            _ => None,
        }
    }

    /// A short name of the value's type, for messages.
    #[must_use]
    pub fn type_name(&self) -> String {
        match self {
            Value::None => "NoneType".into(),
            Value::Bool(_) => "bool".into(),
            Value::Int(_) => "int".into(),
            Value::Float(_) => "float".into(),
            Value::Str(_) => "str".into(),
            Value::Bytes(_) => "bytes".into(),
            Value::List(_) => "list".into(),
            Value::Tuple(_) => "tuple".into(),
            Value::Dict(_) => "dict".into(),
            Value::Set(_) => "set".into(),
            Value::FrozenSet(_) => "frozenset".into(),
            Value::PersId(_) => "persistent id".into(),
            Value::Global { .. } | Value::Object { .. } => self.class().unwrap_or_default(),
        }
    }
}

/// Why a pickle was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum PickleError {
    /// The pickle names a global outside the allow-list (nothing was run).
    #[error(
        "byte {pos}: the pickle names `{module}.{name}`, which is not an allowed class (nothing was run)"
    )]
    Forbidden {
        /// Where.
        pos: usize,
        /// The module.
        module: String,
        /// The name.
        name: String,
    },
    /// An opcode this reader does not interpret.
    #[error("byte {pos}: unsupported pickle opcode 0x{op:02x}")]
    Opcode {
        /// Where.
        pos: usize,
        /// The opcode.
        op: u8,
    },
    /// The input ends inside an opcode or before `STOP`.
    #[error("byte {pos}: the pickle is truncated")]
    Truncated {
        /// Where.
        pos: usize,
    },
    /// A structural error (stack underflow, a missing mark, a memo key never stored, a
    /// container of the wrong kind, an integer too large, bad UTF-8).
    #[error("byte {pos}: malformed pickle: {msg}")]
    Malformed {
        /// Where.
        pos: usize,
        /// What.
        msg: String,
    },
    /// A limit was reached.
    #[error("byte {pos}: the pickle exceeds the limit of {limit} {what}")]
    Limit {
        /// Where.
        pos: usize,
        /// Which limit.
        what: &'static str,
        /// Its value.
        limit: usize,
    },
}

/// Which globals a pickle may name: `(module, name)` pairs, or a whole module with name `*`.
pub type AllowList<'a> = &'a [(&'a str, &'a str)];

enum Node {
    Scalar(Value),
    List(Vec<usize>),
    Tuple(Vec<usize>),
    Dict(Vec<(usize, usize)>),
    Set(Vec<usize>),
    FrozenSet(Vec<usize>),
    Object {
        module: String,
        name: String,
        args: Vec<usize>,
        state: Option<usize>,
    },
    PersId(usize),
}

struct Vm<'a> {
    data: &'a [u8],
    pos: usize,
    op_pos: usize,
    nodes: Vec<Node>,
    stack: Vec<usize>,
    marks: Vec<usize>,
    memo: HashMap<u64, usize>,
    allow: AllowList<'a>,
    out: std::cell::Cell<usize>,
}

/// Reads one pickle (up to its `STOP`) into a [`Value`] tree, accepting only the globals of
/// `allow`.
///
/// # Errors
/// [`PickleError`] for a forbidden global, an unsupported opcode, a truncated or malformed
/// pickle, or a limit reached.
pub fn read(data: &[u8], allow: AllowList<'_>) -> Result<Value, PickleError> {
    if data.len() > MAX_PICKLE_BYTES {
        return Err(PickleError::Limit {
            pos: 0,
            what: "bytes",
            limit: MAX_PICKLE_BYTES,
        });
    }
    let mut vm = Vm {
        data,
        pos: 0,
        op_pos: 0,
        nodes: Vec::new(),
        stack: Vec::new(),
        marks: Vec::new(),
        memo: HashMap::new(),
        allow,
        out: std::cell::Cell::new(0),
    };
    let top = vm.run()?;
    vm.tree(top, 0)
}

impl Vm<'_> {
    fn err(&self, msg: impl Into<String>) -> PickleError {
        PickleError::Malformed {
            pos: self.op_pos,
            msg: msg.into(),
        }
    }

    fn take(&mut self, n: usize) -> Result<&[u8], PickleError> {
        let end = self
            .pos
            .checked_add(n)
            .filter(|&e| e <= self.data.len())
            .ok_or(PickleError::Truncated { pos: self.op_pos })?;
        let s = &self.data[self.pos..end];
        self.pos = end;
        Ok(s)
    }

    fn u8(&mut self) -> Result<u8, PickleError> {
        Ok(self.take(1)?[0])
    }

    fn le<const N: usize>(&mut self) -> Result<[u8; N], PickleError> {
        let mut a = [0u8; N];
        a.copy_from_slice(self.take(N)?);
        Ok(a)
    }

    fn len_of(&self, n: u64) -> Result<usize, PickleError> {
        usize::try_from(n)
            .ok()
            .filter(|&n| n <= self.data.len())
            .ok_or(PickleError::Truncated { pos: self.op_pos })
    }

    fn line(&mut self) -> Result<&str, PickleError> {
        let rest = &self.data[self.pos..];
        let nl = rest
            .iter()
            .position(|&b| b == b'\n')
            .ok_or(PickleError::Truncated { pos: self.op_pos })?;
        let s = std::str::from_utf8(&rest[..nl]).map_err(|_| self.err("a line is not UTF-8"))?;
        self.pos += nl + 1;
        Ok(s)
    }

    fn node(&mut self, n: Node) -> Result<usize, PickleError> {
        if self.nodes.len() >= MAX_NODES {
            return Err(PickleError::Limit {
                pos: self.op_pos,
                what: "values",
                limit: MAX_NODES,
            });
        }
        self.nodes.push(n);
        Ok(self.nodes.len() - 1)
    }

    fn push(&mut self, n: Node) -> Result<(), PickleError> {
        let id = self.node(n)?;
        self.stack.push(id);
        Ok(())
    }

    fn push_scalar(&mut self, v: Value) -> Result<(), PickleError> {
        self.push(Node::Scalar(v))
    }

    fn pop(&mut self) -> Result<usize, PickleError> {
        self.stack.pop().ok_or_else(|| self.err("stack underflow"))
    }

    fn pop_mark(&mut self) -> Result<Vec<usize>, PickleError> {
        let m = self.marks.pop().ok_or_else(|| self.err("no mark"))?;
        if m > self.stack.len() {
            return Err(self.err("mark above the stack"));
        }
        Ok(self.stack.split_off(m))
    }

    fn top(&self) -> Result<usize, PickleError> {
        self.stack
            .last()
            .copied()
            .ok_or_else(|| self.err("stack underflow"))
    }

    fn str_of(&self, id: usize) -> Result<String, PickleError> {
        match &self.nodes[id] {
            Node::Scalar(Value::Str(s)) => Ok(s.clone()),
            _ => Err(self.err("a global's module or name is not a str")),
        }
    }

    fn global(&mut self, module: String, name: String) -> Result<(), PickleError> {
        let ok = self
            .allow
            .iter()
            .any(|(m, n)| *m == module && (*n == name || *n == "*"));
        if !ok {
            return Err(PickleError::Forbidden {
                pos: self.op_pos,
                module,
                name,
            });
        }
        self.push_scalar(Value::Global { module, name })
    }

    fn utf8(&mut self, n: usize) -> Result<(), PickleError> {
        let pos = self.op_pos;
        let b = self.take(n)?;
        let s = std::str::from_utf8(b)
            .map_err(|_| PickleError::Malformed {
                pos,
                msg: "a str is not UTF-8".into(),
            })?
            .to_owned();
        self.push_scalar(Value::Str(s))
    }

    fn bytes(&mut self, n: usize) -> Result<(), PickleError> {
        let b = self.take(n)?.to_vec();
        self.push_scalar(Value::Bytes(b))
    }

    fn long(&mut self, n: usize) -> Result<(), PickleError> {
        let b = self.take(n)?;
        if n > 8 {
            // Two's complement, little endian: fits an i64 only if the extra bytes are sign.
            let sign = if b[7] & 0x80 == 0 { 0u8 } else { 0xff };
            if b[8..].iter().any(|&x| x != sign) {
                return Err(self.err("an integer larger than 64 bits"));
            }
        }
        let mut a = [0u8; 8];
        let k = n.min(8);
        a[..k].copy_from_slice(&b[..k]);
        if k > 0 && k < 8 && b[k - 1] & 0x80 != 0 {
            a[k..].fill(0xff);
        }
        self.push_scalar(Value::Int(i64::from_le_bytes(a)))
    }

    fn memo_put(&mut self, key: u64) -> Result<(), PickleError> {
        let top = self.top()?;
        if self.memo.len() >= MAX_NODES {
            return Err(PickleError::Limit {
                pos: self.op_pos,
                what: "memo entries",
                limit: MAX_NODES,
            });
        }
        self.memo.insert(key, top);
        Ok(())
    }

    fn memo_get(&mut self, key: u64) -> Result<(), PickleError> {
        let id = *self
            .memo
            .get(&key)
            .ok_or_else(|| self.err(format!("memo key {key} was never stored")))?;
        self.stack.push(id);
        if self.stack.len() > MAX_NODES {
            return Err(PickleError::Limit {
                pos: self.op_pos,
                what: "stack entries",
                limit: MAX_NODES,
            });
        }
        Ok(())
    }

    fn call(&mut self, f: usize, args: Vec<usize>) -> Result<(), PickleError> {
        let Node::Scalar(Value::Global { module, name }) = &self.nodes[f] else {
            return Err(self.err("REDUCE / NEWOBJ of a value that is not a global"));
        };
        let (module, name) = (module.clone(), name.clone());
        if module == "_codecs" && name == "encode" {
            return self.codecs_encode(&args);
        }
        self.push(Node::Object {
            module,
            name,
            args,
            state: None,
        })
    }

    /// `_codecs.encode(s, "latin1")`: protocol 2's `bytes`.
    fn codecs_encode(&mut self, args: &[usize]) -> Result<(), PickleError> {
        let (Some(Node::Scalar(Value::Str(s))), Some(Node::Scalar(Value::Str(enc)))) = (
            args.first().map(|&a| &self.nodes[a]),
            args.get(1).map(|&a| &self.nodes[a]),
        ) else {
            return Err(self.err("_codecs.encode without (str, encoding)"));
        };
        if enc != "latin1" && enc != "latin-1" {
            return Err(self.err(format!("_codecs.encode with encoding {enc:?}")));
        }
        let b = s
            .chars()
            .map(|c| u8::try_from(u32::from(c)))
            .collect::<Result<Vec<u8>, _>>()
            .map_err(|_| self.err("_codecs.encode of a str that is not latin-1"))?;
        self.push_scalar(Value::Bytes(b))
    }

    fn args_of(&self, id: usize) -> Result<Vec<usize>, PickleError> {
        match &self.nodes[id] {
            Node::Tuple(items) => Ok(items.clone()),
            _ => Err(self.err("call arguments are not a tuple")),
        }
    }

    fn append(&mut self, list: usize, items: Vec<usize>) -> Result<(), PickleError> {
        match &mut self.nodes[list] {
            Node::List(v) | Node::Set(v) => {
                v.extend(items);
                Ok(())
            }
            _ => Err(self.err("APPEND to a value that is not a list")),
        }
    }

    fn set_items(&mut self, dict: usize, items: &[usize]) -> Result<(), PickleError> {
        if !items.len().is_multiple_of(2) {
            return Err(self.err("SETITEMS with an odd number of values"));
        }
        let pairs = items.chunks(2).map(|p| (p[0], p[1]));
        match &mut self.nodes[dict] {
            Node::Dict(v) => {
                v.extend(pairs);
                Ok(())
            }
            // OrderedDict() and other dict-like objects: items recorded as their state.
            Node::Object { .. } => {
                let pairs: Vec<(usize, usize)> = pairs.collect();
                let d = self.node(Node::Dict(pairs))?;
                match &mut self.nodes[dict] {
                    Node::Object { state, .. } if state.is_none() => {
                        *state = Some(d);
                        Ok(())
                    }
                    _ => Err(self.err("SETITEM twice on an object")),
                }
            }
            _ => Err(self.err("SETITEM on a value that is not a dict")),
        }
    }

    #[allow(clippy::too_many_lines)]
    fn run(&mut self) -> Result<usize, PickleError> {
        loop {
            self.op_pos = self.pos;
            let op = self.u8()?;
            match op {
                0x80 => {
                    // PROTO
                    let p = self.u8()?;
                    if p > 5 {
                        return Err(self.err(format!("protocol {p}")));
                    }
                }
                0x95 => {
                    // FRAME: a hint; the bytes follow inline.
                    self.take(8)?;
                }
                b'.' => return self.pop(),
                b'(' => {
                    if self.marks.len() >= MAX_NODES {
                        return Err(PickleError::Limit {
                            pos: self.op_pos,
                            what: "marks",
                            limit: MAX_NODES,
                        });
                    }
                    self.marks.push(self.stack.len());
                }
                b'0' => {
                    self.pop()?;
                }
                b'1' => {
                    self.pop_mark()?;
                }
                b'2' => {
                    let t = self.top()?;
                    self.stack.push(t);
                }
                b'N' => self.push_scalar(Value::None)?,
                0x88 => self.push_scalar(Value::Bool(true))?,
                0x89 => self.push_scalar(Value::Bool(false))?,
                b'J' => {
                    let v = i32::from_le_bytes(self.le()?);
                    self.push_scalar(Value::Int(v.into()))?;
                }
                b'K' => {
                    let v = self.u8()?;
                    self.push_scalar(Value::Int(v.into()))?;
                }
                b'M' => {
                    let v = u16::from_le_bytes(self.le()?);
                    self.push_scalar(Value::Int(v.into()))?;
                }
                b'I' | b'L' => {
                    let line = self.line()?.trim_end_matches('L').to_owned();
                    let v = match line.as_str() {
                        "00" => Value::Bool(false),
                        "01" => Value::Bool(true),
                        s => Value::Int(s.parse().map_err(|_| self.err("a bad INT line"))?),
                    };
                    self.push_scalar(v)?;
                }
                0x8a => {
                    // LONG1
                    let n = usize::from(self.u8()?);
                    self.long(n)?;
                }
                0x8b => {
                    // LONG4
                    let n = u32::from_le_bytes(self.le()?);
                    let n = self.len_of(n.into())?;
                    self.long(n)?;
                }
                b'G' => {
                    let v = f64::from_be_bytes(self.le()?);
                    self.push_scalar(Value::Float(v))?;
                }
                b'F' => {
                    let v = self
                        .line()?
                        .parse()
                        .map_err(|_| self.err("a bad FLOAT line"))?;
                    self.push_scalar(Value::Float(v))?;
                }
                0x8c => {
                    let n = usize::from(self.u8()?);
                    self.utf8(n)?;
                }
                b'X' => {
                    let n = u32::from_le_bytes(self.le()?);
                    let n = self.len_of(n.into())?;
                    self.utf8(n)?;
                }
                0x8d => {
                    let n = u64::from_le_bytes(self.le()?);
                    let n = self.len_of(n)?;
                    self.utf8(n)?;
                }
                b'C' => {
                    let n = usize::from(self.u8()?);
                    self.bytes(n)?;
                }
                b'B' => {
                    let n = u32::from_le_bytes(self.le()?);
                    let n = self.len_of(n.into())?;
                    self.bytes(n)?;
                }
                0x8e | 0x96 => {
                    let n = u64::from_le_bytes(self.le()?);
                    let n = self.len_of(n)?;
                    self.bytes(n)?;
                }
                b']' => self.push(Node::List(Vec::new()))?,
                b'l' => {
                    let items = self.pop_mark()?;
                    self.push(Node::List(items))?;
                }
                b'a' => {
                    let v = self.pop()?;
                    let l = self.top()?;
                    self.append(l, vec![v])?;
                }
                b'e' => {
                    let items = self.pop_mark()?;
                    let l = self.top()?;
                    self.append(l, items)?;
                }
                b')' => self.push(Node::Tuple(Vec::new()))?,
                b't' => {
                    let items = self.pop_mark()?;
                    self.push(Node::Tuple(items))?;
                }
                0x85..=0x87 => {
                    let n = usize::from(op - 0x84);
                    if self.stack.len() < n {
                        return Err(self.err("stack underflow"));
                    }
                    let items = self.stack.split_off(self.stack.len() - n);
                    self.push(Node::Tuple(items))?;
                }
                b'}' => self.push(Node::Dict(Vec::new()))?,
                b'd' => {
                    let items = self.pop_mark()?;
                    let d = self.node(Node::Dict(Vec::new()))?;
                    self.set_items(d, &items)?;
                    self.stack.push(d);
                }
                b's' => {
                    let v = self.pop()?;
                    let k = self.pop()?;
                    let d = self.top()?;
                    self.set_items(d, &[k, v])?;
                }
                b'u' => {
                    let items = self.pop_mark()?;
                    let d = self.top()?;
                    self.set_items(d, &items)?;
                }
                0x8f => self.push(Node::Set(Vec::new()))?,
                0x90 => {
                    let items = self.pop_mark()?;
                    let s = self.top()?;
                    match &mut self.nodes[s] {
                        Node::Set(v) => v.extend(items),
                        _ => return Err(self.err("ADDITEMS to a value that is not a set")),
                    }
                }
                0x91 => {
                    let items = self.pop_mark()?;
                    self.push(Node::FrozenSet(items))?;
                }
                b'c' => {
                    let module = self.line()?.to_owned();
                    let name = self.line()?.to_owned();
                    self.global(module, name)?;
                }
                0x93 => {
                    let name = self.pop()?;
                    let module = self.pop()?;
                    let (module, name) = (self.str_of(module)?, self.str_of(name)?);
                    self.global(module, name)?;
                }
                b'R' => {
                    let args = self.pop()?;
                    let f = self.pop()?;
                    let args = self.args_of(args)?;
                    self.call(f, args)?;
                }
                0x81 => {
                    let args = self.pop()?;
                    let cls = self.pop()?;
                    let args = self.args_of(args)?;
                    self.call(cls, args)?;
                }
                b'b' => {
                    let state = self.pop()?;
                    let obj = self.top()?;
                    match &mut self.nodes[obj] {
                        Node::Object { state: s, .. } if s.is_none() => *s = Some(state),
                        _ => return Err(self.err("BUILD on a value that is not a new object")),
                    }
                }
                b'Q' => {
                    let pid = self.pop()?;
                    self.push(Node::PersId(pid))?;
                }
                b'p' => {
                    let key = self
                        .line()?
                        .parse()
                        .map_err(|_| self.err("a bad PUT line"))?;
                    self.memo_put(key)?;
                }
                b'q' => {
                    let k = self.u8()?;
                    self.memo_put(k.into())?;
                }
                b'r' => {
                    let k = u32::from_le_bytes(self.le()?);
                    self.memo_put(k.into())?;
                }
                0x94 => {
                    let k = self.memo.len() as u64;
                    self.memo_put(k)?;
                }
                b'g' => {
                    let key = self
                        .line()?
                        .parse()
                        .map_err(|_| self.err("a bad GET line"))?;
                    self.memo_get(key)?;
                }
                b'h' => {
                    let k = self.u8()?;
                    self.memo_get(k.into())?;
                }
                b'j' => {
                    let k = u32::from_le_bytes(self.le()?);
                    self.memo_get(k.into())?;
                }
                op => {
                    return Err(PickleError::Opcode {
                        pos: self.op_pos,
                        op,
                    });
                }
            }
        }
    }

    fn tree(&self, id: usize, depth: usize) -> Result<Value, PickleError> {
        // Shared (memoized) values are copied into the tree: count every copy, so that a
        // pickle of lists of references to lists cannot expand past the node limit.
        self.out.set(self.out.get() + 1);
        if self.out.get() > MAX_NODES {
            return Err(PickleError::Limit {
                pos: self.op_pos,
                what: "values in the tree",
                limit: MAX_NODES,
            });
        }
        if depth > MAX_DEPTH {
            return Err(PickleError::Limit {
                pos: self.op_pos,
                what: "levels of nesting",
                limit: MAX_DEPTH,
            });
        }
        let all = |ids: &[usize]| -> Result<Vec<Value>, PickleError> {
            ids.iter().map(|&i| self.tree(i, depth + 1)).collect()
        };
        Ok(match &self.nodes[id] {
            Node::Scalar(v) => v.clone(),
            Node::List(v) => Value::List(all(v)?),
            Node::Tuple(v) => Value::Tuple(all(v)?),
            Node::Set(v) => Value::Set(all(v)?),
            Node::FrozenSet(v) => Value::FrozenSet(all(v)?),
            Node::Dict(v) => Value::Dict(
                v.iter()
                    .map(|&(k, x)| Ok((self.tree(k, depth + 1)?, self.tree(x, depth + 1)?)))
                    .collect::<Result<_, PickleError>>()?,
            ),
            Node::Object {
                module,
                name,
                args,
                state,
            } => Value::Object {
                module: module.clone(),
                name: name.clone(),
                args: all(args)?,
                state: match state {
                    Some(s) => Some(Box::new(self.tree(*s, depth + 1)?)),
                    None => None,
                },
            },
            Node::PersId(p) => Value::PersId(Box::new(self.tree(*p, depth + 1)?)),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const NONE: AllowList<'static> = &[];

    #[test]
    fn plain_values() {
        // pickle.dumps({"a": [1, 2.5, None, True], "b": (b"x", "y")}, protocol=4)
        let p = b"\x80\x04\x95'\x00\x00\x00\x00\x00\x00\x00}\x94(\x8c\x01a\x94]\x94(K\x01G@\x04\x00\x00\x00\x00\x00\x00N\x88e\x8c\x01b\x94C\x01x\x94\x8c\x01y\x94\x86\x94u.";
        let v = read(p, NONE).unwrap();
        assert_eq!(
            v,
            Value::Dict(vec![
                (
                    Value::Str("a".into()),
                    Value::List(vec![
                        Value::Int(1),
                        Value::Float(2.5),
                        Value::None,
                        Value::Bool(true)
                    ])
                ),
                (
                    Value::Str("b".into()),
                    Value::Tuple(vec![Value::Bytes(b"x".to_vec()), Value::Str("y".into())])
                ),
            ])
        );
    }

    #[test]
    fn os_system_is_refused_at_the_global() {
        // pickle of os.system("echo pwned") via __reduce__, protocol 0.
        let p = b"cos\nsystem\n(S'echo pwned'\ntR.";
        let e = read(p, NONE).unwrap_err();
        assert!(
            matches!(&e, PickleError::Forbidden { module, name, .. } if module == "os" && name == "system"),
            "{e}"
        );
        let p = b"\x80\x04\x8c\x02os\x8c\x06system\x93\x8c\x04echo\x85R.";
        assert!(matches!(read(p, NONE), Err(PickleError::Forbidden { .. })));
    }

    #[test]
    fn allowed_reduce_is_recorded_not_run() {
        let allow: AllowList<'_> = &[("collections", "OrderedDict")];
        let p = b"\x80\x02ccollections\nOrderedDict\nq\x00)Rq\x01.";
        let v = read(p, allow).unwrap();
        assert_eq!(v.class().as_deref(), Some("collections.OrderedDict"));
    }

    #[test]
    fn truncated_and_malformed_are_typed() {
        assert!(matches!(
            read(b"\x80\x04X\xff\xff\xff\x00ab", NONE),
            Err(PickleError::Truncated { .. })
        ));
        assert!(matches!(
            read(b"", NONE),
            Err(PickleError::Truncated { .. })
        ));
        assert!(matches!(
            read(b"a.", NONE),
            Err(PickleError::Malformed { .. })
        ));
        assert!(matches!(
            read(b"h\x05.", NONE),
            Err(PickleError::Malformed { .. })
        ));
        assert!(matches!(
            read(b"\xff", NONE),
            Err(PickleError::Opcode { .. })
        ));
    }

    #[test]
    fn self_reference_stops_at_the_depth_limit() {
        // l = []; l.append(l)
        let p = b"\x80\x04]\x94h\x00a.";
        assert!(matches!(read(p, NONE), Err(PickleError::Limit { .. })));
    }

    #[test]
    fn shared_references_cannot_blow_up() {
        // a = [0]; b = [a] * 1000; c = [b] * 1000; d = [c] * 1000: 10^9 leaves as a tree.
        let mut p = b"\x80\x04]\x94K\x00a".to_vec();
        for level in 0..3u8 {
            p.extend_from_slice(b"](");
            for _ in 0..1000 {
                p.extend_from_slice(&[b'h', level]);
            }
            p.extend_from_slice(b"e\x94");
        }
        p.push(b'.');
        assert!(matches!(read(&p, NONE), Err(PickleError::Limit { .. })));
    }

    #[test]
    fn longs() {
        assert_eq!(read(b"\x8a\x02\xff\x7f.", NONE).unwrap(), Value::Int(32767));
        assert_eq!(read(b"\x8a\x01\xff.", NONE).unwrap(), Value::Int(-1));
        assert_eq!(read(b"\x8a\x00.", NONE).unwrap(), Value::Int(0));
        assert!(read(b"\x8a\x09\x00\x00\x00\x00\x00\x00\x00\x00\x01.", NONE).is_err());
    }
}
