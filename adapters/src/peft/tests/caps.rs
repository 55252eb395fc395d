//! The caps on what an untrusted config can cost: file size, entries, key lengths, and what its
//! regexes compile to, one by one and together.

use super::*;
use crate::peft::{MAX_CONFIG_BYTES, MAX_LIST_ENTRIES, MAX_PATTERN_ENTRIES, MAX_PATTERN_LEN, MAX_REGEX_BYTES, MAX_TOTAL_REGEX_BYTES};

fn parse(text: &str) -> PeftConfig {
    PeftConfig::parse(Path::new(crate::peft::CONFIG_FILE), text).unwrap_or_else(|e| panic!("{e}"))
}

/// A JSON object with `n` entries `key(i): value`.
fn object(n: usize, key: impl Fn(usize) -> String, value: &str) -> String {
    let body: Vec<String> = (0..n).map(|i| format!("{:?}: {value}", key(i))).collect();
    format!("{{{}}}", body.join(", "))
}

fn list(n: usize, item: impl Fn(usize) -> String) -> String {
    format!("[{}]", (0..n).map(item).collect::<Vec<_>>().join(", "))
}

#[test]
fn pattern_maps_are_capped_in_entries() {
    // At the cap, with keys naming single modules as real configs do, both maps parse.
    let full = |i: usize| format!("model.layers.{i}.self_attn.q_proj");
    let at_cap = object(MAX_PATTERN_ENTRIES, full, "4");
    let c = parse(&config(&[("rank_pattern", &at_cap), ("alpha_pattern", &at_cap)]));
    assert_eq!((c.rank_pattern.len(), c.alpha_pattern.len()), (MAX_PATTERN_ENTRIES, MAX_PATTERN_ENTRIES));

    let over = object(MAX_PATTERN_ENTRIES + 1, full, "4");
    for map in ["rank_pattern", "alpha_pattern"] {
        refused(&config(&[(map, &over)]), &qv_tensors(), &["adapter_config.json", &format!("key `{map}`"), "1025 entries", "limit of 1024"]);
    }
}

#[test]
fn lists_are_capped_in_entries() {
    let names = |n| list(n, |i| format!("\"m{i}\""));
    let layers = |n| list(n, |i| i.to_string());
    let c = parse(&config(&[
        ("target_modules", &names(MAX_LIST_ENTRIES)),
        ("exclude_modules", &names(MAX_LIST_ENTRIES)),
        ("layers_to_transform", &layers(MAX_LIST_ENTRIES)),
        ("layers_pattern", &names(MAX_LIST_ENTRIES)),
    ]));
    assert_eq!(c.layer_index.len(), MAX_LIST_ENTRIES);
    for (key, value) in [
        ("target_modules", names(MAX_LIST_ENTRIES + 1)),
        ("exclude_modules", names(MAX_LIST_ENTRIES + 1)),
        ("layers_to_transform", layers(MAX_LIST_ENTRIES + 1)),
        ("layers_pattern", names(MAX_LIST_ENTRIES + 1)),
    ] {
        refused(&config(&[(key, &value)]), &qv_tensors(), &["adapter_config.json", &format!("key `{key}`"), "1025 entries", "limit of 1024"]);
    }
}

#[test]
fn over_long_keys_and_regexes_are_refused() {
    let at_cap = "q".repeat(MAX_PATTERN_LEN);
    let c = parse(&config(&[("rank_pattern", &object(1, |_| at_cap.clone(), "4")), ("target_modules", &format!("{at_cap:?}"))]));
    assert_eq!(c.rank_pattern[0].key.len(), MAX_PATTERN_LEN);

    let long = "q".repeat(MAX_PATTERN_LEN + 1);
    // The key is named by its first 64 bytes.
    let shown = format!("{}…", &long[..64]);
    for map in ["rank_pattern", "alpha_pattern"] {
        let text = config(&[(map, &object(1, |_| long.clone(), "4"))]);
        refused(&text, &qv_tensors(), &["adapter_config.json", &format!("key `{map}.{shown}`"), "1025 bytes long", "limit of 1024"]);
    }
    for key in ["target_modules", "exclude_modules", "layers_pattern"] {
        refused(&config(&[(key, &format!("{long:?}"))]), &qv_tensors(), &["adapter_config.json", &format!("key `{key}`"), "1025 bytes long"]);
        let in_list = format!(r#"["q_proj", {long:?}]"#);
        refused(&config(&[(key, &in_list)]), &qv_tensors(), &["adapter_config.json", &format!("key `{key}`"), "entry 1 is 1025 bytes long"]);
    }
}

#[test]
fn regexes_that_compile_too_big_are_refused() {
    let too_big = format!("compiles to more than {MAX_REGEX_BYTES} bytes");
    let cases: &[(&str, &str, &str)] = &[
        ("rank_pattern", r#"{"(a{1000}){1000}": 4}"#, "rank_pattern.(a{1000}){1000}"),
        ("alpha_pattern", r#"{"q_proj": 16, "\\w{1000}": 8}"#, r"alpha_pattern.\w{1000}"),
        ("target_modules", r#""(?:\\w{100}){100}""#, "target_modules"),
        ("exclude_modules", r#""x{1000}{1000}""#, "exclude_modules"),
    ];
    for (key, value, named) in cases {
        refused(&config(&[(key, value)]), &qv_tensors(), &["adapter_config.json", &format!("key `{named}`"), &too_big]);
    }
    let text = config(&[("layers_to_transform", "[1]"), ("layers_pattern", r#"["layers", "\\w{1000}"]"#)]);
    refused(&text, &qv_tensors(), &["adapter_config.json", "key `layers_pattern`", &too_big]);
}

#[test]
fn regexes_share_one_compile_budget() {
    // `\w{12}` alone compiles to more than half a MiB: one such key is fine, but the config's
    // regexes together may not use more than the budget.
    let key = |i: usize| format!(r"\w{{12}}x{i}");
    parse(&config(&[("rank_pattern", &object(1, key, "4"))]));
    let n = MAX_TOTAL_REGEX_BYTES / MAX_REGEX_BYTES + 1;
    let text = config(&[("rank_pattern", &object(n, key, "4"))]);
    refused(&text, &qv_tensors(), &["adapter_config.json", &format!("key `rank_pattern.{}`", key(n - 1)), "together compile to more than"]);
}

#[test]
fn layers_pattern_is_compiled_at_parse_time() {
    // An invalid layers_pattern is refused when parsing, not skipped at every match.
    let text = config(&[("layers_to_transform", "[1]"), ("layers_pattern", r#""layers(""#)]);
    refused(&text, &qv_tensors(), &["adapter_config.json", "key `layers_pattern`", "invalid regex"]);
    let c = parse(&config(&[("layers_to_transform", "[1]"), ("layers_pattern", r#"["h", "layers"]"#)]));
    assert_eq!(c.layer_index.len(), 2);
    assert_eq!(parse(&config(&[("layers_to_transform", "[1]")])).layer_index.len(), 1, "PEFT's default pattern");
    assert!(parse(&config(&[])).layer_index.is_empty(), "not needed without layers_to_transform");
}

#[test]
fn config_file_size_is_capped() {
    let padding = format!("{:?}", " ".repeat(MAX_CONFIG_BYTES as usize));
    refused(&config(&[("padding", &padding)]), &qv_tensors(), &["adapter_config.json", &format!("more than the limit of {MAX_CONFIG_BYTES}")]);
}

#[test]
fn objects_with_many_keys_parse_in_linear_time() {
    // 200k distinct keys (2.6 MB, under the file cap) take about 0.2 s in a debug build; a
    // duplicate check that scans the keys seen so far takes over 30 s.
    let many = object(200_000, |i| format!("k{i}"), "0");
    let text = config(&[("unknown", &many)]);
    let start = std::time::Instant::now();
    let c = parse(&text);
    let took = start.elapsed();
    assert!(c.rank_pattern.is_empty());
    assert!(took < std::time::Duration::from_secs(5), "parsing took {took:?}");
}
