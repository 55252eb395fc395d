//! Grammars against the reference tokenizer, sampled from random logits (which never make JSON
//! on their own): every finished output matches its specification.

use std::path::PathBuf;
use std::sync::{Arc, OnceLock};

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde_json::{Value, json};

use super::*;

pub(crate) fn tokenizer() -> Arc<Tokenizer> {
    static T: OnceLock<Arc<Tokenizer>> = OnceLock::new();
    T.get_or_init(|| {
        let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/reference/llama/model-f32");
        Arc::new(Tokenizer::from_dir(&dir).unwrap())
    })
    .clone()
}

pub(crate) fn compiler() -> &'static GrammarCompiler {
    static C: OnceLock<GrammarCompiler> = OnceLock::new();
    C.get_or_init(|| GrammarCompiler::new(tokenizer(), tokenizer().eos_token_ids(), GrammarLimits::default()).unwrap())
}

/// Samples from random logits under the constraint until end of sequence: the text (without
/// it), or `None` past `budget` tokens.
pub(crate) fn sample(constraint: &mut Constraint, rng: &mut StdRng, budget: usize) -> Option<String> {
    let t = tokenizer();
    let vocab = t.vocab_size() + 3; // a model's padding rows past the vocabulary
    let mut out = Vec::new();
    for _ in 0..budget {
        let mask = constraint.mask().unwrap();
        let mut logits: Vec<f32> = (0..vocab).map(|_| rng.random_range(-3.0..3.0)).collect();
        mask.apply(&mut logits);
        for (id, &l) in logits.iter().enumerate() {
            assert_eq!(l.is_finite(), mask.allows(id as u32), "token {id}");
        }
        let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let weights: Vec<f32> = logits.iter().map(|&l| (l - max).exp()).collect();
        let total: f32 = weights.iter().sum();
        let mut draw = rng.random_range(0.0..total);
        let mut token = 0;
        for (id, w) in weights.iter().enumerate() {
            if *w > 0.0 {
                token = id as u32;
                if draw < *w {
                    break;
                }
                draw -= w;
            }
        }
        if t.eos_token_ids().contains(&token) {
            assert!(constraint.is_complete() || constraint.can_end());
            constraint.accept(token).unwrap();
            return Some(t.decode(&out, false).unwrap());
        }
        constraint.accept(token).unwrap();
        out.push(token);
    }
    None
}

/// Schemas of the kinds extraction and classification adapters are deployed for: nested
/// objects, bounded arrays, enums, patterns, numeric ranges, optional fields, references.
/// Strings are bounded so that random logits finish them.
pub(crate) fn schemas() -> Vec<Value> {
    let s = |n: u32| json!({"type": "string", "maxLength": n});
    let obj = |props: Value, required: Value| json!({"type": "object", "properties": props, "required": required, "additionalProperties": false});
    vec![
        json!({"type": "integer"}),
        json!({"type": "integer", "minimum": 0, "maximum": 100}),
        json!({"type": "integer", "minimum": -50, "maximum": -10}),
        json!({"type": "number", "minimum": 0, "maximum": 1}),
        json!({"type": "number", "exclusiveMinimum": 10, "maximum": 20}),
        json!({"type": "boolean"}),
        json!({"type": "null"}),
        json!({"enum": ["positive", "negative", "neutral"]}),
        json!({"enum": [1, "two", null, true]}),
        json!({"const": "fixed"}),
        s(8),
        json!({"type": "string", "minLength": 3, "maxLength": 6}),
        json!({"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"}),
        json!({"type": "string", "pattern": "^(cat|dog|bird)s?$"}),
        json!({"type": "string", "pattern": "^[a-z]+@[a-z]+\\.(com|org)$", "maxLength": 20}),
        json!({"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 2, "maxItems": 4}),
        json!({"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3}),
        json!({"type": "array", "items": s(5), "minItems": 1, "maxItems": 2}),
        json!({"type": "array", "prefixItems": [{"type": "integer", "minimum": 0, "maximum": 5}, {"type": "boolean"}], "items": false}),
        json!({"type": "array", "items": {"type": "array", "items": {"type": "boolean"}, "maxItems": 2}, "maxItems": 2}),
        obj(json!({"name": s(10)}), json!(["name"])),
        obj(json!({"name": s(10), "age": {"type": "integer", "minimum": 0, "maximum": 130}}), json!(["name", "age"])),
        obj(json!({"name": s(10), "age": {"type": "integer", "minimum": 0, "maximum": 130}}), json!(["name"])),
        obj(json!({"label": {"enum": ["spam", "ham"]}, "confidence": {"type": "number", "minimum": 0, "maximum": 1}}), json!(["label", "confidence"])),
        obj(json!({"sentiment": {"enum": ["pos", "neg"]}, "reasons": {"type": "array", "items": s(6), "maxItems": 2}}), json!(["sentiment"])),
        obj(json!({"id": {"type": "string", "pattern": "^[0-9]{6}$"}, "active": {"type": "boolean"}}), json!(["id", "active"])),
        obj(
            json!({"point": obj(json!({"x": {"type": "integer", "minimum": -9, "maximum": 9}, "y": {"type": "integer", "minimum": -9, "maximum": 9}}), json!(["x", "y"]))}),
            json!(["point"]),
        ),
        obj(
            json!({"user": obj(json!({"name": s(6), "email": {"type": "string", "pattern": "^[a-z]{1,5}@x\\.io$"}}), json!(["name", "email"])), "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3}}),
            json!(["user", "tags"]),
        ),
        obj(json!({"a": obj(json!({"b": obj(json!({"c": {"type": "boolean"}}), json!(["c"]))}), json!(["b"]))}), json!(["a"])),
        obj(
            json!({"items": {"type": "array", "items": obj(json!({"sku": {"type": "string", "pattern": "^[A-Z][0-9]{2}$"}, "qty": {"type": "integer", "minimum": 1, "maximum": 9}}), json!(["sku", "qty"])), "minItems": 1, "maxItems": 3}}),
            json!(["items"]),
        ),
        obj(json!({"when": {"type": "string", "pattern": "^20[0-9]{2}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])$"}}), json!(["when"])),
        obj(json!({"score": {"type": "integer", "minimum": 1, "maximum": 5}, "comment": {"anyOf": [s(8), {"type": "null"}]}}), json!(["score", "comment"])),
        obj(json!({"kind": {"const": "circle"}, "radius": {"type": "number", "minimum": 0, "maximum": 10}}), json!(["kind", "radius"])),
        json!({"anyOf": [{"type": "integer", "minimum": 0, "maximum": 9}, {"type": "boolean"}]}),
        json!({"oneOf": [obj(json!({"cat": {"type": "boolean"}}), json!(["cat"])), obj(json!({"dog": {"type": "integer", "minimum": 0, "maximum": 3}}), json!(["dog"]))]}),
        json!({"type": ["integer", "null"], "minimum": 0, "maximum": 10}),
        json!({"type": ["string", "boolean"], "maxLength": 4}),
        json!({"$defs": {"pos": {"type": "integer", "minimum": 1, "maximum": 9}}, "type": "object", "properties": {"a": {"$ref": "#/$defs/pos"}, "b": {"$ref": "#/$defs/pos"}}, "required": ["a", "b"], "additionalProperties": false}),
        json!({"$defs": {"leaf": obj(json!({"v": {"type": "boolean"}}), json!(["v"]))}, "type": "array", "items": {"$ref": "#/$defs/leaf"}, "maxItems": 2}),
        obj(
            json!({"matrix": {"type": "array", "items": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 1}, "minItems": 2, "maxItems": 2}, "minItems": 2, "maxItems": 2}}),
            json!(["matrix"]),
        ),
        obj(
            json!({"country": {"enum": ["FR", "DE", "JP", "US"]}, "population": {"type": "integer", "minimum": 0, "maximum": 2000000000_i64}}),
            json!(["country", "population"]),
        ),
        obj(json!({"price": {"type": "number", "minimum": 0.5, "maximum": 99.5}, "currency": {"enum": ["EUR", "USD"]}}), json!(["price", "currency"])),
        obj(json!({"ok": {"type": "boolean"}, "error": {"type": "null"}}), json!(["ok", "error"])),
        obj(
            json!({"title": s(12), "year": {"type": "integer", "minimum": 1900, "maximum": 2030}, "genres": {"type": "array", "items": {"enum": ["drama", "comedy", "horror"]}, "minItems": 1, "maxItems": 2}}),
            json!(["title", "year", "genres"]),
        ),
        obj(json!({"step": {"type": "integer", "minimum": 0, "maximum": 99}, "done": {"type": "boolean"}, "note": s(5)}), json!([])),
        obj(
            json!({"intent": {"enum": ["book", "cancel", "ask"]}, "slots": obj(json!({"date": {"type": "string", "pattern": "^[0-9]{2}/[0-9]{2}$"}, "people": {"type": "integer", "minimum": 1, "maximum": 8}}), json!(["people"]))}),
            json!(["intent", "slots"]),
        ),
        obj(
            json!({"lat": {"type": "number", "minimum": -90, "maximum": 90}, "lon": {"type": "number", "minimum": -180, "maximum": 180}}),
            json!(["lat", "lon"]),
        ),
        obj(json!({"code": {"type": "integer", "enum": [200, 404, 500]}, "message": s(10)}), json!(["code", "message"])),
        obj(
            json!({"answer": {"type": "string", "pattern": "^(yes|no)$"}, "because": {"type": "array", "items": {"type": "string", "pattern": "^[a-z]{2,4}$"}, "maxItems": 3}}),
            json!(["answer", "because"]),
        ),
        obj(json!({"color": {"type": "string", "pattern": "^#[0-9a-f]{6}$"}}), json!(["color"])),
        obj(json!({"version": {"type": "string", "pattern": "^[0-9]\\.[0-9]{1,2}\\.[0-9]$"}, "stable": {"type": "boolean"}}), json!(["version", "stable"])),
        obj(
            json!({"entities": {"type": "array", "items": obj(json!({"text": s(6), "type": {"enum": ["PER", "ORG", "LOC"]}}), json!(["text", "type"])), "maxItems": 3}}),
            json!(["entities"]),
        ),
        obj(
            json!({"x": {"type": "integer", "minimum": 0, "maximum": 9}, "y": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 9}, {"enum": ["none"]}]}}),
            json!(["x", "y"]),
        ),
        json!({"allOf": [{"type": "integer", "minimum": 0}, {"maximum": 50}]}),
        json!({"enum": [[1, 2], {"a": "b"}, "plain"]}),
    ]
}

#[test]
fn every_output_of_fifty_schemas_validates_against_its_schema() {
    let schemas = schemas();
    assert!(schemas.len() >= 50, "{}", schemas.len());
    let mut rng = StdRng::seed_from_u64(7);
    let mut finished = 0;
    for (i, schema) in schemas.iter().enumerate() {
        let validator = jsonschema::validator_for(schema).unwrap_or_else(|e| panic!("schema {i} {schema}: {e}"));
        for round in 0..3 {
            let mut c = compiler().compile(&GrammarSpec::JsonSchema(schema.clone())).unwrap_or_else(|e| panic!("schema {i} {schema}: {e}")).start();
            let Some(text) = sample(&mut c, &mut rng, 2000) else { panic!("schema {i} round {round}: no end within 2000 tokens: {schema}") };
            let value: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("schema {i}: {text:?} is not JSON: {e}"));
            let errors: Vec<String> = validator.iter_errors(&value).map(|e| e.to_string()).collect();
            assert!(errors.is_empty(), "schema {i} {schema}: {text} is invalid: {errors:?}");
            assert!(!text.contains(' ') || value.to_string().contains(' '), "compact JSON: {text:?}");
            finished += 1;
        }
    }
    assert_eq!(finished, schemas.len() * 3);
}

#[test]
fn regex_lark_and_choice_outputs_match() {
    let mut rng = StdRng::seed_from_u64(11);
    let patterns = ["[0-9]{3}-[0-9]{4}", "(yes|no|maybe)", "[a-f0-9]{8}", "[A-Z][a-z]{1,5}( [A-Z][a-z]{1,5})?", "-?(0|[1-9][0-9]{0,3})\\.[0-9]{2}"];
    for p in patterns {
        let whole = regex::Regex::new(&format!("^(?:{p})$")).unwrap();
        for _ in 0..5 {
            let mut c = compiler().compile(&GrammarSpec::Regex(p.into())).unwrap().start();
            let text = sample(&mut c, &mut rng, 200).unwrap();
            assert!(whole.is_match(&text), "{p}: {text:?}");
        }
    }
    // Sums of small numbers, as a grammar with recursion.
    let lark = "start: expr\nexpr: term (\"+\" term){0,3}\nterm: NUMBER | \"(\" expr \")\"\nNUMBER: /[1-9]/\n";
    let sums = regex::Regex::new(r"^[0-9+()]+$").unwrap();
    for _ in 0..10 {
        let mut c = compiler().compile(&GrammarSpec::Lark(lark.into())).unwrap().start();
        let text = sample(&mut c, &mut rng, 300).unwrap();
        assert!(sums.is_match(&text) && balanced(&text) && !text.contains("++") && !text.starts_with('+'), "{text:?}");
    }
    let choices = vec!["alpha".to_string(), "beta".into(), "a.b*c".into(), "gamma ray".into()];
    for _ in 0..10 {
        let mut c = compiler().compile(&GrammarSpec::Choice(choices.clone())).unwrap().start();
        let text = sample(&mut c, &mut rng, 50).unwrap();
        assert!(choices.contains(&text), "{text:?}");
    }
}

fn balanced(text: &str) -> bool {
    let mut depth = 0i32;
    for c in text.chars() {
        depth += match c {
            '(' => 1,
            ')' => -1,
            _ => 0,
        };
        if depth < 0 {
            return false;
        }
    }
    depth == 0
}

#[test]
fn the_json_object_format_takes_any_object_and_nothing_else() {
    let t = tokenizer();
    let eos = t.eos_token_ids()[0];
    // Walks `text`'s tokens through the mask: how many were allowed, and whether it may end there.
    let walk = |text: &str| {
        let mut c = compiler().compile(&GrammarSpec::JsonObject).unwrap().start();
        let tokens = t.encode(text, false).unwrap();
        for (i, &tok) in tokens.iter().enumerate() {
            if !c.mask().unwrap().allows(tok) {
                return (i, false);
            }
            c.accept(tok).unwrap();
        }
        (tokens.len(), c.mask().unwrap().allows(eos))
    };
    for ok in [r#"{"a":[1,2,{"b":null}],"c":"d"}"#, "{}", r#"{"x":{"y":{"z":true}}}"#] {
        let n = t.encode(ok, false).unwrap().len();
        assert_eq!(walk(ok), (n, true), "{ok}");
    }
    for bad in [r#"[1,2]"#, r#"{"a" 1}"#, r#""text""#, "{,}"] {
        let (allowed, end) = walk(bad);
        assert!(allowed < t.encode(bad, false).unwrap().len() || !end, "{bad} passed");
    }
    // Incomplete: every token allowed, but it may not end yet.
    let (_, end) = walk(r#"{"a":[1,"#);
    assert!(!end);
}

#[test]
fn masks_keep_allowed_logits_and_the_end_only_when_complete() {
    let t = tokenizer();
    let eos = t.eos_token_ids()[0];
    let mut c = compiler().compile(&GrammarSpec::Choice(vec!["ab".into()])).unwrap().start();
    let vocab = t.vocab_size() + 5;
    let mut logits = vec![1.5f32; vocab];
    let mask = c.mask().unwrap();
    mask.apply(&mut logits);
    assert!(logits[vocab - 1] == f32::NEG_INFINITY, "past the vocabulary");
    assert!(logits[eos as usize] == f32::NEG_INFINITY, "not complete yet");
    let allowed: Vec<usize> = (0..vocab).filter(|&i| logits[i] == 1.5).collect();
    assert_eq!(allowed.len(), mask.allowed());
    for &tok in &t.encode("ab", false).unwrap() {
        assert!(c.mask().unwrap().allows(tok));
        c.accept(tok).unwrap();
    }
    assert!(c.is_complete() || c.can_end());
    let mask = c.mask().unwrap();
    let mut logits = vec![0.25f32; vocab];
    mask.apply(&mut logits);
    let kept: Vec<u32> = (0..vocab as u32).filter(|&i| logits[i as usize].is_finite()).collect();
    let mut ends = t.eos_token_ids().to_vec();
    ends.sort();
    assert!(ends.len() > 1, "the fixture has several end tokens: {ends:?}");
    assert_eq!(kept, ends, "only the end, by any of its tokens");
    assert_eq!(logits[eos as usize], 0.25);
}

#[test]
fn refusals_name_the_problem_and_compiled_grammars_are_cached() {
    let c = compiler();
    let refused = |spec: GrammarSpec| match c.compile(&spec) {
        Err(e @ GrammarError::Refused { .. }) => e.to_string(),
        Err(e) => panic!("{spec:?}: {e:?}"),
        Ok(_) => panic!("{spec:?} compiled"),
    };
    let m = refused(GrammarSpec::Regex("(unclosed".into()));
    assert!(m.starts_with("the regular expression is refused"), "{m}");
    let m = refused(GrammarSpec::JsonSchema(json!({"type": "colour"})));
    assert!(m.contains("colour"), "{m}");
    let m = refused(GrammarSpec::JsonSchema(json!(false)));
    assert!(m.contains("matches nothing"), "{m}");
    let m = refused(GrammarSpec::JsonSchema(json!([1, 2])));
    assert!(m.contains("an array"), "{m}");
    let m = refused(GrammarSpec::Lark("start: undefined_rule\n".into()));
    assert!(m.contains("undefined_rule"), "{m}");
    let m = refused(GrammarSpec::JsonSchema(json!({"type": "object", "propertyNames": {"pattern": "^[a-z]+$"}})));
    assert!(m.contains("propertyNames"), "a keyword the library does not implement is named: {m}");
    let m = refused(GrammarSpec::Choice(vec![]));
    assert!(m.contains("no choices"), "{m}");
    let m = refused(GrammarSpec::JsonSchema(json!({"type": "integer", "minimum": 5, "maximum": 1})));
    assert!(!m.is_empty());
    // References that only lead to each other admit no value: said in words, without the
    // library's dump of its parser's state (the grammar, the tokens so far, its counters).
    let m = refused(GrammarSpec::JsonSchema(json!({"$ref": "#/definitions/a", "definitions": {"a": {"$ref": "#/definitions/a"}}})));
    assert_eq!(m, "the JSON schema is refused: no text matches it");

    let small = GrammarCompiler::new(tokenizer(), tokenizer().eos_token_ids(), GrammarLimits { max_spec_bytes: 64, ..GrammarLimits::default() }).unwrap();
    let big = GrammarSpec::Regex("a".repeat(65));
    assert_eq!(small.compile(&big).err(), Some(GrammarError::TooLarge { what: "the regular expression", size: 65, max: 64 }));
    // A grammar whose lexer takes more work than allowed is refused, not run.
    let tight = GrammarCompiler::new(tokenizer(), tokenizer().eos_token_ids(), GrammarLimits { compile_fuel: 1, ..GrammarLimits::default() }).unwrap();
    let heavy = GrammarSpec::Regex("(a|b|c|d|e|f|g|h){1,40}x[0-9]{5,30}(foo|bar|baz){2,20}".into());
    let r = tight.compile(&heavy);
    assert!(matches!(r, Err(GrammarError::Refused { .. })), "{:?}", r.err());

    let fresh = GrammarCompiler::new(tokenizer(), tokenizer().eos_token_ids(), GrammarLimits::default()).unwrap();
    let schema = GrammarSpec::JsonSchema(json!({"type": "object", "properties": {"a": {"type": "integer"}}}));
    let (a, b) = (fresh.compile(&schema).unwrap(), fresh.compile(&schema).unwrap());
    assert_eq!(a, b);
    assert_eq!(fresh.cached(), 1);
    // Each start is its own state.
    let (mut one, mut two) = (a.start(), b.start());
    let brace = tokenizer().encode("{", false).unwrap()[0];
    one.accept(brace).unwrap();
    assert!(!one.mask().unwrap().allows(brace) && two.mask().unwrap().allows(brace));
    fresh.compile(&GrammarSpec::Regex("[0-9]+".into())).unwrap();
    assert_eq!(fresh.cached(), 2);
}

/// A schema of its own for each `i`.
fn distinct_schema(i: usize) -> GrammarSpec {
    GrammarSpec::JsonSchema(json!({"type": "object", "properties": {format!("field_{i}"): {"type": "integer"}}, "required": [format!("field_{i}")]}))
}

#[test]
fn one_tenants_distinct_grammars_cannot_push_another_tenants_out_of_the_cache() {
    // A cache of about thirty small grammars, a quarter of it a tenant's share.
    let per = estimated_bytes(&distinct_schema(0));
    let limits = GrammarLimits { cache_bytes: per * 30, tenant_cache_percent: 25, ..GrammarLimits::default() };
    let c = GrammarCompiler::new(tokenizer(), tokenizer().eos_token_ids(), limits).unwrap();
    let kept = distinct_schema(1_000_000);
    c.compile_for(&kept, "quiet").unwrap();
    for i in 0..200 {
        // Every one compiles and works for its request, kept or not.
        let g = c.compile_for(&distinct_schema(i), "noisy").unwrap();
        assert!(g.start().mask().unwrap().allowed() > 0);
    }
    let share = per * 30 / 4;
    assert!(c.tenant_bytes("noisy") <= share, "{} of {share}", c.tenant_bytes("noisy"));
    assert!(c.tenant_bytes("noisy") + per > share, "the share is used: {}", c.tenant_bytes("noisy"));
    assert!(c.is_cached(&kept), "the quiet tenant's grammar is still kept");
    assert_eq!(c.tenant_bytes("quiet"), estimated_bytes(&kept));
    assert!(c.cached() <= 30 / 4 + 1, "{}", c.cached());
}
