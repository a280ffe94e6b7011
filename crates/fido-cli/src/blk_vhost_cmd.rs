//! `fido blk vhost NAME --socket PATH`: a vhost-user-blk back end in the
//! foreground, serving block device NAME (service blk:NAME) to QEMU guests
//! one front end at a time (docs/BLK-vhost.md). SIGINT/SIGTERM stop it.

use std::io::Write as _;
use std::path::PathBuf;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;

use anyhow::Context as _;
use clap::Args;
use fido::{Domain, JoinOptions};
use fido_blk::BlkClient;
use fido_blk_vhost::{VhostBlk, VhostBlkOptions};

use crate::vm::parse_size;

#[derive(Args)]
pub struct VhostArgs {
    /// The block device to serve (service blk:NAME).
    name: String,
    /// The vhost-user socket QEMU connects to (`-chardev socket,path=PATH`); a stale socket there is replaced.
    #[arg(long, value_name = "PATH")]
    socket: PathBuf,
    /// Virtqueues offered (QEMU's vhost-user-blk-pci `num-queues` may not exceed it).
    #[arg(long, default_value_t = 1)]
    queues: u16,
    /// The largest virtqueue (QEMU's `queue-size`), a power of two.
    #[arg(long, default_value_t = 256)]
    queue_size: u16,
    /// Present the disk read-only.
    #[arg(long)]
    readonly: bool,
    /// The disk's serial (GET_ID, at most 20 bytes) [default: fido:NAME].
    #[arg(long)]
    serial: Option<String>,
    /// This domain's arena: write payloads are copied there from the guest.
    #[arg(long, value_parser = parse_size, default_value = "1G")]
    arena: u64,
    /// Broker socket [default: $FIDO_BROKER, $XDG_RUNTIME_DIR/fido/broker.sock, /run/fido/broker.sock]
    #[arg(long, value_name = "PATH")]
    broker: Option<PathBuf>,
}

pub fn run(a: VhostArgs) -> anyhow::Result<()> {
    let stop = Arc::new(AtomicBool::new(false));
    for sig in [signal_hook::consts::SIGINT, signal_hook::consts::SIGTERM] {
        signal_hook::flag::register(sig, stop.clone())?;
    }
    let broker = a.broker.clone().unwrap_or_else(fido::default_broker_path);
    let d = Domain::join(
        JoinOptions::new(format!("blk-vhost-{}", a.name))
            .broker(&broker)
            .arena_len(a.arena),
    )
    .with_context(|| format!("joining the broker at {}", broker.display()))?;
    let client = BlkClient::connect(&d, &a.name).with_context(|| {
        format!(
            "connecting to block device {:?} (service blk:{})",
            a.name, a.name
        )
    })?;
    let opts = VhostBlkOptions {
        num_queues: a.queues,
        queue_size: a.queue_size,
        read_only: a.readonly,
        serial: a.serial.clone(),
    };
    let dev = VhostBlk::new(client, &opts)?;
    let l = dev.limits();
    dev.serve(&a.socket, &stop, || {
        // Scripts and tests wait for this line.
        println!(
            "vhost-user-blk: serving blk:{} on {} size={} block={} queues={} read_only={}",
            a.name,
            a.socket.display(),
            l.capacity,
            l.logical_block,
            l.num_queues,
            l.read_only
        );
        let _ = std::io::stdout().flush();
    })?;
    let s = dev.stats();
    eprintln!(
        "fido blk vhost {}: stopped after {} connections, {} requests ({} errors); copied {} bytes from guests, {} to guests",
        a.name, s.connections, s.requests, s.errors, s.bytes_copied_from_guest, s.bytes_copied_to_guest
    );
    Ok(())
}
