//! Crash consistency (small count): `zarrckpt crash-trials` kills saving processes with SIGKILL
//! at random moments and checks the previous checkpoint or the new one is there, never
//! neither, never a mix. The full run: `zarrckpt crash-trials --trials 200`. Also the
//! corruption harness, `zarrckpt corruption-trials`.

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

/// Corruption (small count): `zarrckpt corruption-trials` damages a checkpoint at random and
/// checks load and verify catch every damage to a shard, naming key, chunk and file, and never
/// return wrong data. The full run: `zarrckpt corruption-trials --trials 1000`.
#[test]
fn forty_random_corruptions_are_caught_naming_key_chunk_and_file() {
    let tmp = tempfile::tempdir().unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_zarrckpt"))
        .args([
            "corruption-trials",
            "--trials",
            "40",
            "--seed",
            "5",
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
    assert!(stdout.contains("40 passed"), "{stdout}");
}
