//! The three-state kernel switch. `Auto` takes the fastest kernels available and falls back to
//! the portable path without a word; `Require` fails at construction when the fused kernels for
//! the device are missing (not compiled in, or no GPU); `Forbid` always takes the portable path.

use crate::error::{Error, Result};

/// Whether a cache uses the fused kernels of its device: the same three words on the command
/// line, in the server's options and in the Python binding (`auto`, `require`, `forbid`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[cfg_attr(feature = "clap", derive(clap::ValueEnum))]
pub enum KernelChoice {
    /// The fused kernels where they serve the device, the portable path elsewhere.
    #[default]
    Auto,
    /// The fused kernels, or an error when building the cache.
    Require,
    /// Always the portable path (candle ops).
    Forbid,
}

impl KernelChoice {
    /// Every choice, in the order the help lists them.
    pub const ALL: [Self; 3] = [Self::Auto, Self::Require, Self::Forbid];

    /// The word for this choice.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Auto => "auto",
            Self::Require => "require",
            Self::Forbid => "forbid",
        }
    }

    /// Whether to use a fused kernel, given whether one is available (and why not, if not).
    pub fn resolve(self, available: std::result::Result<(), String>) -> Result<bool> {
        match (self, available) {
            (Self::Forbid, _) => Ok(false),
            (_, Ok(())) => Ok(true),
            (Self::Auto, Err(_)) => Ok(false),
            (Self::Require, Err(why)) => Err(Error::Device(format!("fused kernels required but unavailable: {why}"))),
        }
    }
}

impl std::str::FromStr for KernelChoice {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self> {
        Self::ALL
            .into_iter()
            .find(|k| k.as_str() == s)
            .ok_or_else(|| Error::Config(format!("kernel choice {s:?}: expected auto, require or forbid")))
    }
}

impl std::fmt::Display for KernelChoice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn three_states() {
        let none = || Err("no GPU".to_string());
        assert!(KernelChoice::Auto.resolve(Ok(())).unwrap());
        assert!(!KernelChoice::Auto.resolve(none()).unwrap());
        assert!(KernelChoice::Require.resolve(Ok(())).unwrap());
        let e = KernelChoice::Require.resolve(none()).unwrap_err().to_string();
        assert!(e.contains("no GPU"), "{e}");
        assert!(!KernelChoice::Forbid.resolve(Ok(())).unwrap());
        assert_eq!("require".parse::<KernelChoice>().unwrap(), KernelChoice::Require);
        assert!("sometimes".parse::<KernelChoice>().is_err());
        assert!(KernelChoice::ALL.iter().all(|k| k.to_string().parse::<KernelChoice>().unwrap() == *k));
    }
}
