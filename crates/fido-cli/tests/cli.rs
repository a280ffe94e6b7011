//! End-to-end tests of the `fido` binary: the demo passes and leaves nothing
//! behind, and `fido status` sees a `fido broker`.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use fido_test_support::wait::run_limited;

const FIDO: &str = env!("CARGO_BIN_EXE_fido");

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

/// Pids of live processes whose environment names `parent` as their spawner
/// (every helper of the demo and of the bench gets one of these variables).
fn helpers_of(parent: u32) -> Vec<u32> {
    let needles = [
        format!("FIDO_CLI_PARENT={parent}"),
        format!("FIDO_BENCH_PARENT={parent}"),
    ];
    let mut out = Vec::new();
    for e in std::fs::read_dir("/proc").unwrap().flatten() {
        let Some(pid) = e.file_name().to_str().and_then(|s| s.parse::<u32>().ok()) else {
            continue;
        };
        let Ok(env) = std::fs::read(e.path().join("environ")) else {
            continue;
        };
        if env
            .split(|b| *b == 0)
            .any(|v| needles.iter().any(|n| v == n.as_bytes()))
        {
            out.push(pid);
        }
    }
    out
}

fn alive_with_cmdline(pid: u32, needle: &str) -> bool {
    std::fs::read(format!("/proc/{pid}/cmdline")).is_ok_and(|c| text(&c).contains(needle))
}

#[test]
fn demo_passes_and_leaves_nothing_behind() {
    let dir = tempfile::tempdir().unwrap();
    let tmp = dir.path().join("tmp");
    std::fs::create_dir(&tmp).unwrap();
    let mut cmd = Command::new(FIDO);
    cmd.args(["demo", "--seconds", "1"])
        // No broker there: the demo must start (and remove) its own.
        .env("FIDO_BROKER", dir.path().join("no-broker/broker.sock"))
        .env("TMPDIR", &tmp)
        .env_remove("RUST_LOG");
    let child_start = Instant::now();
    let (out, demo_pid) = run_limited(&mut cmd, Duration::from_secs(45));
    let stdout = text(&out.stdout);
    let stderr = text(&out.stderr);
    assert!(
        out.status.success(),
        "demo failed ({}):\n{stdout}\n{stderr}",
        out.status
    );
    eprintln!(
        "demo took {:.1} s\n{stdout}",
        child_start.elapsed().as_secs_f64()
    );

    for want in [
        "GB/s at sink",
        "latency p50",
        "uds",
        "fido / uds",
        "[ ok ] pointer unchanged",
        "[ ok ] checksum",
        // Latency is compared at equal queue depth, and the screen says so.
        "sink latency (source→sink), one message in flight",
        "one message in flight, end to end through 3 hops",
        "[ ok ] uds checksum",
        "result: PASS",
    ] {
        assert!(stdout.contains(want), "missing `{want}` in:\n{stdout}");
    }
    assert!(!stdout.contains("FAIL"), "{stdout}");
    // bytes copied is 0 in every fido row (column 7 of the per-domain table).
    for role in ["source", "fwd1", "fwd2", "sink"] {
        let row = stdout
            .lines()
            .find(|l| l.starts_with(&format!("{role} ")))
            .unwrap_or_else(|| panic!("no {role} row"));
        let cols: Vec<&str> = row.split_whitespace().collect();
        assert_eq!(cols[6], "0", "{role} copied bytes: {row}");
    }

    // Every role process is gone (reaped: not even a zombie remains).
    let pids_line = stdout
        .lines()
        .find(|l| l.starts_with("demo pids"))
        .expect("pids line");
    let pids: Vec<u32> = pids_line
        .split(':')
        .nth(1)
        .unwrap()
        .split_whitespace()
        .map(|p| p.parse().unwrap())
        .collect();
    assert_eq!(pids.len(), 4);
    for p in &pids {
        assert!(
            !alive_with_cmdline(*p, "__demo-role"),
            "demo role {p} still exists"
        );
        assert!(
            !Path::new(&format!("/proc/{p}")).exists() || !alive_with_cmdline(*p, "fido"),
            "pid {p} remains"
        );
    }
    // Nothing the demo spawned (fido roles or the uds baseline's peers) is left.
    assert_eq!(
        helpers_of(demo_pid),
        Vec::<u32>::new(),
        "helpers of demo {demo_pid} still alive"
    );
    let broker_line = stdout.lines().find(|l| l.starts_with("broker:")).unwrap();
    assert!(broker_line.contains("embedded"), "{broker_line}");
    // The embedded broker's socket and its temporary directory are removed.
    let sock: PathBuf = broker_line.rsplit("at ").next().unwrap().trim().into();
    assert!(
        sock.starts_with(&tmp),
        "socket {} not under TMPDIR",
        sock.display()
    );
    assert!(!sock.exists(), "socket {} left behind", sock.display());
    assert!(
        !sock.parent().unwrap().exists(),
        "broker directory left behind"
    );
    assert_eq!(
        std::fs::read_dir(&tmp).unwrap().count(),
        0,
        "TMPDIR not empty"
    );
}

#[test]
fn broker_and_status_json() {
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("run/broker.sock");
    let mut broker = Command::new(FIDO)
        .args(["broker", "--heartbeat-ms", "100", "--socket"])
        .arg(&sock)
        .arg("--state-dir")
        .arg(dir.path().join("state"))
        .env_remove("RUST_LOG")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let guard = KillOnDrop(broker.id());
    let t = Instant::now();
    while !sock.exists() {
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "broker never bound {}",
            sock.display()
        );
        assert!(broker.try_wait().unwrap().is_none(), "broker exited early");
        std::thread::sleep(Duration::from_millis(10));
    }

    // `fido status` itself no longer joins (it needs no PGVAS slot): a
    // domain of this test is what it must show, counters and all.
    // The socket file exists from bind(); the broker listens a moment
    // later (a loaded machine showed ECONNREFUSED in between).
    let probe = loop {
        match fido::Domain::join(
            fido::JoinOptions::new("status-probe")
                .broker(&sock)
                .arena_len(1 << 20)
                .ring_entries(2),
        ) {
            Ok(d) => break d,
            Err(fido::Error::BrokerUnavailable(_)) if t.elapsed() < Duration::from_secs(10) => {
                std::thread::sleep(Duration::from_millis(20))
            }
            Err(e) => panic!("joining the broker: {e:?}"),
        }
    };

    // JSON, broker found through FIDO_BROKER.
    let mut cmd = Command::new(FIDO);
    cmd.args(["status", "--json"]).env("FIDO_BROKER", &sock);
    let out = run_limited(&mut cmd, Duration::from_secs(20)).0;
    assert!(out.status.success(), "{}", text(&out.stderr));
    let v: serde_json::Value =
        serde_json::from_slice(&out.stdout).expect("status --json prints JSON");
    assert!(
        v["broker_pid"].as_i64().unwrap() == broker.id() as i64,
        "{v}"
    );
    let domains = v["domains"].as_array().expect("domains");
    let me = domains
        .iter()
        .find(|d| d["name"] == "status-probe" && d["domain"] == probe.id())
        .unwrap_or_else(|| panic!("no status-probe domain in {v}"));
    for k in ["domain", "pid", "slot", "arena_len"] {
        assert!(me[k].is_number(), "{k} in {me}");
    }
    for k in [
        "messages_sent",
        "messages_received",
        "bytes_sent",
        "bytes_received",
        "bytes_copied",
        "doorbells_rung",
        "doorbells_suppressed",
    ] {
        assert!(me["counters"][k].is_u64(), "counter {k} in {me}");
    }
    assert!(
        v["services"].is_array() && v["connections"].is_array(),
        "{v}"
    );

    // Text, broker given with --socket.
    let mut cmd = Command::new(FIDO);
    cmd.args(["status", "--socket"])
        .arg(&sock)
        .env("FIDO_BROKER", dir.path().join("elsewhere.sock"));
    let out = run_limited(&mut cmd, Duration::from_secs(20)).0;
    let s = text(&out.stdout);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(
        s.contains("status-probe")
            && s.contains("services")
            && s.contains("connections"),
        "{s}"
    );

    let _ = probe.leave();
    // SIGTERM: clean shutdown, socket removed.
    let p = rustix::process::Pid::from_raw(broker.id() as i32).unwrap();
    rustix::process::kill_process(p, rustix::process::Signal::TERM).unwrap();
    let t = Instant::now();
    let st = loop {
        if let Some(st) = broker.try_wait().unwrap() {
            break st;
        }
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "broker ignored SIGTERM"
        );
        std::thread::sleep(Duration::from_millis(10));
    };
    std::mem::forget(guard);
    assert!(st.success(), "broker exit {st}");
    assert!(!sock.exists(), "socket left behind");

    // No broker: status fails cleanly.
    let mut cmd = Command::new(FIDO);
    cmd.args(["status", "--json", "--socket"]).arg(&sock);
    let out = run_limited(&mut cmd, Duration::from_secs(20)).0;
    assert!(!out.status.success());
}

struct KillOnDrop(u32);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        if let Some(p) = rustix::process::Pid::from_raw(self.0 as i32) {
            let _ = rustix::process::kill_process(p, rustix::process::Signal::KILL);
        }
    }
}
