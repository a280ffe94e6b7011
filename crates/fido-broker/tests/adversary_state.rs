//! The broker's own state and its intake under attack (issue #16, findings
//! 5, 6, 7 and 13): the state directory against other local users, a broker
//! that was stopped for a while, floods of connections that never join, and
//! a damaged or full state disk.
//!
//! Most tests need root (real users made by `users::test_user`, `setpriv`,
//! a tmpfs mount); without it they say so and pass vacuously. Processes of
//! this test binary play the parts (`FIDO_ADV_ROLE`, see [`child_main`]).

use std::io::Write;
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use fido_broker::{Broker, Config, Policy};
use fido_proto::{ClientMsg, ErrorCode, Reply, Request};
use fido_test_support::raw::*;
use fido_test_support::users::{test_user, User};
use fido_test_support::child::{as_user, role_command};
use fido_test_support::{ChildProc, Defaults};

type TestBroker = fido_test_support::TestBroker<Defaults>;

fn is_root() -> bool {
    rustix::process::geteuid().is_root()
}

fn mode(path: &Path) -> u32 {
    std::fs::symlink_metadata(path).unwrap().mode() & 0o7777
}

/// A temporary directory others may traverse, as `/var/lib` or `/run` are.
fn open_tempdir() -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    dir
}

/// A broker whose socket other uids can reach, on a thread of this process.
fn open_broker(tweak: impl FnOnce(&mut Config)) -> TestBroker {
    TestBroker::start_with(|c| {
        c.heartbeat = Duration::from_millis(1000);
        c.heartbeat_misses = 60;
        let top = c.socket.parent().unwrap().parent().unwrap();
        std::fs::set_permissions(top, std::fs::Permissions::from_mode(0o755)).unwrap();
        tweak(c)
    })
}

/// Runs `sh -c script` as `user`; did it succeed?
fn sh_as(user: User, script: &str) -> bool {
    as_user(Some(user), Path::new("sh"), ["-c", script])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .expect("setpriv (util-linux) must be installed")
        .success()
}

/// This test binary in `role` (as `user`, or as ourselves), its lines read by the caller.
fn spawn_role(user: Option<User>, role: &str, env: &[(&str, String)]) -> ChildProc {
    let mut cmd = role_command(user);
    cmd.env("FIDO_ADV_ROLE", role);
    for (k, v) in env {
        cmd.env(k, v);
    }
    ChildProc::start(cmd)
}

/// A broker in a child process (so it can be stopped or limited), with the
/// default heartbeat (500 ms, 6 misses: 3 s).
fn broker_process(dir: &Path, policy: Option<String>, nofile: Option<u64>) -> (ChildProc, PathBuf) {
    let socket = dir.join("run/broker.sock");
    let mut env = vec![
        ("FIDO_ADV_SOCKET", socket.display().to_string()),
        ("FIDO_ADV_STATE", dir.join("state").display().to_string()),
    ];
    if let Some(p) = policy {
        env.push(("FIDO_ADV_POLICY", p));
    }
    if let Some(n) = nofile {
        env.push(("FIDO_ADV_NOFILE", n.to_string()));
    }
    let mut broker = spawn_role(None, "broker", &env);
    broker.expect_line("@@ listening", Duration::from_secs(30));
    (broker, socket)
}

fn join(raw: &mut Raw, name: &str) -> Result<Reply, fido_proto::RemoteError> {
    raw.join_labelled(name, None, ARENA_LEN)
}

fn joined_id(r: Result<Reply, fido_proto::RemoteError>) -> u64 {
    match r {
        Ok(Reply::Joined { domain, .. }) => domain,
        other => panic!("join failed: {other:?}"),
    }
}

/// How busy process `pid` is, relative to a thread that spins for `window`
/// meanwhile: about 1 for a process spinning too (whatever the machine's
/// load, both get the scheduler's fair share), near 0 for one that sleeps.
fn busy_relative_to_a_spinner(pid: i32, window: Duration) -> f64 {
    let thread_cpu = || {
        let t = rustix::time::clock_gettime(rustix::time::ClockId::ThreadCPUTime);
        Duration::new(t.tv_sec as u64, t.tv_nsec as u32)
    };
    let ticks = rustix::param::clock_ticks_per_second() as f64;
    let before = cpu_ticks(pid);
    let (start, spun_from) = (Instant::now(), thread_cpu());
    while start.elapsed() < window {
        std::hint::spin_loop();
    }
    let spun = (thread_cpu() - spun_from).as_secs_f64();
    let used = (cpu_ticks(pid) - before) as f64 / ticks;
    eprintln!("broker CPU {used:.2} s, spinner {spun:.2} s over {window:?}");
    used / spun.max(0.01)
}

/// CPU time (user + system, in clock ticks) process `pid` has used.
fn cpu_ticks(pid: i32) -> u64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    let after_comm = &stat[stat.rfind(')').unwrap() + 2..];
    let f: Vec<&str> = after_comm.split_whitespace().collect();
    // Fields 14 and 15 of stat(5), counted from the state (field 3).
    f[11].parse::<u64>().unwrap() + f[12].parse::<u64>().unwrap()
}

// ----- finding 5: the state directory belongs to the broker alone ----------

#[test]
fn other_users_can_neither_read_nor_lock_the_state() {
    let Some(outsider) = test_user("fido-test-b") else {
        return;
    };
    let b = open_broker(|_| {});
    let mut root = b.client();
    join(&mut root, "keeper").unwrap();
    root.ok(Request::Write {
        path: "/app/secret/db-password".into(),
        value: b"hunter2".to_vec(),
    });
    let state = b.config.state_dir.clone();
    assert_eq!(mode(&state), 0o700, "state directory mode");
    for f in ["broker.lock", "registry.sqlite", "registry.sqlite-wal", "registry.sqlite-shm"] {
        let p = state.join(f);
        if p.exists() {
            assert_eq!(mode(&p), 0o600, "{f} mode");
        }
    }
    let s = state.display();
    for (what, script) in [
        ("read the registry", format!("cat {s}/registry.sqlite")),
        ("read the WAL", format!("cat {s}/registry.sqlite-wal")),
        ("open the shared-memory index", format!("cat {s}/registry.sqlite-shm")),
        ("lock broker.lock", format!("flock -n -s {s}/broker.lock true")),
        ("list the state directory", format!("ls {s}")),
    ] {
        assert!(!sh_as(outsider, &script), "another user could {what}");
    }
    // The broker still works for its domains.
    assert_eq!(
        root.request(Request::Read { path: "/app/secret/db-password".into() }),
        Ok(Reply::Value(Some(b"hunter2".to_vec())))
    );
}

#[test]
fn an_old_open_state_directory_is_closed_and_a_foreign_one_refused() {
    let Some(other) = test_user("fido-test-b") else {
        return;
    };
    let mut b = open_broker(|_| {});
    let mut c = b.client();
    join(&mut c, "d").unwrap();
    drop(c);
    b.stop();
    // As an older broker left it: everything readable by all.
    let state = b.config.state_dir.clone();
    std::fs::set_permissions(&state, std::fs::Permissions::from_mode(0o755)).unwrap();
    for f in ["broker.lock", "registry.sqlite"] {
        std::fs::set_permissions(state.join(f), std::fs::Permissions::from_mode(0o644)).unwrap();
    }
    b.restart();
    assert_eq!(mode(&state), 0o700);
    assert_eq!(mode(&state.join("broker.lock")), 0o600);
    assert_eq!(mode(&state.join("registry.sqlite")), 0o600);
    b.stop();

    // A state directory another user owns could be swapped under the broker.
    std::os::unix::fs::chown(&state, Some(other.uid), Some(other.gid)).unwrap();
    let e = Broker::bind(b.config.clone()).expect_err("a foreign state directory was accepted");
    assert!(e.to_string().contains("belongs to uid"), "{e}");
    std::os::unix::fs::chown(&state, Some(0), Some(0)).unwrap();
}

#[test]
fn a_socket_directory_others_can_write_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let run = dir.path().join("run");
    std::fs::create_dir(&run).unwrap();
    std::fs::set_permissions(&run, std::fs::Permissions::from_mode(0o777)).unwrap();
    let config = fido_test_support::broker::config_in(dir.path());
    let e = Broker::bind(config.clone()).expect_err("a world-writable socket directory was accepted");
    assert!(e.to_string().contains("replace"), "{e}");
    // Sticky, as /tmp: others cannot remove or rename what is ours.
    std::fs::set_permissions(&run, std::fs::Permissions::from_mode(0o1777)).unwrap();
    Broker::bind(config).expect("a sticky directory is fine");
}

#[test]
fn a_lock_on_the_registry_fails_the_request_and_stalls_nothing() {
    // Only the broker's own user (or root) can still open the files: it
    // takes a read lock on the whole shared-memory index, as the attacker did.
    let dir = open_tempdir();
    let (_broker, socket) = broker_process(dir.path(), None, None);
    let mut writer = Raw::connect(&socket);
    join(&mut writer, "writer").unwrap();
    writer.ok(Request::Write { path: "/app/k".into(), value: b"1".to_vec() });
    let shm = dir.path().join("state/registry.sqlite-shm");
    assert!(shm.exists());
    let mut locker = spawn_role(None, "locker", &[("FIDO_ADV_FILE", shm.display().to_string())]);
    locker.expect_line("@@ locked", Duration::from_secs(30));

    let t = Instant::now();
    let r = writer.request(Request::Write { path: "/app/k".into(), value: b"2".to_vec() });
    let took = t.elapsed();
    assert!(
        matches!(&r, Err(e) if e.code == ErrorCode::Internal && e.message.contains("locked")),
        "{r:?}"
    );
    assert!(took < Duration::from_secs(2), "the broker waited {took:?} for the lock");

    drop(locker);
    writer.ok(Request::Write { path: "/app/k".into(), value: b"3".to_vec() });
}

// ----- finding 6: a broker that was stopped blames no client --------------

#[test]
fn a_stopped_broker_declares_no_one_dead() {
    let dir = tempfile::tempdir().unwrap();
    let (broker, socket) = broker_process(dir.path(), None, None);
    let mut domain = Raw::connect(&socket);
    join(&mut domain, "steady").unwrap();
    let beating = std::sync::atomic::AtomicBool::new(true);
    std::thread::scope(|s| {
        let d = &domain;
        let beat = &beating;
        s.spawn(move || {
            while beat.load(std::sync::atomic::Ordering::Relaxed) {
                d.heartbeat();
                std::thread::sleep(Duration::from_millis(200));
            }
        });
        std::thread::sleep(Duration::from_millis(500));
        broker.signal(rustix::process::Signal::STOP);
        std::thread::sleep(Duration::from_millis(3500));
        broker.signal(rustix::process::Signal::CONT);
        // A few heartbeat checks of the broker go by.
        std::thread::sleep(Duration::from_millis(2000));
        beating.store(false, std::sync::atomic::Ordering::Relaxed);
    });
    let r = domain.recv_raw(Duration::ZERO);
    assert!(!matches!(r, Some(None)), "the broker closed the domain's connection");
    assert!(matches!(domain.request(Request::Status), Ok(Reply::Status(_))));
}

// ----- finding 7: connections that never join ------------------------------

#[test]
fn an_unjoined_connection_expires_even_if_it_beats() {
    let b = TestBroker::start_with(|c| {
        c.join_timeout = Duration::from_millis(1500);
    });
    let mut idle = b.client();
    let t = Instant::now();
    let mut closed = false;
    while t.elapsed() < Duration::from_secs(15) {
        idle.heartbeat();
        if idle.wait_eof(Duration::from_millis(200)) {
            closed = true;
            break;
        }
    }
    assert!(closed, "a connection that never joined was kept for {:?}", t.elapsed());
    // Joining in time is unaffected.
    let mut d = b.client();
    std::thread::sleep(Duration::from_millis(500));
    join(&mut d, "on-time").unwrap();
    std::thread::sleep(Duration::from_millis(2500));
    assert!(matches!(d.request(Request::Status), Ok(Reply::Status(_))));
}

#[test]
fn a_flood_of_unjoined_connections_starves_no_one() {
    let (Some(admitted), Some(refused)) = (test_user("fido-test-a"), test_user("fido-test-b"))
    else {
        return;
    };
    let dir = open_tempdir();
    let policy = format!(
        r#"
        [[rule]]
        name = "root"
        uids = [0]
        offer = ["*"]
        connect = ["*"]
        registry_write = ["/**"]

        [[rule]]
        name = "a"
        uids = [{a}]
        "#,
        a = admitted.uid
    );
    let (broker, socket) = broker_process(dir.path(), Some(policy), Some(512));
    let sock = socket.display().to_string();
    let env = [("FIDO_ADV_SOCKET", sock), ("FIDO_ADV_COUNT", "700".to_string())];
    let mut floods = vec![
        spawn_role(Some(refused), "flooder", &env),
        spawn_role(Some(admitted), "flooder", &env),
    ];
    for f in &mut floods {
        f.expect_line("@@ flooding", Duration::from_secs(60));
    }

    let busy = busy_relative_to_a_spinner(broker.pid(), Duration::from_secs(2));
    assert!(busy < 0.5, "the broker spun on the flood ({busy:.2} of a spinning thread's CPU)");

    // Root gets in and is answered while the floods go on.
    let (tx, rx) = std::sync::mpsc::channel();
    let s = socket.clone();
    std::thread::spawn(move || {
        let mut root = Raw::connect(&s);
        let j = join(&mut root, "root-status").map(|_| ());
        let st = root.request(Request::Status).map(|_| ());
        let _ = tx.send((j, st));
    });
    let (j, st) = rx
        .recv_timeout(Duration::from_secs(10))
        .expect("root's status got no answer during the flood");
    j.unwrap();
    st.unwrap();
    for f in &mut floods {
        let held = f.expect_line("@@ held", Duration::from_secs(30));
        eprintln!("flooder kept {held} connections open");
    }
}

#[test]
fn accept_failures_back_off_instead_of_spinning() {
    let Some(admitted) = test_user("fido-test-a") else {
        return;
    };
    let dir = open_tempdir();
    let policy = format!(
        r#"
        [[rule]]
        name = "a"
        uids = [{a}]
        "#,
        a = admitted.uid
    );
    // So few descriptors that even one uid's share of unjoined connections
    // exhausts them: accept() fails with EMFILE while the backlog is full.
    let (broker, socket) = broker_process(dir.path(), Some(policy), Some(40));
    let env = [
        ("FIDO_ADV_SOCKET", socket.display().to_string()),
        // Past the descriptors left, within the listener's backlog (128).
        ("FIDO_ADV_COUNT", "120".to_string()),
    ];
    let mut flood = spawn_role(Some(admitted), "flooder", &env);
    flood.expect_line("@@ flooding", Duration::from_secs(60));
    let busy = busy_relative_to_a_spinner(broker.pid(), Duration::from_secs(2));
    assert!(busy < 0.5, "the broker spun failing to accept ({busy:.2} of a spinning thread's CPU)");
    let mut broker = broker;
    assert!(broker.child.try_wait().unwrap().is_none(), "the broker exited");
}

#[test]
fn a_refused_uid_is_answered_once_and_closed() {
    let Some(refused) = test_user("fido-test-b") else {
        return;
    };
    let b = open_broker(|_| {});
    let mut probe = spawn_role(
        Some(refused),
        "refused-probe",
        &[("FIDO_ADV_SOCKET", b.socket().display().to_string())],
    );
    probe.expect_line("@@ denied-then-closed", Duration::from_secs(30));
    let ms: u64 = probe.expect_line("@@ beating-closed-after-ms", Duration::from_secs(30)).parse().unwrap();
    assert!(ms < 10_000, "a refused uid's connection stayed {ms} ms");
    probe.wait_success(Duration::from_secs(30));
}

// ----- finding 13: a damaged or full state disk -----------------------------

fn restart_fails(b: &mut TestBroker) -> String {
    b.stop();
    match Broker::bind(b.config.clone()) {
        Ok(_) => panic!("the broker started on a damaged registry"),
        Err(e) => e.to_string(),
    }
}

#[test]
fn a_truncated_registry_is_refused_and_ids_never_repeat() {
    let mut b = TestBroker::start();
    let mut c = b.client();
    let first = joined_id(join(&mut c, "one"));
    drop(c);
    let db = b.config.state_dir.join("registry.sqlite");
    b.stop();
    std::fs::OpenOptions::new().write(true).open(&db).unwrap().set_len(0).unwrap();
    let e = restart_fails(&mut b);
    assert!(e.contains("damaged") && e.contains("truncated"), "{e}");

    // The operator moves it aside, as the error says: a fresh registry,
    // whose ids continue past every id handed out before.
    std::fs::rename(&db, db.with_extension("sqlite.damaged")).unwrap();
    b.restart();
    let mut c = b.client();
    let next = joined_id(join(&mut c, "two"));
    assert!(next > first, "domain id {next} repeats (first was {first})");
}

#[test]
fn a_corrupt_registry_is_refused_at_startup() {
    let mut b = TestBroker::start();
    let mut c = b.client();
    join(&mut c, "filler").unwrap();
    for i in 0..200 {
        c.ok(Request::Write { path: format!("/app/k{i}"), value: vec![b'x'; 1000] });
    }
    drop(c);
    let db = b.config.state_dir.join("registry.sqlite");
    b.stop();
    let len = std::fs::metadata(&db).unwrap().len();
    assert!(len > 16 * 4096, "registry is only {len} bytes");
    // Random bytes over a data page (not the header page).
    let mut f = std::fs::OpenOptions::new().write(true).open(&db).unwrap();
    let mut noise = vec![0u8; 4096];
    let mut x: u32 = 0x1234_5678;
    for b in &mut noise {
        x ^= x << 13;
        x ^= x >> 17;
        x ^= x << 5;
        *b = x as u8;
    }
    std::io::Seek::seek(&mut f, std::io::SeekFrom::Start(8 * 4096)).unwrap();
    f.write_all(&noise).unwrap();
    drop(f);
    let e = restart_fails(&mut b);
    assert!(e.contains("damaged"), "{e}");
}

/// A tmpfs of `size` mounted on `at`, unmounted when dropped.
struct Tmpfs(PathBuf);

impl Tmpfs {
    /// `None` (with a message saying the test is skipped) where mounting is
    /// not allowed (not root, or a container without CAP_SYS_ADMIN).
    fn mount(at: &Path, size: &str) -> Option<Tmpfs> {
        std::fs::create_dir_all(at).unwrap();
        let st = Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={size},mode=0700"), "tmpfs"])
            .arg(at)
            .stderr(Stdio::null())
            .status();
        if !st.is_ok_and(|s| s.success()) {
            eprintln!("SKIPPED: cannot mount a tmpfs on {} here", at.display());
            return None;
        }
        Some(Tmpfs(at.to_owned()))
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg("-l").arg(&self.0).status();
    }
}

/// Fills the filesystem of `dir` with a file; returns its path.
fn fill(dir: &Path) -> PathBuf {
    let path = dir.join("filler");
    let mut f = std::fs::File::create(&path).unwrap();
    let block = vec![0xa5u8; 64 * 1024];
    loop {
        if let Err(e) = f.write_all(&block) {
            assert_eq!(e.raw_os_error(), Some(libc::ENOSPC), "{e}");
            break;
        }
    }
    // Small pieces into what is left.
    while f.write_all(&block[..512]).is_ok() {}
    path
}

#[test]
fn on_a_full_disk_joins_are_refused_and_deletes_still_work() {
    if !is_root() {
        eprintln!("SKIPPED: needs root (to mount a tmpfs)");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path().join("state");
    let Some(_fs) = Tmpfs::mount(&state, "4m") else {
        return;
    };
    let mut config = fido_test_support::broker::config_in(dir.path());
    config.heartbeat = Duration::from_millis(1000);
    config.heartbeat_misses = 60;
    let b = fido_broker::Embedded::start(config.clone()).unwrap();
    let mut a = Raw::connect(b.socket());
    join(&mut a, "writer").unwrap();
    for i in 0..20 {
        a.ok(Request::Write { path: format!("/app/k{i}"), value: vec![b'v'; 2000] });
    }
    a.ok(Request::Offer { service: "svc-before".into() });
    let mut client = Raw::connect(b.socket());
    join(&mut client, "client").unwrap();
    let filler = fill(&state);

    // An offer that cannot be recorded is not made.
    let r = a.request(Request::Offer { service: "svc-full".into() });
    assert!(matches!(&r, Err(e) if e.message.contains("full")), "{r:?}");
    // A connection that cannot be recorded is not established: it fails at
    // Connect (no id), or its Accept fails and it stays pending, intact.
    let bells = [bell(), bell()];
    let connect = client.send_request(
        Request::Connect { service: "svc-before".into(), block: BLOCK },
        &[bells[0].as_fd(), bells[1].as_fd()],
    );
    let mut pending = None;
    match a.recv_timeout(WAIT) {
        Some((fido_proto::BrokerMsg::Event(fido_proto::Event::Incoming { conn, .. }), _)) => {
            let server_bells = [bell(), bell()];
            let (r, _) = a.request_fds(
                Request::Accept { conn, block: BLOCK },
                &[server_bells[0].as_fd(), server_bells[1].as_fd()],
            );
            assert!(matches!(&r, Err(e) if e.message.contains("full")), "{r:?}");
            pending = Some(conn);
        }
        Some(other) => panic!("unexpected {:?}", other.0),
        None => {
            let (r, _) = client.wait_reply(connect);
            assert!(matches!(&r, Err(e) if e.message.contains("full")), "{r:?}");
        }
    }

    // A join that cannot be recorded is refused, and leaves nothing behind.
    let mut late = Raw::connect(b.socket());
    let r = join(&mut late, "late");
    let e = r.expect_err("a join succeeded although its /domain keys cannot be written");
    assert!(e.message.contains("full"), "{e:?}");
    // So is a write, with a clear error.
    let r = a.request(Request::Write { path: "/app/new".into(), value: vec![b'w'; 3000] });
    assert!(matches!(&r, Err(e) if e.message.contains("full")), "{r:?}");
    // A delete frees space, and must work.
    for i in 0..20 {
        a.ok(Request::Delete { path: format!("/app/k{i}") });
    }
    assert_eq!(a.request(Request::List { path: "/app".into() }), Ok(Reply::Keys(vec![])));
    let listed = a.request(Request::List { path: "/domain".into() });
    let Ok(Reply::Keys(domains)) = listed else { panic!("{listed:?}") };
    assert_eq!(domains.len(), 2, "a refused join left keys: {domains:?}");

    std::fs::remove_file(filler).unwrap();
    joined_id(join(&mut late, "late"));
    a.ok(Request::Offer { service: "svc-full".into() });
    if let Some(conn) = pending {
        let server_bells = [bell(), bell()];
        let (r, _) = a.request_fds(
            Request::Accept { conn, block: BLOCK },
            &[server_bells[0].as_fd(), server_bells[1].as_fd()],
        );
        assert_eq!(r, Ok(Reply::Ok));
        let (r, _) = client.wait_reply(connect);
        assert!(matches!(r, Ok(Reply::Connected { .. })), "{r:?}");
    }
    drop((a, late, client));
    b.stop().unwrap();
}

// ----- the children ----------------------------------------------------------

/// The parts other processes play (a no-op in a normal run).
#[test]
fn child_main() {
    let Ok(role) = std::env::var("FIDO_ADV_ROLE") else {
        return;
    };
    let env = |k: &str| std::env::var(k).unwrap();
    match role.as_str() {
        "broker" => {
            if let Ok(n) = std::env::var("FIDO_ADV_NOFILE") {
                let n: u64 = n.parse().unwrap();
                rustix::process::setrlimit(
                    rustix::process::Resource::Nofile,
                    rustix::process::Rlimit { current: Some(n), maximum: Some(n) },
                )
                .unwrap();
            }
            let mut config = Config::new(env("FIDO_ADV_SOCKET"), env("FIDO_ADV_STATE"));
            if let Ok(text) = std::env::var("FIDO_ADV_POLICY") {
                config.policy = Arc::new(Policy::parse(&text, "adversary-policy").unwrap());
            }
            let broker = Broker::bind(config).unwrap();
            println!("@@ listening");
            broker.run().unwrap();
        }
        "locker" => {
            let f = std::fs::File::open(env("FIDO_ADV_FILE")).unwrap();
            rustix::fs::fcntl_lock(&f, rustix::fs::FlockOperation::NonBlockingLockShared).unwrap();
            println!("@@ locked");
            std::thread::sleep(Duration::from_secs(120));
        }
        "refused-probe" => {
            let socket = PathBuf::from(env("FIDO_ADV_SOCKET"));
            let mut c = Raw::connect(&socket);
            let r = join(&mut c, "intruder");
            assert!(matches!(&r, Err(e) if e.code == ErrorCode::Denied && e.message.contains("no rule matches")), "{r:?}");
            assert!(c.wait_eof(Duration::from_secs(10)), "not closed after the refusal");
            println!("@@ denied-then-closed");
            let c = Raw::connect(&socket);
            let t = Instant::now();
            while t.elapsed() < Duration::from_secs(20) {
                let _ = rustix::net::send(&c.sock, &fido_proto::encode(&ClientMsg::Heartbeat).unwrap(), rustix::net::SendFlags::NOSIGNAL);
                if fido_test_support::raw::readable(c.sock.as_fd(), Duration::from_millis(200)) {
                    break;
                }
            }
            println!("@@ beating-closed-after-ms {}", t.elapsed().as_millis());
        }
        "flooder" => flood(Path::new(&env("FIDO_ADV_SOCKET")), env("FIDO_ADV_COUNT").parse().unwrap()),
        other => panic!("unknown role {other}"),
    }
}

/// Opens `count` connections that never join and beats on every one, as a
/// hostile user would; reports how many the broker kept open.
fn flood(socket: &Path, count: usize) {
    let hard = rustix::process::getrlimit(rustix::process::Resource::Nofile).maximum;
    rustix::process::setrlimit(
        rustix::process::Resource::Nofile,
        rustix::process::Rlimit { current: hard, maximum: hard },
    )
    .unwrap();
    let addr = rustix::net::SocketAddrUnix::new(socket).unwrap();
    let beat = fido_proto::encode(&ClientMsg::Heartbeat).unwrap();
    let mut socks: Vec<OwnedFd> = Vec::new();
    let beat_all = |socks: &[OwnedFd]| {
        for s in socks {
            let _ = rustix::net::send(s, &beat, rustix::net::SendFlags::NOSIGNAL);
        }
    };
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut last_beat = Instant::now();
    while socks.len() < count && Instant::now() < deadline {
        // Beat while connecting too: silent ones would be dropped as hung.
        if last_beat.elapsed() > Duration::from_millis(300) {
            beat_all(&socks);
            last_beat = Instant::now();
        }
        let s = rustix::net::socket_with(
            rustix::net::AddressFamily::UNIX,
            rustix::net::SocketType::SEQPACKET,
            rustix::net::SocketFlags::CLOEXEC | rustix::net::SocketFlags::NONBLOCK,
            None,
        )
        .unwrap();
        match rustix::net::connect(&s, &addr) {
            Ok(()) => socks.push(s),
            // A full backlog: the broker is not accepting right now.
            Err(rustix::io::Errno::AGAIN) => std::thread::sleep(Duration::from_millis(5)),
            Err(e) => panic!("connect: {e}"),
        }
    }
    println!("@@ flooding");
    let end = Instant::now() + Duration::from_secs(6);
    while Instant::now() < end {
        beat_all(&socks);
        std::thread::sleep(Duration::from_millis(300));
    }
    let held = socks
        .iter()
        .filter(|s| {
            let mut b = [0u8; 64];
            !matches!(rustix::net::recv(s.as_fd(), &mut b, rustix::net::RecvFlags::DONTWAIT), Ok((0, _)) | Err(rustix::io::Errno::CONNRESET))
        })
        .count();
    println!("@@ held {held}");
    // Keep it up until killed: the flood does not stop for root's sake.
    loop {
        beat_all(&socks);
        std::thread::sleep(Duration::from_millis(300));
    }
}
