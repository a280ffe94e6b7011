//! The same pipeline over stream sockets, the demos' baseline: source →
//! forwarders → sink, one process each, connected by `AF_UNIX` stream
//! sockets in a temporary directory (`fido demo`, [`launch`]) or by TCP
//! connections (`fido demo --vm`, whose forwarders run in VMs and relay over
//! virtio-net: see [`crate::vm`]). A role is told its sockets as
//! [`Endpoint`]s (`unix:PATH` or `tcp:HOST:PORT`).
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

use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::os::fd::{AsFd, BorrowedFd};
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

fn link(dir: &Path, i: usize) -> Endpoint {
    Endpoint::Unix(dir.join(format!("link{i}.sock")))
}

fn ack_path(dir: &Path) -> Endpoint {
    Endpoint::Unix(dir.join("ack.sock"))
}

/// Where a role listens or connects: `unix:PATH` or `tcp:HOST:PORT`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Endpoint {
    Unix(PathBuf),
    Tcp(String),
}

impl std::fmt::Display for Endpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Endpoint::Unix(p) => write!(f, "unix:{}", p.display()),
            Endpoint::Tcp(a) => write!(f, "tcp:{a}"),
        }
    }
}

impl std::str::FromStr for Endpoint {
    type Err = anyhow::Error;
    fn from_str(s: &str) -> anyhow::Result<Endpoint> {
        if let Some(p) = s.strip_prefix("unix:") {
            Ok(Endpoint::Unix(PathBuf::from(p)))
        } else if let Some(a) = s.strip_prefix("tcp:") {
            Ok(Endpoint::Tcp(a.to_string()))
        } else {
            bail!("endpoint {s:?}: expected unix:PATH or tcp:HOST:PORT")
        }
    }
}

/// A connected stream socket of either family.
pub(crate) enum Stream {
    Unix(UnixStream),
    Tcp(TcpStream),
}

impl Stream {
    fn shutdown_write(&self) -> std::io::Result<()> {
        match self {
            Stream::Unix(s) => s.shutdown(Shutdown::Write),
            Stream::Tcp(s) => s.shutdown(Shutdown::Write),
        }
    }

    /// TCP: no Nagle delay (a ping is one message; waiting to fill a segment
    /// would measure Nagle, not the transport).
    fn tuned(self) -> std::io::Result<Stream> {
        if let Stream::Tcp(s) = &self {
            s.set_nodelay(true)?;
        }
        Ok(self)
    }
}

impl Read for Stream {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        match self {
            Stream::Unix(s) => s.read(buf),
            Stream::Tcp(s) => s.read(buf),
        }
    }
}

impl Write for Stream {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        match self {
            Stream::Unix(s) => s.write(buf),
            Stream::Tcp(s) => s.write(buf),
        }
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl AsFd for Stream {
    fn as_fd(&self) -> BorrowedFd<'_> {
        match self {
            Stream::Unix(s) => s.as_fd(),
            Stream::Tcp(s) => s.as_fd(),
        }
    }
}

/// A listening socket of either family.
pub(crate) enum Listener {
    Unix(UnixListener),
    Tcp(TcpListener),
}

impl Listener {
    pub(crate) fn bind(at: &Endpoint) -> anyhow::Result<Listener> {
        Ok(match at {
            Endpoint::Unix(p) => Listener::Unix(UnixListener::bind(p).with_context(|| format!("listening on {at}"))?),
            Endpoint::Tcp(a) => Listener::Tcp(TcpListener::bind(a.as_str()).with_context(|| format!("listening on {at}"))?),
        })
    }

    fn accept(&self) -> std::io::Result<Stream> {
        match self {
            Listener::Unix(l) => Ok(Stream::Unix(l.accept()?.0)),
            Listener::Tcp(l) => Stream::Tcp(l.accept()?.0).tuned(),
        }
    }
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
    let dir_path = dir.path();
    let ready_by = || Instant::now() + Duration::from_secs(20);
    let mut kids: Vec<(String, Kid)> = Vec::new();

    let mut a = spec.launcher.clone();
    a.extend(sink_args(spec, &link(dir_path, spec.links), pings.map(|_| ack_path(dir_path))));
    let mut k = Kid::spawn_without_broker(&a)?;
    k.expect_event("ready", ready_by())?;
    kids.push(("sink".into(), k));
    for i in (1..spec.links).rev() {
        let mut a = spec.launcher.clone();
        a.extend(forwarder_args(spec, &link(dir_path, i), &link(dir_path, i + 1)));
        let mut k = Kid::spawn_without_broker(&a)?;
        k.expect_event("ready", ready_by())?;
        kids.push((format!("fwd{i}"), k));
    }
    let mut a = spec.launcher.clone();
    a.extend(source_args(spec, &link(dir_path, 1), pings.map(|p| (p, ack_path(dir_path)))));
    let mut k = Kid::spawn_without_broker(&a)?;
    k.expect_event("ready", ready_by())?;
    kids.push(("source".into(), k));

    let outcome = pipeline::collect_results(kids, spec, pings)?;
    dir.close().context("removing the sockets' directory")?;
    Ok(outcome)
}

/// The role arguments (after the launcher) of a sink that listens on `up`,
/// and on `ack` for the source's acknowledgement socket when pings follow.
pub fn sink_args(spec: &Spec, up: &Endpoint, ack: Option<Endpoint>) -> Vec<String> {
    let mut a = vec!["role=stream-sink".to_string(), format!("size={}", spec.size), format!("up={up}")];
    a.extend(ack.map(|e| format!("ack={e}")));
    a
}

/// The role arguments of a forwarder from `up` (where it listens) to `down`.
pub fn forwarder_args(spec: &Spec, up: &Endpoint, down: &Endpoint) -> Vec<String> {
    vec!["role=stream-fwd".to_string(), format!("size={}", spec.size), format!("up={up}"), format!("down={down}")]
}

/// The role arguments of the source sending to `down`, with the latency
/// phase and the sink's acknowledgement socket if given.
pub fn source_args(spec: &Spec, down: &Endpoint, pings: Option<(&PingPhase, Endpoint)>) -> Vec<String> {
    let mut a = vec![
        "role=stream-source".to_string(),
        format!("size={}", spec.size),
        format!("down={down}"),
        format!("warm_ns={}", spec.warmup.as_nanos()),
        format!("dur_ns={}", spec.duration.as_nanos()),
    ];
    if let Some((p, ack)) = pings {
        a.push(format!("ack={ack}"));
        a.extend(p.args());
    }
    a
}

/// `role=stream-source|stream-fwd|stream-sink` (reached through [`pipeline::role_main`]).
pub(crate) fn role(a: &Args) -> Option<anyhow::Result<()>> {
    Some(match a.get("role").ok()? {
        "stream-source" => source(a),
        "stream-fwd" => forwarder(a),
        "stream-sink" => sink(a),
        _ => return None,
    })
}

/// A connection to `at` (bound before its process said it was ready).
fn connect(at: &Endpoint) -> anyhow::Result<Stream> {
    let s = match at {
        Endpoint::Unix(p) => UnixStream::connect(p).map(Stream::Unix),
        Endpoint::Tcp(a) => TcpStream::connect(a.as_str()).map(Stream::Tcp),
    };
    s.and_then(Stream::tuned).with_context(|| format!("connecting to {at}"))
}

fn endpoint(a: &Args, k: &str) -> anyhow::Result<Endpoint> {
    a.get(k)?.parse()
}

fn source(a: &Args) -> anyhow::Result<()> {
    let size: usize = a.num("size")?;
    let warm = Duration::from_nanos(a.num("warm_ns")?);
    let dur = Duration::from_nanos(a.num("dur_ns")?);
    let pings = PingPhase::from_args(a)?;
    let mut down = connect(&endpoint(a, "down")?)?;
    let mut ack = match &pings {
        Some(_) => Some(connect(&endpoint(a, "ack")?)?),
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
    down.shutdown_write()?;
    let mut rest = Vec::new();
    down.read_to_end(&mut rest).context("waiting for downstream to finish")?;
    pipeline::result_json(
        "source",
        &window,
        json!({"sent": seq, "size": size, "pings": pinged, "sndbuf": sndbuf}),
    )
}

fn forwarder(a: &Args) -> anyhow::Result<()> {
    let size: usize = a.num("size")?;
    let listener = Listener::bind(&endpoint(a, "up")?)?;
    let mut down = connect(&endpoint(a, "down")?)?;
    emit(&json!({"event": "ready", "pid": std::process::id()}))?;
    let mut up = listener.accept().context("accepting upstream")?;
    let mut buf = vec![0u8; size];
    let mut window = Window::default();
    let mut forwarded = 0u64;
    while read_message(&mut up, &mut buf)? {
        down.write_all(&buf).context("forwarding")?;
        forwarded += 1;
        let op = pipeline::message_op(&buf);
        window.saw(Instant::now(), op == OP_MEASURED, size as u64);
    }
    down.shutdown_write()?;
    let mut rest = Vec::new();
    down.read_to_end(&mut rest).context("waiting for downstream to finish")?;
    pipeline::result_json("fwd", &window, json!({"forwarded": forwarded}))
}

fn sink(a: &Args) -> anyhow::Result<()> {
    let size: usize = a.num("size")?;
    let listener = Listener::bind(&endpoint(a, "up")?)?;
    let ack_listener = match a.opt("ack") {
        Some(e) => Some(Listener::bind(&e.parse()?)?),
        None => None,
    };
    emit(&json!({"event": "ready", "pid": std::process::id()}))?;
    let mut up = listener.accept().context("accepting upstream")?;
    let mut ack = match &ack_listener {
        Some(l) => Some(l.accept().context("accepting the source's acknowledgement socket")?),
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
fn read_message(up: &mut Stream, buf: &mut [u8]) -> anyhow::Result<bool> {
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

#[cfg(test)]
mod tests {
    use super::Endpoint;

    #[test]
    fn endpoints_round_trip_and_reject_other_schemes() {
        for s in ["unix:/tmp/x/link1.sock", "tcp:10.77.0.11:7001", "tcp:0.0.0.0:7001"] {
            let e: Endpoint = s.parse().unwrap();
            assert_eq!(e.to_string(), s);
        }
        assert_eq!("tcp:127.0.0.1:9".parse::<Endpoint>().unwrap(), Endpoint::Tcp("127.0.0.1:9".into()));
        assert!("udp:1.2.3.4:5".parse::<Endpoint>().is_err());
        assert!("/tmp/x".parse::<Endpoint>().is_err());
    }
}
