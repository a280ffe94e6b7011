//! The case study (`kv-get-<size>`): a key-value store served over RPC, fido-rpc
//! against the same service over tonic (gRPC). The client first PUTs [`KEYS`]
//! keys whose `size`-byte values are derived from the key (un-timed), then GETs
//! keys in a fixed pseudo-random order: each GET is timed (round trip, p50/p99)
//! and the value's length and checksum are asserted; requests/s = measured GETs
//! / measured time. The tonic server keeps values as `Bytes` and answers a GET
//! with a reference-counted clone (no copy on the server side before encoding).

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use prost::bytes::Bytes;
use tonic::{Request, Response, Status};

use super::data;
use super::pb::{self, kv_client::KvClient as PbKvClient, kv_server};
use super::ClientResult;

/// Value sizes of the full run.
pub const SIZES: [usize; 4] = [64, 4 << 10, 64 << 10, 1 << 20];
/// Value sizes of `--quick`.
pub const QUICK_SIZES: [usize; 2] = [64, 64 << 10];
/// Keys stored before measuring (fewer for large values: ≤ 64 MiB in total).
pub fn keys_for(size: usize) -> usize {
    (64usize << 20).div_ceil(size.max(1)).clamp(1, 1000).min(1000)
}

/// The key of index `k`.
pub fn key(k: usize) -> Vec<u8> {
    format!("key-{k:08}").into_bytes()
}

/// The value of key `k`: ByteSeq pattern seeded by `k`; returns (bytes, checksum).
pub fn value(k: usize, size: usize) -> (Vec<u8>, u64) {
    let mut v = vec![0u8; size];
    let s = data::fill_bytes(&mut v, k as u64);
    (v, s)
}

/// A connected key-value client of one system.
pub trait KvClient {
    fn put(&mut self, key: &[u8], value: &[u8]) -> anyhow::Result<()>;
    /// GETs `key`; fails unless the value has `len` bytes summing to `sum`.
    fn get_check(&mut self, key: &[u8], len: usize, sum: u64) -> anyhow::Result<()>;
}

/// PUT every key, then timed GETs: warm-up, measured window.
pub fn client_loop(
    c: &mut dyn KvClient,
    size: usize,
    warm: Duration,
    dur: Duration,
) -> anyhow::Result<ClientResult> {
    let n = keys_for(size);
    let mut sums = Vec::with_capacity(n);
    for k in 0..n {
        let (v, s) = value(k, size);
        c.put(&key(k), &v)?;
        sums.push(s);
    }
    let keys: Vec<Vec<u8>> = (0..n).map(key).collect();
    // A fixed permutation walk (odd stride over n keys visits them all).
    let stride = (n / 2) | 1;
    let mut at = 0usize;
    let mut checked = 0u64;
    let mut next = |c: &mut dyn KvClient| -> anyhow::Result<()> {
        at = (at + stride) % n;
        c.get_check(&keys[at], size, sums[at])?;
        checked += 1;
        Ok(())
    };
    let t = Instant::now();
    while t.elapsed() < warm {
        next(c)?;
    }
    let mut samples = Vec::with_capacity(1 << 16);
    let start = Instant::now();
    let mut t0 = start;
    let secs = loop {
        next(c)?;
        let t1 = Instant::now();
        samples.push((t1 - t0).as_nanos() as u64);
        t0 = t1;
        if t1 - start >= dur {
            break (t1 - start).as_secs_f64();
        }
    };
    let (p50, p99) = crate::harness::percentiles(&mut samples);
    Ok(ClientResult {
        calls: samples.len() as u64,
        checked,
        secs,
        bytes: samples.len() as u64 * size as u64,
        p50_ns: Some(p50 as f64),
        p99_ns: Some(p99 as f64),
    })
}

/// Largest key and value a server stores.
const MAX_KEY: usize = 1 << 10;
const MAX_VALUE: usize = 64 << 20;

#[derive(Default)]
struct Store {
    map: Mutex<HashMap<Bytes, Bytes>>,
}

#[tonic::async_trait]
impl kv_server::Kv for Store {
    async fn get(&self, r: Request<pb::Key>) -> Result<Response<pb::Value>, Status> {
        let m = self.map.lock().unwrap();
        Ok(Response::new(match m.get(&r.get_ref().key) {
            Some(v) => pb::Value {
                value: v.clone(),
                found: true,
            },
            None => pb::Value {
                value: Bytes::new(),
                found: false,
            },
        }))
    }

    async fn put(&self, r: Request<pb::KeyValue>) -> Result<Response<pb::Empty>, Status> {
        let kv = r.into_inner();
        if kv.key.len() > MAX_KEY || kv.value.len() > MAX_VALUE {
            return Err(Status::invalid_argument("key or value too large"));
        }
        self.map.lock().unwrap().insert(kv.key, kv.value);
        Ok(Response::new(pb::Empty {}))
    }
}

/// The tonic key-value server: binds `addr`, serves until killed.
pub fn serve_tonic(addr: &str) -> anyhow::Result<()> {
    use super::tonic_sys::WINDOW;
    super::tonic_sys::runtime()?.block_on(async {
        let _ = std::fs::remove_file(addr);
        let l = tokio::net::UnixListener::bind(addr).with_context(|| format!("binding {addr}"))?;
        super::emit_ready()?;
        tonic::transport::Server::builder()
            .initial_stream_window_size(WINDOW)
            .initial_connection_window_size(WINDOW)
            .add_service(
                kv_server::KvServer::new(Store::default())
                    .max_decoding_message_size(usize::MAX)
                    .max_encoding_message_size(usize::MAX),
            )
            .serve_with_incoming(tokio_stream::wrappers::UnixListenerStream::new(l))
            .await?;
        Ok(())
    })
}

pub struct TonicKv {
    rt: tokio::runtime::Runtime,
    c: PbKvClient<tonic::transport::Channel>,
}

impl TonicKv {
    pub fn connect(addr: &str) -> anyhow::Result<TonicKv> {
        let rt = super::tonic_sys::runtime()?;
        let ch = rt.block_on(super::tonic_sys::channel(addr))?;
        Ok(TonicKv {
            rt,
            c: PbKvClient::new(ch)
                .max_decoding_message_size(usize::MAX)
                .max_encoding_message_size(usize::MAX),
        })
    }
}

impl KvClient for TonicKv {
    fn put(&mut self, key: &[u8], value: &[u8]) -> anyhow::Result<()> {
        self.rt.block_on(self.c.put(pb::KeyValue {
            key: Bytes::copy_from_slice(key),
            value: Bytes::copy_from_slice(value),
        }))?;
        Ok(())
    }

    fn get_check(&mut self, key: &[u8], len: usize, sum: u64) -> anyhow::Result<()> {
        let r = self.rt.block_on(self.c.get(pb::Key {
            key: Bytes::copy_from_slice(key),
        }))?;
        let v = r.get_ref();
        anyhow::ensure!(v.found, "key not found");
        anyhow::ensure!(v.value.len() == len, "value of {} bytes, expected {len}", v.value.len());
        data::check("tonic kv get", data::sum_bytes(&v.value), sum)
    }
}
