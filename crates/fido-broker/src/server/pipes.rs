//! The pipe requests of the control protocol, on the broker's main loop.
//!
//! Here descriptors are checked (type, access mode, `O_APPEND`; never blocking
//! calls), pipes are recorded per domain under its quota, operations are
//! checked against the pipe's descriptor kinds and handed to the engine
//! (the `fido-pipe-engine` crate); the engine's results come back through an eventfd in the
//! main epoll set and are sent as the replies of the `PipeRun`/`PipeOnce`
//! requests. Nothing here moves a byte.

use std::collections::{BTreeMap, HashMap};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::sync::Arc;

use fido_proto::{DomainId, ErrorCode, PipeFdKind, PipeId, PipeOp, Reply, Request};

use fido_pipe_engine::{check_fd, check_op, check_overlap, Caller, Engine, JobSpec, StartError};

use super::{err, Handled, Server};

struct PipeRec {
    domain: DomainId,
    src: Arc<OwnedFd>,
    dst: Arc<OwnedFd>,
    src_kind: PipeFdKind,
    dst_kind: PipeFdKind,
    /// The engine job running on it, if any.
    job: Option<u64>,
}

struct JobRec {
    domain: DomainId,
    req: u64,
    pipe: Option<PipeId>,
}

/// The broker's pipe bookkeeping (part of [`Server`]).
pub(crate) struct PipeState {
    pub(crate) engine: Engine,
    pipes: BTreeMap<PipeId, PipeRec>,
    jobs: HashMap<u64, JobRec>,
    /// Weights set live with `PipeWeight`, overriding the policy rule's.
    weights: HashMap<DomainId, u32>,
    next_pipe: PipeId,
    next_job: u64,
}

impl PipeState {
    pub(crate) fn new(cfg: &crate::Config) -> Result<PipeState, crate::BrokerError> {
        let engine = Engine::start(cfg.pipe.clone()).map_err(|e| match e {
            StartError::Sys { what, source } => crate::BrokerError::Sys { what, source },
            StartError::Thread(source) => crate::BrokerError::Io {
                path: "<pipe engine thread>".into(),
                source,
            },
        })?;
        Ok(PipeState {
            engine,
            pipes: BTreeMap::new(),
            jobs: HashMap::new(),
            weights: HashMap::new(),
            next_pipe: 1,
            next_job: 1,
        })
    }

    /// `dom`'s pipe `pipe`. Another domain's pipe answers exactly as a missing
    /// one does, so ids reveal nothing across domains.
    fn owned(&self, dom: DomainId, pipe: PipeId) -> Result<&PipeRec, fido_proto::RemoteError> {
        self.pipes
            .get(&pipe)
            .filter(|p| p.domain == dom)
            .ok_or_else(|| {
                err(
                    ErrorCode::NoSuchPipe,
                    format!("no pipe {pipe} in this domain"),
                )
            })
    }

    /// Pipes and running one-shot operations of `dom` (what its quota counts).
    fn held(&self, dom: DomainId) -> u64 {
        let pipes = self.pipes.values().filter(|p| p.domain == dom).count();
        let once = self
            .jobs
            .values()
            .filter(|j| j.domain == dom && j.pipe.is_none())
            .count();
        (pipes + once) as u64
    }
}

fn two_fds(
    what: &str,
    mut fds: Vec<OwnedFd>,
) -> Result<(OwnedFd, OwnedFd), fido_proto::RemoteError> {
    if fds.len() != 2 {
        return Err(err(
            ErrorCode::BadDescriptor,
            format!(
                "{what} carries exactly two descriptors (source, then sink); got {}",
                fds.len()
            ),
        ));
    }
    let dst = fds.pop().expect("two");
    let src = fds.pop().expect("two");
    Ok((src, dst))
}

fn kinds(
    src: &OwnedFd,
    dst: &OwnedFd,
) -> Result<(PipeFdKind, PipeFdKind), fido_proto::RemoteError> {
    let bad = |m: String| err(ErrorCode::BadDescriptor, m);
    Ok((
        check_fd(src.as_fd(), true).map_err(bad)?,
        check_fd(dst.as_fd(), false).map_err(bad)?,
    ))
}

/// The supplementary groups of the process that connected `sock`, as the
/// kernel recorded them then (`SO_PEERGROUPS`); none if it cannot say, which
/// only makes the engine's writes for that caller stricter.
fn peer_groups(sock: BorrowedFd<'_>) -> Vec<u32> {
    let mut groups = vec![0u32; 32];
    loop {
        let mut len = std::mem::size_of_val(groups.as_slice()) as libc::socklen_t;
        // SAFETY: `groups` has `len` writable bytes; the kernel writes at
        // most that many and sets `len` to what it wrote (or, with ERANGE,
        // to what it needs).
        let r = unsafe {
            libc::getsockopt(
                sock.as_raw_fd(),
                libc::SOL_SOCKET,
                libc::SO_PEERGROUPS,
                groups.as_mut_ptr().cast(),
                &mut len,
            )
        };
        let needed = len as usize / std::mem::size_of::<u32>();
        if r == 0 {
            groups.truncate(needed);
            return groups;
        }
        let range = std::io::Error::last_os_error().raw_os_error() == Some(libc::ERANGE);
        if !range || needed <= groups.len() || needed > 65_536 {
            return Vec::new();
        }
        groups.resize(needed, 0);
    }
}

/// A pidfd for the process that connected `sock` (`SO_PEERPIDFD`): it names
/// that process, not whichever holds its pid number later.
fn peer_pidfd(sock: BorrowedFd<'_>) -> std::io::Result<OwnedFd> {
    let mut fd: libc::c_int = -1;
    let mut len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
    // SAFETY: `fd` is a writable c_int and `len` says so.
    let r = unsafe {
        libc::getsockopt(
            sock.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_PEERPIDFD,
            (&mut fd as *mut libc::c_int).cast(),
            &mut len,
        )
    };
    if r != 0 || fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: the kernel just gave us this new descriptor; nothing else owns it.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// `pid`'s soft RLIMIT_FSIZE (`None`: unlimited), from `/proc/PID/limits`
/// (`prlimit` would need `CAP_SYS_RESOURCE`, which a broker confined to
/// fewer capabilities may lack; the file is readable by all).
fn fsize_limit_of(pid: i32) -> std::io::Result<Option<u64>> {
    let limits = std::fs::read_to_string(format!("/proc/{pid}/limits"))?;
    let bad = || std::io::Error::new(std::io::ErrorKind::InvalidData, "no \"Max file size\" line");
    let soft = limits
        .lines()
        .find_map(|l| l.strip_prefix("Max file size"))
        .and_then(|rest| rest.split_whitespace().next())
        .ok_or_else(bad)?;
    if soft == "unlimited" {
        return Ok(None);
    }
    soft.parse().map(Some).map_err(|_| bad())
}

impl Server {
    /// Whom a transfer of client `key` is for: the engine reads and writes
    /// with these credentials (the peer's, as the kernel reported them).
    fn pipe_caller(&self, key: u64) -> Caller {
        match self.clients.get(&key) {
            Some(c) => Caller {
                uid: c.uid,
                gid: c.gid,
                groups: peer_groups(c.sock.as_fd()),
            },
            // Unreachable (requests come from clients); the least privilege.
            None => Caller {
                uid: u32::MAX - 1,
                gid: u32::MAX - 1,
                groups: Vec::new(),
            },
        }
    }

    /// The file size limit of the process that connected client `key`, read
    /// now, for a transfer into a file: the engine writes nothing past it.
    /// The process must still be the one that connected (a pidfd taken from
    /// the socket says so), or the limit read could be another process's.
    fn caller_fsize_limit(&self, key: u64) -> Result<Option<u64>, fido_proto::RemoteError> {
        let denied = |m: String| err(ErrorCode::Denied, m);
        let Some(c) = self.clients.get(&key) else {
            return Err(denied("no such client".into()));
        };
        let gone = |why: String| {
            denied(format!(
                "the engine cannot read the file size limit of the process that \
                 connected (pid {}: {why}), so it writes no file for this connection",
                c.pid
            ))
        };
        let pidfd = match peer_pidfd(c.sock.as_fd()) {
            Ok(fd) => Some(fd),
            Err(e) if e.raw_os_error() == Some(libc::ENOPROTOOPT) => None,
            Err(e) => return Err(gone(format!("pidfd: {e}"))),
        };
        let limit = fsize_limit_of(c.pid).map_err(|e| gone(format!("its limits: {e}")))?;
        match pidfd {
            // A pidfd becomes readable when its process exits: still alive
            // now, so the pid read above was that process's.
            Some(fd) => {
                let mut fds = [rustix::event::PollFd::new(
                    &fd,
                    rustix::event::PollFlags::IN,
                )];
                let zero = rustix::time::Timespec {
                    tv_sec: 0,
                    tv_nsec: 0,
                };
                if rustix::event::poll(&mut fds, Some(&zero)).map_or(true, |n| n > 0) {
                    return Err(gone("it has exited".into()));
                }
            }
            // A kernel without SO_PEERPIDFD (before 6.5): at least the
            // process is the caller's uid's.
            None => {
                let status = std::fs::read_to_string(format!("/proc/{}/status", c.pid))
                    .map_err(|e| gone(format!("/proc: {e}")))?;
                let uid = status
                    .lines()
                    .find_map(|l| l.strip_prefix("Uid:"))
                    .and_then(|v| v.split_whitespace().next()?.parse::<u32>().ok());
                if uid != Some(c.uid) {
                    return Err(gone("it has exited".into()));
                }
            }
        }
        Ok(limit)
    }

    fn pipe_weight_of(&self, dom: DomainId) -> u32 {
        self.pipes.weights.get(&dom).copied().unwrap_or_else(|| {
            self.domains
                .get(&dom)
                .map_or(crate::policy::DEFAULT_PIPE_WEIGHT, |d| d.rule.pipe_weight)
        })
    }

    fn pipe_quota(&self, dom: DomainId) -> Result<(), fido_proto::RemoteError> {
        let limit = self.domains.get(&dom).map_or(0, |d| d.rule.quotas.pipes);
        let held = self.pipes.held(dom);
        if held >= limit {
            return Err(self.quota(
                dom,
                format!("too many pipes: this domain holds {held} (limit {limit})"),
            ));
        }
        self.check_uid_quota(
            dom,
            "pipes",
            |s, uid| {
                let doms = s.domains.iter().filter(|(_, d)| d.uid == uid);
                doms.map(|(id, _)| s.pipes.held(*id)).sum()
            },
            |q| q.pipes,
        )
    }

    #[allow(clippy::too_many_arguments)]
    fn pipe_start(
        &mut self,
        key: u64,
        dom: DomainId,
        req: u64,
        pipe: Option<PipeId>,
        src: Arc<OwnedFd>,
        dst: Arc<OwnedFd>,
        op: PipeOp,
    ) -> Result<(), fido_proto::RemoteError> {
        let fsize_limit = if op.sink_is_file() {
            // The broker's own limit too: a write past it would stop the
            // broker itself with SIGXFSZ.
            let own = rustix::process::getrlimit(rustix::process::Resource::Fsize).current;
            match (self.caller_fsize_limit(key)?, own) {
                (Some(a), Some(b)) => Some(a.min(b)),
                (a, b) => a.or(b),
            }
        } else {
            None
        };
        let caller = self.pipe_caller(key);
        let id = self.pipes.next_job;
        self.pipes.next_job += 1;
        self.pipes.jobs.insert(
            id,
            JobRec {
                domain: dom,
                req,
                pipe,
            },
        );
        if let Some(p) = pipe.and_then(|p| self.pipes.pipes.get_mut(&p)) {
            p.job = Some(id);
        }
        let weight = self.pipe_weight_of(dom);
        tracing::debug!(domain = dom, job = id, ?pipe, ?op, "pipe operation started");
        self.pipes.engine.submit(JobSpec {
            id,
            domain: dom,
            weight,
            src,
            dst,
            op,
            caller,
            fsize_limit,
        });
        Ok(())
    }

    /// Handles `PipeCreate`, `PipeRun`, `PipeOnce`, `PipeCancel`, `PipeDestroy`, `PipeWeight`.
    pub(super) fn pipe_request(
        &mut self,
        key: u64,
        dom: DomainId,
        req: u64,
        body: Request,
        fds: Vec<OwnedFd>,
    ) -> Handled {
        if let (
            Some(why),
            Request::PipeCreate | Request::PipeRun { .. } | Request::PipeOnce { .. },
        ) = (self.pipes.engine.unavailable(), &body)
        {
            return Err(err(ErrorCode::Unavailable, why.to_string()));
        }
        match body {
            Request::PipeCreate => self.pipe_create(dom, fds),
            Request::PipeRun { pipe, op } => self.pipe_run(key, dom, req, pipe, op),
            Request::PipeOnce { op } => {
                let (src, dst) = two_fds("PipeOnce", fds)?;
                self.pipe_quota(dom)?;
                let (sk, dk) = kinds(&src, &dst)?;
                check_op(&op, sk, dk).map_err(|m| err(ErrorCode::BadDescriptor, m))?;
                check_overlap(&op, src.as_fd(), dst.as_fd())
                    .map_err(|m| err(ErrorCode::BadRequest, m))?;
                self.pipe_start(key, dom, req, None, Arc::new(src), Arc::new(dst), op)?;
                Ok(None)
            }
            Request::PipeCancel { pipe } => {
                let p = self.pipes.owned(dom, pipe)?;
                if let Some(job) = p.job {
                    self.pipes.engine.cancel(job);
                }
                Ok(Some((Reply::Ok, Vec::new())))
            }
            Request::PipeDestroy { pipe } => self.pipe_destroy(dom, pipe),
            Request::PipeWeight { domain, weight } => self.pipe_weight(key, dom, &domain, weight),
            other => Err(err(
                ErrorCode::BadRequest,
                format!("not a pipe request: {other:?}"),
            )),
        }
    }

    fn pipe_create(&mut self, dom: DomainId, fds: Vec<OwnedFd>) -> Handled {
        let (src, dst) = two_fds("PipeCreate", fds)?;
        self.pipe_quota(dom)?;
        let (src_kind, dst_kind) = kinds(&src, &dst)?;
        let pipe = self.pipes.next_pipe;
        self.pipes.next_pipe += 1;
        self.pipes.pipes.insert(
            pipe,
            PipeRec {
                domain: dom,
                src: Arc::new(src),
                dst: Arc::new(dst),
                src_kind,
                dst_kind,
                job: None,
            },
        );
        tracing::debug!(domain = dom, pipe, ?src_kind, ?dst_kind, "pipe created");
        Ok(Some((
            Reply::PipeCreated {
                pipe,
                source: src_kind,
                sink: dst_kind,
            },
            Vec::new(),
        )))
    }

    fn pipe_run(&mut self, key: u64, dom: DomainId, req: u64, pipe: PipeId, op: PipeOp) -> Handled {
        let p = self.pipes.owned(dom, pipe)?;
        if p.job.is_some() {
            return Err(err(
                ErrorCode::Busy,
                format!("pipe {pipe} already runs an operation; one at a time per pipe"),
            ));
        }
        check_op(&op, p.src_kind, p.dst_kind).map_err(|m| err(ErrorCode::BadDescriptor, m))?;
        check_overlap(&op, p.src.as_fd(), p.dst.as_fd())
            .map_err(|m| err(ErrorCode::BadRequest, m))?;
        let (src, dst) = (p.src.clone(), p.dst.clone());
        self.pipe_start(key, dom, req, Some(pipe), src, dst, op)?;
        Ok(None)
    }

    fn pipe_destroy(&mut self, dom: DomainId, pipe: PipeId) -> Handled {
        self.pipes.owned(dom, pipe)?;
        let p = self.pipes.pipes.remove(&pipe).expect("checked");
        if let Some(job) = p.job {
            // Its PipeRun is answered (Cancelled) when the engine lets go;
            // the engine holds its own references to the descriptors.
            if let Some(j) = self.pipes.jobs.get_mut(&job) {
                j.pipe = None;
            }
            self.pipes.engine.cancel(job);
        }
        tracing::debug!(domain = dom, pipe, "pipe destroyed");
        Ok(Some((Reply::Ok, Vec::new())))
    }

    /// `PipeWeight` (for root or the broker's uid): `domain` is an id or a
    /// name (every live domain of that name).
    fn pipe_weight(&mut self, key: u64, dom: DomainId, domain: &str, weight: u32) -> Handled {
        let (uid, pid) = self
            .clients
            .get(&key)
            .map_or((u32::MAX, 0), |c| (c.uid, c.pid));
        let me = rustix::process::geteuid().as_raw();
        if uid != 0 && uid != me {
            return Err(self.deny(
                dom,
                format!("setting pipe weights is for root or the broker's uid {me} (caller uid {uid}, pid {pid})"),
            ));
        }
        let targets: Vec<DomainId> = match domain.parse::<DomainId>() {
            Ok(id) if self.domains.contains_key(&id) => vec![id],
            _ => self
                .domains
                .iter()
                .filter(|(_, d)| d.name == domain)
                .map(|(id, _)| *id)
                .collect(),
        };
        if targets.is_empty() {
            return Err(err(
                ErrorCode::NoSuchDomain,
                format!("no live domain with id or name {domain:?}"),
            ));
        }
        for t in targets {
            self.pipes.weights.insert(t, weight);
            self.pipes.engine.set_weight(t, weight);
            tracing::info!(domain = t, weight, by = dom, "pipe weight set");
        }
        Ok(Some((Reply::Ok, Vec::new())))
    }

    /// Answers the requests whose transfers the engine finished.
    pub(super) fn pipe_completions(&mut self) {
        for done in self.pipes.engine.completions() {
            let Some(j) = self.pipes.jobs.remove(&done.id) else {
                continue;
            };
            if let Some(p) = j.pipe.and_then(|p| self.pipes.pipes.get_mut(&p)) {
                if p.job == Some(done.id) {
                    p.job = None;
                }
            }
            tracing::debug!(domain = j.domain, job = done.id, result = ?done.result, "pipe operation ended");
            self.reply_to_domain(
                j.domain,
                j.req,
                Ok(Reply::PipeDone(done.result)),
                Vec::new(),
            );
        }
    }

    /// The policy was reloaded: domains' rules may give new pipe weights
    /// (weights set live with `PipeWeight` stay). Pipes over a lowered quota
    /// are kept; new ones are refused until the domain is under it.
    pub(super) fn pipe_policy_reloaded(&mut self) {
        let updates: Vec<(DomainId, u32)> = self
            .domains
            .iter()
            .filter(|(id, _)| !self.pipes.weights.contains_key(id))
            .map(|(id, d)| (*id, d.rule.pipe_weight))
            .collect();
        for (dom, w) in updates {
            self.pipes.engine.set_weight(dom, w);
        }
    }

    /// A domain died or left: its pipes go, its transfers are cancelled.
    pub(super) fn pipe_domain_gone(&mut self, dom: DomainId) {
        let n = self.pipes.pipes.len();
        self.pipes.pipes.retain(|_, p| p.domain != dom);
        let dropped = n - self.pipes.pipes.len();
        self.pipes.weights.remove(&dom);
        self.pipes.engine.forget(dom);
        if dropped > 0 {
            tracing::info!(
                domain = dom,
                pipes = dropped,
                "pipes of a departed domain cancelled"
            );
        }
    }

    /// Pipe engine settings and per-domain figures for `Status`.
    pub(super) fn pipe_status(
        &self,
    ) -> (
        Option<fido_proto::PipeEngineStatus>,
        Vec<fido_proto::PipeDomainStatus>,
    ) {
        if self.pipes.engine.unavailable().is_some() {
            return (None, Vec::new());
        }
        let (engine, mut doms) = self.pipes.engine.status();
        for d in doms.iter_mut() {
            d.pipes = self
                .pipes
                .pipes
                .values()
                .filter(|p| p.domain == d.domain)
                .count() as u32;
        }
        // Domains holding pipes the engine has not seen work from yet.
        let mut idle: BTreeMap<DomainId, u32> = BTreeMap::new();
        for p in self.pipes.pipes.values() {
            if !doms.iter().any(|d| d.domain == p.domain) {
                *idle.entry(p.domain).or_default() += 1;
            }
        }
        for (domain, pipes) in idle {
            doms.push(fido_proto::PipeDomainStatus {
                domain,
                weight: self.pipe_weight_of(domain),
                credits: 0,
                bytes_per_s: 0,
                bytes_total: 0,
                pipes,
                running: 0,
            });
        }
        doms.sort_by_key(|d| d.domain);
        (Some(engine), doms)
    }
}
