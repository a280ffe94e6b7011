//! Access policy and per-domain quotas.
//!
//! A policy is an ordered list of rules. At join, the broker picks the first
//! rule whose selectors (uids/users, gids/groups, labels) all match the
//! joining domain — uid and gid from `SO_PEERCRED`, label from
//! `Request::Join` — and that rule decides everything about the domain for
//! its whole life: whether it may join at all, which service names it may
//! offer and connect to, where in the registry it may write, and its quotas.
//! No matching rule means the join is denied.
//!
//! The format (TOML) is documented with an example in `docs/SECURITY.md`.
//! Without a policy file the broker uses [`Policy::default_for_uid`]: only the
//! broker's own uid may join, and it may do everything.

use std::ffi::CString;
use std::fmt;
use std::path::Path;

use serde::Deserialize;

/// Built-in quota defaults, used where neither `[defaults]` nor a rule says otherwise.
pub const DEFAULT_QUOTAS: Quotas = Quotas {
    arena_bytes: u64::MAX,
    connections: 4096,
    registry_keys: 65_536,
    registry_bytes: 64 << 20,
    watches: 4096,
    pipes: 256,
};

/// Built-in per-uid limits, used where neither `[defaults]` nor a rule says
/// otherwise: each a fraction of what the broker has (64 of the default 1024
/// PGVAS slots), so one uid, however many domains it starts, cannot take the
/// broker from the others.
pub const DEFAULT_UID_QUOTAS: UidQuotas = UidQuotas {
    domains: 64,
    services: 1024,
    connections: 16_384,
    registry_keys: 262_144,
    registry_bytes: 256 << 20,
    watches: 16_384,
    pipes: 1024,
};

/// PGVAS slots kept for administrators (root and the broker's own uid): other
/// uids' joins stop this many slots short of a full window, so the admin can
/// always still join.
pub const ADMIN_RESERVED_SLOTS: u32 = 8;

/// Registry paths every admitted domain may read whatever its rule says: the
/// MMNet listener announcements a `fido run` client looks up (a listener key
/// grants nothing by itself; see docs/NET.md).
pub const PUBLIC_READ: [&str; 1] = ["/net/listen/**"];

/// Pipe weight of a domain whose rule names none.
pub const DEFAULT_PIPE_WEIGHT: u32 = 1;

/// Default mode of the broker's socket file: anyone may connect, the policy
/// decides who may join.
pub const DEFAULT_SOCKET_MODE: u32 = 0o666;

/// Per-domain limits (all inclusive maxima).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Quotas {
    /// Largest `arena_len` accepted at join, in bytes (further capped by the PGVAS slot size).
    pub arena_bytes: u64,
    /// Open connections (established or pending) where the domain is client or server.
    pub connections: u64,
    /// Registry keys the domain holds (keys it wrote last and nobody deleted since).
    pub registry_keys: u64,
    /// Sum of the value lengths of those keys, in bytes.
    pub registry_bytes: u64,
    /// Registry watches the domain holds at once.
    pub watches: u64,
    /// vPipe pipes the domain holds at once (one-shot operations count while they run).
    pub pipes: u64,
}

/// Limits on what all live domains of one uid hold together (inclusive
/// maxima), whichever rules admitted them; the rule of the domain asking
/// decides the limit. Root and the broker's own uid are exempt.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct UidQuotas {
    /// Live domains, hence PGVAS slots.
    pub domains: u64,
    /// Services offered.
    pub services: u64,
    /// Open connections (established or pending) with one of the uid's domains at an end.
    pub connections: u64,
    /// Registry keys charged to the uid's domains.
    pub registry_keys: u64,
    /// Sum of the value lengths of those keys, in bytes.
    pub registry_bytes: u64,
    /// Registry watches.
    pub watches: u64,
    /// vPipe pipes and running one-shot operations.
    pub pipes: u64,
}

/// A `*`/`?` glob. `*` matches any run of characters except `/`, `**` any run
/// including `/`, `?` exactly one character except `/`; everything else
/// matches itself. A pattern ending in `/**` also matches the part before it
/// (`/app/**` matches `/app`). For service names and labels, which contain no
/// `/`, `*` simply matches anything.
#[derive(Clone, PartialEq, Eq)]
pub struct Glob {
    text: String,
    toks: Vec<Tok>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Tok {
    Lit(u8),
    One,
    Star,
    DStar,
}

impl Glob {
    /// Compiles a pattern; it must be non-empty.
    pub fn new(pattern: &str) -> Result<Glob, String> {
        if pattern.is_empty() {
            return Err("empty glob pattern".into());
        }
        let b = pattern.as_bytes();
        let mut toks = Vec::with_capacity(b.len());
        let mut i = 0;
        while i < b.len() {
            match b[i] {
                b'*' if b.get(i + 1) == Some(&b'*') => {
                    toks.push(Tok::DStar);
                    i += 2;
                    while b.get(i) == Some(&b'*') {
                        i += 1;
                    }
                    continue;
                }
                b'*' => toks.push(Tok::Star),
                b'?' => toks.push(Tok::One),
                c => toks.push(Tok::Lit(c)),
            }
            i += 1;
        }
        Ok(Glob {
            text: pattern.to_string(),
            toks,
        })
    }

    /// The pattern as written.
    pub fn as_str(&self) -> &str {
        &self.text
    }

    /// Does `s` match? O(len(pattern) × len(s)), no recursion.
    pub fn matches(&self, s: &str) -> bool {
        if self.match_bytes(s.as_bytes()) {
            return true;
        }
        // `prefix/**` also matches `prefix` itself.
        if self.text.ends_with("/**") && !s.ends_with('/') {
            let mut with = Vec::with_capacity(s.len() + 1);
            with.extend_from_slice(s.as_bytes());
            with.push(b'/');
            return self.match_bytes(&with);
        }
        false
    }

    /// Could a key at or below `path` match (`path` itself, or some key
    /// under it)? Decides whether a listing shows `path` to a reader whose
    /// patterns reach further down.
    pub fn matches_at_or_below(&self, path: &str) -> bool {
        if self.matches(path) {
            return true;
        }
        // Some prefix of the pattern matches `path/` exactly: the rest of
        // the pattern can then match a continuation of it.
        let mut s = Vec::with_capacity(path.len() + 1);
        s.extend_from_slice(path.trim_end_matches('/').as_bytes());
        s.push(b'/');
        self.prefix_matches(&s)
    }

    /// True if every key at or below `path` matches too (the pattern ends in
    /// `/**` and `path` matches it).
    pub fn covers_subtree(&self, path: &str) -> bool {
        self.text.ends_with("/**") && self.matches(path)
    }

    fn match_bytes(&self, s: &[u8]) -> bool {
        self.run(s, false)
    }

    /// Do the first k tokens match all of `s`, for some k?
    fn prefix_matches(&self, s: &[u8]) -> bool {
        self.run(s, true)
    }

    /// The matcher: with `any_prefix`, succeeds as soon as some prefix of
    /// the pattern matches all of `s`; else only the whole pattern counts.
    fn run(&self, s: &[u8], any_prefix: bool) -> bool {
        // cur[j]: the tokens seen so far match s[..j].
        let n = s.len();
        let mut cur = vec![false; n + 1];
        cur[0] = true;
        let mut next = vec![false; n + 1];
        for t in &self.toks {
            if any_prefix && cur[n] {
                return true;
            }
            next.iter_mut().for_each(|x| *x = false);
            match *t {
                Tok::Lit(c) => {
                    for j in 0..n {
                        next[j + 1] = cur[j] && s[j] == c;
                    }
                }
                Tok::One => {
                    for j in 0..n {
                        next[j + 1] = cur[j] && s[j] != b'/';
                    }
                }
                Tok::Star => {
                    next[0] = cur[0];
                    for j in 0..n {
                        next[j + 1] = cur[j + 1] || (next[j] && s[j] != b'/');
                    }
                }
                Tok::DStar => {
                    next[0] = cur[0];
                    for j in 0..n {
                        next[j + 1] = cur[j + 1] || next[j];
                    }
                }
            }
            std::mem::swap(&mut cur, &mut next);
        }
        cur[n]
    }
}

impl fmt::Debug for Glob {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:?}", self.text)
    }
}

/// One rule of the policy, with names already resolved to ids.
#[derive(Debug, Clone)]
pub struct Rule {
    /// `name = "…"` in the file, else `#N` (1-based position).
    pub name: String,
    /// Matches if the peer's uid is one of these (`uids` and resolved `users`); empty: any uid.
    pub uids: Vec<u32>,
    /// Matches if the peer's primary gid (from `SO_PEERCRED`) is one of these
    /// (`gids` and resolved `groups`); empty: any gid.
    pub gids: Vec<u32>,
    /// Matches if the join label matches one of these; empty: any label or
    /// none. A domain that gives no label never matches a rule with labels.
    pub labels: Vec<Glob>,
    /// May the domain join at all (a rule with `join = false` is an explicit deny).
    pub join: bool,
    /// Service names the domain may offer.
    pub offer: Vec<Glob>,
    /// Service names the domain may connect to.
    pub connect: Vec<Glob>,
    /// Registry paths the domain may write and delete (never the broker-managed subtrees).
    pub registry_write: Vec<Glob>,
    /// Registry paths outside the managed subtrees the domain may read, list
    /// and watch (`registry_read`; unset: `registry_write` plus
    /// [`PUBLIC_READ`]). The managed subtrees and the owner-private keys
    /// (`/net/stats`, `/net/conn`) are filtered by the broker apart.
    pub registry_read: Vec<Glob>,
    /// The domain's quotas (the rule's own, else `[defaults]`, else built-in).
    pub quotas: Quotas,
    /// Limits on all domains of the domain's uid together (`per_uid_*`).
    pub per_uid: UidQuotas,
    /// The domain's share of the pipe engine relative to other domains
    /// (`pipe_weight`, 1..=10000, default 1); `fido pipe weight` changes it live.
    pub pipe_weight: u32,
    /// May the domain take part in MMNet acceleration (`net`, default true)?
    /// With `net = false` the broker refuses the handshake keys of fido-net
    /// (see [`is_net_handshake`]), so the process's TCP connections stay plain.
    pub net: bool,
}

impl Rule {
    /// Do the selectors match this peer?
    pub fn selects(&self, uid: u32, gid: u32, label: Option<&str>) -> bool {
        (self.uids.is_empty() || self.uids.contains(&uid))
            && (self.gids.is_empty() || self.gids.contains(&gid))
            && (self.labels.is_empty()
                || label.is_some_and(|l| self.labels.iter().any(|g| g.matches(l))))
    }

    /// May offer `service`?
    pub fn may_offer(&self, service: &str) -> bool {
        self.offer.iter().any(|g| g.matches(service))
    }

    /// May connect to `service`?
    pub fn may_connect(&self, service: &str) -> bool {
        self.connect.iter().any(|g| g.matches(service))
    }

    /// May write the key `path`?
    pub fn may_write(&self, path: &str) -> bool {
        self.registry_write.iter().any(|g| g.matches(path))
    }

    /// May read the key `path` (outside the managed subtrees)?
    pub fn may_read(&self, path: &str) -> bool {
        self.registry_read.iter().any(|g| g.matches(path))
    }

    /// May read `path` or some key below it (a listing shows it)?
    pub fn may_read_at_or_below(&self, path: &str) -> bool {
        self.registry_read
            .iter()
            .any(|g| g.matches_at_or_below(path))
    }

    /// May delete `path` and its subtree? Either a pattern covers the whole
    /// subtree, or `path` matches and it has no children (`has_children`).
    pub fn may_delete(&self, path: &str, has_children: impl FnOnce() -> bool) -> bool {
        if self.registry_write.iter().any(|g| g.covers_subtree(path)) {
            return true;
        }
        self.may_write(path) && !has_children()
    }
}

/// The broker's access policy: rules matched in order, first match decides.
#[derive(Debug, Clone)]
pub struct Policy {
    /// The rules, in file order.
    pub rules: Vec<Rule>,
    /// Mode of the socket file (`[socket] mode`, default `0o666`).
    pub socket_mode: u32,
    /// Group of the socket file (`[socket] group`), if set.
    pub socket_gid: Option<u32>,
    /// The `[net]` section: MMNet (fido-net) acceleration for everyone.
    pub net: NetPolicy,
    /// Where the policy came from, for log and error messages.
    pub source: String,
}

/// The `[net]` section of the policy: which fido-net processes (domains named
/// `net-<comm>`) may accelerate their TCP connections.
#[derive(Debug, Clone)]
pub struct NetPolicy {
    /// `accelerate = false`: nobody's connections are accelerated.
    pub accelerate: bool,
    /// Domain names (`net-<comm>`, globs) whose connections are never accelerated.
    pub deny: Vec<Glob>,
}

impl Default for NetPolicy {
    fn default() -> Self {
        NetPolicy {
            accelerate: true,
            deny: Vec::new(),
        }
    }
}

/// Is this registry operation one the `net` policy gates? Writes and deletes
/// under `/net/conn/…`, where fido-net once put its connection requests. The
/// handshake itself now goes through the broker (`NetOffer`, `NetClaim`,
/// checked in `server/net.rs`) and nothing reads these keys any more; they
/// stay refused to a domain the policy refuses acceleration, so such a
/// program publishes nothing about its connections there. Listeners
/// (`NetListen`) are published whatever the policy says — a listener grants
/// nothing by itself — so that a reload that allows acceleration applies to
/// listening sockets opened while it was refused; statistics (`/net/stats/…`)
/// only report.
pub fn is_net_handshake(path: &str, _delete: bool) -> bool {
    path.starts_with("/net/conn/")
}

impl Policy {
    /// Why MMNet acceleration is refused to the domain `name` admitted by
    /// `rule`, or `None` when it is allowed.
    pub fn net_refusal(&self, rule: &Rule, name: &str) -> Option<String> {
        if !self.net.accelerate {
            return Some("[net] accelerate = false".into());
        }
        if let Some(g) = self.net.deny.iter().find(|g| g.matches(name)) {
            return Some(format!("[net] deny matches {:?} ({name})", g.as_str()));
        }
        if !rule.net {
            return Some(format!("rule {} says net = false", rule.name));
        }
        None
    }
}

/// Why a join was refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum JoinDenied {
    /// No rule selects this peer.
    NoRule,
    /// The first rule that selects it says `join = false`.
    Forbidden(String),
}

impl Policy {
    /// The default without a policy file: one rule that lets `uid` (the
    /// broker's own) join and do everything, with the built-in quotas.
    pub fn default_for_uid(uid: u32) -> Policy {
        let all = |p: &str| vec![Glob::new(p).expect("valid")];
        Policy {
            rules: vec![Rule {
                name: format!("default (the broker's own uid {uid})"),
                uids: vec![uid],
                gids: Vec::new(),
                labels: Vec::new(),
                join: true,
                offer: all("*"),
                connect: all("*"),
                registry_write: all("/**"),
                registry_read: all("/**"),
                quotas: DEFAULT_QUOTAS,
                per_uid: DEFAULT_UID_QUOTAS,
                pipe_weight: DEFAULT_PIPE_WEIGHT,
                net: true,
            }],
            socket_mode: DEFAULT_SOCKET_MODE,
            socket_gid: None,
            net: NetPolicy::default(),
            source: "built-in default policy".into(),
        }
    }

    /// The default for the effective uid of this process.
    pub fn default_for_self() -> Policy {
        Policy::default_for_uid(rustix::process::geteuid().as_raw())
    }

    /// Reads and checks a policy file. Errors name the file and, for syntax
    /// errors, the line and column.
    pub fn load(path: &Path) -> Result<Policy, String> {
        let text =
            std::fs::read_to_string(path).map_err(|e| format!("policy {}: {e}", path.display()))?;
        Policy::parse(&text, &path.display().to_string())
    }

    /// Parses a policy from TOML text; `source` names it in messages.
    pub fn parse(text: &str, source: &str) -> Result<Policy, String> {
        let raw: RawPolicy = toml::from_str(text).map_err(|e| format!("policy {source}: {e}"))?;
        raw.resolve(source)
            .map_err(|e| format!("policy {source}: {e}"))
    }

    /// The index of the rule deciding for this peer, if it may join.
    pub fn decide(&self, uid: u32, gid: u32, label: Option<&str>) -> Result<usize, JoinDenied> {
        match self.rules.iter().position(|r| r.selects(uid, gid, label)) {
            None => Err(JoinDenied::NoRule),
            Some(i) if !self.rules[i].join => {
                Err(JoinDenied::Forbidden(self.rules[i].name.clone()))
            }
            Some(i) => Ok(i),
        }
    }

    /// The rule that decides what a peer that has not joined (a `fido
    /// status`, which needs no PGVAS slot) may see: the rule a label-less
    /// join of this uid and gid would get, else the first rule with labels
    /// that would admit it under some label. `None`: the peer could never
    /// join, so it may see nothing.
    pub fn observer_rule(&self, uid: u32, gid: u32) -> Option<usize> {
        for (i, r) in self.rules.iter().enumerate() {
            let ids = (r.uids.is_empty() || r.uids.contains(&uid))
                && (r.gids.is_empty() || r.gids.contains(&gid));
            if !ids {
                continue;
            }
            if r.labels.is_empty() {
                return r.join.then_some(i);
            }
            if r.join {
                return Some(i);
            }
        }
        None
    }
}

// ----- the file format --------------------------------------------------------

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct RawPolicy {
    #[serde(default)]
    defaults: RawQuotas,
    #[serde(default)]
    socket: RawSocket,
    #[serde(default, rename = "rule")]
    rules: Vec<RawRule>,
    #[serde(default)]
    net: RawNet,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct RawNet {
    accelerate: Option<bool>,
    #[serde(default)]
    deny: Vec<String>,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct RawSocket {
    mode: Option<u32>,
    group: Option<String>,
    gid: Option<u32>,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct RawQuotas {
    arena_bytes: Option<Size>,
    connections: Option<u64>,
    registry_keys: Option<u64>,
    registry_bytes: Option<Size>,
    watches: Option<u64>,
    pipes: Option<u64>,
    per_uid_domains: Option<u64>,
    per_uid_services: Option<u64>,
    per_uid_connections: Option<u64>,
    per_uid_registry_keys: Option<u64>,
    per_uid_registry_bytes: Option<Size>,
    per_uid_watches: Option<u64>,
    per_uid_pipes: Option<u64>,
}

/// The `per_uid_*` keys of `[defaults]` or of a rule.
#[derive(Default)]
struct RawUidQuotas {
    per_uid_domains: Option<u64>,
    per_uid_services: Option<u64>,
    per_uid_connections: Option<u64>,
    per_uid_registry_keys: Option<u64>,
    per_uid_registry_bytes: Option<Size>,
    per_uid_watches: Option<u64>,
    per_uid_pipes: Option<u64>,
}

impl RawUidQuotas {
    fn over(&self, base: UidQuotas) -> Result<UidQuotas, String> {
        Ok(UidQuotas {
            domains: self.per_uid_domains.unwrap_or(base.domains),
            services: self.per_uid_services.unwrap_or(base.services),
            connections: self.per_uid_connections.unwrap_or(base.connections),
            registry_keys: self.per_uid_registry_keys.unwrap_or(base.registry_keys),
            registry_bytes: match &self.per_uid_registry_bytes {
                Some(s) => s.bytes("per_uid_registry_bytes")?,
                None => base.registry_bytes,
            },
            watches: self.per_uid_watches.unwrap_or(base.watches),
            pipes: self.per_uid_pipes.unwrap_or(base.pipes),
        })
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawRule {
    name: Option<String>,
    #[serde(default)]
    uids: Vec<u32>,
    #[serde(default)]
    users: Vec<String>,
    #[serde(default)]
    gids: Vec<u32>,
    #[serde(default)]
    groups: Vec<String>,
    #[serde(default)]
    labels: Vec<String>,
    #[serde(default = "yes")]
    join: bool,
    #[serde(default)]
    offer: Vec<String>,
    #[serde(default)]
    connect: Vec<String>,
    #[serde(default)]
    registry_write: Vec<String>,
    registry_read: Option<Vec<String>>,
    arena_bytes: Option<Size>,
    connections: Option<u64>,
    registry_keys: Option<u64>,
    registry_bytes: Option<Size>,
    watches: Option<u64>,
    pipes: Option<u64>,
    pipe_weight: Option<u32>,
    #[serde(default = "yes")]
    net: bool,
    per_uid_domains: Option<u64>,
    per_uid_services: Option<u64>,
    per_uid_connections: Option<u64>,
    per_uid_registry_keys: Option<u64>,
    per_uid_registry_bytes: Option<Size>,
    per_uid_watches: Option<u64>,
    per_uid_pipes: Option<u64>,
}

fn yes() -> bool {
    true
}

/// A byte count: an integer, or a string with a binary suffix ("64KiB", "16M", "1G").
#[derive(Deserialize, Clone)]
#[serde(untagged)]
enum Size {
    N(u64),
    S(String),
}

impl Size {
    fn bytes(&self, what: &str) -> Result<u64, String> {
        match self {
            Size::N(n) => Ok(*n),
            Size::S(s) => parse_size(s).ok_or_else(|| {
                format!(
                    "{what} = {s:?}: not a size (an integer, or e.g. \"64KiB\", \"16M\", \"1G\")"
                )
            }),
        }
    }
}

pub use fido_pipe_engine::parse_size;

impl RawQuotas {
    fn over(&self, base: Quotas) -> Result<Quotas, String> {
        Ok(Quotas {
            arena_bytes: match &self.arena_bytes {
                Some(s) => s.bytes("arena_bytes")?,
                None => base.arena_bytes,
            },
            connections: self.connections.unwrap_or(base.connections),
            registry_keys: self.registry_keys.unwrap_or(base.registry_keys),
            registry_bytes: match &self.registry_bytes {
                Some(s) => s.bytes("registry_bytes")?,
                None => base.registry_bytes,
            },
            watches: self.watches.unwrap_or(base.watches),
            pipes: self.pipes.unwrap_or(base.pipes),
        })
    }
}

fn globs(what: &str, rule: &str, list: &[String]) -> Result<Vec<Glob>, String> {
    list.iter()
        .map(|p| Glob::new(p).map_err(|e| format!("rule {rule}: {what}: {e}")))
        .collect()
}

impl RawPolicy {
    fn resolve(self, source: &str) -> Result<Policy, String> {
        let defaults = self.defaults.over(DEFAULT_QUOTAS)?;
        let d = &self.defaults;
        let uid_defaults = RawUidQuotas {
            per_uid_domains: d.per_uid_domains,
            per_uid_services: d.per_uid_services,
            per_uid_connections: d.per_uid_connections,
            per_uid_registry_keys: d.per_uid_registry_keys,
            per_uid_registry_bytes: d.per_uid_registry_bytes.clone(),
            per_uid_watches: d.per_uid_watches,
            per_uid_pipes: d.per_uid_pipes,
        }
        .over(DEFAULT_UID_QUOTAS)?;
        let mut rules = Vec::with_capacity(self.rules.len());
        for (i, r) in self.rules.into_iter().enumerate() {
            let name = match &r.name {
                Some(n) => n.clone(),
                None => format!("#{}", i + 1),
            };
            let mut uids = r.uids.clone();
            for u in &r.users {
                uids.push(lookup_user(u).map_err(|e| format!("rule {name}: {e}"))?);
            }
            let mut gids = r.gids.clone();
            for g in &r.groups {
                gids.push(lookup_group(g).map_err(|e| format!("rule {name}: {e}"))?);
            }
            for (what, list) in [
                ("registry_write", &r.registry_write),
                (
                    "registry_read",
                    r.registry_read.as_ref().unwrap_or(&Vec::new()),
                ),
            ] {
                if let Some(p) = list.iter().find(|p| !p.starts_with('/')) {
                    return Err(format!(
                        "rule {name}: {what} pattern {p:?} must start with '/'"
                    ));
                }
            }
            let registry_read = match &r.registry_read {
                Some(list) => list.clone(),
                None => r
                    .registry_write
                    .iter()
                    .cloned()
                    .chain(PUBLIC_READ.iter().map(|p| p.to_string()))
                    .collect(),
            };
            let per_uid = RawUidQuotas {
                per_uid_domains: r.per_uid_domains,
                per_uid_services: r.per_uid_services,
                per_uid_connections: r.per_uid_connections,
                per_uid_registry_keys: r.per_uid_registry_keys,
                per_uid_registry_bytes: r.per_uid_registry_bytes.clone(),
                per_uid_watches: r.per_uid_watches,
                per_uid_pipes: r.per_uid_pipes,
            }
            .over(uid_defaults)
            .map_err(|e| format!("rule {name}: {e}"))?;
            let quotas = RawQuotas {
                arena_bytes: r.arena_bytes.clone(),
                connections: r.connections,
                registry_keys: r.registry_keys,
                registry_bytes: r.registry_bytes.clone(),
                watches: r.watches,
                pipes: r.pipes,
                ..RawQuotas::default()
            }
            .over(defaults)
            .map_err(|e| format!("rule {name}: {e}"))?;
            let pipe_weight = r.pipe_weight.unwrap_or(DEFAULT_PIPE_WEIGHT);
            if pipe_weight == 0 || pipe_weight > fido_proto::MAX_PIPE_WEIGHT {
                return Err(format!(
                    "rule {name}: pipe_weight = {pipe_weight}: must be 1..={}",
                    fido_proto::MAX_PIPE_WEIGHT
                ));
            }
            rules.push(Rule {
                labels: globs("labels", &name, &r.labels)?,
                offer: globs("offer", &name, &r.offer)?,
                connect: globs("connect", &name, &r.connect)?,
                registry_write: globs("registry_write", &name, &r.registry_write)?,
                registry_read: globs("registry_read", &name, &registry_read)?,
                per_uid,
                uids,
                gids,
                join: r.join,
                quotas,
                pipe_weight,
                net: r.net,
                name,
            });
        }
        let socket_mode = self.socket.mode.unwrap_or(DEFAULT_SOCKET_MODE);
        if socket_mode & !0o777 != 0 {
            return Err(format!(
                "[socket] mode {socket_mode:#o} has bits beyond 0o777"
            ));
        }
        let socket_gid = match (&self.socket.group, self.socket.gid) {
            (Some(_), Some(_)) => return Err("[socket]: give either group or gid, not both".into()),
            (Some(g), None) => Some(lookup_group(g)?),
            (None, g) => g,
        };
        let net = NetPolicy {
            accelerate: self.net.accelerate.unwrap_or(true),
            deny: globs("deny", "[net]", &self.net.deny)?,
        };
        Ok(Policy {
            rules,
            socket_mode,
            socket_gid,
            net,
            source: source.to_string(),
        })
    }
}

/// Largest buffer a user or group lookup may grow to: a group of some
/// hundred thousand members still fits, a broken NSS module that answers
/// `ERANGE` forever does not make the broker allocate without bound.
const NSS_BUFFER_CAP: usize = 16 << 20;

/// The buffer size the C library suggests for `key` (`_SC_GETPW_R_SIZE_MAX`,
/// `_SC_GETGR_R_SIZE_MAX`), else 1 KiB. Only a starting point: entries may
/// be larger (a group lists its members), which [`grow_on_erange`] handles.
fn suggested_buffer(key: libc::c_int) -> usize {
    // SAFETY: sysconf reads a configuration value; any key is allowed.
    let n = unsafe { libc::sysconf(key) };
    usize::try_from(n).ok().filter(|n| *n > 0).unwrap_or(1024)
}

/// Runs `call` (a reentrant NSS lookup that fills a caller buffer) with a
/// buffer of `initial` bytes, doubling it while the lookup answers `ERANGE`,
/// up to [`NSS_BUFFER_CAP`]. `call` returns the lookup's error number.
fn grow_on_erange<T>(
    initial: usize,
    mut call: impl FnMut(&mut [libc::c_char]) -> Result<T, libc::c_int>,
) -> Result<T, libc::c_int> {
    let mut len = initial.clamp(1, NSS_BUFFER_CAP);
    loop {
        let mut buf = vec![0 as libc::c_char; len];
        match call(&mut buf) {
            Err(libc::ERANGE) if len < NSS_BUFFER_CAP => len = (len * 2).min(NSS_BUFFER_CAP),
            result => return result,
        }
    }
}

/// uid of a user name (getpwnam_r, so NSS sources count too).
pub fn lookup_user(name: &str) -> Result<u32, String> {
    lookup_user_from(name, suggested_buffer(libc::_SC_GETPW_R_SIZE_MAX))
}

/// [`lookup_user`] starting from a buffer of `initial` bytes.
fn lookup_user_from(name: &str, initial: usize) -> Result<u32, String> {
    let c = CString::new(name).map_err(|_| format!("user {name:?}: contains NUL"))?;
    let found = grow_on_erange(initial, |buf| {
        // SAFETY: all-zero is a valid `passwd` (null pointers, zero ids).
        let mut pw: libc::passwd = unsafe { std::mem::zeroed() };
        let mut out: *mut libc::passwd = std::ptr::null_mut();
        // SAFETY: every pointer is valid for the call and `buf` outlives it;
        // only the uid is read afterwards, not the strings pointing into `buf`.
        let rc =
            unsafe { libc::getpwnam_r(c.as_ptr(), &mut pw, buf.as_mut_ptr(), buf.len(), &mut out) };
        match rc {
            0 => Ok((!out.is_null()).then_some(pw.pw_uid)),
            e => Err(e),
        }
    });
    match found {
        Ok(Some(uid)) => Ok(uid),
        Ok(None) => Err(format!("user {name:?} does not exist")),
        Err(e) => Err(format!(
            "user {name:?}: {}",
            std::io::Error::from_raw_os_error(e)
        )),
    }
}

/// gid of a group name (getgrnam_r).
pub fn lookup_group(name: &str) -> Result<u32, String> {
    lookup_group_from(name, suggested_buffer(libc::_SC_GETGR_R_SIZE_MAX))
}

/// [`lookup_group`] starting from a buffer of `initial` bytes.
fn lookup_group_from(name: &str, initial: usize) -> Result<u32, String> {
    let c = CString::new(name).map_err(|_| format!("group {name:?}: contains NUL"))?;
    let found = grow_on_erange(initial, |buf| {
        // SAFETY: all-zero is a valid `group`.
        let mut gr: libc::group = unsafe { std::mem::zeroed() };
        let mut out: *mut libc::group = std::ptr::null_mut();
        // SAFETY: every pointer is valid for the call and `buf` outlives it;
        // only the gid is read afterwards, not the strings pointing into `buf`.
        let rc =
            unsafe { libc::getgrnam_r(c.as_ptr(), &mut gr, buf.as_mut_ptr(), buf.len(), &mut out) };
        match rc {
            0 => Ok((!out.is_null()).then_some(gr.gr_gid)),
            e => Err(e),
        }
    });
    match found {
        Ok(Some(gid)) => Ok(gid),
        Ok(None) => Err(format!("group {name:?} does not exist")),
        Err(e) => Err(format!(
            "group {name:?}: {}",
            std::io::Error::from_raw_os_error(e)
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Reference matcher: plain backtracking, obviously right, exponential.
    fn naive(p: &[u8], s: &[u8]) -> bool {
        match p.first() {
            None => s.is_empty(),
            Some(b'*') if p.get(1) == Some(&b'*') => {
                let mut k = 2;
                while p.get(k) == Some(&b'*') {
                    k += 1;
                }
                (0..=s.len()).any(|i| naive(&p[k..], &s[i..]))
            }
            Some(b'*') => {
                let mut i = 0;
                loop {
                    if naive(&p[1..], &s[i..]) {
                        return true;
                    }
                    if i == s.len() || s[i] == b'/' {
                        return false;
                    }
                    i += 1;
                }
            }
            Some(b'?') => !s.is_empty() && s[0] != b'/' && naive(&p[1..], &s[1..]),
            Some(&c) => !s.is_empty() && s[0] == c && naive(&p[1..], &s[1..]),
        }
    }

    #[test]
    fn glob_examples() {
        let g = |p: &str| Glob::new(p).unwrap();
        assert!(g("svc-*").matches("svc-echo"));
        assert!(g("svc-*").matches("svc-"));
        assert!(!g("svc-*").matches("other-echo"));
        assert!(g("*").matches("anything.at:all"));
        assert!(g("a?c").matches("abc"));
        assert!(!g("a?c").matches("ac"));
        assert!(g("/app/*").matches("/app/x"));
        assert!(!g("/app/*").matches("/app/x/y"));
        assert!(g("/app/**").matches("/app/x/y"));
        assert!(g("/app/**").matches("/app"));
        assert!(!g("/app/**").matches("/apple"));
        assert!(!g("/app/**").matches("/"));
        assert!(g("/**").matches("/anything/at/all"));
        assert!(g("/app/**").covers_subtree("/app/x"));
        assert!(!g("/app/*").covers_subtree("/app/x"));
        assert!(Glob::new("").is_err());
    }

    /// A small deterministic fuzz: the DP matcher agrees with the naive one.
    #[test]
    fn glob_agrees_with_naive_matcher() {
        let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
        let mut rnd = |n: u64| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x % n
        };
        let alpha = b"ab/*?";
        let salpha = b"ab/";
        for _ in 0..20_000 {
            let pl = 1 + rnd(7) as usize;
            let sl = rnd(9) as usize;
            let p: Vec<u8> = (0..pl)
                .map(|_| alpha[rnd(alpha.len() as u64) as usize])
                .collect();
            let s: Vec<u8> = (0..sl)
                .map(|_| salpha[rnd(salpha.len() as u64) as usize])
                .collect();
            let ps = String::from_utf8(p.clone()).unwrap();
            let ss = String::from_utf8(s.clone()).unwrap();
            let g = Glob::new(&ps).unwrap();
            assert_eq!(
                g.match_bytes(&s),
                naive(&p, &s),
                "pattern {ps:?} text {ss:?}"
            );
        }
    }

    #[test]
    fn parse_and_decide() {
        let text = r#"
            [defaults]
            connections = 8
            registry_bytes = "1MiB"

            [socket]
            mode = 0o660

            [[rule]]
            name = "nobody-in"
            uids = [4242]
            join = false

            [[rule]]
            name = "apps"
            uids = [1000, 1001]
            labels = ["prod-*"]
            offer = ["svc-*"]
            connect = ["db", "cache-?"]
            registry_write = ["/app/**"]
            arena_bytes = "64MiB"
            watches = 3

            [[rule]]
            users = ["root"]
            offer = ["*"]
        "#;
        let p = Policy::parse(text, "test").unwrap();
        assert_eq!(p.socket_mode, 0o660);
        assert_eq!(
            p.decide(4242, 0, None),
            Err(JoinDenied::Forbidden("nobody-in".into()))
        );
        let i = p.decide(1000, 5, Some("prod-eu")).unwrap();
        let r = &p.rules[i];
        assert_eq!(r.name, "apps");
        assert_eq!(r.quotas.arena_bytes, 64 << 20);
        assert_eq!(r.quotas.watches, 3);
        assert_eq!(r.quotas.connections, 8);
        assert_eq!(r.quotas.registry_bytes, 1 << 20);
        assert_eq!(r.quotas.registry_keys, DEFAULT_QUOTAS.registry_keys);
        assert!(r.may_offer("svc-a") && !r.may_offer("db"));
        assert!(r.may_connect("cache-1") && !r.may_connect("cache-12"));
        assert!(r.may_write("/app/x/y") && !r.may_write("/other"));
        assert_eq!(p.decide(1000, 5, None), Err(JoinDenied::NoRule), "no label");
        assert_eq!(p.decide(1000, 5, Some("dev")), Err(JoinDenied::NoRule));
        let root = p.decide(0, 0, None).unwrap();
        assert_eq!(p.rules[root].name, "#3");
        assert!(p.rules[root].join);
        assert!(
            p.rules[root].connect.is_empty(),
            "omitted lists allow nothing"
        );
        assert!(!p.rules[root].may_write("/app/x"));
    }

    #[test]
    fn bad_policies_are_refused_with_clear_messages() {
        let e = Policy::parse("[[rule]]\nuids = [1\n", "bad.toml").unwrap_err();
        assert!(e.contains("bad.toml") && e.contains("line"), "{e}");
        let e = Policy::parse("[[rule]]\nuid = [1]\n", "x").unwrap_err();
        assert!(e.contains("uid"), "{e}");
        let e = Policy::parse("[[rule]]\nusers = [\"no-such-user-fido\"]\n", "x").unwrap_err();
        assert!(e.contains("does not exist"), "{e}");
        let e = Policy::parse("[[rule]]\noffer = [\"\"]\n", "x").unwrap_err();
        assert!(e.contains("empty"), "{e}");
        let e = Policy::parse("[[rule]]\narena_bytes = \"lots\"\n", "x").unwrap_err();
        assert!(e.contains("not a size"), "{e}");
        let e = Policy::parse("[[rule]]\nregistry_write = [\"app/**\"]\n", "x").unwrap_err();
        assert!(e.contains("must start with"), "{e}");
        assert!(Policy::parse("", "empty").unwrap().rules.is_empty());
    }

    #[test]
    fn per_uid_limits_and_read_lists() {
        let p = Policy::parse(
            r#"
            [defaults]
            per_uid_domains = 8
            per_uid_registry_bytes = "1MiB"

            [[rule]]
            name = "a"
            uids = [1000]
            registry_write = ["/app/a/**"]
            per_uid_services = 5

            [[rule]]
            name = "b"
            uids = [1001]
            registry_write = ["/app/b/**"]
            registry_read = ["/shared/*"]
            "#,
            "t",
        )
        .unwrap();
        let (a, b) = (&p.rules[0], &p.rules[1]);
        assert_eq!(a.per_uid.domains, 8);
        assert_eq!(a.per_uid.services, 5);
        assert_eq!(a.per_uid.registry_bytes, 1 << 20);
        assert_eq!(b.per_uid.services, DEFAULT_UID_QUOTAS.services);
        assert_eq!(b.per_uid.watches, DEFAULT_UID_QUOTAS.watches);
        // Unset: what it writes, plus the public MMNet listener keys.
        assert!(a.may_read("/app/a/x") && a.may_read("/net/listen/80/k"));
        assert!(!a.may_read("/app/b/x") && !a.may_read("/net/stats/3"));
        assert!(a.may_read_at_or_below("/app") && a.may_read_at_or_below("/net"));
        assert!(!a.may_read_at_or_below("/app/b"));
        // Set: exactly that.
        assert!(b.may_read("/shared/x") && !b.may_read("/app/b/x"));
        assert!(!b.may_read_at_or_below("/net"));
        assert!(Policy::parse("[[rule]]\nper_uid_domain = 1\n", "t").is_err());
        assert!(Policy::parse("[[rule]]\nregistry_read = [\"x\"]\n", "t").is_err());
    }

    #[test]
    fn observers_get_the_rule_a_join_would() {
        let p = Policy::parse(
            "[[rule]]\nuids = [5]\njoin = false\n[[rule]]\nuids = [6]\nlabels = [\"x\"]\n[[rule]]\nuids = [7]\n",
            "t",
        )
        .unwrap();
        assert_eq!(p.observer_rule(5, 0), None, "join = false");
        assert_eq!(p.observer_rule(6, 0), Some(1), "admitted under some label");
        assert_eq!(p.observer_rule(7, 0), Some(2));
        assert_eq!(p.observer_rule(8, 0), None, "no rule");
    }

    #[test]
    fn matches_at_or_below() {
        let g = |p: &str| Glob::new(p).unwrap();
        assert!(g("/app/*/x").matches_at_or_below("/app"));
        assert!(g("/app/*/x").matches_at_or_below("/app/q"));
        assert!(g("/app/*/x").matches_at_or_below("/app/q/x"));
        assert!(!g("/app/*/x").matches_at_or_below("/app/q/y"));
        assert!(!g("/app/*").matches_at_or_below("/app/q/y"));
        assert!(g("/a**").matches_at_or_below("/ab/c"));
        assert!(!g("/app/**").matches_at_or_below("/apple"));
        assert!(g("/**").matches_at_or_below("/"));
    }

    #[test]
    fn sizes() {
        assert_eq!(parse_size("4096"), Some(4096));
        assert_eq!(parse_size("64KiB"), Some(64 << 10));
        assert_eq!(parse_size("16M"), Some(16 << 20));
        assert_eq!(parse_size("1 GiB"), Some(1 << 30));
        assert_eq!(parse_size("1x"), None);
        assert_eq!(parse_size("G"), None);
    }

    #[test]
    fn net_section_and_rule_switch() {
        let p = Policy::parse(
            "[net]\ndeny = [\"net-redis*\"]\n[[rule]]\nname = \"a\"\nuids = [1]\n[[rule]]\nname = \"b\"\nnet = false\n",
            "t",
        )
        .unwrap();
        assert!(p.net.accelerate);
        let (a, b) = (&p.rules[0], &p.rules[1]);
        assert!(a.net && !b.net);
        assert_eq!(p.net_refusal(a, "net-echo"), None);
        assert!(p
            .net_refusal(a, "net-redis-server")
            .unwrap()
            .contains("net-redis*"));
        assert!(p
            .net_refusal(b, "net-echo")
            .unwrap()
            .contains("rule b says net = false"));
        let off = Policy::parse("[net]\naccelerate = false\n", "t").unwrap();
        let d = Policy::default_for_uid(0);
        assert!(off
            .net_refusal(&d.rules[0], "net-x")
            .unwrap()
            .contains("accelerate = false"));
        assert_eq!(d.net_refusal(&d.rules[0], "net-x"), None);
        assert!(
            Policy::parse("[net]\nallow = []\n", "t").is_err(),
            "unknown keys are refused"
        );
        assert!(is_net_handshake("/net/conn/1/x", false));
        assert!(is_net_handshake("/net/conn/1/x", true));
        assert!(
            !is_net_handshake("/net/listen/1/x", false),
            "listeners are always published"
        );
        assert!(!is_net_handshake("/net/stats/3", false));
    }

    /// A buffer too small for the entry: the C library answers `ERANGE`,
    /// which a lookup with one fixed buffer (the code before this test)
    /// reported as the error; the lookup grows the buffer and finds it.
    #[test]
    fn lookups_grow_a_buffer_that_is_too_small() {
        let tiny = |buf: &mut [libc::c_char]| {
            let c = CString::new("root").unwrap();
            // SAFETY: as in lookup_group_from.
            let mut gr: libc::group = unsafe { std::mem::zeroed() };
            let mut out: *mut libc::group = std::ptr::null_mut();
            // SAFETY: every pointer is valid for the call.
            unsafe { libc::getgrnam_r(c.as_ptr(), &mut gr, buf.as_mut_ptr(), buf.len(), &mut out) }
        };
        assert_eq!(
            tiny(&mut [0; 1]),
            libc::ERANGE,
            "a 1-byte buffer is too small for group root"
        );
        assert_eq!(lookup_group_from("root", 1), Ok(0));
        assert_eq!(lookup_user_from("root", 1), Ok(0));
        assert_eq!(lookup_group("root"), Ok(0));
        assert_eq!(lookup_user("root"), Ok(0));
        let missing = lookup_group_from("fido-no-such-group", 1).unwrap_err();
        assert!(missing.contains("does not exist"), "{missing}");
    }

    #[test]
    fn buffer_growth_doubles_and_stops_at_the_cap() {
        let mut sizes = Vec::new();
        let r: Result<(), libc::c_int> = grow_on_erange(1000, |buf| {
            sizes.push(buf.len());
            Err(libc::ERANGE)
        });
        assert_eq!(r, Err(libc::ERANGE), "the cap ends the retries");
        assert_eq!(sizes[..3], [1000, 2000, 4000]);
        assert_eq!(*sizes.last().unwrap(), NSS_BUFFER_CAP);
        assert!(sizes
            .windows(2)
            .all(|w| w[1] == (w[0] * 2).min(NSS_BUFFER_CAP)));
        let mut calls = 0;
        let r = grow_on_erange(64, |buf| {
            calls += 1;
            if buf.len() < 256 {
                Err(libc::ERANGE)
            } else {
                Ok(buf.len())
            }
        });
        assert_eq!((r, calls), (Ok(256), 3));
        assert_eq!(
            grow_on_erange(64, |_| Err::<(), _>(libc::EIO)),
            Err(libc::EIO),
            "other errors are not retried"
        );
    }
}
