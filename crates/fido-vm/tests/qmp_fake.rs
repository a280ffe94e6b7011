//! The QMP client against a fake "QEMU" that sends garbage: every bad
//! stream is an error for that connection, never a panic or a hang.

use fido_vm::qmp::{Qmp, QmpError, MAX_LINE};
use rustix::net::{socketpair, AddressFamily, SocketFlags, SocketType};
use serde_json::{json, Value};
use std::io::Write;
use std::os::fd::OwnedFd;
use std::time::{Duration, Instant};

const GREETING: &[u8] = b"{\"QMP\": {\"version\": {\"qemu\": {\"micro\": 0, \"minor\": 2, \"major\": 7}}, \"capabilities\": []}}\n";
const CAPS_OK: &[u8] = b"{\"return\": {}, \"id\": 1}\n";

/// Starts a fake QEMU that writes `script` and then holds the socket open
/// for `hold` (reading and discarding what the client sends).
fn fake(script: Vec<u8>, hold: Duration) -> OwnedFd {
    let (client, server) = socketpair(AddressFamily::UNIX, SocketType::STREAM, SocketFlags::CLOEXEC, None).unwrap();
    std::thread::spawn(move || {
        let mut out = std::fs::File::from(server);
        let _ = out.write_all(&script);
        let end = Instant::now() + hold;
        rustix::io::ioctl_fionbio(&out, true).unwrap();
        let mut buf = [0u8; 4096];
        while Instant::now() < end {
            let _ = rustix::io::read(&out, &mut buf);
            std::thread::sleep(Duration::from_millis(5));
        }
    });
    client
}

fn connect(script: Vec<u8>) -> Result<Qmp, QmpError> {
    Qmp::connect(fake(script, Duration::from_secs(3)), Duration::from_millis(500))
}

fn cat(parts: &[&[u8]]) -> Vec<u8> {
    parts.concat()
}

#[test]
fn a_well_behaved_fake_works() {
    let script = cat(&[
        GREETING,
        CAPS_OK,
        b"{\"event\": \"RESUME\", \"timestamp\": {\"seconds\": 1, \"microseconds\": 2}}\n",
        b"{\"return\": {\"status\": \"running\"}, \"id\": 2}\n",
        b"{\"error\": {\"class\": \"GenericError\", \"desc\": \"bad\\u0007 thing\"}, \"id\": 3}\n",
        b"{\"event\": \"DEVICE_DELETED\", \"data\": {\"device\": \"fido-dev0\"}}\n",
    ]);
    let mut q = connect(script).unwrap();
    assert_eq!(q.version(), (7, 2, 0));
    assert_eq!(q.execute("query-status", Value::Null).unwrap(), json!({"status": "running"}));
    match q.execute("device_add", json!({"driver": "x"})) {
        Err(QmpError::Command { command, class, desc }) => {
            assert_eq!((command.as_str(), class.as_str()), ("device_add", "GenericError"));
            assert_eq!(desc, "bad thing", "control characters are dropped");
        }
        other => panic!("{other:?}"),
    }
    let e = q.take_event("DEVICE_DELETED", Duration::from_secs(1)).unwrap();
    assert_eq!(e.data["device"], "fido-dev0");
    assert_eq!(q.take_event("RESUME", Duration::from_secs(1)).unwrap().name, "RESUME");
    assert!(matches!(q.take_event("RESUME", Duration::from_millis(100)), Err(QmpError::Timeout { .. })));
}

#[test]
fn garbage_is_an_error_not_a_panic() {
    let cases: Vec<(&str, Vec<u8>)> = vec![
        ("not JSON", b"hello there\n".to_vec()),
        ("binary", vec![0xff, 0xfe, 0x00, b'\n']),
        ("an array", b"[1,2,3]\n".to_vec()),
        ("a greeting without version", b"{\"QMP\": {}}\n".to_vec()),
        ("a reply before the greeting", CAPS_OK.to_vec()),
        ("a garbled reply", cat(&[GREETING, b"{\"return\": \n"])),
        ("a reply without id", cat(&[GREETING, b"{\"return\": {}}\n"])),
        ("a reply to a command never sent", cat(&[GREETING, b"{\"return\": {}, \"id\": 99}\n"])),
        ("an error without desc", cat(&[GREETING, b"{\"error\": {\"class\": \"X\"}, \"id\": 1}\n"])),
        ("an event without a name", cat(&[GREETING, b"{\"event\": 17}\n"])),
        ("a second greeting", cat(&[GREETING, GREETING])),
    ];
    for (what, script) in cases {
        match connect(script) {
            Err(QmpError::Garbled(_)) => {}
            other => panic!("{what}: {other:?}"),
        }
    }
}

#[test]
fn an_endless_line_is_refused_with_bounded_memory() {
    let mut script = GREETING.to_vec();
    script.extend(std::iter::repeat_n(b'x', MAX_LINE + 64 * 1024));
    match connect(script) {
        Err(QmpError::Garbled(why)) => assert!(why.contains("longer than"), "{why}"),
        other => panic!("{other:?}"),
    }
}

#[test]
fn silence_times_out_and_a_close_is_reported() {
    let started = Instant::now();
    assert!(matches!(connect(Vec::new()), Err(QmpError::Timeout { .. })));
    assert!(started.elapsed() < Duration::from_secs(10));
    let closed = Qmp::connect(fake(GREETING.to_vec(), Duration::ZERO), Duration::from_secs(5));
    assert!(matches!(closed, Err(QmpError::Closed)), "{closed:?}");
}

#[test]
fn random_streams_never_panic() {
    // A small deterministic fuzz: greeting + capabilities, then random lines.
    let mut seed: u64 = 0x9e37_79b9_7f4a_7c15;
    let mut next = || {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed
    };
    let alphabet = b"{}[]\":,0123456789-eE.truefalsnul \\u\n\x00\xff idreturnerrorclassdescevent";
    for _ in 0..200 {
        let len = (next() % 300) as usize;
        let body: Vec<u8> = (0..len).map(|_| alphabet[(next() % alphabet.len() as u64) as usize]).collect();
        let script = cat(&[GREETING, CAPS_OK, &body, b"\n"]);
        if let Ok(mut q) = Qmp::connect(fake(script, Duration::from_millis(300)), Duration::from_millis(100)) {
            let _ = q.execute("query-status", Value::Null);
            let _ = q.poll_events();
            let _ = q.drain_events();
        }
    }
}
