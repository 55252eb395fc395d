//! `GET /openapi.json`: an OpenAPI 3.0 description of every route: what each accepts (the
//! handlers' serde structs, with the bounds the server checks) and everything it can answer
//! (success bodies and content types, the errors, `Retry-After`). The schemas are in
//! [`schemas`]; `.ci/schemathesis` fuzzes the server against this document.

use serde_json::{Map, Value, json};

mod schemas;
#[cfg(test)]
mod tests;

use schemas::r;

/// (method, path, summary, the key scope it needs).
pub const ROUTES: &[(&str, &str, &str, &str)] = &[
    ("get", "/health", "Liveness: the process answers.", "none"),
    ("get", "/ready", "Readiness: the database answers and the workers run.", "none"),
    ("get", "/metrics", "Prometheus metrics, with the vllm:* names gateways read (an operator key with the metrics or admin scope).", "metrics"),
    ("get", "/openapi.json", "This document.", "none"),
    ("get", "/admin/stats", "Live state for a dashboard: every worker's counters and pool, the latency histograms and request counts.", "admin"),
    ("get", "/", "Redirects to the admin console.", "none"),
    ("get", "/ui", "Redirects to the admin console.", "none"),
    ("get", "/ui/{path}", "The admin console's files (`/ui/` is its page); it signs in with an API key and calls this API.", "none"),
    ("post", "/v1/completions", "OpenAI text completion; `model` is the base model or an adapter.", "inference"),
    ("post", "/v1/chat/completions", "OpenAI chat completion through the model's chat template.", "inference"),
    ("get", "/v1/models", "The base model and the adapters this key may use.", "inference"),
    ("get", "/v1/models/{id}", "One model this key may use, by its id (404 for any other).", "inference"),
    ("post", "/generate", "LoRAX generate; `parameters.adapter_id` names the adapter.", "inference"),
    ("post", "/generate_stream", "LoRAX generate as server-sent events.", "inference"),
    ("get", "/v1/usage", "The caller's usage: ?from=&to= (Unix seconds or YYYY-MM-DD), &group_by=day|adapter.", "inference"),
    ("post", "/v1/adapters", "Upload an adapter (multipart: name, config, weights); a known name gets a new version.", "adapters"),
    ("get", "/v1/adapters", "The adapters the caller may use (latest versions).", "adapters"),
    ("get", "/v1/adapters/{name}", "One adapter and its versions.", "adapters"),
    ("delete", "/v1/adapters/{name}", "Delete every version; requests in flight finish on theirs.", "adapters"),
    ("post", "/v1/adapters/{name}/load", "Bring the latest version into every worker's pool and keep it there.", "adapters"),
    ("post", "/v1/adapters/{name}/unload", "Let a loaded adapter be evicted again.", "adapters"),
    ("post", "/admin/adapters/publish", "Publish an adapter to every tenant (or make it private again).", "admin"),
    (
        "get",
        "/admin/adapters",
        "Every tenant's adapters and the operator's: the latest version of each, its version count, owner, residency per worker and pins.",
        "admin",
    ),
    ("post", "/admin/adapters/pin", "Pin the latest version of any adapter in every worker's pool as the operator.", "admin"),
    ("post", "/admin/adapters/unpin", "Let the operator's pin of an adapter go, or (with `holder`) a tenant's.", "admin"),
    ("post", "/admin/tenants", "Create a tenant: {name, weight, plan, limits}.", "admin"),
    ("get", "/admin/tenants", "Every tenant.", "admin"),
    ("get", "/admin/tenants/{id}", "One tenant.", "admin"),
    ("patch", "/admin/tenants/{id}", "Change a tenant's weight, plan or limits.", "admin"),
    ("delete", "/admin/tenants/{id}", "Delete a tenant and revoke its keys.", "admin"),
    ("post", "/admin/tenants/{id}/keys", "Create a key for a tenant; the secret is shown once.", "admin"),
    ("get", "/admin/tenants/{id}/keys", "A tenant's keys, revoked ones included, newest first (never their secrets).", "admin"),
    ("post", "/admin/keys", "Create an operator key with the admin and/or metrics scopes; the secret is shown once.", "admin"),
    ("get", "/admin/keys", "The operator's keys, revoked ones included, newest first (never their secrets).", "admin"),
    ("delete", "/admin/keys/{id}", "Revoke a key.", "admin"),
    ("get", "/admin/billing/report", "Every tenant's bill: ?from=&to=&format=json|csv.", "admin"),
    ("get", "/admin/plans", "Every plan and its prices (micro-dollars per million tokens) and batch discount.", "admin"),
    ("post", "/admin/plans", "Create a plan: {name, prompt_price, cached_prompt_price, completion_price, batch_percent}.", "admin"),
    ("patch", "/admin/plans/{name}", "Change a plan's prices: requests admitted from then on pay them; the ledger's rows keep theirs.", "admin"),
    ("get", "/admin/tenants/{id}/prices", "A tenant's plan, its own prices over it, and the prices it pays.", "admin"),
    ("put", "/admin/tenants/{id}/prices", "Set a tenant's own prices over its plan's (a null or absent field is the plan's; {} clears them).", "admin"),
    ("get", "/admin/audit", "Who changed what, when, newest first: ?tenant_id=&before=&limit=.", "admin"),
    ("get", "/v1/me", "The caller's tenant: its plan and prices, its limits, and what it uses and has left of each quota.", "inference"),
    ("post", "/v1/keys", "Mint a key of the caller's tenant (its scopes or fewer), within the per-tenant cap; the secret is shown once.", "inference"),
    ("get", "/v1/keys", "The caller's tenant's keys, revoked ones included, newest first (never their secrets).", "inference"),
    ("delete", "/v1/keys/{id}", "Revoke one of the caller's tenant's keys.", "inference"),
    ("post", "/v1/files", "Upload a file of requests for the Batch API (multipart: purpose=batch, file: JSONL, one request a line).", "inference"),
    ("get", "/v1/files", "The caller's files, newest first: ?purpose=&limit=&after=&order=asc|desc.", "inference"),
    ("get", "/v1/files/{id}", "One file.", "inference"),
    ("delete", "/v1/files/{id}", "Delete a file (not the input of a batch that is running).", "inference"),
    ("get", "/v1/files/{id}/content", "A file's bytes: the requests uploaded, or a batch's answers or failures (JSONL).", "inference"),
    ("post", "/v1/batches", "Run a file of requests as a batch, in capacity interactive requests leave, at the plan's batch prices.", "inference"),
    ("get", "/v1/batches", "The caller's batches, newest first: ?limit=&after=.", "inference"),
    ("get", "/v1/batches/{id}", "One batch: its status, progress and usage.", "inference"),
    ("post", "/v1/batches/{id}/cancel", "Cancel a batch: its lines in flight stop (unbilled); what finished goes to its output file.", "inference"),
];

/// The error statuses a client can see, with the name of their entry in
/// `components.responses` and what they mean. (499, a request cancelled because its client
/// went away, is never seen by a client.)
const ERRORS: &[(u16, &str, &str)] = &[
    (400, "BadRequest", "Malformed or invalid request: bad JSON, unknown fields, values out of range, an unsupported option."),
    (401, "Unauthorized", "Missing, unknown or revoked key."),
    (403, "Forbidden", "The key does not have the scope this route needs."),
    (404, "NotFound", "Unknown (or another tenant's) resource or model."),
    (408, "RequestTimeout", "The request body stalled."),
    (409, "Conflict", "The name is taken (by another tenant; for an adapter, by the base model)."),
    (413, "PayloadTooLarge", "The body, or one of its parts, is too large."),
    (429, "TooManyRequests", "A tenant limit or quota (requests, tokens, concurrency, uploads, pins, adapters); retry after Retry-After seconds."),
    (503, "ServiceUnavailable", "The server is full, shutting down, or its database or workers cannot take the request now; retry after Retry-After seconds."),
];

/// What the inference routes can answer besides success.
const INFERENCE_ERRORS: &[u16] = &[400, 401, 403, 404, 408, 413, 429, 503];

/// What an operation takes and answers, besides its path parameters.
struct Shape {
    query: Vec<Value>,
    body: Option<Value>,
    /// Success statuses and their responses.
    ok: Vec<(&'static str, Value)>,
    errors: &'static [u16],
    /// The errors come in LoRAX's shape (`LoraxError`), not OpenAI's.
    lorax: bool,
}

impl Shape {
    fn new(ok: Vec<(&'static str, Value)>, errors: &'static [u16]) -> Self {
        Self { query: Vec::new(), body: None, ok, errors, lorax: false }
    }

    fn lorax(mut self) -> Self {
        self.lorax = true;
        self
    }

    fn body(mut self, body: Value) -> Self {
        self.body = Some(body);
        self
    }

    fn query(mut self, query: Vec<Value>) -> Self {
        self.query = query;
        self
    }
}

/// A response with a JSON body of schema `schema`.
fn json_ok(description: &str, schema: Value) -> Value {
    json!({"description": description, "content": {"application/json": {"schema": schema}}})
}

/// A response of an inference route: JSON, or with `stream: true` server-sent events.
fn json_or_stream(json_schema: &str, event_schema: &str) -> Value {
    json!({
        "description": "The completion; with `stream: true`, server-sent events of chunks, ended by `data: [DONE]` (a failure mid-stream arrives as an Error event).",
        "content": {
            "application/json": {"schema": r(json_schema)},
            "text/event-stream": {"schema": r(event_schema)},
        },
    })
}

/// A JSON request body, with named examples.
fn json_body(schema: &str, examples: &[(&str, Value)]) -> Value {
    let examples: Map<String, Value> = examples.iter().map(|(name, value)| (name.to_string(), json!({"value": value}))).collect();
    json!({"required": true, "content": {"application/json": {"schema": r(schema), "examples": examples}}})
}

fn header(description: &str) -> Value {
    json!({"description": description, "required": true, "schema": {"type": "string"}})
}

/// The headers of a LoRAX response; `done`: also those known once generation has ended.
fn lorax_headers(done: bool) -> Value {
    let mut h = json!({
        "x-adapter-id": header("The adapter, or the base model's name."),
        "x-compute-type": header("The device."),
        "x-prompt-tokens": header("Prompt tokens."),
    });
    if done {
        h["x-generated-tokens"] = header("Generated tokens.");
        h["x-total-time"] = header("Milliseconds.");
        h["x-queue-time"] = header("Milliseconds.");
        h["x-time-per-token"] = header("Milliseconds.");
    }
    h
}

fn query(name: &str, description: &str, schema: Value) -> Value {
    json!({"name": name, "in": "query", "required": false, "description": description, "schema": schema})
}

/// `from` and `to` of the usage and billing routes.
fn period() -> Vec<Value> {
    let bound = json!({"type": "string", "pattern": "^(-?[0-9]+|[0-9]{4}-[0-9]{2}-[0-9]{2})$"});
    vec![
        query("from", "Start (inclusive): Unix seconds or a YYYY-MM-DD date (its midnight, UTC). Default: the beginning.", bound.clone()),
        query("to", "End (exclusive): Unix seconds or a YYYY-MM-DD date. Default: now.", bound),
    ]
}

fn shape(method: &str, path: &str) -> Shape {
    match (method, path) {
        ("get", "/health") => Shape::new(vec![("200", json_ok("The process answers.", r("Health")))], &[]),
        ("get", "/ready") => Shape::new(vec![("200", json_ok("At least one worker is healthy (`degraded`: not all).", r("Ready")))], &[503]),
        ("get", "/metrics") => Shape::new(
            vec![(
                "200",
                json!({"description": "Prometheus text exposition format 0.0.4.", "content": {"text/plain": {"schema": {"type": "string"}}}}),
            )],
            &[401, 403, 503],
        ),
        ("get", "/openapi.json") => {
            Shape::new(vec![("200", json_ok("This document.", json!({"type": "object", "required": ["openapi", "info", "paths"]})))], &[])
        }
        ("get", "/admin/adapters") => Shape::new(vec![("200", json_ok("Every adapter.", r("AllAdapters")))], &[401, 403, 503]),
        ("get", "/admin/stats") => Shape::new(vec![("200", json_ok("The live state.", r("Stats")))], &[401, 403, 503]),
        ("get", "/") | ("get", "/ui") => Shape::new(
            vec![("302", json!({"description": "To the console.", "headers": {"Location": {"description": "`/ui/`", "schema": {"type": "string"}}}}))],
            &[],
        ),
        ("get", "/ui/{path}") => {
            let any = json!({"schema": {"type": "string"}});
            let types = ["text/html", "text/javascript", "text/css", "text/plain", "text/markdown"];
            let content: Map<String, Value> = types.iter().map(|t| (t.to_string(), any.clone())).collect();
            Shape::new(vec![("200", json!({"description": "The file, with the console's Content-Security-Policy.", "content": content}))], &[404])
        }
        ("post", "/v1/completions") => Shape::new(vec![("200", json_or_stream("Completion", "CompletionEvent"))], INFERENCE_ERRORS)
            .body(json_body(
                "CompletionRequest",
                &[
                    ("text", json!({"model": "loraplex-tiny", "prompt": "Hello", "max_tokens": 8})),
                    (
                        "sampled",
                        json!({"model": "loraplex-tiny", "prompt": [[1, 2, 3], [4, 5]], "max_tokens": 4, "n": 2, "temperature": 0.8, "top_p": 0.9, "top_k": 40, "seed": 7, "stop": ["\n"], "logprobs": 2}),
                    ),
                    (
                        "stream",
                        json!({"model": "loraplex-tiny", "prompt": ["Hello", "World"], "max_tokens": 4, "n": 2, "logprobs": 1, "stream": true, "stream_options": {"include_usage": true}}),
                    ),
                ],
            )),
        ("post", "/v1/chat/completions") => Shape::new(vec![("200", json_or_stream("ChatCompletion", "ChatCompletionEvent"))], INFERENCE_ERRORS)
            .body(json_body(
                "ChatCompletionRequest",
                &[
                    ("chat", json!({"model": "loraplex-tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8})),
                    (
                        "parts",
                        json!({
                            "model": "loraplex-tiny",
                            "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": [{"type": "text", "text": "Hi"}]}],
                            "max_completion_tokens": 4,
                            "n": 2,
                            "logprobs": true,
                            "top_logprobs": 2,
                            "seed": 1,
                            "temperature": 1.0,
                        }),
                    ),
                    (
                        "stream",
                        json!({
                            "model": "loraplex-tiny",
                            "messages": [{"role": "user", "content": "Hi"}],
                            "max_tokens": 4,
                            "logprobs": true,
                            "top_logprobs": 1,
                            "stream": true,
                            "stream_options": {"include_usage": true},
                        }),
                    ),
                ],
            )),
        ("get", "/v1/models") => Shape::new(vec![("200", json_ok("The base model first, then the adapters.", r("ModelList")))], &[401, 403, 503]),
        ("get", "/v1/models/{id}") => Shape::new(vec![("200", json_ok("The model.", r("Model")))], &[401, 403, 404, 503]),
        ("post", "/generate") => Shape::new(
            vec![("200", json!({"description": "The generated text.", "headers": lorax_headers(true), "content": {"application/json": {"schema": r("Generated")}}}))],
            INFERENCE_ERRORS,
        )
        .lorax()
        .body(json_body(
            "GenerateRequest",
            &[
                ("generate", json!({"inputs": "Hello", "parameters": {"max_new_tokens": 8}})),
                (
                    "details",
                    json!({"inputs": "Hello", "parameters": {"max_new_tokens": 4, "details": true, "return_k_alternatives": 2, "return_full_text": true, "do_sample": true, "seed": 3}}),
                ),
            ],
        )),
        ("post", "/generate_stream") => Shape::new(
            vec![(
                "200",
                json!({
                    "description": "Server-sent events, one per token; the last has `generated_text` and `details`.",
                    "headers": lorax_headers(false),
                    "content": {"text/event-stream": {"schema": r("GenerateEvent")}},
                }),
            )],
            INFERENCE_ERRORS,
        )
        .lorax()
        .body(json_body(
            "GenerateRequest",
            &[("stream", json!({"inputs": "Hello", "parameters": {"max_new_tokens": 4, "details": true, "return_k_alternatives": 1, "stop": ["x"]}}))],
        )),
        ("get", "/v1/usage") => Shape::new(vec![("200", json_ok("The caller's usage and cost in the period.", r("UsageReport")))], &[400, 401, 403, 503])
            .query({
                let mut q = period();
                q.push(query(
                    "group_by",
                    "Sum per day or per adapter; default: per tenant, plan, adapter and day.",
                    json!({"type": "string", "enum": ["day", "adapter"]}),
                ));
                q
            }),
        ("post", "/v1/adapters") => {
            Shape::new(vec![("201", json_ok("The new version.", r("Adapter")))], &[400, 401, 403, 408, 409, 413, 429, 503]).body(json!({
                "required": true,
                "content": {"multipart/form-data": {
                    "schema": r("AdapterUpload"),
                    "encoding": {"config": {"contentType": "application/json"}, "weights": {"contentType": "application/octet-stream"}},
                }},
            }))
        }
        ("get", "/v1/adapters") => Shape::new(vec![("200", json_ok("The caller's adapters and the published ones.", r("AdapterList")))], &[401, 403, 503]),
        ("get", "/v1/adapters/{name}") => {
            Shape::new(vec![("200", json_ok("The latest version, and every version.", r("AdapterDetail")))], &[400, 401, 403, 404, 503])
        }
        ("delete", "/v1/adapters/{name}") => Shape::new(vec![("200", json_ok("The versions deleted.", r("AdapterDeleted")))], &[400, 401, 403, 404, 503]),
        ("post", "/v1/adapters/{name}/load") => Shape::new(
            vec![
                ("200", json_ok("Resident and held in every worker's pool.", r("AdapterLoad"))),
                ("202", json_ok("Still on its way into some pool: held only where it was already placed; ask again to pin it everywhere.", r("AdapterLoad"))),
            ],
            &[400, 401, 403, 404, 429, 503],
        ),
        ("post", "/v1/adapters/{name}/unload") => {
            Shape::new(vec![("200", json_ok("Whether a pin of the caller's was released.", r("AdapterUnload")))], &[400, 401, 403, 404, 429, 503])
        }
        ("post", "/admin/adapters/publish") => Shape::new(vec![("200", json_ok("Published (or private again).", r("Published")))], &[400, 401, 403, 404, 408, 413, 503])
            .body(json_body("Publish", &[("publish", json!({"tenant_id": "ten_0123456789abcdef01234567", "name": "support", "public": true}))])),
        ("post", "/admin/adapters/pin") => Shape::new(
            vec![
                ("200", json_ok("Resident and pinned by the operator in every worker's pool.", r("AdapterLoad"))),
                ("202", json_ok("Still on its way into some pool: pinned only where it was already placed; ask again to pin it everywhere.", r("AdapterLoad"))),
            ],
            &[400, 401, 403, 404, 408, 413, 503],
        )
        .body(json_body("PinAdapter", &[("pin", json!({"tenant_id": "ten_0123456789abcdef01234567", "name": "support"}))])),
        ("post", "/admin/adapters/unpin") => Shape::new(vec![("200", json_ok("Whether such a pin was let go.", r("Unpinned")))], &[400, 401, 403, 404, 408, 413, 503])
            .body(json_body(
                "UnpinAdapter",
                &[("operator", json!({"name": "support"})), ("tenant", json!({"tenant_id": "ten_0123456789abcdef01234567", "name": "support", "holder": "ten_0123456789abcdef01234567"}))],
            )),
        ("post", "/admin/tenants") => Shape::new(vec![("201", json_ok("The new tenant.", r("Tenant")))], &[400, 401, 403, 408, 409, 413, 503])
            .body(json_body("CreateTenant", &[("tenant", json!({"name": "acme", "plan": "standard", "limits": {"requests_per_min": 600}}))])),
        ("get", "/admin/tenants/{id}/keys") => Shape::new(vec![("200", json_ok("The tenant's keys.", r("KeyList")))], &[400, 401, 403, 404, 503]),
        ("get", "/admin/keys") => Shape::new(vec![("200", json_ok("The operator's keys.", r("KeyList")))], &[401, 403, 503]),
        ("get", "/admin/tenants") => Shape::new(vec![("200", json_ok("Every tenant.", r("TenantList")))], &[401, 403, 503]),
        ("get", "/admin/tenants/{id}") => Shape::new(vec![("200", json_ok("The tenant.", r("Tenant")))], &[400, 401, 403, 404, 503]),
        ("patch", "/admin/tenants/{id}") => {
            let patch = json!({"schema": r("TenantPatch"), "example": {"weight": 2, "limits": {"requests_per_min": null}}});
            Shape::new(vec![("200", json_ok("The tenant as changed.", r("Tenant")))], &[400, 401, 403, 404, 408, 413, 503])
                .body(json!({"required": true, "content": {"application/merge-patch+json": patch.clone(), "application/json": patch}}))
        }
        ("delete", "/admin/tenants/{id}") => {
            Shape::new(vec![("204", json!({"description": "Deleted; its keys are revoked, its usage stays billable."}))], &[400, 401, 403, 404, 503])
        }
        ("post", "/admin/tenants/{id}/keys") => Shape::new(vec![("201", json_ok("The key; `key` is its secret.", r("CreatedKey")))], &[400, 401, 403, 404, 408, 413, 503])
            .body(json!({
                "required": false,
                "description": "Optional: without a body, the key has the inference and adapters scopes. A tenant's key cannot have admin or metrics.",
                "content": {"application/json": {"schema": r("KeyRequest"), "example": {"scopes": ["inference"]}}},
            })),
        ("post", "/admin/keys") => Shape::new(vec![("201", json_ok("The key; `key` is its secret.", r("CreatedKey")))], &[400, 401, 403, 408, 413, 503]).body(json!({
            "required": true,
            "description": "The scopes: admin and/or metrics (others are a tenant's).",
            "content": {"application/json": {"schema": r("KeyRequest"), "example": {"scopes": ["metrics"]}}},
        })),
        ("delete", "/admin/keys/{id}") => Shape::new(vec![("204", json!({"description": "Revoked."}))], &[400, 401, 403, 404, 503]),
        ("get", "/admin/plans") => Shape::new(vec![("200", json_ok("Every plan.", r("PlanList")))], &[401, 403, 503]),
        ("post", "/admin/plans") => Shape::new(vec![("201", json_ok("The plan.", r("Plan")))], &[400, 401, 403, 408, 409, 413, 503]).body(json_body(
            "NewPlan",
            &[("plan", json!({"name": "startup", "prompt_price": 300000, "cached_prompt_price": 75000, "completion_price": 900000, "batch_percent": 50}))],
        )),
        ("patch", "/admin/plans/{name}") => Shape::new(vec![("200", json_ok("The plan as changed.", r("Plan")))], &[400, 401, 403, 404, 408, 413, 503])
            .body(json_body("PlanPatch", &[("prices", json!({"completion_price": 1000000}))])),
        ("get", "/admin/tenants/{id}/prices") => Shape::new(vec![("200", json_ok("The tenant's prices.", r("TenantPrices")))], &[400, 401, 403, 404, 503]),
        ("put", "/admin/tenants/{id}/prices") => Shape::new(vec![("200", json_ok("The tenant's prices as set.", r("TenantPrices")))], &[400, 401, 403, 404, 408, 413, 503])
            .body(json_body("PriceOverride", &[("discount", json!({"completion_price": 1000000, "batch_percent": 40})), ("clear", json!({}))])),
        ("get", "/admin/audit") => Shape::new(vec![("200", json_ok("The entries, newest first.", r("AuditLog")))], &[400, 401, 403, 503]).query(vec![
            query("tenant_id", "Only changes made by or about this tenant.", json!({"type": "string", "maxLength": 64})),
            query("before", "Only entries before this Unix millisecond (the `at` of the last entry of the page before).", json!({"type": "integer", "format": "int64"})),
            query("limit", "At most this many entries (1 to 1000; default 100).", json!({"type": "integer", "minimum": 1, "maximum": 1000})),
        ]),
        ("get", "/v1/me") => Shape::new(vec![("200", json_ok("The caller's tenant.", r("Me")))], &[401, 403, 503]),
        ("post", "/v1/keys") => Shape::new(vec![("201", json_ok("The key; `key` is its secret.", r("CreatedKey")))], &[400, 401, 403, 408, 413, 429, 503]).body(json!({
            "required": false,
            "description": "Optional: without a body, the key has the caller's scopes.",
            "content": {"application/json": {"schema": r("KeyRequest"), "example": {"scopes": ["inference"]}}},
        })),
        ("get", "/v1/keys") => Shape::new(vec![("200", json_ok("The tenant's keys.", r("KeyList")))], &[401, 403, 503]),
        ("delete", "/v1/keys/{id}") => Shape::new(vec![("204", json!({"description": "Revoked."}))], &[400, 401, 403, 404, 503]),
        ("get", "/admin/billing/report") => Shape::new(
            vec![(
                "200",
                json!({
                    "description": "Per tenant, plan, adapter and day, per tenant, and in total; as CSV, one row per line, then per tenant (adapter and date `*`), then the total (tenant `*`).",
                    "content": {
                        "application/json": {"schema": r("BillingReport")},
                        "text/csv": {"schema": {"type": "string"}},
                    },
                }),
            )],
            &[400, 401, 403, 503],
        )
        .query({
            let mut q = period();
            q.push(query("format", "Default json.", json!({"type": "string", "enum": ["json", "csv"]})));
            q.push(query("tenant_id", "Only this tenant.", json!({"type": "string"})));
            q
        }),
        ("post", "/v1/files") => Shape::new(vec![("200", json_ok("The file, checked and stored.", r("File")))], &[400, 401, 403, 408, 413, 429, 503]).body(
            json!({
                "required": true,
                "content": {"multipart/form-data": {"schema": r("FileUpload"), "encoding": {"file": {"contentType": "application/jsonl, application/octet-stream"}}}},
            }),
        ),
        ("get", "/v1/files") => Shape::new(vec![("200", json_ok("A page of files.", r("FileList")))], &[400, 401, 403, 503]).query(vec![
            query("purpose", "Only files of this purpose.", json!({"type": "string", "enum": ["batch", "batch_output"]})),
            query("limit", "Files on the page (default 100).", json!({"type": "integer", "minimum": 1, "maximum": super::files::MAX_PAGE})),
            query("after", "The last id of the previous page.", json!({"type": "string"})),
            query("order", "By creation time; default desc.", json!({"type": "string", "enum": ["asc", "desc"]})),
        ]),
        ("get", "/v1/files/{id}") => Shape::new(vec![("200", json_ok("The file.", r("File")))], &[400, 401, 403, 404, 503]),
        ("delete", "/v1/files/{id}") => Shape::new(vec![("200", json_ok("Deleted.", r("FileDeleted")))], &[400, 401, 403, 404, 409, 503]),
        ("get", "/v1/files/{id}/content") => Shape::new(
            vec![("200", json!({"description": "The file's lines.", "content": {"application/jsonl": {"schema": {"type": "string"}}}}))],
            &[400, 401, 403, 404, 503],
        ),
        ("post", "/v1/batches") => Shape::new(vec![("200", json_ok("The batch, running.", r("Batch")))], &[400, 401, 403, 404, 408, 413, 429, 503]).body(json_body(
            "CreateBatch",
            &[("batch", json!({"input_file_id": "file-0123456789abcdef01234567", "endpoint": "/v1/chat/completions", "completion_window": "24h"}))],
        )),
        ("get", "/v1/batches") => Shape::new(vec![("200", json_ok("A page of batches.", r("BatchList")))], &[400, 401, 403, 503]).query(vec![
            query("limit", "Batches on the page (default 20).", json!({"type": "integer", "minimum": 1, "maximum": super::files::MAX_PAGE})),
            query("after", "The last id of the previous page.", json!({"type": "string"})),
        ]),
        ("get", "/v1/batches/{id}") => Shape::new(vec![("200", json_ok("The batch.", r("Batch")))], &[400, 401, 403, 404, 503]),
        ("post", "/v1/batches/{id}/cancel") => {
            Shape::new(vec![("200", json_ok("The batch, cancelling or cancelled.", r("Batch")))], &[400, 401, 403, 404, 409, 503])
        }
        // A route of ROUTES without a shape here is caught by the tests.
        _ => Shape::new(Vec::new(), &[]),
    }
}

/// `components.responses`: one per error status.
fn error_responses() -> Value {
    let retry_after = json!({"Retry-After": {
        "description": "Seconds to wait before retrying.",
        "required": true,
        "schema": {"type": "integer", "minimum": 0},
    }});
    let mut out = Map::new();
    for &(status, name, description) in ERRORS {
        // LoRAX's routes are inference routes: their errors are those.
        let shapes: &[(&str, &str)] = if INFERENCE_ERRORS.contains(&status) { &[("", "Error"), ("Lorax", "LoraxError")] } else { &[("", "Error")] };
        for &(prefix, schema) in shapes {
            let mut response = json_ok(description, r(schema));
            if status == 429 || status == 503 {
                response["headers"] = retry_after.clone();
            }
            out.insert(format!("{prefix}{name}"), response);
        }
    }
    Value::Object(out)
}

fn operation(method: &str, path: &str, summary: &str, scope: &str) -> Value {
    let shape = shape(method, path);
    let mut responses = Map::new();
    for (status, response) in shape.ok {
        responses.insert(status.into(), response);
    }
    let prefix = if shape.lorax { "Lorax" } else { "" };
    for status in shape.errors {
        if let Some(&(_, name, _)) = ERRORS.iter().find(|e| e.0 == *status) {
            responses.insert(status.to_string(), json!({"$ref": format!("#/components/responses/{prefix}{name}")}));
        }
    }
    let mut parameters: Vec<Value> = path
        .split('/')
        .filter_map(|s| s.strip_prefix('{').and_then(|s| s.strip_suffix('}')))
        .map(|name| json!({"name": name, "in": "path", "required": true, "schema": {"type": "string"}}))
        .collect();
    parameters.extend(shape.query);
    let mut op = json!({
        "summary": summary,
        "operationId": format!("{method}_{}", path.trim_start_matches('/').replace(['/', '{', '}', '.'], "_")),
        "tags": [if scope == "none" { "server" } else { scope }],
        "responses": responses,
    });
    if !parameters.is_empty() {
        op["parameters"] = parameters.into();
    }
    if let Some(body) = shape.body {
        op["requestBody"] = body;
    }
    if scope == "none" {
        op["security"] = json!([]);
    } else {
        op["security"] = json!([{"bearer": []}]);
        op["x-scope"] = scope.into();
    }
    op
}

/// The document.
pub fn document(version: &str) -> Value {
    let mut paths = Map::new();
    for &(method, path, summary, scope) in ROUTES {
        let entry = paths.entry(path.to_string()).or_insert_with(|| json!({}));
        entry[method] = operation(method, path, summary, scope);
    }
    json!({
        "openapi": "3.0.3",
        "info": {
            "title": "loraplex",
            "version": version,
            "description": "Multi-tenant LoRA serving: OpenAI- and LoRAX-compatible inference, adapters, tenants and billing. \
                Every route but /health, /ready and /openapi.json needs `Authorization: Bearer KEY` with the scope named by the operation's `x-scope` \
                (tenant keys: inference, adapters; operator keys: admin, metrics). Errors have OpenAI's shape, `{\"error\": {\"message\", \"type\", \"param\", \"code\"}}`, everywhere but on LoRAX's routes, which answer the same errors in LoRAX's shape, `{\"error\", \"error_type\"}`.",
        },
        "paths": paths,
        "components": {
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
            "schemas": schemas::schemas(),
            "responses": error_responses(),
        },
    })
}
