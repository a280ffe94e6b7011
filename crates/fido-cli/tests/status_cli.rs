//! `fido status` against what issue #16 found (finding 14): the broker's
//! real answer is printed (not "no broker at …"), a reader that goes away
//! (`fido status | head`) ends it quietly, and another user's `fido status`
//! shows only what that user may see.

use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::process::{Command, Output, Stdio};
use std::sync::Arc;
use std::time::Duration;

use fido_test_support::users::test_user;
use fido_test_support::wait::run_limited;
use fido_test_support::Defaults;

const FIDO: &str = env!("CARGO_BIN_EXE_fido");

type TestBroker = fido_test_support::TestBroker<Defaults>;

/// An in-process broker under `policy` (none: the default, this uid only),
/// its socket reachable by other uids.
fn broker(policy: Option<&str>) -> TestBroker {
    TestBroker::start_with(|c| {
        if let Some(p) = policy {
            c.policy = Arc::new(fido_broker::Policy::parse(p, "test-policy").unwrap());
        }
        let top = c.socket.parent().unwrap().parent().unwrap();
        std::fs::set_permissions(top, std::fs::Permissions::from_mode(0o755)).unwrap();
    })
}

fn status(socket: &Path, json: bool, stdout: Stdio) -> Output {
    let mut cmd = Command::new(FIDO);
    cmd.arg("status");
    if json {
        cmd.arg("--json");
    }
    cmd.arg("--socket")
        .arg(socket)
        .env_remove("RUST_LOG")
        .stdin(Stdio::null())
        .stdout(stdout)
        .stderr(Stdio::piped());
    // `output` keeps the stdout given (a closed pipe, for one test).
    cmd.output().expect("running fido status")
}

/// On d54ab9b: `fido: no broker at …: Denied: …` — the broker was there
/// and answered; now its answer is what is printed.
#[test]
fn status_prints_the_brokers_refusal_not_no_broker() {
    let me = rustix::process::geteuid().as_raw();
    let b = broker(Some(&format!(
        "[[rule]]\nname = \"nope\"\nuids = [{me}]\njoin = false\n"
    )));
    let out = status(&b.socket, false, Stdio::piped());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{err}");
    assert!(
        err.contains("Denied") && err.contains("join = false"),
        "{err}"
    );
    assert!(!err.contains("no broker at"), "{err}");

    // Where there is no broker, that is what it says.
    let out = status(&b.dir.path().join("nothing.sock"), false, Stdio::piped());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("no broker at"),
        "{err}"
    );
}

/// On d54ab9b `fido status | head` panicked ("failed printing to stdout:
/// Broken pipe", exit 101). A reader that has gone now ends it quietly.
#[test]
fn status_into_a_closed_pipe_exits_quietly() {
    let b = broker(None);
    for json in [false, true] {
        let (read, write) = rustix::pipe::pipe().unwrap();
        drop(read);
        let out = status(&b.socket, json, Stdio::from(write));
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "json {json}: {:?} {err}", out.status);
        assert!(!err.contains("panicked"), "json {json}: {err}");
    }
}

/// Finding 14 (c) through the CLI: on d54ab9b another user's `fido status`
/// listed root's domains and services. Now it shows its own uid's domains
/// and the services its rule names, and root's shows everyone's.
#[test]
fn another_users_status_shows_only_its_own() {
    let Some(alice) = test_user("fido-qa-alice") else {
        return;
    };
    let b = broker(Some(
        "[[rule]]\nname = \"alice\"\nusers = [\"fido-qa-alice\"]\noffer = [\"alice-*\"]\n\
         connect = [\"alice-*\"]\nregistry_write = [\"/app/fido-qa-alice/**\", \"/net/**\"]\n\
         [[rule]]\nname = \"admin\"\nuids = [0]\noffer = [\"*\"]\nconnect = [\"*\"]\n\
         registry_write = [\"/**\"]\n",
    ));
    let join = |name: &str| {
        fido::Domain::join(
            fido::JoinOptions::new(name)
                .broker(&b.socket)
                .arena_len(1 << 20)
                .ring_entries(2),
        )
        .expect("joining")
    };
    let root_domain = join("root-secret-app");
    let _listener = root_domain.offer("root-secret-svc").unwrap();

    let mut cmd = Command::new("setpriv");
    cmd.args([
        &format!("--reuid={}", alice.uid),
        &format!("--regid={}", alice.gid),
        "--clear-groups",
        FIDO,
        "status",
        "--json",
        "--socket",
    ])
    .arg(&b.socket)
    .env_remove("RUST_LOG")
    .stdin(Stdio::null());
    let out = run_limited(&mut cmd, Duration::from_secs(30)).0;
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    assert!(!text.contains("root-secret"), "alice sees root's: {text}");
    assert!(v["domains"].as_array().unwrap().is_empty(), "{v}");

    let out = status(&b.socket, true, Stdio::piped());
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("root-secret-app") && text.contains("root-secret-svc"),
        "{text}"
    );
    drop(root_domain);
}

/// `fido demo | head`: on d54ab9b the demo panicked at its first line once
/// the reader had gone. Now it runs to the end (and cleans up) quietly.
#[test]
fn demo_into_a_closed_pipe_runs_to_the_end() {
    let dir = tempfile::tempdir().unwrap();
    let (read, write) = rustix::pipe::pipe().unwrap();
    drop(read);
    let mut cmd = Command::new(FIDO);
    cmd.args(["demo", "--seconds", "1"])
        .env("FIDO_BROKER", dir.path().join("no-broker/broker.sock"))
        .env("TMPDIR", dir.path())
        .env_remove("RUST_LOG")
        .stdin(Stdio::null())
        .stdout(Stdio::from(write))
        .stderr(Stdio::piped());
    let out = cmd.output().expect("running fido demo");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{:?} {err}", out.status);
    assert!(!err.contains("panicked"), "{err}");
}
