//! `fido bench rpc`: fido-rpc against a raw Unix-socket request/response, tarpc,
//! capnp-rpc, tonic and XML-RPC, in one invocation (`fido_bench::rpc` has the
//! method, the baselines and the driver; this module adds the `fido` system and
//! the report).

use std::path::PathBuf;
use std::time::Instant;

use fido_bench::rpc::{self, RpcSystem};
use fido_bench::Opts;

use crate::proc;

/// `fido bench rpc`. `Ok(false)` when a point failed (a checksum mismatch, a
/// crashed peer): every figure is still printed, but the run is not a pass.
pub fn run(opts: &Opts, plot: Option<PathBuf>) -> anyhow::Result<bool> {
    proc::install_interrupt_flag()?;
    let t = Instant::now();
    let dir = tempfile::Builder::new().prefix("fido-bench-rpc-").tempdir()?;
    let baselines = rpc::baselines(opts);
    let systems: Vec<&dyn RpcSystem> = baselines.iter().map(|b| b.as_ref()).collect();
    let dir_path = dir.path().to_path_buf();
    let addr_of = move |s: &dyn RpcSystem, n: usize| {
        rpc::sock_path(&dir_path, s.name(), n)
            .to_string_lossy()
            .into_owned()
    };
    let run = rpc::run_suite(&systems, opts, &addr_of)?;
    proc::check_interrupt()?;
    let records = run.records;
    fido_bench::print_table(&records);
    println!(
        "# rpc: client pinned to the parent CPU, server to the peer CPU; value = p50 round trip \
         (null-*) or payload bytes/s (Table 2 volume); did_not_finish = over the per-point budget of {:?}.",
        rpc::budget(opts)
    );
    println!(
        "# checksums asserted: {} calls ({} measured sequence calls, every one checked)",
        run.checked, run.seq_calls
    );
    rpc::print_goals(&records);
    for f in &run.failures {
        println!("# FAILED: {f}");
    }
    eprintln!(
        "({} records in {:.1} s)",
        records.len(),
        t.elapsed().as_secs_f64()
    );
    if let Some(p) = &opts.json {
        fido_bench::write_json(p, &records)?;
    }
    if let Some(p) = &plot {
        rpc::plot::draw(
            &records,
            p,
            &format!(
                "fido bench rpc{}: throughput vs LEN (VMRPC Table 2)",
                if opts.quick { " --quick" } else { "" }
            ),
        )?;
        println!("# plot: {}", p.display());
    }
    Ok(run.failures.is_empty())
}
