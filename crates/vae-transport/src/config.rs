//! Timeouts shared by every backend.

use std::time::Duration;

use crate::TransportError;

/// Environment variable: longest wait for a live peer at a collective, in seconds.
pub const ENV_COLLECTIVE_TIMEOUT: &str = "VAE_COLLECTIVE_TIMEOUT_S";
/// Environment variable: longest a dead or silent peer goes unnoticed, in seconds.
pub const ENV_FAILURE_TIMEOUT: &str = "VAE_FAILURE_TIMEOUT_S";
/// Environment variable: longest the socket rendezvous waits for every rank, in seconds.
pub const ENV_CONNECT_TIMEOUT: &str = "VAE_CONNECT_TIMEOUT_S";

/// Timeouts of a communicator.
///
/// Two different clocks guard against hangs. A peer that *died* (panicked, returned an error,
/// lost its process or its network) is reported within `failure_timeout`: the local backend
/// knows at once, the socket backend sees the closed connection at once or misses the peer's
/// heartbeats for `failure_timeout`. A peer that is alive but slow (a big tile) is waited for
/// up to `collective_timeout`, which therefore defaults much longer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TransportConfig {
    /// Longest a rank waits for a live peer to reach the same collective.
    pub collective_timeout: Duration,
    /// Longest a dead or silent peer goes unnoticed (socket heartbeat window).
    pub failure_timeout: Duration,
    /// Longest the socket rendezvous waits for every rank to join.
    pub connect_timeout: Duration,
}

impl Default for TransportConfig {
    fn default() -> Self {
        Self {
            collective_timeout: Duration::from_secs(600),
            failure_timeout: Duration::from_secs(5),
            connect_timeout: Duration::from_secs(120),
        }
    }
}

impl TransportConfig {
    /// The defaults, overridden by `VAE_COLLECTIVE_TIMEOUT_S`, `VAE_FAILURE_TIMEOUT_S` and
    /// `VAE_CONNECT_TIMEOUT_S` where set (seconds, fractions allowed).
    pub fn from_env() -> Result<Self, TransportError> {
        let mut config = Self::default();
        if let Some(d) = env_seconds(ENV_COLLECTIVE_TIMEOUT)? {
            config.collective_timeout = d;
        }
        if let Some(d) = env_seconds(ENV_FAILURE_TIMEOUT)? {
            config.failure_timeout = d;
        }
        if let Some(d) = env_seconds(ENV_CONNECT_TIMEOUT)? {
            config.connect_timeout = d;
        }
        config.validate()?;
        Ok(config)
    }

    /// Rejects zero timeouts, which would make every wait fail at once.
    pub fn validate(&self) -> Result<(), TransportError> {
        for (name, d) in [
            ("collective_timeout", self.collective_timeout),
            ("failure_timeout", self.failure_timeout),
            ("connect_timeout", self.connect_timeout),
        ] {
            if d.is_zero() {
                return Err(TransportError::InvalidArgument(format!("{name} must be positive")));
            }
        }
        Ok(())
    }
}

fn env_seconds(name: &str) -> Result<Option<Duration>, TransportError> {
    match std::env::var(name) {
        Ok(text) => {
            let secs: f64 = text
                .trim()
                .parse()
                .map_err(|_| TransportError::InvalidArgument(format!("{name}={text:?} is not a number of seconds")))?;
            Duration::try_from_secs_f64(secs)
                .map(Some)
                .map_err(|_| TransportError::InvalidArgument(format!("{name}={text:?} is not a valid duration")))
        }
        Err(std::env::VarError::NotPresent) => Ok(None),
        Err(e) => Err(TransportError::InvalidArgument(format!("{name}: {e}"))),
    }
}
