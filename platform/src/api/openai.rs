//! The OpenAI-compatible endpoints: `POST /v1/completions`, `POST /v1/chat/completions` and
//! `GET /v1/models`, with vLLM's sampling extensions.

use actix_web::web::Bytes;
use actix_web::{HttpRequest, HttpResponse, web};
use serde::Deserialize;
use serde_json::{Value, json};

use super::infer::{self, Caller, Job, JobEvent, JobSpec, sse, usage_json};
use super::{ApiError, AppState, json_body};
use crate::request::{GenerationRequest, StopConditions};
use crate::sampling::SamplingParams;
use crate::store::{Scope, now_ms};
use crate::tokenizer::ChatMessage;

pub fn routes(cfg: &mut web::ServiceConfig) {
    cfg.route("/v1/completions", web::post().to(completions))
        .route("/v1/chat/completions", web::post().to(chat_completions))
        .route("/v1/models", web::get().to(models));
}

/// Most stop strings per request.
const MAX_STOPS: usize = 16;

#[derive(Debug, Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct StreamOptions {
    #[serde(default)]
    include_usage: bool,
}

/// The sampling and stopping fields both endpoints share, as sent.
#[derive(Debug, Default)]
struct Knobs {
    max_tokens: Option<usize>,
    temperature: Option<f32>,
    top_p: Option<f32>,
    n: Option<usize>,
    stop: Option<Value>,
    seed: Option<i64>,
    presence_penalty: Option<f32>,
    frequency_penalty: Option<f32>,
    top_k: Option<i64>,
    min_p: Option<f32>,
    repetition_penalty: Option<f32>,
    ignore_eos: Option<bool>,
    logprobs: Option<usize>,
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
            n: $b.n,
            stop: $b.stop,
            seed: $b.seed,
            presence_penalty: $b.presence_penalty,
            frequency_penalty: $b.frequency_penalty,
            top_k: $b.top_k,
            min_p: $b.min_p,
            repetition_penalty: $b.repetition_penalty,
            ignore_eos: $b.ignore_eos,
        }
    };
}

impl Knobs {
    /// The generation request (without its prompt). `default_max` applies when `max_tokens`
    /// is absent.
    fn request(&self, default_max: usize) -> Result<GenerationRequest, ApiError> {
        let top_k = match self.top_k {
            None | Some(-1) | Some(0) => 0,
            Some(k) if k > 0 => k as usize,
            Some(k) => return Err(ApiError::Invalid(format!("`top_k` must be -1 (off) or positive; given: {k}"))),
        };
        let defaults = SamplingParams::default();
        let sampling = SamplingParams {
            temperature: self.temperature.unwrap_or(defaults.temperature),
            top_k,
            top_p: self.top_p.unwrap_or(defaults.top_p),
            min_p: self.min_p.unwrap_or(defaults.min_p),
            repetition_penalty: self.repetition_penalty.unwrap_or(defaults.repetition_penalty),
            presence_penalty: self.presence_penalty.unwrap_or(0.0),
            frequency_penalty: self.frequency_penalty.unwrap_or(0.0),
            seed: self.seed.map(|s| s as u64),
            logprobs: self.logprobs,
        };
        Ok(GenerationRequest {
            prompt: Vec::new(),
            sampling,
            stop: StopConditions {
                max_new_tokens: self.max_tokens.unwrap_or(default_max),
                stop_token_ids: Vec::new(),
                stop_strings: stop_strings(self.stop.as_ref())?,
                ignore_eos: self.ignore_eos.unwrap_or(false),
            },
            adapter: None,
            n: self.n.unwrap_or(1),
        })
    }
}

fn stop_strings(stop: Option<&Value>) -> Result<Vec<String>, ApiError> {
    let stops = match stop {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::String(s)) => vec![s.clone()],
        Some(Value::Array(items)) => items
            .iter()
            .map(|v| v.as_str().map(str::to_string).ok_or_else(|| ApiError::Invalid("`stop` must be a string or a list of strings".into())))
            .collect::<Result<_, _>>()?,
        Some(_) => return Err(ApiError::Invalid("`stop` must be a string or a list of strings".into())),
    };
    if stops.len() > MAX_STOPS {
        return Err(ApiError::Invalid(format!("at most {MAX_STOPS} stop strings, got {}", stops.len())));
    }
    if stops.iter().any(String::is_empty) {
        return Err(ApiError::Invalid("stop strings must not be empty".into()));
    }
    Ok(stops)
}

fn unsupported(field: &str, why: &str) -> ApiError {
    ApiError::Invalid(format!("`{field}` is not supported: {why}"))
}

/// The prompts of a completion request, as token ids.
fn prompts(state: &AppState, prompt: &Value) -> Result<Vec<Vec<u32>>, ApiError> {
    let shape = || ApiError::Invalid("`prompt` must be a string, a list of strings, a list of token ids or a list of lists of token ids".into());
    let encode = |s: &str| -> Result<Vec<u32>, ApiError> {
        if s.is_empty() {
            return Err(ApiError::Invalid("the prompt is empty".into()));
        }
        state.tokenizer.encode(s, true).map_err(|e| ApiError::Invalid(format!("the prompt could not be tokenized: {e}")))
    };
    let ids = |items: &[Value]| -> Result<Vec<u32>, ApiError> {
        if items.is_empty() {
            return Err(ApiError::Invalid("the prompt is empty".into()));
        }
        items
            .iter()
            .map(|v| v.as_u64().and_then(|id| u32::try_from(id).ok()).ok_or_else(|| ApiError::Invalid(format!("token id {v} is not a valid token id"))))
            .collect()
    };
    match prompt {
        Value::String(s) => Ok(vec![encode(s)?]),
        Value::Array(items) if items.is_empty() => Err(ApiError::Invalid("the prompt is empty".into())),
        Value::Array(items) => match &items[0] {
            Value::String(_) => items.iter().map(|v| v.as_str().ok_or_else(shape).and_then(encode)).collect(),
            Value::Number(_) => Ok(vec![ids(items)?]),
            Value::Array(_) => items.iter().map(|v| v.as_array().ok_or_else(shape).and_then(|a| ids(a))).collect(),
            _ => Err(shape()),
        },
        _ => Err(shape()),
    }
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct CompletionRequest {
    model: String,
    prompt: Value,
    max_tokens: Option<usize>,
    temperature: Option<f32>,
    top_p: Option<f32>,
    n: Option<usize>,
    stop: Option<Value>,
    seed: Option<i64>,
    presence_penalty: Option<f32>,
    frequency_penalty: Option<f32>,
    logprobs: Option<usize>,
    stream: Option<bool>,
    stream_options: Option<StreamOptions>,
    user: Option<String>,
    top_k: Option<i64>,
    min_p: Option<f32>,
    repetition_penalty: Option<f32>,
    ignore_eos: Option<bool>,
    echo: Option<bool>,
    best_of: Option<usize>,
    suffix: Option<String>,
    logit_bias: Option<serde_json::Map<String, Value>>,
}

/// What a streamed or gathered response needs to know about its request.
struct Shape {
    id: String,
    model: String,
    created: i64,
    n: usize,
    prompts: usize,
    logprobs: Option<usize>,
    include_usage: bool,
    chat: bool,
}

fn check_stream_options(stream: bool, options: &Option<StreamOptions>) -> Result<bool, ApiError> {
    match options {
        Some(_) if !stream => Err(ApiError::Invalid("`stream_options` is only allowed with `stream: true`".into())),
        Some(o) => Ok(o.include_usage),
        None => Ok(false),
    }
}

async fn completions(req: HttpRequest, state: web::Data<AppState>, payload: web::Payload) -> Result<HttpResponse, ApiError> {
    let caller = infer::caller(&req, &state, Scope::Inference).await?;
    let b: CompletionRequest = json_body(payload).await?;
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
    let stream = b.stream.unwrap_or(false);
    let include_usage = check_stream_options(stream, &b.stream_options)?;
    let target = infer::resolve(&state, &caller.tenant.id, &b.model).await?;
    let prompts = prompts(&state, &b.prompt)?;
    let knobs = knobs!(b, b.max_tokens, b.logprobs);
    let request = knobs.request(16)?;
    let shape = Shape {
        id: infer::response_id("cmpl"),
        model: b.model,
        created: now_ms() / 1000,
        n: request.n.max(1),
        prompts: prompts.len(),
        logprobs: b.logprobs,
        include_usage,
        chat: false,
    };
    run(&state, caller, JobSpec { endpoint: "completions", prompts, request, target }, shape, stream).await
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct ChatRequest {
    model: String,
    messages: Vec<ChatMessage>,
    max_tokens: Option<usize>,
    max_completion_tokens: Option<usize>,
    temperature: Option<f32>,
    top_p: Option<f32>,
    n: Option<usize>,
    stop: Option<Value>,
    seed: Option<i64>,
    presence_penalty: Option<f32>,
    frequency_penalty: Option<f32>,
    logprobs: Option<bool>,
    top_logprobs: Option<usize>,
    stream: Option<bool>,
    stream_options: Option<StreamOptions>,
    user: Option<String>,
    top_k: Option<i64>,
    min_p: Option<f32>,
    repetition_penalty: Option<f32>,
    ignore_eos: Option<bool>,
    logit_bias: Option<serde_json::Map<String, Value>>,
    tools: Option<Vec<Value>>,
    tool_choice: Option<Value>,
    response_format: Option<Value>,
}

async fn chat_completions(req: HttpRequest, state: web::Data<AppState>, payload: web::Payload) -> Result<HttpResponse, ApiError> {
    let caller = infer::caller(&req, &state, Scope::Inference).await?;
    let b: ChatRequest = json_body(payload).await?;
    if b.messages.is_empty() {
        return Err(ApiError::Invalid("`messages` must not be empty".into()));
    }
    if b.logit_bias.as_ref().is_some_and(|m| !m.is_empty()) {
        return Err(unsupported("logit_bias", "use stop strings or penalties"));
    }
    if b.tools.as_ref().is_some_and(|t| !t.is_empty()) || b.tool_choice.as_ref().is_some_and(|c| !c.is_null() && c != "none") {
        return Err(unsupported("tools", "tool calling is not offered"));
    }
    if let Some(f) = &b.response_format
        && !f.is_null()
        && f.get("type").and_then(Value::as_str) != Some("text")
    {
        return Err(unsupported("response_format", "only {\"type\": \"text\"} is offered"));
    }
    if b.top_logprobs.is_some() && b.logprobs != Some(true) {
        return Err(ApiError::Invalid("`top_logprobs` needs `logprobs: true`".into()));
    }
    if b.max_tokens.is_some() && b.max_completion_tokens.is_some() && b.max_tokens != b.max_completion_tokens {
        return Err(ApiError::Invalid("give one of `max_tokens` and `max_completion_tokens`".into()));
    }
    let _ = &b.user;
    let stream = b.stream.unwrap_or(false);
    let include_usage = check_stream_options(stream, &b.stream_options)?;
    let target = infer::resolve(&state, &caller.tenant.id, &b.model).await?;
    let prompt = state
        .tokenizer
        .encode_chat(&b.messages, true)
        .map_err(|e| ApiError::Invalid(format!("the messages could not be rendered with the model's chat template: {e}")))?;
    let context = state.serving.model_config().max_position_embeddings;
    let logprobs = if b.logprobs == Some(true) { Some(b.top_logprobs.unwrap_or(0)) } else { None };
    let knobs = knobs!(b, b.max_completion_tokens.or(b.max_tokens), logprobs);
    // Without max_tokens, a chat reply may use the rest of the context.
    let request = knobs.request(context.saturating_sub(prompt.len()).max(1))?;
    let shape = Shape {
        id: infer::response_id("chatcmpl"),
        model: b.model,
        created: now_ms() / 1000,
        n: request.n.max(1),
        prompts: 1,
        logprobs,
        include_usage,
        chat: true,
    };
    run(&state, caller, JobSpec { endpoint: "chat_completions", prompts: vec![prompt], request, target }, shape, stream).await
}

async fn run(state: &AppState, caller: Caller, spec: JobSpec, shape: Shape, stream: bool) -> Result<HttpResponse, ApiError> {
    let job = infer::start(state, caller, spec).await?;
    if stream {
        return Ok(stream_response(state.clone(), job, shape));
    }
    let (samples, usage) = infer::gather(job, shape.prompts, shape.n).await?;
    let mut choices = Vec::with_capacity(shape.prompts * shape.n);
    for (p, prompt) in samples.iter().enumerate() {
        for (i, g) in prompt.iter().enumerate() {
            let finish = g.finish.map(|f| f.as_str());
            let logprobs = shape.logprobs.map(|_| if shape.chat { chat_logprobs(state, &g.tokens) } else { completion_logprobs(state, &g.tokens, 0) });
            let index = p * shape.n + i;
            choices.push(if shape.chat {
                json!({"index": index, "message": {"role": "assistant", "content": g.text}, "logprobs": logprobs, "finish_reason": finish})
            } else {
                json!({"index": index, "text": g.text, "logprobs": logprobs, "finish_reason": finish})
            });
        }
    }
    let object = if shape.chat { "chat.completion" } else { "text_completion" };
    Ok(HttpResponse::Ok().json(json!({
        "id": shape.id,
        "object": object,
        "created": shape.created,
        "model": shape.model,
        "choices": choices,
        "usage": usage_json(&usage),
    })))
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
    shape: Shape,
    offsets: Vec<usize>,
    started: bool,
    done: bool,
}

impl Streaming {
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
        match self.job.events.recv().await {
            Some(JobEvent::Token { prompt, token }) => {
                let index = prompt * self.shape.n + token.index;
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

fn stream_response(state: AppState, job: Job, shape: Shape) -> HttpResponse {
    let offsets = vec![0; shape.n * shape.prompts];
    let s = Streaming { state, job, shape, offsets, started: false, done: false };
    let body = futures::stream::unfold(s, |mut s| async move { s.next().await.map(|b| (Ok::<_, std::convert::Infallible>(b), s)) });
    HttpResponse::Ok().content_type("text/event-stream").insert_header(("cache-control", "no-cache")).streaming(body)
}

async fn models(req: HttpRequest, state: web::Data<AppState>) -> Result<HttpResponse, ApiError> {
    let caller = infer::caller(&req, &state, Scope::Inference).await?;
    let mut data = vec![json!({
        "id": &*state.model_name,
        "object": "model",
        "created": state.started_at / 1000,
        "owned_by": "loraplex",
        "root": &*state.model_name,
        "parent": null,
        "max_model_len": state.serving.model_config().max_position_embeddings,
    })];
    for a in state.store.visible_adapters(&caller.tenant.id).await? {
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
    Ok(HttpResponse::Ok().json(json!({"object": "list", "data": data})))
}
