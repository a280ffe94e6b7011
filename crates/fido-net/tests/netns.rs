//! Connections between network namespaces of this host: two processes under
//! the preload in namespaces joined by a veth pair are accelerated (proven
//! from the published counters, data checked by each client against its own
//! per-process pattern); a peer without the library stays plain TCP and
//! works; and two pairs of namespaces that reuse the *same* addresses — the
//! ambiguous case — each get their own segment, never the other pair's.
//!
//! Needs root (`ip netns`, veth); without it the tests say so and pass
//! vacuously. Namespaces are named `fnt<pid>-<n>…` and deleted on drop, also
//! when a test fails (deleting a namespace destroys its veth end and pair).

use fido_test_support::mmnet::*;
use fido_test_support::wait::*;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

const T: Duration = Duration::from_secs(60);

fn root() -> bool {
    // SAFETY: geteuid cannot fail.
    let ok = unsafe { libc::geteuid() } == 0 && have("ip");
    if !ok {
        eprintln!("skipped: needs root and iproute2");
    }
    ok
}

fn ip(args: &[&str]) {
    let st = Command::new("ip").args(args).status().expect("ip");
    assert!(st.success(), "ip {args:?} failed");
}

/// A pair of namespaces `<base>a` (address .1) and `<base>b` (address .2)
/// joined by a veth, in the /24 `net`. Deleted on drop.
struct Pair {
    a: String,
    b: String,
}

static N: AtomicU32 = AtomicU32::new(0);

impl Pair {
    fn new(net: &str) -> Pair {
        let n = N.fetch_add(1, Ordering::SeqCst);
        let base = format!("fnt{}-{n}", std::process::id());
        let p = Pair {
            a: format!("{base}a"),
            b: format!("{base}b"),
        };
        // veth names: at most 15 bytes.
        let va = format!("fv{}{n}a", std::process::id() % 100_000);
        let vb = format!("fv{}{n}b", std::process::id() % 100_000);
        ip(&["netns", "add", &p.a]);
        ip(&["netns", "add", &p.b]);
        ip(&["link", "add", &va, "type", "veth", "peer", "name", &vb]);
        ip(&["link", "set", &va, "netns", &p.a]);
        ip(&["link", "set", &vb, "netns", &p.b]);
        for (ns, dev, host) in [(&p.a, &va, 1), (&p.b, &vb, 2)] {
            ip(&[
                "-n",
                ns,
                "addr",
                "add",
                &format!("{net}.{host}/24"),
                "dev",
                dev,
            ]);
            ip(&["-n", ns, "link", "set", dev, "up"]);
            ip(&["-n", ns, "link", "set", "lo", "up"]);
        }
        p
    }
}

impl Drop for Pair {
    fn drop(&mut self) {
        for ns in [&self.a, &self.b] {
            let _ = Command::new("ip")
                .args(["netns", "del", ns])
                .stderr(Stdio::null())
                .status();
        }
    }
}

/// `prog args…` in namespace `ns`, under the preload when `b` is given.
fn in_ns(b: Option<&Broker>, ns: &str, prog: &std::path::Path, args: &[&str]) -> Command {
    let mut c = Command::new("ip");
    c.args(["netns", "exec", ns]).arg(prog).args(args);
    c.env_remove("LD_PRELOAD").env_remove("FIDO_NET");
    if let Some(b) = b {
        c.env("LD_PRELOAD", library())
            .env("FIDO_BROKER", &b.socket)
            .env("FIDO_NET_ATTACH_MS", "10000");
    }
    c
}

fn server(b: Option<&Broker>, ns: &str, echo: &std::path::Path, port: u16) -> Guard {
    let mut c = in_ns(b, ns, echo, &["server", &port.to_string(), "0.0.0.0"]);
    c.stdout(Stdio::null());
    let g = Guard(c.spawn().unwrap());
    wait_listening(g.0.id(), port);
    if let Some(b) = b {
        b.wait_listener(port);
    }
    g
}

fn client(b: Option<&Broker>, ns: &str, echo: &std::path::Path, port: u16, dst: &str) {
    let c = in_ns(b, ns, echo, &["client", &port.to_string(), "300000", dst]);
    assert_eq!(run_ok(c, T).trim(), "ok 300000");
}

fn echo(b: &Broker) -> std::path::PathBuf {
    let p = b.dir.path().join("echo");
    compile_c("echo.c", &p, &[]);
    p
}

#[test]
fn connections_between_namespaces_are_accelerated_and_plain_peers_still_work() {
    if !root() {
        return;
    }
    let b = Broker::start();
    let echo = echo(&b);
    let pair = Pair::new("10.231.7");
    let port = 7001;
    let _s = server(Some(&b), &pair.b, &echo, port);
    client(Some(&b), &pair.a, &echo, port, "10.231.7.2");
    let (n, sent, recv) = b.wait_accelerated("echo", 2);
    assert_eq!(n, 2, "both ends accelerated: {:?}", b.stats());
    assert!(sent >= 600_000 && recv >= 600_000, "{sent}/{recv}");

    // A client without the library, across the namespaces: plain TCP, works.
    client(None, &pair.a, &echo, port, "10.231.7.2");
    // An accelerated client against a server without the library: plain.
    let _plain = server(None, &pair.b, &echo, port + 1);
    client(Some(&b), &pair.a, &echo, port + 1, "10.231.7.2");
    std::thread::sleep(Duration::from_millis(500));
    assert_eq!(b.accelerated("echo").0, 2, "{:?}", b.stats());
}

/// Two pairs of namespaces with identical addresses and the same server
/// port: a client's request could name the same 4-tuple as a request of the
/// other pair. Each server attaches only requests the kernel proves come
/// from the namespace at the other end of its own veth, so every connection
/// is accelerated with its own segment, and every client reads back exactly
/// its own bytes (the pattern depends on the client's pid).
#[test]
fn namespace_pairs_with_identical_addresses_never_share_segments() {
    if !root() {
        return;
    }
    let b = Broker::start();
    let echo = echo(&b);
    let p1 = Pair::new("10.231.8");
    let p2 = Pair::new("10.231.8");
    let port = 7002;
    let _s1 = server(Some(&b), &p1.b, &echo, port);
    let _s2 = server(Some(&b), &p2.b, &echo, port);
    b.wait_listeners(port, 2);
    let clients: Vec<_> = (0..6)
        .map(|i| {
            let ns = if i % 2 == 0 { &p1.a } else { &p2.a };
            let mut c = in_ns(
                Some(&b),
                ns,
                &echo,
                &["client", &port.to_string(), "300000", "10.231.8.2"],
            );
            c.stdout(Stdio::piped()).stderr(Stdio::piped());
            c.spawn().unwrap()
        })
        .collect();
    for c in clients {
        let out = wait_timeout(c, T);
        assert!(
            out.status.success() && String::from_utf8_lossy(&out.stdout).trim() == "ok 300000",
            "{out:?}"
        );
    }
    let (n, _, _) = b.wait_accelerated("echo", 12);
    assert_eq!(n, 12, "6 connections, both ends: {:?}", b.stats());

    // Now force the collision: both clients bind source port 40000, so the
    // two connections have the same 4-tuple. The first pair's server is
    // stopped, so its client's offer waits in the broker while the second
    // pair's server accepts and the broker finds *two* offers for its tuple.
    let sport = "40000";
    // SAFETY: stopping and resuming our own child.
    unsafe { libc::kill(_s1.0.id() as i32, libc::SIGSTOP) };
    let mut c1 = in_ns(
        Some(&b),
        &p1.a,
        &echo,
        &["client", &port.to_string(), "300000", "10.231.8.2", sport],
    );
    // Its debug output says when the offer is made (offers live in the
    // broker, not in the registry).
    c1.env("FIDO_NET_DEBUG", "1");
    c1.stdout(Stdio::piped()).stderr(Stdio::piped());
    let mut c1 = c1.spawn().unwrap();
    let (offered, seen) = std::sync::mpsc::channel();
    let err1 = c1.stderr.take().unwrap();
    std::thread::spawn(move || {
        use std::io::BufRead;
        for line in std::io::BufReader::new(err1).lines().map_while(Result::ok) {
            if line.contains("offered") {
                let _ = offered.send(());
            }
        }
    });
    assert!(
        seen.recv_timeout(Duration::from_secs(20)).is_ok(),
        "the first offer was never made"
    );
    let mut c2 = in_ns(
        Some(&b),
        &p2.a,
        &echo,
        &["client", &port.to_string(), "300000", "10.231.8.2", sport],
    );
    c2.env("FIDO_NET_DEBUG", "1");
    let out2 = wait_timeout(
        {
            c2.stdout(Stdio::piped()).stderr(Stdio::piped());
            c2.spawn().unwrap()
        },
        T,
    );
    // SAFETY: as above.
    unsafe { libc::kill(_s1.0.id() as i32, libc::SIGCONT) };
    let out1 = wait_timeout(c1, T);
    for out in [&out1, &out2] {
        assert!(
            out.status.success() && String::from_utf8_lossy(&out.stdout).trim() == "ok 300000",
            "{out:?}"
        );
    }
    let (n, _, _) = b.wait_accelerated("echo", 16);
    assert_eq!(
        n,
        16,
        "both colliding connections accelerated, each with its own segment: {:?}",
        b.stats()
    );
}
