//! `fido guest`: check and exercise a domain from inside a VM (or from the
//! host: these are ordinary domains). `check` is what a user runs in their
//! own image to see that the guest side works; `echo` and `ping` are a
//! zero-copy round trip across the VM boundary, used by the VM tests.

use anyhow::{bail, Context};
use clap::Subcommand;
use fido::{Domain, JoinOptions, Message, WaitStrategy};
use serde_json::json;
use std::time::{Duration, Instant};

#[derive(Subcommand)]
pub enum GuestCmd {
    /// Join the broker and print what this domain got (inside a VM: through
    /// its supervisor; the control port, doorbell device and arena BAR).
    Check {
        #[arg(long, default_value = "fido-guest-check")]
        name: String,
    },
    /// Offer SERVICE and send every message back to its sender, forwarded
    /// (the same buffer, no copy), until `--count` connections ended.
    Echo {
        service: String,
        #[arg(long, default_value = "fido-echo")]
        name: String,
        /// Connections to serve (0: forever).
        #[arg(long, default_value_t = 0)]
        count: u64,
        /// Spin instead of sleeping while waiting for messages.
        #[arg(long)]
        poll: bool,
    },
    /// Connect to SERVICE and time round trips of MESSAGE bytes; checks that
    /// each reply is the very buffer sent (same global address, same bytes).
    /// Prints one JSON line.
    Ping {
        service: String,
        #[arg(long, default_value = "fido-ping")]
        name: String,
        #[arg(long, default_value_t = 1000)]
        count: u64,
        #[arg(long, default_value_t = 64)]
        size: usize,
        /// Spin instead of sleeping while waiting for replies.
        #[arg(long)]
        poll: bool,
        /// Seconds to keep retrying the connection while the service appears.
        #[arg(long, default_value_t = 30.0)]
        wait: f64,
    },
}

fn strategy(poll: bool) -> WaitStrategy {
    if poll {
        WaitStrategy::BusyPoll
    } else {
        WaitStrategy::default()
    }
}

pub fn run(cmd: GuestCmd) -> anyhow::Result<bool> {
    match cmd {
        GuestCmd::Check { name } => check(&name),
        GuestCmd::Echo { service, name, count, poll } => echo(&service, &name, count, poll),
        GuestCmd::Ping { service, name, count, size, poll, wait } => ping(&service, &name, count, size, poll, wait),
    }
}

fn check(name: &str) -> anyhow::Result<bool> {
    match fido_guest::Guest::detect() {
        Some(port) => println!("VM guest: control port {}", port.display()),
        None => println!("not a VM guest (no virtio port named {}): joining the host broker", fido_proto::guest::PORT_NAME),
    }
    let d = Domain::join(JoinOptions::new(name)).context("joining")?;
    println!(
        "{}",
        json!({
            "domain": d.id(), "slot": d.slot(), "arena_base": format!("{:#x}", d.arena().base().0),
            "arena_len": d.arena().len(), "mode": format!("{:?}", d.address_mode()),
        })
    );
    Ok(true)
}

fn echo(service: &str, name: &str, count: u64, poll: bool) -> anyhow::Result<bool> {
    let d = Domain::join(JoinOptions::new(name).wait(strategy(poll))).context("joining")?;
    let listener = d.offer(service)?;
    println!("{}", json!({"ready": service, "domain": d.id()}));
    let mut served = 0;
    let mut workers = Vec::new();
    while count == 0 || served < count {
        let ch = listener.accept()?;
        served += 1;
        workers.push(std::thread::spawn(move || -> anyhow::Result<u64> {
            let mut n = 0;
            loop {
                match ch.recv() {
                    Ok(msg) => {
                        ch.forward(msg).map_err(|e| e.error)?;
                        n += 1;
                    }
                    Err(fido::Error::Closed | fido::Error::PeerGone { .. }) => return Ok(n),
                    Err(e) => return Err(e.into()),
                }
            }
        }));
    }
    for w in workers {
        match w.join() {
            Ok(Ok(_)) => {}
            Ok(Err(e)) => eprintln!("fido guest echo: a connection failed: {e}"),
            Err(_) => bail!("an echo worker panicked"),
        }
    }
    println!("{}", json!({"done": service, "connections": served, "bytes_copied": d.counters().bytes_copied}));
    Ok(true)
}

fn ping(service: &str, name: &str, count: u64, size: usize, poll: bool, wait: f64) -> anyhow::Result<bool> {
    if size == 0 {
        bail!("--size must be at least 1");
    }
    let d = Domain::join(JoinOptions::new(name).wait(strategy(poll))).context("joining")?;
    let deadline = Instant::now() + Duration::from_secs_f64(wait);
    let ch = loop {
        match d.connect(service) {
            Ok(ch) => break ch,
            Err(e) if Instant::now() < deadline => {
                tracing::debug!("connect {service}: {e}; retrying");
                std::thread::sleep(Duration::from_millis(100));
            }
            Err(e) => return Err(e).context(format!("connecting to {service}")),
        }
    };
    let mut rtts = Vec::with_capacity(count as usize);
    let mut same_pointer = true;
    let mut checksum_ok = true;
    let t0 = Instant::now();
    for i in 0..count {
        let mut buf = d.alloc(size)?;
        let fill = (i as u8).wrapping_mul(31).wrapping_add(7);
        buf.fill(fill);
        let sent = buf.gptr();
        let t = Instant::now();
        ch.send(Message::new(buf)).map_err(|e| e.error)?;
        let reply = ch.recv()?;
        rtts.push(t.elapsed());
        let got = reply.global_segments().next().map(|(g, _)| g);
        same_pointer &= got == Some(sent);
        checksum_ok &= reply.len() == size && reply.as_slice().is_some_and(|s| s.iter().all(|b| b == fill));
    }
    let total = t0.elapsed();
    rtts.sort();
    let pct = |p: f64| rtts.get(((rtts.len() as f64 - 1.0) * p).round() as usize).map_or(0.0, |d| d.as_secs_f64() * 1e6);
    println!(
        "{}",
        json!({
            "service": service, "count": count, "size": size, "poll": poll,
            "rtt_p50_us": pct(0.5), "rtt_p99_us": pct(0.99), "seconds": total.as_secs_f64(),
            "same_pointer": same_pointer, "checksum_ok": checksum_ok,
            "bytes_copied": d.counters().bytes_copied, "peer": ch.peer().name,
        })
    );
    Ok(same_pointer && checksum_ok)
}
