"""The official `openai` Python client against a running loraplex server, unchanged.

Usage: python openai_client.py BASE_URL ADMIN_KEY ADAPTER_DIR

Creates a tenant and a key, uploads the adapter in ADAPTER_DIR, then drives the OpenAI
endpoints through the client (completions, chat, streams, logprobs, errors) and checks the
bill. Exits non-zero on the first failure.
"""

import sys

import openai

import loraplex_http

BASE, ADMIN, ADAPTER = sys.argv[1], sys.argv[2], sys.argv[3]


def http(method, path, key, body=None):
    return loraplex_http.http(BASE, method, path, key, body)[1]


tenant = http("POST", "/admin/tenants", ADMIN, {"name": "openai-client", "plan": "standard"})
key = http("POST", f"/admin/tenants/{tenant['id']}/keys", ADMIN)["key"]
assert loraplex_http.upload_adapter(BASE, key, "support", ADAPTER)["version"] == 1

client = openai.OpenAI(base_url=BASE + "/v1", api_key=key)
models = [m.id for m in client.models.list()]
base = models[0]
assert "support" in models, models

# Completions, base and adapter; n, seed and logprobs.
seen = {"prompt": 0, "cached": 0, "completion": 0, "requests": 0}


def count(usage):
    seen["requests"] += 1
    seen["prompt"] += usage.prompt_tokens
    seen["cached"] += usage.prompt_tokens_details.cached_tokens
    seen["completion"] += usage.completion_tokens
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens


c = client.completions.create(model=base, prompt="Hello there", max_tokens=5, temperature=0, extra_body={"ignore_eos": True})
assert c.object == "text_completion" and c.usage.completion_tokens == 5, c
count(c.usage)
t = client.completions.create(model="support", prompt="Hello there", max_tokens=5, temperature=0, extra_body={"ignore_eos": True})
count(t.usage)
assert t.choices[0].text != c.choices[0].text, "the adapter changes the output"
s = client.completions.create(model="support", prompt=["one", "two"], max_tokens=3, n=2, seed=11, temperature=0.8, logprobs=2,
                              extra_body={"top_k": 20, "min_p": 0.01, "repetition_penalty": 1.1, "ignore_eos": True})
count(s.usage)
assert sorted(ch.index for ch in s.choices) == [0, 1, 2, 3], s.choices
assert len(s.choices[0].logprobs.tokens) == 3 and len(s.choices[0].logprobs.top_logprobs[0]) == 2

# Unseeded plain draws (on a GPU, drawn on the device): with top_k 1 the draw is the argmax, so
# the text is the greedy one; with top_p the batch of n draws gives n completions of full length.
one = client.completions.create(model=base, prompt="Hello there", max_tokens=5, temperature=0.8, extra_body={"top_k": 1, "ignore_eos": True})
count(one.usage)
assert one.choices[0].text == c.choices[0].text, (one.choices[0].text, c.choices[0].text)
drawn = client.completions.create(model="support", prompt="Hello there", max_tokens=6, n=3, temperature=0.8, top_p=0.9,
                                  extra_body={"ignore_eos": True})
count(drawn.usage)
assert len(drawn.choices) == 3 and drawn.usage.completion_tokens == 18, drawn

# A completion stream with usage at the end.
chunks = list(client.completions.create(model=base, prompt="Hello there", max_tokens=5, temperature=0, stream=True,
                                        stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == c.choices[0].text
assert chunks[-1].usage.completion_tokens == 5
count(chunks[-1].usage)

# Chat, plain and streamed, with logprobs.
messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
r = client.chat.completions.create(model="support", messages=messages, max_tokens=4, temperature=0, logprobs=True, top_logprobs=2,
                                   presence_penalty=0.5, frequency_penalty=0.5, user="someone", extra_body={"ignore_eos": True})
assert r.choices[0].message.role == "assistant" and r.usage.completion_tokens == 4
assert len(r.choices[0].logprobs.content) == 4 and len(r.choices[0].logprobs.content[0].top_logprobs) == 2
count(r.usage)
stream = client.chat.completions.create(model="support", messages=messages, max_tokens=4, temperature=0, stream=True,
                                        presence_penalty=0.5, frequency_penalty=0.5,
                                        stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
parts = list(stream)
assert parts[0].choices[0].delta.role == "assistant"
assert "".join(p.choices[0].delta.content or "" for p in parts if p.choices) == r.choices[0].message.content
count(parts[-1].usage)
stopped = client.chat.completions.create(model=base, messages=messages, max_completion_tokens=3, stop=["\n"], seed=3)
count(stopped.usage)

# What current SDKs send besides (store, metadata, service_tier, reasoning_effort): accepted,
# ignored, and named in a header; every response carries a request id, the client's own if sent.
raw = client.chat.completions.with_raw_response.create(model=base, messages=messages, max_tokens=2, store=True, metadata={"k": "v"},
                                                       service_tier="auto", reasoning_effort="low", extra_headers={"x-request-id": "my-req-7"})
ignored = raw.headers.get("x-ignored-fields", "")
assert {"store", "metadata", "service_tier", "reasoning_effort"} <= set(ignored.split(", ")), ignored
assert raw.headers.get("x-request-id") == "my-req-7", raw.headers
count(raw.parse().usage)
fresh = client.models.with_raw_response.list()
assert fresh.headers.get("x-request-id", "").startswith("req"), fresh.headers
# One model by id, as `models.retrieve` asks; another tenant's or an unknown one is a 404.
assert client.models.retrieve("support").id == "support"
assert client.models.retrieve(base).id == base
try:
    client.models.retrieve("nope")
    raise AssertionError("an unknown model retrieved")
except openai.NotFoundError:
    pass

# Errors arrive as the client's exceptions, naming the field where there is one.
for bad in [dict(temperature=5), dict(logit_bias={"5": 3}), dict(extra_body={"prediction": {"type": "content", "content": "x"}})]:
    try:
        client.chat.completions.create(model=base, messages=messages, max_tokens=1, **bad)
        raise AssertionError(f"{bad} accepted")
    except openai.BadRequestError as e:
        field = next(iter(bad.get("extra_body", bad)))
        assert e.param == field, (bad, e.param, e.body)
try:
    client.completions.create(model="nope", prompt="x", max_tokens=1)
    raise AssertionError("unknown model accepted")
except openai.NotFoundError as e:
    assert e.body["code"] == "not_found", e.body
try:
    client.completions.create(model=base, prompt="x", max_tokens=100000)
    raise AssertionError("too many tokens accepted")
except openai.BadRequestError as e:
    assert "context" in e.message
try:
    openai.OpenAI(base_url=BASE + "/v1", api_key="lpx_wrong").models.list()
    raise AssertionError("a wrong key accepted")
except openai.AuthenticationError:
    pass

# The bill is what the client was told.
bill = http("GET", "/v1/usage", key)["totals"]
assert (bill["requests"], bill["prompt_tokens"], bill["cached_prompt_tokens"], bill["completion_tokens"]) == \
    (seen["requests"], seen["prompt"], seen["cached"], seen["completion"]), (bill, seen)
print(f"openai {openai.__version__}: ok ({seen['requests']} requests, {seen['completion']} completion tokens)")
