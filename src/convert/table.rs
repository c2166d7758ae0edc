//! Conversion tables as data (spec § 19.2): the JSON document, built-in tables, `extends`.

use std::collections::BTreeMap;
use std::path::Path;

use serde::{Deserialize, Serialize};

use super::error::ConvertError;

/// An expression as written in a table: a string, an integer or a boolean.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum ExprText {
    /// An integer literal.
    Int(i64),
    /// A boolean literal.
    Bool(bool),
    /// An expression in the grammar of § 19.3.
    Text(String),
}

impl ExprText {
    /// The source text.
    #[must_use]
    pub fn text(&self) -> String {
        match self {
            ExprText::Int(i) => i.to_string(),
            ExprText::Bool(b) => b.to_string(),
            ExprText::Text(s) => s.clone(),
        }
    }
}

/// A stack capture (layer, expert): the leading axes of a Megatron tensor.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StackSpec {
    /// The capture's name (`layer`, `expert`).
    pub capture: String,
    /// The axis' size.
    pub size: ExprText,
    /// First index this rule covers (default 0).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub start: Option<ExprText>,
    /// One past the last index this rule covers (default `size`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stop: Option<ExprText>,
    /// The capture is substituted into the Megatron key (per-layer keys of non-homogeneous
    /// models, `decoder.layers.{layer}.…`) instead of being a leading axis.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub in_name: bool,
}

/// One HF tensor of a rule.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HfSpec {
    /// Name pattern.
    pub name: String,
    /// Shape expressions.
    pub shape: Vec<ExprText>,
    /// Data type, when fixed (e.g. a float32 scale).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dtype: Option<String>,
}

/// Where an op's result sits in the Megatron body.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Place {
    /// Axis.
    pub axis: usize,
    /// Start.
    pub at: ExprText,
    /// The body's whole extent along the axis.
    pub size: ExprText,
}

/// FP8 block dequantisation (import only).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Dequant {
    /// Suffix appended to each HF tensor's name to name its fp32 `scale_inv` tensor
    /// (`_scale_inv`: `…weight` -> `…weight_scale_inv`).
    pub scale: String,
    /// Block shape.
    pub block: [u64; 2],
    /// Whether the HF tensors are quantised (e.g. `fp8` = `config.quantization_config ?? false`);
    /// when false the rule copies them as they are.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub when: Option<ExprText>,
}

/// A value op.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "snake_case")]
pub enum ValueOp {
    /// Megatron = HF + c.
    Add(f64),
    /// Megatron = HF (fp8) * scale_inv per block.
    DequantFp8Block(Dequant),
}

/// Tensor parallelism of a Megatron tensor.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TpSpec {
    /// The body axis split.
    pub axis: usize,
    /// Indivisible units along the axis (default: the extent of one part).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub units: Option<ExprText>,
    /// Equal segments each split over TP (default 1).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parts: Option<ExprText>,
}

/// Expert parallelism of a Megatron tensor.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EpSpec {
    /// The stack capture split over EP ranks.
    pub capture: String,
}

/// One rule: a Megatron tensor and its HF tensors.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Rule {
    /// Unique name.
    pub name: String,
    /// Condition.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub when: Option<ExprText>,
    /// Megatron key pattern.
    pub megatron: String,
    /// Other spellings accepted on export.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub megatron_aliases: Vec<String>,
    /// Stack captures.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub stack: Vec<StackSpec>,
    /// The op.
    pub op: String,
    /// Axis of slice / concat / interleave (default 0).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub axis: Option<usize>,
    /// Groups of interleave.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub groups: Option<ExprText>,
    /// Start of slice.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub start: Option<ExprText>,
    /// Stop of slice.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stop: Option<ExprText>,
    /// Rows after pad.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub to: Option<ExprText>,
    /// Placement in the body.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub place: Option<Place>,
    /// HF tensors.
    pub hf: Vec<HfSpec>,
    /// Megatron data type (cast) when it differs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dtype: Option<String>,
    /// Value ops (import direction).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub value: Vec<ValueOp>,
    /// Tensor parallelism.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tp: Option<TpSpec>,
    /// Expert parallelism.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ep: Option<EpSpec>,
}

/// Drop lists.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Drop {
    /// Megatron keys not converted.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub megatron: Vec<String>,
    /// HF names not converted.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub hf: Vec<String>,
}

/// A named check.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CheckSpec {
    /// Name.
    pub name: String,
    /// Boolean expression.
    pub expr: ExprText,
}

/// One part of a vLLM per-rank tensor.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct VllmPart {
    /// HF tensor name pattern.
    pub hf: String,
    /// Axis split over TP (none: the whole tensor on every rank).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub axis: Option<usize>,
    /// Indivisible units along the axis.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub units: Option<ExprText>,
    /// Replicate units when the TP size exceeds their count.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub replicate: bool,
    /// Pad the axis with zeros to this extent first.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pad_to: Option<ExprText>,
}

/// One vLLM per-rank tensor.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct VllmTensor {
    /// vLLM parameter name pattern.
    pub name: String,
    /// Condition.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub when: Option<ExprText>,
    /// Stack captures.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub stack: Vec<StackSpec>,
    /// Concatenation axis of the parts (default 0).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub axis: Option<usize>,
    /// A capture stacked as a new leading axis of the tensor (vLLM's fused-MoE `w13_weight`
    /// [experts, ...]): the parts are evaluated per index and stacked.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub inner: Option<StackSpec>,
    /// Parts.
    pub parts: Vec<VllmPart>,
}

/// The vLLM section.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct VllmSection {
    /// The vLLM version whose layout this is.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub version: Option<String>,
    /// Tensors.
    #[serde(default)]
    pub tensors: Vec<VllmTensor>,
}

/// A Megatron `ShardedObject` an import writes (JSON `null`, as the extra state of
/// Megatron's local linear layers), under Megatron's unique key
/// `<name>/shard_<layer>_<layers>` (`shard_0_1` without a stack).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ObjectSpec {
    /// The object's key.
    pub name: String,
    /// Condition.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub when: Option<ExprText>,
    /// Stack captures (the object's grid).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub stack: Vec<StackSpec>,
}

/// A conversion table (spec § 19).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Table {
    /// JSON Schema reference (ignored).
    #[serde(rename = "$schema", default, skip_serializing_if = "Option::is_none")]
    pub schema: Option<String>,
    /// Always `zarrckpt-mapping`.
    pub format: String,
    /// Always 1.
    pub version: u32,
    /// Name.
    pub name: String,
    /// Description.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub description: Option<String>,
    /// Base table.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub extends: Option<String>,
    /// Params (name -> expression).
    #[serde(default)]
    pub params: BTreeMap<String, ExprText>,
    /// Checks.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub checks: Vec<CheckSpec>,
    /// Rules.
    #[serde(default)]
    pub rules: Vec<Rule>,
    /// Inherited rules removed.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub remove_rules: Vec<String>,
    /// Inherited vLLM tensors removed (by name pattern).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub remove_vllm: Vec<String>,
    /// Drop lists.
    #[serde(default)]
    pub drop: Drop,
    /// vLLM per-rank tensors.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub vllm: Option<VllmSection>,
    /// Megatron objects an import writes.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub objects: Vec<ObjectSpec>,
}

/// The built-in tables: (name, JSON text).
pub const BUILTIN: &[(&str, &str)] = &[
    ("llama", include_str!("../../tables/llama.json")),
    ("qwen2", include_str!("../../tables/qwen2.json")),
    ("qwen3", include_str!("../../tables/qwen3.json")),
    ("qwen3_moe", include_str!("../../tables/qwen3_moe.json")),
    ("deepseek_v3", include_str!("../../tables/deepseek_v3.json")),
];

/// The names of the built-in tables.
#[must_use]
pub fn builtin_names() -> Vec<&'static str> {
    BUILTIN.iter().map(|(n, _)| *n).collect()
}

const OPS: [&str; 6] = [
    "rename",
    "transpose",
    "slice",
    "concat",
    "interleave",
    "pad",
];

impl Table {
    /// Parses one document (no `extends` resolution).
    ///
    /// # Errors
    /// [`ConvertError::Table`] for invalid JSON or structure.
    pub fn parse(text: &str, origin: &str) -> Result<Table, ConvertError> {
        let de = &mut serde_json::Deserializer::from_str(text);
        let t: Table = serde_path_to_error::deserialize(de).map_err(|e| ConvertError::Table {
            table: origin.to_owned(),
            msg: format!("at {}: {}", e.path(), e.inner()),
        })?;
        let bad = |msg: String| ConvertError::Table {
            table: origin.to_owned(),
            msg,
        };
        if t.format != "zarrckpt-mapping" {
            return Err(bad(format!(
                "format is {:?}, not \"zarrckpt-mapping\"",
                t.format
            )));
        }
        if t.version != 1 {
            return Err(bad(format!("version {} is not 1", t.version)));
        }
        for r in &t.rules {
            if !OPS.contains(&r.op.as_str()) {
                return Err(bad(format!(
                    "rule `{}`: unknown op `{}` (one of {})",
                    r.name,
                    r.op,
                    OPS.join(", ")
                )));
            }
        }
        Ok(t)
    }

    /// A table from JSON text, with `extends` resolved against the built-in tables.
    ///
    /// # Errors
    /// [`ConvertError::Table`] for invalid text or an unknown base.
    pub fn from_json(text: &str) -> Result<Table, ConvertError> {
        Table::parse(text, "<json>")?.resolve(0)
    }

    /// A built-in table by name, with `extends` resolved.
    ///
    /// # Errors
    /// [`ConvertError::Table`] for an unknown name.
    pub fn builtin(name: &str) -> Result<Table, ConvertError> {
        let (_, text) =
            BUILTIN
                .iter()
                .find(|(n, _)| *n == name)
                .ok_or_else(|| ConvertError::Table {
                    table: name.to_owned(),
                    msg: format!(
                        "no built-in table of this name (built-in: {})",
                        builtin_names().join(", ")
                    ),
                })?;
        Table::parse(text, name)?.resolve(0)
    }

    /// A built-in name, or a JSON file (whose `extends` may name a built-in table or
    /// another file, relative to it).
    ///
    /// # Errors
    /// [`ConvertError::Table`] for an unreadable or invalid file.
    pub fn load(name_or_path: &str) -> Result<Table, ConvertError> {
        if BUILTIN.iter().any(|(n, _)| *n == name_or_path) {
            return Table::builtin(name_or_path);
        }
        Table::load_file(Path::new(name_or_path), 0)
    }

    fn load_file(path: &Path, depth: usize) -> Result<Table, ConvertError> {
        let text = std::fs::read_to_string(path).map_err(|e| ConvertError::Table {
            table: path.display().to_string(),
            msg: format!(
                "cannot read: {e} (built-in tables: {})",
                builtin_names().join(", ")
            ),
        })?;
        let t = Table::parse(&text, &path.display().to_string())?;
        match &t.extends {
            Some(base) if !BUILTIN.iter().any(|(n, _)| n == base) => {
                let base_path = path.parent().unwrap_or(Path::new(".")).join(base);
                let b = Table::load_file_depth(&base_path, depth + 1)?;
                Ok(b.extend_with(t))
            }
            _ => t.resolve(depth),
        }
    }

    fn load_file_depth(path: &Path, depth: usize) -> Result<Table, ConvertError> {
        if depth > 8 {
            return Err(ConvertError::Table {
                table: path.display().to_string(),
                msg: "`extends` nests deeper than 8 tables".into(),
            });
        }
        Table::load_file(path, depth)
    }

    /// Resolves `extends` against the built-in tables.
    fn resolve(self, depth: usize) -> Result<Table, ConvertError> {
        let Some(base) = self.extends.clone() else {
            return Ok(self);
        };
        if depth > 8 {
            return Err(ConvertError::Table {
                table: self.name.clone(),
                msg: "`extends` nests deeper than 8 tables".into(),
            });
        }
        let (_, text) =
            BUILTIN
                .iter()
                .find(|(n, _)| *n == base)
                .ok_or_else(|| ConvertError::Table {
                    table: self.name.clone(),
                    msg: format!("extends `{base}`, which is not a built-in table"),
                })?;
        let b = Table::parse(text, &base)?.resolve(depth + 1)?;
        Ok(b.extend_with(self))
    }

    /// `self` extended by `ext` (spec § 19.2).
    #[must_use]
    pub fn extend_with(mut self, ext: Table) -> Table {
        self.name = ext.name;
        if ext.description.is_some() {
            self.description = ext.description;
        }
        self.extends = None;
        self.params.extend(ext.params);
        self.checks.extend(ext.checks);
        self.rules.retain(|r| !ext.remove_rules.contains(&r.name));
        for r in ext.rules {
            match self.rules.iter_mut().find(|x| x.name == r.name) {
                Some(slot) => *slot = r,
                None => self.rules.push(r),
            }
        }
        for o in ext.objects {
            match self.objects.iter_mut().find(|x| x.name == o.name) {
                Some(slot) => *slot = o,
                None => self.objects.push(o),
            }
        }
        self.drop.megatron.extend(ext.drop.megatron);
        self.drop.hf.extend(ext.drop.hf);
        if let Some(mine) = &mut self.vllm {
            mine.tensors.retain(|t| !ext.remove_vllm.contains(&t.name));
        }
        if let Some(v) = ext.vllm {
            let mine = self.vllm.get_or_insert_with(VllmSection::default);
            if v.version.is_some() {
                mine.version = v.version;
            }
            for t in v.tensors {
                match mine
                    .tensors
                    .iter_mut()
                    .find(|x| x.name == t.name && x.when == t.when)
                {
                    Some(slot) => *slot = t,
                    None => mine.tensors.push(t),
                }
            }
        }
        self
    }

    /// The table as JSON (round trip of [`Table::parse`]).
    #[must_use]
    pub fn to_json(&self) -> String {
        serde_json::to_string_pretty(self)
            .expect("a table is plain data with string keys: serialising it cannot fail")
    }
}

/// Whether `name` matches a `drop` glob (`*` matches any run of characters).
#[must_use]
pub fn glob_match(glob: &str, name: &str) -> bool {
    let parts: Vec<&str> = glob.split('*').collect();
    if parts.len() == 1 {
        return glob == name;
    }
    let (first, last) = (parts[0], parts[parts.len() - 1]);
    if !name.starts_with(first) || name.len() < first.len() + last.len() || !name.ends_with(last) {
        return false;
    }
    let mut rest = &name[first.len()..name.len() - last.len()];
    for p in &parts[1..parts.len() - 1] {
        match rest.find(p) {
            Some(i) => rest = &rest[i + p.len()..],
            None => return false,
        }
    }
    true
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn globs() {
        assert!(glob_match("*._extra_state", "a.b._extra_state"));
        assert!(glob_match("optimizer.*", "optimizer.state.x"));
        assert!(glob_match("a*b*c", "aXXbYYc"));
        assert!(!glob_match("a*b*c", "aXXcYYb"));
        assert!(glob_match("x", "x"));
        assert!(!glob_match("x*", "y"));
    }

    #[test]
    fn builtins_parse_and_round_trip() {
        for name in builtin_names() {
            let t = Table::builtin(name).unwrap();
            let back = Table::parse(&t.to_json(), name).unwrap();
            assert_eq!(t, back, "{name}");
        }
    }
}
