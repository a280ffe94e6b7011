//! A small synchronous QMP client.
//!
//! QEMU runs as the VM's owner, so everything it writes on the QMP socket is
//! untrusted input: lines are bounded ([`MAX_LINE`]), each must be one JSON
//! object of a known shape, replies must carry the id of the command they
//! answer, the event queue is bounded, and every wait has a deadline. A bad
//! line is a [`QmpError`] for this VM, never a panic.

use rustix::event::{poll, PollFd, PollFlags, Timespec};
use rustix::io::Errno;
use rustix::net::{recv, send, sendmsg, RecvFlags, SendAncillaryBuffer, SendAncillaryMessage, SendFlags};
use serde_json::{json, Map, Value};
use std::collections::VecDeque;
use std::io::{self, IoSlice};
use std::mem::MaybeUninit;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::time::{Duration, Instant};

/// Longest line accepted from QEMU (a `query-pci` of a full machine is a few
/// tens of KiB).
pub const MAX_LINE: usize = 1 << 20;
/// Most events kept unclaimed; older ones are dropped (and counted).
pub const MAX_EVENTS: usize = 1024;
/// Longest event name or error text kept.
const MAX_TEXT: usize = 4096;

/// What went wrong talking to QEMU.
#[derive(Debug, thiserror::Error)]
pub enum QmpError {
    #[error("QMP socket: {0}")]
    Io(#[from] io::Error),
    #[error("QMP: no answer to {what} within {timeout:?}")]
    Timeout { what: String, timeout: Duration },
    #[error("QMP: QEMU closed the socket")]
    Closed,
    #[error("QMP: garbled message from QEMU: {0}")]
    Garbled(String),
    #[error("QMP: {command} failed: {class}: {desc}")]
    Command { command: String, class: String, desc: String },
}

/// An asynchronous event from QEMU.
#[derive(Debug, Clone, PartialEq)]
pub struct QmpEvent {
    pub name: String,
    /// The event's `data` (`Null` when it has none).
    pub data: Value,
}

/// A QMP connection in command mode.
#[derive(Debug)]
pub struct Qmp {
    sock: OwnedFd,
    /// Bytes read but not yet split into lines.
    buf: Vec<u8>,
    events: VecDeque<QmpEvent>,
    dropped_events: u64,
    next_id: u64,
    timeout: Duration,
    version: (u64, u64, u64),
}

impl Qmp {
    /// Takes the supervisor's end of the QMP socket pair, reads QEMU's
    /// greeting and enters command mode (`qmp_capabilities`). `timeout` bounds
    /// this and, later, each command.
    pub fn connect(sock: OwnedFd, timeout: Duration) -> Result<Qmp, QmpError> {
        rustix::io::ioctl_fionbio(&sock, true).map_err(io::Error::from)?;
        let mut qmp = Qmp { sock, buf: Vec::new(), events: VecDeque::new(), dropped_events: 0, next_id: 1, timeout, version: (0, 0, 0) };
        let deadline = Instant::now() + timeout;
        let greeting = loop {
            match qmp.read_message(deadline, "the QMP greeting")? {
                Message::Greeting(v) => break v,
                Message::Event(e) => qmp.queue(e),
                Message::Reply { .. } => return Err(QmpError::Garbled("a reply before the greeting".into())),
            }
        };
        qmp.version = greeting;
        qmp.execute("qmp_capabilities", Value::Null)?;
        Ok(qmp)
    }

    /// QEMU's version from the greeting (major, minor, micro).
    pub fn version(&self) -> (u64, u64, u64) {
        self.version
    }

    /// The timeout each command gets.
    pub fn set_timeout(&mut self, timeout: Duration) {
        self.timeout = timeout;
    }

    /// Runs `command` with `args` (`Value::Null` for none) and returns its
    /// `return` value. Events that arrive meanwhile are queued.
    pub fn execute(&mut self, command: &str, args: Value) -> Result<Value, QmpError> {
        self.execute_inner(command, args, None)
    }

    /// [`Qmp::execute`], passing `fd` with the command (SCM_RIGHTS), as
    /// `add-fd` and `getfd` expect.
    pub fn execute_with_fd(&mut self, command: &str, args: Value, fd: BorrowedFd<'_>) -> Result<Value, QmpError> {
        self.execute_inner(command, args, Some(fd))
    }

    fn execute_inner(&mut self, command: &str, args: Value, fd: Option<BorrowedFd<'_>>) -> Result<Value, QmpError> {
        let id = self.next_id;
        self.next_id += 1;
        let mut msg = json!({ "execute": command, "id": id });
        if !args.is_null() {
            msg["arguments"] = args;
        }
        let mut line = serde_json::to_vec(&msg).map_err(|e| QmpError::Garbled(format!("encoding {command}: {e}")))?;
        line.push(b'\n');
        let deadline = Instant::now() + self.timeout;
        self.write_all(&line, fd, deadline, command)?;
        loop {
            match self.read_message(deadline, command)? {
                Message::Event(e) => self.queue(e),
                Message::Greeting(_) => return Err(QmpError::Garbled("a second greeting".into())),
                // A late answer to a command that timed out earlier.
                Message::Reply { id: got, .. } if got != id && got < id => continue,
                Message::Reply { id: got, .. } if got != id => {
                    return Err(QmpError::Garbled(format!("a reply to command {got}, waiting for {id}")));
                }
                Message::Reply { result, .. } => {
                    return result.map_err(|(class, desc)| QmpError::Command { command: command.to_string(), class, desc });
                }
            }
        }
    }

    /// Waits up to `timeout` for event `name` (the first queued one, else the
    /// next to arrive) and returns it; other events stay queued.
    pub fn take_event(&mut self, name: &str, timeout: Duration) -> Result<QmpEvent, QmpError> {
        self.take_event_matching(name, timeout, |_| true)
    }

    /// [`Qmp::take_event`] for an event whose data satisfies `matches`.
    pub fn take_event_matching(&mut self, name: &str, timeout: Duration, matches: impl Fn(&Value) -> bool) -> Result<QmpEvent, QmpError> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(i) = self.events.iter().position(|e| e.name == name && matches(&e.data)) {
                return Ok(self.events.remove(i).expect("index just found"));
            }
            match self.read_message(deadline, &format!("event {name}"))? {
                Message::Event(e) => self.queue(e),
                Message::Greeting(_) => return Err(QmpError::Garbled("a second greeting".into())),
                // No command is outstanding: a stale answer to one that timed out.
                Message::Reply { id, .. } if id < self.next_id => {}
                Message::Reply { id, .. } => return Err(QmpError::Garbled(format!("a reply to command {id}, which was never sent"))),
            }
        }
    }

    /// Reads whatever QEMU has sent without waiting and queues its events
    /// (for a supervisor that polls [`Qmp::as_fd`]). `Err(Closed)` when QEMU
    /// has gone.
    pub fn poll_events(&mut self) -> Result<(), QmpError> {
        loop {
            match self.read_message(Instant::now(), "") {
                Ok(Message::Event(e)) => self.queue(e),
                Ok(Message::Reply { id, .. }) if id < self.next_id => {}
                Ok(Message::Reply { id, .. }) => return Err(QmpError::Garbled(format!("a reply to command {id}, which was never sent"))),
                Ok(Message::Greeting(_)) => return Err(QmpError::Garbled("a second greeting".into())),
                Err(QmpError::Timeout { .. }) => return Ok(()),
                Err(e) => return Err(e),
            }
        }
    }

    /// Takes every queued event.
    pub fn drain_events(&mut self) -> Vec<QmpEvent> {
        self.events.drain(..).collect()
    }

    /// Events dropped because the queue was full.
    pub fn dropped_events(&self) -> u64 {
        self.dropped_events
    }

    fn queue(&mut self, e: QmpEvent) {
        if self.events.len() >= MAX_EVENTS {
            self.events.pop_front();
            self.dropped_events += 1;
        }
        self.events.push_back(e);
    }

    fn write_all(&mut self, mut bytes: &[u8], mut fd: Option<BorrowedFd<'_>>, deadline: Instant, what: &str) -> Result<(), QmpError> {
        while !bytes.is_empty() {
            let sent = match fd {
                Some(f) => {
                    let mut space = [MaybeUninit::<u8>::uninit(); rustix::cmsg_space!(ScmRights(1))];
                    let mut control = SendAncillaryBuffer::new(&mut space);
                    let fds = [f];
                    if !control.push(SendAncillaryMessage::ScmRights(&fds)) {
                        return Err(QmpError::Io(io::Error::other("control buffer too small")));
                    }
                    sendmsg(&self.sock, &[IoSlice::new(bytes)], &mut control, SendFlags::NOSIGNAL)
                }
                None => send(&self.sock, bytes, SendFlags::NOSIGNAL),
            };
            match sent {
                Ok(n) => {
                    // The descriptor went with the first byte.
                    fd = None;
                    bytes = &bytes[n..];
                }
                Err(Errno::INTR) => {}
                Err(Errno::AGAIN) => self.wait(PollFlags::OUT, deadline, what)?,
                Err(Errno::PIPE) | Err(Errno::CONNRESET) => return Err(QmpError::Closed),
                Err(e) => return Err(QmpError::Io(e.into())),
            }
        }
        Ok(())
    }

    /// Waits until the socket is ready for `flags` or `deadline` passes.
    fn wait(&self, flags: PollFlags, deadline: Instant, what: &str) -> Result<(), QmpError> {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(QmpError::Timeout { what: what.to_string(), timeout: self.timeout });
        }
        let ts = Timespec { tv_sec: left.as_secs() as i64, tv_nsec: left.subsec_nanos() as i64 };
        let mut fds = [PollFd::new(&self.sock, flags)];
        match poll(&mut fds, Some(&ts)) {
            Ok(_) | Err(Errno::INTR) => Ok(()),
            Err(e) => Err(QmpError::Io(e.into())),
        }
    }

    /// Reads the next complete message, waiting until `deadline`.
    fn read_message(&mut self, deadline: Instant, what: &str) -> Result<Message, QmpError> {
        loop {
            if let Some(end) = self.buf.iter().position(|&b| b == b'\n') {
                let line: Vec<u8> = self.buf.drain(..=end).collect();
                let text = line.trim_ascii();
                if text.is_empty() {
                    continue;
                }
                return parse_message(text);
            }
            if self.buf.len() > MAX_LINE {
                return Err(QmpError::Garbled(format!("a line longer than {MAX_LINE} bytes")));
            }
            let mut chunk = [0u8; 16 << 10];
            match recv(&self.sock, &mut chunk[..], RecvFlags::DONTWAIT) {
                Ok((0, _)) => return Err(QmpError::Closed),
                Ok((n, _)) => self.buf.extend_from_slice(&chunk[..n]),
                Err(Errno::INTR) => {}
                Err(Errno::AGAIN) => {
                    if Instant::now() >= deadline {
                        return Err(QmpError::Timeout { what: what.to_string(), timeout: self.timeout });
                    }
                    self.wait(PollFlags::IN, deadline, what)?;
                }
                Err(Errno::CONNRESET) => return Err(QmpError::Closed),
                Err(e) => return Err(QmpError::Io(e.into())),
            }
        }
    }
}

impl AsFd for Qmp {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.sock.as_fd()
    }
}

/// One message from QEMU, checked.
#[derive(Debug)]
enum Message {
    Greeting((u64, u64, u64)),
    Reply { id: u64, result: Result<Value, (String, String)> },
    Event(QmpEvent),
}

fn garbled(why: &str, text: &[u8]) -> QmpError {
    let shown = String::from_utf8_lossy(&text[..text.len().min(200)]).into_owned();
    QmpError::Garbled(format!("{why}: {shown:?}"))
}

/// A bounded, printable copy of a string QEMU sent.
fn text_field(v: Option<&Value>) -> Option<String> {
    let s = v?.as_str()?;
    Some(s.chars().take(MAX_TEXT).filter(|c| !c.is_control()).collect())
}

fn parse_message(text: &[u8]) -> Result<Message, QmpError> {
    let value: Value = serde_json::from_slice(text).map_err(|e| garbled(&format!("not JSON ({e})"), text))?;
    let Value::Object(obj) = value else {
        return Err(garbled("not a JSON object", text));
    };
    if let Some(q) = obj.get("QMP") {
        let v = &q["version"]["qemu"];
        let num = |k: &str| v.get(k).and_then(Value::as_u64);
        return match (num("major"), num("minor"), num("micro")) {
            (Some(a), Some(b), Some(c)) => Ok(Message::Greeting((a, b, c))),
            _ => Err(garbled("a greeting without a version", text)),
        };
    }
    if obj.contains_key("event") {
        let name = text_field(obj.get("event")).filter(|n| !n.is_empty()).ok_or_else(|| garbled("an event without a name", text))?;
        let data = obj.get("data").cloned().unwrap_or(Value::Null);
        return Ok(Message::Event(QmpEvent { name, data }));
    }
    let id = obj.get("id").and_then(Value::as_u64).ok_or_else(|| garbled("a reply without our id", text))?;
    reply(id, obj).ok_or_else(|| garbled("neither a return nor an error", text))
}

fn reply(id: u64, mut obj: Map<String, Value>) -> Option<Message> {
    if let Some(r) = obj.remove("return") {
        return Some(Message::Reply { id, result: Ok(r) });
    }
    let e = obj.get("error")?;
    let class = text_field(e.get("class"))?;
    let desc = text_field(e.get("desc"))?;
    Some(Message::Reply { id, result: Err((class, desc)) })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_and_refuses() {
        assert!(matches!(parse_message(br#"{"QMP":{"version":{"qemu":{"major":7,"minor":2,"micro":22}}}}"#), Ok(Message::Greeting((7, 2, 22)))));
        assert!(matches!(parse_message(br#"{"return":{},"id":3}"#), Ok(Message::Reply { id: 3, result: Ok(_) })));
        match parse_message(br#"{"error":{"class":"GenericError","desc":"no"},"id":4}"#) {
            Ok(Message::Reply { id: 4, result: Err((c, d)) }) => assert_eq!((c.as_str(), d.as_str()), ("GenericError", "no")),
            other => panic!("{other:?}"),
        }
        assert!(matches!(parse_message(br#"{"event":"DEVICE_DELETED","data":{"device":"x"}}"#), Ok(Message::Event(_))));
        for bad in [&b"[1,2]"[..], b"{", b"{\"return\":{}}", b"{\"id\":1}", b"{\"event\":5}", b"{\"QMP\":{}}", b"{\"error\":{\"class\":1},\"id\":1}", b"\xff\xfe"] {
            assert!(matches!(parse_message(bad), Err(QmpError::Garbled(_))), "{:?}", String::from_utf8_lossy(bad));
        }
    }
}
