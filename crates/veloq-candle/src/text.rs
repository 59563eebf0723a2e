//! Completion text as tokens arrive: decoded incrementally and cut at the first stop string.
//!
//! Decoding a window of recent tokens instead of the whole completion each time keeps the cost per
//! token constant; the window starts at the last token whose text was complete, so a character
//! split over several byte tokens comes out whole and a SentencePiece leading space is stripped
//! alike from both decodes it compares. Text that could still grow into a stop string is held
//! back until it cannot, so a stop string is never half sent.

use tokenizers::Tokenizer;

use crate::error::Result;
use crate::model::decode;

/// The text of one completion, token by token.
#[derive(Clone, Debug, Default)]
pub struct TextStream {
    ids: Vec<u32>,
    /// Decode window: tokens from `prefix` on; those before `read` were already turned into text.
    prefix: usize,
    read: usize,
    /// Text decoded so far (whole characters), cut at a stop string once one is seen.
    text: String,
    /// Bytes of `text` handed out.
    sent: usize,
    stops: Vec<String>,
    stopped: bool,
}

impl TextStream {
    /// A completion that ends at the first of `stops` (empty strings ignored).
    pub fn new(stops: Vec<String>) -> Self {
        Self { stops: stops.into_iter().filter(|s| !s.is_empty()).collect(), ..Self::default() }
    }

    /// Adds the next token; returns the text that can be sent now (possibly empty). After a stop
    /// string, [`stopped`](Self::stopped) is true and the text ends before it.
    pub fn push(&mut self, tok: &Tokenizer, id: u32) -> Result<String> {
        if self.stopped {
            return Ok(String::new());
        }
        self.ids.push(id);
        let before = decode(tok, &self.ids[self.prefix..self.read])?;
        let now = decode(tok, &self.ids[self.prefix..])?;
        // A trailing U+FFFD is a character whose bytes have not all arrived.
        if now.len() > before.len() && !now.ends_with('\u{FFFD}') && now.is_char_boundary(before.len()) {
            self.text.push_str(&now[before.len()..]);
            self.prefix = self.read;
            self.read = self.ids.len();
        }
        Ok(self.release())
    }

    /// Everything not sent yet, at the end of the completion.
    pub fn finish(&mut self) -> String {
        let rest = self.text[self.sent..].to_string();
        self.sent = self.text.len();
        rest
    }

    /// Whether a stop string ended the completion.
    pub fn stopped(&self) -> bool {
        self.stopped
    }

    /// The completion's text so far (without the stop string).
    pub fn text(&self) -> &str {
        &self.text
    }

    /// Cuts at a stop string if one is complete, else sends what cannot become one.
    fn release(&mut self) -> String {
        let longest = self.stops.iter().map(String::len).max().unwrap_or(0);
        // A stop string is new only if it ends in text not yet sent.
        let mut from = self.sent.saturating_sub(longest);
        while !self.text.is_char_boundary(from) {
            from -= 1;
        }
        let hit = self.stops.iter().filter_map(|s| self.text[from..].find(s.as_str()).map(|i| from + i)).min();
        let end = match hit {
            Some(at) => {
                self.text.truncate(at);
                self.stopped = true;
                at
            }
            None => self.text.len() - self.held_back(),
        };
        let out = self.text[self.sent..end.max(self.sent)].to_string();
        self.sent = self.sent.max(end);
        out
    }

    /// Bytes at the end of the text that are the start of some stop string.
    fn held_back(&self) -> usize {
        let t = &self.text;
        self.stops
            .iter()
            .flat_map(|s| (1..s.len()).rev().filter(|&n| s.is_char_boundary(n) && t.ends_with(&s[..n])).take(1))
            .max()
            .unwrap_or(0)
            .min(t.len() - self.sent)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Feeds text as if each piece were a token's text (the stop logic does not look at ids).
    fn run(stops: &[&str], pieces: &[&str]) -> (Vec<String>, String, bool) {
        let mut s = TextStream::new(stops.iter().map(|s| s.to_string()).collect());
        let mut sent = Vec::new();
        for p in pieces {
            if s.stopped() {
                sent.push(String::new());
                continue;
            }
            s.text.push_str(p);
            sent.push(s.release());
        }
        let rest = s.finish();
        sent.push(rest);
        let stopped = s.stopped();
        (sent, s.text().to_string(), stopped)
    }

    #[test]
    fn stop_strings_cut_and_hold_back() {
        // No stops: everything goes out as it comes.
        let (sent, text, stopped) = run(&[], &["Hel", "lo", " world"]);
        assert_eq!((sent.concat(), text.as_str(), stopped), ("Hello world".to_string(), "Hello world", false));
        assert_eq!(sent[0], "Hel");
        // A stop split over pieces: the partial match is held back, then cut.
        let (sent, text, stopped) = run(&["\nUser:"], &["Sure.", "\nUs", "er:", " more"]);
        assert_eq!(sent, vec!["Sure.", "", "", "", ""]);
        assert_eq!((text.as_str(), stopped), ("Sure.", true));
        // A held-back prefix that turns out not to be a stop is sent later.
        let (sent, text, stopped) = run(&["STOP"], &["a ST", "ART b"]);
        assert_eq!(sent, vec!["a ", "START b", ""]);
        assert_eq!((text.as_str(), stopped), ("a START b", false));
        // The earliest of several stops wins; text before it in the same piece is sent.
        let (sent, text, _) = run(&["cd", "b"], &["abcd"]);
        assert_eq!((sent.concat(), text.as_str()), ("a".to_string(), "a"));
        // Multi-byte characters around a partial match stay whole.
        let (sent, text, stopped) = run(&["é!"], &["café", "é", "!"]);
        assert_eq!((sent.concat(), text.as_str(), stopped), ("café".to_string(), "café", true));
        // At the end, what was held back goes out.
        let (sent, _, stopped) = run(&["###"], &["x #", "#"]);
        assert_eq!((sent.concat(), stopped), ("x ##".to_string(), false));
        assert_eq!(sent.last().unwrap(), "##");
    }
}
