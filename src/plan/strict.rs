//! The load's key-check policy: what to do with keys requested but absent and keys present
//! but requested by no rank (re-exported as `zarrckpt::load::StrictMode`).

/// How to treat keys requested but absent ("unexpected", per rank) and keys present but
/// requested by no rank ("missing", global), after Megatron-Core's `StrictHandling`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum StrictMode {
    /// No key check before reading (Megatron's `ASSUME_OK_UNEXPECTED`: the caller vouches
    /// that every requested key exists, and nothing is looked up before the read step). A key
    /// the checkpoint lacks still fails, when it is read:
    /// [`Error::UnexpectedKeys`](crate::Error::UnexpectedKeys) on the rank that asked for it,
    /// naming that rank ([`Error::RemoteFailure`](crate::Error::RemoteFailure) naming it on
    /// the others). Data types and shapes are checked as in every mode; missing keys are not
    /// computed.
    AssumeOkUnexpected,
    /// Log unexpected keys and skip them (their buffers are left untouched).
    LogUnexpected,
    /// Log unexpected and missing keys, skip unexpected ones.
    LogAll,
    /// Fail if any rank requested an unexpected key (the default).
    #[default]
    RaiseUnexpected,
    /// Fail on unexpected or missing keys.
    RaiseAll,
    /// Skip unexpected keys and return them in the report.
    ReturnUnexpected,
    /// Skip unexpected keys and return both sets in the report.
    ReturnAll,
    /// Skip unexpected keys silently.
    IgnoreAll,
}

impl StrictMode {
    pub(crate) fn needs_missing(self) -> bool {
        matches!(
            self,
            StrictMode::LogAll | StrictMode::RaiseAll | StrictMode::ReturnAll
        )
    }
    pub(crate) fn raises_unexpected(self) -> bool {
        matches!(
            self,
            StrictMode::RaiseUnexpected | StrictMode::RaiseAll | StrictMode::AssumeOkUnexpected
        )
    }
}
