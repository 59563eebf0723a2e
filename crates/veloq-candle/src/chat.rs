//! A multi-turn conversation whose history lives in the caches: each turn feeds only its own new
//! tokens (a follow-up turn appended after positions are already codes), never the whole
//! conversation again.

use tokenizers::Tokenizer;

use crate::cache::ModelCache;
use crate::error::{Error, Result};
use crate::generate::{generate_ids, prompt_ids, Event, Finish, GenerateOptions, GenerateOutput};
use crate::model::{encode, ChatTemplate};
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
    template: ChatTemplate,
    /// Tokens of the conversation not yet in the caches: the reply's last token (generation does
    /// not feed it) and whatever closes the reply.
    unfed: Vec<u32>,
    /// Every token of the conversation, fed or not (what a single feed would see).
    history: Vec<u32>,
}

impl<'m> Chat<'m> {
    /// A new conversation in the model's chat template (raw text when it has none).
    pub fn new(model: &'m dyn Forward, tok: &'m Tokenizer, caches: ModelCache) -> Self {
        let template = model.model().info.arch.chat_template(tok);
        Self { model, tok, c: Conversation { caches, template, unfed: Vec::new(), history: Vec::new() } }
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
        let fed = self.c.caches.len(0);
        let mut ids = self.c.unfed.clone();
        if self.c.history.is_empty() {
            ids.extend(prompt_ids(self.model.model(), self.tok, user, true)?);
        } else {
            ids.extend(encode(self.tok, &self.c.template.turn(user))?);
        }
        let need = fed + ids.len() + 1;
        let max = self.model.model().max_context();
        if need > max {
            return Err(Error::ContextOverflow { requested: need, max });
        }
        let out = generate_ids(self.model, self.tok, &mut self.c.caches, &ids, opts, on_event).inspect_err(|_| {
            let _ = self.c.caches.truncate(0, fed);
        })?;
        // The carried tokens (the last reply's end) are in the history already.
        self.c.history.extend(&ids[self.c.unfed.len()..]);
        self.c.history.extend(&out.tokens);
        let last = *out.tokens.last().expect("generation yields at least one token");
        self.c.unfed = vec![last];
        self.c.unfed.extend(encode(self.tok, self.c.template.close_reply(out.finish == Finish::Stop))?);
        self.c.history.extend(&self.c.unfed[1..]);
        Ok(out)
    }

    /// Forgets the conversation (frees the caches' positions).
    pub fn reset(&mut self) -> Result<()> {
        self.c.caches.truncate(0, 0)?;
        self.c.unfed.clear();
        self.c.history.clear();
        Ok(())
    }

    /// Every token of the conversation so far, in order, including those not yet fed.
    pub fn history(&self) -> &[u32] {
        &self.c.history
    }

    /// The caches holding the conversation.
    pub fn caches(&self) -> &ModelCache {
        &self.c.caches
    }
}
