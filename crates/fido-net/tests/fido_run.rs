//! `fido run`: the preload reaches the program through a shell and across
//! `exec` (the environment carries it), `--no-accel` keeps plain TCP, and
//! `fido status` lists what was accelerated. Needs the `fido` binary built
//! beside the library (`cargo build -p fido-cli -p fido-net`).

use fido_test_support::mmnet::*;
use fido_test_support::wait::*;
use std::process::{Command, Stdio};
use std::time::Duration;

fn fido() -> std::path::PathBuf {
    let p = library().parent().unwrap().join("fido");
    assert!(
        p.is_file(),
        "{} missing: build it with `cargo build -p fido-cli`",
        p.display()
    );
    p
}

#[test]
fn fido_run_preloads_across_exec_and_status_lists_it() {
    let b = Broker::start();
    let echo = b.dir.path().join("echo");
    compile_c("echo.c", &echo, &[]);
    let port = free_port().to_string();
    // Server: fido run -> sh -> exec echo (the preload survives the exec).
    let mut s = Command::new(fido());
    s.arg("run").arg("--socket").arg(&b.socket).arg("--");
    s.args([
        "sh",
        "-c",
        &format!("exec {} server {port}", echo.display()),
    ]);
    s.env_remove("LD_PRELOAD")
        .env("FIDO_NET_ATTACH_MS", "10000")
        .stdout(Stdio::null());
    let _s = Guard(s.spawn().unwrap());
    wait_port(port.parse().unwrap());
    // Client: fido run -> sh -> echo (a child of the shell).
    let mut c = Command::new(fido());
    c.arg("run").arg("--socket").arg(&b.socket).arg("--");
    c.args([
        "sh",
        "-c",
        &format!("{} client {port} 200000", echo.display()),
    ]);
    c.env_remove("LD_PRELOAD")
        .env("FIDO_NET_ATTACH_MS", "10000");
    assert_eq!(run_ok(c, Duration::from_secs(60)).trim(), "ok 200000");
    let (n, sent, recv) = b.wait_accelerated("echo", 2);
    assert_eq!(n, 2, "{:?}", b.stats());
    assert!(sent >= 400_000 && recv >= 400_000, "{sent}/{recv}");

    // --no-accel: plain TCP, nothing more accelerated.
    let mut c = Command::new(fido());
    c.arg("run")
        .arg("--no-accel")
        .arg("--socket")
        .arg(&b.socket)
        .arg("--");
    c.arg(&echo).args(["client", &port, "200000"]);
    assert_eq!(run_ok(c, Duration::from_secs(60)).trim(), "ok 200000");
    assert_eq!(b.accelerated("echo").0, 2, "{:?}", b.stats());

    // fido status shows the processes and their counts.
    let mut st = Command::new(fido());
    st.arg("status").arg("--socket").arg(&b.socket);
    let out = run_ok(st, Duration::from_secs(30));
    assert!(out.contains("net: processes under `fido run`"), "{out}");
    assert!(out.lines().any(|l| l.contains(" echo ")), "{out}");
    let mut st = Command::new(fido());
    st.arg("status")
        .arg("--json")
        .arg("--socket")
        .arg(&b.socket);
    let v: serde_json::Value = serde_json::from_str(&run_ok(st, Duration::from_secs(30))).unwrap();
    let total: u64 = v["net"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|p| p["name"] == "echo")
        .map(|p| p["accelerated"].as_u64().unwrap())
        .sum();
    assert_eq!(total, 2, "{v}");
}
