//! The LoRAX-compatible endpoints: `POST /generate` and `POST /generate_stream`, with LoRAX's
//! request and response shapes and its `x-*` headers. `parameters.adapter_id` names the
//! adapter as `model` does on the OpenAI endpoints; absent or empty means the base model.

use actix_web::web::Bytes;
use actix_web::{HttpRequest, HttpResponse, HttpResponseBuilder, web};
use serde::Deserialize;
use serde_json::{Value, json};

use super::infer::{self, Job, JobEvent, JobSpec, Target, sse};
use super::peer::Peer;
use super::validate::{DefaultMax, Knobs, Prompt};
use super::{ApiError, AppState, json_body};
use crate::request::FinishReason;
use crate::runtime::{TokenOut, Usage};

pub fn routes(cfg: &mut web::ServiceConfig) {
    cfg.route("/generate", web::post().to(generate)).route("/generate_stream", web::post().to(generate_stream));
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct GenerateRequest {
    inputs: String,
    #[serde(default)]
    parameters: Parameters,
    /// Accepted for compatibility; `/generate_stream` streams, `/generate` does not.
    #[serde(default)]
    stream: Option<bool>,
}

#[derive(Debug, Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct Parameters {
    adapter_id: Option<String>,
    adapter_source: Option<String>,
    merged_adapters: Option<Value>,
    /// For fetching adapters from a hub; adapters here are uploaded, so it is not used.
    api_token: Option<String>,
    #[serde(default)]
    do_sample: bool,
    max_new_tokens: Option<u32>,
    #[serde(default)]
    ignore_eos_token: bool,
    repetition_penalty: Option<f32>,
    #[serde(default)]
    return_full_text: bool,
    #[serde(default)]
    stop: Vec<String>,
    seed: Option<u64>,
    temperature: Option<f32>,
    top_k: Option<u32>,
    top_p: Option<f32>,
    truncate: Option<u32>,
    typical_p: Option<f32>,
    best_of: Option<u32>,
    #[serde(default)]
    watermark: bool,
    #[serde(default)]
    details: bool,
    #[serde(default)]
    decoder_input_details: bool,
    return_k_alternatives: Option<u32>,
    response_format: Option<Value>,
}

fn unsupported(field: &str, why: &str) -> ApiError {
    ApiError::Invalid(format!("`{field}` is not supported: {why}"))
}

/// LoRAX's default for `max_new_tokens`.
const DEFAULT_MAX_NEW_TOKENS: u32 = 20;

struct Prepared {
    spec: JobSpec,
    adapter_id: String,
    details: bool,
    full_text: Option<String>,
    seed: Option<u64>,
    eos: Vec<u32>,
}

async fn prepare(req: &HttpRequest, state: &AppState, payload: web::Payload) -> Result<(infer::Admitted, Prepared), ApiError> {
    let caller = infer::admitted(req, state).await?;
    let body: GenerateRequest = json_body(state, payload).await?;
    let p = body.parameters;
    let _ = (&p.api_token, body.stream);
    if p.merged_adapters.as_ref().is_some_and(|v| !v.is_null()) {
        return Err(unsupported("merged_adapters", "name one adapter in `adapter_id`"));
    }
    if let Some(src) = &p.adapter_source
        && src != "local"
        && src != "hub"
    {
        return Err(unsupported("adapter_source", "adapters are uploaded through POST /v1/adapters and named by `adapter_id`"));
    }
    if p.watermark {
        return Err(unsupported("watermark", "no watermarking is offered"));
    }
    if p.typical_p.is_some() {
        return Err(unsupported("typical_p", "use top_p, top_k or min_p"));
    }
    if p.best_of.is_some_and(|b| b > 1) {
        return Err(unsupported("best_of", "one sequence per request; use the OpenAI endpoint's `n`"));
    }
    if p.decoder_input_details {
        return Err(unsupported("decoder_input_details", "prompt logprobs are not computed"));
    }
    let grammar = super::structured::response_format(p.response_format.as_ref())?.map(super::structured::GrammarSource::Spec);
    if body.inputs.is_empty() {
        return Err(ApiError::Invalid("`inputs` must not be empty".into()));
    }
    if p.truncate == Some(0) {
        return Err(ApiError::Invalid("`truncate` must be at least 1".into()));
    }
    // LoRAX samples when asked to or when a sampling parameter departs from its default.
    let sampling = p.do_sample || p.temperature.is_some_and(|t| t != 1.0) || p.top_k.is_some() || p.top_p.is_some();
    let knobs = Knobs {
        max_tokens: p.max_new_tokens,
        temperature: Some(if sampling { p.temperature.unwrap_or(1.0) } else { 0.0 }),
        top_p: p.top_p,
        top_k: p.top_k.map(|k| i32::try_from(k).unwrap_or(i32::MAX)),
        repetition_penalty: p.repetition_penalty,
        seed: p.seed,
        logprobs: Some(p.return_k_alternatives.unwrap_or(0)),
        stop: p.stop.clone(),
        ignore_eos: p.ignore_eos_token,
        ..Knobs::default()
    };
    knobs.check()?;
    let adapter_id = p.adapter_id.clone().unwrap_or_default();
    let target = if adapter_id.is_empty() { Target::Base } else { infer::resolve(state, &caller.caller.tenant.id, &adapter_id).await? };
    let eos = state.tokenizer.eos_token_ids().to_vec();
    let full_text = p.return_full_text.then(|| body.inputs.clone());
    let spec = JobSpec {
        endpoint: "generate",
        prompts: vec![Prompt::Text(body.inputs)],
        knobs,
        default_max: DefaultMax::Tokens(DEFAULT_MAX_NEW_TOKENS),
        truncate: p.truncate,
        target,
        grammar,
        batch: None,
        peer: Peer::of(req),
    };
    let prepared = Prepared { spec, adapter_id, details: p.details, full_text, seed: p.seed, eos };
    Ok((caller, prepared))
}

fn finish_reason(reason: Option<FinishReason>, last: Option<&TokenOut>, eos: &[u32]) -> &'static str {
    match reason {
        Some(FinishReason::Length) | None => "length",
        Some(FinishReason::Stop) if last.is_some_and(|t| eos.contains(&t.token)) => "eos_token",
        Some(FinishReason::Stop) => "stop_sequence",
    }
}

fn token_json(state: &AppState, t: &TokenOut, eos: &[u32]) -> Value {
    let mut v = json!({"id": t.token, "text": t.text, "logprob": t.logprob, "special": eos.contains(&t.token), "skipped": false});
    if !t.top_logprobs.is_empty() {
        v["alternative_tokens"] = t.top_logprobs.iter().map(|&(id, lp)| json!({"id": id, "text": infer::token_text(state, id), "logprob": lp})).collect();
    }
    v
}

fn headers(res: &mut HttpResponseBuilder, state: &AppState, adapter_id: &str, prompt_tokens: usize, usage: Option<&Usage>) {
    let adapter = if adapter_id.is_empty() { &*state.model_name } else { adapter_id };
    res.insert_header(("x-adapter-id", adapter.to_string()))
        .insert_header(("x-compute-type", state.serving.device_name().to_string()))
        .insert_header(("x-prompt-tokens", prompt_tokens.to_string()));
    if let Some(u) = usage {
        let per_token = if u.completion_tokens > 0 { u.total_time.as_millis() / u.completion_tokens as u128 } else { 0 };
        res.insert_header(("x-generated-tokens", u.completion_tokens.to_string()))
            .insert_header(("x-total-time", u.total_time.as_millis().to_string()))
            .insert_header(("x-queue-time", u.queue_time.as_millis().to_string()))
            .insert_header(("x-time-per-token", per_token.to_string()));
    }
}

/// `POST /generate`; errors in LoRAX's shape.
async fn generate(req: HttpRequest, state: web::Data<AppState>, payload: web::Payload) -> HttpResponse {
    generated(req, state, payload).await.unwrap_or_else(|e| e.lorax_response())
}

async fn generated(req: HttpRequest, state: web::Data<AppState>, payload: web::Payload) -> Result<HttpResponse, ApiError> {
    let (caller, p) = prepare(&req, &state, payload).await?;
    let peer = p.spec.peer.clone();
    let job = infer::start(&state, caller, p.spec).await?;
    let prompt_tokens = job.prompt_tokens;
    let (samples, usage) = infer::gather(job, 1, 1, &peer).await?;
    let g = &samples[0][0];
    let text = match &p.full_text {
        Some(input) => format!("{input}{}", g.text),
        None => g.text.clone(),
    };
    let mut body = json!({"generated_text": text});
    if p.details {
        body["details"] = json!({
            "finish_reason": finish_reason(g.finish, g.tokens.last(), &p.eos),
            "prompt_tokens": usage.prompt_tokens,
            "generated_tokens": usage.completion_tokens,
            "skipped_tokens": 0,
            "seed": p.seed,
            "prefill": [],
            "tokens": g.tokens.iter().map(|t| token_json(&state, t, &p.eos)).collect::<Vec<_>>(),
        });
    }
    let mut res = HttpResponse::Ok();
    headers(&mut res, &state, &p.adapter_id, prompt_tokens, Some(&usage));
    Ok(res.json(body))
}

struct Streaming {
    state: AppState,
    job: Job,
    peer: Peer,
    eos: Vec<u32>,
    seed: Option<u64>,
    text: String,
    /// A token held back until the next event says whether it is the last.
    held: Option<TokenOut>,
    done: bool,
}

impl Streaming {
    async fn next(&mut self) -> Option<Bytes> {
        if self.done {
            return None;
        }
        // The first token is held back without writing anything: each token goes out once
        // the next event says whether it is the last.
        // `None` from `next_event`: the client went away; ending the body cancels the job.
        let mut event = infer::next_event(&mut self.job, &self.peer).await?;
        while self.held.is_none()
            && let Some(JobEvent::Token { token, .. }) = event
        {
            self.text.push_str(&token.text);
            self.held = Some(token);
            event = infer::next_event(&mut self.job, &self.peer).await?;
        }
        match event {
            Some(JobEvent::Token { token, .. }) => {
                self.text.push_str(&token.text);
                // The final token goes out with the details, once the usage is committed.
                let t = self.held.replace(token)?;
                Some(sse(&json!({"token": token_json(&self.state, &t, &self.eos), "generated_text": null, "details": null})))
            }
            Some(JobEvent::Done(usage)) => {
                self.done = true;
                let last = self.held.take()?;
                let details = json!({
                    "finish_reason": finish_reason(last.finish, Some(&last), &self.eos),
                    "prompt_tokens": usage.prompt_tokens,
                    "generated_tokens": usage.completion_tokens,
                    "seed": self.seed,
                });
                Some(sse(&json!({"token": token_json(&self.state, &last, &self.eos), "generated_text": self.text, "details": details})))
            }
            Some(JobEvent::Failed(e)) => {
                self.done = true;
                Some(sse(&e.lorax_body()))
            }
            None => {
                self.done = true;
                Some(sse(&ApiError::Unavailable("the request ended without a result".into()).lorax_body()))
            }
        }
    }
}

/// `POST /generate_stream`; errors in LoRAX's shape, before the stream and inside it.
async fn generate_stream(req: HttpRequest, state: web::Data<AppState>, payload: web::Payload) -> HttpResponse {
    streamed(req, state, payload).await.unwrap_or_else(|e| e.lorax_response())
}

async fn streamed(req: HttpRequest, state: web::Data<AppState>, payload: web::Payload) -> Result<HttpResponse, ApiError> {
    let (caller, p) = prepare(&req, &state, payload).await?;
    let peer = p.spec.peer.clone();
    let job = infer::start(&state, caller, p.spec).await?;
    let mut res = HttpResponse::Ok();
    headers(&mut res, &state, &p.adapter_id, job.prompt_tokens, None);
    let s = Streaming { state: (**state).clone(), job, peer, eos: p.eos, seed: p.seed, text: p.full_text.unwrap_or_default(), held: None, done: false };
    let body = futures::stream::unfold(s, |mut s| async move { s.next().await.map(|b| (Ok::<_, std::convert::Infallible>(b), s)) });
    Ok(res.content_type("text/event-stream").insert_header(("cache-control", "no-cache")).streaming(body))
}
