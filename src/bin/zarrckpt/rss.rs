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
