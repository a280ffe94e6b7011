//! Readiness is exact for readers: when epoll reports an accelerated socket
//! readable, the next non-blocking read returns data or EOF, never EAGAIN
//! (wrk counts such an EAGAIN as a read error). The C probe
//! (tests/c/readiness.c) reads one message per readiness and, in between,
//! reads eagerly without readiness, which consumes data whose doorbell may
//! still be on its way; it fails on any EAGAIN right after readiness.
//!
//! `FIDO_NET_TEST_DOORBELL_DELAY_US` makes the writer sleep between taking
//! the reader's arm and sending the doorbell, so the race the library must
//! survive (a doorbell landing after its data was read) happens on nearly
//! every message instead of only under heavy CPU load. Before the fix the
//! delayed run reported dozens of spurious EAGAINs per 200 messages.

mod common;
use common::*;
use std::time::Duration;

fn run(b: &Broker, exe: &std::path::Path, delay_us: u32, messages: u32) {
    let mut c = b.accel(exe);
    c.arg(messages.to_string())
        .env("FIDO_NET_TEST_DOORBELL_DELAY_US", delay_us.to_string());
    let out = run_ok(c, Duration::from_secs(120));
    assert!(out.contains("spurious_eagain 0 content ok"), "{out}");
}

#[test]
fn no_eagain_after_readiness_even_when_doorbells_land_late() {
    let b = Broker::start();
    let exe = b.dir.path().join("fido-net-readiness");
    compile_c("readiness.c", &exe, &[]);
    // Plain TCP first: the probe itself is right.
    let plain = run_ok(
        {
            let mut c = std::process::Command::new(&exe);
            c.arg("100");
            c
        },
        Duration::from_secs(60),
    );
    assert!(plain.contains("spurious_eagain 0 content ok"), "{plain}");
    // Doorbells 3 ms late (longer than any bounded grace the reader could
    // give them), then undelayed.
    run(&b, &exe, 3000, 200);
    run(&b, &exe, 0, 300);
    let (n, _, recv) = b.wait_accelerated("fido-net-readin", 2);
    assert!(n >= 2, "not accelerated: {:?}", b.stats());
    assert!(recv >= 500 * 16, "bytes received {recv}: {:?}", b.stats());
}
