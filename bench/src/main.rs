//! `fido-bench`: Fido's benchmark suites and its chaos run, each measuring Fido
//! beside real baselines in the same invocation (docs/BENCHMARKS.md).
//!
//! * `fido-bench channel`: channel latency, throughput, pipelines, doorbells —
//!   fido vs spin/eventfd floors, uds, tcp, iceoryx2, ucx.
//! * `fido-bench rpc`: null calls and the VMRPC paper's Table 2 — fido-rpc vs
//!   uds, tarpc, capnp-rpc, tonic and XML-RPC.
//! * `fido-bench pipe`: piped I/O — fido pipe vs sendfile/splice, read/write, nginx.
//! * `fido-bench net`: real TCP programs over plain TCP and under MMNet.
//! * `fido-bench net-apps`: the programs people run (memcached, MariaDB, ssh,
//!   node, socat, ncat, python asyncio, a connect/echo/close loop, redis, nginx):
//!   accelerated or not, correct or not, fido/tcp ratio (docs/NET.md's table).
//! * `fido-bench vm`: host↔VM and VM↔VM latency and throughput — fido vs TCP
//!   over virtio-net and virtio-serial, in the same QEMU guests; the guest side
//!   is this binary too (`fido-bench vm-endpoint --mode agent`, in the image).
//! * `fido-bench blk`: block devices — fio through `fido blk nbd` (storage
//!   and RAID-1 domains) against nbdkit, qemu-nbd and the file itself.
//! * `fido-bench chaos`: pipelines of domains while domains and the broker are
//!   killed (-9) and restarted at random: no corruption, no silent duplicate or
//!   loss, no leak.
//!
//! What this binary must never do: leave anything behind — every helper process
//! it starts is killed and reaped on every path (and dies with us through
//! `PR_SET_PDEATHSIG`), an embedded broker is shut down (its socket removed) and
//! its temporary directory deleted, also on Ctrl-C; and print a figure it did
//! not measure in the same run, or report success when a check failed.
//!
//! Hidden subcommands (helpers re-executing this binary): `__bench-peer` (Fido's
//! own peers when the first argument is `fido`, otherwise the baselines' peers
//! in [`fido_bench::peer_main`]), `__demo-role` (pipelines), `__pipe-role` and
//! `__pipe-app` (the pipe suite's helpers and servers), `__chaos-role`,
//! `__chaos-broker` and `__chaos-status` (the processes of the chaos run).

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use fido_bench::{chaos, suites};
use fido_demo::{pipeline, proc};

#[derive(Parser)]
#[command(
    name = "fido-bench",
    version,
    about = "Fido's benchmarks (separate processes, baselines in the same run) and its chaos run"
)]
struct Cli {
    #[command(subcommand)]
    suite: Suite,
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
    /// The programs of issue #19 over plain TCP and under `fido run`: version,
    /// accelerated or not, correct or not, figure and fido/tcp ratio.
    NetApps {
        /// 2 s per point and 128 MiB files instead of 5 s and 1 GiB.
        #[arg(long)]
        quick: bool,
        /// Also write one JSON object per result to FILE.
        #[arg(long, value_name = "FILE")]
        json: Option<PathBuf>,
        /// Only points whose system or case contains this substring.
        #[arg(long, value_name = "S")]
        filter: Option<String>,
    },
    /// VMs: host↔VM and VM↔VM latency and throughput, fido vs TCP over
    /// virtio-net and virtio-serial, same guests and accelerator (needs root and QEMU).
    Vm {
        /// 1 s per point instead of 4 s.
        #[arg(long)]
        quick: bool,
        /// Also write one JSON object per result to FILE.
        #[arg(long, value_name = "FILE")]
        json: Option<PathBuf>,
        /// Only points whose system or case contains this substring.
        #[arg(long, value_name = "S")]
        filter: Option<String>,
    },
    /// Block devices (MMBlk): fio through NBD against fido's storage, RAID-1
    /// and the same file under nbdkit, qemu-nbd, psync and io_uring.
    Blk {
        /// 2 s per point on 256 MiB instead of 8 s on 1 GiB.
        #[arg(long)]
        quick: bool,
        /// Also write one JSON object per result to FILE.
        #[arg(long, value_name = "FILE")]
        json: Option<PathBuf>,
        /// Only points whose system or case contains this substring.
        #[arg(long, value_name = "S")]
        filter: Option<String>,
    },
    /// Inside a guest: the guest side of `fido-bench vm` (serves the host's
    /// commands on the virtio-serial port org.fido.bench.ctl).
    VmEndpoint {
        /// `agent`: run the cases the host asks for, until it says quit.
        #[arg(long, default_value = "agent")]
        mode: String,
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
    let rest = args.get(1..).unwrap_or(&[]);
    Some(match args.first().map(|s| s.as_str())? {
        "__bench-peer" => {
            if rest.first().map(|s| s.as_str()) == Some("fido") {
                suites::channel::peer_main(&rest[1..])
            } else {
                fido_bench::peer_main(rest)
            }
        }
        "__demo-role" => pipeline::role_main(rest),
        "__pipe-role" => suites::pipe::role_main(rest),
        "__pipe-app" => suites::pipe::app_main(rest),
        "__chaos-role" => chaos::role_main(rest),
        "__chaos-broker" => chaos::broker_main(rest),
        "__chaos-status" => chaos::status_main(rest),
        _ => return None,
    })
}

fn main() -> ExitCode {
    init_logging();
    let args: Vec<String> = std::env::args().skip(1).collect();
    if let Some(r) = hidden(&args) {
        return proc::helper_exit("fido-bench", &args, r);
    }
    let cli = Cli::parse();
    let r: anyhow::Result<bool> = match cli.suite {
        Suite::Channel {
            quick,
            json,
            filter,
        } => suites::channel::run(&fido_bench::Opts {
            quick,
            json,
            filter,
        })
        .map(|_| true),
        Suite::Pipe {
            quick,
            json,
            plot,
            filter,
        } => suites::pipe::run(&suites::pipe::PipeBenchOpts {
            quick,
            json,
            plot,
            filter,
        }),
        Suite::Net {
            quick,
            json,
            filter,
        } => suites::net::run(&fido_bench::Opts {
            quick,
            json,
            filter,
        })
        .map(|_| true),
        Suite::NetApps {
            quick,
            json,
            filter,
        } => suites::net_apps::run(&fido_bench::Opts {
            quick,
            json,
            filter,
        })
        .map(|_| true),
        Suite::Vm {
            quick,
            json,
            filter,
        } => suites::vm::run(&fido_bench::Opts {
            quick,
            json,
            filter,
        })
        .map(|_| true),
        Suite::Blk {
            quick,
            json,
            filter,
        } => suites::blk::run(&fido_bench::Opts {
            quick,
            json,
            filter,
        })
        .map(|_| true),
        Suite::VmEndpoint { mode } => suites::vm::endpoint_main(&mode).map(|_| true),
        Suite::Rpc {
            quick,
            json,
            filter,
            plot,
        } => suites::rpc::run(
            &fido_bench::Opts {
                quick,
                json,
                filter,
            },
            plot,
        ),
        Suite::Chaos {
            seconds,
            seed,
            json,
            rate,
            interval_ms,
            stall_secs,
            log_dir,
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
            eprintln!("fido-bench: checks failed");
            ExitCode::FAILURE
        }
        Err(_) if proc::interrupted() => {
            eprintln!("fido-bench: interrupted; cleaned up");
            ExitCode::from(130)
        }
        Err(e) => {
            eprintln!("fido-bench: {e:#}");
            ExitCode::FAILURE
        }
    }
}
