//! The NBD server with its in-memory export on a Unix socket, no storage
//! domain behind it: measures the front end alone against `nbdkit memory`.
//!
//!   cargo run --release -p fido-blk-nbd --example nbd_memory -- SOCKET SIZE_MIB

use std::sync::atomic::AtomicBool;

use fido_blk_nbd::{Listener, MemoryExport, MemoryOptions, NbdServer, ServerConfig};

fn main() -> std::io::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    if args.len() != 3 {
        eprintln!("usage: nbd_memory SOCKET SIZE_MIB");
        std::process::exit(2);
    }
    let size_mib: u64 = args[2].parse().expect("SIZE_MIB: a number");
    let mut opts = MemoryOptions::new(size_mib << 20);
    opts.reorder = false;
    opts.max_transfer = 4 << 20;
    opts.queue_depth = 128;
    let server = NbdServer::new(MemoryExport::new(opts)?, ServerConfig::new("mem"))?;
    let listener = Listener::bind_unix(std::path::Path::new(&args[1]))?;
    println!("serving on {}", listener.describe());
    server.serve(&listener, &AtomicBool::new(false))
}
