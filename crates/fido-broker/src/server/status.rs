//! What `Status` reports (domains, services, connections, the pipe
//! engine), and the counters domains report for it.

use fido_proto::{ConnStatus, Counters, DomainId, DomainStatus, Reply, Status};

use super::{Handled, Server};

impl Server {
    pub(super) fn status(&self) -> Status {
        let (pipe_engine, pipes) = self.pipe_status();
        Status {
            pipe_engine,
            pipes,
            broker_pid: rustix::process::getpid().as_raw_nonzero().get(),
            domains: self
                .domains
                .iter()
                .map(|(id, d)| DomainStatus {
                    domain: *id,
                    name: d.name.clone(),
                    slot: d.slot,
                    pid: d.pid,
                    uid: d.uid,
                    arena_len: d.arena_len,
                    counters: d.counters,
                })
                .collect(),
            services: self.services.iter().map(|(s, d)| (s.clone(), *d)).collect(),
            connections: self
                .conns
                .iter()
                .map(|(c, x)| ConnStatus {
                    conn: *c,
                    service: x.service.clone(),
                    client: x.client,
                    server: x.server,
                })
                .collect(),
        }
    }

    /// Handles `Counters`: a domain's own figures, kept for `Status`.
    pub(super) fn set_counters(&mut self, dom: DomainId, counters: Counters) -> Handled {
        if let Some(d) = self.domains.get_mut(&dom) {
            d.counters = counters;
        }
        Ok(Some((Reply::Ok, Vec::new())))
    }
}
