//! `fido-bench chaos --seconds 20 --seed 50`: domains and the broker killed (-9) and
//! restarted at random under load. The run must pass its own checks and its
//! JSON records must show no corrupted, silently duplicated or silently lost
//! message and no leak (invariant 4, docs/ARCHITECTURE.md §3.4).

use std::collections::HashMap;
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

const FIDO: &str = env!("CARGO_BIN_EXE_fido-bench");

#[test]
fn chaos_20s_no_corruption_no_silent_loss_no_leak() {
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("chaos.json");
    let logs = dir.path().join("logs");
    // A fixed seed fixes the kill schedule (victims, pauses, intervals; process
    // timing still varies): seed 50 kills, in 20 s, the broker twice, srcB, a
    // forwarder and both sinks among others. FIDO_CHAOS_SEED explores others.
    let seed = std::env::var("FIDO_CHAOS_SEED").unwrap_or_else(|_| "50".into());
    let mut cmd = Command::new(FIDO);
    cmd.args([
        "chaos",
        "--seconds",
        "20",
        "--seed",
        &seed,
        "--json",
    ])
    .arg(&json)
    .arg("--log-dir")
    .arg(&logs)
    .stdin(Stdio::null())
    .stdout(Stdio::piped())
    .stderr(Stdio::piped());
    let child = cmd.spawn().expect("spawn fido-bench chaos");
    let pid = child.id() as i32;
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(child.wait_with_output());
    });
    // 20 s of chaos + start-up, drain and checks; CI budget is 2 minutes.
    let out = match rx.recv_timeout(Duration::from_secs(110)) {
        Ok(o) => o.expect("wait"),
        Err(_) => {
            if let Some(p) = rustix::process::Pid::from_raw(pid) {
                let _ = rustix::process::kill_process(p, rustix::process::Signal::KILL);
            }
            panic!("`fido-bench chaos --seconds 20` did not finish within 110 s (a hang?)");
        }
    };
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    let timeline = std::fs::read_to_string(logs.join("driver.log")).unwrap_or_default();
    let problems: Vec<&str> = timeline
        .lines()
        .filter(|l| l.contains("PROBLEM"))
        .take(30)
        .collect();
    let report = format!(
        "--- stdout\n{stdout}\n--- stderr (tail)\n{}\n--- first problems in driver.log\n{}",
        stderr
            .lines()
            .rev()
            .take(40)
            .collect::<Vec<_>>()
            .into_iter()
            .rev()
            .collect::<Vec<_>>()
            .join("\n"),
        problems.join("\n")
    );

    let records: HashMap<String, f64> = std::fs::read_to_string(&json)
        .unwrap_or_default()
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .map(|v| {
            assert_eq!(v["suite"], "chaos", "{v}");
            assert_eq!(v["system"], "fido", "{v}");
            for k in ["metric", "unit", "n"] {
                assert!(v.get(k).is_some(), "record without {k}: {v}");
            }
            (
                v["case"].as_str().unwrap_or_default().to_string(),
                v["value"].as_f64().unwrap_or(f64::NAN),
            )
        })
        .collect();
    let get = |case: &str| -> f64 {
        *records
            .get(case)
            .unwrap_or_else(|| panic!("no `{case}` record in {}\n{report}", json.display()))
    };

    // Something was measured.
    assert!(get("messages") > 0.0, "no messages\n{report}");
    assert!(get("delivered") > 0.0, "nothing delivered\n{report}");
    assert!(get("kills") > 0.0, "nothing was killed\n{report}");
    // The guarantee: never corrupted, never silently duplicated or lost.
    for case in [
        "corrupted",
        "duplicated-silent",
        "lost-silent",
        "undrained",
        "inconsistent-reports",
        "protocol-errors",
        "unexpected-exits",
        "stalls",
        "drain-timeouts",
        "bad-exits",
        // Nothing left behind.
        "leaked-fds",
        "leaked-memfds",
        "stale-mappings",
        "leaked-shm",
        "leaked-processes",
        "leaked-broker-state",
        "leaked-state-files",
    ] {
        assert_eq!(
            get(case),
            0.0,
            "`{case}` is {} (must be 0)\n{report}",
            get(case)
        );
    }
    assert!(
        out.status.success(),
        "fido-bench chaos failed: {}\n{report}",
        out.status
    );
    assert!(stdout.contains("all checks passed"), "{report}");
}
