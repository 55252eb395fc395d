//! `adapter_config.json`: the keys that decide which modules are adapted and how, read with the
//! semantics of PEFT's `LoraConfig`. Keys we do not know are ignored; keys that change what the
//! weights mean in ways this crate does not implement are refused.

use std::path::Path;

use regex::Regex;

use super::json::Json;
use crate::AdapterError;

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
    /// `layers_pattern` as a list (empty when absent).
    pub layers_pattern: Vec<String>,
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

fn compile(path: &Path, key: &str, pattern: &str) -> Result<Regex, AdapterError> {
    regex::RegexBuilder::new(pattern).size_limit(1 << 22).build().map_err(|e| AdapterError::config(path, key, format!("invalid regex {pattern:?}: {e}")))
}

/// The value of `v` as a list of strings (used by `target_modules`, `exclude_modules`, ...).
fn string_list(path: &Path, key: &str, v: &[Json]) -> Result<Vec<String>, AdapterError> {
    v.iter()
        .map(|item| match item {
            Json::Str(s) => Ok(s.clone()),
            other => Err(AdapterError::config(path, key, format!("list entries must be strings, found {}", other.kind()))),
        })
        .collect()
}

fn patterns(path: &Path, key: &str, v: Option<&Json>, integer: bool) -> Result<Vec<Pattern>, AdapterError> {
    let pairs = match v {
        None | Some(Json::Null) => return Ok(Vec::new()),
        Some(Json::Obj(pairs)) => pairs,
        Some(other) => {
            return Err(AdapterError::config(path, key, format!("expected an object, found {}", other.kind())));
        }
    };
    let mut out = Vec::with_capacity(pairs.len());
    for (pat, val) in pairs {
        let entry_key = format!("{key}.{pat}");
        let value = if integer { val.as_index().filter(|&r| r > 0).map(|r| r as f64) } else { val.as_f64().filter(|a| a.is_finite()) };
        let Some(value) = value else {
            let want = if integer { "a positive integer" } else { "a finite number" };
            return Err(AdapterError::config(path, &entry_key, format!("expected {want}, found {}", val.kind())));
        };
        let re = compile(path, &entry_key, &format!(r"^(?:.*\.)?(?:{pat})$"))?;
        out.push(Pattern { key: pat.clone(), re, value });
    }
    Ok(out)
}

impl PeftConfig {
    /// Parses and validates the config text read from `path`.
    pub(crate) fn parse(path: &Path, text: &str) -> Result<PeftConfig, AdapterError> {
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
            Some(Json::Str(s)) => Targets::Regex(compile(path, "target_modules", &format!("^(?:{s})$"))?),
            Some(Json::Arr(items)) => Targets::Names(string_list(path, "target_modules", items)?),
            Some(other) => {
                return Err(AdapterError::config(path, "target_modules", format!("expected a list or a string, found {}", other.kind())));
            }
        };
        let exclude = match get("exclude_modules") {
            None | Some(Json::Null) => Exclude::Nothing,
            Some(Json::Str(s)) if s.is_empty() => Exclude::Nothing,
            Some(Json::Str(s)) => Exclude::Regex(compile(path, "exclude_modules", &format!("^(?:{s})$"))?),
            Some(Json::Arr(items)) => Exclude::Names(string_list(path, "exclude_modules", items)?),
            Some(other) => {
                return Err(AdapterError::config(path, "exclude_modules", format!("expected a list or a string, found {}", other.kind())));
            }
        };

        let bad_layer = |v: &Json| AdapterError::config(path, "layers_to_transform", format!("expected a non-negative integer, found {v:?}"));
        let layers = match get("layers_to_transform") {
            None | Some(Json::Null) => None,
            Some(Json::Arr(items)) if items.is_empty() => None,
            Some(Json::Arr(items)) => Some(items.iter().map(|v| v.as_index().ok_or_else(|| bad_layer(v))).collect::<Result<Vec<_>, _>>()?),
            Some(v) => Some(vec![v.as_index().ok_or_else(|| bad_layer(v))?]),
        };
        let layers_pattern = match get("layers_pattern") {
            None | Some(Json::Null) => Vec::new(),
            Some(Json::Str(s)) if s.is_empty() => Vec::new(),
            Some(Json::Str(s)) => vec![s.clone()],
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

        Ok(PeftConfig {
            lora_alpha,
            use_rslora,
            targets,
            exclude,
            layers,
            layers_pattern,
            rank_pattern: patterns(path, "rank_pattern", get("rank_pattern"), true)?,
            alpha_pattern: patterns(path, "alpha_pattern", get("alpha_pattern"), false)?,
        })
    }
}
