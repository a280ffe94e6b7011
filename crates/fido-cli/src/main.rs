//! `fido`: the command-line face of Fido.
//!
//! * `fido broker` runs the broker (the control plane) in the foreground.
//! * `fido status` asks a running broker for its domains, services and
//!   connections (with each domain's data-path counters).
//! * `fido demo` moves messages through a pipeline of separate processes with
//!   zero copies, checks every message end to end, and runs the same pipeline
//!   over Unix sockets beside it.
//! * `fido run -- CMD` runs a program with MMNet (crates/fido-net) preloaded.
//!
//! The benchmark suites and the chaos run are another binary, `fido-bench`
//! (bench/): the product never depends on its benchmarks.
//!
//! What this binary must never do: leave anything behind — every helper process
//! it starts is killed and reaped on every path (and dies with us through
//! `PR_SET_PDEATHSIG`), an embedded broker is shut down (its socket removed) and
//! its temporary directory deleted, also on Ctrl-C; and print a figure it did
//! not measure in the same run, or report success when a check failed.
//!
//! Hidden subcommand (helpers re-executing this binary): `__demo-role` (the
//! domains of `fido demo`'s pipeline).

#![forbid(unsafe_code)]

mod blk_cmd;
mod blk_nbd;
mod blk_raid_cmd;
mod blk_vhost_cmd;
mod broker;
mod pipe_cli;
mod pipe_cmd;
mod run;
mod status;
mod guest;
mod vm;

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use fido_demo::{demo, pipeline, proc};

#[derive(Parser)]
#[command(
    name = "fido",
    version,
    about = "Zero-copy shared-memory IPC between processes, through a broker"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Run the broker in the foreground (SIGINT/SIGTERM stop it cleanly).
    Broker {
        /// Lock file and registry database [default: $XDG_STATE_HOME/fido, /var/lib/fido as root, else ~/.local/state/fido]
        #[arg(long)]
        state_dir: Option<PathBuf>,
        /// Listening socket [default: $FIDO_BROKER, $XDG_RUNTIME_DIR/fido/broker.sock, /run/fido/broker.sock]
        #[arg(long)]
        socket: Option<PathBuf>,
        /// Heartbeat interval told to domains, in ms [default: 500]
        #[arg(long)]
        heartbeat_ms: Option<u64>,
        /// Missed heartbeats before a domain is declared hung [default: 6]
        #[arg(long)]
        heartbeat_misses: Option<u32>,
        /// Access policy and quotas (TOML, see docs/SECURITY.md) [default: only the broker's own uid may join]
        #[arg(long, value_name = "FILE")]
        policy: Option<PathBuf>,
        /// Pipe engine capacity shared by weight: auto (calibrated at start), unlimited, or bytes/s (e.g. 120M)
        #[arg(long, value_name = "CAP", default_value = "auto")]
        pipe_capacity: fido_broker::Capacity,
        /// Pipe engine: a domain out of credits waits for its next refill even if the engine is idle (not work-conserving)
        #[arg(long)]
        pipe_strict: bool,
        /// Pipe engine: chunks moved at once
        #[arg(long, default_value_t = 4)]
        pipe_lanes: u32,
        /// Do not run the pipe engine (pipe requests get Unavailable)
        #[arg(long)]
        pipe_disable: bool,
    },
    /// vPipe: let the broker move bytes between descriptors (see docs/PIPE.md).
    Pipe {
        #[command(subcommand)]
        cmd: pipe_cmd::PipeCmd,
    },
    /// Block devices served by storage domains: serve, info, read, write, ... (see docs/BLK.md).
    Blk {
        #[command(subcommand)]
        cmd: blk_cmd::BlkCmd,
    },
    /// Show the broker's domains, services and connections.
    Status {
        /// Print JSON instead of tables.
        #[arg(long)]
        json: bool,
        /// Broker socket [default: $FIDO_BROKER, $XDG_RUNTIME_DIR/fido/broker.sock, /run/fido/broker.sock]
        #[arg(long)]
        socket: Option<PathBuf>,
    },
    /// Zero-copy pipeline across processes, checked end to end, beside Unix sockets.
    Demo {
        /// Measured seconds.
        #[arg(long, default_value_t = 3.0)]
        seconds: f64,
        /// Message size in bytes (at least 64) [default: 1 MiB; 64 KiB with --vm].
        #[arg(long)]
        size: Option<usize>,
        /// Hops (links); the pipeline has hops+1 processes.
        #[arg(long, default_value_t = 3, conflicts_with = "vm")]
        hops: usize,
        /// Both forwarders in VMs (source and sink on the host), beside the
        /// same pipeline over virtio-net TCP (needs QEMU and the test image of
        /// scripts/vm-image.sh; docs/VM.md).
        #[arg(long)]
        vm: bool,
        /// The storage appliance: a VM's ext4 on a virtio-blk disk served by
        /// a RAID-1 of two storage domains, one killed with SIGKILL mid-write
        /// and restarted, then fsck and every checksum (QEMU and the test
        /// image of scripts/vm-image.sh; docs/BLK.md).
        #[arg(long, conflicts_with_all = ["vm", "size", "hops"])]
        blk: bool,
    },
    /// Start, list and stop VM domains: QEMU guests whose programs use Fido
    /// like any other domain (docs/VM.md).
    Vm {
        #[command(subcommand)]
        cmd: vm::VmCmd,
    },
    /// Check and exercise a domain from inside a VM (docs/VM.md).
    Guest {
        #[command(subcommand)]
        cmd: guest::GuestCmd,
    },
    /// Run a program with MMNet: its TCP connections to co-located programs
    /// also under `fido run` move onto Fido rings (docs/NET.md).
    Run {
        /// Do not accelerate (plain TCP; sets FIDO_NET=off).
        #[arg(long)]
        no_accel: bool,
        /// Broker socket [default: $FIDO_BROKER, $XDG_RUNTIME_DIR/fido/broker.sock, /run/fido/broker.sock]
        #[arg(long)]
        socket: Option<PathBuf>,
        /// The program and its arguments (after `--`).
        #[arg(trailing_var_arg = true, allow_hyphen_values = true, required = true)]
        cmd: Vec<std::ffi::OsString>,
    },
}

fn init_logging() {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .try_init();
}

fn hidden(args: &[String]) -> Option<anyhow::Result<()>> {
    match args.first().map(|s| s.as_str()) {
        Some("__demo-role") => Some(pipeline::role_main(&args[1..])),
        _ => None,
    }
}

/// A `fido blk` helper of `fido demo --blk` (it sets the parent's pid in
/// the environment) dies with the demo, even when the demo is SIGKILLed.
fn die_with_demo() -> anyhow::Result<()> {
    if std::env::var_os(proc::PARENT_ENV).is_some() {
        proc::child_prologue()?;
    }
    Ok(())
}

fn main() -> ExitCode {
    init_logging();
    let args: Vec<String> = std::env::args().skip(1).collect();
    if let Some(r) = hidden(&args) {
        return proc::helper_exit("fido", &args, r);
    }
    let cli = Cli::parse();
    let r: anyhow::Result<bool> = match cli.cmd {
        Cmd::Broker {
            state_dir,
            socket,
            heartbeat_ms,
            heartbeat_misses,
            policy,
            pipe_capacity,
            pipe_strict,
            pipe_lanes,
            pipe_disable,
        } => broker::run(broker::BrokerArgs {
            state_dir,
            socket,
            heartbeat_ms,
            heartbeat_misses,
            policy,
            pipe: fido_broker::PipeConfig {
                capacity: pipe_capacity,
                work_conserving: !pipe_strict,
                lanes: pipe_lanes.max(1),
                enabled: !pipe_disable,
                ..Default::default()
            },
        })
        .map(|_| true),
        Cmd::Pipe { cmd } => pipe_cmd::run(cmd),
        Cmd::Blk { cmd } => die_with_demo().and_then(|()| blk_cmd::run(cmd)),
        Cmd::Vm { cmd } => vm::run(cmd),
        Cmd::Guest { cmd } => guest::run(cmd),
        Cmd::Status { json, socket } => status::run(json, socket).map(|_| true),
        Cmd::Run {
            no_accel,
            socket,
            cmd,
        } => run::run(no_accel, socket, cmd),
        Cmd::Demo { blk: true, .. } => fido_demo::blk::run(),
        Cmd::Demo {
            seconds,
            size,
            hops,
            vm: true,
            ..
        } => {
            let _ = hops;
            fido_demo::vm::run(fido_demo::vm::VmDemoArgs {
                seconds,
                size: size.unwrap_or(64 << 10),
            })
        }
        Cmd::Demo {
            seconds,
            size,
            hops,
            vm: false,
            ..
        } => demo::run(demo::DemoArgs {
            seconds,
            size: size.unwrap_or(1 << 20),
            hops,
        }),
    };
    match r {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => {
            eprintln!("fido: checks failed");
            ExitCode::FAILURE
        }
        Err(_) if proc::interrupted() => {
            eprintln!("fido: interrupted; cleaned up");
            ExitCode::from(130)
        }
        Err(e) => {
            eprintln!("fido: {e:#}");
            ExitCode::FAILURE
        }
    }
}
