//! `fido blk nbd NAME --unix PATH | --tcp ADDR`: an NBD server in front of
//! block device NAME (crates/fido-blk-nbd), in the foreground until
//! SIGINT/SIGTERM.

use std::io::Write as _;
use std::path::PathBuf;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;

use anyhow::Context as _;
use clap::Args;
use fido::{Domain, JoinOptions, WaitStrategy};
use fido_blk_nbd::{BlkExport, Listener, NbdServer, ServerConfig};

use crate::vm::parse_size;

#[derive(Args)]
#[command(group = clap::ArgGroup::new("listen").required(true).args(["unix", "tcp"]))]
pub struct NbdArgs {
    /// The block device served (service blk:NAME).
    name: String,
    /// Listen on this Unix socket (a stale socket file is replaced).
    #[arg(long, value_name = "PATH")]
    unix: Option<PathBuf>,
    /// Listen on this TCP address (e.g. 127.0.0.1:10809; port 0: any, printed).
    #[arg(long, value_name = "ADDR")]
    tcp: Option<String>,
    /// The NBD export name [default: NAME]; the empty name selects it too.
    #[arg(long, value_name = "EXPORTNAME")]
    export: Option<String>,
    /// NBD connections served at once.
    #[arg(long, default_value_t = 64)]
    max_connections: usize,
    /// Requests in flight per NBD connection, at most (also bounded by the device's queue depth).
    #[arg(long, default_value_t = 128)]
    max_in_flight: usize,
    /// This domain's arena: WRITE payloads wait here until the storage domain wrote them.
    #[arg(long, value_parser = parse_size, default_value = "1G")]
    arena: u64,
    /// How long a thread waiting for the storage domain spins before it sleeps, in µs (0: sleep at once).
    #[arg(long, default_value_t = 50)]
    spin_us: u64,
    /// Broker socket [default: $FIDO_BROKER, $XDG_RUNTIME_DIR/fido/broker.sock, /run/fido/broker.sock]
    #[arg(long)]
    socket: Option<PathBuf>,
}

fn wait_strategy(spin_us: u64) -> WaitStrategy {
    if spin_us == 0 {
        WaitStrategy::Block
    } else {
        WaitStrategy::Adaptive { spin: std::time::Duration::from_micros(spin_us) }
    }
}

pub fn run(a: NbdArgs) -> anyhow::Result<bool> {
    let broker = a.socket.clone().unwrap_or_else(fido::default_broker_path);
    let domain = Domain::join(JoinOptions::new(format!("nbd:{}", a.name)).broker(&broker).arena_len(a.arena).wait(wait_strategy(a.spin_us)))
        .with_context(|| format!("joining the broker at {}", broker.display()))?;
    let export = BlkExport::new(domain, &a.name)?;
    let info = export.probe().with_context(|| format!("is `fido blk serve {}` running?", a.name))?;

    let mut cfg = ServerConfig::new(a.export.clone().unwrap_or_else(|| a.name.clone()));
    cfg.description = Some(format!("fido block device {}", a.name));
    cfg.max_connections = a.max_connections;
    cfg.max_in_flight = a.max_in_flight;
    let export_name = cfg.export_name.clone();
    let server = NbdServer::new(export, cfg)?;

    let listener = match (&a.unix, &a.tcp) {
        (Some(p), None) => Listener::bind_unix(p).with_context(|| format!("listening on {}", p.display()))?,
        (None, Some(addr)) => Listener::bind_tcp(addr.as_str()).with_context(|| format!("listening on {addr}"))?,
        _ => anyhow::bail!("give one of --unix PATH and --tcp ADDR"),
    };
    let place = listener.describe();
    let stop = Arc::new(AtomicBool::new(false));
    for sig in [signal_hook::consts::SIGINT, signal_hook::consts::SIGTERM] {
        signal_hook::flag::register(sig, stop.clone())?;
    }
    // Scripts and tests wait for this line.
    println!(
        "nbd: serving blk:{} as export {:?} on {place} size={} block={}",
        a.name, export_name, info.size, info.logical_block
    );
    std::io::stdout().flush()?;
    let served = server.serve(&listener, &stop);
    if let Some(p) = &a.unix {
        let _ = std::fs::remove_file(p);
    }
    served.context("accepting NBD clients")?;
    eprintln!("fido blk nbd {}: stopped", a.name);
    Ok(true)
}
