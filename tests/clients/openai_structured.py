"""Structured output and tool calls through the official `openai` Python client, unchanged.

Usage: python openai_structured.py BASE_URL ADMIN_KEY ADAPTER_DIR

Creates a tenant and a key, uploads the adapter in ADAPTER_DIR, then asks the random-weight
model (which never writes JSON by itself) for JSON under schemas (response_format, the client's
`parse` with a pydantic model, vLLM's guided fields), and for tool calls (required, named, auto,
streamed, and the client's strict pydantic function tools). Every output is validated with
`jsonschema`. Exits non-zero on the first failure.
"""

import json
import sys
from enum import Enum
from typing import List, Optional

import jsonschema
import openai
from pydantic import BaseModel, Field

import loraplex_http

BASE, ADMIN, ADAPTER = sys.argv[1], sys.argv[2], sys.argv[3]


def http(method, path, key, body=None):
    return loraplex_http.http(BASE, method, path, key, body)[1]


tenant = http("POST", "/admin/tenants", ADMIN, {"name": "structured-client", "plan": "standard"})
key = http("POST", f"/admin/tenants/{tenant['id']}/keys", ADMIN)["key"]
assert loraplex_http.upload_adapter(BASE, key, "extractor", ADAPTER)["version"] == 1
client = openai.OpenAI(base_url=BASE + "/v1", api_key=key)
base = [m.id for m in client.models.list()][0]
checked = 0

# JSON schemas through response_format, base model and adapter, sampled.
SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10}, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "object", "properties": {"label": {"enum": ["spam", "ham"]}, "score": {"type": "number", "minimum": 0, "maximum": 1}},
     "required": ["label"], "additionalProperties": False},
    {"type": "array", "items": {"type": "integer", "minimum": 1, "maximum": 9}, "minItems": 1, "maxItems": 4},
    {"type": "object", "properties": {"sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"},
                                      "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3}},
     "required": ["sku", "tags"], "additionalProperties": False},
    {"type": "object", "properties": {"ok": {"type": "boolean"}, "note": {"type": ["string", "null"], "maxLength": 6}},
     "required": ["ok", "note"], "additionalProperties": False},
]
for i, schema in enumerate(SCHEMAS):
    for model in (base, "extractor"):
        r = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": f"record {i}"}], max_tokens=300, temperature=1.0, seed=i,
            response_format={"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": schema, "strict": True}})
        assert r.choices[0].finish_reason == "stop", r
        jsonschema.validate(json.loads(r.choices[0].message.content), schema)
        checked += 1


# The client's own structured outputs: a pydantic model, made a strict schema by the client.
class Colour(str, Enum):
    red = "red"
    green = "green"


class Item(BaseModel):
    name: str = Field(max_length=8)
    count: int = Field(ge=1, le=5)


class Order(BaseModel):
    colour: Colour
    items: List[Item] = Field(max_length=2)
    note: Optional[str] = Field(max_length=6)


parsed = client.chat.completions.parse(model="extractor", messages=[{"role": "user", "content": "an order"}], response_format=Order,
                                       max_tokens=300, temperature=1.0, seed=5)
order = parsed.choices[0].message.parsed
assert isinstance(order, Order) and all(1 <= it.count <= 5 for it in order.items), parsed
checked += 1

# JSON mode, and vLLM's fields through extra_body.
r = client.chat.completions.create(model=base, messages=[{"role": "user", "content": "json"}], max_tokens=300, seed=2, temperature=1.0,
                                   response_format={"type": "json_object"})
assert isinstance(json.loads(r.choices[0].message.content), dict), r
c = client.completions.create(model="extractor", prompt="code:", max_tokens=20, n=3, seed=4, temperature=1.0,
                              extra_body={"guided_regex": "[A-Z]{2}[0-9]{3}"})
assert all(len(ch.text) == 5 and ch.text[:2].isupper() and ch.text[2:].isdigit() for ch in c.choices), c
c = client.completions.create(model=base, prompt="sentiment:", max_tokens=8, temperature=0,
                              extra_body={"structured_outputs": {"choice": ["positive", "negative"]}})
assert c.choices[0].text in ("positive", "negative"), c
checked += 3

# A schema the server cannot enforce whole, asked strictly: the client's BadRequestError.
try:
    client.chat.completions.create(model=base, messages=[{"role": "user", "content": "x"}], max_tokens=5, response_format={
        "type": "json_schema", "json_schema": {"name": "x", "strict": True, "schema": {"type": "object", "propertyNames": {"pattern": "^a"}}}})
    raise AssertionError("an unenforceable strict schema was accepted")
except openai.BadRequestError as e:
    assert "propertyNames" in e.message, e.message

# Tools: required, named and auto; plain and streamed; the client's strict pydantic tools.
WEATHER = {"type": "object", "properties": {"city": {"enum": ["Oslo", "Lima"]}, "days": {"type": "integer", "minimum": 1, "maximum": 3}},
           "required": ["city"], "additionalProperties": False}
tools = [{"type": "function", "function": {"name": "weather", "parameters": WEATHER}}]


def check_calls(calls, schemas):
    assert calls, "no tool calls"
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
    return len(calls)


for seed, choice in enumerate(["required", {"type": "function", "function": {"name": "weather"}}]):
    r = client.chat.completions.create(model="extractor", messages=[{"role": "user", "content": "weather?"}], tools=tools, tool_choice=choice,
                                       parallel_tool_calls=False, max_tokens=150, temperature=1.0, seed=seed)
    assert r.choices[0].finish_reason == "tool_calls" and r.choices[0].message.content is None, r
    check_calls(r.choices[0].message.tool_calls, {"weather": WEATHER})
    stream = client.chat.completions.create(model="extractor", messages=[{"role": "user", "content": "weather?"}], tools=tools,
                                            tool_choice=choice, parallel_tool_calls=False, max_tokens=150, temperature=1.0, seed=seed,
                                            stream=True)
    deltas = [d for ch in stream for d in (ch.choices[0].delta.tool_calls or []) if ch.choices]
    assert [(d.function.name, d.function.arguments) for d in deltas] == \
        [(t.function.name, t.function.arguments) for t in r.choices[0].message.tool_calls], (deltas, r)
    checked += 2
for seed in range(3):
    r = client.chat.completions.create(model=base, messages=[{"role": "user", "content": "hi"}], tools=tools, max_tokens=150,
                                       temperature=1.0, seed=seed)
    m = r.choices[0].message
    if m.tool_calls:
        check_calls(m.tool_calls, {"weather": WEATHER})
    else:
        assert not m.content.startswith("<tool_call>"), m
    checked += 1


class Lookup(BaseModel):
    order_id: str = Field(pattern="^[A-Z][0-9]{3}$")
    rush: bool


r = client.chat.completions.parse(model="extractor", messages=[{"role": "user", "content": "look it up"}], max_tokens=150, temperature=1.0,
                                  seed=9, tools=[openai.pydantic_function_tool(Lookup)], tool_choice="required", parallel_tool_calls=False)
call = r.choices[0].message.tool_calls[0]
assert isinstance(call.function.parsed_arguments, Lookup), r
checked += 1

# The conversation goes on with the call and its result.
r = client.chat.completions.create(model="extractor", max_tokens=5, tools=tools, tool_choice="none", messages=[
    {"role": "user", "content": "weather in Oslo?"},
    {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function",
                                                           "function": {"name": "weather", "arguments": "{\"city\": \"Oslo\"}"}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "12 degrees"}])
assert isinstance(r.choices[0].message.content, str) and not r.choices[0].message.tool_calls, r
print(f"openai {openai.__version__}: structured ok ({checked} constrained answers validated)")
