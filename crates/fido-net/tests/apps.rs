//! The programs of issue #19 (people's real servers and clients, Debian
//! packages, unmodified) with both ends under the preload: each is started
//! once, its own results are checked (values read back, sha256 of what went
//! through, CHECKSUM TABLE, HTTP bodies) and every client runs under a
//! deadline, so a hang is a failure, never a stuck CI job. Where the program
//! is expected to be accelerated the library's statistics must say so.
//!
//! On d54ab9b, sshd+ssh (seccomp killed sshd's pre-auth child over the
//! doorbell's `sendto`), node + a plain curl after an accelerated one
//! (`syscall(SYS_close)` left stale state) and node's `cluster` (accepted
//! sockets passed with `SCM_RIGHTS`) failed here.
//! Packages: memcached libmemcached-tools mariadb-server sysbench
//! openssh-server openssh-client nodejs curl socat ncat
//! (scripts/install-test-deps.sh).

use fido_test_support::mmnet::*;
use fido_test_support::child::ChildProc;
use fido_test_support::bytes::pattern;
use fido_test_support::wait::*;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// Per client run: generous for a loaded 2-core machine, far below CI's limit.
const T: Duration = Duration::from_secs(30);

fn require(progs: &[&str]) {
    for p in progs {
        assert!(have(p), "{p} is not installed: run scripts/install-test-deps.sh");
    }
}

fn spawn_logged(mut c: Command, log: &Path) -> Guard {
    let f = std::fs::File::create(log).unwrap();
    c.stdin(Stdio::null()).stdout(f.try_clone().unwrap()).stderr(f);
    Guard(c.spawn().unwrap_or_else(|e| panic!("starting {c:?}: {e}")))
}

/// Starts `c` with its stdout into the file `out`.
fn spawn_to_file(mut c: Command, out: &Path) -> Guard {
    c.stdin(Stdio::null()).stdout(std::fs::File::create(out).unwrap()).stderr(Stdio::null());
    Guard(c.spawn().unwrap_or_else(|e| panic!("starting {c:?}: {e}")))
}

/// Waits until a started program exits by itself (panics after `timeout`:
/// a hang; the guard then stops it).
fn wait_exit(mut g: Guard, timeout: Duration) {
    let deadline = Instant::now() + timeout;
    while g.0.try_wait().unwrap().is_none() {
        assert!(Instant::now() < deadline, "server did not exit within {timeout:?} (a hang)");
        std::thread::sleep(Duration::from_millis(20));
    }
}


fn sha256_file(p: &Path) -> String {
    let out = Command::new("sha256sum").arg(p).output().unwrap();
    String::from_utf8(out.stdout).unwrap().split_whitespace().next().unwrap().to_string()
}

/// Runs `c` (stdin from `input`, else empty) to completion under `timeout`
/// and returns its output; its output is read while it runs (a client that
/// prints more than a pipe holds must not block). Kills it and panics after
/// `timeout`.
fn run_bounded(mut c: Command, input: Option<&Path>, timeout: Duration) -> std::process::Output {
    match input {
        Some(p) => c.stdin(std::fs::File::open(p).unwrap()),
        None => c.stdin(Stdio::null()),
    };
    let child = c
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("spawning {c:?}: {e}"));
    let pid = child.id() as i32;
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(child.wait_with_output());
    });
    match rx.recv_timeout(timeout) {
        Ok(out) => out.expect("collecting the child's output"),
        Err(_) => {
            if let Some(p) = rustix::process::Pid::from_raw(pid) {
                let _ = rustix::process::kill_process(p, rustix::process::Signal::KILL);
            }
            panic!("{c:?} did not finish within {timeout:?} (a hang)");
        }
    }
}

/// [`run_bounded`], which must succeed; returns its stdout.
fn run_checked(c: Command, input: Option<&Path>, timeout: Duration) -> String {
    let what = format!("{c:?}");
    let out = run_bounded(c, input, timeout);
    assert!(
        out.status.success(),
        "{what} failed: {:?}\nstdout:\n{}\nstderr:\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Runs `c` with `input` as stdin under the deadline.
fn run_with_stdin(c: Command, input: &Path, timeout: Duration) -> String {
    run_checked(c, Some(input), timeout)
}

#[test]
fn memcached_values_round_trip_and_memcslap() {
    require(&["memcached", "memccp", "memccat", "memcslap"]);
    let b = Broker::start();
    let dir = b.dir.path();
    let port = free_port();
    let mut srv = b.accel("memcached");
    srv.args(["-u", "root", "-U", "0", "-I", "2m", "-l", "127.0.0.1", "-p", &port.to_string()]);
    let _srv = spawn_logged(srv, &dir.join("memcached.log"));
    wait_port(port);
    let servers = format!("--servers=127.0.0.1:{port}");
    // Values of 0 B to 1 MiB, stored and read back under fido run, and read
    // back over plain TCP too: the same bytes reached memcached.
    for (i, len) in [0usize, 1, 1000, 100_000, 1 << 20].into_iter().enumerate() {
        let name = format!("value{i}");
        std::fs::write(dir.join(&name), pattern(len, i as u64 + 7)).unwrap();
        let mut cp = b.accel("memccp");
        cp.arg(&servers).arg(dir.join(&name));
        run_checked(cp, None, T);
        let get = |accel: bool| {
            let mut c = if accel { b.accel("memccat") } else { Command::new("memccat") };
            c.arg(&servers).arg(&name);
            let out = run_bounded(c, None, T);
            assert!(out.status.success(), "memccat {name}: {out:?}");
            out.stdout
        };
        let fido = get(true);
        let want = std::fs::read(dir.join(&name)).unwrap();
        // memccat prints the value and a newline.
        assert_eq!(fido.len(), len + 1, "{name}");
        assert!(fido[..len] == want[..], "{name}: value differs");
        assert!(get(false) == fido, "{name}: plain read differs");
    }
    let mut slap = b.accel("memcslap");
    slap.args([&servers, "--concurrency=4", "--execute-number=500", "--binary"]);
    let out = run_checked(slap, None, T);
    assert!(out.contains("Time total"), "{out}");
    let (n, _, recv) = b.wait_accelerated("memcached", 10);
    assert!(n >= 10 && recv > 1 << 20, "memcached accelerated {n}, received {recv}: {:?}", b.stats());
}

#[test]
fn mariadb_sysbench_and_checksum_table() {
    require(&["mariadbd", "mariadb-install-db", "mariadb", "sysbench"]);
    let b = Broker::start();
    let dir = b.dir.path();
    let data = dir.join("data");
    let mut init = Command::new("mariadb-install-db");
    init.args(["--no-defaults", "--user=root", "--auth-root-authentication-method=normal", "--skip-test-db"])
        .arg(format!("--datadir={}", data.display()));
    run_checked(init, None, Duration::from_secs(120));
    let port = free_port();
    let mut srv = b.accel("mariadbd");
    srv.args([
        "--no-defaults",
        "--user=root",
        "--bind-address=127.0.0.1",
        "--skip-grant-tables",
        "--skip-log-bin",
        "--innodb-buffer-pool-size=32M",
        "--innodb-log-file-size=16M",
        &format!("--port={port}"),
    ])
    .arg(format!("--datadir={}", data.display()))
    .arg(format!("--socket={}", dir.join("mysql.sock").display()));
    let _srv = spawn_logged(srv, &dir.join("mariadbd.log"));
    wait_port(port);
    let p = port.to_string();
    let sql = |q: &str, accel: bool| {
        let mut c = if accel { b.accel("mariadb") } else { Command::new("mariadb") };
        c.args(["--no-defaults", "-h127.0.0.1", "-uroot", "-N", "-B", "-P", &p, "-e", q]);
        run_checked(c, None, T)
    };
    sql("CREATE DATABASE sbtest", true);
    let sysbench = |cmd: &str| {
        let mut c = b.accel("sysbench");
        c.args([
            "oltp_read_only",
            "--db-driver=mysql",
            "--mysql-host=127.0.0.1",
            "--mysql-user=root",
            "--tables=2",
            "--table-size=1000",
            "--threads=4",
            "--time=2",
            "--rand-seed=1",
        ])
        .arg(format!("--mysql-port={port}"))
        .arg(cmd);
        run_checked(c, None, Duration::from_secs(60))
    };
    sysbench("prepare");
    let out = sysbench("run");
    assert!(out.contains("ignored errors:                      0"), "{out}");
    let tx: u64 = out
        .lines()
        .find(|l| l.trim_start().starts_with("transactions:"))
        .and_then(|l| l.split_whitespace().nth(1)?.parse().ok())
        .unwrap_or(0);
    assert!(tx > 0, "{out}");
    // What sysbench prepared (its INSERTs went through MMNet) reads back the
    // same with and without MMNet.
    let q = "CHECKSUM TABLE sbtest.sbtest1, sbtest.sbtest2; SELECT COUNT(*), SUM(k), MD5(GROUP_CONCAT(c ORDER BY id)) FROM sbtest.sbtest1";
    let fido = sql(q, true);
    assert_eq!(fido, sql(q, false));
    assert!(fido.lines().count() == 3, "{fido}");
    let (n, sent, _) = b.wait_accelerated("mariadbd", 5);
    assert!(n >= 5 && sent > 10_000, "mariadbd accelerated {n}, sent {sent}: {:?}", b.stats());
}

#[test]
fn sshd_and_ssh_both_under_fido_run() {
    require(&["/usr/sbin/sshd", "ssh", "ssh-keygen"]);
    let b = Broker::start();
    let dir = b.dir.path();
    for key in ["host", "user"] {
        let mut k = Command::new("ssh-keygen");
        k.args(["-q", "-t", "ed25519", "-N", "", "-f"]).arg(dir.join(key));
        run_checked(k, None, T);
    }
    std::fs::copy(dir.join("user.pub"), dir.join("authorized_keys")).unwrap();
    // sshd's privilege separation directory (the package creates it at boot).
    std::fs::create_dir_all("/run/sshd").unwrap();
    let port = free_port();
    let d = dir.display();
    std::fs::write(
        dir.join("sshd_config"),
        format!(
            "Port {port}\nListenAddress 127.0.0.1\nHostKey {d}/host\nAuthorizedKeysFile {d}/authorized_keys\n\
             PidFile {d}/sshd.pid\nPermitRootLogin prohibit-password\nPasswordAuthentication no\n\
             KbdInteractiveAuthentication no\nUsePAM no\nStrictModes no\n"
        ),
    )
    .unwrap();
    let mut srv = b.accel("/usr/sbin/sshd");
    srv.args(["-D", "-e", "-f"]).arg(dir.join("sshd_config"));
    let _srv = spawn_logged(srv, &dir.join("sshd.log"));
    wait_port(port);
    let input = dir.join("in");
    std::fs::write(&input, pattern(8 << 20, 3)).unwrap();
    let want = sha256_file(&input);
    for accel in [true, false] {
        let mut c = if accel { b.accel("ssh") } else { Command::new("ssh") };
        c.args([
            "-o",
            "StrictHostKeyChecking=no",
            "-o",
            "UserKnownHostsFile=/dev/null",
            "-o",
            "BatchMode=yes",
            "-o",
            "LogLevel=ERROR",
            "-p",
            &port.to_string(),
            "-i",
        ])
        .arg(dir.join("user"))
        .args(["root@127.0.0.1", "sha256sum"]);
        let t = Instant::now();
        let log = || std::fs::read_to_string(dir.join("sshd.log")).unwrap_or_default();
        let out = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| run_with_stdin(c, &input, T)))
            .unwrap_or_else(|_| panic!("ssh (fido run: {accel}) failed\nsshd:\n{}", log()));
        let log = log();
        assert_eq!(out.split_whitespace().next(), Some(want.as_str()), "ssh (fido run: {accel}) {out:?}\nsshd:\n{log}");
        eprintln!("ssh (fido run: {accel}): 8 MiB in {:?}", t.elapsed());
    }
}

const NODE_SERVER: &str = r#"
const http = require('http'), crypto = require('crypto');
http.createServer((req, res) => {
  const h = crypto.createHash('sha256'); let n = 0;
  req.on('data', c => { h.update(c); n += c.length; });
  req.on('end', () => res.end(`${req.method} ${req.url} ${n} ${h.digest('hex')}\n`));
}).listen(+process.argv[2], '127.0.0.1');
"#;

/// POSTs the file argv[3] to 127.0.0.1:argv[2] and prints the answer.
const NODE_POST: &str = r#"
const http = require('http'), fs = require('fs');
const body = fs.readFileSync(process.argv[3]);
const req = http.request({ host: '127.0.0.1', port: +process.argv[2], path: '/post', method: 'POST' }, res => {
  let s = ''; res.on('data', c => s += c); res.on('end', () => process.stdout.write(s));
});
req.end(body);
"#;

const NODE_CLUSTER: &str = r#"
const cluster = require('cluster'), http = require('http');
cluster.schedulingPolicy = cluster.SCHED_RR;   // the primary accepts, workers get the sockets
if (cluster.isPrimary) {
  for (let i = 0; i < 2; i++) cluster.fork();
} else {
  http.createServer((req, res) => res.end(`worker ${cluster.worker.id} ${req.url}\n`))
    .listen(+process.argv[2], '127.0.0.1');
}
"#;

fn curl(b: &Broker, accel: bool, url: &str, timeout: Duration) -> String {
    let mut c = if accel { b.accel("curl") } else { Command::new("curl") };
    c.args(["-sS", "--fail", "--max-time", "20", url]);
    run_checked(c, None, timeout)
}

#[test]
fn node_http_server_with_curl_and_node_client() {
    require(&["node", "curl"]);
    let b = Broker::start();
    let dir = b.dir.path();
    std::fs::write(dir.join("server.js"), NODE_SERVER).unwrap();
    std::fs::write(dir.join("post.js"), NODE_POST).unwrap();
    let port = free_port();
    let mut srv = b.accel("node");
    srv.arg(dir.join("server.js")).arg(port.to_string());
    let _srv = spawn_logged(srv, &dir.join("node.log"));
    wait_port(port);
    b.wait_listener(port);
    let empty = "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855";
    // libuv closes with syscall(SYS_close): a plain connection that reuses
    // an accelerated one's descriptor number must still be answered.
    for i in 0..4 {
        for accel in [true, false] {
            let path = format!("/r{i}-{accel}");
            let got = curl(&b, accel, &format!("http://127.0.0.1:{port}{path}"), T);
            assert_eq!(got, format!("GET {path} 0 {empty}\n"));
        }
    }
    // A 4 MiB POST from node's own client.
    let body = dir.join("body");
    std::fs::write(&body, pattern(4 << 20, 11)).unwrap();
    let mut post = b.accel("node");
    post.arg(dir.join("post.js")).arg(port.to_string()).arg(&body);
    let got = run_checked(post, None, T);
    assert_eq!(got, format!("POST /post {} {}\n", 4 << 20, sha256_file(&body)));
    let (n, _, recv) = b.wait_accelerated("curl", 4);
    assert!(n >= 4, "curl accelerated {n}: {:?}", b.stats());
    // The server publishes its statistics every 200 ms: wait for the POST's
    // bytes too, not only for the connection count (the client's own count
    // reaches 5 first).
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    let (n, recv_node) = loop {
        let (n, _, recv_node) = b.accelerated("node");
        if (n >= 5 && recv_node >= 4 << 20) || std::time::Instant::now() > deadline {
            break (n, recv_node);
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    assert!(n >= 5 && recv_node >= 4 << 20, "node accelerated {n} ({recv}/{recv_node} bytes): {:?}", b.stats());
}

#[test]
fn node_cluster_hands_accepted_sockets_to_workers() {
    require(&["node", "curl"]);
    let b = Broker::start();
    let dir = b.dir.path();
    std::fs::write(dir.join("cluster.js"), NODE_CLUSTER).unwrap();
    let port = free_port();
    let mut srv = b.accel("node");
    srv.arg(dir.join("cluster.js")).arg(port.to_string());
    let _srv = spawn_logged(srv, &dir.join("node.log"));
    wait_port(port);
    b.wait_listener(port);
    for i in 0..6 {
        let accel = i % 3 != 2;
        let got = curl(&b, accel, &format!("http://127.0.0.1:{port}/c{i}"), T);
        assert!(got.starts_with("worker ") && got.ends_with(&format!(" /c{i}\n")), "request {i}: {got:?}");
    }
}

/// Sends `input` through `client` to a server that answers its sha256 once
/// the client half-closed; returns what the client printed.
fn through(client: Command, input: &Path) -> String {
    let t = Instant::now();
    let out = run_with_stdin(client, input, T);
    eprintln!("{} bytes in {:?}", std::fs::metadata(input).unwrap().len(), t.elapsed());
    out
}

#[test]
fn socat_and_ncat_bulk_with_half_close() {
    require(&["socat", "ncat", "sha256sum"]);
    let b = Broker::start();
    let dir = b.dir.path();
    let input = dir.join("in");
    std::fs::write(&input, pattern(64 << 20, 5)).unwrap();
    let want = sha256_file(&input);

    // socat: the server pipes the connection through sha256sum, which
    // answers only after the client's FIN (socat shuts down its write side
    // at the end of stdin and keeps reading, -t 30).
    let port = free_port();
    let mut srv = b.accel("socat");
    srv.arg(format!("TCP-LISTEN:{port},bind=127.0.0.1,reuseaddr,fork")).arg("EXEC:sha256sum");
    let _srv = spawn_logged(srv, &dir.join("socat.log"));
    wait_port(port);
    b.wait_listener(port);
    let mut cli = b.accel("socat");
    cli.args(["-t", "30", "-"]).arg(format!("TCP:127.0.0.1:{port}"));
    let got = through(cli, &input);
    assert_eq!(got.split_whitespace().next(), Some(want.as_str()), "socat {got:?}");

    // ncat (7.93 closes both directions at the end of its stdin, so no
    // answer after a half-close): once from client to a server that writes
    // to a file and must see EOF right after the last byte, once from a
    // server whose accepted socket becomes `cat`'s stdout across exec
    // (--sh-exec: dup2, then sh, then cat).
    let port = free_port();
    let out = dir.join("ncat-out");
    let mut srv = b.accel("ncat");
    srv.args(["-l", "--recv-only", "127.0.0.1", &port.to_string()]);
    let srv = spawn_to_file(srv, &out);
    b.wait_listener(port);
    let mut cli = b.accel("ncat");
    cli.args(["--send-only", "127.0.0.1", &port.to_string()]);
    through(cli, &input);
    wait_exit(srv, T);
    assert_eq!(sha256_file(&out), want, "ncat to a file");

    let port = free_port();
    let mut srv = b.accel("ncat");
    srv.args(["-l", "-k", "127.0.0.1", &port.to_string(), "--sh-exec"])
        .arg(format!("cat {}", input.display()));
    let _srv = spawn_logged(srv, &dir.join("ncat.log"));
    b.wait_listener(port);
    let mut cli = b.accel("sh");
    cli.arg("-c").arg(format!("ncat --recv-only 127.0.0.1 {port} | sha256sum"));
    let got = run_checked(cli, None, T);
    assert_eq!(got.split_whitespace().next(), Some(want.as_str()), "ncat --sh-exec {got:?}");

    let (n, sent, _) = b.wait_accelerated("socat", 2);
    assert!(n >= 2 && sent >= 64 << 20, "socat accelerated {n}, sent {sent}: {:?}", b.stats());
    let (n, sent, recv) = b.wait_accelerated("ncat", 3);
    assert!(n >= 3 && sent >= 64 << 20 && recv >= 64 << 20, "ncat accelerated {n}, sent {sent}: {:?}", b.stats());
}

const PY_MANY: &str = r#"
import resource, socket, sys, time
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
port, n = int(sys.argv[2]), int(sys.argv[3])
if sys.argv[1] == "server":
    import selectors
    l = socket.create_server(("127.0.0.1", port), backlog=1024)
    sel = selectors.DefaultSelector()
    sel.register(l, selectors.EVENT_READ)
    while True:
        for key, _ in sel.select():
            if key.fileobj is l:
                c, _ = l.accept()
                sel.register(c, selectors.EVENT_READ)
            else:
                d = key.fileobj.recv(4096)
                if d:
                    key.fileobj.sendall(d)
                else:
                    sel.unregister(key.fileobj)
                    key.fileobj.close()
socks = [socket.create_connection(("127.0.0.1", port)) for _ in range(n)]
for i, s in enumerate(socks):
    s.sendall(b"x%05d" % i)
    assert s.recv(16) == b"x%05d" % i
print("holding", flush=True)
time.sleep(float(sys.argv[4]))
"#;

/// A process with many accelerated connections open (asyncio programs hold
/// thousands) still publishes its statistics: its value once grew past the
/// registry's limit and was refused whole (`fido status` and the
/// acceleration counters saw nothing while the connections were open).
#[test]
fn statistics_of_a_process_with_1000_open_connections_are_published() {
    require(&["python3"]);
    let b = Broker::start();
    let dir = b.dir.path();
    let py = dir.join("many.py");
    std::fs::write(&py, PY_MANY).unwrap();
    let port = free_port();
    let mut srv = b.accel("python3");
    srv.arg(&py).args(["server", &port.to_string(), "0"]);
    let _srv = spawn_logged(srv, &dir.join("server.log"));
    wait_port(port);
    b.wait_listener(port);
    let mut cli = b.accel("python3");
    cli.arg(&py).args(["client", &port.to_string(), "1000", "20"]);
    let mut cli = ChildProc::start(cli);
    cli.expect_line("holding", T);
    let deadline = Instant::now() + Duration::from_secs(10);
    let client_stats = loop {
        let s = b.stats();
        if let Some(v) = s.iter().find(|v| v["pid"] == cli.pid() && v["accelerated"].as_u64() >= Some(1000)) {
            break v.clone();
        }
        assert!(Instant::now() < deadline, "the client's statistics were not published: {s:?}");
        std::thread::sleep(Duration::from_millis(100));
    };
    assert_eq!(client_stats["open_total"], 1000, "{client_stats}");
    let listed = client_stats["open"].as_array().unwrap().len();
    assert!((1..1000).contains(&listed), "{listed} listed");
    cli.kill9();
}
