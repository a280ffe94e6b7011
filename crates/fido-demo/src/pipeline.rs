//! A zero-copy pipeline across processes: source → forwarders → sink, one
//! domain per process, used by `fido demo` and by the `pipeline-*` cases of
//! `fido-bench channel`.
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
//! * An optional **latency phase** ([`PingPhase`]) follows the measured
//!   window: the sink acknowledges each message on a channel of its own back
//!   to the source, and the source sends the next only then — one message in
//!   flight through every hop, so the latency measured is the pipeline's, not
//!   its queue's. (Under full load a message also waits behind up to
//!   `ring_entries` others per hop.)
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
// A message's phase (its opcode, and word 6 of its header).
pub(crate) const OP_WARMUP: u16 = 1;
pub(crate) const OP_MEASURED: u16 = 2;
const OP_END: u16 = 3;
/// Latency phase, not measured: acknowledged, so the queues are empty after it.
pub(crate) const OP_DRAIN: u16 = 4;
/// Latency phase, measured: acknowledged; the source sends one at a time.
pub(crate) const OP_PING: u16 = 5;

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
    fill_message(buf, seq, gptr, 0);
}

/// [`write_message`] into any buffer: `gptr` is the global pointer the sink
/// must find the message at (0 where the transport has none), `op` the phase
/// carried in the header. Needs `bytes.len() >= HEADER`.
pub fn fill_message(bytes: &mut [u8], seq: u64, gptr: u64, op: u16) {
    let len = bytes.len() as u64;
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
        op as u64,
        0,
    ];
    for (i, f) in fields.iter().enumerate() {
        head[i * 8..i * 8 + 8].copy_from_slice(&f.to_le_bytes());
    }
}

/// The phase written by [`fill_message`] (0 for a message shorter than the header).
pub fn message_op(bytes: &[u8]) -> u16 {
    match bytes.get(48..56) {
        Some(w) => u64::from_le_bytes(w.try_into().unwrap()) as u16,
        None => 0,
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
pub fn check_message(bytes: fido::PeerSlice<'_>) -> Checked {
    // Read in place, each word once (the sender's memory: see `PeerSlice`).
    let word = |i: usize| u64::from_le_bytes(bytes.read_obj(i * 8).expect("inside the header"));
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
    // Whole words straight from the peer's memory (`fold_u64`: one volatile
    // load each, no staging copy), then the last bytes one by one, as
    // `write_message` summed them.
    let body = bytes.subslice(HEADER, bytes.len() - HEADER).expect("inside the message");
    let whole = body.len() / 8 * 8;
    let words = body.subslice(0, whole).expect("inside the body");
    let mut sum = words.fold_u64(Sum::new(), |mut sum, w| {
        sum.add(u64::from_le_bytes(w.to_ne_bytes()));
        sum
    });
    body.subslice(whole, body.len() - whole).expect("inside the body").read_chunks(|tail| {
        for b in tail {
            sum.add(*b as u64);
        }
    });
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
pub(crate) struct Window {
    messages: u64,
    bytes: u64,
    start: Option<Instant>,
    last: Option<Instant>,
    pub(crate) prev: Option<Instant>,
}

impl Window {
    pub(crate) fn saw(&mut self, now: Instant, measured: bool, bytes: u64) {
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
        "domain": d.id(),
        "slot": d.slot(),
        "name": d.name(),
        "address_mode": format!("{:?}", d.address_mode()),
        "counters": counters_json(&d.counters()),
    });
    if let (Value::Object(m), Value::Object(x)) = (&mut v, extra) {
        m.extend(x);
    }
    result_json(role, window, v)
}

/// Prints a role's `result` line: its role, pid, window, and `extra`'s fields.
pub(crate) fn result_json(role: &str, window: &Window, extra: Value) -> anyhow::Result<()> {
    let mut v = json!({
        "event": "result",
        "role": role,
        "pid": std::process::id(),
        "window": window.json(),
    });
    if let (Value::Object(m), Value::Object(x)) = (&mut v, extra) {
        m.extend(x);
    }
    emit(&v)
}

/// The latency phase after the measured window (see the module documentation).
#[derive(Debug, Clone)]
pub struct PingPhase {
    /// Pings are sent for this long…
    pub duration: Duration,
    /// …but at least this many (a slow pipeline still gets percentiles)…
    pub min_pings: u64,
    /// …and at most this many.
    pub max_pings: u64,
}

impl PingPhase {
    /// The role arguments that carry it.
    pub(crate) fn args(&self) -> Vec<String> {
        vec![
            format!("ping_ns={}", self.duration.as_nanos()),
            format!("ping_min={}", self.min_pings),
            format!("ping_max={}", self.max_pings),
        ]
    }

    pub(crate) fn from_args(a: &Args) -> anyhow::Result<Option<PingPhase>> {
        if a.opt("ping_ns").is_none() {
            return Ok(None);
        }
        Ok(Some(PingPhase {
            duration: Duration::from_nanos(a.num("ping_ns")?),
            min_pings: a.num("ping_min")?,
            max_pings: a.num("ping_max")?,
        }))
    }

    /// Whether another ping is due after `sent` of them in `elapsed`.
    pub(crate) fn wants_more(&self, sent: u64, elapsed: Duration) -> bool {
        sent < self.max_pings && (sent < self.min_pings || elapsed < self.duration)
    }
}

/// What a sink learns from the messages it receives, whatever carried them.
#[derive(Default)]
pub(crate) struct SinkLedger {
    pub(crate) window: Window,
    received: u64,
    /// The sequence number due next (0: none seen yet, the first must be 1).
    expect: u64,
    seq_errors: u64,
    checksum_errors: u64,
    pointer_errors: u64,
    header_errors: u64,
    first_error: Option<String>,
    /// Source→sink latency of the measured window's messages (full load).
    loaded: Vec<u64>,
    /// Source→sink latency of the pings (one message in flight).
    pings: Vec<u64>,
}

impl SinkLedger {
    /// Books one message checked at `now_ns`: `tag` is what the transport says
    /// its sequence is, `op` its phase, `arrived_at` the global pointer it
    /// arrived at where the transport has one.
    pub(crate) fn saw(
        &mut self,
        tag: u64,
        op: u16,
        c: &Checked,
        arrived_at: Option<u64>,
        now_ns: u64,
        len: u64,
    ) {
        let expect = self.expect.max(1);
        self.received += 1;
        if !c.header_ok {
            self.header_errors += 1;
            self.note(format!("message tag {tag}: bad header"));
        }
        if c.seq != expect || tag != c.seq {
            self.seq_errors += 1;
            self.note(format!("expected sequence {expect}, got {} (tag {tag})", c.seq));
        }
        self.expect = c.seq + 1;
        if !c.checksum_ok {
            self.checksum_errors += 1;
            self.note(format!("sequence {}: checksum mismatch", c.seq));
        }
        if let Some(g) = arrived_at {
            if c.gptr != g {
                self.pointer_errors += 1;
                self.note(format!(
                    "sequence {}: source wrote pointer {:#x}, message arrived at {g:#x}",
                    c.seq, c.gptr
                ));
            }
        }
        let latency = now_ns.saturating_sub(c.stamp);
        match op {
            OP_MEASURED => self.loaded.push(latency),
            OP_PING => self.pings.push(latency),
            _ => {}
        }
        self.window.saw(Instant::now(), op == OP_MEASURED, len);
    }

    fn note(&mut self, s: String) {
        self.first_error.get_or_insert(s);
    }

    /// The sink's fields of its result line.
    pub(crate) fn json(mut self) -> Value {
        let samples = self.loaded.len();
        let (p50, p99) = percentiles(&mut self.loaded);
        let pings = self.pings.len();
        let (ping_p50, ping_p99) = percentiles(&mut self.pings);
        json!({
            "received": self.received,
            "last_seq": self.expect.max(1) - 1,
            "latency_samples": samples,
            "p50_ns": p50,
            "p99_ns": p99,
            "ping_samples": pings,
            "ping_p50_ns": ping_p50,
            "ping_p99_ns": ping_p99,
            "seq_errors": self.seq_errors,
            "checksum_errors": self.checksum_errors,
            "pointer_errors": self.pointer_errors,
            "header_errors": self.header_errors,
            "first_error": self.first_error,
        })
    }
}

/// `role=source|fwd|sink` plus its arguments (see [`launch`]), or a role of
/// the socket pipeline (`stream-*`, see [`crate::uds`]). `gate=1`: first
/// print a `waiting` event and wait for a line on stdin (roles in VMs).
pub fn role_main(args: &[String]) -> anyhow::Result<()> {
    proc::child_prologue()?;
    let a = Args::parse(args);
    if a.flag("gate") {
        // A role in a VM (`fido demo --vm`) starts with the guest, before its
        // peers exist: it says so, then waits for the demo's word on its
        // console (any line) before it listens or connects.
        emit(&json!({"event": "waiting", "pid": std::process::id()}))?;
        let mut line = String::new();
        if std::io::stdin().read_line(&mut line).context("waiting for the word to start")? == 0 {
            bail!("the console closed before the word to start");
        }
    }
    if let Some(r) = crate::uds::role(&a) {
        return r;
    }
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
    let mut arena = block * (entries as u64 + 8) + (16 << 20);
    if a.flag("arena_pow2") {
        // A VM maps a peer's arena as a PCI BAR, whose size is a power of two.
        arena = arena.next_power_of_two();
    }
    let d = join(a.get("name")?, arena, true, entries)?;
    let ch = d
        .connect(next)
        .with_context(|| format!("connecting to {next}"))?;
    let pings = PingPhase::from_args(a)?;
    let ack = match &pings {
        Some(_) => {
            let svc = a.get("ack")?;
            Some(d.connect(svc).with_context(|| format!("connecting to {svc}"))?)
        }
        None => None,
    };
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
        let op = if measured { OP_MEASURED } else { OP_WARMUP };
        let gptr = buf.gptr().addr();
        fill_message(&mut buf, seq, gptr, op);
        ch.send(Message::new(buf).tag(seq).opcode(op))
            .context("sending")?;
        window.saw(Instant::now(), measured, size as u64);
        publisher.tick(&d);
    }
    let mut pinged = 0u64;
    if let (Some(p), Some(ack)) = (&pings, &ack) {
        let one = |seq: u64, op: u16| -> anyhow::Result<()> {
            let mut buf = d.alloc(size)?;
            let gptr = buf.gptr().addr();
            fill_message(&mut buf, seq, gptr, op);
            ch.send(Message::new(buf).tag(seq).opcode(op))
                .context("sending a ping")?;
            let m = ack
                .recv_timeout(Duration::from_secs(10))
                .context("waiting for the sink's acknowledgement")?;
            if m.tag() != seq {
                bail!("the sink acknowledged {}, expected {seq}", m.tag());
            }
            Ok(())
        };
        // The first empties the queues the measured window left behind.
        seq += 1;
        one(seq, OP_DRAIN)?;
        let t = Instant::now();
        while p.wants_more(pinged, t.elapsed()) {
            seq += 1;
            one(seq, OP_PING)?;
            pinged += 1;
        }
    }
    let mut endbuf = d.alloc(HEADER)?;
    endbuf.fill(0);
    ch.send(Message::new(endbuf).tag(seq + 1).opcode(OP_END))
        .context("sending END")?;
    wait_closed(&ch)?;
    result_line(
        "source",
        &d,
        &window,
        json!({"sent": seq, "size": size, "pings": pinged}),
    )
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
    // throughput 0.64 spinning vs 0.85 blocking (fido-bench channel --quick).
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
    let ack_listener = match a.opt("ack") {
        Some(svc) => Some(d.offer(svc)?),
        None => None,
    };
    emit(&json!({"event": "ready", "pid": std::process::id(), "domain": d.id()}))?;
    let up = listener.accept().context("accepting upstream")?;
    let ack = match &ack_listener {
        Some(l) => Some(
            l.accept()
                .context("accepting the source's acknowledgement channel")?,
        ),
        None => None,
    };
    let mut ledger = SinkLedger::default();
    let mut publisher = Publisher::new();
    loop {
        let m = up.recv().context("receiving from upstream")?;
        let op = m.opcode();
        if op == OP_END {
            break;
        }
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
        let (tag, len) = (m.tag(), m.len() as u64);
        drop(m);
        ledger.saw(tag, op, &c, Some(g.addr()), now, len);
        if matches!(op, OP_DRAIN | OP_PING) {
            let ack = ack
                .as_ref()
                .context("a ping, but no acknowledgement channel")?;
            // No payload: the acknowledgement is its tag.
            ack.send(Message::inline(&[])?.tag(tag))
                .context("acknowledging")?;
        }
        publisher.tick(&d);
    }
    // Dropping `up` (at return) tells the forwarder we are done.
    let window = std::mem::take(&mut ledger.window);
    result_line("sink", &d, &window, ledger.json())
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
        let mut out = self.delivery_checks();
        let at = out
            .iter()
            .position(|c| c.0 == "checksum")
            .map_or(out.len(), |i| i + 1);
        out.splice(
            at..at,
            [
                (
                    "pointer unchanged".to_string(),
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
            ],
        );
        out
    }

    /// The checks that hold for any transport: every message arrived, in
    /// order, intact, and every forwarder passed all of them on.
    pub fn delivery_checks(&self) -> Vec<(String, bool, String)> {
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
    launch_with_pings(spec, None, broker)
}

/// [`launch`], with the latency phase `pings` after the measured window.
pub fn launch_with_pings(
    spec: &Spec,
    pings: Option<&PingPhase>,
    broker: &std::path::Path,
) -> anyhow::Result<Outcome> {
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
    if pings.is_some() {
        a.push(format!("ack={}", svc("ack")));
    }
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
    if let Some(p) = pings {
        a.push(format!("ack={}", svc("ack")));
        a.extend(p.args());
    }
    let mut k = Kid::spawn(&a, broker)?;
    k.expect_event("ready", ready_by())?;
    kids.push(("source".into(), k));

    collect_results(kids, spec, pings)
}

/// Waits for every role's `result` line (they come in any order; everyone is
/// done a little after the source), then for every role to exit. Shared with
/// the Unix-socket pipeline (`uds`), whose roles report the same way.
pub(crate) fn collect_results(
    mut kids: Vec<(String, Kid)>,
    spec: &Spec,
    pings: Option<&PingPhase>,
) -> anyhow::Result<Outcome> {
    let ping_time = pings.map_or(Duration::ZERO, |p| p.duration);
    let deadline =
        Instant::now() + spec.warmup + spec.duration + ping_time + Duration::from_secs(20);
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

#[cfg(test)]
mod tests {
    use super::*;

    fn message(seq: u64, gptr: u64, op: u16) -> Vec<u8> {
        let mut b = vec![0u8; 4096 + 5];
        fill_message(&mut b, seq, gptr, op);
        b
    }

    #[test]
    fn a_filled_message_checks_and_carries_its_phase() {
        let b = message(7, 0x1000, OP_PING);
        let c = check_message(fido::PeerSlice::from_own(&b));
        assert!(c.header_ok && c.checksum_ok);
        assert_eq!((c.seq, c.gptr), (7, 0x1000));
        assert_eq!(message_op(&b), OP_PING);
        let mut bad = b.clone();
        bad[HEADER + 100] ^= 1;
        assert!(!check_message(fido::PeerSlice::from_own(&bad)).checksum_ok);
        assert!(!check_message(fido::PeerSlice::from_own(&b[..HEADER - 1])).header_ok);
    }

    #[test]
    fn the_ledger_counts_errors_and_keeps_the_phases_apart() {
        let mut l = SinkLedger::default();
        for (seq, op) in [(1, OP_WARMUP), (2, OP_MEASURED), (3, OP_DRAIN), (4, OP_PING)] {
            let c = check_message(fido::PeerSlice::from_own(&message(seq, 0x40, op)));
            l.saw(seq, op, &c, Some(0x40), c.stamp + 1000 * seq, 4101);
        }
        // A gap (6 after 4), a wrong pointer, a corrupt body.
        let mut b = message(6, 0x40, OP_PING);
        b[HEADER] ^= 0xff;
        let c = check_message(fido::PeerSlice::from_own(&b));
        l.saw(6, OP_PING, &c, Some(0x80), c.stamp + 6000, 4101);
        let v = l.json();
        assert_eq!(v["received"], 5);
        assert_eq!(v["last_seq"], 6);
        assert_eq!(v["seq_errors"], 1);
        assert_eq!(v["pointer_errors"], 1);
        assert_eq!(v["checksum_errors"], 1);
        assert_eq!(v["header_errors"], 0);
        // Only the measured message is a full-load sample, only pings are pings.
        assert_eq!((v["latency_samples"].clone(), v["p50_ns"].clone()), (1.into(), 2000.into()));
        assert_eq!(v["ping_samples"], 2);
        assert_eq!((v["ping_p50_ns"].clone(), v["ping_p99_ns"].clone()), (4000.into(), 6000.into()));
        assert!(v["first_error"].as_str().unwrap().contains("expected sequence 5"));
    }

    #[test]
    fn pings_run_for_their_time_within_their_bounds() {
        let p = PingPhase {
            duration: Duration::from_millis(10),
            min_pings: 3,
            max_pings: 5,
        };
        assert!(p.wants_more(2, Duration::from_secs(1)), "at least min_pings");
        assert!(!p.wants_more(3, Duration::from_secs(1)), "time is up");
        assert!(p.wants_more(4, Duration::ZERO), "time left");
        assert!(!p.wants_more(5, Duration::ZERO), "at most max_pings");
        let args: Vec<String> = p.args();
        let back = PingPhase::from_args(&Args::parse(&args)).unwrap().unwrap();
        assert_eq!((back.duration, back.min_pings, back.max_pings), (p.duration, 3, 5));
        assert!(PingPhase::from_args(&Args::parse(&[])).unwrap().is_none());
    }
}
