//! The shared validation: named cases, and properties over arbitrary input (never a panic,
//! every refusal a typed 400, every accepted request within the bounds).

use proptest::prelude::*;

use super::*;
use crate::model::ModelConfig;

fn limits() -> PromptLimits {
    PromptLimits { context: 128, max_bytes: 128 * 8 }
}

fn message(e: ApiError) -> String {
    match e {
        ApiError::Invalid(m) => m,
        other => panic!("expected a 400, got {other:?}"),
    }
}

#[test]
fn each_limit_is_refused_with_a_message_that_names_it() {
    let ok = Knobs::default();
    assert!(ok.check().is_ok());
    for (knobs, needle) in [
        (Knobs { n: Some(0), ..ok.clone() }, "`n`"),
        (Knobs { n: Some(MAX_SAMPLES + 1), ..ok.clone() }, "`n`"),
        (Knobs { max_tokens: Some(0), ..ok.clone() }, "max_tokens"),
        (Knobs { logprobs: Some(21), ..ok.clone() }, "logprobs"),
        (Knobs { stop: vec!["x".into(); MAX_STOPS + 1], ..ok.clone() }, "stop strings"),
        (Knobs { stop: vec![String::new()], ..ok.clone() }, "empty"),
        (Knobs { stop: vec!["y".repeat(MAX_STOP_BYTES + 1)], ..ok.clone() }, "stop string"),
        (Knobs { top_k: Some(-2), ..ok.clone() }, "top_k"),
        (Knobs { temperature: Some(f32::NAN), ..ok.clone() }, "temperature"),
        (Knobs { top_p: Some(0.0), ..ok.clone() }, "top_p"),
        (Knobs { presence_penalty: Some(9.0), ..ok.clone() }, "presence_penalty"),
    ] {
        let m = message(knobs.check().unwrap_err());
        assert!(m.contains(needle), "{knobs:?}: {m}");
    }
    assert!(Knobs { stop: vec!["z".repeat(MAX_STOP_BYTES); MAX_STOPS], n: Some(MAX_SAMPLES), logprobs: Some(20), ..ok }.check().is_ok());
}

#[test]
fn prompts_are_refused_by_their_size_before_tokenizing() {
    let l = limits();
    assert!(check_prompts(&[Prompt::Text("hi".into())], &l).is_ok());
    for (prompts, needle) in [
        (vec![], "empty"),
        (vec![Prompt::Text(String::new())], "empty"),
        (vec![Prompt::Ids(vec![])], "empty"),
        (vec![Prompt::Text("x".into()); MAX_PROMPTS + 1], "at most 64 prompts"),
        (vec![Prompt::Text("x".repeat(l.max_bytes + 1))], "more than the model's context"),
        (vec![Prompt::Ids(vec![1; l.context + 1])], "context length"),
        (vec![Prompt::Chat(vec![], None)], "messages"),
        (vec![Prompt::Chat(vec![ChatMessage::new("wizard", "hi")], None)], "role \"wizard\""),
        (vec![Prompt::Chat(vec![ChatMessage::new("user", "x".repeat(l.max_bytes))], None)], "more than the model's context"),
    ] {
        let m = message(check_prompts(&prompts, &l).unwrap_err());
        assert!(m.contains(needle), "{needle}: {m}");
    }
    for role in CHAT_ROLES {
        assert!(check_prompts(&[Prompt::Chat(vec![ChatMessage::new(role, "hi")], None)], &l).is_ok(), "{role}");
    }
}

#[test]
fn budgets_and_defaults_never_overflow() {
    let k = Knobs { max_tokens: None, ..Knobs::default() };
    let r = k.request(vec![1; 100], DefaultMax::RestOfContext, 128).unwrap();
    assert_eq!(r.stop.max_new_tokens, 28);
    let r = k.request(vec![1; 200], DefaultMax::RestOfContext, 128).unwrap();
    assert_eq!(r.stop.max_new_tokens, 1, "at least one; the context check refuses it later");
    let big = Knobs { max_tokens: Some(u32::MAX), n: Some(MAX_SAMPLES), ..Knobs::default() };
    let requests: Vec<_> = (0..MAX_PROMPTS).map(|_| big.request(vec![1; 10], DefaultMax::Tokens(16), usize::MAX).unwrap()).collect();
    let expect = MAX_PROMPTS as u64 * (10 + u64::from(MAX_SAMPLES) * u64::from(u32::MAX));
    assert_eq!(token_budget(&requests), expect);
}

fn model() -> ModelConfig {
    let dir = tempfile::tempdir().unwrap();
    crate::synth::synthesize_model(&crate::synth::SynthOptions {
        out: dir.path().join("m"),
        preset: crate::synth::Preset::Tiny,
        seed: 0,
        dtype: crate::synth::FileDType::F32,
        kv_heads: None,
    })
    .unwrap();
    ModelConfig::from_dir(&dir.path().join("m")).unwrap()
}

fn any_knobs() -> impl Strategy<Value = Knobs> {
    let float = prop_oneof![Just(f32::NAN), Just(f32::INFINITY), Just(-f32::INFINITY), any::<f32>(), -3.0f32..3.0];
    (
        (proptest::option::of(any::<u32>()), proptest::option::of(float.clone()), proptest::option::of(float.clone()), proptest::option::of(any::<i32>())),
        (proptest::option::of(any::<u32>()), proptest::collection::vec(".{0,300}", 0..20), proptest::option::of(any::<u64>())),
        (
            proptest::option::of(float.clone()),
            proptest::option::of(float.clone()),
            proptest::option::of(float),
            any::<bool>(),
            proptest::option::of(any::<u32>()),
        ),
    )
        .prop_map(
            |((max_tokens, temperature, top_p, top_k), (n, stop, seed), (presence_penalty, frequency_penalty, repetition_penalty, ignore_eos, logprobs))| {
                Knobs {
                    max_tokens,
                    temperature,
                    top_p,
                    top_k,
                    min_p: None,
                    n,
                    stop,
                    seed,
                    presence_penalty,
                    frequency_penalty,
                    repetition_penalty,
                    ignore_eos,
                    logprobs,
                }
            },
        )
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    /// Whatever is sent, validation answers Ok or a 400, and what it accepts is within every
    /// bound; the model's own check then never panics either.
    #[test]
    fn any_knobs_and_prompt_are_accepted_within_bounds_or_refused(knobs in any_knobs(), prompt in proptest::collection::vec(any::<u32>(), 0..300)) {
        let model = model_once();
        match knobs.check() {
            Err(e) => { message(e); }
            Ok(()) => {
                let r = knobs.request(prompt.clone(), DefaultMax::RestOfContext, model.max_position_embeddings);
                let r = r.unwrap();
                prop_assert!(r.n >= 1 && r.n <= MAX_SAMPLES);
                prop_assert!(r.stop.max_new_tokens >= 1);
                prop_assert!(r.stop.stop_strings.len() <= MAX_STOPS && r.stop.stop_strings.iter().all(|s| !s.is_empty() && s.len() <= MAX_STOP_BYTES));
                prop_assert!(r.sampling.logprobs.is_none_or(|l| l <= MAX_LOGPROBS));
                let _ = token_budget(std::slice::from_ref(&r));
                let _ = r.max_pages(16);
                let _ = r.validate(model);
            }
        }
        let prompts = vec![Prompt::Ids(prompt)];
        if let Err(e) = check_prompts(&prompts, &limits()) { message(e); }
    }

    #[test]
    fn any_chat_is_accepted_or_refused_with_a_400(roles in proptest::collection::vec("[a-z]{0,12}", 0..8), content in ".{0,400}") {
        let messages: Vec<ChatMessage> = roles.iter().map(|r| ChatMessage::new(r.clone(), content.clone())).collect();
        if let Err(e) = check_prompts(&[Prompt::Chat(messages, None)], &limits()) { message(e); }
    }
}

fn model_once() -> &'static ModelConfig {
    static MODEL: std::sync::OnceLock<ModelConfig> = std::sync::OnceLock::new();
    MODEL.get_or_init(model)
}
