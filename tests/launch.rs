//! The local launcher with real processes, and `TcpComm` across processes through it.

use std::ffi::OsString;
use std::os::unix::process::ExitStatusExt;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

// The launcher belongs to the CLI (`zarrckpt launch`); its source is included here.
#[allow(dead_code)]
#[path = "../src/bin/zarrckpt/launcher.rs"]
mod launcher;

use launcher::{LaunchError, LaunchOptions, Sink, launch};

fn sh(script: &str) -> Vec<OsString> {
    vec!["sh".into(), "-c".into(), script.into()]
}

type Captured = Arc<Mutex<Vec<u8>>>;

/// Options capturing both output streams in memory.
fn captured() -> (LaunchOptions, Captured, Captured) {
    let (out, out_buf) = Sink::memory();
    let (err, err_buf) = Sink::memory();
    let opts = LaunchOptions {
        stdout: out,
        stderr: err,
        timeout: Some(Duration::from_secs(60)),
        ..Default::default()
    };
    (opts, out_buf, err_buf)
}

fn text(buf: &Captured) -> String {
    String::from_utf8_lossy(&buf.lock().unwrap()).into_owned()
}

#[test]
fn all_succeed_with_prefixed_output() {
    let (opts, out, err) = captured();
    let s = launch(3, &sh("echo hello $RANK of $WORLD_SIZE $LOCAL_RANK/$LOCAL_WORLD_SIZE at $MASTER_ADDR:$MASTER_PORT; echo oops $RANK >&2"), &opts).unwrap();
    assert_eq!(s.statuses.len(), 3);
    assert!(s.statuses.iter().all(std::process::ExitStatus::success));
    let (out, err) = (text(&out), text(&err));
    for r in 0..3 {
        let line = format!(
            "[rank {r}] hello {r} of 3 {r}/3 at 127.0.0.1:{}\n",
            s.master_port
        );
        assert!(out.contains(&line), "{out}");
        assert!(err.contains(&format!("[rank {r}] oops {r}\n")), "{err}");
    }
    assert!(!out.contains("oops") && !err.contains("hello"));
}

#[test]
fn first_failure_stops_the_others_fast() {
    let (opts, _, _) = captured();
    let t0 = Instant::now();
    let e = launch(
        4,
        &sh(r#"if [ "$RANK" = 2 ]; then sleep 0.2; exit 7; fi; sleep 60"#),
        &opts,
    )
    .unwrap_err();
    assert!(
        t0.elapsed() < Duration::from_secs(5),
        "took {:?}",
        t0.elapsed()
    );
    let LaunchError::RankFailed {
        rank,
        status,
        statuses,
    } = &e
    else {
        panic!("{e}")
    };
    assert_eq!((*rank, status.code()), (2, Some(7)));
    for (r, s) in statuses.iter().enumerate().filter(|(r, _)| *r != 2) {
        assert_eq!(s.and_then(|s| s.signal()), Some(libc::SIGTERM), "rank {r}");
    }
    let msg = e.to_string();
    assert!(msg.contains("rank 2 failed first (exit status 7)"), "{msg}");
}

#[test]
fn a_killed_rank_is_a_failure_and_sigterm_escalates_to_sigkill() {
    let (mut opts, _, _) = captured();
    opts.grace = Duration::from_millis(300);
    let t0 = Instant::now();
    // Rank 1 dies once rank 0 has had time to start ignoring TERM (a TERM arriving before
    // the trap would kill rank 0 outright).
    let script = r#"if [ "$RANK" = 1 ]; then sleep 0.5; kill -9 $$; fi; trap "" TERM; sleep 60"#;
    let e = launch(2, &sh(script), &opts).unwrap_err();
    assert!(
        t0.elapsed() < Duration::from_secs(5),
        "took {:?}",
        t0.elapsed()
    );
    let LaunchError::RankFailed {
        rank: 1,
        status,
        statuses,
    } = &e
    else {
        panic!("{e}")
    };
    assert_eq!(status.signal(), Some(libc::SIGKILL));
    assert_eq!(
        statuses[0].and_then(|s| s.signal()),
        Some(libc::SIGKILL),
        "TERM was ignored"
    );
    assert!(
        e.to_string().contains("killed by signal 9 (SIGKILL)"),
        "{e}"
    );
}

#[test]
fn without_fail_fast_everyone_finishes() {
    let (mut opts, out, _) = captured();
    opts.fail_fast = false;
    let e = launch(
        3,
        &sh(r#"if [ "$RANK" = 0 ]; then exit 1; fi; sleep 0.3; echo done"#),
        &opts,
    )
    .unwrap_err();
    let LaunchError::RankFailed {
        rank: 0, statuses, ..
    } = &e
    else {
        panic!("{e}")
    };
    assert!(statuses[1..].iter().all(|s| s.is_some_and(|s| s.success())));
    assert_eq!(text(&out).matches("done").count(), 2);
}

#[test]
fn timeouts_and_bad_requests() {
    let (mut opts, _, _) = captured();
    opts.timeout = Some(Duration::from_millis(300));
    let t0 = Instant::now();
    let e = launch(2, &sh("sleep 60"), &opts).unwrap_err();
    assert!(matches!(e, LaunchError::TimedOut { .. }), "{e}");
    assert!(t0.elapsed() < Duration::from_secs(5));
    assert!(matches!(
        launch(0, &sh("true"), &opts),
        Err(LaunchError::NoProcesses)
    ));
    assert!(matches!(launch(1, &[], &opts), Err(LaunchError::NoCommand)));
    let e = launch(2, &["/nonexistent/zarrckpt-test-program".into()], &opts).unwrap_err();
    assert!(matches!(e, LaunchError::Spawn { rank: 0, .. }), "{e}");
}

/// The self-test example, built by `cargo test` next to this test's binary.
fn selftest_binary() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let profile_dir = exe.parent().and_then(|deps| deps.parent()).unwrap();
    let path = profile_dir.join("examples").join("comm_selftest");
    if !path.exists() {
        // `cargo test --test launch` alone does not build examples.
        let status = std::process::Command::new(env!("CARGO"))
            .args(["build", "--example", "comm_selftest"])
            .current_dir(env!("CARGO_MANIFEST_DIR"))
            .status()
            .unwrap();
        assert!(
            status.success(),
            "building the comm_selftest example failed"
        );
    }
    assert!(path.exists(), "{} not found", path.display());
    path
}

#[test]
fn tcp_comm_across_processes() {
    let (mut opts, out, err) = captured();
    opts.env.push(("ZARRCKPT_TIMEOUT_S".into(), "20".into()));
    let exe = selftest_binary();
    let r = launch(4, &[exe.into_os_string()], &opts);
    let (out, err) = (text(&out), text(&err));
    assert!(r.is_ok(), "{r:?}\nstdout:\n{out}\nstderr:\n{err}");
    for rank in 0..4 {
        assert!(
            out.contains(&format!("[rank {rank}] selftest ok: rank {rank} of 4")),
            "{out}"
        );
    }
}

#[test]
fn a_rank_that_dies_is_named_by_the_others() {
    let (mut opts, _, err) = captured();
    // Let the survivors report on their own rather than be stopped.
    opts.fail_fast = false;
    opts.env.push(("ZARRCKPT_TIMEOUT_S".into(), "10".into()));
    opts.env
        .push(("ZARRCKPT_SELFTEST_DIE_RANK".into(), "1".into()));
    let exe = selftest_binary();
    let t0 = Instant::now();
    let e = launch(4, &[exe.into_os_string()], &opts).unwrap_err();
    let took = t0.elapsed();
    let err = text(&err);
    let LaunchError::RankFailed { statuses, .. } = &e else {
        panic!("{e}\n{err}")
    };
    assert_eq!(statuses[1].and_then(|s| s.code()), Some(3), "{err}");
    for r in [0, 2, 3] {
        // 1: a collective failed; 2: still joining when the news arrived (rank 1 exits
        // right after its own setup, which may be before others finish theirs).
        let code = statuses[r].and_then(|s| s.code());
        assert!(matches!(code, Some(1 | 2)), "rank {r}: {code:?}\n{err}");
        let named = err.lines().any(|l| {
            l.starts_with(&format!("[rank {r}] selftest")) && l.contains("rank 1 is gone")
        });
        assert!(named, "rank {r} did not name rank 1:\n{err}");
    }
    assert!(
        took < Duration::from_secs(8),
        "took {took:?}, the timeout is 10 s:\n{err}"
    );
}
