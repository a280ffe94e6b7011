//! What `Status` reports (domains, services, connections, the pipe
//! engine), page by page and only what the asker may see, and the counters
//! domains report for it.
//!
//! A page holds at most [`STATUS_PAGE_BYTES`] of entries, so however much
//! other users create, a status reply always fits a control message; the
//! client follows `next` until it is `None`.

use std::ops::Bound;

use fido_proto::{ConnStatus, Counters, DomainId, DomainStatus, Reply, Status, StatusCursor};
use serde::Serialize;

use super::authorization::Viewer;
use super::{Handled, Server};

/// Encoded bytes of entries one status page carries at most (a fraction of
/// `MAX_REPLY`: the page is answered as one datagram).
pub(super) const STATUS_PAGE_BYTES: usize = 64 * 1024;

/// Fills one page: entries go in while they fit; the first entry always does.
struct Page {
    left: usize,
    taken: usize,
}

impl Page {
    fn fits(&mut self, entry: &impl Serialize) -> bool {
        let len = fido_proto::encode(entry).map_or(usize::MAX, |b| b.len());
        if self.taken > 0 && len > self.left {
            return false;
        }
        self.left = self.left.saturating_sub(len);
        self.taken += 1;
        true
    }
}

fn after<K: Ord>(k: Option<K>) -> (Bound<K>, Bound<K>) {
    (
        k.map_or(Bound::Unbounded, Bound::Excluded),
        Bound::Unbounded,
    )
}

impl Server {
    /// The page of `Status` from `cursor` on, as `viewer` may see it: an
    /// administrator everything; anyone else its own uid's domains and
    /// pipes, the services its rule lets it offer or connect to, and the
    /// connections one of its uid's domains is an end of.
    pub(super) fn status_page(&self, viewer: &Viewer, cursor: StatusCursor) -> Status {
        let (pipe_engine, mut pipes) = self.pipe_status();
        pipes.sort_by_key(|p| p.domain);
        let mut st = Status {
            pipe_engine,
            pipes: Vec::new(),
            broker_pid: rustix::process::getpid().as_raw_nonzero().get(),
            domains: Vec::new(),
            services: Vec::new(),
            connections: Vec::new(),
            next: None,
        };
        let mut page = Page {
            left: STATUS_PAGE_BYTES,
            taken: 0,
        };
        let mut section = cursor;
        loop {
            section = match section {
                StatusCursor::Domains { after: from } => {
                    let mut last = from;
                    for (id, d) in self.domains.range(after(from)) {
                        if !self.sees_domain(viewer, *id) {
                            continue;
                        }
                        let entry = DomainStatus {
                            domain: *id,
                            name: d.name.clone(),
                            slot: d.slot,
                            pid: d.pid,
                            uid: d.uid,
                            arena_len: d.arena_len,
                            counters: d.counters,
                            label: d.label.clone(),
                        };
                        if !page.fits(&entry) {
                            st.next = Some(StatusCursor::Domains { after: last });
                            return st;
                        }
                        last = Some(*id);
                        st.domains.push(entry);
                    }
                    StatusCursor::Services { after: None }
                }
                StatusCursor::Services { after: from } => {
                    let mut last = from.clone();
                    for (s, d) in self.services.range::<String, _>(after(from.as_ref())) {
                        if !self.sees_service(viewer, s) {
                            continue;
                        }
                        let entry = (s.clone(), *d);
                        if !page.fits(&entry) {
                            st.next = Some(StatusCursor::Services { after: last });
                            return st;
                        }
                        last = Some(s.clone());
                        st.services.push(entry);
                    }
                    StatusCursor::Connections { after: None }
                }
                StatusCursor::Connections { after: from } => {
                    let mut last = from;
                    for (c, x) in self.conns.range(after(from)) {
                        if !self.sees_connection(viewer, x.client, x.server) {
                            continue;
                        }
                        let entry = ConnStatus {
                            conn: *c,
                            service: x.service.clone(),
                            client: x.client,
                            server: x.server,
                        };
                        if !page.fits(&entry) {
                            st.next = Some(StatusCursor::Connections { after: last });
                            return st;
                        }
                        last = Some(*c);
                        st.connections.push(entry);
                    }
                    StatusCursor::Pipes { after: None }
                }
                StatusCursor::Pipes { after: from } => {
                    let mut last = from;
                    let visible = pipes.into_iter().filter(|p| {
                        from.is_none_or(|f| p.domain > f) && self.sees_domain(viewer, p.domain)
                    });
                    for entry in visible {
                        if !page.fits(&entry) {
                            st.next = Some(StatusCursor::Pipes { after: last });
                            return st;
                        }
                        last = Some(entry.domain);
                        st.pipes.push(entry);
                    }
                    return st;
                }
            };
        }
    }

    /// Handles `Status` (the first page) and `StatusPage`, joined or not.
    pub(super) fn status_request(&self, viewer: &Viewer, cursor: StatusCursor) -> Handled {
        Ok(Some((
            Reply::Status(self.status_page(viewer, cursor)),
            Vec::new(),
        )))
    }

    /// Handles `Counters`: a domain's own figures, kept for `Status`.
    pub(super) fn set_counters(&mut self, dom: DomainId, counters: Counters) -> Handled {
        if let Some(d) = self.domains.get_mut(&dom) {
            d.counters = counters;
        }
        Ok(Some((Reply::Ok, Vec::new())))
    }
}
