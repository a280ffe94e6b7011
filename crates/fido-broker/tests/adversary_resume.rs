//! Hostile resumes (issue #16, finding 1), between two real users.
//!
//! A root broker whose policy admits two unprivileged users, alice and bob,
//! each allowed to offer and connect to its own services only. Bob forges
//! `Join { resume }` requests: naming ids and slots, claiming mappings of
//! alice's arena and connections with alice, taking alice's identity after a
//! broker restart, flooding the broker with a resume of thousands of items.
//! None of it may work, and alice's own resume must.
//!
//! The users are real (`fido-test-a` is alice, `fido-test-b` bob, created
//! when missing; root only — without root the tests say so and pass
//! vacuously). Each user's domains live in a child process, this test binary
//! run again under that uid with `setpriv`; the test drives it line by line
//! over stdin (see [`child_main`] for the commands) and reads `@@` answers.

use std::collections::HashMap;
use std::io::{BufRead, Write};
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use fido_broker::Policy;
use fido_proto::{Event, Reply, Request, Resume, ResumeSecret};
use fido_test_support::child::{role_command, RoleChild};
use fido_test_support::raw::*;
use fido_test_support::users::{test_user, User};
use fido_test_support::Defaults;
use rustix::fs::{MemfdFlags, Mode, OFlags, SealFlags};

type TestBroker = fido_test_support::TestBroker<Defaults>;

/// Held while this process runs a child and while a broker restarts. A
/// child holds copies of all our descriptors until it execs, the state
/// directory's lock among them (a flock belongs to the open file, not the
/// descriptor): a broker restarting in that window would find its state
/// directory still locked.
static FORKING: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn restart(b: &mut TestBroker) {
    let _g = FORKING.lock().unwrap_or_else(|e| e.into_inner());
    b.restart();
}

/// Alice may hold this many connections; bob's forged ones once filled it.
const ALICE_CONNECTIONS: u64 = 8;
/// What alice keeps in her arena, for nobody else's eyes.
const ALICE_SECRET: &str = "616c6963652d7365637265742d6279746573";

fn policy(alice: User, bob: User) -> Arc<Policy> {
    let text = format!(
        r#"
        [[rule]]
        name = "alice"
        uids = [{a}]
        offer = ["alice-*"]
        connect = ["alice-*"]
        registry_write = ["/app/alice/**", "/net/**"]
        connections = {ALICE_CONNECTIONS}

        [[rule]]
        name = "bob"
        uids = [{b}]
        offer = ["bob-*"]
        connect = ["bob-*"]
        registry_write = ["/app/bob/**", "/net/**"]

        [[rule]]
        name = "root"
        uids = [0]
        "#,
        a = alice.uid,
        b = bob.uid
    );
    Arc::new(Policy::parse(&text, "adversary-policy").unwrap())
}

/// A broker other uids can reach (its tempdir made 0755), with a heartbeat
/// slow enough that the children need not beat.
fn broker(alice: User, bob: User) -> TestBroker {
    TestBroker::start_with(|c| {
        c.policy = policy(alice, bob);
        c.heartbeat = Duration::from_millis(1000);
        c.heartbeat_misses = 60;
        let top = c.socket.parent().unwrap().parent().unwrap();
        std::fs::set_permissions(top, std::fs::Permissions::from_mode(0o755)).unwrap();
    })
}

fn users() -> Option<(User, User)> {
    // test_user runs `id` (and maybe `useradd`): children too.
    let _g = FORKING.lock().unwrap_or_else(|e| e.into_inner());
    Some((test_user("fido-test-a")?, test_user("fido-test-b")?))
}

// ----- the parent's side -----------------------------------------------------------

/// One user's process, driven over stdin.
struct Kid(RoleChild);

impl Kid {
    fn spawn(user: User, socket: &Path) -> Kid {
        let mut cmd = role_command(Some(user));
        cmd.env("FIDO_ADVERSARY_SOCKET", socket);
        // spawn() returns once the child has exec'ed (or failed to).
        let _g = FORKING.lock().unwrap_or_else(|e| e.into_inner());
        Kid(RoleChild::spawn(cmd))
    }

    /// Runs one command in the child; its answer, split into words.
    fn run(&mut self, cmd: &str) -> Vec<String> {
        let stdin = self.0.stdin.as_mut().expect("stdin held open");
        writeln!(stdin, "{cmd}").unwrap();
        stdin.flush().unwrap();
        let mut line = String::new();
        loop {
            line.clear();
            if self.0.out.read_line(&mut line).unwrap() == 0 {
                let st = self.0.child.wait().unwrap();
                panic!("child exited ({st}) while running {cmd:?}");
            }
            if let Some(rest) = line.trim_end().strip_prefix("@@ ") {
                return rest.split(' ').map(str::to_string).collect();
            }
        }
    }

    /// A fresh domain `client` named `name` whose arena starts with `fill`
    /// (hex); its (id, slot, secret).
    fn join_filled(&mut self, client: &str, name: &str, fill: &str) -> (u64, u32, String) {
        let a = self.run(&format!("join {client} {name} {fill}"));
        assert_eq!(a[0], "joined", "{a:?}");
        (a[1].parse().unwrap(), a[2].parse().unwrap(), a[3].clone())
    }

    fn join(&mut self, client: &str, name: &str) -> (u64, u32, String) {
        self.join_filled(client, name, "00")
    }
}

/// The `resume` command: as `client`, resume `id` in `slot` with `secret`,
/// claiming `mapped` (`slot:owner,…`) and `conns` (`conn:peer:service,…`
/// or `fake:N:peer:service` for N made-up ones); `-` for none.
fn resume_cmd(client: &str, id: u64, slot: u32, secret: &str, mapped: &str, conns: &str) -> String {
    format!("resume {client} {id} {slot} {secret} {mapped} {conns}")
}

const NO_SECRET: &str = "00000000000000000000000000000000000000000000000000000000000000ff";

#[test]
fn forged_resume_neither_reads_an_arena_nor_charges_another_user() {
    let Some((alice_u, bob_u)) = users() else {
        return;
    };
    let b = broker(alice_u, bob_u);
    let mut alice = Kid::spawn(alice_u, &b.socket());
    let mut bob = Kid::spawn(bob_u, &b.socket());

    let (a_id, a_slot, _) = alice.join_filled("srv", "alice-server", ALICE_SECRET);
    assert_eq!(alice.run("offer srv alice-svc"), ["ok"]);
    let (bob_id, _, _) = bob.join("own", "bob-own");

    // Bob names a fresh id and a free slot and claims to map alice's arena
    // and to hold connections with her.
    let forged = resume_cmd(
        "forger",
        bob_id + 50,
        60,
        NO_SECRET,
        &format!("{a_slot}:{a_id}"),
        &format!("fake:{ALICE_CONNECTIONS}:{a_id}:alice-svc"),
    );
    let answer = bob.run(&forged);
    assert_eq!(
        answer[..2],
        ["err", "Denied"],
        "a resume without the broker's secret must be refused: {answer:?}"
    );
    // Nothing granted: neither through the forged resume's socket nor
    // through bob's real domain.
    let grant = bob.run(&format!("grant forger {a_slot}"));
    assert!(
        !grant.iter().any(|w| w == ALICE_SECRET),
        "bob read alice's arena: {grant:?}"
    );
    assert_eq!(grant[0], "err", "{grant:?}");
    let grant = bob.run(&format!("grant own {a_slot}"));
    assert_eq!(grant[..2], ["err", "Denied"], "{grant:?}");

    // Alice's connection quota is hers: she still connects to her service.
    let (c_id, c_slot, _) = alice.join("cli", "alice-client");
    let link = alice.run("link srv cli alice-svc");
    assert_eq!(link[0], "ok", "alice's own connect failed: {link:?}");
    let conn = &link[1];

    // Nor can bob act on alice's connection by naming its id, or have a
    // grant by unmapping what he never mapped.
    for cmd in ["close", "refuse", "accept"] {
        let answer = bob.run(&format!("{cmd} own {conn}"));
        assert_eq!(
            answer[..2],
            ["err", "NoSuchConnection"],
            "{cmd}: {answer:?}"
        );
    }
    assert_eq!(bob.run(&format!("unmapped own {c_slot} {c_id}")), ["ok"]);
    let grant = bob.run(&format!("grant own {c_slot}"));
    assert_eq!(grant[..2], ["err", "Denied"], "{grant:?}");

    // The broker keeps no trace of the forgery.
    let mut root = b.client();
    root.join("root");
    match root.request(Request::Status) {
        Ok(Reply::Status(s)) => {
            assert_eq!(s.connections.len(), 1, "{:?}", s.connections);
            assert!(
                s.domains.iter().all(|d| d.domain != bob_id + 50),
                "{:?}",
                s.domains
            );
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn after_a_restart_only_alice_resumes_alice() {
    let Some((alice_u, bob_u)) = users() else {
        return;
    };
    let mut b = broker(alice_u, bob_u);
    let mut alice = Kid::spawn(alice_u, &b.socket());
    let mut bob = Kid::spawn(bob_u, &b.socket());
    let (a_id, a_slot, a_secret) = alice.join("srv", "alice-server");
    assert_eq!(alice.run("offer srv alice-svc"), ["ok"]);
    let (c_id, c_slot, c_secret) = alice.join("cli", "alice-client");
    let conn = alice.run("link srv cli alice-svc");
    assert_eq!(conn[0], "ok", "{conn:?}");
    let conn: u64 = conn[1].parse().unwrap();
    let (bob_id, bob_slot, _) = bob.join("own", "bob-own");

    restart(&mut b);

    // Bob takes alice's id and slot: without her secret, and even with it
    // (say it leaked) from the wrong uid.
    for secret in [NO_SECRET, a_secret.as_str()] {
        let theft = resume_cmd(
            "thief",
            a_id,
            a_slot,
            secret,
            &format!("{c_slot}:{c_id}"),
            &format!("{conn}:{c_id}:alice-svc"),
        );
        let answer = bob.run(&theft);
        assert_eq!(answer[..2], ["err", "Denied"], "{answer:?}");
    }
    // Nor does alice's secret resume bob's domain.
    let answer = bob.run(&resume_cmd("mine", bob_id, bob_slot, &a_secret, "-", "-"));
    assert_eq!(answer[..2], ["err", "Denied"], "{answer:?}");

    // Alice's own resumes work, connection and mapping included.
    let answer = alice.run(&resume_cmd(
        "srv2",
        a_id,
        a_slot,
        &a_secret,
        &format!("{c_slot}:{c_id}"),
        &format!("{conn}:{c_id}:alice-svc"),
    ));
    assert_eq!(
        answer[..3],
        ["ok", &a_id.to_string(), &a_slot.to_string()],
        "{answer:?}"
    );
    let answer = alice.run(&resume_cmd(
        "cli2",
        c_id,
        c_slot,
        &c_secret,
        &format!("{a_slot}:{a_id}"),
        &format!("{conn}:{a_id}:alice-svc"),
    ));
    assert_eq!(
        answer[..3],
        ["ok", &c_id.to_string(), &c_slot.to_string()],
        "{answer:?}"
    );
    let mut root = b.client();
    root.join("root");
    match root.request(Request::Status) {
        Ok(Reply::Status(s)) => {
            assert_eq!(s.connections.len(), 1, "{:?}", s.connections);
            let c = &s.connections[0];
            assert_eq!((c.conn, c.client, c.server), (conn, c_id, a_id));
        }
        other => panic!("{other:?}"),
    }
    // A second resume of a live domain, proof and all, is refused.
    let answer = alice.run(&resume_cmd("dup", a_id, a_slot, &a_secret, "-", "-"));
    assert_eq!(answer[..2], ["err", "AlreadyJoined"], "{answer:?}");
}

#[test]
fn a_huge_resume_is_refused_at_once_and_others_are_served() {
    let Some((alice_u, bob_u)) = users() else {
        return;
    };
    let mut b = broker(alice_u, bob_u);
    let mut alice = Kid::spawn(alice_u, &b.socket());
    let mut bob = Kid::spawn(bob_u, &b.socket());
    let (a_id, a_slot, a_secret) = alice.join("srv", "alice-server");
    let (bob_id, _, _) = bob.join("own", "bob-own");
    restart(&mut b);
    let mut root = b.client();
    root.join("root");

    // Bob's 4096 made-up connections, without a proof; then alice's own
    // resume carrying as many (over her quota of 8).
    let started = Instant::now();
    let answer = bob.run(&resume_cmd(
        "flood",
        bob_id + 50,
        60,
        NO_SECRET,
        "-",
        &format!("fake:4096:{a_id}:alice-svc"),
    ));
    assert_eq!(answer[..2], ["err", "Denied"], "{answer:?}");
    let answer = alice.run(&resume_cmd(
        "srv2",
        a_id,
        a_slot,
        &a_secret,
        "-",
        "fake:4096:1:alice-svc",
    ));
    assert_eq!(answer[..2], ["err", "Quota"], "{answer:?}");
    // Both answered quickly, and the broker still answers others at once
    // (generous bounds: a loaded 2-core machine; the flood took 3.6 s).
    let both: u64 = answer[2].parse::<u64>().unwrap();
    assert!(both < 1500, "a refused resume took {both} ms");
    let t = Instant::now();
    assert!(matches!(
        root.request(Request::Status),
        Ok(Reply::Status(_))
    ));
    assert!(t.elapsed() < Duration::from_secs(2), "{:?}", t.elapsed());
    assert!(started.elapsed() < Duration::from_secs(20));

    // The refused resume took nothing: alice's proper one still works.
    let answer = alice.run(&resume_cmd("srv3", a_id, a_slot, &a_secret, "-", "-"));
    assert_eq!(answer[0], "ok", "{answer:?}");
}

/// A domain's resume record goes when the domain goes: one that left, and
/// one that did not come back within the grace period after a restart, can
/// no longer be resumed, secret or not. (Same uid throughout: no users needed.)
#[test]
fn a_domain_that_left_or_stayed_away_cannot_be_resumed() {
    let mut b = TestBroker::start_with(|c| {
        c.heartbeat = Duration::from_millis(50);
        c.heartbeat_misses = 4;
    });
    let mut gone = b.client();
    let (gone_id, gone_slot) = gone.join("leaver");
    let mut away = b.client();
    let (away_id, away_slot) = away.join("away");
    assert_eq!(gone.request(Request::Leave), Ok(Reply::Ok));
    let bare = |domain, slot, secret| Resume {
        domain,
        slot,
        services: vec![],
        mapped: vec![],
        connections: vec![],
        watches: vec![],
        secret,
    };
    restart(&mut b);
    let r = b
        .client()
        .join_with("leaver", Some(bare(gone_id, gone_slot, gone.secret())));
    assert_eq!(r.unwrap_err().code, fido_proto::ErrorCode::Denied);
    // The grace period is one heartbeat timeout (200 ms); wait it out,
    // with a live domain beating so that the broker ticks.
    let mut live = b.client();
    live.join("live");
    let end = Instant::now() + Duration::from_millis(600);
    while Instant::now() < end {
        live.heartbeat();
        std::thread::sleep(Duration::from_millis(20));
    }
    let r = b
        .client()
        .join_with("away", Some(bare(away_id, away_slot, away.secret())));
    assert_eq!(r.unwrap_err().code, fido_proto::ErrorCode::Denied);
}

// ----- the children's side ----------------------------------------------------------

/// An arena already holding `bytes` at offset 0: (rw, ro).
fn filled_arena(bytes: &[u8]) -> (OwnedFd, OwnedFd) {
    let fd = rustix::fs::memfd_create(
        "adversary-arena",
        MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING,
    )
    .unwrap();
    rustix::fs::ftruncate(&fd, ARENA_LEN).unwrap();
    rustix::io::pwrite(&fd, bytes, 0).unwrap();
    rustix::fs::fcntl_add_seals(
        &fd,
        SealFlags::SHRINK | SealFlags::GROW | SealFlags::FUTURE_WRITE,
    )
    .unwrap();
    let path = format!("/proc/self/fd/{}", fd.as_raw_fd());
    let ro = rustix::fs::open(
        path.as_str(),
        OFlags::RDONLY | OFlags::CLOEXEC,
        Mode::empty(),
    )
    .unwrap();
    (fd, ro)
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn unhex(s: &str) -> Vec<u8> {
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
        .collect()
}

fn secret_of(s: &str) -> ResumeSecret {
    ResumeSecret(unhex(s).try_into().expect("32-byte secret"))
}

fn answer_err(e: &fido_proto::RemoteError) -> String {
    format!("err {:?}", e.code)
}

/// Entry point of the re-executed children; a no-op in a normal run.
///
/// Commands, one per stdin line (`C` names one of this child's clients):
/// `join C NAME HEX` (the arena starts with HEX), `offer C SERVICE`,
/// `link SERVER CLIENT SERVICE`, `grant C SLOT`, `close C CONN`,
/// `refuse C CONN`, `accept C CONN`, `unmapped C SLOT OWNER`,
/// `resume C ID SLOT SECRET MAPPED CONNS` (see [`resume_cmd`]).
#[test]
fn child_main() {
    let Ok(socket) = std::env::var("FIDO_ADVERSARY_SOCKET") else {
        return;
    };
    let socket = Path::new(&socket);
    let mut clients: HashMap<String, Raw> = HashMap::new();
    for line in std::io::stdin().lock().lines() {
        let line = line.unwrap();
        let w: Vec<&str> = line.split(' ').collect();
        let answer = match w[0] {
            "join" => {
                let (rw, ro) = filled_arena(&unhex(w[3]));
                let mut raw = Raw::connect(socket);
                let (r, _) = raw.request_fds(
                    Request::Join {
                        name: w[2].into(),
                        label: None,
                        arena_len: ARENA_LEN,
                        resume: None,
                    },
                    &[ro.as_fd()],
                );
                raw.arena = Some(rw);
                let a = match r {
                    Ok(Reply::Joined {
                        domain,
                        slot,
                        resume_secret,
                        ..
                    }) => format!("joined {domain} {slot} {}", hex(&resume_secret.0)),
                    Err(e) => answer_err(&e),
                    Ok(other) => panic!("{other:?}"),
                };
                clients.insert(w[1].into(), raw);
                a
            }
            "offer" => match clients.get_mut(w[1]).unwrap().request(Request::Offer {
                service: w[2].into(),
            }) {
                Ok(_) => "ok".into(),
                Err(e) => answer_err(&e),
            },
            "link" => {
                let mut client = clients.remove(w[2]).unwrap();
                let server = clients.get_mut(w[1]).unwrap();
                let bells = [bell(), bell()];
                let id = client.send_request(
                    Request::Connect {
                        service: w[3].into(),
                        block: BLOCK,
                    },
                    &[bells[0].as_fd(), bells[1].as_fd()],
                );
                let mut answer = None;
                if let Some((fido_proto::BrokerMsg::Event(Event::Incoming { conn, .. }), _)) =
                    server.recv_timeout(Duration::from_secs(2))
                {
                    let bells = [bell(), bell()];
                    let (r, _) = server.request_fds(
                        Request::Accept { conn, block: BLOCK },
                        &[bells[0].as_fd(), bells[1].as_fd()],
                    );
                    assert_eq!(r, Ok(Reply::Ok));
                    answer = Some(conn);
                }
                let (r, _) = client.wait_reply(id);
                clients.insert(w[2].into(), client);
                match (r, answer) {
                    (Ok(Reply::Connected { conn, .. }), Some(_)) => format!("ok {conn}"),
                    (Err(e), _) => answer_err(&e),
                    (other, _) => panic!("{other:?}"),
                }
            }
            "close" | "refuse" | "accept" | "unmapped" => {
                let raw = clients.get_mut(w[1]).unwrap();
                let n: u64 = w[2].parse().unwrap();
                let (body, bells) = match w[0] {
                    "close" => (Request::Close { conn: n }, vec![]),
                    "refuse" => (
                        Request::Refuse {
                            conn: n,
                            reason: "no".into(),
                        },
                        vec![],
                    ),
                    "accept" => (
                        Request::Accept {
                            conn: n,
                            block: BLOCK,
                        },
                        vec![bell(), bell()],
                    ),
                    _ => (
                        Request::Unmapped {
                            slot: n as u32,
                            owner: w[3].parse().unwrap(),
                        },
                        vec![],
                    ),
                };
                let fds: Vec<_> = bells.iter().map(|b| b.as_fd()).collect();
                match raw.request_fds(body, &fds).0 {
                    Ok(_) => "ok".into(),
                    Err(e) => answer_err(&e),
                }
            }
            "grant" => {
                let raw = clients.get_mut(w[1]).unwrap();
                let (r, fds) = raw.request_fds(
                    Request::GrantSlot {
                        slot: w[2].parse().unwrap(),
                    },
                    &[],
                );
                match r {
                    Ok(Reply::Grant { .. }) => {
                        let mut buf = [0u8; 18];
                        rustix::io::pread(&fds[0], &mut buf, 0).unwrap();
                        format!("ok {}", hex(&buf))
                    }
                    Err(e) => answer_err(&e),
                    Ok(other) => panic!("{other:?}"),
                }
            }
            "resume" => {
                let mapped = if w[5] == "-" {
                    vec![]
                } else {
                    w[5].split(',')
                        .map(|m| {
                            let (s, o) = m.split_once(':').unwrap();
                            (s.parse().unwrap(), o.parse().unwrap())
                        })
                        .collect()
                };
                let connections: Vec<(u64, u64, String)> = if w[6] == "-" {
                    vec![]
                } else if let Some(fake) = w[6].strip_prefix("fake:") {
                    let f: Vec<&str> = fake.split(':').collect();
                    let n: u64 = f[0].parse().unwrap();
                    (0..n)
                        .map(|i| (100 + i, f[1].parse().unwrap(), f[2].to_string()))
                        .collect()
                } else {
                    w[6].split(',')
                        .map(|c| {
                            let f: Vec<&str> = c.split(':').collect();
                            (
                                f[0].parse().unwrap(),
                                f[1].parse().unwrap(),
                                f[2].to_string(),
                            )
                        })
                        .collect()
                };
                let resume = Resume {
                    domain: w[2].parse().unwrap(),
                    slot: w[3].parse().unwrap(),
                    services: vec![],
                    mapped,
                    connections,
                    watches: vec![],
                    secret: secret_of(w[4]),
                };
                let mut raw = Raw::connect(socket);
                let t = Instant::now();
                let r = raw.join_with("resumer", Some(resume));
                let ms = t.elapsed().as_millis();
                let a = match r {
                    Ok(Reply::Joined { domain, slot, .. }) => format!("ok {domain} {slot} {ms}"),
                    Err(e) => format!("{} {ms}", answer_err(&e)),
                    Ok(other) => panic!("{other:?}"),
                };
                clients.insert(w[1].into(), raw);
                a
            }
            other => panic!("unknown command {other:?}"),
        };
        println!("@@ {answer}");
    }
}
