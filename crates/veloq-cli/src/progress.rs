//! The command line's progress bar.

use indicatif::{ProgressBar, ProgressStyle};

/// Message, bar, count, elapsed time and estimate.
pub fn bar(len: u64, msg: &str) -> ProgressBar {
    let b = ProgressBar::new(len);
    b.set_style(
        ProgressStyle::with_template("{msg:>14} [{bar:40}] {pos}/{len} {elapsed} (eta {eta})")
            .expect("a valid template")
            .progress_chars("=> "),
    );
    b.set_message(msg.to_string());
    b
}
