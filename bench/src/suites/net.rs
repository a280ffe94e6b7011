//! `fido-bench net`: real TCP programs (sockperf, iperf3, redis-benchmark,
//! nginx + wrk), each run over plain TCP (system `tcp`) and under `fido run`
//! (system `fido`, both ends preloaded) in the same invocation, against an
//! embedded broker. A `fido` figure is only reported if the library's
//! statistics show the client's connections were accelerated.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context as _};
use fido::{Domain, JoinOptions};
use crate::{Opts, Record};

use fido_demo::proc::EmbeddedBroker;

const SUITE: &str = "net";

pub(super) struct Env<'a> {
    pub(super) lib: PathBuf,
    pub(super) broker: &'a Path,
    pub(super) dir: &'a Path,
    pub(super) secs: u64,
    pub(super) quick: bool,
}

impl Env<'_> {
    /// Runs the client `prog args` as `system` runs it (timeout `secs` + 30 s)
    /// and returns its output. Under fido the run must also have been
    /// accelerated (see [`check_accel`]): every client goes through here so
    /// no figure can skip that check.
    fn client(&self, system: &str, prog: &str, args: &[&str], secs: u64) -> anyhow::Result<String> {
        let before = accelerated(self.broker, prog);
        let mut c = self.cmd(system, prog);
        c.args(args);
        let text = output(c, secs)?;
        check_accel(self, system, prog, before)?;
        Ok(text)
    }

    pub(super) fn cmd(&self, system: &str, prog: &str) -> Command {
        let mut c = Command::new(prog);
        if system == "fido" {
            // Generous attach wait: a figure is only reported for accelerated
            // connections, and this machine may be loaded.
            c.env("FIDO_NET_ATTACH_MS", "5000");
            c.env("LD_PRELOAD", &self.lib)
                .env("FIDO_BROKER", self.broker)
                .env_remove("FIDO_NET");
        } else {
            c.env_remove("LD_PRELOAD").env("FIDO_NET", "off");
        }
        c.stdin(Stdio::null());
        c
    }
}

pub(super) struct Server(pub(super) Child);
impl Drop for Server {
    fn drop(&mut self) {
        // SAFETY: signalling our own child.
        terminate(self.0.id() as i32);
        let t = Instant::now();
        while t.elapsed() < Duration::from_secs(5) {
            if let Ok(Some(_)) = self.0.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// SIGTERM to a child we started (it may already be gone: ignored).
pub(super) fn terminate(pid: i32) {
    let _ = rustix::process::kill_process(
        rustix::process::Pid::from_raw(pid).expect("child pid"),
        rustix::process::Signal::TERM,
    );
}

pub(super) fn spawn_server(mut c: Command, port: u16) -> anyhow::Result<Server> {
    c.stdout(Stdio::null()).stderr(Stdio::null());
    let s = Server(c.spawn().with_context(|| format!("starting {c:?}"))?);
    let t = Instant::now();
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        if t.elapsed() > Duration::from_secs(20) {
            bail!("server {c:?} did not listen on {port}");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    Ok(s)
}

pub(super) fn output(mut c: Command, secs: u64) -> anyhow::Result<String> {
    c.stdout(Stdio::piped()).stderr(Stdio::piped());
    let child = c.spawn().with_context(|| format!("running {c:?}"))?;
    let pid = child.id() as i32;
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(child.wait_with_output());
    });
    let out = match rx.recv_timeout(Duration::from_secs(secs + 30)) {
        Ok(o) => o?,
        Err(_) => {
            // SAFETY: our own child.
            terminate(pid);
            bail!("{c:?} did not finish");
        }
    };
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    if !out.status.success() {
        bail!("{c:?} failed ({}):\n{text}", out.status);
    }
    Ok(text)
}

pub(super) fn free_port() -> anyhow::Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port())
}

/// Connections the named program accelerated so far (from `/net/stats`).
pub(super) fn accelerated(broker: &Path, name: &str) -> u64 {
    let Ok(d) = Domain::join(
        JoinOptions::new("fido-bench-net")
            .broker(broker)
            .arena_len(1 << 20)
            .ring_entries(2),
    ) else {
        return 0;
    };
    let mut n = 0;
    for id in d.list("/net/stats").unwrap_or_default() {
        if let Ok(Some(v)) = d.read(&format!("/net/stats/{id}")) {
            if let Ok(v) = serde_json::from_slice::<serde_json::Value>(&v) {
                if v["name"] == name {
                    n += v["accelerated"].as_u64().unwrap_or(0);
                }
            }
        }
    }
    let _ = d.leave();
    n
}

pub(super) fn after_number(text: &str, key: &str) -> Option<f64> {
    let i = text.find(key)? + key.len();
    let rest = text[i..].trim_start_matches([' ', '=', ':']);
    let num: String = rest
        .chars()
        .take_while(|c| c.is_ascii_digit() || *c == '.')
        .collect();
    num.parse().ok()
}

fn check_accel(e: &Env, system: &str, name: &str, before: u64) -> anyhow::Result<()> {
    if system == "fido" && accelerated(e.broker, name) <= before {
        bail!("{name} under fido run was not accelerated (see FIDO_NET_DEBUG=1)");
    }
    Ok(())
}

fn sockperf(e: &Env, system: &str, opts: &Opts, out: &mut Vec<Record>) -> anyhow::Result<()> {
    let port = free_port()?;
    let p = port.to_string();
    let mut s = e.cmd(system, "sockperf");
    s.args(["sr", "--tcp", "-i", "127.0.0.1", "-p", &p]);
    let _s = spawn_server(s, port)?;
    let t = e.secs.to_string();
    // The client's arguments for `mode` (pp: ping-pong, tp: throughput) with
    // messages of `size` bytes.
    let sockperf_args = |mode: &'static str, size: &'static str| {
        [
            mode,
            "--tcp",
            "-i",
            "127.0.0.1",
            "-p",
            &p,
            "-t",
            &t,
            "-m",
            size,
        ]
    };
    if opts.wants(system, "sockperf-pp") {
        // sockperf sizes its table of send times for 600 000 round trips a
        // second unless told a higher rate; a ring with both ends spinning on
        // idle CPUs exceeds that ("_seqN > m_maxSequenceNo"). 2 M/s is well
        // above either system (the table then takes ~240 MB).
        let mut args = sockperf_args("pp", "14").to_vec();
        args.extend(["--mps", "2000000"]);
        let text = e.client(system, "sockperf", &args, e.secs)?;
        let p50 = after_number(&text, "percentile 50.000").context("sockperf p50")? * 1000.0;
        let p99 = after_number(&text, "percentile 99.000").context("sockperf p99")? * 1000.0;
        let n = after_number(&text, "ReceivedMessages").unwrap_or(0.0) as u64;
        out.push(Record::latency(SUITE, "sockperf-pp", system, p50, p99, n));
    }
    if opts.wants(system, "sockperf-tp") {
        let text = e.client(system, "sockperf", &sockperf_args("tp", "64000"), e.secs)?;
        let mbps = after_number(&text, "BandWidth is").context("sockperf bandwidth")?;
        let n = after_number(&text, "Total of").unwrap_or(0.0) as u64;
        out.push(Record::throughput(
            SUITE,
            "sockperf-tp",
            system,
            mbps * 1e6,
            n,
        ));
    }
    Ok(())
}

fn iperf3(e: &Env, system: &str, opts: &Opts, out: &mut Vec<Record>) -> anyhow::Result<()> {
    let port = free_port()?;
    let p = port.to_string();
    let mut s = e.cmd(system, "iperf3");
    s.args(["-s", "-p", &p]);
    let _s = spawn_server(s, port)?;
    for (case, z) in [("iperf3", false), ("iperf3-zerocopy", true)] {
        if !opts.wants(system, case) {
            continue;
        }
        let t = e.secs.to_string();
        let mut args = vec!["-c", "127.0.0.1", "-p", &p, "-t", &t, "--json"];
        if z {
            args.push("-Z");
        }
        let text = e.client(system, "iperf3", &args, e.secs)?;
        let v: serde_json::Value = serde_json::from_str(&text).context("iperf3 json")?;
        let bps = v["end"]["sum_received"]["bits_per_second"]
            .as_f64()
            .context("iperf3 result")?;
        let bytes = v["end"]["sum_received"]["bytes"].as_u64().unwrap_or(0);
        out.push(Record::throughput(SUITE, case, system, bps / 8.0, bytes));
    }
    Ok(())
}

pub(super) fn redis(e: &Env, system: &str, opts: &Opts, out: &mut Vec<Record>) -> anyhow::Result<()> {
    if !opts.wants(system, "redis-get") && !opts.wants(system, "redis-set") {
        return Ok(());
    }
    let port = free_port()?;
    let p = port.to_string();
    let mut s = e.cmd(system, "redis-server");
    s.args([
        "--port",
        &p,
        "--bind",
        "127.0.0.1",
        "--save",
        "",
        "--appendonly",
        "no",
    ])
    .current_dir(e.dir);
    let _s = spawn_server(s, port)?;
    let n = if e.quick { "20000" } else { "200000" };
    let text = e.client(
        system,
        "redis-benchmark",
        &[
            "-p", &p, "-t", "set,get", "-n", n, "-c", "50", "-d", "1024", "--csv",
        ],
        120,
    )?;
    for line in text.lines() {
        let f: Vec<&str> = line.split(',').map(|x| x.trim_matches('"')).collect();
        let case = match f.first() {
            Some(&"SET") => "redis-set",
            Some(&"GET") => "redis-get",
            _ => continue,
        };
        let rps: f64 = f
            .get(1)
            .and_then(|x| x.parse().ok())
            .context("redis-benchmark rps")?;
        // Percentiles of a rate do not exist: p50/p99 stay empty (the table
        // and JSON would otherwise label latencies as req/s).
        let (p50, p99) = (None, None);
        out.push(Record {
            suite: SUITE.into(),
            case: case.into(),
            system: system.into(),
            metric: "requests_per_s".into(),
            value: rps,
            unit: "req/s".into(),
            p50,
            p99,
            n: n.parse().unwrap_or(0),
        });
    }
    Ok(())
}

pub(super) fn nginx(e: &Env, system: &str, opts: &Opts, out: &mut Vec<Record>) -> anyhow::Result<()> {
    if !opts.wants(system, "nginx-wrk") {
        return Ok(());
    }
    let port = free_port()?;
    let d = e.dir.join(format!("nginx-{system}"));
    std::fs::create_dir_all(d.join("www"))?;
    std::fs::write(d.join("www/index.html"), vec![b'f'; 1024])?;
    let user = if rustix::process::geteuid().is_root() {
        "user root;"
    } else {
        ""
    };
    let dd = d.display();
    std::fs::write(
        d.join("nginx.conf"),
        format!(
            "daemon off;\n{user}\nworker_processes 1;\npid {dd}/nginx.pid;\nerror_log {dd}/error.log warn;\n\
             events {{ worker_connections 1024; }}\n\
             http {{ access_log off; sendfile on;\n\
               client_body_temp_path {dd}/body; proxy_temp_path {dd}/proxy; fastcgi_temp_path {dd}/fcgi;\n\
               uwsgi_temp_path {dd}/uwsgi; scgi_temp_path {dd}/scgi;\n\
               server {{ listen 127.0.0.1:{port}; root {dd}/www; }} }}\n"
        ),
    )?;
    let mut s = e.cmd(system, "nginx");
    s.arg("-c")
        .arg(d.join("nginx.conf"))
        .arg("-e")
        .arg(d.join("error.log"));
    let _s = spawn_server(s, port)?;
    let text = e.client(
        system,
        "wrk",
        &[
            "-t",
            "2",
            "-c",
            "100",
            "-d",
            &e.secs.to_string(),
            &format!("http://127.0.0.1:{port}/index.html"),
        ],
        e.secs,
    )?;
    if text.contains("Socket errors") || text.contains("Non-2xx") {
        eprintln!("warning: wrk over {system} reported errors:\n{text}");
    }
    let rps = after_number(&text, "Requests/sec:").context("wrk requests/sec")?;
    let n = text
        .lines()
        .find(|l| l.contains("requests in"))
        .and_then(|l| l.split_whitespace().next()?.parse().ok())
        .unwrap_or(0);
    out.push(Record {
        suite: SUITE.into(),
        case: "nginx-wrk".into(),
        system: system.into(),
        metric: "requests_per_s".into(),
        value: rps,
        unit: "req/s".into(),
        p50: None,
        p99: None,
        n,
    });
    Ok(())
}

pub fn run(opts: &Opts) -> anyhow::Result<()> {
    for p in [
        "sockperf",
        "iperf3",
        "redis-server",
        "redis-benchmark",
        "nginx",
        "wrk",
    ] {
        if Command::new("sh")
            .args(["-c", &format!("command -v {p}")])
            .stdout(Stdio::null())
            .status()?
            .code()
            != Some(0)
        {
            bail!("{p} is not installed (scripts/install-test-deps.sh installs the benchmark programs)");
        }
    }
    let broker = EmbeddedBroker::start("fido-bench-net-")?;
    let dir = tempfile::Builder::new()
        .prefix("fido-bench-net-")
        .tempdir()?;
    let e = Env {
        lib: find_library()?,
        broker: broker.socket(),
        dir: dir.path(),
        secs: if opts.quick { 1 } else { 5 },
        quick: opts.quick,
    };
    let t = Instant::now();
    let mut records = Vec::new();
    let mut failures = Vec::new();
    type Case = fn(&Env, &str, &Opts, &mut Vec<Record>) -> anyhow::Result<()>;
    let cases: [(&str, Case); 4] = [
        ("sockperf", sockperf),
        ("iperf3", iperf3),
        ("redis", redis),
        ("nginx", nginx),
    ];
    for system in ["tcp", "fido"] {
        for (name, f) in cases {
            // One failing program does not hide the others' figures; the
            // failure is reported and makes the command fail.
            if let Err(err) = f(&e, system, opts, &mut records) {
                eprintln!("{name} over {system} FAILED: {err:#}");
                failures.push(format!("{name}/{system}"));
            }
        }
    }
    crate::print_table(&records);
    println!(
        "# net: loopback, both ends of every connection under `fido run` for system fido, plain for tcp; \
         sockperf pp -m 14 --mps 2000000 (one_way_ns = RTT/2 as sockperf reports), tp -m 64000 (sender rate); \
         iperf3 receiver rate; redis-benchmark -c 50 -d 1024; wrk -t 2 -c 100 on a 1 KiB file."
    );
    eprintln!(
        "({} records in {:.1} s)",
        records.len(),
        t.elapsed().as_secs_f64()
    );
    if let Some(p) = &opts.json {
        crate::write_json(p, &records)?;
    }
    broker.stop()?;
    if !failures.is_empty() {
        bail!("failed: {}", failures.join(", "));
    }
    Ok(())
}

/// MMNet's preload library: `$FIDO_NET_LIB`, else `libfido_net.so` beside this
/// executable (the cargo target directory `cargo build --release --workspace`
/// fills), as `fido run` looks for it first.
pub(super) fn find_library() -> anyhow::Result<PathBuf> {
    if let Some(p) = std::env::var_os("FIDO_NET_LIB") {
        let p = PathBuf::from(p);
        if p.is_file() {
            return Ok(p);
        }
        bail!("FIDO_NET_LIB={} is not a file", p.display());
    }
    let exe = std::env::current_exe().context("current_exe")?;
    let lib = exe.with_file_name("libfido_net.so");
    if lib.is_file() {
        return Ok(lib);
    }
    bail!(
        "{} not found; build it with `cargo build --release -p fido-net` or set FIDO_NET_LIB",
        lib.display()
    )
}
