//! Accelerated connections across `exec` (tests/c/exec.c): a server
//! accepts an accelerated connection, converses, then hands the socket to a
//! new image — inetd style (dup2 onto 0/1 and execl), fork + execv, and
//! posix_spawn with dup2 file actions — which continues the conversation in
//! both directions on the ring (every byte checked; the client's counters
//! show both phases on the ring). An image that cannot load the library
//! (LD_PRELOAD removed, or a static executable) gets a reset connection,
//! never doorbell bytes as data; `FIDO_NET=off` in the new image still
//! adopts (the connection already is accelerated).

use fido_test_support::mmnet::*;
use fido_test_support::wait::*;
use std::process::Stdio;
use std::time::Duration;

const T: Duration = Duration::from_secs(60);
const N: u64 = 200_000;

struct Bins {
    server: std::path::PathBuf,
    client: std::path::PathBuf,
    stat: std::path::PathBuf,
}

/// The programs, compiled once for all tests of this binary (compiling
/// them per test, statically too, loaded the machine enough to delay
/// accepts past the client's attach wait).
fn bins() -> &'static Bins {
    static B: std::sync::OnceLock<(tempfile::TempDir, Bins)> = std::sync::OnceLock::new();
    &B.get_or_init(|| {
        let dir = tempfile::tempdir().unwrap();
        let server = dir.path().join("xserver");
        compile_c("exec.c", &server, &[]);
        let client = dir.path().join("xclient");
        std::fs::copy(&server, &client).unwrap();
        let stat = dir.path().join("xstatic");
        compile_c("exec.c", &stat, &["-static"]);
        (
            dir,
            Bins {
                server,
                client,
                stat,
            },
        )
    })
    .1
}

/// Runs one mode; returns (client stdout, server exit success, server stderr).
fn run_mode(mode: &str, handler: Option<&std::path::Path>) -> (String, bool, String, Broker) {
    run_mode_with(mode, handler, &[])
}

fn run_mode_with(
    mode: &str,
    handler: Option<&std::path::Path>,
    client_args: &[&str],
) -> (String, bool, String, Broker) {
    let b = Broker::start();
    let bins = bins();
    let port = free_port();
    let mut s = b.accel(&bins.server);
    s.args(["server", &port.to_string(), mode, &N.to_string()]);
    if let Some(h) = handler.map(|h| {
        // The static handler lives beside the broker's files.
        if h.as_os_str() == "static" {
            bins.stat.clone()
        } else {
            h.to_path_buf()
        }
    }) {
        s.arg(h);
    }
    s.env("FIDO_NET_DEBUG", "1")
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    let server = s.spawn().unwrap();
    wait_listening(server.id(), port);
    b.wait_listener(port);
    let mut c = b.accel(&bins.client);
    c.args(["client", &port.to_string(), &N.to_string()])
        .args(client_args)
        .env("FIDO_NET_DEBUG", "1")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let co = wait_timeout(c.spawn().unwrap(), T);
    let so = wait_timeout(server, T);
    let err = format!(
        "{}\n(client stderr:\n{})",
        String::from_utf8_lossy(&so.stderr),
        String::from_utf8_lossy(&co.stderr)
    );
    assert!(co.status.success(), "client failed: {co:?}\nserver:\n{err}");
    let out = String::from_utf8_lossy(&co.stdout).trim().to_string();
    (out, so.status.success(), err, b)
}

fn continues(mode: &str) {
    let (out, ok, err, b) = run_mode(mode, None);
    assert_eq!(out, "ok", "client; server said:\n{err}");
    assert!(ok && err.contains("handler ok"), "server:\n{err}");
    assert!(
        err.contains("exec: adopted the accelerated connection"),
        "server:\n{err}"
    );
    ring_carried_both_phases(&b);
}

fn ring_carried_both_phases(b: &Broker) {
    // Both phases went through the ring: the client's ring counters hold
    // 2N bytes each way.
    let (n, sent, recv) = b.wait_accelerated("xclient", 1);
    assert_eq!(n, 1, "{:?}", b.stats());
    assert!(
        sent >= 2 * N && recv >= 2 * N,
        "{sent}/{recv}: {:?}",
        b.stats()
    );
}

#[test]
fn inetd_style_dup2_and_execl_continues_on_the_ring() {
    continues("exec");
}

#[test]
fn fork_and_execv_continues_on_the_ring() {
    continues("forkexec");
}

#[test]
fn posix_spawn_with_dup2_actions_continues_on_the_ring() {
    continues("spawn");
}

#[test]
fn fido_net_off_in_the_new_image_still_adopts() {
    continues("off");
}

#[test]
fn an_image_without_the_library_gets_a_reset_not_doorbells() {
    for (mode, handler) in [
        ("noload", None),
        ("exec", Some(std::path::Path::new("static"))),
    ] {
        let (out, _, err, _b) = run_mode(mode, handler);
        assert!(
            out == "reset",
            "{mode}: client said {out:?}; server:\n{err}"
        );
        assert!(
            err.contains("survives but the new image will not load the library: reset"),
            "{mode}: server:\n{err}"
        );
        assert!(
            !err.contains("handler ok") && !err.contains("mismatch"),
            "{mode}:\n{err}"
        );
    }
}

/// An exec that fails (no such file) undoes its preparation: the process
/// goes on with the connection on the ring (phase 2 in the same process).
#[test]
fn a_failed_exec_leaves_the_connection_working() {
    let (out, ok, err, b) = run_mode("failexec", None);
    assert_eq!(out, "ok", "client; server said:\n{err}");
    assert!(
        ok && err.contains("exec failed as expected") && err.contains("handler ok"),
        "{err}"
    );
    ring_carried_both_phases(&b);
}

/// fork + exec of a program while the accelerated socket is close-on-exec:
/// the child's hold (raised by fork) is given up at its exec, so when the
/// parent closes, it is the last holder and marks the connection closed —
/// the client's writes after EOF then fail with EPIPE as over TCP (with the
/// hold left high they went on filling the ring).
#[test]
fn exec_gives_up_the_hold_of_close_on_exec_connections() {
    let (out, ok, err, b) = run_mode_with("cloexec", None, &["epipe"]);
    assert_eq!(out, "ok", "client; server said:\n{err}");
    assert!(ok && err.contains("handler ok"), "{err}");
    ring_carried_both_phases(&b);
}
