"""The Batch API through the official `openai` Python client, unchanged.

Usage: python openai_batch.py BASE_URL ADMIN_KEY ADAPTERS_DIR

Creates a tenant and a key, uploads every adapter under ADAPTERS_DIR (one directory each), then:
uploads a file of chat requests spread over the adapters and the base model (`files.create`),
runs it as a batch (`batches.create`), waits for it (`batches.retrieve`), reads its output
(`files.content`) and checks every answer against the same request sent to the interactive API
(greedy, so they must be equal) and a JSON-schema answer with `jsonschema`; then cancels a long
batch (`batches.cancel`) and checks what it kept; lists and deletes files. Exits non-zero on the
first failure.
"""

import io
import json
import os
import sys
import time

import jsonschema
import openai

import loraplex_http

BASE, ADMIN, ADAPTERS = sys.argv[1], sys.argv[2], sys.argv[3]


def http(method, path, key, body=None):
    return loraplex_http.http(BASE, method, path, key, body)[1]


tenant = http("POST", "/admin/tenants", ADMIN, {"name": "batch-client", "plan": "standard"})
key = http("POST", f"/admin/tenants/{tenant['id']}/keys", ADMIN)["key"]
names = []
for i, d in enumerate(sorted(os.listdir(ADAPTERS))):
    name = f"tuned-{i}"
    assert loraplex_http.upload_adapter(BASE, key, name, os.path.join(ADAPTERS, d))["version"] == 1
    names.append(name)
client = openai.OpenAI(base_url=BASE + "/v1", api_key=key)
base = [m.id for m in client.models.list()][0]
models = names + [base]

SCHEMA = {"type": "object", "properties": {"label": {"enum": ["spam", "ham"]}, "score": {"type": "integer", "minimum": 0, "maximum": 9}},
          "required": ["label", "score"], "additionalProperties": False}
requests = {}
for i in range(60):
    body = {"model": models[i % len(models)], "messages": [{"role": "user", "content": f"question {i}"}], "max_tokens": 3 + i % 5, "temperature": 0}
    if i % 20 == 3:
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "label", "schema": SCHEMA, "strict": True}}
        body["max_tokens"] = 60
    requests[f"q{i}"] = body
lines = "".join(json.dumps({"custom_id": k, "method": "POST", "url": "/v1/chat/completions", "body": b}) + "\n" for k, b in requests.items())


def wait(batch_id, done=("completed", "failed", "expired", "cancelled")):
    deadline = time.time() + 120
    while True:
        b = client.batches.retrieve(batch_id)
        if b.status in done:
            return b
        assert time.time() < deadline, b
        time.sleep(0.1)


upload = client.files.create(file=("questions.jsonl", io.BytesIO(lines.encode())), purpose="batch")
assert upload.purpose == "batch" and upload.bytes == len(lines.encode()) and upload.filename == "questions.jsonl", upload
assert client.files.retrieve(upload.id).id == upload.id
assert client.files.content(upload.id).text == lines
batch = client.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h", metadata={"run": "client"})
assert batch.status == "in_progress" and batch.request_counts.total == 60 and batch.metadata == {"run": "client"}, batch
batch = wait(batch.id)
assert batch.status == "completed" and batch.request_counts.completed == 60 and batch.request_counts.failed == 0, batch
assert batch.error_file_id is None, batch
output = [json.loads(l) for l in client.files.content(batch.output_file_id).text.splitlines()]
assert sorted(o["custom_id"] for o in output) == sorted(requests), "every line answered once"
prompt = completion = 0
for o in output:
    body = requests[o["custom_id"]]
    answer = o["response"]["body"]
    assert o["response"]["status_code"] == 200 and o["error"] is None, o
    interactive = client.chat.completions.create(**body)
    assert answer["choices"][0]["message"]["content"] == interactive.choices[0].message.content, (o, interactive)
    assert answer["usage"]["completion_tokens"] == interactive.usage.completion_tokens, (o, interactive)
    if "response_format" in body:
        jsonschema.validate(json.loads(answer["choices"][0]["message"]["content"]), SCHEMA)
    prompt += answer["usage"]["prompt_tokens"]
    completion += answer["usage"]["completion_tokens"]
assert (batch.usage.input_tokens, batch.usage.output_tokens) == (prompt, completion), batch.usage

# A long batch, cancelled once it has answered a few lines: it keeps those.
long = "".join(json.dumps({"custom_id": f"l{i}", "method": "POST", "url": "/v1/completions",
                           "body": {"model": base, "prompt": f"story {i}", "max_tokens": 200, "ignore_eos": True, "temperature": 0}}) + "\n"
               for i in range(100))
long_file = client.files.create(file=("long.jsonl", io.BytesIO(long.encode())), purpose="batch")
running = client.batches.create(input_file_id=long_file.id, endpoint="/v1/completions", completion_window="24h")
deadline = time.time() + 60
while client.batches.retrieve(running.id).request_counts.completed < 2:
    assert time.time() < deadline
    time.sleep(0.05)
try:
    # The client retries a 409 by default, by which time the batch may have ended.
    client.with_options(max_retries=0).files.delete(long_file.id)
    raise AssertionError("the input of a running batch was deleted")
except openai.ConflictError:
    pass
cancelled = client.batches.cancel(running.id)
assert cancelled.status in ("cancelling", "cancelled"), cancelled
cancelled = wait(running.id)
assert cancelled.status == "cancelled" and 2 <= cancelled.request_counts.completed < 100, cancelled
kept = client.files.content(cancelled.output_file_id).text.splitlines()
assert len(kept) == cancelled.request_counts.completed and cancelled.usage.output_tokens == 200 * len(kept), cancelled

listed = [b.id for b in client.batches.list(limit=1)]
assert listed[:2] == [running.id, batch.id], listed
outputs = {f.id for f in client.files.list(purpose="batch_output")}
assert {batch.output_file_id, cancelled.output_file_id} <= outputs, outputs
assert client.files.delete(long_file.id).deleted
try:
    client.files.retrieve(long_file.id)
    raise AssertionError("a deleted file is still there")
except openai.NotFoundError:
    pass
try:
    client.files.create(file=("bad.jsonl", io.BytesIO(b'{"custom_id": "x"}\n')), purpose="batch")
    raise AssertionError("an invalid file was accepted")
except openai.BadRequestError as e:
    assert e.body["lines"][0]["line"] == 1, e.body

print(f"openai {openai.__version__}: batch ok (60 lines over {len(models)} models equal to the interactive API, a cancelled batch kept "
      f"{len(kept)} of 100)")
