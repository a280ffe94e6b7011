//! `fido-bench channel`: Fido's own cases (system `fido`), measured across
//! processes exactly as the baselines of `crate::channel_baselines` are,
//! then the baselines themselves in the same invocation.
//!
//! Every fido case runs against an embedded broker in a temporary directory.
//! The measuring parent is a domain; its peer is this binary re-executed as
//! `fido-bench __bench-peer fido <kind> key=value...` (a separate domain, pinned to
//! the second CPU of our affinity mask; the parent pins itself to the first,
//! like the baselines — see `crate::Placement`).
//!
//! * `latency-{polled,notified}-<size>`: ping-pong; each iteration the parent
//!   **allocates a fresh buffer in its arena** (allocation is part of the cost),
//!   writes every byte, sends; the peer folds every byte, releases it,
//!   allocates and fills a reply; one-way = RTT/2. Polled: both sides
//!   `WaitStrategy::BusyPoll`; notified: `WaitStrategy::Block`; adaptive: the
//!   default (`WaitStrategy::default()`, what a user gets). Each latency case
//!   also reports `cpu_ns_per_msg`: both processes' CPU time over the measured
//!   window (scheduler accounting, every thread of the peer, the measuring
//!   thread of the parent) per message, two messages per round trip.
//! * `throughput-<size>-{touch,notouch}`: the peer streams (adaptive wait, one
//!   fresh buffer per message), the parent receives for the measured window.
//!   `touch`: the sender writes every byte of every message, the receiver
//!   folds every byte. `notouch`: as the uds sender, which writes its buffer
//!   once and then only hands it to the kernel, the sender writes only the
//!   8-byte sequence number, and the receiver reads only that (no payload pass).
//!   With zero copy nobody else moves the bytes either, so the fido `-notouch`
//!   figure is messages/s × size: a descriptor rate, said so under the table.
//! * `pipeline-<n>hop`: 1 MiB messages through n links (n+1 processes,
//!   unpinned), see [`fido_demo::pipeline`]; bytes/s at the sink, source→sink
//!   latency under load, and `bytes_copied` summed over every domain (0).
//! * `doorbells-64B`: the parent streams 64-byte messages to a peer that folds
//!   them; doorbells the sender rang per message sent (notification
//!   suppression at work), from the sender domain's counters.
//! * `software-inline-8B`: Fido's own cost of a message and nothing else —
//!   one thread, two domains of this process, ping-pong of 8-byte inline
//!   messages (`Message::inline`) on a polled channel: send, receive,
//!   release and collect the release, both ways, with no other CPU and no
//!   cache line crossing one. one-way = RTT/2, as above. A regression
//!   guard for the code path; the cross-CPU cases add the transfers.

use std::time::{Duration, Instant};

use anyhow::{bail, Context as _};
use fido::{Domain, JoinOptions, Message, WaitStrategy};
use crate::{fill, latency_record, size_label, Opts, PinGuard, Placement, Record};
use serde_json::json;

use fido_demo::pipeline::{self, emit, Args};
use fido_demo::proc::{self, EmbeddedBroker, Kid};

const SYSTEM: &str = "fido";
const ENTRIES: u32 = 64;
const ARENA: u64 = 256 << 20;
const READY: Duration = Duration::from_secs(20);

/// `fido-bench channel`.
pub fn run(opts: &Opts) -> anyhow::Result<()> {
    proc::install_interrupt_flag()?;
    let t = Instant::now();
    let mut records = fido_cases(opts)?;
    proc::check_interrupt()?;
    records.extend(crate::channel_baselines(opts)?);
    proc::check_interrupt()?;
    crate::print_table(&records);
    if records.iter().any(|r| r.system == SYSTEM) {
        println!(
            "# fido: one fresh arena buffer per message (allocation included); ring {ENTRIES} entries; embedded broker.\n\
             # fido throughput-*-notouch: as defined for every system, neither application touches the payload; with \
             zero copy nothing else does either,\n\
             #   so the figure is messages/s x size (uds -notouch still copies every byte twice in the kernel)."
        );
    }
    println!(
        "# baselines, each as a competent user would write it, pinned like fido (parent CPU / peer CPU above):\n\
         #   uds: AF_UNIX SOCK_STREAM socketpair, blocking send(MSG_NOSIGNAL)/read_exact of the whole message, one \
         buffer per side reused;\n\
         #   tcp: loopback TCP, TCP_NODELAY both ends, otherwise as uds; eventfd-floor: shared memfd + one blocking \
         eventfd per direction (read/write);\n\
         #   spin-floor: shared memfd, both sides spin on one cache line; iceoryx2: ipc pub-sub, polling; \
         ucx-posix: ucx_perftest am_lat / ucp_am_lat over the posix transport (bench/src/ucx.rs), polling.\n\
         # latency-adaptive-*: each system's default (fido WaitStrategy::default(); the sockets and the eventfd \
         block; the spin floor spins); cpu_ns_per_msg = both processes' CPU time in the measured window / messages."
    );
    eprintln!(
        "({} records in {:.1} s)",
        records.len(),
        t.elapsed().as_secs_f64()
    );
    if let Some(p) = &opts.json {
        crate::write_json(p, &records)?;
    }
    Ok(())
}

fn wait_name(w: WaitStrategy) -> &'static str {
    match w {
        WaitStrategy::BusyPoll => "poll",
        WaitStrategy::Block => "block",
        WaitStrategy::Adaptive { .. } => "adaptive",
    }
}

fn parse_wait(s: &str) -> anyhow::Result<WaitStrategy> {
    Ok(match s {
        "poll" => WaitStrategy::BusyPoll,
        "block" => WaitStrategy::Block,
        "adaptive" => WaitStrategy::default(),
        o => bail!("unknown wait strategy {o}"),
    })
}

type Case<'a> = (
    String,
    Box<dyn FnOnce(&Ctx) -> anyhow::Result<Vec<Record>> + 'a>,
);

/// Runs the fido cases the filter wants. A failing case is reported on stderr
/// and skipped, as the baselines do.
pub fn fido_cases(opts: &Opts) -> anyhow::Result<Vec<Record>> {
    let mut cases: Vec<Case> = Vec::new();
    for (wait, kind) in [
        (WaitStrategy::BusyPoll, "polled"),
        (WaitStrategy::Block, "notified"),
        (WaitStrategy::default(), "adaptive"),
    ] {
        for &size in &crate::LATENCY_SIZES {
            let case = format!("latency-{kind}-{}", size_label(size));
            let c2 = case.clone();
            cases.push((
                case,
                Box::new(move |ctx: &Ctx| {
                    let (rtts, cpu) = ctx.latency(size, wait)?;
                    let n = rtts.len();
                    Ok(vec![
                        latency_record(SYSTEM, &c2, rtts),
                        crate::cpu_record("channel", SYSTEM, &c2, &cpu, n),
                    ])
                }),
            ));
        }
    }
    for &size in &crate::THROUGHPUT_SIZES {
        for touch in [true, false] {
            let case = format!(
                "throughput-{}-{}",
                size_label(size),
                if touch { "touch" } else { "notouch" }
            );
            let c2 = case.clone();
            cases.push((
                case,
                Box::new(move |ctx: &Ctx| {
                    let (bps, n) = ctx.throughput(size, touch)?;
                    Ok(vec![Record::throughput("channel", &c2, SYSTEM, bps, n)])
                }),
            ));
        }
    }
    for hops in 1..=4usize {
        let case = format!("pipeline-{hops}hop");
        let c2 = case.clone();
        cases.push((case, Box::new(move |ctx: &Ctx| ctx.pipeline(&c2, hops))));
    }
    let case = "doorbells-64B".to_string();
    cases.push((
        case.clone(),
        Box::new(move |ctx: &Ctx| ctx.doorbells(&case, 64)),
    ));
    let case = "software-inline-8B".to_string();
    cases.push((
        case.clone(),
        Box::new(move |ctx: &Ctx| Ok(vec![latency_record(SYSTEM, &case, ctx.software()?)])),
    ));

    cases.retain(|(c, _)| opts.wants(SYSTEM, c));
    if cases.is_empty() {
        return Ok(Vec::new());
    }
    let broker = EmbeddedBroker::start("fido-bench-")?;
    // One parent domain for every case: a process can place only one domain in
    // the PGVAS window at a time (a second one would fall back to swizzling).
    let domain = Domain::join(
        JoinOptions::new("bench-parent")
            .broker(broker.socket())
            .arena_len(ARENA)
            .ring_entries(ENTRIES),
    )
    .context("joining the embedded broker")?;
    let ctx = Ctx {
        opts: opts.clone(),
        broker: broker.socket().to_path_buf(),
        d: domain,
    };
    let mut out = Vec::new();
    for (case, f) in cases {
        proc::check_interrupt()?;
        match f(&ctx) {
            Ok(r) => out.extend(r),
            Err(e) => {
                proc::check_interrupt()?;
                eprintln!("bench: {SYSTEM} {case} failed: {e:#}");
            }
        }
    }
    // Dropped rather than `leave()`d: `Domain::leave` races with the domain's
    // control thread, which can see the broker close the connection before
    // the stop flag is set, log "lost the broker" and re-register the domain.
    // The control thread holds the domain for up to half a heartbeat (250 ms
    // by default) after the last handle is gone; stopping the broker inside
    // that window would leave it reconnecting for the rest of the process.
    drop(ctx);
    std::thread::sleep(Duration::from_millis(400));
    broker.stop()?;
    Ok(out)
}

struct Ctx {
    opts: Opts,
    broker: std::path::PathBuf,
    /// The measuring parent's domain.
    d: Domain,
}

fn peer_args(kind: &str, kv: &[String]) -> Vec<String> {
    let mut v = vec!["__bench-peer".to_string(), "fido".into(), kind.into()];
    v.extend(kv.iter().cloned());
    v
}

static SERVICE: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

fn service(kind: &str) -> String {
    format!(
        "bench-{kind}-{}-{}",
        std::process::id(),
        SERVICE.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
    )
}

fn is_end(e: &fido::Error) -> bool {
    matches!(e, fido::Error::Closed | fido::Error::PeerGone { .. })
}

fn msg_bytes(m: &fido::Msg) -> anyhow::Result<fido::PeerSlice<'_>> {
    m.as_slice()
        .with_context(|| format!("expected one segment, got {}", m.segment_count()))
}

/// [`fido_bench::fold`] over a received message, read in place through its view: folds
/// every byte (as u64 words) and returns the sequence number carried in the
/// first 8 bytes (0 if the message is shorter).
fn fold_view(v: fido::PeerSlice<'_>) -> u64 {
    std::hint::black_box(v.fold_u64(0u64, |acc, w| acc.wrapping_add(w).rotate_left(1)));
    v.read_obj::<[u8; 8]>(0).map_or(0, u64::from_le_bytes)
}

impl Ctx {
    fn spawn(&self, kind: &str, kv: &[String]) -> anyhow::Result<Kid> {
        let mut k = Kid::spawn(&peer_args(kind, kv), &self.broker)?;
        k.expect_event("ready", Instant::now() + READY)?;
        Ok(k)
    }

    /// One-thread ping-pong of inline messages between our domain and a
    /// second one of this process; returns round-trip samples.
    fn software(&self) -> anyhow::Result<Vec<u64>> {
        let other = Domain::join(
            JoinOptions::new("bench-software")
                .broker(&self.broker)
                .arena_len(16 << 20)
                .ring_entries(ENTRIES)
                // The PGVAS window is taken by our first domain; say so
                // rather than have the join try and warn. Inline messages
                // carry no pointers to translate.
                .swizzle(true),
        )
        .context("joining a second domain")?;
        let svc = service("software");
        let listener = other.offer(&svc)?;
        let a = self.d.connect(&svc)?;
        let b = listener.accept_timeout(READY)?;
        a.set_wait(WaitStrategy::BusyPoll);
        b.set_wait(WaitStrategy::BusyPoll);
        let place = Placement::detect();
        let rtts = {
            let _pin = PinGuard::pin(place.parent)?;
            crate::time_round_trips(self.opts.warmup(), self.opts.duration(), |k| {
                a.send(Message::inline(&k.to_ne_bytes())?.tag(k))?;
                let m = b.recv()?;
                b.send(Message::inline(m.inline_bytes().unwrap_or_default())?.tag(m.tag()))?;
                drop(m);
                let r = a.recv()?;
                let got = r.inline_bytes().and_then(|b| b.try_into().ok()).map(u64::from_ne_bytes);
                if r.tag() != k || got != Some(k) {
                    bail!("reply {} carried {got:?}, expected {k}", r.tag());
                }
                Ok(())
            })?
        };
        drop((a, b, listener));
        drop(other);
        Ok(rtts)
    }

    /// Ping-pong; returns round-trip samples and both sides' CPU time over the
    /// measured window.
    fn latency(&self, size: usize, wait: WaitStrategy) -> anyhow::Result<(Vec<u64>, crate::CpuUse)> {
        let place = Placement::detect();
        let svc = service("echo");
        let kid = self.spawn(
            "echo",
            &[
                format!("svc={svc}"),
                format!("size={size}"),
                format!("wait={}", wait_name(wait)),
                format!("cpu={}", place.peer),
            ],
        )?;
        let d = &self.d;
        let ch = d.connect(&svc)?;
        ch.set_wait(wait);
        let rtts = {
            let _pin = PinGuard::pin(place.parent)?;
            crate::time_round_trips_cpu(self.opts.warmup(), self.opts.duration(), Some(kid.pid()), |k| {
                let mut b = d.alloc(size)?;
                fill(&mut b, k);
                ch.send(b)?;
                let m = ch.recv()?;
                let got = fold_view(msg_bytes(&m)?);
                if size >= 8 && got != k {
                    bail!("echo carried {got}, expected {k}");
                }
                Ok(())
            })?
        };
        // Collect the last releases so the channel does not linger in the domain.
        pipeline::drain(&ch, Duration::from_secs(5))?;
        drop(ch);
        kid.finish(Duration::from_secs(10))?;
        Ok(rtts)
    }

    /// The peer streams, we receive: (bytes/s over the window, messages).
    fn throughput(&self, size: usize, touch: bool) -> anyhow::Result<(f64, u64)> {
        let place = Placement::detect();
        let svc = service("stream");
        let kid = self.spawn(
            "stream",
            &[
                format!("svc={svc}"),
                format!("size={size}"),
                format!("touch={}", touch as u8),
                format!("cpu={}", place.peer),
            ],
        )?;
        let ch = self.d.connect(&svc)?;
        ch.set_wait(WaitStrategy::default());
        let mut expect = 1u64;
        let mut recv = || -> anyhow::Result<()> {
            let m = ch.recv()?;
            let b = msg_bytes(&m)?;
            let seq = if touch {
                fold_view(b)
            } else {
                u64::from_le_bytes(b.read_obj(0).context("message shorter than 8 bytes")?)
            };
            if seq != expect {
                bail!("stream carried sequence {seq}, expected {expect}");
            }
            expect += 1;
            Ok(())
        };
        let (n, elapsed) = {
            let _pin = PinGuard::pin(place.parent)?;
            let warm = Instant::now();
            while warm.elapsed() < self.opts.warmup() {
                recv()?;
            }
            let start = Instant::now();
            let mut n = 0u64;
            let elapsed = loop {
                recv()?;
                n += 1;
                let e = start.elapsed();
                if e >= self.opts.duration() {
                    break e;
                }
            };
            (n, elapsed)
        };
        drop(ch);
        kid.finish(Duration::from_secs(10))?;
        Ok(((n * size as u64) as f64 / elapsed.as_secs_f64(), n))
    }

    fn pipeline(&self, case: &str, hops: usize) -> anyhow::Result<Vec<Record>> {
        let dur = self.opts.duration();
        let spec = pipeline::Spec {
            links: hops,
            size: 1 << 20,
            // The same warm-up as the uds pipeline baseline.
            warmup: (dur / 4).min(Duration::from_millis(500)),
            duration: dur,
            ring_entries: ENTRIES,
            launcher: vec!["__bench-peer".into(), "fido".into(), "pipe".into()],
            prefix: "bench".into(),
        };
        let out = pipeline::launch(&spec, &self.broker)?;
        if !out.all_ok() {
            let failed: Vec<String> = out
                .checks()
                .into_iter()
                .filter(|(_, ok, _)| !ok)
                .map(|(w, _, d)| format!("{w}: {d}"))
                .collect();
            bail!("pipeline checks failed: {}", failed.join("; "));
        }
        let s = out.sink();
        let n = s.u(&["window", "messages"]);
        let (p50, p99) = (s.f(&["p50_ns"]), s.f(&["p99_ns"]));
        Ok(vec![
            Record::throughput("channel", case, SYSTEM, s.f(&["window", "bytes_per_s"]), n),
            Record {
                metric: "source_to_sink_ns".into(),
                unit: "ns".into(),
                value: p50,
                p50: Some(p50),
                p99: Some(p99),
                ..Record::throughput("channel", case, SYSTEM, 0.0, s.u(&["latency_samples"]))
            },
            Record {
                metric: "bytes_copied".into(),
                unit: "B".into(),
                value: out.bytes_copied() as f64,
                ..Record::throughput(
                    "channel",
                    case,
                    SYSTEM,
                    0.0,
                    out.roles
                        .iter()
                        .map(|r| r.u(&["counters", "messages_received"]))
                        .sum(),
                )
            },
        ])
    }

    fn doorbells(&self, case: &str, size: usize) -> anyhow::Result<Vec<Record>> {
        let place = Placement::detect();
        let svc = service("consume");
        let kid = self.spawn(
            "consume",
            &[format!("svc={svc}"), format!("cpu={}", place.peer)],
        )?;
        let d = &self.d;
        let ch = d.connect(&svc)?;
        ch.set_wait(WaitStrategy::default());
        let mut seq = 0u64;
        let mut send = || -> anyhow::Result<()> {
            seq += 1;
            let mut b = d.alloc(size)?;
            fill(&mut b, seq);
            ch.send(Message::new(b).tag(seq))?;
            Ok(())
        };
        let (c0, c1) = {
            let _pin = PinGuard::pin(place.parent)?;
            let warm = Instant::now();
            while warm.elapsed() < self.opts.warmup() {
                send()?;
            }
            let c0 = d.counters();
            let start = Instant::now();
            while start.elapsed() < self.opts.duration() {
                send()?;
            }
            (c0, d.counters())
        };
        // Collect the last releases so the channel does not linger in the domain.
        pipeline::drain(&ch, Duration::from_secs(5))?;
        drop(ch);
        kid.finish(Duration::from_secs(10))?;
        let sent = c1.messages_sent - c0.messages_sent;
        let rung = c1.doorbells_rung - c0.doorbells_rung;
        if sent == 0 {
            bail!("nothing sent");
        }
        Ok(vec![Record {
            metric: "doorbells_per_message".into(),
            unit: "ratio".into(),
            value: rung as f64 / sent as f64,
            ..Record::throughput("channel", case, SYSTEM, 0.0, sent)
        }])
    }
}

// ---------------------------------------------------------------------------
// Peer side: `fido-bench __bench-peer fido <kind> key=value...`
// ---------------------------------------------------------------------------

pub fn peer_main(args: &[String]) -> anyhow::Result<()> {
    let kind = args.first().map(|s| s.as_str()).unwrap_or("");
    let rest = args.get(1..).unwrap_or(&[]);
    if kind == "pipe" {
        return pipeline::role_main(rest);
    }
    if kind.starts_with("rpc-") {
        return super::rpc::peer_main(kind, rest);
    }
    proc::child_prologue()?;
    let a = Args::parse(rest);
    if let Some(cpu) = a.opt("cpu") {
        crate::pin_to(cpu.parse()?)?;
    }
    match kind {
        "echo" => echo_peer(&a),
        "stream" => stream_peer(&a),
        "consume" => consume_peer(&a),
        k => bail!("unknown fido-bench peer `{k}`"),
    }
}

fn peer_domain(name: &str, wait: WaitStrategy) -> anyhow::Result<Domain> {
    Domain::join(
        JoinOptions::new(name)
            .arena_len(ARENA)
            .ring_entries(ENTRIES)
            .wait(wait),
    )
    .context("joining")
}

fn accept(d: &Domain, a: &Args) -> anyhow::Result<fido::Channel> {
    let l = d.offer(a.get("svc")?)?;
    emit(&json!({"event": "ready", "pid": std::process::id(), "domain": d.id()}))?;
    Ok(l.accept_timeout(READY)?)
}

fn echo_peer(a: &Args) -> anyhow::Result<()> {
    let size: usize = a.num("size")?;
    let wait = parse_wait(a.get("wait")?)?;
    let d = peer_domain("bench-echo", wait)?;
    let ch = accept(&d, a)?;
    ch.set_wait(wait);
    loop {
        let m = match ch.recv() {
            Ok(m) => m,
            Err(e) if is_end(&e) => return Ok(()),
            Err(e) => return Err(e.into()),
        };
        let k = fold_view(msg_bytes(&m)?);
        drop(m);
        let mut b = d.alloc(size)?;
        fill(&mut b, k);
        match ch.send(b) {
            Ok(()) => {}
            Err(e) if is_end(&e.error) => return Ok(()),
            Err(e) => return Err(e.error.into()),
        }
    }
}

fn stream_peer(a: &Args) -> anyhow::Result<()> {
    let size: usize = a.num("size")?;
    let touch = a.opt("touch") == Some("1");
    let d = peer_domain("bench-stream", WaitStrategy::default())?;
    let ch = accept(&d, a)?;
    for k in 1u64.. {
        let mut b = d.alloc(size)?;
        if touch {
            fill(&mut b, k);
        } else {
            b[..8].copy_from_slice(&k.to_le_bytes());
        }
        match ch.send(Message::new(b).tag(k)) {
            Ok(()) => {}
            Err(e) if is_end(&e.error) => return Ok(()),
            Err(e) => return Err(e.error.into()),
        }
    }
    Ok(())
}

fn consume_peer(a: &Args) -> anyhow::Result<()> {
    let d = peer_domain("bench-consume", WaitStrategy::default())?;
    let ch = accept(&d, a)?;
    let mut expect = 1u64;
    loop {
        let m = match ch.recv() {
            Ok(m) => m,
            Err(e) if is_end(&e) => return Ok(()),
            Err(e) => return Err(e.into()),
        };
        let k = fold_view(msg_bytes(&m)?);
        if k != expect {
            bail!("consumer: sequence {k}, expected {expect}");
        }
        expect += 1;
    }
}
