//! Composition domains: a block device made of other block services.
//!
//! * RAID-1 ([`Layout::Mirror`]): every write goes to every mirror — the
//!   client's payload forwarded **by pointer** (`Message::shared_part`, one
//!   reference per mirror; the client's buffers go back when the last mirror
//!   released them), behind a 16-byte header of our own (the header we
//!   checked, not the client's, which it could change under us). A write
//!   completes when every live mirror completed. Reads go to one in-sync
//!   mirror (the least busy) and are retried on another on failure. A mirror
//!   that dies, errs or lies is marked down; the others keep serving, and
//!   the regions written meanwhile are remembered in a dirty bitmap. When
//!   its service comes back, the dirty regions (all of them for a mirror
//!   never known in sync) are copied from an in-sync mirror — READ data
//!   forwarded by pointer as the WRITE payload — while clients go on, and
//!   the mirror is in sync again.
//! * RAID-0 ([`Layout::Stripe`]) and concatenation ([`Layout::Concat`]): a
//!   request is split at chunk or member boundaries, each part forwarded by
//!   pointer to its member, and completed when every part is; a READ's
//!   parts are sent back to the client as one message gathering the
//!   members' buffers (`Message::shared_gather`). No redundancy: a member
//!   that is down fails the requests that touch it until it is back.
//!
//! The composition is a [`BlockBackend`]: [`crate::serve`] offers it,
//! validates every client request against its [`Info`] and hands it over.

mod bitmap;
mod member;

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use fido::{Domain, Message, Msg};
use parking_lot::{Condvar, Mutex};

use crate::proto::{self, Info, Op, HEADER_LEN};
use crate::server::{BackendQueue, BlockBackend, Replier, Request};
use bitmap::Bitmap;
use member::{call, write_header, Completion, Member, MemberEvents, Outcome};

/// How the members make up the device.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Layout {
    /// RAID-1: every member holds the whole device.
    Mirror,
    /// RAID-0: `chunk` bytes on each member in turn.
    Stripe { chunk: u64 },
    /// One member after the other.
    Concat,
}

impl Layout {
    pub fn name(&self) -> &'static str {
        match self {
            Layout::Mirror => "raid1",
            Layout::Stripe { .. } => "raid0",
            Layout::Concat => "concat",
        }
    }
}

/// What [`Raid::start`] builds.
#[derive(Clone, Debug)]
pub struct RaidOptions {
    pub layout: Layout,
    /// The members' block device names (services `blk:NAME`), in order.
    pub members: Vec<String>,
    /// RAID-1: the mirrors connected at start are taken as identical (no
    /// initial copy). Otherwise every mirror but the first connected one is
    /// copied from it first (reads go to in-sync mirrors only meanwhile).
    pub assume_clean: bool,
    /// RAID-1: a mirror that comes back is copied whole, not only the
    /// regions written while it was away (for members that do not keep
    /// their data across a restart, such as RAM disks).
    pub full_resync: bool,
    /// How long [`Raid::start`] waits for the members to be there: all of
    /// them for a stripe or concatenation, at least one mirror (the others
    /// join when they come).
    pub connect_timeout: Duration,
}

impl RaidOptions {
    pub fn new(layout: Layout, members: Vec<String>) -> RaidOptions {
        RaidOptions { layout, members, assume_clean: false, full_resync: false, connect_timeout: Duration::from_secs(10) }
    }
}

/// Why a composition cannot be built.
#[derive(Debug, thiserror::Error)]
pub enum RaidError {
    #[error("{0}")]
    Config(String),
    #[error("member {name}: {why}")]
    Member { name: String, why: String },
    #[error(transparent)]
    Io(#[from] std::io::Error),
}

/// A member's state in the composition.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MemberState {
    /// Connected and (for a mirror) in sync: serves reads and writes.
    Up,
    /// A mirror connected again, getting writes while its dirty regions are
    /// copied; serves reads only from regions that are not dirty.
    Resyncing,
    /// Not connected (or failed): writes to a mirror are remembered as dirty.
    Down,
}

impl MemberState {
    pub fn name(&self) -> &'static str {
        match self {
            MemberState::Up => "up",
            MemberState::Resyncing => "resyncing",
            MemberState::Down => "down",
        }
    }
}

/// One member in a [`RaidStatus`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MemberStatus {
    pub name: String,
    pub state: MemberState,
    /// RAID-1: regions written while the mirror was not in sync, still to copy.
    pub dirty_regions: u64,
    pub requests: u64,
    pub failures: u64,
    pub connects: u64,
    /// Why the member is down (the last connection's end or connect error).
    pub last_error: Option<String>,
}

/// The composition's state, for `fido blk` and the registry.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RaidStatus {
    pub layout: Layout,
    pub size: u64,
    /// RAID-1: the dirty-region size in bytes.
    pub region: u64,
    /// `clean`, `degraded` (a member down), `resyncing`, or `failed` (no
    /// member can serve).
    pub state: &'static str,
    pub members: Vec<MemberStatus>,
    /// Regions copied by the resync now running, and how many it started with.
    pub resync_done: u64,
    pub resync_total: u64,
    /// Regions copied since start, in all.
    pub resynced_regions: u64,
}

impl RaidStatus {
    /// `key=value` lines (`member.N.*` per member).
    pub fn to_text(&self) -> String {
        let mut s = format!(
            "layout={}\nsize={}\nstate={}\nregion={}\nresync_done={}\nresync_total={}\nresynced_regions={}\nmembers={}\n",
            self.layout.name(),
            self.size,
            self.state,
            self.region,
            self.resync_done,
            self.resync_total,
            self.resynced_regions,
            self.members.len()
        );
        for (i, m) in self.members.iter().enumerate() {
            s += &format!(
                "member.{i}.name={}\nmember.{i}.state={}\nmember.{i}.dirty_regions={}\nmember.{i}.requests={}\nmember.{i}.failures={}\nmember.{i}.connects={}\n",
                m.name,
                m.state.name(),
                m.dirty_regions,
                m.requests,
                m.failures,
                m.connects
            );
            if let Some(e) = &m.last_error {
                s += &format!("member.{i}.last_error={}\n", e.replace('\n', " "));
            }
        }
        s
    }
}

/// The registry key of composition `name`'s state ([`RaidStatus::to_text`]).
pub fn status_key(name: &str) -> String {
    format!("/blk/{name}/raid")
}

/// A running composition; its members' connections end when it is dropped.
pub struct Raid {
    inner: Arc<Inner>,
    resync: Mutex<Option<JoinHandle<()>>>,
}

/// Mirror bookkeeping, under one lock.
struct MirrorLock {
    states: Vec<MemberState>,
    /// Writes (and discards, write-zeroes) in flight: id -> [start, end).
    writes: HashMap<u64, (u64, u64)>,
    next_write: u64,
    /// The region the resync is copying (member, [start, end)): writes to it
    /// wait, reads of it avoid that member.
    copying: Option<(usize, u64, u64)>,
}

struct Mirrors {
    lock: Mutex<MirrorLock>,
    changed: Condvar,
    /// One per member: regions written while it was not in sync.
    dirty: Vec<Bitmap>,
    region: u64,
    resync_done: AtomicU64,
    resync_total: AtomicU64,
    resynced: AtomicU64,
}

struct Inner {
    layout: Layout,
    domain: Domain,
    members: Vec<Arc<Member>>,
    info: OnceLock<Info>,
    /// Stripe/concat: where each member's part starts (concat) and the
    /// bytes of each member in use.
    extents: OnceLock<Vec<(u64, u64)>>,
    /// Set once the layout is fixed (member events before are only noted).
    started: AtomicBool,
    full_resync: bool,
    stop: AtomicBool,
    /// RAID-1 state, set once the device's size is known.
    mirrors: OnceLock<Mirrors>,
    round_robin: AtomicUsize,
    /// Member states for stripe/concat (up while connected).
    plain_up: Vec<AtomicBool>,
}

/// The dirty-region size for a device of `size` bytes: at least 64 KiB and
/// at most 65536 regions (a bitmap of 8 KiB).
fn region_size(size: u64, block: u64) -> u64 {
    let mut region = 64 << 10;
    while size.div_ceil(region) > 65536 {
        region *= 2;
    }
    region.max(block)
}

impl Raid {
    /// Connects to the members (waiting up to `connect_timeout` for them),
    /// checks that they fit together and works out the device's [`Info`].
    pub fn start(domain: &Domain, opts: RaidOptions) -> Result<Arc<Raid>, RaidError> {
        let n = opts.members.len();
        match opts.layout {
            Layout::Mirror if n < 2 => return Err(RaidError::Config("a mirror needs at least 2 members".into())),
            Layout::Stripe { chunk } if n < 2 || chunk == 0 || chunk % 512 != 0 || chunk > u64::from(u32::MAX) => {
                return Err(RaidError::Config(format!("a stripe needs at least 2 members and a chunk that is a multiple of 512 (got {n} members, chunk {chunk})")))
            }
            Layout::Concat if n < 2 => return Err(RaidError::Config("a concatenation needs at least 2 members".into())),
            _ => {}
        }
        let mut seen = std::collections::HashSet::new();
        let mut members = Vec::new();
        for (i, name) in opts.members.iter().enumerate() {
            if !seen.insert(name.as_str()) {
                return Err(RaidError::Config(format!("member {name} given twice")));
            }
            members.push(Member::new(i, name).map_err(|e| RaidError::Member { name: name.clone(), why: e.to_string() })?);
        }
        let inner = Arc::new(Inner {
            layout: opts.layout,
            domain: domain.clone(),
            members,
            info: OnceLock::new(),
            extents: OnceLock::new(),
            started: AtomicBool::new(false),
            full_resync: opts.full_resync,
            stop: AtomicBool::new(false),
            mirrors: OnceLock::new(),
            round_robin: AtomicUsize::new(0),
            plain_up: (0..n).map(|_| AtomicBool::new(false)).collect(),
        });
        let raid = Raid { inner, resync: Mutex::new(None) };
        for m in &raid.inner.members {
            m.start(domain, raid.inner.clone())?;
        }
        // Wait for the members.
        let deadline = Instant::now() + opts.connect_timeout;
        let need_all = opts.layout != Layout::Mirror;
        loop {
            let up = raid.inner.members.iter().filter(|m| m.is_connected()).count();
            if up == n || (!need_all && up > 0 && Instant::now() >= deadline) {
                break;
            }
            if Instant::now() >= deadline {
                let missing: Vec<String> = raid
                    .inner
                    .members
                    .iter()
                    .filter(|m| !m.is_connected())
                    .map(|m| format!("{} ({})", m.name, m.last_error.lock().clone().unwrap_or_default()))
                    .collect();
                return Err(RaidError::Config(format!("members not reachable within {:?}: {}", opts.connect_timeout, missing.join(", "))));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let infos: Vec<Option<Info>> = raid.inner.members.iter().map(|m| m.info()).collect();
        let (info, extents) = layout_info(opts.layout, &raid.inner.members, &infos)?;
        if opts.layout == Layout::Mirror {
            let region = region_size(info.size, u64::from(info.logical_block));
            let _ = raid.inner.mirrors.set(Mirrors {
                lock: Mutex::new(MirrorLock { states: vec![MemberState::Down; n], writes: HashMap::new(), next_write: 1, copying: None }),
                changed: Condvar::new(),
                dirty: (0..n).map(|_| Bitmap::new(info.size.div_ceil(region))).collect(),
                region,
                resync_done: AtomicU64::new(0),
                resync_total: AtomicU64::new(0),
                resynced: AtomicU64::new(0),
            });
        }
        let _ = raid.inner.info.set(info);
        let _ = raid.inner.extents.set(extents);
        raid.inner.begin(opts.assume_clean);
        if opts.layout == Layout::Mirror {
            let inner = raid.inner.clone();
            let t = std::thread::Builder::new().name("raid-resync".into()).spawn(move || inner.resync_loop())?;
            *raid.resync.lock() = Some(t);
        }
        Ok(Arc::new(raid))
    }

    pub fn info(&self) -> Info {
        *self.inner.info.get().expect("set by start")
    }

    pub fn layout(&self) -> Layout {
        self.inner.layout
    }

    /// The composition's state now.
    pub fn status(&self) -> RaidStatus {
        self.inner.status()
    }
}

impl Drop for Raid {
    fn drop(&mut self) {
        self.inner.stop.store(true, Ordering::Relaxed);
        for m in &self.inner.members {
            m.signal_stop();
        }
        if let Some(m) = self.inner.mirrors.get() {
            m.changed.notify_all();
        }
        if let Some(t) = self.resync.lock().take() {
            let _ = t.join();
        }
        for m in &self.inner.members {
            m.stop();
        }
    }
}

/// The device the members make, and (stripe, concat) each member's extent
/// (start in the device, bytes used).
fn layout_info(layout: Layout, members: &[Arc<Member>], infos: &[Option<Info>]) -> Result<(Info, Vec<(u64, u64)>), RaidError> {
    let known: Vec<&Info> = infos.iter().flatten().collect();
    let block = known.iter().map(|i| i.logical_block).max().expect("at least one member is up");
    let b = u64::from(block);
    let max_transfer = known.iter().map(|i| i.max_transfer).min().expect("nonempty");
    let max_transfer = max_transfer - max_transfer % block;
    let queue_depth = known.iter().map(|i| i.queue_depth).min().expect("nonempty").max(1);
    let all = |flag: u32| known.iter().all(|i| i.flags & flag != 0);
    let mut flags = proto::INFO_CAN_MULTI_CONN;
    for f in [proto::INFO_FLUSH, proto::INFO_FUA, proto::INFO_DISCARD, proto::INFO_WRITE_ZEROES] {
        if all(f) {
            flags |= f;
        }
    }
    if known.iter().any(|i| i.read_only()) {
        flags |= proto::INFO_READ_ONLY;
    }
    if max_transfer == 0 {
        return Err(RaidError::Config("members' transfer sizes are smaller than their block".into()));
    }
    let usable = |i: &Info| i.size - i.size % b;
    let (size, extents) = match layout {
        Layout::Mirror => (known.iter().map(|i| usable(i)).min().expect("nonempty"), Vec::new()),
        Layout::Stripe { chunk } => {
            if chunk % b != 0 {
                return Err(RaidError::Config(format!("chunk {chunk} is not a multiple of the members' block {block}")));
            }
            let per = known.iter().map(|i| usable(i)).min().expect("nonempty") / chunk * chunk;
            if per == 0 {
                return Err(RaidError::Config(format!("members smaller than one chunk of {chunk} bytes")));
            }
            let n = members.len() as u64;
            (per * n, (0..n).map(|k| (k * per, per)).collect())
        }
        Layout::Concat => {
            let mut start = 0u64;
            let mut ext = Vec::new();
            for (m, i) in members.iter().zip(infos) {
                let i = i.as_ref().ok_or_else(|| RaidError::Member { name: m.name.clone(), why: "not connected".into() })?;
                let len = usable(i);
                if len == 0 {
                    return Err(RaidError::Member { name: m.name.clone(), why: "smaller than one block".into() });
                }
                ext.push((start, len));
                start = start.checked_add(len).ok_or_else(|| RaidError::Config("members too large".into()))?;
            }
            (start, ext)
        }
    };
    if size == 0 {
        return Err(RaidError::Config("the composed device would be empty".into()));
    }
    let info = Info { size, logical_block: block, max_transfer, flags, queue_depth };
    info.validate().map_err(|e| RaidError::Config(e.to_string()))?;
    Ok((info, extents))
}

impl MemberEvents for Inner {
    fn check_info(&self, index: usize, info: &Info) -> Result<(), String> {
        let Some(raid) = self.info.get() else {
            // Still starting: the layout is worked out from what comes.
            return Ok(());
        };
        if raid.logical_block % info.logical_block != 0 {
            return Err(format!("block {} does not divide the composition's {}", info.logical_block, raid.logical_block));
        }
        if info.max_transfer < raid.max_transfer {
            return Err(format!("max transfer {} below the composition's {}", info.max_transfer, raid.max_transfer));
        }
        if info.read_only() && !raid.read_only() {
            return Err("read-only".into());
        }
        let needed = match self.layout {
            Layout::Mirror => raid.size,
            _ => self.extents.get().expect("set with info")[index].1,
        };
        if info.size < needed {
            return Err(format!("{} bytes, the composition needs {needed}", info.size));
        }
        Ok(())
    }

    fn member_up(&self, index: usize) {
        match (self.layout, self.mirrors.get()) {
            (Layout::Mirror, None) => {}
            (Layout::Mirror, Some(m)) => {
                let mut st = m.lock.lock();
                if !self.started.load(Ordering::Relaxed) {
                    return;
                }
                if st.states[index] == MemberState::Down {
                    if self.full_resync {
                        m.dirty[index].set_all();
                    }
                    // Its dirty regions (all, if it was never in sync) are
                    // copied by the resync thread; writes reach it from now.
                    st.states[index] = MemberState::Resyncing;
                    tracing::info!(member = %self.members[index].name, dirty = m.dirty[index].count(), "mirror back: resyncing");
                }
                m.changed.notify_all();
            }
            _ => self.plain_up[index].store(true, Ordering::Relaxed),
        }
    }

    fn member_down(&self, index: usize, _why: &str) {
        match (self.layout, self.mirrors.get()) {
            (Layout::Mirror, None) => {}
            (Layout::Mirror, Some(m)) => {
                let mut st = m.lock.lock();
                st.states[index] = MemberState::Down;
                m.changed.notify_all();
            }
            _ => self.plain_up[index].store(false, Ordering::Relaxed),
        }
    }
}

/// What one client request's parts have come to.
struct Gather {
    left: usize,
    /// The first failure's status.
    status: u16,
    /// READ parts' data, by part.
    data: Vec<Option<Msg>>,
    reply: Option<Replier>,
}

impl Inner {
    fn info(&self) -> &Info {
        self.info.get().expect("set by start")
    }

    /// Fixes the initial states once the layout is known.
    fn begin(&self, assume_clean: bool) {
        match self.mirrors.get() {
            Some(m) => {
                let mut st = m.lock.lock();
                let mut have_source = false;
                for (i, member) in self.members.iter().enumerate() {
                    if member.is_connected() && (assume_clean || !have_source) {
                        st.states[i] = MemberState::Up;
                        have_source = true;
                    } else {
                        // Unknown contents: everything is to be copied.
                        m.dirty[i].set_all();
                        st.states[i] = if member.is_connected() { MemberState::Resyncing } else { MemberState::Down };
                    }
                }
                self.started.store(true, Ordering::Relaxed);
                m.changed.notify_all();
            }
            None => {
                for (i, member) in self.members.iter().enumerate() {
                    self.plain_up[i].store(member.is_connected(), Ordering::Relaxed);
                }
                self.started.store(true, Ordering::Relaxed);
            }
        }
    }

    fn status(&self) -> RaidStatus {
        let info = self.info();
        let member = |i: usize, state: MemberState, dirty: u64| {
            let m = &self.members[i];
            MemberStatus {
                name: m.name.clone(),
                state,
                dirty_regions: dirty,
                requests: m.requests.load(Ordering::Relaxed),
                failures: m.failures.load(Ordering::Relaxed),
                connects: m.connects.load(Ordering::Relaxed),
                last_error: m.last_error.lock().clone(),
            }
        };
        match self.mirrors.get() {
            Some(m) => {
                let states = m.lock.lock().states.clone();
                let members: Vec<MemberStatus> = states.iter().enumerate().map(|(i, s)| member(i, *s, m.dirty[i].count())).collect();
                let state = if !states.contains(&MemberState::Up) {
                    "failed"
                } else if states.contains(&MemberState::Down) {
                    "degraded"
                } else if states.contains(&MemberState::Resyncing) {
                    "resyncing"
                } else {
                    "clean"
                };
                RaidStatus {
                    layout: self.layout,
                    size: info.size,
                    region: m.region,
                    state,
                    members,
                    resync_done: m.resync_done.load(Ordering::Relaxed),
                    resync_total: m.resync_total.load(Ordering::Relaxed),
                    resynced_regions: m.resynced.load(Ordering::Relaxed),
                }
            }
            None => {
                let members: Vec<MemberStatus> = (0..self.members.len())
                    .map(|i| member(i, if self.plain_up[i].load(Ordering::Relaxed) { MemberState::Up } else { MemberState::Down }, 0))
                    .collect();
                let state = if members.iter().all(|m| m.state == MemberState::Up) { "clean" } else { "failed" };
                RaidStatus { layout: self.layout, size: info.size, region: 0, state, members, resync_done: 0, resync_total: 0, resynced_regions: 0 }
            }
        }
    }

    // ---------------------------------------------------------------- RAID-1

    fn mirrors(&self) -> &Mirrors {
        self.mirrors.get().expect("a mirror, started")
    }

    /// A mirror that can serve a read of [start, end) now, not in `tried`:
    /// in sync, or resyncing with the range clean and not being copied; the
    /// least busy, ties in turn.
    fn read_target(&self, start: u64, end: u64, tried: &[usize]) -> Option<usize> {
        let m = self.mirrors();
        let st = m.lock.lock();
        let n = self.members.len();
        let first = self.round_robin.fetch_add(1, Ordering::Relaxed);
        (0..n)
            .map(|k| (first + k) % n)
            .filter(|i| !tried.contains(i))
            .filter(|&i| match st.states[i] {
                MemberState::Up => true,
                MemberState::Resyncing => {
                    m.dirty[i].is_clean(start / m.region, (end - 1) / m.region)
                        && !matches!(st.copying, Some((c, s, e)) if c == i && s < end && start < e)
                }
                MemberState::Down => false,
            })
            .min_by_key(|&i| self.members[i].in_flight())
    }

    /// Marks mirror `i` failed: down, [start, end) dirty, its connection
    /// ended (it is tried again and resynced when it answers).
    fn mirror_failed(&self, i: usize, range: Option<(u64, u64)>, why: String) {
        let m = self.mirrors();
        let mut st = m.lock.lock();
        if let Some((start, end)) = range {
            m.dirty[i].set_range(start / m.region, (end - 1) / m.region);
        }
        if st.states[i] != MemberState::Down {
            tracing::warn!(member = %self.members[i].name, why = %why, "mirror failed: degraded");
            st.states[i] = MemberState::Down;
        }
        m.changed.notify_all();
        drop(st);
        self.members[i].fail(why);
    }

    fn mirror_read(self: &Arc<Self>, offset: u64, len: u32, reply: Replier, tried: Vec<usize>, last_status: u16) {
        let end = offset + u64::from(len);
        let Some(i) = self.read_target(offset, end, &tried) else {
            reply.error(if last_status == 0 { proto::EIO } else { last_status });
            return;
        };
        let me = self.clone();
        let done: Completion = Box::new(move |outcome| match outcome {
            Outcome::Answered { status: 0, data: Some(data) } => reply.data(data),
            other => {
                let status = other.status();
                me.mirror_failed(i, None, format!("READ failed: {}", proto::status_name(status)));
                let mut tried = tried;
                tried.push(i);
                me.mirror_read(offset, len, reply, tried, status);
            }
        });
        self.members[i].submit_header(proto::OP_READ, offset, len, 0, done);
    }

    /// Registers a modifying request on [start, end) (waiting while the
    /// resync copies an overlapping region) and returns its id and the
    /// mirrors to send it to; the mirrors that are down get the range dirty.
    fn begin_write(&self, start: u64, end: u64) -> (u64, Vec<usize>) {
        let m = self.mirrors();
        let mut st = m.lock.lock();
        while matches!(st.copying, Some((_, s, e)) if s < end && start < e) {
            m.changed.wait(&mut st);
        }
        let id = st.next_write;
        st.next_write += 1;
        st.writes.insert(id, (start, end));
        let mut targets = Vec::new();
        for (i, s) in st.states.iter().enumerate() {
            match s {
                MemberState::Down => m.dirty[i].set_range(start / m.region, (end - 1) / m.region),
                _ => targets.push(i),
            }
        }
        (id, targets)
    }

    /// Ends a modifying request: whether it reached a mirror that holds the
    /// range validly now (in sync, or resyncing with the range clean).
    fn end_write(&self, id: u64, start: u64, end: u64, ok: &[usize]) -> bool {
        let m = self.mirrors();
        let mut st = m.lock.lock();
        st.writes.remove(&id);
        // Only the resync waits for writes to end (before it copies a region).
        if st.copying.is_some() {
            m.changed.notify_all();
        }
        ok.iter().any(|&i| match st.states[i] {
            MemberState::Up => true,
            MemberState::Resyncing => m.dirty[i].is_clean(start / m.region, (end - 1) / m.region),
            MemberState::Down => false,
        })
    }

    /// WRITE, DISCARD, WRITE_ZEROES and FLUSH on every live mirror.
    fn mirror_modify(self: &Arc<Self>, req: Request) {
        let Request { checked, msg, reply } = req;
        let flags = (if checked.fua { proto::REQ_FUA } else { 0 }) | (if checked.no_unmap { proto::REQ_NO_UNMAP } else { 0 });
        let (start, end) = if checked.op == Op::Flush { (0, 0) } else { (checked.offset, checked.offset + u64::from(checked.len)) };
        let (id, targets) = if checked.op == Op::Flush {
            let st = self.mirrors().lock.lock();
            let t = st.states.iter().enumerate().filter(|(_, s)| **s != MemberState::Down).map(|(i, _)| i).collect();
            (0, t)
        } else {
            self.begin_write(start, end)
        };
        if targets.is_empty() {
            if checked.op != Op::Flush {
                self.end_write(id, start, end, &[]);
            }
            reply.error(proto::EIO);
            return;
        }
        let payload = (checked.op == Op::Write).then(|| Arc::new(msg));
        // Every mirror's write is built before any goes out: a buffer we
        // cannot get is our failure (ENOMEM), not a mirror's.
        let mut writes = Vec::new();
        if let Some(p) = &payload {
            for _ in &targets {
                match write_header(&self.domain, start, checked.len, flags).and_then(|h| Message::shared_part(vec![h], p, HEADER_LEN, checked.len as usize)) {
                    Ok(m) => writes.push(m),
                    Err(e) => {
                        tracing::warn!(error = %e, "RAID: building a mirror's write");
                        self.end_write(id, start, end, &[]);
                        reply.error(proto::ENOMEM);
                        return;
                    }
                }
            }
        }
        drop(payload);
        let mut writes = writes.into_iter();
        let state = Arc::new(Mutex::new((targets.len(), Vec::new(), 0u16, Some(reply))));
        for &i in &targets {
            let me = self.clone();
            let state = state.clone();
            let op = checked.op;
            let done: Completion = Box::new(move |outcome| {
                let status = outcome.status();
                if status != 0 {
                    let range = (op != Op::Flush).then_some((start, end));
                    me.mirror_failed(i, range, format!("{op:?} failed: {}", proto::status_name(status)));
                }
                let mut s = state.lock();
                s.0 -= 1;
                if status == 0 {
                    s.1.push(i);
                } else if s.2 == 0 {
                    s.2 = status;
                }
                if s.0 > 0 {
                    return;
                }
                let reply = s.3.take().expect("completed once");
                let ok_mirrors = std::mem::take(&mut s.1);
                let first_error = s.2;
                drop(s);
                let valid = if op == Op::Flush {
                    let st = me.mirrors().lock.lock();
                    ok_mirrors.iter().any(|&i| st.states[i] != MemberState::Down)
                } else {
                    me.end_write(id, start, end, &ok_mirrors)
                };
                if valid {
                    reply.ok();
                } else {
                    reply.error(if first_error == 0 { proto::EIO } else { first_error });
                }
            });
            let member = &self.members[i];
            // The writes hold the references to the client's message now
            // (ours went above): the last mirror to release it releases it.
            match (writes.next(), checked.op) {
                (Some(message), _) => member.submit(proto::OP_WRITE, checked.len, message, done),
                (None, Op::Flush) => member.submit_header(proto::OP_FLUSH, 0, 0, 0, done),
                (None, op) => member.submit_header(op.opcode(), start, checked.len, flags, done),
            }
        }
    }

    /// The resync thread: copies the dirty regions of each resyncing mirror
    /// from an in-sync one, region by region, while clients go on.
    fn resync_loop(self: Arc<Self>) {
        let m = self.mirrors();
        while !self.stop.load(Ordering::Relaxed) {
            let target = {
                let mut st = m.lock.lock();
                let t = st.states.iter().position(|s| *s == MemberState::Resyncing);
                let source = st.states.contains(&MemberState::Up);
                match (t, source) {
                    (Some(t), true) => t,
                    _ => {
                        m.changed.wait_for(&mut st, Duration::from_millis(200));
                        continue;
                    }
                }
            };
            self.resync_member(target);
        }
    }

    fn resync_member(&self, target: usize) {
        let m = self.mirrors();
        let info = *self.info();
        let total = m.dirty[target].count();
        m.resync_total.store(total, Ordering::Relaxed);
        m.resync_done.store(0, Ordering::Relaxed);
        tracing::info!(member = %self.members[target].name, regions = total, "resync started");
        while let Some(r) = m.dirty[target].first_set() {
            if self.stop.load(Ordering::Relaxed) {
                return;
            }
            let start = r * m.region;
            let end = (start + m.region).min(info.size);
            {
                let mut st = m.lock.lock();
                if st.states[target] != MemberState::Resyncing {
                    return;
                }
                st.copying = Some((target, start, end));
                // Writes in flight to the region finish first; new ones wait.
                while st.writes.values().any(|&(s, e)| s < end && start < e) {
                    m.changed.wait(&mut st);
                }
                m.dirty[target].clear(r);
            }
            let copied = self.copy_region(target, start, end, &info);
            let mut st = m.lock.lock();
            st.copying = None;
            m.changed.notify_all();
            if let Err((failed, why)) = copied {
                m.dirty[target].set_range(r, r);
                drop(st);
                tracing::warn!(region = r, why = %why, "resync of a region failed");
                if let Some(i) = failed {
                    self.mirror_failed(i, None, why);
                } else {
                    std::thread::sleep(Duration::from_millis(100));
                }
                return;
            }
            drop(st);
            m.resync_done.fetch_add(1, Ordering::Relaxed);
            m.resynced.fetch_add(1, Ordering::Relaxed);
        }
        // Everything copied: make it durable, then the mirror is in sync.
        if let Outcome::Answered { status: 0, .. } = call(&self.members[target], proto::OP_FLUSH, 0, flush_message()) {
            let mut st = m.lock.lock();
            if st.states[target] == MemberState::Resyncing && m.dirty[target].count() == 0 {
                st.states[target] = MemberState::Up;
                tracing::info!(member = %self.members[target].name, "resync complete: mirror in sync");
            }
            m.changed.notify_all();
        } else {
            self.mirror_failed(target, None, "FLUSH after resync failed".into());
        }
    }

    /// Copies [start, end) to `target` from in-sync mirrors: each READ's
    /// data forwarded by pointer as the WRITE's payload. On failure, the
    /// mirror to blame (if it is one) and why.
    fn copy_region(&self, target: usize, start: u64, end: u64, info: &Info) -> Result<(), (Option<usize>, String)> {
        let mut at = start;
        while at < end {
            let len = (end - at).min(u64::from(info.max_transfer)) as u32;
            let source = {
                let st = self.mirrors().lock.lock();
                (0..self.members.len()).filter(|&i| st.states[i] == MemberState::Up).min_by_key(|&i| self.members[i].in_flight())
            };
            let Some(source) = source else { return Err((None, "no mirror in sync to copy from".into())) };
            let data = match call(&self.members[source], proto::OP_READ, len, Message::inline(&proto::header_bytes(at, len, 0)).expect("fits")) {
                Outcome::Answered { status: 0, data: Some(d) } => Arc::new(d),
                other => return Err((Some(source), format!("resync READ failed: {}", proto::status_name(other.status())))),
            };
            let header = write_header(&self.domain, at, len, 0).map_err(|e| (None, format!("header buffer: {e}")))?;
            let message = Message::shared_part(vec![header], &data, 0, len as usize).map_err(|e| (None, e.to_string()))?;
            drop(data);
            match call(&self.members[target], proto::OP_WRITE, len, message) {
                Outcome::Answered { status: 0, .. } => {}
                other => return Err((Some(target), format!("resync WRITE failed: {}", proto::status_name(other.status())))),
            }
            at += u64::from(len);
        }
        Ok(())
    }

    // ------------------------------------------------------ RAID-0, concat

    /// The parts of [offset, offset + len): (member, offset in the member,
    /// length, offset in the request), in request order.
    fn split(&self, offset: u64, len: u64) -> Vec<(usize, u64, u64, u64)> {
        let extents = self.extents.get().expect("set by start");
        let mut parts = Vec::new();
        let mut at = 0u64;
        while at < len {
            let pos = offset + at;
            let (member, member_offset, room) = match self.layout {
                Layout::Stripe { chunk } => {
                    let n = self.members.len() as u64;
                    let stripe = pos / chunk;
                    ((stripe % n) as usize, stripe / n * chunk + pos % chunk, chunk - pos % chunk)
                }
                Layout::Concat => {
                    let k = extents.partition_point(|&(s, _)| s <= pos) - 1;
                    let (s, l) = extents[k];
                    (k, pos - s, s + l - pos)
                }
                Layout::Mirror => unreachable!("mirrors do not split"),
            };
            let take = room.min(len - at);
            parts.push((member, member_offset, take, at));
            at += take;
        }
        parts
    }

    fn plain_request(self: &Arc<Self>, req: Request) {
        let Request { checked, msg, reply } = req;
        let flags = (if checked.fua { proto::REQ_FUA } else { 0 }) | (if checked.no_unmap { proto::REQ_NO_UNMAP } else { 0 });
        let parts: Vec<(usize, u64, u64, u64)> = if checked.op == Op::Flush {
            (0..self.members.len()).map(|i| (i, 0, 0, 0)).collect()
        } else {
            self.split(checked.offset, u64::from(checked.len))
        };
        let gather = Arc::new(Mutex::new(Gather { left: parts.len(), status: 0, data: (0..parts.len()).map(|_| None).collect(), reply: Some(reply) }));
        let payload = (checked.op == Op::Write).then(|| Arc::new(msg));
        // Every part's write is built before any goes out (see mirror_modify).
        let mut writes = Vec::new();
        if let Some(p) = &payload {
            for &(_, member_offset, len, at) in &parts {
                match write_header(&self.domain, member_offset, len as u32, flags)
                    .and_then(|h| Message::shared_part(vec![h], p, HEADER_LEN + at as usize, len as usize))
                {
                    Ok(m) => writes.push(m),
                    Err(e) => {
                        tracing::warn!(error = %e, "RAID: building a member's write");
                        if let Some(reply) = gather.lock().reply.take() {
                            reply.error(proto::ENOMEM);
                        }
                        return;
                    }
                }
            }
        }
        drop(payload);
        let mut writes = writes.into_iter();
        for (k, &(member, member_offset, len, _)) in parts.iter().enumerate() {
            let gather = gather.clone();
            let op = checked.op;
            let done: Completion = Box::new(move |outcome| {
                let mut g = gather.lock();
                match outcome {
                    Outcome::Answered { status: 0, data } => g.data[k] = data,
                    other => {
                        if g.status == 0 {
                            g.status = other.status();
                        }
                    }
                }
                g.left -= 1;
                if g.left > 0 {
                    return;
                }
                let reply = g.reply.take().expect("completed once");
                let status = g.status;
                let data = std::mem::take(&mut g.data);
                drop(g);
                if status != 0 {
                    reply.error(status);
                } else if op != Op::Read {
                    reply.ok();
                } else {
                    reply_read(reply, data);
                }
            });
            let m = &self.members[member];
            let len32 = len as u32;
            match (writes.next(), checked.op) {
                (Some(message), _) => m.submit(proto::OP_WRITE, len32, message, done),
                (None, Op::Flush) => m.submit_header(proto::OP_FLUSH, 0, 0, 0, done),
                (None, op) => m.submit_header(op.opcode(), member_offset, len32, flags, done),
            }
        }
    }
}

/// A READ's reply from its parts' data: one part forwarded as it came, or
/// all of them gathered into one message by pointer.
fn reply_read(reply: Replier, data: Vec<Option<Msg>>) {
    let mut parts: Vec<Msg> = data.into_iter().flatten().collect();
    if parts.len() == 1 {
        reply.data(parts.pop().expect("one"));
        return;
    }
    let pieces: Vec<(Arc<Msg>, std::ops::Range<usize>)> = parts
        .into_iter()
        .map(|m| {
            let len = m.len();
            (Arc::new(m), 0..len)
        })
        .collect();
    match Message::shared_gather(Vec::new(), pieces) {
        Ok(message) => reply.data(message),
        Err(e) => {
            tracing::warn!(error = %e, "RAID: gathering a read");
            reply.error(proto::EIO);
        }
    }
}

fn flush_message() -> Message {
    Message::inline(&proto::header_bytes(0, 0, 0)).expect("fits")
}

/// One client connection's queue: requests go straight to the members.
struct Queue {
    inner: Arc<Inner>,
}

impl BackendQueue for Queue {
    fn submit(&mut self, req: Request) {
        match (self.inner.layout, req.checked.op) {
            (Layout::Mirror, Op::Read) => {
                let c = req.checked;
                self.inner.mirror_read(c.offset, c.len, req.reply, Vec::new(), 0);
            }
            (Layout::Mirror, _) => self.inner.mirror_modify(req),
            _ => self.inner.plain_request(req),
        }
    }
}

impl BlockBackend for Raid {
    fn info(&self) -> Info {
        *self.inner.info()
    }

    fn open_queue(&self, _domain: &Domain) -> std::io::Result<Box<dyn BackendQueue>> {
        Ok(Box::new(Queue { inner: self.inner.clone() }))
    }
}

#[cfg(test)]
mod tests {
    use super::region_size;

    #[test]
    fn regions_are_at_least_64k_and_at_most_65536() {
        assert_eq!(region_size(1 << 20, 512), 64 << 10);
        assert_eq!(region_size(4 << 30, 512), 64 << 10);
        assert_eq!(region_size(8 << 30, 512), 128 << 10);
        assert_eq!(region_size((8 << 30) + 1, 4096), 256 << 10);
    }
}
