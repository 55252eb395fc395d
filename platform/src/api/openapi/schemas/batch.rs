//! The schemas of the Files and Batch APIs (OpenAI's objects).

use serde_json::{Value, json};

use super::{array, boolean, constant, count, described, nullable, r, record, strict, string};
use crate::api::batch::lines::{MAX_CUSTOM_ID_BYTES, MAX_LINES};
use crate::api::batch::{COMPLETION_WINDOW, MAX_METADATA, MAX_METADATA_KEY, MAX_METADATA_VALUE};

fn seconds(description: &str) -> Value {
    described(nullable(count()), &format!("Unix seconds: {description}; null until then."))
}

fn file() -> Value {
    record(json!({
        "id": string(),
        "object": constant("file"),
        "bytes": count(),
        "created_at": described(count(), "Unix seconds."),
        "filename": string(),
        "purpose": described(json!({"type": "string", "enum": ["batch", "batch_output"]}), "batch: uploaded requests; batch_output: a batch's output or error file."),
        "status": constant("processed"),
        "expires_at": described(json!({"nullable": true, "enum": [null]}), "Files do not expire."),
        "status_details": json!({"nullable": true, "enum": [null]}),
    }))
}

fn file_upload() -> Value {
    json!({
        "type": "object",
        "required": ["purpose", "file"],
        "properties": {
            "purpose": {"type": "string", "enum": ["batch"]},
            "file": {
                "type": "string",
                "format": "binary",
                "description": format!(
                    "JSONL, one request a line (at most {MAX_LINES}, and --max-file-mb in all): \
                     {{\"custom_id\": unique, at most {MAX_CUSTOM_ID_BYTES} bytes, \"method\": \"POST\", \"url\": \"/v1/chat/completions\" or \"/v1/completions\", \
                     \"body\": the request, without stream}}. Every line is checked as its endpoint checks a request; a file with invalid lines is refused \
                     with each line's problem."
                ),
            },
        },
    })
}

fn list(item: &str) -> Value {
    record(json!({
        "object": constant("list"),
        "data": array(r(item)),
        "first_id": nullable(string()),
        "last_id": nullable(string()),
        "has_more": boolean(),
    }))
}

fn create_batch() -> Value {
    strict(
        &["input_file_id", "endpoint", "completion_window"],
        json!({
            "input_file_id": described(string(), "A file of the caller's with purpose batch."),
            "endpoint": {"type": "string", "enum": ["/v1/chat/completions", "/v1/completions"]},
            "completion_window": {"type": "string", "enum": [COMPLETION_WINDOW]},
            "metadata": described(
                nullable(json!({"type": "object", "maxProperties": MAX_METADATA, "additionalProperties": {"type": "string", "maxLength": MAX_METADATA_VALUE}})),
                &format!("Labels: at most {MAX_METADATA} pairs, keys of at most {MAX_METADATA_KEY} characters."),
            ),
        }),
    )
}

fn batch() -> Value {
    let statuses = ["validating", "in_progress", "finalizing", "completed", "failed", "expired", "cancelling", "cancelled"];
    let error = record(json!({"code": string(), "message": string(), "param": nullable(string()), "line": nullable(count())}));
    record(json!({
        "id": string(),
        "object": constant("batch"),
        "endpoint": string(),
        "errors": described(nullable(record(json!({"object": constant("list"), "data": array(error)}))), "Why the whole batch failed."),
        "input_file_id": string(),
        "completion_window": constant(COMPLETION_WINDOW),
        "status": {"type": "string", "enum": statuses},
        "output_file_id": described(nullable(string()), "The answers, once the batch has ended (null if none succeeded)."),
        "error_file_id": described(nullable(string()), "The failed lines, once the batch has ended (null if none failed)."),
        "created_at": described(count(), "Unix seconds."),
        "in_progress_at": seconds("when it started"),
        "expires_at": described(count(), "Unix seconds: when its completion window closes."),
        "finalizing_at": seconds("when its last line finished"),
        "completed_at": seconds("when its files were written"),
        "failed_at": seconds("when it failed"),
        "expired_at": seconds("when it expired"),
        "cancelling_at": seconds("when it was cancelled"),
        "cancelled_at": seconds("when its cancellation finished"),
        "request_counts": record(json!({"total": count(), "completed": count(), "failed": count()})),
        "metadata": nullable(json!({"type": "object", "additionalProperties": string()})),
        "usage": described(
            record(json!({
                "input_tokens": count(),
                "input_tokens_details": record(json!({"cached_tokens": count()})),
                "output_tokens": count(),
                "output_tokens_details": record(json!({"reasoning_tokens": count()})),
                "total_tokens": count(),
            })),
            "The tokens of its finished lines, billed at the plan's batch prices.",
        ),
    }))
}

pub(super) fn schemas() -> Vec<(&'static str, Value)> {
    vec![
        ("File", file()),
        ("FileUpload", file_upload()),
        ("FileList", list("File")),
        ("FileDeleted", record(json!({"id": string(), "object": constant("file"), "deleted": boolean()}))),
        ("CreateBatch", create_batch()),
        ("Batch", batch()),
        ("BatchList", list("Batch")),
    ]
}
