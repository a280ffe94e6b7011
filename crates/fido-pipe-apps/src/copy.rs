//! `fido pipe cp SRC DST`: a copy through the broker's pipe engine — the
//! bytes never pass through this process. Either end may be `-` (this
//! process's stdin or stdout, which may be a pipe or a socket); a file
//! destination is created or truncated with the source's mode, a directory
//! destination receives `DST/basename(SRC)`.

use std::fs::File;
use std::io;
use std::os::fd::AsFd;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

use fido_pipe::{Client, PipeOp, Transfer};

use crate::proxy::in_context;

/// One end of a copy: a regular file, or this process's stdin/stdout.
enum End {
    Stdio,
    File(File),
}

/// A copy whose ends are open, ready to hand to the engine.
pub struct PipeCopy {
    src: End,
    dst: End,
    /// The source file's length (`None` for stdin: until it ends).
    src_len: Option<u64>,
}

/// Whether `p` names stdin/stdout.
fn is_stdio(p: &Path) -> bool {
    p.as_os_str() == "-"
}

impl PipeCopy {
    /// Opens `src` and creates (or truncates) `dst`; `-` is stdin or stdout.
    /// Refuses a source that is not a regular file, stdin into a directory,
    /// and a destination that is the source itself.
    pub fn open(src: &Path, dst: &Path) -> io::Result<PipeCopy> {
        let (src_end, src_len, mode) = if is_stdio(src) {
            (End::Stdio, None, 0o644)
        } else {
            // O_NONBLOCK: a FIFO (refused below) must not block the open until
            // a writer comes; cleared again for the regular file that is copied.
            let f = std::fs::OpenOptions::new()
                .read(true)
                .custom_flags(rustix::fs::OFlags::NONBLOCK.bits() as i32)
                .open(src)
                .map_err(|e| in_context(e, format!("opening {}", src.display())))?;
            let m = f.metadata()?;
            if !m.is_file() {
                return Err(invalid(format!("{}: not a regular file", src.display())));
            }
            rustix::fs::fcntl_setfl(&f, rustix::fs::OFlags::empty())?;
            (End::File(f), Some(m.len()), m.permissions().mode() & 0o7777)
        };
        let dst_end = if is_stdio(dst) {
            End::Stdio
        } else {
            let target: PathBuf = if dst.is_dir() {
                let name = src
                    .file_name()
                    .filter(|_| !is_stdio(src))
                    .ok_or_else(|| invalid("copying stdin into a directory needs a file name".into()))?;
                dst.join(name)
            } else {
                dst.to_path_buf()
            };
            if let (End::File(s), Ok(m)) = (&src_end, std::fs::metadata(&target)) {
                let sm = s.metadata()?;
                if sm.dev() == m.dev() && sm.ino() == m.ino() {
                    return Err(invalid(format!(
                        "{} and {} are the same file",
                        src.display(),
                        target.display()
                    )));
                }
            }
            let f = std::fs::OpenOptions::new()
                .write(true)
                .create(true)
                .truncate(true)
                .mode(mode)
                .open(&target)
                .map_err(|e| in_context(e, format!("creating {}", target.display())))?;
            End::File(f)
        };
        Ok(PipeCopy {
            src: src_end,
            dst: dst_end,
            src_len,
        })
    }

    /// Has the engine of `client` move the bytes; returns the bytes copied.
    /// Fails if a source file ended before its length at open (it shrank).
    pub fn run(&self, client: &Client) -> io::Result<u64> {
        let (stdin, stdout) = (io::stdin(), io::stdout());
        let (src_fd, src_file) = match &self.src {
            End::Stdio => (stdin.as_fd(), false),
            End::File(f) => (f.as_fd(), true),
        };
        let (dst_fd, dst_file) = match &self.dst {
            End::Stdio => (stdout.as_fd(), false),
            End::File(f) => (f.as_fd(), true),
        };
        let len = self.src_len.unwrap_or(fido_pipe::UNTIL_EOF);
        let op = match (src_file, dst_file) {
            (true, true) => PipeOp::FileToFile { in_off: 0, len, out_off: 0 },
            (true, false) => PipeOp::FileToSocket { off: 0, len },
            (false, true) => PipeOp::SocketToFile { off: 0, len },
            (false, false) => PipeOp::SocketToSocket { len },
        };
        let t: Transfer = client
            .once(src_fd, dst_fd, op)
            .map_err(|e| io::Error::other(format!("pipe transfer: {e}")))?;
        if let Some(n) = self.src_len {
            if t.moved != n {
                return Err(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    format!(
                        "copied {} of {n} bytes: the source ended early (it shrank while copying?)",
                        t.moved
                    ),
                ));
            }
        }
        Ok(t.moved)
    }
}

fn invalid(msg: String) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidInput, msg)
}
