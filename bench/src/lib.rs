//! Fido's benchmark tool: the `fido-bench` binary's suites ([`suites`]: `channel`,
//! `rpc`, `pipe`, `net`, `vm`), its chaos run ([`chaos`]), and the baselines they measure
//! beside Fido (docs/BENCHMARKS.md says how to run and read them). This crate is never
//! shipped: it lives under `bench/`, outside the crates that ship, and exists so that every Fido figure is printed
//! beside the figures of real systems **measured in the same invocation** on the same
//! machine — results are read as ratios, never as absolute numbers from elsewhere. It
//! must never be a dependency of a shipped crate (crates/fido-cli/tests/product_deps.rs
//! checks the `fido` binary's), and it needs no external compiler to build: the
//! generated code of its schemas is checked in (bench/proto/regenerate.sh).
//!
//! # Methodology
//!
//! * **Processes, never threads.** Every peer is a separate process: the running binary
//!   re-executed with the hidden subcommand `__bench-peer` ([`spawn_peer`],
//!   [`peer_main`]). Peers die with their parent (`PR_SET_PDEATHSIG` = SIGKILL, and they
//!   refuse to start orphaned); the parent always kills and reaps them, also on error,
//!   and a pidfd watchdog turns a peer's death into an error instead of a hang.
//! * **One-way latency = round trip / 2.** Latency cases are ping-pongs: each iteration
//!   the parent sends `size` bytes and waits for `size` bytes back; each iteration is
//!   timed individually (monotonic clock) and the *half* of that round trip is the
//!   sample. Reported: `value` = p50, `p50`, `p99` (nearest rank over all samples), `n` =
//!   measured iterations. No means for latency.
//! * **The payload is touched.** The sender writes every byte of the message every
//!   iteration; the receiver reads every byte (a fold over u64 words) and checks the
//!   sequence number it carries. Nobody measures an untouched buffer and calls it a
//!   message.
//! * **Throughput** (`bytes_per_s`): the peer streams, the parent receives; value = mean
//!   over the measured window, `n` = messages; `-touch` folds every byte at the
//!   receiver and rewrites every message at the sender, `-notouch` does neither.
//! * **Warm-up, pre-faulting.** Each point runs un-timed for a warm-up period first;
//!   shared memory is mapped `MAP_POPULATE` and reused across iterations.
//! * **Placement.** The measuring parent thread is pinned to the first CPU of its
//!   affinity mask and the peer to the second (cross-CPU) — see [`Placement`]; with a
//!   single allowed CPU both share it. `ucx_perftest` gets the same CPUs via `-c`.
//!   Pipelines (hops+1 processes) are not pinned. The placement is read once, from the
//!   mask the process started with (never from a thread already pinned).
//! * **Where it ran.** [`print_table`] prints the machine ([`Machine`]: CPU, cores,
//!   allowed CPUs, NUMA, SMT, virtualization, kernel, cpuidle) and the placement in its
//!   header; [`write_json`] puts the same in every record (field `machine`).
//! * **CPU per message.** Latency cases also report `cpu_ns_per_msg`: both sides' CPU
//!   time (scheduler accounting) over the measured window per message ([`CpuUse`]).
//! * **Durations.** Quick mode ≈ 0.3 s measured per point (+80 ms warm-up); full mode
//!   ≈ 2 s (+0.4 s).
//!
//! # Systems of the `channel` suite
//!
//! `spin-floor` (shared cache line, both spinning), `eventfd-floor` (same, blocking on
//! eventfds), `uds` (Unix stream sockets: latency, throughput, pipelines), `tcp`
//! (loopback, `TCP_NODELAY`), `iceoryx2` (0.10, ipc pub-sub ping/pong, polling) and
//! `ucx-posix` (`ucx_perftest`, if installed).

pub mod chaos;
mod harness;
pub mod rpc;
pub mod suites;
mod ice;
mod machine;
mod shm;
mod sock;
mod ucx;

pub use harness::{
    PeerArgs,
    fill, fold, latency_record, mono_ns, percentiles, pin_to, print_rows, print_table, print_table_on, quantile, size_label,
    spawn_peer, spawn_peer_with, spin_until, time_round_trips, time_round_trips_cpu, cpu_record, CpuUse, write_json, write_json_on, Histogram, Opts, Peer,
    PinGuard, Placement, Record, Watchdog, PEER_FD0,
};
pub use machine::Machine;
pub use sock::{uds_pipeline, Transport};

/// Message sizes of the latency cases.
pub const LATENCY_SIZES: [usize; 4] = [64, 4 << 10, 64 << 10, 1 << 20];
/// Message sizes of the throughput cases.
pub const THROUGHPUT_SIZES: [usize; 3] = [4 << 10, 64 << 10, 1 << 20];

/// Entry point of helper processes: `fido-bench __bench-peer <kind> key=value...`.
pub fn peer_main(args: &[String]) -> anyhow::Result<()> {
    harness::peer_prologue()?;
    let kind = args.first().map(|s| s.as_str()).unwrap_or("");
    let a = harness::PeerArgs::parse(args.get(1..).unwrap_or(&[]));
    crate::harness::pin_peer(&a)?;
    shm::peer(kind, &a)
        .or_else(|| sock::peer(kind, &a))
        .or_else(|| ice::peer(kind, &a))
        .or_else(|| rpc::peer(kind, &a))
        .unwrap_or_else(|| Err(anyhow::anyhow!("unknown bench peer kind `{kind}`")))
}

/// Runs one point if the filter wants it; a failing point is reported on stderr and
/// skipped (the rest of the suite still runs).
fn point(
    opts: &Opts,
    out: &mut Vec<Record>,
    system: &str,
    case: &str,
    f: impl FnOnce() -> anyhow::Result<Vec<Record>>,
) {
    if !opts.wants(system, case) {
        return;
    }
    match f() {
        Ok(r) => out.extend(r),
        Err(e) => eprintln!("bench: {system} {case} failed: {e:#}"),
    }
}

/// Runs every baseline of the `channel` suite and returns their records (suite
/// `channel`). Does not write `opts.json`; callers merge and call [`write_json`].
pub fn channel_baselines(opts: &Opts) -> anyhow::Result<Vec<Record>> {
    let mut out = Vec::new();
    let lat = |system: &'static str, case: String, rtts: Vec<u64>| {
        vec![latency_record(system, &case, rtts)]
    };

    // Latency with both sides' CPU time per message beside it: `latency-adaptive-*` is
    // what a user gets by default from each system (Fido's `Adaptive`; a socket or an
    // eventfd blocks in the kernel; the spin floor spins), `polled` / `notified` the
    // forced modes.
    let lat_cpu = |system: &'static str, case: String, (rtts, cpu): (Vec<u64>, CpuUse)| {
        let n = rtts.len();
        vec![latency_record(system, &case, rtts), cpu_record("channel", system, &case, &cpu, n)]
    };
    for kind in ["polled", "adaptive"] {
        for &size in &LATENCY_SIZES {
            let case = format!("latency-{kind}-{}", size_label(size));
            point(opts, &mut out, "spin-floor", &case, || {
                Ok(lat_cpu("spin-floor", case.clone(), shm::spin_floor(size, opts)?))
            });
        }
    }
    for kind in ["notified", "adaptive"] {
        for &size in &LATENCY_SIZES {
            let case = format!("latency-{kind}-{}", size_label(size));
            point(opts, &mut out, "eventfd-floor", &case, || {
                Ok(lat_cpu("eventfd-floor", case.clone(), shm::eventfd_floor(size, opts)?))
            });
        }
    }
    for t in [Transport::Uds, Transport::Tcp] {
        let system = t.system();
        for kind in ["notified", "adaptive"] {
            for &size in &LATENCY_SIZES {
                let case = format!("latency-{kind}-{}", size_label(size));
                point(opts, &mut out, system, &case, || {
                    Ok(lat_cpu(system, case.clone(), sock::latency(t, size, opts)?))
                });
            }
        }
        for &size in &THROUGHPUT_SIZES {
            for touch in [true, false] {
                let case = format!(
                    "throughput-{}-{}",
                    size_label(size),
                    if touch { "touch" } else { "notouch" }
                );
                point(opts, &mut out, system, &case, || {
                    let (bps, n) = sock::throughput(t, size, touch, opts)?;
                    Ok(vec![Record::throughput("channel", &case, system, bps, n)])
                });
            }
        }
    }
    for hops in 1..=4 {
        let case = format!("pipeline-{hops}hop");
        point(opts, &mut out, "uds", &case, || {
            let (bps, mut lat) = uds_pipeline(hops, 1 << 20, opts.duration())?;
            let n = lat.len() as u64;
            let (p50, p99) = percentiles(&mut lat);
            Ok(vec![
                Record::throughput("channel", &case, "uds", bps, n),
                // Per-message source→sink latency under full load (not RTT/2).
                Record {
                    metric: "source_to_sink_ns".into(),
                    unit: "ns".into(),
                    value: p50 as f64,
                    p50: Some(p50 as f64),
                    p99: Some(p99 as f64),
                    ..Record::throughput("channel", &case, "uds", 0.0, n)
                },
            ])
        });
    }
    for &size in &LATENCY_SIZES {
        let case = format!("latency-polled-{}", size_label(size));
        point(opts, &mut out, "iceoryx2", &case, || {
            Ok(lat("iceoryx2", case.clone(), ice::latency(size, opts)?))
        });
    }
    if ucx::available() {
        for &size in &LATENCY_SIZES {
            let case = format!("latency-polled-{}", size_label(size));
            point(opts, &mut out, "ucx-posix", &case, || {
                let (p50, n) = ucx::latency(size, opts)?;
                let mut r = Record::latency("channel", &case, "ucx-posix", p50, 0.0, n);
                r.p99 = None;
                Ok(vec![r])
            });
        }
    } else if opts.wants("ucx-posix", "latency-polled") {
        eprintln!("bench: ucx-posix skipped: ucx_perftest not on PATH (Debian package ucx-utils)");
    }
    Ok(out)
}
