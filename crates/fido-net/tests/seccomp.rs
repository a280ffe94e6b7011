//! A program that confines itself with a seccomp filter after its
//! connection was accelerated (sshd's pre-auth child: `tests/c/seccomp.c`
//! installs a filter like OpenSSH's, which kills the process on `sendto`,
//! `recvfrom`, `getsockopt`, `fstat`, `sched_yield`, ...): the library
//! notices the `prctl(PR_SET_SECCOMP)` and from then on uses only the calls
//! the program makes itself (`read`, `write`, `poll`), so 4 rounds of 2 MiB
//! each way — more than the ring holds, so writers wait for space — complete
//! on the ring and the child exits normally. Before, the first doorbell
//! (`sendto`) killed the child with SIGSYS.

use fido_test_support::mmnet::*;
use fido_test_support::wait::*;
use std::process::Stdio;
use std::time::Duration;

const T: Duration = Duration::from_secs(50);

#[test]
fn a_connection_keeps_working_under_the_programs_seccomp_filter() {
    let b = Broker::start();
    let exe = b.dir.path().join("seccomp");
    compile_c("seccomp.c", &exe, &[]);
    let port = free_port();
    let mut srv = b.accel(&exe);
    srv.args(["server", &port.to_string()])
        .stdout(Stdio::piped());
    let mut guard = Guard(srv.spawn().unwrap());
    let mut out = std::io::BufReader::new(guard.0.stdout.take().unwrap());
    let mut line = String::new();
    std::io::BufRead::read_line(&mut out, &mut line).unwrap();
    assert_eq!(line, "listening\n");
    let mut cli = b.accel(&exe);
    cli.args(["client", &port.to_string()]);
    assert_eq!(run_ok(cli, T), "ok\n");
    let mut rest = String::new();
    std::io::Read::read_to_string(&mut out, &mut rest).unwrap();
    assert_eq!(rest, "child ok\n");
    assert!(guard.0.wait().unwrap().success());
    // The conversation ran on the ring: the client's counters hold it.
    let (n, sent, recv) = b.wait_accelerated("seccomp", 2);
    assert_eq!(n, 2, "both ends accelerated");
    let round = 2u64 << 20;
    assert!(
        sent >= 4 * round && recv >= 4 * round,
        "ring bytes: sent {sent} received {recv}"
    );
}

/// The real thing: sshd and ssh, both under the preload, over loopback on
/// a private port (throwaway host and user keys, key authentication as
/// root). sshd hands the accepted socket to a re-executed image, whose
/// pre-auth child confines itself with seccomp; before, that child died of
/// SIGSYS on the first doorbell (`sendto`) and ssh said "Connection reset".
#[test]
fn sshd_and_ssh_both_under_fido() {
    let sshd_path = ["/usr/sbin/sshd", "/usr/bin/sshd"]
        .into_iter()
        .find(|p| std::path::Path::new(p).exists());
    let Some(sshd_path) = sshd_path.filter(|_| have("ssh") && have("ssh-keygen")) else {
        eprintln!(
            "SKIP: openssh-server/openssh-client not installed (scripts/install-test-deps.sh)"
        );
        return;
    };
    assert!(rustix::process::geteuid().is_root(), "sshd needs root");
    let b = Broker::start();
    let d = b.dir.path();
    for k in ["host", "user"] {
        let st = std::process::Command::new("ssh-keygen")
            .args(["-q", "-t", "ed25519", "-N", "", "-f"])
            .arg(d.join(k))
            .status()
            .unwrap();
        assert!(st.success(), "ssh-keygen");
    }
    std::fs::copy(d.join("user.pub"), d.join("authorized_keys")).unwrap();
    std::fs::create_dir_all("/run/sshd").unwrap(); // privilege separation directory
    let port = free_port();
    let config = d.join("sshd_config");
    std::fs::write(
        &config,
        format!(
            "Port {port}\nListenAddress 127.0.0.1\nHostKey {h}\nAuthorizedKeysFile {a}\n\
             StrictModes no\nPidFile none\nUsePAM no\nPasswordAuthentication no\n\
             KbdInteractiveAuthentication no\nPermitRootLogin prohibit-password\n",
            h = d.join("host").display(),
            a = d.join("authorized_keys").display()
        ),
    )
    .unwrap();
    let mut sshd = b.accel(sshd_path);
    // sshd's log (shown if ssh fails).
    let log_path = d.join("sshd.log");
    let log_file = std::fs::File::create(&log_path).unwrap();
    sshd.arg("-D")
        .arg("-e")
        .arg("-f")
        .arg(&config)
        .stdout(Stdio::null())
        .stderr(log_file);
    let _sshd = Guard(sshd.spawn().unwrap());
    let log = || std::fs::read_to_string(&log_path).unwrap_or_default();
    wait_port(port);
    let ssh = |remote: &str, input: Option<&std::path::Path>| {
        let mut c = b.accel("ssh");
        c.args(["-p", &port.to_string(), "-i"])
            .arg(d.join("user"))
            .args([
                "-o",
                "StrictHostKeyChecking=no",
                "-o",
                "UserKnownHostsFile=/dev/null",
                "-o",
                "BatchMode=yes",
                "-o",
                "LogLevel=ERROR",
                "root@127.0.0.1",
                remote,
            ]);
        if let Some(f) = input {
            c.stdin(std::fs::File::open(f).unwrap());
        }
        std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| run_ok(c, T)))
            .unwrap_or_else(|_| panic!("ssh {remote} failed\nsshd:\n{}", log()))
    };
    assert_eq!(ssh("echo hi", None), "hi\n");
    // A few MiB through the encrypted channel, checked on the other side.
    let blob = d.join("blob");
    let data: Vec<u8> = (0..4u32 << 20)
        .map(|i| (i.wrapping_mul(2654435761) >> 13) as u8)
        .collect();
    std::fs::write(&blob, &data).unwrap();
    let want = std::process::Command::new("sha256sum")
        .arg(&blob)
        .output()
        .unwrap();
    let want = String::from_utf8_lossy(&want.stdout)
        .split(' ')
        .next()
        .unwrap()
        .to_string();
    // Several times: the pre-auth child (under the filter, its connection
    // eager since it crossed sshd's re-exec) used to sleep in poll now and
    // then with the client's request in its ring, its doorbell read off the
    // socket and held where the kernel's poll could not see it (1 ssh in 2
    // to 4 hung).
    const RUNS: u64 = 4;
    for _ in 0..RUNS {
        let got = ssh("sha256sum", Some(&blob));
        assert_eq!(got.split(' ').next().unwrap(), want, "sha256 of 4 MiB through ssh");
    }
    // Accelerated: the ssh clients count their connections as such.
    let (n, sent, _) = b.wait_accelerated("ssh", 1 + RUNS);
    assert_eq!(n, 1 + RUNS, "every ssh connection accelerated: {n}");
    assert!(
        sent >= 4 << 20,
        "the upload went through the ring: {sent} bytes"
    );
}
