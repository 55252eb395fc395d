//! The OpenAI-compatible endpoints: `POST /v1/completions`, `POST /v1/chat/completions`,
//! `GET /v1/models` and `GET /v1/models/{id}`, with vLLM's sampling extensions. Fields a
//! request carries that this server does not read are ignored and named in the response's
//! `x-ignored-fields` header, unless ignoring them would change the answer (then they are a
//! 400 that names them).

use actix_web::web::Bytes;
use actix_web::{HttpRequest, HttpResponse, web};
use serde::Deserialize;
use serde_json::{Value, json};
use std::collections::BTreeMap;
use std::sync::Arc;

use super::infer::{self, Admitted, Job, JobEvent, JobSpec, sse, usage_json};
use super::peer::Peer;
use super::structured::{self, GrammarSource};
use super::tools::{ToolCall, ToolSet};
use super::validate::{self, DefaultMax, Knobs, Prompt};
use super::{ApiError, AppState, json_body};
use crate::store::{Scope, now_ms};
use crate::tokenizer::ChatMessage;

pub fn routes(cfg: &mut web::ServiceConfig) {
    cfg.route("/v1/completions", web::post().to(completions))
        .route("/v1/chat/completions", web::post().to(chat_completions))
        .route("/v1/models", web::get().to(models))
        .route("/v1/models/{id}", web::get().to(model));
}

#[derive(Debug, Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct StreamOptions {
    #[serde(default)]
    include_usage: bool,
}

/// The [`Knobs`] of a completion or chat request: the fields both spell the same way, and the
/// two they spell differently.
macro_rules! knobs {
    ($b:ident, $max_tokens:expr, $logprobs:expr) => {
        Knobs {
            max_tokens: $max_tokens,
            logprobs: $logprobs,
            temperature: $b.temperature,
            top_p: $b.top_p,
            top_k: $b.top_k,
            min_p: $b.min_p,
            n: $b.n,
            stop: stop_strings($b.stop.as_ref())?,
            // OpenAI's seed is a signed integer; every value maps to its own generator seed.
            seed: $b.seed.map(|s| s as u64),
            presence_penalty: $b.presence_penalty,
            frequency_penalty: $b.frequency_penalty,
            repetition_penalty: $b.repetition_penalty,
            ignore_eos: $b.ignore_eos.unwrap_or(false),
        }
    };
}

/// The one constraint on the output among the fields of either endpoint that name one.
macro_rules! constraint {
    ($b:ident) => {{
        let guided = structured::Guided {
            json: $b.guided_json.take(),
            regex: $b.guided_regex.take(),
            choice: $b.guided_choice.take(),
            grammar: $b.guided_grammar.take(),
            whitespace_pattern: $b.guided_whitespace_pattern.take(),
            backend: $b.guided_decoding_backend.take(),
        };
        let found: Vec<(&'static str, crate::grammar::GrammarSpec)> = [
            ("response_format", structured::response_format($b.response_format.as_ref())?),
            ("structured_outputs", structured::structured_outputs($b.structured_outputs.as_ref())?),
            ("guided_*", structured::guided(&guided)?),
        ]
        .into_iter()
        .filter_map(|(name, spec)| spec.map(|s| (name, s)))
        .collect();
        structured::one(found)?
    }};
}

/// `stop` as sent: a string or a list of strings (their count and lengths are checked with the
/// other limits, in [`validate`]).
fn stop_strings(stop: Option<&Value>) -> Result<Vec<String>, ApiError> {
    let shape = || ApiError::Invalid("`stop` must be a string or a list of strings".into());
    match stop {
        None | Some(Value::Null) => Ok(Vec::new()),
        Some(Value::String(s)) => Ok(vec![s.clone()]),
        Some(Value::Array(items)) if items.len() > validate::MAX_STOPS => {
            Err(ApiError::Invalid(format!("at most {} stop strings; given: {}", validate::MAX_STOPS, items.len())))
        }
        Some(Value::Array(items)) => items.iter().map(|v| v.as_str().map(str::to_string).ok_or_else(shape)).collect(),
        Some(_) => Err(shape()),
    }
}

fn unsupported(field: &str, why: &str) -> ApiError {
    ApiError::InvalidParam { param: field.to_owned(), message: format!("`{field}` is not supported: {why}") }
}

/// Fields of OpenAI's API that would change the answer if they were ignored: refused, naming
/// the field.
const REFUSED: [(&str, &str); 4] = [
    ("prediction", "predicted outputs are not used by this server"),
    ("functions", "give them as `tools`"),
    ("function_call", "give it as `tool_choice`"),
    ("audio", "the model answers in text only"),
];

/// The most ignored fields named in the response's header.
const MAX_IGNORED_SHOWN: usize = 16;

/// Fields of a request this server does not read. Those that would change the answer
/// ([`REFUSED`], `modalities` other than text) are refused; the rest (`store`, `metadata`,
/// `service_tier`, `reasoning_effort` and whatever newer clients send) are ignored, as vLLM
/// does, and named in the response's `x-ignored-fields` header.
fn other_fields(other: &BTreeMap<String, Value>) -> Result<Vec<String>, ApiError> {
    for (key, value) in other {
        if value.is_null() {
            continue;
        }
        if let Some((field, why)) = REFUSED.iter().find(|(f, _)| f == key) {
            return Err(unsupported(field, why));
        }
        if key == "modalities" && value != &serde_json::json!(["text"]) {
            return Err(unsupported("modalities", "the model answers in text only: give [\"text\"] or leave it out"));
        }
    }
    Ok(other.iter().filter(|(_, v)| !v.is_null()).map(|(k, _)| k.clone()).collect())
}

/// OpenAI's bound on `temperature`.
const MAX_TEMPERATURE: f32 = 2.0;

fn check_temperature(t: Option<f32>) -> Result<(), ApiError> {
    match t {
        Some(t) if !(0.0..=MAX_TEMPERATURE).contains(&t) => {
            Err(ApiError::InvalidParam { param: "temperature".into(), message: format!("`temperature` must be between 0 and {MAX_TEMPERATURE}; given: {t}") })
        }
        _ => Ok(()),
    }
}

/// The `x-ignored-fields` header of a response, if the request had any: names of at most
/// [`MAX_IGNORED_SHOWN`] fields, each shown only if it is a plain name.
fn with_ignored(mut res: HttpResponse, ignored: &[String]) -> HttpResponse {
    let shown: Vec<&str> = ignored
        .iter()
        .filter(|k| k.len() <= 64 && !k.is_empty() && k.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-' || b == b'.'))
        .take(MAX_IGNORED_SHOWN)
        .map(String::as_str)
        .collect();
    if !shown.is_empty()
        && let Ok(value) = actix_web::http::header::HeaderValue::from_str(&shown.join(", "))
    {
        res.headers_mut().insert(actix_web::http::header::HeaderName::from_static("x-ignored-fields"), value);
    }
    res
}

/// The prompts of a completion request, as sent.
fn prompts(prompt: &Value) -> Result<Vec<Prompt>, ApiError> {
    let shape = || ApiError::Invalid("`prompt` must be a string, a list of strings, a list of token ids or a list of lists of token ids".into());
    let ids = |items: &[Value]| -> Result<Prompt, ApiError> {
        items
            .iter()
            .map(|v| {
                v.as_u64().and_then(|id| u32::try_from(id).ok()).ok_or_else(|| {
                    let shown: String = v.to_string().chars().take(24).collect();
                    ApiError::Invalid(format!("token id {shown} is not a valid token id"))
                })
            })
            .collect::<Result<_, _>>()
            .map(Prompt::Ids)
    };
    match prompt {
        Value::String(s) => Ok(vec![Prompt::Text(s.clone())]),
        Value::Array(items) if items.is_empty() => Err(ApiError::Invalid("the prompt is empty".into())),
        Value::Array(items) if items.len() > validate::MAX_PROMPTS && !items[0].is_number() => {
            Err(ApiError::Invalid(format!("at most {} prompts per request; given: {}", validate::MAX_PROMPTS, items.len())))
        }
        Value::Array(items) => match &items[0] {
            Value::String(_) => items.iter().map(|v| v.as_str().map(|s| Prompt::Text(s.to_string())).ok_or_else(shape)).collect(),
            Value::Number(_) => Ok(vec![ids(items)?]),
            Value::Array(_) => items.iter().map(|v| v.as_array().ok_or_else(shape).and_then(|a| ids(a))).collect(),
            _ => Err(shape()),
        },
        _ => Err(shape()),
    }
}

#[derive(Debug, Deserialize)]
struct CompletionRequest {
    model: String,
    prompt: Value,
    max_tokens: Option<u32>,
    temperature: Option<f32>,
    top_p: Option<f32>,
    n: Option<u32>,
    stop: Option<Value>,
    seed: Option<i64>,
    presence_penalty: Option<f32>,
    frequency_penalty: Option<f32>,
    logprobs: Option<u32>,
    stream: Option<bool>,
    stream_options: Option<StreamOptions>,
    user: Option<String>,
    top_k: Option<i32>,
    min_p: Option<f32>,
    repetition_penalty: Option<f32>,
    ignore_eos: Option<bool>,
    echo: Option<bool>,
    best_of: Option<u32>,
    suffix: Option<String>,
    logit_bias: Option<serde_json::Map<String, Value>>,
    response_format: Option<Value>,
    structured_outputs: Option<Value>,
    guided_json: Option<Value>,
    guided_regex: Option<String>,
    guided_choice: Option<Vec<String>>,
    guided_grammar: Option<String>,
    guided_decoding_backend: Option<String>,
    guided_whitespace_pattern: Option<String>,
    /// Fields this server does not read (see [`other_fields`]).
    #[serde(flatten)]
    other: BTreeMap<String, Value>,
}

/// What a streamed or gathered response needs to know about its request.
struct Shape {
    id: String,
    model: String,
    created: i64,
    n: usize,
    prompts: usize,
    logprobs: Option<u32>,
    include_usage: bool,
    chat: bool,
    /// The request's tools, when calls are read from the output.
    tools: Option<Arc<ToolSet>>,
}

fn check_stream_options(stream: bool, options: &Option<StreamOptions>) -> Result<bool, ApiError> {
    match options {
        Some(_) if !stream => Err(ApiError::Invalid("`stream_options` is only allowed with `stream: true`".into())),
        Some(o) => Ok(o.include_usage),
        None => Ok(false),
    }
}

/// A request of either endpoint, translated and checked as far as it can be without the
/// model: what [`run`] needs.
pub(super) struct Parsed {
    pub model: String,
    prompts: Vec<Prompt>,
    knobs: Knobs,
    default_max: DefaultMax,
    stream: bool,
    include_usage: bool,
    logprobs: Option<u32>,
    chat: bool,
    grammar: Option<GrammarSource>,
    tools: Option<Arc<ToolSet>>,
    /// Fields of the request that were ignored.
    ignored: Vec<String>,
}

impl Parsed {
    /// What the output must follow, if anything.
    pub(super) fn grammar(&self) -> Option<&GrammarSource> {
        self.grammar.as_ref()
    }
}

fn parse_completion(mut b: CompletionRequest) -> Result<Parsed, ApiError> {
    if b.echo == Some(true) {
        return Err(unsupported("echo", "the prompt is not returned with the completion"));
    }
    if b.suffix.is_some() {
        return Err(unsupported("suffix", "the model has no insertion mode"));
    }
    if b.logit_bias.as_ref().is_some_and(|m| !m.is_empty()) {
        return Err(unsupported("logit_bias", "use stop strings or penalties"));
    }
    if let Some(best_of) = b.best_of
        && best_of != b.n.unwrap_or(1)
    {
        return Err(unsupported("best_of", "only best_of equal to n is accepted"));
    }
    let _ = &b.user;
    let ignored = other_fields(&b.other)?;
    check_temperature(b.temperature)?;
    let stream = b.stream.unwrap_or(false);
    let include_usage = check_stream_options(stream, &b.stream_options)?;
    let prompts = prompts(&b.prompt)?;
    let knobs = knobs!(b, b.max_tokens, b.logprobs);
    knobs.check()?;
    let grammar = constraint!(b).map(GrammarSource::Spec);
    Ok(Parsed {
        model: b.model,
        prompts,
        knobs,
        default_max: DefaultMax::Tokens(16),
        stream,
        include_usage,
        logprobs: b.logprobs,
        chat: false,
        grammar,
        tools: None,
        ignored,
    })
}

async fn completions(req: HttpRequest, state: web::Data<AppState>, payload: web::Payload) -> Result<HttpResponse, ApiError> {
    let caller = infer::admitted(&req, &state).await?;
    let parsed = parse_completion(json_body(&state, payload).await?)?;
    run(&state, caller, parsed, "completions", &Peer::of(&req)).await
}

#[derive(Debug, Deserialize)]
struct ChatRequest {
    model: String,
    messages: Vec<ChatMessage>,
    max_tokens: Option<u32>,
    max_completion_tokens: Option<u32>,
    temperature: Option<f32>,
    top_p: Option<f32>,
    n: Option<u32>,
    stop: Option<Value>,
    seed: Option<i64>,
    presence_penalty: Option<f32>,
    frequency_penalty: Option<f32>,
    logprobs: Option<bool>,
    top_logprobs: Option<u32>,
    stream: Option<bool>,
    stream_options: Option<StreamOptions>,
    user: Option<String>,
    top_k: Option<i32>,
    min_p: Option<f32>,
    repetition_penalty: Option<f32>,
    ignore_eos: Option<bool>,
    logit_bias: Option<serde_json::Map<String, Value>>,
    tools: Option<Vec<Value>>,
    tool_choice: Option<Value>,
    parallel_tool_calls: Option<bool>,
    response_format: Option<Value>,
    structured_outputs: Option<Value>,
    guided_json: Option<Value>,
    guided_regex: Option<String>,
    guided_choice: Option<Vec<String>>,
    guided_grammar: Option<String>,
    guided_decoding_backend: Option<String>,
    guided_whitespace_pattern: Option<String>,
    /// Fields this server does not read (see [`other_fields`]).
    #[serde(flatten)]
    other: BTreeMap<String, Value>,
}

fn parse_chat(mut b: ChatRequest) -> Result<Parsed, ApiError> {
    if b.logit_bias.as_ref().is_some_and(|m| !m.is_empty()) {
        return Err(unsupported("logit_bias", "use stop strings or penalties"));
    }
    if b.top_logprobs.is_some() && b.logprobs != Some(true) {
        return Err(ApiError::Invalid("`top_logprobs` needs `logprobs: true`".into()));
    }
    if b.max_tokens.is_some() && b.max_completion_tokens.is_some() && b.max_tokens != b.max_completion_tokens {
        return Err(ApiError::Invalid("give one of `max_tokens` and `max_completion_tokens`".into()));
    }
    let _ = &b.user;
    let ignored = other_fields(&b.other)?;
    check_temperature(b.temperature)?;
    let stream = b.stream.unwrap_or(false);
    let include_usage = check_stream_options(stream, &b.stream_options)?;
    let logprobs = if b.logprobs == Some(true) { Some(b.top_logprobs.unwrap_or(0)) } else { None };
    let knobs = knobs!(b, b.max_completion_tokens.or(b.max_tokens), logprobs);
    knobs.check()?;
    let spec = constraint!(b);
    let tools = ToolSet::parse(b.tools.take(), b.tool_choice.as_ref(), b.parallel_tool_calls)?.map(Arc::new);
    let calls = tools.as_ref().filter(|t| t.calls()).cloned();
    let grammar = match (spec, &calls) {
        (Some(_), Some(_)) => {
            return Err(ApiError::Invalid("a request that may call tools cannot also constrain its text; use `tool_choice: \"none\"`".into()));
        }
        (Some(spec), None) => Some(GrammarSource::Spec(spec)),
        (None, Some(t)) => Some(GrammarSource::Tools(t.clone())),
        (None, None) => None,
    };
    // Without max_tokens, a chat reply may use the rest of the context.
    let prompts = vec![Prompt::Chat(b.messages, tools)];
    Ok(Parsed {
        model: b.model,
        prompts,
        knobs,
        default_max: DefaultMax::RestOfContext,
        stream,
        include_usage,
        logprobs,
        chat: true,
        grammar,
        tools: calls,
        ignored,
    })
}

async fn chat_completions(req: HttpRequest, state: web::Data<AppState>, payload: web::Payload) -> Result<HttpResponse, ApiError> {
    let caller = infer::admitted(&req, &state).await?;
    let parsed = parse_chat(json_body(&state, payload).await?)?;
    run(&state, caller, parsed, "chat_completions", &Peer::of(&req)).await
}

async fn run(state: &AppState, caller: Admitted, mut p: Parsed, endpoint: &'static str, peer: &Peer) -> Result<HttpResponse, ApiError> {
    let target = infer::resolve(state, &caller.caller.tenant.id, &p.model).await?;
    let ignored = std::mem::take(&mut p.ignored);
    if p.stream {
        let (job, shape) = start(state, caller, p, target, endpoint, None, peer).await?;
        return Ok(with_ignored(stream_response(state.clone(), job, shape, peer.clone()), &ignored));
    }
    Ok(with_ignored(HttpResponse::Ok().json(answer(state, caller, p, target, endpoint, None, peer).await?), &ignored))
}

/// Starts the job of a request whose `model` resolved to `target`.
async fn start(
    state: &AppState,
    caller: Admitted,
    p: Parsed,
    target: infer::Target,
    endpoint: &'static str,
    batch: Option<infer::BatchLine>,
    peer: &Peer,
) -> Result<(Job, Shape), ApiError> {
    let shape = Shape {
        id: infer::response_id(if p.chat { "chatcmpl" } else { "cmpl" }),
        model: p.model,
        created: now_ms() / 1000,
        n: p.knobs.samples() as usize,
        prompts: p.prompts.len(),
        logprobs: p.logprobs,
        include_usage: p.include_usage,
        chat: p.chat,
        tools: p.tools,
    };
    let spec = JobSpec {
        endpoint,
        prompts: p.prompts,
        knobs: p.knobs,
        default_max: p.default_max,
        truncate: None,
        target,
        grammar: p.grammar,
        batch,
        peer: peer.clone(),
    };
    Ok((infer::start(state, caller, spec).await?, shape))
}

/// The whole (non-streamed) answer to a request whose `model` resolved to `target`: the body
/// of the HTTP response, and of a batch line's.
pub(super) async fn answer(
    state: &AppState,
    caller: Admitted,
    p: Parsed,
    target: infer::Target,
    endpoint: &'static str,
    batch: Option<infer::BatchLine>,
    peer: &Peer,
) -> Result<Value, ApiError> {
    let (job, shape) = start(state, caller, p, target, endpoint, batch, peer).await?;
    let (samples, usage) = infer::gather(job, shape.prompts, shape.n, peer).await?;
    let mut choices = Vec::with_capacity(shape.prompts * shape.n);
    for (p, prompt) in samples.iter().enumerate() {
        for (i, g) in prompt.iter().enumerate() {
            let finish = g.finish.map(|f| f.as_str());
            let logprobs = shape.logprobs.map(|_| if shape.chat { chat_logprobs(state, &g.tokens) } else { completion_logprobs(state, &g.tokens, 0) });
            let index = p * shape.n + i;
            let calls = shape.tools.as_ref().and_then(|t| t.read_calls(&g.text));
            choices.push(if let Some(calls) = calls {
                let calls: Vec<Value> = calls.iter().map(ToolCall::to_json).collect();
                let finish = if finish == Some("stop") { Some("tool_calls") } else { finish };
                json!({"index": index, "message": {"role": "assistant", "content": null, "tool_calls": calls}, "logprobs": logprobs, "finish_reason": finish})
            } else if shape.chat {
                json!({"index": index, "message": {"role": "assistant", "content": g.text}, "logprobs": logprobs, "finish_reason": finish})
            } else {
                json!({"index": index, "text": g.text, "logprobs": logprobs, "finish_reason": finish})
            });
        }
    }
    let object = if shape.chat { "chat.completion" } else { "text_completion" };
    Ok(json!({
        "id": shape.id,
        "object": object,
        "created": shape.created,
        "model": shape.model,
        "choices": choices,
        "usage": usage_json(&usage),
    }))
}

/// The endpoints a batch can call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BatchEndpoint {
    Completions,
    ChatCompletions,
}

impl BatchEndpoint {
    pub const ALL: [BatchEndpoint; 2] = [BatchEndpoint::ChatCompletions, BatchEndpoint::Completions];

    pub fn url(self) -> &'static str {
        match self {
            BatchEndpoint::Completions => "/v1/completions",
            BatchEndpoint::ChatCompletions => "/v1/chat/completions",
        }
    }

    pub fn from_url(url: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|e| e.url() == url)
    }

    /// The name its lines carry in metrics.
    pub fn batch_name(self) -> &'static str {
        match self {
            BatchEndpoint::Completions => "batch_completions",
            BatchEndpoint::ChatCompletions => "batch_chat_completions",
        }
    }

    /// A line's body, checked as the endpoint checks a request's: the request it makes, and the
    /// model it names.
    pub(super) fn parse(self, body: &serde_json::value::RawValue) -> Result<Parsed, ApiError> {
        let parsed = match self {
            BatchEndpoint::Completions => parse_completion(parse_body(body)?)?,
            BatchEndpoint::ChatCompletions => parse_chat(parse_body(body)?)?,
        };
        if parsed.stream {
            return Err(unsupported("stream", "a batch writes whole answers to its output file"));
        }
        Ok(parsed)
    }
}

fn parse_body<T: serde::de::DeserializeOwned>(body: &serde_json::value::RawValue) -> Result<T, ApiError> {
    serde_json::from_str(body.get()).map_err(|e| ApiError::Invalid(format!("invalid body: {e}")))
}

fn completion_logprobs(state: &AppState, tokens: &[crate::runtime::TokenOut], offset: usize) -> Value {
    let mut offsets = Vec::with_capacity(tokens.len());
    let mut at = offset;
    for t in tokens {
        offsets.push(at);
        at += t.text.len();
    }
    json!({
        "tokens": tokens.iter().map(|t| infer::token_text(state, t.token)).collect::<Vec<_>>(),
        "token_logprobs": tokens.iter().map(|t| t.logprob).collect::<Vec<_>>(),
        "top_logprobs": tokens.iter().map(|t| {
            t.top_logprobs.iter().map(|&(id, lp)| (infer::token_text(state, id), json!(lp))).collect::<serde_json::Map<_, _>>()
        }).collect::<Vec<_>>(),
        "text_offset": offsets,
    })
}

fn chat_logprobs(state: &AppState, tokens: &[crate::runtime::TokenOut]) -> Value {
    let entry = |id: u32, lp: Option<f32>| {
        let text = infer::token_text(state, id);
        json!({"token": text, "logprob": lp, "bytes": text.as_bytes()})
    };
    let content: Vec<Value> = tokens
        .iter()
        .map(|t| {
            let mut e = entry(t.token, t.logprob);
            e["top_logprobs"] = t.top_logprobs.iter().map(|&(id, lp)| entry(id, Some(lp))).collect();
            e
        })
        .collect();
    json!({"content": content})
}

/// The stream's state: the job, and per choice how much text it has sent (for offsets).
struct Streaming {
    state: AppState,
    job: Job,
    peer: Peer,
    shape: Shape,
    offsets: Vec<usize>,
    /// Per choice, with tools: what is held back until it is known to be text or calls.
    held: Vec<Held>,
    started: bool,
    done: bool,
}

/// A chat choice's stream when the model may call tools: its first characters are held until
/// they cannot open a call block (then they, and all that follows, stream as text), and a call
/// block is held whole, to be sent as `tool_calls` once the choice ends.
#[derive(Debug, Default)]
struct Held {
    mode: HeldMode,
    text: String,
    tokens: Vec<crate::runtime::TokenOut>,
}

#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
enum HeldMode {
    #[default]
    Undecided,
    Text,
    Calls,
}

impl Streaming {
    /// The delta for `token` of chat choice `index` when tools are offered: `None` while held.
    fn tool_delta(&mut self, tools: &ToolSet, index: usize, token: crate::runtime::TokenOut) -> Option<Value> {
        let held = &mut self.held[index];
        if held.mode == HeldMode::Text {
            let finish = token.finish.map(|f| f.as_str());
            let logprobs = self.shape.logprobs.map(|_| chat_logprobs(&self.state, std::slice::from_ref(&token)));
            return Some(json!({"index": index, "delta": {"content": token.text}, "logprobs": logprobs, "finish_reason": finish}));
        }
        let finish = token.finish.map(|f| f.as_str());
        held.text.push_str(&token.text);
        held.tokens.push(token);
        if held.mode == HeldMode::Undecided {
            if held.text.starts_with(super::tools::CALL_OPEN) {
                held.mode = HeldMode::Calls;
            } else if !tools.may_open_call(&held.text) {
                held.mode = HeldMode::Text;
            }
        }
        if held.mode != HeldMode::Text && finish.is_none() {
            return None;
        }
        let held = std::mem::take(&mut self.held[index]);
        let mode = if held.mode == HeldMode::Text { HeldMode::Text } else { HeldMode::Calls };
        self.held[index].mode = mode;
        let logprobs = self.shape.logprobs.map(|_| chat_logprobs(&self.state, &held.tokens));
        if let Some(calls) = tools.read_calls(&held.text) {
            let calls: Vec<Value> = calls
                .iter()
                .enumerate()
                .map(|(i, c)| {
                    let mut v = c.to_json();
                    v["index"] = i.into();
                    v
                })
                .collect();
            let finish = if finish == Some("stop") { Some("tool_calls") } else { finish };
            return Some(json!({"index": index, "delta": {"tool_calls": calls}, "logprobs": logprobs, "finish_reason": finish}));
        }
        Some(json!({"index": index, "delta": {"content": held.text}, "logprobs": logprobs, "finish_reason": finish}))
    }

    fn chunk(&self, choices: Vec<Value>, usage: Option<Value>) -> Value {
        let object = if self.shape.chat { "chat.completion.chunk" } else { "text_completion" };
        let mut v = json!({"id": self.shape.id, "object": object, "created": self.shape.created, "model": self.shape.model, "choices": choices});
        if self.shape.include_usage {
            v["usage"] = usage.unwrap_or(Value::Null);
        }
        v
    }

    /// The bytes for the next event; `None` once the stream has ended.
    async fn next(&mut self) -> Option<Bytes> {
        if self.done {
            return None;
        }
        let mut out = Vec::new();
        if !self.started && self.shape.chat {
            // Every choice opens with the assistant's role.
            let choices = (0..self.shape.n * self.shape.prompts)
                .map(|i| json!({"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": null, "finish_reason": null}))
                .collect();
            out.extend_from_slice(&sse(&self.chunk(choices, None)));
        }
        self.started = true;
        loop {
            // The client went away: end the body, which drops the job and so cancels it.
            let event = infer::next_event(&mut self.job, &self.peer).await?;
            if let Some(JobEvent::Token { token, .. }) = &event
                && token.text.is_empty()
                && token.finish.is_none()
                && self.shape.logprobs.is_none()
                && self.shape.tools.is_none()
            {
                // A token that ends inside a character (its text comes with the next one):
                // no chunk of its own, as an empty delta says nothing.
                if out.is_empty() {
                    continue;
                }
                return Some(Bytes::from(out));
            }
            return self.chunk_of(event, out);
        }
    }

    /// The bytes of one job event (after what `out` holds already).
    fn chunk_of(&mut self, event: Option<JobEvent>, mut out: Vec<u8>) -> Option<Bytes> {
        match event {
            Some(JobEvent::Token { prompt, token }) => {
                let index = prompt * self.shape.n + token.index;
                if let Some(tools) = self.shape.tools.clone() {
                    if let Some(choice) = self.tool_delta(&tools, index, token) {
                        out.extend_from_slice(&sse(&self.chunk(vec![choice], None)));
                    }
                    return Some(Bytes::from(out));
                }
                let finish = token.finish.map(|f| f.as_str());
                let offset = self.offsets[index];
                self.offsets[index] += token.text.len();
                let one = std::slice::from_ref(&token);
                let choice = if self.shape.chat {
                    let logprobs = self.shape.logprobs.map(|_| chat_logprobs(&self.state, one));
                    json!({"index": index, "delta": {"content": token.text}, "logprobs": logprobs, "finish_reason": finish})
                } else {
                    let logprobs = self.shape.logprobs.map(|_| completion_logprobs(&self.state, one, offset));
                    json!({"index": index, "text": token.text, "logprobs": logprobs, "finish_reason": finish})
                };
                out.extend_from_slice(&sse(&self.chunk(vec![choice], None)));
            }
            Some(JobEvent::Done(usage)) => {
                if self.shape.include_usage {
                    out.extend_from_slice(&sse(&self.chunk(Vec::new(), Some(usage_json(&usage)))));
                }
                out.extend_from_slice(b"data: [DONE]\n\n");
                self.done = true;
            }
            Some(JobEvent::Failed(e)) => {
                out.extend_from_slice(&sse(&e.body()));
                out.extend_from_slice(b"data: [DONE]\n\n");
                self.done = true;
            }
            None => {
                let e = ApiError::Unavailable("the request ended without a result".into());
                out.extend_from_slice(&sse(&e.body()));
                self.done = true;
            }
        }
        Some(Bytes::from(out))
    }
}

fn stream_response(state: AppState, job: Job, shape: Shape, peer: Peer) -> HttpResponse {
    let offsets = vec![0; shape.n * shape.prompts];
    let held = (0..shape.n * shape.prompts).map(|_| Held::default()).collect();
    let s = Streaming { state, job, peer, shape, offsets, held, started: false, done: false };
    let body = futures::stream::unfold(s, |mut s| async move { s.next().await.map(|b| (Ok::<_, std::convert::Infallible>(b), s)) });
    HttpResponse::Ok().content_type("text/event-stream").insert_header(("cache-control", "no-cache")).streaming(body)
}

/// Every model the caller may name: the base model, then its adapters.
async fn model_objects(state: &AppState, caller: &infer::Caller) -> Result<Vec<Value>, ApiError> {
    let mut data = vec![json!({
        "id": &*state.model_name,
        "object": "model",
        "created": state.started_at / 1000,
        "owned_by": "loraplex",
        "root": &*state.model_name,
        "parent": null,
        "max_model_len": state.serving.model_config().max_position_embeddings,
    })];
    // Adapters of another base model are not models this server can run.
    for a in state.store.visible_adapters(&caller.tenant.id).await?.into_iter().filter(|a| state.base.unusable(a).is_none()) {
        let owned_by = if a.owner == caller.tenant.id { caller.tenant.name.as_str() } else { "loraplex" };
        data.push(json!({
            "id": a.name,
            "object": "model",
            "created": a.created_at / 1000,
            "owned_by": owned_by,
            "root": a.label(),
            "parent": &*state.model_name,
            "version": a.version,
            "rank": a.rank,
        }));
    }
    Ok(data)
}

async fn models(req: HttpRequest, state: web::Data<AppState>) -> Result<HttpResponse, ApiError> {
    let caller = infer::caller(&req, &state, Scope::Inference).await?;
    let data = model_objects(&state, &caller).await?;
    Ok(HttpResponse::Ok().json(json!({"object": "list", "data": data})))
}

/// One model by its id (the client's `models.retrieve`): 404 for one the caller may not use.
async fn model(req: HttpRequest, state: web::Data<AppState>, id: web::Path<String>) -> Result<HttpResponse, ApiError> {
    let caller = infer::caller(&req, &state, Scope::Inference).await?;
    let found = model_objects(&state, &caller).await?.into_iter().find(|m| m["id"].as_str() == Some(id.as_str()));
    let shown: String = id.chars().take(80).collect();
    found.map(|m| HttpResponse::Ok().json(m)).ok_or_else(|| ApiError::NotFound(format!("model `{shown}`")))
}
