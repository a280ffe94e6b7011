//! Builds the C example (crates/fido-capi/examples/rpc_demo.c) with `cc`
//! against libfido.so and runs it against a private broker: a C server and a
//! C client (both processes in C, talking through Fido).

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};

mod common;

#[test]
fn c_client_and_c_server() {
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("broker.sock");
    let broker = fido_broker::Embedded::start(fido_broker::Config::new(&sock, dir.path().join("state"))).unwrap();
    let bin = common::build_example("rpc_demo", dir.path());
    let mut server = Command::new(&bin)
        .args(["server", "c-demo"])
        .env("FIDO_BROKER", &sock)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut line = String::new();
    BufReader::new(server.stdout.take().unwrap()).read_line(&mut line).unwrap();
    assert_eq!(line.trim(), "serving");
    let out = Command::new(&bin).args(["client", "c-demo"]).env("FIDO_BROKER", &sock).output().unwrap();
    assert!(out.status.success(), "client failed: {}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "client ok");
    drop(server.stdin.take());
    let st = server.wait().unwrap();
    assert!(st.success());
    broker.stop().unwrap();
}
