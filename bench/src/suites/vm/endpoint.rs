//! `fido-bench vm-endpoint --mode agent`: the guest side of every `vm` case,
//! started by the test guest's init (`fido.run=`) and driven by the host over
//! the virtio-serial port [`CTL_PORT`], one line per command:
//!
//! ```text
//! host  → guest   <command> key=value ...
//! guest → host    ready            (listening / offering: the other side may start)
//!                 done key=value ...   or   error <why>
//! ```
//!
//! It announces itself with `hello` when it has opened the port. Commands:
//! `tcp-echo|tcp-sink port= size=`, `tcp-source|tcp-ping addr= port= size=
//! ms= [warm_ms=]`, `serial-echo|serial-source size= [ms=]` (on the port
//! [`SERIAL_PORT`]), `fido-echo|fido-sink|fido-source|fido-ping svc= size=
//! [wait=] [ms=] [warm_ms=] [batch=]`, `fido-source-to svc= size= ms= [batch=]`
//! (connects, then streams; `batch=N`: N messages per Fido message), `fido-probe` (joins Fido: can this guest be a domain?), `quit`. A failing command answers `error` and
//! the agent takes the next one: one bad case does not end the run.

use std::collections::HashMap;
use std::fs::File;
use std::io::{BufRead, BufReader, Write};
use std::net::{TcpListener, TcpStream};
use std::os::fd::AsFd;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{bail, Context as _};

use super::{fidoops, stream};

/// The agent's control port (virtio-serial port name).
pub const CTL_PORT: &str = "org.fido.bench.ctl";
/// The port the `virtio-serial` system's bytes cross.
pub const SERIAL_PORT: &str = "org.fido.bench.serial";
/// Socket buffers of the TCP baseline (SO_SNDBUF / SO_RCVBUF, forced: root).
pub const SOCKET_BUFFER: usize = 4 << 20;

/// `key=value` arguments of one command line.
pub struct Kv(HashMap<String, String>);

impl Kv {
    pub fn parse<'a>(words: impl Iterator<Item = &'a str>) -> Kv {
        Kv(words
            .filter_map(|w| w.split_once('='))
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect())
    }

    pub fn get(&self, k: &str) -> anyhow::Result<&str> {
        self.0
            .get(k)
            .map(String::as_str)
            .with_context(|| format!("missing {k}="))
    }

    pub fn num<T: std::str::FromStr>(&self, k: &str) -> anyhow::Result<T> {
        self.get(k)?
            .parse()
            .map_err(|_| anyhow::anyhow!("{k}= is not a number"))
    }

    pub fn ms(&self, k: &str) -> anyhow::Result<Duration> {
        Ok(Duration::from_millis(self.num(k)?))
    }

    /// `batch=`: messages per Fido message of a source (1 when absent).
    pub fn batch(&self) -> anyhow::Result<usize> {
        match self.0.get("batch") {
            None => Ok(1),
            Some(_) => match self.num("batch")? {
                0 => bail!("batch=0"),
                n => Ok(n),
            },
        }
    }
}

/// `/dev/vportNpM` of the virtio-serial port named `name` (no udev in the
/// test guest: `/sys/class/virtio-ports/*/name` says which is which).
pub fn find_port(name: &str) -> anyhow::Result<PathBuf> {
    for e in std::fs::read_dir("/sys/class/virtio-ports").context("no virtio-ports in sysfs")? {
        let e = e?;
        if std::fs::read_to_string(e.path().join("name")).is_ok_and(|n| n.trim() == name) {
            return Ok(PathBuf::from("/dev").join(e.file_name()));
        }
    }
    bail!("no virtio-serial port named {name}")
}

fn open_port(name: &str) -> anyhow::Result<File> {
    let p = find_port(name)?;
    std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(&p)
        .with_context(|| format!("opening {}", p.display()))
}

/// Large socket buffers, as a competent user sets them for throughput (forced
/// past `rmem_max`/`wmem_max` where we may: the agent and the host bench run
/// as root).
pub fn big_buffers(s: impl AsFd) -> anyhow::Result<()> {
    use rustix::net::sockopt as so;
    let fd = s.as_fd();
    if so::set_socket_send_buffer_size_force(fd, SOCKET_BUFFER).is_err() {
        so::set_socket_send_buffer_size(fd, SOCKET_BUFFER)?;
    }
    if so::set_socket_recv_buffer_size_force(fd, SOCKET_BUFFER).is_err() {
        so::set_socket_recv_buffer_size(fd, SOCKET_BUFFER)?;
    }
    Ok(())
}

/// Accepts one connection within [`fidoops::ACCEPT`].
pub fn accept_one(l: &TcpListener) -> anyhow::Result<TcpStream> {
    l.set_nonblocking(true)?;
    let t = Instant::now();
    loop {
        match l.accept() {
            Ok((s, _)) => {
                s.set_nonblocking(false)?;
                return Ok(s);
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                if t.elapsed() > fidoops::ACCEPT {
                    bail!("nobody connected within {:?}", fidoops::ACCEPT);
                }
                std::thread::sleep(Duration::from_millis(2));
            }
            Err(e) => return Err(e.into()),
        }
    }
}

/// Connects, retrying while the other side is not listening yet.
pub fn connect_retry(addr: &str, port: u16) -> anyhow::Result<TcpStream> {
    let t = Instant::now();
    loop {
        match TcpStream::connect((addr, port)) {
            Ok(s) => return Ok(s),
            Err(e) if t.elapsed() > Duration::from_secs(30) => {
                return Err(e).with_context(|| format!("connecting to {addr}:{port}"))
            }
            Err(_) => std::thread::sleep(Duration::from_millis(20)),
        }
    }
}

/// A sink's report as `done` arguments (and back: [`parse_sink`]).
pub fn sink_words(r: &stream::SinkReport) -> String {
    format!(
        "messages={} checksum={} timed_messages={} timed_ns={}",
        r.messages, r.checksum, r.timed_messages, r.timed_ns
    )
}

pub fn parse_sink(kv: &Kv) -> anyhow::Result<stream::SinkReport> {
    Ok(stream::SinkReport {
        messages: kv.num("messages")?,
        checksum: kv.num("checksum")?,
        timed_messages: kv.num("timed_messages")?,
        timed_ns: kv.num("timed_ns")?,
    })
}

/// Round trips as `done` arguments: count, p50, p99 (ns).
fn rtt_words(mut rtts: Vec<u64>) -> String {
    let (p50, p99) = crate::percentiles(&mut rtts);
    format!("n={} rtt_p50={p50} rtt_p99={p99}", rtts.len())
}

struct Agent {
    ctl: File,
    /// The guest's Fido domain, joined at the first `fido-*` command and kept
    /// (one domain per process: the PGVAS window holds one).
    domain: Option<fido::Domain>,
}

impl Agent {
    fn say(&mut self, line: &str) -> anyhow::Result<()> {
        let mut l = line.replace('\n', " ");
        l.push('\n');
        self.ctl.write_all(l.as_bytes())?;
        Ok(())
    }

    fn domain(&mut self) -> anyhow::Result<fido::Domain> {
        if let Some(d) = &self.domain {
            return Ok(d.clone());
        }
        let host = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default();
        // Inside a guest, `Domain::join` finds the broker through the
        // virtio-serial port `org.fido.broker` (the VM's supervisor): no
        // socket path, no configuration. The arena is the VM's own (its size
        // is `fido vm run --arena`).
        let d = fido::Domain::join(
            fido::JoinOptions::new(format!("bench-{}", host.trim())).ring_entries(64),
        )
        .context("joining Fido from the guest")?;
        self.domain = Some(d.clone());
        Ok(d)
    }

    fn run(&mut self, cmd: &str, kv: &Kv) -> anyhow::Result<String> {
        Ok(match cmd {
            "tcp-echo" | "tcp-sink" => {
                let l = TcpListener::bind(("0.0.0.0", kv.num::<u16>("port")?))?;
                self.say("ready")?;
                let mut s = accept_one(&l)?;
                if cmd == "tcp-echo" {
                    s.set_nodelay(true)?;
                    format!("messages={}", stream::echo(&mut s, kv.num("size")?)?)
                } else {
                    big_buffers(&s)?;
                    sink_words(&stream::sink(&mut s, kv.num("size")?)?)
                }
            }
            "tcp-source" | "tcp-ping" => {
                let mut s = connect_retry(kv.get("addr")?, kv.num("port")?)?;
                let size = kv.num("size")?;
                if cmd == "tcp-ping" {
                    s.set_nodelay(true)?;
                    let rtts = stream::ping_pong(&mut s, size, kv.ms("warm_ms")?, kv.ms("ms")?)?;
                    rtt_words(rtts)
                } else {
                    big_buffers(&s)?;
                    format!("messages={}", stream::source(&mut s, size, kv.ms("ms")?)?)
                }
            }
            "serial-echo" | "serial-source" => {
                let mut port = open_port(SERIAL_PORT)?;
                self.say("ready")?;
                let size = kv.num("size")?;
                if cmd == "serial-echo" {
                    format!("messages={}", stream::echo(&mut port, size)?)
                } else {
                    format!(
                        "messages={}",
                        stream::source(&mut port, size, kv.ms("ms")?)?
                    )
                }
            }
            "fido-echo" | "fido-sink" | "fido-source" => {
                let d = self.domain()?;
                let size = kv.num("size")?;
                let listener = d.offer(kv.get("svc")?)?;
                self.say("ready")?;
                let ch = listener.accept_timeout(fidoops::ACCEPT)?;
                ch.set_wait(fidoops::parse_wait(kv.get("wait").unwrap_or("block"))?);
                let before = d.counters().bytes_copied;
                let words = match cmd {
                    "fido-echo" => format!("messages={}", fidoops::echo(&d, &ch, size)?),
                    "fido-sink" => sink_words(&fidoops::sink(&ch, size)?),
                    _ => format!("messages={}", fidoops::source(&d, &ch, size, kv.batch()?, kv.ms("ms")?)?),
                };
                // The peer's last receive ends with END: let its releases come
                // back before the channel goes.
                let _ = fido_drain(&ch);
                format!(
                    "{words} bytes_copied={}",
                    d.counters().bytes_copied - before
                )
            }
            "fido-ping" => {
                let d = self.domain()?;
                let ch = d.connect(kv.get("svc")?)?;
                ch.set_wait(fidoops::parse_wait(kv.get("wait").unwrap_or("block"))?);
                let before = d.counters().bytes_copied;
                let rtts =
                    fidoops::ping_pong(&d, &ch, kv.num("size")?, kv.ms("warm_ms")?, kv.ms("ms")?)?;
                let _ = fido_drain(&ch);
                format!(
                    "{} bytes_copied={}",
                    rtt_words(rtts),
                    d.counters().bytes_copied - before
                )
            }
            "fido-source-to" => {
                // VM↔VM throughput: this guest connects and streams.
                let d = self.domain()?;
                let ch = d.connect(kv.get("svc")?)?;
                let before = d.counters().bytes_copied;
                let n = fidoops::source(&d, &ch, kv.num("size")?, kv.batch()?, kv.ms("ms")?)?;
                let _ = fido_drain(&ch);
                format!(
                    "messages={n} bytes_copied={}",
                    d.counters().bytes_copied - before
                )
            }
            "fido-probe" => {
                // Whether the guest can be a Fido domain at all (joins once).
                format!("domain={}", self.domain()?.id())
            }
            o => bail!("unknown command `{o}`"),
        })
    }
}

fn fido_drain(ch: &fido::Channel) -> anyhow::Result<()> {
    fido_demo::pipeline::drain(ch, Duration::from_secs(5))
}

/// Raises the guest's socket buffer limits (as the host's allow) so that
/// forced 4 MiB buffers and TCP autotuning are not capped at 208 KiB.
fn tune_guest_network() {
    for (path, v) in [
        ("/proc/sys/net/core/rmem_max", "16777216"),
        ("/proc/sys/net/core/wmem_max", "16777216"),
        ("/proc/sys/net/ipv4/tcp_rmem", "4096 131072 16777216"),
        ("/proc/sys/net/ipv4/tcp_wmem", "4096 131072 16777216"),
    ] {
        let _ = std::fs::write(path, v);
    }
}

/// `fido-bench vm-endpoint --mode MODE`.
pub fn main(mode: &str) -> anyhow::Result<()> {
    if mode != "agent" {
        bail!("unknown vm-endpoint mode `{mode}` (agent: serve the host's commands on the port {CTL_PORT})");
    }
    tune_guest_network();
    let ctl = open_port(CTL_PORT)?;
    let mut lines = BufReader::new(ctl.try_clone()?);
    let mut agent = Agent { ctl, domain: None };
    agent.say(&format!("hello pid={}", std::process::id()))?;
    let mut line = String::new();
    loop {
        line.clear();
        if lines.read_line(&mut line)? == 0 {
            // No host connected to the port (reads return 0 then): wait.
            std::thread::sleep(Duration::from_millis(50));
            continue;
        }
        let mut words = line.split_whitespace();
        let Some(cmd) = words.next() else { continue };
        if cmd == "quit" {
            agent.say("done")?;
            return Ok(());
        }
        let kv = Kv::parse(words);
        let reply = match agent.run(cmd, &kv) {
            Ok(w) => format!("done {w}"),
            Err(e) => format!("error {cmd}: {e:#}"),
        };
        agent.say(&reply)?;
    }
}
