//! `fido-bench rpc`: fido-rpc against a raw Unix-socket request/response, tarpc,
//! capnp-rpc, tonic and XML-RPC, in one invocation. `crate::rpc` has the
//! method, the baselines and the driver; this module adds the `fido` system —
//! the same calls as the baselines, declared with `#[fido_rpc::service]` over
//! the paper's Table 2 types — its server and client processes
//! (`fido-bench __bench-peer fido rpc-server|rpc-client ...`, each its own domain of an
//! embedded broker) and the report.
//!
//! * Arguments are built in the client's arena (a `Frame`), results in the
//!   server's; the call carries handles; nothing is serialized or copied by the
//!   transport. Building the arguments (every element, fresh per call) and the
//!   frame allocation are part of each call's time, as for the baselines.
//! * `null-notified`: client and server wait with `WaitStrategy::Block`;
//!   `null-polled`: `BusyPoll` on both ends. Sequence and file cases use the
//!   domain default (`Adaptive`: spin 50 µs, then sleep) and ring (64
//!   entries).
//! * Case study: `fido_examples::services::files` (the fido-rpc crate's caching file
//!   server; a read is a view of the server's cache) against the same service
//!   over tonic.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{bail, Context as _};
use bytemuck::{Pod, Zeroable};
use fido::{Domain, JoinOptions, PeerSlice, PeerSliceOf, WaitStrategy};
use crate::rpc::data::{self, Dir, Seq};
use crate::rpc::{self, files, Case, RpcClient, RpcSystem, Timing};
use crate::{Opts, PeerArgs};
use fido_examples::services::files::{FileServer, FilesClient as FidoFilesClient, FilesServer};
use fido_rpc::{Ctx, Fault, RpcError, Server, ServerOptions, ShmSlice, ShmStr};

use fido_demo::proc::{self, EmbeddedBroker};

/// A FixedSeq element: the paper's `struct { int i; int j; double d; }`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
pub struct FFixed {
    pub i: i32,
    pub j: i32,
    pub d: f64,
}

/// A VarSeq element: the paper's `struct { char *s; double d; }` (the string in
/// the sender's arena).
#[repr(C)]
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
pub struct FVar {
    pub d: f64,
    pub s: ShmStr,
}

/// A received sequence and the checksum the server computed while building it.
#[repr(C)]
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
pub struct BytesReply {
    pub data: ShmSlice<u8>,
    pub sum: u64,
}

#[repr(C)]
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
pub struct FixedReply {
    pub data: ShmSlice<FFixed>,
    pub sum: u64,
}

#[repr(C)]
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
pub struct VarReply {
    pub data: ShmSlice<FVar>,
    pub sum: u64,
}

/// The benchmark service: the same calls as the baselines' schemas
/// (bench/proto/bench.proto, bench.capnp).
#[fido_rpc::service]
pub trait RpcBench: Send + Sync + 'static {
    fn null(&self, cx: &mut Ctx<'_>);
    fn send_bytes(&self, cx: &mut Ctx<'_>, data: ShmSlice<u8>) -> Result<u64, Fault>;
    fn send_fixed(&self, cx: &mut Ctx<'_>, data: ShmSlice<FFixed>) -> Result<u64, Fault>;
    fn send_var(&self, cx: &mut Ctx<'_>, data: ShmSlice<FVar>) -> Result<u64, Fault>;
    fn recv_bytes(&self, cx: &mut Ctx<'_>, len: u64, seed: u64) -> Result<BytesReply, Fault>;
    fn recv_fixed(&self, cx: &mut Ctx<'_>, len: u64, seed: u64) -> Result<FixedReply, Fault>;
    fn recv_var(&self, cx: &mut Ctx<'_>, len: u64, seed: u64) -> Result<VarReply, Fault>;
}

/// Largest LEN the server builds (10× the largest case).
const MAX_LEN: u64 = 100_000_000;

struct Impl;

fn mem(e: RpcError) -> Fault {
    tracing::warn!("rpc bench reply: {e}");
    Fault::ServerMemory
}

fn check_len(len: u64) -> Result<usize, Fault> {
    if len > MAX_LEN {
        return Err(Fault::Refused);
    }
    Ok(len as usize)
}

fn fixed_of(f: &FFixed) -> data::Fixed {
    data::Fixed {
        i: f.i,
        j: f.j,
        d: f.d,
    }
}

/// Builds the FixedSeq of `seed` straight into `frame`; returns its handle
/// and checksum.
fn build_fixed(frame: &mut fido_rpc::Frame, len: usize, seed: u64) -> Result<(ShmSlice<FFixed>, u64), RpcError> {
    let mut s = 0u64;
    let h = frame.fill_slice(len, |k| {
        let f = data::fixed_at(seed, k);
        s = s.wrapping_add(data::fixed_sum(&f));
        FFixed { i: f.i, j: f.j, d: f.d }
    })?;
    Ok((h, s))
}

/// Builds the VarSeq of `seed` in `frame` (each string in the frame too);
/// returns its handle and checksum.
fn build_var(
    frame: &mut fido_rpc::Frame,
    len: usize,
    seed: u64,
) -> Result<(ShmSlice<FVar>, u64), RpcError> {
    let mut s = 0u64;
    let h = frame.slice_with(len, |k, f| {
        let st = data::var_str_at(seed, k);
        let d = data::var_d_at(k);
        s = s.wrapping_add(data::var_sum(&st, d));
        let b = f.bytes(&st)?;
        Ok(FVar {
            d,
            s: ShmStr {
                addr: b.addr(),
                len: b.len(),
            },
        })
    })?;
    Ok((h, s))
}

fn sum_var(v: &fido_rpc::View<'_>, seq: PeerSliceOf<'_, FVar>) -> Result<u64, Fault> {
    let mut s = 0u64;
    for e in seq.iter() {
        s = s.wrapping_add(var_sum_view(v.str(e.s)?.as_bytes(), e.d)?);
    }
    Ok(s)
}

/// `data::var_sum` of a string read in place. The strings are `VAR_STR`
/// bytes, one chunk of [`PeerSlice::read_chunks`]; a longer one is refused.
fn var_sum_view(s: PeerSlice<'_>, d: f64) -> Result<u64, Fault> {
    if s.len() > fido::READ_CHUNK {
        return Err(Fault::BadArguments);
    }
    let mut sum = data::var_sum(&[], d);
    s.read_chunks(|c| sum = data::var_sum(c, d));
    Ok(sum)
}

/// `data::sum_bytes` of bytes read in place, chunk by chunk (the sum is
/// additive).
fn sum_bytes_view(d: PeerSliceOf<'_, u8>) -> u64 {
    let mut s = 0u64;
    d.as_bytes().read_chunks(|c| s = s.wrapping_add(data::sum_bytes(c)));
    s
}

impl RpcBench for Impl {
    fn null(&self, _cx: &mut Ctx<'_>) {}

    fn send_bytes(&self, cx: &mut Ctx<'_>, d: ShmSlice<u8>) -> Result<u64, Fault> {
        Ok(data::server_sum(sum_bytes_view(cx.slice(d)?)))
    }

    fn send_fixed(&self, cx: &mut Ctx<'_>, d: ShmSlice<FFixed>) -> Result<u64, Fault> {
        let s = cx
            .slice(d)?
            .iter()
            .fold(0u64, |a, f| a.wrapping_add(data::fixed_sum(&fixed_of(&f))));
        Ok(data::server_sum(s))
    }

    fn send_var(&self, cx: &mut Ctx<'_>, d: ShmSlice<FVar>) -> Result<u64, Fault> {
        let v = cx.view();
        Ok(data::server_sum(sum_var(&v, v.slice(d)?)?))
    }

    fn recv_bytes(&self, cx: &mut Ctx<'_>, len: u64, seed: u64) -> Result<BytesReply, Fault> {
        let n = Seq::Byte.elements(check_len(len)?);
        let (h, dst) = cx.frame().map_err(mem)?.alloc_slice::<u8>(n).map_err(mem)?;
        let s = data::fill_bytes(dst, seed);
        Ok(BytesReply {
            data: h,
            sum: data::server_sum(s),
        })
    }

    fn recv_fixed(&self, cx: &mut Ctx<'_>, len: u64, seed: u64) -> Result<FixedReply, Fault> {
        let n = check_len(len)?;
        let (h, s) = build_fixed(cx.frame().map_err(mem)?, n, seed).map_err(mem)?;
        Ok(FixedReply {
            data: h,
            sum: data::server_sum(s),
        })
    }

    fn recv_var(&self, cx: &mut Ctx<'_>, len: u64, seed: u64) -> Result<VarReply, Fault> {
        let n = check_len(len)?;
        let (h, s) = build_var(cx.frame().map_err(mem)?, n, seed).map_err(mem)?;
        Ok(VarReply {
            data: h,
            sum: data::server_sum(s),
        })
    }
}

// ---------------------------------------------------------------------------
// The system, as the driver sees it
// ---------------------------------------------------------------------------

struct FidoSys {
    broker: PathBuf,
}

impl FidoSys {
    fn cmd(&self, role: &str, addr: &str, case: &Case, cpu: usize) -> Command {
        let exe = std::env::current_exe().expect("current_exe");
        let mut c = Command::new(exe);
        c.args(["__bench-peer", "fido", role])
            .arg(format!("svc={addr}"))
            .arg(format!("case={}", case.name()))
            .arg(format!("cpu={cpu}"))
            .env("FIDO_BROKER", &self.broker)
            .env(proc::PARENT_ENV, std::process::id().to_string());
        c
    }
}

impl RpcSystem for FidoSys {
    fn name(&self) -> &str {
        "fido"
    }
    fn supports(&self, _case: &Case) -> bool {
        true
    }
    fn server(&self, addr: &str, case: &Case, cpu: usize) -> Command {
        self.cmd("rpc-server", addr, case, cpu)
    }
    fn client(&self, addr: &str, case: &Case, cpu: usize, t: Timing) -> Command {
        let mut c = self.cmd("rpc-client", addr, case, cpu);
        c.arg(format!("warm_ms={}", t.warmup.as_millis()))
            .arg(format!("dur_ms={}", t.duration.as_millis()));
        c
    }
}

/// Arena bytes a domain needs for one point (see the body), at least 64 MiB.
/// Arenas up to 1 GiB are pre-faulted at join.
fn arena_for(case: &Case) -> u64 {
    let per_call = match case {
        Case::Seq { seq, len, .. } => match seq {
            Seq::Byte => 10 * *len as u64,
            Seq::Fixed => 16 * *len as u64,
            // FVar (24 B) + its 10-byte string.
            Seq::Var => (24 + data::VAR_STR as u64) * *len as u64,
        },
        Case::FileRead { size } => (files::files_for(*size) * *size) as u64,
        _ => 0,
    };
    // Eight calls' worth (a call's frame and the previous ones not yet
    // released, with room to spare), plus the buddy's slack. Both ends
    // collect releases before building a frame (`Client::frame`, and the
    // server before each call), so frames do not pile up with the window.
    (8 * per_call + (64 << 20)).next_power_of_two()
}

fn wait_for(case: &Case) -> WaitStrategy {
    match case {
        Case::NullNotified => WaitStrategy::Block,
        Case::NullPolled => WaitStrategy::BusyPoll,
        _ => WaitStrategy::default(),
    }
}

fn join(role: &str, case: &Case) -> anyhow::Result<Domain> {
    Domain::join(
        JoinOptions::new(role)
            .arena_len(arena_for(case))
            // Page faults of a fresh arena are paid at join, not in the
            // measured calls (ANCHORS: pre-fault and reuse shared memory).
            .prefault(arena_for(case) <= 1 << 30)
            .wait(wait_for(case)),
    )
    .context("joining the embedded broker")
}

/// `fido-bench __bench-peer fido rpc-server|rpc-client key=value...`.
pub fn peer_main(kind: &str, args: &[String]) -> anyhow::Result<()> {
    proc::child_prologue()?;
    let a = PeerArgs::parse(args);
    crate::harness::pin_peer(&a)?;
    let case = Case::parse(a.get("case")?)?;
    let svc = a.get("svc")?;
    match kind {
        "rpc-server" => {
            let d = join("rpc-bench-server", &case)?;
            let opts = ServerOptions {
                workers: 1,
                wait: Some(wait_for(&case)),
            };
            let _h = match case {
                Case::FileRead { .. } => {
                    Server::spawn(&d, svc, FilesServer(FileServer::new(d.arena(), None)), opts)?
                }
                _ => Server::spawn(&d, svc, RpcBenchServer(Impl), opts)?,
            };
            rpc::emit_ready()?;
            // Serves until the driver kills us (we die with it, too).
            loop {
                std::thread::sleep(Duration::from_secs(3600));
            }
        }
        "rpc-client" => {
            let d = join("rpc-bench-client", &case)?;
            match case {
                Case::FileRead { size } => {
                    let c = FidoFilesClient::connect(&d, svc)?;
                    rpc::run_files_client(&mut FidoFiles { c }, size, &a)
                }
                _ => {
                    let c = RpcBenchClient::connect(&d, svc)?;
                    c.0.set_wait(wait_for(&case));
                    rpc::run_client(&mut FidoClient { c }, &a)
                }
            }
        }
        k => bail!("unknown fido rpc peer {k}"),
    }
}

struct FidoClient {
    c: RpcBenchClient,
}

impl RpcClient for FidoClient {
    fn null(&mut self) -> anyhow::Result<()> {
        self.c.null(self.c.frame()?)?;
        Ok(())
    }

    fn call(&mut self, seq: Seq, dir: Dir, len: usize, seed: u64) -> anyhow::Result<()> {
        let c = &self.c;
        let l = len as u64;
        match (seq, dir) {
            (Seq::Byte, Dir::Send) => {
                let mut f = c.frame()?;
                let (h, dst) = f.alloc_slice::<u8>(seq.elements(len))?;
                let want = data::fill_bytes(dst, seed);
                data::check("fido send", *c.send_bytes(f, h)?.get(), want)
            }
            (Seq::Fixed, Dir::Send) => {
                let mut f = c.frame()?;
                let (h, want) = build_fixed(&mut f, len, seed)?;
                data::check("fido send", *c.send_fixed(f, h)?.get(), want)
            }
            (Seq::Var, Dir::Send) => {
                let mut f = c.frame()?;
                let (h, want) = build_var(&mut f, len, seed)?;
                data::check("fido send", *c.send_var(f, h)?.get(), want)
            }
            (Seq::Byte, Dir::Recv) => {
                let r = c.recv_bytes(c.frame()?, l, seed)?;
                let rep = *r.get();
                let d = r.slice(rep.data)?;
                anyhow::ensure!(d.len() == seq.elements(len), "short ByteSeq");
                data::check("fido recv", sum_bytes_view(d), rep.sum)
            }
            (Seq::Fixed, Dir::Recv) => {
                let r = c.recv_fixed(c.frame()?, l, seed)?;
                let rep = *r.get();
                let d = r.slice(rep.data)?;
                anyhow::ensure!(d.len() == len, "short FixedSeq");
                let got = d
                    .iter()
                    .fold(0u64, |a, f| a.wrapping_add(data::fixed_sum(&fixed_of(&f))));
                data::check("fido recv", got, rep.sum)
            }
            (Seq::Var, Dir::Recv) => {
                let r = c.recv_var(c.frame()?, l, seed)?;
                let rep = *r.get();
                let v = r.view();
                let d = v.slice(rep.data)?;
                anyhow::ensure!(d.len() == len, "short VarSeq");
                data::check("fido recv", sum_var(&v, d)?, rep.sum)
            }
        }
    }
}

struct FidoFiles {
    c: FidoFilesClient,
}

impl files::FilesClient for FidoFiles {
    fn put(&mut self, path: &str, bytes: &[u8]) -> anyhow::Result<()> {
        let mut f = self.c.frame()?;
        let p = f.str(path)?;
        let d = f.bytes(bytes)?;
        let n = *self.c.put(f, p, d)?.get();
        anyhow::ensure!(n == bytes.len() as u64, "short put");
        Ok(())
    }

    fn read_check(&mut self, path: &str, len: usize, sum: u64) -> anyhow::Result<()> {
        let mut f = self.c.frame()?;
        let p = f.str(path)?;
        let r = self.c.read(f, p, 0, len as u64)?;
        let d = r.slice(*r.get())?;
        anyhow::ensure!(d.len() == len, "read {} bytes, expected {len}", d.len());
        data::check("fido file read", sum_bytes_view(d), sum)
    }
}

// ---------------------------------------------------------------------------
// The run
// ---------------------------------------------------------------------------

static POINT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

fn addr(dir: &Path, s: &dyn RpcSystem, n: usize) -> String {
    if s.name() == "fido" {
        // A service name in the embedded broker, unique per point.
        format!(
            "rpc-bench-{}-{n}-{}",
            std::process::id(),
            POINT.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
        )
    } else {
        rpc::sock_path(dir, s.name(), n)
            .to_string_lossy()
            .into_owned()
    }
}

/// `fido-bench rpc`. `Ok(false)` when a point failed (a checksum mismatch, a
/// crashed peer): every figure is still printed, but the run is not a pass.
pub fn run(opts: &Opts, plot: Option<PathBuf>) -> anyhow::Result<bool> {
    proc::install_interrupt_flag()?;
    let t = Instant::now();
    let dir = tempfile::Builder::new()
        .prefix("fido-bench-rpc-")
        .tempdir()?;
    let want_fido = Case::all(opts.quick)
        .iter()
        .any(|c| rpc::wants(opts.filter.as_deref(), "fido", &c.name()));
    let broker = if want_fido {
        Some(EmbeddedBroker::start("fido-bench-")?)
    } else {
        None
    };
    let fido = broker.as_ref().map(|b| FidoSys {
        broker: b.socket().to_path_buf(),
    });
    let baselines = rpc::baselines(opts);
    let mut systems: Vec<&dyn RpcSystem> = Vec::new();
    if let Some(f) = &fido {
        systems.push(f);
    }
    systems.extend(baselines.iter().map(|b| b.as_ref()));
    let dir_path = dir.path().to_path_buf();
    let addr_of = move |s: &dyn RpcSystem, n: usize| addr(&dir_path, s, n);
    let run = rpc::run_suite(&systems, opts, &addr_of);
    if let Some(b) = broker {
        b.stop()?;
    }
    let run = run?;
    proc::check_interrupt()?;
    let records = run.records;
    let place = crate::Placement::detect();
    let machine = crate::Machine::describe(format!(
        "rpc: every point a fresh client process pinned to CPU{} and server process pinned to CPU{}{}; \
         the driver unpinned",
        place.parent,
        place.peer,
        if place.cross() { "" } else { " (one CPU allowed: the same CPU)" },
    ));
    crate::print_table_on(&records, &machine);
    println!(
        "# rpc: client pinned to the parent CPU, server to the peer CPU; value = p50 round trip \
         (null-*, file-read-*) or payload bytes/s (Table 2 volume); did_not_finish = over the per-point \
         budget of {:?}.",
        rpc::budget(opts)
    );
    println!(
        "# checksums asserted: {} calls ({} measured sequence calls, every one checked)",
        run.checked, run.seq_calls
    );
    rpc::print_goals(&records);
    for f in &run.failures {
        println!("# FAILED: {f}");
    }
    eprintln!(
        "({} records in {:.1} s)",
        records.len(),
        t.elapsed().as_secs_f64()
    );
    if let Some(p) = &opts.json {
        crate::write_json_on(p, &records, &machine)?;
    }
    if let Some(p) = &plot {
        rpc::plot::draw(
            &records,
            p,
            &format!(
                "fido-bench rpc{}: payload throughput vs LEN (VMRPC Table 2)",
                if opts.quick { " --quick" } else { "" }
            ),
        )?;
        println!("# plot: {}", p.display());
    }
    Ok(run.failures.is_empty())
}
