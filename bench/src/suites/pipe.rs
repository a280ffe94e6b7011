//! `fido-bench pipe`: vPipe's Figures 4–7 and its web-server / load-balancer
//! experiment, on one machine with two CPUs.
//!
//! Placement (as vPipe pinned the driver domain and the guest): the
//! *application* and 0–3 *busy* processes (spinning loops, vPipe's lookbusy)
//! share CPU A; the broker — whose pipe engine moves the bytes in `fido-pipe`
//! mode — runs on CPU B, with the measuring parent and its sinks/sources.
//!
//! * `<kind>-busy<N>` for kind `file-to-socket`, `socket-to-file`,
//!   `socket-to-socket`, `file-to-file`: the application moves one transfer
//!   (512 MiB; `--quick` 32 MiB) with a read/write loop (`readwrite`),
//!   sendfile/splice/copy_file_range (`sendfile`) or the engine (`fido-pipe`).
//!   `bytes_per_s` = bytes / the application's wall time for the move;
//!   `cpu_s_per_gib` = the application process's CPU time
//!   (`CLOCK_PROCESS_CPUTIME_ID`, all threads, user+system) per GiB moved. The
//!   socket ends are TCP over loopback to the parent: its sink splices into
//!   `/dev/null` (no copy to user space), its source writes a 1 MiB buffer.
//!   Files live in a temporary directory on the default temp filesystem; the
//!   source file is in the page cache (it was just written), written files are
//!   not fsynced (vPipe used O_SYNC on a disk; here the page cache is measured).
//! * `fairness-1-1-2`: three clients streaming file→socket start 5 s apart
//!   (`--quick`: 0.5 s) with weights 1, 1, 2; per-client throughput over time
//!   (PNG with `--plot`), each one's `share` of the bytes moved while all three
//!   ran, and the weighted Jain index. The same clients in `sendfile` mode are
//!   the baseline (the kernel knows no weights).
//! * `serve-wrk[-busy0]`: `fido pipe serve` on CPU A (with 2 busy processes;
//!   `-busy0` without) under `wrk` (on CPU B, keep-alive, 1 MiB file) with each
//!   strategy, and nginx (sendfile on, one worker on CPU A) serving the same
//!   directory. `requests_per_s` and `bytes_per_s`.
//! * `proxy-wrk[-busy0]`: `fido pipe proxy` on CPU A in front of nginx (on
//!   CPU B) under wrk, with each strategy, and nginx's own TCP proxy (`stream`
//!   module) in the same place.
//!
//! Helpers are this binary re-executed as `fido-bench __pipe-role <role> key=value...`.

use std::fs::{File, OpenOptions};
use std::io::Write as _;
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsFd;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use anyhow::{bail, Context as _};
use crate::{PeerArgs, PinGuard, Placement, Record};
use serde_json::json;

use fido_pipe_apps::{engine, mover as pipe_move, Strategy};
use fido_demo::proc::{self, EmbeddedBroker, Kid};

const SUITE: &str = "pipe";
const GIB: f64 = (1u64 << 30) as f64;

/// Options of `fido-bench pipe`.
pub struct PipeBenchOpts {
    pub quick: bool,
    pub json: Option<PathBuf>,
    pub plot: Option<PathBuf>,
    pub filter: Option<String>,
}

impl PipeBenchOpts {
    fn wants(&self, system: &str, case: &str) -> bool {
        match &self.filter {
            None => true,
            Some(f) => system.contains(f.as_str()) || case.contains(f.as_str()),
        }
    }
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Kind {
    FileToSocket,
    SocketToFile,
    SocketToSocket,
    FileToFile,
}

impl Kind {
    const ALL: [Kind; 4] = [
        Kind::FileToSocket,
        Kind::SocketToFile,
        Kind::SocketToSocket,
        Kind::FileToFile,
    ];
    fn name(self) -> &'static str {
        match self {
            Kind::FileToSocket => "file-to-socket",
            Kind::SocketToFile => "socket-to-file",
            Kind::SocketToSocket => "socket-to-socket",
            Kind::FileToFile => "file-to-file",
        }
    }
    fn parse(s: &str) -> anyhow::Result<Kind> {
        Kind::ALL
            .into_iter()
            .find(|k| k.name() == s)
            .ok_or_else(|| anyhow::anyhow!("unknown transfer kind {s}"))
    }
}

fn strategy(s: &str) -> anyhow::Result<Strategy> {
    [Strategy::Fido, Strategy::Sendfile, Strategy::Readwrite]
        .into_iter()
        .find(|x| x.system() == s)
        .ok_or_else(|| anyhow::anyhow!("unknown mode {s}"))
}

fn record(case: &str, system: &str, metric: &str, value: f64, unit: &str, n: u64) -> Record {
    Record {
        suite: SUITE.into(),
        case: case.into(),
        system: system.into(),
        metric: metric.into(),
        value,
        unit: unit.into(),
        p50: None,
        p99: None,
        n,
    }
}

/// Everything a run shares: CPUs, the broker, the scratch directory.
struct Ctx {
    app_cpu: usize,
    broker: EmbeddedBroker,
    dir: tempfile::TempDir,
    quick: bool,
    modes: Vec<Strategy>,
}

impl Ctx {
    /// Spawns `fido args...` with CPU A as its whole affinity mask (children
    /// inherit the mask of the thread that forks them).
    fn spawn_on_app(&self, args: &[String]) -> anyhow::Result<Kid> {
        self.spawn_on_app_with(args, self.broker.socket())
    }

    fn spawn_on_app_with(&self, args: &[String], broker: &Path) -> anyhow::Result<Kid> {
        let _g = PinGuard::pin(self.app_cpu)?;
        Kid::spawn(args, broker)
    }

    fn busy(&self, n: usize) -> anyhow::Result<Vec<Kid>> {
        let mut v = Vec::new();
        for _ in 0..n {
            let mut k = self.spawn_on_app(&["__pipe-role".into(), "busy".into()])?;
            k.expect_event("ready", Instant::now() + Duration::from_secs(20))?;
            v.push(k);
        }
        Ok(v)
    }
}

/// `fido-bench pipe`.
pub fn run(o: &PipeBenchOpts) -> anyhow::Result<bool> {
    proc::install_interrupt_flag()?;
    let t = Instant::now();
    let pl = Placement::detect();
    let (app_cpu, eng_cpu) = (pl.parent, pl.peer);
    // Everything started from here on (broker threads, sinks, wrk) inherits CPU B.
    let _pin = PinGuard::pin(eng_cpu)?;
    let broker = EmbeddedBroker::start("fido-bench-pipe-")?;
    let dir = tempfile::Builder::new()
        .prefix("fido-bench-pipe-")
        .tempdir()
        .context("scratch directory")?;
    let mut modes = Vec::new();
    if engine::available(broker.socket()) {
        modes.push(Strategy::Fido);
    } else {
        eprintln!(
            "# fido-pipe: the pipe engine is not available in this build; its points are skipped"
        );
    }
    modes.extend([Strategy::Sendfile, Strategy::Readwrite]);
    let cx = Ctx {
        app_cpu,
        broker,
        dir,
        quick: o.quick,
        modes,
    };
    let mut records = Vec::new();
    let mut ok = true;
    let r = (|| -> anyhow::Result<()> {
        if cx.modes.contains(&Strategy::Fido) {
            // The engine calibrates its capacity on its first transfer: not in a
            // measured point.
            let w = cx.dir.path().join("warmup.bin");
            make_file(&w, 8 << 20)?;
            transfer_point(&cx, Kind::FileToSocket, Strategy::Fido, 0, 8 << 20, &w)
                .context("engine warm-up")?;
            std::fs::remove_file(&w)?;
        }
        transfers(&cx, o, &mut records)?;
        ok &= fairness(&cx, o, &mut records)?;
        web(&cx, o, &mut records)?;
        Ok(())
    })();
    drop(cx);
    drop(_pin);
    // Print whatever was measured even if a later point failed.
    let machine = crate::Machine::describe(format!(
        "pipe: the application and its busy loops on CPU{app_cpu}; the broker (pipe engine), sinks, sources \
         and wrk on CPU{eng_cpu}"
    ));
    crate::print_table_on(&records, &machine);
    println!(
        "# app + busy loops on CPU{app_cpu}, broker (pipe engine), sinks/sources and wrk on CPU{eng_cpu}; \
         transfers {} MiB; cpu_s_per_gib = the application's CPU time per GiB moved",
        transfer_len(o.quick) >> 20
    );
    eprintln!(
        "({} records in {:.1} s)",
        records.len(),
        t.elapsed().as_secs_f64()
    );
    if let Some(p) = &o.json {
        crate::write_json_on(p, &records, &machine)?;
    }
    r?;
    Ok(ok)
}

fn transfer_len(quick: bool) -> u64 {
    if quick {
        32 << 20
    } else {
        512 << 20
    }
}

/// A file of `len` pseudo-random bytes.
fn make_file(path: &Path, len: u64) -> anyhow::Result<()> {
    let mut f = File::create(path).with_context(|| format!("creating {}", path.display()))?;
    let mut buf = vec![0u8; 1 << 20];
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
    let mut left = len;
    while left > 0 {
        for c in buf.chunks_mut(8) {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            c.copy_from_slice(&x.to_le_bytes()[..c.len()]);
        }
        let n = left.min(buf.len() as u64) as usize;
        f.write_all(&buf[..n])?;
        left -= n as u64;
    }
    f.sync_all()?;
    Ok(())
}

// ---------------------------------------------------------------------------------------
// Figures 4 and 6: one transfer per point
// ---------------------------------------------------------------------------------------

/// The parent's end of a socket transfer: a listener and a thread that, once
/// the application connected, drains (sink) or feeds (source) it.
struct End {
    addr: SocketAddr,
    thread: JoinHandle<std::io::Result<u64>>,
}

fn sink() -> anyhow::Result<End> {
    let l = TcpListener::bind("127.0.0.1:0")?;
    let addr = l.local_addr()?;
    let thread = std::thread::spawn(move || {
        let (s, _) = l.accept()?;
        pipe_move::drain_to_null(s.as_fd())
    });
    Ok(End { addr, thread })
}

fn source(len: u64) -> anyhow::Result<End> {
    let l = TcpListener::bind("127.0.0.1:0")?;
    let addr = l.local_addr()?;
    let thread = std::thread::spawn(move || {
        let (mut s, _) = l.accept()?;
        let buf = vec![0x5au8; 1 << 20];
        let mut left = len;
        while left > 0 {
            let n = left.min(buf.len() as u64) as usize;
            s.write_all(&buf[..n])?;
            left -= n as u64;
        }
        s.shutdown(Shutdown::Write)?;
        Ok(len)
    });
    Ok(End { addr, thread })
}

fn join_end(e: End) -> anyhow::Result<u64> {
    match e.thread.join() {
        Ok(r) => Ok(r?),
        Err(_) => bail!("bench end thread panicked"),
    }
}

fn transfers(cx: &Ctx, o: &PipeBenchOpts, out: &mut Vec<Record>) -> anyhow::Result<()> {
    let len = transfer_len(cx.quick);
    let mut src: Option<PathBuf> = None;
    for kind in Kind::ALL {
        for busy in 0..=3usize {
            let case = format!("{}-busy{busy}", kind.name());
            for &mode in &cx.modes {
                if !o.wants(mode.system(), &case) {
                    continue;
                }
                proc::check_interrupt()?;
                if src.is_none() && kind != Kind::SocketToFile && kind != Kind::SocketToSocket {
                    let p = cx.dir.path().join("src.bin");
                    make_file(&p, len)?;
                    src = Some(p);
                }
                let srcp = match &src {
                    Some(p) => p.clone(),
                    None => cx.dir.path().join("src.bin"),
                };
                let (bytes, secs, cpu) = transfer_point(cx, kind, mode, busy, len, &srcp)
                    .with_context(|| format!("{case} {}", mode.system()))?;
                out.push(record(
                    &case,
                    mode.system(),
                    "bytes_per_s",
                    bytes as f64 / secs,
                    "B/s",
                    bytes,
                ));
                out.push(record(
                    &case,
                    mode.system(),
                    "cpu_s_per_gib",
                    cpu / (bytes as f64 / GIB),
                    "s/GiB",
                    bytes,
                ));
            }
        }
    }
    Ok(())
}

fn transfer_point(
    cx: &Ctx,
    kind: Kind,
    mode: Strategy,
    busy: usize,
    len: u64,
    src: &Path,
) -> anyhow::Result<(u64, f64, f64)> {
    let _busy = cx.busy(busy)?;
    let dst = cx.dir.path().join("dst.bin");
    let _ = std::fs::remove_file(&dst);
    let (inp, outp) = match kind {
        Kind::FileToSocket => (None, Some(sink()?)),
        Kind::SocketToFile => (Some(source(len)?), None),
        Kind::SocketToSocket => (Some(source(len)?), Some(sink()?)),
        Kind::FileToFile => (None, None),
    };
    let mut args = vec![
        "__pipe-role".to_string(),
        "app".into(),
        format!("kind={}", kind.name()),
        format!("mode={}", mode.system()),
        format!("len={len}"),
        format!("src={}", src.display()),
        format!("dst={}", dst.display()),
    ];
    if let Some(e) = &inp {
        args.push(format!("in={}", e.addr));
    }
    if let Some(e) = &outp {
        args.push(format!("out={}", e.addr));
    }
    let mut app = cx.spawn_on_app(&args)?;
    let v = app.expect_event("done", Instant::now() + Duration::from_secs(900))?;
    app.finish(Duration::from_secs(30))?;
    if let Some(e) = inp {
        join_end(e)?;
    }
    if let Some(e) = outp {
        let got = join_end(e)?;
        if got != len {
            bail!("the sink received {got} of {len} bytes");
        }
    }
    if kind == Kind::SocketToFile || kind == Kind::FileToFile {
        let l = std::fs::metadata(&dst)?.len();
        if l != len {
            bail!("the destination file has {l} of {len} bytes");
        }
    }
    let _ = std::fs::remove_file(&dst);
    let bytes = v["bytes"].as_u64().context("bytes")?;
    let secs = v["secs"].as_f64().context("secs")?;
    let cpu = v["cpu_s"].as_f64().context("cpu_s")?;
    if bytes != len {
        bail!("moved {bytes} of {len} bytes");
    }
    Ok((bytes, secs.max(1e-9), cpu))
}

fn cpu_time_s() -> f64 {
    let t = rustix::time::clock_gettime(rustix::time::ClockId::ProcessCPUTime);
    t.tv_sec as f64 + t.tv_nsec as f64 * 1e-9
}

/// `__pipe-role app`: one transfer, timed, reported as JSON.
fn role_app(a: &PeerArgs) -> anyhow::Result<()> {
    let kind = Kind::parse(a.get("kind")?)?;
    let mode = strategy(a.get("mode")?)?;
    let len: u64 = a.num("len")?;
    let m = mode.mover()?;
    let (t0, c0, n) = match kind {
        Kind::FileToSocket => {
            let f = File::open(a.get("src")?)?;
            let s = TcpStream::connect(a.get("out")?)?;
            let (t0, c0) = (Instant::now(), cpu_time_s());
            let n = m.file_to_socket(f.as_fd(), 0, len, s.as_fd())?;
            s.shutdown(Shutdown::Write)?;
            (t0, c0, n)
        }
        Kind::SocketToFile => {
            let s = TcpStream::connect(a.get("in")?)?;
            let f = OpenOptions::new()
                .write(true)
                .create_new(true)
                .open(a.get("dst")?)?;
            let (t0, c0) = (Instant::now(), cpu_time_s());
            (t0, c0, m.socket_to_file(s.as_fd(), f.as_fd(), 0, len)?)
        }
        Kind::SocketToSocket => {
            let i = TcpStream::connect(a.get("in")?)?;
            let o = TcpStream::connect(a.get("out")?)?;
            let (t0, c0) = (Instant::now(), cpu_time_s());
            let n = m.socket_to_socket(i.as_fd(), o.as_fd(), Some(len))?;
            o.shutdown(Shutdown::Write)?;
            (t0, c0, n)
        }
        Kind::FileToFile => {
            let f = File::open(a.get("src")?)?;
            let d = OpenOptions::new()
                .write(true)
                .create_new(true)
                .open(a.get("dst")?)?;
            let (t0, c0) = (Instant::now(), cpu_time_s());
            (t0, c0, m.file_to_file(f.as_fd(), 0, len, d.as_fd(), 0)?)
        }
    };
    let secs = t0.elapsed().as_secs_f64();
    let cpu = cpu_time_s() - c0;
    emit(json!({"event": "done", "bytes": n, "secs": secs, "cpu_s": cpu}))
}

fn emit(v: serde_json::Value) -> anyhow::Result<()> {
    let mut out = std::io::stdout().lock();
    writeln!(out, "{v}")?;
    out.flush()?;
    Ok(())
}

// ---------------------------------------------------------------------------------------
// Figure 7: weights 1:1:2
// ---------------------------------------------------------------------------------------

/// One client's samples: (CLOCK_MONOTONIC ns, cumulative bytes).
type Series = Vec<(u64, u64)>;

struct FairPlan {
    starts: [f64; 3],
    ends: [f64; 3],
    bin: f64,
}

fn fair_plan(quick: bool) -> FairPlan {
    // vPipe: client 3 (weight 2) joins at 10 s and leaves before the others.
    let s = if quick { 0.1 } else { 1.0 };
    FairPlan {
        starts: [0.0, 5.0 * s, 10.0 * s],
        ends: [30.0 * s, 30.0 * s, 25.0 * s],
        bin: if quick { 0.1 } else { 0.5 },
    }
}

const WEIGHTS: [u32; 3] = [1, 1, 2];
/// Engine capacity of the weight experiment (vPipe: ~117 MB/s, a 1 Gb/s wire).
const FAIR_CAPACITY: u64 = 120_000_000;

fn fairness(cx: &Ctx, o: &PipeBenchOpts, out: &mut Vec<Record>) -> anyhow::Result<bool> {
    let case = "fairness-1-1-2";
    let plan = fair_plan(cx.quick);
    let mut panels: Vec<(String, [Series; 3], f64)> = Vec::new();
    let mut ok = true;
    for mode in [Strategy::Fido, Strategy::Sendfile] {
        if !cx.modes.contains(&mode) || !o.wants(mode.system(), case) {
            continue;
        }
        proc::check_interrupt()?;
        let file = cx.dir.path().join("fair.bin");
        if !file.exists() {
            make_file(&file, 64 << 20)?;
        }
        // The engine must be the bottleneck for weights to matter (vPipe's was a
        // 1 Gb/s wire): a broker of its own with a fixed capacity, not work-conserving.
        let capped = match mode {
            Strategy::Fido => Some(EmbeddedBroker::start_with_pipe(
                "fido-bench-pipe-fair-",
                fido_broker::PipeConfig {
                    capacity: fido_broker::Capacity::BytesPerSec(FAIR_CAPACITY),
                    work_conserving: false,
                    ..Default::default()
                },
            )?),
            _ => None,
        };
        let broker_path = capped
            .as_ref()
            .map_or(cx.broker.socket(), |b| b.socket())
            .to_path_buf();
        let t0 = crate::mono_ns() + 300_000_000;
        let mut kids = Vec::new();
        let mut sinks = Vec::new();
        for i in 0..3 {
            let s = sink()?;
            let start_ns = t0 + (plan.starts[i] * 1e9) as u64;
            let end_ns = t0 + (plan.ends[i] * 1e9) as u64;
            let args = vec![
                "__pipe-role".to_string(),
                "stream".into(),
                format!("mode={}", mode.system()),
                format!("src={}", file.display()),
                format!("out={}", s.addr),
                format!("weight={}", WEIGHTS[i]),
                format!("start_ns={start_ns}"),
                format!("end_ns={end_ns}"),
            ];
            kids.push(cx.spawn_on_app_with(&args, &broker_path)?);
            sinks.push(s);
        }
        let deadline = Instant::now() + Duration::from_secs_f64(plan.ends[0] + 120.0);
        let mut series: Vec<Series> = Vec::new();
        for k in kids.iter_mut() {
            let v = k.expect_event("done", deadline)?;
            let s: Series = serde_json::from_value(v["samples"].clone()).context("samples")?;
            series.push(s);
        }
        proc::finish_all(kids, Duration::from_secs(30))?;
        for s in sinks {
            join_end(s)?;
        }
        // Shares over the time all three ran, a margin cut at both ends.
        let margin = (plan.bin * 2.0 * 1e9) as u64;
        let a = t0 + (plan.starts[2] * 1e9) as u64 + margin;
        let b = t0 + (plan.ends[2] * 1e9) as u64 - margin;
        let moved: Vec<f64> = series
            .iter()
            .map(|s| (cum_at(s, b) - cum_at(s, a)) as f64)
            .collect();
        let total: f64 = moved.iter().sum();
        if total <= 0.0 {
            bail!(
                "{case} {}: nothing moved while all three clients ran",
                mode.system()
            );
        }
        let secs = (b - a) as f64 / 1e9;
        for i in 0..3 {
            let c = format!("{case}-c{}-w{}", i + 1, WEIGHTS[i]);
            out.push(record(
                &c,
                mode.system(),
                "share",
                moved[i] / total,
                "",
                moved[i] as u64,
            ));
            out.push(record(
                &c,
                mode.system(),
                "bytes_per_s",
                moved[i] / secs,
                "B/s",
                moved[i] as u64,
            ));
        }
        let x: Vec<f64> = (0..3).map(|i| moved[i] / WEIGHTS[i] as f64).collect();
        let jain = x.iter().sum::<f64>().powi(2) / (3.0 * x.iter().map(|v| v * v).sum::<f64>());
        out.push(record(case, mode.system(), "jain_weighted", jain, "", 3));
        out.push(record(
            case,
            mode.system(),
            "bytes_per_s",
            total / secs,
            "B/s",
            total as u64,
        ));
        let arr: [Series; 3] = series
            .try_into()
            .map_err(|_| anyhow::anyhow!("three series"))?;
        panels.push((mode.system().to_string(), arr, (t0 as f64) / 1e9));
        if mode == Strategy::Fido && jain < 0.99 {
            eprintln!("# fairness-1-1-2: fido-pipe weighted Jain index {jain:.3} < 0.99");
        }
        ok &= jain.is_finite();
    }
    if let (Some(p), false) = (&o.plot, panels.is_empty()) {
        plot(p, &panels, &plan).with_context(|| format!("plotting {}", p.display()))?;
        println!("# fairness plot: {}", p.display());
    }
    Ok(ok)
}

/// Cumulative bytes at `t` (the last sample at or before it).
fn cum_at(s: &Series, t: u64) -> u64 {
    match s.partition_point(|(ts, _)| *ts <= t) {
        0 => 0,
        i => s[i - 1].1,
    }
}

/// `__pipe-role stream`: file→socket in 1 MiB pieces from `start_ns` to
/// `end_ns`, with this domain's weight; reports every piece's completion.
fn role_stream(a: &PeerArgs) -> anyhow::Result<()> {
    let mode = strategy(a.get("mode")?)?;
    let weight: u32 = a.num("weight")?;
    let start_ns: u64 = a.num("start_ns")?;
    let end_ns: u64 = a.num("end_ns")?;
    let m = match mode {
        Strategy::Fido => engine::mover_weighted(weight)?,
        _ => mode.mover()?,
    };
    let f = File::open(a.get("src")?)?;
    let size = f.metadata()?.len();
    let s = TcpStream::connect(a.get("out")?)?;
    const PIECE: u64 = 1 << 20;
    let now = crate::mono_ns();
    if start_ns > now {
        std::thread::sleep(Duration::from_nanos(start_ns - now));
    }
    let mut samples: Series = vec![(crate::mono_ns(), 0)];
    let mut off = 0u64;
    let mut cum = 0u64;
    while crate::mono_ns() < end_ns {
        if off + PIECE > size {
            off = 0;
        }
        let n = m.file_to_socket(f.as_fd(), off, PIECE, s.as_fd())?;
        if n == 0 {
            bail!("file ended at {off}");
        }
        off += n;
        cum += n;
        samples.push((crate::mono_ns(), cum));
    }
    s.shutdown(Shutdown::Write)?;
    emit(json!({"event": "done", "samples": samples}))
}

/// Per-client throughput over time, one panel per system.
fn plot(path: &Path, panels: &[(String, [Series; 3], f64)], plan: &FairPlan) -> anyhow::Result<()> {
    use plotters::prelude::*;
    let font = load_font();
    let h = 360 * panels.len() as u32;
    let root = BitMapBackend::new(path, (1000, h)).into_drawing_area();
    root.fill(&WHITE)?;
    let areas = root.split_evenly((panels.len(), 1));
    let total = plan.ends[0];
    let colors = [
        RGBColor(31, 119, 180),
        RGBColor(255, 127, 14),
        RGBColor(44, 160, 44),
    ];
    for ((name, series, t0), area) in panels.iter().zip(areas.iter()) {
        let t0_ns = (t0 * 1e9) as u64;
        let rates: Vec<Vec<(f64, f64)>> = series
            .iter()
            .map(|s| {
                let mut v = Vec::new();
                let mut t = 0.0;
                while t + plan.bin <= total + 1e-9 {
                    let a = t0_ns + (t * 1e9) as u64;
                    let b = t0_ns + ((t + plan.bin) * 1e9) as u64;
                    let mb = (cum_at(s, b) - cum_at(s, a)) as f64 / 1e6 / plan.bin;
                    v.push((t + plan.bin / 2.0, mb));
                    t += plan.bin;
                }
                v
            })
            .collect();
        let ymax = rates.iter().flatten().map(|p| p.1).fold(1.0f64, f64::max) * 1.1;
        let mut b = ChartBuilder::on(area);
        b.margin(12);
        if font {
            b.caption(
                format!("{name}: file→socket, weights 1:1:2"),
                ("sans-serif", 20),
            )
            .x_label_area_size(36)
            .y_label_area_size(64);
        }
        let mut chart = b.build_cartesian_2d(0.0..total, 0.0..ymax)?;
        if font {
            chart
                .configure_mesh()
                .x_desc("seconds")
                .y_desc("MB/s")
                .draw()?;
        } else {
            chart
                .configure_mesh()
                .disable_x_mesh()
                .disable_y_mesh()
                .draw()?;
        }
        for (i, r) in rates.iter().enumerate() {
            let c = colors[i];
            let s = chart.draw_series(LineSeries::new(r.clone(), c.stroke_width(2)))?;
            if font {
                s.label(format!("client {} (w={})", i + 1, WEIGHTS[i]))
                    .legend(move |(x, y)| {
                        PathElement::new(vec![(x, y), (x + 20, y)], c.stroke_width(2))
                    });
            }
        }
        if font {
            chart
                .configure_series_labels()
                .background_style(WHITE.mix(0.8))
                .border_style(BLACK)
                .draw()?;
        }
    }
    root.present()?;
    Ok(())
}

/// Registers a system TrueType font for the plot's text; `false` (the plot is
/// drawn without text) if none is installed.
fn load_font() -> bool {
    use std::sync::OnceLock;
    static DONE: OnceLock<bool> = OnceLock::new();
    *DONE.get_or_init(|| {
        for p in [
            "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf",
            "/usr/share/fonts/truetype/liberation/LiberationSans-Regular.ttf",
            "/usr/share/fonts/TTF/DejaVuSans.ttf",
        ] {
            if let Ok(bytes) = std::fs::read(p) {
                let bytes: &'static [u8] = Box::leak(bytes.into_boxed_slice());
                if plotters::style::register_font(
                    "sans-serif",
                    plotters::style::FontStyle::Normal,
                    bytes,
                )
                .is_ok()
                {
                    return true;
                }
            }
        }
        false
    })
}

// ---------------------------------------------------------------------------------------
// vPipe's web-server and load-balancer experiment, with wrk
// ---------------------------------------------------------------------------------------

/// A process that is not `fido` (nginx), stopped gracefully (SIGTERM to the
/// master, which stops its workers) and reaped on drop.
struct Daemon {
    child: Option<Child>,
}

impl Drop for Daemon {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            if let Some(pid) = rustix::process::Pid::from_raw(c.id() as i32) {
                let _ = rustix::process::kill_process(pid, rustix::process::Signal::TERM);
            }
            let t = Instant::now();
            while t.elapsed() < Duration::from_secs(5) {
                if let Ok(Some(_)) = c.try_wait() {
                    return;
                }
                std::thread::sleep(Duration::from_millis(10));
            }
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

fn have(prog: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .chain([PathBuf::from("/usr/sbin"), PathBuf::from("/sbin")])
        .map(|d| d.join(prog))
        .find(|p| p.is_file())
}

fn free_port() -> anyhow::Result<u16> {
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

fn wait_port(addr: SocketAddr, deadline: Instant) -> anyhow::Result<()> {
    loop {
        if TcpStream::connect_timeout(&addr, Duration::from_millis(200)).is_ok() {
            return Ok(());
        }
        if Instant::now() > deadline {
            bail!("nothing listens on {addr}");
        }
        proc::check_interrupt()?;
        std::thread::sleep(Duration::from_millis(20));
    }
}

const STREAM_MODULE: &str = "/usr/lib/nginx/modules/ngx_stream_module.so";

/// Starts nginx (one worker, sendfile on, logs off) on `port`, either serving
/// `www` or (`upstream` given) as a TCP proxy with its stream module.
fn nginx(
    nginx: &Path,
    dir: &Path,
    tag: &str,
    port: u16,
    www: &Path,
    upstream: Option<SocketAddr>,
) -> anyhow::Result<Daemon> {
    let d = dir.join(format!("nginx-{tag}"));
    std::fs::create_dir_all(d.join("tmp"))?;
    let root_user = if rustix::process::geteuid().is_root() {
        "user root;\n"
    } else {
        ""
    };
    let body = match upstream {
        None => format!(
            "http {{\n access_log off;\n sendfile on;\n tcp_nopush on;\n tcp_nodelay on;\n \
             keepalive_requests 1000000;\n keepalive_timeout 65;\n default_type application/octet-stream;\n \
             client_body_temp_path {t}/body;\n proxy_temp_path {t}/proxy;\n fastcgi_temp_path {t}/fcgi;\n \
             uwsgi_temp_path {t}/uwsgi;\n scgi_temp_path {t}/scgi;\n \
             server {{\n  listen 127.0.0.1:{port};\n  root {www};\n  location / {{ }}\n }}\n}}\n",
            t = d.join("tmp").display(),
            www = www.display()
        ),
        Some(up) => format!(
            "stream {{\n server {{\n  listen 127.0.0.1:{port};\n  proxy_pass {up};\n }}\n}}\n"
        ),
    };
    let load = if upstream.is_some() {
        format!("load_module {STREAM_MODULE};\n")
    } else {
        String::new()
    };
    let conf = format!(
        "{load}{root_user}daemon off;\nmaster_process on;\nworker_processes 1;\npid {pid};\nerror_log {err} warn;\n\
         events {{ worker_connections 4096; }}\n{body}",
        pid = d.join("nginx.pid").display(),
        err = d.join("error.log").display(),
    );
    let cf = d.join("nginx.conf");
    std::fs::write(&cf, conf)?;
    let child = Command::new(nginx)
        .arg("-p")
        .arg(&d)
        .arg("-e")
        .arg(d.join("error.log"))
        .arg("-c")
        .arg(&cf)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .spawn()
        .context("starting nginx")?;
    let dm = Daemon { child: Some(child) };
    wait_port(
        SocketAddr::from(([127, 0, 0, 1], port)),
        Instant::now() + Duration::from_secs(20),
    )
    .with_context(|| format!("nginx ({})", d.join("error.log").display()))?;
    Ok(dm)
}

/// Runs wrk against `url` (on the caller's CPU); returns requests/s.
fn wrk(wrk: &Path, url: &str, secs: u64) -> anyhow::Result<(f64, u64)> {
    let out = Command::new(wrk)
        .args(["-t1", "-c8", &format!("-d{secs}s"), "--timeout", "10s", url])
        .stdin(Stdio::null())
        .stderr(Stdio::inherit())
        .output()
        .context("running wrk")?;
    let text = String::from_utf8_lossy(&out.stdout);
    if !out.status.success() {
        bail!("wrk failed: {text}");
    }
    if text.contains("Non-2xx") || text.contains("Socket errors") {
        bail!("wrk saw errors against {url}:\n{text}");
    }
    let rps = text
        .lines()
        .find_map(|l| l.trim().strip_prefix("Requests/sec:"))
        .and_then(|v| v.trim().parse::<f64>().ok())
        .with_context(|| format!("no Requests/sec in wrk output:\n{text}"))?;
    let n = text
        .lines()
        .find_map(|l| {
            l.split_once(" requests in ")
                .map(|(a, _)| a.trim().to_string())
        })
        .and_then(|v| v.parse::<u64>().ok())
        .unwrap_or(0);
    Ok((rps, n))
}

const WEB_FILE: u64 = 1 << 20;

fn web(cx: &Ctx, o: &PipeBenchOpts, out: &mut Vec<Record>) -> anyhow::Result<()> {
    let cases = [
        "serve-wrk",
        "serve-wrk-busy0",
        "proxy-wrk",
        "proxy-wrk-busy0",
    ];
    let systems = ["fido-pipe", "sendfile", "readwrite", "nginx"];
    if !cases.iter().any(|c| systems.iter().any(|s| o.wants(s, c))) {
        return Ok(());
    }
    let Some(wrk_bin) = have("wrk") else {
        eprintln!("# serve-wrk / proxy-wrk skipped: wrk is not installed (apt-get install wrk)");
        return Ok(());
    };
    let nginx_bin = have("nginx");
    if nginx_bin.is_none() {
        eprintln!("# nginx points skipped: nginx is not installed (apt-get install nginx-light)");
    }
    let www = cx.dir.path().join("www");
    std::fs::create_dir_all(&www)?;
    make_file(&www.join("f1m.bin"), WEB_FILE)?;
    let secs = if cx.quick { 1 } else { 5 };
    for case in cases {
        let busy = if case.ends_with("busy0") { 0 } else { 2 };
        let proxy = case.starts_with("proxy");
        // The proxy's upstream: nginx (or our sendfile server) on CPU B.
        let mut _upstream_keep: (Option<Daemon>, Option<Kid>) = (None, None);
        let mut upstream_addr = None;
        for sys in systems {
            if !o.wants(sys, case) {
                continue;
            }
            let strat = match sys {
                "nginx" => None,
                s => match strategy(s) {
                    Ok(st) if cx.modes.contains(&st) => Some(st),
                    _ => continue,
                },
            };
            if strat.is_none()
                && (nginx_bin.is_none() || (proxy && !Path::new(STREAM_MODULE).exists()))
            {
                if proxy && nginx_bin.is_some() {
                    eprintln!("# proxy-wrk nginx skipped: no {STREAM_MODULE} (apt-get install libnginx-mod-stream)");
                }
                continue;
            }
            proc::check_interrupt()?;
            if proxy && upstream_addr.is_none() {
                let up = start_upstream(cx, nginx_bin.as_deref(), &www)?;
                upstream_addr = Some(up.0);
                _upstream_keep = (up.1, up.2);
            }
            let _busy = cx.busy(busy)?;
            let (addr, _keep_d, _keep_k) = match (strat, proxy) {
                (Some(st), false) => {
                    let mut k = cx.spawn_on_app(&[
                        "__pipe-app".into(),
                        "serve".into(),
                        www.display().to_string(),
                        "--port".into(),
                        "0".into(),
                        "--strategy".into(),
                        cli_name(st).into(),
                    ])?;
                    let addr = announced_addr(&mut k)?;
                    (addr, None, Some(k))
                }
                (Some(st), true) => {
                    let up = upstream_addr.expect("started above");
                    let mut k = cx.spawn_on_app(&[
                        "__pipe-app".into(),
                        "proxy".into(),
                        "127.0.0.1:0".into(),
                        up.to_string(),
                        "--strategy".into(),
                        cli_name(st).into(),
                    ])?;
                    let addr = announced_addr(&mut k)?;
                    (addr, None, Some(k))
                }
                (None, p) => {
                    let port = free_port()?;
                    let _g = PinGuard::pin(cx.app_cpu)?;
                    let d = nginx(
                        nginx_bin.as_deref().expect("checked"),
                        cx.dir.path(),
                        case,
                        port,
                        &www,
                        if p { upstream_addr } else { None },
                    )?;
                    (SocketAddr::from(([127, 0, 0, 1], port)), Some(d), None)
                }
            };
            let url = format!("http://{addr}/f1m.bin");
            check_get(addr)?;
            let (rps, n) = wrk(&wrk_bin, &url, secs).with_context(|| format!("{case} {sys}"))?;
            out.push(record(case, sys, "requests_per_s", rps, "req/s", n));
            out.push(record(
                case,
                sys,
                "bytes_per_s",
                rps * WEB_FILE as f64,
                "B/s",
                n,
            ));
        }
    }
    Ok(())
}

fn cli_name(s: Strategy) -> &'static str {
    match s {
        Strategy::Fido => "fido",
        Strategy::Sendfile => "sendfile",
        Strategy::Readwrite => "readwrite",
    }
}

/// One GET of the benchmark file through `addr`, checked (status and length),
/// so wrk never measures a server answering errors quickly.
fn check_get(addr: SocketAddr) -> anyhow::Result<()> {
    use std::io::Read as _;
    let mut s = TcpStream::connect(addr)?;
    s.set_read_timeout(Some(Duration::from_secs(20)))?;
    s.write_all(b"GET /f1m.bin HTTP/1.1\r\nHost: bench\r\nConnection: close\r\n\r\n")?;
    let mut buf = Vec::new();
    s.read_to_end(&mut buf)?;
    let head_end = buf
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .context("no response head")?;
    let head = String::from_utf8_lossy(&buf[..head_end]);
    if !head.starts_with("HTTP/1.1 200") || (buf.len() - head_end - 4) as u64 != WEB_FILE {
        bail!(
            "bad response from {addr}: {head} with {} body bytes",
            buf.len() - head_end - 4
        );
    }
    Ok(())
}

/// Starts the proxy experiments' upstream on CPU B: nginx if installed, else
/// our own server with sendfile.
fn start_upstream(
    cx: &Ctx,
    nginx_bin: Option<&Path>,
    www: &Path,
) -> anyhow::Result<(SocketAddr, Option<Daemon>, Option<Kid>)> {
    if let Some(n) = nginx_bin {
        let port = free_port()?;
        let d = nginx(n, cx.dir.path(), "upstream", port, www, None)?;
        return Ok((SocketAddr::from(([127, 0, 0, 1], port)), Some(d), None));
    }
    let mut k = Kid::spawn(
        &[
            "__pipe-app".into(),
            "serve".into(),
            www.display().to_string(),
            "--port".into(),
            "0".into(),
            "--strategy".into(),
            "sendfile".into(),
        ],
        cx.broker.socket(),
    )?;
    let a = announced_addr(&mut k)?;
    Ok((a, None, Some(k)))
}

/// The address in `__pipe-app serve|proxy`'s first stdout line.
fn announced_addr(k: &mut Kid) -> anyhow::Result<SocketAddr> {
    let line = k.next_line(Instant::now() + Duration::from_secs(20))?;
    let tok = line
        .split_whitespace()
        .find_map(|w| {
            let w = w.trim_start_matches("http://").trim_end_matches('/');
            w.parse::<SocketAddr>().ok()
        })
        .with_context(|| format!("no address in `{line}`"))?;
    Ok(tok)
}

// ---------------------------------------------------------------------------------------
// Roles
// ---------------------------------------------------------------------------------------

/// `fido-bench __pipe-role <role> key=value...`.
pub fn role_main(args: &[String]) -> anyhow::Result<()> {
    proc::child_prologue()?;
    let role = args.first().map(|s| s.as_str()).unwrap_or("");
    let a = PeerArgs::parse(&args[1.min(args.len())..]);
    match role {
        "busy" => {
            emit(json!({"event": "ready"}))?;
            let mut x = 0u64;
            loop {
                x = std::hint::black_box(x.wrapping_mul(6364136223846793005).wrapping_add(1));
            }
        }
        "app" => role_app(&a),
        "stream" => role_stream(&a),
        r => bail!("unknown role {r:?}"),
    }
}

/// `fido-bench __pipe-app serve DIR --port P --strategy S` and `__pipe-app proxy
/// LISTEN UPSTREAM --strategy S`: the programs `fido pipe serve` and `fido pipe
/// proxy` run, with their defaults (127.0.0.1, 60 s idle timeout, 1024
/// connections), from the same library; the first stdout line announces the
/// address.
pub fn app_main(args: &[String]) -> anyhow::Result<()> {
    use fido_pipe_apps::{proxy, serve};
    let mut positional = Vec::new();
    let (mut port, mut strat) = (0u16, Strategy::Fido);
    let mut it = args.iter();
    while let Some(a) = it.next() {
        match a.as_str() {
            "--port" => port = it.next().context("--port P")?.parse()?,
            "--strategy" => {
                strat = it
                    .next()
                    .context("--strategy S")?
                    .parse()
                    .map_err(|e: String| anyhow::anyhow!(e))?
            }
            _ => positional.push(a.as_str()),
        }
    }
    let idle = Duration::from_secs(60);
    let announce = |line: String| -> anyhow::Result<()> {
        let mut out = std::io::stdout().lock();
        writeln!(out, "{line}")?;
        out.flush()?;
        Ok(())
    };
    match positional.as_slice() {
        ["serve", dir] => {
            let m = match strat {
                Strategy::Fido => engine::mover_with_stall(idle)?,
                s => s.mover()?,
            };
            let cfg = serve::ServeConfig {
                idle_timeout: idle,
                ..serve::ServeConfig::new(PathBuf::from(dir))
            };
            let srv = serve::Server::bind(SocketAddr::from(([127, 0, 0, 1], port)), cfg, m)?;
            announce(format!("serving on http://{}/ ({})", srv.local_addr()?, strat.system()))?;
            Ok(srv.run()?)
        }
        ["proxy", listen, upstream] => {
            let p = proxy::Proxy::bind(listen, upstream, strat.mover()?)?;
            announce(format!("proxying {} -> {upstream} ({})", p.local_addr()?, strat.system()))?;
            Ok(p.run()?)
        }
        _ => bail!("usage: __pipe-app serve DIR [--port P] [--strategy S] | proxy LISTEN UPSTREAM [--strategy S]"),
    }
}
