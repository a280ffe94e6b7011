//! Null-RPC round trip, notified and polled: a quick self-check, not the
//! benchmark (`fido bench rpc` is). Starts a private broker, a server domain
//! and a client domain in this process (separate threads).
//!
//! cargo run --release -p fido-rpc --example null_rtt [ITERS]

use fido::{Domain, JoinOptions, WaitStrategy};
use fido_rpc::services::bench::{BenchClient, BenchImpl, BenchServer};
use fido_rpc::{Server, ServerOptions};
use std::time::{Duration, Instant};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let iters: usize = std::env::args().nth(1).map(|s| s.parse()).transpose()?.unwrap_or(20_000);
    let dir = tempfile::tempdir()?;
    let sock = dir.path().join("broker.sock");
    let (_t, shutdown) = fido_broker::Broker::spawn(fido_broker::Config::new(&sock, dir.path().join("state")))?;
    let join = |n: &str| Domain::join(JoinOptions::new(n).broker(&sock).arena_len(64 << 20));
    let sd = join("server")?;
    let cd = join("client")?;
    for (name, wait) in [("notified", WaitStrategy::Block), ("polled", WaitStrategy::BusyPoll)] {
        let h = Server::spawn(&sd, name, BenchServer(BenchImpl), ServerOptions { workers: 1, wait: Some(wait) })?;
        let c = BenchClient::connect(&cd, name)?;
        c.0.set_wait(wait);
        for _ in 0..1000 {
            c.null(c.frame()?)?;
        }
        let mut lat = Vec::with_capacity(iters);
        for _ in 0..iters {
            let t = Instant::now();
            let f = c.frame()?;
            drop(c.null(f)?);
            lat.push(t.elapsed());
        }
        lat.sort();
        let p = |q: f64| lat[((lat.len() as f64 * q) as usize).min(lat.len() - 1)];
        println!("null-{name}: p50 {:?} p99 {:?} ({iters} calls)", p(0.5), p(0.99));
        drop(c);
        h.stop();
        std::thread::sleep(Duration::from_millis(50));
    }
    shutdown.shutdown();
    Ok(())
}
