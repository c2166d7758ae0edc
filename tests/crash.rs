//! Crash consistency (small count): `zarrckpt crash-trials` kills saving processes with SIGKILL
//! at random moments and checks the previous checkpoint or the new one is there, never
//! neither, never a mix. The full run: `zarrckpt crash-trials --trials 200`. Also the
//! corruption harness, `zarrckpt corruption-trials`.

#[path = "common/s3.rs"]
mod s3_server;

use std::process::Command;

/// Crash consistency on S3 (SeaweedFS on loopback, started here): `zarrckpt crash-trials
/// --url` SIGKILLs overwrites straight to the store at random moments; every trial must leave
/// the old or the new checkpoint loadable and verified, and `gc` must leave only the committed
/// generation after the next overwrite. 10 trials by default; the full run:
/// `ZARRCKPT_S3_CRASH_TRIALS=200 cargo test --release --test crash s3 -- --nocapture`.
#[test]
fn killed_overwrites_on_s3_leave_the_old_or_the_new_checkpoint() {
    if s3_server::skipped("killed_overwrites_on_s3_leave_the_old_or_the_new_checkpoint") {
        return;
    }
    let trials: usize = std::env::var("ZARRCKPT_S3_CRASH_TRIALS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(10);
    let server = s3_server::S3Server::start();
    let url = format!("s3://{}/crash", s3_server::BUCKET);
    // The bucket exists a moment after the port opens: wait until a signed LIST answers.
    let t0 = std::time::Instant::now();
    while !Command::new(env!("CARGO_BIN_EXE_zarrckpt"))
        .args(["ls", &url])
        .envs(server.env())
        .output()
        .unwrap()
        .status
        .success()
    {
        assert!(
            t0.elapsed() < std::time::Duration::from_secs(60),
            "SeaweedFS answers no signed LIST after 60 s\n{}",
            server.log()
        );
        std::thread::sleep(std::time::Duration::from_millis(200));
    }
    let out = Command::new(env!("CARGO_BIN_EXE_zarrckpt"))
        .args([
            "crash-trials",
            "--trials",
            &trials.to_string(),
            "--size",
            "1048576",
            "--seed",
            "11",
            "--url",
        ])
        .arg(&url)
        .envs(server.env())
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    println!("{stdout}");
    assert!(
        out.status.success(),
        "{stdout}\n{}\n{}",
        String::from_utf8_lossy(&out.stderr),
        server.log()
    );
    assert!(
        stdout.contains(&format!("passed {trials}/{trials}")),
        "{stdout}"
    );
}

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
