//! `adapter_config.json`: the keys that decide which modules are adapted and how, read with the
//! semantics of PEFT's `LoraConfig`. Keys we do not know are ignored; keys that change what the
//! weights mean in ways this crate does not implement are refused.
//!
//! The file is untrusted, so what it can cost is bounded: its size ([`MAX_CONFIG_BYTES`]), the
//! entries of each list and pattern map ([`MAX_LIST_ENTRIES`], [`MAX_PATTERN_ENTRIES`]), the
//! length of every name and regex ([`MAX_PATTERN_LEN`]), and what each regex may compile to
//! ([`MAX_REGEX_BYTES`], [`MAX_REGEX_DFA_BYTES`]) and all of them together
//! ([`MAX_TOTAL_REGEX_BYTES`]). Every regex is compiled once, here.

use std::path::Path;

use regex::Regex;

use super::json::Json;
use crate::AdapterError;

/// Largest `adapter_config.json` read, in bytes. PEFT writes about 2 KiB.
pub const MAX_CONFIG_BYTES: u64 = 4 << 20;
/// Most entries in `rank_pattern`, and in `alpha_pattern`.
pub const MAX_PATTERN_ENTRIES: usize = 1024;
/// Most entries in the list forms of `target_modules`, `exclude_modules`,
/// `layers_to_transform` and `layers_pattern`.
pub const MAX_LIST_ENTRIES: usize = 1024;
/// Longest `rank_pattern`/`alpha_pattern` key, regex string (`target_modules`,
/// `exclude_modules`, `layers_pattern`) or list entry, in bytes.
pub const MAX_PATTERN_LEN: usize = 1024;
/// Most heap one compiled regex may use (`RegexBuilder::size_limit`).
pub const MAX_REGEX_BYTES: usize = 1 << 20;
/// Most heap the lazy DFA of one regex may use while matching (`RegexBuilder::dfa_size_limit`).
pub const MAX_REGEX_DFA_BYTES: usize = 1 << 20;
/// Most compiled size all the regexes of one config may use together. Each regex is charged
/// the smallest power-of-two size limit, from 4 KiB up to [`MAX_REGEX_BYTES`], it compiles
/// under: a key naming one module costs 8 KiB, so 1024 of them in each map fit.
pub const MAX_TOTAL_REGEX_BYTES: usize = 32 << 20;
/// The first size limit a regex is compiled under (see [`MAX_TOTAL_REGEX_BYTES`]).
const FIRST_REGEX_STEP: usize = 4 << 10;

/// Which modules `target_modules` selects.
#[derive(Debug)]
pub(crate) enum Targets {
    /// A list: a module is selected when its full name equals an entry or ends with `.entry`.
    Names(Vec<String>),
    /// A string: a regex that must match the whole module name.
    Regex(Regex),
    /// PEFT's `"all-linear"` shorthand: every linear layer except the output head, which for
    /// a decoder layer means all seven projections.
    AllLinear,
}

/// `exclude_modules`, with the same two forms as `target_modules`.
#[derive(Debug)]
pub(crate) enum Exclude {
    Nothing,
    Names(Vec<String>),
    Regex(Regex),
}

/// One `rank_pattern`/`alpha_pattern` entry: its key as written, the compiled
/// `^(?:.*\.)?(?:KEY)$` matcher and the value.
#[derive(Debug)]
pub(crate) struct Pattern {
    pub key: String,
    pub re: Regex,
    pub value: f64,
}

#[derive(Debug)]
pub(crate) struct PeftConfig {
    /// The default `lora_alpha` (PEFT's default, 8, when the key is absent).
    pub lora_alpha: f64,
    pub use_rslora: bool,
    pub targets: Targets,
    pub exclude: Exclude,
    /// `layers_to_transform`, normalised to a list; `None` means every layer.
    pub layers: Option<Vec<u64>>,
    /// The regexes that read a module's layer index (capture 1) for `layers_to_transform`, one
    /// per `layers_pattern` entry (`^.*\.(?:P)\.(\d+)\.`), or PEFT's default
    /// `^.*\.[^.]*\.(\d+)\.` when there is none. Compiled once, here; empty when
    /// `layers_to_transform` is absent, as they are not consulted then.
    pub layer_index: Vec<Regex>,
    /// In the order the file wrote them: the first key that matches wins.
    pub rank_pattern: Vec<Pattern>,
    pub alpha_pattern: Vec<Pattern>,
}

/// Keys that must be absent, null, false or empty: each changes what the saved weights mean
/// (or adds weights) in a way the serving path does not implement.
const REFUSED_WHEN_SET: &[(&str, &str)] = &[
    ("use_dora", "DoRA adapters (weight-decomposed LoRA) are not supported"),
    ("fan_in_fan_out", "fan_in_fan_out (transposed Conv1D-style weights) is not supported; Llama-family linears are not transposed"),
    ("modules_to_save", "modules_to_save (fully fine-tuned extra modules) is not supported"),
    ("lora_bias", "LoRA with a bias on lora_B is not supported"),
    ("use_qalora", "QA-LoRA is not supported"),
    ("layer_replication", "layer_replication is not supported"),
    ("target_parameters", "target_parameters (LoRA on raw parameters) is not supported"),
    ("trainable_token_indices", "trainable_token_indices (extra embedding rows) is not supported"),
    ("alora_invocation_tokens", "activated LoRA (alora_invocation_tokens) is not supported"),
];

/// How a key is named in an error: `map.KEY`, with an over-long `KEY` cut short.
fn entry_key(map: &str, key: &str) -> String {
    const SHOWN: usize = 64;
    if key.len() <= SHOWN {
        return format!("{map}.{key}");
    }
    let cut = (0..=SHOWN).rev().find(|&i| key.is_char_boundary(i)).unwrap_or(0);
    format!("{map}.{}…", &key[..cut])
}

fn check_len(path: &Path, key: &str, what: &str, s: &str) -> Result<(), AdapterError> {
    if s.len() > MAX_PATTERN_LEN {
        return Err(AdapterError::config(path, key, format!("{what} is {} bytes long, more than the limit of {MAX_PATTERN_LEN}", s.len())));
    }
    Ok(())
}

fn check_count(path: &Path, key: &str, n: usize, max: usize) -> Result<(), AdapterError> {
    if n > max {
        return Err(AdapterError::config(path, key, format!("{n} entries, more than the limit of {max}")));
    }
    Ok(())
}

/// Compiles the regexes of one config, each under [`MAX_REGEX_BYTES`] and all of them under
/// [`MAX_TOTAL_REGEX_BYTES`].
struct Compiler<'a> {
    path: &'a Path,
    /// What is left of [`MAX_TOTAL_REGEX_BYTES`].
    left: usize,
}

impl Compiler<'_> {
    /// Compiles `pattern`, the regex built around `source` (what the config wrote under `key`).
    /// It is tried under size limits doubling from [`FIRST_REGEX_STEP`], and charged the one it
    /// compiles under: a pattern that does not fit fails fast, as compiling stops at the limit.
    fn compile(&mut self, key: &str, source: &str, pattern: &str) -> Result<Regex, AdapterError> {
        check_len(self.path, key, "the regex", source)?;
        let mut limit = FIRST_REGEX_STEP;
        loop {
            let cap = limit.min(MAX_REGEX_BYTES).min(self.left);
            match regex::RegexBuilder::new(pattern).size_limit(cap).dfa_size_limit(MAX_REGEX_DFA_BYTES).build() {
                Ok(re) => {
                    self.left -= cap;
                    return Ok(re);
                }
                Err(regex::Error::CompiledTooBig(_)) if cap == MAX_REGEX_BYTES => {
                    return Err(AdapterError::config(
                        self.path,
                        key,
                        format!("regex {source:?} compiles to more than {MAX_REGEX_BYTES} bytes, the limit for one regex"),
                    ));
                }
                Err(regex::Error::CompiledTooBig(_)) if cap == self.left => {
                    return Err(AdapterError::config(
                        self.path,
                        key,
                        format!("regex {source:?} does not fit: the config's regexes together compile to more than {MAX_TOTAL_REGEX_BYTES} bytes"),
                    ));
                }
                Err(regex::Error::CompiledTooBig(_)) => limit = cap * 2,
                Err(e) => return Err(AdapterError::config(self.path, key, format!("invalid regex {source:?}: {e}"))),
            }
        }
    }
}

/// The value of `v` as a list of strings (used by `target_modules`, `exclude_modules`, ...).
fn string_list(path: &Path, key: &str, v: &[Json]) -> Result<Vec<String>, AdapterError> {
    check_count(path, key, v.len(), MAX_LIST_ENTRIES)?;
    v.iter()
        .enumerate()
        .map(|(i, item)| match item {
            Json::Str(s) => check_len(path, key, &format!("entry {i}"), s).map(|()| s.clone()),
            other => Err(AdapterError::config(path, key, format!("list entries must be strings, found {}", other.kind()))),
        })
        .collect()
}

fn patterns(re: &mut Compiler<'_>, key: &str, v: Option<&Json>, integer: bool) -> Result<Vec<Pattern>, AdapterError> {
    let path = re.path;
    let pairs = match v {
        None | Some(Json::Null) => return Ok(Vec::new()),
        Some(Json::Obj(pairs)) => pairs,
        Some(other) => {
            return Err(AdapterError::config(path, key, format!("expected an object, found {}", other.kind())));
        }
    };
    check_count(path, key, pairs.len(), MAX_PATTERN_ENTRIES)?;
    let mut out = Vec::with_capacity(pairs.len());
    for (pat, val) in pairs {
        let entry_key = entry_key(key, pat);
        check_len(path, &entry_key, "the key", pat)?;
        let value = if integer { val.as_index().filter(|&r| r > 0).map(|r| r as f64) } else { val.as_f64().filter(|a| a.is_finite()) };
        let Some(value) = value else {
            let want = if integer { "a positive integer" } else { "a finite number" };
            return Err(AdapterError::config(path, &entry_key, format!("expected {want}, found {}", val.kind())));
        };
        let compiled = re.compile(&entry_key, pat, &format!(r"^(?:.*\.)?(?:{pat})$"))?;
        out.push(Pattern { key: pat.clone(), re: compiled, value });
    }
    Ok(out)
}

impl PeftConfig {
    /// Parses and validates the config text read from `path` (the caller caps its size at
    /// [`MAX_CONFIG_BYTES`] when reading it).
    pub(crate) fn parse(path: &Path, text: &str) -> Result<PeftConfig, AdapterError> {
        let mut re = Compiler { path, left: MAX_TOTAL_REGEX_BYTES };
        let root: Json = serde_json::from_str(text).map_err(|e| AdapterError::ConfigJson { path: path.to_path_buf(), reason: e.to_string() })?;
        let Json::Obj(pairs) = root else {
            return Err(AdapterError::ConfigJson {
                path: path.to_path_buf(),
                reason: format!("expected a JSON object at the top level, found {}", root.kind()),
            });
        };
        let get = |k: &str| pairs.iter().find(|(key, _)| key == k).map(|(_, v)| v);

        if let Some(v) = get("peft_type") {
            match v {
                Json::Str(s) if s.eq_ignore_ascii_case("lora") => {}
                Json::Null => {}
                other => {
                    return Err(AdapterError::config(path, "peft_type", format!("only LORA adapters are supported, found {other:?}")));
                }
            }
        }
        for &(key, why) in REFUSED_WHEN_SET {
            if let Some(v) = get(key)
                && !v.is_falsy()
            {
                return Err(AdapterError::config(path, key, format!("{why} (value {v:?})")));
            }
        }
        match get("bias") {
            None | Some(Json::Null) => {}
            Some(Json::Str(s)) if s == "none" => {}
            Some(other) => {
                return Err(AdapterError::config(path, "bias", format!("only \"none\" is supported (trained biases change the base layers), found {other:?}")));
            }
        }

        // The default rank is only checked for sanity: ranks come from the tensor shapes.
        if let Some(v) = get("r")
            && *v != Json::Null
            && v.as_index().is_none_or(|r| r == 0)
        {
            return Err(AdapterError::config(path, "r", format!("expected a positive integer, found {v:?}")));
        }
        let lora_alpha = match get("lora_alpha") {
            None | Some(Json::Null) => 8.0,
            Some(v) => v
                .as_f64()
                .filter(|a| a.is_finite())
                .ok_or_else(|| AdapterError::config(path, "lora_alpha", format!("expected a finite number, found {v:?}")))?,
        };
        let use_rslora = match get("use_rslora") {
            None | Some(Json::Null) => false,
            Some(Json::Bool(b)) => *b,
            Some(other) => {
                return Err(AdapterError::config(path, "use_rslora", format!("expected a boolean, found {}", other.kind())));
            }
        };

        let targets = match get("target_modules") {
            None | Some(Json::Null) => {
                return Err(AdapterError::config(
                    path,
                    "target_modules",
                    "missing: the modules an adapter applies to must be named (PEFT's per-architecture defaults are not guessed)",
                ));
            }
            Some(Json::Str(s)) if s.eq_ignore_ascii_case("all-linear") => Targets::AllLinear,
            Some(Json::Str(s)) => Targets::Regex(re.compile("target_modules", s, &format!("^(?:{s})$"))?),
            Some(Json::Arr(items)) => Targets::Names(string_list(path, "target_modules", items)?),
            Some(other) => {
                return Err(AdapterError::config(path, "target_modules", format!("expected a list or a string, found {}", other.kind())));
            }
        };
        let exclude = match get("exclude_modules") {
            None | Some(Json::Null) => Exclude::Nothing,
            Some(Json::Str(s)) if s.is_empty() => Exclude::Nothing,
            Some(Json::Str(s)) => Exclude::Regex(re.compile("exclude_modules", s, &format!("^(?:{s})$"))?),
            Some(Json::Arr(items)) => Exclude::Names(string_list(path, "exclude_modules", items)?),
            Some(other) => {
                return Err(AdapterError::config(path, "exclude_modules", format!("expected a list or a string, found {}", other.kind())));
            }
        };

        let bad_layer = |v: &Json| AdapterError::config(path, "layers_to_transform", format!("expected a non-negative integer, found {v:?}"));
        let layers = match get("layers_to_transform") {
            None | Some(Json::Null) => None,
            Some(Json::Arr(items)) if items.is_empty() => None,
            Some(Json::Arr(items)) => {
                check_count(path, "layers_to_transform", items.len(), MAX_LIST_ENTRIES)?;
                Some(items.iter().map(|v| v.as_index().ok_or_else(|| bad_layer(v))).collect::<Result<Vec<_>, _>>()?)
            }
            Some(v) => Some(vec![v.as_index().ok_or_else(|| bad_layer(v))?]),
        };
        let layers_pattern = match get("layers_pattern") {
            None | Some(Json::Null) => Vec::new(),
            Some(Json::Str(s)) if s.is_empty() => Vec::new(),
            Some(Json::Str(s)) => {
                check_len(path, "layers_pattern", "the regex", s)?;
                vec![s.clone()]
            }
            Some(Json::Arr(items)) => string_list(path, "layers_pattern", items)?,
            Some(other) => {
                return Err(AdapterError::config(path, "layers_pattern", format!("expected a list or a string, found {}", other.kind())));
            }
        };
        // PEFT's LoraConfig refuses these combinations too: with a regex the layers are the
        // regex's business.
        if matches!(targets, Targets::Regex(_)) && layers.is_some() {
            return Err(AdapterError::config(path, "layers_to_transform", "cannot be used when target_modules is a regex string"));
        }
        if matches!(targets, Targets::Regex(_)) && !layers_pattern.is_empty() {
            return Err(AdapterError::config(path, "layers_pattern", "cannot be used when target_modules is a regex string"));
        }

        let layer_index = match (&layers, layers_pattern.is_empty()) {
            (None, _) => Vec::new(),
            (Some(_), true) => vec![re.compile("layers_to_transform", "", r"^.*\.[^.]*\.(\d+)\.")?],
            (Some(_), false) => layers_pattern.iter().map(|p| re.compile("layers_pattern", p, &format!(r"^.*\.(?:{p})\.(\d+)\."))).collect::<Result<_, _>>()?,
        };

        Ok(PeftConfig {
            lora_alpha,
            use_rslora,
            targets,
            exclude,
            layers,
            layer_index,
            rank_pattern: patterns(&mut re, "rank_pattern", get("rank_pattern"), true)?,
            alpha_pattern: patterns(&mut re, "alpha_pattern", get("alpha_pattern"), false)?,
        })
    }
}
