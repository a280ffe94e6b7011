//! `fido blk raid1|raid0|concat NAME --member A --member B …`: a composition
//! domain in the foreground, serving block device NAME made of other block
//! services (docs/BLK.md, "RAID"); `fido blk raid-status NAME` prints its
//! state (also in the registry under `/blk/NAME/raid`).

use std::io::Write as _;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context as _};
use clap::Args;
use fido::{Domain, JoinOptions};
use fido_blk::raid::{self, Layout, Raid, RaidOptions, RaidStatus};
use fido_blk::{proto, ServeOptions};

use crate::vm::parse_size;

#[derive(Args)]
pub struct CommonArgs {
    /// The composed block device's name (service blk:NAME).
    name: String,
    /// A member block device (its service blk:MEMBER); give two or more, in order.
    #[arg(long = "member", value_name = "MEMBER", required = true)]
    members: Vec<String>,
    /// How long to wait at start for the members (all of them for raid0 and
    /// concat; at least one mirror for raid1, the others join when they come).
    #[arg(long, value_name = "SECONDS", default_value_t = 10)]
    wait: u64,
    /// The composition domain's arena.
    #[arg(long, value_parser = parse_size, default_value = "64M")]
    arena: u64,
    /// Broker socket [default: $FIDO_BROKER, $XDG_RUNTIME_DIR/fido/broker.sock, /run/fido/broker.sock]
    #[arg(long)]
    socket: Option<PathBuf>,
}

#[derive(Args)]
pub struct Raid1Args {
    #[command(flatten)]
    common: CommonArgs,
    /// The mirrors are identical already: no initial copy from the first one.
    #[arg(long)]
    assume_clean: bool,
    /// Copy a mirror that comes back whole, not only the regions written
    /// while it was away (members that lose their data on restart: --ram).
    #[arg(long)]
    full_resync: bool,
}

#[derive(Args)]
pub struct Raid0Args {
    #[command(flatten)]
    common: CommonArgs,
    /// Bytes on each member in turn (a multiple of the members' block).
    #[arg(long, value_parser = parse_size, default_value = "64K")]
    chunk: u64,
}

#[derive(Args)]
pub struct ConcatArgs {
    #[command(flatten)]
    common: CommonArgs,
}

#[derive(Args)]
pub struct StatusArgs {
    name: String,
    /// Broker socket [default: $FIDO_BROKER, $XDG_RUNTIME_DIR/fido/broker.sock, /run/fido/broker.sock]
    #[arg(long)]
    socket: Option<PathBuf>,
}

pub fn raid1(a: Raid1Args) -> anyhow::Result<()> {
    run(a.common, Layout::Mirror, a.assume_clean, a.full_resync)
}

pub fn raid0(a: Raid0Args) -> anyhow::Result<()> {
    run(a.common, Layout::Stripe { chunk: a.chunk }, false, false)
}

pub fn concat(a: ConcatArgs) -> anyhow::Result<()> {
    run(a.common, Layout::Concat, false, false)
}

pub fn status(a: StatusArgs) -> anyhow::Result<()> {
    proto::service_name(&a.name)?;
    let d = join(&a.socket, "fido-blk-raid-status", 1 << 20)?;
    let Some(v) = d.read(&raid::status_key(&a.name))? else {
        bail!("no RAID state published for {:?} (is `fido blk raid1|raid0|concat {}` running?)", a.name, a.name)
    };
    print!("{}", String::from_utf8_lossy(&v));
    Ok(())
}

fn join(socket: &Option<PathBuf>, name: &str, arena: u64) -> anyhow::Result<Domain> {
    let path = socket.clone().unwrap_or_else(fido::default_broker_path);
    Domain::join(JoinOptions::new(name).broker(&path).arena_len(arena)).with_context(|| format!("joining the broker at {}", path.display()))
}

/// One line of what changed: the state, each member's, the resync's progress.
fn summary(s: &RaidStatus) -> String {
    let members: Vec<String> = s.members.iter().map(|m| format!("{}:{}", m.name, m.state.name())).collect();
    let mut line = format!("state={} members={}", s.state, members.join(","));
    if s.resync_total > 0 && s.members.iter().any(|m| m.state == raid::MemberState::Resyncing) {
        line += &format!(" resync={}/{}", s.resync_done, s.resync_total);
    }
    line
}

fn run(a: CommonArgs, layout: Layout, assume_clean: bool, full_resync: bool) -> anyhow::Result<()> {
    proto::service_name(&a.name)?;
    let stop = Arc::new(AtomicBool::new(false));
    for sig in [signal_hook::consts::SIGINT, signal_hook::consts::SIGTERM] {
        signal_hook::flag::register(sig, stop.clone())?;
    }
    let d = join(&a.socket, &format!("blk-{}", a.name), a.arena)?;
    let opts = RaidOptions { layout, members: a.members.clone(), assume_clean, full_resync, connect_timeout: Duration::from_secs(a.wait) };
    let raid = Raid::start(&d, opts).with_context(|| format!("building {} {}", layout.name(), a.name))?;
    let server = fido_blk::serve(&d, &a.name, raid.clone(), ServeOptions { publish_stats: true, ..Default::default() })?;
    let i = server.info();
    // Scripts and tests wait for this line.
    println!(
        "serving blk:{} {} size={} block={} max_transfer={} flags={:#x} members={}",
        a.name,
        layout.name(),
        i.size,
        i.logical_block,
        i.max_transfer,
        i.flags,
        a.members.join(",")
    );
    std::io::stdout().flush()?;
    let key = raid::status_key(&a.name);
    let mut last_line = String::new();
    let mut published = String::new();
    let mut last_publish = Instant::now() - Duration::from_secs(1);
    while !stop.load(Ordering::Relaxed) {
        let s = raid.status();
        let line = summary(&s);
        // A change of state is published at once; counters at most twice a second.
        let changed = line != last_line;
        if changed {
            println!("raid {}: {line}", a.name);
            std::io::stdout().flush()?;
            last_line = line;
        }
        let text = s.to_text();
        if text != published && (changed || last_publish.elapsed() >= Duration::from_millis(500)) {
            if let Err(e) = d.write(&key, text.as_bytes()) {
                tracing::debug!(error = %e, "publishing the RAID state");
            }
            published = text;
            last_publish = Instant::now();
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    eprintln!("fido blk {} {}: stopping after the requests in flight", layout.name(), a.name);
    server.stop();
    drop(raid);
    Ok(())
}
