//! Measuring the capacity (`Capacity::Auto`).

use std::time::{Duration, Instant};

use rustix::io::Errno;

/// How long calibration moves bytes.
const CALIBRATION: Duration = Duration::from_millis(150);

/// Measures how fast one lane moves a file to a socket: splice from a 16 MiB
/// memfd through a pipe into a Unix stream socket drained by a helper thread.
pub(crate) fn calibrate(chunk: u32) -> Result<u64, Errno> {
    use rustix::net::{AddressFamily, SocketFlags, SocketType};
    let mfd = rustix::fs::memfd_create("fido-pipe-calibrate", rustix::fs::MemfdFlags::CLOEXEC)?;
    let size: usize = 16 << 20;
    let block = vec![0x5au8; 1 << 20];
    for i in 0..(size >> 20) {
        rustix::io::pwrite(&mfd, &block, (i << 20) as u64)?;
    }
    let (a, b) = rustix::net::socketpair(
        AddressFamily::UNIX,
        SocketType::STREAM,
        SocketFlags::CLOEXEC,
        None,
    )?;
    let drain = std::thread::spawn(move || {
        let mut buf = vec![0u8; 1 << 20];
        while matches!(rustix::io::read(&b, &mut buf), Ok(n) if n > 0) {}
    });
    let (pr, pw) = rustix::pipe::pipe_with(rustix::pipe::PipeFlags::CLOEXEC)?;
    let _ = rustix::pipe::fcntl_setpipe_size(&pw, chunk as usize);
    let start = Instant::now();
    let mut moved = 0u64;
    let mut off = 0u64;
    let res = (|| {
        while start.elapsed() < CALIBRATION {
            let mut o = off;
            let n = rustix::pipe::splice(
                &mfd,
                Some(&mut o),
                &pw,
                None,
                chunk as usize,
                rustix::pipe::SpliceFlags::empty(),
            )?;
            off = if o as usize >= size { 0 } else { o };
            let mut left = n;
            while left > 0 {
                let m = rustix::pipe::splice(
                    &pr,
                    None,
                    &a,
                    None,
                    left,
                    rustix::pipe::SpliceFlags::empty(),
                )?;
                left -= m;
                moved += m as u64;
            }
        }
        Ok::<(), Errno>(())
    })();
    drop(a);
    let _ = drain.join();
    res?;
    let secs = start.elapsed().as_secs_f64().max(1e-6);
    Ok(((moved as f64 / secs) as u64).max(1 << 20))
}
