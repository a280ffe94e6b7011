//! Socket semantics on accelerated connections are those of TCP: the C probe
//! (tests/c/semantics.c) prints what it observes — flags, readiness under
//! poll/select/epoll (LT and ET), half-close, resets, EPIPE/SIGPIPE, dup, fork,
//! threads, sendfile, socket names and options — and the transcript under the
//! preload must equal the plain-TCP transcript, with every connection accelerated.

use fido_test_support::mmnet::*;
use fido_test_support::wait::*;
use std::time::Duration;

#[test]
fn accelerated_transcript_equals_tcp() {
    transcript_equals_tcp(None);
}

/// The same with eager arming throughout (`FIDO_NET_LAZY=0`): readiness then
/// comes from the kernel alone, as for programs that wait in ways the
/// library cannot see.
#[test]
fn eager_arming_transcript_equals_tcp() {
    transcript_equals_tcp(Some("0"));
}

fn transcript_equals_tcp(lazy: Option<&str>) {
    let b = Broker::start();
    let exe = b.dir.path().join("fido-net-semantics");
    compile_c("semantics.c", &exe, &[]);
    let plain = run_ok(std::process::Command::new(&exe), Duration::from_secs(120));
    assert!(plain.ends_with("done\n"), "{plain}");
    let mut cmd = b.accel(&exe);
    if let Some(v) = lazy {
        cmd.env("FIDO_NET_LAZY", v);
    }
    let accel = run_ok(cmd, Duration::from_secs(120));
    let pl: Vec<&str> = plain.lines().collect();
    let ac: Vec<&str> = accel.lines().collect();
    for (i, (p, a)) in pl.iter().zip(&ac).enumerate() {
        assert_eq!(
            p, a,
            "line {i} differs\nplain:\n{plain}\naccelerated:\n{accel}"
        );
    }
    assert_eq!(pl.len(), ac.len(), "plain:\n{plain}\naccelerated:\n{accel}");
    // The probe opens 27 connections (54 ends). An end is counted by the
    // process that makes its first I/O; a few are first used in forked
    // children that leave with _exit before publishing, so the main process
    // accounts for at least 30 ends. One falls back to TCP on purpose:
    // `t_stdio` wraps its sockets in stdio streams, which glibc reads and
    // writes where the library cannot see.
    let (n, sent, recv) = b.wait_accelerated("fido-net-semant", 30);
    assert!(
        n >= 30,
        "only {n} accelerated connection ends; stats: {:?}",
        b.stats()
    );
    let plain: u64 = b
        .stats()
        .iter()
        .map(|v| v["plain_local"].as_u64().unwrap_or(0))
        .sum();
    assert_eq!(plain, 1, "{:?}", b.stats());
    assert!(sent > 1 << 20 && recv > 1 << 20, "bytes {sent}/{recv}");
}

#[test]
fn acceleration_off_switch_keeps_tcp() {
    let b = Broker::start();
    let exe = b.dir.path().join("fido-net-semantics");
    compile_c("semantics.c", &exe, &[]);
    let plain = run_ok(std::process::Command::new(&exe), Duration::from_secs(120));
    let mut c = b.accel(&exe);
    c.env("FIDO_NET", "off");
    let off = run_ok(c, Duration::from_secs(120));
    assert_eq!(plain, off);
    assert_eq!(b.accelerated("fido-net-semant").0, 0, "{:?}", b.stats());
}
