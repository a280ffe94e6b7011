//! `fido`: the command-line face of Fido.
//!
//! * `fido broker` runs the broker (the control plane) in the foreground.
//! * `fido status` asks a running broker for its domains, services and
//!   connections (with each domain's data-path counters).
//! * `fido demo` moves messages through a pipeline of separate processes with
//!   zero copies, checks every message end to end, and runs the same pipeline
//!   over Unix sockets beside it.
//! * `fido run -- CMD` runs a program with MMNet (crates/fido-net) preloaded.
//! * `fido bench channel` measures Fido against real baselines in the same
//!   invocation (DESIGN.md §8).
//! * `fido bench rpc` measures fido-rpc against uds, tarpc, capnp-rpc, tonic
//!   and XML-RPC (the VMRPC paper's evaluation) in the same invocation.
//!
//! What this binary must never do: leave anything behind — every helper process
//! it starts is killed and reaped on every path (and dies with us through
//! `PR_SET_PDEATHSIG`), an embedded broker is shut down (its socket removed) and
//! its temporary directory deleted, also on Ctrl-C; and print a figure it did
//! not measure in the same run, or report success when a check failed.
//!
//! Hidden subcommands (helpers re-executing this binary): `__bench-peer` (Fido's
//! own peers when the first argument is `fido`, otherwise the baselines' peers
//! in `fido_bench::peer_main`), `__demo-role` and `__chaos-role` (the domains
//! of `fido bench chaos`).

mod bench;
mod broker;
mod chaos;
mod pipe_bench;
mod pipe_cli;
mod pipe_cmd;
mod netbench;
mod rpc_bench;
mod run;
mod status;

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
    /// Piped I/O (vPipe Figures 4-7, file server and proxy under wrk): fido pipe vs sendfile/splice, read/write, nginx.
    Pipe {
        /// 32 MiB transfers and a 3 s weight experiment instead of 512 MiB and 30 s.
        #[arg(long)]
        quick: bool,
        /// Also write one JSON object per result to FILE.
        #[arg(long, value_name = "FILE")]
        json: Option<PathBuf>,
        /// Draw the 1:1:2 weight experiment's time series into FILE (PNG).
        #[arg(long, value_name = "FILE.png")]
        plot: Option<PathBuf>,
        /// Only points whose system or case contains this substring.
        #[arg(long, value_name = "S")]
        filter: Option<String>,
    },
    /// Real TCP programs (sockperf, iperf3, redis-benchmark, nginx + wrk) over
    /// plain TCP and under `fido run` (MMNet), in one invocation.
    Net {
        /// 1 s per point (and fewer redis requests) instead of 5 s.
        #[arg(long)]
        quick: bool,
        /// Also write one JSON object per result to FILE.
        #[arg(long, value_name = "FILE")]
        json: Option<PathBuf>,
        /// Only points whose system or case contains this substring.
        #[arg(long, value_name = "S")]
        filter: Option<String>,
    },
    /// RPC (VMRPC): null calls and Table 2 throughput, fido-rpc vs uds, tarpc, capnp-rpc, tonic, XML-RPC.
    Rpc {
        /// ≈0.3 s per point instead of ≈2 s, and LEN 10^2, 10^4, 10^6 only.
        #[arg(long)]
        quick: bool,
        /// Also write one JSON object per result to FILE.
        #[arg(long, value_name = "FILE")]
        json: Option<PathBuf>,
        /// Only points whose system or case contains one of these comma-separated terms (`T$`: case ends with T).
        #[arg(long, value_name = "S")]
        filter: Option<String>,
        /// Also draw throughput against LEN per system into this PNG.
        #[arg(long, value_name = "FILE.png")]
        plot: Option<PathBuf>,
    },
    /// Pipelines of domains while domains and the broker are killed (-9) and
    /// restarted at random: no corruption, no silent duplicate or loss, no leak.
    Chaos {
        /// Seconds of chaos (then the pipelines drain and everything stops).
        #[arg(long, default_value_t = 60.0)]
        seconds: f64,
        /// Seed of the kill schedule and message sizes [default: from the clock; printed].
        #[arg(long)]
        seed: Option<u64>,
        /// Also write one JSON object per result to FILE.
        #[arg(long, value_name = "FILE")]
        json: Option<PathBuf>,
        /// Messages per second of each source (the echo client sends half).
        #[arg(long, default_value_t = 1000.0)]
        rate: f64,
        /// Pause between kills: uniform in MIN-MAX milliseconds.
        #[arg(long, value_name = "MIN-MAX", default_value = "1000-4000")]
        interval_ms: String,
        /// A pipeline delivering nothing for this long counts as a stall.
        #[arg(long, default_value_t = 20.0)]
        stall_secs: f64,
        /// Keep the stderr of every role and of the broker in DIR.
        #[arg(long, value_name = "DIR")]
        log_dir: Option<PathBuf>,
    },
}

fn parse_range(s: &str) -> anyhow::Result<(u64, u64)> {
    let (a, b) = s
        .split_once('-')
        .ok_or_else(|| anyhow::anyhow!("expected MIN-MAX, got {s}"))?;
    Ok((a.trim().parse()?, b.trim().parse()?))
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
        Some("__chaos-role") => Some(chaos::role_main(&args[1..])),
        Some("__pipe-role") => Some(pipe_bench::role_main(&args[1..])),
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
        Cmd::Status { json, socket } => status::run(json, socket).map(|_| true),
        Cmd::Run {
            no_accel,
            socket,
            cmd,
        } => run::run(no_accel, socket, cmd),
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
        Cmd::Bench {
            suite:
                Suite::Pipe {
                    quick,
                    json,
                    plot,
                    filter,
                },
        } => pipe_bench::run(&pipe_bench::PipeBenchOpts {
            quick,
            json,
            plot,
            filter,
        }),
        Cmd::Bench {
            suite:
                Suite::Net {
                    quick,
                    json,
                    filter,
                },
        } => netbench::run(&fido_bench::Opts {
            quick,
            json,
            filter,
        })
        .map(|_| true),
        Cmd::Bench {
            suite:
                Suite::Rpc {
                    quick,
                    json,
                    filter,
                    plot,
                },
        } => rpc_bench::run(
            &fido_bench::Opts {
                quick,
                json,
                filter,
            },
            plot,
        ),
        Cmd::Bench {
            suite:
                Suite::Chaos {
                    seconds,
                    seed,
                    json,
                    rate,
                    interval_ms,
                    stall_secs,
                    log_dir,
                },
        } => parse_range(&interval_ms).and_then(|interval_ms| {
            chaos::run(chaos::Opts {
                seconds,
                seed,
                json,
                rate,
                interval_ms,
                stall_secs,
                log_dir,
            })
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
