//! `components.schemas` of the document: the request bodies as the handlers' serde structs read
//! them, and the response bodies as the handlers write them.
//!
//! Conventions, from serde: an `Option` field also accepts `null` (`nullable`); a field with
//! `#[serde(default)]` may be left out but is not nullable; `deny_unknown_fields` is
//! `additionalProperties: false`. Counts the server reads as `u32` are bounded to its range.
//! Request bounds the server checks after parsing (n, logprobs, stop strings, sampling ranges)
//! are written where OpenAPI can say them; values outside them are answered with 400.

use serde_json::{Map, Value, json};

mod batch;

use crate::api::structured::MAX_CHOICES;
use crate::api::tools::MAX_TOOLS;
use crate::api::validate::{CHAT_ROLES, MAX_MESSAGES, MAX_PROMPTS, MAX_STOP_BYTES, MAX_STOPS};
use crate::request::MAX_SAMPLES;
use crate::sampling::MAX_LOGPROBS;
use crate::store::MAX_WEIGHT;

/// A reference to a schema of this document.
pub fn r(name: &str) -> Value {
    json!({"$ref": format!("#/components/schemas/{name}")})
}

/// `schema` that also accepts `null`.
fn nullable(mut schema: Value) -> Value {
    if schema.get("$ref").is_some() {
        // Siblings of `$ref` are ignored in OpenAPI 3.0.
        return json!({"allOf": [schema], "nullable": true});
    }
    schema["nullable"] = true.into();
    if let Some(values) = schema.get_mut("enum").and_then(Value::as_array_mut) {
        values.push(Value::Null);
    }
    schema
}

fn described(mut schema: Value, description: &str) -> Value {
    schema["description"] = description.into();
    schema
}

/// An integer in `[min, max]`.
fn uint(min: u64, max: u64) -> Value {
    json!({"type": "integer", "minimum": min, "maximum": max})
}

/// An unsigned 32-bit count, at least `min`.
fn u32_from(min: u64) -> Value {
    uint(min, u32::MAX.into())
}

fn int64() -> Value {
    json!({"type": "integer", "format": "int64", "minimum": i64::MIN, "maximum": i64::MAX})
}

/// A count the server keeps as a non-negative `i64`.
fn count() -> Value {
    json!({"type": "integer", "format": "int64", "minimum": 0, "maximum": i64::MAX})
}

fn string() -> Value {
    json!({"type": "string"})
}

fn boolean() -> Value {
    json!({"type": "boolean"})
}

fn number() -> Value {
    json!({"type": "number"})
}

fn array(items: Value) -> Value {
    json!({"type": "array", "items": items})
}

fn constant(value: &str) -> Value {
    json!({"type": "string", "enum": [value]})
}

/// An object with these properties, all of them required.
fn record(properties: Value) -> Value {
    let required: Vec<Value> = properties.as_object().map(|p| p.keys().cloned().map(Value::from).collect()).unwrap_or_default();
    json!({"type": "object", "required": required, "properties": properties})
}

/// `object` with one more required property.
fn with(mut object: Value, name: &str, schema: Value) -> Value {
    if let Some(required) = object["required"].as_array_mut() {
        required.push(name.into());
    }
    object["properties"][name] = schema;
    object
}

/// A request object: these properties, `required` of them needed, no others.
fn strict(required: &[&str], properties: Value) -> Value {
    let mut v = json!({"type": "object", "additionalProperties": false, "properties": properties});
    if !required.is_empty() {
        // OpenAPI 3.0 wants a `required` list to have an item.
        v["required"] = required.into();
    }
    v
}

/// A field the server accepts for compatibility only while it asks for nothing: `null`, or
/// absent; anything else is refused with 400.
fn only_null(what: &str) -> Value {
    json!({"nullable": true, "enum": [null], "description": format!("Not supported ({what}): only null is accepted.")})
}

/// A 32-bit float in `[min, max]`. The server reads JSON numbers as `f32`: a positive bound is
/// the smallest positive `f32` (anything smaller reads as 0), and past `f32::MAX` is infinity.
fn float(min: f32, max: f32) -> Value {
    json!({"type": "number", "format": "float", "minimum": min, "maximum": max})
}

/// The smallest positive `f32`.
const TINY: f32 = f32::from_bits(1);

fn temperature() -> Value {
    nullable(described(float(0.0, f32::MAX), "0 is greedy decoding."))
}

fn top_p() -> Value {
    nullable(float(TINY, 1.0))
}

fn min_p() -> Value {
    nullable(float(0.0, 1.0))
}

fn penalty() -> Value {
    nullable(float(-2.0, 2.0))
}

fn repetition_penalty() -> Value {
    nullable(described(float(TINY, f32::MAX), "1 is off."))
}

fn top_k() -> Value {
    nullable(json!({"type": "integer", "minimum": -1, "maximum": i32::MAX, "description": "-1 or 0: off."}))
}

fn n() -> Value {
    nullable(described(uint(1, MAX_SAMPLES.into()), "Samples per prompt."))
}

fn logprobs_count() -> Value {
    nullable(uint(0, MAX_LOGPROBS as u64))
}

fn stop_string() -> Value {
    json!({"type": "string", "minLength": 1, "maxLength": MAX_STOP_BYTES, "description": format!("At most {MAX_STOP_BYTES} bytes of UTF-8.")})
}

fn token_id() -> Value {
    json!({"type": "integer", "minimum": 0, "maximum": u32::MAX, "description": "A token id of the model's vocabulary."})
}

// ---------------------------------------------------------------------------------------------
// Shared

fn error() -> Value {
    let codes = [
        "missing_api_key",
        "invalid_api_key",
        "insufficient_scope",
        "not_found",
        "invalid_request",
        "invalid_lines",
        "conflict",
        "payload_too_large",
        "rate_limit_exceeded",
        "quota_exceeded",
        "server_overloaded",
        "unavailable",
        "request_timeout",
        "cancelled",
        "internal_error",
    ];
    let types = ["authentication_error", "permission_error", "not_found_error", "invalid_request_error", "rate_limit_error", "server_error"];
    let line = record(json!({"line": described(count(), "From 1."), "custom_id": nullable(string()), "message": string()}));
    let mut body = record(json!({
        "message": string(),
        "type": {"type": "string", "enum": types},
        "param": described(nullable(string()), "The request's field the error is about, where it is about one."),
        "code": {"type": "string", "enum": codes},
    }));
    body["properties"]["lines"] = described(array(line), "With `invalid_lines`: the problem of each invalid line of a file (the first 100).");
    record(json!({"error": body}))
}

fn usage() -> Value {
    record(json!({
        "prompt_tokens": count(),
        "completion_tokens": count(),
        "total_tokens": count(),
        "prompt_tokens_details": described(record(json!({"cached_tokens": count()})), "Prompt tokens served from the prefix cache."),
    }))
}

fn finish_reason() -> Value {
    json!({"type": "string", "enum": ["stop", "length", null], "nullable": true})
}

// ---------------------------------------------------------------------------------------------
// OpenAI

fn stop() -> Value {
    json!({"anyOf": [
        nullable(stop_string()),
        json!({"type": "array", "maxItems": MAX_STOPS, "items": stop_string()}),
    ], "description": format!("A stop string or a list of at most {MAX_STOPS}.")})
}

fn stream_options() -> Value {
    nullable(json!({
        "type": "object",
        "additionalProperties": false,
        "properties": {"include_usage": boolean()},
        "description": "Only with `stream: true`. `include_usage` adds a last chunk with the usage.",
    }))
}

fn prompt() -> Value {
    let text = json!({"type": "string", "minLength": 1});
    let ids = json!({"type": "array", "minItems": 1, "items": token_id()});
    json!({
        "anyOf": [
            text.clone(),
            json!({"type": "array", "minItems": 1, "maxItems": MAX_PROMPTS, "items": text}),
            ids.clone(),
            json!({"type": "array", "minItems": 1, "maxItems": MAX_PROMPTS, "items": ids}),
        ],
        "description": format!("A string, a list of strings, a list of token ids, or a list of lists of token ids (at most {MAX_PROMPTS} prompts)."),
    })
}

/// A request of OpenAI's: fields it does not name are accepted and ignored (and named in the
/// response's `x-ignored-fields`), as vLLM does, unless they would change the answer.
fn open(mut request: Value) -> Value {
    request["additionalProperties"] =
        json!({"description": "Ignored, and named in the response's `x-ignored-fields` header (those that would change the answer are refused)."});
    request
}

fn completion_request() -> Value {
    open(strict(
        &["model", "prompt"],
        generation_fields(json!({
            "prompt": r("Prompt"),
            "max_tokens": nullable(described(u32_from(1), "Default 16.")),
            "logprobs": logprobs_count(),
            "echo": nullable(json!({"type": "boolean", "enum": [false], "description": "Not supported: only false is accepted."})),
            "best_of": nullable(described(u32_from(0), "Accepted only when equal to `n`.")),
            "suffix": only_null("no insertion mode"),
        })),
    ))
}

/// The fields both OpenAI generation requests take, with `specific`'s.
fn generation_fields(specific: Value) -> Value {
    let mut v = json!({
        "model": described(string(), "The base model, an adapter the key's tenant may use, or `name@version`."),
        "temperature": nullable(described(float(0.0, 2.0), "0 is greedy decoding; at most 2, as OpenAI.")),
        "top_p": top_p(),
        "n": n(),
        "stop": r("Stop"),
        "seed": nullable(int64()),
        "presence_penalty": penalty(),
        "frequency_penalty": penalty(),
        "stream": nullable(boolean()),
        "stream_options": stream_options(),
        "user": nullable(string()),
        "top_k": top_k(),
        "min_p": min_p(),
        "repetition_penalty": repetition_penalty(),
        "ignore_eos": nullable(boolean()),
        "logit_bias": nullable(json!({"type": "object", "maxProperties": 0, "description": "Not supported: only an empty object is accepted."})),
        "response_format": nullable(r("ResponseFormat")),
        "structured_outputs": nullable(r("StructuredOutputs")),
        "guided_json": described(nullable(json!({"anyOf": [json_schema(), string()]})), "vLLM: output valid against this JSON schema (or its JSON text); not strict."),
        "guided_regex": described(nullable(string()), "vLLM: output matching this regular expression whole."),
        "guided_choice": described(nullable(json!({"type": "array", "minItems": 1, "maxItems": MAX_CHOICES, "items": {"type": "string", "minLength": 1}})), "vLLM: exactly one of these strings."),
        "guided_grammar": described(nullable(string()), "vLLM: output of this Lark grammar (llguidance's dialect)."),
        "guided_decoding_backend": described(nullable(string()), "Accepted for compatibility (auto, guidance, llguidance, xgrammar, outlines, lm-format-enforcer): every constraint runs on llguidance."),
        "guided_whitespace_pattern": described(nullable(string()), "vLLM: the whitespace allowed between JSON tokens (default: none)."),
    });
    if let (Some(all), Value::Object(more)) = (v.as_object_mut(), specific) {
        all.extend(more);
    }
    v
}

/// A JSON schema (an object, or `true`).
fn json_schema() -> Value {
    json!({"anyOf": [{"type": "object"}, {"type": "boolean"}], "description": "A JSON schema."})
}

fn response_format() -> Value {
    json!({
        "type": "object",
        "required": ["type"],
        "properties": {
            "type": {"type": "string", "enum": ["text", "json_object", "json_schema"]},
            "json_schema": {
                "type": "object",
                "properties": {
                    "name": string(),
                    "description": string(),
                    "schema": nullable(json_schema()),
                    "strict": described(nullable(boolean()), "true: every keyword is enforced, or the schema is refused with 400; otherwise keywords that cannot be enforced are skipped."),
                },
                "description": "With type json_schema: the schema the output must be valid against.",
            },
            "schema": described(nullable(json!({"anyOf": [json_schema(), string()]})), "LoRAX: with type json_object, the schema to enforce."),
        },
        "description": "text: free text; json_object: any JSON object (or, LoRAX, valid against `schema`); json_schema: valid against `json_schema.schema`.",
    })
}

fn structured_outputs() -> Value {
    json!({
        "type": "object",
        "properties": {
            "json": nullable(json!({"anyOf": [json_schema(), string()]})),
            "regex": nullable(string()),
            "choice": nullable(json!({"type": "array", "minItems": 1, "maxItems": MAX_CHOICES, "items": {"type": "string", "minLength": 1}})),
            "grammar": described(nullable(string()), "Lark, in llguidance's dialect."),
            "json_object": nullable(boolean()),
            "whitespace_pattern": nullable(string()),
            "disable_any_whitespace": nullable(boolean()),
            "disable_fallback": nullable(boolean()),
            "backend": nullable(string()),
        },
        "description": "vLLM's structured outputs: one of json, regex, choice, grammar, json_object.",
    })
}

fn tool() -> Value {
    json!({
        "type": "object",
        "required": ["type", "function"],
        "properties": {
            "type": constant("function"),
            "function": {
                "type": "object",
                "required": ["name"],
                "properties": {
                    "name": {"type": "string", "pattern": "^[A-Za-z0-9_-]{1,64}$"},
                    "description": nullable(string()),
                    "parameters": described(nullable(json!({"type": "object"})), "A JSON schema; the arguments of every call are generated valid against it (or the request is refused with 400)."),
                    "strict": nullable(boolean()),
                },
            },
        },
    })
}

fn tool_choice() -> Value {
    json!({
        "anyOf": [
            {"type": "string", "enum": ["none", "auto", "required"]},
            {"type": "object", "required": ["type", "function"], "properties": {"type": constant("function"), "function": {"type": "object", "required": ["name"], "properties": {"name": string()}}}},
        ],
        "description": "none: text only; auto (the default with tools): text or calls; required: one call or more; a function: one call of it.",
    })
}

fn tool_call(index: bool) -> Value {
    let v = record(
        json!({"id": string(), "type": constant("function"), "function": record(json!({"name": string(), "arguments": described(string(), "The arguments object as JSON text.")}))}),
    );
    if index { with(v, "index", count()) } else { v }
}

fn chat_finish_reason() -> Value {
    json!({"type": "string", "enum": ["stop", "length", "tool_calls", null], "nullable": true})
}

fn chat_message() -> Value {
    let part = json!({
        "type": "object",
        "required": ["type", "text"],
        "properties": {"type": constant("text"), "text": string()},
    });
    json!({
        "type": "object",
        "required": ["role"],
        "properties": {
            "role": {"type": "string", "enum": CHAT_ROLES},
            "content": {"anyOf": [nullable(string()), array(part)], "description": "Text, or a list of text parts (concatenated); null or absent is empty."},
            "tool_calls": described(nullable(array(json!({"type": "object"}))), "An assistant's calls, as the API returned them."),
            "tool_call_id": described(nullable(string()), "A tool's message: the call it answers."),
            "name": nullable(string()),
        },
    })
}

fn chat_request() -> Value {
    open(strict(
        &["model", "messages"],
        generation_fields(json!({
            "messages": {"type": "array", "minItems": 1, "maxItems": MAX_MESSAGES, "items": r("ChatMessage")},
            "max_tokens": nullable(u32_from(1)),
            "max_completion_tokens": nullable(described(u32_from(1), "Default: the rest of the context. If `max_tokens` is given too, they must be equal.")),
            "logprobs": nullable(boolean()),
            "top_logprobs": nullable(described(uint(0, MAX_LOGPROBS as u64), "Needs `logprobs: true`.")),
            "tools": nullable(json!({"type": "array", "maxItems": MAX_TOOLS, "items": r("Tool"), "description": "Functions the model may call (through its chat template)."})),
            "tool_choice": nullable(r("ToolChoice")),
            "parallel_tool_calls": described(nullable(boolean()), "Default true: several calls in one answer."),
        })),
    ))
}

fn completion_logprobs() -> Value {
    nullable(record(json!({
        "tokens": array(string()),
        "token_logprobs": array(nullable(number())),
        "top_logprobs": array(json!({"type": "object", "additionalProperties": nullable(number())})),
        "text_offset": array(count()),
    })))
}

fn chat_logprob() -> Value {
    record(json!({"token": string(), "logprob": nullable(number()), "bytes": array(json!({"type": "integer", "minimum": 0, "maximum": 255}))}))
}

fn chat_logprobs() -> Value {
    let entry = with(chat_logprob(), "top_logprobs", array(chat_logprob()));
    nullable(record(json!({"content": array(entry)})))
}

/// The fields every completion object and chunk has.
fn completion_object(object: &str, choice: Value) -> Value {
    record(json!({
        "id": string(),
        "object": constant(object),
        "created": described(count(), "Unix seconds."),
        "model": string(),
        "choices": array(choice),
    }))
}

fn completion() -> Value {
    let choice = record(json!({"index": count(), "text": string(), "logprobs": completion_logprobs(), "finish_reason": finish_reason()}));
    with(completion_object("text_completion", choice), "usage", r("Usage"))
}

fn chat_completion() -> Value {
    let message = json!({
        "type": "object",
        "required": ["role", "content"],
        "properties": {
            "role": constant("assistant"),
            "content": described(nullable(string()), "null when the answer is tool calls."),
            "tool_calls": array(tool_call(false)),
        },
    });
    let choice = record(json!({"index": count(), "message": message, "logprobs": chat_logprobs(), "finish_reason": chat_finish_reason()}));
    with(completion_object("chat.completion", choice), "usage", r("Usage"))
}

/// A chunk of a stream: `usage` is there (null until the last chunk) with `include_usage`.
fn chunk(object: &str, choice: Value) -> Value {
    let mut v = completion_object(object, choice);
    v["properties"]["usage"] = nullable(r("Usage"));
    v
}

fn completion_chunk() -> Value {
    chunk("text_completion", record(json!({"index": count(), "text": string(), "logprobs": completion_logprobs(), "finish_reason": finish_reason()})))
}

fn chat_completion_chunk() -> Value {
    let delta = json!({
        "type": "object",
        "properties": {"role": constant("assistant"), "content": string(), "tool_calls": described(array(tool_call(true)), "Sent whole, once the choice ends.")},
    });
    chunk("chat.completion.chunk", record(json!({"index": count(), "delta": delta, "logprobs": chat_logprobs(), "finish_reason": chat_finish_reason()})))
}

/// One server-sent event whose `data` is a JSON value of one of `schemas` (or `[DONE]`). What
/// the JSON is, is said with JSON Schema's `contentMediaType` and `contentSchema`, which
/// OpenAPI 3.0 only allows as extensions (`x-`); `.ci/schemathesis` reads them.
/// LoRAX's error body, on its routes.
fn lorax_error() -> Value {
    record(json!({
        "error": described(string(), "The message."),
        "error_type": described(json!({"type": "string", "enum": crate::api::LORAX_ERROR_TYPES}), "What kind of error: LoRAX's own, and `authentication` and `not_found`."),
    }))
}

fn event(schemas: &[&str], done: bool) -> Value {
    let json_data = json!({
        "type": "string",
        "description": format!("JSON: {}.", schemas.join(" or ")),
        "x-contentMediaType": "application/json",
        "x-contentSchema": {"anyOf": schemas.iter().map(|s| r(s)).collect::<Vec<_>>()},
    });
    let data = if done { json!({"anyOf": [constant("[DONE]"), json_data]}) } else { json_data };
    json!({
        "type": "object",
        "required": ["data"],
        "properties": {"data": data, "event": string()},
        "description": "One server-sent event (`data: JSON`); a failure ends the stream with an Error event.",
    })
}

fn model() -> Value {
    json!({
        "type": "object",
        "required": ["id", "object", "created", "owned_by", "root", "parent"],
        "properties": {
            "id": string(),
            "object": constant("model"),
            "created": described(count(), "Unix seconds."),
            "owned_by": string(),
            "root": described(string(), "The base model's name, or the adapter's `name@version`."),
            "parent": described(nullable(string()), "null for the base model, else the base model's name."),
            "max_model_len": described(count(), "The base model's context, in tokens."),
            "version": count(),
            "rank": count(),
        },
    })
}

// ---------------------------------------------------------------------------------------------
// LoRAX

fn generate_request() -> Value {
    strict(
        &["inputs"],
        json!({
            "inputs": {"type": "string", "minLength": 1},
            "parameters": r("GenerateParameters"),
            "stream": described(nullable(boolean()), "Accepted and ignored: /generate_stream streams, /generate does not."),
        }),
    )
}

fn generate_parameters() -> Value {
    strict(
        &[],
        json!({
            "adapter_id": described(nullable(string()), "An adapter the key's tenant may use, or `name@version`; absent or empty: the base model."),
            "adapter_source": nullable(json!({"type": "string", "enum": ["local", "hub"]})),
            "merged_adapters": only_null("name one adapter in `adapter_id`"),
            "api_token": nullable(string()),
            "do_sample": boolean(),
            "max_new_tokens": nullable(described(u32_from(1), "Default 20.")),
            "ignore_eos_token": boolean(),
            "repetition_penalty": repetition_penalty(),
            "return_full_text": boolean(),
            "stop": {"type": "array", "maxItems": MAX_STOPS, "items": stop_string()},
            "seed": nullable(json!({"type": "integer", "minimum": 0, "maximum": u64::MAX})),
            "temperature": temperature(),
            "top_k": nullable(u32_from(0)),
            "top_p": top_p(),
            "truncate": nullable(described(u32_from(1), "Keep only the last this many prompt tokens.")),
            "typical_p": only_null("use top_p, top_k or min_p"),
            "best_of": nullable(uint(0, 1)),
            "watermark": {"type": "boolean", "enum": [false], "description": "Not supported: only false is accepted."},
            "details": boolean(),
            "decoder_input_details": {"type": "boolean", "enum": [false], "description": "Not supported: only false is accepted."},
            "return_k_alternatives": logprobs_count(),
            "response_format": nullable(r("ResponseFormat")),
        }),
    )
}

fn lorax_token() -> Value {
    let alternative = record(json!({"id": token_id(), "text": string(), "logprob": nullable(number())}));
    json!({
        "type": "object",
        "required": ["id", "text", "logprob", "special", "skipped"],
        "properties": {
            "id": token_id(),
            "text": string(),
            "logprob": nullable(number()),
            "special": boolean(),
            "skipped": boolean(),
            "alternative_tokens": array(alternative),
        },
    })
}

fn lorax_finish() -> Value {
    json!({"type": "string", "enum": ["length", "eos_token", "stop_sequence"]})
}

fn generated() -> Value {
    let details = record(json!({
        "finish_reason": lorax_finish(),
        "prompt_tokens": count(),
        "generated_tokens": count(),
        "skipped_tokens": count(),
        "seed": nullable(json!({"type": "integer", "minimum": 0, "maximum": u64::MAX})),
        "prefill": array(json!({})),
        "tokens": array(r("LoraxToken")),
    }));
    json!({
        "type": "object",
        "required": ["generated_text"],
        "properties": {"generated_text": string(), "details": described(details, "With `parameters.details`.")},
    })
}

fn stream_token() -> Value {
    let details = nullable(record(json!({
        "finish_reason": lorax_finish(),
        "prompt_tokens": count(),
        "generated_tokens": count(),
        "seed": nullable(json!({"type": "integer", "minimum": 0, "maximum": u64::MAX})),
    })));
    record(json!({
        "token": r("LoraxToken"),
        "generated_text": described(nullable(string()), "The whole text, on the last event only."),
        "details": described(details, "On the last event only."),
    }))
}

// ---------------------------------------------------------------------------------------------
// Tenants, keys, adapters

fn tenant_name() -> Value {
    json!({"type": "string", "minLength": 1, "maxLength": 64, "pattern": "^[A-Za-z0-9_-][A-Za-z0-9._-]*$", "description": "Letters, digits, '-', '_' and '.', not starting with '.'."})
}

fn weight() -> Value {
    json!({"type": "number", "minimum": 0, "exclusiveMinimum": true, "maximum": MAX_WEIGHT, "description": "The tenant's share of the server against others'. Default 1."})
}

fn plan() -> Value {
    json!({"type": "string", "minLength": 1, "maxLength": 64, "pattern": "^[A-Za-z0-9_-][A-Za-z0-9._-]*$", "description": "A price plan's name (`GET /admin/plans`). Default standard."})
}

/// A price: micro-dollars per million tokens.
fn price() -> Value {
    json!({"type": "integer", "format": "int64", "minimum": 0, "maximum": crate::store::MAX_PRICE, "description": "Micro-dollars per million tokens."})
}

fn percent() -> Value {
    json!({"type": "integer", "format": "int64", "minimum": 0, "maximum": 100, "description": "Percent of the prices a token of batch work costs."})
}

fn plan_record() -> Value {
    record(json!({
        "name": plan(),
        "prompt_price": price(),
        "cached_prompt_price": price(),
        "completion_price": price(),
        "batch_percent": percent(),
        "batch_prices": record(json!({"prompt_price": price(), "cached_prompt_price": price(), "completion_price": price()})),
    }))
}

fn business_schemas() -> Vec<(&'static str, Value)> {
    let quota = record(json!({"used": count(), "limit": nullable(count()), "left": described(nullable(count()), "null: unlimited.")}));
    vec![
        ("Plan", plan_record()),
        ("PlanList", record(json!({"data": array(r("Plan"))}))),
        (
            "NewPlan",
            strict(
                &["name", "prompt_price", "cached_prompt_price", "completion_price"],
                json!({"name": plan(), "prompt_price": price(), "cached_prompt_price": price(), "completion_price": price(), "batch_percent": percent()}),
            ),
        ),
        ("PlanPatch", strict(&[], json!({"prompt_price": price(), "cached_prompt_price": price(), "completion_price": price(), "batch_percent": percent()}))),
        (
            "PriceOverride",
            strict(
                &[],
                json!({"prompt_price": nullable(price()), "cached_prompt_price": nullable(price()), "completion_price": nullable(price()), "batch_percent": nullable(percent())}),
            ),
        ),
        (
            "TenantPrices",
            record(json!({
                "plan": r("Plan"),
                "override": r("PriceOverride"),
                "effective": r("Plan"),
            })),
        ),
        (
            "AuditLog",
            record(json!({"data": array(record(json!({
                "id": string(),
                "at": described(count(), "Unix milliseconds."),
                "actor": described(nullable(string()), "The tenant that made the change; null for the operator."),
                "actor_name": nullable(string()),
                "key_id": described(string(), "The key it was made with."),
                "tenant_id": described(nullable(string()), "The tenant it is about."),
                "tenant": nullable(string()),
                "action": described(string(), "`thing.verb`: tenant.create, key.revoke, plan.update, adapter.upload, ..."),
                "target": described(string(), "What it was done to: an id or a name."),
                "detail": described(json!({}), "The change's fields."),
            })))})),
        ),
        (
            "Me",
            record(json!({
                "tenant": record(json!({"id": string(), "name": string(), "weight": number(), "plan": plan(), "created_at": count()})),
                "prices": r("Plan"),
                "limits": r("TenantLimits"),
                "key": record(json!({"id": string(), "prefix": string(), "scopes": array(string())})),
                "quotas": record(json!({"adapters": quota.clone(), "adapter_bytes": quota.clone(), "file_bytes": quota.clone(), "keys": quota})),
            })),
        ),
    ]
}

const LIMITS: [&str; 6] = ["requests_per_min", "tokens_per_min", "max_concurrent", "max_adapters", "max_adapter_bytes", "max_pinned_pages"];

fn tenant_limits() -> Value {
    let properties: Map<String, Value> = LIMITS.iter().map(|l| (l.to_string(), nullable(count()))).collect();
    json!({
        "type": "object",
        "additionalProperties": false,
        "properties": properties,
        "description": "Per-tenant limits; null or absent is unlimited (for max_pinned_pages: the server's default share). In a patch, absent leaves a limit as it is and null clears it.",
    })
}

fn create_tenant() -> Value {
    strict(&["name"], json!({"name": tenant_name(), "weight": weight(), "plan": plan(), "limits": r("TenantLimits")}))
}

fn tenant_patch() -> Value {
    let mut v = strict(&[], json!({"weight": weight(), "plan": plan(), "limits": r("TenantLimits")}));
    v["description"] = "A JSON merge patch (RFC 7396): absent fields stay; `weight`, `plan` and `limits` cannot be null.".into();
    v
}

fn tenant() -> Value {
    let mut properties = json!({
        "id": string(),
        "name": string(),
        "weight": number(),
        "plan": string(),
        "created_at": described(count(), "Unix milliseconds."),
    });
    for l in LIMITS {
        properties[l] = nullable(count());
    }
    record(properties)
}

fn scope() -> Value {
    json!({"type": "string", "enum": ["inference", "adapters", "admin", "metrics"]})
}

fn key_request() -> Value {
    strict(
        &[],
        json!({"scopes": {
            "type": "array",
            "minItems": 1,
            "items": r("Scope"),
            "description": "A tenant's key: inference and/or adapters (the default). An operator's key: admin and/or metrics.",
        }}),
    )
}

/// A histogram as `/admin/stats` gives it.
fn histogram() -> Value {
    record(json!({
        "le": described(array(json!({"type": "number"})), "Upper bounds of the buckets, in seconds."),
        "cumulative": described(array(count()), "Observations at or below each bound."),
        "count": count(),
        "sum": json!({"type": "number"}),
    }))
}

fn stats() -> Value {
    let free_form = json!({"type": "object"});
    record(json!({
        "at_ms": described(count(), "When the state was read, Unix milliseconds."),
        "requests": described(json!({"type": "object", "additionalProperties": count()}), "Inference requests finished so far, by outcome."),
        "in_http": record(json!({"waiting_first_token": count(), "generating": count()})),
        "ttft_seconds": histogram(),
        "tpot_seconds": histogram(),
        "e2e_seconds": histogram(),
        "queue_seconds": histogram(),
        "workers": described(array(free_form), "Each worker: health, requests running and waiting, steps, generated tokens, pool pages by kind and evictions, prefix cache and adapter load counters."),
    }))
}

fn created_key() -> Value {
    record(json!({
        "id": string(),
        "key": described(string(), "The secret, shown only here."),
        "prefix": string(),
        "scopes": described(string(), "Its scopes, comma-separated."),
        "tenant_id": described(nullable(string()), "null for an operator's key."),
    }))
}

fn adapter() -> Value {
    record(json!({
        "id": string(),
        "name": string(),
        "version": count(),
        "owner": described(nullable(string()), "The owning tenant's id; null for the operator's adapters."),
        "public": boolean(),
        "rank": count(),
        "targets": array(string()),
        "bytes": count(),
        "content_hash": string(),
        "created_at": described(count(), "Unix milliseconds."),
        "base_model": described(nullable(string()), "The served name of the base model it was uploaded for."),
        "usable": described(boolean(), "Whether this server's base model can use it (its shape is the one it was uploaded for)."),
        "unusable_reason": described(nullable(string()), "Why it cannot be used, when it cannot."),
    }))
}

fn adapter_upload() -> Value {
    json!({
        "type": "object",
        "required": ["name", "config", "weights"],
        "properties": {
            "name": described(tenant_name(), "The adapter's name; a known name gets a new version."),
            "config": {"type": "string", "format": "binary", "maxLength": 1 << 20, "description": "adapter_config.json (at most 1 MiB)."},
            "weights": {"type": "string", "format": "binary", "description": "adapter_model.safetensors (at most --max-upload-mb)."},
        },
    })
}

/// Where an adapter version is on one worker.
fn residency() -> Value {
    json!({
        "type": "object",
        "required": ["worker", "tier"],
        "properties": {
            "worker": count(),
            "tier": described(
                json!({"type": "string", "enum": ["pool", "host", "loading", "disk", "failed", "unknown"]}),
                "pool: in pool pages; host: in host memory; loading: being read from disk; disk: only on disk; failed: its load was refused; unknown: the worker has no engine now.",
            ),
            "error": described(string(), "Why its load was refused (tier failed only)."),
        },
    })
}

fn admin_adapter(holder: bool) -> Value {
    let mut v = strict(
        &["name"],
        json!({
            "tenant_id": described(nullable(string()), "The owning tenant; absent or null for the operator's own adapters."),
            "name": string(),
        }),
    );
    if holder {
        v["properties"]["holder"] = described(nullable(string()), "Whose pin to let go: a tenant's id; absent or null for the operator's own.");
    }
    v
}

fn publish() -> Value {
    strict(
        &["name"],
        json!({
            "tenant_id": described(nullable(string()), "The owning tenant; absent or null for the operator's own adapters."),
            "name": string(),
            "public": described(boolean(), "Default true; false makes it private again."),
        }),
    )
}

// ---------------------------------------------------------------------------------------------
// Usage and billing

fn totals() -> Value {
    record(json!({
        "requests": count(),
        "prompt_tokens": count(),
        "cached_prompt_tokens": count(),
        "completion_tokens": count(),
        "total_tokens": count(),
        "cost": {"type": "string", "pattern": "^-?[0-9]+\\.[0-9]{6,12}$", "description": "Dollars, exact, as a decimal string."},
    }))
}

fn with_totals(extra: Value) -> Value {
    json!({"allOf": [r("Totals"), record(extra)]})
}

fn date() -> Value {
    json!({"type": "string", "pattern": "^-?[0-9]+-[0-9]{2}-[0-9]{2}$", "description": "YYYY-MM-DD (UTC)."})
}

fn billing_line() -> Value {
    with_totals(
        json!({"tenant_id": string(), "tenant": string(), "plan": string(), "adapter": described(string(), "`name@version`, or empty for the base model."), "date": date()}),
    )
}

fn usage_line() -> Value {
    json!({
        "allOf": [r("Totals"), {
            "type": "object",
            "properties": {"tenant_id": string(), "tenant": string(), "plan": string(), "adapter": string(), "date": date()},
        }],
        "description": "Without group_by: a billing line (tenant, plan, adapter, date); by day: date; by adapter: adapter.",
    })
}

fn usage_report() -> Value {
    record(json!({
        "object": constant("usage"),
        "tenant_id": string(),
        "from": described(int64(), "Unix seconds."),
        "to": described(int64(), "Unix seconds."),
        "group_by": nullable(json!({"type": "string", "enum": ["day", "adapter"]})),
        "data": array(r("UsageLine")),
        "totals": r("Totals"),
    }))
}

fn billing_report() -> Value {
    record(json!({
        "from": described(int64(), "Unix seconds."),
        "to": described(int64(), "Unix seconds."),
        "lines": array(r("BillingLine")),
        "tenants": array(with_totals(json!({"tenant_id": string(), "tenant": string()}))),
        "adapters": described(
            array(with_totals(json!({"tenant_id": string(), "tenant": string(), "adapter": described(string(), "`name@version`, or empty for the base model.")}))),
            "The lines summed per tenant and adapter.",
        ),
        "days": described(array(with_totals(json!({"date": date()}))), "The lines summed per day, every tenant together."),
        "totals": r("Totals"),
    }))
}

// ---------------------------------------------------------------------------------------------
// Operations of the server itself

fn ready() -> Value {
    let worker = record(json!({"worker": count(), "healthy": boolean(), "reason": nullable(string())}));
    record(json!({"status": {"type": "string", "enum": ["ready", "degraded"]}, "workers": array(worker)}))
}

/// Every schema, by name.
pub fn schemas() -> Value {
    let all: Vec<(&str, Value)> = vec![
        ("Error", error()),
        ("Usage", usage()),
        ("Stop", stop()),
        ("Prompt", prompt()),
        ("CompletionRequest", completion_request()),
        ("ChatMessage", chat_message()),
        ("ResponseFormat", response_format()),
        ("StructuredOutputs", structured_outputs()),
        ("Tool", tool()),
        ("ToolChoice", tool_choice()),
        ("ChatCompletionRequest", chat_request()),
        ("Completion", completion()),
        ("ChatCompletion", chat_completion()),
        ("CompletionChunk", completion_chunk()),
        ("ChatCompletionChunk", chat_completion_chunk()),
        ("CompletionEvent", event(&["CompletionChunk", "Error"], true)),
        ("ChatCompletionEvent", event(&["ChatCompletionChunk", "Error"], true)),
        ("Model", model()),
        ("ModelList", record(json!({"object": constant("list"), "data": array(r("Model"))}))),
        ("GenerateRequest", generate_request()),
        ("GenerateParameters", generate_parameters()),
        ("LoraxToken", lorax_token()),
        ("Generated", generated()),
        ("GenerateStreamToken", stream_token()),
        ("LoraxError", lorax_error()),
        ("GenerateEvent", event(&["GenerateStreamToken", "LoraxError"], false)),
        ("TenantLimits", tenant_limits()),
        ("CreateTenant", create_tenant()),
        ("TenantPatch", tenant_patch()),
        ("Tenant", tenant()),
        ("TenantList", record(json!({"data": array(r("Tenant"))}))),
        ("Scope", scope()),
        ("KeyRequest", key_request()),
        ("CreatedKey", created_key()),
        ("Stats", stats()),
        (
            "AllAdapters",
            record(json!({
                "object": constant("list"),
                "data": array(json!({"allOf": [r("Adapter"), record(json!({
                    "versions": described(count(), "Live versions."),
                    "bytes_all_versions": described(count(), "Bytes of every live version."),
                    "owner_name": described(nullable(string()), "The owning tenant's name; null for the operator's adapters."),
                    "residency": described(array(residency()), "Where the latest version is on each worker."),
                    "pinned_by": described(array(record(json!({
                        "tenant_id": described(nullable(string()), "The pinning tenant; null for the operator."),
                        "tenant": described(nullable(string()), "Its name; null for the operator."),
                        "version": described(count(), "The version it pins."),
                    }))), "Who keeps a version pinned in some worker's pool, one entry per holder and version."),
                }))]})),
            })),
        ),
        (
            "KeyList",
            record(json!({"data": array(record(json!({
                "id": string(),
                "tenant_id": described(nullable(string()), "null for an operator's key."),
                "prefix": described(string(), "The secret's first characters."),
                "scopes": described(string(), "Its scopes, comma-separated."),
                "created_at": described(count(), "Unix milliseconds."),
                "revoked_at": described(nullable(count()), "Unix milliseconds; null while the key is live."),
            })))})),
        ),
        ("Adapter", adapter()),
        ("AdapterDetail", json!({"allOf": [r("Adapter"), record(json!({"versions": array(r("Adapter"))}))]})),
        ("AdapterList", record(json!({"object": constant("list"), "data": array(r("Adapter"))}))),
        ("AdapterUpload", adapter_upload()),
        ("AdapterDeleted", record(json!({"name": string(), "deleted_versions": array(count())}))),
        (
            "AdapterLoad",
            record(json!({
                "name": string(),
                "version": count(),
                "workers": described(array(string()), "Per worker: absent, loading, staged, copying (into the pool, usable once landed), resident or failed: why."),
                "held": boolean(),
            })),
        ),
        ("AdapterUnload", record(json!({"name": string(), "released": boolean()}))),
        ("Publish", publish()),
        ("PinAdapter", admin_adapter(false)),
        ("UnpinAdapter", admin_adapter(true)),
        (
            "Unpinned",
            record(json!({
                "name": string(),
                "tenant_id": described(string(), "Empty for the operator's adapters."),
                "holder": described(string(), "Whose pins were let go; empty for the operator."),
                "released": described(boolean(), "Whether any worker held such a pin."),
            })),
        ),
        ("Published", record(json!({"name": string(), "tenant_id": described(string(), "Empty for the operator's adapters."), "public": boolean()}))),
        ("Totals", totals()),
        ("BillingLine", billing_line()),
        ("UsageLine", usage_line()),
        ("UsageReport", usage_report()),
        ("BillingReport", billing_report()),
        ("Health", record(json!({"status": constant("ok")}))),
        ("Ready", ready()),
    ];
    Value::Object(all.into_iter().chain(batch::schemas()).chain(business_schemas()).map(|(k, v)| (k.to_string(), v)).collect())
}
