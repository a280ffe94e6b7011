//! A zero-copy pipeline across processes: source → forwarders → sink, one
//! domain per process, used by `fido demo` and by the `pipeline-*` cases of
//! `fido bench channel`.
//!
//! * The **source** allocates each message in its own arena and writes every
//!   byte once: a pattern derived from the sequence number, then a 64-byte
//!   header (magic, sequence, `CLOCK_MONOTONIC` stamp, the buffer's global
//!   pointer, length, a checksum of the pattern). Tag = sequence number; opcode
//!   says whether the message is in the measured window.
//! * Each **forwarder** `recv`s and `forward`s: it never touches the payload.
//! * The **sink** reads every byte (recomputes the checksum), checks the
//!   sequence has no gap, and checks that the message's global pointer is the
//!   one the source wrote: the pointer travelled unchanged through every hop.
//!   It records source→sink latency after its read (as the uds baseline does).
//! * The end is an `END` message; each role then waits for its downstream to
//!   close, so nobody's memory disappears while someone still reads it.
//!
//! Every role prints `{"event":"ready"}` once it can take traffic and one
//! `{"event":"result",...}` line at the end, with figures it measured and its
//! domain's counters (`bytes_copied` must be 0).

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::{bail, Context as _};
use fido::{Channel, Domain, JoinOptions, Message, Msg, WaitStrategy};
use serde_json::{json, Value};

use crate::measure::{mono_ns, percentiles};
use crate::proc::{self, Kid};

pub const HEADER: usize = 64;
const MAGIC: u64 = 0x6f64_6966_6570_6970; // "pipefido"
const OP_WARMUP: u16 = 1;
const OP_MEASURED: u16 = 2;
const OP_END: u16 = 3;

/// `key=value` arguments of a role process.
pub struct Args(HashMap<String, String>);

impl Args {
    pub fn parse(args: &[String]) -> Args {
        Args(
            args.iter()
                .filter_map(|a| {
                    a.split_once('=')
                        .map(|(k, v)| (k.to_string(), v.to_string()))
                })
                .collect(),
        )
    }
    pub fn get(&self, k: &str) -> anyhow::Result<&str> {
        self.0
            .get(k)
            .map(|s| s.as_str())
            .with_context(|| format!("role argument {k}= missing"))
    }
    pub fn num<T: std::str::FromStr>(&self, k: &str) -> anyhow::Result<T>
    where
        T::Err: std::error::Error + Send + Sync + 'static,
    {
        Ok(self.get(k)?.parse()?)
    }
    pub fn opt(&self, k: &str) -> Option<&str> {
        self.0.get(k).map(|s| s.as_str())
    }
    pub fn flag(&self, k: &str) -> bool {
        matches!(self.0.get(k).map(|s| s.as_str()), Some("1") | Some("true"))
    }
}

/// Prints one JSON line on stdout and flushes it.
pub fn emit(v: &Value) -> anyhow::Result<()> {
    use std::io::Write as _;
    let mut out = std::io::stdout().lock();
    serde_json::to_writer(&mut out, v)?;
    out.write_all(b"\n")?;
    out.flush()?;
    Ok(())
}

pub fn counters_json(c: &fido::Counters) -> Value {
    json!({
        "messages_sent": c.messages_sent,
        "messages_received": c.messages_received,
        "bytes_sent": c.bytes_sent,
        "bytes_received": c.bytes_received,
        "bytes_copied": c.bytes_copied,
        "doorbells_rung": c.doorbells_rung,
        "doorbells_suppressed": c.doorbells_suppressed,
    })
}

// ---------------------------------------------------------------------------
// Payload
// ---------------------------------------------------------------------------

const K1: u64 = 0x9E37_79B9_7F4A_7C15;
const K2: u64 = 0xD1B5_4A32_D192_ED03;

/// Fletcher-style sum over 64-bit words (order-sensitive), tail bytes included.
struct Sum {
    a: u64,
    b: u64,
}

impl Sum {
    fn new() -> Sum {
        Sum { a: 0, b: 0 }
    }
    #[inline(always)]
    fn add(&mut self, w: u64) {
        self.a = self.a.wrapping_add(w);
        self.b = self.b.wrapping_add(self.a);
    }
    fn value(&self) -> u64 {
        self.a ^ self.b.rotate_left(32)
    }
}

/// Writes a whole message (every byte once): the pattern of `seq` after the
/// header, then the header. Needs `buf.len() >= HEADER`.
pub fn write_message(buf: &mut fido::Buf, seq: u64) {
    let gptr = buf.gptr().addr();
    let len = buf.len() as u64;
    let bytes: &mut [u8] = buf;
    let (head, body) = bytes.split_at_mut(HEADER);
    let mut sum = Sum::new();
    let seed = seq.wrapping_mul(K2);
    let mut chunks = body.chunks_exact_mut(8);
    let mut w = seed;
    for c in &mut chunks {
        c.copy_from_slice(&w.to_le_bytes());
        sum.add(w);
        w = w.wrapping_add(K1);
    }
    for b in chunks.into_remainder() {
        *b = seq as u8;
        sum.add(*b as u64);
    }
    let fields = [
        MAGIC,
        seq,
        mono_ns(),
        gptr,
        len,
        sum.value(),
        0,
        0,
    ];
    for (i, f) in fields.iter().enumerate() {
        head[i * 8..i * 8 + 8].copy_from_slice(&f.to_le_bytes());
    }
}

/// What the sink learned from one message.
pub struct Checked {
    pub seq: u64,
    pub stamp: u64,
    pub gptr: u64,
    pub checksum_ok: bool,
    pub header_ok: bool,
}

/// Reads every byte of a message written by [`write_message`].
pub fn check_message(bytes: &[u8]) -> Checked {
    let word = |i: usize| u64::from_le_bytes(bytes[i * 8..i * 8 + 8].try_into().unwrap());
    if bytes.len() < HEADER {
        return Checked {
            seq: 0,
            stamp: 0,
            gptr: 0,
            checksum_ok: false,
            header_ok: false,
        };
    }
    let (magic, seq, stamp, gptr, len, want) =
        (word(0), word(1), word(2), word(3), word(4), word(5));
    let mut sum = Sum::new();
    let mut chunks = bytes[HEADER..].chunks_exact(8);
    for c in &mut chunks {
        sum.add(u64::from_le_bytes(c.try_into().unwrap()));
    }
    for b in chunks.remainder() {
        sum.add(*b as u64);
    }
    Checked {
        seq,
        stamp,
        gptr,
        checksum_ok: sum.value() == want,
        header_ok: magic == MAGIC && len == bytes.len() as u64,
    }
}

// ---------------------------------------------------------------------------
// Roles (helper processes)
// ---------------------------------------------------------------------------

fn join(name: &str, arena: u64, prefault: bool, entries: u32) -> anyhow::Result<Domain> {
    let opts = JoinOptions::new(name)
        .arena_len(arena)
        .prefault(prefault)
        .ring_entries(entries)
        .wait(WaitStrategy::default());
    Domain::join(opts).with_context(|| format!("joining the broker as {name}"))
}

fn is_end(e: &fido::Error) -> bool {
    matches!(e, fido::Error::Closed | fido::Error::PeerGone { .. })
}

/// Waits until the downstream peer closes the channel (it never sends to us).
fn wait_closed(ch: &Channel) -> anyhow::Result<()> {
    match ch.recv_timeout(Duration::from_secs(60)) {
        Err(e) if is_end(&e) => Ok(()),
        Err(e) => Err(e).context("waiting for downstream to finish"),
        Ok(m) => bail!("downstream sent an unexpected message {m:?}"),
    }
}

/// Throughput bookkeeping: bytes/messages of the measured window and the span
/// from the arrival (or send) before the first measured message to the last.
#[derive(Default)]
struct Window {
    messages: u64,
    bytes: u64,
    start: Option<Instant>,
    last: Option<Instant>,
    prev: Option<Instant>,
}

impl Window {
    fn saw(&mut self, now: Instant, measured: bool, bytes: u64) {
        if measured {
            if self.start.is_none() {
                self.start = Some(self.prev.unwrap_or(now));
            }
            self.messages += 1;
            self.bytes += bytes;
            self.last = Some(now);
        }
        self.prev = Some(now);
    }
    fn json(&self) -> Value {
        let span = match (self.start, self.last) {
            (Some(s), Some(l)) => l.duration_since(s).as_secs_f64(),
            _ => 0.0,
        };
        let (bps, mps) = if span > 0.0 {
            (self.bytes as f64 / span, self.messages as f64 / span)
        } else {
            (0.0, 0.0)
        };
        json!({"messages": self.messages, "bytes": self.bytes, "seconds": span, "bytes_per_s": bps, "msgs_per_s": mps})
    }
}

/// Publishes the domain's counters to the broker now and then, so `fido
/// status` shows them while the pipeline runs.
struct Publisher(Instant);

impl Publisher {
    fn new() -> Publisher {
        Publisher(Instant::now())
    }
    fn tick(&mut self, d: &Domain) {
        if self.0.elapsed() >= Duration::from_millis(500) {
            let _ = d.publish_counters();
            self.0 = Instant::now();
        }
    }
}

fn result_line(role: &str, d: &Domain, window: &Window, extra: Value) -> anyhow::Result<()> {
    let _ = d.publish_counters();
    let mut v = json!({
        "event": "result",
        "role": role,
        "pid": std::process::id(),
        "domain": d.id(),
        "slot": d.slot(),
        "name": d.name(),
        "address_mode": format!("{:?}", d.address_mode()),
        "window": window.json(),
        "counters": counters_json(&d.counters()),
    });
    if let (Value::Object(m), Value::Object(x)) = (&mut v, extra) {
        m.extend(x);
    }
    emit(&v)
}

/// `role=source|fwd|sink` plus its arguments (see [`launch`]).
pub fn role_main(args: &[String]) -> anyhow::Result<()> {
    proc::child_prologue()?;
    let a = Args::parse(args);
    let entries: u32 = a.num("entries")?;
    match a.get("role")? {
        "source" => source(&a, entries),
        "fwd" => forwarder(&a, entries),
        "sink" => sink(&a, entries),
        r => bail!("unknown pipeline role {r}"),
    }
}

fn source(a: &Args, entries: u32) -> anyhow::Result<()> {
    let size: usize = a.num("size")?;
    let warm = Duration::from_nanos(a.num("warm_ns")?);
    let dur = Duration::from_nanos(a.num("dur_ns")?);
    let next = a.get("next")?;
    let block = (size as u64).next_power_of_two().max(64 << 10);
    let arena = block * (entries as u64 + 8) + (16 << 20);
    let d = join(a.get("name")?, arena, true, entries)?;
    let ch = d
        .connect(next)
        .with_context(|| format!("connecting to {next}"))?;
    emit(&json!({"event": "ready", "pid": std::process::id(), "domain": d.id()}))?;
    let mut window = Window::default();
    let start = Instant::now();
    let (warm_end, end) = (start + warm, start + warm + dur);
    window.prev = Some(start);
    let mut seq = 0u64;
    let mut publisher = Publisher::new();
    loop {
        let now = Instant::now();
        if now >= end {
            break;
        }
        let measured = now >= warm_end;
        seq += 1;
        let mut buf = d.alloc(size)?;
        write_message(&mut buf, seq);
        let op = if measured { OP_MEASURED } else { OP_WARMUP };
        ch.send(Message::new(buf).tag(seq).opcode(op))
            .context("sending")?;
        window.saw(Instant::now(), measured, size as u64);
        publisher.tick(&d);
    }
    let mut endbuf = d.alloc(HEADER)?;
    endbuf.fill(0);
    ch.send(Message::new(endbuf).tag(seq + 1).opcode(OP_END))
        .context("sending END")?;
    wait_closed(&ch)?;
    result_line("source", &d, &window, json!({"sent": seq, "size": size}))
}

fn forwarder(a: &Args, entries: u32) -> anyhow::Result<()> {
    let next = a.get("next")?;
    let d = join(a.get("name")?, 8 << 20, false, entries)?;
    let down = d
        .connect(next)
        .with_context(|| format!("connecting to {next}"))?;
    let listener = d.offer(a.get("listen")?)?;
    emit(&json!({"event": "ready", "pid": std::process::id(), "domain": d.id()}))?;
    let up = listener.accept().context("accepting upstream")?;
    // A forwarder is a pure relay: it has nothing to do between messages, so
    // it sleeps on its doorbell instead of spinning. On a host with fewer
    // cores than pipeline stages (2 cores, up to 5 processes here), a spinning
    // relay steals the CPU the source and sink need: measured 4-hop/1-hop
    // throughput 0.64 spinning vs 0.85 blocking (fido bench channel --quick).
    up.set_wait(WaitStrategy::Block);
    down.set_wait(WaitStrategy::Block);
    let mut window = Window::default();
    let mut forwarded = 0u64;
    let mut publisher = Publisher::new();
    loop {
        // While we wait here, the library keeps passing the downstream's
        // releases of forwarded messages upstream.
        let m: Msg = up.recv().context("receiving from upstream")?;
        let op = m.opcode();
        let len = m.len() as u64;
        down.forward(m).context("forwarding")?;
        if op == OP_END {
            break;
        }
        forwarded += 1;
        window.saw(Instant::now(), op == OP_MEASURED, len);
        publisher.tick(&d);
    }
    wait_closed(&down)?;
    result_line("fwd", &d, &window, json!({"forwarded": forwarded}))
}

/// Waits until the peer released everything we sent (or `timeout` passes),
/// so that dropping the channel leaves nothing lingering in the domain.
pub fn drain(ch: &Channel, timeout: Duration) -> anyhow::Result<()> {
    let deadline = Instant::now() + timeout;
    loop {
        // `in_flight` collects the releases the peer published.
        let left = ch.in_flight();
        if left == 0 {
            return Ok(());
        }
        if Instant::now() > deadline {
            bail!("peer still holds {left} messages after {timeout:?}");
        }
        std::thread::sleep(Duration::from_micros(200));
    }
}

fn sink(a: &Args, entries: u32) -> anyhow::Result<()> {
    let d = join(a.get("name")?, 8 << 20, false, entries)?;
    let listener = d.offer(a.get("listen")?)?;
    emit(&json!({"event": "ready", "pid": std::process::id(), "domain": d.id()}))?;
    let up = listener.accept().context("accepting upstream")?;
    let mut window = Window::default();
    let mut lat: Vec<u64> = Vec::with_capacity(1 << 16);
    let (mut received, mut seq_errors, mut checksum_errors, mut pointer_errors, mut header_errors) =
        (0u64, 0u64, 0u64, 0u64, 0u64);
    let mut expect = 1u64;
    let mut publisher = Publisher::new();
    let mut first_error: Option<String> = None;
    let mut note = |s: String| {
        if first_error.is_none() {
            first_error = Some(s);
        }
    };
    loop {
        let m = up.recv().context("receiving from upstream")?;
        if m.opcode() == OP_END {
            break;
        }
        let measured = m.opcode() == OP_MEASURED;
        received += 1;
        let (g, _) = m
            .global_segments()
            .next()
            .context("message without segments")?;
        let bytes = match m.as_slice() {
            Some(b) => b,
            None => bail!("pipeline message with {} segments", m.segment_count()),
        };
        let c = check_message(bytes);
        let now = mono_ns();
        if !c.header_ok {
            header_errors += 1;
            note(format!("message tag {}: bad header", m.tag()));
        }
        if c.seq != expect || m.tag() != c.seq {
            seq_errors += 1;
            note(format!(
                "expected sequence {expect}, got {} (tag {})",
                c.seq,
                m.tag()
            ));
        }
        expect = c.seq + 1;
        if !c.checksum_ok {
            checksum_errors += 1;
            note(format!("sequence {}: checksum mismatch", c.seq));
        }
        if c.gptr != g.addr() {
            pointer_errors += 1;
            note(format!(
                "sequence {}: source wrote pointer {:#x}, message arrived at {:#x}",
                c.seq,
                c.gptr,
                g.addr()
            ));
        }
        if measured {
            lat.push(now.saturating_sub(c.stamp));
        }
        let len = m.len() as u64;
        drop(m);
        window.saw(Instant::now(), measured, len);
        publisher.tick(&d);
    }
    // Dropping `up` (at return) tells the forwarder we are done.
    let samples = lat.len();
    let (p50, p99) = percentiles(&mut lat);
    result_line(
        "sink",
        &d,
        &window,
        json!({
            "received": received,
            "last_seq": expect - 1,
            "latency_samples": samples,
            "p50_ns": p50,
            "p99_ns": p99,
            "seq_errors": seq_errors,
            "checksum_errors": checksum_errors,
            "pointer_errors": pointer_errors,
            "header_errors": header_errors,
            "first_error": first_error,
        }),
    )
}

// ---------------------------------------------------------------------------
// Parent side
// ---------------------------------------------------------------------------

/// What to run.
pub struct Spec {
    /// Links (hops): `links + 1` processes.
    pub links: usize,
    pub size: usize,
    pub warmup: Duration,
    pub duration: Duration,
    pub ring_entries: u32,
    /// Hidden subcommand prefix that reaches [`role_main`], e.g. `["__demo-role"]`.
    pub launcher: Vec<String>,
    /// Service/domain name prefix, e.g. `demo`.
    pub prefix: String,
}

/// One role's report (its result line).
#[derive(Debug, Clone)]
pub struct RoleReport {
    pub label: String,
    pub pid: u32,
    pub v: Value,
}

impl RoleReport {
    pub fn u(&self, path: &[&str]) -> u64 {
        let mut v = &self.v;
        for p in path {
            v = &v[*p];
        }
        v.as_u64().unwrap_or(0)
    }
    pub fn f(&self, path: &[&str]) -> f64 {
        let mut v = &self.v;
        for p in path {
            v = &v[*p];
        }
        v.as_f64().unwrap_or(0.0)
    }
}

/// The whole run: reports source first, sink last.
pub struct Outcome {
    pub roles: Vec<RoleReport>,
}

static RUN: AtomicU64 = AtomicU64::new(0);

impl Outcome {
    pub fn sink(&self) -> &RoleReport {
        self.roles.last().expect("a sink")
    }
    pub fn source(&self) -> &RoleReport {
        &self.roles[0]
    }
    pub fn bytes_copied(&self) -> u64 {
        self.roles
            .iter()
            .map(|r| r.u(&["counters", "bytes_copied"]))
            .sum()
    }
    /// Every check, as (what, passed, detail).
    pub fn checks(&self) -> Vec<(String, bool, String)> {
        let s = self.sink();
        let sent = self.source().u(&["sent"]);
        let got = s.u(&["received"]);
        let mut out = vec![
            (
                "sequence".to_string(),
                s.u(&["seq_errors"]) == 0 && s.u(&["header_errors"]) == 0,
                format!(
                    "{} messages in order, {} gaps/reorders",
                    got,
                    s.u(&["seq_errors"])
                ),
            ),
            (
                "delivered = sent".into(),
                got == sent && sent > 0,
                format!("{got} of {sent}"),
            ),
            (
                "checksum".into(),
                s.u(&["checksum_errors"]) == 0,
                format!("{} mismatches", s.u(&["checksum_errors"])),
            ),
            (
                "pointer unchanged".into(),
                s.u(&["pointer_errors"]) == 0,
                format!(
                    "{} messages arrived at another address",
                    s.u(&["pointer_errors"])
                ),
            ),
            (
                "bytes copied".into(),
                self.bytes_copied() == 0,
                format!(
                    "{} B over {} domains",
                    self.bytes_copied(),
                    self.roles.len()
                ),
            ),
        ];
        for r in &self.roles[1..self.roles.len() - 1] {
            let f = r.u(&["forwarded"]);
            out.push((
                format!("{} forwarded all", r.label),
                f == sent,
                format!("{f} of {sent}"),
            ));
        }
        if let Some(Value::String(e)) = s.v.get("first_error") {
            out.push(("first error".into(), false, e.clone()));
        }
        out
    }
    pub fn all_ok(&self) -> bool {
        self.checks().iter().all(|(_, ok, _)| *ok)
    }
}

/// Runs a pipeline: spawns sink, forwarders (downstream first), then the
/// source; collects every result; reaps every process (killing them on any
/// error or interrupt).
pub fn launch(spec: &Spec, broker: &std::path::Path) -> anyhow::Result<Outcome> {
    if spec.links == 0 {
        bail!("a pipeline needs at least one hop");
    }
    if spec.size < HEADER {
        bail!("pipeline messages carry a {HEADER}-byte header: --size must be at least {HEADER}");
    }
    let run = format!(
        "{}-{}",
        std::process::id(),
        RUN.fetch_add(1, Ordering::Relaxed)
    );
    let fwds = spec.links - 1;
    // Labels from the sink up: sink, fwd<fwds>, ..., fwd1, source.
    let svc = |label: &str| format!("{}-{label}-{run}", spec.prefix);
    let base = |role: &str, label: &str| -> Vec<String> {
        let mut v = spec.launcher.clone();
        v.extend([
            format!("role={role}"),
            format!("entries={}", spec.ring_entries),
            format!("name={}-{label}", spec.prefix),
        ]);
        v
    };
    let mut kids: Vec<(String, Kid)> = Vec::new();
    let ready_by = || Instant::now() + Duration::from_secs(20);

    let mut a = base("sink", "sink");
    a.push(format!("listen={}", svc("sink")));
    let mut k = Kid::spawn(&a, broker)?;
    k.expect_event("ready", ready_by())?;
    kids.push(("sink".into(), k));
    let mut downstream = svc("sink");
    for i in (1..=fwds).rev() {
        let label = format!("fwd{i}");
        let mut a = base("fwd", &label);
        a.push(format!("listen={}", svc(&label)));
        a.push(format!("next={downstream}"));
        let mut k = Kid::spawn(&a, broker)?;
        k.expect_event("ready", ready_by())?;
        kids.push((label.clone(), k));
        downstream = svc(&label);
    }
    let mut a = base("source", "source");
    a.extend([
        format!("next={downstream}"),
        format!("size={}", spec.size),
        format!("warm_ns={}", spec.warmup.as_nanos()),
        format!("dur_ns={}", spec.duration.as_nanos()),
    ]);
    let mut k = Kid::spawn(&a, broker)?;
    k.expect_event("ready", ready_by())?;
    kids.push(("source".into(), k));

    // Results come in any order; everyone is done a little after the source.
    let deadline = Instant::now() + spec.warmup + spec.duration + Duration::from_secs(20);
    let mut roles = Vec::new();
    for (label, k) in kids.iter_mut().rev() {
        let v = k.expect_event("result", deadline)?;
        roles.push(RoleReport {
            label: label.clone(),
            pid: k.pid(),
            v,
        });
    }
    proc::finish_all(
        kids.into_iter().map(|(_, k)| k).collect(),
        Duration::from_secs(10),
    )?;
    Ok(Outcome { roles })
}
