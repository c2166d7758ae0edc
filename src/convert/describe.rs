//! A plan as text, for dry runs and `inspect --map`: per destination its sources, the bytes
//! each group (file, rank) reads and writes, and the checks passed.

use std::fmt::Write as _;

use super::plan::Plan;

/// `plan` as text, headed `plan: {what}`; `group_name` names a group (`file`, `rank`).
#[must_use]
pub fn describe(plan: &Plan, what: &str, group_name: &str) -> String {
    let mut s = String::new();
    // Writing into a String cannot fail.
    let _ = write_plan(&mut s, plan, what, group_name);
    s
}

fn write_plan(s: &mut String, plan: &Plan, what: &str, group_name: &str) -> std::fmt::Result {
    writeln!(s, "plan: {what}")?;
    writeln!(s, "params:")?;
    for (k, v) in &plan.params {
        writeln!(s, "  {k} = {v}")?;
    }
    writeln!(s, "destinations ({}):", plan.dests.len())?;
    for d in &plan.dests {
        let srcs: Vec<String> = d
            .pieces
            .iter()
            .map(|p| {
                format!(
                    "{}{}{}",
                    plan.sources[p.src].name,
                    p.sbox,
                    if p.transpose { "^T" } else { "" }
                )
            })
            .collect();
        let shown = if srcs.is_empty() {
            "zeros".to_string()
        } else if srcs.len() > 6 {
            format!("{} ... ({} pieces)", srcs[..6].join(" + "), srcs.len())
        } else {
            srcs.join(" + ")
        };
        let whole = d.region.volume() == d.shape.iter().product::<u64>();
        writeln!(
            s,
            "  [{group_name} {}] {} {}{:?} {} <- {shown}",
            d.group,
            d.name,
            d.dtype,
            d.shape,
            if whole {
                String::new()
            } else {
                format!("box {}", d.region)
            },
        )?;
    }
    writeln!(s, "bytes per {group_name}:")?;
    for (g, (r, w)) in plan.bytes_per_group() {
        writeln!(s, "  {group_name} {g}: reads {r} bytes, writes {w} bytes")?;
    }
    writeln!(s, "checks passed:")?;
    for c in &plan.checks {
        writeln!(s, "  ok: {c}")?;
    }
    Ok(())
}
