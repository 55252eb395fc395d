//! Structured output: what a request's text must match (a JSON schema, any JSON object, a
//! regular expression, a Lark grammar, or one of a list of strings), compiled by llguidance
//! against the served tokenizer into per-sequence matchers that say, before every sampled token,
//! which tokens may come next.
//!
//! Compiling is CPU work bounded by llguidance's fuel and size limits ([`GrammarLimits`]);
//! callers run it on the blocking pool. Compiled grammars are cached by the hash of their
//! specification, so a schema sent with every request compiles once; each sequence gets its own
//! copy of the compiled matcher ([`Constraint`]).
//!
//! JSON is generated compact (no whitespace between tokens) unless a schema asks otherwise
//! with llguidance's `x-guidance` options: a model may not pad a constrained answer with
//! whitespace until it runs out of tokens.
//!
//! The end of the grammar is the end of the sequence: once the text is complete only the
//! end-of-sequence tokens are allowed, and while it is not they are not.

use std::panic::AssertUnwindSafe;
use std::sync::Arc;

use llguidance::api::{GrammarWithLexer, TopLevelGrammar};
use llguidance::toktrie::{SimpleVob, TokEnv, TokRxInfo, TokTrie, TokenId, TokenizerEnv};
use llguidance::{Matcher, ParserFactory};
use sha2::{Digest, Sha256};

use crate::tokenizer::Tokenizer;

mod depth;
#[cfg(test)]
mod stack;
#[cfg(test)]
pub(crate) mod tests;

/// What a request's output must match.
#[derive(Debug, Clone, PartialEq)]
pub enum GrammarSpec {
    /// A JSON value valid against this JSON schema.
    JsonSchema(serde_json::Value),
    /// Any JSON object.
    JsonObject,
    /// Text matching this regular expression, whole.
    Regex(String),
    /// Text of this Lark grammar (llguidance's dialect), from its `start` rule.
    Lark(String),
    /// Exactly one of these strings.
    Choice(Vec<String>),
    /// A Lark grammar built by the server for a request's tools (see the API's tool calls):
    /// its own kind only so that refusals name the tools, not a grammar the client never sent.
    Tools(String),
}

impl GrammarSpec {
    /// A JSON schema, `strict` or not. Not strict: keywords llguidance cannot enforce are
    /// skipped (its lenient mode) instead of refused, so output may not satisfy them; strict:
    /// every keyword is enforced or the schema is refused.
    pub fn json_schema(mut schema: serde_json::Value, strict: bool) -> Self {
        if !strict
            && let serde_json::Value::Object(map) = &mut schema
            && let serde_json::Value::Object(options) = map.entry("x-guidance").or_insert_with(|| serde_json::json!({}))
        {
            options.entry("lenient").or_insert(serde_json::Value::Bool(true));
        }
        Self::JsonSchema(schema)
    }

    /// How the API names this kind of constraint, for messages.
    pub fn kind(&self) -> &'static str {
        match self {
            Self::JsonSchema(_) => "the JSON schema",
            Self::JsonObject => "the JSON object format",
            Self::Regex(_) => "the regular expression",
            Self::Lark(_) => "the grammar",
            Self::Choice(_) => "the choice list",
            Self::Tools(_) => "the tools' grammar",
        }
    }

    /// Bytes of the specification's text (a schema as compact JSON).
    pub fn size(&self) -> usize {
        match self {
            Self::JsonSchema(v) => serde_json::to_string(v).map_or(usize::MAX, |s| s.len()),
            Self::JsonObject => 0,
            Self::Regex(s) | Self::Lark(s) | Self::Tools(s) => s.len(),
            Self::Choice(c) => c.iter().fold(0usize, |a, s| a.saturating_add(s.len()).saturating_add(1)),
        }
    }

    /// The cache key: a hash of the kind and the text.
    fn key(&self) -> [u8; 32] {
        let mut h = Sha256::new();
        match self {
            Self::JsonSchema(v) => {
                h.update(b"json_schema\0");
                h.update(serde_json::to_string(v).unwrap_or_default().as_bytes());
            }
            Self::JsonObject => h.update(b"json_object\0"),
            Self::Regex(s) => {
                h.update(b"regex\0");
                h.update(s.as_bytes());
            }
            Self::Lark(s) => {
                h.update(b"lark\0");
                h.update(s.as_bytes());
            }
            Self::Tools(s) => {
                h.update(b"tools\0");
                h.update(s.as_bytes());
            }
            Self::Choice(c) => {
                h.update(b"choice\0");
                for s in c {
                    h.update((s.len() as u64).to_le_bytes());
                    h.update(s.as_bytes());
                }
            }
        }
        h.finalize().into()
    }

    /// The grammar llguidance compiles.
    fn to_llguidance(&self) -> Result<TopLevelGrammar, GrammarError> {
        let refused = |message: String| GrammarError::Refused { what: self.kind(), message };
        Ok(match self {
            Self::JsonSchema(schema) => {
                let schema = compact_json(schema.clone()).map_err(refused)?;
                TopLevelGrammar::from_grammar(GrammarWithLexer::from_json_schema(schema))
            }
            Self::JsonObject => {
                TopLevelGrammar::from_grammar(GrammarWithLexer::from_json_schema(compact_json(serde_json::json!({"type": "object"})).map_err(refused)?))
            }
            Self::Regex(rx) => TopLevelGrammar::from_regex(rx),
            Self::Lark(text) | Self::Tools(text) => TopLevelGrammar::from_lark(text.clone()),
            Self::Choice(choices) => {
                if choices.is_empty() {
                    return Err(refused("it has no choices".into()));
                }
                let alternatives: Vec<String> = choices.iter().map(|c| regex::escape(c)).collect();
                TopLevelGrammar::from_regex(&format!("(?:{})", alternatives.join("|")))
            }
        })
    }
}

/// A schema with llguidance's compact-whitespace option, unless its `x-guidance` options set
/// the whitespace themselves.
pub fn compact_json(mut schema: serde_json::Value) -> Result<serde_json::Value, String> {
    match &mut schema {
        serde_json::Value::Object(map) => {
            match map.entry("x-guidance").or_insert_with(|| serde_json::json!({})) {
                serde_json::Value::Object(options) => {
                    options.entry("whitespace_flexible").or_insert(serde_json::Value::Bool(false));
                }
                _ => return Err("`x-guidance` must be an object of llguidance's JSON options".into()),
            }
            Ok(schema)
        }
        // `true` and `false` are schemas too: any value, and none.
        serde_json::Value::Bool(true) => Ok(serde_json::json!({"x-guidance": {"whitespace_flexible": false}})),
        serde_json::Value::Bool(false) => Err("the schema `false` matches nothing".into()),
        other => Err(format!("a JSON schema is an object (or a boolean); given {}", kind_of(other))),
    }
}

fn kind_of(v: &serde_json::Value) -> &'static str {
    match v {
        serde_json::Value::Null => "null",
        serde_json::Value::Bool(_) => "a boolean",
        serde_json::Value::Number(_) => "a number",
        serde_json::Value::String(_) => "a string",
        serde_json::Value::Array(_) => "an array",
        serde_json::Value::Object(_) => "an object",
    }
}

/// Why structured output could not be had.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum GrammarError {
    /// This tokenizer's token bytes could not be read, so no grammar can be compiled for it.
    #[error("structured output is not available with this model's tokenizer: {0}")]
    Unsupported(Arc<str>),
    /// The specification is larger than the server accepts.
    #[error("{what} is {size} bytes; at most {max} are accepted")]
    TooLarge { what: &'static str, size: usize, max: usize },
    /// The specification nests deeper than the server compiles (see [`GrammarLimits::max_depth`]).
    #[error("{what} nests {} levels deep, counting every object and array and each definition a `$ref` or a rule enters; at most {max} are accepted", if *.depth == usize::MAX { "too many".to_string() } else { depth.to_string() })]
    TooDeep { what: &'static str, depth: usize, max: usize },
    /// The grammar does not compile, or goes past a compile limit; the library's message names
    /// the problem.
    #[error("{what} is refused: {message}")]
    Refused { what: &'static str, message: String },
    /// A sequence's matcher failed while generating (a per-step limit, or a token it did not
    /// allow).
    #[error("structured output failed while generating: {0}")]
    Generation(String),
}

/// The stack of a thread that compiles grammars. The compiler recurses about once per level of
/// [`GrammarLimits::max_depth`]'s measure, with about 3.3 kB of stack a level (measured on every
/// kind of level, in the `stack` tests: a compile at the default limit touches 3-4 MB); this is
/// over fifteen times that, so a limit an operator raises a few times still has room. A thread
/// reserves it as address space and takes its pages only as it recurses. Computing masks does
/// not recurse (tens of kB at any depth), so the engine's threads need no more than they have.
pub const COMPILE_STACK: usize = 64 << 20;

/// Bounds on what one grammar may cost, in bytes and llguidance's units.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GrammarLimits {
    /// Bytes of a specification's text.
    pub max_spec_bytes: usize,
    /// Lexer work to build a grammar (llguidance: about 50,000 per millisecond).
    pub compile_fuel: u64,
    /// Lexer work for one step's token mask (about 14,000 per millisecond).
    pub step_fuel: u64,
    /// Lexer states a grammar may create (about 1-2 kB each).
    pub max_lexer_states: usize,
    /// Symbols of a grammar's productions.
    pub max_grammar_size: usize,
    /// How deep a specification may nest: JSON containers, and the definitions its references
    /// and rules enter on the way (the measure is in [`depth`]). It bounds the compiler's
    /// recursion, and so the stack it needs ([`COMPILE_STACK`]).
    pub max_depth: usize,
    /// Bytes of compiled grammars kept (an estimate of each: [`estimated_bytes`]).
    pub cache_bytes: u64,
    /// Percent of those bytes the grammars one tenant compiled may hold; past it, a tenant's
    /// new grammars are compiled for its requests but not kept, so one tenant's distinct
    /// schemas cannot push every other tenant's out.
    pub tenant_cache_percent: u32,
}

impl Default for GrammarLimits {
    fn default() -> Self {
        Self {
            max_spec_bytes: 256 << 10,
            compile_fuel: 1_000_000,
            step_fuel: 200_000,
            max_lexer_states: 100_000,
            max_grammar_size: 200_000,
            max_depth: 1_000,
            cache_bytes: 256 << 20,
            tenant_cache_percent: 25,
        }
    }
}

impl GrammarLimits {
    /// The checks made before compiling, cheapest first: the specification's size, then its
    /// depth. Linear in the size, and without recursion.
    pub fn check(&self, spec: &GrammarSpec) -> Result<(), GrammarError> {
        let size = spec.size();
        if size > self.max_spec_bytes {
            return Err(GrammarError::TooLarge { what: spec.kind(), size, max: self.max_spec_bytes });
        }
        let depth = depth::depth(spec);
        if depth > self.max_depth {
            return Err(GrammarError::TooDeep { what: spec.kind(), depth, max: self.max_depth });
        }
        Ok(())
    }
}

/// The served tokenizer as llguidance sees it: every token's bytes (special tokens marked so
/// text never matches them), and the tokenizer itself for tokenizing literal text.
struct Vocabulary {
    trie: TokTrie,
    tokenizer: Arc<Tokenizer>,
}

impl TokenizerEnv for Vocabulary {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }

    fn tokenize_bytes(&self, s: &[u8]) -> Vec<TokenId> {
        match std::str::from_utf8(s) {
            Ok(text) => self.tokenizer.encode(text, false).unwrap_or_else(|_| self.trie.greedy_tokenize(s)),
            Err(_) => self.trie.greedy_tokenize(s),
        }
    }

    fn tokenize_is_canonical(&self) -> bool {
        // Nothing here forces tokens: masks do not depend on it.
        false
    }
}

/// Compiles grammars for one tokenizer, and keeps the compiled ones.
pub struct GrammarCompiler {
    factory: ParserFactory,
    eos: Arc<[u32]>,
    trie_eos: u32,
    vocab: usize,
    limits: GrammarLimits,
    cache: moka::sync::Cache<[u8; 32], Arc<Cached>>,
    /// Bytes each tenant's kept grammars hold in the cache.
    shares: Arc<std::sync::Mutex<std::collections::HashMap<Arc<str>, u64>>>,
}

/// A kept compiled grammar, with who compiled it and its estimated bytes.
struct Cached {
    matcher: Arc<Matcher>,
    owner: Arc<str>,
    bytes: u32,
}

/// The memory a compiled grammar holds, estimated from its specification's size: measured on
/// JSON schemas of 200 bytes to 70 kB, a compiled grammar (its lexer, its parser and the first
/// mask) held about 100-140 kB plus 50-60 bytes for each byte of the specification.
pub fn estimated_bytes(spec: &GrammarSpec) -> u64 {
    (128u64 << 10).saturating_add((spec.size() as u64).saturating_mul(64))
}

impl GrammarCompiler {
    /// Reads the tokenizer's token bytes (byte-level BPE and byte-fallback vocabularies).
    /// `eos` are the model's end-of-sequence tokens (at least one), which end a complete text.
    pub fn new(tokenizer: Arc<Tokenizer>, eos: &[u32], limits: GrammarLimits) -> Result<Self, GrammarError> {
        let unsupported = |m: String| GrammarError::Unsupported(m.into());
        let json = tokenizer.to_json().map_err(|e| unsupported(e.to_string()))?;
        // The reader asserts on malformed entries; a tokenizer it cannot read only turns
        // structured output off.
        let words = std::panic::catch_unwind(AssertUnwindSafe(|| llguidance::token_bytes_from_tokenizer_json(&json)))
            .map_err(|_| unsupported("its vocabulary could not be read as bytes".into()))?
            .map_err(|e| unsupported(e.to_string()))?;
        let eos: Arc<[u32]> = eos.into();
        let Some(&trie_eos) = eos.first() else { return Err(unsupported("it names no end-of-sequence token".into())) };
        let mut words = words;
        let vocab = words.len().max(tokenizer.vocab_size());
        words.resize(vocab, Vec::new());
        let vocab_u32 = u32::try_from(vocab).map_err(|_| unsupported(format!("its vocabulary of {vocab} tokens is too large")))?;
        if trie_eos >= vocab_u32 {
            return Err(unsupported(format!("its end-of-sequence token {trie_eos} is outside its vocabulary of {vocab}")));
        }
        let info = TokRxInfo { tok_bos: tokenizer.bos_token_id(), ..TokRxInfo::new(vocab_u32, trie_eos) };
        let trie =
            std::panic::catch_unwind(AssertUnwindSafe(|| TokTrie::from(&info, &words))).map_err(|_| unsupported("its token trie could not be built".into()))?;
        let env: TokEnv = Arc::new(Vocabulary { trie, tokenizer });
        let mut factory = ParserFactory::new_simple(&env).map_err(|e| unsupported(e.to_string()))?;
        factory.quiet();
        let l = factory.limits_mut();
        l.initial_lexer_fuel = limits.compile_fuel;
        l.step_lexer_fuel = limits.step_fuel;
        l.max_lexer_states = limits.max_lexer_states;
        l.max_grammar_size = limits.max_grammar_size;
        // Errors name the problem, not the parser's state: that dump (the grammar, the tokens so
        // far, internal counters) means nothing to a client and is not for it to read.
        l.verbose_errors = false;
        let shares: Arc<std::sync::Mutex<std::collections::HashMap<Arc<str>, u64>>> = Arc::default();
        let released = shares.clone();
        let cache = moka::sync::Cache::builder()
            .max_capacity(limits.cache_bytes)
            .weigher(|_, c: &Arc<Cached>| c.bytes)
            .eviction_listener(move |_, c: Arc<Cached>, _| {
                let mut shares = released.lock().unwrap_or_else(|e| e.into_inner());
                if let Some(held) = shares.get_mut(&c.owner) {
                    *held = held.saturating_sub(u64::from(c.bytes));
                    if *held == 0 {
                        shares.remove(&c.owner);
                    }
                }
            })
            .build();
        Ok(Self { factory, eos, trie_eos, vocab, limits, cache, shares })
    }

    pub fn limits(&self) -> &GrammarLimits {
        &self.limits
    }

    /// The compiled grammar: compiled now (CPU work: call it off the async executor, on a
    /// thread with [`COMPILE_STACK`]) or taken from the cache. The size and depth caps are
    /// checked first. Kept in the cache as the server's own (see [`Self::compile_for`]).
    pub fn compile(&self, spec: &GrammarSpec) -> Result<CompiledGrammar, GrammarError> {
        self.compile_for(spec, "")
    }

    /// [`Self::compile`] for a request of `tenant`: a grammar it compiles is kept only while
    /// the grammars it compiled hold less than its share of the cache.
    pub fn compile_for(&self, spec: &GrammarSpec, tenant: &str) -> Result<CompiledGrammar, GrammarError> {
        self.limits.check(spec)?;
        let key = spec.key();
        let template = match self.cache.get(&key) {
            Some(c) => c.matcher.clone(),
            None => {
                let matcher = Arc::new(self.build(spec)?);
                let bytes = u32::try_from(estimated_bytes(spec)).unwrap_or(u32::MAX);
                let share = self.limits.cache_bytes.saturating_mul(u64::from(self.limits.tenant_cache_percent.min(100))) / 100;
                let owner: Arc<str> = tenant.into();
                let kept = {
                    let mut shares = self.shares.lock().unwrap_or_else(|e| e.into_inner());
                    let held = shares.entry(owner.clone()).or_default();
                    let fits = held.saturating_add(u64::from(bytes)) <= share;
                    if fits {
                        *held += u64::from(bytes);
                    }
                    fits
                };
                if kept {
                    self.cache.insert(key, Arc::new(Cached { matcher: matcher.clone(), owner, bytes }));
                }
                matcher
            }
        };
        Ok(CompiledGrammar { template, key, eos: self.eos.clone(), trie_eos: self.trie_eos })
    }

    /// Compiled grammars in the cache now.
    pub fn cached(&self) -> u64 {
        self.cache.run_pending_tasks();
        self.cache.entry_count()
    }

    /// Whether `spec`'s compiled grammar is in the cache.
    pub fn is_cached(&self, spec: &GrammarSpec) -> bool {
        self.cache.contains_key(&spec.key())
    }

    /// Estimated bytes the grammars `tenant` compiled hold in the cache.
    pub fn tenant_bytes(&self, tenant: &str) -> u64 {
        self.cache.run_pending_tasks();
        self.shares.lock().unwrap_or_else(|e| e.into_inner()).get(tenant).copied().unwrap_or(0)
    }

    fn build(&self, spec: &GrammarSpec) -> Result<Matcher, GrammarError> {
        let refused = |message: String| GrammarError::Refused { what: spec.kind(), message };
        let grammar = spec.to_llguidance()?;
        // The compiler asserts on some inputs it does not expect; that is a refusal of this
        // specification, never the end of the thread serving it.
        let parser = std::panic::catch_unwind(AssertUnwindSafe(|| self.factory.create_parser(grammar)))
            .map_err(|_| refused("the grammar compiler failed on it".into()))?
            .map_err(|e| refused(library_message(e)))?;
        let mut matcher = Matcher::new(Ok(parser));
        // Some problems (an empty language, a lexer limit) show only when the first mask is
        // computed: find them now, and keep that mask computed for every copy.
        let first = matcher.compute_mask().map_err(|e| refused(library_message(e)))?;
        if let Some(e) = matcher.get_error() {
            return Err(refused(library_message(e)));
        }
        if first.num_set() == 0 {
            return Err(refused("no text matches it".into()));
        }
        Ok(matcher)
    }

    /// Tokens the masks cover (the tokenizer's vocabulary).
    pub fn vocab_size(&self) -> usize {
        self.vocab
    }
}

/// A message of the grammar library in the words a client reads: without the marker it puts
/// where its state dump would go (errors are asked for without the dump), and the reasons its
/// parser stops named for what they mean here (an empty language is the likeliest: a schema
/// whose `$ref`s only lead to each other, or whose bounds exclude every value).
fn library_message(e: impl std::fmt::Display) -> String {
    let text = e.to_string();
    let text = text.split("\n<non-verbose/>").next().unwrap_or_default().trim();
    match text {
        "NoExtension" | "NoExtensionBias" => "no text matches it".into(),
        "LexerTooComplex" | "ParserTooComplex" => "matching it takes more work than this server allows".into(),
        "MaxTokensTotal" | "MaxTokensParser" => "it allows no more tokens".into(),
        "InternalError" => "the grammar library failed on it".into(),
        other => other.to_string(),
    }
}

/// A grammar ready for sequences: each one [`CompiledGrammar::start`]s its own copy.
#[derive(Clone)]
pub struct CompiledGrammar {
    template: Arc<Matcher>,
    key: [u8; 32],
    eos: Arc<[u32]>,
    trie_eos: u32,
}

impl CompiledGrammar {
    /// A fresh constraint at the start of the text.
    pub fn start(&self) -> Constraint {
        Constraint { matcher: self.template.deep_clone(), eos: self.eos.clone(), trie_eos: self.trie_eos }
    }
}

impl std::fmt::Debug for CompiledGrammar {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let hex: String = self.key[..6].iter().map(|b| format!("{b:02x}")).collect();
        write!(f, "CompiledGrammar({hex})")
    }
}

/// Two grammars are the same when their specifications are.
impl PartialEq for CompiledGrammar {
    fn eq(&self, other: &Self) -> bool {
        self.key == other.key
    }
}

/// One sequence's grammar state.
pub struct Constraint {
    matcher: Matcher,
    /// The model's end-of-sequence tokens; llguidance knows the first one.
    eos: Arc<[u32]>,
    trie_eos: u32,
}

impl Constraint {
    /// The tokens that may come next. Once the text is complete, only end of sequence.
    pub fn mask(&mut self) -> Result<TokenMask, GrammarError> {
        let vob = self.matcher.compute_mask_or_eos().map_err(|e| GrammarError::Generation(library_message(e)))?;
        Ok(TokenMask { eos_allowed: vob.is_allowed(self.trie_eos), vob, eos: self.eos.clone() })
    }

    /// Moves past a sampled token (one the last mask allowed).
    pub fn accept(&mut self, token: u32) -> Result<(), GrammarError> {
        if self.eos.contains(&token) && self.matcher.is_stopped() {
            // The end after a complete text: the matcher stopped at its last byte.
            return Ok(());
        }
        let token = if self.eos.contains(&token) { self.trie_eos } else { token };
        self.matcher.consume_token(token).map_err(|e| GrammarError::Generation(library_message(e)))
    }

    /// Whether the text is complete: nothing but end of sequence may follow.
    pub fn is_complete(&self) -> bool {
        self.matcher.is_stopped()
    }

    /// Whether the text so far is a whole match (end of sequence is allowed now).
    pub fn can_end(&mut self) -> bool {
        self.matcher.is_accepting().unwrap_or(false)
    }
}

/// The tokens one step may sample.
pub struct TokenMask {
    vob: SimpleVob,
    eos: Arc<[u32]>,
    eos_allowed: bool,
}

impl TokenMask {
    pub fn allows(&self, token: u32) -> bool {
        if self.eos.contains(&token) {
            return self.eos_allowed;
        }
        (token as usize) < self.vob.len() && self.vob.is_allowed(token)
    }

    /// Sets the logit of every token it does not allow to minus infinity (tokens past the
    /// tokenizer's vocabulary, a model's padding rows, included).
    pub fn apply(&self, logits: &mut [f32]) {
        const BITS: usize = 32;
        // llguidance knows one end-of-sequence token; the model's others go with it.
        let eos_logits: Vec<(usize, f32)> = self.eos.iter().filter_map(|&e| logits.get(e as usize).map(|&l| (e as usize, l))).collect();
        let words = self.vob.as_slice();
        for (w, chunk) in logits.chunks_mut(BITS).enumerate() {
            let bits = words.get(w).copied().unwrap_or(0);
            if bits == u32::MAX && chunk.len() == BITS {
                continue;
            }
            // Most words of a narrow mask allow nothing.
            if bits == 0 {
                chunk.fill(f32::NEG_INFINITY);
                continue;
            }
            for (b, logit) in chunk.iter_mut().enumerate() {
                if bits & (1 << b) == 0 {
                    *logit = f32::NEG_INFINITY;
                }
            }
        }
        for (e, l) in eos_logits {
            logits[e] = if self.eos_allowed { l } else { f32::NEG_INFINITY };
        }
    }

    /// How many tokens it allows (of the tokenizer's vocabulary).
    pub fn allowed(&self) -> usize {
        self.vob.num_set()
    }
}
