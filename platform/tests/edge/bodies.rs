//! Request bodies a tenant can send: every malformed, oversized or out-of-range one gets a 4xx
//! that names the problem, on every inference route alike, and the server keeps serving.

use loraplex::bench::http::{Request, Response, read_response};
use serde_json::{Value, json};

use super::common::*;

/// (case, route, body, status, a string the answer contains).
fn table(context: usize) -> Vec<(&'static str, &'static str, Value, u16, String)> {
    // Far more text than the context could hold, under the 4 MiB body limit.
    let long = "x".repeat(3 << 20);
    let c = |name, route, body, status, needle: &str| (name, route, body, status, needle.to_string());
    let cmp = "/v1/completions";
    let chat = "/v1/chat/completions";
    let lorax = "/generate";
    let m = MODEL;
    vec![
        c("max_tokens 0", cmp, json!({"model": m, "prompt": "x", "max_tokens": 0}), 400, "max_tokens"),
        c("max_tokens negative", cmp, json!({"model": m, "prompt": "x", "max_tokens": -1}), 400, "invalid JSON"),
        c("max_tokens past u32", cmp, json!({"model": m, "prompt": "x", "max_tokens": 4_294_967_296u64}), 400, "invalid JSON"),
        c("max_tokens u32::MAX", cmp, json!({"model": m, "prompt": "x", "max_tokens": u32::MAX}), 400, "context length"),
        c("max_tokens a float", cmp, json!({"model": m, "prompt": "x", "max_tokens": 1.5}), 400, "invalid JSON"),
        c("max_tokens a string", cmp, json!({"model": m, "prompt": "x", "max_tokens": "10"}), 400, "invalid JSON"),
        c("n 0", cmp, json!({"model": m, "prompt": "x", "n": 0}), 400, "`n`"),
        c("n 129", cmp, json!({"model": m, "prompt": "x", "n": 129}), 400, "`n`"),
        c("n huge", cmp, json!({"model": m, "prompt": "x", "n": 1u64 << 40}), 400, "invalid JSON"),
        c("logprobs 21", cmp, json!({"model": m, "prompt": "x", "logprobs": 21}), 400, "logprobs"),
        c("top_logprobs 21", chat, json!({"model": m, "messages": [{"role": "user", "content": "x"}], "logprobs": true, "top_logprobs": 21}), 400, "logprobs"),
        c(
            "top_logprobs without logprobs",
            chat,
            json!({"model": m, "messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}),
            400,
            "needs `logprobs: true`",
        ),
        c("17 stop strings", cmp, json!({"model": m, "prompt": "x", "stop": vec!["a"; 17]}), 400, "stop strings"),
        c("an empty stop string", cmp, json!({"model": m, "prompt": "x", "stop": [""]}), 400, "must not be empty"),
        c("a 257-byte stop string", cmp, json!({"model": m, "prompt": "x", "stop": ["s".repeat(257)]}), 400, "256 bytes"),
        c("stop a number", cmp, json!({"model": m, "prompt": "x", "stop": 5}), 400, "`stop` must be"),
        c("stop list with a number", cmp, json!({"model": m, "prompt": "x", "stop": ["a", 5]}), 400, "`stop` must be"),
        c("lorax: 17 stop strings", lorax, json!({"inputs": "x", "parameters": {"stop": vec!["a"; 17]}}), 400, "stop strings"),
        c("lorax: an empty stop string", lorax, json!({"inputs": "x", "parameters": {"stop": [""]}}), 400, "must not be empty"),
        c("lorax: a 257-byte stop string", lorax, json!({"inputs": "x", "parameters": {"stop": ["s".repeat(257)]}}), 400, "256 bytes"),
        c("lorax: max_new_tokens 0", lorax, json!({"inputs": "x", "parameters": {"max_new_tokens": 0}}), 400, "max_tokens"),
        c("lorax: max_new_tokens past u32", lorax, json!({"inputs": "x", "parameters": {"max_new_tokens": 5_000_000_000u64}}), 400, "invalid JSON"),
        c("lorax: 21 alternatives", lorax, json!({"inputs": "x", "parameters": {"return_k_alternatives": 21}}), 400, "logprobs"),
        c("lorax: truncate 0", lorax, json!({"inputs": "x", "parameters": {"truncate": 0}}), 400, "truncate"),
        c("lorax: empty inputs", lorax, json!({"inputs": ""}), 400, "must not be empty"),
        c("lorax: inputs past what the context holds", lorax, json!({"inputs": long}), 400, "more than the model's context"),
        c("lorax: unknown field", lorax, json!({"inputs": "x", "parameters": {"colour": 1}}), 400, "unknown field"),
        c("temperature negative", cmp, json!({"model": m, "prompt": "x", "temperature": -1}), 400, "temperature"),
        c("temperature huge", cmp, json!({"model": m, "prompt": "x", "temperature": 1e39}), 400, "temperature"),
        c("top_p 0", cmp, json!({"model": m, "prompt": "x", "top_p": 0}), 400, "top_p"),
        c("top_p above 1", cmp, json!({"model": m, "prompt": "x", "top_p": 1.5}), 400, "top_p"),
        c("top_k -2", cmp, json!({"model": m, "prompt": "x", "top_k": -2}), 400, "top_k"),
        c("min_p 2", cmp, json!({"model": m, "prompt": "x", "min_p": 2}), 400, "min_p"),
        c("presence_penalty 3", cmp, json!({"model": m, "prompt": "x", "presence_penalty": 3}), 400, "presence_penalty"),
        c("frequency_penalty -3", cmp, json!({"model": m, "prompt": "x", "frequency_penalty": -3}), 400, "frequency_penalty"),
        c("repetition_penalty 0", cmp, json!({"model": m, "prompt": "x", "repetition_penalty": 0}), 400, "repetition_penalty"),
        c("empty prompt", cmp, json!({"model": m, "prompt": ""}), 400, "empty"),
        c("empty prompt list", cmp, json!({"model": m, "prompt": []}), 400, "empty"),
        c("65 prompts", cmp, json!({"model": m, "prompt": vec!["x"; 65]}), 400, "at most 64 prompts"),
        c("a prompt past what the context holds", cmp, json!({"model": m, "prompt": long}), 400, "more than the model's context"),
        c("token ids past the context", cmp, json!({"model": m, "prompt": vec![5; context + 1]}), 400, "context length"),
        c("a token id past u32", cmp, json!({"model": m, "prompt": [5, 4_294_967_296u64]}), 400, "not a valid token id"),
        c("a negative token id", cmp, json!({"model": m, "prompt": [5, -1]}), 400, "not a valid token id"),
        c("a token id outside the vocabulary", cmp, json!({"model": m, "prompt": [5, 4_000_000]}), 400, "vocabulary"),
        c("a prompt of objects", cmp, json!({"model": m, "prompt": [{"a": 1}]}), 400, "`prompt` must be"),
        c("mixed prompt list", cmp, json!({"model": m, "prompt": ["x", 5]}), 400, "`prompt` must be"),
        c("prompt plus max_tokens past the context", cmp, json!({"model": m, "prompt": "x", "max_tokens": context}), 400, "context length"),
        c("n times max_tokens past the pool", cmp, json!({"model": m, "prompt": "x", "max_tokens": context - 8, "n": 128}), 400, "pages of the device pool"),
        c("no model", cmp, json!({"prompt": "x"}), 400, "missing field `model`"),
        c("temperature past OpenAI's 2", cmp, json!({"model": m, "prompt": "x", "temperature": 2.01}), 400, "\"param\":\"temperature\""),
        c(
            "a field that would change the answer",
            chat,
            json!({"model": m, "messages": [{"role": "user", "content": "x"}], "prediction": {"type": "content", "content": "x"}}),
            400,
            "\"param\":\"prediction\"",
        ),
        c(
            "audio out",
            chat,
            json!({"model": m, "messages": [{"role": "user", "content": "x"}], "modalities": ["text", "audio"]}),
            400,
            "\"param\":\"modalities\"",
        ),
        c("echo", cmp, json!({"model": m, "prompt": "x", "echo": true}), 400, "not supported"),
        c("best_of", cmp, json!({"model": m, "prompt": "x", "best_of": 3}), 400, "not supported"),
        c("logit_bias", cmp, json!({"model": m, "prompt": "x", "logit_bias": {"5": 10}}), 400, "\"param\":\"logit_bias\""),
        c("stream_options without stream", cmp, json!({"model": m, "prompt": "x", "stream_options": {"include_usage": true}}), 400, "stream_options"),
        c("no messages", chat, json!({"model": m, "messages": []}), 400, "`messages` must not be empty"),
        c("a role that is not one", chat, json!({"model": m, "messages": [{"role": "wizard", "content": "x"}]}), 400, "role \\\"wizard\\\""),
        c("a role of 1000 bytes", chat, json!({"model": m, "messages": [{"role": "r".repeat(1000), "content": "x"}]}), 400, "is not one of"),
        c(
            "messages past what the context holds",
            chat,
            json!({"model": m, "messages": [{"role": "user", "content": long}]}),
            400,
            "more than the model's context",
        ),
        c("content of a wrong type", chat, json!({"model": m, "messages": [{"role": "user", "content": 5}]}), 400, "invalid JSON"),
        c(
            "a tool without a name",
            chat,
            json!({"model": m, "messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}),
            400,
            "with a `name`",
        ),
        c(
            "two max token fields that disagree",
            chat,
            json!({"model": m, "messages": [{"role": "user", "content": "x"}], "max_tokens": 2, "max_completion_tokens": 3}),
            400,
            "give one of",
        ),
        c(
            "a response_format of an unknown type",
            chat,
            json!({"model": m, "messages": [{"role": "user", "content": "x"}], "response_format": {"type": "yaml"}}),
            400,
            "response_format",
        ),
        c("a body that is not an object", cmp, json!([1, 2, 3]), 400, "invalid JSON"),
        c("a body that is a string", cmp, json!("prompt"), 400, "invalid JSON"),
        c(
            "a deeply nested prompt",
            cmp,
            serde_json::from_str::<Value>(&format!("{{\"model\": \"{m}\", \"prompt\": {}5{}}}", "[".repeat(100), "]".repeat(100))).unwrap(),
            400,
            "is not a valid token id",
        ),
    ]
}

#[test]
fn bad_bodies_get_a_clear_4xx_on_every_route_and_the_server_keeps_serving() {
    for db in databases() {
        // A small pool, so that a request too large for it is refused, not run.
        let env = Env::start(&db, &["--pool-mb", "16"]);
        let (_, key) = env.tenant("acme", json!({}));
        let context = env.call(Some(&key), "GET", "/v1/models", None).json()["data"][0]["max_model_len"].as_u64().unwrap() as usize;
        let mut cases = Cases::default();
        for (name, route, body, status, needle) in table(context) {
            let res = env.call(Some(&key), "POST", route, Some(body));
            cases.check(name, &res, status, &needle);
            let shape = if route.starts_with("/generate") {
                // LoRAX's routes keep LoRAX's shape.
                let v = res.json();
                v["error"].is_string() && v["error_type"].is_string() && v.as_object().is_some_and(|o| o.len() == 2)
            } else {
                res.json()["error"]["code"].is_string()
            };
            cases.ok(&format!("{name}: the route's error shape"), shape, res.text());
            cases.ok(&format!("{name}: a short answer"), res.body.len() < 1024, res.body.len());
        }
        // Bodies that are not JSON at all.
        let raw = |ctype: &str, body: &[u8]| env.http.send(&Request::new("POST", "/v1/completions").key(&key).body(ctype, body)).unwrap();
        cases.check("not JSON", &raw("application/json", b"{not json"), 400, "invalid JSON");
        cases.check("an empty body", &raw("application/json", b""), 400, "needs a JSON body");
        cases.check("only whitespace", &raw("application/json", b"  \n\t "), 400, "needs a JSON body");
        cases.check("invalid UTF-8", &raw("application/json", b"{\"model\": \"\xff\xfe\"}"), 400, "invalid JSON");
        cases.check("a body over 4 MiB", &raw("application/json", &vec![b' '; (4 << 20) + 10]), 413, "larger than");
        cases.check("a NUL byte", &raw("application/json", b"{\"model\": \"a\0\", \"prompt\": \"x\"}"), 400, "invalid JSON");
        let big = format!("{{\"model\": \"{MODEL}\", \"prompt\": \"x\", \"max_tokens\": 1{}}}", "0".repeat(5000));
        cases.check("a number of 5000 digits", &raw("application/json", big.as_bytes()), 400, "invalid JSON");
        // A declared length the body never reaches is cut by the body timeout (see uploads).
        for (query, needle) in [
            ("from=999999999999-01-01", "YYYY-MM-DD"),
            ("to=9223372036854775807", "out of range"),
            ("from=2026-02-30", "YYYY-MM-DD"),
            ("group_by=week", "group_by"),
        ] {
            cases.check(&format!("usage with {query}"), &env.call(Some(&key), "GET", &format!("/v1/usage?{query}"), None), 400, needle);
        }
        // LoRAX's error types: a bad key, an unknown adapter, a limit, each in LoRAX's shape.
        let lorax = json!({"inputs": "hi", "parameters": {"max_new_tokens": 1}});
        for route in ["/generate", "/generate_stream"] {
            let res = env.call(Some("sk-unknown-0123456789"), "POST", route, Some(lorax.clone()));
            cases.check(&format!("{route}: a bad key"), &res, 401, "\"error_type\":\"authentication\"");
            let unknown = json!({"inputs": "hi", "parameters": {"adapter_id": "nope"}});
            let res = env.call(Some(&key), "POST", route, Some(unknown));
            cases.check(&format!("{route}: an unknown adapter"), &res, 404, "\"error_type\":\"not_found\"");
            let res = env.call(Some(&key), "POST", route, Some(json!({"inputs": "hi", "parameters": {"watermark": true}})));
            cases.check(&format!("{route}: a bad parameter"), &res, 400, "\"error_type\":\"validation\"");
        }
        let (_, once) = env.tenant("once", json!({"requests_per_min": 1}));
        cases.check("lorax: the one request of the minute", &env.call(Some(&once), "POST", "/generate", Some(lorax.clone())), 200, "generated_text");
        let res = env.call(Some(&once), "POST", "/generate", Some(lorax));
        cases.check("lorax: over the rate limit", &res, 429, "\"error_type\":\"overloaded\"");
        cases.ok("lorax: over the rate limit, with Retry-After", res.header("retry-after").is_some(), format!("{:?}", res.headers));
        cases.check("an unknown route", &env.call(Some(&key), "POST", "/v1/nothing", None), 404, "not found");
        cases.check("a wrong method", &env.call(Some(&key), "GET", "/v1/completions", None), 404, "not found");
        // Still serving, on every route.
        cases.check("still serving completions", &env.complete(&key, MODEL, 2), 200, "choices");
        let chat = json!({"model": MODEL, "messages": [{"role": "developer", "content": "be brief"}, {"role": "user", "content": "hi"}], "max_tokens": 2});
        cases.check("still serving chat (the developer role is accepted)", &env.call(Some(&key), "POST", "/v1/chat/completions", Some(chat)), 200, "choices");
        cases.check(
            "still serving lorax",
            &env.call(Some(&key), "POST", "/generate", Some(json!({"inputs": "hi", "parameters": {"max_new_tokens": 2}}))),
            200,
            "generated_text",
        );
        let ledger = env.query("SELECT COUNT(*) FROM usage WHERE outcome <> 'ok'");
        cases.ok("refused requests leave no ledger rows", ledger[0][0] == "0", format!("{ledger:?}"));
        cases.finish(&format!("bodies on {}", env.kind()));
    }
}

/// Sends a request declaring a body of `declared` bytes and writes it until the server stops
/// taking it: how many bytes it took, and its answer.
fn push_body(env: &Env, key: Option<&str>, path: &str, declared: usize) -> (usize, Response) {
    let body = vec![b' '; declared];
    let mut req = Request::new("POST", path).body("application/json", &body);
    req.key = key;
    let mut s = env.http.open(&req).unwrap();
    s.set_write_timeout(Some(std::time::Duration::from_secs(20))).unwrap();
    let mut written = 0;
    for chunk in body.chunks(256 << 10) {
        match std::io::Write::write_all(&mut s, chunk) {
            Ok(()) => written += chunk.len(),
            Err(_) => break,
        }
    }
    (written, read_response(s).unwrap())
}

#[test]
fn a_large_body_refused_before_it_is_read_is_not_read_and_its_answer_still_arrives() {
    let db = Db::Sqlite;
    let env = Env::start(&db, &[]);
    let (_, key) = env.tenant("limited", json!({"requests_per_min": 1}));
    let mut cases = Cases::default();
    const DECLARED: usize = 64 << 20;
    // The server reads no more than a refusal needs; what it leaves unread is dropped, and the
    // client's writes fail long before the declared length.
    let (written, res) = push_body(&env, None, "/v1/completions", DECLARED);
    cases.check("no key", &res, 401, "Authorization");
    cases.ok("no key: the body was not read", written < DECLARED, written);
    cases.ok("no key: the connection closes", res.header("connection") == Some("close"), format!("{:?}", res.headers));
    cases.check("the one request of the minute", &env.complete(&key, MODEL, 1), 200, "choices");
    let (written, res) = push_body(&env, Some(&key), "/v1/completions", DECLARED);
    cases.check("over the rate limit", &res, 429, "per minute");
    cases.ok("over the rate limit: the body was not read", written < DECLARED, written);
    cases.ok("over the rate limit: a Retry-After", res.header("retry-after").is_some(), format!("{:?}", res.headers));
    let (_, other) = env.tenant("other", json!({}));
    let (written, res) = push_body(&env, Some(&other), "/v1/completions", DECLARED);
    cases.check("over the body cap", &res, 413, "larger than");
    cases.ok("over the body cap: the rest was not read", written < DECLARED, written);
    // A small body refused keeps its answer too.
    let (_, res) = push_body(&env, None, "/v1/completions", 1000);
    cases.check("no key, a small body", &res, 401, "Authorization");
    cases.check("still serving", &env.complete(&other, MODEL, 2), 200, "choices");
    cases.finish("refused bodies");
}
