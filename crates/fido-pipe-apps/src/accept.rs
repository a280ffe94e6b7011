//! Pacing for the accept loops of `serve` and `proxy`: a listener whose
//! `accept` keeps failing (out of descriptors — `EMFILE`/`ENFILE` — or
//! memory) must neither spin nor log every failure, since a flood of
//! connections is exactly what causes it. The loop waits longer after each
//! failure in a row (10 ms doubling to 250 ms), and says so once per streak,
//! then at most once a minute while the streak lasts.

use std::io;
use std::time::{Duration, Instant};

const FIRST_WAIT: Duration = Duration::from_millis(10);
const LONGEST_WAIT: Duration = Duration::from_millis(250);
const LOG_EVERY: Duration = Duration::from_secs(60);

/// A failure that concerns one connection only (reset before it was
/// accepted, a signal): try again at once.
pub fn passing(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::ConnectionAborted | io::ErrorKind::Interrupted
    )
}

/// The state of one accept loop.
#[derive(Default)]
pub struct Backoff {
    /// Failures since the last successful accept.
    streak: u64,
    wait: Duration,
    logged: Option<Instant>,
}

impl Backoff {
    /// `accept` failed with `e`: logs if due, then waits before the next try.
    pub fn failed(&mut self, e: &io::Error) {
        self.streak += 1;
        self.wait = if self.streak == 1 {
            FIRST_WAIT
        } else {
            (self.wait * 2).min(LONGEST_WAIT)
        };
        if self.logged.is_none_or(|t| t.elapsed() >= LOG_EVERY) {
            tracing::warn!(
                "accept: {e} ({} failures in a row; retrying, at most every {} ms)",
                self.streak,
                LONGEST_WAIT.as_millis()
            );
            self.logged = Some(Instant::now());
        }
        std::thread::sleep(self.wait);
    }

    /// `accept` worked: ends a streak of failures (said once, if one was logged).
    pub fn succeeded(&mut self) {
        if self.streak > 0 {
            if self.logged.is_some() {
                tracing::warn!("accept works again after {} failures", self.streak);
            }
            *self = Backoff::default();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn waits_grow_and_reset() {
        let mut b = Backoff::default();
        let e = io::Error::from_raw_os_error(24);
        b.failed(&e);
        assert_eq!(b.wait, FIRST_WAIT);
        for _ in 0..8 {
            b.failed(&e);
        }
        assert_eq!(b.wait, LONGEST_WAIT);
        assert_eq!(b.streak, 9);
        b.succeeded();
        assert_eq!(b.streak, 0);
        assert!(b.logged.is_none());
    }
}
