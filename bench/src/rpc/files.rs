//! The case study (`file-read-<size>`): a file server whose reads come from its
//! cache — fido-rpc's `fido_rpc::services::files` (a read returns a zero-copy
//! view of the cached bytes) against the same service over tonic (gRPC). The
//! client first PUTs [`files_for`] files of `size` bytes whose contents derive
//! from the file's index (un-timed, the cache is warm), then reads whole files
//! (`read(path, 0, size)`) in a fixed pseudo-random order: each read is timed
//! (round trip, p50/p99) and the data's length and checksum are asserted;
//! requests/s = measured reads / measured time. The tonic server keeps each file
//! as `Bytes` and answers with a reference-counted slice (no copy on the server
//! side before encoding).

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use prost::bytes::Bytes;
use tonic::{Request, Response, Status};

use super::data;
use super::pb::{self, files_client::FilesClient as PbFilesClient, files_server};
use super::ClientResult;

/// Value sizes of the full run.
pub const SIZES: [usize; 4] = [64, 4 << 10, 64 << 10, 1 << 20];
/// Value sizes of `--quick`.
pub const QUICK_SIZES: [usize; 2] = [64, 64 << 10];
/// Files stored before measuring (fewer for large ones: ≤ 32 MiB in total).
pub fn files_for(size: usize) -> usize {
    (32usize << 20).div_ceil(size.max(1)).clamp(1, 256)
}

/// The path of file `k`.
pub fn path(k: usize) -> String {
    format!("dir/file-{k:06}.bin")
}

/// The contents of file `k`: ByteSeq pattern seeded by `k`; returns (bytes, checksum).
pub fn contents(k: usize, size: usize) -> (Vec<u8>, u64) {
    let mut v = vec![0u8; size];
    let s = data::fill_bytes(&mut v, k as u64);
    (v, s)
}

/// A connected file-server client of one system.
pub trait FilesClient {
    fn put(&mut self, path: &str, data: &[u8]) -> anyhow::Result<()>;
    /// Reads `path` from offset 0 for `len` bytes; fails unless the data has
    /// `len` bytes summing to `sum`.
    fn read_check(&mut self, path: &str, len: usize, sum: u64) -> anyhow::Result<()>;
}

/// PUT every file, then timed whole-file reads: warm-up, measured window.
pub fn client_loop(
    c: &mut dyn FilesClient,
    size: usize,
    warm: Duration,
    dur: Duration,
) -> anyhow::Result<ClientResult> {
    let n = files_for(size);
    let mut sums = Vec::with_capacity(n);
    for k in 0..n {
        let (v, s) = contents(k, size);
        c.put(&path(k), &v)?;
        sums.push(s);
    }
    let keys: Vec<String> = (0..n).map(path).collect();
    // A fixed permutation walk (odd stride over n keys visits them all).
    let stride = (n / 2) | 1;
    let mut at = 0usize;
    let mut checked = 0u64;
    let mut next = |c: &mut dyn FilesClient| -> anyhow::Result<()> {
        at = (at + stride) % n;
        c.read_check(&keys[at], size, sums[at])?;
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

/// Largest path and file a server stores.
const MAX_PATH: usize = 4096;
const MAX_FILE: usize = 64 << 20;

#[derive(Default)]
struct Cache {
    files: Mutex<HashMap<String, Bytes>>,
}

#[tonic::async_trait]
impl files_server::Files for Cache {
    async fn read(&self, r: Request<pb::ReadRequest>) -> Result<Response<pb::ReadReply>, Status> {
        let r = r.get_ref();
        let f = self
            .files
            .lock()
            .unwrap()
            .get(&r.path)
            .cloned()
            .ok_or_else(|| Status::not_found(r.path.clone()))?;
        if r.offset > f.len() as u64 {
            return Err(Status::out_of_range("offset past the end"));
        }
        let off = r.offset as usize;
        let n = (r.len.min((f.len() - off) as u64)) as usize;
        Ok(Response::new(pb::ReadReply {
            data: f.slice(off..off + n),
        }))
    }

    async fn put(&self, r: Request<pb::PutRequest>) -> Result<Response<pb::PutReply>, Status> {
        let r = r.into_inner();
        if r.path.len() > MAX_PATH || r.data.len() > MAX_FILE {
            return Err(Status::invalid_argument("path or file too large"));
        }
        let len = r.data.len() as u64;
        self.files.lock().unwrap().insert(r.path, r.data);
        Ok(Response::new(pb::PutReply { len }))
    }
}

/// The tonic file server: binds `addr`, serves until killed.
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
                files_server::FilesServer::new(Cache::default())
                    .max_decoding_message_size(usize::MAX)
                    .max_encoding_message_size(usize::MAX),
            )
            .serve_with_incoming(tokio_stream::wrappers::UnixListenerStream::new(l))
            .await?;
        Ok(())
    })
}

pub struct TonicFiles {
    rt: tokio::runtime::Runtime,
    c: PbFilesClient<tonic::transport::Channel>,
}

impl TonicFiles {
    pub fn connect(addr: &str) -> anyhow::Result<TonicFiles> {
        let rt = super::tonic_sys::runtime()?;
        let ch = rt.block_on(super::tonic_sys::channel(addr))?;
        Ok(TonicFiles {
            rt,
            c: PbFilesClient::new(ch)
                .max_decoding_message_size(usize::MAX)
                .max_encoding_message_size(usize::MAX),
        })
    }
}

impl FilesClient for TonicFiles {
    fn put(&mut self, path: &str, data: &[u8]) -> anyhow::Result<()> {
        let r = self.rt.block_on(self.c.put(pb::PutRequest {
            path: path.to_string(),
            data: Bytes::copy_from_slice(data),
        }))?;
        anyhow::ensure!(r.get_ref().len == data.len() as u64, "short put");
        Ok(())
    }

    fn read_check(&mut self, path: &str, len: usize, sum: u64) -> anyhow::Result<()> {
        let r = self.rt.block_on(self.c.read(pb::ReadRequest {
            path: path.to_string(),
            offset: 0,
            len: len as u64,
        }))?;
        let d = &r.get_ref().data;
        anyhow::ensure!(d.len() == len, "read {} bytes, expected {len}", d.len());
        data::check("tonic file read", data::sum_bytes(d), sum)
    }
}
