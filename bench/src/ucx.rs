//! `ucx-posix` baseline: `ucx_perftest` (Debian `ucx-utils`) over UCX's POSIX
//! shared-memory transport, polling. Server `ucx_perftest -c <peer cpu> -p PORT`, client
//! `ucx_perftest localhost -p PORT -c <parent cpu> … -n N -w W -s SIZE`; its "Final:" line
//! gives the 50th-percentile half round trip (µs), which becomes value = p50 (no p99:
//! ucx_perftest does not print one).
//!
//! UCT `am_lat` over `-x posix -d memory` supports short messages only up to 100 B and
//! bcopy up to ~8 KiB, so:
//! * ≤ 100 B: `-t am_lat -x posix -d memory` (short, the command of ANCHORS.md);
//! * ≤ 8 KiB: `-t am_lat -x posix -d memory -D bcopy`;
//! * larger: UCP `-t ucp_am_lat` with `UCX_TLS=posix,self` (fragmented active messages
//!   over the same shared-memory transport).
//!
//! The receiver does not fold the payload (ucx_perftest cannot be told to): bcopy/UCP
//! copy it once, short messages are inlined.

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context as _};

use crate::harness::*;

/// Whether `ucx_perftest` is on PATH.
pub fn available() -> bool {
    std::env::var_os("PATH")
        .map(|p| std::env::split_paths(&p).any(|d| d.join("ucx_perftest").is_file()))
        .unwrap_or(false)
}

struct Reaped(Child);

impl Drop for Reaped {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn free_port() -> anyhow::Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port())
}

/// Whether some socket listens on TCP `port` (from /proc/net/tcp{,6}).
fn listening(port: &str) -> bool {
    let Ok(p) = port.parse::<u16>() else {
        return false;
    };
    let want = format!(":{p:04X}");
    ["/proc/net/tcp", "/proc/net/tcp6"].iter().any(|f| {
        std::fs::read_to_string(f).is_ok_and(|t| {
            t.lines().skip(1).any(|l| {
                let c: Vec<&str> = l.split_whitespace().collect();
                c.len() > 3 && c[1].ends_with(&want) && c[3] == "0A"
            })
        })
    })
}

/// Rough half-round-trip guess (ns) used to size the iteration count to the duration.
fn guess_ns(size: usize) -> u64 {
    match size {
        0..=100 => 300,
        101..=8192 => 600,
        8193..=65536 => 8_000,
        _ => 100_000,
    }
}

/// Runs one size. Returns (p50 one-way ns, iterations).
pub fn latency(size: usize, opts: &Opts) -> anyhow::Result<(f64, u64)> {
    let place = Placement::detect();
    let n = (opts.duration().as_nanos() as u64 / (2 * guess_ns(size))).clamp(1000, 20_000_000);
    let w = (opts.warmup().as_nanos() as u64 / (2 * guess_ns(size))).clamp(100, 1_000_000);
    let port = free_port()?.to_string();
    let (test, extra): (&str, &[&str]) = match size {
        0..=100 => ("am_lat", &["-x", "posix", "-d", "memory"]),
        101..=8192 => ("am_lat", &["-x", "posix", "-d", "memory", "-D", "bcopy"]),
        _ => ("ucp_am_lat", &[]),
    };
    let env_tls = "posix,self";

    let mut server = Reaped(
        Command::new("ucx_perftest")
            .args(["-c", &place.peer.to_string(), "-p", &port])
            .env("UCX_TLS", env_tls)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .context("spawning ucx_perftest server")?,
    );
    // Its stdout is block-buffered into a pipe, so wait for the listening socket instead
    // (a probe connection would be taken for the client).
    let t = Instant::now();
    while !listening(&port) {
        if let Some(st) = server.0.try_wait()? {
            bail!("ucx_perftest server exited early: {st}");
        }
        if t.elapsed() > Duration::from_secs(10) {
            bail!("ucx_perftest server did not start listening on port {port}");
        }
        std::thread::sleep(Duration::from_millis(2));
    }

    let size_s = size.to_string();
    let (n_s, w_s) = (n.to_string(), w.to_string());
    let mut args = vec!["localhost", "-p", &port, "-t", test];
    args.extend_from_slice(extra);
    let cpu = place.parent.to_string();
    args.extend_from_slice(&["-c", &cpu, "-n", &n_s, "-w", &w_s, "-s", &size_s]);
    let client = Command::new("ucx_perftest")
        .args(&args)
        .env("UCX_TLS", env_tls)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .context("spawning ucx_perftest client")?;
    let mut client = Reaped(client);
    let deadline = Instant::now() + opts.duration() * 20 + Duration::from_secs(20);
    while client.0.try_wait()?.is_none() {
        if Instant::now() > deadline {
            bail!("ucx_perftest client timed out");
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    let mut text = String::new();
    use std::io::Read as _;
    if let Some(mut o) = client.0.stdout.take() {
        o.read_to_string(&mut text)?;
    }
    if let Some(mut o) = client.0.stderr.take() {
        o.read_to_string(&mut text)?;
    }
    drop(client);
    drop(server);
    let fin = text
        .lines()
        .find(|l| l.trim_start().starts_with("Final:"))
        .with_context(|| format!("ucx_perftest printed no Final line:\n{text}"))?;
    let tok: Vec<&str> = fin.split_whitespace().collect();
    // Final: <iterations> <p50 µs> <avg µs> <overall µs> ...
    let iters: u64 = tok.get(1).context("short Final line")?.parse()?;
    let p50_us: f64 = tok.get(2).context("short Final line")?.parse()?;
    Ok((p50_us * 1e3, iters))
}
