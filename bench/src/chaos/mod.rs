//! `fido-bench chaos`: pipelines of domains, each a separate process, while
//! domains and the broker are killed (`SIGKILL`) and restarted at random; every
//! message is checked end to end and accounted for.
//!
//! # What runs
//!
//! * A **broker** process (`fido-bench __chaos-broker D S`: this binary
//!   re-executed, running the broker as `fido broker --state-dir D --socket S`
//!   does) that the driver kills and restarts on the same state directory and
//!   socket.
//! * Pipeline **A**: `srcA → fwdA → sinkA`; pipeline **B**: `srcB → fwdB1 →
//!   fwdB2 → sinkB` (transitive zero-copy: sinkB maps srcB's arena); an
//!   **echo** pair: `echo-client ⇄ echo-server` (requests one way, replies the
//!   other, on one connection). Each is `fido-bench __chaos-role role=...`.
//! * The **driver** (this process) kills a random role or the broker every
//!   `--interval-ms` (seeded xorshift), sometimes the broker and a domain
//!   together, and restarts it (a micro-reboot: same service names). Each
//!   restart of a sending role is a new **stream** (source incarnation).
//!
//! # Messages
//!
//! A message is 1–3 segments (more than two travel as an SG list); the first
//! starts with a 64-byte header: magic, tag, total length, segment count, a
//! 64-bit hash of every payload byte after the header, and the tag of the
//! request it answers (echo replies). The tag is `stream << 40 | seq`. The
//! receiver checks all of it against the descriptor (tag, length, segments).
//!
//! # Journal and accounting
//!
//! Every role writes one-line records to its stdout, a pipe the driver reads,
//! *before* the fact they describe becomes visible to anyone else (a record
//! written to a pipe survives the writer's `SIGKILL`):
//!
//! * `S stream seq` — a sender is about to send message `seq` for the first time;
//! * `D tag...` / `C tag why` — a receiver got a verified / corrupted message
//!   (written before the message is released);
//! * `U tag...` — `take_undelivered` (or a failed `send` handing the message
//!   back) reported messages not delivered, on any hop (forwarders included);
//! * `X tag...` — a reported message was sent again;
//! * `R tag|a-b...` — the origin sender knows these were released: everything
//!   it sent on a channel once `in_flight()` is 0, and on a failed channel
//!   everything it sent there minus what `take_undelivered` returned, once the
//!   channel settled (see [`settle`]: a peer that closed gracefully releases
//!   later; only a gone peer's unreleased messages are handed back);
//! * `P why`, `A why` — a protocol error between honest peers; an inconsistent
//!   report (e.g. `take_undelivered` returned a message already confirmed released);
//! * `ready`, `done` (a sender drained: everything it sent is released or
//!   reported).
//!
//! Per message the driver counts deliveries `d`, corrupt deliveries, reports
//! `r` (any hop), resends, and whether its release was confirmed. Then:
//!
//! * **corrupted**: corrupt deliveries, plus deliveries of messages never
//!   announced (phantoms).
//! * **duplicated-silent**: `Σ max(0, d − 1 − r)`: a second delivery that no
//!   report explains. **redelivered-reported**: `Σ min(d − 1, r)`: the receiver
//!   got it, but the release did not make it back before a crash, so the
//!   sender was told "not delivered" and resent it.
//! * **lost-silent**: released but never delivered, plus — for senders that
//!   lived to drain — messages neither released nor reported.
//! * Messages of a sender that was killed and that it never saw released are
//!   **unconfirmed-sender-killed**: nobody is left to report to (not a failure).
//!
//! The guarantee checked (docs/BENCHMARKS.md, "Chaos"): at-least-once delivery
//! with every undelivered message reported to its sender; never silent loss,
//! never silent duplication, never corruption.
//!
//! # Leaks
//!
//! Counted before and after: the driver's open fds; live processes carrying
//! this run's token in their environment (and our children); `/dev/shm`
//! entries; after every domain exited, the broker's fds (against the count of
//! a fresh broker with no domain), its `memfd:` fds, and the domains, services
//! and connections it still lists; after the broker stopped, files in the
//! state directory other than the lock and the registry. And, after the drain
//! with every domain still running, *stale mappings*: read-only mappings of an
//! arena that no live domain owns (a dead domain's memory kept alive).
//!
//! `FIDO_CHAOS_TRACE=1` copies every record into `driver.log` (in `--log-dir`),
//! the timeline of kills, restarts, domain ids and slots.
//!
//! # Modules
//!
//! [`wire`] (the messages), [`roles`] (the helper processes), [`ledger`] (the
//! books), [`fleet`] (starting, killing and restarting processes; the kill
//! schedule), [`checks`] (drain, exit and leak checks), [`report`].

mod checks;
mod fleet;
mod ledger;
mod report;
mod roles;
mod wire;

use std::fs::File;
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{bail, Context as _};
use fido_demo::proc;

pub use roles::{broker_main, role_main, status_main};

const SUITE: &str = "chaos";
const SYSTEM: &str = "fido";
/// Environment variable naming the run: every helper carries it, so survivors
/// can be found in /proc.
const RUN_ENV: &str = "FIDO_CHAOS_RUN";

/// `fido-bench chaos` options.
pub struct Opts {
    pub seconds: f64,
    pub seed: Option<u64>,
    pub json: Option<PathBuf>,
    /// Messages per second of each source (the echo client sends half).
    pub rate: f64,
    /// Pause between kills, uniform in [min, max] ms.
    pub interval_ms: (u64, u64),
    /// A pipeline that delivers nothing for this long has stalled.
    pub stall_secs: f64,
    /// Keep the roles' and broker's stderr here (default: a temporary directory).
    pub log_dir: Option<PathBuf>,
}

/// `fido-bench chaos`. `Ok(false)`: a check failed.
pub fn run(o: Opts) -> anyhow::Result<bool> {
    proc::install_interrupt_flag()?;
    if o.interval_ms.0 > o.interval_ms.1 || o.interval_ms.1 == 0 {
        bail!("--interval-ms: MIN-MAX with MIN <= MAX, MAX > 0");
    }
    let seed = o.seed.unwrap_or_else(|| {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(1)
    });
    let host = checks::HostSnapshot::take();
    let t_start = Instant::now();
    let token = format!("{}-{seed:x}", std::process::id());
    let dir = tempfile::Builder::new()
        .prefix("fido-chaos-")
        .tempdir()
        .context("creating a temporary directory")?;
    let logs = match &o.log_dir {
        Some(d) => d.clone(),
        None => dir.path().join("logs"),
    };
    std::fs::create_dir_all(&logs).with_context(|| format!("creating {}", logs.display()))?;
    *TIMELINE.lock().unwrap() = Some(log_file(&logs, "driver")?);
    let mut f = fleet::Fleet::new(&token, dir.path(), &logs, seed, o.rate)?;
    eprintln!(
        "chaos: seed {seed}, {} s, kill every {}-{} ms, {} msg/s per source; logs in {}",
        o.seconds,
        o.interval_ms.0,
        o.interval_ms.1,
        o.rate,
        logs.display()
    );

    let broker_fd0 = f.start()?;
    f.unleash(&o, seed)?;
    let chaos_secs = t_start.elapsed().as_secs_f64();
    let drain = f.drain()?;
    let stale = f.stale_mappings();
    let bad_exits = f.exit_roles()?;
    let broker = f.broker_leaks(broker_fd0);
    let broker_exit_ok = f.stop_broker()?;
    let state_files = f.state_files();
    let books = f.close_books();
    let processes = f.specs.len() + 1;
    drop(f);
    drop(TIMELINE.lock().unwrap().take());
    let log_tails = if o.log_dir.is_some() {
        String::new()
    } else {
        report::tails(&logs)
    };
    dir.close().context("removing the temporary directory")?;
    let host = host.leaks(&token);

    let findings = report::Findings {
        books,
        drain,
        stale,
        bad_exits,
        broker,
        broker_exit_ok,
        state_files,
        host,
        chaos_secs,
    };
    report::finish(&o, seed, processes, findings, &log_tails)
}

fn epoch() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0)
}

/// The driver's timeline (`driver.log` in the log directory): kills, starts,
/// readiness (domain id and slot) and problems, with the same Unix-epoch
/// timestamps as the roles' logs.
static TIMELINE: std::sync::Mutex<Option<File>> = std::sync::Mutex::new(None);

fn tl(msg: impl std::fmt::Display) {
    if let Ok(mut g) = TIMELINE.lock() {
        if let Some(f) = g.as_mut() {
            let _ = writeln!(f, "{:.6} {msg}", epoch());
        }
    }
}

fn log_file(dir: &Path, name: &str) -> anyhow::Result<File> {
    std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(dir.join(format!("{name}.log")))
        .with_context(|| format!("opening the log of {name}"))
}
