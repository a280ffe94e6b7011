//! `iceoryx2` baseline: iceoryx2 0.10 publish-subscribe over its `ipc` service between two
//! processes, zero-copy loan API, polling on both sides — a request-response ping-pong
//! built from two pub-sub services (`…/ping`, `…/pong`) as in iceoryx2's own benchmarks,
//! but with processes instead of threads and the payload written by the sender
//! (`loan_slice_uninit` + fill) and folded by the receiver every iteration.

use std::mem::MaybeUninit;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail};
use iceoryx2::port::update_connections::UpdateConnections as _;
use iceoryx2::prelude::*;

use crate::harness::*;

const READY: u64 = u64::MAX - 1;
const STOP: u64 = u64::MAX;
const STALL: Duration = Duration::from_secs(10);

type Pub = iceoryx2::port::publisher::Publisher<ipc::Service, [u8], ()>;
type Sub = iceoryx2::port::subscriber::Subscriber<ipc::Service, [u8], ()>;

fn e<E: std::fmt::Debug>(what: &'static str) -> impl FnOnce(E) -> anyhow::Error {
    move |err| anyhow!("iceoryx2 {what}: {err:?}")
}

struct Ports {
    _node: Node<ipc::Service>,
    publisher: Pub,
    subscriber: Sub,
}

fn ports(base: &str, size: usize, publish_on: &str, subscribe_to: &str) -> anyhow::Result<Ports> {
    set_log_level(LogLevel::Error);
    let node = NodeBuilder::new()
        .signal_handling_mode(SignalHandlingMode::Disabled)
        .create::<ipc::Service>()
        .map_err(e("node"))?;
    // Remove what SIGKILLed runs (e.g. a parent killed mid-benchmark) left in /dev/shm.
    let _ = node.try_cleanup_dead_nodes();
    let service = |suffix: &str| {
        let name: ServiceName = format!("{base}/{suffix}")
            .as_str()
            .try_into()
            .map_err(e("service name"))?;
        node.service_builder(&name)
            .publish_subscribe::<[u8]>()
            .max_publishers(1)
            .max_subscribers(1)
            .history_size(0)
            .subscriber_max_buffer_size(1)
            .enable_safe_overflow(true)
            .open_or_create()
            .map_err(e("service"))
    };
    let out = service(publish_on)?;
    let inp = service(subscribe_to)?;
    let publisher = out
        .publisher_builder()
        .initial_max_slice_len(size)
        .create()
        .map_err(e("publisher"))?;
    let subscriber = inp.subscriber_builder().create().map_err(e("subscriber"))?;
    Ok(Ports {
        _node: node,
        publisher,
        subscriber,
    })
}

fn send(p: &Pub, size: usize, seq: u64) -> anyhow::Result<()> {
    let mut s = p.loan_slice_uninit(size).map_err(e("loan"))?;
    let buf: &mut [MaybeUninit<u8>] = s.payload_mut();
    // SAFETY: `buf` is the loaned chunk of exactly `size` bytes, exclusively ours until send.
    unsafe { fill_raw(buf.as_mut_ptr() as *mut u8, buf.len(), seq) };
    // SAFETY: fill_raw initialized every byte.
    let s = unsafe { s.assume_init() };
    s.send().map_err(e("send"))?;
    Ok(())
}

/// Polls until a sample arrives; returns the sequence number it carried (after folding).
fn recv(sub: &Sub, abort: &AtomicBool, stall: Duration) -> anyhow::Result<u64> {
    let mut got = None;
    let mut err = None;
    spin_until(
        || match sub.receive() {
            Ok(Some(s)) => {
                got = Some(fold(s.payload()));
                true
            }
            Ok(None) => false,
            Err(x) => {
                err = Some(x);
                true
            }
        },
        abort,
        stall,
    )?;
    if let Some(x) = err {
        bail!("iceoryx2 receive: {x:?}");
    }
    Ok(got.unwrap())
}

static SERIAL: AtomicU32 = AtomicU32::new(0);

/// Parent side of the ping-pong for one size (>= 8 bytes). Returns round-trip samples.
pub fn latency(size: usize, opts: &Opts) -> anyhow::Result<Vec<u64>> {
    let size = size.max(8);
    let place = Placement::detect();
    let base = format!(
        "fido-bench/{}-{}/{size}",
        std::process::id(),
        SERIAL.fetch_add(1, Ordering::Relaxed)
    );
    let ports = ports(&base, size, "ping", "pong")?;
    let _pin = PinGuard::pin(place.parent)?;
    let peer = Peer::spawn(
        &[
            "iceoryx2-pong",
            &format!("size={size}"),
            &format!("base={base}"),
            &format!("cpu={}", place.peer),
        ],
        &[],
    )?;
    let dog = Watchdog::new(peer.pid(), || {})?;
    let abort = dog.flag();
    // The peer announces itself on `pong` until it has seen our first ping.
    loop {
        if recv(&ports.subscriber, &abort, STALL)? == READY {
            break;
        }
    }
    let _ = ports.publisher.update_connections();
    let rtts = time_round_trips(opts.warmup(), opts.duration(), |k| {
        send(&ports.publisher, size, k)?;
        loop {
            let got = recv(&ports.subscriber, &abort, STALL)?;
            if got == k {
                return Ok(());
            }
            if got == READY {
                // a late announcement; our ping may have preceded the peer's subscriber
                // being connected: resend it.
                send(&ports.publisher, size, k)?;
                continue;
            }
            if got < k {
                continue; // duplicate reply to a ping we resent during the hand-shake
            }
            bail!("iceoryx2 pong carried {got}, expected {k}");
        }
    })?;
    send(&ports.publisher, size, STOP)?;
    drop(dog);
    peer.finish(Duration::from_secs(5))?;
    Ok(rtts)
}

fn pong_peer(a: &PeerArgs) -> anyhow::Result<()> {
    let size: usize = a.num("size")?;
    let base = a.get("base")?;
    let ports = ports(base, size, "pong", "ping")?;
    let never = AtomicBool::new(false);
    // Announce until the first ping arrives.
    let t = Instant::now();
    let first = loop {
        send(&ports.publisher, size, READY)?;
        let deadline = Instant::now() + Duration::from_millis(1);
        let mut got = None;
        while Instant::now() < deadline {
            if let Some(s) = ports.subscriber.receive().map_err(e("receive"))? {
                got = Some(fold(s.payload()));
                break;
            }
            std::hint::spin_loop();
        }
        if let Some(g) = got {
            break g;
        }
        if t.elapsed() > STALL {
            bail!("iceoryx2 peer: no ping within {STALL:?}");
        }
    };
    let mut k = first;
    loop {
        if k == STOP {
            return Ok(());
        }
        send(&ports.publisher, size, k)?;
        k = recv(&ports.subscriber, &never, Duration::MAX)?;
    }
}

pub(crate) fn peer(kind: &str, a: &PeerArgs) -> Option<anyhow::Result<()>> {
    match kind {
        "iceoryx2-pong" => Some(pong_peer(a)),
        _ => None,
    }
}
