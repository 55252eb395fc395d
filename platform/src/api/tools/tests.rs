//! Tools: what is accepted, the grammar (sampled from random logits, which never call a tool on
//! their own: every call read back validates against its function's schema), reading calls
//! back, and rendering through templates with and without tool support.

use rand::SeedableRng;
use rand::rngs::StdRng;
use serde_json::{Value, json};

use super::*;
use crate::grammar::tests::{compiler, sample};

fn weather() -> Value {
    json!({"type": "function", "function": {"name": "get_weather", "description": "The weather in a city", "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["c", "f"]}, "days": {"type": "integer", "minimum": 1, "maximum": 7}},
        "required": ["city", "unit"],
        "additionalProperties": false,
    }}})
}

fn lookup() -> Value {
    json!({"type": "function", "function": {"name": "lookup_order", "parameters": {
        "type": "object",
        "properties": {"order_id": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{4}$"}, "items": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99}, "minItems": 1, "maxItems": 3}},
        "required": ["order_id", "items"],
        "additionalProperties": false,
    }}})
}

/// A function without parameters takes `{}`.
fn ping() -> Value {
    json!({"type": "function", "function": {"name": "ping"}})
}

fn set(tools: Vec<Value>, choice: Value) -> ToolSet {
    let choice = (!choice.is_null()).then_some(choice);
    ToolSet::parse(Some(tools), choice.as_ref(), None).unwrap().unwrap()
}

fn schema_of(tools: &[Value], name: &str) -> Value {
    let t = tools.iter().find(|t| t["function"]["name"] == name).unwrap_or_else(|| panic!("no tool {name}"));
    t["function"].get("parameters").cloned().unwrap_or(json!({"type": "object", "properties": {}}))
}

#[test]
fn what_is_accepted() {
    let bad: Vec<(Option<Vec<Value>>, Value, &str)> = vec![
        (None, json!("required"), "offers no `tools`"),
        (Some(vec![]), json!({"type": "function", "function": {"name": "x"}}), "offers no `tools`"),
        (Some(vec![weather()]), json!("sometimes"), "`tool_choice` must be"),
        (Some(vec![weather()]), json!({"type": "function", "function": {"name": "nope"}}), "not among the `tools`"),
        (Some(vec![weather(), weather()]), Value::Null, "two tools are named"),
        (Some(vec![json!({"type": "retrieval"})]), Value::Null, "`tools[0].type`"),
        (Some(vec![json!({"type": "function", "function": {"name": "bad name"}})]), Value::Null, "must be 1 to 64"),
        (Some(vec![json!({"type": "function", "function": {"name": "f", "parameters": [1]}})]), Value::Null, "parameters"),
        (Some(vec![json!({"type": "function", "function": {"name": "f", "strict": "yes"}})]), Value::Null, "strict"),
        (Some(vec![ping(); MAX_TOOLS + 1]), Value::Null, "at most"),
    ];
    for (tools, choice, needle) in bad {
        let choice = (!choice.is_null()).then_some(choice);
        let e = ToolSet::parse(tools.clone(), choice.as_ref(), None).expect_err(needle);
        assert!(e.to_string().contains(needle), "{tools:?} {choice:?}: {e}");
    }
    assert!(ToolSet::parse(None, None, None).unwrap().is_none());
    assert!(ToolSet::parse(Some(vec![]), Some(&json!("none")), None).unwrap().is_none());
    let s = set(vec![weather()], Value::Null);
    assert_eq!(s.choice, ToolChoice::Auto, "tools without a choice: auto");
    assert!(s.calls());
    let none = set(vec![weather()], json!("none"));
    assert!(!none.calls() && none.grammar().unwrap().is_none() && none.read_calls("<tool_call>\n{}\n</tool_call>").is_none());
}

#[test]
fn calls_are_read_back_only_when_whole() {
    let s = set(vec![weather(), ping()], json!("auto"));
    let one = "<tool_call>\n{\"name\":\"ping\",\"arguments\":{}}\n</tool_call>";
    assert_eq!(s.read_calls(one), Some(vec![ToolCall { name: "ping".into(), arguments: "{}".into() }]));
    let two = format!("{one}\n<tool_call>\n{{\"name\":\"get_weather\",\"arguments\":{{\"city\":\"Oslo\",\"unit\":\"c\"}}}}\n</tool_call>");
    let calls = s.read_calls(&two).unwrap();
    assert_eq!(calls.len(), 2);
    assert_eq!(serde_json::from_str::<Value>(&calls[1].arguments).unwrap(), json!({"city": "Oslo", "unit": "c"}));
    for text in ["hello", "", &one[..one.len() - 3], &format!("{one}\nmore"), "<tool_call>\n{\"name\":\"ping\"}\n</tool_call>"] {
        assert_eq!(s.read_calls(text), None, "{text:?}");
    }
    assert!(s.may_open_call("<tool") && s.may_open_call("<tool_call>\n{") && !s.may_open_call("<b>") && !s.may_open_call("hi"));
}

/// A function whose parameters refer to definitions of their own, as pydantic writes nested
/// models (`openai.pydantic_function_tool`): the references resolve against the parameters.
fn pydantic_order() -> Value {
    json!({"type": "function", "function": {"name": "place_order", "strict": true, "parameters": {
        "$defs": {
            "Item": {"type": "object", "properties": {"sku": {"type": "string", "maxLength": 8}, "count": {"type": "integer", "minimum": 1, "maximum": 9}},
                     "required": ["sku", "count"], "additionalProperties": false},
            "Address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10}}, "required": ["city"], "additionalProperties": false},
        },
        "type": "object",
        "properties": {"items": {"type": "array", "items": {"$ref": "#/$defs/Item"}, "minItems": 1, "maxItems": 2}, "ship_to": {"$ref": "#/$defs/Address"}},
        "required": ["items", "ship_to"],
        "additionalProperties": false,
    }}})
}

#[test]
fn parameters_with_their_own_definitions_compile_and_every_call_validates() {
    let tools = vec![pydantic_order(), weather()];
    let validator = jsonschema::validator_for(&schema_of(&tools, "place_order")).unwrap();
    let s = set(tools, json!({"type": "function", "function": {"name": "place_order"}}));
    let grammar = compiler().compile(&s.grammar().unwrap().unwrap()).unwrap_or_else(|e| panic!("{e}"));
    let mut rng = StdRng::seed_from_u64(11);
    let mut read = 0;
    for _ in 0..6 {
        let Some(text) = sample(&mut grammar.start(), &mut rng, 400) else { continue };
        let calls = s.read_calls(&text).unwrap_or_else(|| panic!("{text:?}"));
        assert!(validator.is_valid(&serde_json::from_str(&calls[0].arguments).unwrap()), "{text:?}");
        read += 1;
    }
    assert!(read >= 3, "{read}");
}

#[test]
fn whole_calls_are_read_back_when_the_last_one_was_cut_short() {
    let s = set(vec![weather(), ping()], json!("required"));
    let one = "<tool_call>\n{\"name\": \"ping\", \"arguments\": {}}\n</tool_call>";
    let ping = ToolCall { name: "ping".into(), arguments: "{}".into() };
    assert_eq!(s.read_calls(&format!("{one}\n")), Some(vec![ping.clone()]), "a newline after the last call");
    assert_eq!(s.read_calls(&format!("{one}\n{one}\n<tool_call>\n{{\"name\": \"get_w")), Some(vec![ping.clone(), ping.clone()]));
    assert_eq!(s.read_calls(&format!("{one}\n<tool")), Some(vec![ping]));
    assert_eq!(s.read_calls(&one[..20]), None, "no call is whole");
}

/// Feeds `text` to a constraint token by token, as the tokenizer splits it.
fn feed(c: &mut crate::grammar::Constraint, text: &str) {
    for t in crate::grammar::tests::tokenizer().encode(text, false).unwrap() {
        c.accept(t).unwrap_or_else(|e| panic!("{text:?}: {e}"));
    }
}

#[test]
fn parallel_calls_may_end_after_a_newline_and_stop_at_the_most_calls() {
    let s = set(vec![ping()], json!("required"));
    let grammar = compiler().compile(&s.grammar().unwrap().unwrap()).unwrap();
    let one = "<tool_call>\n{\"name\": \"ping\", \"arguments\": {}}\n</tool_call>";
    let mut c = grammar.start();
    feed(&mut c, one);
    feed(&mut c, "\n");
    assert!(c.can_end(), "the answer may end after a call and a newline");
    let mut c = grammar.start();
    let most = vec![one; MAX_PARALLEL_CALLS].join("\n");
    feed(&mut c, &most);
    feed(&mut c, "\n");
    assert!(c.is_complete(), "after {MAX_PARALLEL_CALLS} calls only the end may follow");
    assert_eq!(s.read_calls(&format!("{most}\n")).map(|c| c.len()), Some(MAX_PARALLEL_CALLS));
}

/// Every sampled output of every choice is text that opens no call (auto only), or calls whose
/// arguments validate against the schema of the function they name.
#[test]
fn sampled_calls_always_validate() {
    let tools = vec![weather(), lookup(), ping()];
    let validators: Vec<(String, jsonschema::Validator)> =
        ["get_weather", "lookup_order", "ping"].iter().map(|n| (n.to_string(), jsonschema::validator_for(&schema_of(&tools, n)).unwrap())).collect();
    let mut rng = StdRng::seed_from_u64(7);
    let mut seen = std::collections::BTreeMap::<&str, usize>::new();
    for (choice, runs) in [(json!("required"), 12), (json!({"type": "function", "function": {"name": "lookup_order"}}), 6), (json!("auto"), 12)] {
        let s = set(tools.clone(), choice.clone());
        let grammar = compiler().compile(&s.grammar().unwrap().unwrap()).unwrap();
        for _ in 0..runs {
            let mut c = grammar.start();
            let Some(text) = sample(&mut c, &mut rng, 400) else { continue };
            match s.read_calls(&text) {
                Some(calls) => {
                    assert!(!calls.is_empty());
                    for call in &calls {
                        let (_, v) = validators.iter().find(|(n, _)| *n == call.name).unwrap_or_else(|| panic!("unknown function in {text:?}"));
                        let args: Value = serde_json::from_str(&call.arguments).unwrap();
                        assert!(v.is_valid(&args), "{choice}: {text:?}");
                    }
                    if let ToolChoice::Named(n) = &s.choice {
                        assert_eq!(calls.len(), 1, "a named choice makes one call: {text:?}");
                        assert_eq!(&calls[0].name, n);
                    }
                    *seen.entry("calls").or_default() += 1;
                }
                None => {
                    assert_eq!(s.choice, ToolChoice::Auto, "{choice}: only auto may answer in text: {text:?}");
                    assert!(!text.starts_with("<tool_call>"), "text that opens a call must be one: {text:?}");
                    *seen.entry("text").or_default() += 1;
                }
            }
        }
    }
    assert!(seen.get("calls").copied().unwrap_or(0) >= 12, "{seen:?}");
}

#[test]
fn tools_reach_the_template_or_the_system_message() {
    use crate::tokenizer::tests::{edited_copy, load};
    let messages = vec![
        ChatMessage::new("user", "weather?"),
        ChatMessage {
            tool_calls: Some(vec![json!({"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\":\"Oslo\"}"}})]),
            ..ChatMessage::new("assistant", "")
        },
        ChatMessage { tool_call_id: Some("call_1".into()), ..ChatMessage::new("tool", "12 degrees") },
    ];
    let s = set(vec![weather()], Value::Null);

    // A template that knows tools gets them, and the call's arguments as an object.
    let dir = edited_copy(|_, cfg| {
        cfg["chat_template"] = json!(
            "{% for t in tools %}[{{ t.function.name }}]{% endfor %}{% for m in messages %}{{ m.role }}:{{ m.content }}{% if m.tool_calls %}{% for c in m.tool_calls %}<{{ c.function.name }} {{ c.function.arguments.city }}>{% endfor %}{% endif %};{% endfor %}"
        );
    });
    let tok = load(&dir);
    assert!(tok.chat_template_reads_tools(true));
    assert_eq!(render(&tok, messages.clone(), Some(&s)).unwrap().0, "[get_weather]user:weather?;assistant:<get_weather Oslo>;tool:12 degrees;");

    // One that does not: a system message describes them, calls and results become text.
    let dir = edited_copy(|_, cfg| {
        cfg["chat_template"] = json!("{% for m in messages %}{{ m.role }}:{{ m.content }};{% endfor %}");
    });
    let tok = load(&dir);
    assert!(!tok.chat_template_reads_tools(true));
    let text = render(&tok, messages.clone(), Some(&s)).unwrap().0;
    assert!(text.starts_with("system:You can call functions."), "{text}");
    assert!(text.contains("\"name\":\"get_weather\""), "{text}");
    assert!(text.contains("assistant:<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\":\"Oslo\"}}\n</tool_call>;"), "{text}");
    assert!(text.ends_with("user:<tool_response>\n12 degrees\n</tool_response>;"), "{text}");
    // With `tool_choice: none` nothing invites a call.
    let none = set(vec![weather()], json!("none"));
    assert!(!render(&tok, messages, Some(&none)).unwrap().0.contains("You can call functions"));
}
