//! `fido guest`: check and exercise a domain from inside a VM (or from the
//! host: these are ordinary domains). `check` is what a user runs in their
//! own image to see that the guest side works; `echo` and `ping` are a
//! zero-copy round trip across the VM boundary, used by the VM tests.

use anyhow::{bail, Context};
use clap::Subcommand;
use fido::{Domain, JoinOptions, Message, WaitStrategy};
use serde_json::json;
use std::path::{Path, PathBuf};
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
    /// Test only (the VM isolation tests): connect to SERVICE, take one
    /// message and print (JSON) how its peer's arena is mapped here, hold it
    /// until the file RELEASE exists, then send it back (forwarded).
    #[command(name = "__hold", hide = true)]
    Hold {
        service: String,
        #[arg(long)]
        release: PathBuf,
        /// Seconds to wait for RELEASE.
        #[arg(long, default_value_t = 120.0)]
        wait: f64,
    },
    /// Test only: what a hostile root in a guest can do to a device BAR it
    /// reads: map the sysfs resource file PATH read-write, write VALUE at
    /// OFFSET and read the word back (JSON line).
    #[command(name = "__poke", hide = true)]
    Poke { path: PathBuf, offset: u64, value: u32 },
    /// Test only: connect to SERVICE and send COUNT small messages without
    /// waiting for replies (a sender whose every publish may ring its peer).
    #[command(name = "__flood", hide = true)]
    Flood {
        service: String,
        #[arg(long, default_value_t = 1_000_000)]
        count: u64,
        /// Meanwhile offer this service and echo on it (one Fido guest per
        /// VM: the same process serves the VM's other connections).
        #[arg(long)]
        echo: Option<String>,
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
        GuestCmd::Hold { service, release, wait } => hold(&service, &release, wait),
        GuestCmd::Poke { path, offset, value } => poke(&path, offset, value),
        GuestCmd::Flood { service, count, echo } => flood(&service, count, echo.as_deref()),
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

/// Round trips `ping` keeps for its percentiles.
const RTT_SAMPLES: usize = 1 << 16;

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
    // A uniform sample of the round trips (Algorithm R): an endless ping
    // (`--count` in the billions) keeps memory bounded and its percentiles
    // unbiased.
    let mut rtts = Vec::with_capacity(count.min(RTT_SAMPLES as u64) as usize);
    let mut rng = 0x9e37_79b9_7f4a_7c15_u64;
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
        let rtt = t.elapsed();
        if rtts.len() < RTT_SAMPLES {
            rtts.push(rtt);
        } else {
            // xorshift64: uniform enough for sampling, no dependency.
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            let slot = rng % (i + 1);
            if let Some(kept) = rtts.get_mut(slot as usize) {
                *kept = rtt;
            }
        }
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

/// Connects to `service`, retrying for `wait` seconds while it appears.
fn connect_retry(d: &Domain, service: &str, wait: f64) -> anyhow::Result<fido::Channel> {
    let deadline = Instant::now() + Duration::from_secs_f64(wait);
    loop {
        match d.connect(service) {
            Ok(ch) => return Ok(ch),
            Err(e) if Instant::now() < deadline => {
                tracing::debug!("connect {service}: {e}; retrying");
                std::thread::sleep(Duration::from_millis(100));
            }
            Err(e) => return Err(e).context(format!("connecting to {service}")),
        }
    }
}

/// The line of /proc/self/maps whose range holds `addr`, with the offset of
/// `addr` in the mapped file.
fn mapping_of(addr: u64) -> anyhow::Result<(String, u64)> {
    let maps = std::fs::read_to_string("/proc/self/maps")?;
    for line in maps.lines() {
        let mut f = line.split_whitespace();
        let (Some(range), Some(_perms), Some(offset)) = (f.next(), f.next(), f.next()) else { continue };
        let Some((start, end)) = range.split_once('-') else { continue };
        let (start, end) = (u64::from_str_radix(start, 16)?, u64::from_str_radix(end, 16)?);
        if (start..end).contains(&addr) {
            return Ok((line.to_string(), addr - start + u64::from_str_radix(offset, 16)?));
        }
    }
    bail!("no mapping holds {addr:#x}")
}

fn hold(service: &str, release: &Path, wait: f64) -> anyhow::Result<bool> {
    let d = Domain::join(JoinOptions::new("fido-hold")).context("joining")?;
    let ch = connect_retry(&d, service, 30.0)?;
    let msg = ch.recv()?;
    let view = msg.as_slice().context("the message is not one segment")?;
    let first = view.iter().next().unwrap_or(0);
    let uniform = view.iter().all(|b| b == first);
    let gptr = msg.global_segments().next().map_or(0, |(g, _)| g.0);
    let addr = view.as_ptr() as u64;
    let (line, file_offset) = mapping_of(addr)?;
    // What fido mapped must stay read-only, even to a write that ignores
    // page protections (/proc/self/mem, as a debugger writes): a shared
    // mapping of a file opened read-only cannot be written at all.
    let forced = match std::fs::OpenOptions::new().write(true).open("/proc/self/mem") {
        Ok(mem) => match std::os::unix::fs::FileExt::write_at(&mem, &[!first], addr) {
            Ok(n) => format!("wrote {n} bytes"),
            Err(e) => e.to_string(),
        },
        Err(e) => format!("open: {e}"),
    };
    println!(
        "{}",
        json!({
            "holding": service, "gptr": gptr, "addr": addr, "len": msg.len(), "first": first, "uniform": uniform,
            "map": line, "file_offset": file_offset, "forced_write": forced,
        })
    );
    let deadline = Instant::now() + Duration::from_secs_f64(wait);
    while !release.exists() {
        if Instant::now() >= deadline {
            bail!("{} never appeared", release.display());
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    ch.forward(msg).map_err(|e| e.error)?;
    // Wait for the host to close: our message must stay mapped until it read it.
    let _ = ch.recv();
    println!("{}", json!({"released": service}));
    Ok(true)
}

fn poke(path: &Path, offset: u64, value: u32) -> anyhow::Result<bool> {
    let path_s = path.display().to_string();
    match fido_guest::pci::write_through_mapping(path, offset, value) {
        Ok((before, after)) => println!("{}", json!({"path": path_s, "offset": offset, "before": before, "wrote": value, "read_back": after})),
        Err(e) => println!("{}", json!({"path": path_s, "failed": e.to_string()})),
    }
    Ok(true)
}

fn flood(service: &str, count: u64, echo: Option<&str>) -> anyhow::Result<bool> {
    let d = Domain::join(JoinOptions::new("fido-flood")).context("joining")?;
    if let Some(echo) = echo {
        let listener = d.offer(echo)?;
        println!("{}", json!({"ready": echo}));
        std::thread::spawn(move || {
            while let Ok(ch) = listener.accept() {
                std::thread::spawn(move || {
                    while let Ok(m) = ch.recv() {
                        if ch.forward(m).is_err() {
                            return;
                        }
                    }
                });
            }
        });
    }
    let ch = connect_retry(&d, service, 30.0)?;
    println!("{}", json!({"flooding": service}));
    let mut ended = None;
    for i in 0..count {
        let mut buf = d.alloc(64)?;
        buf.fill(i as u8);
        if let Err(e) = ch.send(Message::new(buf)) {
            ended = Some((i, e.error.to_string()));
            break;
        }
    }
    match ended {
        Some((sent, why)) => println!("{}", json!({"flood_ended": why, "sent": sent})),
        None => println!("{}", json!({"flooded": service, "count": count})),
    }
    // The echo service lives on (the tests look at it after the flood).
    while echo.is_some() {
        std::thread::sleep(Duration::from_secs(1));
    }
    Ok(true)
}
