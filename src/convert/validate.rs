//! Checking a table document before it is used: the JSON schema of spec § 19
//! (`spec/schema/mapping.schema.json`, embedded) and the name-pattern rule of § 19.3 (each
//! `{expr}` a whole dot-separated component), with JSON pointers to each violation.

use std::path::Path;
use std::sync::OnceLock;

use super::error::ConvertError;
use super::expand::Pattern;
use super::table::{BUILTIN, Table};

/// The mapping schema.
pub const SCHEMA: &str = include_str!("../../spec/schema/mapping.schema.json");

/// At most this many violations are named in one error.
const SHOWN: usize = 8;

fn validator() -> Result<&'static jsonschema::Validator, ConvertError> {
    static V: OnceLock<Result<jsonschema::Validator, String>> = OnceLock::new();
    V.get_or_init(|| {
        let schema: serde_json::Value = serde_json::from_str(SCHEMA).map_err(|e| e.to_string())?;
        jsonschema::draft202012::new(&schema).map_err(|e| e.to_string())
    })
    .as_ref()
    .map_err(|e| ConvertError::Table {
        table: "mapping schema".into(),
        msg: e.clone(),
    })
}

/// Checks one table document (before `extends` is resolved) against the schema and the
/// name-pattern rule.
///
/// # Errors
/// [`ConvertError::Table`] naming `origin` and each violation's JSON pointer (at most 8).
pub fn validate(doc: &serde_json::Value, origin: &str) -> Result<(), ConvertError> {
    let mut errors: Vec<String> = validator()?
        .iter_errors(doc)
        .map(|e| {
            let at = e.instance_path.to_string();
            format!("{}: {e}", if at.is_empty() { "/" } else { &at })
        })
        .collect();
    if errors.is_empty() {
        errors = pattern_errors(doc);
    }
    if errors.is_empty() {
        return Ok(());
    }
    let n = errors.len();
    let mut msg = errors[..n.min(SHOWN)].join("; ");
    if n > SHOWN {
        msg.push_str(&format!("; ... ({n} in all)"));
    }
    Err(ConvertError::Table {
        table: origin.to_owned(),
        msg,
    })
}

/// The name patterns of a (schema-valid) document that break the pattern rule.
fn pattern_errors(doc: &serde_json::Value) -> Vec<String> {
    let mut out = Vec::new();
    let mut check = |v: Option<&serde_json::Value>, at: String| {
        if let Some(p) = v.and_then(serde_json::Value::as_str)
            && let Err(e) = Pattern::parse(p)
        {
            out.push(format!("{at}: {e}"));
        }
    };
    let list = |v: &serde_json::Value, k: &str| -> Vec<serde_json::Value> {
        v.get(k)
            .and_then(serde_json::Value::as_array)
            .cloned()
            // The document passed the schema: an absent list is an optional one, empty.
            .unwrap_or_default()
    };
    for (i, rule) in list(doc, "rules").iter().enumerate() {
        check(rule.get("megatron"), format!("/rules/{i}/megatron"));
        for (j, a) in list(rule, "megatron_aliases").iter().enumerate() {
            check(Some(a), format!("/rules/{i}/megatron_aliases/{j}"));
        }
        for (j, h) in list(rule, "hf").iter().enumerate() {
            check(h.get("name"), format!("/rules/{i}/hf/{j}/name"));
        }
    }
    // No `vllm` section: a null value, with no tensors to check.
    let vllm = doc.get("vllm").cloned().unwrap_or_default();
    for (i, t) in list(&vllm, "tensors").iter().enumerate() {
        check(t.get("name"), format!("/vllm/tensors/{i}/name"));
        for (j, p) in list(t, "parts").iter().enumerate() {
            check(p.get("hf"), format!("/vllm/tensors/{i}/parts/{j}/hf"));
        }
    }
    for (i, o) in list(doc, "objects").iter().enumerate() {
        check(o.get("name"), format!("/objects/{i}/name"));
    }
    out
}

/// A table by built-in name, file path or JSON text (`{...}`), every document of its
/// `extends` chain that is not built in checked by [`validate`] first.
///
/// # Errors
/// [`ConvertError::Table`].
pub fn load_checked(name_path_or_json: &str) -> Result<Table, ConvertError> {
    if name_path_or_json.trim_start().starts_with('{') {
        let doc = parse(name_path_or_json, "<json>")?;
        validate(&doc, "<json>")?;
        return Table::from_json(name_path_or_json);
    }
    if BUILTIN.iter().any(|(n, _)| *n == name_path_or_json) {
        return Table::builtin(name_path_or_json);
    }
    // The chain of files (built-in bases are valid: tests check them).
    let mut path = Path::new(name_path_or_json).to_owned();
    for _ in 0..=8 {
        let origin = path.display().to_string();
        let Ok(text) = std::fs::read_to_string(&path) else {
            // Table::load names the unreadable file.
            break;
        };
        let doc = parse(&text, &origin)?;
        validate(&doc, &origin)?;
        match doc.get("extends").and_then(serde_json::Value::as_str) {
            Some(base) if !BUILTIN.iter().any(|(n, _)| *n == base) => {
                path = path.parent().unwrap_or(Path::new(".")).join(base);
            }
            _ => break,
        }
    }
    Table::load(name_path_or_json)
}

fn parse(text: &str, origin: &str) -> Result<serde_json::Value, ConvertError> {
    serde_json::from_str(text).map_err(|e| ConvertError::Table {
        table: origin.to_owned(),
        msg: format!("not JSON: {e}"),
    })
}
