//! Builds the C example (crates/fido-capi/examples/rpc_demo.c) with `cc`
//! against libfido.so and runs it against a private broker: a C server and a
//! C client (both processes in C, talking through Fido).

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

fn lib_dir() -> PathBuf {
    // target/<profile>/deps/c_rpc-XXXX -> target/<profile>
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
    let st = cmd.status().expect("run cargo build");
    assert!(st.success(), "building libfido failed");
}

fn build_demo(out: &Path) -> PathBuf {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let lib = lib_dir();
    build_lib(&root, &lib);
    assert!(lib.join("libfido.so").exists(), "libfido.so not built in {}", lib.display());
    let bin = out.join("rpc_demo");
    let st = Command::new(std::env::var("CC").unwrap_or_else(|_| "cc".into()))
        .args(["-std=c11", "-D_DEFAULT_SOURCE", "-Wall", "-Wextra", "-Werror", "-o"])
        .arg(&bin)
        .arg(root.join("crates/fido-capi/examples/rpc_demo.c"))
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
fn c_client_and_c_server() {
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("broker.sock");
    let broker = fido_broker::Embedded::start(fido_broker::Config::new(&sock, dir.path().join("state"))).unwrap();
    let bin = build_demo(dir.path());
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
