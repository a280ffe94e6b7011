//! `fido bench chaos`: pipelines of domains, each a separate process, while
//! domains and the broker are killed (`SIGKILL`) and restarted at random; every
//! message is checked end to end and accounted for.
//!
//! # What runs
//!
//! * A **broker** process (`fido broker --state-dir D --socket S`, this binary
//!   re-executed) that the driver kills and restarts on the same state
//!   directory and socket.
//! * Pipeline **A**: `srcA → fwdA → sinkA`; pipeline **B**: `srcB → fwdB1 →
//!   fwdB2 → sinkB` (transitive zero-copy: sinkB maps srcB's arena); an
//!   **echo** pair: `echo-client ⇄ echo-server` (requests one way, replies the
//!   other, on one connection). Each is `fido __chaos-role role=...`.
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

use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::fs::File;
use std::io::{BufRead, Write as _};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use anyhow::{bail, Context as _};
use fido::{Channel, Domain, Error, JoinOptions, Listener, Message, Msg, SendError, WaitStrategy};
use fido_bench::Record;
use serde_json::Value;

use fido_demo::pipeline::Args;
use fido_demo::proc;

const SUITE: &str = "chaos";
const SYSTEM: &str = "fido";
const MAGIC: u64 = 0x736f_6168_6364_6966; // "fidchaos"
const HDR: usize = 64;
const MAX_BODY: u64 = 16 << 10;
const SEQ_BITS: u32 = 40;
const SEQ_MASK: u64 = (1 << SEQ_BITS) - 1;
const ENTRIES: u32 = 64;
/// Environment variable naming the run: every helper carries it, so survivors
/// can be found in /proc.
const RUN_ENV: &str = "FIDO_CHAOS_RUN";

// ---------------------------------------------------------------------------
// Shared bits: RNG, message format
// ---------------------------------------------------------------------------

/// xorshift64* (Vigna), seeded through splitmix64.
#[derive(Clone)]
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        let mut z = seed.wrapping_add(0x9E37_79B9_7F4A_7C15);
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        Rng((z ^ (z >> 31)) | 1)
    }
    pub fn next(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        x.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    pub fn below(&mut self, n: u64) -> u64 {
        if n == 0 {
            0
        } else {
            self.next() % n
        }
    }
    pub fn range(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.below(hi.saturating_sub(lo) + 1)
    }
    fn chance(&mut self, p: f64) -> bool {
        (self.next() >> 11) as f64 / (1u64 << 53) as f64 <= p
    }
}

fn tag_of(stream: u64, seq: u64) -> u64 {
    (stream << SEQ_BITS) | (seq & SEQ_MASK)
}

fn split_tag(tag: u64) -> (u64, u64) {
    (tag >> SEQ_BITS, tag & SEQ_MASK)
}

#[inline]
fn mix(h: u64, w: u64) -> u64 {
    (h ^ w).wrapping_mul(0x9E37_79B9_7F4A_7C15).rotate_left(31)
}

/// Hash of one segment's payload bytes (words, then the tail).
fn hash_bytes(bytes: &[u8]) -> u64 {
    let mut h = 0x5851_F42D_4C95_7F2D ^ bytes.len() as u64;
    let mut chunks = bytes.chunks_exact(8);
    for c in &mut chunks {
        h = mix(h, u64::from_le_bytes(c.try_into().unwrap()));
    }
    let mut tail = [0u8; 8];
    let r = chunks.remainder();
    tail[..r.len()].copy_from_slice(r);
    mix(h, u64::from_le_bytes(tail) ^ ((r.len() as u64) << 56))
}

/// The end-to-end checksum: every payload byte after the header, segment by
/// segment, order-sensitive.
fn payload_hash<'a>(segments: impl Iterator<Item = &'a [u8]>) -> u64 {
    let mut h = 0xC0FF_EE00_D15E_A5E5u64;
    for (i, s) in segments.enumerate() {
        let body = if i == 0 { &s[HDR.min(s.len())..] } else { s };
        h = mix(h, hash_bytes(body) ^ (i as u64).rotate_left(48));
    }
    h ^ (h >> 33)
}

fn fill(bytes: &mut [u8], seed: u64) {
    let mut r = Rng::new(seed);
    let mut chunks = bytes.chunks_exact_mut(8);
    for c in &mut chunks {
        c.copy_from_slice(&r.next().to_le_bytes());
    }
    let w = r.next().to_le_bytes();
    let rem = chunks.into_remainder();
    let n = rem.len();
    rem.copy_from_slice(&w[..n]);
}

/// Builds a message of 1–3 segments from our arena, every byte written.
fn build(d: &Domain, rng: &mut Rng, tag: u64, ref_tag: u64) -> anyhow::Result<Message> {
    let body = rng.below(MAX_BODY + 1) as usize;
    let mut nseg = 1 + rng.below(3) as usize;
    if body < 2 {
        nseg = 1;
    }
    // Cut the body into nseg parts; every segment after the first non-empty.
    let mut lens = vec![0usize; nseg];
    let mut left = body;
    for (i, l) in lens.iter_mut().enumerate().skip(1) {
        let rest = nseg - i; // segments still to fill, this one included
        let max = left - (rest - 1);
        *l = 1 + rng.below(max.saturating_sub(1) as u64 / 2 + 1) as usize;
        *l = (*l).min(max);
        left -= *l;
    }
    lens[0] = HDR + left;
    let mut bufs = Vec::with_capacity(nseg);
    for (i, &l) in lens.iter().enumerate() {
        let mut b = d.alloc(l).context("allocating a message buffer")?;
        b.truncate(l);
        let start = if i == 0 { HDR } else { 0 };
        fill(&mut b[start..], tag ^ ((i as u64) << 60) ^ 0xA5A5);
        bufs.push(b);
    }
    let total: usize = lens.iter().sum();
    let h = payload_hash(bufs.iter().map(|b| &b[..]));
    let fields = [MAGIC, tag, total as u64, nseg as u64, h, ref_tag, 0, 0];
    for (i, f) in fields.iter().enumerate() {
        bufs[0][i * 8..i * 8 + 8].copy_from_slice(&f.to_le_bytes());
    }
    Ok(Message::gather(bufs).tag(tag))
}

/// Checks a received message against its header and descriptor; returns the
/// tag of the request it answers (0: none).
fn verify(m: &Msg) -> Result<u64, String> {
    let segs: Vec<&[u8]> = m.segments().collect();
    let Some(first) = segs.first() else {
        return Err("no segments".into());
    };
    if first.len() < HDR {
        return Err(format!(
            "first segment {} B, shorter than the header",
            first.len()
        ));
    }
    let w = |i: usize| u64::from_le_bytes(first[i * 8..i * 8 + 8].try_into().unwrap());
    if w(0) != MAGIC {
        return Err(format!("bad magic {:#x}", w(0)));
    }
    if w(1) != m.tag() {
        return Err(format!(
            "header tag {:#x} != descriptor tag {:#x}",
            w(1),
            m.tag()
        ));
    }
    if w(2) != m.len() as u64 {
        return Err(format!(
            "header length {} != descriptor length {}",
            w(2),
            m.len()
        ));
    }
    if w(3) != segs.len() as u64 {
        return Err(format!("header says {} segments, got {}", w(3), segs.len()));
    }
    let h = payload_hash(segs.iter().copied());
    if h != w(4) {
        return Err(format!("checksum {h:#x} != {:#x}", w(4)));
    }
    Ok(w(5))
}

// ---------------------------------------------------------------------------
// Roles (helper processes)
// ---------------------------------------------------------------------------

static STOP: AtomicBool = AtomicBool::new(false);
static WHO: std::sync::OnceLock<String> = std::sync::OnceLock::new();

fn epoch() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0)
}

/// A line in the role's log (its stderr): what happened to its connections.
fn elog(msg: impl std::fmt::Display) {
    eprintln!(
        "{:.6} {} {msg}",
        epoch(),
        WHO.get().map(|s| s.as_str()).unwrap_or("?")
    );
}

/// Announces the role: a `ready` record with its domain and slot.
fn ready(d: &Domain, j: &mut Journal) -> anyhow::Result<()> {
    let _ = WHO.set(format!("{}[d{} s{}]", d.name(), d.id(), d.slot()));
    elog(format_args!("ready (pid {})", std::process::id()));
    j.line(&format!("ready {} {}", d.id(), d.slot()));
    j.flush()
}

fn describe(c: &Channel) -> String {
    format!(
        "conn {} (peer d{} s{})",
        c.id(),
        c.peer().domain,
        c.peer().slot
    )
}

/// Where a received message's segments live: `d<from> [slot+offset ...]`.
fn whereabouts(m: &Msg) -> String {
    let segs: Vec<String> = m
        .global_segments()
        .map(|(g, len)| format!("{:#x}+{len}", g.addr()))
        .collect();
    format!("from d{} segments [{}]", m.from_domain(), segs.join(" "))
}
static EXIT: AtomicBool = AtomicBool::new(false);

fn stopping() -> bool {
    STOP.load(Ordering::Relaxed)
}
fn exiting() -> bool {
    EXIT.load(Ordering::Relaxed)
}

/// The driver's commands arrive on stdin: `stop` (drain, stop sending new
/// messages), `exit` or EOF (leave).
fn watch_stdin() -> anyhow::Result<()> {
    std::thread::Builder::new()
        .name("chaos-stdin".into())
        .spawn(|| {
            let stdin = std::io::stdin();
            for line in stdin.lock().lines() {
                match line.as_deref().map(str::trim) {
                    Ok("stop") => STOP.store(true, Ordering::Relaxed),
                    Ok("exit") | Err(_) => break,
                    Ok(_) => {}
                }
            }
            STOP.store(true, Ordering::Relaxed);
            EXIT.store(true, Ordering::Relaxed);
        })?;
    Ok(())
}

/// Records for the driver, written to stdout in one `write` per flush.
#[derive(Default)]
struct Journal {
    buf: String,
}

impl Journal {
    fn line(&mut self, s: &str) {
        self.buf.push_str(s);
        self.buf.push('\n');
    }
    fn tags(&mut self, kind: char, tags: impl IntoIterator<Item = u64>) {
        let mut n = 0;
        for t in tags {
            if n == 0 {
                self.buf.push(kind);
            }
            self.buf.push(' ');
            self.buf.push_str(&t.to_string());
            n += 1;
            if n == 256 {
                self.buf.push('\n');
                n = 0;
            }
        }
        if n > 0 {
            self.buf.push('\n');
        }
    }
    /// `R` with runs of consecutive tags as `a-b`.
    fn released(&mut self, tags: &[u64]) {
        let mut sorted = tags.to_vec();
        sorted.sort_unstable();
        let mut toks: Vec<String> = Vec::new();
        let mut i = 0;
        while i < sorted.len() {
            let mut j = i;
            while j + 1 < sorted.len() && sorted[j + 1] == sorted[j] + 1 {
                j += 1;
            }
            toks.push(if j > i {
                format!("{}-{}", sorted[i], sorted[j])
            } else {
                sorted[i].to_string()
            });
            i = j + 1;
        }
        for chunk in toks.chunks(256) {
            self.buf.push('R');
            for t in chunk {
                self.buf.push(' ');
                self.buf.push_str(t);
            }
            self.buf.push('\n');
        }
    }
    fn flush(&mut self) -> anyhow::Result<()> {
        if self.buf.is_empty() {
            return Ok(());
        }
        let mut out = std::io::stdout().lock();
        out.write_all(self.buf.as_bytes()).context("journal")?;
        out.flush().context("journal")?;
        self.buf.clear();
        Ok(())
    }
}

/// The error of a failed connection worth a journal record.
fn note_error(j: &mut Journal, what: &str, e: &Error) {
    if let Error::Protocol(why) = e {
        j.line(&format!("P {what}: {}", why.replace('\n', " ")));
    }
}

fn join_retry(name: &str, arena: u64) -> anyhow::Result<Domain> {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let opts = JoinOptions::new(name)
            .arena_len(arena)
            .ring_entries(ENTRIES)
            .wait(WaitStrategy::default());
        match Domain::join(opts) {
            Ok(d) => return Ok(d),
            Err(e) if Instant::now() < deadline && !exiting() => {
                tracing::debug!("join: {e}; retrying");
                std::thread::sleep(Duration::from_millis(50));
            }
            Err(e) => return Err(e).context("joining the broker (60 s of retries)"),
        }
    }
}

fn offer_retry(d: &Domain, service: &str) -> anyhow::Result<Listener> {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        match d.offer(service) {
            Ok(l) => return Ok(l),
            // ServiceTaken while the broker has not yet seen our previous
            // incarnation die; BrokerUnavailable while it restarts.
            Err(e) if Instant::now() < deadline && !exiting() => {
                tracing::debug!("offer {service}: {e}; retrying");
                std::thread::sleep(Duration::from_millis(50));
            }
            Err(e) => {
                return Err(e).with_context(|| format!("offering {service} (60 s of retries)"))
            }
        }
    }
}

/// Connects, retrying; `None` when asked to exit. Fails after 60 s of failures.
fn connect_retry(
    d: &Domain,
    service: &str,
    since: &mut Option<Instant>,
) -> anyhow::Result<Option<Channel>> {
    match d.connect(service) {
        Ok(c) => {
            *since = None;
            elog(format_args!("connected to {service}: {}", describe(&c)));
            Ok(Some(c))
        }
        Err(e) => {
            let t0 = *since.get_or_insert_with(Instant::now);
            if t0.elapsed() > Duration::from_secs(60) {
                return Err(e)
                    .with_context(|| format!("connecting to {service}: failing for 60 s"));
            }
            tracing::debug!("connect {service}: {e}; retrying");
            std::thread::sleep(Duration::from_millis(20));
            Ok(None)
        }
    }
}

/// How long a failed connection may take to settle (every message it carried
/// released or reported) before that counts as a problem.
const SETTLE: Duration = Duration::from_secs(10);

/// Waits until every message outstanding on a failed connection is either
/// released or handed back by `take_undelivered`. A peer that closed
/// gracefully keeps what it received valid and releases it later; only once it
/// is gone (or lied) does `take_undelivered` return what it never released. So
/// poll: done when `take_undelivered` hands something back (it hands back
/// everything unreleased at once) or nothing is in flight any more.
fn settle(ch: &Channel) -> (Vec<fido::Undelivered>, bool) {
    let deadline = Instant::now() + SETTLE;
    let mut und = Vec::new();
    loop {
        let u = ch.take_undelivered();
        let got = !u.is_empty();
        und.extend(u);
        if got || ch.in_flight() == 0 {
            return (und, true);
        }
        if Instant::now() > deadline {
            return (und, false);
        }
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// A connection failed: waits until it settles, journals what
/// `take_undelivered` reports and what we therefore know was released; returns
/// the undelivered messages.
fn fail_channel(
    ch: Channel,
    why: &Error,
    on_ch: &mut Vec<u64>,
    j: &mut Journal,
    origin: bool,
) -> Vec<(u64, Message)> {
    let t0 = Instant::now();
    let (mut und, settled) = settle(&ch);
    elog(format_args!(
        "{} failed: {why}; {} undelivered reported, {} outstanding on it; settled in {:.1} ms",
        describe(&ch),
        und.len(),
        on_ch.len(),
        t0.elapsed().as_secs_f64() * 1e3
    ));
    if !settled {
        j.line(&format!(
            "A {} failed ({why}) but after {SETTLE:?} {} of its messages are neither released nor reported undelivered",
            describe(&ch),
            ch.in_flight()
        ));
    }
    und.sort_by_key(|u| u.tag);
    let reported: HashSet<u64> = und.iter().map(|u| u.tag).collect();
    j.tags('U', und.iter().map(|u| u.tag));
    let outstanding: HashSet<u64> = on_ch.iter().copied().collect();
    for t in &reported {
        if !outstanding.contains(t) {
            j.line(&format!(
                "A take_undelivered returned tag {t} which was not outstanding on this connection (already confirmed released, or never sent on it)"
            ));
        }
    }
    if origin && settled {
        let released: Vec<u64> = on_ch
            .iter()
            .copied()
            .filter(|t| !reported.contains(t))
            .collect();
        j.released(&released);
    }
    on_ch.clear();
    drop(ch);
    und.into_iter().map(|u| (u.tag, u.message)).collect()
}

/// `fido __chaos-role role=... key=value...`
pub fn role_main(args: &[String]) -> anyhow::Result<()> {
    proc::child_prologue()?;
    watch_stdin()?;
    let a = Args::parse(args);
    let r = match a.get("role")? {
        "source" => sender(&a, false),
        "echo-client" => sender(&a, true),
        "fwd" => forwarder(&a),
        "sink" => sink(&a),
        "echo-server" => echo_server(&a),
        r => bail!("unknown chaos role {r}"),
    };
    // Leave promptly whatever happened; the driver reads the exit status.
    let _ = std::io::stdout().flush();
    r
}

/// A source (or the echo client): sends new messages at `rate`, resends what
/// `take_undelivered` reports (and only that), and — as echo client — checks
/// the replies.
fn sender(a: &Args, echo: bool) -> anyhow::Result<()> {
    let stream: u64 = a.num("stream")?;
    let rate: f64 = a.num("rate")?;
    let next = a.get("next")?;
    let seed: u64 = a.num("seed")?;
    let d = join_retry(a.get("name")?, 32 << 20)?;
    let mut j = Journal::default();
    ready(&d, &mut j)?;
    let mut rng = Rng::new(seed ^ stream.rotate_left(17));
    let interval = Duration::from_secs_f64(1.0 / rate.max(1.0));
    let mut due = Instant::now();
    let mut ch: Option<Channel> = None;
    let mut on_ch: Vec<u64> = Vec::new();
    let mut pending: VecDeque<(Message, bool)> = VecDeque::new();
    let mut seq = 0u64;
    let mut done = false;
    let mut conn_fail: Option<Instant> = None;
    let send_wait = Duration::from_millis(if echo { 5 } else { 50 });
    while !exiting() {
        let draining = stopping();
        let c = match &ch {
            Some(c) => c,
            None => {
                ch = connect_retry(&d, next, &mut conn_fail)?;
                continue;
            }
        };
        // Replies first (echo): they are what frees the server's window.
        let mut failed: Option<Error> = None;
        if echo {
            let mut got = Vec::new();
            while got.len() < 64 {
                match c.try_recv() {
                    Ok(Some(m)) => got.push(m),
                    Ok(None) => break,
                    Err(e) => {
                        failed = Some(e);
                        break;
                    }
                }
            }
            let mut ok = Vec::new();
            for m in &got {
                match verify(m) {
                    Ok(r) if split_tag(r).0 == stream => ok.push(m.tag()),
                    Ok(r) => j.line(&format!(
                        "C {} reply to {r:#x}, not to one of our requests",
                        m.tag()
                    )),
                    Err(why) => {
                        elog(format_args!(
                            "corrupted reply {:#x}: {why}; {}",
                            m.tag(),
                            whereabouts(m)
                        ));
                        j.line(&format!("C {} {why}", m.tag()))
                    }
                }
            }
            j.tags('D', ok);
            j.flush()?;
            drop(got);
        }
        if failed.is_none() && !c.is_open() {
            failed = Some(Error::Invalid("is_open() turned false".into()));
        }
        if let Some(e) = failed {
            note_error(&mut j, "connection to the next hop", &e);
            let c = ch.take().expect("checked");
            for (_, m) in fail_channel(c, &e, &mut on_ch, &mut j, true) {
                pending.push_back((m, true));
            }
            j.flush()?;
            continue;
        }
        // Everything sent on this connection is released once nothing is in flight.
        if !on_ch.is_empty() && c.in_flight() == 0 {
            j.released(&on_ch);
            on_ch.clear();
        }
        let now = Instant::now();
        let next_msg = if let Some(p) = pending.pop_front() {
            Some(p)
        } else if !draining && now >= due {
            due = if now.duration_since(due) > Duration::from_millis(100) {
                now + interval
            } else {
                due + interval
            };
            seq += 1;
            let tag = tag_of(stream, seq);
            j.line(&format!("S {stream} {seq}"));
            Some((build(&d, &mut rng, tag, 0)?, false))
        } else {
            None
        };
        let Some((msg, reported)) = next_msg else {
            if draining && pending.is_empty() && on_ch.is_empty() && !done {
                j.line("done");
                done = true;
            }
            j.flush()?;
            let wait = due
                .saturating_duration_since(Instant::now())
                .min(Duration::from_millis(2));
            std::thread::sleep(wait.max(Duration::from_micros(200)));
            continue;
        };
        // The announcement reaches the driver before the message can reach anyone.
        j.flush()?;
        let tag = msg.get_tag();
        match c.send_timeout(msg, send_wait) {
            Ok(()) => {
                on_ch.push(tag);
                if reported {
                    j.tags('X', [tag]);
                }
            }
            Err(SendError {
                error: Error::Timeout | Error::WouldBlock,
                message,
            }) => pending.push_front((message, reported)),
            Err(SendError { error, message }) => {
                note_error(&mut j, "send", &error);
                pending.push_front((message, reported));
                let c = ch.take().expect("checked");
                for (_, m) in fail_channel(c, &error, &mut on_ch, &mut j, true) {
                    pending.push_back((m, true));
                }
            }
        }
        j.flush()?;
    }
    j.flush()?;
    Ok(())
}

/// A forwarder: `recv` from upstream, `forward` downstream (same pointers);
/// what the downstream reports undelivered is forwarded again once a new
/// downstream is there. While it has no downstream it reads nothing upstream.
fn forwarder(a: &Args) -> anyhow::Result<()> {
    let next = a.get("next")?;
    let d = join_retry(a.get("name")?, 4 << 20)?;
    let listener = offer_retry(&d, a.get("listen")?)?;
    let mut j = Journal::default();
    ready(&d, &mut j)?;
    let mut up: Option<Channel> = None;
    let mut down: Option<Channel> = None;
    let mut held: VecDeque<(Message, bool)> = VecDeque::new();
    let mut on_down: Vec<u64> = Vec::new();
    let mut conn_fail: Option<Instant> = None;
    while !exiting() {
        let dn = match &down {
            Some(c) => c,
            None => {
                down = connect_retry(&d, next, &mut conn_fail)?;
                continue;
            }
        };
        if !on_down.is_empty() && dn.in_flight() == 0 {
            on_down.clear();
        }
        let mut failed: Option<Error> = if dn.is_open() {
            None
        } else {
            Some(Error::Invalid("is_open() turned false".into()))
        };
        if failed.is_none() {
            if let Some((m, reported)) = held.pop_front() {
                let tag = m.get_tag();
                match dn.send_timeout(m, Duration::from_millis(50)) {
                    Ok(()) => {
                        on_down.push(tag);
                        if reported {
                            j.tags('X', [tag]);
                            j.flush()?;
                        }
                    }
                    Err(SendError {
                        error: Error::Timeout | Error::WouldBlock,
                        message,
                    }) => held.push_front((message, reported)),
                    Err(SendError { error, message }) => {
                        held.push_front((message, reported));
                        failed = Some(error);
                    }
                }
                if failed.is_none() {
                    continue;
                }
            }
        }
        if let Some(e) = failed {
            note_error(&mut j, "downstream", &e);
            let c = down.take().expect("checked");
            for (_, m) in fail_channel(c, &e, &mut on_down, &mut j, false) {
                held.push_back((m, true));
            }
            j.flush()?;
            continue;
        }
        let u = match &up {
            Some(u) => u,
            None => {
                match listener.accept_timeout(Duration::from_millis(50)) {
                    Ok(c) => {
                        elog(format_args!("accepted {}", describe(&c)));
                        up = Some(c);
                    }
                    Err(Error::Timeout) => {}
                    Err(e) => return Err(e).context("accepting upstream"),
                }
                continue;
            }
        };
        match u.recv_timeout(Duration::from_millis(50)) {
            Ok(m) => held.push_back((Message::from(m), false)),
            Err(Error::Timeout) => {}
            Err(e) => {
                note_error(&mut j, "upstream", &e);
                j.flush()?;
                elog(format_args!("upstream {}: {e}", describe(u)));
                up = None;
            }
        }
    }
    if !held.is_empty() {
        j.line(&format!(
            "A forwarder exits holding {} messages",
            held.len()
        ));
    }
    j.flush()?;
    Ok(())
}

/// Receives a batch, journals it, then releases it.
fn receive_batch(u: &Channel, first: Msg, j: &mut Journal) -> anyhow::Result<()> {
    let mut batch = vec![first];
    while batch.len() < 64 {
        match u.try_recv() {
            Ok(Some(m)) => batch.push(m),
            _ => break, // errors show up on the next recv
        }
    }
    let mut ok = Vec::with_capacity(batch.len());
    for m in &batch {
        match verify(m) {
            Ok(_) => ok.push(m.tag()),
            Err(why) => {
                elog(format_args!(
                    "corrupted message {:#x} on {}: {why}; {}",
                    m.tag(),
                    describe(u),
                    whereabouts(m)
                ));
                j.line(&format!("C {} {why}", m.tag()))
            }
        }
    }
    j.tags('D', ok);
    j.flush()?;
    drop(batch);
    Ok(())
}

fn sink(a: &Args) -> anyhow::Result<()> {
    let d = join_retry(a.get("name")?, 4 << 20)?;
    let listener = offer_retry(&d, a.get("listen")?)?;
    let mut j = Journal::default();
    ready(&d, &mut j)?;
    let mut up: Option<Channel> = None;
    while !exiting() {
        let u = match &up {
            Some(u) => u,
            None => {
                match listener.accept_timeout(Duration::from_millis(50)) {
                    Ok(c) => {
                        elog(format_args!("accepted {}", describe(&c)));
                        up = Some(c);
                    }
                    Err(Error::Timeout) => {}
                    Err(e) => return Err(e).context("accepting upstream"),
                }
                continue;
            }
        };
        match u.recv_timeout(Duration::from_millis(50)) {
            Ok(m) => receive_batch(u, m, &mut j)?,
            Err(Error::Timeout) => {}
            Err(e) => {
                note_error(&mut j, "upstream", &e);
                j.flush()?;
                elog(format_args!("upstream {}: {e}", describe(u)));
                up = None;
            }
        }
    }
    j.flush()?;
    Ok(())
}

/// Echo server: checks each request (it is their final receiver), answers
/// with a new message of its own stream; replies that come back undelivered
/// (the client died) are reported and dropped — their requester is gone.
fn echo_server(a: &Args) -> anyhow::Result<()> {
    let stream: u64 = a.num("stream")?;
    let seed: u64 = a.num("seed")?;
    let d = join_retry(a.get("name")?, 32 << 20)?;
    let listener = offer_retry(&d, a.get("listen")?)?;
    let mut j = Journal::default();
    ready(&d, &mut j)?;
    let mut rng = Rng::new(seed ^ stream.rotate_left(17));
    let mut up: Option<Channel> = None;
    let mut reply: Option<Message> = None;
    let mut on_ch: Vec<u64> = Vec::new();
    let mut seq = 0u64;
    let mut done = false;
    while !exiting() {
        if stopping() && reply.is_none() && on_ch.is_empty() && !done {
            j.line("done");
            j.flush()?;
            done = true;
        }
        let c = match &up {
            Some(c) => c,
            None => {
                match listener.accept_timeout(Duration::from_millis(20)) {
                    Ok(c) => {
                        elog(format_args!("accepted {}", describe(&c)));
                        up = Some(c);
                    }
                    Err(Error::Timeout) => {}
                    Err(e) => return Err(e).context("accepting a client"),
                }
                continue;
            }
        };
        if !on_ch.is_empty() && c.in_flight() == 0 {
            j.released(&on_ch);
            on_ch.clear();
        }
        let mut failed: Option<Error> = None;
        if let Some(r) = reply.take() {
            let tag = r.get_tag();
            match c.send_timeout(r, Duration::from_millis(5)) {
                Ok(()) => on_ch.push(tag),
                Err(SendError {
                    error: Error::Timeout | Error::WouldBlock,
                    message,
                }) => reply = Some(message),
                Err(SendError { error, message }) => {
                    // Handed back unsent: reported to us, dropped.
                    j.tags('U', [message.get_tag()]);
                    failed = Some(error);
                }
            }
        }
        if failed.is_none() && reply.is_none() {
            match c.recv_timeout(Duration::from_millis(5)) {
                Ok(m) => {
                    match verify(&m) {
                        Ok(_) => {
                            j.tags('D', [m.tag()]);
                            seq += 1;
                            j.line(&format!("S {stream} {seq}"));
                            reply = Some(build(&d, &mut rng, tag_of(stream, seq), m.tag())?);
                        }
                        Err(why) => {
                            elog(format_args!(
                                "corrupted request {:#x}: {why}; {}",
                                m.tag(),
                                whereabouts(&m)
                            ));
                            j.line(&format!("C {} {why}", m.tag()))
                        }
                    }
                    j.flush()?;
                    drop(m);
                }
                Err(Error::Timeout) => {}
                Err(e) => failed = Some(e),
            }
        }
        if failed.is_none() && !c.is_open() {
            failed = Some(Error::Invalid("is_open() turned false".into()));
        }
        if let Some(e) = failed {
            note_error(&mut j, "client", &e);
            let c = up.take().expect("checked");
            drop(fail_channel(c, &e, &mut on_ch, &mut j, true));
            if let Some(r) = reply.take() {
                j.tags('U', [r.get_tag()]);
            }
        }
        j.flush()?;
    }
    j.flush()?;
    Ok(())
}

// ---------------------------------------------------------------------------
// Driver
// ---------------------------------------------------------------------------

/// `fido bench chaos` options.
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

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Kind {
    Source,
    Fwd,
    Sink,
    EchoServer,
    EchoClient,
}

impl Kind {
    fn role(self) -> &'static str {
        match self {
            Kind::Source => "source",
            Kind::Fwd => "fwd",
            Kind::Sink => "sink",
            Kind::EchoServer => "echo-server",
            Kind::EchoClient => "echo-client",
        }
    }
    /// Has a stream of its own (each incarnation a new one).
    fn sends(self) -> bool {
        matches!(self, Kind::Source | Kind::EchoServer | Kind::EchoClient)
    }
    /// Resends what is reported undelivered.
    fn resends(self) -> bool {
        matches!(self, Kind::Source | Kind::EchoClient)
    }
}

struct Spec {
    name: &'static str,
    kind: Kind,
    /// Pipeline index (for stalls and recovery).
    group: usize,
    /// Its deliveries are the group's end-to-end progress.
    terminal: bool,
    listen: Option<String>,
    next: Option<String>,
}

const GROUPS: [&str; 3] = ["A", "B", "echo"];

fn specs(run: &str) -> Vec<Spec> {
    let svc = |s: &str| Some(format!("chaos-{s}-{run}"));
    let s = |name, kind, group, terminal, listen: Option<String>, next: Option<String>| Spec {
        name,
        kind,
        group,
        terminal,
        listen,
        next,
    };
    vec![
        s("sinkA", Kind::Sink, 0, true, svc("sinkA"), None),
        s("fwdA", Kind::Fwd, 0, false, svc("fwdA"), svc("sinkA")),
        s("srcA", Kind::Source, 0, false, None, svc("fwdA")),
        s("sinkB", Kind::Sink, 1, true, svc("sinkB"), None),
        s("fwdB2", Kind::Fwd, 1, false, svc("fwdB2"), svc("sinkB")),
        s("fwdB1", Kind::Fwd, 1, false, svc("fwdB1"), svc("fwdB2")),
        s("srcB", Kind::Source, 1, false, None, svc("fwdB1")),
        s("echo-server", Kind::EchoServer, 2, false, svc("echo"), None),
        s("echo-client", Kind::EchoClient, 2, true, None, svc("echo")),
    ]
}

enum Ev {
    Line(u64, String),
}

/// One incarnation of a role.
struct Running {
    inst: u64,
    child: Child,
    stdin: Option<ChildStdin>,
    reader: Option<JoinHandle<()>>,
    stream: Option<u64>,
    ready_at: Option<Instant>,
    done: bool,
}

#[derive(Clone, Copy, Default)]
struct Cell {
    delivered: u16,
    corrupt: u16,
    reported: u16,
    resent: u16,
    released: bool,
}

struct StreamLedger {
    announced: u64,
    cells: Vec<Cell>,
    killed: bool,
    done: bool,
    resends: bool,
}

#[derive(Default)]
struct Ledger {
    streams: HashMap<u64, StreamLedger>,
    phantom: u64,
    corrupted: u64,
    protocol: u64,
    inconsistent: u64,
    problems: Vec<String>,
    logged: u64,
}

impl Ledger {
    fn problem(&mut self, s: String) {
        // A livelock can repeat one problem millions of times: keep the
        // timeline readable.
        self.logged += 1;
        if self.logged <= 5000 {
            tl(format_args!("PROBLEM {s}"));
        } else if self.logged == 5001 {
            tl("PROBLEM ... (further problems are counted, not logged)");
        }
        if self.problems.len() < 40 {
            eprintln!("chaos: {s}");
            self.problems.push(s);
        }
    }

    fn cell(&mut self, tag: u64) -> Option<&mut Cell> {
        let (stream, seq) = split_tag(tag);
        let st = self.streams.get_mut(&stream)?;
        if seq == 0 || seq > st.cells.len() as u64 + 10_000_000 {
            return None;
        }
        if seq as usize > st.cells.len() {
            st.cells.resize(seq as usize, Cell::default());
        }
        Some(&mut st.cells[seq as usize - 1])
    }

    fn each(&mut self, tag: u64, who: &str, f: impl FnOnce(&mut Cell)) {
        match self.cell(tag) {
            Some(c) => f(c),
            None => {
                self.phantom += 1;
                self.problem(format!(
                    "{who}: record for unknown message {tag:#x} (stream {}, seq {})",
                    tag >> SEQ_BITS,
                    tag & SEQ_MASK
                ));
            }
        }
    }
}

fn parse_tags(rest: &str) -> impl Iterator<Item = u64> + '_ {
    rest.split_ascii_whitespace().filter_map(|t| t.parse().ok())
}

/// Every message's fate, summed.
#[derive(Default, Debug)]
struct Totals {
    messages: u64,
    delivered: u64,
    released: u64,
    reported: u64,
    resent: u64,
    redelivered_reported: u64,
    duplicated_silent: u64,
    lost_released: u64,
    lost_unaccounted: u64,
    dropped_reported: u64,
    unconfirmed_killed: u64,
    undrained: u64,
    corrupted: u64,
    streams: u64,
}

impl Ledger {
    fn totals(&mut self) -> Totals {
        let mut t = Totals {
            corrupted: self.corrupted + self.phantom,
            ..Default::default()
        };
        let mut probs = Vec::new();
        for (id, s) in &self.streams {
            t.streams += 1;
            let n = s.announced.max(s.cells.len() as u64);
            for seq in 1..=n {
                let c = s.cells.get(seq as usize - 1).copied().unwrap_or_default();
                if seq > s.announced {
                    if c.delivered > 0 || c.corrupt > 0 {
                        t.corrupted += (c.delivered + c.corrupt) as u64;
                        probs.push(format!(
                            "stream {id} seq {seq}: delivered but never announced (phantom)"
                        ));
                    }
                    continue;
                }
                t.messages += 1;
                t.delivered += c.delivered as u64;
                t.reported += c.reported as u64;
                t.resent += c.resent as u64;
                if c.delivered > 1 {
                    let extra = (c.delivered - 1) as u64;
                    let rep = extra.min(c.reported as u64);
                    t.redelivered_reported += rep;
                    if extra > rep {
                        t.duplicated_silent += extra - rep;
                        probs.push(format!("stream {id} seq {seq}: delivered {} times, reported undelivered {} times", c.delivered, c.reported));
                    }
                }
                if c.released {
                    t.released += 1;
                    if c.delivered == 0 && c.corrupt == 0 {
                        t.lost_released += 1;
                        probs.push(format!(
                            "stream {id} seq {seq}: confirmed released but never delivered"
                        ));
                    }
                } else if s.done {
                    if c.reported > 0 && !s.resends {
                        t.dropped_reported += 1;
                    } else {
                        t.lost_unaccounted += 1;
                        probs.push(format!(
                            "stream {id} seq {seq}: sender drained, yet neither released nor reported ({} deliveries, {} reports)",
                            c.delivered, c.reported
                        ));
                    }
                } else if s.killed {
                    t.unconfirmed_killed += 1;
                } else {
                    t.undrained += 1;
                }
            }
        }
        for p in probs {
            self.problem(p);
        }
        t
    }
}

/// Recovery measurement: after a kill at `t`, the first delivery in `group`
/// once the replacement is ready.
struct Recovery {
    group: usize,
    killed_at: Instant,
    /// Role index whose replacement must be ready first (`None`: the broker).
    role: Option<usize>,
    broker: bool,
}

struct Fleet {
    exe: PathBuf,
    token: String,
    socket: PathBuf,
    state: PathBuf,
    logs: PathBuf,
    seed: u64,
    rate: f64,
    specs: Vec<Spec>,
    running: Vec<Option<Running>>,
    broker: Option<Child>,
    broker_ready_at: Option<Instant>,
    tx: mpsc::Sender<Ev>,
    rx: mpsc::Receiver<Ev>,
    inst_role: HashMap<u64, usize>,
    next_inst: u64,
    next_stream: u64,
    ledger: Ledger,
    last_delivery: [Instant; 3],
    stalled: [bool; 3],
    recoveries: Vec<Recovery>,
    recovery_domain_ms: Vec<u64>,
    recovery_broker_ms: Vec<u64>,
    kills: BTreeMap<&'static str, u64>,
    broker_restarts: u64,
    unexpected_exits: u64,
    stalls: u64,
    /// `FIDO_CHAOS_TRACE=1`: copy every journal record into driver.log.
    trace: bool,
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

impl Fleet {
    fn start_broker(&mut self) -> anyhow::Result<()> {
        use std::os::unix::process::CommandExt as _;
        let mut cmd = Command::new(&self.exe);
        cmd.arg("broker")
            .arg("--state-dir")
            .arg(&self.state)
            .arg("--socket")
            .arg(&self.socket)
            .env(RUN_ENV, &self.token)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log_file(&self.logs, "broker")?);
        // SAFETY: prctl(PR_SET_PDEATHSIG) is async-signal-safe; the closure
        // touches nothing else. The broker dies with us (we spawn only from
        // the main thread, which lives until the end).
        unsafe {
            cmd.pre_exec(|| {
                rustix::process::set_parent_process_death_signal(Some(
                    rustix::process::Signal::KILL,
                ))
                .map_err(std::io::Error::from)
            });
        }
        let child = cmd.spawn().context("spawning the broker")?;
        tl(format_args!("broker started, pid {}", child.id()));
        self.broker = Some(child);
        self.broker_ready_at = None;
        let deadline = Instant::now() + Duration::from_secs(20);
        while !proc::broker_reachable(&self.socket) {
            proc::check_interrupt()?;
            if let Some(st) = self.broker.as_mut().unwrap().try_wait()? {
                self.broker = None;
                bail!("the broker exited at start: {st} (see its log)");
            }
            if Instant::now() > deadline {
                bail!("the broker did not listen within 20 s");
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        self.broker_ready_at = Some(Instant::now());
        Ok(())
    }

    fn kill_broker(&mut self) -> anyhow::Result<()> {
        if let Some(mut c) = self.broker.take() {
            let _ = c.kill();
            c.wait().context("reaping the broker")?;
            tl(format_args!("broker pid {} killed", c.id()));
        }
        Ok(())
    }

    fn broker_pid(&self) -> Option<u32> {
        self.broker.as_ref().map(|c| c.id())
    }

    fn start_role(&mut self, i: usize) -> anyhow::Result<()> {
        let spec = &self.specs[i];
        let inst = self.next_inst;
        self.next_inst += 1;
        let stream = spec.kind.sends().then(|| {
            self.next_stream += 1;
            self.next_stream
        });
        let mut args = vec![
            "__chaos-role".to_string(),
            format!("role={}", spec.kind.role()),
            format!("name=chaos-{}", spec.name),
            format!("seed={}", self.seed),
        ];
        if let Some(s) = stream {
            args.push(format!("stream={s}"));
        }
        if let Some(l) = &spec.listen {
            args.push(format!("listen={l}"));
        }
        if let Some(n) = &spec.next {
            args.push(format!("next={n}"));
        }
        let rate = if spec.kind == Kind::EchoClient {
            self.rate / 2.0
        } else {
            self.rate
        };
        args.push(format!("rate={rate}"));
        let mut child = Command::new(&self.exe)
            .args(&args)
            .env("FIDO_BROKER", &self.socket)
            .env("FIDO_CLI_PARENT", std::process::id().to_string())
            .env(RUN_ENV, &self.token)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(log_file(&self.logs, spec.name)?)
            .spawn()
            .with_context(|| format!("spawning {}", spec.name))?;
        let out = child.stdout.take().expect("piped");
        let stdin = child.stdin.take();
        let tx = self.tx.clone();
        let reader = fido_demo::proc::read_lines(&mut child, format!("chaos-{}", spec.name), out, move |line| match line {
            Some(s) => tx.send(Ev::Line(inst, s)).is_ok(),
            None => false,
        })?;
        if let Some(s) = stream {
            self.ledger.streams.insert(
                s,
                StreamLedger {
                    announced: 0,
                    cells: Vec::new(),
                    killed: false,
                    done: false,
                    resends: spec.kind.resends(),
                },
            );
        }
        self.inst_role.insert(inst, i);
        tl(format_args!(
            "{} inst {inst} started, pid {}, stream {stream:?}",
            spec.name,
            child.id()
        ));
        self.running[i] = Some(Running {
            inst,
            child,
            stdin,
            reader: Some(reader),
            stream,
            ready_at: None,
            done: false,
        });
        Ok(())
    }

    /// Kills (if still running) and reaps a role, reads the rest of its
    /// journal; returns its exit status.
    fn stop_role(&mut self, i: usize, kill: bool) -> anyhow::Result<Option<ExitStatus>> {
        let Some(mut r) = self.running[i].take() else {
            return Ok(None);
        };
        if kill {
            let _ = r.child.kill();
            tl(format_args!(
                "{} inst {} pid {} killed",
                self.specs[i].name,
                r.inst,
                r.child.id()
            ));
        }
        drop(r.stdin.take());
        let st = r
            .child
            .wait()
            .with_context(|| format!("reaping {}", self.specs[i].name))?;
        if let Some(h) = r.reader.take() {
            let _ = h.join();
        }
        self.pump(Duration::ZERO);
        if let Some(s) = r.stream {
            if let Some(l) = self.ledger.streams.get_mut(&s) {
                // A sender that drained has accounted for everything it sent.
                l.killed = !l.done;
            }
        }
        Ok(Some(st))
    }

    fn send_cmd(&mut self, i: usize, cmd: &str) {
        if let Some(r) = self.running[i].as_mut() {
            if let Some(s) = r.stdin.as_mut() {
                let _ = s.write_all(format!("{cmd}\n").as_bytes());
                let _ = s.flush();
            }
        }
    }

    /// Processes journal records for up to `wait`.
    fn pump(&mut self, wait: Duration) {
        let deadline = Instant::now() + wait;
        loop {
            let ev = match self.rx.try_recv() {
                Ok(ev) => ev,
                Err(_) => {
                    let left = deadline.saturating_duration_since(Instant::now());
                    if left.is_zero() {
                        return;
                    }
                    match self.rx.recv_timeout(left) {
                        Ok(ev) => ev,
                        Err(_) => return,
                    }
                }
            };
            let Ev::Line(inst, line) = ev;
            self.handle(inst, &line);
        }
    }

    fn handle(&mut self, inst: u64, line: &str) {
        let Some(&i) = self.inst_role.get(&inst) else {
            return;
        };
        let now = Instant::now();
        let who = self.specs[i].name;
        if self.trace {
            tl(format_args!("{who}/{inst}: {line}"));
        }
        let (kind, rest) = line.split_once(' ').unwrap_or((line, ""));
        let current = self.running[i].as_ref().is_some_and(|r| r.inst == inst);
        match kind {
            "ready" => {
                tl(format_args!("{who} inst {inst} ready: domain/slot {rest}"));
                if current {
                    self.running[i].as_mut().unwrap().ready_at = Some(now);
                }
            }
            "done" => {
                if current {
                    let r = self.running[i].as_mut().unwrap();
                    r.done = true;
                    if let Some(s) = r.stream {
                        if let Some(l) = self.ledger.streams.get_mut(&s) {
                            l.done = true;
                        }
                    }
                }
            }
            "S" => {
                let mut it = parse_tags(rest);
                if let (Some(stream), Some(seq)) = (it.next(), it.next()) {
                    if let Some(l) = self.ledger.streams.get_mut(&stream) {
                        l.announced = l.announced.max(seq);
                    }
                }
            }
            "D" => {
                let mut n = 0;
                for t in parse_tags(rest) {
                    n += 1;
                    self.ledger
                        .each(t, who, |c| c.delivered = c.delivered.saturating_add(1));
                }
                if n > 0 && self.specs[i].terminal {
                    self.delivered_in(self.specs[i].group, now);
                }
            }
            "C" => {
                self.ledger.corrupted += 1;
                let tag = rest
                    .split_ascii_whitespace()
                    .next()
                    .and_then(|t| t.parse().ok())
                    .unwrap_or(0);
                if let Some(c) = self.ledger.cell(tag) {
                    c.corrupt = c.corrupt.saturating_add(1);
                }
                self.ledger
                    .problem(format!("{who}: corrupted message: {rest}"));
            }
            "U" => {
                for t in parse_tags(rest) {
                    self.ledger
                        .each(t, who, |c| c.reported = c.reported.saturating_add(1));
                }
            }
            "X" => {
                for t in parse_tags(rest) {
                    self.ledger
                        .each(t, who, |c| c.resent = c.resent.saturating_add(1));
                }
            }
            "R" => {
                for tok in rest.split_ascii_whitespace() {
                    let (a, b) = match tok.split_once('-') {
                        Some((a, b)) => (a.parse().unwrap_or(0), b.parse().unwrap_or(0)),
                        None => {
                            let a = tok.parse().unwrap_or(0);
                            (a, a)
                        }
                    };
                    for t in a..=b.min(a + 1_000_000) {
                        self.ledger.each(t, who, |c| c.released = true);
                    }
                }
            }
            "P" => {
                self.ledger.protocol += 1;
                self.ledger.problem(format!(
                    "{who}: protocol error between honest peers: {rest}"
                ));
            }
            "A" => {
                self.ledger.inconsistent += 1;
                self.ledger.problem(format!("{who}: {rest}"));
            }
            _ => self
                .ledger
                .problem(format!("{who}: unexpected output: {line}")),
        }
    }

    fn delivered_in(&mut self, group: usize, now: Instant) {
        self.last_delivery[group] = now;
        self.stalled[group] = false;
        let mut keep = Vec::new();
        for r in std::mem::take(&mut self.recoveries) {
            let ready = match r.role {
                Some(i) => self.running[i].as_ref().and_then(|x| x.ready_at),
                None => self.broker_ready_at,
            };
            if r.group == group && ready.is_some_and(|t| t <= now) {
                let ms = now.duration_since(r.killed_at).as_millis() as u64;
                if r.broker {
                    self.recovery_broker_ms.push(ms);
                } else {
                    self.recovery_domain_ms.push(ms);
                }
            } else {
                keep.push(r);
            }
        }
        self.recoveries = keep;
    }

    /// Restarts roles (and the broker) that exited on their own: a crash.
    fn reap_unexpected(&mut self) -> anyhow::Result<()> {
        if let Some(c) = self.broker.as_mut() {
            if let Some(st) = c.try_wait()? {
                self.broker = None;
                self.unexpected_exits += 1;
                self.ledger
                    .problem(format!("the broker exited on its own: {st}"));
                self.start_broker()?;
            }
        }
        for i in 0..self.specs.len() {
            let exited = match self.running[i].as_mut() {
                Some(r) => r.child.try_wait()?.is_some(),
                None => false,
            };
            if exited {
                let st = self.stop_role(i, false)?;
                self.unexpected_exits += 1;
                self.ledger.problem(format!(
                    "{} exited on its own ({}); see its log",
                    self.specs[i].name,
                    st.map(|s| s.to_string()).unwrap_or_default()
                ));
                self.start_role(i)?;
            }
        }
        Ok(())
    }

    fn all_ready(&self) -> bool {
        self.broker.is_some()
            && self
                .running
                .iter()
                .all(|r| r.as_ref().is_some_and(|r| r.ready_at.is_some()))
    }

    fn check_stalls(&mut self, limit: Duration) {
        let now = Instant::now();
        for (g, group) in GROUPS.iter().enumerate() {
            if !self.stalled[g] && now.duration_since(self.last_delivery[g]) > limit {
                self.stalled[g] = true;
                self.stalls += 1;
                self.ledger.problem(format!(
                    "pipeline {group} delivered nothing for {:.0} s (stall); broker status: {}",
                    limit.as_secs_f64(),
                    self.status_json()
                        .map(|v| v.to_string())
                        .unwrap_or_else(|e| format!("{e:#}"))
                ));
            }
        }
    }

    /// `fido status --json` against our broker, in a child process.
    fn status_json(&self) -> anyhow::Result<Value> {
        let mut child = Command::new(&self.exe)
            .args(["status", "--json", "--socket"])
            .arg(&self.socket)
            .env(RUN_ENV, &self.token)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .context("spawning fido status")?;
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            if child.try_wait()?.is_some() {
                break;
            }
            if Instant::now() > deadline {
                let _ = child.kill();
                let _ = child.wait();
                bail!("fido status did not answer within 20 s");
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        let out = child.wait_with_output()?;
        if !out.status.success() {
            bail!(
                "fido status: {} {}",
                out.status,
                String::from_utf8_lossy(&out.stderr).trim()
            );
        }
        Ok(serde_json::from_slice(&out.stdout)?)
    }

    fn kill_all(&mut self) {
        for i in 0..self.running.len() {
            let _ = self.stop_role(i, true);
        }
        let _ = self.kill_broker();
    }
}

impl Drop for Fleet {
    fn drop(&mut self) {
        self.kill_all();
    }
}

fn fd_count(pid: &str) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .map(|d| d.count())
        .unwrap_or(0)
}

fn memfd_count(pid: &str) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .map(|d| {
            d.flatten()
                .filter(|e| {
                    std::fs::read_link(e.path())
                        .is_ok_and(|l| l.to_string_lossy().starts_with("/memfd:"))
                })
                .count()
        })
        .unwrap_or(0)
}

/// Arenas mapped read-only by a role whose owner is not a live role: the
/// arena of a dead domain kept alive (its memory is not freed while mapped).
/// A domain's own arena is its one `rw-s` mapping of a `memfd:fido-arena`;
/// a peer's is `r--s` of the same inode.
fn stale_mappings(pids: &[(&str, u32)]) -> Vec<String> {
    let mut own: HashSet<String> = HashSet::new();
    let mut peers: Vec<(String, String, String)> = Vec::new();
    for (name, pid) in pids {
        let Ok(maps) = std::fs::read_to_string(format!("/proc/{pid}/maps")) else {
            continue;
        };
        for l in maps.lines().filter(|l| l.contains("memfd:fido-arena")) {
            let f: Vec<&str> = l.split_whitespace().collect();
            if f.len() < 5 {
                continue;
            }
            let (range, perms, inode) = (f[0], f[1], f[4]);
            if perms.starts_with("rw") {
                own.insert(inode.to_string());
            } else {
                peers.push((name.to_string(), range.to_string(), inode.to_string()));
            }
        }
    }
    peers
        .into_iter()
        .filter(|(_, _, ino)| !own.contains(ino))
        .map(|(name, range, ino)| {
            format!("{name} maps {range} (memfd inode {ino}), owned by no live domain")
        })
        .collect()
}

fn dev_shm() -> HashSet<String> {
    std::fs::read_dir("/dev/shm")
        .map(|d| {
            d.flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default()
}

/// Live processes carrying `RUN_ENV=token`, or whose parent is us.
fn survivors(token: &str) -> Vec<u32> {
    let me = std::process::id();
    let needle = format!("{RUN_ENV}={token}");
    let mut out = Vec::new();
    for e in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Some(pid) = e.file_name().to_str().and_then(|s| s.parse::<u32>().ok()) else {
            continue;
        };
        if pid == me {
            continue;
        }
        let tagged = std::fs::read(e.path().join("environ"))
            .is_ok_and(|env| env.split(|b| *b == 0).any(|v| v == needle.as_bytes()));
        let child = std::fs::read_to_string(e.path().join("stat")).is_ok_and(|s| {
            // pid (comm) state ppid ...
            s.rsplit_once(')')
                .and_then(|(_, r)| r.split_whitespace().nth(1).map(|p| p == me.to_string()))
                .unwrap_or(false)
        });
        if tagged || child {
            out.push(pid);
        }
    }
    out
}

fn pct(v: &mut [u64]) -> (f64, f64, f64) {
    if v.is_empty() {
        return (0.0, 0.0, 0.0);
    }
    let (p50, p99) = fido_bench::percentiles(v);
    (p50 as f64, p99 as f64, *v.iter().max().unwrap() as f64)
}

/// One line of the report: a JSON record, and whether it is a check that passed.
struct Row {
    rec: Record,
    check: Option<bool>,
    note: String,
}

fn count(case: &str, value: u64, unit: &str, check_zero: bool, note: impl Into<String>) -> Row {
    Row {
        rec: Record {
            suite: SUITE.into(),
            case: case.into(),
            system: SYSTEM.into(),
            metric: "count".into(),
            value: value as f64,
            unit: unit.into(),
            p50: None,
            p99: None,
            n: value,
        },
        check: check_zero.then_some(value == 0),
        note: note.into(),
    }
}

fn print_rows(rows: &[Row]) {
    let w0 = rows
        .iter()
        .map(|r| r.rec.case.len())
        .max()
        .unwrap_or(4)
        .max(4);
    println!(
        "{:<w0$}  {:>12}  {:<10}  {:<5}  note",
        "case", "value", "unit", "check"
    );
    println!("{}", "-".repeat(w0 + 40));
    for r in rows {
        let v = if r.rec.metric == "count" {
            format!("{}", r.rec.value as u64)
        } else {
            format!("{:.1}", r.rec.value)
        };
        let c = match r.check {
            Some(true) => "ok",
            Some(false) => "FAIL",
            None => "",
        };
        println!(
            "{:<w0$}  {:>12}  {:<10}  {:<5}  {}",
            r.rec.case, v, r.rec.unit, c, r.note
        );
    }
}

/// `fido bench chaos`. `Ok(false)`: a check failed.
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
    let self_fd0 = fd_count("self");
    let shm0 = dev_shm();
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
    let (tx, rx) = mpsc::channel();
    let run_id = format!("{}", std::process::id());
    let specs = specs(&run_id);
    let n = specs.len();
    let mut f = Fleet {
        exe: std::env::current_exe().context("current_exe")?,
        token: token.clone(),
        socket: dir.path().join("broker.sock"),
        state: dir.path().join("state"),
        logs: logs.clone(),
        seed,
        rate: o.rate,
        specs,
        running: (0..n).map(|_| None).collect(),
        broker: None,
        broker_ready_at: None,
        tx,
        rx,
        inst_role: HashMap::new(),
        next_inst: 1,
        next_stream: 0,
        ledger: Ledger::default(),
        last_delivery: [Instant::now(); 3],
        stalled: [false; 3],
        recoveries: Vec::new(),
        recovery_domain_ms: Vec::new(),
        recovery_broker_ms: Vec::new(),
        kills: BTreeMap::new(),
        broker_restarts: 0,
        unexpected_exits: 0,
        stalls: 0,
        trace: std::env::var_os("FIDO_CHAOS_TRACE").is_some_and(|v| v == "1"),
    };
    eprintln!(
        "chaos: seed {seed}, {} s, kill every {}-{} ms, {} msg/s per source; logs in {}",
        o.seconds,
        o.interval_ms.0,
        o.interval_ms.1,
        o.rate,
        logs.display()
    );

    f.start_broker()?;
    // A fresh broker's descriptors, before any domain joined.
    std::thread::sleep(Duration::from_millis(200));
    let broker_fd0 = fd_count(&f.broker_pid().unwrap().to_string());
    for i in 0..n {
        f.start_role(i)?;
    }
    let deadline = Instant::now() + Duration::from_secs(60);
    while !f.all_ready() {
        proc::check_interrupt()?;
        f.reap_unexpected()?;
        f.pump(Duration::from_millis(20));
        if Instant::now() > deadline {
            bail!(
                "roles not ready within 60 s (see the logs in {})",
                logs.display()
            );
        }
    }
    f.last_delivery = [Instant::now(); 3];

    // ---- chaos ----
    let mut rng = Rng::new(seed);
    let stall = Duration::from_secs_f64(o.stall_secs);
    let chaos_end = Instant::now() + Duration::from_secs_f64(o.seconds);
    let mut next_kill =
        Instant::now() + Duration::from_millis(rng.range(o.interval_ms.0, o.interval_ms.1));
    while Instant::now() < chaos_end {
        proc::check_interrupt()?;
        let wake = next_kill
            .min(chaos_end)
            .min(Instant::now() + Duration::from_millis(50));
        f.pump(wake.saturating_duration_since(Instant::now()));
        f.reap_unexpected()?;
        f.check_stalls(stall);
        if Instant::now() < next_kill || Instant::now() >= chaos_end {
            continue;
        }
        // Victim: one of the domains (weight 1 each) or the broker (weight 2).
        let pick = rng.below(n as u64 + 2) as usize;
        let now = Instant::now();
        let pause = Duration::from_millis(if rng.chance(0.5) {
            0
        } else {
            rng.range(1, 300)
        });
        if pick >= n {
            f.kill_broker()?;
            *f.kills.entry("broker").or_default() += 1;
            // Sometimes a domain dies while the broker is down.
            let also = if rng.chance(0.3) {
                Some(rng.below(n as u64) as usize)
            } else {
                None
            };
            if let Some(i) = also {
                f.stop_role(i, true)?;
                *f.kills.entry(f.specs[i].name).or_default() += 1;
            }
            std::thread::sleep(pause);
            f.start_broker()?;
            f.broker_restarts += 1;
            for g in 0..GROUPS.len() {
                f.recoveries.push(Recovery {
                    group: g,
                    killed_at: now,
                    role: None,
                    broker: true,
                });
            }
            if let Some(i) = also {
                f.start_role(i)?;
                f.recoveries.push(Recovery {
                    group: f.specs[i].group,
                    killed_at: now,
                    role: Some(i),
                    broker: false,
                });
            }
        } else {
            f.stop_role(pick, true)?;
            *f.kills.entry(f.specs[pick].name).or_default() += 1;
            std::thread::sleep(pause);
            f.start_role(pick)?;
            f.recoveries.push(Recovery {
                group: f.specs[pick].group,
                killed_at: now,
                role: Some(pick),
                broker: false,
            });
        }
        next_kill =
            Instant::now() + Duration::from_millis(rng.range(o.interval_ms.0, o.interval_ms.1));
    }
    let chaos_secs = t_start.elapsed().as_secs_f64();

    // ---- drain ----
    let mut drain_timeouts = 0u64;
    let deadline = Instant::now() + Duration::from_secs(60);
    while !f.all_ready() {
        proc::check_interrupt()?;
        f.reap_unexpected()?;
        f.pump(Duration::from_millis(20));
        if Instant::now() > deadline {
            bail!("roles not ready again within 60 s after the chaos phase");
        }
    }
    let t_drain = Instant::now();
    let senders: Vec<usize> = (0..n).filter(|&i| f.specs[i].kind.resends()).collect();
    let servers: Vec<usize> = (0..n)
        .filter(|&i| f.specs[i].kind == Kind::EchoServer)
        .collect();
    for phase in [&senders, &servers] {
        for &i in phase.iter() {
            f.send_cmd(i, "stop");
        }
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            proc::check_interrupt()?;
            f.pump(Duration::from_millis(20));
            f.reap_unexpected()?;
            let pending: Vec<usize> = phase
                .iter()
                .copied()
                .filter(|&i| !f.running[i].as_ref().is_some_and(|r| r.done))
                .collect();
            if pending.is_empty() {
                break;
            }
            // A role restarted after a crash meanwhile must hear it too.
            for &i in &pending {
                f.send_cmd(i, "stop");
            }
            if Instant::now() > deadline {
                for &i in &pending {
                    drain_timeouts += 1;
                    f.ledger.problem(format!(
                        "{} did not drain within 60 s (messages still in flight: a hang?)",
                        f.specs[i].name
                    ));
                }
                break;
            }
        }
    }
    let drain_secs = t_drain.elapsed().as_secs_f64();

    // ---- stale mappings: nothing is in flight now, so no domain has a reason
    // to map an arena whose owner is gone ----
    let mut stale: Vec<String>;
    let deadline = Instant::now() + Duration::from_secs(3);
    loop {
        f.pump(Duration::from_millis(100));
        let pids: Vec<(&'static str, u32)> = (0..n)
            .filter_map(|i| {
                f.running[i]
                    .as_ref()
                    .map(|r| (f.specs[i].name, r.child.id()))
            })
            .collect();
        stale = stale_mappings(&pids);
        if stale.is_empty() || Instant::now() > deadline {
            break;
        }
    }
    for s in &stale {
        f.ledger
            .problem(format!("dead domain's arena still mapped: {s}"));
    }

    // ---- exit ----
    let mut bad_exits = 0u64;
    for i in 0..n {
        f.send_cmd(i, "exit");
    }
    let deadline = Instant::now() + Duration::from_secs(15);
    for i in 0..n {
        loop {
            f.pump(Duration::from_millis(10));
            let exited = match f.running[i].as_mut() {
                Some(r) => r.child.try_wait()?.is_some(),
                None => true,
            };
            if exited || Instant::now() > deadline {
                let st = f.stop_role(i, !exited)?;
                if !exited {
                    bad_exits += 1;
                    f.ledger.problem(format!(
                        "{} did not exit within 15 s of `exit`; killed",
                        f.specs[i].name
                    ));
                } else if let Some(st) = st.filter(|s| !s.success()) {
                    bad_exits += 1;
                    f.ledger
                        .problem(format!("{} exited with {st}", f.specs[i].name));
                }
                break;
            }
        }
    }
    f.pump(Duration::from_millis(50));

    // ---- broker-side leaks: every domain is gone now ----
    let bpid = f.broker_pid().map(|p| p.to_string()).unwrap_or_default();
    let mut broker_state: u64;
    let mut broker_state_note: String;
    let mut broker_fds: i64;
    let mut broker_memfds: usize;
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        match f.status_json() {
            Ok(v) => {
                let len = |k: &str| v[k].as_array().map(|a| a.len()).unwrap_or(0);
                // `fido status` itself is one domain.
                let (d, s, c) = (
                    len("domains").saturating_sub(1),
                    len("services"),
                    len("connections"),
                );
                broker_state = (d + s + c) as u64;
                broker_state_note = format!("{d} domains, {s} services, {c} connections left");
            }
            Err(e) => {
                broker_state = 1;
                broker_state_note = format!("status failed: {e:#}");
            }
        }
        // Let the broker see the status domain go.
        std::thread::sleep(Duration::from_millis(300));
        broker_fds = fd_count(&bpid) as i64 - broker_fd0 as i64;
        broker_memfds = memfd_count(&bpid);
        if (broker_state == 0 && broker_fds <= 0 && broker_memfds == 0) || Instant::now() > deadline
        {
            break;
        }
    }
    // Stop the broker cleanly.
    let mut broker_exit_ok = false;
    if let Some(mut c) = f.broker.take() {
        if let Some(p) = rustix::process::Pid::from_raw(c.id() as i32) {
            let _ = rustix::process::kill_process(p, rustix::process::Signal::TERM);
        }
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            if let Some(st) = c.try_wait()? {
                broker_exit_ok = st.success();
                if !broker_exit_ok {
                    f.ledger
                        .problem(format!("the broker exited with {st} on SIGTERM"));
                }
                break;
            }
            if Instant::now() > deadline {
                let _ = c.kill();
                let _ = c.wait();
                f.ledger
                    .problem("the broker did not stop within 10 s of SIGTERM".into());
                break;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }
    let mut state_files: Vec<String> = std::fs::read_dir(&f.state)
        .map(|d| {
            d.flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default();
    state_files.retain(|n| n != "broker.lock" && !n.starts_with("registry.sqlite"));
    if f.socket.exists() {
        state_files.push(f.socket.display().to_string());
    }

    // ---- the books ----
    f.pump(Duration::from_millis(10));
    let t = f.ledger.totals();
    let ledger_protocol = f.ledger.protocol;
    let ledger_inconsistent = f.ledger.inconsistent;
    let problems = f.ledger.problems.clone();
    let kills = f.kills.clone();
    let total_kills: u64 = kills.values().sum();
    let (broker_restarts, unexpected_exits, stalls) =
        (f.broker_restarts, f.unexpected_exits, f.stalls);
    let mut rec_dom = std::mem::take(&mut f.recovery_domain_ms);
    let mut rec_brk = std::mem::take(&mut f.recovery_broker_ms);
    drop(f);
    drop(TIMELINE.lock().unwrap().take());
    let logs_kept = o.log_dir.is_some();
    let log_tails = if logs_kept {
        String::new()
    } else {
        tails(&logs)
    };
    dir.close().context("removing the temporary directory")?;

    // ---- host-side leaks ----
    let procs = {
        let mut s = survivors(&token);
        let deadline = Instant::now() + Duration::from_secs(2);
        while !s.is_empty() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(50));
            s = survivors(&token);
        }
        s
    };
    let self_fd1 = fd_count("self");
    let self_memfd = memfd_count("self");
    let shm_new: Vec<String> = dev_shm().difference(&shm0).cloned().collect();

    let mut rows = vec![
        count(
            "messages",
            t.messages,
            "msgs",
            false,
            format!("{} streams (sender incarnations)", t.streams),
        ),
        count(
            "delivered",
            t.delivered,
            "msgs",
            false,
            "verified deliveries at final receivers",
        ),
        count(
            "released",
            t.released,
            "msgs",
            false,
            "release confirmed to the origin sender",
        ),
        count(
            "corrupted",
            t.corrupted,
            "msgs",
            true,
            "checksum/header mismatch or phantom",
        ),
        count(
            "duplicated-silent",
            t.duplicated_silent,
            "msgs",
            true,
            "extra deliveries not explained by a report",
        ),
        count(
            "redelivered-reported",
            t.redelivered_reported,
            "msgs",
            false,
            "delivered, reported undelivered after a crash, resent",
        ),
        count(
            "lost-silent",
            t.lost_released + t.lost_unaccounted,
            "msgs",
            true,
            format!(
                "{} released-undelivered, {} unaccounted",
                t.lost_released, t.lost_unaccounted
            ),
        ),
        count(
            "reported-undelivered",
            t.reported,
            "msgs",
            false,
            format!("reports on every hop; {} resent", t.resent),
        ),
        count(
            "dropped-reported",
            t.dropped_reported,
            "msgs",
            false,
            "echo replies reported undelivered (client gone), not resent",
        ),
        count(
            "unconfirmed-sender-killed",
            t.unconfirmed_killed,
            "msgs",
            false,
            "sender killed before learning the fate",
        ),
        count(
            "undrained",
            t.undrained,
            "msgs",
            true,
            "sender alive but never drained",
        ),
        count(
            "kills",
            total_kills,
            "kills",
            false,
            kills
                .iter()
                .map(|(k, v)| format!("{k}:{v}"))
                .collect::<Vec<_>>()
                .join(" "),
        ),
        count("broker-restarts", broker_restarts, "restarts", false, ""),
        count(
            "unexpected-exits",
            unexpected_exits,
            "processes",
            true,
            "a role or the broker died without being killed",
        ),
        count(
            "protocol-errors",
            ledger_protocol,
            "errors",
            true,
            "Error::Protocol between honest peers",
        ),
        count(
            "inconsistent-reports",
            ledger_inconsistent,
            "reports",
            true,
            "take_undelivered vs confirmed releases",
        ),
        count(
            "stalls",
            stalls,
            "stalls",
            true,
            format!("a pipeline delivered nothing for {} s", o.stall_secs),
        ),
        count(
            "drain-timeouts",
            drain_timeouts,
            "roles",
            true,
            "did not drain within 60 s at the end",
        ),
        count(
            "bad-exits",
            bad_exits + u64::from(!broker_exit_ok),
            "processes",
            true,
            "non-zero exit or no exit at the end",
        ),
        count(
            "leaked-fds",
            (self_fd1 as i64 - self_fd0 as i64).max(0) as u64 + broker_fds.max(0) as u64,
            "fds",
            true,
            format!("driver {self_fd0}->{self_fd1}; broker {broker_fds:+} vs fresh"),
        ),
        count(
            "leaked-memfds",
            (self_memfd + broker_memfds) as u64,
            "fds",
            true,
            "memfd fds in the driver and the broker with no domain left",
        ),
        count(
            "stale-mappings",
            stale.len() as u64,
            "mappings",
            true,
            "arenas of dead domains still mapped by live ones after the drain",
        ),
        count(
            "leaked-shm",
            shm_new.len() as u64,
            "entries",
            true,
            shm_new.join(" "),
        ),
        count(
            "leaked-processes",
            procs.len() as u64,
            "processes",
            true,
            format!("{procs:?}"),
        ),
        count(
            "leaked-broker-state",
            broker_state,
            "entries",
            true,
            broker_state_note,
        ),
        count(
            "leaked-state-files",
            state_files.len() as u64,
            "files",
            true,
            state_files.join(" "),
        ),
    ];
    for (case, v) in [
        ("recovery-domain-kill", &mut rec_dom),
        ("recovery-broker-kill", &mut rec_brk),
    ] {
        let (p50, p99, max) = pct(v);
        rows.push(Row {
            rec: Record {
                suite: SUITE.into(),
                case: case.into(),
                system: SYSTEM.into(),
                metric: "recovery_ms".into(),
                value: p50,
                unit: "ms".into(),
                p50: Some(p50),
                p99: Some(p99),
                n: v.len() as u64,
            },
            check: None,
            note: format!("kill -> first end-to-end delivery after restart: p50 {p50:.0} p99 {p99:.0} max {max:.0} ms, n {}", v.len()),
        });
    }
    let rate = t.delivered as f64 / chaos_secs.max(1e-9);
    rows.push(Row {
        rec: Record {
            suite: SUITE.into(),
            case: "throughput".into(),
            system: SYSTEM.into(),
            metric: "msgs_per_s".into(),
            value: rate,
            unit: "msg/s".into(),
            p50: None,
            p99: None,
            n: t.delivered,
        },
        check: None,
        note: format!("deliveries / {chaos_secs:.0} s (chaos + drain {drain_secs:.1} s)"),
    });
    let sane = t.messages > 0 && total_kills > 0 && t.delivered > 0;
    let ok = sane && rows.iter().all(|r| r.check != Some(false));
    println!("# fido bench chaos: seed {seed}, {:.0} s of chaos, {} processes (broker separate), kills every {}-{} ms", o.seconds, n + 1, o.interval_ms.0, o.interval_ms.1);
    print_rows(&rows);
    if !sane {
        println!(
            "# FAIL: nothing was measured (messages {}, kills {total_kills})",
            t.messages
        );
    }
    if !problems.is_empty() {
        println!("# problems ({} shown):", problems.len());
        for p in &problems {
            println!("#   {p}");
        }
    }
    if !ok && !log_tails.is_empty() {
        eprintln!("{log_tails}");
    }
    println!(
        "# {}",
        if ok {
            "all checks passed"
        } else {
            "CHECKS FAILED"
        }
    );
    if let Some(p) = &o.json {
        let recs: Vec<Record> = rows.into_iter().map(|r| r.rec).collect();
        fido_bench::write_json(p, &recs)?;
    }
    Ok(ok)
}

/// The last lines of every non-empty log (printed when a check failed).
fn tails(dir: &Path) -> String {
    let mut out = String::new();
    let Ok(d) = std::fs::read_dir(dir) else {
        return out;
    };
    let mut files: Vec<PathBuf> = d.flatten().map(|e| e.path()).collect();
    files.sort();
    for p in files {
        let Ok(s) = std::fs::read_to_string(&p) else {
            continue;
        };
        let lines: Vec<&str> = s.lines().collect();
        if lines.is_empty() {
            continue;
        }
        out.push_str(&format!(
            "--- {} (last {} of {} lines)\n",
            p.display(),
            lines.len().min(15),
            lines.len()
        ));
        for l in &lines[lines.len().saturating_sub(15)..] {
            out.push_str(l);
            out.push('\n');
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tags_roundtrip() {
        let t = tag_of(123, 456);
        assert_eq!(split_tag(t), (123, 456));
    }

    #[test]
    fn hash_sees_a_flipped_bit() {
        let mut a = vec![0u8; 4096];
        fill(&mut a, 7);
        let h = payload_hash([&a[..]].into_iter());
        a[HDR + 100] ^= 1;
        assert_ne!(h, payload_hash([&a[..]].into_iter()));
    }
}
