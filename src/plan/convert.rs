//! The error of conversion planning (tables, expressions, checks, plans): every refusal names
//! the rule (or check), the tensor key and the numbers involved (spec § 19.5). It lives in the
//! plan layer so that planning needs nothing above it; [`crate::convert`] re-exports it.

/// Why a conversion was refused (before any data byte is read) or a table is invalid.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ConvertError {
    /// A table document is malformed (JSON, schema-level structure, unknown op, `extends`).
    #[error("table `{table}`: {msg}")]
    Table {
        /// The table's name (or file).
        table: String,
        /// What is wrong.
        msg: String,
    },
    /// An expression failed to parse or evaluate.
    #[error("expression `{expr}`: {msg}")]
    Expr {
        /// The expression's text.
        expr: String,
        /// What failed, with the numbers.
        msg: String,
    },
    /// An error inside one rule (wraps the cause).
    #[error("rule `{rule}`: {cause}")]
    InRule {
        /// The rule's name.
        rule: String,
        /// The cause.
        cause: Box<ConvertError>,
    },
    /// A name pattern is invalid (a substitution inside a name component, bad braces).
    #[error("pattern `{pattern}`: {msg}")]
    Pattern {
        /// The pattern.
        pattern: String,
        /// What is wrong.
        msg: String,
    },
    /// A table check (`checks`) is false.
    #[error("check `{check}` failed: `{expr}` is false")]
    Check {
        /// The check's name.
        check: String,
        /// Its expression.
        expr: String,
    },
    /// The op of a rule cannot relate its tensors (shapes that do not concatenate, a group
    /// count that does not divide, an axis out of range).
    #[error("rule `{rule}` ({op}): {msg}")]
    Op {
        /// The rule.
        rule: String,
        /// The op.
        op: String,
        /// What is wrong, with the numbers.
        msg: String,
    },
    /// Destination elements produced by no rule (`count` = 0) or more than once.
    #[error("{side} tensor `{key}`{at}: {elements} elements produced {how} ({rules})", how = if *.times == 0 { "by no rule".to_string() } else { format!("{} times", .times) })]
    Coverage {
        /// `megatron`, `hf` or `vllm`.
        side: &'static str,
        /// The destination tensor.
        key: String,
        /// Where (stack index and box), may be empty.
        at: String,
        /// How many elements.
        elements: u64,
        /// How many times they are produced (0 = never).
        times: u32,
        /// The rules involved.
        rules: String,
    },
    /// Source elements consumed more than once (e.g. tied embeddings written twice).
    #[error(
        "{side} tensor `{key}`{at}: {elements} elements consumed twice, by rules {rules} (a source is converted once; tied embeddings are written once)"
    )]
    ConsumedTwice {
        /// `megatron` or `hf`.
        side: &'static str,
        /// The source tensor.
        key: String,
        /// Where.
        at: String,
        /// How many elements.
        elements: u64,
        /// The rules involved.
        rules: String,
    },
    /// A source tensor of the input that no rule consumes and no `drop` glob lists.
    #[error(
        "{side} tensor `{key}` (shape {shape:?}) is consumed by no rule and not listed in the table's `drop.{side}`{hint}"
    )]
    Unconsumed {
        /// `megatron` or `hf`.
        side: &'static str,
        /// The tensor.
        key: String,
        /// Its shape.
        shape: Vec<u64>,
        /// A hint (e.g. a near miss), may be empty.
        hint: String,
    },
    /// Source elements no rule consumes (a split part with no target).
    #[error(
        "{side} tensor `{key}`{at}: {elements} of its elements are consumed by no rule (rules {rules}): a split part without a target"
    )]
    PartlyConsumed {
        /// `megatron` or `hf`.
        side: &'static str,
        /// The tensor.
        key: String,
        /// Where.
        at: String,
        /// Elements not consumed.
        elements: u64,
        /// The rules consuming the rest.
        rules: String,
    },
    /// A source tensor the table needs is not in the input.
    #[error("rule `{rule}`: {side} tensor `{key}` is not in the input{hint}")]
    Missing {
        /// The rule.
        rule: String,
        /// `megatron` or `hf`.
        side: &'static str,
        /// The tensor.
        key: String,
        /// A hint, may be empty.
        hint: String,
    },
    /// A stored shape differs from the one the table implies from config.json.
    #[error(
        "rule `{rule}`: {side} tensor `{key}` is stored with shape {stored:?}, config.json implies {expected:?}{hint}"
    )]
    Shape {
        /// The rule.
        rule: String,
        /// `megatron` or `hf`.
        side: &'static str,
        /// The tensor.
        key: String,
        /// Stored shape.
        stored: Vec<u64>,
        /// Implied shape.
        expected: Vec<u64>,
        /// A hint, may be empty.
        hint: String,
    },
    /// A stored data type the conversion cannot take.
    #[error("rule `{rule}`: {side} tensor `{key}` is stored as {stored}, expected {expected}")]
    Dtype {
        /// The rule.
        rule: String,
        /// `megatron` or `hf`.
        side: &'static str,
        /// The tensor.
        key: String,
        /// Stored.
        stored: String,
        /// Expected.
        expected: String,
    },
    /// The requested layout does not divide the model.
    #[error(
        "rule `{rule}`: {key}: {what} = {value} is not divisible by {by_name} = {by} ({layout})"
    )]
    Divisibility {
        /// The rule.
        rule: String,
        /// The tensor.
        key: String,
        /// What must divide (e.g. `units (query groups) along axis 1`).
        what: String,
        /// Its value.
        value: u64,
        /// The divisor's name (`tp`, `ep`, `pp`, vLLM `tp`).
        by_name: String,
        /// The divisor.
        by: u64,
        /// The layout requested.
        layout: String,
    },
    /// A fused tensor's structure is wrong: its tensor-parallel units do not each hold an
    /// equal share of every source (e.g. QKV concatenated instead of interleaved per group).
    #[error("rule `{rule}`: megatron tensor `{key}`: {msg}")]
    Structure {
        /// The rule.
        rule: String,
        /// The tensor.
        key: String,
        /// What is wrong, with the numbers.
        msg: String,
    },
    /// Two rules write the same destination name, or a rule name repeats.
    #[error("{what} `{name}` is defined by rules {rules}")]
    Duplicate {
        /// `rule name`, `megatron tensor`, `hf tensor`, `vllm tensor`.
        what: &'static str,
        /// The name.
        name: String,
        /// The rules.
        rules: String,
    },
    /// An HF shape that depends on the Megatron layout (padding rows kept in an HF tensor).
    #[error(
        "rule `{rule}`: hf tensor `{key}` has shape {shape:?} at {layout} but {other:?} at {other_layout}: HF shapes are fixed by config.json alone; Megatron's padding rows (vocabulary padded for the saving TP) must not be kept in HF tensors"
    )]
    LayoutDependentShape {
        /// The rule.
        rule: String,
        /// The HF tensor.
        key: String,
        /// Its shape at the layout of the conversion.
        shape: Vec<u64>,
        /// The layout.
        layout: String,
        /// Its shape at a probe layout.
        other: Vec<u64>,
        /// The probe layout.
        other_layout: String,
    },
    /// Something the conversion does not support (e.g. export through an import-only value op).
    #[error("rule `{rule}`: {msg}")]
    Unsupported {
        /// The rule.
        rule: String,
        /// What.
        msg: String,
    },
}

impl ConvertError {
    /// Wraps `self` with the rule it happened in.
    #[must_use]
    pub fn in_rule(self, rule: &str) -> Self {
        match self {
            e @ (ConvertError::InRule { .. }
            | ConvertError::Op { .. }
            | ConvertError::Missing { .. }
            | ConvertError::Shape { .. }
            | ConvertError::Dtype { .. }
            | ConvertError::Divisibility { .. }
            | ConvertError::Structure { .. }
            | ConvertError::LayoutDependentShape { .. }
            | ConvertError::Unsupported { .. }) => e,
            e => ConvertError::InRule {
                rule: rule.to_owned(),
                cause: Box::new(e),
            },
        }
    }
}
