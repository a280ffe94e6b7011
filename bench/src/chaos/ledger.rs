//! The driver's books: per message (stream, seq) its deliveries, corrupt
//! deliveries, reports and resends and whether its release was confirmed,
//! filled from the roles' journal records ([`Ledger::record`]) and summed into
//! each message's fate ([`Ledger::totals`]; the categories are explained in
//! the module above).

use std::collections::HashMap;

use super::tl;
use super::wire::{split_tag, SEQ_BITS, SEQ_MASK};

#[derive(Clone, Copy, Default)]
pub(super) struct Cell {
    pub(super) delivered: u16,
    pub(super) corrupt: u16,
    pub(super) reported: u16,
    pub(super) resent: u16,
    pub(super) released: bool,
}

pub(super) struct StreamLedger {
    pub(super) announced: u64,
    pub(super) cells: Vec<Cell>,
    pub(super) killed: bool,
    pub(super) done: bool,
    pub(super) resends: bool,
}

#[derive(Default)]
pub(super) struct Ledger {
    pub(super) streams: HashMap<u64, StreamLedger>,
    pub(super) phantom: u64,
    pub(super) corrupted: u64,
    pub(super) protocol: u64,
    pub(super) inconsistent: u64,
    pub(super) problems: Vec<String>,
    pub(super) logged: u64,
}

impl Ledger {
    pub(super) fn problem(&mut self, s: String) {
        // A livelock can repeat one problem millions of times: keep the
        // timeline readable.
        self.logged += 1;
        if self.logged <= 5000 {
            tl(format_args!("PROBLEM {s}"));
        } else if self.logged == 5001 {
            tl("PROBLEM ... (further problems are counted, not logged)");
        }
        if self.problems.len() < 40 {
            eprintln!("chaos: {s}");
            self.problems.push(s);
        }
    }

    fn cell(&mut self, tag: u64) -> Option<&mut Cell> {
        let (stream, seq) = split_tag(tag);
        let st = self.streams.get_mut(&stream)?;
        if seq == 0 || seq > st.cells.len() as u64 + 10_000_000 {
            return None;
        }
        if seq as usize > st.cells.len() {
            st.cells.resize(seq as usize, Cell::default());
        }
        Some(&mut st.cells[seq as usize - 1])
    }

    fn each(&mut self, tag: u64, who: &str, f: impl FnOnce(&mut Cell)) {
        match self.cell(tag) {
            Some(c) => f(c),
            None => {
                self.phantom += 1;
                self.problem(format!(
                    "{who}: record for unknown message {tag:#x} (stream {}, seq {})",
                    tag >> SEQ_BITS,
                    tag & SEQ_MASK
                ));
            }
        }
    }

    /// Applies one journal record of `who` (anything but `ready` and `done`,
    /// which concern the process, not messages); returns how many verified
    /// deliveries it reports.
    pub(super) fn record(&mut self, who: &str, line: &str) -> u64 {
        let (kind, rest) = line.split_once(' ').unwrap_or((line, ""));
        let mut delivered = 0;
        match kind {
            "S" => {
                let mut it = parse_tags(rest);
                if let (Some(stream), Some(seq)) = (it.next(), it.next()) {
                    if let Some(l) = self.streams.get_mut(&stream) {
                        l.announced = l.announced.max(seq);
                    }
                }
            }
            "D" => {
                let mut n = 0;
                for t in parse_tags(rest) {
                    n += 1;
                    self.each(t, who, |c| c.delivered = c.delivered.saturating_add(1));
                }
                delivered = n;
            }
            "C" => {
                self.corrupted += 1;
                let tag = rest
                    .split_ascii_whitespace()
                    .next()
                    .and_then(|t| t.parse().ok())
                    .unwrap_or(0);
                if let Some(c) = self.cell(tag) {
                    c.corrupt = c.corrupt.saturating_add(1);
                }
                self.problem(format!("{who}: corrupted message: {rest}"));
            }
            "U" => {
                for t in parse_tags(rest) {
                    self.each(t, who, |c| c.reported = c.reported.saturating_add(1));
                }
            }
            "X" => {
                for t in parse_tags(rest) {
                    self.each(t, who, |c| c.resent = c.resent.saturating_add(1));
                }
            }
            "R" => {
                for tok in rest.split_ascii_whitespace() {
                    let (a, b) = match tok.split_once('-') {
                        Some((a, b)) => (a.parse().unwrap_or(0), b.parse().unwrap_or(0)),
                        None => {
                            let a = tok.parse().unwrap_or(0);
                            (a, a)
                        }
                    };
                    for t in a..=b.min(a + 1_000_000) {
                        self.each(t, who, |c| c.released = true);
                    }
                }
            }
            "P" => {
                self.protocol += 1;
                self.problem(format!(
                    "{who}: protocol error between honest peers: {rest}"
                ));
            }
            "A" => {
                self.inconsistent += 1;
                self.problem(format!("{who}: {rest}"));
            }
            _ => self.problem(format!("{who}: unexpected output: {line}")),
        }
        delivered
    }
}

fn parse_tags(rest: &str) -> impl Iterator<Item = u64> + '_ {
    rest.split_ascii_whitespace().filter_map(|t| t.parse().ok())
}

/// Every message's fate, summed.
#[derive(Default, Debug)]
pub(super) struct Totals {
    pub(super) messages: u64,
    pub(super) delivered: u64,
    pub(super) released: u64,
    pub(super) reported: u64,
    pub(super) resent: u64,
    pub(super) redelivered_reported: u64,
    pub(super) duplicated_silent: u64,
    pub(super) lost_released: u64,
    pub(super) lost_unaccounted: u64,
    pub(super) dropped_reported: u64,
    pub(super) unconfirmed_killed: u64,
    pub(super) undrained: u64,
    pub(super) corrupted: u64,
    pub(super) streams: u64,
}

impl Ledger {
    pub(super) fn totals(&mut self) -> Totals {
        let mut t = Totals {
            corrupted: self.corrupted + self.phantom,
            ..Default::default()
        };
        let mut probs = Vec::new();
        for (id, s) in &self.streams {
            t.streams += 1;
            let n = s.announced.max(s.cells.len() as u64);
            for seq in 1..=n {
                let c = s.cells.get(seq as usize - 1).copied().unwrap_or_default();
                if seq > s.announced {
                    if c.delivered > 0 || c.corrupt > 0 {
                        t.corrupted += (c.delivered + c.corrupt) as u64;
                        probs.push(format!(
                            "stream {id} seq {seq}: delivered but never announced (phantom)"
                        ));
                    }
                    continue;
                }
                t.messages += 1;
                t.delivered += c.delivered as u64;
                t.reported += c.reported as u64;
                t.resent += c.resent as u64;
                if c.delivered > 1 {
                    let extra = (c.delivered - 1) as u64;
                    let rep = extra.min(c.reported as u64);
                    t.redelivered_reported += rep;
                    if extra > rep {
                        t.duplicated_silent += extra - rep;
                        probs.push(format!("stream {id} seq {seq}: delivered {} times, reported undelivered {} times", c.delivered, c.reported));
                    }
                }
                if c.released {
                    t.released += 1;
                    if c.delivered == 0 && c.corrupt == 0 {
                        t.lost_released += 1;
                        probs.push(format!(
                            "stream {id} seq {seq}: confirmed released but never delivered"
                        ));
                    }
                } else if s.done {
                    if c.reported > 0 && !s.resends {
                        t.dropped_reported += 1;
                    } else {
                        t.lost_unaccounted += 1;
                        probs.push(format!(
                            "stream {id} seq {seq}: sender drained, yet neither released nor reported ({} deliveries, {} reports)",
                            c.delivered, c.reported
                        ));
                    }
                } else if s.killed {
                    t.unconfirmed_killed += 1;
                } else {
                    t.undrained += 1;
                }
            }
        }
        for p in probs {
            self.problem(p);
        }
        t
    }
}
