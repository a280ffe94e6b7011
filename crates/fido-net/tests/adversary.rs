//! A hostile local user against MMNet (issue #16, finding 2): two real
//! users, alice (the victim) and bob (the attacker), admitted by a root
//! broker with the policy `fido run` needs (`registry_write =
//! ["/app/<user>/**", "/net/**"]`). Bob writes and deletes raw registry keys
//! with the fido Domain API; none of it may reach alice's connections:
//!
//! - (a) bob pre-writes connection requests for alice's 4-tuple, pointing at
//!   a segment of his: the root server must not attach to it (bob would read
//!   what the server sends alice and speak as alice), and alice, a plain
//!   client, must get her echo — never a doorbell byte;
//! - (b) bob copies alice's pending request onto another connection's
//!   4-tuple: alice's second server must not attach to her first client's
//!   segment (her secret would reach the wrong server) and no side reads
//!   doorbell bytes as data;
//! - (c) bob deletes alice's listener keys and publishes a fake listener for
//!   a plain server of hers: her connections stay accelerated and never wait
//!   for an attach that cannot come.
//!
//! Needs root (users, `setpriv`); without it the tests say so and pass
//! vacuously. Children are this test binary again in a role (`child_main`).

use fido::{Domain, JoinOptions};
use fido_test_support::child::{as_user, role_command, RoleChild};
use fido_test_support::mmnet::*;
use fido_test_support::users::{test_user, User};
use fido_test_support::wait::*;
use std::io::{Read, Write};
use std::os::fd::FromRawFd;
use std::os::unix::fs::PermissionsExt;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const ROLE: &str = "FIDO_ADVERSARY_ROLE";

fn users() -> Option<(User, User)> {
    Some((test_user("fido-test-a")?, test_user("fido-test-b")?))
}

/// A root broker admitting root (the servers of (a)), alice and bob with the
/// registry rights `fido run` needs; its socket reachable by both users.
fn broker(alice: User, bob: User) -> Broker {
    let policy = format!(
        r#"
        [[rule]]
        name = "root"
        uids = [0]
        registry_write = ["/**"]
        [[rule]]
        name = "alice"
        uids = [{a}]
        registry_write = ["/app/alice/**", "/net/**"]
        [[rule]]
        name = "bob"
        uids = [{b}]
        registry_write = ["/app/bob/**", "/net/**"]
        "#,
        a = alice.uid,
        b = bob.uid
    );
    let b = Broker::start_with_policy(Some(&policy));
    std::fs::set_permissions(b.dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    b
}

fn echo(b: &Broker) -> PathBuf {
    let p = b.dir.path().join("echo");
    compile_c("echo.c", &p, &[]);
    p
}

/// This test binary in `role` as `user`, with `env`.
fn role(user: Option<User>, b: &Broker, role: &str, env: &[(&str, String)]) -> Command {
    let mut c = role_command(user);
    c.env(ROLE, role).env("FIDO_BROKER", &b.socket);
    for (k, v) in env {
        c.env(k, v);
    }
    c
}

/// `cmd` with MMNet preloaded (what `fido run` does) against `b`.
fn preloaded(b: &Broker, mut cmd: Command) -> Command {
    cmd.env("LD_PRELOAD", library())
        .env("FIDO_BROKER", &b.socket)
        .env_remove("FIDO_NET")
        .env("FIDO_NET_DEBUG", "1")
        .env("FIDO_NET_ATTACH_MS", "10000");
    cmd
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn netns_inode() -> u64 {
    std::os::unix::fs::MetadataExt::ino(&std::fs::metadata("/proc/self/ns/net").unwrap())
}

#[test]
fn a_forged_request_never_hands_a_connection_to_another_user() {
    let Some((alice, bob)) = users() else { return };
    let b = broker(alice, bob);
    let echo = echo(&b);
    let (port, sport) = (free_port(), free_port());
    // The server: root, under fido run.
    let _server = RoleChild::spawn(preloaded(
        &b,
        as_user(None, &echo, ["server", &port.to_string()]),
    ));
    wait_port(port);
    b.wait_listener(port);

    // Bob pre-writes requests for the 4-tuple alice's client will use,
    // naming a segment of his.
    let mut forger = RoleChild::spawn(role(
        Some(bob),
        &b,
        "forge",
        &[
            ("PORT", port.to_string()),
            ("SPORT", sport.to_string()),
            ("HOLD_MS", "4000".into()),
        ],
    ));
    forger.line("forged");

    // Alice, a plain client (no preload), says hello from that port.
    let msg = b"alice: session please".to_vec();
    let mut client = RoleChild::spawn(role(
        Some(alice),
        &b,
        "client",
        &[
            ("PORT", port.to_string()),
            ("SPORT", sport.to_string()),
            ("MSG", hex(&msg)),
        ],
    ));
    let got = client.line("got");
    let state = forger.line("state");
    assert_eq!(
        state, "0",
        "the root server attached to bob's segment (1 = attached): bob reads what it sends alice"
    );
    assert_eq!(
        got,
        hex(&msg),
        "alice's plain client did not get her echo (doorbell bytes as data?)"
    );
}

#[test]
fn b_a_copied_request_never_crosses_two_connections() {
    let Some((alice, bob)) = users() else { return };
    let b = broker(alice, bob);
    let (p1, p2, sport2) = (free_port(), free_port(), free_port());
    // Alice's two servers under fido run; the first accepts late, so her
    // first client's request is pending when the second server accepts.
    let server = |port: u16, delay: &str| {
        RoleChild::spawn(preloaded(
            &b,
            role(
                Some(alice),
                &b,
                "server",
                &[("PORT", port.to_string()), ("DELAY_MS", delay.into())],
            ),
        ))
    };
    let mut s1 = server(p1, "2500");
    let mut s2 = server(p2, "0");
    s1.line("listening");
    s2.line("listening");
    b.wait_listener(p1);
    b.wait_listener(p2);

    // Bob copies the first request he sees onto the 4-tuple of alice's
    // second (plain) client towards her second server.
    let target = format!("/net/conn/127.0.0.1/{p2}/{sport2}/{}", netns_inode());
    let mut copier = RoleChild::spawn(role(Some(bob), &b, "copy", &[("TARGET", target)]));
    copier.line("watching");

    let secret = b"alice-1: the secret".to_vec();
    let mut c1 = RoleChild::spawn(preloaded(
        &b,
        role(
            Some(alice),
            &b,
            "client",
            &[("PORT", p1.to_string()), ("MSG", hex(&secret))],
        ),
    ));
    let copied = copier.line("copy");
    let hello = b"alice-2: hello".to_vec();
    let mut c2 = RoleChild::spawn(role(
        Some(alice),
        &b,
        "client",
        &[
            ("PORT", p2.to_string()),
            ("SPORT", sport2.to_string()),
            ("MSG", hex(&hello)),
        ],
    ));
    let r2 = s2.line("recv");
    let g2 = c2.line("got");
    let r1 = s1.line("recv");
    let g1 = c1.line("got");
    eprintln!("bob's copy: {copied}");
    assert_eq!(
        r2,
        hex(&hello),
        "alice's second server got another connection's bytes (or doorbells)"
    );
    assert_eq!(
        r1,
        hex(&secret),
        "alice's first server got doorbell bytes as data"
    );
    assert_eq!(g2, hex(&hello));
    assert_eq!(g1, hex(&secret));
    drop(copier);
}

#[test]
fn c_deleting_listener_keys_costs_a_victim_nothing() {
    let Some((alice, bob)) = users() else { return };
    let b = broker(alice, bob);
    let echo = echo(&b);

    // Bob deletes every listener key of the port as soon as it appears.
    let port = free_port();
    let mut deleter =
        RoleChild::spawn(role(Some(bob), &b, "delete", &[("PORT", port.to_string())]));
    deleter.line("deleting");
    let _server = RoleChild::spawn(preloaded(
        &b,
        as_user(Some(alice), &echo, ["server", &port.to_string()]),
    ));
    wait_port(port);
    // Long enough for bob to see and delete the listener key.
    std::thread::sleep(Duration::from_millis(500));
    let mut c = preloaded(
        &b,
        as_user(Some(alice), &echo, ["client", &port.to_string(), "100000"]),
    );
    c.stdout(Stdio::piped());
    let out = wait_timeout(c.spawn().unwrap(), Duration::from_secs(60));
    assert!(out.status.success(), "{out:?}");
    deleter.close_stdin();
    let deleted = deleter.line("deleted");
    eprintln!("bob deleted {deleted} keys");
    assert_eq!(
        b.wait_accelerated("echo", 2).0,
        2,
        "alice's connection lost its acceleration to bob's deletions: {:?}",
        b.stats()
    );
}

#[test]
fn c_a_fake_listener_costs_a_victim_no_wait() {
    let Some((alice, bob)) = users() else { return };
    let b = broker(alice, bob);
    let echo = echo(&b);

    // Bob publishes a fake listener (alice's uid, his own live domain) for
    // a plain server of alice's: her client must not wait for an attach.
    let plain_port = free_port();
    let _plain = RoleChild::spawn(as_user(
        Some(alice),
        &echo,
        ["server", &plain_port.to_string()],
    ));
    wait_port(plain_port);
    let faker = {
        let mut k = RoleChild::spawn(role(
            Some(bob),
            &b,
            "fake-listener",
            &[
                ("PORT", plain_port.to_string()),
                ("VICTIM_UID", alice.uid.to_string()),
            ],
        ));
        let r = k.line("faked");
        eprintln!("bob's fake listener: {r}");
        k
    };
    // (Built before the clock starts: the first use may run cargo.)
    library();
    let t0 = Instant::now();
    let mut c = preloaded(
        &b,
        as_user(
            Some(alice),
            &echo,
            ["client", &plain_port.to_string(), "1000"],
        ),
    );
    c.stdout(Stdio::piped());
    let out = wait_timeout(c.spawn().unwrap(), Duration::from_secs(60));
    let took = t0.elapsed();
    assert!(out.status.success(), "{out:?}");
    assert!(
        took < Duration::from_secs(5),
        "alice's client waited {took:?} for an attach a fake listener promised (attach wait 10 s)"
    );
    drop(faker);
}

#[test]
fn d_an_offer_through_the_broker_never_reaches_another_users_server() {
    let Some((alice, bob)) = users() else { return };
    let b = broker(alice, bob);
    let echo = echo(&b);
    let port = free_port();
    let _server = RoleChild::spawn(preloaded(
        &b,
        as_user(Some(alice), &echo, ["server", &port.to_string()]),
    ));
    wait_port(port);
    b.wait_listener(port);
    // Bob offers a segment of his for his own connection to alice's server,
    // through the broker's real handshake.
    let mut bob_client = RoleChild::spawn(role(
        Some(bob),
        &b,
        "offer",
        &[("PORT", port.to_string()), ("HOLD_MS", "3000".into())],
    ));
    // The broker refuses it at once (every listener that could take the
    // connection is alice's: her server would refuse the claim anyway), so
    // nothing of bob's is even kept for her server to find.
    let offered = bob_client.line("offered");
    assert!(
        offered.starts_with("refused") && offered.contains("belongs to uid"),
        "bob's offer: {offered}"
    );
    assert_eq!(
        bob_client.line("state"),
        "0",
        "alice's server attached to bob's segment"
    );
}

// ----- the children's roles -------------------------------------------------------

/// Runs a role when started as a child (`FIDO_ADVERSARY_ROLE`); passes otherwise.
#[test]
fn child_main() {
    let Ok(role) = std::env::var(ROLE) else {
        return;
    };
    let env = |k: &str| std::env::var(k).unwrap_or_else(|_| panic!("{k} unset"));
    match role.as_str() {
        "offer" => offer(
            env("PORT").parse().unwrap(),
            env("HOLD_MS").parse().unwrap(),
        ),
        "forge" => forge(
            env("PORT").parse().unwrap(),
            env("SPORT").parse().unwrap(),
            env("HOLD_MS").parse().unwrap(),
        ),
        "copy" => copy(&env("TARGET")),
        "delete" => delete(env("PORT").parse().unwrap()),
        "fake-listener" => fake_listener(
            env("PORT").parse().unwrap(),
            env("VICTIM_UID").parse().unwrap(),
        ),
        "client" => client(
            env("PORT").parse().unwrap(),
            std::env::var("SPORT").ok().map(|p| p.parse().unwrap()),
            &unhex(&env("MSG")),
        ),
        "server" => server(
            env("PORT").parse().unwrap(),
            env("DELAY_MS").parse().unwrap(),
        ),
        other => panic!("unknown role {other}"),
    }
}

fn unhex(s: &str) -> Vec<u8> {
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
        .collect()
}

fn join(name: &str) -> Domain {
    Domain::join(JoinOptions::new(name).arena_len(64 << 10).ring_entries(2))
        .expect("joining the broker")
}

/// Blocks until the test closes our stdin (our domain stays alive meanwhile).
fn hold() {
    let mut sink = Vec::new();
    let _ = std::io::stdin().read_to_end(&mut sink);
}

/// Bob: a segment of his (valid header, known nonce) and requests naming it
/// for the 4-tuple `127.0.0.1:sport -> 127.0.0.1:port`; prints the state
/// the segment ends in (0 pending, 1 attached by a server).
fn forge(port: u16, sport: u16, hold_ms: u64) {
    let d = join("net-bob");
    let ring: usize = 1 << 16;
    let len = 4096 + 2 * ring;
    // SAFETY: creating, sizing and mapping a memfd of our own.
    let base = unsafe {
        let fd = libc::memfd_create(c"seg".as_ptr(), 0);
        assert!(fd >= 0);
        assert_eq!(libc::ftruncate(fd, len as libc::off_t), 0);
        let p = libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED,
            fd,
            0,
        );
        assert_ne!(p, libc::MAP_FAILED);
        let key_fd = fd;
        // Header: magic, version, ring length, nonce, state.
        let h = p as *mut u8;
        (h as *mut u64).write(0x6669_646f_6e65_7431);
        (h.add(8) as *mut u32).write(2);
        (h.add(12) as *mut u32).write(ring as u32);
        (h.add(16) as *mut u64).write(0x5eed);
        let value = format!("{} {key_fd} {} {ring}", std::process::id(), 0x5eed);
        let key = format!("/net/conn/127.0.0.1/{port}/{sport}/{}", netns_inode());
        match d.write(&key, value.as_bytes()) {
            Ok(()) => println!("forged {key}"),
            Err(e) => println!("forged nothing ({e})"),
        }
        h
    };
    std::io::stdout().flush().unwrap();
    watch_state(base, hold_ms);
}

/// A sealed segment with a valid header (nonce `0x5eed`) of 64 KiB rings:
/// its descriptor and mapping.
fn segment() -> (std::os::fd::OwnedFd, *mut u8) {
    let ring: usize = 1 << 16;
    let len = 4096 + 2 * ring;
    // SAFETY: creating, sizing, sealing and mapping a memfd of our own.
    unsafe {
        let fd = libc::memfd_create(c"seg".as_ptr(), libc::MFD_ALLOW_SEALING);
        assert!(fd >= 0);
        assert_eq!(libc::ftruncate(fd, len as libc::off_t), 0);
        assert_eq!(
            libc::fcntl(
                fd,
                libc::F_ADD_SEALS,
                libc::F_SEAL_SHRINK | libc::F_SEAL_GROW
            ),
            0
        );
        let p = libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED,
            fd,
            0,
        );
        assert_ne!(p, libc::MAP_FAILED);
        let h = p as *mut u8;
        (h as *mut u64).write(0x6669_646f_6e65_7431);
        (h.add(8) as *mut u32).write(2);
        (h.add(12) as *mut u32).write(ring as u32);
        (h.add(16) as *mut u64).write(0x5eed);
        (std::os::fd::OwnedFd::from_raw_fd(fd), h)
    }
}

/// Watches the state word of segment header `h` for `hold_ms`; prints the
/// highest state seen (0 pending, 1 attached by a server).
fn watch_state(h: *mut u8, hold_ms: u64) {
    let end = Instant::now() + Duration::from_millis(hold_ms);
    let mut seen = 0u32;
    while Instant::now() < end {
        // SAFETY: reading the state word of our own mapping.
        let s = unsafe { std::ptr::read_volatile(h.add(24) as *const u32) };
        seen = seen.max(s);
        std::thread::sleep(Duration::from_millis(5));
    }
    println!("state {seen}");
}

/// Bob: offers a segment through the broker for his own connection to
/// `127.0.0.1:port`, connects, and reports whether a server attached.
fn offer(port: u16, hold_ms: u64) {
    use std::os::fd::AsFd;
    let d = join("net-bob");
    let (seg, h) = segment();
    // A bound, unconnected socket (what fido-net offers with).
    // SAFETY: a socket of our own, bound with plain calls.
    let fd = unsafe {
        let fd = libc::socket(libc::AF_INET, libc::SOCK_STREAM, 0);
        assert!(fd >= 0);
        let mut a: libc::sockaddr_in = std::mem::zeroed();
        a.sin_family = libc::AF_INET as libc::sa_family_t;
        a.sin_addr.s_addr = u32::from_ne_bytes([127, 0, 0, 1]);
        let alen = std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t;
        assert_eq!(
            libc::bind(fd, &a as *const _ as *const libc::sockaddr, alen),
            0
        );
        std::os::fd::OwnedFd::from_raw_fd(fd)
    };
    let dst: std::net::SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
    match d.net_offer(fd.as_fd(), seg.as_fd(), dst, 1 << 16, 0x5eed) {
        Ok(id) => println!("offered ok {id}"),
        Err(e) => println!("offered refused ({e})"),
    }
    std::io::stdout().flush().unwrap();
    let s = std::net::TcpStream::from(fd);
    let sa = socket_addr_c(dst);
    // SAFETY: connecting our own socket to a sockaddr_in of the size given.
    let r = unsafe {
        libc::connect(
            std::os::fd::AsRawFd::as_raw_fd(&s),
            &sa as *const _ as *const libc::sockaddr,
            std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t,
        )
    };
    assert_eq!(r, 0, "connect: {}", std::io::Error::last_os_error());
    watch_state(h, hold_ms);
    drop(s);
}

fn socket_addr_c(a: std::net::SocketAddr) -> libc::sockaddr_in {
    let std::net::SocketAddr::V4(v4) = a else {
        panic!("IPv4 only")
    };
    // SAFETY: sockaddr_in is plain data.
    let mut s: libc::sockaddr_in = unsafe { std::mem::zeroed() };
    s.sin_family = libc::AF_INET as libc::sa_family_t;
    s.sin_addr.s_addr = u32::from_ne_bytes(v4.ip().octets());
    s.sin_port = v4.port().to_be();
    s
}

/// Bob: copies the first connection request written under `/net/conn` to
/// `target`.
fn copy(target: &str) {
    let d = join("net-bob");
    let w = d.watch("/net/conn").expect("watching /net/conn");
    println!("watching");
    std::io::stdout().flush().unwrap();
    let end = Instant::now() + Duration::from_secs(4);
    let mut done = false;
    while !done && Instant::now() < end {
        if let Some(ev) = w.recv_timeout(Duration::from_millis(50)) {
            if let Some(v) = ev.value {
                match d.write(target, &v) {
                    Ok(()) => println!("copy {} to {target}", ev.path),
                    Err(e) => println!("copy refused: {e}"),
                }
                done = true;
            }
        }
    }
    if !done {
        println!("copy: no request seen");
    }
    std::io::stdout().flush().unwrap();
    hold();
}

/// Bob: deletes every listener key of `port` as it appears, until stdin closes.
fn delete(port: u16) {
    let d = join("net-bob");
    println!("deleting");
    std::io::stdout().flush().unwrap();
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let s = stop.clone();
    std::thread::spawn(move || {
        hold();
        s.store(true, std::sync::atomic::Ordering::SeqCst);
    });
    let dir = format!("/net/listen/{port}");
    let mut n = 0;
    let end = Instant::now() + Duration::from_secs(300);
    while !stop.load(std::sync::atomic::Ordering::SeqCst) && Instant::now() < end {
        for k in d.list(&dir).unwrap_or_default() {
            if d.delete(&format!("{dir}/{k}")).is_ok() {
                n += 1;
                println!("deleted {n}");
                std::io::stdout().flush().unwrap();
            }
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    println!("deleted {n}");
}

/// Bob: a listener key for `port` that says it is the victim's, in his own
/// live domain.
fn fake_listener(port: u16, victim: u32) {
    let d = join("net-bob");
    let key = format!(
        "/net/listen/{port}/{}@127.0.0.1@{}@{victim}@{}",
        netns_inode(),
        d.id(),
        std::process::id()
    );
    match d.write(&key, std::process::id().to_string().as_bytes()) {
        Ok(()) => println!("faked {key}"),
        Err(e) => println!("faked nothing ({e})"),
    }
    std::io::stdout().flush().unwrap();
    hold();
}

/// Reads until `n` bytes, EOF or 5 s of silence.
fn read_some(s: &mut std::net::TcpStream, n: usize) -> Vec<u8> {
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let mut got = Vec::new();
    let mut buf = [0u8; 256];
    while got.len() < n {
        match s.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(k) => got.extend_from_slice(&buf[..k]),
        }
    }
    got
}

/// Connects to `127.0.0.1:port` (from `sport` if given), sends `msg`,
/// prints what comes back.
fn client(port: u16, sport: Option<u16>, msg: &[u8]) {
    let mut s = match sport {
        None => std::net::TcpStream::connect(("127.0.0.1", port)).unwrap(),
        // SAFETY: a socket of our own, bound and connected with plain calls.
        Some(sp) => unsafe {
            let fd = libc::socket(libc::AF_INET, libc::SOCK_STREAM, 0);
            assert!(fd >= 0);
            let one: libc::c_int = 1;
            libc::setsockopt(
                fd,
                libc::SOL_SOCKET,
                libc::SO_REUSEADDR,
                &one as *const _ as *const libc::c_void,
                4,
            );
            let mut a: libc::sockaddr_in = std::mem::zeroed();
            a.sin_family = libc::AF_INET as libc::sa_family_t;
            a.sin_addr.s_addr = u32::from_ne_bytes([127, 0, 0, 1]);
            a.sin_port = sp.to_be();
            let alen = std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t;
            assert_eq!(
                libc::bind(fd, &a as *const _ as *const libc::sockaddr, alen),
                0
            );
            a.sin_port = port.to_be();
            assert_eq!(
                libc::connect(fd, &a as *const _ as *const libc::sockaddr, alen),
                0
            );
            std::net::TcpStream::from_raw_fd(fd)
        },
    };
    s.write_all(msg).unwrap();
    let got = read_some(&mut s, msg.len());
    println!("got {}", hex(&got));
}

/// Listens on `127.0.0.1:port`, accepts one connection after `delay_ms`,
/// prints what it received (up to 5 s of silence) and echoes it.
fn server(port: u16, delay_ms: u64) {
    let l = std::net::TcpListener::bind(("127.0.0.1", port)).unwrap();
    println!("listening");
    std::io::stdout().flush().unwrap();
    std::thread::sleep(Duration::from_millis(delay_ms));
    let (mut s, _) = l.accept().unwrap();
    s.set_read_timeout(Some(Duration::from_secs(2))).unwrap();
    let mut got = Vec::new();
    let mut buf = [0u8; 256];
    // Everything the client sends arrives in one burst: read until 2 s of silence.
    loop {
        match s.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(k) => {
                got.extend_from_slice(&buf[..k]);
                s.set_read_timeout(Some(Duration::from_millis(300)))
                    .unwrap();
            }
        }
    }
    println!("recv {}", hex(&got));
    std::io::stdout().flush().unwrap();
    let _ = s.write_all(&got);
    std::thread::sleep(Duration::from_millis(500));
}
