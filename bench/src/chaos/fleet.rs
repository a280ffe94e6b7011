//! The driver's fleet: the broker and one process per role, started,
//! killed (`SIGKILL`) and restarted; their journals read on one thread each and
//! applied to the [`Ledger`] on the driver's; stalls and recovery times watched;
//! and the kill schedule itself ([`Fleet::unleash`]).

use std::collections::{BTreeMap, HashMap};
use std::io::Write as _;
use std::path::PathBuf;
use std::process::{Child, ChildStdin, Command, ExitStatus, Stdio};
use std::sync::mpsc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use anyhow::{bail, Context as _};
use fido_demo::proc;
use serde_json::Value;

use super::ledger::{Ledger, StreamLedger, Totals};
use super::wire::Rng;
use super::{log_file, tl, Opts, RUN_ENV};

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(super) enum Kind {
    Source,
    Fwd,
    Sink,
    EchoServer,
    EchoClient,
}

impl Kind {
    pub(super) fn role(self) -> &'static str {
        match self {
            Kind::Source => "source",
            Kind::Fwd => "fwd",
            Kind::Sink => "sink",
            Kind::EchoServer => "echo-server",
            Kind::EchoClient => "echo-client",
        }
    }
    /// Has a stream of its own (each incarnation a new one).
    pub(super) fn sends(self) -> bool {
        matches!(self, Kind::Source | Kind::EchoServer | Kind::EchoClient)
    }
    /// Resends what is reported undelivered.
    pub(super) fn resends(self) -> bool {
        matches!(self, Kind::Source | Kind::EchoClient)
    }
}

pub(super) struct Spec {
    pub(super) name: &'static str,
    pub(super) kind: Kind,
    /// Pipeline index (for stalls and recovery).
    pub(super) group: usize,
    /// Its deliveries are the group's end-to-end progress.
    pub(super) terminal: bool,
    pub(super) listen: Option<String>,
    pub(super) next: Option<String>,
}

pub(super) const GROUPS: [&str; 3] = ["A", "B", "echo"];

pub(super) fn specs(run: &str) -> Vec<Spec> {
    let svc = |s: &str| Some(format!("chaos-{s}-{run}"));
    let s = |name, kind, group, terminal, listen: Option<String>, next: Option<String>| Spec {
        name,
        kind,
        group,
        terminal,
        listen,
        next,
    };
    vec![
        s("sinkA", Kind::Sink, 0, true, svc("sinkA"), None),
        s("fwdA", Kind::Fwd, 0, false, svc("fwdA"), svc("sinkA")),
        s("srcA", Kind::Source, 0, false, None, svc("fwdA")),
        s("sinkB", Kind::Sink, 1, true, svc("sinkB"), None),
        s("fwdB2", Kind::Fwd, 1, false, svc("fwdB2"), svc("sinkB")),
        s("fwdB1", Kind::Fwd, 1, false, svc("fwdB1"), svc("fwdB2")),
        s("srcB", Kind::Source, 1, false, None, svc("fwdB1")),
        s("echo-server", Kind::EchoServer, 2, false, svc("echo"), None),
        s("echo-client", Kind::EchoClient, 2, true, None, svc("echo")),
    ]
}

pub(super) enum Ev {
    Line(u64, String),
}

/// One incarnation of a role.
pub(super) struct Running {
    pub(super) inst: u64,
    pub(super) child: Child,
    pub(super) stdin: Option<ChildStdin>,
    pub(super) reader: Option<JoinHandle<()>>,
    pub(super) stream: Option<u64>,
    pub(super) ready_at: Option<Instant>,
    pub(super) done: bool,
}

/// Recovery measurement: after a kill at `t`, the first delivery in `group`
/// once the replacement is ready.
pub(super) struct Recovery {
    pub(super) group: usize,
    pub(super) killed_at: Instant,
    /// Role index whose replacement must be ready first (`None`: the broker).
    pub(super) role: Option<usize>,
    pub(super) broker: bool,
}

pub(super) struct Fleet {
    pub(super) exe: PathBuf,
    pub(super) token: String,
    pub(super) socket: PathBuf,
    pub(super) state: PathBuf,
    pub(super) logs: PathBuf,
    pub(super) seed: u64,
    pub(super) rate: f64,
    pub(super) specs: Vec<Spec>,
    pub(super) running: Vec<Option<Running>>,
    pub(super) broker: Option<Child>,
    pub(super) broker_ready_at: Option<Instant>,
    pub(super) tx: mpsc::Sender<Ev>,
    pub(super) rx: mpsc::Receiver<Ev>,
    pub(super) inst_role: HashMap<u64, usize>,
    pub(super) next_inst: u64,
    pub(super) next_stream: u64,
    pub(super) ledger: Ledger,
    pub(super) last_delivery: [Instant; 3],
    pub(super) stalled: [bool; 3],
    pub(super) recoveries: Vec<Recovery>,
    pub(super) recovery_domain_ms: Vec<u64>,
    pub(super) recovery_broker_ms: Vec<u64>,
    pub(super) kills: BTreeMap<&'static str, u64>,
    pub(super) broker_restarts: u64,
    pub(super) unexpected_exits: u64,
    pub(super) stalls: u64,
    /// `FIDO_CHAOS_TRACE=1`: copy every journal record into driver.log.
    pub(super) trace: bool,
}

impl Fleet {
    pub(super) fn start_broker(&mut self) -> anyhow::Result<()> {
        use std::os::unix::process::CommandExt as _;
        let mut cmd = Command::new(&self.exe);
        cmd.arg("__chaos-broker")
            .arg(&self.state)
            .arg(&self.socket)
            .env(RUN_ENV, &self.token)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log_file(&self.logs, "broker")?);
        // SAFETY: prctl(PR_SET_PDEATHSIG) is async-signal-safe; the closure
        // touches nothing else. The broker dies with us (we spawn only from
        // the main thread, which lives until the end).
        unsafe {
            cmd.pre_exec(|| {
                rustix::process::set_parent_process_death_signal(Some(
                    rustix::process::Signal::KILL,
                ))
                .map_err(std::io::Error::from)
            });
        }
        let child = cmd.spawn().context("spawning the broker")?;
        tl(format_args!("broker started, pid {}", child.id()));
        self.broker = Some(child);
        self.broker_ready_at = None;
        let deadline = Instant::now() + Duration::from_secs(20);
        while !proc::broker_reachable(&self.socket) {
            proc::check_interrupt()?;
            if let Some(st) = self.broker.as_mut().unwrap().try_wait()? {
                self.broker = None;
                bail!("the broker exited at start: {st} (see its log)");
            }
            if Instant::now() > deadline {
                bail!("the broker did not listen within 20 s");
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        self.broker_ready_at = Some(Instant::now());
        Ok(())
    }

    pub(super) fn kill_broker(&mut self) -> anyhow::Result<()> {
        if let Some(mut c) = self.broker.take() {
            let _ = c.kill();
            c.wait().context("reaping the broker")?;
            tl(format_args!("broker pid {} killed", c.id()));
        }
        Ok(())
    }

    pub(super) fn broker_pid(&self) -> Option<u32> {
        self.broker.as_ref().map(|c| c.id())
    }

    pub(super) fn start_role(&mut self, i: usize) -> anyhow::Result<()> {
        let spec = &self.specs[i];
        let inst = self.next_inst;
        self.next_inst += 1;
        let stream = spec.kind.sends().then(|| {
            self.next_stream += 1;
            self.next_stream
        });
        let mut args = vec![
            "__chaos-role".to_string(),
            format!("role={}", spec.kind.role()),
            format!("name=chaos-{}", spec.name),
            format!("seed={}", self.seed),
        ];
        if let Some(s) = stream {
            args.push(format!("stream={s}"));
        }
        if let Some(l) = &spec.listen {
            args.push(format!("listen={l}"));
        }
        if let Some(n) = &spec.next {
            args.push(format!("next={n}"));
        }
        let rate = if spec.kind == Kind::EchoClient {
            self.rate / 2.0
        } else {
            self.rate
        };
        args.push(format!("rate={rate}"));
        let mut child = Command::new(&self.exe)
            .args(&args)
            .env("FIDO_BROKER", &self.socket)
            .env("FIDO_CLI_PARENT", std::process::id().to_string())
            .env(RUN_ENV, &self.token)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(log_file(&self.logs, spec.name)?)
            .spawn()
            .with_context(|| format!("spawning {}", spec.name))?;
        let out = child.stdout.take().expect("piped");
        let stdin = child.stdin.take();
        let tx = self.tx.clone();
        let reader = proc::read_lines(&mut child, format!("chaos-{}", spec.name), out, move |line| match line {
            Some(s) => tx.send(Ev::Line(inst, s)).is_ok(),
            None => false,
        })?;
        if let Some(s) = stream {
            self.ledger.streams.insert(
                s,
                StreamLedger {
                    announced: 0,
                    cells: Vec::new(),
                    killed: false,
                    done: false,
                    resends: spec.kind.resends(),
                },
            );
        }
        self.inst_role.insert(inst, i);
        tl(format_args!(
            "{} inst {inst} started, pid {}, stream {stream:?}",
            spec.name,
            child.id()
        ));
        self.running[i] = Some(Running {
            inst,
            child,
            stdin,
            reader: Some(reader),
            stream,
            ready_at: None,
            done: false,
        });
        Ok(())
    }

    /// Kills (if still running) and reaps a role, reads the rest of its
    /// journal; returns its exit status.
    pub(super) fn stop_role(&mut self, i: usize, kill: bool) -> anyhow::Result<Option<ExitStatus>> {
        let Some(mut r) = self.running[i].take() else {
            return Ok(None);
        };
        if kill {
            let _ = r.child.kill();
            tl(format_args!(
                "{} inst {} pid {} killed",
                self.specs[i].name,
                r.inst,
                r.child.id()
            ));
        }
        drop(r.stdin.take());
        let st = r
            .child
            .wait()
            .with_context(|| format!("reaping {}", self.specs[i].name))?;
        if let Some(h) = r.reader.take() {
            let _ = h.join();
        }
        self.pump(Duration::ZERO);
        if let Some(s) = r.stream {
            if let Some(l) = self.ledger.streams.get_mut(&s) {
                // A sender that drained has accounted for everything it sent.
                l.killed = !l.done;
            }
        }
        Ok(Some(st))
    }

    pub(super) fn send_cmd(&mut self, i: usize, cmd: &str) {
        if let Some(r) = self.running[i].as_mut() {
            if let Some(s) = r.stdin.as_mut() {
                let _ = s.write_all(format!("{cmd}\n").as_bytes());
                let _ = s.flush();
            }
        }
    }

    /// Processes journal records for up to `wait`.
    pub(super) fn pump(&mut self, wait: Duration) {
        let deadline = Instant::now() + wait;
        loop {
            let ev = match self.rx.try_recv() {
                Ok(ev) => ev,
                Err(_) => {
                    let left = deadline.saturating_duration_since(Instant::now());
                    if left.is_zero() {
                        return;
                    }
                    match self.rx.recv_timeout(left) {
                        Ok(ev) => ev,
                        Err(_) => return,
                    }
                }
            };
            let Ev::Line(inst, line) = ev;
            self.handle(inst, &line);
        }
    }

    fn handle(&mut self, inst: u64, line: &str) {
        let Some(&i) = self.inst_role.get(&inst) else {
            return;
        };
        let now = Instant::now();
        let who = self.specs[i].name;
        if self.trace {
            tl(format_args!("{who}/{inst}: {line}"));
        }
        let (kind, rest) = line.split_once(' ').unwrap_or((line, ""));
        let current = self.running[i].as_ref().is_some_and(|r| r.inst == inst);
        match kind {
            "ready" => {
                tl(format_args!("{who} inst {inst} ready: domain/slot {rest}"));
                if current {
                    self.running[i].as_mut().unwrap().ready_at = Some(now);
                }
            }
            "done" => {
                if current {
                    let r = self.running[i].as_mut().unwrap();
                    r.done = true;
                    if let Some(s) = r.stream {
                        if let Some(l) = self.ledger.streams.get_mut(&s) {
                            l.done = true;
                        }
                    }
                }
            }
            _ => {
                let delivered = self.ledger.record(who, line);
                if delivered > 0 && self.specs[i].terminal {
                    self.delivered_in(self.specs[i].group, now);
                }
            }
        }
    }

    fn delivered_in(&mut self, group: usize, now: Instant) {
        self.last_delivery[group] = now;
        self.stalled[group] = false;
        let mut keep = Vec::new();
        for r in std::mem::take(&mut self.recoveries) {
            let ready = match r.role {
                Some(i) => self.running[i].as_ref().and_then(|x| x.ready_at),
                None => self.broker_ready_at,
            };
            if r.group == group && ready.is_some_and(|t| t <= now) {
                let ms = now.duration_since(r.killed_at).as_millis() as u64;
                if r.broker {
                    self.recovery_broker_ms.push(ms);
                } else {
                    self.recovery_domain_ms.push(ms);
                }
            } else {
                keep.push(r);
            }
        }
        self.recoveries = keep;
    }

    /// Restarts roles (and the broker) that exited on their own: a crash.
    pub(super) fn reap_unexpected(&mut self) -> anyhow::Result<()> {
        if let Some(c) = self.broker.as_mut() {
            if let Some(st) = c.try_wait()? {
                self.broker = None;
                self.unexpected_exits += 1;
                self.ledger
                    .problem(format!("the broker exited on its own: {st}"));
                self.start_broker()?;
            }
        }
        for i in 0..self.specs.len() {
            let exited = match self.running[i].as_mut() {
                Some(r) => r.child.try_wait()?.is_some(),
                None => false,
            };
            if exited {
                let st = self.stop_role(i, false)?;
                self.unexpected_exits += 1;
                self.ledger.problem(format!(
                    "{} exited on its own ({}); see its log",
                    self.specs[i].name,
                    st.map(|s| s.to_string()).unwrap_or_default()
                ));
                self.start_role(i)?;
            }
        }
        Ok(())
    }

    pub(super) fn all_ready(&self) -> bool {
        self.broker.is_some()
            && self
                .running
                .iter()
                .all(|r| r.as_ref().is_some_and(|r| r.ready_at.is_some()))
    }

    pub(super) fn check_stalls(&mut self, limit: Duration) {
        let now = Instant::now();
        for (g, group) in GROUPS.iter().enumerate() {
            if !self.stalled[g] && now.duration_since(self.last_delivery[g]) > limit {
                self.stalled[g] = true;
                self.stalls += 1;
                self.ledger.problem(format!(
                    "pipeline {group} delivered nothing for {:.0} s (stall); broker status: {}",
                    limit.as_secs_f64(),
                    self.status_json()
                        .map(|v| v.to_string())
                        .unwrap_or_else(|e| format!("{e:#}"))
                ));
            }
        }
    }

    /// The broker's domains, services and connections (as `fido status
    /// --json` lists them), asked by a probe in a child process.
    pub(super) fn status_json(&self) -> anyhow::Result<Value> {
        let mut child = Command::new(&self.exe)
            .arg("__chaos-status")
            .arg(&self.socket)
            .env(RUN_ENV, &self.token)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .context("spawning the status probe")?;
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            if child.try_wait()?.is_some() {
                break;
            }
            if Instant::now() > deadline {
                let _ = child.kill();
                let _ = child.wait();
                bail!("the status probe did not answer within 20 s");
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        let out = child.wait_with_output()?;
        if !out.status.success() {
            bail!(
                "status probe: {} {}",
                out.status,
                String::from_utf8_lossy(&out.stderr).trim()
            );
        }
        Ok(serde_json::from_slice(&out.stdout)?)
    }

    pub(super) fn kill_all(&mut self) {
        for i in 0..self.running.len() {
            let _ = self.stop_role(i, true);
        }
        let _ = self.kill_broker();
    }
}

impl Fleet {
    /// A fleet of the roles of [`specs`] for run `token` (nothing started):
    /// the broker's socket and state directory in `dir`, logs in `logs`.
    pub(super) fn new(token: &str, dir: &std::path::Path, logs: &std::path::Path, seed: u64, rate: f64) -> anyhow::Result<Fleet> {
        let (tx, rx) = mpsc::channel();
        let specs = specs(&std::process::id().to_string());
        let n = specs.len();
        Ok(Fleet {
            exe: std::env::current_exe().context("current_exe")?,
            token: token.to_string(),
            socket: dir.join("broker.sock"),
            state: dir.join("state"),
            logs: logs.to_path_buf(),
            seed,
            rate,
            specs,
            running: (0..n).map(|_| None).collect(),
            broker: None,
            broker_ready_at: None,
            tx,
            rx,
            inst_role: HashMap::new(),
            next_inst: 1,
            next_stream: 0,
            ledger: Ledger::default(),
            last_delivery: [Instant::now(); 3],
            stalled: [false; 3],
            recoveries: Vec::new(),
            recovery_domain_ms: Vec::new(),
            recovery_broker_ms: Vec::new(),
            kills: BTreeMap::new(),
            broker_restarts: 0,
            unexpected_exits: 0,
            stalls: 0,
            trace: std::env::var_os("FIDO_CHAOS_TRACE").is_some_and(|v| v == "1"),
        })
    }

    /// Starts the broker, then every role, and waits until all are ready.
    /// Returns the descriptors of the fresh broker before any domain joined.
    pub(super) fn start(&mut self) -> anyhow::Result<usize> {
        self.start_broker()?;
        std::thread::sleep(Duration::from_millis(200));
        let broker_fd0 = super::checks::fd_count(&self.broker_pid().expect("just started").to_string());
        for i in 0..self.specs.len() {
            self.start_role(i)?;
        }
        let deadline = Instant::now() + Duration::from_secs(60);
        while !self.all_ready() {
            proc::check_interrupt()?;
            self.reap_unexpected()?;
            self.pump(Duration::from_millis(20));
            if Instant::now() > deadline {
                bail!(
                    "roles not ready within 60 s (see the logs in {})",
                    self.logs.display()
                );
            }
        }
        self.last_delivery = [Instant::now(); 3];
        Ok(broker_fd0)
    }

    /// The chaos phase: for `o.seconds`, every `o.interval_ms` (seeded) kills
    /// a random role or the broker (sometimes the broker and a domain
    /// together), waits 0–300 ms and restarts it; meanwhile applies the
    /// journals, restarts what crashed on its own and watches for stalls.
    pub(super) fn unleash(&mut self, o: &Opts, seed: u64) -> anyhow::Result<()> {
        let n = self.specs.len();
        let mut rng = Rng::new(seed);
        let stall = Duration::from_secs_f64(o.stall_secs);
        let chaos_end = Instant::now() + Duration::from_secs_f64(o.seconds);
        let mut next_kill =
            Instant::now() + Duration::from_millis(rng.range(o.interval_ms.0, o.interval_ms.1));
        while Instant::now() < chaos_end {
            proc::check_interrupt()?;
            let wake = next_kill
                .min(chaos_end)
                .min(Instant::now() + Duration::from_millis(50));
            self.pump(wake.saturating_duration_since(Instant::now()));
            self.reap_unexpected()?;
            self.check_stalls(stall);
            if Instant::now() < next_kill || Instant::now() >= chaos_end {
                continue;
            }
            // Victim: one of the domains (weight 1 each) or the broker (weight 2).
            let pick = rng.below(n as u64 + 2) as usize;
            let now = Instant::now();
            let pause = Duration::from_millis(if rng.chance(0.5) {
                0
            } else {
                rng.range(1, 300)
            });
            if pick >= n {
                self.kill_broker()?;
                *self.kills.entry("broker").or_default() += 1;
                // Sometimes a domain dies while the broker is down.
                let also = if rng.chance(0.3) {
                    Some(rng.below(n as u64) as usize)
                } else {
                    None
                };
                if let Some(i) = also {
                    self.stop_role(i, true)?;
                    *self.kills.entry(self.specs[i].name).or_default() += 1;
                }
                std::thread::sleep(pause);
                self.start_broker()?;
                self.broker_restarts += 1;
                for g in 0..GROUPS.len() {
                    self.recoveries.push(Recovery {
                        group: g,
                        killed_at: now,
                        role: None,
                        broker: true,
                    });
                }
                if let Some(i) = also {
                    self.start_role(i)?;
                    self.recoveries.push(Recovery {
                        group: self.specs[i].group,
                        killed_at: now,
                        role: Some(i),
                        broker: false,
                    });
                }
            } else {
                self.stop_role(pick, true)?;
                *self.kills.entry(self.specs[pick].name).or_default() += 1;
                std::thread::sleep(pause);
                self.start_role(pick)?;
                self.recoveries.push(Recovery {
                    group: self.specs[pick].group,
                    killed_at: now,
                    role: Some(pick),
                    broker: false,
                });
            }
            next_kill =
                Instant::now() + Duration::from_millis(rng.range(o.interval_ms.0, o.interval_ms.1));
        }
        Ok(())
    }
}

/// The books once the run is over: every message's fate and the fleet's own
/// counts.
pub(super) struct Books {
    pub(super) totals: Totals,
    /// `P` records: protocol errors between honest peers.
    pub(super) protocol: u64,
    /// `A` records: inconsistent reports.
    pub(super) inconsistent: u64,
    /// The first problems, for the report.
    pub(super) problems: Vec<String>,
    pub(super) kills: BTreeMap<&'static str, u64>,
    pub(super) broker_restarts: u64,
    pub(super) unexpected_exits: u64,
    pub(super) stalls: u64,
    pub(super) recovery_domain_ms: Vec<u64>,
    pub(super) recovery_broker_ms: Vec<u64>,
}

impl Fleet {
    /// Applies the last journal records and closes the books.
    pub(super) fn close_books(&mut self) -> Books {
        self.pump(Duration::from_millis(10));
        Books {
            totals: self.ledger.totals(),
            protocol: self.ledger.protocol,
            inconsistent: self.ledger.inconsistent,
            problems: self.ledger.problems.clone(),
            kills: self.kills.clone(),
            broker_restarts: self.broker_restarts,
            unexpected_exits: self.unexpected_exits,
            stalls: self.stalls,
            recovery_domain_ms: std::mem::take(&mut self.recovery_domain_ms),
            recovery_broker_ms: std::mem::take(&mut self.recovery_broker_ms),
        }
    }
}

impl Drop for Fleet {
    fn drop(&mut self) {
        self.kill_all();
    }
}
