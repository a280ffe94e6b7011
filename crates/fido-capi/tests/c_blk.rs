//! Builds the C example (crates/fido-capi/examples/blk_demo.c) with `cc`
//! against libfido.so and runs it against a storage domain serving a RAM
//! disk: every blocking call of include/fido/blk.h, checked from C.

use std::process::Command;
use std::sync::Arc;

use fido_blk::{serve, BackingOptions, FileBackend, ServeOptions};

mod common;

#[test]
fn c_client_of_a_storage_domain() {
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("broker.sock");
    let broker = fido_broker::Embedded::start(fido_broker::Config::new(&sock, dir.path().join("state"))).unwrap();
    let bin = common::build_example("blk_demo", dir.path());
    let d = fido::Domain::join(fido::JoinOptions::new("storage").broker(&sock).arena_len(64 << 20)).unwrap();
    let backend = Arc::new(FileBackend::ram(4 << 20, &BackingOptions::default()).unwrap());
    let server = serve(&d, "c-disk", backend, ServeOptions::default()).unwrap();

    let out = Command::new(&bin).arg("c-disk").env("FIDO_BROKER", &sock).output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "blk_demo failed: {stdout}{}", String::from_utf8_lossy(&out.stderr));
    assert!(stdout.contains("size 4194304 block 512") && stdout.trim_end().ends_with("blk ok"), "{stdout}");
    let st = server.stats();
    assert!(st.writes >= 1 && st.reads >= 3 && st.flushes == 1 && st.discards == 1 && st.write_zeroes == 1, "{st:?}");
    assert_eq!(st.errors, 2, "the two refused reads");

    // A device nobody serves: -ENOENT.
    let out = Command::new(&bin).arg("nobody").env("FIDO_BROKER", &sock).output().unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("no such block device"), "{}", String::from_utf8_lossy(&out.stderr));
    drop(server);
    broker.stop().unwrap();
}
