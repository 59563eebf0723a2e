//! Sizes in bytes as people write them (`2GiB`, `512MiB`, `1.5GB`): one parser for the command
//! line, the server's options and the Python binding, and the form reports print them in.

use crate::error::{Error, Result};

/// `2GiB`, `512MiB`, `1.5GB`, `64k`, `1000` (bytes); units B, KB/k, MB, GB (powers of 1000) and
/// KiB, MiB, GiB (powers of 1024), case-insensitive.
pub fn parse_bytes(s: &str) -> Result<usize> {
    let t = s.trim();
    let split = t.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let bad = |why: String| Error::Config(why);
    let n: f64 = num.parse().map_err(|_| bad(format!("{s:?} is not a size (e.g. 2GiB, 512MiB, 1.5GB)")))?;
    let scale = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1.0,
        "k" | "kb" => 1e3,
        "m" | "mb" => 1e6,
        "g" | "gb" => 1e9,
        "kib" => 1024.0,
        "mib" => 1024.0 * 1024.0,
        "gib" => 1024.0 * 1024.0 * 1024.0,
        other => return Err(bad(format!("{s:?}: unknown unit {other:?} (B, KB, MB, GB, KiB, MiB, GiB)"))),
    };
    let bytes = n * scale;
    if !bytes.is_finite() || bytes < 1.0 || bytes > usize::MAX as f64 {
        return Err(bad(format!("{s:?} is not a usable size")));
    }
    Ok(bytes as usize)
}

/// `5.62 MiB`, `12.0 KiB`.
pub fn human_bytes(b: usize) -> String {
    if b >= 1 << 20 {
        format!("{:.2} MiB", b as f64 / (1 << 20) as f64)
    } else {
        format!("{:.1} KiB", b as f64 / 1024.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse_with_units() {
        assert_eq!(parse_bytes("2GiB").unwrap(), 2 << 30);
        assert_eq!(parse_bytes("512 MiB").unwrap(), 512 << 20);
        assert_eq!(parse_bytes("1.5GB").unwrap(), 1_500_000_000);
        assert_eq!(parse_bytes("4096").unwrap(), 4096);
        for bad in ["", "GiB", "2 parsecs", "-1GiB", "0"] {
            assert!(parse_bytes(bad).is_err(), "{bad}");
        }
        assert_eq!(human_bytes(3 << 20), "3.00 MiB");
        assert_eq!(human_bytes(1536), "1.5 KiB");
    }
}
