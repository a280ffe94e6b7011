//! `fido-bench rpc`: the VMRPC paper's evaluation (§5.2 null RPC, §5.3 Table 2
//! throughput) with today's baselines, all measured in one invocation, plus the
//! case study (a caching file server, fido-rpc against the same service over
//! tonic: [`files`]).
//!
//! # How a point is measured
//!
//! Every point runs in **two fresh processes**: a server pinned to the peer CPU
//! and a client pinned to the parent CPU (see [`Placement`]); the driver (this
//! process) only starts them, reads the client's one-line JSON result and kills
//! and reaps both. The Rust systems are this binary re-executed
//! (`__bench-peer rpc-server|rpc-client system=...`), the fido system is the
//! `fido` binary's own peer (`__bench-peer fido rpc-...`), XML-RPC is Python's
//! standard `xmlrpc.server` / `xmlrpc.client` ([`xmlrpc`]).
//!
//! * `null-notified`: a call with no arguments and no result; each call is timed
//!   (round trip, monotonic clock); p50/p99 over all measured calls. The client
//!   blocks in the kernel between request and reply (the RPC systems' normal
//!   mode: tokio runtimes park in epoll). Its floors: `futex-floor` (two
//!   processes, pinned like every point, ping-pong through `FUTEX_WAIT` /
//!   `FUTEX_WAKE` on two words of a shared memfd page: no spinning, two wake-ups
//!   per round trip) and `eventfd-floor` (the same through two eventfds, with an
//!   8-byte payload), both in `bench/src/shm.rs`. No call whose both ends block
//!   between request and reply can beat the faster of the two.
//! * `null-adaptive`: the same with each system's default wait — fido's
//!   `WaitStrategy::default()` (adaptive, learned spin), every other system
//!   blocks as in `null-notified`: what a user gets without choosing.
//! * `null-polled`: the same with both ends busy-polling (only systems that can:
//!   fido's `BusyPoll`, uds with `MSG_DONTWAIT` spinning); `spin-floor` is two
//!   processes ping-ponging a shared cache line — the floor of any polled call.
//! * `<seq>-<send|recv>-<LEN>` ([`data`]): send = the client builds the sequence
//!   (every element, fresh per call: its values depend on the call number), calls,
//!   the server folds every element and returns the checksum, which the client
//!   asserts; recv = the server builds the sequence fresh and returns it with its
//!   checksum, the client folds every element and asserts. Throughput = Table 2
//!   payload × calls / measured time. Their floor, `shm-floor` (`shm_floor.rs`),
//!   is run as a system like the others: build straight into a pre-faulted
//!   shared memfd region in fido's layout, bump a word, the other side spins on
//!   it and folds — build + fold + two cache-line hand-offs, the ceiling of any
//!   synchronous shared-memory RPC under these rules.
//! * Goals (issue #4, [`goal_lines`]): each goal line carries the bound the run's
//!   floor implies (how much faster than the baseline the floor itself is); a
//!   goal not met whose required ratio is beyond that bound is marked
//!   `[beyond floor]` instead of `[NOT met]`.
//! * Warm-up (un-timed calls, at least one) then the measured window (at least one
//!   call). Quick: 80 ms + 0.3 s per point; full: 0.4 s + 2 s.
//! * **Budget.** A point whose client has not reported within the budget (quick
//!   5 s, full 20 s) is killed and reported `did_not_finish`; the same sequence and
//!   direction at a larger LEN is then reported `did_not_finish` without running.
//! * Baseline fairness (ANCHORS.md): single-threaded tokio runtimes on both ends,
//!   size limits raised (tonic's 4 MiB decode limit, tokio-util's 8 MiB frame,
//!   capnp's 64 MiB traversal limit), bytes as `Bytes` / `serde_bytes`, HTTP/2
//!   windows raised for tonic, tarpc deadlines raised above the budget.

mod capnp_sys;
pub mod data;
pub mod files;
pub mod plot;
mod shm_floor;
mod tarpc_sys;
mod tonic_sys;
mod uds;
mod xmlrpc;

use std::collections::{HashMap, HashSet};
use std::io::BufRead as _;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context as _};

pub use data::{Dir, Seq};

use crate::harness::{PeerArgs, Placement, Record, PARENT_ENV};
use crate::Opts;

/// Generated protobuf + tonic code (bench/proto/bench.proto), checked in so that
/// the build needs no `protoc`; bench/proto/regenerate.sh rewrites it.
pub mod pb {
    include!("generated/fidobench.rs");
}

/// Generated Cap'n Proto code (bench/proto/bench.capnp), checked in so that the
/// build needs no `capnp`; bench/proto/regenerate.sh rewrites it.
#[allow(clippy::all, dead_code)]
pub mod bench_capnp {
    include!("generated/bench_capnp.rs");
}

pub const SUITE: &str = "rpc";

/// The floors measured beside the systems (see [`run_suite`]).
pub const SPIN_FLOOR: &str = "spin-floor";
pub const FUTEX_FLOOR: &str = "futex-floor";
pub const EVENTFD_FLOOR: &str = "eventfd-floor";
pub const SHM_FLOOR: &str = shm_floor::NAME;

/// LEN values of the full run (the paper's 10² … 10⁷).
pub const LENS: [usize; 6] = [100, 1_000, 10_000, 100_000, 1_000_000, 10_000_000];
/// LEN values of `--quick`.
pub const QUICK_LENS: [usize; 3] = [100, 10_000, 1_000_000];

/// One case of the suite.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Case {
    NullNotified,
    NullPolled,
    /// A null call with each system's default wait (fido `WaitStrategy::default()`,
    /// adaptive; every other system blocks as in `null-notified`).
    NullAdaptive,
    Seq {
        seq: Seq,
        dir: Dir,
        len: usize,
    },
    /// The case study: `read(path, 0, size)` from a caching file server.
    FileRead {
        size: usize,
    },
}

impl Case {
    pub fn name(&self) -> String {
        match self {
            Case::NullNotified => "null-notified".into(),
            Case::NullPolled => "null-polled".into(),
            Case::NullAdaptive => "null-adaptive".into(),
            Case::Seq { seq, dir, len } => format!("{}-{}-{len}", seq.name(), dir.name()),
            Case::FileRead { size } => format!("file-read-{size}"),
        }
    }

    pub fn parse(s: &str) -> anyhow::Result<Case> {
        Ok(match s {
            "null-notified" => Case::NullNotified,
            "null-polled" => Case::NullPolled,
            "null-adaptive" => Case::NullAdaptive,
            _ if s.starts_with("file-read-") => Case::FileRead {
                size: s["file-read-".len()..]
                    .parse()
                    .with_context(|| format!("bad size in {s}"))?,
            },
            _ => {
                let mut it = s.splitn(3, '-');
                let (Some(q), Some(d), Some(l)) = (it.next(), it.next(), it.next()) else {
                    bail!("bad rpc case {s}");
                };
                Case::Seq {
                    seq: Seq::parse(q).with_context(|| format!("bad sequence in {s}"))?,
                    dir: Dir::parse(d).with_context(|| format!("bad direction in {s}"))?,
                    len: l.parse().with_context(|| format!("bad LEN in {s}"))?,
                }
            }
        })
    }

    /// Every case of a run, in table order.
    pub fn all(quick: bool) -> Vec<Case> {
        let mut v = vec![Case::NullNotified, Case::NullPolled, Case::NullAdaptive];
        let lens: &[usize] = if quick { &QUICK_LENS } else { &LENS };
        for seq in Seq::ALL {
            for dir in [Dir::Send, Dir::Recv] {
                for &len in lens {
                    v.push(Case::Seq { seq, dir, len });
                }
            }
        }
        let sizes: &[usize] = if quick {
            &files::QUICK_SIZES
        } else {
            &files::SIZES
        };
        v.extend(sizes.iter().map(|&size| Case::FileRead { size }));
        v
    }
}

/// `--filter` of this suite: comma-separated terms, each a substring of the system
/// or the case; a term ending in `$` must end the case name (`byteseq-send-100$`
/// is LEN 100 only).
pub fn wants(filter: Option<&str>, system: &str, case: &str) -> bool {
    let Some(f) = filter else { return true };
    f.split(',')
        .map(str::trim)
        .filter(|t| !t.is_empty())
        .any(|t| {
            if let Some(t) = t.strip_suffix('$') {
                case.ends_with(t) || system == t
            } else {
                system.contains(t) || case.contains(t)
            }
        })
}

/// Timing knobs handed to a client process.
#[derive(Debug, Clone, Copy)]
pub struct Timing {
    pub warmup: Duration,
    pub duration: Duration,
}

impl Timing {
    pub fn of(opts: &Opts) -> Timing {
        Timing {
            warmup: opts.warmup(),
            duration: opts.duration(),
        }
    }
    fn args(&self) -> [String; 2] {
        [
            format!("warm_ms={}", self.warmup.as_millis()),
            format!("dur_ms={}", self.duration.as_millis()),
        ]
    }
}

/// Time a point's client may take before the point is `did_not_finish`.
pub fn budget(opts: &Opts) -> Duration {
    if opts.quick {
        Duration::from_secs(5)
    } else {
        Duration::from_secs(20)
    }
}

/// A system under test: how to start its server and its client processes. The
/// driver pins, watches, times out, kills and reaps them.
pub trait RpcSystem {
    fn name(&self) -> &str;
    /// Whether the system takes part in `case` (only busy-polling systems run
    /// `null-polled`).
    fn supports(&self, case: &Case) -> bool;
    /// The server process for one point, listening at `addr` (a Unix socket path or
    /// a service name), pinned to `cpu`. It prints one line (`{"event":"ready"}`)
    /// on stdout once clients may connect.
    fn server(&self, addr: &str, case: &Case, cpu: usize) -> Command;
    /// The client process: runs `case` against `addr` and prints one JSON line
    /// ([`ClientResult`]) on stdout.
    fn client(&self, addr: &str, case: &Case, cpu: usize, timing: Timing) -> Command;
}

/// A Rust system of this crate, run as `<exe> __bench-peer rpc-server|rpc-client`.
pub struct Builtin(pub &'static str);

fn self_cmd(args: &[String]) -> Command {
    let exe = std::env::current_exe().expect("current_exe");
    let mut c = Command::new(exe);
    c.arg("__bench-peer").args(args);
    c
}

impl RpcSystem for Builtin {
    fn name(&self) -> &str {
        self.0
    }
    fn supports(&self, case: &Case) -> bool {
        if self.0 == shm_floor::NAME {
            return matches!(case, Case::Seq { .. });
        }
        match case {
            Case::NullPolled => self.0 == "uds",
            Case::FileRead { .. } => self.0 == "tonic",
            _ => true,
        }
    }
    fn server(&self, addr: &str, case: &Case, cpu: usize) -> Command {
        let system = match case {
            Case::FileRead { .. } => format!("{}-files", self.0),
            _ => self.0.to_string(),
        };
        self_cmd(&[
            "rpc-server".into(),
            format!("system={system}"),
            format!("addr={addr}"),
            format!("case={}", case.name()),
            format!("cpu={cpu}"),
        ])
    }
    fn client(&self, addr: &str, case: &Case, cpu: usize, t: Timing) -> Command {
        let [w, d] = t.args();
        self_cmd(&[
            "rpc-client".into(),
            format!("system={}", self.0),
            format!("addr={addr}"),
            format!("case={}", case.name()),
            format!("cpu={cpu}"),
            w,
            d,
        ])
    }
}

/// The baselines of the suite, in table order after fido. XML-RPC is left out,
/// with a message, when no Python with `xmlrpc` runs here.
pub fn baselines(opts: &Opts) -> Vec<Box<dyn RpcSystem>> {
    let mut v: Vec<Box<dyn RpcSystem>> = vec![
        Box::new(Builtin("uds")),
        Box::new(Builtin("tarpc")),
        Box::new(Builtin("capnp")),
        Box::new(Builtin("tonic")),
    ];
    if xmlrpc::available() {
        v.push(Box::new(xmlrpc::XmlRpc));
    } else if wants(opts.filter.as_deref(), "xmlrpc", "") {
        eprintln!(
            "bench: xmlrpc skipped: `{} -c 'import xmlrpc.server'` failed (Debian package python3)",
            xmlrpc::python()
        );
    }
    v
}

// ---------------------------------------------------------------------------
// Client side: the timing loop every Rust client (and fido's) runs
// ---------------------------------------------------------------------------

/// What a client process reports (one JSON line on stdout).
#[derive(Debug, Clone, Default, serde::Serialize, serde::Deserialize)]
pub struct ClientResult {
    /// Measured calls.
    pub calls: u64,
    /// Calls (warm-up included) whose checksum the client asserted.
    pub checked: u64,
    /// Measured seconds.
    pub secs: f64,
    /// Payload bytes moved in the measured window (Table 2 volume × calls).
    pub bytes: u64,
    /// Round-trip p50/p99 in ns (null cases).
    pub p50_ns: Option<f64>,
    pub p99_ns: Option<f64>,
}

/// One connected client of a system. Implementations assert checksums inside
/// [`RpcClient::call`] (returning an error on mismatch).
pub trait RpcClient {
    fn null(&mut self) -> anyhow::Result<()>;
    /// One call moving the sequence `(seq, len, seed)` in direction `dir`; fails
    /// unless the checksum came back right.
    fn call(&mut self, seq: Seq, dir: Dir, len: usize, seed: u64) -> anyhow::Result<()>;
}

/// The client process's loop: warm-up, measured window, one JSON line on stdout.
pub fn run_client(c: &mut dyn RpcClient, a: &PeerArgs) -> anyhow::Result<()> {
    let case = Case::parse(a.get("case")?)?;
    let warm = Duration::from_millis(a.num("warm_ms")?);
    let dur = Duration::from_millis(a.num("dur_ms")?);
    let r = client_loop(c, case, warm, dur)?;
    emit_result(&r)
}

/// The file-server client process's loop (`file-read-<size>`).
pub fn run_files_client(
    c: &mut dyn files::FilesClient,
    size: usize,
    a: &PeerArgs,
) -> anyhow::Result<()> {
    let warm = Duration::from_millis(a.num("warm_ms")?);
    let dur = Duration::from_millis(a.num("dur_ms")?);
    emit_result(&files::client_loop(c, size, warm, dur)?)
}

pub fn emit_result(r: &ClientResult) -> anyhow::Result<()> {
    use std::io::Write as _;
    let mut out = std::io::stdout().lock();
    serde_json::to_writer(&mut out, r)?;
    out.write_all(b"\n")?;
    out.flush()?;
    Ok(())
}

pub fn client_loop(
    c: &mut dyn RpcClient,
    case: Case,
    warm: Duration,
    dur: Duration,
) -> anyhow::Result<ClientResult> {
    let mut seed = 1u64;
    match case {
        Case::NullNotified | Case::NullPolled | Case::NullAdaptive => {
            let rtts = crate::harness::time_round_trips(warm, dur, |_| c.null())?;
            let mut rtts = rtts;
            let (p50, p99) = crate::harness::percentiles(&mut rtts);
            Ok(ClientResult {
                calls: rtts.len() as u64,
                checked: 0,
                secs: 0.0,
                bytes: 0,
                p50_ns: Some(p50 as f64),
                p99_ns: Some(p99 as f64),
            })
        }
        Case::FileRead { size } => bail!("file-read-{size} runs through run_files_client"),
        Case::Seq { seq, dir, len } => {
            let mut checked = 0u64;
            let t = Instant::now();
            loop {
                c.call(seq, dir, len, seed)?;
                seed += 1;
                checked += 1;
                if t.elapsed() >= warm {
                    break;
                }
            }
            let t = Instant::now();
            let mut calls = 0u64;
            let secs = loop {
                c.call(seq, dir, len, seed)?;
                seed += 1;
                checked += 1;
                calls += 1;
                let e = t.elapsed();
                if e >= dur {
                    break e.as_secs_f64();
                }
            };
            Ok(ClientResult {
                calls,
                checked,
                secs,
                bytes: calls * seq.payload(len),
                p50_ns: None,
                p99_ns: None,
            })
        }
    }
}

/// Entry point of `__bench-peer rpc-server|rpc-client system=... ...` for the
/// Rust baselines (fido's own peers live in the `fido` binary).
pub(crate) fn peer(kind: &str, a: &PeerArgs) -> Option<anyhow::Result<()>> {
    let r = match kind {
        "rpc-server" => (|| {
            let addr = a.get("addr")?;
            match a.get("system")? {
                "uds" => uds::serve(addr, Case::parse(a.get("case")?)?),
                shm_floor::NAME => shm_floor::serve(addr, Case::parse(a.get("case")?)?),
                "tarpc" => tarpc_sys::serve(addr),
                "capnp" => capnp_sys::serve(addr),
                "tonic" => tonic_sys::serve(addr),
                "tonic-files" => files::serve_tonic(addr),
                s => bail!("unknown rpc system {s}"),
            }
        })(),
        "rpc-client" => (|| {
            let addr = a.get("addr")?;
            let case = Case::parse(a.get("case")?)?;
            if let Case::FileRead { size } = case {
                return match a.get("system")? {
                    "tonic" => run_files_client(&mut files::TonicFiles::connect(addr)?, size, a),
                    s => bail!("system {s} has no file-read case"),
                };
            }
            match a.get("system")? {
                "uds" => run_client(&mut uds::Client::connect(addr, case)?, a),
                shm_floor::NAME => run_client(&mut shm_floor::Client::connect(addr)?, a),
                "tarpc" => run_client(&mut tarpc_sys::Client::connect(addr)?, a),
                "capnp" => run_client(&mut capnp_sys::Client::connect(addr)?, a),
                "tonic" => run_client(&mut tonic_sys::Client::connect(addr)?, a),
                s => bail!("unknown rpc system {s}"),
            }
        })(),
        _ => return None,
    };
    Some(r)
}

/// A server's "ready" line.
pub fn emit_ready() -> anyhow::Result<()> {
    use std::io::Write as _;
    let mut out = std::io::stdout().lock();
    writeln!(
        out,
        "{{\"event\":\"ready\",\"pid\":{}}}",
        std::process::id()
    )?;
    out.flush()?;
    Ok(())
}

// ---------------------------------------------------------------------------
// Driver side
// ---------------------------------------------------------------------------

/// A child process whose stdout lines arrive on a channel; killed and reaped on
/// drop (every path).
pub struct Proc {
    child: Option<Child>,
    lines: mpsc::Receiver<String>,
    what: String,
}

impl Proc {
    pub fn spawn(mut cmd: Command, what: &str) -> anyhow::Result<Proc> {
        cmd.env(PARENT_ENV, std::process::id().to_string())
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit());
        let mut child = cmd.spawn().with_context(|| format!("spawning {what}"))?;
        let out = child.stdout.take().expect("piped");
        let (tx, rx) = mpsc::channel();
        std::thread::Builder::new()
            .name("rpc-bench-stdout".into())
            .spawn(move || {
                for l in std::io::BufReader::new(out).lines() {
                    let Ok(l) = l else { return };
                    if tx.send(l).is_err() {
                        return;
                    }
                }
            })?;
        Ok(Proc {
            child: Some(child),
            lines: rx,
            what: what.into(),
        })
    }

    /// The next stdout line; `Ok(None)` on timeout; an error if the process
    /// exited without one.
    pub fn line(&mut self, timeout: Duration) -> anyhow::Result<Option<String>> {
        match self.lines.recv_timeout(timeout) {
            Ok(l) => Ok(Some(l)),
            Err(mpsc::RecvTimeoutError::Timeout) => Ok(None),
            Err(mpsc::RecvTimeoutError::Disconnected) => {
                let st = self.child.as_mut().and_then(|c| c.wait().ok());
                bail!(
                    "{} exited ({}) without reporting",
                    self.what,
                    st.map(|s| s.to_string()).unwrap_or_default()
                )
            }
        }
    }

    /// Waits for a line that parses as JSON with `"event":"ready"`.
    pub fn ready(&mut self, timeout: Duration) -> anyhow::Result<()> {
        let deadline = Instant::now() + timeout;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.line(left)? {
                Some(l) if l.contains("\"ready\"") => return Ok(()),
                Some(_) => continue,
                None => bail!("{} not ready within {timeout:?}", self.what),
            }
        }
    }

    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        self.kill();
    }
}

/// What happened to one point.
pub enum Outcome {
    Done(ClientResult),
    DidNotFinish,
}

/// Runs one point of `sys`: server, client, result (or did-not-finish).
pub fn run_point(
    sys: &dyn RpcSystem,
    case: &Case,
    addr: &str,
    opts: &Opts,
) -> anyhow::Result<Outcome> {
    let place = Placement::detect();
    let mut server = Proc::spawn(
        sys.server(addr, case, place.peer),
        &format!("{} server", sys.name()),
    )?;
    server.ready(Duration::from_secs(20))?;
    let mut client = Proc::spawn(
        sys.client(addr, case, place.parent, Timing::of(opts)),
        &format!("{} client", sys.name()),
    )?;
    let line = client.line(budget(opts))?;
    client.kill();
    server.kill();
    let Some(line) = line else {
        return Ok(Outcome::DidNotFinish);
    };
    let r: ClientResult = serde_json::from_str(&line)
        .with_context(|| format!("{} client printed `{line}`", sys.name()))?;
    Ok(Outcome::Done(r))
}

/// A unique socket path for one point.
pub fn sock_path(dir: &Path, system: &str, n: usize) -> PathBuf {
    dir.join(format!("{system}-{n}.sock"))
}

/// The result of a whole suite run.
pub struct SuiteRun {
    pub records: Vec<Record>,
    /// Points that failed (error, checksum mismatch): `system case: error`.
    pub failures: Vec<String>,
    /// Calls whose checksum a client asserted, summed over every point.
    pub checked: u64,
    /// Measured sequence calls summed over every point.
    pub seq_calls: u64,
}

/// Runs `systems` (fido first, then the baselines) over every case the filter
/// wants, with the floors of the run: `futex-floor` and `eventfd-floor` on
/// `null-notified`, `spin-floor` on `null-polled`, `shm-floor` (a system run
/// like the others) on the sequence cases.
pub fn run_suite(
    systems: &[&dyn RpcSystem],
    opts: &Opts,
    addr_of: &dyn Fn(&dyn RpcSystem, usize) -> String,
) -> anyhow::Result<SuiteRun> {
    let filter = opts.filter.as_deref();
    let mut run = SuiteRun {
        records: Vec::new(),
        failures: Vec::new(),
        checked: 0,
        seq_calls: 0,
    };
    // (system, seq, dir) pairs that already ran out of budget at a smaller LEN.
    let mut over: HashSet<(String, &'static str, &'static str)> = HashSet::new();
    let mut n = 0usize;
    let floor = Builtin(shm_floor::NAME);
    let systems: Vec<&dyn RpcSystem> = std::iter::once(&floor as &dyn RpcSystem)
        .chain(systems.iter().copied())
        .collect();
    for case in Case::all(opts.quick) {
        let cname = case.name();
        type Floor = fn(&Opts) -> anyhow::Result<Vec<u64>>;
        let floors: &[(&str, Floor)] = match case {
            Case::NullNotified => &[
                (FUTEX_FLOOR, crate::shm::futex_floor),
                (EVENTFD_FLOOR, |o| Ok(crate::shm::eventfd_floor(8, o)?.0)),
            ],
            Case::NullPolled => &[(SPIN_FLOOR, |o| Ok(crate::shm::spin_floor(8, o)?.0))],
            _ => &[],
        };
        for (fname, f) in floors {
            if !wants(filter, fname, &cname) {
                continue;
            }
            match f(opts) {
                Ok(mut rtts) => {
                    let (p50, p99) = crate::harness::percentiles(&mut rtts);
                    run.records.push(rtt_record(
                        &cname,
                        fname,
                        p50 as f64,
                        p99 as f64,
                        rtts.len() as u64,
                    ));
                }
                Err(e) => {
                    eprintln!("bench: {fname} {cname} failed: {e:#}");
                    run.failures.push(format!("{fname} {cname}: {e:#}"));
                }
            }
        }
        for sys in &systems {
            let name = sys.name().to_string();
            if !sys.supports(&case) || !wants(filter, &name, &cname) {
                continue;
            }
            if let Case::Seq { seq, dir, .. } = case {
                if over.contains(&(name.clone(), seq.name(), dir.name())) {
                    run.records.push(dnf_record(&cname, &name, opts, true));
                    eprintln!("bench: {name} {cname}: did not finish (a smaller LEN already exceeded the budget)");
                    continue;
                }
            }
            n += 1;
            let addr = addr_of(*sys, n);
            let t = Instant::now();
            match run_point(*sys, &case, &addr, opts) {
                Ok(Outcome::Done(r)) => {
                    run.checked += r.checked;
                    match case {
                        Case::Seq { .. } => {
                            run.seq_calls += r.calls;
                            if r.checked < r.calls || r.calls == 0 {
                                run.failures.push(format!(
                                    "{name} {cname}: {} measured calls but {} checksums asserted",
                                    r.calls, r.checked
                                ));
                            }
                            run.records.push(Record::throughput(
                                SUITE,
                                &cname,
                                &name,
                                r.bytes as f64 / r.secs.max(1e-9),
                                r.calls,
                            ));
                        }
                        Case::FileRead { .. } => {
                            run.records.push(rtt_record(
                                &cname,
                                &name,
                                r.p50_ns.unwrap_or(0.0),
                                r.p99_ns.unwrap_or(0.0),
                                r.calls,
                            ));
                            run.records.push(Record {
                                metric: "requests_per_s".into(),
                                unit: "req/s".into(),
                                value: r.calls as f64 / r.secs.max(1e-9),
                                p50: None,
                                p99: None,
                                ..rtt_record(&cname, &name, 0.0, 0.0, r.calls)
                            });
                        }
                        _ => run.records.push(rtt_record(
                            &cname,
                            &name,
                            r.p50_ns.unwrap_or(0.0),
                            r.p99_ns.unwrap_or(0.0),
                            r.calls,
                        )),
                    }
                }
                Ok(Outcome::DidNotFinish) => {
                    eprintln!(
                        "bench: {name} {cname}: did not finish within {:?} (killed after {:.1} s)",
                        budget(opts),
                        t.elapsed().as_secs_f64()
                    );
                    run.records.push(dnf_record(&cname, &name, opts, false));
                    if let Case::Seq { seq, dir, .. } = case {
                        over.insert((name.clone(), seq.name(), dir.name()));
                    }
                }
                Err(e) => {
                    eprintln!("bench: {name} {cname} failed: {e:#}");
                    run.failures.push(format!("{name} {cname}: {e:#}"));
                }
            }
        }
    }
    Ok(run)
}

/// A null-call record: value = p50 round trip.
pub fn rtt_record(case: &str, system: &str, p50: f64, p99: f64, n: u64) -> Record {
    Record {
        suite: SUITE.into(),
        case: case.into(),
        system: system.into(),
        metric: "round_trip_ns".into(),
        value: p50,
        unit: "ns".into(),
        p50: Some(p50),
        p99: Some(p99),
        n,
    }
}

/// A point over its time budget: metric `did_not_finish`, value = the budget in
/// seconds, n = 0. `skipped`: not run because a smaller LEN already was over.
pub fn dnf_record(case: &str, system: &str, opts: &Opts, skipped: bool) -> Record {
    Record {
        suite: SUITE.into(),
        case: case.into(),
        system: system.into(),
        metric: "did_not_finish".into(),
        value: budget(opts).as_secs_f64(),
        unit: if skipped {
            "s budget (smaller LEN over)"
        } else {
            "s budget"
        }
        .into(),
        p50: None,
        p99: None,
        n: 0,
    }
}

/// How a goal of issue #4 stands in one run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    Met,
    NotMet,
    /// Not met, and the floor measured in the same run shows that no
    /// implementation could meet it on this machine.
    BeyondFloor,
}

impl Verdict {
    pub fn label(self) -> &'static str {
        match self {
            Verdict::Met => "met",
            Verdict::NotMet => "NOT met",
            Verdict::BeyondFloor => "beyond floor",
        }
    }
}

/// One goal of issue #4 read off a run: the ratio (fido's advantage, or for the
/// polled goal fido / floor), the verdict (`None` = not measured) and a note
/// (the bound the run's floor implies, or why the goal counts as met).
pub struct Goal {
    pub what: String,
    pub ratio: Option<f64>,
    pub verdict: Option<Verdict>,
    pub note: String,
}

/// `Met` if the ratio reaches `want`; otherwise `BeyondFloor` when the floor's
/// own ratio does not reach it either, else `NotMet`.
fn verdict(ratio: f64, want: f64, floor_ratio: Option<f64>) -> Verdict {
    if ratio >= want {
        Verdict::Met
    } else if floor_ratio.is_some_and(|b| b < want) {
        Verdict::BeyondFloor
    } else {
        Verdict::NotMet
    }
}

/// The goals of issue #4 read off one run's records.
pub fn goals(records: &[Record]) -> Vec<Goal> {
    let get = |case: &str, sys: &str, metric: &str| -> Option<f64> {
        records
            .iter()
            .find(|r| r.case == case && r.system == sys && r.metric == metric)
            .map(|r| r.value)
    };
    let mut out = Vec::new();
    let fido_nn = get("null-notified", "fido", "round_trip_ns");
    // The faster blocking floor of the run: no call whose both ends block can beat it.
    let blocking_floor = [FUTEX_FLOOR, EVENTFD_FLOOR]
        .into_iter()
        .filter_map(|f| {
            get("null-notified", f, "round_trip_ns")
                .filter(|&v| v > 0.0)
                .map(|v| (f, v))
        })
        .min_by(|a, b| a.1.total_cmp(&b.1));
    for (sys, want) in [("tonic", 5.0), ("capnp", 5.0), ("uds", 1.5)] {
        let b = get("null-notified", sys, "round_trip_ns");
        let ratio = match (fido_nn, b) {
            (Some(f), Some(b)) if f > 0.0 => Some(b / f),
            _ => None,
        };
        let floor = blocking_floor.zip(b).map(|((f, v), b)| (f, b / v));
        let verdict = ratio.map(|r| verdict(r, want, floor.map(|x| x.1)));
        let note = match floor {
            Some((f, fr)) if verdict == Some(Verdict::BeyondFloor) => {
                format!("{f} is {fr:.2}x faster than {sys}: no blocking RPC can meet this")
            }
            Some((f, fr)) => format!("{f} is {fr:.2}x faster than {sys}"),
            None => String::new(),
        };
        out.push(Goal {
            what: format!("null-notified: fido >= {want}x faster than {sys}"),
            ratio,
            verdict,
            note,
        });
    }
    let ratio = match (
        get("null-polled", "fido", "round_trip_ns"),
        get("null-polled", SPIN_FLOOR, "round_trip_ns"),
    ) {
        (Some(f), Some(s)) if s > 0.0 => Some(f / s),
        _ => None,
    };
    out.push(Goal {
        what: "null-polled: fido <= 2x the spin floor (ratio = fido / floor)".into(),
        ratio,
        verdict: ratio.map(|r| {
            if r <= 2.0 {
                Verdict::Met
            } else {
                Verdict::NotMet
            }
        }),
        note: String::new(),
    });
    let mut lens: Vec<usize> = records
        .iter()
        .filter_map(|r| match Case::parse(&r.case) {
            Ok(Case::Seq { len, .. }) if len >= 100_000 => Some(len),
            _ => None,
        })
        .collect();
    lens.sort_unstable();
    lens.dedup();
    for seq in [Seq::Fixed, Seq::Var] {
        for dir in [Dir::Send, Dir::Recv] {
            for &len in &lens {
                let case = Case::Seq { seq, dir, len }.name();
                let f = get(&case, "fido", "bytes_per_s");
                let floor = get(&case, SHM_FLOOR, "bytes_per_s");
                for sys in ["capnp", "tonic"] {
                    let b = get(&case, sys, "bytes_per_s");
                    let dnf = get(&case, sys, "did_not_finish").is_some();
                    let floor_ratio = match (floor, b) {
                        (Some(fl), Some(b)) if b > 0.0 => Some(fl / b),
                        _ => None,
                    };
                    let (ratio, verdict) = match (f, b) {
                        (Some(f), Some(b)) if b > 0.0 => {
                            (Some(f / b), Some(verdict(f / b, 10.0, floor_ratio)))
                        }
                        (Some(_), None) if dnf => (None, Some(Verdict::Met)),
                        _ => (None, None),
                    };
                    let note = match floor_ratio {
                        _ if ratio.is_none() && dnf => "baseline did not finish".to_string(),
                        Some(fr) if verdict == Some(Verdict::BeyondFloor) => format!(
                            "{SHM_FLOOR} is {fr:.2}x {sys}: no synchronous RPC can meet this"
                        ),
                        Some(fr) => format!("{SHM_FLOOR} is {fr:.2}x {sys}"),
                        None => String::new(),
                    };
                    out.push(Goal {
                        what: format!("{case}: fido >= 10x {sys}"),
                        ratio,
                        verdict,
                        note,
                    });
                }
            }
        }
    }
    out
}

/// The goal lines of a run as printed (only the goals measured in it; nothing
/// when none was): a header, then `#   [verdict] goal: ratio (note)`.
pub fn goal_lines(records: &[Record]) -> Vec<String> {
    let g: Vec<Goal> = goals(records)
        .into_iter()
        .filter(|g| g.verdict.is_some())
        .collect();
    if g.is_empty() {
        return Vec::new();
    }
    let mut out = vec!["# goals (issue #4), ratios from this run:".to_string()];
    for g in g {
        let r = g.ratio.map(|r| format!("{r:.2}x")).unwrap_or_default();
        out.push(format!(
            "#   [{}] {}: {r}{}",
            g.verdict.map(Verdict::label).unwrap_or_default(),
            g.what,
            if g.note.is_empty() {
                String::new()
            } else {
                format!(" ({})", g.note)
            }
        ));
    }
    out
}

/// Prints the goals (only those measured in this run).
pub fn print_goals(records: &[Record]) {
    for l in goal_lines(records) {
        println!("{l}");
    }
}

/// Groups records by (system) for quick look-ups by the caller.
pub fn by_system(records: &[Record]) -> HashMap<String, Vec<&Record>> {
    let mut m: HashMap<String, Vec<&Record>> = HashMap::new();
    for r in records {
        m.entry(r.system.clone()).or_default().push(r);
    }
    m
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn case_names_round_trip() {
        for c in Case::all(false) {
            assert_eq!(Case::parse(&c.name()).unwrap(), c);
        }
        assert_eq!(Case::all(false).len(), 3 + 3 * 2 * 6 + files::SIZES.len());
        assert!(Case::parse("byteseq-sideways-10").is_err());
    }

    fn rec(case: &str, system: &str, value: f64) -> Record {
        if case.starts_with("null") {
            rtt_record(case, system, value, value * 2.0, 100)
        } else {
            Record::throughput(SUITE, case, system, value, 100)
        }
    }

    #[test]
    fn goal_lines_classify_against_the_floors() {
        let nn = "null-notified";
        let fs = "fixedseq-send-100000";
        let vr = "varseq-recv-1000000";
        let mut records = vec![
            rec(nn, EVENTFD_FLOOR, 9_000.0),
            rec(nn, FUTEX_FLOOR, 8_000.0),
            rec(nn, "fido", 10_000.0),
            rec(nn, "uds", 10_000.0),
            rec(nn, "capnp", 30_000.0),
            rec(nn, "tonic", 45_000.0),
            rec("null-polled", SPIN_FLOOR, 100.0),
            rec("null-polled", "fido", 150.0),
            rec(fs, SHM_FLOOR, 1.5e9),
            rec(fs, "fido", 1e9),
            rec(fs, "capnp", 5e8),
            rec(fs, "tonic", 5e7),
            rec(vr, SHM_FLOOR, 4e9),
            rec(vr, "fido", 1e9),
            rec(vr, "capnp", 2e8),
            dnf_record(vr, "tonic", &Opts::default(), false),
        ];
        let want = [
            "# goals (issue #4), ratios from this run:",
            // The faster blocking floor (futex, 8 µs) bounds every null-notified goal.
            "#   [NOT met] null-notified: fido >= 5x faster than tonic: 4.50x (futex-floor is 5.62x faster than tonic)",
            "#   [beyond floor] null-notified: fido >= 5x faster than capnp: 3.00x (futex-floor is 3.75x faster than capnp: no blocking RPC can meet this)",
            "#   [beyond floor] null-notified: fido >= 1.5x faster than uds: 1.00x (futex-floor is 1.25x faster than uds: no blocking RPC can meet this)",
            "#   [met] null-polled: fido <= 2x the spin floor (ratio = fido / floor): 1.50x",
            "#   [beyond floor] fixedseq-send-100000: fido >= 10x capnp: 2.00x (shm-floor is 3.00x capnp: no synchronous RPC can meet this)",
            "#   [met] fixedseq-send-100000: fido >= 10x tonic: 20.00x (shm-floor is 30.00x tonic)",
            "#   [NOT met] varseq-recv-1000000: fido >= 10x capnp: 5.00x (shm-floor is 20.00x capnp)",
            "#   [met] varseq-recv-1000000: fido >= 10x tonic:  (baseline did not finish)",
        ];
        assert_eq!(goal_lines(&records), want);

        // Met beats a floor that says it cannot be (noise): the goal was reached.
        records.retain(|r| r.system != "tonic" || r.case != nn);
        records.push(rec(nn, "tonic", 60_000.0));
        assert!(goal_lines(&records)[1].starts_with(
            "#   [met] null-notified: fido >= 5x faster than tonic: 6.00x (futex-floor is 7.50x"
        ));

        // Without floors in the run nothing is "beyond floor".
        records.retain(|r| !r.system.ends_with("-floor"));
        let lines = goal_lines(&records);
        assert!(
            lines
                .iter()
                .all(|l| !l.contains("beyond") && !l.contains("floor is")),
            "{lines:#?}"
        );
        assert!(lines
            .iter()
            .any(|l| l
                .starts_with("#   [NOT met] null-notified: fido >= 1.5x faster than uds: 1.00x")));
        // The polled goal is not measured without its floor.
        assert!(lines.iter().all(|l| !l.contains("null-polled")));

        // Nothing measured: no header either.
        assert!(goal_lines(&[]).is_empty());
    }

    #[test]
    fn floors_take_part_only_in_their_cases() {
        let f = Builtin(SHM_FLOOR);
        assert!(!f.supports(&Case::NullNotified) && !f.supports(&Case::NullPolled));
        assert!(!f.supports(&Case::FileRead { size: 4096 }));
        for c in Case::all(true) {
            if let Case::Seq { .. } = c {
                assert!(f.supports(&c), "{}", c.name());
            }
        }
    }

    #[test]
    fn filter_terms() {
        assert!(wants(Some("uds"), "uds", "null-notified"));
        assert!(wants(
            Some("x,byteseq-send-100$"),
            "tonic",
            "byteseq-send-100"
        ));
        assert!(!wants(
            Some("byteseq-send-100$"),
            "tonic",
            "byteseq-send-10000"
        ));
        assert!(wants(None, "a", "b"));
    }
}
