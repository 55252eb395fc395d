use super::*;

fn request(id: &str, url: &str, body: &str) -> String {
    format!(r#"{{"custom_id": "{id}", "method": "POST", "url": "{url}", "body": {body}}}"#)
}

fn chat(id: &str) -> String {
    request(id, "/v1/chat/completions", r#"{"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}"#)
}

fn all_lines(text: &[u8]) -> Vec<(u64, Line)> {
    let mut r = LineReader::new(text);
    let mut out = Vec::new();
    while let Some(l) = r.next_line().unwrap() {
        out.push(l);
    }
    out
}

#[test]
fn lines_end_at_newlines_skip_blanks_and_pass_over_what_is_too_long() {
    let long = "x".repeat(MAX_LINE_BYTES + 10);
    let text = format!("a\r\n\n  \nb\n{long}\nc\n\u{e9}\nd");
    let mut bytes = text.into_bytes();
    bytes.extend_from_slice(b"\n\xff\xfe\n");
    let lines = all_lines(&bytes);
    let shown: Vec<(u64, Result<&str, &str>)> = lines.iter().map(|(n, l)| (*n, l.as_deref().map_err(String::as_str))).collect();
    assert_eq!(shown[..4], [(0, Ok("a")), (3, Ok("b")), (4, Err("the line is longer than 4194304 bytes")), (5, Ok("c"))]);
    assert_eq!(shown[4..], [(6, Ok("\u{e9}")), (7, Ok("d")), (8, Err("the line is not UTF-8"))]);
    assert!(all_lines(b"").is_empty());
}

#[test]
fn a_valid_file_counts_its_requests() {
    let text = format!("{}\n{}\n\n{}\n", chat("a"), request("b", "/v1/completions", r#"{"model": "m", "prompt": "x", "max_tokens": 2, "n": 2}"#), chat("c"));
    assert_eq!(check(text.as_bytes(), &GrammarLimits::default()).unwrap(), Checked::Valid { requests: 3 });
}

#[test]
fn every_invalid_line_is_named_with_its_problem() {
    let lines = [
        chat("a"),
        chat("a"),
        "not json".to_string(),
        request("m", "/v1/embeddings", "{}"),
        r#"{"custom_id": "g", "method": "GET", "url": "/v1/completions", "body": {}}"#.to_string(),
        request("s", "/v1/chat/completions", r#"{"model": "m", "messages": [], "stream": true}"#),
        request("t", "/v1/completions", r#"{"model": "m", "prompt": "x", "temperature": -1}"#),
        request("u", "/v1/completions", r#"{"model": "m", "prompt": "x", "prediction": {"type": "content", "content": "x"}}"#),
        r#"{"custom_id": "x", "method": "POST", "url": "/v1/completions", "body": {}, "extra": 1}"#.to_string(),
        request("", "/v1/completions", r#"{"model": "m", "prompt": "x"}"#),
    ];
    let Checked::Invalid { count, first } = check(lines.join("\n").as_bytes(), &GrammarLimits::default()).unwrap() else { panic!("accepted") };
    assert_eq!(count, 9);
    let at: Vec<(u64, Option<&str>)> = first.iter().map(|e| (e.line, e.custom_id.as_deref())).collect();
    assert_eq!(at, [(2, Some("a")), (3, None), (4, Some("m")), (5, Some("g")), (6, Some("s")), (7, Some("t")), (8, Some("u")), (9, Some("x")), (10, None)]);
    let message = |line: u64| first.iter().find(|e| e.line == line).map(|e| e.message.as_str()).unwrap_or_default();
    assert!(message(2).contains("unique"), "{}", message(2));
    assert!(message(4).contains("/v1/embeddings"), "{}", message(4));
    assert!(message(6).contains("stream"), "{}", message(6));
    assert!(message(7).contains("temperature"), "{}", message(7));
    assert!(message(8).contains("prediction"), "{}", message(8));
    assert!(message(10).contains("custom_id"), "{}", message(10));
    // An empty file is refused too.
    assert!(matches!(check(&b"\n\n"[..], &GrammarLimits::default()).unwrap(), Checked::Invalid { count: 1, .. }));
}

#[test]
fn a_file_holds_at_most_max_lines_requests_and_reports_at_most_a_hundred() {
    let line = chat("same");
    let mut text = String::new();
    for _ in 0..=MAX_LINES {
        text.push_str(&line);
        text.push('\n');
    }
    let Checked::Invalid { count, first } = check(text.as_bytes(), &GrammarLimits::default()).unwrap() else { panic!("accepted") };
    // Every line after the first repeats its id; the one past the bound says so too.
    assert_eq!(count, MAX_LINES + 1);
    assert_eq!(first.len(), MAX_REPORTED);
    let bound = text.lines().take(MAX_LINES as usize).collect::<Vec<_>>().join("\n");
    let Checked::Invalid { count, .. } = check(bound.as_bytes(), &GrammarLimits::default()).unwrap() else { panic!("accepted") };
    assert_eq!(count, MAX_LINES - 1, "the bound itself is allowed: only duplicates");
}

#[test]
fn a_scan_finds_the_models_and_the_lines_of_other_endpoints() {
    let text = [
        chat("a"),
        request("b", "/v1/chat/completions", r#"{"model": "other", "messages": []}"#),
        request("c", "/v1/completions", r#"{"model": "m", "prompt": "x"}"#),
        chat("d"),
    ]
    .join("\n");
    let scan = scan(text.as_bytes(), BatchEndpoint::ChatCompletions).unwrap();
    assert_eq!(scan.models.into_iter().collect::<Vec<_>>(), [("m".to_string(), 0), ("other".to_string(), 1)]);
    assert_eq!(scan.problem_count, 1);
    assert_eq!((scan.problems[0].line, scan.problems[0].custom_id.as_deref()), (3, Some("c")));
}

/// A schema whose `$ref`s chain `n` definitions.
fn ref_chain(n: usize) -> serde_json::Value {
    let mut defs = serde_json::Map::new();
    for i in 0..n {
        defs.insert(format!("A{i}"), serde_json::json!({"$ref": format!("#/$defs/A{}", i + 1)}));
    }
    defs.insert(format!("A{n}"), serde_json::json!({"type": "integer"}));
    serde_json::json!({"$ref": "#/$defs/A0", "$defs": defs})
}

#[test]
fn a_line_whose_constraint_nests_past_the_limit_is_named_at_upload() {
    let deep = ref_chain(1200);
    let messages = serde_json::json!([{"role": "user", "content": "hi"}]);
    let format =
        serde_json::json!({"model": "m", "messages": messages, "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": deep}}});
    let tool = serde_json::json!({"model": "m", "messages": messages, "tools": [{"type": "function", "function": {"name": "f", "parameters": deep}}]});
    let guided = serde_json::json!({"model": "m", "prompt": "x", "guided_json": deep});
    let shallow = serde_json::json!({"model": "m", "prompt": "x", "guided_json": ref_chain(20)});
    let lines = [
        chat("a"),
        request("format", "/v1/chat/completions", &format.to_string()),
        request("tool", "/v1/chat/completions", &tool.to_string()),
        request("guided", "/v1/completions", &guided.to_string()),
        request("shallow", "/v1/completions", &shallow.to_string()),
    ];
    let Checked::Invalid { count, first } = check(lines.join("\n").as_bytes(), &GrammarLimits::default()).unwrap() else { panic!("accepted") };
    assert_eq!(count, 3, "{first:?}");
    let named: Vec<&str> = first.iter().filter_map(|e| e.custom_id.as_deref()).collect();
    assert_eq!(named, ["format", "tool", "guided"]);
    assert!(first.iter().all(|e| e.message.contains("levels deep") && e.message.contains("at most 1000")), "{first:?}");
}
