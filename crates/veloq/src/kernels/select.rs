//! The three-state kernel switch. `Auto` takes the fastest kernels available and falls back to
//! the portable path without a word; `Require` fails at construction when the fused kernels for
//! the device are missing (not compiled in, or no GPU); `Forbid` always takes the portable path.

use crate::error::{Error, Result};

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum KernelChoice {
    #[default]
    Auto,
    Require,
    Forbid,
}

impl KernelChoice {
    pub fn parse(s: &str) -> Result<Self> {
        match s {
            "auto" => Ok(Self::Auto),
            "require" => Ok(Self::Require),
            "forbid" => Ok(Self::Forbid),
            other => Err(Error::Config(format!("kernel choice {other:?}: expected auto, require or forbid"))),
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
        assert_eq!(KernelChoice::parse("require").unwrap(), KernelChoice::Require);
        assert!(KernelChoice::parse("sometimes").is_err());
    }
}
