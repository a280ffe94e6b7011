//! The same pipeline over Unix stream sockets, the demo's baseline: source →
//! forwarders → sink, one process each, connected by `AF_UNIX` stream
//! sockets in a temporary directory.
//!
//! Every role does what its Fido counterpart does, so that only the transport
//! differs: the source writes every byte of each message once
//! ([`pipeline::fill_message`]: pattern, header, `CLOCK_MONOTONIC` stamp) and
//! hands it to its socket (a copy into the kernel); each forwarder reads a
//! whole message into its buffer and writes it on (a copy out of and one into
//! the kernel per hop); the sink reads it (a copy out of the kernel) and
//! checks every byte with [`pipeline::check_message`], as the Fido sink does.
//! The phase of a message (warm-up, measured, drain, ping) travels in its
//! header; the end is the source closing its socket.
//!
//! The latency phase is the Fido pipeline's: the sink acknowledges each ping
//! on a socket of its own back to the source, which sends the next ping only
//! then — one message in flight through every hop.

use std::io::{Read as _, Write as _};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{bail, Context as _};
use serde_json::json;

use crate::pipeline::{
    self, emit, fill_message, Args, Outcome, PingPhase, SinkLedger, Spec, Window,
    OP_DRAIN, OP_MEASURED, OP_PING, OP_WARMUP,
};
use crate::proc::Kid;

fn link(dir: &Path, i: usize) -> PathBuf {
    dir.join(format!("link{i}.sock"))
}

fn ack_path(dir: &Path) -> PathBuf {
    dir.join("ack.sock")
}

/// Runs the socket pipeline of `spec` (its `ring_entries` and `prefix` do not
/// apply), then `pings` if given: spawns the sink, the forwarders (downstream
/// first), then the source; collects every result; reaps every process
/// (killing them on any error or interrupt). The sockets live in a temporary
/// directory removed before this returns.
pub fn launch(spec: &Spec, pings: Option<&PingPhase>) -> anyhow::Result<Outcome> {
    if spec.links == 0 {
        bail!("a pipeline needs at least one hop");
    }
    if spec.size < pipeline::HEADER {
        bail!("pipeline messages carry a {}-byte header", pipeline::HEADER);
    }
    let dir = tempfile::Builder::new()
        .prefix("fido-demo-uds-")
        .tempdir()
        .context("creating a directory for the sockets")?;
    let base = |role: &str| -> Vec<String> {
        let mut v = spec.launcher.clone();
        v.extend([
            format!("role={role}"),
            format!("dir={}", dir.path().display()),
            format!("size={}", spec.size),
        ]);
        v
    };
    let ready_by = || Instant::now() + Duration::from_secs(20);
    let mut kids: Vec<(String, Kid)> = Vec::new();

    let mut a = base("uds-sink");
    a.push(format!("link={}", spec.links));
    a.push(format!("ack={}", pings.is_some()));
    let mut k = Kid::spawn_without_broker(&a)?;
    k.expect_event("ready", ready_by())?;
    kids.push(("sink".into(), k));
    for i in (1..spec.links).rev() {
        let mut a = base("uds-fwd");
        a.push(format!("link={i}"));
        let mut k = Kid::spawn_without_broker(&a)?;
        k.expect_event("ready", ready_by())?;
        kids.push((format!("fwd{i}"), k));
    }
    let mut a = base("uds-source");
    a.extend([
        format!("warm_ns={}", spec.warmup.as_nanos()),
        format!("dur_ns={}", spec.duration.as_nanos()),
    ]);
    a.extend(pings.map(PingPhase::args).unwrap_or_default());
    let mut k = Kid::spawn_without_broker(&a)?;
    k.expect_event("ready", ready_by())?;
    kids.push(("source".into(), k));

    let outcome = pipeline::collect_results(kids, spec, pings)?;
    dir.close().context("removing the sockets' directory")?;
    Ok(outcome)
}

/// `role=uds-source|uds-fwd|uds-sink` (reached through [`pipeline::role_main`]).
pub(crate) fn role(a: &Args) -> Option<anyhow::Result<()>> {
    Some(match a.get("role").ok()? {
        "uds-source" => source(a),
        "uds-fwd" => forwarder(a),
        "uds-sink" => sink(a),
        _ => return None,
    })
}

/// A connection to `path` (bound before its process said it was ready).
fn connect(path: &Path) -> anyhow::Result<UnixStream> {
    UnixStream::connect(path).with_context(|| format!("connecting to {}", path.display()))
}

fn source(a: &Args) -> anyhow::Result<()> {
    let dir = PathBuf::from(a.get("dir")?);
    let size: usize = a.num("size")?;
    let warm = Duration::from_nanos(a.num("warm_ns")?);
    let dur = Duration::from_nanos(a.num("dur_ns")?);
    let pings = PingPhase::from_args(a)?;
    let mut down = connect(&link(&dir, 1))?;
    let mut ack = match &pings {
        Some(_) => Some(connect(&ack_path(&dir))?),
        None => None,
    };
    let sndbuf = rustix::net::sockopt::socket_send_buffer_size(&down)?;
    emit(&json!({"event": "ready", "pid": std::process::id()}))?;
    let mut buf = vec![0u8; size];
    let mut window = Window::default();
    let start = Instant::now();
    let (warm_end, end) = (start + warm, start + warm + dur);
    window.prev = Some(start);
    let mut seq = 0u64;
    loop {
        let now = Instant::now();
        if now >= end {
            break;
        }
        let measured = now >= warm_end;
        seq += 1;
        fill_message(&mut buf, seq, 0, if measured { OP_MEASURED } else { OP_WARMUP });
        down.write_all(&buf).context("sending")?;
        window.saw(Instant::now(), measured, size as u64);
    }
    let mut pinged = 0u64;
    if let (Some(p), Some(ack)) = (&pings, ack.as_mut()) {
        let mut one = |seq: u64, op: u16| -> anyhow::Result<()> {
            fill_message(&mut buf, seq, 0, op);
            down.write_all(&buf).context("sending a ping")?;
            let mut got = [0u8; 8];
            ack.read_exact(&mut got).context("waiting for the sink's acknowledgement")?;
            let got = u64::from_le_bytes(got);
            if got != seq {
                bail!("the sink acknowledged {got}, expected {seq}");
            }
            Ok(())
        };
        seq += 1;
        one(seq, OP_DRAIN)?;
        let t = Instant::now();
        while p.wants_more(pinged, t.elapsed()) {
            seq += 1;
            one(seq, OP_PING)?;
            pinged += 1;
        }
    }
    // The end: the sink sees end of stream after the last message.
    down.shutdown(std::net::Shutdown::Write)?;
    let mut rest = Vec::new();
    down.read_to_end(&mut rest).context("waiting for downstream to finish")?;
    pipeline::result_json(
        "source",
        &window,
        json!({"sent": seq, "size": size, "pings": pinged, "sndbuf": sndbuf}),
    )
}

fn forwarder(a: &Args) -> anyhow::Result<()> {
    let dir = PathBuf::from(a.get("dir")?);
    let size: usize = a.num("size")?;
    let i: usize = a.num("link")?;
    let listener = UnixListener::bind(link(&dir, i))?;
    let mut down = connect(&link(&dir, i + 1))?;
    emit(&json!({"event": "ready", "pid": std::process::id()}))?;
    let (mut up, _) = listener.accept().context("accepting upstream")?;
    let mut buf = vec![0u8; size];
    let mut window = Window::default();
    let mut forwarded = 0u64;
    while read_message(&mut up, &mut buf)? {
        down.write_all(&buf).context("forwarding")?;
        forwarded += 1;
        let op = pipeline::message_op(&buf);
        window.saw(Instant::now(), op == OP_MEASURED, size as u64);
    }
    down.shutdown(std::net::Shutdown::Write)?;
    let mut rest = Vec::new();
    down.read_to_end(&mut rest).context("waiting for downstream to finish")?;
    pipeline::result_json("fwd", &window, json!({"forwarded": forwarded}))
}

fn sink(a: &Args) -> anyhow::Result<()> {
    let dir = PathBuf::from(a.get("dir")?);
    let size: usize = a.num("size")?;
    let i: usize = a.num("link")?;
    let listener = UnixListener::bind(link(&dir, i))?;
    let ack_listener = if a.flag("ack") {
        Some(UnixListener::bind(ack_path(&dir))?)
    } else {
        None
    };
    emit(&json!({"event": "ready", "pid": std::process::id()}))?;
    let (mut up, _) = listener.accept().context("accepting upstream")?;
    let mut ack = match &ack_listener {
        Some(l) => Some(l.accept().context("accepting the source's acknowledgement socket")?.0),
        None => None,
    };
    let mut buf = vec![0u8; size];
    let mut ledger = SinkLedger::default();
    while read_message(&mut up, &mut buf)? {
        let c = pipeline::check_message(fido::PeerSlice::from_own(&buf));
        let now = crate::measure::mono_ns();
        ledger.saw(c.seq, pipeline::message_op(&buf), &c, None, now, size as u64);
        if matches!(pipeline::message_op(&buf), OP_DRAIN | OP_PING) {
            let ack = ack.as_mut().context("a ping, but no acknowledgement socket")?;
            ack.write_all(&c.seq.to_le_bytes()).context("acknowledging")?;
        }
    }
    // Dropping `up` (at return) tells the forwarder we are done.
    let window = std::mem::take(&mut ledger.window);
    pipeline::result_json("sink", &window, ledger.json())
}

/// Reads one whole message; `false` at end of stream between messages.
fn read_message(up: &mut UnixStream, buf: &mut [u8]) -> anyhow::Result<bool> {
    let mut got = 0;
    while got < buf.len() {
        match up.read(&mut buf[got..]) {
            Ok(0) if got == 0 => return Ok(false),
            Ok(0) => bail!("upstream closed in the middle of a message"),
            Ok(n) => got += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e).context("receiving from upstream"),
        }
    }
    Ok(true)
}
