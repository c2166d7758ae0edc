//! Crash consistency (small count): `zarrckpt crash-trials` kills saving processes with SIGKILL
//! at random moments and checks the previous checkpoint or the new one is there, never
//! neither, never a mix. The full run: `zarrckpt crash-trials --trials 200`.

use std::process::Command;

#[test]
fn eight_killed_saves_leave_the_previous_or_the_new_checkpoint() {
    let tmp = tempfile::tempdir().unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_zarrckpt"))
        .args([
            "crash-trials",
            "--trials",
            "8",
            "--size",
            "1048576",
            "--seed",
            "7",
            "--dir",
        ])
        .arg(tmp.path())
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("passed 8/8"), "{stdout}");
}
