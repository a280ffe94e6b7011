//! Failures across processes: a server killed mid-call, a client killed
//! mid-call, a server restarted under the same name (micro-reboot).
//! Children re-execute this binary with FIDO_TEST_ROLE (see `child_main`).

use fido_test_support::domains::Patient;
use fido_test_support::{eventually, ChildProc};
use fido::{Domain, JoinOptions};
use fido_rpc::{CallError, Ctx, Fault, RpcError, Server, ServerOptions};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

type TestBroker = fido_test_support::TestBroker<Patient>;

#[fido_rpc::service]
pub trait Slow: Send + Sync + 'static {
    /// Builds a `reply_len`-byte result, then waits up to `ms` or until
    /// cancelled.
    fn hold(&self, cx: &mut Ctx<'_>, ms: u64, reply_len: u64) -> Result<u64, Fault>;
    fn pid(&self, cx: &mut Ctx<'_>) -> u64;
}

#[derive(Default)]
struct SlowImpl {
    started: AtomicU64,
    cancelled: AtomicU64,
}

impl Slow for Arc<SlowImpl> {
    fn hold(&self, cx: &mut Ctx<'_>, ms: u64, reply_len: u64) -> Result<u64, Fault> {
        let (_h, _) = cx.frame().map_err(|_| Fault::ServerMemory)?.alloc_slice::<u8>(reply_len as usize).map_err(|_| Fault::ServerMemory)?;
        self.started.fetch_add(1, Ordering::SeqCst);
        let end = Instant::now() + Duration::from_millis(ms);
        while Instant::now() < end {
            if cx.is_cancelled() {
                self.cancelled.fetch_add(1, Ordering::SeqCst);
                return Err(Fault::Cancelled);
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        Ok(ms)
    }
    fn pid(&self, _cx: &mut Ctx<'_>) -> u64 {
        std::process::id() as u64
    }
}

fn join_env(name: &str) -> Domain {
    Domain::join(JoinOptions::new(name).arena_len(64 << 20)).unwrap()
}

fn connect_retry(d: &Domain, service: &str) -> SlowClient {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        match SlowClient::connect(d, service) {
            Ok(c) => return c,
            Err(e) if Instant::now() < deadline => {
                let _ = e;
                std::thread::sleep(Duration::from_millis(20));
            }
            Err(e) => panic!("connect {service}: {e}"),
        }
    }
}

#[test]
fn child_main() {
    let Ok(role) = std::env::var("FIDO_TEST_ROLE") else { return };
    match role.as_str() {
        "server" => {
            let d = join_env("slow-server");
            let _h = Server::spawn(&d, "slow", SlowServer(Arc::new(SlowImpl::default())), ServerOptions { workers: 2, wait: None }).unwrap();
            println!("ready {}", std::process::id());
            std::thread::sleep(Duration::from_secs(120));
        }
        "client" => {
            let d = join_env("slow-client");
            let c = connect_retry(&d, "slow");
            println!("calling");
            // Never returns: the parent kills us mid-call.
            let _ = c.hold(c.frame().unwrap(), 120_000, 1 << 20);
            std::thread::sleep(Duration::from_secs(120));
        }
        other => panic!("unknown role {other}"),
    }
}

#[test]
fn server_crash_fails_calls_in_flight_and_a_restarted_server_is_reached() {
    let b = TestBroker::start();
    let d = b.join("client");
    let mut server = ChildProc::spawn("server", &b.socket, &[]);
    let first_pid: u64 = server.expect_line("ready", Duration::from_secs(30)).parse().unwrap();
    let c = Arc::new(connect_retry(&d, "slow"));
    assert_eq!(*c.pid(c.frame().unwrap()).unwrap().get(), first_pid);
    let inflight: Vec<_> = (0..3)
        .map(|_| {
            let c = c.clone();
            std::thread::spawn(move || c.hold(c.frame().unwrap(), 60_000, 16).map(|r| *r.get()))
        })
        .collect();
    std::thread::sleep(Duration::from_millis(300));
    server.kill9();
    for t in inflight {
        match t.join().unwrap() {
            Err(CallError::Rpc(RpcError::ServerGone(why))) => assert!(!why.is_empty()),
            other => panic!("expected ServerGone, got {other:?}"),
        }
    }
    assert!(!c.0.is_connected());
    // Micro-reboot: a new server process under the same name; the same
    // client reconnects on its next call.
    let mut server2 = ChildProc::spawn("server", &b.socket, &[]);
    let second_pid: u64 = server2.expect_line("ready", Duration::from_secs(30)).parse().unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    let pid = loop {
        match c.pid(c.frame().unwrap()) {
            Ok(r) => break *r.get(),
            Err(e) => {
                assert!(Instant::now() < deadline, "no reconnect: {e}");
                std::thread::sleep(Duration::from_millis(50));
            }
        }
    };
    assert_eq!(pid, second_pid);
    assert_ne!(first_pid, second_pid);
    assert_eq!(*c.hold(c.frame().unwrap(), 1, 16).unwrap().get(), 1);
    server2.kill9();
}

#[test]
fn client_crash_cancels_its_calls_and_frees_their_memory() {
    let b = TestBroker::start();
    let sd = b.join("server");
    let imp = Arc::new(SlowImpl::default());
    let _h = Server::spawn(&sd, "slow", SlowServer(imp.clone()), ServerOptions { workers: 2, wait: None }).unwrap();
    let base = sd.arena().stats().bytes_in_use;
    let mut client = ChildProc::spawn("client", &b.socket, &[]);
    client.expect_line("calling", Duration::from_secs(30));
    eventually("the call starts", Duration::from_secs(20), || imp.started.load(Ordering::SeqCst) == 1);
    // The call built a 1 MiB result in our arena.
    assert!(sd.arena().stats().bytes_in_use >= base + (1 << 20));
    client.kill9();
    eventually("the server cancels the dead client's call", Duration::from_secs(20), || imp.cancelled.load(Ordering::SeqCst) == 1);
    eventually("its memory is freed", Duration::from_secs(20), || sd.arena().stats().bytes_in_use <= base + 64 * 1024);
    // Another client is served normally.
    let cd = b.join("client2");
    let c = connect_retry(&cd, "slow");
    assert_eq!(*c.hold(c.frame().unwrap(), 1, 16).unwrap().get(), 1);
}

#[test]
fn async_client_sees_the_crash_and_reconnects() {
    let b = TestBroker::start();
    let d = b.join("client");
    let mut server = ChildProc::spawn("server", &b.socket, &[]);
    let first_pid: u64 = server.expect_line("ready", Duration::from_secs(30)).parse().unwrap();
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    rt.block_on(async {
        let c = Arc::new(SlowAsyncClient::connect(&d, "slow").unwrap());
        assert_eq!(*c.pid(c.frame().unwrap()).await.unwrap().get(), first_pid);
        let inflight = {
            let c = c.clone();
            tokio::spawn(async move { c.hold(c.frame().unwrap(), 60_000, 16).await.map(|r| *r.get()) })
        };
        tokio::time::sleep(Duration::from_millis(300)).await;
        server.kill9();
        match tokio::time::timeout(Duration::from_secs(20), inflight).await.expect("the call ends").unwrap() {
            Err(CallError::Rpc(RpcError::ServerGone(_))) => {}
            other => panic!("expected ServerGone, got {other:?}"),
        }
        assert!(!c.0.is_connected());
        let mut server2 = ChildProc::spawn("server", &b.socket, &[]);
        let second_pid: u64 = server2.expect_line("ready", Duration::from_secs(30)).parse().unwrap();
        let deadline = Instant::now() + Duration::from_secs(20);
        let pid = loop {
            match c.pid(c.frame().unwrap()).await {
                Ok(r) => break *r.get(),
                Err(e) => {
                    assert!(Instant::now() < deadline, "no reconnect: {e}");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            }
        };
        assert_eq!(pid, second_pid);
        server2.kill9();
    });
}
