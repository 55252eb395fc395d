"""The official `openai` Python client against a loraplex server serving a trained model.

Usage: python openai_real_model.py BASE_URL ADMIN_KEY

Creates a tenant and a key, then asks the served model, through the client's chat API, for
the capital of France, plain and streamed, and checks the answer names Paris, that the
answer ends on the model's own end of turn, and that the streamed text is the plain one.
Exits non-zero on the first failure.
"""

import sys

import openai

import loraplex_http

BASE, ADMIN = sys.argv[1], sys.argv[2]


def http(method, path, key, body=None):
    return loraplex_http.http(BASE, method, path, key, body)[1]


tenant = http("POST", "/admin/tenants", ADMIN, {"name": "real-model", "plan": "standard"})
key = http("POST", f"/admin/tenants/{tenant['id']}/keys", ADMIN)["key"]
client = openai.OpenAI(base_url=BASE + "/v1", api_key=key)
base = client.models.list().data[0].id

question = [{"role": "user", "content": "What is the capital of France?"}]
chat = client.chat.completions.create(model=base, messages=question, max_tokens=32, temperature=0)
answer = chat.choices[0].message.content
assert "Paris" in answer, answer
# The model says it all in a few words and ends its turn: stopped by its end of turn, not the cap.
assert chat.choices[0].finish_reason == "stop", chat.choices[0]
assert chat.usage.completion_tokens < 32, chat.usage

stream = client.chat.completions.create(model=base, messages=question, max_tokens=32, temperature=0, stream=True)
streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
assert streamed == answer, (streamed, answer)

print(f"{base}: {answer!r}: ok")
