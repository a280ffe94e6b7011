//! fido-rpc in one process: calls, views, errors, faults, concurrency,
//! deadlines and cancellation, one-way calls, zero-copy cache views.

use fido_test_support::domains::Patient;
use fido_test_support::eventually;
use fido_examples::services::bench::*;
use fido_examples::services::files::*;
use fido_rpc::{CallError, CallOpts, CancelToken, Ctx, Failure, Fault, RpcError, Server, ServerOptions, ShmSlice, ShmStr};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

type TestBroker = fido_test_support::TestBroker<Patient>;

/// An application error.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, bytemuck::Pod, bytemuck::Zeroable)]
pub struct TestError {
    pub code: u32,
}

#[fido_rpc::service]
pub trait Test: Send + Sync + 'static {
    fn add(&self, cx: &mut Ctx<'_>, a: u64, b: u32) -> u64;
    fn div(&self, cx: &mut Ctx<'_>, a: u64, b: u64) -> Result<u64, TestError>;
    /// Waits `ms` (or until cancelled); returns whether it was cancelled.
    fn sleep(&self, cx: &mut Ctx<'_>, ms: u64) -> Result<u64, Fault>;
    /// Waits until `n` calls of `gather` run at once (or 10 s).
    fn gather(&self, cx: &mut Ctx<'_>, n: u64) -> u64;
    fn upper(&self, cx: &mut Ctx<'_>, s: ShmStr) -> Result<ShmStr, Failure<TestError>>;
    fn boom(&self, cx: &mut Ctx<'_>);
    #[oneway]
    fn bump(&self, cx: &mut Ctx<'_>, by: u64);
}

#[derive(Default)]
struct TestImpl {
    running: AtomicUsize,
    peak: AtomicUsize,
    cancelled_seen: AtomicU64,
    /// Sleeps that ran their whole time, and those running now.
    slept: AtomicU64,
    sleeping: AtomicUsize,
    saw_deadline: AtomicBool,
    bumps: AtomicU64,
}

impl Test for Arc<TestImpl> {
    fn add(&self, _cx: &mut Ctx<'_>, a: u64, b: u32) -> u64 {
        a + b as u64
    }
    fn div(&self, _cx: &mut Ctx<'_>, a: u64, b: u64) -> Result<u64, TestError> {
        a.checked_div(b).ok_or(TestError { code: 42 })
    }
    fn sleep(&self, cx: &mut Ctx<'_>, ms: u64) -> Result<u64, Fault> {
        if cx.deadline_ns().is_some() {
            self.saw_deadline.store(true, Ordering::SeqCst);
        }
        self.sleeping.fetch_add(1, Ordering::SeqCst);
        let end = Instant::now() + Duration::from_millis(ms);
        let r = loop {
            if Instant::now() >= end {
                self.slept.fetch_add(1, Ordering::SeqCst);
                break Ok(ms);
            }
            if cx.is_cancelled() {
                self.cancelled_seen.fetch_add(1, Ordering::SeqCst);
                break Err(Fault::Cancelled);
            }
            std::thread::sleep(Duration::from_millis(2));
        };
        self.sleeping.fetch_sub(1, Ordering::SeqCst);
        r
    }
    fn gather(&self, _cx: &mut Ctx<'_>, n: u64) -> u64 {
        let now = self.running.fetch_add(1, Ordering::SeqCst) + 1;
        self.peak.fetch_max(now, Ordering::SeqCst);
        let end = Instant::now() + Duration::from_secs(10);
        while (self.peak.load(Ordering::SeqCst) as u64) < n && Instant::now() < end {
            std::thread::sleep(Duration::from_millis(1));
        }
        self.running.fetch_sub(1, Ordering::SeqCst);
        self.peak.load(Ordering::SeqCst) as u64
    }
    fn upper(&self, cx: &mut Ctx<'_>, s: ShmStr) -> Result<ShmStr, Failure<TestError>> {
        let src = cx.str(s)?.as_bytes();
        if src.is_empty() {
            return Err(Failure::App(TestError { code: 7 }));
        }
        let up: Vec<u8> = src.iter().map(|b| b.to_ascii_uppercase()).collect();
        let h = cx.frame().map_err(|_| Fault::ServerMemory)?.bytes(&up).map_err(|_| Fault::ServerMemory)?;
        Ok(ShmStr { addr: h.addr(), len: h.len() })
    }
    fn boom(&self, _cx: &mut Ctx<'_>) {
        panic!("handler panics on purpose");
    }
    fn bump(&self, _cx: &mut Ctx<'_>, by: u64) {
        self.bumps.fetch_add(by, Ordering::SeqCst);
    }
}

fn setup(workers: usize) -> (TestBroker, fido::Domain, fido::Domain, Arc<TestImpl>, fido_rpc::ServerHandle) {
    let b = TestBroker::start();
    let sd = b.join("server");
    let cd = b.join("client");
    let imp = Arc::new(TestImpl::default());
    let h = Server::spawn(&sd, "test", TestServer(imp.clone()), ServerOptions { workers, wait: None }).unwrap();
    (b, sd, cd, imp, h)
}

#[test]
fn scalars_app_errors_and_faults() {
    let (_b, _sd, cd, imp, _h) = setup(1);
    let c = TestClient::connect(&cd, "test").unwrap();
    assert_eq!(*c.add(c.frame().unwrap(), 40, 2).unwrap().get(), 42);
    assert_eq!(*c.div(c.frame().unwrap(), 10, 3).unwrap().get(), 3);
    match c.div(c.frame().unwrap(), 1, 0) {
        Err(CallError::App(TestError { code: 42 })) => {}
        other => panic!("expected the app error, got {:?}", other.map(|r| *r.get())),
    }
    // A handler that panics is a fault for that call only.
    match c.boom(c.frame().unwrap()) {
        Err(CallError::Rpc(RpcError::Fault(Fault::Panicked, _))) => {}
        other => panic!("expected Panicked, got {:?}", other.map(|_| ())),
    }
    assert_eq!(*c.add(c.frame().unwrap(), 1, 1).unwrap().get(), 2);
    // Strings in and out, in place.
    let mut f = c.frame().unwrap();
    let s = f.str("hello vmrpc").unwrap();
    let r = c.upper(f, s).unwrap();
    assert_eq!(r.str(*r.get()).unwrap().as_bytes(), b"HELLO VMRPC");
    let mut f = c.frame().unwrap();
    let s = f.str("").unwrap();
    assert!(matches!(c.upper(f, s), Err(CallError::App(TestError { code: 7 }))));
    // One-way calls.
    for _ in 0..10 {
        c.bump(c.frame().unwrap(), 3).unwrap();
    }
    eventually("10 one-way calls", Duration::from_secs(10), || imp.bumps.load(Ordering::SeqCst) == 30);
}

#[test]
fn pointers_outside_the_grant_are_refused() {
    let (_b, _sd, cd, _imp, _h) = setup(1);
    let c = TestClient::connect(&cd, "test").unwrap();
    let base = cd.arena().base().addr();
    let len = cd.arena().len();
    for (addr, n) in [(0u64, 5u64), (base + len - 2, 5), (base.wrapping_sub(1), 2), (u64::MAX - 1, 4), (base, u64::MAX)] {
        let r = c.upper(c.frame().unwrap(), ShmStr { addr, len: n });
        assert!(matches!(r, Err(CallError::Rpc(RpcError::Fault(Fault::BadPointer, _)))), "{addr:#x}+{n}: {:?}", r.map(|_| ()));
    }
    // A misaligned slice of u64s.
    let bench = Server::spawn(&_sd, "bench", BenchServer(BenchImpl), ServerOptions::default()).unwrap();
    let bc = BenchClient::connect(&cd, "bench").unwrap();
    let mut f = bc.frame().unwrap();
    let h = make_fixedseq(&mut f, 4).unwrap();
    let bad = ShmSlice::<Fixed>::from_raw(h.addr() + 1, 2);
    assert!(matches!(bc.fixedseq_send(f, bad), Err(CallError::Rpc(RpcError::Fault(Fault::BadPointer, _)))));
    // Wrong signature (a client built against another version of a method).
    let raw = bc.0.call::<u64, fido_rpc::NoAppError>(1, 12345, bc.frame().unwrap(), &[0u8; 16], &CallOpts::default());
    assert!(matches!(raw, Err(CallError::Rpc(RpcError::Fault(Fault::BadSignature, _)))));
    let raw = bc.0.call::<u64, fido_rpc::NoAppError>(99, 0, bc.frame().unwrap(), &[], &CallOpts::default());
    assert!(matches!(raw, Err(CallError::Rpc(RpcError::Fault(Fault::UnknownMethod, _)))));
    // Arguments too short for the method.
    let raw = bc.0.call::<u64, fido_rpc::NoAppError>(1, 0, bc.frame().unwrap(), &[0u8; 8], &CallOpts::default());
    assert!(matches!(raw, Err(CallError::Rpc(RpcError::Fault(Fault::BadArguments, _)))));
    drop(bench);
}

#[test]
fn sequences_send_and_recv() {
    sequences(false);
}

/// Without the PGVAS window every handle is translated (swizzled): the same
/// calls must give the same answers.
#[test]
fn sequences_send_and_recv_swizzled() {
    sequences(true);
}

fn sequences(swizzle: bool) {
    let b = TestBroker::start();
    let join = |n: &str| fido::Domain::join(fido::JoinOptions::new(n).broker(&b.socket).arena_len(64 << 20).swizzle(swizzle)).unwrap();
    let sd = join("server");
    let cd = join("client");
    // (Two domains of one process share one PGVAS window: the second one
    // joined is swizzled anyway; forcing it makes both so.)
    if swizzle {
        assert_ne!(cd.address_mode(), fido::AddressMode::Pgvas);
        assert_ne!(sd.address_mode(), fido::AddressMode::Pgvas);
    }
    let _h = Server::spawn(&sd, "bench", BenchServer(BenchImpl), ServerOptions::default()).unwrap();
    let c = BenchClient::connect(&cd, "bench").unwrap();
    c.null(c.frame().unwrap()).unwrap();
    for len in [0usize, 1, 100, 10_000, 300_000] {
        let mut f = c.frame().unwrap();
        let h = make_byteseq(&mut f, len).unwrap();
        assert_eq!(*c.byteseq_send(f, h).unwrap().get(), expected_byteseq(len), "byteseq {len}");
        let mut f = c.frame().unwrap();
        let h = make_fixedseq(&mut f, len).unwrap();
        assert_eq!(*c.fixedseq_send(f, h).unwrap().get(), expected_fixedseq(len), "fixedseq {len}");
        let mut f = c.frame().unwrap();
        let h = make_varseq(&mut f, len).unwrap();
        assert_eq!(*c.varseq_send(f, h).unwrap().get(), expected_varseq(len), "varseq {len}");

        let r = c.byteseq_recv(c.frame().unwrap(), len as u64).unwrap();
        assert_eq!(byteseq_sum(r.slice(*r.get()).unwrap()), expected_byteseq(len));
        let r = c.fixedseq_recv(c.frame().unwrap(), len as u64).unwrap();
        assert_eq!(fixed_sum(r.slice(*r.get()).unwrap()), expected_fixedseq(len));
        let r = c.varseq_recv(c.frame().unwrap(), len as u64).unwrap();
        let v = r.view();
        assert_eq!(var_sum(v.slice(*r.get()).unwrap(), |s| v.str(s).map(|x| x.as_bytes())).unwrap(), expected_varseq(len));
    }
    // Nothing was copied by the transport: only the server's own building.
    assert_eq!(cd.counters().bytes_copied, 0);
    assert_eq!(sd.counters().bytes_copied, 0);
}

/// The bench service between two domains with 16 MiB arenas: small enough
/// that 1 MiB frames left unreclaimed exhaust them.
fn bench_in_16_mib_arenas() -> (TestBroker, fido::Domain, fido::Domain, fido_rpc::ServerHandle, BenchClient) {
    let b = TestBroker::start();
    let join = |n: &str| fido::Domain::join(fido::JoinOptions::new(n).broker(&b.socket).arena_len(16 << 20)).unwrap();
    let sd = join("server");
    let cd = join("client");
    let h = Server::spawn(&sd, "bench", BenchServer(BenchImpl), ServerOptions::default()).unwrap();
    let c = BenchClient::connect(&cd, "bench").unwrap();
    (b, sd, cd, h, c)
}

/// A synchronous caller never fills half its ring, where sending reaps: the
/// client must take back finished calls' argument memory itself, or large
/// calls exhaust the arena (32 unreaped 1 MiB frames would need 32 MiB here).
#[test]
fn large_synchronous_calls_reuse_their_argument_memory() {
    let (_b, _sd, _cd, _h, c) = bench_in_16_mib_arenas();
    let len = 1 << 20;
    for i in 0..48 {
        let mut f = c.frame().unwrap_or_else(|e| panic!("call {i}: {e}"));
        let h = make_byteseq(&mut f, len).unwrap_or_else(|e| panic!("call {i}: {e}"));
        assert_eq!(*c.byteseq_send(f, h).unwrap().get(), expected_byteseq(len), "call {i}");
    }
}

/// The same for results: a server replying synchronously never fills half
/// its window either, so it must collect the client's releases of earlier
/// replies before building the next, or large results exhaust its arena
/// (32 unreaped 1 MiB reply frames would need 32 MiB here).
#[test]
fn large_synchronous_results_reuse_the_servers_memory() {
    let (_b, _sd, _cd, _h, c) = bench_in_16_mib_arenas();
    let len = 1 << 20;
    for i in 0..48 {
        let r = c.byteseq_recv(c.frame().unwrap(), len as u64).unwrap_or_else(|e| panic!("call {i}: {e}"));
        assert_eq!(byteseq_sum(r.slice(*r.get()).unwrap()), expected_byteseq(len), "call {i}");
    }
}

#[test]
fn many_calls_in_flight_complete_out_of_order() {
    let (_b, _sd, cd, _imp, _h) = setup(4);
    let c = Arc::new(TestClient::connect(&cd, "test").unwrap());
    let slow = {
        let c = c.clone();
        std::thread::spawn(move || *c.sleep(c.frame().unwrap(), 1500).unwrap().get())
    };
    std::thread::sleep(Duration::from_millis(100));
    // Fast calls on the same connection complete while the slow one runs.
    let t0 = Instant::now();
    for i in 0..50u64 {
        assert_eq!(*c.add(c.frame().unwrap(), i, 1).unwrap().get(), i + 1);
    }
    assert!(!slow.is_finished(), "the slow call finished before the fast ones ({:?})", t0.elapsed());
    assert_eq!(slow.join().unwrap(), 1500);
    // Many threads, one connection.
    let ts: Vec<_> = (0..8u64)
        .map(|t| {
            let c = c.clone();
            std::thread::spawn(move || {
                for i in 0..200u64 {
                    assert_eq!(*c.add(c.frame().unwrap(), t * 1000 + i, 7).unwrap().get(), t * 1000 + i + 7);
                }
            })
        })
        .collect();
    for t in ts {
        t.join().unwrap();
    }
}

#[test]
fn n_workers_run_calls_concurrently() {
    let (_b, _sd, cd, imp, _h) = setup(4);
    let c = Arc::new(TestClient::connect(&cd, "test").unwrap());
    let ts: Vec<_> = (0..4)
        .map(|_| {
            let c = c.clone();
            std::thread::spawn(move || *c.gather(c.frame().unwrap(), 4).unwrap().get())
        })
        .collect();
    for t in ts {
        assert_eq!(t.join().unwrap(), 4);
    }
    assert_eq!(imp.peak.load(Ordering::SeqCst), 4);
}

#[test]
fn deadlines_and_cancellation_reach_the_server() {
    let (_b, _sd, cd, imp, _h) = setup(2);
    let c = Arc::new(TestClient::connect(&cd, "test").unwrap());
    // Deadline: the client gives up, the server sees it and stops.
    let r = c.sleep_with(c.frame().unwrap(), &CallOpts::timeout(Duration::from_millis(200)), 20_000);
    assert!(matches!(r, Err(CallError::Rpc(RpcError::DeadlineExceeded))), "{:?}", r.map(|r| *r.get()));
    eventually("server sees the deadline", Duration::from_secs(10), || imp.cancelled_seen.load(Ordering::SeqCst) == 1);
    assert!(imp.saw_deadline.load(Ordering::SeqCst));
    // Explicit cancellation from another thread.
    let tok = CancelToken::new();
    let t = {
        let (c, tok) = (c.clone(), tok.clone());
        std::thread::spawn(move || c.sleep_with(c.frame().unwrap(), &CallOpts::default().cancel(&tok), 20_000).map(|r| *r.get()))
    };
    std::thread::sleep(Duration::from_millis(200));
    tok.cancel();
    assert!(matches!(t.join().unwrap(), Err(CallError::Rpc(RpcError::Cancelled))));
    eventually("server sees the cancel", Duration::from_secs(10), || imp.cancelled_seen.load(Ordering::SeqCst) == 2);
    // The connection still works.
    assert_eq!(*c.add(c.frame().unwrap(), 2, 2).unwrap().get(), 4);
}

/// The receiving turn changes hands under every kind of call at once:
/// fast calls, slow ones, calls that time out and calls cancelled while
/// another thread holds the turn. Every reply reaches its own caller, every
/// given-up call is stopped on the server (or never started: it waited past
/// its deadline), and the connection stays usable. With more callers than
/// workers, every worker is often busy: cancels must still reach the calls
/// (before running calls looked for them, this took 94 s instead of 0.4).
#[test]
fn the_receiving_turn_survives_a_crowd_of_callers() {
    let (_b, _sd, cd, imp, _h) = setup(3);
    let c = Arc::new(TestClient::connect(&cd, "test").unwrap());
    let given_up = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let ts: Vec<_> = (0..8u64)
        .map(|t| {
            let (c, given_up) = (c.clone(), given_up.clone());
            std::thread::spawn(move || {
                for i in 0..120u64 {
                    match (t + i) % 5 {
                        0 | 1 => assert_eq!(*c.add(c.frame().unwrap(), t << 32 | i, 3).unwrap().get(), (t << 32 | i) + 3),
                        2 => assert_eq!(*c.sleep(c.frame().unwrap(), 1).unwrap().get(), 1),
                        // Given up on after 3 ms, or 2 ms: a 2 s sleep that ran
                        // to its end would be a cancel that never arrived.
                        3 => {
                            let r = c.sleep_with(c.frame().unwrap(), &CallOpts::timeout(Duration::from_millis(3)), 2_000);
                            assert!(matches!(r, Err(CallError::Rpc(RpcError::DeadlineExceeded))), "{:?}", r.map(|r| *r.get()));
                            given_up.fetch_add(1, Ordering::SeqCst);
                        }
                        _ => {
                            let tok = CancelToken::new();
                            let canceller = {
                                let tok = tok.clone();
                                std::thread::spawn(move || {
                                    std::thread::sleep(Duration::from_millis(2));
                                    tok.cancel();
                                })
                            };
                            let r = c.sleep_with(c.frame().unwrap(), &CallOpts::default().cancel(&tok), 2_000);
                            canceller.join().unwrap();
                            assert!(matches!(r, Err(CallError::Rpc(RpcError::Cancelled))), "{:?}", r.map(|r| *r.get()));
                            given_up.fetch_add(1, Ordering::SeqCst);
                        }
                    }
                }
            })
        })
        .collect();
    for t in ts {
        t.join().unwrap();
    }
    assert!(given_up.load(Ordering::SeqCst) > 0);
    // Only the 1 ms sleeps ran to their end.
    let short = (0..8u64).flat_map(|t| (0..120u64).map(move |i| (t + i) % 5)).filter(|k| *k == 2).count() as u64;
    eventually("every call ended", Duration::from_secs(20), || imp.sleeping.load(Ordering::SeqCst) == 0);
    assert_eq!(imp.slept.load(Ordering::SeqCst), short, "a call given up on ran to its end: its cancel never reached it");
    assert!(imp.cancelled_seen.load(Ordering::SeqCst) > 0);
    assert_eq!(*c.add(c.frame().unwrap(), 40, 2).unwrap().get(), 42);
}

#[test]
fn async_client() {
    let (_b, _sd, cd, imp, _h) = setup(2);
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    rt.block_on(async {
        let c = Arc::new(TestAsyncClient::connect(&cd, "test").unwrap());
        // Concurrent calls on one connection.
        let mut tasks = Vec::new();
        for i in 0..64u64 {
            let c = c.clone();
            tasks.push(tokio::spawn(async move { *c.add(c.frame().unwrap(), i, 1).await.unwrap().get() }));
        }
        for (i, t) in tasks.into_iter().enumerate() {
            assert_eq!(t.await.unwrap(), i as u64 + 1);
        }
        // A slow call and a fast one: the fast one completes first.
        let slow = {
            let c = c.clone();
            tokio::spawn(async move { *c.sleep(c.frame().unwrap(), 1000).await.unwrap().get() })
        };
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert_eq!(*c.add(c.frame().unwrap(), 1, 2).await.unwrap().get(), 3);
        assert!(!slow.is_finished());
        assert_eq!(slow.await.unwrap(), 1000);
        // Dropping a call's future cancels it at the server.
        let r = tokio::time::timeout(Duration::from_millis(150), c.sleep(c.frame().unwrap(), 20_000)).await;
        assert!(r.is_err());
        // Deadlines in the options do the same.
        let r = c.sleep_with(c.frame().unwrap(), &CallOpts::timeout(Duration::from_millis(100)), 20_000).await;
        assert!(matches!(r, Err(CallError::Rpc(RpcError::DeadlineExceeded))));
        c.bump(c.frame().unwrap(), 5).await.unwrap();
    });
    eventually("two cancellations", Duration::from_secs(10), || imp.cancelled_seen.load(Ordering::SeqCst) == 2);
    eventually("one-way", Duration::from_secs(10), || imp.bumps.load(Ordering::SeqCst) == 5);
}

#[test]
fn file_reads_are_views_of_the_cache() {
    let b = TestBroker::start();
    let sd = b.join("server");
    let cd = b.join("client");
    let dir = tempfile::tempdir().unwrap();
    let content: Vec<u8> = (0..200_000u32).map(|i| (i % 251) as u8).collect();
    std::fs::write(dir.path().join("data.bin"), &content).unwrap();
    let fs = Arc::new(FileServer::new(sd.arena(), Some(dir.path())));
    struct Shared(Arc<FileServer>);
    impl Files for Shared {
        fn read(&self, cx: &mut Ctx<'_>, p: ShmStr, o: u64, l: u64) -> Result<ShmSlice<u8>, Failure<FsError>> {
            self.0.read(cx, p, o, l)
        }
        fn stat(&self, cx: &mut Ctx<'_>, p: ShmStr) -> Result<u64, Failure<FsError>> {
            self.0.stat(cx, p)
        }
        fn put(&self, cx: &mut Ctx<'_>, p: ShmStr, d: ShmSlice<u8>) -> Result<u64, Failure<FsError>> {
            self.0.put(cx, p, d)
        }
        fn evict(&self, cx: &mut Ctx<'_>, p: ShmStr) -> Result<(), Failure<FsError>> {
            self.0.evict(cx, p)
        }
    }
    let _h = Server::spawn(&sd, "files", FilesServer(Shared(fs.clone())), ServerOptions { workers: 2, wait: None }).unwrap();
    let c = FilesClient::connect(&cd, "files").unwrap();
    let path = |c: &FilesClient| {
        let mut f = c.frame().unwrap();
        let p = f.str("data.bin").unwrap();
        (f, p)
    };
    let (f, p) = path(&c);
    assert_eq!(*c.stat(f, p).unwrap().get(), content.len() as u64);
    let (f, p) = path(&c);
    let r1 = c.read(f, p, 1000, 5000).unwrap();
    let v1 = r1.slice(*r1.get()).unwrap();
    assert_eq!(v1, &content[1000..6000]);
    // Two reads of the same range point at the same cached bytes.
    let (f, p) = path(&c);
    let r2 = c.read(f, p, 1000, 10).unwrap();
    assert_eq!(r2.get().addr(), r1.get().addr());
    // Past the end: a short read; beyond: an application error.
    let (f, p) = path(&c);
    let r3 = c.read(f, p, content.len() as u64 - 3, 100).unwrap();
    assert_eq!(r3.get().len(), 3);
    let (f, p) = path(&c);
    assert!(matches!(c.read(f, p, content.len() as u64 + 1, 1), Err(CallError::App(FsError::BAD_RANGE))));
    let mut f = c.frame().unwrap();
    let p = f.str("../etc/passwd").unwrap();
    assert!(matches!(c.read(f, p, 0, 10), Err(CallError::App(FsError::BAD_PATH))));
    let mut f = c.frame().unwrap();
    let p = f.str("missing").unwrap();
    assert!(matches!(c.read(f, p, 0, 10), Err(CallError::App(FsError::NOT_FOUND))));
    // Evicting while a client holds a view keeps the bytes (held by the reply).
    let in_use = sd.arena().stats().bytes_in_use;
    let (f, p) = path(&c);
    c.evict(f, p).unwrap();
    assert_eq!(fs.cached(), 0);
    assert_eq!(v1, &content[1000..6000]);
    assert!(sd.arena().stats().bytes_in_use > in_use - 100_000, "entry freed while held");
    drop((r1, r2, r3));
    eventually("the entry freed once every reply is released", Duration::from_secs(10), || {
        sd.arena().stats().bytes_in_use < in_use.saturating_sub(150_000)
    });
    // put then read back.
    let mut f = c.frame().unwrap();
    let p = f.str("new").unwrap();
    let d = f.bytes(b"fresh bytes").unwrap();
    assert_eq!(*c.put(f, p, d).unwrap().get(), 11);
    let mut f = c.frame().unwrap();
    let p = f.str("new").unwrap();
    let r = c.read(f, p, 6, 100).unwrap();
    assert_eq!(r.slice(*r.get()).unwrap(), b"bytes");
    assert_eq!(cd.counters().bytes_copied, 0);
}

/// A client speaking raw fido to the server: short headers, bad magic,
/// roots outside its arena, unknown opcodes. Each bad call gets a fault (or
/// is ignored), and the server keeps serving.
#[test]
fn raw_garbage_from_a_client_fails_alone() {
    use fido_rpc::wire::*;
    let (_b, _sd, cd, _imp, _h) = setup(1);
    let ch = cd.connect("test").unwrap();
    let fault_of = |m: &fido::Msg| -> (u32, u32) {
        let (status, fault, _) = fido_rpc::reply_parts(m).unwrap();
        (status, fault)
    };
    // Too short for a header.
    ch.send(fido::Message::new(cd.alloc_copy(b"short").unwrap()).tag(1).opcode(OP_CALL)).unwrap();
    assert_eq!(fault_of(&ch.recv_timeout(Duration::from_secs(10)).unwrap()), (STATUS_FAULT, Fault::BadHeader as u32));
    // Bad magic.
    ch.send(fido::Message::new(cd.alloc_copy(&[0xAB; 64]).unwrap()).tag(2).opcode(OP_CALL)).unwrap();
    assert_eq!(fault_of(&ch.recv_timeout(Duration::from_secs(10)).unwrap()), (STATUS_FAULT, Fault::BadHeader as u32));
    // A root pointing outside our arena.
    let h = CallHeader { magic: MAGIC, method: 0, sig: 0, _reserved: 0, deadline_ns: 0, root_addr: 64, root_len: 12, _pad: [0; 3] };
    ch.send(fido::Message::new(cd.alloc_copy(bytemuck::bytes_of(&h)).unwrap()).tag(3).opcode(OP_CALL)).unwrap();
    assert_eq!(fault_of(&ch.recv_timeout(Duration::from_secs(10)).unwrap()), (STATUS_FAULT, Fault::BadPointer as u32));
    // An unknown opcode and a cancel for nothing: ignored.
    ch.send(fido::Message::new(cd.alloc_copy(b"x").unwrap()).tag(4).opcode(77)).unwrap();
    ch.send(fido::Message::new(cd.alloc_copy(b"x").unwrap()).tag(5).opcode(OP_CANCEL)).unwrap();
    // A well-formed call on the same raw channel still works: add(40, 2) —
    // the root (a: u64, b: u32: 12 bytes) in a second segment.
    let mut root = cd.alloc(16).unwrap();
    root[..8].copy_from_slice(&40u64.to_ne_bytes());
    root[8..12].copy_from_slice(&2u32.to_ne_bytes());
    root.truncate(12);
    let h = CallHeader { magic: MAGIC, method: 0, sig: 0, _reserved: 0, deadline_ns: 0, root_addr: root.gptr().addr(), root_len: 12, _pad: [0; 3] };
    let hb = cd.alloc_copy(bytemuck::bytes_of(&h)).unwrap();
    ch.send(fido::Message::gather(vec![hb, root]).tag(6).opcode(OP_CALL)).unwrap();
    let m = ch.recv_timeout(Duration::from_secs(10)).unwrap();
    assert_eq!(m.tag(), 6);
    let (status, _, v) = fido_rpc::reply_parts(&m).unwrap();
    assert_eq!(status, STATUS_OK);
    assert_eq!(root_u64(v), 42);
    // Inline calls: too short for the inline header, then add(40, 2) with
    // its root in the descriptor (method 0, any signature, no deadline).
    ch.send(fido::Message::inline(b"short").unwrap().tag(7).opcode(OP_CALL)).unwrap();
    assert_eq!(fault_of(&ch.recv_timeout(Duration::from_secs(10)).unwrap()), (STATUS_FAULT, Fault::BadHeader as u32));
    let mut call = vec![0u8; INLINE_HEADER_LEN];
    call.extend_from_slice(&40u64.to_ne_bytes());
    call.extend_from_slice(&2u32.to_ne_bytes());
    ch.send(fido::Message::inline(&call).unwrap().tag(8).opcode(OP_CALL)).unwrap();
    let m = ch.recv_timeout(Duration::from_secs(10)).unwrap();
    assert_eq!(m.inline_bytes().map(<[u8]>::len), Some(INLINE_HEADER_LEN + 8), "a small result comes back inline");
    let (status, _, v) = fido_rpc::reply_parts(&m).unwrap();
    assert_eq!((m.tag(), status, root_u64(v)), (8, STATUS_OK, 42));
    // And a normal client is unaffected.
    let c = TestClient::connect(&cd, "test").unwrap();
    assert_eq!(*c.add(c.frame().unwrap(), 1, 2).unwrap().get(), 3);
}

/// A root that is exactly one `u64`, read in place.
fn root_u64(v: fido::PeerSlice<'_>) -> u64 {
    assert_eq!(v.len(), 8, "root length");
    u64::from_ne_bytes(v.read_obj(0).unwrap())
}

/// What a client keeps of a reply is counted in `bytes_copied`
/// (`ShmStrRef::to_string`, `to_vec` of a `Reply::slice` or of a string's
/// bytes); reading the result and the views in place is not.
#[test]
fn copies_kept_from_replies_are_counted() {
    let (_b, _sd, cd, _imp, _h) = setup(1);
    let c = TestClient::connect(&cd, "test").unwrap();
    let mut f = c.frame().unwrap();
    let s = f.str("hello vmrpc").unwrap();
    let r = c.upper(f, s).unwrap();
    let v = r.str(*r.get()).unwrap();
    assert!(v == "HELLO VMRPC" && v.as_bytes().iter().all(|b| b.is_ascii_uppercase() || b == b' '));
    assert_eq!(cd.counters().bytes_copied, 0, "reads in place");
    assert_eq!(v.to_string().unwrap(), "HELLO VMRPC");
    assert_eq!(cd.counters().bytes_copied, 11, "ShmStrRef::to_string");
    assert_eq!(v.as_bytes().to_vec(), b"HELLO VMRPC");
    assert_eq!(cd.counters().bytes_copied, 22, "a string's bytes, to_vec");
    let bytes = r.view().bytes(r.get().addr, 5).unwrap();
    assert_eq!(bytes.copy_to(&mut [0u8; 5]), 5);
    assert_eq!(cd.counters().bytes_copied, 27, "View::bytes().copy_to");
}
