//! Builds the C example (crates/fido-capi/examples/blk_demo.c) with `cc`
//! against libfido.so and runs it against a storage domain serving a RAM
//! disk: every blocking call of include/fido/blk.h, checked from C.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;

use fido_blk::{serve, BackingOptions, FileBackend, ServeOptions};

fn lib_dir() -> PathBuf {
    // target/<profile>/deps/c_blk-XXXX -> target/<profile>
    let exe = std::env::current_exe().unwrap();
    exe.parent().unwrap().parent().unwrap().to_path_buf()
}

/// `cargo test` builds this crate as an rlib only: build libfido.so (same
/// profile, same target dir) so the C program links today's code.
fn build_lib(root: &Path, lib: &Path) {
    let mut cmd = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()));
    cmd.args(["build", "-p", "fido-capi", "--lib"]).current_dir(root);
    if lib.file_name().is_some_and(|n| n == "release") {
        cmd.arg("--release");
    }
    cmd.env("CARGO_TARGET_DIR", lib.parent().unwrap());
    assert!(cmd.status().expect("run cargo build").success(), "building libfido failed");
}

fn build_demo(out: &Path) -> PathBuf {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let lib = lib_dir();
    build_lib(&root, &lib);
    let bin = out.join("blk_demo");
    let st = Command::new(std::env::var("CC").unwrap_or_else(|_| "cc".into()))
        .args(["-std=c11", "-D_DEFAULT_SOURCE", "-Wall", "-Wextra", "-Werror", "-o"])
        .arg(&bin)
        .arg(root.join("crates/fido-capi/examples/blk_demo.c"))
        .arg("-I")
        .arg(root.join("include"))
        .arg("-L")
        .arg(&lib)
        .arg(format!("-Wl,-rpath,{}", lib.display()))
        .arg("-lfido")
        .status()
        .expect("run cc");
    assert!(st.success(), "cc failed");
    bin
}

#[test]
fn c_client_of_a_storage_domain() {
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("broker.sock");
    let broker = fido_broker::Embedded::start(fido_broker::Config::new(&sock, dir.path().join("state"))).unwrap();
    let bin = build_demo(dir.path());
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
