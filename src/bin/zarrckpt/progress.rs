//! Progress bars on long commands, hidden when stderr is not a terminal.

use std::io::IsTerminal;
use std::sync::Arc;

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

/// A byte-counting progress bar (hidden when stderr is not a terminal).
pub fn bytes(total: u64, what: &str) -> ProgressBar {
    let pb = ProgressBar::with_draw_target(Some(total), draw_target());
    pb.set_style(
        ProgressStyle::with_template(
            "{msg:>10} [{bar:40}] {bytes}/{total_bytes} {bytes_per_sec} eta {eta}",
        )
        .unwrap_or_else(|_| ProgressStyle::default_bar())
        .progress_chars("=> "),
    );
    pb.set_message(what.to_owned());
    pb
}

fn draw_target() -> ProgressDrawTarget {
    if std::io::stderr().is_terminal() {
        ProgressDrawTarget::stderr()
    } else {
        ProgressDrawTarget::hidden()
    }
}

/// A library progress callback feeding `pb`.
pub fn callback(pb: &ProgressBar) -> zarrckpt::save::Progress {
    let pb = pb.clone();
    Arc::new(move |n| pb.inc(n))
}
