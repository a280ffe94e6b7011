//! The engine's settings: capacity, sharing mode, lanes, chunk size.

/// How much the engine may move per second, shared among domains by weight.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Capacity {
    /// No cap; weights decide who goes first when the lanes are busy.
    Unlimited,
    /// Measured when the first transfer arrives (150 ms of file → socket
    /// splice through one lane); unlimited until then.
    Auto,
    /// A fixed figure in bytes per second.
    BytesPerSec(u64),
}

impl std::str::FromStr for Capacity {
    type Err = String;
    fn from_str(s: &str) -> Result<Capacity, String> {
        match s.trim() {
            "auto" => Ok(Capacity::Auto),
            "unlimited" => Ok(Capacity::Unlimited),
            other => {
                let t = other.trim_end_matches("/s");
                parse_size(t)
                    .filter(|n| *n > 0)
                    .map(Capacity::BytesPerSec)
                    .ok_or_else(|| {
                        format!("pipe capacity {s:?}: give auto, unlimited, or bytes per second such as 100M or 1GiB/s")
                    })
            }
        }
    }
}

/// Pipe engine settings.
#[derive(Debug, Clone)]
pub struct PipeConfig {
    pub capacity: Capacity,
    /// May a domain out of credits run when nobody with credits waits?
    pub work_conserving: bool,
    /// Chunks moved at once.
    pub lanes: u32,
    /// Bytes per chunk (the size asked of each engine pipe).
    pub chunk: u32,
    /// Run the engine at all (`false`: pipe requests are refused with `Unavailable`).
    pub enabled: bool,
}

impl Default for PipeConfig {
    fn default() -> Self {
        PipeConfig {
            capacity: Capacity::Auto,
            work_conserving: true,
            lanes: 4,
            chunk: 1 << 20,
            enabled: true,
        }
    }
}

/// `"4096"`, `"64K"`, `"64KiB"`, `"16M"`, `"1G"`, `"1 GiB"` (binary units).
pub fn parse_size(s: &str) -> Option<u64> {
    let s = s.trim();
    let split = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
    let (num, unit) = s.split_at(split);
    let n: u64 = num.parse().ok()?;
    let shift = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 0,
        "k" | "kb" | "kib" => 10,
        "m" | "mb" | "mib" => 20,
        "g" | "gb" | "gib" => 30,
        "t" | "tb" | "tib" => 40,
        _ => return None,
    };
    n.checked_mul(1u64 << shift)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn capacities_parse() {
        assert_eq!("auto".parse(), Ok(Capacity::Auto));
        assert_eq!(" unlimited ".parse(), Ok(Capacity::Unlimited));
        assert_eq!("100M".parse(), Ok(Capacity::BytesPerSec(100 << 20)));
        assert_eq!("1GiB/s".parse(), Ok(Capacity::BytesPerSec(1 << 30)));
        assert!("0".parse::<Capacity>().is_err());
        assert!("fast".parse::<Capacity>().is_err());
    }
}
