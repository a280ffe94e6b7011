//! The `registry_path` property, shared by the fuzz target and by
//! crates/fido-registry/tests/corpus.rs (which includes this file with
//! `#[path]`, so it depends on nothing but `std`, `fido_proto` and
//! `fido_registry`).
//!
//! The input is a little program: a stream of operations (write, read, delete,
//! list, transact, watch, unwatch, drop_owner, usage) on paths drawn mostly from
//! a small alphabet of valid and invalid components, or from raw bytes. Each
//! operation runs against an in-memory [`Registry`] and against a plain
//! `BTreeMap` model, and the two must agree on every answer, every watch event
//! (order included) and on `usage("/")` after every step. In particular:
//!
//! - an op the registry rejects must be exactly the ops whose input fails
//!   [`fido_proto::check_path`] / the value or transaction limits, and it must
//!   leave `usage("/")` (indeed the whole tree) unchanged;
//! - nothing ever panics.

use std::collections::BTreeMap;

use fido_proto::{check_path, TxnOp, MAX_PATH, MAX_TXN_OPS, MAX_VALUE};
use fido_registry::{Registry, TxnOutcome, WatchEvent};

/// Byte reader that yields zeros once the input is exhausted.
struct Input<'a> {
    data: &'a [u8],
}

impl Input<'_> {
    fn u8(&mut self) -> u8 {
        match self.data.split_first() {
            Some((&b, rest)) => {
                self.data = rest;
                b
            }
            None => 0,
        }
    }
    fn take(&mut self, n: usize) -> &[u8] {
        let n = n.min(self.data.len());
        let (head, rest) = self.data.split_at(n);
        self.data = rest;
        head
    }
    fn is_empty(&self) -> bool {
        self.data.is_empty()
    }
}

/// Components: mostly valid ones chosen to exercise sibling ordering around '/'
/// (`a`, `a+x`, `a-`, `a.`, `a0` sort around `a/`), then invalid ones.
const COMPONENTS: &[&str] = &[
    "a", "b", "ab", "a+x", "a-", "a.", "a0", "c", "x.y", "0", "Z", "@", "=", ":", "_", "..a",
    // invalid
    "", ".", "..", "a b", "é", "a\0",
];

fn path(inp: &mut Input) -> String {
    let mode = inp.u8();
    match mode % 16 {
        // Raw bytes, anything goes (usually invalid).
        0 => {
            let n = (inp.u8() % 32) as usize;
            String::from_utf8_lossy(inp.take(n)).into_owned()
        }
        // Length limit: exactly MAX_PATH (valid) or one more (invalid).
        1 => {
            let extra = (inp.u8() % 2) as usize;
            format!("/{}", "a".repeat(MAX_PATH - 1 + extra))
        }
        // Trailing slash / missing leading slash.
        2 => format!("{}/", path_from_components(inp)),
        3 => path_from_components(inp).trim_start_matches('/').to_owned(),
        _ => path_from_components(inp),
    }
}

fn path_from_components(inp: &mut Input) -> String {
    let depth = inp.u8() % 4;
    if depth == 0 {
        return "/".to_owned();
    }
    let mut p = String::new();
    for _ in 0..depth {
        let b = inp.u8() as usize;
        // 7 in 8 draws come from the valid part of the table.
        let valid = COMPONENTS.len() - 6;
        let c = if b % 8 != 7 { COMPONENTS[b / 8 % valid] } else { COMPONENTS[valid + b / 8 % 6] };
        p.push('/');
        p.push_str(c);
    }
    p
}

fn value(inp: &mut Input) -> Vec<u8> {
    match inp.u8() {
        255 => vec![7; MAX_VALUE + 1],
        254 => vec![7; MAX_VALUE],
        b => inp.take((b % 16) as usize).to_vec(),
    }
}

/// Reference model of the registry's semantics.
#[derive(Default, Clone, PartialEq, Debug)]
struct Model {
    keys: BTreeMap<String, Vec<u8>>,
    /// (owner, token) -> prefix
    watches: BTreeMap<(u64, u64), String>,
}

fn is_at_or_below(key: &str, prefix: &str) -> bool {
    prefix == "/" || key == prefix || (key.starts_with(prefix) && key.as_bytes()[prefix.len()] == b'/')
}

fn ancestors(path: &str) -> Vec<&str> {
    let mut out = vec![path];
    let mut cur = path;
    while cur != "/" {
        cur = match cur.rfind('/') {
            Some(0) => "/",
            Some(i) => &cur[..i],
            None => break,
        };
        out.push(cur);
    }
    out
}

impl Model {
    fn fire(&self, path: &str, value: Option<&[u8]>, out: &mut Vec<WatchEvent>) {
        for anc in ancestors(path) {
            for (&(owner, token), prefix) in &self.watches {
                if prefix == anc {
                    out.push(WatchEvent { owner, token, path: path.to_owned(), value: value.map(<[u8]>::to_vec) });
                }
            }
        }
    }
    fn write(&mut self, path: &str, value: &[u8], events: &mut Vec<WatchEvent>) {
        self.keys.insert(path.to_owned(), value.to_vec());
        self.fire(path, Some(value), events);
    }
    fn delete(&mut self, path: &str, events: &mut Vec<WatchEvent>) {
        let doomed: Vec<String> = self.keys.keys().filter(|k| is_at_or_below(k, path)).cloned().collect();
        for k in &doomed {
            self.keys.remove(k);
            self.fire(k, None, events);
        }
    }
    fn list(&self, path: &str) -> Vec<String> {
        let base = if path == "/" { "/".to_owned() } else { format!("{path}/") };
        let mut names: Vec<String> = self
            .keys
            .keys()
            .filter(|k| k.len() > base.len() && k.starts_with(&base))
            .map(|k| k[base.len()..].split('/').next().unwrap().to_owned())
            .collect();
        names.sort();
        names.dedup();
        names
    }
    fn usage(&self, prefix: &str) -> (u64, u64) {
        let mut n = 0;
        let mut bytes = 0;
        for (k, v) in &self.keys {
            if is_at_or_below(k, prefix) {
                n += 1;
                bytes += v.len() as u64;
            }
        }
        (n, bytes)
    }
    fn watch_count(&self, owner: u64) -> usize {
        self.watches.keys().filter(|(o, _)| *o == owner).count()
    }
}

fn txn_op(inp: &mut Input) -> TxnOp {
    match inp.u8() % 5 {
        0 => TxnOp::Put { path: path(inp), value: value(inp) },
        1 => TxnOp::Delete { path: path(inp) },
        2 => TxnOp::Read { path: path(inp) },
        3 => TxnOp::Check { path: path(inp), expected: None },
        _ => TxnOp::Check { path: path(inp), expected: Some(value(inp)) },
    }
}

fn txn_op_ok(op: &TxnOp) -> bool {
    match op {
        TxnOp::Put { path, value } => check_path(path).is_ok() && value.len() <= MAX_VALUE,
        TxnOp::Check { path, expected } => {
            check_path(path).is_ok() && expected.as_ref().is_none_or(|v| v.len() <= MAX_VALUE)
        }
        TxnOp::Delete { path } | TxnOp::Read { path } => check_path(path).is_ok(),
    }
}

fn expect_same<T: PartialEq + std::fmt::Debug>(what: &str, got: T, want: T) {
    assert_eq!(got, want, "{what}: registry and model disagree");
}

/// Runs one program. Panics on any disagreement.
pub fn run(data: &[u8]) {
    let mut reg = Registry::in_memory().expect("in-memory registry");
    let mut model = Model::default();
    let mut inp = Input { data };
    // Bound the work per input so the fuzzer stays fast.
    for _ in 0..64 {
        if inp.is_empty() {
            break;
        }
        let before = reg.usage("/").expect("usage(/)");
        expect_same("usage(/) before op", before, model.usage("/"));
        let op = inp.u8();
        let rejected: bool = match op % 10 {
            0 | 1 => {
                let p = path(&mut inp);
                let v = value(&mut inp);
                let ok = check_path(&p).is_ok() && v.len() <= MAX_VALUE;
                match reg.write(&p, &v) {
                    Ok(events) => {
                        assert!(ok, "write({p:?}, {} bytes) accepted", v.len());
                        let mut want = Vec::new();
                        model.write(&p, &v, &mut want);
                        expect_same("write events", events, want);
                        false
                    }
                    Err(e) => {
                        assert!(!ok, "valid write({p:?}) failed: {e}");
                        true
                    }
                }
            }
            2 => {
                let p = path(&mut inp);
                let ok = check_path(&p).is_ok();
                match reg.read(&p) {
                    Ok(v) => {
                        assert!(ok, "read({p:?}) accepted");
                        expect_same("read", v, model.keys.get(&p).cloned());
                        false
                    }
                    Err(e) => {
                        assert!(!ok, "valid read({p:?}) failed: {e}");
                        true
                    }
                }
            }
            3 => {
                let p = path(&mut inp);
                let ok = check_path(&p).is_ok();
                match reg.delete(&p) {
                    Ok(events) => {
                        assert!(ok, "delete({p:?}) accepted");
                        let mut want = Vec::new();
                        model.delete(&p, &mut want);
                        expect_same("delete events", events, want);
                        false
                    }
                    Err(e) => {
                        assert!(!ok, "valid delete({p:?}) failed: {e}");
                        true
                    }
                }
            }
            4 => {
                let p = path(&mut inp);
                let ok = check_path(&p).is_ok();
                match reg.list(&p) {
                    Ok(names) => {
                        assert!(ok, "list({p:?}) accepted");
                        expect_same(&format!("list({p:?})"), names, model.list(&p));
                        false
                    }
                    Err(e) => {
                        assert!(!ok, "valid list({p:?}) failed: {e}");
                        true
                    }
                }
            }
            5 | 6 => {
                let n = inp.u8() as usize % 8;
                // Rarely, one op too many.
                let n = if n == 7 && inp.u8() == 0xff { MAX_TXN_OPS + 1 } else { n };
                let ops: Vec<TxnOp> = (0..n).map(|_| txn_op(&mut inp)).collect();
                let ok = ops.len() <= MAX_TXN_OPS && ops.iter().all(txn_op_ok);
                match reg.transact(&ops) {
                    Ok(outcome) => {
                        assert!(ok, "transaction {ops:?} accepted");
                        expect_same("transaction", outcome, model_transact(&mut model, &ops));
                        false
                    }
                    Err(e) => {
                        assert!(!ok, "valid transaction failed: {e}");
                        true
                    }
                }
            }
            7 => {
                let owner = (inp.u8() % 3) as u64;
                let token = (inp.u8() % 4) as u64;
                let p = path(&mut inp);
                let ok = check_path(&p).is_ok();
                match reg.watch(owner, token, &p) {
                    Ok(()) => {
                        assert!(ok, "watch({p:?}) accepted");
                        model.watches.insert((owner, token), p);
                        false
                    }
                    Err(e) => {
                        assert!(!ok, "valid watch({p:?}) failed: {e}");
                        true
                    }
                }
            }
            8 => {
                let owner = (inp.u8() % 3) as u64;
                if inp.u8() % 4 == 0 {
                    reg.drop_owner(owner);
                    model.watches.retain(|(o, _), _| *o != owner);
                } else {
                    let token = (inp.u8() % 4) as u64;
                    let removed = reg.unwatch(owner, token);
                    expect_same("unwatch", removed, model.watches.remove(&(owner, token)).is_some());
                }
                expect_same("watch_count", reg.watch_count(owner), model.watch_count(owner));
                false
            }
            _ => {
                let p = path(&mut inp);
                let ok = check_path(&p).is_ok();
                match reg.usage(&p) {
                    Ok(u) => {
                        assert!(ok, "usage({p:?}) accepted");
                        expect_same(&format!("usage({p:?})"), u, model.usage(&p));
                        false
                    }
                    Err(e) => {
                        assert!(!ok, "valid usage({p:?}) failed: {e}");
                        true
                    }
                }
            }
        };
        let after = reg.usage("/").expect("usage(/)");
        if rejected {
            assert_eq!(before, after, "a rejected op changed usage(/)");
        }
        expect_same("usage(/) after op", after, model.usage("/"));
    }
}

fn model_transact(model: &mut Model, ops: &[TxnOp]) -> TxnOutcome {
    for op in ops {
        if let TxnOp::Check { path, expected } = op {
            if model.keys.get(path) != expected.as_ref() {
                return TxnOutcome { committed: false, reads: Vec::new(), events: Vec::new() };
            }
        }
    }
    let mut reads = Vec::new();
    let mut events = Vec::new();
    for op in ops {
        match op {
            TxnOp::Check { .. } => {}
            TxnOp::Put { path, value } => model.write(path, value, &mut events),
            TxnOp::Delete { path } => model.delete(path, &mut events),
            TxnOp::Read { path } => reads.push(model.keys.get(path).cloned()),
        }
    }
    TxnOutcome { committed: true, reads, events }
}
