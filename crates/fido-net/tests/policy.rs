//! The broker's `net` policy turns MMNet acceleration off for matching
//! processes (domains `net-<comm>`), end to end under `fido run`: the
//! programs keep working over plain TCP, the counters show no acceleration,
//! `FIDO_NET_DEBUG` says why, and a reload (what SIGHUP does) applies to the
//! next connection — in both directions.

use fido_test_support::mmnet::*;
use fido_test_support::wait::*;
use std::process::{Command, Stdio};
use std::time::Duration;

const T: Duration = Duration::from_secs(60);

fn fido() -> std::path::PathBuf {
    library().parent().unwrap().join("fido")
}

fn policy(deny: &[&str]) -> String {
    format!(
        "[net]\ndeny = {deny:?}\n[[rule]]\nname = \"me\"\nuids = [{}]\nregistry_write = [\"/**\"]\n",
        // SAFETY: geteuid cannot fail.
        unsafe { libc::geteuid() }
    )
}

fn run(b: &Broker, prog: &std::path::Path, args: &[&str]) -> Command {
    let mut c = Command::new(fido());
    c.arg("run")
        .arg("--socket")
        .arg(&b.socket)
        .arg("--")
        .arg(prog)
        .args(args);
    c.env_remove("LD_PRELOAD")
        .env("FIDO_NET_DEBUG", "1")
        .env("FIDO_NET_ATTACH_MS", "10000");
    c
}

/// Runs the client; returns its debug output (stderr).
fn client(b: &Broker, echo: &std::path::Path, port: u16) -> String {
    let mut c = run(b, echo, &["client", &port.to_string(), "200000"]);
    c.stdout(Stdio::piped()).stderr(Stdio::piped());
    let out = wait_timeout(c.spawn().unwrap(), T);
    assert!(out.status.success(), "{out:?}");
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "ok 200000");
    String::from_utf8_lossy(&out.stderr).into_owned()
}

#[test]
fn a_denying_policy_keeps_plain_tcp_and_reloads_apply_to_new_connections() {
    let b = Broker::start_with_policy(Some(&policy(&["net-echo", "net-echosrv"])));
    let echo = b.dir.path().join("echo");
    compile_c("echo.c", &echo, &[]);
    // The server under another name, so the policy can single it out.
    let srv = b.dir.path().join("echosrv");
    std::fs::copy(&echo, &srv).unwrap();
    let port = free_port();
    let log = b.dir.path().join("server.log");
    let mut s = run(&b, &srv, &["server", &port.to_string()]);
    s.stdout(Stdio::null())
        .stderr(std::fs::File::create(&log).unwrap());
    let _s = Guard(s.spawn().unwrap());
    wait_port(port);

    // Denied: the client's request is refused, both ends speak TCP.
    let err = client(&b, &echo, port);
    assert!(
        err.contains("request refused (MMNet acceleration disabled by policy")
            && err.contains("net-echo"),
        "{err}"
    );
    assert_eq!(
        b.accelerated("echo").0 + b.accelerated("echosrv").0,
        0,
        "{:?}",
        b.stats()
    );

    // Reloaded to allow: the next connection is accelerated (the listener
    // opened while refused was published all along).
    b.reload(&policy(&[]));
    std::thread::sleep(Duration::from_millis(300));
    client(&b, &echo, port);
    assert_eq!(b.wait_accelerated("echo", 1).0, 1, "{:?}", b.stats());
    assert_eq!(b.wait_accelerated("echosrv", 1).0, 1, "{:?}", b.stats());

    // Reloaded to deny the server only: its claim is refused, it abandons
    // the segment at once (the client does not wait out its attach time).
    b.reload(&policy(&["net-echosrv"]));
    std::thread::sleep(Duration::from_millis(300));
    let err = client(&b, &echo, port);
    assert!(!err.contains("did not attach"), "the client waited: {err}");
    let slog = std::fs::read_to_string(&log).unwrap();
    assert!(
        slog.contains("MMNet acceleration disabled by policy") && slog.contains("net-echosrv"),
        "{slog}"
    );
    std::thread::sleep(Duration::from_millis(500));
    assert_eq!(b.accelerated("echo").0, 1, "{:?}", b.stats());
    assert_eq!(b.accelerated("echosrv").0, 1, "{:?}", b.stats());
}
