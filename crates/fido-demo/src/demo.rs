//! `fido demo`: a zero-copy pipeline across separate processes (source →
//! forwarders → sink, one domain each), checked end to end, then the same
//! pipeline over Unix sockets ([`crate::uds`]) for comparison. Every figure
//! printed here was measured in this run; every check must pass for exit
//! status 0.
//!
//! Each pipeline runs two phases, and the screen says which figure comes from
//! which: **throughput** under full load (the source sends as fast as the
//! pipeline takes messages, so each transport holds as many messages in flight
//! as it allows — Fido up to its ring's entries per hop, a socket what its
//! buffer holds), then **latency** with one message in flight (the sink
//! acknowledges each message and the source sends the next only then). The
//! latency under full load is shown too, apart, since it measures the queues
//! rather than the transport.

use std::time::Duration;

use anyhow::bail;

use crate::pipeline::{self, Outcome, PingPhase};
use crate::proc::{self, EmbeddedBroker};
use crate::text::table;
use crate::uds;

pub struct DemoArgs {
    pub seconds: f64,
    pub size: usize,
    pub hops: usize,
}

pub(crate) fn gbps(bps: f64) -> String {
    format!("{:.2}", bps / 1e9)
}

pub(crate) fn dur_ns(ns: f64) -> String {
    if ns < 10_000.0 {
        format!("{ns:.0} ns")
    } else if ns < 1_000_000.0 {
        format!("{:.1} µs", ns / 1e3)
    } else {
        format!("{:.2} ms", ns / 1e6)
    }
}

pub(crate) fn size_str(n: usize) -> String {
    if n >= 1 << 20 && n % (1 << 20) == 0 {
        format!("{} MiB", n >> 20)
    } else if n >= 1 << 10 && n % (1 << 10) == 0 {
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
        say!("broker: existing, at {}", default.display());
        default
    } else {
        let b = EmbeddedBroker::start("fido-demo-")?;
        say!(
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
    say!(
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
    let pings = PingPhase {
        duration: (duration / 4).clamp(Duration::from_millis(100), Duration::from_secs(2)),
        min_pings: 100,
        max_pings: 100_000,
    };
    say!(
        "  throughput: {:.1} s at full load (after {:.2} s warm-up); then latency: one message in flight for {:.2} s (at least {} messages)",
        duration.as_secs_f64(),
        warmup.as_secs_f64(),
        pings.duration.as_secs_f64(),
        pings.min_pings,
    );
    let out = pipeline::launch_with_pings(&spec, Some(&pings), &broker)?;
    proc::check_interrupt()?;
    // The broker is no longer needed; stop it (and remove its directory) now.
    if let Some(b) = embedded.take() {
        b.stop()?;
    }

    print_fido(&out, spec.ring_entries);

    say!("\nsame pipeline over Unix stream sockets (every hop copies into and out of the kernel)...");
    let uds = uds::launch(&spec, Some(&pings));
    proc::check_interrupt()?;
    let s = out.sink();
    let (fido_bps, fido_mps) = (
        s.f(&["window", "bytes_per_s"]),
        s.f(&["window", "msgs_per_s"]),
    );
    let (fp50, fp99) = (s.f(&["ping_p50_ns"]), s.f(&["ping_p99_ns"]));
    let mut rows = vec![vec![
        "fido".to_string(),
        a.hops.to_string(),
        gbps(fido_bps),
        format!("{fido_mps:.0}"),
        dur_ns(fp50),
        dur_ns(fp99),
        out.bytes_copied().to_string(),
    ]];
    if let Ok(u) = &uds {
        let us = u.sink();
        let (bps, mps) = (
            us.f(&["window", "bytes_per_s"]),
            us.f(&["window", "msgs_per_s"]),
        );
        let (p50, p99) = (us.f(&["ping_p50_ns"]), us.f(&["ping_p99_ns"]));
        rows.push(vec![
            "uds".into(),
            a.hops.to_string(),
            gbps(bps),
            format!("{mps:.0}"),
            dur_ns(p50),
            dur_ns(p99),
            "not counted (each hop copies into and out of the kernel)".into(),
        ]);
        rows.push(vec![
            "fido / uds".into(),
            String::new(),
            ratio(fido_bps, bps),
            ratio(fido_mps, mps),
            ratio(fp50, p50),
            ratio(fp99, p99),
            String::new(),
        ]);
    }
    if let Err(e) = &uds {
        eprintln!("fido demo: the uds comparison failed: {e:#}");
    }
    say!();
    say_raw!(
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
    say!("(fido / uds: above 1 means fido moves more for GB/s and msgs/s; below 1 means fido is quicker for latency)");
    let sndbuf = uds
        .as_ref()
        .ok()
        .map(|u| u.source().u(&["sndbuf"]))
        .unwrap_or(0);
    say!(
        "(throughput: the source sends as fast as the pipeline takes messages, each transport holding as many in flight as it allows: fido up to {} messages per hop (its ring), uds what a socket buffer holds ({} per hop, SO_SNDBUF))",
        spec.ring_entries,
        bytes_str(sndbuf),
    );
    say!(
        "(latency: one message in flight, end to end through {} hop{}: from the source stamping a message it has just written to the sink having read and checked every byte; the source sends the next when the sink has acknowledged it, and that way back is not counted; same host clock; fido {} and uds {} messages)",
        a.hops,
        if a.hops == 1 { "" } else { "s" },
        s.u(&["ping_samples"]),
        uds.as_ref().map_or(0, |u| u.sink().u(&["ping_samples"])),
    );
    if let Ok(u) = &uds {
        let us = u.sink();
        say!(
            "(under full load a message also waits in the queues: latency p50 fido {} behind up to {} messages per hop, uds {} behind a socket buffer per hop; a measure of the queues, not of the transport)",
            dur_ns(s.f(&["p50_ns"])),
            spec.ring_entries,
            dur_ns(us.f(&["p50_ns"])),
        );
    }

    say!("\nchecks:");
    let mut checks = out.checks();
    match &uds {
        Ok(u) => checks.extend(
            u.delivery_checks()
                .into_iter()
                .map(|(what, ok, detail)| (format!("uds {what}"), ok, detail)),
        ),
        Err(e) => checks.push(("uds comparison".into(), false, format!("{e:#}"))),
    }
    for (what, ok, detail) in &checks {
        say!("  [{}] {what}: {detail}", if *ok { " ok " } else { "FAIL" });
    }
    let ok = checks.iter().all(|(_, ok, _)| *ok);
    let pids: Vec<String> = out.roles.iter().map(|r| r.pid.to_string()).collect();
    say!("demo pids (all exited and reaped): {}", pids.join(" "));
    if let Ok(u) = &uds {
        let pids: Vec<String> = u.roles.iter().map(|r| r.pid.to_string()).collect();
        say!("uds pids (all exited and reaped): {}", pids.join(" "));
    }
    say!("result: {}", if ok { "PASS" } else { "FAIL" });
    Ok(ok)
}

pub(crate) fn ratio(fido: f64, uds: f64) -> String {
    if uds > 0.0 {
        format!("{:.2}x", fido / uds)
    } else {
        "-".into()
    }
}

pub(crate) fn bytes_str(n: u64) -> String {
    if n >= 1 << 10 {
        format!("{:.0} KiB", n as f64 / 1024.0)
    } else {
        format!("{n} B")
    }
}

pub(crate) fn print_fido(out: &Outcome, ring_entries: u32) {
    let s = out.sink();
    say!(
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
    say_raw!(
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
    say!(
        "sink latency (source→sink), one message in flight: p50 {}  p99 {}  over {} messages",
        dur_ns(s.f(&["ping_p50_ns"])),
        dur_ns(s.f(&["ping_p99_ns"])),
        s.u(&["ping_samples"])
    );
    say!(
        "sink latency (source→sink), full load, queueing behind up to {ring_entries} messages per hop: p50 {}  p99 {}  over {} messages",
        dur_ns(s.f(&["p50_ns"])),
        dur_ns(s.f(&["p99_ns"])),
        s.u(&["latency_samples"])
    );
}
