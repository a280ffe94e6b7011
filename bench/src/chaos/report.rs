//! The chaos run's report: one row per count, check or figure — printed as a
//! table (with `ok`/`FAIL` on the checks) and written as JSON records — and the
//! verdict.

use std::path::{Path, PathBuf};

use crate::Record;

use super::checks::{BrokerLeaks, Drain, HostLeaks};
use super::fleet::Books;
use super::{Opts, SUITE, SYSTEM};

/// Everything a run found, for the report.
pub(super) struct Findings {
    pub(super) books: Books,
    pub(super) drain: Drain,
    /// Arenas of dead domains still mapped after the drain.
    pub(super) stale: Vec<String>,
    pub(super) bad_exits: u64,
    pub(super) broker: BrokerLeaks,
    pub(super) broker_exit_ok: bool,
    pub(super) state_files: Vec<String>,
    pub(super) host: HostLeaks,
    /// Seconds from the start to the end of the chaos phase.
    pub(super) chaos_secs: f64,
}

/// Prints the report of a run with `processes` processes (the broker
/// included), writes `o.json`, and returns the verdict: `false` if a check
/// failed or nothing was measured. `log_tails` goes to stderr on failure.
pub(super) fn finish(o: &Opts, seed: u64, processes: usize, mut f: Findings, log_tails: &str) -> anyhow::Result<bool> {
    let t = &f.books.totals;
    let total_kills: u64 = f.books.kills.values().sum();
    let sane = t.messages > 0 && total_kills > 0 && t.delivered > 0;
    let messages = t.messages;
    let problems = std::mem::take(&mut f.books.problems);
    let rows = rows(o, f);
    let ok = sane && rows.iter().all(|r| r.check != Some(false));
    println!("# fido-bench chaos: seed {seed}, {:.0} s of chaos, {processes} processes (broker separate), kills every {}-{} ms", o.seconds, o.interval_ms.0, o.interval_ms.1);
    print_rows(&rows);
    if !sane {
        println!(
            "# FAIL: nothing was measured (messages {messages}, kills {total_kills})"
        );
    }
    if !problems.is_empty() {
        println!("# problems ({} shown):", problems.len());
        for p in &problems {
            println!("#   {p}");
        }
    }
    if !ok && !log_tails.is_empty() {
        eprintln!("{log_tails}");
    }
    println!(
        "# {}",
        if ok {
            "all checks passed"
        } else {
            "CHECKS FAILED"
        }
    );
    if let Some(p) = &o.json {
        let recs: Vec<Record> = rows.into_iter().map(|r| r.rec).collect();
        crate::write_json(p, &recs)?;
    }
    Ok(ok)
}

/// The rows of the report, checks first.
fn rows(o: &Opts, f: Findings) -> Vec<Row> {
    let Findings {
        books,
        drain,
        stale,
        bad_exits,
        broker,
        broker_exit_ok,
        state_files,
        host,
        chaos_secs,
    } = f;
    let t = books.totals;
    let kills = books.kills;
    let total_kills: u64 = kills.values().sum();
    let (broker_restarts, unexpected_exits, stalls) =
        (books.broker_restarts, books.unexpected_exits, books.stalls);
    let (ledger_protocol, ledger_inconsistent) = (books.protocol, books.inconsistent);
    let (mut rec_dom, mut rec_brk) = (books.recovery_domain_ms, books.recovery_broker_ms);
    let (drain_timeouts, drain_secs) = (drain.timeouts, drain.secs);
    let (self_fd0, self_fd1, self_memfd) = (host.fds_before, host.fds_after, host.memfds);
    let (shm_new, procs) = (host.shm, host.procs);
    let (broker_state, broker_state_note, broker_fds, broker_memfds) =
        (broker.state, broker.state_note, broker.fds, broker.memfds);
    let mut rows = vec![
        count(
            "messages",
            t.messages,
            "msgs",
            false,
            format!("{} streams (sender incarnations)", t.streams),
        ),
        count(
            "delivered",
            t.delivered,
            "msgs",
            false,
            "verified deliveries at final receivers",
        ),
        count(
            "released",
            t.released,
            "msgs",
            false,
            "release confirmed to the origin sender",
        ),
        count(
            "corrupted",
            t.corrupted,
            "msgs",
            true,
            "checksum/header mismatch or phantom",
        ),
        count(
            "duplicated-silent",
            t.duplicated_silent,
            "msgs",
            true,
            "extra deliveries not explained by a report",
        ),
        count(
            "redelivered-reported",
            t.redelivered_reported,
            "msgs",
            false,
            "delivered, reported undelivered after a crash, resent",
        ),
        count(
            "lost-silent",
            t.lost_released + t.lost_unaccounted,
            "msgs",
            true,
            format!(
                "{} released-undelivered, {} unaccounted",
                t.lost_released, t.lost_unaccounted
            ),
        ),
        count(
            "reported-undelivered",
            t.reported,
            "msgs",
            false,
            format!("reports on every hop; {} resent", t.resent),
        ),
        count(
            "dropped-reported",
            t.dropped_reported,
            "msgs",
            false,
            "echo replies reported undelivered (client gone), not resent",
        ),
        count(
            "unconfirmed-sender-killed",
            t.unconfirmed_killed,
            "msgs",
            false,
            "sender killed before learning the fate",
        ),
        count(
            "undrained",
            t.undrained,
            "msgs",
            true,
            "sender alive but never drained",
        ),
        count(
            "kills",
            total_kills,
            "kills",
            false,
            kills
                .iter()
                .map(|(k, v)| format!("{k}:{v}"))
                .collect::<Vec<_>>()
                .join(" "),
        ),
        count("broker-restarts", broker_restarts, "restarts", false, ""),
        count(
            "unexpected-exits",
            unexpected_exits,
            "processes",
            true,
            "a role or the broker died without being killed",
        ),
        count(
            "protocol-errors",
            ledger_protocol,
            "errors",
            true,
            "Error::Protocol between honest peers",
        ),
        count(
            "inconsistent-reports",
            ledger_inconsistent,
            "reports",
            true,
            "take_undelivered vs confirmed releases",
        ),
        count(
            "stalls",
            stalls,
            "stalls",
            true,
            format!("a pipeline delivered nothing for {} s", o.stall_secs),
        ),
        count(
            "drain-timeouts",
            drain_timeouts,
            "roles",
            true,
            "did not drain within 60 s at the end",
        ),
        count(
            "bad-exits",
            bad_exits + u64::from(!broker_exit_ok),
            "processes",
            true,
            "non-zero exit or no exit at the end",
        ),
        count(
            "leaked-fds",
            (self_fd1 as i64 - self_fd0 as i64).max(0) as u64 + broker_fds.max(0) as u64,
            "fds",
            true,
            format!("driver {self_fd0}->{self_fd1}; broker {broker_fds:+} vs fresh"),
        ),
        count(
            "leaked-memfds",
            (self_memfd + broker_memfds) as u64,
            "fds",
            true,
            "memfd fds in the driver and the broker with no domain left",
        ),
        count(
            "stale-mappings",
            stale.len() as u64,
            "mappings",
            true,
            "arenas of dead domains still mapped by live ones after the drain",
        ),
        count(
            "leaked-shm",
            shm_new.len() as u64,
            "entries",
            true,
            shm_new.join(" "),
        ),
        count(
            "leaked-processes",
            procs.len() as u64,
            "processes",
            true,
            format!("{procs:?}"),
        ),
        count(
            "leaked-broker-state",
            broker_state,
            "entries",
            true,
            broker_state_note,
        ),
        count(
            "leaked-state-files",
            state_files.len() as u64,
            "files",
            true,
            state_files.join(" "),
        ),
    ];
    for (case, v) in [
        ("recovery-domain-kill", &mut rec_dom),
        ("recovery-broker-kill", &mut rec_brk),
    ] {
        let (p50, p99, max) = pct(v);
        rows.push(Row {
            rec: Record {
                suite: SUITE.into(),
                case: case.into(),
                system: SYSTEM.into(),
                metric: "recovery_ms".into(),
                value: p50,
                unit: "ms".into(),
                p50: Some(p50),
                p99: Some(p99),
                n: v.len() as u64,
            },
            check: None,
            note: format!("kill -> first end-to-end delivery after restart: p50 {p50:.0} p99 {p99:.0} max {max:.0} ms, n {}", v.len()),
        });
    }
    let rate = t.delivered as f64 / chaos_secs.max(1e-9);
    rows.push(Row {
        rec: Record {
            suite: SUITE.into(),
            case: "throughput".into(),
            system: SYSTEM.into(),
            metric: "msgs_per_s".into(),
            value: rate,
            unit: "msg/s".into(),
            p50: None,
            p99: None,
            n: t.delivered,
        },
        check: None,
        note: format!("deliveries / {chaos_secs:.0} s (chaos + drain {drain_secs:.1} s)"),
    });
    rows
}

fn pct(v: &mut [u64]) -> (f64, f64, f64) {
    if v.is_empty() {
        return (0.0, 0.0, 0.0);
    }
    let (p50, p99) = crate::percentiles(v);
    (p50 as f64, p99 as f64, *v.iter().max().unwrap() as f64)
}

/// One line of the report: a JSON record, and whether it is a check that passed.
struct Row {
    rec: Record,
    check: Option<bool>,
    note: String,
}

fn count(case: &str, value: u64, unit: &str, check_zero: bool, note: impl Into<String>) -> Row {
    Row {
        rec: Record {
            suite: SUITE.into(),
            case: case.into(),
            system: SYSTEM.into(),
            metric: "count".into(),
            value: value as f64,
            unit: unit.into(),
            p50: None,
            p99: None,
            n: value,
        },
        check: check_zero.then_some(value == 0),
        note: note.into(),
    }
}

fn print_rows(rows: &[Row]) {
    let w0 = rows
        .iter()
        .map(|r| r.rec.case.len())
        .max()
        .unwrap_or(4)
        .max(4);
    println!(
        "{:<w0$}  {:>12}  {:<10}  {:<5}  note",
        "case", "value", "unit", "check"
    );
    println!("{}", "-".repeat(w0 + 40));
    for r in rows {
        let v = if r.rec.metric == "count" {
            format!("{}", r.rec.value as u64)
        } else {
            format!("{:.1}", r.rec.value)
        };
        let c = match r.check {
            Some(true) => "ok",
            Some(false) => "FAIL",
            None => "",
        };
        println!(
            "{:<w0$}  {:>12}  {:<10}  {:<5}  {}",
            r.rec.case, v, r.rec.unit, c, r.note
        );
    }
}


/// The last lines of every non-empty log (printed when a check failed).
pub(super) fn tails(dir: &Path) -> String {
    let mut out = String::new();
    let Ok(d) = std::fs::read_dir(dir) else {
        return out;
    };
    let mut files: Vec<PathBuf> = d.flatten().map(|e| e.path()).collect();
    files.sort();
    for p in files {
        let Ok(s) = std::fs::read_to_string(&p) else {
            continue;
        };
        let lines: Vec<&str> = s.lines().collect();
        if lines.is_empty() {
            continue;
        }
        out.push_str(&format!(
            "--- {} (last {} of {} lines)\n",
            p.display(),
            lines.len().min(15),
            lines.len()
        ));
        for l in &lines[lines.len().saturating_sub(15)..] {
            out.push_str(l);
            out.push('\n');
        }
    }
    out
}
