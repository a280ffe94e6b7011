//! `uds` and `tcp` baselines: kernel sockets between two processes.
//!
//! * Latency: ping-pong of `size`-byte messages in both directions on a Unix stream
//!   `socketpair` / a TCP loopback connection (`TCP_NODELAY` on both ends). The sender
//!   writes the payload each iteration, the receiver reads it into its buffer and folds it.
//! * Throughput: the peer streams `size`-byte messages as fast as it can; the parent
//!   receives for the measured window (after a warm-up) and reports the mean. `touch`:
//!   the sender rewrites every message and the receiver folds every byte; `notouch`: only
//!   the two socket copies.
//! * Pipeline: source → forwarders → sink over Unix stream sockets, each a process.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::process::Stdio;
use std::time::{Duration, Instant};

use anyhow::{bail, Context as _};
use rustix::net::{AddressFamily, SendFlags, SocketFlags, SocketType};

use crate::harness::*;

/// Which kernel transport.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Transport {
    Uds,
    Tcp,
}

impl Transport {
    pub fn system(self) -> &'static str {
        match self {
            Transport::Uds => "uds",
            Transport::Tcp => "tcp",
        }
    }
}

/// `write_all` with `MSG_NOSIGNAL` (a vanished reader is an error, never SIGPIPE).
fn send_all(fd: impl AsFd, mut buf: &[u8]) -> std::io::Result<()> {
    while !buf.is_empty() {
        match rustix::net::send(&fd, buf, SendFlags::NOSIGNAL) {
            Ok(0) => return Err(std::io::ErrorKind::WriteZero.into()),
            Ok(n) => buf = &buf[n..],
            Err(rustix::io::Errno::INTR) => {}
            Err(e) => return Err(e.into()),
        }
    }
    Ok(())
}

/// A connected stream either way; both are `Read + AsFd`.
enum Stream {
    Unix(UnixStream),
    Tcp(TcpStream),
}

impl Stream {
    fn read_exact(&mut self, buf: &mut [u8]) -> std::io::Result<()> {
        match self {
            Stream::Unix(s) => s.read_exact(buf),
            Stream::Tcp(s) => s.read_exact(buf),
        }
    }
    fn send_all(&self, buf: &[u8]) -> std::io::Result<()> {
        match self {
            Stream::Unix(s) => send_all(s, buf),
            Stream::Tcp(s) => send_all(s, buf),
        }
    }
    fn shutdown(&self) {
        let _ = match self {
            Stream::Unix(s) => s.shutdown(std::net::Shutdown::Both),
            Stream::Tcp(s) => s.shutdown(std::net::Shutdown::Both),
        };
    }
}

/// Parent side of a connection to a new peer: returns (stream, peer).
fn connect_peer(t: Transport, args: &[String]) -> anyhow::Result<(Stream, Peer)> {
    let place = Placement::detect();
    let mut args: Vec<String> = args.to_vec();
    args.push(format!("cpu={}", place.peer));
    match t {
        Transport::Uds => {
            let (a, b) = rustix::net::socketpair(
                AddressFamily::UNIX,
                SocketType::STREAM,
                SocketFlags::CLOEXEC,
                None,
            )?;
            args.push("transport=uds".into());
            let argv: Vec<&str> = args.iter().map(|s| s.as_str()).collect();
            let peer = Peer::spawn(&argv, &[b.as_fd()])?;
            Ok((Stream::Unix(UnixStream::from(a)), peer))
        }
        Transport::Tcp => {
            let l = TcpListener::bind("127.0.0.1:0")?;
            args.push("transport=tcp".into());
            args.push(format!("port={}", l.local_addr()?.port()));
            let argv: Vec<&str> = args.iter().map(|s| s.as_str()).collect();
            let peer = Peer::spawn(&argv, &[])?;
            l.set_nonblocking(true)?;
            let deadline = Instant::now() + Duration::from_secs(10);
            let s = loop {
                match l.accept() {
                    Ok((s, _)) => break s,
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                        if Instant::now() > deadline {
                            bail!("tcp peer never connected");
                        }
                        std::thread::sleep(Duration::from_millis(1));
                    }
                    Err(e) => return Err(e.into()),
                }
            };
            s.set_nonblocking(false)?;
            s.set_nodelay(true)?;
            Ok((Stream::Tcp(s), peer))
        }
    }
}

/// Peer side: the stream the parent set up.
fn peer_stream(a: &PeerArgs) -> anyhow::Result<Stream> {
    match a.get("transport")? {
        "uds" => Ok(Stream::Unix(UnixStream::from(peer_fd(0)))),
        "tcp" => {
            let port: u16 = a.num("port")?;
            let s = TcpStream::connect(("127.0.0.1", port)).context("tcp peer connect")?;
            s.set_nodelay(true)?;
            Ok(Stream::Tcp(s))
        }
        t => bail!("unknown transport {t}"),
    }
}

fn is_eof(e: &std::io::Error) -> bool {
    use std::io::ErrorKind::*;
    matches!(e.kind(), UnexpectedEof | BrokenPipe | ConnectionReset)
}

/// Ping-pong latency for one size. Returns round-trip samples and both sides'
/// CPU time over the measured window.
pub fn latency(t: Transport, size: usize, opts: &Opts) -> anyhow::Result<(Vec<u64>, CpuUse)> {
    let place = Placement::detect();
    let _pin = PinGuard::pin(place.parent)?;
    let (mut s, peer) = connect_peer(t, &["sock-echo".into(), format!("size={size}")])?;
    let mut out = vec![0u8; size];
    let mut inb = vec![0u8; size];
    let rtts = time_round_trips_cpu(opts.warmup(), opts.duration(), Some(peer.pid()), |k| {
        fill(&mut out, k);
        s.send_all(&out)?;
        s.read_exact(&mut inb).context("socket peer died")?;
        let got = fold(&inb);
        if size >= 8 && got != k {
            bail!("echo carried {got}, expected {k}");
        }
        Ok(())
    })?;
    s.shutdown();
    peer.finish(Duration::from_secs(5))?;
    Ok(rtts)
}

fn echo_peer(a: &PeerArgs) -> anyhow::Result<()> {
    let size: usize = a.num("size")?;
    let mut s = peer_stream(a)?;
    let mut buf = vec![0u8; size];
    loop {
        if let Err(e) = s.read_exact(&mut buf) {
            return if is_eof(&e) { Ok(()) } else { Err(e.into()) };
        }
        let k = fold(&buf);
        fill(&mut buf, k);
        if let Err(e) = s.send_all(&buf) {
            return if is_eof(&e) { Ok(()) } else { Err(e.into()) };
        }
    }
}

/// Streaming throughput for one size: (bytes/s mean over the window, messages).
pub fn throughput(
    t: Transport,
    size: usize,
    touch: bool,
    opts: &Opts,
) -> anyhow::Result<(f64, u64)> {
    let place = Placement::detect();
    let _pin = PinGuard::pin(place.parent)?;
    let (mut s, peer) = connect_peer(
        t,
        &[
            "sock-stream".into(),
            format!("size={size}"),
            format!("touch={}", touch as u8),
        ],
    )?;
    let mut buf = vec![0u8; size];
    let warm = Instant::now();
    while warm.elapsed() < opts.warmup() {
        s.read_exact(&mut buf).context("socket peer died")?;
        if touch {
            fold(&buf);
        }
    }
    let start = Instant::now();
    let mut n = 0u64;
    let elapsed = loop {
        s.read_exact(&mut buf).context("socket peer died")?;
        if touch {
            fold(&buf);
        }
        n += 1;
        let e = start.elapsed();
        if e >= opts.duration() {
            break e;
        }
    };
    s.shutdown();
    drop(s);
    peer.finish(Duration::from_secs(5))?;
    Ok(((n * size as u64) as f64 / elapsed.as_secs_f64(), n))
}

fn stream_peer(a: &PeerArgs) -> anyhow::Result<()> {
    let size: usize = a.num("size")?;
    let touch = a.flag("touch");
    let s = peer_stream(a)?;
    let mut buf = vec![0u8; size];
    fill(&mut buf, 0);
    for k in 1.. {
        if touch {
            fill(&mut buf, k);
        }
        if let Err(e) = s.send_all(&buf) {
            return if is_eof(&e) { Ok(()) } else { Err(e.into()) };
        }
    }
    Ok(())
}

/// Unix-socket pipeline baseline: source → (hops-1) forwarders → sink, each a process
/// (unpinned), `msg_size`-byte messages for `duration` (after a warm-up of
/// `duration/4`, at most 0.5 s). The source writes every message (and stamps
/// CLOCK_MONOTONIC into its first 8 bytes), each forwarder reads it into its buffer and
/// writes it on, the sink reads and folds every byte. Returns (bytes/s at the sink,
/// per-message source→sink latency samples in ns).
pub fn uds_pipeline(
    hops: usize,
    msg_size: usize,
    duration: Duration,
) -> anyhow::Result<(f64, Vec<u64>)> {
    if hops == 0 {
        bail!("a pipeline needs at least one hop");
    }
    if msg_size < 16 {
        bail!("pipeline messages carry a timestamp: at least 16 bytes");
    }
    let warm = (duration / 4).min(Duration::from_millis(500));
    let mut links: Vec<(Option<OwnedFd>, Option<OwnedFd>)> = Vec::new();
    for _ in 0..hops {
        let (a, b) = rustix::net::socketpair(
            AddressFamily::UNIX,
            SocketType::STREAM,
            SocketFlags::CLOEXEC,
            None,
        )?;
        links.push((Some(a), Some(b)));
    }
    let size = format!("size={msg_size}");
    let mut peers = Vec::new();
    // Sink first (its stdout carries the result), then forwarders, then the source.
    let sink_in = links[hops - 1].1.take().unwrap();
    let mut sink = Peer::spawn_stdout(
        &[
            "pipe-sink",
            &size,
            &format!("warm_ns={}", warm.as_nanos()),
            &format!("dur_ns={}", duration.as_nanos()),
        ],
        &[sink_in.as_fd()],
        Stdio::piped(),
    )?;
    drop(sink_in);
    for i in (1..hops).rev() {
        let inp = links[i - 1].1.take().unwrap();
        let out = links[i].0.take().unwrap();
        peers.push(Peer::spawn(
            &["pipe-forward", &size],
            &[inp.as_fd(), out.as_fd()],
        )?);
    }
    let src_out = links[0].0.take().unwrap();
    peers.push(Peer::spawn(&["pipe-source", &size], &[src_out.as_fd()])?);
    drop(src_out);
    drop(links);

    let mut raw = Vec::new();
    sink.child_mut()
        .stdout
        .take()
        .context("sink stdout")?
        .read_to_end(&mut raw)?;
    sink.finish(Duration::from_secs(5))?;
    for p in peers {
        p.finish(Duration::from_secs(5))?;
    }
    if raw.len() < 16 {
        bail!("pipeline sink reported nothing");
    }
    let bps = f64::from_le_bytes(raw[..8].try_into().unwrap());
    let n = u64::from_le_bytes(raw[8..16].try_into().unwrap()) as usize;
    let samples: Vec<u64> = raw[16..]
        .chunks_exact(8)
        .take(n)
        .map(|c| u64::from_le_bytes(c.try_into().unwrap()))
        .collect();
    Ok((bps, samples))
}

fn pipe_source(a: &PeerArgs) -> anyhow::Result<()> {
    let size: usize = a.num("size")?;
    let out = peer_fd(0);
    let mut buf = vec![0u8; size];
    for k in 1.. {
        fill(&mut buf, k);
        buf[8..16].copy_from_slice(&mono_ns().to_le_bytes());
        if let Err(e) = send_all(&out, &buf) {
            return if is_eof(&e) { Ok(()) } else { Err(e.into()) };
        }
    }
    Ok(())
}

fn pipe_forward(a: &PeerArgs) -> anyhow::Result<()> {
    let size: usize = a.num("size")?;
    let mut inp = UnixStream::from(peer_fd(0));
    let out = peer_fd(1);
    let mut buf = vec![0u8; size];
    loop {
        if let Err(e) = inp.read_exact(&mut buf) {
            return if is_eof(&e) { Ok(()) } else { Err(e.into()) };
        }
        if let Err(e) = send_all(&out, &buf) {
            return if is_eof(&e) { Ok(()) } else { Err(e.into()) };
        }
    }
}

fn pipe_sink(a: &PeerArgs) -> anyhow::Result<()> {
    let size: usize = a.num("size")?;
    let warm = Duration::from_nanos(a.num("warm_ns")?);
    let dur = Duration::from_nanos(a.num("dur_ns")?);
    let mut inp = UnixStream::from(peer_fd(0));
    let mut buf = vec![0u8; size];
    let mut recv = |buf: &mut [u8]| -> anyhow::Result<u64> {
        inp.read_exact(buf).context("pipeline broke")?;
        fold(buf);
        let stamp = u64::from_le_bytes(buf[8..16].try_into().unwrap());
        Ok(mono_ns().saturating_sub(stamp))
    };
    let t = Instant::now();
    while t.elapsed() < warm {
        recv(&mut buf)?;
    }
    let mut lat = Vec::with_capacity(1 << 14);
    let start = Instant::now();
    let elapsed = loop {
        lat.push(recv(&mut buf)?);
        let e = start.elapsed();
        if e >= dur {
            break e;
        }
    };
    let bps = (lat.len() * size) as f64 / elapsed.as_secs_f64();
    let mut out = Vec::with_capacity(16 + 8 * lat.len());
    out.extend_from_slice(&bps.to_le_bytes());
    out.extend_from_slice(&(lat.len() as u64).to_le_bytes());
    for l in &lat {
        out.extend_from_slice(&l.to_le_bytes());
    }
    let mut so = std::io::stdout().lock();
    so.write_all(&out)?;
    so.flush()?;
    Ok(())
}

pub(crate) fn peer(kind: &str, a: &PeerArgs) -> Option<anyhow::Result<()>> {
    match kind {
        "sock-echo" => Some(echo_peer(a)),
        "sock-stream" => Some(stream_peer(a)),
        "pipe-source" => Some(pipe_source(a)),
        "pipe-forward" => Some(pipe_forward(a)),
        "pipe-sink" => Some(pipe_sink(a)),
        _ => None,
    }
}
