//! `fido`: the command-line face of Fido.
//!
//! * `fido broker` runs the broker (the control plane) in the foreground.
//! * `fido status` asks a running broker for its domains, services and
//!   connections (with each domain's data-path counters).
//! * `fido demo` moves messages through a pipeline of separate processes with
//!   zero copies, checks every message end to end, and runs the same pipeline
//!   over Unix sockets beside it.
//! * `fido bench channel` measures Fido against real baselines in the same
//!   invocation (DESIGN.md §8).
//!
//! What this binary must never do: leave anything behind — every helper process
//! it starts is killed and reaped on every path (and dies with us through
//! `PR_SET_PDEATHSIG`), an embedded broker is shut down (its socket removed) and
//! its temporary directory deleted, also on Ctrl-C; and print a figure it did
//! not measure in the same run, or report success when a check failed.
//!
//! Hidden subcommands (helpers re-executing this binary): `__bench-peer` (Fido's
//! own peers when the first argument is `fido`, otherwise the baselines' peers
//! in `fido_bench::peer_main`) and `__demo-role`.

mod bench;
mod broker;
mod demo;
mod pipeline;
mod proc;
mod status;

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};

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
        /// Message size in bytes (at least 64).
        #[arg(long, default_value_t = 1 << 20)]
        size: usize,
        /// Hops (links); the pipeline has hops+1 processes.
        #[arg(long, default_value_t = 3)]
        hops: usize,
    },
    /// Benchmarks (separate processes, baselines in the same run).
    Bench {
        #[command(subcommand)]
        suite: Suite,
    },
}

#[derive(Subcommand)]
enum Suite {
    /// Channel latency, throughput, pipelines, doorbells: fido vs spin/eventfd floors, uds, tcp, iceoryx2, ucx.
    Channel {
        /// ≈0.3 s per point instead of ≈2 s.
        #[arg(long)]
        quick: bool,
        /// Also write one JSON object per result to FILE.
        #[arg(long, value_name = "FILE")]
        json: Option<PathBuf>,
        /// Only points whose system or case contains this substring.
        #[arg(long, value_name = "S")]
        filter: Option<String>,
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
        Some("__bench-peer") => Some(if args.get(1).map(|s| s.as_str()) == Some("fido") {
            bench::peer_main(&args[2..])
        } else {
            fido_bench::peer_main(&args[1..])
        }),
        Some("__demo-role") => Some(pipeline::role_main(&args[1..])),
        _ => None,
    }
}

fn main() -> ExitCode {
    init_logging();
    let args: Vec<String> = std::env::args().skip(1).collect();
    if let Some(r) = hidden(&args) {
        return match r {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!(
                    "fido {}: {e:#}",
                    args.iter().take(3).cloned().collect::<Vec<_>>().join(" ")
                );
                ExitCode::FAILURE
            }
        };
    }
    let cli = Cli::parse();
    let r: anyhow::Result<bool> = match cli.cmd {
        Cmd::Broker {
            state_dir,
            socket,
            heartbeat_ms,
            heartbeat_misses,
        } => broker::run(broker::BrokerArgs {
            state_dir,
            socket,
            heartbeat_ms,
            heartbeat_misses,
        })
        .map(|_| true),
        Cmd::Status { json, socket } => status::run(json, socket).map(|_| true),
        Cmd::Demo {
            seconds,
            size,
            hops,
        } => demo::run(demo::DemoArgs {
            seconds,
            size,
            hops,
        }),
        Cmd::Bench {
            suite:
                Suite::Channel {
                    quick,
                    json,
                    filter,
                },
        } => bench::channel(&fido_bench::Opts {
            quick,
            json,
            filter,
        })
        .map(|_| true),
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
