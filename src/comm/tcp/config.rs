//! [`TcpConfig`]: how a rank finds its group, explicitly or from `torchrun`-style
//! environment variables.

use std::ffi::OsString;
use std::net::IpAddr;
use std::time::Duration;

use crate::comm::{CommError, DEFAULT_TIMEOUT};

/// How to reach the group: the explicit form of the `torchrun` environment variables.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct TcpConfig {
    /// This rank, in `0..world_size`.
    pub rank: usize,
    /// Number of ranks.
    pub world_size: usize,
    /// Rank within this host, when the launcher says (informational).
    pub local_rank: Option<usize>,
    /// Host name or address of rank 0.
    pub master_addr: String,
    /// Port rank 0 listens on for the rendezvous; 0 lets [`TcpMaster::bind`](super::TcpMaster::bind) pick one.
    pub master_port: u16,
    /// The liveness timeout: a peer silent for this long (no heartbeat; its process is
    /// stopped or hung, or its host unreachable) is dead. Also bounds the rendezvous and
    /// connecting. A peer that is alive but late is waited for, however late (see
    /// [`TcpConfig::deadline`]).
    pub timeout: Duration,
    /// Longest any single exchange (a collective is a few of them) may wait for live but late
    /// peers; `None` (the default): no limit, lateness alone is never an error. When it strikes, the error names the peer
    /// this rank waited for, which may itself be waiting for a later one.
    pub deadline: Option<Duration>,
    /// Largest message this rank accepts in a collective (an all-gather's whole result, a
    /// broadcast's value; [`Communicator::max_message`](crate::comm::Communicator::max_message));
    /// a peer announcing more is refused with
    /// [`CommError::TooLarge`](crate::comm::CommError::TooLarge) before anything is allocated.
    /// Default 4 GiB. Exchanges receive into the caller's buffers and accept exactly their size.
    pub max_message_bytes: u64,
    /// Identifies the job: ranks whose tokens differ refuse each other at rendezvous, so that
    /// a process of another job reaching the same `MASTER_ADDR:MASTER_PORT` cannot join.
    /// Empty by default; see [`TcpConfig::from_env`].
    pub job_token: String,
    /// Address to bind listeners to; by default all interfaces. Peers connect to the address
    /// through which this rank reached the master, whatever this is.
    pub bind_addr: Option<IpAddr>,
}

impl TcpConfig {
    /// A configuration with the default timeout and no `local_rank` or `bind_addr`.
    #[must_use]
    pub fn new(
        rank: usize,
        world_size: usize,
        master_addr: impl Into<String>,
        master_port: u16,
    ) -> TcpConfig {
        TcpConfig {
            rank,
            world_size,
            local_rank: None,
            master_addr: master_addr.into(),
            master_port,
            timeout: DEFAULT_TIMEOUT,
            deadline: None,
            max_message_bytes: super::DEFAULT_MAX_MESSAGE,
            job_token: String::new(),
            bind_addr: None,
        }
    }

    /// Reads `RANK`, `WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT` (required), `LOCAL_RANK`,
    /// `ZARRCKPT_TIMEOUT_S` (the liveness timeout in seconds, default 60),
    /// `ZARRCKPT_DEADLINE_S` (optional bound on any single operation's wait, default none) and
    /// the job token (optional): `ZARRCKPT_JOB_TOKEN` if set (`zarrckpt launch` sets one per
    /// launch), else torchrun's `TORCHELASTIC_RUN_ID`, else empty.
    ///
    /// # Errors
    /// [`CommError::Transport`] naming the variable that is missing or invalid.
    pub fn from_env() -> Result<TcpConfig, CommError> {
        Self::from_lookup(|k| std::env::var_os(k))
    }

    fn from_lookup(get: impl Fn(&str) -> Option<OsString>) -> Result<TcpConfig, CommError> {
        let mut rank_seen = 0;
        let err = |rank: usize, detail: String| CommError::Transport {
            op: "from_env",
            rank,
            detail,
        };
        let text = |name: &str, required: bool, rank: usize| -> Result<Option<String>, CommError> {
            match get(name) {
                None if required => {
                    Err(err(rank, format!("environment variable {name} is not set")))
                }
                None => Ok(None),
                Some(v) => match v.into_string() {
                    Ok(s) => Ok(Some(s.trim().to_owned())),
                    Err(v) => Err(err(
                        rank,
                        format!("environment variable {name}={v:?} is not valid UTF-8"),
                    )),
                },
            }
        };
        let number =
            |name: &str, required: bool, rank: usize| -> Result<Option<usize>, CommError> {
                text(name, required, rank)?
                    .map(|s| {
                        s.parse::<usize>().map_err(|_| {
                            err(rank, format!("{name}={s:?} is not a non-negative integer"))
                        })
                    })
                    .transpose()
            };
        // Required variables: `text` refuses a missing one, so these are `Some`.
        let unset = |name: &str, rank: usize| err(rank, format!("{name} is not set"));
        let rank = number("RANK", true, rank_seen)?.ok_or_else(|| unset("RANK", rank_seen))?;
        rank_seen = rank;
        let world =
            number("WORLD_SIZE", true, rank_seen)?.ok_or_else(|| unset("WORLD_SIZE", rank_seen))?;
        if world == 0 || rank >= world {
            return Err(err(
                rank_seen,
                format!("RANK={rank} is not below WORLD_SIZE={world}"),
            ));
        }
        let local_rank = number("LOCAL_RANK", false, rank_seen)?;
        let master_addr =
            text("MASTER_ADDR", true, rank_seen)?.ok_or_else(|| unset("MASTER_ADDR", rank_seen))?;
        if master_addr.is_empty() {
            return Err(err(rank_seen, "MASTER_ADDR is empty".to_owned()));
        }
        let port_text =
            text("MASTER_PORT", true, rank_seen)?.ok_or_else(|| unset("MASTER_PORT", rank_seen))?;
        let master_port = port_text
            .parse::<u16>()
            .ok()
            .filter(|&p| p != 0)
            .ok_or_else(|| {
                err(
                    rank_seen,
                    format!("MASTER_PORT={port_text:?} is not a port number in 1..=65535"),
                )
            })?;
        let seconds = |name: &str| -> Result<Option<Duration>, CommError> {
            text(name, false, rank_seen)?
                .map(|s| {
                    s.parse::<f64>()
                        .ok()
                        .filter(|t| *t > 0.0)
                        .and_then(|t| Duration::try_from_secs_f64(t).ok())
                        .ok_or_else(|| {
                            err(
                                rank_seen,
                                format!("{name}={s:?} is not a positive number of seconds"),
                            )
                        })
                })
                .transpose()
        };
        let timeout = seconds("ZARRCKPT_TIMEOUT_S")?.unwrap_or(DEFAULT_TIMEOUT);
        let deadline = seconds("ZARRCKPT_DEADLINE_S")?;
        let job_token = match text("ZARRCKPT_JOB_TOKEN", false, rank_seen)? {
            Some(t) => t,
            // No token at all is the empty one (documented on `TcpConfig::job_token`).
            None => text("TORCHELASTIC_RUN_ID", false, rank_seen)?.unwrap_or_default(),
        };
        Ok(TcpConfig {
            rank,
            world_size: world,
            local_rank,
            master_addr,
            master_port,
            timeout,
            deadline,
            max_message_bytes: super::DEFAULT_MAX_MESSAGE,
            job_token,
            bind_addr: None,
        })
    }

    pub(super) fn check(&self, op: &'static str) -> Result<(), CommError> {
        let err = |detail: String| CommError::Transport {
            op,
            rank: self.rank,
            detail,
        };
        if self.world_size == 0 || self.rank >= self.world_size {
            return Err(err(format!(
                "rank {} is not below world size {}",
                self.rank, self.world_size
            )));
        }
        if self.timeout.is_zero() {
            return Err(err("the timeout must be positive".to_owned()));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::*;

    fn lookup(vars: &[(&str, &str)]) -> impl Fn(&str) -> Option<OsString> {
        let m: HashMap<String, OsString> = vars
            .iter()
            .map(|(k, v)| ((*k).to_owned(), OsString::from(v)))
            .collect();
        move |k| m.get(k).cloned()
    }

    #[test]
    fn env_parsing_names_the_variable() {
        let base = [
            ("RANK", "1"),
            ("WORLD_SIZE", "4"),
            ("MASTER_ADDR", "10.0.0.1"),
            ("MASTER_PORT", "29500"),
        ];
        let cfg = TcpConfig::from_lookup(lookup(&base)).unwrap();
        assert_eq!(
            (cfg.rank, cfg.world_size, cfg.master_port, cfg.timeout),
            (1, 4, 29500, DEFAULT_TIMEOUT)
        );
        assert_eq!(cfg.local_rank, None);
        let mut v = base.to_vec();
        v.push(("LOCAL_RANK", "1"));
        v.push(("ZARRCKPT_TIMEOUT_S", "2.5"));
        let cfg = TcpConfig::from_lookup(lookup(&v)).unwrap();
        assert_eq!(
            (cfg.local_rank, cfg.timeout),
            (Some(1), Duration::from_millis(2500))
        );
        assert_eq!((cfg.deadline, cfg.job_token.as_str()), (None, ""));
        v.push(("TORCHELASTIC_RUN_ID", "run-7"));
        v.push(("ZARRCKPT_DEADLINE_S", "600"));
        let cfg = TcpConfig::from_lookup(lookup(&v)).unwrap();
        assert_eq!(
            (cfg.deadline, cfg.job_token.as_str()),
            (Some(Duration::from_secs(600)), "run-7")
        );
        v.push(("ZARRCKPT_JOB_TOKEN", "launch-42"));
        assert_eq!(
            TcpConfig::from_lookup(lookup(&v)).unwrap().job_token,
            "launch-42"
        );
        let cases: &[(&str, Option<&str>)] = &[
            ("RANK", None),
            ("RANK", Some("x")),
            ("WORLD_SIZE", None),
            ("MASTER_ADDR", None),
            ("MASTER_PORT", Some("70000")),
            ("MASTER_PORT", Some("0")),
            ("LOCAL_RANK", Some("-1")),
            ("ZARRCKPT_TIMEOUT_S", Some("0")),
            ("ZARRCKPT_TIMEOUT_S", Some("nan")),
            ("ZARRCKPT_DEADLINE_S", Some("-1")),
        ];
        for (name, value) in cases {
            let mut v: Vec<(&str, &str)> =
                base.iter().copied().filter(|(k, _)| k != name).collect();
            if let Some(value) = value {
                v.push((name, value));
            }
            let e = TcpConfig::from_lookup(lookup(&v)).unwrap_err();
            assert!(
                matches!(e, CommError::Transport { op: "from_env", .. }),
                "{e}"
            );
            assert!(e.to_string().contains(name), "{name}: {e}");
        }
        let e = TcpConfig::from_lookup(lookup(&[("RANK", "4"), ("WORLD_SIZE", "4")])).unwrap_err();
        assert!(e.to_string().contains("WORLD_SIZE=4"), "{e}");
    }
}
