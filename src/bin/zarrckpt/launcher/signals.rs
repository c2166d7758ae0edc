//! While a launch runs, `SIGINT`, `SIGTERM` and `SIGHUP` sent to the launcher are recorded
//! instead of killing it, so that it can pass them on to its children (which run in process
//! groups of their own and so do not see the terminal's signals) and clean up.

use std::sync::Mutex;
use std::sync::atomic::{AtomicI32, Ordering};

const SIGNALS: [libc::c_int; 3] = [libc::SIGINT, libc::SIGTERM, libc::SIGHUP];

/// The last signal received, 0 for none.
static RECEIVED: AtomicI32 = AtomicI32::new(0);

/// Number of launches running, and the handlers in place before the first one started.
static STATE: Mutex<(usize, Vec<libc::sigaction>)> = Mutex::new((0, Vec::new()));

extern "C" fn record(sig: libc::c_int) {
    RECEIVED.store(sig, Ordering::SeqCst);
}

/// Handlers installed for the lifetime of the guard (shared by concurrent launches).
pub(super) struct Guard(());

impl Guard {
    pub(super) fn install() -> Guard {
        let mut st = STATE
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if st.0 == 0 {
            RECEIVED.store(0, Ordering::SeqCst);
            let mut old = Vec::with_capacity(SIGNALS.len());
            for sig in SIGNALS {
                // SAFETY: installs an async-signal-safe handler (one atomic store) and keeps
                // the previous disposition to restore it.
                unsafe {
                    let mut new: libc::sigaction = std::mem::zeroed();
                    new.sa_sigaction = record as *const () as libc::sighandler_t;
                    libc::sigemptyset(&raw mut new.sa_mask);
                    new.sa_flags = libc::SA_RESTART;
                    let mut prev: libc::sigaction = std::mem::zeroed();
                    libc::sigaction(sig, &raw const new, &raw mut prev);
                    old.push(prev);
                }
            }
            st.1 = old;
        }
        st.0 += 1;
        Guard(())
    }

    /// The signal received since the first guard was installed, if any.
    pub(super) fn received() -> Option<i32> {
        match RECEIVED.load(Ordering::SeqCst) {
            0 => None,
            s => Some(s),
        }
    }
}

impl Drop for Guard {
    fn drop(&mut self) {
        let mut st = STATE
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        st.0 -= 1;
        if st.0 == 0 {
            let old = std::mem::take(&mut st.1);
            for (sig, prev) in SIGNALS.into_iter().zip(old) {
                // SAFETY: restores the disposition saved by `install`.
                unsafe { libc::sigaction(sig, &raw const prev, std::ptr::null_mut()) };
            }
        }
    }
}
