//! `fido blk …`: block devices served by storage domains (docs/BLK.md).
//! `serve` runs a storage domain in the foreground (SIGINT/SIGTERM stop it
//! after the requests in flight); `info`, `read`, `write`, `flush`,
//! `discard`, `write-zeroes` and `stats` are a client for scripts and tests.

use std::fs::File;
use std::io::{Read as _, Write as _};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context as _};
use clap::{Args, Subcommand};
use fido::{Domain, JoinOptions};
use fido_blk::{proto, BackingOptions, BlkClient, FileBackend, ServeOptions, Stats};

use crate::vm::parse_size;

#[derive(Subcommand)]
pub enum BlkCmd {
    /// Serve block device NAME (service blk:NAME) from a file, a block device or RAM, in the foreground.
    Serve(ServeArgs),
    /// Print a block device's INFO.
    Info {
        name: String,
        #[command(flatten)]
        conn: ConnArgs,
    },
    /// Read LEN bytes at OFFSET (block multiples) to stdout or --out.
    Read {
        name: String,
        #[arg(value_parser = parse_size)]
        offset: u64,
        #[arg(value_parser = parse_size)]
        len: u64,
        /// Write the bytes to FILE (created or truncated) instead of stdout.
        #[arg(long, value_name = "FILE")]
        out: Option<PathBuf>,
        #[command(flatten)]
        conn: ConnArgs,
    },
    /// Write the contents of --in (a block multiple) at OFFSET.
    Write {
        name: String,
        #[arg(value_parser = parse_size)]
        offset: u64,
        /// The bytes to write (`-`: stdin).
        #[arg(long = "in", value_name = "FILE")]
        input: PathBuf,
        /// Each write is durable when acknowledged.
        #[arg(long)]
        fua: bool,
        #[command(flatten)]
        conn: ConnArgs,
    },
    /// Make every acknowledged write durable.
    Flush {
        name: String,
        #[command(flatten)]
        conn: ConnArgs,
    },
    /// Discard LEN bytes at OFFSET (they read back as zeros).
    Discard {
        name: String,
        #[arg(value_parser = parse_size)]
        offset: u64,
        #[arg(value_parser = parse_size)]
        len: u64,
        #[command(flatten)]
        conn: ConnArgs,
    },
    /// Zero LEN bytes at OFFSET without sending zeros.
    WriteZeroes {
        name: String,
        #[arg(value_parser = parse_size)]
        offset: u64,
        #[arg(value_parser = parse_size)]
        len: u64,
        /// Keep the range allocated.
        #[arg(long)]
        no_unmap: bool,
        #[command(flatten)]
        conn: ConnArgs,
    },
    /// Serve NAME as a RAID-1 mirror of block devices (--member A --member B ...), in the foreground.
    Raid1(crate::blk_raid_cmd::Raid1Args),
    /// Serve NAME as a RAID-0 stripe of block devices (--chunk SIZE --member A ...), in the foreground.
    Raid0(crate::blk_raid_cmd::Raid0Args),
    /// Serve NAME as the concatenation of block devices (--member A ...), in the foreground.
    Concat(crate::blk_raid_cmd::ConcatArgs),
    /// Print a RAID composition's state: members, their states, resync progress.
    RaidStatus(crate::blk_raid_cmd::StatusArgs),
    /// Serve block device NAME to QEMU guests as a vhost-user-blk back end on --socket, in the foreground.
    Vhost(crate::blk_vhost_cmd::VhostArgs),
    /// Print a storage domain's counters (published in the registry every second).
    Stats {
        name: String,
        #[command(flatten)]
        conn: ConnArgs,
    },
}

#[derive(Args)]
pub struct ConnArgs {
    /// Broker socket [default: $FIDO_BROKER, $XDG_RUNTIME_DIR/fido/broker.sock, /run/fido/broker.sock]
    #[arg(long)]
    socket: Option<PathBuf>,
}

#[derive(Args)]
pub struct ServeArgs {
    name: String,
    /// A regular file (its size) or a block device.
    #[arg(long, value_name = "PATH", conflicts_with = "ram", required_unless_present = "ram")]
    file: Option<PathBuf>,
    /// A RAM disk of SIZE bytes (e.g. 256M), gone when the storage domain exits.
    #[arg(long, value_name = "SIZE", value_parser = parse_size)]
    ram: Option<u64>,
    /// O_DIRECT: clients' write buffers must be block aligned (BlkClient's are).
    #[arg(long)]
    direct: bool,
    /// Refuse every write, discard and write-zeroes (EROFS).
    #[arg(long)]
    readonly: bool,
    /// Logical block size: 512 or 4096.
    #[arg(long, default_value_t = 512)]
    block_size: u32,
    /// The largest READ or WRITE.
    #[arg(long, value_parser = parse_size, default_value = "4M")]
    max_transfer: u64,
    /// io_uring entries per connection (INFO's queue_depth).
    #[arg(long, default_value_t = fido_blk::backing::DEFAULT_QUEUE_DEPTH)]
    queue_depth: u32,
    /// The storage domain's arena (READ replies live there until released).
    #[arg(long, value_parser = parse_size, default_value = "1G")]
    arena: u64,
    #[command(flatten)]
    conn: ConnArgs,
}

fn broker(conn: &ConnArgs) -> PathBuf {
    conn.socket.clone().unwrap_or_else(fido::default_broker_path)
}

fn join(conn: &ConnArgs, name: &str, arena: u64) -> anyhow::Result<Domain> {
    let path = broker(conn);
    Domain::join(JoinOptions::new(name).broker(&path).arena_len(arena)).with_context(|| format!("joining the broker at {}", path.display()))
}

fn client(conn: &ConnArgs, name: &str) -> anyhow::Result<BlkClient> {
    let d = join(conn, "fido-blk-cli", 256 << 20)?;
    BlkClient::connect(&d, name).with_context(|| format!("connecting to block device {name:?} (service blk:{name})"))
}

pub fn run(cmd: BlkCmd) -> anyhow::Result<bool> {
    match cmd {
        BlkCmd::Serve(a) => serve(a).map(|_| true),
        BlkCmd::Raid1(a) => crate::blk_raid_cmd::raid1(a).map(|_| true),
        BlkCmd::Raid0(a) => crate::blk_raid_cmd::raid0(a).map(|_| true),
        BlkCmd::Concat(a) => crate::blk_raid_cmd::concat(a).map(|_| true),
        BlkCmd::RaidStatus(a) => crate::blk_raid_cmd::status(a).map(|_| true),
        BlkCmd::Info { name, conn } => {
            let c = client(&conn, &name)?;
            print_info(&name, &c.info());
            Ok(true)
        }
        BlkCmd::Read { name, offset, len, out, conn } => read(&client(&conn, &name)?, offset, len, out).map(|_| true),
        BlkCmd::Write { name, offset, input, fua, conn } => write(&client(&conn, &name)?, offset, &input, fua).map(|_| true),
        BlkCmd::Flush { name, conn } => {
            client(&conn, &name)?.flush().context("FLUSH")?;
            Ok(true)
        }
        BlkCmd::Discard { name, offset, len, conn } => ranged(&client(&conn, &name)?, offset, len, |c, o, l| c.discard(o, l, false)).map(|_| true),
        BlkCmd::WriteZeroes { name, offset, len, no_unmap, conn } => {
            ranged(&client(&conn, &name)?, offset, len, |c, o, l| c.write_zeroes(o, l, false, no_unmap)).map(|_| true)
        }
        BlkCmd::Vhost(a) => crate::blk_vhost_cmd::run(a).map(|_| true),
        BlkCmd::Stats { name, conn } => {
            proto::service_name(&name)?;
            let d = join(&conn, "fido-blk-stats", 1 << 20)?;
            let Some(v) = d.read(&fido_blk::stats_key(&name))? else {
                bail!("no counters published for {name:?} (is `fido blk serve {name}` running?)")
            };
            print!("{}", Stats::from_text(&String::from_utf8_lossy(&v)).to_text());
            // A RAID composition adds its state (members, resync progress).
            if let Some(raid) = d.read(&fido_blk::raid::status_key(&name))? {
                print!("{}", String::from_utf8_lossy(&raid));
            }
            Ok(true)
        }
    }
}

fn print_info(name: &str, i: &proto::Info) {
    let flags: Vec<&str> = [
        (proto::INFO_READ_ONLY, "read-only"),
        (proto::INFO_FLUSH, "flush"),
        (proto::INFO_FUA, "fua"),
        (proto::INFO_DISCARD, "discard"),
        (proto::INFO_WRITE_ZEROES, "write-zeroes"),
        (proto::INFO_CAN_MULTI_CONN, "multi-conn"),
    ]
    .iter()
    .filter(|(bit, _)| i.flags & bit != 0)
    .map(|(_, n)| *n)
    .collect();
    println!("name: {name}");
    println!("size: {}", i.size);
    println!("logical_block: {}", i.logical_block);
    println!("max_transfer: {}", i.max_transfer);
    println!("queue_depth: {}", i.queue_depth);
    println!("flags: {}", flags.join(","));
}

fn serve(a: ServeArgs) -> anyhow::Result<()> {
    let max_transfer = u32::try_from(a.max_transfer).context("--max-transfer")?;
    let opts = BackingOptions { direct: a.direct, read_only: a.readonly, logical_block: a.block_size, max_transfer, queue_depth: a.queue_depth };
    let backend = match (&a.file, a.ram) {
        (Some(path), None) => FileBackend::open(path, &opts)?,
        (None, Some(size)) => FileBackend::ram(size, &opts)?,
        _ => bail!("give one of --file PATH and --ram SIZE"),
    };
    let stop = Arc::new(AtomicBool::new(false));
    for sig in [signal_hook::consts::SIGINT, signal_hook::consts::SIGTERM] {
        signal_hook::flag::register(sig, stop.clone())?;
    }
    let d = join(&a.conn, &format!("blk-{}", a.name), a.arena)?;
    let server = fido_blk::serve(&d, &a.name, Arc::new(backend), ServeOptions { publish_stats: true, ..Default::default() })?;
    let i = server.info();
    // Scripts and tests wait for this line.
    println!("serving blk:{} size={} block={} max_transfer={} flags={:#x}", a.name, i.size, i.logical_block, i.max_transfer, i.flags);
    std::io::stdout().flush()?;
    while !stop.load(Ordering::Relaxed) {
        std::thread::sleep(Duration::from_millis(100));
    }
    eprintln!("fido blk serve {}: stopping after the requests in flight", a.name);
    server.stop();
    Ok(())
}

fn read(c: &BlkClient, offset: u64, len: u64, out: Option<PathBuf>) -> anyhow::Result<()> {
    let mut sink: Box<dyn std::io::Write> = match out {
        Some(p) => Box::new(File::create(&p).with_context(|| format!("creating {}", p.display()))?),
        None => Box::new(std::io::stdout().lock()),
    };
    let chunk = u64::from(c.info().max_transfer);
    let mut done = 0;
    while done < len {
        let n = (len - done).min(chunk) as u32;
        let m = c.read_at(offset + done, n).with_context(|| format!("READ of {n} bytes at {}", offset + done))?;
        let mut err = None;
        for seg in m.segments() {
            seg.read_chunks(|bytes| {
                if err.is_none() {
                    err = sink.write_all(bytes).err();
                }
            });
        }
        if let Some(e) = err {
            return Err(e).context("writing the output");
        }
        done += u64::from(n);
    }
    sink.flush()?;
    Ok(())
}

fn write(c: &BlkClient, offset: u64, input: &PathBuf, fua: bool) -> anyhow::Result<()> {
    let block = u64::from(c.info().logical_block);
    let mut src: Box<dyn std::io::Read> = if input.as_os_str() == "-" {
        Box::new(std::io::stdin().lock())
    } else {
        let f = File::open(input).with_context(|| format!("opening {}", input.display()))?;
        // Refuse before writing anything (stdin can only be found out at its end).
        let len = f.metadata()?.len();
        if len % block != 0 || offset % block != 0 {
            bail!("{} is {len} bytes and the offset {offset}: both must be multiples of the {block}-byte block", input.display());
        }
        Box::new(f)
    };
    let chunk = c.info().max_transfer as usize;
    let mut at = offset;
    loop {
        // The bytes go from the file straight into an arena buffer (the
        // kernel's copy), and from there to the storage domain in place.
        let mut buf = c.alloc(chunk)?;
        let mut n = 0;
        while n < chunk {
            match src.read(&mut buf[n..])? {
                0 => break,
                k => n += k,
            }
        }
        if n == 0 {
            break;
        }
        buf.truncate(n);
        c.write_bufs(at, vec![buf], fua).with_context(|| format!("WRITE of {n} bytes at {at}"))?;
        at += n as u64;
        if n < chunk {
            break;
        }
    }
    eprintln!("wrote {} bytes at {offset}", at - offset);
    Ok(())
}

fn ranged(c: &BlkClient, offset: u64, len: u64, op: impl Fn(&BlkClient, u64, u32) -> fido_blk::client::Result<()>) -> anyhow::Result<()> {
    // Split at 1 GiB (a request's length is 32 bits).
    let mut done = 0;
    while done < len {
        let n = (len - done).min(1 << 30) as u32;
        op(c, offset + done, n).with_context(|| format!("{n} bytes at {}", offset + done))?;
        done += u64::from(n);
    }
    Ok(())
}
