//! Sockets closed behind the library's back (`tests/c/rawclose.c`): libuv
//! (Node.js) closes with `syscall(SYS_close)`, which the library routes to
//! its own `close`; a raw `syscall` instruction is seen by nobody, so the
//! next call that hands out that descriptor number drops what the library
//! knew about it: here `accept`, `pipe`, `timerfd_create`, `fopen`,
//! `mkstemp` and a descriptor received over `SCM_RIGHTS`. Either way a later
//! plain connection, or the new descriptor, that gets the same number works
//! as it would without the library, and the segment descriptors of closed
//! connections do not pile up.

use fido_test_support::mmnet::*;
use fido_test_support::wait::*;
use std::process::{Command, Stdio};
use std::time::Duration;

const T: Duration = Duration::from_secs(40);
const N: usize = 20;

fn run(mode: &str) {
    let b = Broker::start();
    let exe = b.dir.path().join("rawclose");
    compile_c("rawclose.c", &exe, &[]);
    let port = free_port();
    let mut srv = b.accel(&exe);
    srv.args(["server", &port.to_string(), &N.to_string(), mode])
        .current_dir(b.dir.path())
        .stdout(Stdio::piped());
    let mut guard = Guard(srv.spawn().unwrap());
    let mut stdout = std::io::BufReader::new(guard.0.stdout.take().unwrap());
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let mut text = String::new();
        // The first line says it listens (a probe connection would count
        // as one of its N); the rest come at the end.
        let _ = std::io::BufRead::read_line(&mut stdout, &mut text);
        let _ = tx.send(std::mem::take(&mut text));
        let _ = std::io::Read::read_to_string(&mut stdout, &mut text);
        let _ = tx.send(text);
    });
    assert_eq!(rx.recv_timeout(T).unwrap(), "listening\n");
    // Every other client is plain (no preload): its connection reuses the
    // descriptor number the accelerated one before it had in the server.
    for i in 0..N {
        let mut c = if i % 2 == 0 {
            b.accel(&exe)
        } else {
            Command::new(&exe)
        };
        c.args(["client", &port.to_string(), &i.to_string()]);
        let out = run_ok(c, T);
        assert_eq!(out, format!("reply {i}\n"), "client {i} ({mode} close)");
    }
    let text = rx.recv_timeout(T).expect("the server finishes");
    assert!(guard.0.wait().unwrap().success(), "server: {text}");
    assert!(
        text.contains(&format!("reused {N}\n")),
        "each new descriptor took the closed number: {text}"
    );
    // The segment descriptors of the closed connections are gone (before
    // the fix one stayed per accelerated connection: 10).
    let memfds: usize = text
        .lines()
        .find_map(|l| l.strip_prefix("memfds "))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or_else(|| panic!("no memfd count: {text}"));
    assert!(
        memfds <= 1,
        "memfds left after {N} closed connections: {memfds}"
    );
    let (n, _, _) = b.wait_accelerated("rawclose", (N / 2) as u64 * 2);
    assert_eq!(n, (N / 2) as u64 * 2, "{:?}", b.stats());
}

#[test]
fn syscall_close_forgets_the_connection() {
    run("syscall");
}

#[test]
fn a_close_nobody_saw_does_not_outlive_the_descriptor_number() {
    run("raw");
}
