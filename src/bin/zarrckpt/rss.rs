//! Resident memory of this process (Linux `/proc`).

fn status_kb(field: &str) -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix(field))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .unwrap_or(0)
}

/// Peak resident memory since the last reset, in bytes.
pub fn peak() -> u64 {
    status_kb("VmHWM:") * 1024
}

/// Current resident memory, in bytes.
pub fn current() -> u64 {
    status_kb("VmRSS:") * 1024
}

/// Resets the peak to the current value (`clear_refs` value 5); false where unsupported.
pub fn reset_peak() -> bool {
    std::fs::write("/proc/self/clear_refs", "5").is_ok()
}

/// CPU seconds so far: (this process, user + system; the whole machine, every CPU busy), from
/// `/proc` (zeros where unreadable). The difference of two readings around a step, with the
/// machine otherwise idle, splits its CPU between this process and the rest (a local server).
pub fn cpu_seconds() -> (f64, f64) {
    // SAFETY: sysconf has no preconditions.
    let tick = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1);
    #[allow(clippy::cast_precision_loss)]
    let secs = |ticks: u64| ticks as f64 / tick as f64;
    let own = std::fs::read_to_string("/proc/self/stat")
        .ok()
        .and_then(|s| {
            // Fields after the command name (which may hold spaces) in parentheses.
            let rest = s.rsplit_once(')')?.1;
            let f: Vec<&str> = rest.split_whitespace().collect();
            Some(f.get(11)?.parse::<u64>().ok()? + f.get(12)?.parse::<u64>().ok()?)
        })
        .unwrap_or(0);
    let busy = std::fs::read_to_string("/proc/stat")
        .ok()
        .and_then(|s| {
            let f: Vec<u64> = s
                .lines()
                .next()?
                .split_whitespace()
                .skip(1)
                .filter_map(|v| v.parse().ok())
                .collect();
            // user nice system idle iowait irq softirq steal: busy is all but idle and iowait.
            Some(f.iter().sum::<u64>() - f.get(3)? - f.get(4)?)
        })
        .unwrap_or(0);
    (secs(own), secs(busy))
}
