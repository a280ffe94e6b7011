//! What a domain must prove to resume after a broker restart, and what the
//! broker recorded that a resume is checked against.
//!
//! A `Join { resume }` names a domain id and slot and re-reports services,
//! mappings, connections and watches. None of it is taken on the caller's
//! word: the caller proves it is the domain (the secret the broker issued at
//! its first join, from the same uid), and each mapping and connection it
//! claims must be one the broker itself recorded for that domain before the
//! restart. Claims beyond the domain's quotas refuse the whole resume at once,
//! before any of them is looked at.
//!
//! Everything here is pure (no I/O but [`new_secret`]), so the check is fuzzed
//! on its own (`fuzz/fuzz_targets/resume.rs`).

use std::collections::{BTreeMap, BTreeSet};

use fido_proto::{ConnId, DomainId, ErrorCode, RemoteError, Resume, ResumeSecret};
use sha2::{Digest, Sha256};

/// What the broker keeps about a joined domain, so that the domain, and only
/// it, can take up its identity after a restart. Kept in the registry's
/// private table, which no registry request reaches.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DomainRecord {
    /// Who joined (SO_PEERCRED at the first join).
    pub uid: u32,
    pub gid: u32,
    pub slot: u32,
    /// SHA-256 of the secret handed out in `Joined`.
    pub secret_hash: [u8; 32],
}

const RECORD_LEN: usize = 12 + 32;

impl DomainRecord {
    /// The record's stored form: uid, gid, slot (little-endian u32s), hash.
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(RECORD_LEN);
        out.extend_from_slice(&self.uid.to_le_bytes());
        out.extend_from_slice(&self.gid.to_le_bytes());
        out.extend_from_slice(&self.slot.to_le_bytes());
        out.extend_from_slice(&self.secret_hash);
        out
    }

    /// Reads a stored record; `None` for anything not exactly what
    /// [`encode`](Self::encode) writes.
    pub fn decode(bytes: &[u8]) -> Option<DomainRecord> {
        if bytes.len() != RECORD_LEN {
            return None;
        }
        let word = |i: usize| {
            let mut w = [0u8; 4];
            w.copy_from_slice(&bytes[4 * i..4 * i + 4]);
            u32::from_le_bytes(w)
        };
        let mut secret_hash = [0u8; 32];
        secret_hash.copy_from_slice(&bytes[12..]);
        Some(DomainRecord {
            uid: word(0),
            gid: word(1),
            slot: word(2),
            secret_hash,
        })
    }
}

/// A connection as the broker recorded it (its `/connection/<id>` keys).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RecordedConn {
    pub service: String,
    pub client: DomainId,
    pub server: DomainId,
}

/// What the broker recorded before the restart.
#[derive(Debug, Default, Clone)]
pub struct Recorded {
    /// Domains that may resume, with what proves them.
    pub domains: BTreeMap<DomainId, DomainRecord>,
    /// Connections established before the restart.
    pub conns: BTreeMap<ConnId, RecordedConn>,
    /// Arena mappings granted before the restart: (mapper, slot, owner).
    pub mappings: BTreeSet<(DomainId, u32, DomainId)>,
}

/// How much one resume may carry: the resuming domain's quotas.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    pub services: u64,
    pub connections: u64,
    pub watches: u64,
    /// Slots in the PGVAS window: nobody maps more arenas than that.
    pub mappings: u64,
}

/// The part of a resume that holds: items on record for the resuming domain.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Admitted {
    /// Service names to offer again (deduplicated; the policy still decides).
    pub services: Vec<String>,
    /// (slot, owner) the domain was granted before the restart.
    pub mapped: Vec<(u32, DomainId)>,
    /// Recorded connections the domain is an end of, with the peer and
    /// service it named; roles come from the record.
    pub connections: Vec<(ConnId, RecordedConn)>,
    /// Watches to set up again (through the same checks as a `Watch`).
    pub watches: Vec<(u64, String)>,
    /// Claimed connections not on record (or not the caller's): dropped.
    pub unrecorded_connections: Vec<(ConnId, DomainId)>,
    /// Claimed mappings not on record: dropped.
    pub unrecorded_mappings: Vec<(u32, DomainId)>,
}

/// A fresh resume secret from the kernel's random source.
pub fn new_secret() -> std::io::Result<ResumeSecret> {
    let mut bytes = [0u8; 32];
    let mut filled = 0;
    while filled < bytes.len() {
        match rustix::rand::getrandom(&mut bytes[filled..], rustix::rand::GetRandomFlags::empty()) {
            Ok(n) => filled += n,
            Err(rustix::io::Errno::INTR) => {}
            Err(e) => return Err(e.into()),
        }
    }
    Ok(ResumeSecret(bytes))
}

/// What the broker stores instead of the secret.
pub fn hash_secret(secret: &ResumeSecret) -> [u8; 32] {
    Sha256::digest(secret.0).into()
}

/// Equal, in time that does not depend on where the bytes differ.
fn same_hash(a: &[u8; 32], b: &[u8; 32]) -> bool {
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

fn denied(msg: String) -> RemoteError {
    RemoteError::new(ErrorCode::Denied, msg)
}

/// Checks `r`, sent by a process of `uid`, against what the broker recorded.
///
/// Refused (`Denied`) unless the domain is on record, for this uid, in this
/// slot, and the secret matches; refused (`Quota`) when it carries more than
/// `limits` allow. Otherwise returns the claims that are on record for this
/// domain; the others are listed as dropped. Work is O(n log n) in the size
/// of `r`, which `limits` bound.
pub fn check_resume(
    recorded: &Recorded,
    uid: u32,
    r: &Resume,
    limits: &Limits,
) -> Result<Admitted, RemoteError> {
    let id = r.domain;
    let Some(rec) = recorded.domains.get(&id) else {
        return Err(denied(format!(
            "no domain {id} on record to resume (it left, died, or did not come back in time); join without resume"
        )));
    };
    // The uid first, then the secret: a different user learns nothing about it.
    if rec.uid != uid {
        return Err(denied(format!(
            "domain {id} was joined by another user; uid {uid} may not resume it"
        )));
    }
    if !same_hash(&hash_secret(&r.secret), &rec.secret_hash) {
        return Err(denied(format!("wrong resume secret for domain {id}")));
    }
    if rec.slot != r.slot {
        return Err(denied(format!(
            "domain {id} held slot {}, not {}",
            rec.slot, r.slot
        )));
    }
    for (what, n, limit) in [
        ("services", r.services.len(), limits.services),
        ("connections", r.connections.len(), limits.connections),
        ("watches", r.watches.len(), limits.watches),
        ("mappings", r.mapped.len(), limits.mappings),
    ] {
        if n as u64 > limit {
            return Err(RemoteError::new(
                ErrorCode::Quota,
                format!("resume of domain {id} carries {n} {what}; its quota allows {limit}"),
            ));
        }
    }

    let mut out = Admitted {
        services: r
            .services
            .iter()
            .cloned()
            .collect::<BTreeSet<_>>()
            .into_iter()
            .collect(),
        watches: r.watches.clone(),
        ..Admitted::default()
    };
    let mut seen = BTreeSet::new();
    for &(slot, owner) in &r.mapped {
        if !seen.insert((slot, owner)) {
            continue;
        }
        if recorded.mappings.contains(&(id, slot, owner)) {
            out.mapped.push((slot, owner));
        } else {
            out.unrecorded_mappings.push((slot, owner));
        }
    }
    let mut seen = BTreeSet::new();
    for (conn, peer, service) in &r.connections {
        if !seen.insert(*conn) {
            continue;
        }
        match recorded.conns.get(conn) {
            Some(c)
                if c.service == *service
                    && ((c.client == id && c.server == *peer)
                        || (c.server == id && c.client == *peer)) =>
            {
                out.connections.push((*conn, c.clone()));
            }
            _ => out.unrecorded_connections.push((*conn, *peer)),
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn recorded(secret: &ResumeSecret) -> Recorded {
        let mut r = Recorded::default();
        r.domains.insert(
            1,
            DomainRecord {
                uid: 1000,
                gid: 1000,
                slot: 3,
                secret_hash: hash_secret(secret),
            },
        );
        r.conns.insert(
            10,
            RecordedConn {
                service: "svc".into(),
                client: 2,
                server: 1,
            },
        );
        r.conns.insert(
            11,
            RecordedConn {
                service: "svc".into(),
                client: 2,
                server: 4,
            },
        );
        r.mappings.insert((1, 5, 2));
        r
    }

    const LIMITS: Limits = Limits {
        services: 8,
        connections: 8,
        watches: 8,
        mappings: 8,
    };

    fn resume(secret: ResumeSecret) -> Resume {
        Resume {
            domain: 1,
            slot: 3,
            services: vec!["svc".into(), "svc".into()],
            mapped: vec![(5, 2), (6, 4)],
            connections: vec![(10, 2, "svc".into()), (11, 2, "svc".into())],
            watches: vec![],
            secret,
        }
    }

    #[test]
    fn only_recorded_claims_of_the_proven_domain_pass() {
        let secret = new_secret().unwrap();
        let rec = recorded(&secret);
        let ok = check_resume(&rec, 1000, &resume(secret), &LIMITS).unwrap();
        assert_eq!(ok.services, vec!["svc".to_string()]);
        assert_eq!(ok.mapped, vec![(5, 2)]);
        assert_eq!(ok.unrecorded_mappings, vec![(6, 4)]);
        assert_eq!(ok.connections.len(), 1);
        assert_eq!(ok.connections[0].0, 10);
        assert_eq!(ok.unrecorded_connections, vec![(11, 2)]);

        let code = |uid, r: &Resume| check_resume(&rec, uid, r, &LIMITS).unwrap_err().code;
        assert_eq!(code(1001, &resume(secret)), ErrorCode::Denied);
        let mut wrong = secret;
        wrong.0[31] ^= 1;
        assert_eq!(code(1000, &resume(wrong)), ErrorCode::Denied);
        let mut other_slot = resume(secret);
        other_slot.slot = 4;
        assert_eq!(code(1000, &other_slot), ErrorCode::Denied);
        let mut unknown = resume(secret);
        unknown.domain = 2;
        assert_eq!(code(1000, &unknown), ErrorCode::Denied);
        let mut huge = resume(secret);
        huge.connections = vec![(10, 2, "svc".into()); 9];
        assert_eq!(code(1000, &huge), ErrorCode::Quota);
    }

    #[test]
    fn records_round_trip_and_reject_junk() {
        let rec = DomainRecord {
            uid: 7,
            gid: 8,
            slot: 9,
            secret_hash: [3; 32],
        };
        assert_eq!(DomainRecord::decode(&rec.encode()), Some(rec));
        assert_eq!(DomainRecord::decode(&rec.encode()[1..]), None);
        assert_ne!(new_secret().unwrap(), new_secret().unwrap());
    }
}
