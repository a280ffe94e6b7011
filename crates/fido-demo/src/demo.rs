//! `fido demo`: a zero-copy pipeline across separate processes (source →
//! forwarders → sink, one domain each), checked end to end, then the same
//! pipeline over Unix sockets for comparison. Every figure printed here was
//! measured in this run; every check must pass for exit status 0.

use std::time::Duration;

use anyhow::bail;

use crate::pipeline::{self, Outcome};
use crate::proc::{self, EmbeddedBroker};
use crate::measure::percentiles;
use crate::text::table;

/// The same pipeline over Unix sockets: `(hops, message size, measured
/// duration)` → (bytes/s at the sink, source→sink latency samples in ns).
pub type UdsPipeline = fn(usize, usize, Duration) -> anyhow::Result<(f64, Vec<u64>)>;

pub struct DemoArgs {
    pub seconds: f64,
    pub size: usize,
    pub hops: usize,
    pub uds_pipeline: UdsPipeline,
}

fn gbps(bps: f64) -> String {
    format!("{:.2}", bps / 1e9)
}

fn dur_ns(ns: f64) -> String {
    if ns < 10_000.0 {
        format!("{ns:.0} ns")
    } else if ns < 1_000_000.0 {
        format!("{:.1} µs", ns / 1e3)
    } else {
        format!("{:.2} ms", ns / 1e6)
    }
}

fn size_str(n: usize) -> String {
    if n >= 1 << 20 && n.is_multiple_of(1 << 20) {
        format!("{} MiB", n >> 20)
    } else if n >= 1 << 10 && n.is_multiple_of(1 << 10) {
        format!("{} KiB", n >> 10)
    } else {
        format!("{n}B")
    }
}

/// Runs the demo; `Ok(false)` when a check failed.
pub fn run(a: DemoArgs) -> anyhow::Result<bool> {
    proc::install_interrupt_flag()?;
    if a.hops == 0 {
        bail!("--hops must be at least 1");
    }
    if a.size < pipeline::HEADER {
        bail!(
            "--size must be at least {} bytes (the message header)",
            pipeline::HEADER
        );
    }
    if !(a.seconds > 0.0 && a.seconds <= 3600.0) {
        bail!("--seconds must be in (0, 3600]");
    }
    let duration = Duration::from_secs_f64(a.seconds);
    let warmup = (duration / 4).min(Duration::from_millis(500));

    let default = fido::default_broker_path();
    let mut embedded = None;
    let broker = if proc::broker_reachable(&default) {
        println!("broker: existing, at {}", default.display());
        default
    } else {
        let b = EmbeddedBroker::start("fido-demo-")?;
        println!(
            "broker: embedded (no broker at {}), at {}",
            default.display(),
            b.socket().display()
        );
        let p = b.socket().to_path_buf();
        embedded = Some(b);
        p
    };

    let names: Vec<String> = std::iter::once("source".to_string())
        .chain((1..a.hops).map(|i| format!("fwd{i}")))
        .chain(std::iter::once("sink".to_string()))
        .collect();
    println!(
        "fido demo: {} processes ({}), {} hop{}, {} messages, {:.1} s measured after {:.2} s warm-up",
        a.hops + 1,
        names.join(" → "),
        a.hops,
        if a.hops == 1 { "" } else { "s" },
        size_str(a.size),
        duration.as_secs_f64(),
        warmup.as_secs_f64(),
    );

    let spec = pipeline::Spec {
        links: a.hops,
        size: a.size,
        warmup,
        duration,
        ring_entries: 64,
        launcher: vec!["__demo-role".into()],
        prefix: "demo".into(),
    };
    let out = pipeline::launch(&spec, &broker)?;
    proc::check_interrupt()?;
    // The broker is no longer needed; stop it (and remove its directory) now.
    if let Some(b) = embedded.take() {
        b.stop()?;
    }

    print_fido(&out);

    println!("\nsame pipeline over Unix stream sockets (every hop copies in and out of the kernel)...");
    let uds = (a.uds_pipeline)(a.hops, a.size, duration);
    proc::check_interrupt()?;
    let s = out.sink();
    let (fido_bps, fido_mps) = (
        s.f(&["window", "bytes_per_s"]),
        s.f(&["window", "msgs_per_s"]),
    );
    let (fp50, fp99) = (s.f(&["p50_ns"]), s.f(&["p99_ns"]));
    let mut rows = vec![vec![
        "fido".to_string(),
        a.hops.to_string(),
        gbps(fido_bps),
        format!("{fido_mps:.0}"),
        dur_ns(fp50),
        dur_ns(fp99),
        out.bytes_copied().to_string(),
    ]];
    match &uds {
        Ok((bps, lat)) => {
            let mut lat = lat.clone();
            let (p50, p99) = percentiles(&mut lat);
            rows.push(vec![
                "uds".into(),
                a.hops.to_string(),
                gbps(*bps),
                format!("{:.0}", bps / a.size as f64),
                dur_ns(p50 as f64),
                dur_ns(p99 as f64),
                "not counted (each hop copies into and out of the kernel)".into(),
            ]);
            rows.push(vec![
                "fido / uds".into(),
                String::new(),
                format!("{:.2}x", fido_bps / bps),
                String::new(),
                format!("{:.2}x", fp50 / p50.max(1) as f64),
                format!("{:.2}x", fp99 / p99.max(1) as f64),
                String::new(),
            ]);
        }
        Err(e) => eprintln!("fido demo: the uds comparison failed: {e:#}"),
    }
    println!();
    print!(
        "{}",
        table(
            &[
                "system",
                "hops",
                "GB/s at sink",
                "msgs/s",
                "latency p50",
                "latency p99",
                "bytes copied"
            ],
            &rows
        )
    );
    println!("(fido / uds: above 1 means fido is faster for GB/s and msgs/s, slower for latency)");
    println!(
        "(latency: source→sink per message under full load, queueing included: fido lets up to {} messages wait per hop; same host clock)",
        spec.ring_entries
    );

    println!("\nchecks:");
    let checks = out.checks();
    for (what, ok, detail) in &checks {
        println!("  [{}] {what}: {detail}", if *ok { " ok " } else { "FAIL" });
    }
    if let Err(e) = &uds {
        println!("  [FAIL] uds comparison: {e:#}");
    }
    let ok = checks.iter().all(|(_, ok, _)| *ok) && uds.is_ok();
    let pids: Vec<String> = out.roles.iter().map(|r| r.pid.to_string()).collect();
    println!("demo pids (all exited and reaped): {}", pids.join(" "));
    println!("result: {}", if ok { "PASS" } else { "FAIL" });
    Ok(ok)
}

fn print_fido(out: &Outcome) {
    let s = out.sink();
    println!(
        "\nfido (shared memory, {} mode): per domain, measured window",
        s.v["address_mode"].as_str().unwrap_or("?").to_lowercase()
    );
    let rows: Vec<Vec<String>> = out
        .roles
        .iter()
        .map(|r| {
            vec![
                r.label.clone(),
                r.u(&["domain"]).to_string(),
                r.pid.to_string(),
                r.u(&["window", "messages"]).to_string(),
                gbps(r.f(&["window", "bytes_per_s"])),
                format!("{:.0}", r.f(&["window", "msgs_per_s"])),
                r.u(&["counters", "bytes_copied"]).to_string(),
                r.u(&["counters", "doorbells_rung"]).to_string(),
                r.u(&["counters", "doorbells_suppressed"]).to_string(),
            ]
        })
        .collect();
    print!(
        "{}",
        table(
            &[
                "role",
                "domain",
                "pid",
                "messages",
                "GB/s",
                "msgs/s",
                "bytes copied",
                "doorbells rung",
                "suppressed"
            ],
            &rows
        )
    );
    println!(
        "sink latency (source→sink): p50 {}  p99 {}  over {} messages",
        dur_ns(s.f(&["p50_ns"])),
        dur_ns(s.f(&["p99_ns"])),
        s.u(&["latency_samples"])
    );
}
