//! Reading the JSON side files that sit next to `tokenizer.json`: `tokenizer_config.json`,
//! `special_tokens_map.json` and `generation_config.json`.
//!
//! Only the keys the engine acts on are interpreted; every other key is ignored, so configs written
//! by any transformers version load. Keys that are interpreted must have a sensible type, otherwise
//! loading fails with an error naming the file and the key.

use std::path::{Path, PathBuf};

use serde_json::{Map, Value};
use tokenizers::AddedToken;
use tokenizers::processors::template::TemplateProcessing;

use super::TokenizerError;

/// The named special tokens transformers knows, in its attribute order.
pub(crate) const NAMED_SPECIAL_TOKENS: [&str; 7] = ["bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token"];

/// Keys holding lists of extra special tokens (`extra_special_tokens` is the transformers 5 name).
const EXTRA_SPECIAL_TOKEN_LISTS: [&str; 2] = ["additional_special_tokens", "extra_special_tokens"];

/// Where a chat template's source text came from; used in error messages.
#[derive(Debug, Clone)]
pub(crate) struct TemplateSource {
    /// `"default"` for the main template, otherwise the name it was stored under.
    pub name: String,
    pub source: String,
    pub path: PathBuf,
}

/// Everything the tokenizer needs from the side files.
#[derive(Debug, Default)]
pub(crate) struct SideConfig {
    /// Named special tokens (`bos_token`, ...) in [`NAMED_SPECIAL_TOKENS`] order, only those set.
    pub named: Vec<(&'static str, AddedToken)>,
    /// `additional_special_tokens` / `extra_special_tokens`, deduplicated, in file order.
    pub extra: Vec<AddedToken>,
    /// `added_tokens_decoder` entries, sorted by id.
    pub added_tokens_decoder: Vec<(u32, AddedToken)>,
    /// `add_bos_token`; `None` when the key is absent (a JSON null counts as `false`).
    pub add_bos_token: Option<bool>,
    /// `add_eos_token`; `None` when the key is absent.
    pub add_eos_token: Option<bool>,
    pub clean_up_tokenization_spaces: bool,
    pub templates: Vec<TemplateSource>,
    /// `eos_token_id` from `generation_config.json`, in file order.
    pub generation_eos_ids: Vec<u32>,
}

impl SideConfig {
    pub(crate) fn named(&self, key: &str) -> Option<&AddedToken> {
        self.named.iter().find(|(k, _)| *k == key).map(|(_, t)| t)
    }
}

fn invalid(path: &Path, message: impl Into<String>) -> TokenizerError {
    TokenizerError::InvalidConfig { path: path.to_path_buf(), message: message.into() }
}

/// Reads a JSON file that may be absent. Absent: `Ok(None)`; unreadable or not JSON: an error.
fn read_optional_json(path: &Path) -> Result<Option<Value>, TokenizerError> {
    let bytes = match std::fs::read(path) {
        Ok(bytes) => bytes,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(source) => {
            return Err(TokenizerError::Io { path: path.to_path_buf(), source });
        }
    };
    serde_json::from_slice(&bytes).map(Some).map_err(|e| invalid(path, format!("not valid JSON: {e}")))
}

fn read_optional_text(path: &Path) -> Result<Option<String>, TokenizerError> {
    match std::fs::read_to_string(path) {
        Ok(text) => Ok(Some(text)),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(source) => Err(TokenizerError::Io { path: path.to_path_buf(), source }),
    }
}

fn as_object<'v>(value: &'v Value, path: &Path) -> Result<&'v Map<String, Value>, TokenizerError> {
    value.as_object().ok_or_else(|| invalid(path, "expected a JSON object at the top level"))
}

/// Parses a token given as a plain string or as an AddedToken-like object `{"content": ...}`.
/// `force_special` marks named special tokens, which transformers always treats as special.
fn parse_token(value: &Value, key: &str, path: &Path, force_special: bool) -> Result<Option<AddedToken>, TokenizerError> {
    match value {
        Value::Null => Ok(None),
        Value::String(s) => Ok(Some(AddedToken::from(s.clone(), true))),
        Value::Object(obj) => {
            let Some(content) = obj.get("content").and_then(Value::as_str) else {
                return Err(invalid(path, format!("`{key}` is an object without a string `content`")));
            };
            let flag = |name: &str, default: bool| -> Result<bool, TokenizerError> {
                match obj.get(name) {
                    None | Some(Value::Null) => Ok(default),
                    Some(Value::Bool(b)) => Ok(*b),
                    Some(_) => Err(invalid(path, format!("`{key}.{name}` must be a boolean"))),
                }
            };
            let special = force_special || flag("special", false)?;
            Ok(Some(AddedToken {
                content: content.to_owned(),
                single_word: flag("single_word", false)?,
                lstrip: flag("lstrip", false)?,
                rstrip: flag("rstrip", false)?,
                normalized: flag("normalized", !special)?,
                special,
            }))
        }
        _ => Err(invalid(path, format!("`{key}` must be a string, an object with `content`, or null"))),
    }
}

fn parse_bool(obj: &Map<String, Value>, key: &str, path: &Path) -> Result<Option<bool>, TokenizerError> {
    match obj.get(key) {
        None => Ok(None),
        Some(Value::Null) => Ok(Some(false)),
        Some(Value::Bool(b)) => Ok(Some(*b)),
        Some(_) => Err(invalid(path, format!("`{key}` must be a boolean"))),
    }
}

fn parse_token_list(obj: &Map<String, Value>, path: &Path, out: &mut Vec<AddedToken>) -> Result<(), TokenizerError> {
    for key in EXTRA_SPECIAL_TOKEN_LISTS {
        let items = match obj.get(key) {
            None | Some(Value::Null) => continue,
            Some(Value::Array(items)) => items,
            // transformers 5 also allows a {name: token} mapping of extra special tokens.
            Some(Value::Object(map)) => &map.values().cloned().collect::<Vec<_>>(),
            Some(_) => return Err(invalid(path, format!("`{key}` must be a list of tokens"))),
        };
        for item in items {
            if let Some(token) = parse_token(item, key, path, true)?
                && !out.iter().any(|t| t.content == token.content)
            {
                out.push(token);
            }
        }
    }
    Ok(())
}

/// Reads the named special tokens of one file into `named`. With `overwrite` a value from this
/// file replaces one already present; otherwise it only fills keys that are still missing.
fn merge_named(obj: &Map<String, Value>, path: &Path, named: &mut Vec<(&'static str, AddedToken)>, overwrite: bool) -> Result<(), TokenizerError> {
    for key in NAMED_SPECIAL_TOKENS {
        let Some(value) = obj.get(key) else { continue };
        let present = named.iter().position(|(k, _)| *k == key);
        if present.is_some() && !overwrite {
            continue;
        }
        let parsed = parse_token(value, key, path, true)?;
        match (present, parsed) {
            (Some(i), Some(token)) => named[i].1 = token,
            (None, Some(token)) => named.push((key, token)),
            (Some(i), None) => {
                named.remove(i);
            }
            (None, None) => {}
        }
    }
    named.sort_by_key(|(k, _)| NAMED_SPECIAL_TOKENS.iter().position(|n| n == k));
    Ok(())
}

fn parse_chat_templates(obj: &Map<String, Value>, path: &Path) -> Result<Vec<TemplateSource>, TokenizerError> {
    let source = |name: &str, text: &str| TemplateSource { name: name.to_owned(), source: text.to_owned(), path: path.to_path_buf() };
    match obj.get("chat_template") {
        None | Some(Value::Null) => Ok(Vec::new()),
        Some(Value::String(text)) => Ok(vec![source("default", text)]),
        Some(Value::Array(items)) => items
            .iter()
            .map(|item| {
                let name = item.get("name").and_then(Value::as_str);
                let text = item.get("template").and_then(Value::as_str);
                match (name, text) {
                    (Some(name), Some(text)) => Ok(source(name, text)),
                    _ => Err(invalid(path, "`chat_template` list entries must be objects with string `name` and `template`")),
                }
            })
            .collect(),
        Some(_) => Err(invalid(path, "`chat_template` must be a string or a list of {name, template}")),
    }
}

/// Chat templates stored as files: `chat_template.jinja` (the default; it takes precedence over
/// the `chat_template` key, as in transformers 5) and `additional_chat_templates/<name>.jinja`.
fn file_templates(dir: &Path) -> Result<Option<Vec<TemplateSource>>, TokenizerError> {
    let main = dir.join("chat_template.jinja");
    let Some(text) = read_optional_text(&main)? else {
        return Ok(None);
    };
    let mut templates = vec![TemplateSource { name: "default".into(), source: text, path: main }];
    let extra_dir = dir.join("additional_chat_templates");
    if let Ok(entries) = std::fs::read_dir(&extra_dir) {
        let mut paths: Vec<PathBuf> = entries.filter_map(|e| e.ok().map(|e| e.path())).collect();
        paths.sort();
        for path in paths {
            if path.extension().and_then(|e| e.to_str()) != Some("jinja") {
                continue;
            }
            let Some(name) = path.file_stem().and_then(|s| s.to_str()).map(str::to_owned) else {
                continue;
            };
            if let Some(source) = read_optional_text(&path)? {
                templates.push(TemplateSource { name, source, path });
            }
        }
    }
    Ok(Some(templates))
}

fn parse_generation_eos(value: &Value, path: &Path) -> Result<Vec<u32>, TokenizerError> {
    let bad = || invalid(path, "`eos_token_id` must be a token id or a list of token ids");
    let one = |v: &Value| v.as_u64().and_then(|id| u32::try_from(id).ok()).ok_or_else(bad);
    match value.get("eos_token_id") {
        None | Some(Value::Null) => Ok(Vec::new()),
        Some(Value::Array(items)) => items.iter().map(one).collect(),
        Some(v) => Ok(vec![one(v)?]),
    }
}

/// Reads every optional side file in `dir`.
/// What `tokenizer_config.json` (its JSON value, read from `config_path`) says, and whether it is
/// a "legacy" config (no `added_tokens_decoder`).
pub(crate) fn from_tokenizer_config(config: Option<&Value>, config_path: &Path) -> Result<(SideConfig, bool), TokenizerError> {
    let mut cfg = SideConfig::default();
    let mut legacy = true;
    if let Some(config) = config {
        let obj = as_object(config, config_path)?;
        merge_named(obj, config_path, &mut cfg.named, true)?;
        parse_token_list(obj, config_path, &mut cfg.extra)?;
        cfg.add_bos_token = parse_bool(obj, "add_bos_token", config_path)?;
        cfg.add_eos_token = parse_bool(obj, "add_eos_token", config_path)?;
        cfg.clean_up_tokenization_spaces = parse_bool(obj, "clean_up_tokenization_spaces", config_path)?.unwrap_or(false);
        cfg.templates = parse_chat_templates(obj, config_path)?;
        if let Some(decoder) = obj.get("added_tokens_decoder") {
            legacy = false;
            let Some(decoder) = decoder.as_object() else {
                return Err(invalid(config_path, "`added_tokens_decoder` must be an object"));
            };
            for (id, token) in decoder {
                let id: u32 = id.parse().map_err(|_| invalid(config_path, format!("`added_tokens_decoder` key `{id}` is not a token id")))?;
                if let Some(token) = parse_token(token, "added_tokens_decoder", config_path, false)? {
                    cfg.added_tokens_decoder.push((id, token));
                }
            }
            cfg.added_tokens_decoder.sort_by_key(|(id, _)| *id);
        }
    }

    Ok((cfg, legacy))
}

pub(crate) fn load(dir: &Path) -> Result<SideConfig, TokenizerError> {
    let config_path = dir.join("tokenizer_config.json");
    let config = read_optional_json(&config_path)?;
    let (mut cfg, legacy) = from_tokenizer_config(config.as_ref(), &config_path)?;

    // transformers reads special_tokens_map.json only for "legacy" configs (no
    // added_tokens_decoder), and there its values win over tokenizer_config.json. For current
    // configs it is ignored there; here it still fills in tokens the config does not name.
    let map_path = dir.join("special_tokens_map.json");
    if let Some(map) = read_optional_json(&map_path)? {
        let obj = as_object(&map, &map_path)?;
        merge_named(obj, &map_path, &mut cfg.named, legacy)?;
        parse_token_list(obj, &map_path, &mut cfg.extra)?;
    }

    if let Some(templates) = file_templates(dir)? {
        cfg.templates = templates;
    }

    let gen_path = dir.join("generation_config.json");
    if let Some(gen_config) = read_optional_json(&gen_path)? {
        as_object(&gen_config, &gen_path)?;
        cfg.generation_eos_ids = parse_generation_eos(&gen_config, &gen_path)?;
    }
    Ok(cfg)
}

/// Adds the tokens transformers adds at load: `added_tokens_decoder` entries and named or extra
/// special tokens that `tokenizer.json` does not have as added tokens.
pub(crate) fn add_missing_tokens(inner: &mut tokenizers::Tokenizer, cfg: &SideConfig) {
    let mut known: std::collections::HashSet<String> = inner.get_added_vocabulary().get_vocab().keys().cloned().collect();
    let mut to_add: Vec<AddedToken> = Vec::new();
    let candidates = cfg.added_tokens_decoder.iter().map(|(_, t)| t).chain(cfg.named.iter().map(|(_, t)| t)).chain(cfg.extra.iter());
    for token in candidates {
        if !token.content.is_empty() && known.insert(token.content.clone()) {
            to_add.push(token.clone());
        }
    }
    if !to_add.is_empty() {
        inner.add_tokens(&to_add);
    }
}

/// The post-processor transformers builds from `add_bos_token` / `add_eos_token`:
/// single `[bos:0] $A:0 [eos:0]`, pair `... [bos:1] $B:1 [eos:1]`.
pub(crate) fn bos_eos_processor(bos: Option<&(String, u32)>, eos: Option<&(String, u32)>) -> Result<TemplateProcessing, String> {
    use serde_json::{Value, json};
    let special = |t: &(String, u32), type_id: u32| json!({"SpecialToken": {"id": t.0, "type_id": type_id}});
    let sequence = |id: &str, type_id: u32| json!({"Sequence": {"id": id, "type_id": type_id}});
    let mut single: Vec<Value> = Vec::new();
    let mut pair: Vec<Value> = Vec::new();
    for (seq, type_id) in [("A", 0), ("B", 1)] {
        let part = [bos.map(|t| special(t, type_id)), Some(sequence(seq, type_id)), eos.map(|t| special(t, type_id))];
        if seq == "A" {
            single.extend(part.iter().flatten().cloned());
        }
        pair.extend(part.into_iter().flatten());
    }
    let mut special_tokens = serde_json::Map::new();
    for (token, id) in bos.into_iter().chain(eos) {
        special_tokens.insert(token.clone(), json!({"id": token, "ids": [id], "tokens": [token]}));
    }
    let processor = json!({"type": "TemplateProcessing", "single": single, "pair": pair, "special_tokens": special_tokens});
    serde_json::from_value(processor).map_err(|e| format!("cannot build the BOS/EOS post-processor: {e}"))
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use serde_json::{Value, json};

    use super::super::tests::{LLAMA_DIR, edited_copy, encode, fixture_tokenizer, load};
    use super::super::{Tokenizer, clean_up_tokenization};

    #[test]
    fn model_dir_eos_ids_union_generation_config_first() {
        let tok = Tokenizer::from_dir(Path::new(LLAMA_DIR)).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(tok.eos_token_ids(), &[2, 4]);

        // A single id in generation_config.json, different from eos_token: both, config first.
        let dir = edited_copy(|_, _| {});
        std::fs::write(dir.path().join("generation_config.json"), r#"{"eos_token_id": 4}"#).expect("write");
        assert_eq!(load(&dir).eos_token_ids(), &[4, 2]);
        std::fs::write(dir.path().join("generation_config.json"), r#"{"eos_token_id": [2, 4, 2]}"#).expect("write");
        assert_eq!(load(&dir).eos_token_ids(), &[2, 4]);
        std::fs::write(dir.path().join("generation_config.json"), r#"{"eos_token_id": "x"}"#).expect("write");
        let err = Tokenizer::from_dir(dir.path()).err().map(|e| e.to_string()).unwrap_or_default();
        assert!(err.contains("generation_config.json"), "{err}");
    }

    #[test]
    fn add_bos_token_true_does_not_double_the_processor_bos() {
        let tok = fixture_tokenizer(); // add_bos_token: true and TemplateProcessing adds <s>
        assert_eq!(encode(&tok, "Hello world!", true), [&[1][..], &encode(&tok, "Hello world!", false)].concat());

        // Without the key, tokenizer.json's own post-processor decides (it adds BOS).
        let dir = edited_copy(|_, cfg| {
            cfg.as_object_mut().map(|o| o.remove("add_bos_token"));
            cfg.as_object_mut().map(|o| o.remove("add_eos_token"));
        });
        assert_eq!(encode(&load(&dir), "Hello", true)[0], 1);
    }

    #[test]
    fn add_bos_token_false_removes_processor_bos() {
        let dir = edited_copy(|_, cfg| cfg["add_bos_token"] = json!(false));
        let tok = load(&dir);
        assert_eq!(encode(&tok, "Hello world!", true), encode(&tok, "Hello world!", false));
        assert_eq!(encode(&tok, "", true), Vec::<u32>::new());
        // Literal special tokens in the text are still matched.
        assert_eq!(encode(&tok, "<s>Hi", true)[0], 1);
    }

    #[test]
    fn add_bos_and_eos_without_post_processor() {
        // No post-processor in tokenizer.json: transformers builds one from the flags.
        let dir = edited_copy(|tok, cfg| {
            tok["post_processor"] = Value::Null;
            cfg["add_eos_token"] = json!(true);
        });
        let tok = load(&dir);
        let plain = encode(&tok, "Hello", false);
        assert_eq!(encode(&tok, "Hello", true), [&[1][..], &plain, &[2]].concat());

        // No post-processor and no flags: nothing is added.
        let dir = edited_copy(|tok, cfg| {
            tok["post_processor"] = Value::Null;
            cfg.as_object_mut().map(|o| o.remove("add_bos_token"));
            cfg.as_object_mut().map(|o| o.remove("add_eos_token"));
        });
        let tok = load(&dir);
        assert_eq!(encode(&tok, "Hello", true), encode(&tok, "Hello", false));
    }

    #[test]
    fn special_tokens_as_objects_and_from_special_tokens_map() {
        let dir = edited_copy(|_, cfg| {
            cfg["bos_token"] = json!({"__type": "AddedToken", "content": "<s>", "lstrip": false, "normalized": false});
            cfg.as_object_mut().map(|o| o.remove("eos_token"));
        });
        std::fs::write(dir.path().join("special_tokens_map.json"), r#"{"eos_token": {"content": "<|im_end|>"}}"#).expect("write");
        let tok = load(&dir);
        assert_eq!(tok.bos_token_id(), Some(1));
        assert_eq!(tok.eos_token_ids(), &[4]); // filled in from special_tokens_map.json

        // A legacy config (no added_tokens_decoder): special_tokens_map.json wins over it.
        let dir = edited_copy(|_, cfg| {
            cfg.as_object_mut().map(|o| o.remove("added_tokens_decoder"));
        });
        std::fs::write(dir.path().join("special_tokens_map.json"), r#"{"eos_token": "<|im_end|>"}"#).expect("write");
        assert_eq!(load(&dir).eos_token_ids(), &[4]);
    }

    #[test]
    fn missing_special_tokens_are_added_like_transformers() {
        let dir = edited_copy(|_, cfg| cfg["additional_special_tokens"] = json!(["<|im_start|>", "<|im_end|>", "<|tool|>"]));
        let tok = load(&dir);
        assert_eq!(tok.vocab_size(), 513);
        assert_eq!(tok.token_id("<|tool|>"), Some(512));
        let ids = encode(&tok, "a<|tool|>b", false);
        assert!(ids.contains(&512), "{ids:?}");
        assert_eq!(tok.decode(&ids, true).ok().as_deref(), Some("ab"));
    }

    #[test]
    fn clean_up_tokenization_spaces_is_ignored_for_bpe() {
        let dir = edited_copy(|_, cfg| cfg["clean_up_tokenization_spaces"] = json!(true));
        let tok = load(&dir);
        let ids = encode(&tok, "Hello , world !", false);
        assert_eq!(tok.decode(&ids, false).ok().as_deref(), Some("Hello , world !"));
        assert_eq!(clean_up_tokenization("Hello , world ! I 'm"), "Hello, world! I'm");
    }
}
