//! `veloq chat`: an interactive conversation whose history stays in the caches; each turn feeds
//! only its own tokens. Reads lines from standard input, so it can be scripted by a pipe.

use std::io::{BufRead, Write};

use anyhow::Result;
use clap::Args as ClapArgs;

use veloq_candle::chat::Chat;

use crate::args::Run;
use crate::generate::{kv_report, Printer, Sampling};

/// `veloq chat`'s flags.
#[derive(ClapArgs)]
pub struct Args {
    #[command(flatten)]
    /// Model and caches.
    pub run: Run,
    #[command(flatten)]
    /// Sampling.
    pub sampling: Sampling,
}

const HELP: &str = "commands: /reset (forget the conversation), /stats (KV memory, speed), /quit";

/// Runs the conversation.
pub fn run(a: Args) -> Result<()> {
    let opts = a.sampling.options(true)?;
    let l = a.run.load()?;
    let caches = l.cache.build(l.model())?;
    let mut chat = Chat::new(&l.runner, &l.tokenizer, caches);
    let mut last: Option<veloq_candle::generate::GenerateOutput> = None;
    eprintln!("[{}] {HELP}", l.cache.name());
    let stdin = std::io::stdin();
    loop {
        eprint!("> ");
        std::io::stderr().flush()?;
        let mut line = String::new();
        if stdin.lock().read_line(&mut line)? == 0 {
            break;
        }
        let line = line.trim_end_matches(['\n', '\r']);
        match line.trim() {
            "" => continue,
            "/quit" | "/exit" => break,
            "/help" => eprintln!("{HELP}"),
            "/reset" => {
                chat.reset()?;
                last = None;
                eprintln!("(conversation cleared)");
            }
            "/stats" => {
                let positions = chat.caches().len(0);
                let mut s = format!("{positions} positions | {}", kv_report(&l, chat.caches()));
                if let Some(o) = &last {
                    s += &format!(
                        " | last turn: {} prompt tok at {:.1} tok/s, {} generated at {:.1} tok/s",
                        o.prompt_tokens,
                        o.prefill_tok_s(),
                        o.tokens.len(),
                        o.decode_tok_s()
                    );
                }
                eprintln!("{s}");
            }
            cmd if cmd.starts_with('/') => eprintln!("unknown command {cmd:?}; {HELP}"),
            _ => {
                let mut printer = Printer::new(opts.prefill_chunk);
                match chat.say(line, &opts, &mut |e| printer.event(e)) {
                    Ok(out) => {
                        println!();
                        last = Some(out);
                    }
                    // A refused turn (context full, …) leaves the conversation as it was.
                    Err(e) => eprintln!("error: {e}"),
                }
            }
        }
    }
    Ok(())
}
