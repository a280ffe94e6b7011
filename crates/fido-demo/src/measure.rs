//! Clocks and percentiles shared by the pipeline's roles and their parent.

/// CLOCK_MONOTONIC in ns (one clock for every process on the machine, so a
/// stamp written by one process can be subtracted from a reading in another).
pub fn mono_ns() -> u64 {
    let t = rustix::time::clock_gettime(rustix::time::ClockId::Monotonic);
    t.tv_sec as u64 * 1_000_000_000 + t.tv_nsec as u64
}

/// (p50, p99) by nearest rank (reorders the slice); (0, 0) when empty.
pub fn percentiles(samples: &mut [u64]) -> (u64, u64) {
    (quantile(samples, 0.50), quantile(samples, 0.99))
}

/// Exact nearest-rank quantile `q` in [0, 1] (reorders the slice).
pub fn quantile(samples: &mut [u64], q: f64) -> u64 {
    if samples.is_empty() {
        return 0;
    }
    let rank = ((q * samples.len() as f64).ceil() as usize).clamp(1, samples.len()) - 1;
    *samples.select_nth_unstable(rank).1
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nearest_rank() {
        let mut v: Vec<u64> = (1..=100).rev().collect();
        assert_eq!(percentiles(&mut v), (50, 99));
        assert_eq!(quantile(&mut v, 0.0), 1);
        assert_eq!(quantile(&mut v, 1.0), 100);
        assert_eq!(percentiles(&mut []), (0, 0));
    }
}
