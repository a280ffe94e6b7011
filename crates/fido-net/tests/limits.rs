//! What cannot be accelerated falls back to plain TCP and keeps working:
//! static binaries (the preload never enters), programs that created an
//! io_uring (their new connections are left alone), setuid programs (the
//! loader ignores LD_PRELOAD), a peer without Fido, and no broker at all.

use fido_test_support::mmnet::*;
use fido_test_support::wait::*;
use std::process::{Command, Stdio};
use std::time::Duration;

const T: Duration = Duration::from_secs(60);

struct Bins {
    dynamic: std::path::PathBuf,
    stat: std::path::PathBuf,
}

fn build(b: &Broker) -> Bins {
    let dynamic = b.dir.path().join("echo");
    compile_c("echo.c", &dynamic, &[]);
    let stat = b.dir.path().join("echo-static");
    compile_c("echo.c", &stat, &["-static"]);
    Bins { dynamic, stat }
}

fn server(b: &Broker, bin: &std::path::Path, accel: bool) -> (Guard, u16) {
    let port = free_port();
    let mut c = if accel {
        b.accel(bin)
    } else {
        Command::new(bin)
    };
    c.args(["server", &port.to_string()]).stdout(Stdio::null());
    let g = Guard(c.spawn().unwrap());
    wait_port(port);
    (g, port)
}

fn client(mut c: Command, port: u16, mode: &str) {
    c.args([mode, &port.to_string(), "300000"]);
    assert_eq!(run_ok(c, T).trim(), "ok 300000");
}

#[test]
fn static_binaries_use_plain_tcp() {
    let b = Broker::start();
    let bins = build(&b);
    // Accelerated server, static client: the client never asks, the server
    // finds no request and both speak TCP.
    let (_s, port) = server(&b, &bins.dynamic, true);
    client(b.accel(&bins.stat), port, "client");
    // Static server (publishes no listener), accelerated client: plain TCP.
    let (_s2, port2) = server(&b, &bins.stat, true);
    client(b.accel(&bins.dynamic), port2, "client");
    // And the control: both dynamic, accelerated.
    client(b.accel(&bins.dynamic), port, "client");
    let (n, _, _) = b.wait_accelerated("echo", 2);
    assert_eq!(
        n,
        2,
        "exactly the dynamic pair (both ends) is accelerated: {:?}",
        b.stats()
    );
}

#[test]
fn io_uring_programs_and_plain_peers_use_plain_tcp() {
    let b = Broker::start();
    let bins = build(&b);
    let (_s, port) = server(&b, &bins.dynamic, true);
    client(b.accel(&bins.dynamic), port, "uring-client");
    // A client without the preload against an accelerated server.
    client(Command::new(&bins.dynamic), port, "client");
    // An accelerated client against a server without the preload.
    let (_s2, port2) = server(&b, &bins.dynamic, false);
    client(b.accel(&bins.dynamic), port2, "client");
    assert_eq!(b.accelerated("echo").0, 0, "{:?}", b.stats());
}

#[test]
fn no_broker_means_plain_tcp() {
    let b = Broker::start();
    let bins = build(&b);
    let port = free_port();
    let mut s = Command::new(&bins.dynamic);
    s.env("LD_PRELOAD", library())
        .env("FIDO_BROKER", b.dir.path().join("nonexistent.sock"));
    s.args(["server", &port.to_string()]).stdout(Stdio::null());
    let _s = Guard(s.spawn().unwrap());
    wait_port(port);
    let mut c = Command::new(&bins.dynamic);
    c.env("LD_PRELOAD", library())
        .env("FIDO_BROKER", b.dir.path().join("nonexistent.sock"));
    client(c, port, "client");
}

#[test]
fn setuid_programs_use_plain_tcp() {
    // The loader ignores LD_PRELOAD for a set-user-ID program run by another
    // user (AT_SECURE). Needs root (to make a root-owned setuid binary and to
    // run it as nobody).
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 || !have("setpriv") {
        eprintln!("skipped: needs root and setpriv");
        return;
    }
    let b = Broker::start();
    let bins = build(&b);
    let (_s, port) = server(&b, &bins.dynamic, true);
    let suid = std::path::Path::new("/tmp").join(format!("fido-net-suid-{}", std::process::id()));
    std::fs::copy(&bins.dynamic, &suid).unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&suid, std::fs::Permissions::from_mode(0o4755)).unwrap();
    let mut c = Command::new("setpriv");
    c.args(["--reuid=nobody", "--regid=nogroup", "--clear-groups", "--"])
        .arg(&suid);
    c.env("LD_PRELOAD", library()).env("FIDO_BROKER", &b.socket);
    c.args(["client", &port.to_string(), "300000"]);
    let out = run_ok(c, T);
    let _ = std::fs::remove_file(&suid);
    assert_eq!(out.trim(), "ok 300000");
    // The server saw a loopback connection without a request: plain.
    assert_eq!(b.accelerated("echo").0, 0, "{:?}", b.stats());
}
