//! `fido-bench net-apps`: the programs of issue #19, each run over plain TCP
//! (system `tcp`) and with both ends under the preload (system `fido`) in one
//! invocation, against an embedded broker. For every program it reports the
//! version, whether the `fido` run was accelerated (the library's own
//! statistics), whether the bytes were correct (sha256 of what went through,
//! values read back, CHECKSUM TABLE, answers checked by the client), the
//! figure and the fido/tcp ratio — the compatibility table of docs/NET.md.
//! Unlike `fido-bench net`, a `fido` run that stayed plain TCP is reported
//! (accelerated: no), not an error: falling back is a correct answer for
//! some programs (sshd's seccomp sandbox, sockets passed between processes).
//!
//! redis and nginx are `fido-bench net`'s own cases, run from here.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context as _};

use super::net::{self, accelerated, free_port, output, spawn_server, Env, Server};
use crate::{Opts, Record};

const SUITE: &str = "net-apps";

const CEC_C: &str = include_str!("net_apps/cec.c");
const ASYNCIO_PY: &str = include_str!("net_apps/asyncio_echo.py");
const NODE_SERVER_JS: &str = include_str!("net_apps/node_server.js");
const NODE_CLIENT_JS: &str = include_str!("net_apps/node_client.js");

/// What the table says about one program's run beside its figure.
#[derive(Clone, Debug)]
struct Meta {
    case: String,
    system: String,
    program: String,
    version: String,
    /// Connections the program accelerated during the run (`fido` only).
    accelerated: Option<u64>,
    /// Whether the bytes were checked and right; `None`: the case checks nothing.
    correct: Option<bool>,
}

/// Goal of a case: fido/tcp at least this.
fn goal_of(case: &str) -> f64 {
    match case {
        "connect-echo-close" => 0.9,
        c if c.starts_with("memcached") || c.starts_with("redis") || c.starts_with("nginx") => 1.5,
        _ => 1.0,
    }
}

struct Run<'a> {
    e: Env<'a>,
    records: Vec<Record>,
    metas: Vec<Meta>,
    big: PathBuf,
    big_sha: String,
    mib: usize,
}

impl Run<'_> {
    /// Records `value` for (`case`, `system`) with what the table needs.
    #[allow(clippy::too_many_arguments)]
    fn push(
        &mut self,
        case: &str,
        system: &str,
        program: &str,
        version: &str,
        metric: &str,
        unit: &str,
        value: f64,
        n: u64,
        accel_before: u64,
        correct: Option<bool>,
    ) {
        let accelerated = (system == "fido").then(|| accelerated(self.e.broker, program).saturating_sub(accel_before));
        self.records.push(Record {
            suite: SUITE.into(),
            case: case.into(),
            system: system.into(),
            metric: metric.into(),
            value,
            unit: unit.into(),
            p50: None,
            p99: None,
            n,
        });
        self.metas.push(Meta {
            case: case.into(),
            system: system.into(),
            program: program.into(),
            version: version.into(),
            accelerated,
            correct,
        });
    }

    fn accel_before(&self, system: &str, program: &str) -> u64 {
        if system == "fido" {
            accelerated(self.e.broker, program)
        } else {
            0
        }
    }
}

/// The first line of `cmd args` (stdout, else stderr), trimmed.
fn version_of(cmd: &str, args: &[&str]) -> String {
    Command::new(cmd)
        .args(args)
        .stdin(Stdio::null())
        .output()
        .ok()
        .and_then(|o| {
            let text = if o.stdout.is_empty() { o.stderr } else { o.stdout };
            String::from_utf8_lossy(&text).lines().find(|l| !l.trim().is_empty()).map(|l| l.trim().to_string())
        })
        .unwrap_or_else(|| "?".into())
}

/// Everything `cmd args` prints.
fn all_output(cmd: &str, args: &[&str]) -> String {
    Command::new(cmd)
        .args(args)
        .stdin(Stdio::null())
        .output()
        .map(|o| format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr)))
        .unwrap_or_default()
}

/// The word after `key` in `text` (a version in a banner), else the text.
fn word_after(text: &str, key: &str) -> String {
    text.find(key)
        .and_then(|i| text[i + key.len()..].split_whitespace().next())
        .map(str::to_string)
        .unwrap_or_else(|| text.trim().to_string())
}

/// Waits (20 s) until something listens on 127.0.0.1:`port` without
/// connecting to it (a one-shot server would take the probe for its client).
fn wait_listen(port: u16) -> anyhow::Result<()> {
    let needle = format!("0100007F:{port:04X} 00000000:0000 0A");
    let t = Instant::now();
    while !std::fs::read_to_string("/proc/net/tcp").unwrap_or_default().contains(&needle) {
        if t.elapsed() > Duration::from_secs(20) {
            bail!("nothing listens on {port}");
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    Ok(())
}

/// Waits for a one-shot server to exit by itself (bounded: a hang fails).
fn wait_server(mut s: Server, secs: u64) -> anyhow::Result<()> {
    let t = Instant::now();
    loop {
        if let Some(st) = s.0.try_wait()? {
            if !st.success() {
                bail!("server exited with {st}");
            }
            return Ok(());
        }
        if t.elapsed() > Duration::from_secs(secs) {
            bail!("server did not finish within {secs} s");
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

fn sha256(path: &Path) -> anyhow::Result<String> {
    let out = Command::new("sha256sum").arg(path).output()?;
    String::from_utf8_lossy(&out.stdout)
        .split_whitespace()
        .next()
        .map(str::to_string)
        .context("sha256sum")
}

fn json_of(text: &str) -> anyhow::Result<serde_json::Value> {
    let line = text.lines().rev().find(|l| l.starts_with('{')).with_context(|| format!("no JSON in {text}"))?;
    Ok(serde_json::from_str(line)?)
}

/// One file to another through `program`: a one-shot server writes what it
/// receives to a file, the client sends `r.big` and closes (a half-close the
/// server must see as EOF right after the last byte). Time: client start to
/// server exit. Correct: sha256 of the file.
fn file_transfer(r: &mut Run, system: &str, program: &str) -> anyhow::Result<()> {
    let case = format!("{program}-file-{}MiB", r.mib);
    let port = free_port()?;
    let out = r.e.dir.join(format!("{program}-{system}.out"));
    let (server, client): (Vec<String>, Vec<String>) = match program {
        "socat" => (
            vec![
                "-u".into(),
                format!("TCP-LISTEN:{port},bind=127.0.0.1,reuseaddr"),
                format!("OPEN:{},creat,trunc", out.display()),
            ],
            vec!["-u".into(), format!("OPEN:{}", r.big.display()), format!("TCP:127.0.0.1:{port}")],
        ),
        _ => (
            vec!["-l".into(), "--recv-only".into(), "127.0.0.1".into(), port.to_string()],
            vec!["--send-only".into(), "127.0.0.1".into(), port.to_string(), "-i".into(), "60".into()],
        ),
    };
    let mut s = r.e.cmd(system, program);
    s.args(&server).stderr(Stdio::null());
    if program == "ncat" {
        s.stdout(std::fs::File::create(&out)?);
    } else {
        s.stdout(Stdio::null());
    }
    let srv = Server(s.spawn().with_context(|| format!("starting {program}"))?);
    wait_listen(port)?;
    if system == "fido" {
        wait_listener_published(r.e.broker, port)?;
    }
    let before = r.accel_before(system, program);
    let mut c = r.e.cmd(system, program);
    c.args(&client).stdin(std::fs::File::open(&r.big)?);
    let t = Instant::now();
    output(c, 120)?;
    wait_server(srv, 120)?;
    let secs = t.elapsed().as_secs_f64();
    let correct = sha256(&out)? == r.big_sha;
    let _ = std::fs::remove_file(&out);
    let version = match program {
        "socat" => word_after(&all_output("socat", &["-V"]), "socat version"),
        _ => word_after(&version_of("ncat", &["--version"]), "Version"),
    };
    let bytes = (r.mib as u64) << 20;
    r.push(&case, system, program, &version, "bytes_per_s", "B/s", bytes as f64 / secs, bytes, before, Some(correct));
    Ok(())
}

/// Waits until the library published a listener on `port` (it does right
/// after the kernel's `listen`; a client faster than that stays plain).
fn wait_listener_published(broker: &Path, port: u16) -> anyhow::Result<()> {
    let d = fido::Domain::join(
        fido::JoinOptions::new("fido-bench-net-apps").broker(broker).arena_len(1 << 20).ring_entries(2),
    )?;
    let t = Instant::now();
    let res = loop {
        if !d.list(&format!("/net/listen/{port}")).unwrap_or_default().is_empty() {
            break Ok(());
        }
        if t.elapsed() > Duration::from_secs(20) {
            break Err(anyhow::anyhow!("no listener published on {port}"));
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    let _ = d.leave();
    res
}

fn connect_echo_close(r: &mut Run, system: &str, cec: &Path) -> anyhow::Result<()> {
    let port = free_port()?;
    let mut s = r.e.cmd(system, cec.to_str().context("path")?);
    s.args(["server", &port.to_string()]);
    let _srv = spawn_server(s, port)?;
    if system == "fido" {
        wait_listener_published(r.e.broker, port)?;
    }
    let before = r.accel_before(system, "cec");
    let mut c = r.e.cmd(system, cec.to_str().context("path")?);
    let secs = r.e.secs.max(2);
    c.args(["client", &port.to_string(), &secs.to_string()]);
    let text = output(c, secs + 30)?;
    let conns = net::after_number(&text, "conns").context("cec conns")?;
    let t = net::after_number(&text, "secs").context("cec secs")?;
    let bad = net::after_number(&text, "bad").context("cec bad")?;
    r.push(
        "connect-echo-close",
        system,
        "cec",
        "C, 64 B echo",
        "connections_per_s",
        "conn/s",
        conns / t,
        conns as u64,
        before,
        Some(bad == 0.0),
    );
    Ok(())
}

fn asyncio(r: &mut Run, system: &str, py: &Path) -> anyhow::Result<()> {
    let port = free_port()?;
    let mut s = r.e.cmd(system, "python3");
    s.arg(py).args(["server", &port.to_string()]);
    let _srv = spawn_server(s, port)?;
    if system == "fido" {
        wait_listener_published(r.e.broker, port)?;
    }
    let before = r.accel_before(system, "python3");
    let (conns, rounds) = (1000, 20);
    let mut c = r.e.cmd(system, "python3");
    c.arg(py).args(["client", &port.to_string(), &conns.to_string(), &rounds.to_string(), "4096"]);
    let v = json_of(&output(c, 120)?)?;
    let bad = v["bad"].as_u64().unwrap_or(1);
    let secs = v["rounds_s"].as_f64().context("rounds_s")?;
    let version = version_of("python3", &["--version"]);
    let n = (conns * rounds) as u64;
    r.push(
        "asyncio-1000conn-4KiBx20",
        system,
        "python3",
        &version,
        "round_trips_per_s",
        "rt/s",
        n as f64 / secs,
        n,
        before,
        Some(bad == 0),
    );
    Ok(())
}

fn node(r: &mut Run, system: &str) -> anyhow::Result<()> {
    let dir = r.e.dir;
    let (srv_js, cli_js) = (dir.join("node_server.js"), dir.join("node_client.js"));
    let port = free_port()?;
    let mut s = r.e.cmd(system, "node");
    s.arg(&srv_js).arg(port.to_string());
    let _srv = spawn_server(s, port)?;
    if system == "fido" {
        wait_listener_published(r.e.broker, port)?;
    }
    let before = r.accel_before(system, "node");
    let posts = if r.e.quick { 16 } else { 64 };
    let mut c = r.e.cmd(system, "node");
    c.arg(&cli_js).args([port.to_string(), r.e.secs.to_string(), posts.to_string()]);
    let v = json_of(&output(c, 120 + r.e.secs)?)?;
    let correct = v["bad"].as_u64() == Some(0);
    let version = version_of("node", &["--version"]);
    let gets = v["gets"].as_f64().context("gets")?;
    let post_bytes = v["post_bytes"].as_f64().context("post_bytes")?;
    let get_s = v["get_s"].as_f64().context("get_s")?;
    let post_s = v["post_s"].as_f64().context("post_s")?;
    // Both cases ran on the client's one connection: the second sees the
    // acceleration counted already.
    r.push("node-http-get", system, "node", &version, "requests_per_s", "req/s", gets / get_s, gets as u64, before, Some(correct));
    r.push("node-http-post-4MiB", system, "node", &version, "bytes_per_s", "B/s", post_bytes / post_s, post_bytes as u64, before, Some(correct));
    Ok(())
}

fn memcached(r: &mut Run, system: &str) -> anyhow::Result<()> {
    let port = free_port()?;
    let mut s = r.e.cmd(system, "memcached");
    s.args(["-u", "root", "-U", "0", "-I", "2m", "-t", "2", "-l", "127.0.0.1", "-p", &port.to_string()]);
    let _srv = spawn_server(s, port)?;
    if system == "fido" {
        wait_listener_published(r.e.broker, port)?;
    }
    let servers = format!("--servers=127.0.0.1:{port}");
    // Values of 0 B to 1 MiB stored and read back through the library.
    let mut correct = true;
    for (i, len) in [0usize, 1, 4096, 1 << 20].into_iter().enumerate() {
        let name = format!("mcv-{system}-{i}");
        let path = r.e.dir.join(&name);
        let value: Vec<u8> = (0..len).map(|j| (j * 131 + i) as u8).collect();
        std::fs::write(&path, &value)?;
        let mut cp = r.e.cmd(system, "memccp");
        cp.arg(&servers).arg(&path);
        output(cp, 30)?;
        let mut cat = r.e.cmd(system, "memccat");
        cat.arg(&servers).arg(&name).stdout(Stdio::piped()).stderr(Stdio::null());
        let got = cat.output()?.stdout;
        correct &= got.len() == len + 1 && got[..len] == value[..];
        let _ = std::fs::remove_file(&path);
    }
    let before = r.accel_before(system, "memcaslap");
    let mut c = r.e.cmd(system, "memcaslap");
    let t = format!("{}s", r.e.secs.max(2));
    c.args(["-s", &format!("127.0.0.1:{port}"), "-T", "1", "-c", "16", "-t", &t, "-X", "1024", "-v", "0.1"]);
    let text = output(c, r.e.secs + 60)?;
    let tps = net::after_number(&text, "TPS:").context("memcaslap TPS")?;
    let ops = net::after_number(&text, "Ops:").unwrap_or(0.0) as u64;
    let failed = net::after_number(&text, "verify_failed:").unwrap_or(0.0);
    let version = version_of("memcached", &["-V"]);
    r.push(
        "memcached-memcaslap",
        system,
        "memcaslap",
        &version,
        "ops_per_s",
        "op/s",
        tps,
        ops,
        before,
        Some(correct && failed == 0.0),
    );
    Ok(())
}

fn mariadb(r: &mut Run, system: &str, data: &Path) -> anyhow::Result<()> {
    let port = free_port()?;
    let mut s = r.e.cmd(system, "mariadbd");
    s.args([
        "--no-defaults",
        "--user=root",
        "--bind-address=127.0.0.1",
        "--skip-grant-tables",
        "--skip-log-bin",
        "--innodb-buffer-pool-size=64M",
        &format!("--port={port}"),
    ])
    .arg(format!("--datadir={}", data.display()))
    .arg(format!("--socket={}", r.e.dir.join("mysql.sock").display()));
    let _srv = spawn_server(s, port)?;
    if system == "fido" {
        wait_listener_published(r.e.broker, port)?;
    }
    let p = port.to_string();
    let sql_over = |sys: &str, q: &str| -> anyhow::Result<String> {
        let mut c = r.e.cmd(sys, "mariadb");
        c.args(["--no-defaults", "-h127.0.0.1", "-uroot", "-N", "-B", "-P", &p, "-e", q]);
        output(c, 60)
    };
    let sql = |q: &str| sql_over(system, q);
    let sysbench = |cmd: &str, secs: u64| -> anyhow::Result<String> {
        let mut c = r.e.cmd(system, "sysbench");
        c.args([
            "oltp_read_only",
            "--db-driver=mysql",
            "--mysql-host=127.0.0.1",
            "--mysql-user=root",
            "--tables=2",
            "--table-size=10000",
            "--threads=4",
            "--rand-seed=1",
            &format!("--mysql-port={port}"),
            &format!("--time={secs}"),
            cmd,
        ]);
        output(c, secs + 120)
    };
    // Each system prepares its own copy of the tables (the first drops what
    // the other left) through its own connections.
    sql("DROP DATABASE IF EXISTS sbtest; CREATE DATABASE sbtest")?;
    sysbench("prepare", 1)?;
    let before = r.accel_before(system, "sysbench");
    let text = sysbench("run", r.e.secs.max(2))?;
    let tps = net::after_number(&text, "transactions:").context("sysbench transactions")?;
    let tps = text
        .lines()
        .find(|l| l.trim_start().starts_with("transactions:"))
        .and_then(|l| l.split('(').nth(1)?.split_whitespace().next()?.parse::<f64>().ok())
        .unwrap_or(tps);
    let errors = net::after_number(&text, "ignored errors:").unwrap_or(1.0);
    // What sysbench prepared (through this system's connections) reads back
    // the same over this system and over plain TCP.
    let q = "CHECKSUM TABLE sbtest.sbtest1, sbtest.sbtest2; \
             SELECT COUNT(*), SUM(k), MD5(GROUP_CONCAT(c ORDER BY id)) FROM sbtest.sbtest1";
    let same = sql(q)? == sql_over("tcp", q)?;
    let version = word_after(&version_of("mariadbd", &["--version"]), "Ver");
    r.push(
        "mariadb-sysbench-oltp-ro",
        system,
        "sysbench",
        &version,
        "transactions_per_s",
        "tx/s",
        tps,
        0,
        before,
        Some(errors == 0.0 && same),
    );
    Ok(())
}

fn ssh(r: &mut Run, system: &str, sshd_dir: &Path) -> anyhow::Result<()> {
    let port = free_port()?;
    let d = sshd_dir.display();
    let conf = sshd_dir.join(format!("sshd_config-{system}"));
    std::fs::write(
        &conf,
        format!(
            "Port {port}\nListenAddress 127.0.0.1\nHostKey {d}/host\nAuthorizedKeysFile {d}/authorized_keys\n\
             PidFile {d}/sshd-{system}.pid\nPermitRootLogin prohibit-password\nPasswordAuthentication no\n\
             KbdInteractiveAuthentication no\nUsePAM no\nStrictModes no\n"
        ),
    )?;
    let mut s = r.e.cmd(system, "/usr/sbin/sshd");
    s.args(["-D", "-e", "-f"]).arg(&conf);
    let _srv = spawn_server(s, port)?;
    if system == "fido" {
        wait_listener_published(r.e.broker, port)?;
    }
    let mib = r.mib.min(256);
    let before = r.accel_before(system, "ssh");
    let mut c = r.e.cmd(system, "sh");
    c.arg("-c").arg(format!(
        "head -c {mib}M {big} | ssh -o StrictHostKeyChecking=no -o UserKnownHostsFile=/dev/null -o BatchMode=yes \
         -o LogLevel=ERROR -p {port} -i {d}/user root@127.0.0.1 cat | sha256sum; head -c {mib}M {big} | sha256sum",
        big = r.big.display()
    ));
    let t = Instant::now();
    let text = output(c, 120)?;
    let secs = t.elapsed().as_secs_f64();
    let sums: Vec<&str> = text.lines().filter_map(|l| l.split_whitespace().next()).collect();
    let correct = sums.len() == 2 && sums[0] == sums[1];
    let version = version_of("ssh", &["-V"]).split(',').next().unwrap_or("?").to_string();
    let bytes = (mib as u64) << 20;
    r.push(&format!("ssh-cat-{mib}MiB"), system, "ssh", &version, "bytes_per_s", "B/s", bytes as f64 / secs, bytes, before, Some(correct));
    Ok(())
}

/// redis and nginx: `fido-bench net`'s cases (they fail if not accelerated).
fn net_cases(r: &mut Run, system: &str, opts: &Opts) -> anyhow::Result<()> {
    let mut recs = Vec::new();
    let before = (r.accel_before(system, "redis-benchmark"), r.accel_before(system, "wrk"));
    net::redis(&r.e, system, opts, &mut recs)?;
    net::nginx(&r.e, system, opts, &mut recs)?;
    for rec in recs {
        let (program, version, b) = if rec.case.starts_with("redis") {
            ("redis-benchmark", word_after(&version_of("redis-server", &["--version"]), "v="), before.0)
        } else {
            ("wrk", word_after(&version_of("nginx", &["-v"]), "nginx/"), before.1)
        };
        r.push(&rec.case, system, program, &version, &rec.metric, &rec.unit, rec.value, rec.n, b, None);
    }
    Ok(())
}

pub fn run(opts: &Opts) -> anyhow::Result<()> {
    let progs = [
        "memcached", "memcaslap", "memccp", "memccat", "mariadbd", "mariadb-install-db", "mariadb", "sysbench",
        "/usr/sbin/sshd", "ssh", "ssh-keygen", "node", "socat", "ncat", "python3", "cc", "sha256sum",
        "redis-server", "redis-benchmark", "nginx", "wrk",
    ];
    for p in progs {
        if !Command::new("sh")
            .args(["-c", &format!("command -v {p}")])
            .stdout(Stdio::null())
            .status()?
            .success()
        {
            bail!("{p} is not installed (scripts/install-test-deps.sh installs the benchmark programs)");
        }
    }
    let broker = fido_demo::proc::EmbeddedBroker::start("fido-bench-net-apps-")?;
    let dir = tempfile::Builder::new().prefix("fido-bench-net-apps-").tempdir()?;
    let d = dir.path();
    let mib = if opts.quick { 128 } else { 1024 };
    let big = d.join("big");
    {
        // Incompressible (ssh compresses nothing by default, but be sure).
        let mut f = std::io::BufWriter::new(std::fs::File::create(&big)?);
        let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
        let mut block = vec![0u8; 1 << 20];
        for _ in 0..mib {
            for b in block.chunks_exact_mut(8) {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                b.copy_from_slice(&x.to_le_bytes());
            }
            std::io::Write::write_all(&mut f, &block)?;
        }
        std::io::Write::flush(&mut f)?;
    }
    let big_sha = sha256(&big)?;
    std::fs::write(d.join("node_server.js"), NODE_SERVER_JS)?;
    std::fs::write(d.join("node_client.js"), NODE_CLIENT_JS)?;
    let py = d.join("asyncio_echo.py");
    std::fs::write(&py, ASYNCIO_PY)?;
    let cec = d.join("cec");
    std::fs::write(d.join("cec.c"), CEC_C)?;
    let st = Command::new("cc").args(["-O2", "-o"]).arg(&cec).arg(d.join("cec.c")).status()?;
    if !st.success() {
        bail!("compiling cec.c failed");
    }
    // MariaDB's data directory (system tables), made once.
    let data = d.join("mariadb");
    let mut init = Command::new("mariadb-install-db");
    init.args(["--no-defaults", "--user=root", "--auth-root-authentication-method=normal", "--skip-test-db"])
        .arg(format!("--datadir={}", data.display()));
    output(init, 120)?;
    // sshd's keys; its privilege separation directory (made at boot by the package).
    let sshd_dir = d.join("ssh");
    std::fs::create_dir_all(&sshd_dir)?;
    std::fs::create_dir_all("/run/sshd")?;
    for key in ["host", "user"] {
        let mut k = Command::new("ssh-keygen");
        k.args(["-q", "-t", "ed25519", "-N", "", "-f"]).arg(sshd_dir.join(key));
        output(k, 30)?;
    }
    std::fs::copy(sshd_dir.join("user.pub"), sshd_dir.join("authorized_keys"))?;

    let mut r = Run {
        e: Env { lib: net::find_library()?, broker: broker.socket(), dir: d, secs: if opts.quick { 2 } else { 5 }, quick: opts.quick },
        records: Vec::new(),
        metas: Vec::new(),
        big,
        big_sha,
        mib,
    };
    let t = Instant::now();
    let mut failures = Vec::new();
    for system in ["tcp", "fido"] {
        let mut step = |name: &str, wanted: bool, res: &mut dyn FnMut(&mut Run) -> anyhow::Result<()>| {
            if !wanted {
                return;
            }
            // One failing program does not hide the others' figures.
            if let Err(err) = res(&mut r) {
                eprintln!("{name} over {system} FAILED: {err:#}");
                failures.push(format!("{name}/{system}"));
            }
        };
        step("connect-echo-close", opts.wants(system, "connect-echo-close"), &mut |r| connect_echo_close(r, system, &cec));
        step("asyncio", opts.wants(system, "asyncio"), &mut |r| asyncio(r, system, &py));
        step("node", opts.wants(system, "node"), &mut |r| node(r, system));
        step("memcached", opts.wants(system, "memcached"), &mut |r| memcached(r, system));
        step("mariadb", opts.wants(system, "mariadb"), &mut |r| mariadb(r, system, &data));
        step("ssh", opts.wants(system, "ssh"), &mut |r| ssh(r, system, &sshd_dir));
        step("socat", opts.wants(system, "socat"), &mut |r| file_transfer(r, system, "socat"));
        step("ncat", opts.wants(system, "ncat"), &mut |r| file_transfer(r, system, "ncat"));
        step("redis+nginx", opts.wants(system, "redis") || opts.wants(system, "nginx"), &mut |r| net_cases(r, system, opts));
    }
    let load = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    let machine = crate::Machine::describe("unpinned (the programs, their clients and the broker scheduled by the kernel)")
        .with("loadavg_at_end", load.split_whitespace().take(3).collect::<Vec<_>>().join(" "));
    println!("{}", machine.header());
    let machine = machine.to_json();
    crate::print_table(&r.records);
    println!();
    for line in compat_table(&r.records, &r.metas) {
        println!("{line}");
    }
    println!();
    for line in goal_lines(&r.records, &r.metas) {
        println!("{line}");
    }
    println!(
        "# net-apps: loopback; fido = both ends under the preload, tcp = plain. {} MiB files (socat -u, ncat --send-only \
         -> --recv-only > FILE), ssh cat of min({} MiB, 256 MiB), node: GETs on one keep-alive connection then 4 MiB POSTs, \
         python asyncio: 1000 connections x 20 rounds of 4 KiB echo, memcaslap -T 1 -c 16 -X 1024, sysbench oltp_read_only \
         --threads=4 (2 x 10000 rows), C connect/64 B echo/close loop, redis-benchmark -c 50 -d 1024, wrk -t 2 -c 100.",
        r.mib, r.mib
    );
    eprintln!("({} records in {:.1} s)", r.records.len(), t.elapsed().as_secs_f64());
    if let Some(p) = &opts.json {
        write_json(p, &r.records, &r.metas, &machine)?;
    }
    drop(dir);
    broker.stop()?;
    if !failures.is_empty() {
        bail!("failed: {}", failures.join(", "));
    }
    Ok(())
}

fn value(records: &[Record], case: &str, system: &str) -> Option<f64> {
    records.iter().find(|r| r.case == case && r.system == system).map(|r| r.value)
}

fn meta<'a>(metas: &'a [Meta], case: &str, system: &str) -> Option<&'a Meta> {
    metas.iter().find(|m| m.case == case && m.system == system)
}

fn ratio(records: &[Record], case: &str) -> Option<f64> {
    Some(value(records, case, "fido")? / value(records, case, "tcp")?)
}

/// The compatibility table (markdown, as docs/NET.md carries it).
fn compat_table(records: &[Record], metas: &[Meta]) -> Vec<String> {
    let mut out = vec![
        "| case | program | version | accelerated | correct | tcp | fido | fido/tcp |".to_string(),
        "|---|---|---|---|---|---|---|---|".to_string(),
    ];
    let mut cases: Vec<&str> = Vec::new();
    for r in records {
        if !cases.contains(&r.case.as_str()) {
            cases.push(&r.case);
        }
    }
    let fmt = |v: Option<f64>, unit: &str| match v {
        Some(v) if unit == "B/s" => format!("{:.0} MiB/s", v / (1 << 20) as f64),
        Some(v) => format!("{v:.0} {unit}"),
        None => "—".into(),
    };
    for case in cases {
        let (mt, mf) = (meta(metas, case, "tcp"), meta(metas, case, "fido"));
        let any = mf.or(mt).expect("a record has its meta");
        let unit = records.iter().find(|r| r.case == case).map_or("", |r| r.unit.as_str());
        let accel = match mf.and_then(|m| m.accelerated) {
            Some(0) => "no (plain TCP)".to_string(),
            Some(n) => format!("yes ({n} conn)"),
            None => "—".into(),
        };
        let correct = |m: Option<&Meta>| match m.and_then(|m| m.correct) {
            Some(true) => "yes",
            Some(false) => "NO",
            None => "not checked",
        };
        let correct = if mt.is_some() && mf.is_some() && correct(mt) != correct(mf) {
            format!("tcp {}, fido {}", correct(mt), correct(mf))
        } else {
            correct(mf.or(mt)).to_string()
        };
        out.push(format!(
            "| {case} | {} | {} | {accel} | {correct} | {} | {} | {} |",
            any.program,
            any.version,
            fmt(value(records, case, "tcp"), unit),
            fmt(value(records, case, "fido"), unit),
            ratio(records, case).map_or("—".into(), |x| format!("{x:.2}x")),
        ));
    }
    out
}

/// The goals from this run's ratios: connect/echo/close >= 0.9x,
/// memcached/redis/nginx >= 1.5x, every other case >= 1.0x; a case whose
/// fido run was not accelerated is measured the same (falling back must not
/// cost either).
fn goal_lines(records: &[Record], metas: &[Meta]) -> Vec<String> {
    let mut out = Vec::new();
    let mut seen: Vec<&str> = Vec::new();
    for r in records {
        if seen.contains(&r.case.as_str()) {
            continue;
        }
        seen.push(&r.case);
        let Some(x) = ratio(records, &r.case) else { continue };
        let at_least = goal_of(&r.case);
        let plain = meta(metas, &r.case, "fido").and_then(|m| m.accelerated) == Some(0);
        out.push(format!(
            "goal: {} fido/tcp: {x:.2}x (>= {at_least}x) {}{}",
            r.case,
            if x >= at_least { "met" } else { "NOT met" },
            if plain { " (not accelerated)" } else { "" }
        ));
    }
    out
}

/// One JSON object per record (DESIGN §8 fields), with the program, its
/// version, accelerated, correct, the fido/tcp ratio (on fido records) and
/// the machine.
fn write_json(path: &Path, records: &[Record], metas: &[Meta], machine: &serde_json::Value) -> anyhow::Result<()> {
    let mut out = String::new();
    for r in records {
        let mut v = serde_json::to_value(r)?;
        if let Some(m) = meta(metas, &r.case, &r.system) {
            v["program"] = m.program.clone().into();
            v["version"] = m.version.clone().into();
            v["accelerated"] = m.accelerated.map(|n| n > 0).into();
            v["accelerated_connections"] = m.accelerated.into();
            v["correct"] = m.correct.into();
        }
        if r.system == "fido" {
            v["ratio_fido_tcp"] = ratio(records, &r.case).into();
            v["goal_ratio"] = goal_of(&r.case).into();
        }
        v["machine"] = machine.clone();
        out.push_str(&serde_json::to_string(&v)?);
        out.push('\n');
    }
    std::fs::write(path, out).with_context(|| format!("writing {}", path.display()))
}
