//! How the bytes of `fido pipe serve`, `fido pipe proxy` and `fido-bench pipe`
//! are moved: one [`Mover`] trait, three strategies.
//!
//! * [`ReadWrite`]: the classic loop in the application — `pread`/`read` into a
//!   buffer, `write`/`pwrite` out of it (every byte crosses into user space twice).
//! * [`Sendfile`]: the kernel's in-process shortcuts, still on the application's
//!   CPU time — `sendfile` (file→socket), `splice` through a private pipe
//!   (socket→socket, socket→file), `copy_file_range` (file→file).
//! * [`FidoPipe`](crate::engine::FidoPipe): the broker's pipe engine moves the bytes;
//!   the application only hands it the descriptors and waits.
//!
//! Servers and benchmarks are written once against the trait, so every figure
//! compares the same program with only the strategy changed.
//!
//! Every call moves exactly `len` bytes or fails; a short count is only returned
//! at end of input (the caller decides whether that is an error). Offsets are
//! explicit: the shared file offset of a descriptor is never used or moved.

use std::io;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::Arc;

use rustix::pipe::SpliceFlags;

/// Bytes per syscall of the read/write loop and of each splice/sendfile call.
pub const CHUNK: usize = 128 << 10;

/// A way of moving bytes between descriptors (see the module documentation).
pub trait Mover: Send + Sync {
    /// `len` bytes of `file` at `off` to the socket `sock`. Returns the bytes
    /// sent: fewer than `len` only if the file ended first.
    fn file_to_socket(
        &self,
        file: BorrowedFd<'_>,
        off: u64,
        len: u64,
        sock: BorrowedFd<'_>,
    ) -> io::Result<u64>;

    /// Up to `len` bytes (`None`: until end of stream) from socket `from` to
    /// socket `to`. Returns the bytes forwarded; stops early only at EOF.
    fn socket_to_socket(
        &self,
        from: BorrowedFd<'_>,
        to: BorrowedFd<'_>,
        len: Option<u64>,
    ) -> io::Result<u64>;

    /// Up to `len` bytes from socket `sock` into `file` at `off`. Returns the
    /// bytes written; stops early only at EOF.
    fn socket_to_file(
        &self,
        sock: BorrowedFd<'_>,
        file: BorrowedFd<'_>,
        off: u64,
        len: u64,
    ) -> io::Result<u64>;

    /// `len` bytes of `src` at `src_off` into `dst` at `dst_off`. Returns the
    /// bytes copied; fewer than `len` only if `src` ended first.
    fn file_to_file(
        &self,
        src: BorrowedFd<'_>,
        src_off: u64,
        len: u64,
        dst: BorrowedFd<'_>,
        dst_off: u64,
    ) -> io::Result<u64>;
}

fn retry<T>(mut f: impl FnMut() -> rustix::io::Result<T>) -> io::Result<T> {
    loop {
        match f() {
            Err(rustix::io::Errno::INTR) => continue,
            r => return r.map_err(io::Error::from),
        }
    }
}

fn write_all_fd(fd: BorrowedFd<'_>, mut buf: &[u8]) -> io::Result<()> {
    while !buf.is_empty() {
        let n = retry(|| rustix::io::write(fd, buf))?;
        if n == 0 {
            return Err(io::ErrorKind::WriteZero.into());
        }
        buf = &buf[n..];
    }
    Ok(())
}

fn pwrite_all(fd: BorrowedFd<'_>, mut buf: &[u8], mut off: u64) -> io::Result<()> {
    while !buf.is_empty() {
        let n = retry(|| rustix::io::pwrite(fd, buf, off))?;
        if n == 0 {
            return Err(io::ErrorKind::WriteZero.into());
        }
        buf = &buf[n..];
        off += n as u64;
    }
    Ok(())
}

fn chunk(left: Option<u64>) -> usize {
    left.map_or(CHUNK, |l| l.min(CHUNK as u64) as usize)
}

/// The read/write loop in the application.
#[derive(Debug, Default, Clone, Copy)]
pub struct ReadWrite;

/// The loop all four [`ReadWrite`] moves share: up to `len` bytes (`None`: until
/// EOF), one [`CHUNK`] at a time. `read(buf, done)` fills `buf` from the source
/// at `done` bytes in (0 = EOF); `write(bytes, done)` puts all of `bytes` to the
/// sink at `done` bytes in. Returns the bytes moved.
fn copy_loop(
    len: Option<u64>,
    mut read: impl FnMut(&mut [u8], u64) -> io::Result<usize>,
    mut write: impl FnMut(&[u8], u64) -> io::Result<()>,
) -> io::Result<u64> {
    let mut buf = vec![0u8; CHUNK];
    let mut done = 0u64;
    while len.is_none_or(|l| done < l) {
        let want = chunk(len.map(|l| l - done));
        let n = read(&mut buf[..want], done)?;
        if n == 0 {
            break;
        }
        write(&buf[..n], done)?;
        done += n as u64;
    }
    Ok(done)
}

impl Mover for ReadWrite {
    fn file_to_socket(
        &self,
        file: BorrowedFd<'_>,
        off: u64,
        len: u64,
        sock: BorrowedFd<'_>,
    ) -> io::Result<u64> {
        copy_loop(
            Some(len),
            |b, done| retry(|| rustix::io::pread(file, &mut *b, off + done)),
            |b, _| write_all_fd(sock, b),
        )
    }

    fn socket_to_socket(
        &self,
        from: BorrowedFd<'_>,
        to: BorrowedFd<'_>,
        len: Option<u64>,
    ) -> io::Result<u64> {
        copy_loop(
            len,
            |b, _| retry(|| rustix::io::read(from, &mut *b)),
            |b, _| write_all_fd(to, b),
        )
    }

    fn socket_to_file(
        &self,
        sock: BorrowedFd<'_>,
        file: BorrowedFd<'_>,
        off: u64,
        len: u64,
    ) -> io::Result<u64> {
        copy_loop(
            Some(len),
            |b, _| retry(|| rustix::io::read(sock, &mut *b)),
            |b, done| pwrite_all(file, b, off + done),
        )
    }

    fn file_to_file(
        &self,
        src: BorrowedFd<'_>,
        src_off: u64,
        len: u64,
        dst: BorrowedFd<'_>,
        dst_off: u64,
    ) -> io::Result<u64> {
        copy_loop(
            Some(len),
            |b, done| retry(|| rustix::io::pread(src, &mut *b, src_off + done)),
            |b, done| pwrite_all(dst, b, dst_off + done),
        )
    }
}

/// `sendfile` / `splice` / `copy_file_range` in the application.
#[derive(Debug, Default, Clone, Copy)]
pub struct Sendfile;

/// A private pipe for splice; emptied into `to` after every fill, so it never
/// holds bytes between calls.
struct SplicePipe {
    r: OwnedFd,
    w: OwnedFd,
}

impl SplicePipe {
    fn new() -> io::Result<SplicePipe> {
        let (r, w) = rustix::pipe::pipe_with(rustix::pipe::PipeFlags::CLOEXEC)?;
        // A bigger pipe means fewer splice calls; failure only costs speed.
        let _ = rustix::pipe::fcntl_setpipe_size(&w, 1 << 20);
        Ok(SplicePipe { r, w })
    }

    /// Splices up to `want` bytes from `from` into the pipe, then all of them
    /// out to `to` (at `*out_off` if given). Returns 0 at EOF of `from`.
    fn relay(
        &self,
        from: BorrowedFd<'_>,
        to: BorrowedFd<'_>,
        mut out_off: Option<&mut u64>,
        want: usize,
    ) -> io::Result<usize> {
        let n = retry(|| {
            rustix::pipe::splice(from, None, self.w.as_fd(), None, want, SpliceFlags::MOVE)
        })?;
        let mut left = n;
        while left > 0 {
            let m = retry(|| {
                rustix::pipe::splice(
                    self.r.as_fd(),
                    None,
                    to,
                    out_off.as_deref_mut(),
                    left,
                    SpliceFlags::MOVE,
                )
            })?;
            if m == 0 {
                return Err(io::ErrorKind::WriteZero.into());
            }
            left -= m;
        }
        Ok(n)
    }
}

impl Mover for Sendfile {
    fn file_to_socket(
        &self,
        file: BorrowedFd<'_>,
        off: u64,
        len: u64,
        sock: BorrowedFd<'_>,
    ) -> io::Result<u64> {
        let mut pos = off;
        while pos - off < len {
            let want = chunk(Some(len - (pos - off))).max(1);
            let n = retry(|| rustix::fs::sendfile(sock, file, Some(&mut pos), want))?;
            if n == 0 {
                break;
            }
        }
        Ok(pos - off)
    }

    fn socket_to_socket(
        &self,
        from: BorrowedFd<'_>,
        to: BorrowedFd<'_>,
        len: Option<u64>,
    ) -> io::Result<u64> {
        let p = SplicePipe::new()?;
        let mut done = 0u64;
        while len.is_none_or(|l| done < l) {
            let n = p.relay(from, to, None, chunk(len.map(|l| l - done)))?;
            if n == 0 {
                break;
            }
            done += n as u64;
        }
        Ok(done)
    }

    fn socket_to_file(
        &self,
        sock: BorrowedFd<'_>,
        file: BorrowedFd<'_>,
        off: u64,
        len: u64,
    ) -> io::Result<u64> {
        let p = SplicePipe::new()?;
        let mut pos = off;
        while pos - off < len {
            let want = chunk(Some(len - (pos - off)));
            let n = p.relay(sock, file, Some(&mut pos), want)?;
            if n == 0 {
                break;
            }
        }
        Ok(pos - off)
    }

    fn file_to_file(
        &self,
        src: BorrowedFd<'_>,
        src_off: u64,
        len: u64,
        dst: BorrowedFd<'_>,
        dst_off: u64,
    ) -> io::Result<u64> {
        let (mut i, mut o) = (src_off, dst_off);
        while i - src_off < len {
            let want = (len - (i - src_off)).min(1 << 30) as usize;
            let r = loop {
                match rustix::fs::copy_file_range(src, Some(&mut i), dst, Some(&mut o), want) {
                    Err(rustix::io::Errno::INTR) => continue,
                    r => break r,
                }
            };
            match r {
                Ok(0) => break,
                Ok(_) => {}
                // Not supported between these two (across filesystems on old kernels,
                // special files): the portable loop does the rest.
                Err(
                    rustix::io::Errno::XDEV | rustix::io::Errno::NOSYS | rustix::io::Errno::INVAL,
                ) => {
                    let done = i - src_off;
                    return Ok(done + ReadWrite.file_to_file(src, i, len - done, dst, o)?);
                }
                Err(e) => return Err(e.into()),
            }
        }
        Ok(i - src_off)
    }
}

/// Who moves the bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Strategy {
    /// The broker's pipe engine moves the bytes (the application's CPU stays idle).
    Fido,
    /// sendfile / splice / copy_file_range in this process.
    Sendfile,
    /// read/write loop in this process.
    Readwrite,
}

impl Strategy {
    /// Every strategy, in the order the command line lists them.
    pub const ALL: [Strategy; 3] = [Strategy::Fido, Strategy::Sendfile, Strategy::Readwrite];

    /// The name on the command line (`--strategy NAME`).
    pub fn name(self) -> &'static str {
        match self {
            Strategy::Fido => "fido",
            Strategy::Sendfile => "sendfile",
            Strategy::Readwrite => "readwrite",
        }
    }

    /// What the strategy does, in a line (for help texts).
    pub fn describe(self) -> &'static str {
        match self {
            Strategy::Fido => {
                "The broker's pipe engine moves the bytes (the application's CPU stays idle)"
            }
            Strategy::Sendfile => "sendfile / splice / copy_file_range in this process",
            Strategy::Readwrite => "read/write loop in this process",
        }
    }

    /// A mover of this strategy; [`Strategy::Fido`] joins the broker named by
    /// `$FIDO_BROKER` (or the default socket) — see [`crate::engine::mover`].
    pub fn mover(self) -> io::Result<Arc<dyn Mover>> {
        Ok(match self {
            Strategy::Sendfile => Arc::new(Sendfile),
            Strategy::Readwrite => Arc::new(ReadWrite),
            Strategy::Fido => crate::engine::mover()?,
        })
    }

    /// The `system` name used in bench records.
    pub fn system(self) -> &'static str {
        match self {
            Strategy::Fido => "fido-pipe",
            Strategy::Sendfile => "sendfile",
            Strategy::Readwrite => "readwrite",
        }
    }
}

impl std::str::FromStr for Strategy {
    type Err = String;

    fn from_str(s: &str) -> Result<Strategy, String> {
        Strategy::ALL
            .into_iter()
            .find(|m| m.name() == s)
            .ok_or_else(|| format!("unknown strategy {s:?} (fido, sendfile or readwrite)"))
    }
}

/// Reads `sock` until EOF, discarding the bytes with as little CPU as the
/// kernel allows (splice into `/dev/null`, never copied to user space). The
/// benchmarks' sink: its cost is the same whichever strategy fed the socket.
pub fn drain_to_null(sock: BorrowedFd<'_>) -> io::Result<u64> {
    let null = std::fs::OpenOptions::new().write(true).open("/dev/null")?;
    let p = SplicePipe::new()?;
    let mut done = 0u64;
    loop {
        let n = p.relay(sock, null.as_fd(), None, 1 << 20)?;
        if n == 0 {
            return Ok(done);
        }
        done += n as u64;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read as _, Write as _};
    use std::os::unix::net::UnixStream;

    fn pattern(n: usize) -> Vec<u8> {
        (0..n).map(|i| (i * 7 + i / 251) as u8).collect()
    }

    #[test]
    fn strategy_names_round_trip() {
        for s in Strategy::ALL {
            assert_eq!(s.name().parse::<Strategy>(), Ok(s));
        }
        assert!("splice".parse::<Strategy>().is_err());
    }

    /// Each in-process strategy copies exactly the asked range, at the asked
    /// offsets, across several chunks, and stops short only at the source's end.
    #[test]
    fn in_process_file_to_file_is_exact() {
        let data = pattern(3 * CHUNK + 123);
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("src"), &data).unwrap();
        let movers: [&dyn Mover; 2] = [&ReadWrite, &Sendfile];
        for (i, m) in movers.into_iter().enumerate() {
            let src = std::fs::File::open(dir.path().join("src")).unwrap();
            let dst_path = dir.path().join(format!("dst{i}"));
            let dst = std::fs::File::create(&dst_path).unwrap();
            let n = m
                .file_to_file(src.as_fd(), 10, (2 * CHUNK + 5) as u64, dst.as_fd(), 3)
                .unwrap();
            assert_eq!(n, (2 * CHUNK + 5) as u64);
            let got = std::fs::read(&dst_path).unwrap();
            assert_eq!(&got[..3], &[0, 0, 0]);
            assert_eq!(&got[3..], &data[10..10 + 2 * CHUNK + 5]);
            // Asking past the end returns what there was.
            let n = m
                .file_to_file(src.as_fd(), data.len() as u64 - 4, 100, dst.as_fd(), 0)
                .unwrap();
            assert_eq!(n, 4);
        }
    }

    #[test]
    fn in_process_socket_to_socket_runs_until_end_of_stream() {
        let data = pattern(2 * CHUNK + 77);
        let movers: [&dyn Mover; 2] = [&ReadWrite, &Sendfile];
        for m in movers {
            let (mut tx, from) = UnixStream::pair().unwrap();
            let (to, mut rx) = UnixStream::pair().unwrap();
            let sent = data.clone();
            let writer = std::thread::spawn(move || {
                tx.write_all(&sent).unwrap();
            });
            let reader = std::thread::spawn(move || {
                let mut got = Vec::new();
                rx.read_to_end(&mut got).unwrap();
                got
            });
            let n = m.socket_to_socket(from.as_fd(), to.as_fd(), None).unwrap();
            writer.join().unwrap();
            drop(to);
            assert_eq!(n, data.len() as u64);
            assert_eq!(reader.join().unwrap(), data);
        }
    }
}
