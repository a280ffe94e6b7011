//! The helper processes of a chaos run, each `fido-bench __chaos-role
//! role=... key=value...`: sources and the echo client (senders that resend
//! what is reported undelivered), forwarders, sinks, the echo server — and the
//! broker itself (`__chaos-broker`), and the status probe (`__chaos-status`).
//!
//! A role writes its journal (see the records in the module above) to stdout,
//! each record *before* the fact it describes becomes visible to anyone else,
//! and its log (what happened to its connections) to stderr. The driver's
//! commands arrive on stdin: `stop` (drain: send nothing new), `exit` or EOF.

use std::collections::{HashSet, VecDeque};
use std::io::{BufRead, Write as _};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use anyhow::{bail, Context as _};
use fido::{Channel, Domain, Error, JoinOptions, Listener, Message, Msg, SendError, WaitStrategy};
use fido_demo::pipeline::Args;
use fido_demo::proc;

use super::epoch;
use super::wire::{build, split_tag, tag_of, verify, Rng};

/// Ring entries of every role's connections.
const ENTRIES: u32 = 64;

static STOP: AtomicBool = AtomicBool::new(false);
static WHO: std::sync::OnceLock<String> = std::sync::OnceLock::new();

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
        j.line(&format!("P {what}: {}", why.to_string().replace('\n', " ")));
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

/// `fido-bench __chaos-role role=... key=value...`
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
            failed = Some(Error::Closed);
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
            Some(Error::Closed)
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
            failed = Some(Error::Closed);
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

/// `fido-bench __chaos-broker STATE_DIR SOCKET`: the broker of a chaos run, run
/// as `fido broker --state-dir STATE_DIR --socket SOCKET` runs it (default
/// policy: only our uid may join) until SIGTERM or SIGINT. A process of its own,
/// so that the driver can kill it (-9) and restart it on the same state
/// directory and socket.
pub fn broker_main(args: &[String]) -> anyhow::Result<()> {
    use signal_hook::consts::{SIGINT, SIGTERM};
    let [state, socket] = args else {
        bail!("usage: __chaos-broker STATE_DIR SOCKET");
    };
    let (state, socket) = (PathBuf::from(state), PathBuf::from(socket));
    let broker = fido_broker::Broker::bind(fido_broker::Config::new(&socket, &state))
        .context("starting the broker")?;
    let shutdown = broker.shutdown_handle();
    let mut signals =
        signal_hook::iterator::Signals::new([SIGINT, SIGTERM]).context("installing signal handlers")?;
    let signals_handle = signals.handle();
    let waiter = std::thread::Builder::new()
        .name("chaos-signals".into())
        .spawn(move || {
            if signals.forever().next().is_some() {
                shutdown.shutdown();
            }
        })?;
    eprintln!(
        "chaos broker: listening on {} (state in {})",
        socket.display(),
        state.display()
    );
    let r = broker.run();
    signals_handle.close();
    let _ = waiter.join();
    r.context("broker")?;
    eprintln!("chaos broker: stopped");
    Ok(())
}

/// `fido-bench __chaos-status SOCKET`: the broker's view as one JSON object on
/// stdout — its domains, services and connections, as `fido status --json`
/// lists them. The probe joins as a short-lived domain of its own (listed too;
/// the caller discounts it) and leaves explicitly.
pub fn status_main(args: &[String]) -> anyhow::Result<()> {
    let [socket] = args else {
        bail!("usage: __chaos-status SOCKET");
    };
    let opts = JoinOptions::new("fido-status")
        .broker(socket)
        .arena_len(1 << 20)
        .ring_entries(2);
    let d = Domain::join(opts).with_context(|| format!("no broker at {socket}"))?;
    let st = d.status().context("asking the broker for its status")?;
    let _ = d.leave();
    let v = serde_json::json!({
        "broker_pid": st.broker_pid,
        "domains": st.domains.iter().map(|d| serde_json::json!({
            "domain": d.domain,
            "name": d.name,
            "pid": d.pid,
            "slot": d.slot,
            "counters": fido_demo::pipeline::counters_json(&d.counters),
        })).collect::<Vec<_>>(),
        "services": st.services.iter().map(|(s, d)| serde_json::json!({"service": s, "domain": d})).collect::<Vec<_>>(),
        "connections": st.connections.iter().map(|c| serde_json::json!({
            "conn": c.conn, "service": c.service, "client": c.client, "server": c.server,
        })).collect::<Vec<_>>(),
    });
    println!("{v}");
    Ok(())
}
