//! A multi-turn conversation whose history lives in the caches: each turn renders the whole
//! conversation in the model's own chat template (the file's Jinja, else its family's) and feeds
//! only what the caches do not already hold — the new turn, where the template renders earlier
//! turns as they were fed — never the whole conversation again.

use tokenizers::Tokenizer;

use crate::cache::ModelCache;
use crate::error::{Error, Result};
use crate::generate::{chat_ids, generate_ids, Event, GenerateOptions, GenerateOutput};
use crate::model::Role;
use crate::runner::Forward;

/// A conversation with a model, in slot 0 of its caches.
pub struct Chat<'m> {
    model: &'m dyn Forward,
    tok: &'m Tokenizer,
    c: Conversation,
}

/// A conversation's state apart from the model it runs on: what [`Chat::into_conversation`]
/// returns and [`Chat::resume`] continues, for callers that cannot hold the model's borrow
/// between turns (the Python binding).
pub struct Conversation {
    caches: ModelCache,
    messages: Vec<(Role, String)>,
    /// Every token of the conversation: what was fed for the last turn and the reply generated.
    /// The caches hold its first `caches.len(0)` (the reply's last token is not fed).
    history: Vec<u32>,
}

impl<'m> Chat<'m> {
    /// A new conversation in the model's chat template (raw text when it has none).
    pub fn new(model: &'m dyn Forward, tok: &'m Tokenizer, caches: ModelCache) -> Self {
        Self { model, tok, c: Conversation { caches, messages: Vec::new(), history: Vec::new() } }
    }

    /// Continues a conversation on the model it was started with.
    pub fn resume(model: &'m dyn Forward, tok: &'m Tokenizer, c: Conversation) -> Self {
        Self { model, tok, c }
    }

    /// The conversation, to [`resume`](Self::resume) later.
    pub fn into_conversation(self) -> Conversation {
        self.c
    }

    /// Adds the user's turn and generates the model's reply. A turn that fails (over the
    /// context, bad settings) leaves the conversation as it was.
    pub fn say(
        &mut self,
        user: &str,
        opts: &GenerateOptions,
        on_event: &mut dyn FnMut(Event<'_>),
    ) -> Result<GenerateOutput> {
        let mut messages: Vec<(Role, &str)> = self.c.messages.iter().map(|(r, t)| (*r, t.as_str())).collect();
        messages.push((Role::User, user));
        let ids = chat_ids(self.model.model(), self.tok, &messages)?;
        let need = ids.len() + 1;
        let max = self.model.model().max_context();
        if need > max {
            return Err(Error::ContextOverflow { requested: need, max });
        }
        // What the caches hold and the new rendering share stays; the rest is fed.
        let held = &self.c.history[..self.c.caches.len(0)];
        let keep = held.iter().zip(&ids).take_while(|(a, b)| a == b).count();
        if keep < held.len() {
            self.c.caches.truncate(0, keep)?;
        }
        let out =
            generate_ids(self.model, self.tok, &mut self.c.caches, &ids[keep..], opts, on_event).inspect_err(|_| {
                let _ = self.c.caches.truncate(0, keep);
            })?;
        // The reply's last token is not fed (nothing attends to it yet): the next turn's
        // rendering decides what follows it.
        self.c.history = ids;
        self.c.history.extend(&out.tokens);
        self.c.messages.push((Role::User, user.to_string()));
        self.c.messages.push((Role::Assistant, out.text.clone()));
        Ok(out)
    }

    /// Forgets the conversation (frees the caches' positions).
    pub fn reset(&mut self) -> Result<()> {
        self.c.caches.truncate(0, 0)?;
        self.c.messages.clear();
        self.c.history.clear();
        Ok(())
    }

    /// Every token of the conversation so far, in order: the last turn as fed and the reply
    /// generated after it.
    pub fn history(&self) -> &[u32] {
        &self.c.history
    }

    /// The conversation's messages so far.
    pub fn messages(&self) -> &[(Role, String)] {
        &self.c.messages
    }

    /// The caches holding the conversation.
    pub fn caches(&self) -> &ModelCache {
        &self.c.caches
    }
}
