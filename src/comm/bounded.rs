//! A deadline-bounded wait on work that completes on its own (an NCCL transfer enqueued on a
//! GPU stream): polled until it finishes, fails, its transport reports an asynchronous error
//! (a peer's failure), or the deadline passes. On a failure or the deadline the work is
//! aborted, so that a dead peer is an error within the timeout, never a hang.
//!
//! The loop is written over the small [`InFlight`] trait so that it is tested without a GPU
//! (a fake that never completes); `device::nccl` implements it with `cuEventQuery`,
//! `ncclCommGetAsyncError` and `ncclCommAbort`.

use std::time::{Duration, Instant};

use super::CommError;

/// Work in flight that can be polled, checked for an asynchronous error, and aborted.
pub(crate) trait InFlight {
    /// Whether the work has finished (`Ok(true)`), is still running (`Ok(false)`), or failed.
    ///
    /// # Errors
    /// What failed, in words.
    fn poll(&mut self) -> Result<bool, String>;

    /// An error the transport reports asynchronously (for NCCL, a peer's failure or a
    /// network error seen by its proxy thread).
    ///
    /// # Errors
    /// The error, in words.
    fn async_error(&mut self) -> Result<(), String>;

    /// Abandons the work and the transport it runs on. Called at most once per wait, after a
    /// failure or at the deadline; the transport is unusable afterwards.
    fn abort(&mut self);
}

/// The longest sleep between two polls: short beside any timeout, long enough not to burn a
/// core while a large transfer runs.
const MAX_PAUSE: Duration = Duration::from_millis(1);

/// Waits for `work` until it finishes or `timeout` has passed since the call.
///
/// # Errors
/// [`CommError::Timeout`] at the deadline and [`CommError::Transport`] when the work or its
/// transport fails; in both cases `work` has been aborted.
pub(crate) fn wait_bounded(
    work: &mut dyn InFlight,
    op: &'static str,
    rank: usize,
    timeout: Duration,
) -> Result<(), CommError> {
    let start = Instant::now();
    let mut pause = Duration::from_micros(1);
    loop {
        let failed = match work.poll() {
            Ok(true) => return Ok(()),
            Ok(false) => work.async_error().err(),
            Err(e) => Some(e),
        };
        if let Some(detail) = failed {
            work.abort();
            return Err(CommError::Transport { op, rank, detail });
        }
        let waited = start.elapsed();
        if waited >= timeout {
            work.abort();
            return Err(CommError::Timeout {
                op,
                rank,
                peer: None,
                after: waited,
            });
        }
        std::thread::sleep(pause.min(timeout - waited));
        pause = (pause * 2).min(MAX_PAUSE);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A fake transfer: finishes after `done_after` polls (never when `None`), reports an
    /// asynchronous error from poll `error_at` on, and counts polls and aborts.
    #[derive(Default)]
    struct Fake {
        done_after: Option<usize>,
        error_at: Option<usize>,
        polls: usize,
        aborts: usize,
    }

    impl InFlight for Fake {
        fn poll(&mut self) -> Result<bool, String> {
            assert_eq!(self.aborts, 0, "polled after its abort");
            self.polls += 1;
            Ok(self.done_after.is_some_and(|n| self.polls >= n))
        }
        fn async_error(&mut self) -> Result<(), String> {
            match self.error_at {
                Some(n) if self.polls >= n => Err("ncclRemoteError: rank 1 is gone".into()),
                _ => Ok(()),
            }
        }
        fn abort(&mut self) {
            self.aborts += 1;
        }
    }

    #[test]
    fn work_that_never_completes_times_out_and_is_aborted() {
        let mut f = Fake::default();
        let t = Duration::from_millis(150);
        let start = Instant::now();
        let e = wait_bounded(&mut f, "exchange", 3, t).unwrap_err();
        let took = start.elapsed();
        assert!(
            matches!(e, CommError::Timeout { op: "exchange", rank: 3, peer: None, after } if after >= t),
            "{e:?}"
        );
        assert!(took >= t && took < t + Duration::from_secs(5), "{took:?}");
        assert_eq!(f.aborts, 1);
        assert!(f.polls > 1, "polled once only");
    }

    #[test]
    fn an_asynchronous_error_aborts_at_once() {
        let mut f = Fake {
            error_at: Some(3),
            ..Fake::default()
        };
        let start = Instant::now();
        let e = wait_bounded(&mut f, "exchange", 0, Duration::from_secs(600)).unwrap_err();
        assert!(start.elapsed() < Duration::from_secs(5));
        assert!(
            matches!(&e, CommError::Transport { op: "exchange", rank: 0, detail } if detail.contains("rank 1 is gone")),
            "{e:?}"
        );
        assert_eq!((f.polls, f.aborts), (3, 1));
    }

    #[test]
    fn work_that_completes_is_not_aborted() {
        let mut f = Fake {
            done_after: Some(5),
            ..Fake::default()
        };
        wait_bounded(&mut f, "exchange", 0, Duration::from_secs(600)).unwrap();
        assert_eq!((f.polls, f.aborts), (5, 0));
    }

    #[test]
    fn a_failed_poll_aborts() {
        struct Broken(usize);
        impl InFlight for Broken {
            fn poll(&mut self) -> Result<bool, String> {
                Err("cuEventQuery: an illegal memory access".into())
            }
            fn async_error(&mut self) -> Result<(), String> {
                Ok(())
            }
            fn abort(&mut self) {
                self.0 += 1;
            }
        }
        let mut b = Broken(0);
        let e = wait_bounded(&mut b, "exchange", 2, Duration::from_secs(600)).unwrap_err();
        assert!(matches!(e, CommError::Transport { rank: 2, .. }), "{e:?}");
        assert_eq!(b.0, 1);
    }
}
