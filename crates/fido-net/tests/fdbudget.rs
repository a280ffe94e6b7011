//! The library never costs a program a descriptor it would have had over
//! plain TCP (`tests/c/fdbudget.c`): a client and a server, each with
//! `RLIMIT_NOFILE` lowered to 300, hold 250 connections open at once. Before,
//! the client kept a memfd per connection until its first byte and both
//! ends a segment descriptor per connection (up to a quarter of the limit),
//! so the server's `accept` failed with `EMFILE` well before 250.

use fido_test_support::mmnet::*;
use fido_test_support::wait::*;
use std::process::Stdio;
use std::time::Duration;

const T: Duration = Duration::from_secs(50);
const N: &str = "250";
const LIMIT: &str = "300";

#[test]
fn connections_near_the_descriptor_limit_all_succeed() {
    let b = Broker::start();
    let exe = b.dir.path().join("fdbudget");
    compile_c("fdbudget.c", &exe, &[]);
    let port = free_port();
    let mut srv = b.accel(&exe);
    srv.args(["server", &port.to_string(), N, LIMIT])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let mut guard = Guard(srv.spawn().unwrap());
    let mut out = std::io::BufReader::new(guard.0.stdout.take().unwrap());
    let mut line = String::new();
    std::io::BufRead::read_line(&mut out, &mut line).unwrap();
    assert_eq!(line, "listening\n");
    let mut cli = b.accel(&exe);
    cli.args(["client", &port.to_string(), N, LIMIT]);
    assert_eq!(run_ok(cli, T), format!("ok {N}\n"));
    let mut rest = String::new();
    std::io::Read::read_to_string(&mut out, &mut rest).unwrap();
    assert_eq!(rest, format!("ok {N}\n"), "server");
    assert!(guard.0.wait().unwrap().success());
    // And (nearly) all were accelerated, both ends: a connection set up
    // while the program holds every number but a few may stay plain.
    let n: u64 = N.parse().unwrap();
    let (got, _, _) = b.wait_accelerated("fdbudget", 2 * n);
    assert!(got >= 2 * n - 10, "accelerated ends: {got} of {}", 2 * n);
}
