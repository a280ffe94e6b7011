//! `fido broker --policy`: a bad policy file refuses to start with a clear
//! message (and binds nothing); a good one is used (`fido status` may join
//! under it, and a rule that forbids it makes `fido status` fail with Denied).

use std::path::Path;
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

const FIDO: &str = env!("CARGO_BIN_EXE_fido");

fn broker(dir: &Path, policy: &Path) -> Command {
    let mut c = Command::new(FIDO);
    c.args(["broker", "--heartbeat-ms", "100", "--policy"])
        .arg(policy)
        .arg("--socket")
        .arg(dir.join("run/broker.sock"))
        .arg("--state-dir")
        .arg(dir.join("state"))
        .env_remove("RUST_LOG")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    c
}

fn wait_exit(mut child: Child, limit: Duration) -> Output {
    let end = Instant::now() + limit;
    while child.try_wait().unwrap().is_none() {
        if Instant::now() > end {
            let _ = child.kill();
            panic!("`fido broker` still running after {limit:?}");
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    child.wait_with_output().unwrap()
}

#[test]
fn invalid_policy_is_refused_at_startup() {
    let dir = tempfile::tempdir().unwrap();
    let cases = [
        ("syntax.toml", "[[rule]]\nuids = [1,\n", "line 2"),
        ("field.toml", "[[rule]]\nuid = [1]\n", "unknown field `uid`"),
        (
            "user.toml",
            "[[rule]]\nusers = [\"no-such-user-fido\"]\n",
            "does not exist",
        ),
        (
            "size.toml",
            "[defaults]\narena_bytes = \"big\"\n",
            "not a size",
        ),
    ];
    for (name, text, needle) in cases {
        let path = dir.path().join(name);
        std::fs::write(&path, text).unwrap();
        let child = broker(dir.path(), &path).spawn().unwrap();
        let out = wait_exit(child, Duration::from_secs(10));
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{name}: started anyway");
        assert!(err.contains("refusing to start"), "{name}: {err}");
        assert!(err.contains(name), "{name}: the file is named: {err}");
        assert!(err.contains(needle), "{name}: {needle:?} in {err}");
        assert!(
            !dir.path().join("run/broker.sock").exists(),
            "{name}: bound anyway"
        );
    }
    let missing = dir.path().join("missing.toml");
    let out = wait_exit(
        broker(dir.path(), &missing).spawn().unwrap(),
        Duration::from_secs(10),
    );
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("missing.toml"));
}

fn status_with(dir: &Path, policy_text: &str) -> (Output, String) {
    let path = dir.join("policy.toml");
    std::fs::write(&path, policy_text).unwrap();
    let sock = dir.join("run/broker.sock");
    let mut child = broker(dir, &path).spawn().unwrap();
    let t = Instant::now();
    while !sock.exists() {
        assert!(t.elapsed() < Duration::from_secs(10), "broker never bound");
        assert!(child.try_wait().unwrap().is_none(), "broker exited early");
        std::thread::sleep(Duration::from_millis(10));
    }
    let status = Command::new(FIDO)
        .args(["status", "--json", "--socket"])
        .arg(&sock)
        .stdin(Stdio::null())
        .output()
        .unwrap();
    let _ = rustix::process::kill_process(
        rustix::process::Pid::from_raw(child.id() as i32).unwrap(),
        rustix::process::Signal::TERM,
    );
    let out = wait_exit(child, Duration::from_secs(10));
    assert!(out.status.success(), "broker exit");
    (status, String::from_utf8_lossy(&out.stderr).into_owned())
}

#[test]
fn valid_policy_is_applied() {
    let me = rustix::process::geteuid().as_raw();
    let dir = tempfile::tempdir().unwrap();
    let (status, log) = status_with(
        dir.path(),
        &format!("[[rule]]\nname = \"me\"\nuids = [{me}]\n"),
    );
    assert!(
        status.status.success(),
        "{}",
        String::from_utf8_lossy(&status.stderr)
    );
    assert!(log.contains("(1 rules)"), "{log}");

    let dir = tempfile::tempdir().unwrap();
    let (status, _log) = status_with(
        dir.path(),
        &format!("[[rule]]\nname = \"nope\"\nuids = [{me}]\njoin = false\n"),
    );
    assert!(!status.status.success());
    let err = String::from_utf8_lossy(&status.stderr);
    assert!(err.contains("join = false"), "{err}");
}

/// SIGHUP reloads the policy file: a file that does not load is refused and
/// the running policy stays; a valid one takes effect for the next join.
#[test]
fn sighup_reloads_the_policy_and_keeps_it_when_the_file_is_bad() {
    let me = rustix::process::geteuid().as_raw();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("policy.toml");
    std::fs::write(&path, format!("[[rule]]\nname = \"me\"\nuids = [{me}]\n")).unwrap();
    let sock = dir.path().join("run/broker.sock");
    let mut child = broker(dir.path(), &path).spawn().unwrap();
    let t = Instant::now();
    while !sock.exists() {
        assert!(t.elapsed() < Duration::from_secs(10), "broker never bound");
        assert!(child.try_wait().unwrap().is_none(), "broker exited early");
        std::thread::sleep(Duration::from_millis(10));
    }
    let pid = rustix::process::Pid::from_raw(child.id() as i32).unwrap();
    let status_ok = || {
        Command::new(FIDO)
            .args(["status", "--json", "--socket"])
            .arg(&sock)
            .stdin(Stdio::null())
            .output()
            .unwrap()
    };
    assert!(status_ok().status.success());
    // Reload only acts when the signal has been handled: poll for the effect.
    let until = |want_ok: bool| {
        let t = Instant::now();
        loop {
            let out = status_ok();
            if out.status.success() == want_ok {
                return out;
            }
            assert!(t.elapsed() < Duration::from_secs(10), "policy reload had no effect");
            std::thread::sleep(Duration::from_millis(50));
        }
    };
    // A broken file: refused, the old policy stays (status still joins).
    std::fs::write(&path, "[[rule]]\nuids = [1,\n").unwrap();
    rustix::process::kill_process(pid, rustix::process::Signal::HUP).unwrap();
    std::thread::sleep(Duration::from_millis(300));
    assert!(status_ok().status.success(), "a bad file must not change the policy");
    // A valid, stricter file: the next join is denied.
    std::fs::write(&path, format!("[[rule]]\nname = \"closed\"\nuids = [{me}]\njoin = false\n")).unwrap();
    rustix::process::kill_process(pid, rustix::process::Signal::HUP).unwrap();
    let denied = until(false);
    assert!(String::from_utf8_lossy(&denied.stderr).contains("join = false"));
    rustix::process::kill_process(pid, rustix::process::Signal::TERM).unwrap();
    let out = wait_exit(child, Duration::from_secs(10));
    assert!(out.status.success(), "broker exit");
    let log = String::from_utf8_lossy(&out.stderr);
    assert!(log.contains("policy reload refused"), "{log}");
    assert!(log.contains("reloading policy"), "{log}");
}
