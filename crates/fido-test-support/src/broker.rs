//! A private broker per test: bound in a fresh temporary directory and run on
//! a thread of the test process, stopped and waited for when dropped.
//!
//! How its configuration differs from the defaults is a [`Preset`], chosen by
//! the type a suite names (`TestBroker<domains::HangDetection>`, ...), so a
//! suite's tests all say `TestBroker::start()` and get the same broker.

use std::marker::PhantomData;
use std::path::{Path, PathBuf};
use std::thread::JoinHandle;

use fido_broker::{Broker, BrokerError, Config, ReloadHandle, ShutdownHandle};

/// How a suite's test brokers differ from the default configuration.
pub trait Preset {
    fn configure(config: &mut Config);

    /// The configuration of a test broker with `socket` and `state` (for a
    /// broker a test runs elsewhere, e.g. in a child process it can kill).
    fn config(socket: &Path, state: &Path) -> Config
    where
        Self: Sized,
    {
        let mut c = Config::new(socket, state);
        Self::configure(&mut c);
        c
    }
}

/// The broker's own defaults (the broker's tests, which test them).
pub struct Defaults;

impl Preset for Defaults {
    fn configure(_: &mut Config) {}
}

/// The default configuration of a test broker living in `dir`: its socket in
/// `dir/run/` (a directory the broker creates), its state in `dir/state`.
pub fn config_in(dir: &Path) -> Config {
    Config::new(dir.join("run/broker.sock"), dir.join("state"))
}

/// A broker on a thread of this process, in its own temporary directory.
pub struct TestBroker<P: Preset> {
    /// Where domains join (`config.socket`).
    pub socket: PathBuf,
    /// What it was started with (a restart starts it again with this).
    pub config: Config,
    pub handle: ShutdownHandle,
    /// Gives the running broker a new policy (what SIGHUP does).
    pub reload: ReloadHandle,
    thread: Option<JoinHandle<Result<(), BrokerError>>>,
    /// Removed last: `Drop` stops the broker before its directory goes.
    pub dir: tempfile::TempDir,
    preset: PhantomData<P>,
}

/// Binds a broker and runs it on its own thread, keeping both handles.
fn spawn(config: Config) -> (JoinHandle<Result<(), BrokerError>>, ShutdownHandle, ReloadHandle) {
    let broker = Broker::bind(config).expect("binding the test broker");
    let (handle, reload) = (broker.shutdown_handle(), broker.reload_handle());
    (std::thread::spawn(move || broker.run()), handle, reload)
}

impl<P: Preset> TestBroker<P> {
    pub fn start() -> Self {
        Self::start_with(|_| {})
    }

    /// A broker whose configuration `tweak` changes after the preset did.
    pub fn start_with(tweak: impl FnOnce(&mut Config)) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let mut config = config_in(dir.path());
        P::configure(&mut config);
        tweak(&mut config);
        let (thread, handle, reload) = spawn(config.clone());
        TestBroker { socket: config.socket.clone(), config, handle, reload, thread: Some(thread), dir, preset: PhantomData }
    }

    /// The socket domains join through.
    pub fn socket(&self) -> PathBuf {
        self.socket.clone()
    }

    /// Stops the broker and waits for its thread (the state directory stays);
    /// panics if its loop failed.
    pub fn stop(&mut self) {
        self.handle.shutdown();
        if let Some(t) = self.thread.take() {
            t.join().unwrap().unwrap();
        }
    }

    /// Starts a new broker with `self.config` (same socket and state directory).
    pub fn restart(&mut self) {
        self.stop();
        let (thread, handle, reload) = spawn(self.config.clone());
        self.socket = self.config.socket.clone();
        self.thread = Some(thread);
        self.handle = handle;
        self.reload = reload;
    }
}

impl<P: Preset> Drop for TestBroker<P> {
    fn drop(&mut self) {
        self.handle.shutdown();
        if let Some(t) = self.thread.take() {
            // How it ended is for `stop` to report; a drop only waits.
            let _ = t.join();
        }
    }
}
