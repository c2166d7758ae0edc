//! Expanding a table for one model (its `config.json`) and one layout into concrete tensors
//! and box correspondences (links). Pure: no I/O.

use std::cell::RefCell;
use std::collections::BTreeMap;

use super::error::ConvertError;
use super::expr::{self, Expr, Scope, Value};
use super::geom::Bx;
use super::table::{ExprText, Rule, StackSpec, Table, ValueOp};

/// A Megatron layout: tensor, pipeline and expert parallel sizes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Layout {
    /// Tensor parallel size.
    pub tp: u64,
    /// Pipeline parallel size.
    pub pp: u64,
    /// Expert parallel size.
    pub ep: u64,
}

impl Default for Layout {
    fn default() -> Self {
        Layout {
            tp: 1,
            pp: 1,
            ep: 1,
        }
    }
}

impl std::fmt::Display for Layout {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "tp={},pp={},ep={}", self.tp, self.pp, self.ep)
    }
}

impl std::str::FromStr for Layout {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let mut l = Layout::default();
        for kv in s.split(',').filter(|p| !p.is_empty()) {
            let (k, v) = kv
                .split_once('=')
                .ok_or_else(|| format!("`{kv}`: expected NAME=VALUE (tp=2,pp=1,ep=1)"))?;
            let v: u64 = v
                .parse()
                .ok()
                .filter(|v| *v > 0)
                .ok_or_else(|| format!("`{kv}`: expected a positive integer"))?;
            match k.trim() {
                "tp" => l.tp = v,
                "pp" => l.pp = v,
                "ep" => l.ep = v,
                _ => return Err(format!("`{k}`: expected tp, pp or ep")),
            }
        }
        Ok(l)
    }
}

/// A parsed name pattern: literal text and `{expr}` substitutions.
#[derive(Debug, Clone)]
pub struct Pattern {
    text: String,
    parts: Vec<(String, Option<Expr>)>,
}

impl Pattern {
    /// Parses and checks a pattern (each substitution a whole dot-separated component).
    ///
    /// # Errors
    /// [`ConvertError::Pattern`].
    pub fn parse(text: &str) -> Result<Pattern, ConvertError> {
        let bad = |msg: String| ConvertError::Pattern {
            pattern: text.to_owned(),
            msg,
        };
        let mut parts = Vec::new();
        let mut rest = text;
        let mut lit = String::new();
        while let Some(i) = rest.find('{') {
            lit.push_str(&rest[..i]);
            let j = rest[i..]
                .find('}')
                .ok_or_else(|| bad("`{` without `}`".into()))?
                + i;
            let inner = &rest[i + 1..j];
            let before_ok = lit.is_empty() || lit.ends_with('.');
            let after = &rest[j + 1..];
            let after_ok = after.is_empty() || after.starts_with('.');
            if !before_ok || !after_ok {
                return Err(bad(format!(
                    "substitution `{{{inner}}}` is not a whole dot-separated name component \
                     (a name like `weight{{expert}}` would give `weight100`; write `.{{{inner}}}.`)"
                )));
            }
            parts.push((std::mem::take(&mut lit), Some(expr::parse(inner)?)));
            rest = after;
        }
        if rest.contains('}') {
            return Err(bad("`}` without `{`".into()));
        }
        lit.push_str(rest);
        parts.push((lit, None));
        Ok(Pattern {
            text: text.to_owned(),
            parts,
        })
    }

    /// The pattern's text.
    #[must_use]
    pub fn text(&self) -> &str {
        &self.text
    }

    /// Whether the pattern has substitutions.
    #[must_use]
    pub fn is_literal(&self) -> bool {
        self.parts.iter().all(|(_, e)| e.is_none())
    }

    /// The name for one set of captures.
    ///
    /// # Errors
    /// An expression error.
    pub fn render(&self, scope: &dyn Scope) -> Result<String, ConvertError> {
        let mut s = String::new();
        for (lit, e) in &self.parts {
            s.push_str(lit);
            if let Some(e) = e {
                match expr::eval(&self.text, e, scope)? {
                    Value::Int(i) => s.push_str(&i.to_string()),
                    Value::Bool(b) => s.push_str(&b.to_string()),
                }
            }
        }
        Ok(s)
    }
}

/// Names resolve to: captures, layout parameters, params (lazily, with cycle detection).
pub struct Env<'a> {
    table: &'a Table,
    config: &'a serde_json::Value,
    layout: Layout,
    cache: RefCell<BTreeMap<String, Option<Value>>>,
    active: RefCell<Vec<String>>,
    parsed: RefCell<std::collections::HashMap<String, std::rc::Rc<Expr>>>,
}

impl<'a> Env<'a> {
    /// An environment for `table`, `config` (the HF config.json) and `layout`.
    #[must_use]
    pub fn new(table: &'a Table, config: &'a serde_json::Value, layout: Layout) -> Self {
        Env {
            table,
            config,
            layout,
            cache: RefCell::new(BTreeMap::new()),
            active: RefCell::new(Vec::new()),
            parsed: RefCell::new(std::collections::HashMap::new()),
        }
    }

    /// The layout.
    #[must_use]
    pub fn layout(&self) -> Layout {
        self.layout
    }

    /// Evaluates an expression text.
    ///
    /// # Errors
    /// An expression error.
    pub fn eval(&self, e: &ExprText, caps: &[(String, i64)]) -> Result<Value, ConvertError> {
        let scope = Caps { env: self, caps };
        match e {
            ExprText::Int(i) => Ok(Value::Int(*i)),
            ExprText::Bool(b) => Ok(Value::Bool(*b)),
            ExprText::Text(t) => {
                let cached = self.parsed.borrow().get(t).cloned();
                let e = match cached {
                    Some(e) => e,
                    None => {
                        let e = std::rc::Rc::new(expr::parse(t)?);
                        self.parsed.borrow_mut().insert(t.clone(), e.clone());
                        e
                    }
                };
                expr::eval(t, &e, &scope)
            }
        }
    }

    /// Evaluates to a non-negative integer.
    ///
    /// # Errors
    /// An expression error, or a negative or boolean value.
    pub fn eval_u64(&self, e: &ExprText, caps: &[(String, i64)]) -> Result<u64, ConvertError> {
        match self.eval(e, caps)? {
            Value::Int(i) if i >= 0 => Ok(i.unsigned_abs()),
            v => Err(ConvertError::Expr {
                expr: e.text(),
                msg: format!("expected a non-negative integer, got {v}"),
            }),
        }
    }

    /// Evaluates to a boolean.
    ///
    /// # Errors
    /// An expression error, or an integer value.
    pub fn eval_bool(&self, e: &ExprText, caps: &[(String, i64)]) -> Result<bool, ConvertError> {
        match self.eval(e, caps)? {
            Value::Bool(b) => Ok(b),
            v => Err(ConvertError::Expr {
                expr: e.text(),
                msg: format!("expected a boolean, got {v}"),
            }),
        }
    }

    /// A param's value (evaluated once).
    ///
    /// # Errors
    /// An expression error or a cycle.
    pub fn param(&self, name: &str) -> Result<Option<Value>, ConvertError> {
        if let Some(v) = self.cache.borrow().get(name) {
            return Ok(*v);
        }
        let Some(e) = self.table.params.get(name) else {
            return Ok(None);
        };
        if self.active.borrow().iter().any(|a| a == name) {
            return Err(ConvertError::Expr {
                expr: e.text(),
                msg: format!(
                    "params refer to each other in a cycle: {} -> {name}",
                    self.active.borrow().join(" -> ")
                ),
            });
        }
        self.active.borrow_mut().push(name.to_owned());
        let v = self.eval(e, &[]);
        self.active.borrow_mut().pop();
        // A param whose expression names a missing config value is itself missing (so that
        // `param ?? default` works), every other failure is an error.
        let v = match v {
            Ok(v) => Some(v),
            Err(ConvertError::Expr { msg, .. }) if msg.starts_with("config.json has no") => None,
            Err(e) => return Err(e),
        };
        self.cache.borrow_mut().insert(name.to_owned(), v);
        Ok(v)
    }

    /// Every param that evaluates, by name (for dry runs).
    #[must_use]
    pub fn params(&self) -> BTreeMap<String, String> {
        self.table
            .params
            .keys()
            .filter_map(|k| match self.param(k) {
                Ok(Some(v)) => Some((k.clone(), v.to_string())),
                _ => None,
            })
            .collect()
    }
}

struct Caps<'e, 'a> {
    env: &'e Env<'a>,
    caps: &'e [(String, i64)],
}

impl Scope for Caps<'_, '_> {
    fn name(&self, name: &str) -> Result<Option<Value>, ConvertError> {
        if let Some((_, v)) = self.caps.iter().rev().find(|(n, _)| n == name) {
            return Ok(Some(Value::Int(*v)));
        }
        let l = self.env.layout;
        let lay = |v: u64| Ok(Some(Value::Int(i64::try_from(v).unwrap_or(i64::MAX))));
        match name {
            "tp" => return lay(l.tp),
            "pp" => return lay(l.pp),
            "ep" => return lay(l.ep),
            _ => {}
        }
        match self.env.param(name)? {
            Some(v) => Ok(Some(v)),
            None => match self.env.table.params.get(name) {
                // A param whose config value is missing: say which.
                Some(e) => Err(ConvertError::Expr {
                    expr: e.text(),
                    msg: format!(
                        "param `{name}`: config.json lacks a value it needs ({})",
                        match self.env.eval(e, &[]) {
                            Err(ConvertError::Expr { msg, .. }) => msg,
                            _ => "missing".into(),
                        }
                    ),
                }),
                None => Ok(None),
            },
        }
    }

    fn config(&self, name: &str) -> Result<Option<Value>, ConvertError> {
        Ok(match self.env.config.get(name) {
            None | Some(serde_json::Value::Null) => None,
            Some(serde_json::Value::Bool(b)) => Some(Value::Bool(*b)),
            Some(serde_json::Value::Number(n)) => match n.as_i64() {
                Some(i) => Some(Value::Int(i)),
                None => {
                    return Err(ConvertError::Expr {
                        expr: format!("config.{name}"),
                        msg: format!("config.json's `{name}` = {n} is not an integer"),
                    });
                }
            },
            // An object counts as `true` (present: `config.quantization_config ?? false`), a
            // list as its length (`config.mlp_only_layers == 0`).
            Some(serde_json::Value::Object(_)) => Some(Value::Bool(true)),
            Some(serde_json::Value::Array(a)) => {
                Some(Value::Int(i64::try_from(a.len()).unwrap_or(i64::MAX)))
            }
            Some(v) => {
                return Err(ConvertError::Expr {
                    expr: format!("config.{name}"),
                    msg: format!(
                        "config.json's `{name}` = {v} is not an integer, boolean, object or list"
                    ),
                });
            }
        })
    }
}

/// A Megatron tensor of the expansion.
#[derive(Debug, Clone)]
pub struct MTensor {
    /// The key import writes.
    pub key: String,
    /// Other spellings export accepts.
    pub aliases: Vec<String>,
    /// Global shape: stack sizes, then the body.
    pub shape: Vec<u64>,
    /// Number of stack axes.
    pub stack_axes: usize,
    /// Stack capture names.
    pub captures: Vec<String>,
    /// Data type set by the rule (a cast), as written.
    pub dtype: Option<String>,
    /// Tensor parallelism.
    pub tp: Option<TpInfo>,
    /// Expert-parallel axis.
    pub ep_axis: Option<usize>,
    /// Rules producing it.
    pub rules: Vec<usize>,
}

/// Tensor parallelism of a Megatron tensor, resolved.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TpInfo {
    /// Axis in global coordinates.
    pub axis: usize,
    /// Equal segments, each split over TP.
    pub parts: u64,
    /// Indivisible units per part.
    pub units: u64,
    /// Whether the table named the units (then units are checked for equal composition).
    pub explicit_units: bool,
}

/// An HF tensor of the expansion.
#[derive(Debug, Clone)]
pub struct HTensor {
    /// Name.
    pub name: String,
    /// Shape implied by config.json.
    pub shape: Vec<u64>,
    /// Fixed data type, as written.
    pub dtype: Option<String>,
    /// Stack index it belongs to (for ordering), and its rule.
    pub order: (Vec<u64>, usize, usize),
}

/// A box correspondence: `hbox` of HF tensor `h` is `mbox` of Megatron tensor `m` (same
/// shape, or the last two axes swapped when `transpose`).
#[derive(Debug, Clone)]
pub struct Link {
    /// The rule.
    pub rule: usize,
    /// Megatron tensor index.
    pub m: usize,
    /// Box in the Megatron tensor's global coordinates.
    pub mbox: Bx,
    /// HF tensor index.
    pub h: usize,
    /// Box in the HF tensor.
    pub hbox: Bx,
    /// Transposed.
    pub transpose: bool,
    /// fp8 block dequantisation on import: the HF scale tensor and the block shape.
    pub scale: Option<(usize, [u64; 2])>,
}

/// A rule after expansion (what execution needs beyond links).
#[derive(Debug, Clone)]
pub struct RuleInfo {
    /// Name.
    pub name: String,
    /// Op.
    pub op: String,
    /// Value ops.
    pub value: Vec<ValueOp>,
    /// Whether `when` held.
    pub active: bool,
}

/// A table expanded for one config and layout.
#[derive(Debug, Clone)]
pub struct Expanded {
    /// Table name.
    pub table: String,
    /// Rules.
    pub rules: Vec<RuleInfo>,
    /// Megatron tensors.
    pub m: Vec<MTensor>,
    /// HF tensors.
    pub h: Vec<HTensor>,
    /// Links.
    pub links: Vec<Link>,
    /// Padding boxes of Megatron tensors (zero on import, dropped on export), with their rule.
    pub pads: Vec<(usize, usize, Bx)>,
    /// HF tensors consumed on import besides links (fp8 scales), with their rule.
    pub aux: Vec<(usize, usize)>,
    /// Drop globs.
    pub drop_m: Vec<String>,
    /// Drop globs.
    pub drop_h: Vec<String>,
    /// The layout it was expanded for.
    pub layout: Layout,
    /// Params that evaluate (for dry runs).
    pub params: BTreeMap<String, String>,
}

/// The body relation of one op: body shape, (hf index, hbox, body box, transpose), pads.
type BodyLinks = (Vec<u64>, Vec<(usize, Bx, Bx, bool)>, Vec<Bx>);

fn op_err(rule: &Rule, msg: String) -> ConvertError {
    ConvertError::Op {
        rule: rule.name.clone(),
        op: rule.op.clone(),
        msg,
    }
}

fn body_links(rule: &Rule, env: &Env, hshapes: &[Vec<u64>]) -> Result<BodyLinks, ConvertError> {
    let one = |what: &str| -> Result<&Vec<u64>, ConvertError> {
        if hshapes.len() != 1 {
            return Err(op_err(
                rule,
                format!(
                    "{what} takes exactly one hf tensor, {} given",
                    hshapes.len()
                ),
            ));
        }
        Ok(&hshapes[0])
    };
    let axis_of = |ndim: usize| -> Result<usize, ConvertError> {
        let a = rule.axis.unwrap_or(0); // the documented default
        if a >= ndim {
            return Err(op_err(
                rule,
                format!("axis {a} out of range for {ndim} dimensions"),
            ));
        }
        Ok(a)
    };
    let full = |s: &Vec<u64>| Bx::full(s);
    let ev = |e: &Option<ExprText>, what: &str| -> Result<u64, ConvertError> {
        let e = e
            .as_ref()
            .ok_or_else(|| op_err(rule, format!("needs `{what}`")))?;
        env.eval_u64(e, &[])
    };
    Ok(match rule.op.as_str() {
        "rename" => {
            let s = one("rename")?;
            (s.clone(), vec![(0, full(s), full(s), false)], vec![])
        }
        "transpose" => {
            let s = one("transpose")?;
            if s.len() != 2 {
                return Err(op_err(
                    rule,
                    format!("transpose needs 2 dimensions, not {s:?}"),
                ));
            }
            let t = vec![s[1], s[0]];
            (t.clone(), vec![(0, full(s), full(&t), true)], vec![])
        }
        "slice" => {
            let s = one("slice")?;
            let a = axis_of(s.len())?;
            let (start, stop) = (ev(&rule.start, "start")?, ev(&rule.stop, "stop")?);
            if start >= stop || stop > s[a] {
                return Err(op_err(
                    rule,
                    format!("slice [{start}, {stop}) of axis {a} of extent {}", s[a]),
                ));
            }
            let mut body = s.clone();
            body[a] = stop - start;
            let mut hb = full(s);
            hb.off[a] = start;
            hb.len[a] = stop - start;
            (body.clone(), vec![(0, hb, full(&body), false)], vec![])
        }
        "concat" | "interleave" => {
            let first = hshapes
                .first()
                .ok_or_else(|| op_err(rule, "needs hf tensors".into()))?;
            let a = axis_of(first.len())?;
            for (i, s) in hshapes.iter().enumerate() {
                let mut x = s.clone();
                let mut y = first.clone();
                if x.len() != y.len() {
                    return Err(op_err(
                        rule,
                        format!("hf[{i}] has shape {s:?}, hf[0] {first:?}"),
                    ));
                }
                x[a] = 0;
                y[a] = 0;
                if x != y {
                    return Err(op_err(
                        rule,
                        format!(
                            "hf[{i}] shape {s:?} and hf[0] shape {first:?} differ off axis {a}"
                        ),
                    ));
                }
            }
            let groups = if rule.op == "interleave" {
                ev(&rule.groups, "groups")?
            } else {
                1
            };
            if groups == 0 {
                return Err(op_err(rule, "groups = 0".into()));
            }
            let mut per = Vec::new();
            for (i, s) in hshapes.iter().enumerate() {
                if s[a] % groups != 0 {
                    return Err(op_err(
                        rule,
                        format!(
                            "hf[{i}] extent {} along axis {a} is not divisible by groups = {groups}",
                            s[a]
                        ),
                    ));
                }
                per.push(s[a] / groups);
            }
            let total: u64 = hshapes.iter().map(|s| s[a]).sum();
            let mut body = first.clone();
            body[a] = total;
            let mut links = Vec::new();
            let mut pos = 0;
            for g in 0..groups {
                for (i, s) in hshapes.iter().enumerate() {
                    let mut hb = full(s);
                    hb.off[a] = g * per[i];
                    hb.len[a] = per[i];
                    let mut mb = full(&body);
                    mb.off[a] = pos;
                    mb.len[a] = per[i];
                    pos += per[i];
                    links.push((i, hb, mb, false));
                }
            }
            (body, links, vec![])
        }
        "pad" => {
            let s = one("pad")?;
            let to = ev(&rule.to, "to")?;
            if s.is_empty() || to < s[0] {
                return Err(op_err(
                    rule,
                    format!("pad to {to} rows, hf has shape {s:?}"),
                ));
            }
            let mut body = s.clone();
            body[0] = to;
            let mut pads = vec![];
            if to > s[0] {
                let mut pb = full(&body);
                pb.off[0] = s[0];
                pb.len[0] = to - s[0];
                pads.push(pb);
            }
            let mut mb = full(&body);
            mb.len[0] = s[0];
            (body, vec![(0, full(s), mb, false)], pads)
        }
        other => return Err(op_err(rule, format!("unknown op `{other}`"))),
    })
}

/// The `(capture, size, start, stop)` of each stack axis, evaluated and checked.
///
/// # Errors
/// [`ConvertError::Expr`] when an expression fails or a range lies outside its size.
pub fn stack_ranges(
    stack: &[StackSpec],
    env: &Env,
) -> Result<Vec<(String, u64, u64, u64)>, ConvertError> {
    stack
        .iter()
        .map(|s| {
            let size = env.eval_u64(&s.size, &[])?;
            let start = s
                .start
                .as_ref()
                .map(|e| env.eval_u64(e, &[]))
                .transpose()?
                .unwrap_or(0); // the documented default
            let stop = s
                .stop
                .as_ref()
                .map(|e| env.eval_u64(e, &[]))
                .transpose()?
                .unwrap_or(size);
            if start > stop || stop > size {
                return Err(ConvertError::Expr {
                    expr: s.capture.clone(),
                    msg: format!("stack range [{start}, {stop}) outside size {size}"),
                });
            }
            Ok((s.capture.clone(), size, start, stop))
        })
        .collect()
}

/// Every index of the product of ranges, in C order.
pub fn stack_indices(ranges: &[(String, u64, u64, u64)]) -> Vec<Vec<u64>> {
    let mut out = vec![vec![]];
    for (_, _, start, stop) in ranges {
        out = out
            .into_iter()
            .flat_map(|p| {
                (*start..*stop).map(move |i| {
                    let mut q = p.clone();
                    q.push(i);
                    q
                })
            })
            .collect();
    }
    out
}

fn caps_of(ranges: &[(String, u64, u64, u64)], idx: &[u64]) -> Vec<(String, i64)> {
    ranges
        .iter()
        .zip(idx)
        .map(|((n, ..), &i)| (n.clone(), i64::try_from(i).unwrap_or(i64::MAX)))
        .collect()
}

/// Expands `table` for `config` and `layout` (spec § 19.4). Checks the table's own
/// consistency on the way (ops, patterns, duplicate names, shapes agreeing across rules).
///
/// # Errors
/// The first [`ConvertError`] found.
pub fn expand(
    table: &Table,
    config: &serde_json::Value,
    layout: Layout,
) -> Result<Expanded, ConvertError> {
    let env = Env::new(table, config, layout);
    for c in &table.checks {
        if !env.eval_bool(&c.expr, &[])? {
            return Err(ConvertError::Check {
                check: c.name.clone(),
                expr: c.expr.text(),
            });
        }
    }
    let mut seen: BTreeMap<&str, usize> = BTreeMap::new();
    for r in &table.rules {
        if let Some(_prev) = seen.insert(&r.name, 0) {
            return Err(ConvertError::Duplicate {
                what: "rule name",
                name: r.name.clone(),
                rules: format!("`{}` (twice)", r.name),
            });
        }
    }
    let mut ex = Expanded {
        table: table.name.clone(),
        rules: Vec::new(),
        m: Vec::new(),
        h: Vec::new(),
        links: Vec::new(),
        pads: Vec::new(),
        aux: Vec::new(),
        drop_m: table.drop.megatron.clone(),
        drop_h: table.drop.hf.clone(),
        layout,
        params: BTreeMap::new(),
    };
    let mut m_index: BTreeMap<String, usize> = BTreeMap::new();
    let mut h_index: BTreeMap<String, usize> = BTreeMap::new();
    for (ri, rule) in table.rules.iter().enumerate() {
        let active = match &rule.when {
            Some(w) => env.eval_bool(w, &[]).map_err(|e| e.in_rule(&rule.name))?,
            None => true,
        };
        ex.rules.push(RuleInfo {
            name: rule.name.clone(),
            op: rule.op.clone(),
            value: rule.value.clone(),
            active,
        });
        if !active {
            continue;
        }
        expand_rule(&env, rule, ri, &mut ex, &mut m_index, &mut h_index)
            .map_err(|e| e.in_rule(&rule.name))?;
    }
    ex.params = env.params();
    Ok(ex)
}

fn expand_rule(
    env: &Env,
    rule: &Rule,
    ri: usize,
    ex: &mut Expanded,
    m_index: &mut BTreeMap<String, usize>,
    h_index: &mut BTreeMap<String, usize>,
) -> Result<(), ConvertError> {
    let mpat = Pattern::parse(&rule.megatron)?;
    let has_name_caps = rule.stack.iter().any(|s| s.in_name);
    if !mpat.is_literal() && !has_name_caps {
        return Err(ConvertError::Pattern {
            pattern: rule.megatron.clone(),
            msg: "a Megatron key takes substitutions of `in_name` captures only (other stack captures are leading axes)".into(),
        });
    }
    let hpats: Vec<Pattern> = rule
        .hf
        .iter()
        .map(|h| Pattern::parse(&h.name))
        .collect::<Result<_, _>>()?;
    let hshapes: Vec<Vec<u64>> = rule
        .hf
        .iter()
        .map(|h| h.shape.iter().map(|e| env.eval_u64(e, &[])).collect())
        .collect::<Result<_, _>>()?;
    // HF shapes come from config.json alone: the same at any Megatron layout.
    let probe_layout = Layout {
        tp: 1009,
        pp: 1,
        ep: 1,
    };
    let probe = Env::new(env.table, env.config, probe_layout);
    for (k, h) in rule.hf.iter().enumerate() {
        let other: Result<Vec<u64>, _> = h.shape.iter().map(|e| probe.eval_u64(e, &[])).collect();
        if let Ok(other) = other
            && other != hshapes[k]
        {
            return Err(ConvertError::LayoutDependentShape {
                rule: rule.name.clone(),
                key: h.name.clone(),
                shape: hshapes[k].clone(),
                layout: env.layout.to_string(),
                other,
                other_layout: probe_layout.to_string(),
            });
        }
    }
    let (mut body, blinks, mut bpads) = body_links(rule, env, &hshapes)?;
    let mut blinks = blinks;
    if let Some(p) = &rule.place {
        let at = env.eval_u64(&p.at, &[])?;
        let size = env.eval_u64(&p.size, &[])?;
        if p.axis >= body.len() || at + body[p.axis] > size {
            return Err(op_err(
                rule,
                format!(
                    "place at {at} of {size} along axis {}: the result has shape {body:?}",
                    p.axis
                ),
            ));
        }
        for (_, _, mb, _) in &mut blinks {
            mb.off[p.axis] += at;
        }
        for pb in &mut bpads {
            pb.off[p.axis] += at;
        }
        body[p.axis] = size;
    }
    let all_ranges = stack_ranges(&rule.stack, env)?;
    let name_ranges: Vec<_> = all_ranges
        .iter()
        .zip(&rule.stack)
        .filter(|(_, s)| s.in_name)
        .map(|(r, _)| r.clone())
        .collect();
    let ranges: Vec<_> = all_ranges
        .iter()
        .zip(&rule.stack)
        .filter(|(_, s)| !s.in_name)
        .map(|(r, _)| r.clone())
        .collect();
    let ns = ranges.len();
    let mut shape: Vec<u64> = ranges.iter().map(|r| r.1).collect();
    shape.extend(&body);
    let tp = match &rule.tp {
        Some(t) => {
            if t.axis >= body.len() {
                return Err(op_err(rule, format!("tp axis {} out of range", t.axis)));
            }
            let parts = t
                .parts
                .as_ref()
                .map(|e| env.eval_u64(e, &[]))
                .transpose()?
                .unwrap_or(1);
            let extent = body[t.axis];
            if parts == 0 || extent % parts != 0 {
                return Err(op_err(
                    rule,
                    format!("tp parts = {parts} does not divide extent {extent}"),
                ));
            }
            let units = t
                .units
                .as_ref()
                .map(|e| env.eval_u64(e, &[]))
                .transpose()?
                .unwrap_or(extent / parts);
            Some(TpInfo {
                axis: ns + t.axis,
                parts,
                units,
                explicit_units: t.units.is_some(),
            })
        }
        None => None,
    };
    let ep_axis = match &rule.ep {
        Some(e) => Some(
            ranges
                .iter()
                .position(|r| r.0 == e.capture)
                .ok_or_else(|| {
                    op_err(
                        rule,
                        format!("ep capture `{}` is not an axis stack capture", e.capture),
                    )
                })?,
        ),
        None => None,
    };
    let dequant = match rule.value.iter().find_map(|v| match v {
        ValueOp::DequantFp8Block(d) => Some(d),
        ValueOp::Add(_) => None,
    }) {
        Some(d) => match &d.when {
            Some(w) => env.eval_bool(w, &[])?.then(|| (d.scale.clone(), d.block)),
            None => Some((d.scale.clone(), d.block)),
        },
        None => None,
    };
    for nidx in stack_indices(&name_ranges) {
        let ncaps = caps_of(&name_ranges, &nidx);
        let mkey = mpat.render(&CapScope { env, caps: &ncaps })?;
        let aliases: Vec<String> = rule
            .megatron_aliases
            .iter()
            .map(|a| Pattern::parse(a)?.render(&CapScope { env, caps: &ncaps }))
            .collect::<Result<_, _>>()?;
        let mi = match m_index.get(&mkey) {
            Some(&mi) => {
                let m = &mut ex.m[mi];
                if m.shape != shape {
                    return Err(ConvertError::Duplicate {
                        what: "megatron tensor",
                        name: format!("{mkey} (shapes {:?} and {shape:?})", m.shape),
                        rules: format!("`{}` and `{}`", ex.rules[m.rules[0]].name, rule.name),
                    });
                }
                m.rules.push(ri);
                mi
            }
            None => {
                ex.m.push(MTensor {
                    key: mkey.clone(),
                    aliases,
                    shape: shape.clone(),
                    stack_axes: ns,
                    captures: ranges.iter().map(|r| r.0.clone()).collect(),
                    dtype: rule.dtype.clone(),
                    tp,
                    ep_axis,
                    rules: vec![ri],
                });
                m_index.insert(mkey.clone(), ex.m.len() - 1);
                ex.m.len() - 1
            }
        };
        for idx in stack_indices(&ranges) {
            let mut caps = ncaps.clone();
            caps.extend(caps_of(&ranges, &idx));
            let scope = CapScope { env, caps: &caps };
            let mut order_idx = nidx.clone();
            order_idx.extend(&idx);
            let mut his = Vec::new();
            for (k, p) in hpats.iter().enumerate() {
                let name = p.render(&scope)?;
                let hi = match h_index.get(&name) {
                    Some(&hi) => {
                        if ex.h[hi].shape != hshapes[k] {
                            return Err(ConvertError::Duplicate {
                                what: "hf tensor",
                                name: format!(
                                    "{name} (shapes {:?} and {:?})",
                                    ex.h[hi].shape, hshapes[k]
                                ),
                                rules: format!(
                                    "`{}` and `{}`",
                                    ex.rules[ex.h[hi].order.1].name, rule.name
                                ),
                            });
                        }
                        hi
                    }
                    None => {
                        ex.h.push(HTensor {
                            name: name.clone(),
                            shape: hshapes[k].clone(),
                            dtype: rule.hf[k].dtype.clone(),
                            order: (order_idx.clone(), ri, k),
                        });
                        h_index.insert(name, ex.h.len() - 1);
                        ex.h.len() - 1
                    }
                };
                his.push(hi);
            }
            // fp8 scales: one per HF tensor, named by the tensor's name plus the suffix.
            let mut scales: Vec<Option<(usize, [u64; 2])>> = vec![None; his.len()];
            if let Some((suffix, block)) = &dequant {
                for (k, &h) in his.iter().enumerate() {
                    let name = format!("{}{suffix}", ex.h[h].name);
                    let s = &hshapes[k];
                    if s.len() != 2 {
                        return Err(op_err(
                            rule,
                            "fp8 block dequantisation needs 2-D tensors".into(),
                        ));
                    }
                    let sshape = vec![s[0].div_ceil(block[0]), s[1].div_ceil(block[1])];
                    let hi = *h_index.entry(name.clone()).or_insert_with(|| {
                        ex.h.push(HTensor {
                            name,
                            shape: sshape,
                            dtype: Some("float32".into()),
                            order: (order_idx.clone(), ri, usize::MAX),
                        });
                        ex.h.len() - 1
                    });
                    ex.aux.push((ri, hi));
                    scales[k] = Some((hi, *block));
                }
            }
            for (hk, hb, mb, tr) in &blinks {
                ex.links.push(Link {
                    rule: ri,
                    m: mi,
                    mbox: mb.prepend(&idx),
                    h: his[*hk],
                    hbox: hb.clone(),
                    transpose: *tr,
                    scale: scales[*hk],
                });
            }
            for pb in &bpads {
                ex.pads.push((ri, mi, pb.prepend(&idx)));
            }
        }
    }
    Ok(())
}

/// A scope with captures bound.
pub struct CapScope<'e, 'a> {
    /// The environment.
    pub env: &'e Env<'a>,
    /// Captures.
    pub caps: &'e [(String, i64)],
}

impl Scope for CapScope<'_, '_> {
    fn name(&self, name: &str) -> Result<Option<Value>, ConvertError> {
        Caps {
            env: self.env,
            caps: self.caps,
        }
        .name(name)
    }
    fn config(&self, name: &str) -> Result<Option<Value>, ConvertError> {
        Caps {
            env: self.env,
            caps: self.caps,
        }
        .config(name)
    }
}

/// The keys of the Megatron `ShardedObject`s an import writes for `table` (the extra state
/// of linear layers): `<name>/shard_<index>_<grid>` over the object's stack axes that are not
/// in its name (`shard_0_1` without any), in stack order.
///
/// # Errors
/// An expression, pattern or stack range that fails.
pub fn object_keys(
    table: &Table,
    config: &serde_json::Value,
    layout: Layout,
) -> Result<Vec<String>, ConvertError> {
    let env = Env::new(table, config, layout);
    let mut out = Vec::new();
    for o in &table.objects {
        if let Some(w) = &o.when
            && !env.eval_bool(w, &[])?
        {
            continue;
        }
        let pat = Pattern::parse(&o.name)?;
        let ranges = stack_ranges(&o.stack, &env)?;
        for idx in stack_indices(&ranges) {
            let caps = ranges
                .iter()
                .zip(&idx)
                .map(|((n, ..), &i)| {
                    i64::try_from(i)
                        .map(|i| (n.clone(), i))
                        .map_err(|_| ConvertError::Expr {
                            expr: n.clone(),
                            msg: format!("stack index {i} exceeds 63 bits"),
                        })
                })
                .collect::<Result<Vec<_>, _>>()?;
            let name = pat.render(&CapScope {
                env: &env,
                caps: &caps,
            })?;
            let axes: Vec<(u64, u64)> = o
                .stack
                .iter()
                .zip(ranges.iter().zip(&idx))
                .filter(|(s, _)| !s.in_name)
                .map(|(_, ((_, size, ..), &i))| (i, *size))
                .collect();
            let join = |f: fn(&(u64, u64)) -> u64| {
                axes.iter()
                    .map(|a| f(a).to_string())
                    .collect::<Vec<_>>()
                    .join(".")
            };
            out.push(if axes.is_empty() {
                format!("{name}/shard_0_1")
            } else {
                format!("{name}/shard_{}_{}", join(|a| a.0), join(|a| a.1))
            });
        }
    }
    Ok(out)
}

/// The value of one expression of § 19.3 for `names` (params, layout parameters, captures)
/// and `config` (the HF config.json), outside any table.
///
/// # Errors
/// [`ConvertError::Expr`] when it does not parse or evaluate.
pub fn evaluate(
    expr: &ExprText,
    names: &BTreeMap<String, Value>,
    config: &serde_json::Value,
) -> Result<Value, ConvertError> {
    // Integers are bound as captures (which shadow the layout's tp, pp, ep), booleans as
    // literal params of an empty table.
    let mut table = Table {
        schema: None,
        format: "zarrckpt-mapping".into(),
        version: 1,
        name: "expression".into(),
        description: None,
        extends: None,
        params: BTreeMap::new(),
        checks: vec![],
        rules: vec![],
        remove_rules: vec![],
        remove_vllm: vec![],
        drop: super::table::Drop::default(),
        vllm: None,
        objects: vec![],
    };
    let mut caps = Vec::new();
    for (k, v) in names {
        match v {
            Value::Int(i) => caps.push((k.clone(), *i)),
            Value::Bool(b) => {
                table.params.insert(k.clone(), ExprText::Bool(*b));
            }
        }
    }
    Env::new(&table, config, Layout::default()).eval(expr, &caps)
}
