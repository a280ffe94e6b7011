//! What the end of a chaos run checks beyond the books: that every sender
//! drains, that no live domain keeps a dead domain's arena mapped, that every
//! process exits cleanly, and that nothing leaks — in the broker (domains,
//! services, connections, descriptors, memfds, state files) and on the host
//! (the driver's descriptors, processes of this run, `/dev/shm` entries).

use std::collections::HashSet;
use std::time::{Duration, Instant};

use anyhow::bail;
use fido_demo::proc;

use super::fleet::{Fleet, Kind};
use super::RUN_ENV;

/// The end of the drain: senders that did not drain in time, and how long the
/// drain took.
pub(super) struct Drain {
    pub(super) timeouts: u64,
    pub(super) secs: f64,
}

/// What the broker still holds once every domain is gone.
pub(super) struct BrokerLeaks {
    /// Domains (the status probe's own not counted), services and connections left.
    pub(super) state: u64,
    pub(super) state_note: String,
    /// Descriptors beyond those of a fresh broker with no domain.
    pub(super) fds: i64,
    pub(super) memfds: usize,
}

/// The host before the run, to compare with after it.
pub(super) struct HostSnapshot {
    fds: usize,
    shm: HashSet<String>,
}

/// What the run left on the host.
pub(super) struct HostLeaks {
    /// Live processes of this run.
    pub(super) procs: Vec<u32>,
    pub(super) fds_before: usize,
    pub(super) fds_after: usize,
    pub(super) memfds: usize,
    /// New `/dev/shm` entries.
    pub(super) shm: Vec<String>,
}

impl HostSnapshot {
    pub(super) fn take() -> HostSnapshot {
        HostSnapshot { fds: fd_count("self"), shm: dev_shm() }
    }

    /// Compares with now (after the run's processes were reaped and its
    /// directory removed); processes of run `token` get 2 s to disappear.
    pub(super) fn leaks(self, token: &str) -> HostLeaks {
        let procs = {
            let mut s = survivors(&token);
            let deadline = Instant::now() + Duration::from_secs(2);
            while !s.is_empty() && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(50));
                s = survivors(&token);
            }
            s
        };
        let self_fd1 = fd_count("self");
        let self_memfd = memfd_count("self");
        let shm: Vec<String> = dev_shm().difference(&self.shm).cloned().collect();
        HostLeaks {
            procs,
            fds_before: self.fds,
            fds_after: self_fd1,
            memfds: self_memfd,
            shm,
        }
    }
}

impl Fleet {
    /// Waits until every role is ready again, then tells the senders to stop
    /// (they drain: everything they sent released or reported), then the echo
    /// server; each phase gets 60 s.
    pub(super) fn drain(&mut self) -> anyhow::Result<Drain> {
        let n = self.specs.len();
        let mut drain_timeouts = 0u64;
        let deadline = Instant::now() + Duration::from_secs(60);
        while !self.all_ready() {
            proc::check_interrupt()?;
            self.reap_unexpected()?;
            self.pump(Duration::from_millis(20));
            if Instant::now() > deadline {
                bail!("roles not ready again within 60 s after the chaos phase");
            }
        }
        let t_drain = Instant::now();
        let senders: Vec<usize> = (0..n).filter(|&i| self.specs[i].kind.resends()).collect();
        let servers: Vec<usize> = (0..n)
            .filter(|&i| self.specs[i].kind == Kind::EchoServer)
            .collect();
        for phase in [&senders, &servers] {
            for &i in phase.iter() {
                self.send_cmd(i, "stop");
            }
            let deadline = Instant::now() + Duration::from_secs(60);
            loop {
                proc::check_interrupt()?;
                self.pump(Duration::from_millis(20));
                self.reap_unexpected()?;
                let pending: Vec<usize> = phase
                    .iter()
                    .copied()
                    .filter(|&i| !self.running[i].as_ref().is_some_and(|r| r.done))
                    .collect();
                if pending.is_empty() {
                    break;
                }
                // A role restarted after a crash meanwhile must hear it too.
                for &i in &pending {
                    self.send_cmd(i, "stop");
                }
                if Instant::now() > deadline {
                    for &i in &pending {
                        drain_timeouts += 1;
                        self.ledger.problem(format!(
                            "{} did not drain within 60 s (messages still in flight: a hang?)",
                            self.specs[i].name
                        ));
                    }
                    break;
                }
            }
        }
        let drain_secs = t_drain.elapsed().as_secs_f64();
        Ok(Drain {
            timeouts: drain_timeouts,
            secs: drain_secs,
        })
    }

    /// After the drain nothing is in flight, so no domain has a reason to map
    /// an arena whose owner is gone: lists (and reports) those still mapped.
    pub(super) fn stale_mappings(&mut self) -> Vec<String> {
        let n = self.specs.len();
        let mut stale: Vec<String>;
        let deadline = Instant::now() + Duration::from_secs(3);
        loop {
            self.pump(Duration::from_millis(100));
            let pids: Vec<(&'static str, u32)> = (0..n)
                .filter_map(|i| {
                    self.running[i]
                        .as_ref()
                        .map(|r| (self.specs[i].name, r.child.id()))
                })
                .collect();
            stale = stale_mappings(&pids);
            if stale.is_empty() || Instant::now() > deadline {
                break;
            }
        }
        for s in &stale {
            self.ledger
                .problem(format!("dead domain's arena still mapped: {s}"));
        }
        stale
    }

    /// Tells every role to exit and reaps it (15 s in all; killed after);
    /// returns how many did not exit cleanly.
    pub(super) fn exit_roles(&mut self) -> anyhow::Result<u64> {
        let n = self.specs.len();
        let mut bad_exits = 0u64;
        for i in 0..n {
            self.send_cmd(i, "exit");
        }
        let deadline = Instant::now() + Duration::from_secs(15);
        for i in 0..n {
            loop {
                self.pump(Duration::from_millis(10));
                let exited = match self.running[i].as_mut() {
                    Some(r) => r.child.try_wait()?.is_some(),
                    None => true,
                };
                if exited || Instant::now() > deadline {
                    let st = self.stop_role(i, !exited)?;
                    if !exited {
                        bad_exits += 1;
                        self.ledger.problem(format!(
                            "{} did not exit within 15 s of `exit`; killed",
                            self.specs[i].name
                        ));
                    } else if let Some(st) = st.filter(|s| !s.success()) {
                        bad_exits += 1;
                        self.ledger
                            .problem(format!("{} exited with {st}", self.specs[i].name));
                    }
                    break;
                }
            }
        }
        self.pump(Duration::from_millis(50));
        Ok(bad_exits)
    }

    /// Once every domain is gone: what the broker still lists (asked with the
    /// status probe), and its descriptors and memfds against `fd0`, those of
    /// the fresh broker; retried for up to 10 s while anything is left.
    pub(super) fn broker_leaks(&mut self, fd0: usize) -> BrokerLeaks {
        let bpid = self.broker_pid().map(|p| p.to_string()).unwrap_or_default();
        let mut broker_state: u64;
        let mut broker_state_note: String;
        let mut broker_fds: i64;
        let mut broker_memfds: usize;
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            match self.status_json() {
                Ok(v) => {
                    let len = |k: &str| v[k].as_array().map(|a| a.len()).unwrap_or(0);
                    // `fido status` itself is one domain.
                    let (d, s, c) = (
                        len("domains").saturating_sub(1),
                        len("services"),
                        len("connections"),
                    );
                    broker_state = (d + s + c) as u64;
                    broker_state_note = format!("{d} domains, {s} services, {c} connections left");
                }
                Err(e) => {
                    broker_state = 1;
                    broker_state_note = format!("status failed: {e:#}");
                }
            }
            // Let the broker see the status domain go.
            std::thread::sleep(Duration::from_millis(300));
            broker_fds = fd_count(&bpid) as i64 - fd0 as i64;
            broker_memfds = memfd_count(&bpid);
            if (broker_state == 0 && broker_fds <= 0 && broker_memfds == 0) || Instant::now() > deadline
            {
                break;
            }
        }
        BrokerLeaks {
            state: broker_state,
            state_note: broker_state_note,
            fds: broker_fds,
            memfds: broker_memfds,
        }
    }

    /// Stops the broker with SIGTERM (10 s, then killed); whether it exited
    /// with success.
    pub(super) fn stop_broker(&mut self) -> anyhow::Result<bool> {
        let mut broker_exit_ok = false;
        if let Some(mut c) = self.broker.take() {
            if let Some(p) = rustix::process::Pid::from_raw(c.id() as i32) {
                let _ = rustix::process::kill_process(p, rustix::process::Signal::TERM);
            }
            let deadline = Instant::now() + Duration::from_secs(10);
            loop {
                if let Some(st) = c.try_wait()? {
                    broker_exit_ok = st.success();
                    if !broker_exit_ok {
                        self.ledger
                            .problem(format!("the broker exited with {st} on SIGTERM"));
                    }
                    break;
                }
                if Instant::now() > deadline {
                    let _ = c.kill();
                    let _ = c.wait();
                    self.ledger
                        .problem("the broker did not stop within 10 s of SIGTERM".into());
                    break;
                }
                std::thread::sleep(Duration::from_millis(10));
            }
        }
        Ok(broker_exit_ok)
    }

    /// Files the stopped broker left in its state directory besides the lock
    /// and the registry's own (the database, its id marks and its reserve for
    /// a full disk: docs/OPERATIONS.md), and its socket if still there.
    pub(super) fn state_files(&self) -> Vec<String> {
        let mut state_files: Vec<String> = std::fs::read_dir(&self.state)
            .map(|d| {
                d.flatten()
                    .map(|e| e.file_name().to_string_lossy().into_owned())
                    .collect()
            })
            .unwrap_or_default();
        state_files.retain(|n| {
            !matches!(n.as_str(), "broker.lock" | "registry.ids" | "registry.reserve")
                && !n.starts_with("registry.sqlite")
        });
        if self.socket.exists() {
            state_files.push(self.socket.display().to_string());
        }
        state_files
    }
}

pub(super) fn fd_count(pid: &str) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .map(|d| d.count())
        .unwrap_or(0)
}

fn memfd_count(pid: &str) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .map(|d| {
            d.flatten()
                .filter(|e| {
                    std::fs::read_link(e.path())
                        .is_ok_and(|l| l.to_string_lossy().starts_with("/memfd:"))
                })
                .count()
        })
        .unwrap_or(0)
}

/// Arenas mapped read-only by a role whose owner is not a live role: the
/// arena of a dead domain kept alive (its memory is not freed while mapped).
/// A domain's own arena is its one `rw-s` mapping of a `memfd:fido-arena`;
/// a peer's is `r--s` of the same inode.
fn stale_mappings(pids: &[(&str, u32)]) -> Vec<String> {
    let mut own: HashSet<String> = HashSet::new();
    let mut peers: Vec<(String, String, String)> = Vec::new();
    for (name, pid) in pids {
        let Ok(maps) = std::fs::read_to_string(format!("/proc/{pid}/maps")) else {
            continue;
        };
        for l in maps.lines().filter(|l| l.contains("memfd:fido-arena")) {
            let f: Vec<&str> = l.split_whitespace().collect();
            if f.len() < 5 {
                continue;
            }
            let (range, perms, inode) = (f[0], f[1], f[4]);
            if perms.starts_with("rw") {
                own.insert(inode.to_string());
            } else {
                peers.push((name.to_string(), range.to_string(), inode.to_string()));
            }
        }
    }
    peers
        .into_iter()
        .filter(|(_, _, ino)| !own.contains(ino))
        .map(|(name, range, ino)| {
            format!("{name} maps {range} (memfd inode {ino}), owned by no live domain")
        })
        .collect()
}

fn dev_shm() -> HashSet<String> {
    std::fs::read_dir("/dev/shm")
        .map(|d| {
            d.flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default()
}

/// Live processes carrying `RUN_ENV=token`, or whose parent is us.
fn survivors(token: &str) -> Vec<u32> {
    let me = std::process::id();
    let needle = format!("{RUN_ENV}={token}");
    let mut out = Vec::new();
    for e in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Some(pid) = e.file_name().to_str().and_then(|s| s.parse::<u32>().ok()) else {
            continue;
        };
        if pid == me {
            continue;
        }
        let tagged = std::fs::read(e.path().join("environ"))
            .is_ok_and(|env| env.split(|b| *b == 0).any(|v| v == needle.as_bytes()));
        let child = std::fs::read_to_string(e.path().join("stat")).is_ok_and(|s| {
            // pid (comm) state ppid ...
            s.rsplit_once(')')
                .and_then(|(_, r)| r.split_whitespace().nth(1).map(|p| p == me.to_string()))
                .unwrap_or(false)
        });
        if tagged || child {
            out.push(pid);
        }
    }
    out
}
