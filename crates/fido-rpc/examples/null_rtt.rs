//! Null-RPC round trip, notified and polled: a quick self-check, not the
//! benchmark (`fido-bench rpc` is). Starts a private broker, runs the server
//! in a child process (this program re-executed with `--serve`), and calls
//! it from this one.
//!
//! cargo run --release -p fido-rpc --example null_rtt [ITERS [notified|polled]]

use fido::{Domain, JoinOptions, WaitStrategy};
use fido_examples::services::bench::{BenchClient, BenchImpl, BenchServer};
use fido_rpc::{Server, ServerOptions};
use std::io::Read;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const CASES: [(&str, WaitStrategy); 2] = [("notified", WaitStrategy::Block), ("polled", WaitStrategy::BusyPoll)];

fn serve() -> Result<(), Box<dyn std::error::Error>> {
    let d = Domain::join(JoinOptions::new("rtt-server").arena_len(64 << 20))?;
    let _hs: Vec<_> = CASES
        .iter()
        .map(|(name, wait)| Server::spawn(&d, name, BenchServer(BenchImpl), ServerOptions { workers: 1, wait: Some(*wait) }))
        .collect::<Result<_, _>>()?;
    println!("ready");
    // Until the parent closes our stdin.
    let _ = std::io::stdin().read(&mut [0u8; 1]);
    Ok(())
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    if std::env::args().nth(1).as_deref() == Some("--serve") {
        return serve();
    }
    let iters: usize = std::env::args().nth(1).map(|s| s.parse()).transpose()?.unwrap_or(20_000);
    let dir = tempfile::tempdir()?;
    let sock = dir.path().join("broker.sock");
    let broker = fido_broker::Embedded::start(fido_broker::Config::new(&sock, dir.path().join("state")))?;
    let mut child = Command::new(std::env::current_exe()?)
        .arg("--serve")
        .env("FIDO_BROKER", &sock)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()?;
    let mut buf = [0u8; 6];
    child.stdout.take().expect("piped").read_exact(&mut buf)?;
    let cd = Domain::join(JoinOptions::new("rtt-client").broker(&sock).arena_len(64 << 20))?;
    let only = std::env::args().nth(2);
    for (name, wait) in CASES.into_iter().filter(|(n, _)| only.as_deref().is_none_or(|o| o == *n)) {
        let c = BenchClient::connect(&cd, name)?;
        c.0.set_wait(wait);
        for _ in 0..1000 {
            c.null(c.frame()?)?;
        }
        let mut lat = Vec::with_capacity(iters);
        for _ in 0..iters {
            let t = Instant::now();
            drop(c.null(c.frame()?)?);
            lat.push(t.elapsed());
        }
        lat.sort();
        let p = |q: f64| lat[((lat.len() as f64 * q) as usize).min(lat.len() - 1)];
        println!("null-{name}: p50 {:?} p99 {:?} ({iters} calls, server in another process)", p(0.5), p(0.99));
    }
    drop(child.stdin.take());
    let _ = child.wait();
    broker.stop()?;
    std::thread::sleep(Duration::from_millis(10));
    Ok(())
}
