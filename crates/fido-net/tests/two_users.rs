//! `fido run` for two unprivileged users under the policy of issue #16 (each
//! may write `/app/<user>/**` and `/net/**`, nothing else is said about
//! reading): a user's own client and server are accelerated — the broker
//! lets each read the listener keys everyone publishes and the requests and
//! statistics its own uid wrote — and another user's client stays on plain
//! TCP. Needs root (to run the programs as the two users); without it the
//! test prints why and passes vacuously.

use std::os::unix::fs::PermissionsExt;
use std::process::{Command, Stdio};
use std::time::Duration;

use fido_test_support::mmnet::*;
use fido_test_support::users::{test_user, User};
use fido_test_support::wait::*;

fn fido() -> std::path::PathBuf {
    library().parent().unwrap().join("fido")
}

fn policy() -> String {
    let rule = |user: &str| {
        format!(
            "[[rule]]\nname = \"{user}\"\nusers = [\"{user}\"]\n\
             registry_write = [\"/app/{user}/**\", \"/net/**\"]\n"
        )
    };
    format!(
        "{}{}[[rule]]\nname = \"admin\"\nuids = [0]\nregistry_write = [\"/**\"]\n",
        rule("fido-qa-alice"),
        rule("fido-qa-bob")
    )
}

/// `fido run -- echo ARGS` as `user`.
fn run_as(b: &Broker, user: User, echo: &std::path::Path, args: &[&str]) -> Command {
    let mut c = Command::new("setpriv");
    c.args([
        &format!("--reuid={}", user.uid),
        &format!("--regid={}", user.gid),
        "--clear-groups",
        "--",
    ])
    .arg(fido())
    .arg("run")
    .arg("--socket")
    .arg(&b.socket)
    .arg("--")
    .arg(echo)
    .args(args)
    .env_remove("LD_PRELOAD")
    .env("FIDO_NET_ATTACH_MS", "10000");
    c
}

#[test]
fn two_users_each_accelerate_their_own_connections_only() {
    let (Some(alice), Some(bob)) = (test_user("fido-qa-alice"), test_user("fido-qa-bob")) else {
        return;
    };
    let b = Broker::start_with_policy(Some(&policy()));
    // The users reach the socket (and the program) through the test's directory.
    std::fs::set_permissions(b.dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let echo = b.dir.path().join("echo");
    compile_c("echo.c", &echo, &[]);
    let port = free_port().to_string();
    let mut s = run_as(&b, alice, &echo, &["server", &port]);
    s.stdout(Stdio::null());
    let _s = Guard(s.spawn().unwrap());
    wait_port(port.parse().unwrap());
    b.wait_listener(port.parse().unwrap());

    // Alice's client: her own server, accelerated on both ends.
    let c = run_as(&b, alice, &echo, &["client", &port, "200000"]);
    assert_eq!(run_ok(c, Duration::from_secs(60)).trim(), "ok 200000");
    let (n, sent, recv) = b.wait_accelerated("echo", 2);
    assert_eq!(n, 2, "{:?}", b.stats());
    assert!(sent >= 400_000 && recv >= 400_000, "{sent}/{recv}");

    // Bob's client: another uid, plain TCP, nothing more accelerated.
    let c = run_as(&b, bob, &echo, &["client", &port, "100000"]);
    assert_eq!(run_ok(c, Duration::from_secs(60)).trim(), "ok 100000");
    std::thread::sleep(Duration::from_millis(500));
    assert_eq!(b.accelerated("echo").0, 2, "{:?}", b.stats());
}
