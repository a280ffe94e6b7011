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
