//! The case study: a file server whose `read(path, offset, len)` returns a
//! zero-copy view of cached file data. Files are loaded from a directory (or
//! `put`) into the server's arena once; every read afterwards hands the
//! client a handle into that cache entry and holds the entry (an `Arc`) until
//! the client drops its reply — eviction or replacement never frees memory a
//! client is reading.

use fido_rpc::{Ctx, Failure, ShmSlice, ShmStr};
use bytemuck::{Pod, Zeroable};
use fido::Buf;
use fido_shm::Arena;
use parking_lot::RwLock;
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// Application errors of the file service.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Pod, Zeroable)]
pub struct FsError {
    pub code: u32,
}

impl FsError {
    pub const NOT_FOUND: FsError = FsError { code: 1 };
    pub const BAD_PATH: FsError = FsError { code: 2 };
    pub const BAD_RANGE: FsError = FsError { code: 3 };
    pub const IO: FsError = FsError { code: 4 };
    pub const NO_SPACE: FsError = FsError { code: 5 };
}

#[fido_rpc::service]
pub trait Files: Send + Sync + 'static {
    /// `len` bytes at `offset` of `path` (fewer at the end of the file), as a
    /// view of the server's cache: nothing is copied.
    fn read(&self, cx: &mut Ctx<'_>, path: ShmStr, offset: u64, len: u64) -> Result<ShmSlice<u8>, Failure<FsError>>;
    /// The file's size.
    fn stat(&self, cx: &mut Ctx<'_>, path: ShmStr) -> Result<u64, Failure<FsError>>;
    /// Stores `data` as `path` in the cache (one copy, into the server's
    /// arena); returns its size.
    fn put(&self, cx: &mut Ctx<'_>, path: ShmStr, data: ShmSlice<u8>) -> Result<u64, Failure<FsError>>;
    /// Drops `path` from the cache (readers holding a view keep theirs).
    fn evict(&self, cx: &mut Ctx<'_>, path: ShmStr) -> Result<(), Failure<FsError>>;
}

/// The file server: a cache of whole files in the server's arena, filled
/// from `root` on first read.
pub struct FileServer {
    arena: Arc<Arena>,
    root: Option<PathBuf>,
    cache: RwLock<HashMap<Vec<u8>, Arc<Entry>>>,
}

/// One cached file: its bytes in our arena (at least one byte is allocated,
/// so an empty file has `len` 0).
struct Entry {
    buf: Buf,
    len: usize,
}

impl FileServer {
    /// A server caching files of `root` (None: only what is `put`).
    pub fn new(arena: &Arc<Arena>, root: Option<&Path>) -> Self {
        FileServer { arena: arena.clone(), root: root.map(Path::to_path_buf), cache: RwLock::new(HashMap::new()) }
    }

    /// Cached files.
    pub fn cached(&self) -> usize {
        self.cache.read().len()
    }

    fn path_of(&self, name: &[u8]) -> Result<PathBuf, FsError> {
        let root = self.root.as_ref().ok_or(FsError::NOT_FOUND)?;
        let s = std::str::from_utf8(name).map_err(|_| FsError::BAD_PATH)?;
        let rel = Path::new(s);
        // Only plain relative components: no "..", no absolute paths.
        if s.is_empty() || !rel.components().all(|c| matches!(c, std::path::Component::Normal(_))) {
            return Err(FsError::BAD_PATH);
        }
        Ok(root.join(rel))
    }

    fn store(&self, name: Vec<u8>, data: &[u8]) -> Result<Arc<Entry>, FsError> {
        self.store_with(name, data.len(), |b| b.copy_from_slice(data))
    }

    /// Caches `len` bytes under `name`, written by `fill`.
    fn store_with(&self, name: Vec<u8>, len: usize, fill: impl FnOnce(&mut [u8])) -> Result<Arc<Entry>, FsError> {
        let mut b = self.arena.alloc(len.max(1)).map_err(|_| FsError::NO_SPACE)?;
        fill(&mut b[..len]);
        let e = Arc::new(Entry { buf: b, len });
        self.cache.write().insert(name, e.clone());
        Ok(e)
    }

    /// The cache entry of `name`, loading it from disk on a miss.
    fn entry(&self, name: &[u8]) -> Result<Arc<Entry>, FsError> {
        if let Some(e) = self.cache.read().get(name) {
            return Ok(e.clone());
        }
        let p = self.path_of(name)?;
        let data = std::fs::read(&p).map_err(|e| if e.kind() == std::io::ErrorKind::NotFound { FsError::NOT_FOUND } else { FsError::IO })?;
        self.store(name.to_vec(), &data)
    }
}

fn key(cx: &Ctx<'_>, path: ShmStr) -> Result<Vec<u8>, Failure<FsError>> {
    if path.len() > 4096 {
        return Err(Failure::App(FsError::BAD_PATH));
    }
    // Copied out once: the client cannot change the name after we looked it up.
    Ok(cx.str(path)?.as_bytes().to_vec())
}

impl Files for FileServer {
    fn read(&self, cx: &mut Ctx<'_>, path: ShmStr, offset: u64, len: u64) -> Result<ShmSlice<u8>, Failure<FsError>> {
        let name = key(cx, path)?;
        let e = self.entry(&name).map_err(Failure::App)?;
        if offset > e.len as u64 {
            return Err(Failure::App(FsError::BAD_RANGE));
        }
        let n = len.min(e.len as u64 - offset) as usize;
        let h = if n == 0 { ShmSlice::empty() } else { ShmSlice::of_buf_range(&e.buf, offset as usize, n) };
        // The client reads the entry in place: keep it until it lets go.
        cx.hold(e);
        Ok(h)
    }
    fn stat(&self, cx: &mut Ctx<'_>, path: ShmStr) -> Result<u64, Failure<FsError>> {
        let name = key(cx, path)?;
        Ok(self.entry(&name).map_err(Failure::App)?.len as u64)
    }
    fn put(&self, cx: &mut Ctx<'_>, path: ShmStr, data: ShmSlice<u8>) -> Result<u64, Failure<FsError>> {
        let name = key(cx, path)?;
        let bytes = cx.slice(data)?.as_bytes();
        self.store_with(name, bytes.len(), |b| {
            bytes.copy_to(b);
        })
        .map_err(Failure::App)?;
        Ok(bytes.len() as u64)
    }
    fn evict(&self, cx: &mut Ctx<'_>, path: ShmStr) -> Result<(), Failure<FsError>> {
        let name = key(cx, path)?;
        self.cache.write().remove(&name).map(|_| ()).ok_or(Failure::App(FsError::NOT_FOUND))
    }
}
