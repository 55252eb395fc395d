//! Tokenization for the engine: a HuggingFace `tokenizer.json` plus the side files next to it,
//! interpreted the way transformers interprets them.
//!
//! * [`Tokenizer::from_dir`] loads `tokenizer.json` (required) and, when present,
//!   `tokenizer_config.json`, `special_tokens_map.json`, `generation_config.json`,
//!   `chat_template.jinja` and `additional_chat_templates/*.jinja`.
//! * `add_bos_token` / `add_eos_token` follow transformers 5: when `tokenizer_config.json` sets
//!   either key (or `tokenizer.json` has no post-processor), the post-processor is rebuilt as
//!   `[bos] $A [eos]` from those two flags, replacing whatever `tokenizer.json` had; so a
//!   `TemplateProcessing` that already adds BOS never adds it twice, and `add_bos_token: false`
//!   removes it. Without either key the post-processor of `tokenizer.json` is used as it is.
//! * Truncation and padding stored in `tokenizer.json` are switched off: transformers only
//!   applies them when asked per call, and a prompt must never be silently cut.
//! * Chat templates are compiled once at load ([`template`]); streaming detokenization lives
//!   in [`stream`].

mod config;
mod gguf;
mod literal;
mod pycompat;
pub mod stream;
pub mod template;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Deserializer, Serialize};
use tokenizers::ModelWrapper;

pub use literal::Marked;
pub use stream::DecodeStream;
pub use template::ChatTemplateOptions;
use template::ChatTemplates;

/// Everything that can go wrong loading a tokenizer or using it.
#[derive(Debug, thiserror::Error)]
pub enum TokenizerError {
    #[error("{path}: no such directory (a model is a directory or a .gguf file)")]
    DirNotFound { path: PathBuf },
    #[error("{path} not found: a tokenizer directory needs a tokenizer.json")]
    MissingTokenizerJson { path: PathBuf },
    #[error("cannot read {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{path} is not a valid tokenizer.json (truncated or corrupt?): {message}")]
    InvalidTokenizerJson { path: PathBuf, message: String },
    #[error("invalid {path}: {message}")]
    InvalidConfig { path: PathBuf, message: String },
    #[error("chat template `{name}` from {path} does not compile: {message}")]
    TemplateSyntax { path: PathBuf, name: String, message: String },
    #[error("this tokenizer has no chat template (none in tokenizer_config.json or chat_template.jinja)")]
    NoChatTemplate,
    #[error("this tokenizer has several chat templates {available:?} and none is named `default`")]
    NoDefaultChatTemplate { available: Vec<String> },
    #[error("no chat template named `{name}` (available: {available:?})")]
    UnknownChatTemplate { name: String, available: Vec<String> },
    /// The template called `raise_exception(message)`; the message is the template's own.
    #[error("chat template rejected the conversation: {0}")]
    TemplateException(String),
    #[error("chat template rendering failed: {0}")]
    TemplateRender(String),
    #[error("token id {id} is not in the vocabulary (size {vocab_size})")]
    UnknownTokenId { id: u32, vocab_size: usize },
    #[error("encoding failed: {0}")]
    Encode(String),
    #[error("the text has more than {max} tokens ({tokens} so far)")]
    TooLong { tokens: usize, max: usize },
    #[error("decoding failed: {0}")]
    Decode(String),
}

/// One chat message. On input, `content` may also be an OpenAI-style list of parts
/// (`[{"type": "text", "text": ...}, ...]`, whose texts are concatenated) or null/absent (empty).
/// An assistant's message may carry the `tool_calls` it made, and a tool's message the
/// `tool_call_id` it answers; templates see those fields only when they are present.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChatMessage {
    pub role: String,
    #[serde(default, deserialize_with = "deserialize_content")]
    pub content: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<Vec<serde_json::Value>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
}

impl ChatMessage {
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        Self { role: role.into(), content: content.into(), tool_calls: None, tool_call_id: None, name: None }
    }
}

fn deserialize_content<'de, D: Deserializer<'de>>(deserializer: D) -> Result<String, D::Error> {
    #[derive(Deserialize)]
    struct Part {
        #[serde(rename = "type")]
        kind: String,
        text: Option<String>,
    }
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Content {
        Text(String),
        Parts(Vec<Part>),
        Null(()),
    }
    let parts = match Content::deserialize(deserializer)? {
        Content::Text(text) => return Ok(text),
        Content::Null(()) => return Ok(String::new()),
        Content::Parts(parts) => parts,
    };
    let mut out = String::new();
    for part in parts {
        match (part.kind.as_str(), part.text) {
            ("text", Some(text)) => out.push_str(&text),
            ("text", None) => {
                return Err(serde::de::Error::custom("a text content part has no `text`"));
            }
            (other, _) => {
                return Err(serde::de::Error::custom(format!("content parts of type `{other}` are not supported (only `text`)")));
            }
        }
    }
    Ok(out)
}

/// A loaded tokenizer. `Send + Sync` and immutable: share it with `Arc`.
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    path: PathBuf,
    bos: Option<(String, u32)>,
    eos_token_ids: Vec<u32>,
    /// Special token name -> id, for the named tokens that exist in the vocabulary.
    special_ids: BTreeMap<&'static str, u32>,
    clean_up_tokenization_spaces: bool,
    templates: Option<ChatTemplates>,
    /// The special tokens' strings, for reading them as text where a client wrote them.
    literals: literal::Literals,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field("path", &self.path)
            .field("vocab_size", &self.vocab_size())
            .field("bos", &self.bos)
            .field("eos_token_ids", &self.eos_token_ids)
            .field("templates", &self.templates)
            .finish_non_exhaustive()
    }
}

impl Tokenizer {
    /// Loads the tokenizer of the model at `path`: a HuggingFace directory or a GGUF file.
    pub fn open(path: &Path) -> Result<Self, TokenizerError> {
        if path.is_dir() {
            return Self::from_dir(path);
        }
        let file = crate::model::gguf::GgufFile::open(path).map_err(|e| match e {
            crate::model::ModelError::Io { path, source } if source.kind() == std::io::ErrorKind::NotFound => TokenizerError::DirNotFound { path },
            other => TokenizerError::InvalidConfig { path: path.to_path_buf(), message: other.to_string() },
        })?;
        Self::from_gguf(&file, path)
    }

    /// Loads the tokenizer stored in `dir` (see the module documentation for the files read).
    pub fn from_dir(dir: &Path) -> Result<Self, TokenizerError> {
        if !dir.is_dir() {
            return Err(TokenizerError::DirNotFound { path: dir.to_path_buf() });
        }
        let path = dir.join("tokenizer.json");
        let bytes = match std::fs::read(&path) {
            Ok(bytes) => bytes,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                return Err(TokenizerError::MissingTokenizerJson { path });
            }
            Err(source) => return Err(TokenizerError::Io { path, source }),
        };
        let inner =
            tokenizers::Tokenizer::from_bytes(&bytes).map_err(|e| TokenizerError::InvalidTokenizerJson { path: path.clone(), message: e.to_string() })?;
        let cfg = config::load(dir)?;
        Self::from_parts(inner, cfg, dir, &path)
    }

    /// A tokenizer from its parts: `inner` as `tokenizer.json` describes it, `cfg` from the side
    /// files (or what stands for them); `origin` is where it came from (for [`Self::path`]) and
    /// `json_path` where `inner` was read (for messages).
    fn from_parts(mut inner: tokenizers::Tokenizer, cfg: config::SideConfig, origin: &Path, json_path: &Path) -> Result<Self, TokenizerError> {
        let (dir, path) = (origin, json_path.to_path_buf());
        inner.with_truncation(None).map_err(|e| TokenizerError::InvalidTokenizerJson { path: path.clone(), message: e.to_string() })?;
        inner.with_padding(None);
        config::add_missing_tokens(&mut inner, &cfg);

        let id_of = |name: &str| cfg.named(name).and_then(|t| inner.token_to_id(&t.content).map(|id| (t.content.clone(), id)));
        let bos = id_of("bos_token");
        let eos = id_of("eos_token");
        let special_ids: BTreeMap<&'static str, u32> = config::NAMED_SPECIAL_TOKENS.iter().filter_map(|name| id_of(name).map(|(_, id)| (*name, id))).collect();

        if cfg.add_bos_token.is_some() || cfg.add_eos_token.is_some() || inner.get_post_processor().is_none() {
            let add_bos = bos.as_ref().filter(|_| cfg.add_bos_token == Some(true));
            let add_eos = eos.as_ref().filter(|_| cfg.add_eos_token == Some(true));
            let processor = config::bos_eos_processor(add_bos, add_eos).map_err(|message| TokenizerError::InvalidConfig {
                path: if dir.is_dir() { dir.join("tokenizer_config.json") } else { dir.to_path_buf() },
                message,
            })?;
            inner.with_post_processor(Some(processor));
        }

        let mut eos_token_ids = cfg.generation_eos_ids.clone();
        if let Some((_, id)) = &eos {
            eos_token_ids.push(*id);
        }
        let mut seen = std::collections::HashSet::new();
        eos_token_ids.retain(|id| seen.insert(*id));

        let templates = if cfg.templates.is_empty() {
            None
        } else {
            let mut ctx = BTreeMap::new();
            for (name, token) in &cfg.named {
                ctx.insert((*name).to_owned(), minijinja::Value::from(token.content.clone()));
            }
            if !cfg.extra.is_empty() {
                let extra: Vec<String> = cfg.extra.iter().map(|t| t.content.clone()).collect();
                ctx.insert("additional_special_tokens".to_owned(), minijinja::Value::from(extra));
            }
            Some(ChatTemplates::compile(cfg.templates.clone(), ctx)?)
        };

        // transformers ignores clean_up_tokenization_spaces for BPE models: the clean-up was made
        // for WordPiece and would delete real spaces before punctuation.
        let is_bpe = matches!(inner.get_model(), ModelWrapper::BPE(_));
        let literals = literal::Literals::new(&inner);
        Ok(Self {
            literals,
            inner,
            path: dir.to_path_buf(),
            bos,
            eos_token_ids,
            special_ids,
            clean_up_tokenization_spaces: cfg.clean_up_tokenization_spaces && !is_bpe,
            templates,
        })
    }

    /// The tokenizer as `tokenizer.json` would hold it, the tokens added from its configuration
    /// included.
    pub fn to_json(&self) -> Result<serde_json::Value, TokenizerError> {
        let text =
            self.inner.to_string(false).map_err(|e| TokenizerError::InvalidTokenizerJson { path: self.path.join("tokenizer.json"), message: e.to_string() })?;
        serde_json::from_str(&text).map_err(|e| TokenizerError::InvalidTokenizerJson { path: self.path.join("tokenizer.json"), message: e.to_string() })
    }

    /// The directory this tokenizer was loaded from.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Token ids for `text`. With `add_special_tokens` the post-processor adds BOS/EOS as
    /// configured. Special tokens written literally in `text` are always matched as such.
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>, TokenizerError> {
        // `encode_fast` skips offset tracking, which nothing here needs; the ids are the same.
        self.inner.encode_fast(text, add_special_tokens).map(|encoding| encoding.get_ids().to_vec()).map_err(|e| TokenizerError::Encode(e.to_string()))
    }

    /// Text for `ids`; an id outside the vocabulary is an error.
    pub fn decode(&self, ids: &[u32], skip_special_tokens: bool) -> Result<String, TokenizerError> {
        self.check_ids(ids)?;
        let text = self.inner.decode(ids, skip_special_tokens).map_err(|e| TokenizerError::Decode(e.to_string()))?;
        Ok(if self.clean_up_tokenization_spaces { clean_up_tokenization(&text) } else { text })
    }

    fn check_ids(&self, ids: &[u32]) -> Result<(), TokenizerError> {
        match ids.iter().find(|&&id| self.inner.id_to_token(id).is_none()) {
            Some(&id) => Err(TokenizerError::UnknownTokenId { id, vocab_size: self.vocab_size() }),
            None => Ok(()),
        }
    }

    /// Number of distinct tokens, added tokens included (transformers' `len(tokenizer)`).
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    /// The longest token of the vocabulary, in bytes of its stored form. Text of `n` bytes
    /// encodes to at least `n` divided by this many tokens (byte-level and SentencePiece
    /// vocabularies store a token in at least as many bytes as it stands for), which bounds how
    /// much text can ever fit a context before any of it is tokenized.
    pub fn longest_token_bytes(&self) -> usize {
        self.inner.get_vocab(true).keys().map(String::len).max().unwrap_or(1).max(1)
    }

    pub fn bos_token_id(&self) -> Option<u32> {
        self.bos.as_ref().map(|(_, id)| *id)
    }

    /// Ids that end generation: `generation_config.json`'s `eos_token_id` (one id or a list), then
    /// the tokenizer's `eos_token`, without duplicates.
    pub fn eos_token_ids(&self) -> &[u32] {
        &self.eos_token_ids
    }

    pub fn pad_token_id(&self) -> Option<u32> {
        self.special_ids.get("pad_token").copied()
    }

    pub fn unk_token_id(&self) -> Option<u32> {
        self.special_ids.get("unk_token").copied()
    }

    /// The id of a token string (vocabulary or added token).
    pub fn token_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    /// The token string of an id.
    pub fn id_to_token(&self, id: u32) -> Option<String> {
        self.inner.id_to_token(id)
    }

    /// Whether there is a chat template that [`Self::apply_chat_template`] can use.
    pub fn has_chat_template(&self) -> bool {
        self.templates.as_ref().is_some_and(ChatTemplates::has_default)
    }

    /// Names of all chat templates (`"default"` is the one used unless another is asked for).
    pub fn chat_template_names(&self) -> &[String] {
        self.templates.as_ref().map_or(&[], |t| t.names())
    }

    /// Renders the default chat template for `messages`.
    pub fn apply_chat_template(&self, messages: &[ChatMessage], add_generation_prompt: bool) -> Result<String, TokenizerError> {
        self.apply_chat_template_with(messages, add_generation_prompt, &ChatTemplateOptions::default())
    }

    /// Whether the template that renders a chat (the `tool_use` one when `tools` are given and
    /// the tokenizer has one, as transformers picks it; else the default) reads the `tools`
    /// variable at all: a template that never mentions it would drop the tools silently.
    pub fn chat_template_reads_tools(&self, tools: bool) -> bool {
        self.templates.as_ref().is_some_and(|t| t.reads_tools(self.chat_template_for(tools)))
    }

    /// The template a chat is rendered with: `tool_use` for a chat with tools when there is one.
    pub fn chat_template_for(&self, tools: bool) -> Option<&'static str> {
        let names = self.templates.as_ref().map_or(&[][..], ChatTemplates::names);
        (tools && names.iter().any(|n| n == "tool_use")).then_some("tool_use")
    }

    /// Renders a chat template with tools, documents, extra variables or a named template.
    pub fn apply_chat_template_with(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
        options: &ChatTemplateOptions<'_>,
    ) -> Result<String, TokenizerError> {
        let templates = self.templates.as_ref().ok_or(TokenizerError::NoChatTemplate)?;
        templates.render(messages, add_generation_prompt, options)
    }

    /// Renders the chat template and encodes the result without adding special tokens: the
    /// template writes BOS itself where the model wants it (transformers'
    /// `apply_chat_template(tokenize=True)`).
    pub fn encode_chat(&self, messages: &[ChatMessage], add_generation_prompt: bool) -> Result<Vec<u32>, TokenizerError> {
        let text = self.apply_chat_template(messages, add_generation_prompt)?;
        self.encode(&text, false)
    }

    /// Incremental detokenizer for one generated sequence.
    pub fn decode_stream(&self, skip_special_tokens: bool) -> DecodeStream {
        DecodeStream::new(skip_special_tokens)
    }
}

/// transformers' `clean_up_tokenization`: removes spaces before punctuation and contractions.
fn clean_up_tokenization(text: &str) -> String {
    const REPLACEMENTS: [(&str, &str); 10] =
        [(" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"), (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re")];
    REPLACEMENTS.iter().fold(text.to_owned(), |acc, (from, to)| acc.replace(from, to))
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use serde_json::{Value, json};

    pub(crate) const FIXTURE_DIR: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../tests/fixtures/reference/tokenizer");
    const REFERENCE: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../tests/fixtures/reference/tokenizer_reference.json");
    pub(crate) const LLAMA_DIR: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../tests/fixtures/reference/llama/model-f32");

    #[derive(Debug, Deserialize)]
    pub(crate) struct RefEncoding {
        pub text: String,
        pub ids_with_special: Vec<u32>,
        pub ids_without_special: Vec<u32>,
        pub tokens_without_special: Vec<String>,
        pub decode_skip_special: String,
        pub decode_keep_special: String,
    }

    #[derive(Debug, Deserialize)]
    pub(crate) struct RefChat {
        pub messages: Vec<ChatMessage>,
        pub add_generation_prompt: bool,
        pub rendered: String,
        pub ids: Vec<u32>,
    }

    #[derive(Debug, Deserialize)]
    pub(crate) struct Reference {
        pub vocab_size: usize,
        pub special_tokens: BTreeMap<String, u32>,
        pub encodings: Vec<RefEncoding>,
        pub chat: RefChat,
    }

    pub(crate) fn reference() -> Reference {
        let text = std::fs::read_to_string(REFERENCE).expect("reference file readable");
        serde_json::from_str(&text).expect("reference file parses")
    }

    pub(crate) fn fixture_tokenizer() -> Tokenizer {
        Tokenizer::from_dir(Path::new(FIXTURE_DIR)).expect("fixture tokenizer loads")
    }

    /// A copy of the fixture tokenizer in a temp dir, with its JSON files edited by `edit`.
    pub(crate) fn edited_copy(edit: impl FnOnce(&mut Value, &mut Value)) -> tempfile::TempDir {
        let dir = tempfile::tempdir().expect("temp dir");
        let read = |name: &str| -> Value {
            serde_json::from_str(&std::fs::read_to_string(Path::new(FIXTURE_DIR).join(name)).expect("read fixture")).expect("fixture json")
        };
        let mut tokenizer = read("tokenizer.json");
        let mut config = read("tokenizer_config.json");
        edit(&mut tokenizer, &mut config);
        std::fs::write(dir.path().join("tokenizer.json"), tokenizer.to_string()).expect("write");
        std::fs::write(dir.path().join("tokenizer_config.json"), config.to_string()).expect("write");
        dir
    }

    pub(crate) fn load(dir: &tempfile::TempDir) -> Tokenizer {
        Tokenizer::from_dir(dir.path()).unwrap_or_else(|e| panic!("load failed: {e}"))
    }

    pub(crate) fn encode(tok: &Tokenizer, text: &str, special: bool) -> Vec<u32> {
        tok.encode(text, special).unwrap_or_else(|e| panic!("encode failed: {e}"))
    }

    #[test]
    fn tokenizer_is_send_sync() {
        fn assert_send_sync<T: Send + Sync>() {}
        assert_send_sync::<Tokenizer>();
    }

    #[test]
    fn encodings_match_reference() {
        let tok = fixture_tokenizer();
        let reference = reference();
        assert_eq!(reference.encodings.len(), 9);
        for enc in &reference.encodings {
            let text = &enc.text;
            assert_eq!(encode(&tok, text, true), enc.ids_with_special, "ids with special for {text:?}");
            assert_eq!(encode(&tok, text, false), enc.ids_without_special, "ids without special for {text:?}");
            let tokens = tok.inner.encode(text.as_str(), false).expect("encode").get_tokens().to_vec();
            assert_eq!(tokens, enc.tokens_without_special, "tokens for {text:?}");
            assert_eq!(tok.decode(&enc.ids_with_special, true).ok().as_deref(), Some(enc.decode_skip_special.as_str()));
            assert_eq!(tok.decode(&enc.ids_with_special, false).ok().as_deref(), Some(enc.decode_keep_special.as_str()));
        }
    }

    #[test]
    fn vocabulary_and_special_tokens_match_reference() {
        let tok = fixture_tokenizer();
        let reference = reference();
        assert_eq!(tok.vocab_size(), reference.vocab_size);
        for (token, id) in &reference.special_tokens {
            assert_eq!(tok.token_id(token), Some(*id), "{token}");
            assert_eq!(tok.id_to_token(*id).as_deref(), Some(token.as_str()));
        }
        assert_eq!(tok.bos_token_id(), Some(1));
        assert_eq!(tok.eos_token_ids(), &[2]); // no generation_config.json in this dir
        assert_eq!(tok.unk_token_id(), Some(0));
        assert_eq!(tok.pad_token_id(), Some(2));
        assert_eq!(tok.token_id("no such token"), None);
    }

    #[test]
    fn chat_template_matches_reference() {
        let tok = fixture_tokenizer();
        let chat = reference().chat;
        assert!(tok.has_chat_template());
        let rendered = tok.apply_chat_template(&chat.messages, chat.add_generation_prompt);
        assert_eq!(rendered.ok().as_deref(), Some(chat.rendered.as_str()));
        assert_eq!(tok.encode_chat(&chat.messages, chat.add_generation_prompt).ok(), Some(chat.ids.clone()));
        // Encoding the rendering with special tokens would add a second BOS.
        assert_eq!(encode(&tok, &chat.rendered, true)[..2], [1, 1]);
        let no_prompt = tok.apply_chat_template(&chat.messages, false).unwrap_or_default();
        assert!(!no_prompt.ends_with("assistant\n") && chat.rendered.starts_with(&no_prompt));
    }

    pub(crate) fn load_err(dir: &Path) -> TokenizerError {
        match Tokenizer::from_dir(dir) {
            Ok(_) => panic!("loading {} should fail", dir.display()),
            Err(e) => e,
        }
    }

    #[test]
    fn load_errors_name_the_file() {
        let missing = Path::new("/nonexistent/loraplex-tokenizer");
        let err = load_err(missing);
        assert!(matches!(err, TokenizerError::DirNotFound { .. }) && err.to_string().contains("/nonexistent/loraplex-tokenizer"), "{err}");

        let empty = tempfile::tempdir().expect("temp dir");
        let err = load_err(empty.path());
        assert!(matches!(err, TokenizerError::MissingTokenizerJson { .. }), "{err}");
        assert!(err.to_string().contains(&empty.path().join("tokenizer.json").display().to_string()), "{err}");

        let dir = edited_copy(|_, _| {});
        let json_path = dir.path().join("tokenizer.json");
        let full = std::fs::read(&json_path).expect("read");
        std::fs::write(&json_path, &full[..full.len() / 2]).expect("write");
        let err = load_err(dir.path());
        assert!(matches!(err, TokenizerError::InvalidTokenizerJson { .. }), "{err}");
        assert!(err.to_string().contains(&json_path.display().to_string()), "{err}");

        let dir = edited_copy(|_, _| {});
        let config_path = dir.path().join("tokenizer_config.json");
        std::fs::write(&config_path, "{\"bos_token\": ").expect("write");
        let err = load_err(dir.path());
        assert!(matches!(err, TokenizerError::InvalidConfig { .. }), "{err}");
        assert!(err.to_string().contains(&config_path.display().to_string()), "{err}");

        let dir = edited_copy(|_, cfg| cfg["add_bos_token"] = json!("yes"));
        let err = load_err(dir.path());
        assert!(err.to_string().contains("tokenizer_config.json") && err.to_string().contains("add_bos_token"), "{err}");
    }

    #[test]
    fn decoding_unknown_ids_is_an_error() {
        let tok = fixture_tokenizer();
        let err = tok.decode(&[1, 512, 3], false);
        assert!(matches!(err, Err(TokenizerError::UnknownTokenId { id: 512, vocab_size: 512 })), "{err:?}");
        assert!(tok.decode(&[u32::MAX], true).is_err());
        assert_eq!(tok.decode(&[], true).ok().as_deref(), Some(""));
    }

    #[test]
    fn chat_message_content_forms() {
        let parse = |s: &str| serde_json::from_str::<ChatMessage>(s);
        assert_eq!(parse(r#"{"role": "user", "content": "hi"}"#).ok(), Some(ChatMessage::new("user", "hi")));
        let parts = r#"{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}"#;
        assert_eq!(parse(parts).ok(), Some(ChatMessage::new("user", "ab")));
        assert_eq!(parse(r#"{"role": "assistant", "content": null}"#).ok(), Some(ChatMessage::new("assistant", "")));
        assert_eq!(parse(r#"{"role": "assistant"}"#).ok(), Some(ChatMessage::new("assistant", "")));
        assert!(parse(r#"{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}"#).is_err());
        assert!(parse(r#"{"role": "user", "content": 5}"#).is_err());
        assert_eq!(serde_json::to_string(&ChatMessage::new("user", "x")).ok().as_deref(), Some(r#"{"role":"user","content":"x"}"#));
    }
}
