//! `loraplex generate`: one prompt through the engine, streamed or as one JSON object.

use std::io::Write;
use std::sync::Arc;

use anyhow::Context;
use loraplex_kernels::cpu::CpuBackend;
use serde::Serialize;

use crate::config::{GenerateArgs, PromptArgs};
use crate::engine::{Engine, TokenLogprobs};
use crate::model;
use crate::request::{GenerationRequest, StopConditions};
use crate::tokenizer::{ChatMessage, Tokenizer};

#[derive(Serialize)]
struct JsonOutput<'a> {
    prompt_tokens: usize,
    tokens: &'a [u32],
    text: &'a str,
    finish_reason: &'static str,
    #[serde(skip_serializing_if = "Option::is_none")]
    logprobs: Option<&'a [TokenLogprobs]>,
}

/// The prompt's token ids, from whichever form the user gave.
pub fn prompt_ids(input: &PromptArgs, tokenizer: &Tokenizer) -> anyhow::Result<Vec<u32>> {
    if let Some(text) = &input.prompt {
        return Ok(tokenizer.encode(text, true)?);
    }
    if let Some(ids) = &input.prompt_ids {
        return Ok(ids.clone());
    }
    if let Some(chat) = &input.chat {
        let messages: Vec<ChatMessage> =
            serde_json::from_str(chat).context("--chat must be a JSON array of {\"role\", \"content\"} messages")?;
        return Ok(tokenizer.encode_chat(&messages, true)?);
    }
    anyhow::bail!("give one of --prompt, --prompt-ids or --chat")
}

pub fn run(args: &GenerateArgs) -> anyhow::Result<()> {
    super::init_threads(args.engine.threads)?;
    let backend = Arc::new(CpuBackend::new());
    let model = model::load(backend, &args.model)?;
    let tokenizer = Tokenizer::from_dir(&args.model)?;
    let prompt = prompt_ids(&args.input, &tokenizer)?;
    let request = GenerationRequest {
        prompt,
        sampling: args.sampling.params(),
        stop: StopConditions {
            max_new_tokens: args.max_new_tokens,
            stop_token_ids: Vec::new(),
            stop_strings: args.stop.clone(),
            ignore_eos: args.ignore_eos,
        },
    }
    .validate(model.config())?;
    let mut engine = Engine::new(Arc::new(model), Arc::new(tokenizer), args.engine.engine_config())?;
    engine.add(request)?;
    if args.json {
        let done = engine.run_to_completion()?;
        let c = done.first().context("the engine returned no completion")?;
        let logprobs = args.sampling.logprobs.map(|_| c.logprobs.as_slice());
        let out = JsonOutput {
            prompt_tokens: c.prompt_tokens,
            tokens: &c.tokens,
            text: &c.text,
            finish_reason: c.finish_reason.as_str(),
            logprobs,
        };
        println!("{}", serde_json::to_string(&out)?);
    } else {
        let mut stdout = std::io::stdout().lock();
        while engine.has_work() {
            for event in engine.step()? {
                stdout.write_all(event.text.as_bytes())?;
                stdout.flush()?;
            }
        }
        writeln!(stdout)?;
    }
    Ok(())
}
