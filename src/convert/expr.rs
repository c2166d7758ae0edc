//! The expression language of conversion tables (spec § 19.3): integers, booleans, names,
//! `config.NAME`, arithmetic with exact division, comparisons, `??`, a few functions.

use std::fmt;

use super::error::ConvertError;

/// A value: a 64-bit signed integer or a boolean.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Value {
    /// An integer.
    Int(i64),
    /// A boolean.
    Bool(bool),
}

impl fmt::Display for Value {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Value::Int(i) => write!(f, "{i}"),
            Value::Bool(b) => write!(f, "{b}"),
        }
    }
}

/// A parsed expression.
#[derive(Debug, Clone, PartialEq)]
pub enum Expr {
    /// A literal.
    Lit(Value),
    /// A param, layout parameter or capture.
    Name(String),
    /// `config.NAME`.
    Config(String),
    /// A unary operator (`!`, `-`).
    Unary(char, Box<Expr>),
    /// A binary operator.
    Binary(&'static str, Box<Expr>, Box<Expr>),
    /// A function call.
    Call(String, Vec<Expr>),
}

/// What an expression's names resolve to.
pub trait Scope {
    /// A name (param, layout parameter, capture); `Ok(None)` when unknown.
    fn name(&self, name: &str) -> Result<Option<Value>, ConvertError>;
    /// A config value; `Ok(None)` when missing or null.
    fn config(&self, name: &str) -> Result<Option<Value>, ConvertError>;
}

struct Parser<'a> {
    src: &'a str,
    toks: Vec<Tok>,
    pos: usize,
}

#[derive(Debug, Clone, PartialEq)]
enum Tok {
    Int(i64),
    Ident(String),
    Op(&'static str),
}

const OPS: [&str; 22] = [
    "??", "||", "&&", "==", "!=", "<=", ">=", "//", "<", ">", "+", "-", "*", "/", "%", "!", "(",
    ")", ",", ".", "[", "]",
];

fn lex(src: &str) -> Result<Vec<Tok>, String> {
    let b = src.as_bytes();
    let mut i = 0;
    let mut out = Vec::new();
    while i < b.len() {
        let c = b[i];
        if c.is_ascii_whitespace() {
            i += 1;
        } else if c.is_ascii_digit() {
            let s = i;
            while i < b.len() && b[i].is_ascii_digit() {
                i += 1;
            }
            let n = src[s..i]
                .parse::<i64>()
                .map_err(|_| format!("integer `{}` out of range", &src[s..i]))?;
            out.push(Tok::Int(n));
        } else if c.is_ascii_alphabetic() || c == b'_' {
            let s = i;
            while i < b.len() && (b[i].is_ascii_alphanumeric() || b[i] == b'_') {
                i += 1;
            }
            out.push(Tok::Ident(src[s..i].to_owned()));
        } else if let Some(op) = OPS.iter().find(|op| src[i..].starts_with(**op)) {
            out.push(Tok::Op(op));
            i += op.len();
        } else {
            return Err(format!("unexpected character `{}`", c as char));
        }
    }
    Ok(out)
}

/// Parses an expression.
///
/// # Errors
/// [`ConvertError::Expr`] on a syntax error.
pub fn parse(src: &str) -> Result<Expr, ConvertError> {
    let err = |msg: String| ConvertError::Expr {
        expr: src.to_owned(),
        msg,
    };
    let toks = lex(src).map_err(err)?;
    let mut p = Parser { src, toks, pos: 0 };
    let e = p.binary(0).map_err(err)?;
    if p.pos != p.toks.len() {
        return Err(err(format!("unexpected `{:?}`", p.toks[p.pos])));
    }
    let _ = p.src;
    Ok(e)
}

const LEVELS: [&[&str]; 6] = [
    &["??"],
    &["||"],
    &["&&"],
    &["==", "!=", "<", "<=", ">", ">="],
    &["+", "-"],
    &["*", "/", "//", "%"],
];

impl Parser<'_> {
    fn peek_op(&self) -> Option<&'static str> {
        match self.toks.get(self.pos) {
            Some(Tok::Op(o)) => Some(o),
            _ => None,
        }
    }

    fn expect(&mut self, op: &str) -> Result<(), String> {
        if self.peek_op() == Some(op) {
            self.pos += 1;
            Ok(())
        } else {
            Err(format!("expected `{op}`"))
        }
    }

    fn binary(&mut self, level: usize) -> Result<Expr, String> {
        if level == LEVELS.len() {
            return self.unary();
        }
        let mut lhs = self.binary(level + 1)?;
        while let Some(op) = self.peek_op().filter(|o| LEVELS[level].contains(o)) {
            self.pos += 1;
            let rhs = self.binary(level + 1)?;
            lhs = Expr::Binary(op, Box::new(lhs), Box::new(rhs));
        }
        Ok(lhs)
    }

    fn unary(&mut self) -> Result<Expr, String> {
        match self.peek_op() {
            Some("!") => {
                self.pos += 1;
                Ok(Expr::Unary('!', Box::new(self.unary()?)))
            }
            Some("-") => {
                self.pos += 1;
                Ok(Expr::Unary('-', Box::new(self.unary()?)))
            }
            _ => self.atom(),
        }
    }

    fn atom(&mut self) -> Result<Expr, String> {
        let t = self.toks.get(self.pos).cloned().ok_or("unexpected end")?;
        self.pos += 1;
        match t {
            Tok::Int(n) => Ok(Expr::Lit(Value::Int(n))),
            Tok::Op("(") => {
                let e = self.binary(0)?;
                self.expect(")")?;
                Ok(e)
            }
            Tok::Ident(id) if id == "true" => Ok(Expr::Lit(Value::Bool(true))),
            Tok::Ident(id) if id == "false" => Ok(Expr::Lit(Value::Bool(false))),
            Tok::Ident(id) if id == "config" => {
                self.expect(".")?;
                match self.toks.get(self.pos).cloned() {
                    Some(Tok::Ident(name)) => {
                        self.pos += 1;
                        Ok(Expr::Config(name))
                    }
                    _ => Err("expected a name after `config.`".into()),
                }
            }
            Tok::Ident(id) => {
                if self.peek_op() == Some("(") {
                    self.pos += 1;
                    let mut args = Vec::new();
                    if self.peek_op() != Some(")") {
                        loop {
                            args.push(self.binary(0)?);
                            if self.peek_op() == Some(",") {
                                self.pos += 1;
                            } else {
                                break;
                            }
                        }
                    }
                    self.expect(")")?;
                    let arity = match id.as_str() {
                        "min" | "max" | "round_up" | "ceil_div" => 2,
                        _ => return Err(format!("unknown function `{id}`")),
                    };
                    if args.len() != arity {
                        return Err(format!("`{id}` takes {arity} arguments"));
                    }
                    Ok(Expr::Call(id, args))
                } else {
                    Ok(Expr::Name(id))
                }
            }
            Tok::Op(o) => Err(format!("unexpected `{o}`")),
        }
    }
}

/// Evaluates `e` (whose source text is `src`, for errors) in `scope`.
///
/// # Errors
/// [`ConvertError::Expr`] naming the expression and the failing operation with its numbers.
pub fn eval(src: &str, e: &Expr, scope: &dyn Scope) -> Result<Value, ConvertError> {
    let err = |msg: String| ConvertError::Expr {
        expr: src.to_owned(),
        msg,
    };
    match e {
        Expr::Lit(v) => Ok(*v),
        Expr::Name(n) => scope
            .name(n)?
            .ok_or_else(|| err(format!("unknown name `{n}`"))),
        Expr::Config(n) => scope
            .config(n)?
            .ok_or_else(|| err(format!("config.json has no `{n}`"))),
        Expr::Unary(op, a) => match (op, eval(src, a, scope)?) {
            ('!', Value::Bool(b)) => Ok(Value::Bool(!b)),
            ('-', Value::Int(i)) => i
                .checked_neg()
                .map(Value::Int)
                .ok_or_else(|| err("overflow".into())),
            (op, v) => Err(err(format!("`{op}` does not apply to {v}"))),
        },
        Expr::Binary("??", a, b) => {
            let missing = match a.as_ref() {
                Expr::Config(n) => scope.config(n)?.is_none(),
                Expr::Name(n) => scope.name(n).map_or(true, |v| v.is_none()),
                _ => false,
            };
            if missing {
                eval(src, b, scope)
            } else {
                eval(src, a, scope)
            }
        }
        Expr::Binary(op, a, b) => {
            let x = eval(src, a, scope)?;
            // Short-circuit booleans.
            if let (&"&&", Value::Bool(false)) = (op, x) {
                return Ok(Value::Bool(false));
            }
            if let (&"||", Value::Bool(true)) = (op, x) {
                return Ok(Value::Bool(true));
            }
            let y = eval(src, b, scope)?;
            binop(op, x, y).map_err(err)
        }
        Expr::Call(f, args) => {
            let a = int(eval(src, &args[0], scope)?).map_err(err)?;
            let b = int(eval(src, &args[1], scope)?).map_err(err)?;
            let v = match f.as_str() {
                "min" => a.min(b),
                "max" => a.max(b),
                "round_up" | "ceil_div" => {
                    if b <= 0 {
                        return Err(err(format!("{f}({a}, {b}): divisor must be positive")));
                    }
                    let q = a
                        .checked_add(b - 1)
                        .ok_or_else(|| err("overflow".into()))?
                        .div_euclid(b);
                    if f == "round_up" {
                        q.checked_mul(b).ok_or_else(|| err("overflow".into()))?
                    } else {
                        q
                    }
                }
                _ => return Err(err(format!("unknown function `{f}`"))),
            };
            Ok(Value::Int(v))
        }
    }
}

fn int(v: Value) -> Result<i64, String> {
    match v {
        Value::Int(i) => Ok(i),
        Value::Bool(b) => Err(format!("expected an integer, got {b}")),
    }
}

fn binop(op: &str, x: Value, y: Value) -> Result<Value, String> {
    use Value::{Bool, Int};
    let over = || format!("overflow in {x} {op} {y}");
    Ok(match (op, x, y) {
        ("&&", Bool(a), Bool(b)) => Bool(a && b),
        ("||", Bool(a), Bool(b)) => Bool(a || b),
        ("==", a, b) => Bool(a == b),
        ("!=", a, b) => Bool(a != b),
        ("<", Int(a), Int(b)) => Bool(a < b),
        ("<=", Int(a), Int(b)) => Bool(a <= b),
        (">", Int(a), Int(b)) => Bool(a > b),
        (">=", Int(a), Int(b)) => Bool(a >= b),
        ("+", Int(a), Int(b)) => Int(a.checked_add(b).ok_or_else(over)?),
        ("-", Int(a), Int(b)) => Int(a.checked_sub(b).ok_or_else(over)?),
        ("*", Int(a), Int(b)) => Int(a.checked_mul(b).ok_or_else(over)?),
        ("/", Int(a), Int(b)) => {
            if b == 0 || a % b != 0 {
                return Err(format!(
                    "{a} / {b} is not exact ({a} is not a multiple of {b})"
                ));
            }
            Int(a / b)
        }
        ("//", Int(a), Int(b)) => {
            if b == 0 {
                return Err(format!("{a} // 0"));
            }
            Int(a.div_euclid(b))
        }
        ("%", Int(a), Int(b)) => {
            if b == 0 {
                return Err(format!("{a} % 0"));
            }
            Int(a.rem_euclid(b))
        }
        _ => return Err(format!("`{op}` does not apply to {x} and {y}")),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    struct S;
    impl Scope for S {
        fn name(&self, n: &str) -> Result<Option<Value>, ConvertError> {
            Ok(match n {
                "heads" => Some(Value::Int(9)),
                "groups" => Some(Value::Int(3)),
                _ => None,
            })
        }
        fn config(&self, n: &str) -> Result<Option<Value>, ConvertError> {
            Ok((n == "hidden_size").then_some(Value::Int(576)))
        }
    }

    fn ev(s: &str) -> Result<Value, ConvertError> {
        eval(s, &parse(s)?, &S)
    }

    #[test]
    fn arithmetic_and_config() {
        assert_eq!(ev("config.hidden_size / heads").unwrap(), Value::Int(64));
        assert_eq!(ev("heads / groups * 2 + 1").unwrap(), Value::Int(7));
        assert_eq!(ev("round_up(49153, 128 * 3)").unwrap(), Value::Int(49536));
        assert_eq!(ev("config.head_dim ?? 64").unwrap(), Value::Int(64));
        assert_eq!(
            ev("!(heads % groups == 0) || false").unwrap(),
            Value::Bool(false)
        );
        assert_eq!(ev("7 // 2 - -1").unwrap(), Value::Int(4));
    }

    #[test]
    fn errors_name_numbers() {
        let e = ev("heads / 2").unwrap_err().to_string();
        assert!(e.contains("9 / 2 is not exact"), "{e}");
        let e = ev("config.nope").unwrap_err().to_string();
        assert!(e.contains("config.json has no `nope`"), "{e}");
        assert!(ev("1 +").is_err());
        assert!(ev("foo(1)").is_err());
    }
}
