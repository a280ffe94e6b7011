//! Builds examples/c/pipe_copy.c with `cc` against libfido.a and runs it
//! against a private broker: the C ABI end to end.

use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;

fn target_dir() -> PathBuf {
    // .../target/debug/deps/c_pipe-HASH → .../target/debug (where libfido.a is).
    let exe = std::env::current_exe().unwrap();
    exe.parent().unwrap().parent().unwrap().to_path_buf()
}

#[test]
fn c_example_copies_through_the_broker() {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..");
    let lib = target_dir().join("libfido.a");
    if !lib.exists() {
        // `cargo test` builds the library as an rlib only; `cargo build` (as CI
        // does first) also makes libfido.a. Build it if that did not happen.
        let mut cmd = Command::new(env!("CARGO"));
        cmd.args(["build", "-p", "fido-capi", "--lib"]);
        if !cfg!(debug_assertions) {
            cmd.arg("--release");
        }
        if let Some(t) = target_dir().parent() {
            cmd.env("CARGO_TARGET_DIR", t);
        }
        assert!(cmd.status().unwrap().success(), "building libfido.a");
    }
    assert!(lib.exists(), "{} missing", lib.display());
    let dir = tempfile::tempdir().unwrap();
    let exe = dir.path().join("pipe_copy");
    let st = Command::new("cc")
        .args([
            "-std=c11",
            "-D_GNU_SOURCE",
            "-Wall",
            "-Wextra",
            "-Werror",
            "-I",
        ])
        .arg(root.join("include"))
        .arg(root.join("examples/c/pipe_copy.c"))
        .arg(&lib)
        .args(["-lpthread", "-ldl", "-lm", "-o"])
        .arg(&exe)
        .status()
        .expect("cc (apt-get install gcc)");
    assert!(st.success(), "cc failed");

    let socket = dir.path().join("broker.sock");
    let mut cfg = fido_broker::Config::new(&socket, dir.path().join("state"));
    cfg.heartbeat = Duration::from_millis(100);
    cfg.pipe.capacity = fido_broker::Capacity::Unlimited;
    let broker = fido_broker::Embedded::start(cfg).unwrap();

    let src = dir.path().join("src.bin");
    let data: Vec<u8> = (0..(3u32 << 20) + 4099)
        .map(|i| (i.wrapping_mul(2654435761) >> 13) as u8)
        .collect();
    std::fs::write(&src, &data).unwrap();
    let dst = dir.path().join("dst.bin");
    let out = Command::new(&exe)
        .arg(&src)
        .arg(&dst)
        .env("FIDO_BROKER", &socket)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "pipe_copy failed: {stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        stdout.starts_with(&format!("OK {} bytes", data.len())),
        "{stdout}"
    );
    assert_eq!(std::fs::read(&dst).unwrap(), data);
    broker.stop().unwrap();
}
