//! `fido pipe …`: vPipe from the command line. `cp` copies through the
//! broker's pipe engine (the bytes never pass through this process,
//! [`fido_pipe_apps::copy`]); `weight` sets a domain's share of the engine
//! live.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Context as _};
use clap::Subcommand;
use fido_pipe::{Client, ClientOptions};

#[derive(Subcommand)]
pub enum PipeCmd {
    /// `serve` and `proxy` (crate::pipe_cli).
    #[command(flatten)]
    App(crate::pipe_cli::AppCmd),
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
        PipeCmd::App(c) => crate::pipe_cli::run(c).map(|_| true),
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

fn cp(src: PathBuf, dst: PathBuf, socket: Option<PathBuf>) -> anyhow::Result<bool> {
    let copy = fido_pipe_apps::copy::PipeCopy::open(&src, &dst)?;
    let c = client(socket, "fido-pipe-cp")?;
    let start = Instant::now();
    let moved = copy.run(&c)?;
    let secs = start.elapsed().as_secs_f64();
    eprintln!(
        "fido pipe cp: {} bytes in {:.3} s ({:.1} MiB/s) through the broker",
        moved,
        secs,
        moved as f64 / secs.max(1e-9) / (1 << 20) as f64
    );
    Ok(true)
}
