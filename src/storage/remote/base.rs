//! What the generation modules share, below all of them: the key of an object in a
//! generation, an error's text with its sources, and how often progress is logged.

use std::time::Duration;

use super::GENERATIONS;

/// How often, at most, a writer logs its progress.
pub const PROGRESS_EVERY: Duration = Duration::from_secs(5);

/// The key of `rel` in generation `generation`.
#[must_use]
pub fn generation_key(generation: &str, rel: &str) -> String {
    if rel.is_empty() {
        format!("{GENERATIONS}/{generation}")
    } else {
        format!("{GENERATIONS}/{generation}/{rel}")
    }
}

/// An error with its sources, as one line (the HTTP status sits deep in the chain).
#[must_use]
pub fn error_chain(e: &dyn std::error::Error) -> String {
    let mut out = e.to_string();
    let mut s = e.source();
    while let Some(x) = s {
        let t = x.to_string();
        if !out.contains(&t) {
            out.push_str(": ");
            out.push_str(&t);
        }
        s = x.source();
    }
    out
}
