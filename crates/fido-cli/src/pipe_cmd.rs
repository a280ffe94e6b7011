//! `fido pipe …`: vPipe from the command line. `cp` copies through the
//! broker's pipe engine (the bytes never pass through this process); `weight`
//! sets a domain's share of the engine live.

use std::os::fd::AsFd;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Context as _};
use clap::Subcommand;
use fido_pipe::{Client, ClientOptions, PipeOp};

#[derive(Subcommand)]
pub enum PipeCmd {
    /// Copy SRC to DST through the broker (file→file; `-` is stdin/stdout, which may be a pipe or socket).
    Cp {
        src: PathBuf,
        /// A file (created or truncated, mode of SRC) or a directory (DST/basename(SRC)).
        dst: PathBuf,
        /// Broker socket [default: $FIDO_BROKER, $XDG_RUNTIME_DIR/fido/broker.sock, /run/fido/broker.sock]
        #[arg(long)]
        socket: Option<PathBuf>,
    },
    /// Set the pipe weight of live domains (by id, or every domain with that name); root or the broker's uid only.
    Weight {
        domain: String,
        weight: u32,
        #[arg(long)]
        socket: Option<PathBuf>,
    },
}

fn client(socket: Option<PathBuf>, name: &str) -> anyhow::Result<Client> {
    let path = socket.unwrap_or_else(fido_proto_path);
    Client::connect_with(ClientOptions::new(name).broker(&path))
        .with_context(|| format!("joining the broker at {}", path.display()))
}

fn fido_proto_path() -> PathBuf {
    fido::default_broker_path()
}

pub fn run(cmd: PipeCmd) -> anyhow::Result<bool> {
    match cmd {
        PipeCmd::Cp { src, dst, socket } => cp(src, dst, socket),
        PipeCmd::Weight { domain, weight, socket } => {
            if weight == 0 || weight > 10_000 {
                bail!("weight {weight}: must be 1..=10000");
            }
            let c = client(socket, "fido-pipe-weight")?;
            c.set_weight(&domain, weight).with_context(|| format!("setting the pipe weight of {domain:?}"))?;
            eprintln!("pipe weight of {domain} set to {weight}");
            Ok(true)
        }
    }
}

enum End {
    Stdio,
    File(std::fs::File),
}

fn cp(src: PathBuf, dst: PathBuf, socket: Option<PathBuf>) -> anyhow::Result<bool> {
    let stdin = std::io::stdin();
    let stdout = std::io::stdout();
    let (src_end, src_len, mode) = if src.as_os_str() == "-" {
        (End::Stdio, None, 0o644)
    } else {
        let f = std::fs::File::open(&src).with_context(|| format!("opening {}", src.display()))?;
        let m = f.metadata()?;
        if !m.is_file() {
            bail!("{}: not a regular file", src.display());
        }
        (End::File(f), Some(m.len()), m.permissions().mode() & 0o7777)
    };
    let dst_end = if dst.as_os_str() == "-" {
        End::Stdio
    } else {
        let target = if dst.is_dir() {
            let name = src.file_name().filter(|_| src.as_os_str() != "-").context("copying stdin into a directory needs a file name")?;
            dst.join(name)
        } else {
            dst.clone()
        };
        if let (End::File(s), Ok(m)) = (&src_end, std::fs::metadata(&target)) {
            let sm = s.metadata()?;
            if sm.dev() == m.dev() && sm.ino() == m.ino() {
                bail!("{} and {} are the same file", src.display(), target.display());
            }
        }
        let f = std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(mode)
            .open(&target)
            .with_context(|| format!("creating {}", target.display()))?;
        End::File(f)
    };
    let c = client(socket, "fido-pipe-cp")?;
    let start = Instant::now();
    let (src_fd, src_file) = match &src_end {
        End::Stdio => (stdin.as_fd(), false),
        End::File(f) => (f.as_fd(), true),
    };
    let (dst_fd, dst_file) = match &dst_end {
        End::Stdio => (stdout.as_fd(), false),
        End::File(f) => (f.as_fd(), true),
    };
    let len = src_len.unwrap_or(fido_proto_max());
    let op = match (src_file, dst_file) {
        (true, true) => PipeOp::FileToFile { in_off: 0, len, out_off: 0 },
        (true, false) => PipeOp::FileToSocket { off: 0, len },
        (false, true) => PipeOp::SocketToFile { off: 0, len },
        (false, false) => PipeOp::SocketToSocket { len },
    };
    let t = c.once(src_fd, dst_fd, op).context("pipe transfer")?;
    let secs = start.elapsed().as_secs_f64();
    if let Some(n) = src_len {
        if t.moved != n {
            bail!("copied {} of {n} bytes: the source ended early (it shrank while copying?)", t.moved);
        }
    }
    eprintln!(
        "fido pipe cp: {} bytes in {:.3} s ({:.1} MiB/s) through the broker",
        t.moved,
        secs,
        t.moved as f64 / secs.max(1e-9) / (1 << 20) as f64
    );
    Ok(true)
}

fn fido_proto_max() -> u64 {
    1 << 62
}
