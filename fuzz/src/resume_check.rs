//! The broker's resume check (`fido_broker::resume::check_resume`) on any
//! resume a caller could send, against a fixed recorded world.
//!
//! The world: four domains on record (ids 1..=4; 1 and 2 joined by uid 1000,
//! 3 and 4 by uid 2000; domain `d` in slot `d - 1` with secret `[d; 32]`),
//! six connections among them and a few granted mappings. The input picks
//! the caller's uid and builds a `Resume`: the id and slot it names, its
//! secret (the right one, another domain's, one bit off, or raw bytes) and
//! any number of services, mappings, connections and watches (claims drawn
//! mostly from the ids, slots and services the world uses, so that many are
//! on record).
//!
//! The property: never a panic; accepted exactly when the domain is on record
//! for this uid in this slot with this secret and every list is within its
//! limit (else `Denied` for a failed proof, `Quota` only after a proof
//! succeeded); and what is accepted is on record for that domain: each
//! mapping is one it was granted, each connection one it is an end of, with
//! the peer and service it named. Admitted and dropped claims partition the
//! (deduplicated) claims.
//!
//! Used by the `resume` fuzz target and, on stable, by
//! crates/fido-broker/tests/resume_corpus.rs (which includes this file with
//! `#[path]`): only fido_broker's and fido_proto's public API.

use std::collections::BTreeSet;

use fido_broker::resume::{
    check_resume, hash_secret, DomainRecord, Limits, Recorded, RecordedConn,
};
use fido_proto::{ErrorCode, Resume, ResumeSecret};

pub const LIMITS: Limits = Limits {
    services: 6,
    connections: 5,
    watches: 4,
    mappings: 8,
};

const SERVICES: [&str; 3] = ["s0", "s1", "s2"];

fn secret_of(domain: u64) -> ResumeSecret {
    ResumeSecret([domain as u8; 32])
}

/// The recorded world every input is checked against.
pub fn world() -> Recorded {
    let mut w = Recorded::default();
    for d in 1..=4u64 {
        let uid = if d <= 2 { 1000 } else { 2000 };
        w.domains.insert(
            d,
            DomainRecord {
                uid,
                gid: uid,
                slot: d as u32 - 1,
                secret_hash: hash_secret(&secret_of(d)),
            },
        );
    }
    // (conn, client, server, service)
    for (conn, client, server, service) in [
        (10, 1, 2, 0),
        (11, 2, 1, 1),
        (12, 1, 3, 0),
        (13, 3, 4, 2),
        (14, 4, 1, 1),
        (15, 2, 4, 0),
    ] {
        w.conns.insert(
            conn,
            RecordedConn {
                service: SERVICES[service].to_string(),
                client,
                server,
            },
        );
    }
    for (mapper, slot, owner) in [
        (1, 1, 2),
        (2, 0, 1),
        (1, 2, 3),
        (3, 3, 4),
        (4, 0, 1),
        (5, 0, 1),
    ] {
        w.mappings.insert((mapper, slot, owner));
    }
    w
}

/// Reads bytes off the input; zeros once it runs out.
struct Bytes<'a>(&'a [u8]);

impl Bytes<'_> {
    fn byte(&mut self) -> u8 {
        match self.0.split_first() {
            Some((b, rest)) => {
                self.0 = rest;
                *b
            }
            None => 0,
        }
    }
    /// A small id, mostly among the world's (0..=6).
    fn id(&mut self) -> u64 {
        let b = self.byte();
        if b < 0xf0 {
            u64::from(b % 7)
        } else {
            u64::from(b) << 24
        }
    }
    /// How many items of a list: mostly a few, sometimes many.
    fn count(&mut self) -> usize {
        let b = self.byte();
        match b {
            0..=0xdf => usize::from(b % 8),
            _ => usize::from(b - 0xdf) * 256,
        }
    }
}

/// Builds (uid, resume) from the input.
pub fn resume_from(data: &[u8]) -> (u32, Resume) {
    let mut b = Bytes(data);
    let uid = match b.byte() % 4 {
        0 => 1000,
        1 => 2000,
        2 => 0,
        _ => u32::from_le_bytes([b.byte(), b.byte(), b.byte(), b.byte()]),
    };
    let domain = b.id();
    let slot = u32::from(b.byte() % 6);
    let secret = match b.byte() % 4 {
        0 => secret_of(domain),
        1 => secret_of(b.id()),
        2 => {
            let mut s = secret_of(domain);
            let bit = b.byte();
            s.0[usize::from(bit / 8) % 32] ^= 1 << (bit % 8);
            s
        }
        _ => ResumeSecret(std::array::from_fn(|_| b.byte())),
    };
    let n = b.count();
    let services = (0..n)
        .map(|_| SERVICES[usize::from(b.byte() % 3)].to_string())
        .collect();
    let n = b.count();
    let mapped = (0..n).map(|_| (u32::from(b.byte() % 6), b.id())).collect();
    let n = b.count();
    let connections = (0..n)
        .map(|_| {
            let conn = 8 + u64::from(b.byte() % 10);
            (
                conn,
                b.id(),
                SERVICES[usize::from(b.byte() % 3)].to_string(),
            )
        })
        .collect();
    let n = b.count();
    let watches = (0..n)
        .map(|_| (u64::from(b.byte()), "/app".to_string()))
        .collect();
    let resume = Resume {
        domain,
        slot,
        services,
        mapped,
        connections,
        watches,
        secret,
    };
    (uid, resume)
}

/// The property, on one input.
pub fn check(data: &[u8]) {
    let world = world();
    let (uid, r) = resume_from(data);
    let result = check_resume(&world, uid, &r, &LIMITS);

    let proven = world.domains.get(&r.domain).is_some_and(|rec| {
        rec.uid == uid && rec.slot == r.slot && hash_secret(&r.secret) == rec.secret_hash
    });
    let within = r.services.len() as u64 <= LIMITS.services
        && r.connections.len() as u64 <= LIMITS.connections
        && r.watches.len() as u64 <= LIMITS.watches
        && r.mapped.len() as u64 <= LIMITS.mappings;
    let a = match result {
        Err(e) => {
            assert!(
                !(proven && within),
                "a proven resume within limits was refused: {e}"
            );
            let want = if proven {
                ErrorCode::Quota
            } else {
                ErrorCode::Denied
            };
            assert_eq!(e.code, want, "{e}");
            return;
        }
        Ok(a) => a,
    };
    assert!(proven, "accepted without proof: {r:?}");
    assert!(within, "accepted over the limits");

    // Mappings: admitted ones are on record for this domain, dropped ones
    // are not, and together they are the claims.
    let claims: BTreeSet<(u32, u64)> = r.mapped.iter().copied().collect();
    let admitted: BTreeSet<(u32, u64)> = a.mapped.iter().copied().collect();
    let dropped: BTreeSet<(u32, u64)> = a.unrecorded_mappings.iter().copied().collect();
    assert_eq!(admitted.len(), a.mapped.len(), "a mapping admitted twice");
    for (slot, owner) in &admitted {
        assert!(world.mappings.contains(&(r.domain, *slot, *owner)));
    }
    for (slot, owner) in &dropped {
        assert!(!world.mappings.contains(&(r.domain, *slot, *owner)));
    }
    assert_eq!(
        admitted.union(&dropped).copied().collect::<BTreeSet<_>>(),
        claims
    );

    // Connections: each admitted one is recorded with this domain as an end,
    // the other end the peer it named, the same service; and comes with the
    // record's roles.
    let mut seen = BTreeSet::new();
    for (conn, rec) in &a.connections {
        assert!(seen.insert(*conn), "connection {conn} admitted twice");
        assert_eq!(world.conns.get(conn), Some(rec));
        assert!(rec.client == r.domain || rec.server == r.domain);
        let peer = if rec.client == r.domain {
            rec.server
        } else {
            rec.client
        };
        assert!(
            r.connections
                .iter()
                .any(|(c, p, s)| c == conn && *p == peer && *s == rec.service),
            "connection {conn} admitted without being claimed as it is recorded"
        );
    }
    for (conn, _) in &a.unrecorded_connections {
        assert!(
            seen.insert(*conn),
            "connection {conn} both admitted and dropped"
        );
    }
    let claimed: BTreeSet<u64> = r.connections.iter().map(|(c, _, _)| *c).collect();
    assert_eq!(seen, claimed);

    let services: BTreeSet<&String> = r.services.iter().collect();
    assert_eq!(a.services.iter().collect::<BTreeSet<_>>(), services);
    assert_eq!(a.services.len(), services.len());
    assert_eq!(a.watches, r.watches);
}
