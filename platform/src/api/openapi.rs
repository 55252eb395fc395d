//! `GET /openapi.json`: an OpenAPI 3 description of every route.

use serde_json::{Map, Value, json};

/// (method, path, summary, the key scope it needs).
pub const ROUTES: &[(&str, &str, &str, &str)] = &[
    ("get", "/health", "Liveness: the process answers.", "none"),
    ("get", "/ready", "Readiness: the database answers and the workers run.", "none"),
    ("get", "/metrics", "Prometheus metrics, with the vllm:* names gateways read (an operator key with the metrics or admin scope).", "metrics"),
    ("get", "/openapi.json", "This document.", "none"),
    ("post", "/v1/completions", "OpenAI text completion; `model` is the base model or an adapter.", "inference"),
    ("post", "/v1/chat/completions", "OpenAI chat completion through the model's chat template.", "inference"),
    ("get", "/v1/models", "The base model and the adapters this key may use.", "inference"),
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
    ("post", "/admin/tenants", "Create a tenant: {name, weight, plan, limits}.", "admin"),
    ("get", "/admin/tenants", "Every tenant.", "admin"),
    ("get", "/admin/tenants/{id}", "One tenant.", "admin"),
    ("patch", "/admin/tenants/{id}", "Change a tenant's weight, plan or limits.", "admin"),
    ("delete", "/admin/tenants/{id}", "Delete a tenant and revoke its keys.", "admin"),
    ("post", "/admin/tenants/{id}/keys", "Create a key for a tenant; the secret is shown once.", "admin"),
    ("post", "/admin/keys", "Create an operator key with the admin and/or metrics scopes; the secret is shown once.", "admin"),
    ("delete", "/admin/keys/{id}", "Revoke a key.", "admin"),
    ("get", "/admin/billing/report", "Every tenant's bill: ?from=&to=&format=json|csv.", "admin"),
];

fn error_response(description: &str) -> Value {
    json!({"description": description, "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}})
}

/// The document.
pub fn document(version: &str) -> Value {
    let mut paths = Map::new();
    for &(method, path, summary, scope) in ROUTES {
        let mut op = json!({
            "summary": summary,
            "operationId": format!("{method}_{}", path.trim_start_matches('/').replace(['/', '{', '}', '.'], "_")),
            "responses": {
                "200": {"description": "Success."},
                "400": error_response("Malformed or invalid request."),
                "401": error_response("Missing, unknown or revoked key."),
                "404": error_response("Unknown (or another tenant's) resource."),
                "429": error_response("A tenant limit; see Retry-After."),
            },
        });
        if scope != "none" {
            op["security"] = json!([{"bearer": []}]);
            op["x-scope"] = scope.into();
        }
        if path.contains("{name}") {
            op["parameters"] = json!([{"name": "name", "in": "path", "required": true, "schema": {"type": "string"}}]);
        } else if path.contains("{id}") {
            op["parameters"] = json!([{"name": "id", "in": "path", "required": true, "schema": {"type": "string"}}]);
        }
        if method == "post" && path != "/v1/adapters" && !path.ends_with("/load") && !path.ends_with("/unload") && !path.ends_with("/keys") {
            op["requestBody"] = json!({"required": true, "content": {"application/json": {"schema": {"type": "object"}}}});
        }
        if path == "/v1/adapters" && method == "post" {
            op["requestBody"] = json!({"required": true, "content": {"multipart/form-data": {"schema": {
                "type": "object",
                "required": ["name", "config", "weights"],
                "properties": {
                    "name": {"type": "string"},
                    "config": {"type": "string", "format": "binary", "description": "adapter_config.json"},
                    "weights": {"type": "string", "format": "binary", "description": "adapter_model.safetensors"},
                },
            }}}});
        }
        let entry = paths.entry(path.to_string()).or_insert_with(|| json!({}));
        entry[method] = op;
    }
    json!({
        "openapi": "3.0.3",
        "info": {"title": "loraplex", "version": version, "description": "Multi-tenant LoRA serving: OpenAI- and LoRAX-compatible inference, adapters, tenants and billing."},
        "paths": paths,
        "components": {
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
            "schemas": {"Error": {
                "type": "object",
                "properties": {"error": {"type": "object", "properties": {
                    "message": {"type": "string"}, "type": {"type": "string"}, "code": {"type": "string"},
                }}},
            }},
        },
    })
}
