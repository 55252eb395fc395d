//! What `--model` names, resolved to files on disk: a local HuggingFace directory, a local
//! GGUF file, or a hub id (`org/name[@revision]`) fetched into the hub cache. A local path
//! that exists wins over a hub id of the same spelling, as in vLLM.

use std::path::{Path, PathBuf};

use super::hub::{Hub, HubError, HubId, Listing};

/// A model as the user wrote it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ModelSpec {
    /// A local directory or `.gguf` file.
    Path(PathBuf),
    /// A repository on the hub.
    Hub(HubId),
}

impl ModelSpec {
    /// Reads `--model`: an existing path, else a hub id, else a path (whose absence is then
    /// reported when it is opened).
    pub fn parse(text: &str) -> Result<Self, String> {
        if text.is_empty() {
            return Err("the model is empty: give a directory, a .gguf file or a hub id (org/name)".into());
        }
        let path = PathBuf::from(text);
        if path.exists() {
            return Ok(Self::Path(path));
        }
        let looks_local = text.starts_with(['.', '/', '~']) || text.ends_with(".gguf") || text.matches('/').count() != 1;
        if looks_local {
            return Ok(Self::Path(path));
        }
        HubId::parse(text).map(Self::Hub).map_err(|e| format!("{text}: no such file or directory, and {e}"))
    }
}

impl std::str::FromStr for ModelSpec {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::parse(s)
    }
}

impl std::fmt::Display for ModelSpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Path(p) => write!(f, "{}", p.display()),
            Self::Hub(id) => write!(f, "{id}"),
        }
    }
}

/// A model's files on disk.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ModelFiles {
    /// config.json, tokenizer files and safetensors in one directory.
    Dir(PathBuf),
    /// One GGUF file holding the config, the tokenizer and the weights.
    Gguf(PathBuf),
}

impl ModelFiles {
    pub fn path(&self) -> &Path {
        match self {
            Self::Dir(p) | Self::Gguf(p) => p,
        }
    }
}

/// A resolved model and the name clients see by default.
#[derive(Debug, Clone)]
pub struct ResolvedModel {
    pub files: ModelFiles,
    pub name: String,
}

#[derive(Debug, thiserror::Error)]
pub enum SourceError {
    #[error("model {}: no such file or directory", path.display())]
    Missing { path: PathBuf },
    #[error("model {}: neither a directory nor a .gguf file", path.display())]
    NotAModel { path: PathBuf },
    #[error("--gguf-file {0}: only a hub id's repository has GGUF files to choose from; give the file's path as --model instead")]
    GgufFileWithoutHub(String),
    #[error(transparent)]
    Hub(#[from] HubError),
}

/// Files of a HuggingFace checkpoint beside its weights, fetched when the repository has them.
const SIDE_FILES: &[&str] =
    &["config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"];

/// Resolves `spec`: local paths are checked, hub ids fetched (only what the model needs).
/// `gguf_file` chooses among a repository's GGUF files by name or quantization (`Q4_K_M`).
pub fn resolve(spec: &ModelSpec, gguf_file: Option<&str>, hub: &Hub) -> Result<ResolvedModel, SourceError> {
    match spec {
        ModelSpec::Path(path) => {
            if let Some(g) = gguf_file {
                return Err(SourceError::GgufFileWithoutHub(g.to_string()));
            }
            let files = local(path)?;
            let name = match &files {
                ModelFiles::Dir(d) => d.canonicalize().ok().and_then(|d| d.file_name().map(|n| n.to_string_lossy().into_owned())),
                ModelFiles::Gguf(f) => f.file_stem().map(|n| n.to_string_lossy().into_owned()),
            };
            Ok(ResolvedModel { files, name: name.unwrap_or_else(|| "model".into()) })
        }
        ModelSpec::Hub(id) => {
            let listing = hub.list(id)?;
            let plan = plan(&listing, gguf_file)?;
            let files = match plan {
                Plan::Gguf(file) => {
                    let dir = hub.fetch(&listing, std::slice::from_ref(&file))?;
                    ModelFiles::Gguf(dir.join(file))
                }
                Plan::Checkpoint { side, index } => {
                    let mut wanted = side;
                    let dir = match index {
                        Some(index) => {
                            let dir = hub.fetch(&listing, std::slice::from_ref(&index))?;
                            wanted.extend(shards(&dir.join(&index), &listing)?);
                            dir
                        }
                        None => hub.snapshot_dir(&listing),
                    };
                    hub.fetch(&listing, &wanted)?;
                    ModelFiles::Dir(dir)
                }
            };
            Ok(ResolvedModel { files, name: id.repo.clone() })
        }
    }
}

fn local(path: &Path) -> Result<ModelFiles, SourceError> {
    if path.is_dir() {
        Ok(ModelFiles::Dir(path.to_path_buf()))
    } else if path.is_file() {
        if path.extension().is_some_and(|e| e.eq_ignore_ascii_case("gguf")) || looks_gguf(path) {
            Ok(ModelFiles::Gguf(path.to_path_buf()))
        } else {
            Err(SourceError::NotAModel { path: path.to_path_buf() })
        }
    } else {
        Err(SourceError::Missing { path: path.to_path_buf() })
    }
}

fn looks_gguf(path: &Path) -> bool {
    use std::io::Read;
    let mut magic = [0u8; 4];
    std::fs::File::open(path).and_then(|mut f| f.read_exact(&mut magic)).is_ok() && &magic == b"GGUF"
}

/// What to fetch from a repository.
#[derive(Debug, PartialEq, Eq)]
enum Plan {
    Gguf(String),
    /// The side files it has, and its shard index (if sharded; else `model.safetensors` is
    /// among `side`).
    Checkpoint {
        side: Vec<String>,
        index: Option<String>,
    },
}

fn plan(listing: &Listing, gguf_file: Option<&str>) -> Result<Plan, SourceError> {
    let repo = &listing.id.repo;
    let no_model = |detail: String| SourceError::Hub(HubError::NoModel { repo: repo.clone(), detail });
    let ggufs: Vec<&str> = listing.files.iter().map(|f| f.rfilename.as_str()).filter(|n| n.to_ascii_lowercase().ends_with(".gguf")).collect();
    if let Some(want) = gguf_file {
        let exact: Vec<&str> = ggufs.iter().copied().filter(|n| *n == want || n.rsplit('/').next() == Some(want)).collect();
        let matches = if exact.is_empty() { ggufs.iter().copied().filter(|n| names_quant(n, want)).collect() } else { exact };
        return match matches.as_slice() {
            [one] => Ok(Plan::Gguf(one.to_string())),
            [] => Err(no_model(format!("no GGUF file matches `{want}` (it has: {})", list(&ggufs)))),
            many => Err(no_model(format!("several GGUF files match `{want}`: {}; give a whole file name", list(many)))),
        };
    }
    let side: Vec<String> = SIDE_FILES.iter().filter(|f| listing.has(f)).map(|f| f.to_string()).collect();
    if listing.has("config.json") {
        if listing.has("model.safetensors.index.json") {
            return Ok(Plan::Checkpoint { side, index: Some("model.safetensors.index.json".into()) });
        }
        if listing.has("model.safetensors") {
            let mut side = side;
            side.push("model.safetensors".into());
            return Ok(Plan::Checkpoint { side, index: None });
        }
    }
    match ggufs.as_slice() {
        [one] => Ok(Plan::Gguf(one.to_string())),
        [] => Err(no_model("no config.json with safetensors weights and no GGUF file".into())),
        many => Err(no_model(format!("it has several GGUF files ({}): choose one with --gguf-file NAME or a quantization like Q4_K_M", list(many)))),
    }
}

fn list(names: &[&str]) -> String {
    if names.is_empty() { "none".into() } else { names.join(", ") }
}

/// Whether GGUF file `name` is of quantization `quant` (`Q4_K_M` in `model-Q4_K_M.gguf`,
/// case-insensitive, not inside a longer name such as `Q4_K_M_L`).
fn names_quant(name: &str, quant: &str) -> bool {
    let (name, quant) = (name.to_ascii_lowercase(), quant.to_ascii_lowercase());
    let stem = name.rsplit('/').next().unwrap_or(&name).trim_end_matches(".gguf");
    if quant.is_empty() {
        return false;
    }
    let bytes = stem.as_bytes();
    stem.match_indices(&quant).any(|(at, m)| {
        let before = at.checked_sub(1).map(|i| bytes[i]);
        let after = bytes.get(at + m.len()).copied();
        let edge = |c: Option<u8>| c.is_none_or(|c| matches!(c, b'-' | b'.' | b'_'));
        edge(before) && edge(after) && after != Some(b'_')
    })
}

/// The shard files a safetensors index names, each listed by the repository.
fn shards(index: &Path, listing: &Listing) -> Result<Vec<String>, SourceError> {
    #[derive(serde::Deserialize)]
    struct Index {
        weight_map: std::collections::BTreeMap<String, String>,
    }
    let bad = |detail: String| SourceError::Hub(HubError::Listing { repo: listing.id.repo.clone(), detail });
    let text = std::fs::read_to_string(index).map_err(|e| bad(format!("{}: {e}", index.display())))?;
    let parsed: Index = serde_json::from_str(&text).map_err(|e| bad(format!("{}: {e}", index.display())))?;
    let mut files: Vec<String> = parsed.weight_map.into_values().collect();
    files.sort();
    files.dedup();
    for f in &files {
        if f.contains('/') || f.contains('\\') || f.starts_with('.') || !listing.has(f) {
            return Err(bad(format!("the index names shard {f:?}, which the repository does not list")));
        }
    }
    Ok(files)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::hub::Sibling;

    fn listing(names: &[&str]) -> Listing {
        let files = names.iter().map(|n| Sibling { rfilename: n.to_string(), size: Some(1), blob_id: None, lfs: None }).collect();
        Listing { id: HubId::parse("org/m").unwrap(), commit: "0".repeat(40), files, cached: false }
    }

    #[test]
    fn specs() {
        assert_eq!(
            ModelSpec::parse("HuggingFaceTB/SmolLM2-135M-Instruct").unwrap(),
            ModelSpec::Hub(HubId::parse("HuggingFaceTB/SmolLM2-135M-Instruct").unwrap())
        );
        let id = HubId::parse("org/name@v1.0").unwrap();
        assert_eq!((id.repo.as_str(), id.revision.as_str()), ("org/name", "v1.0"));
        assert_eq!(HubId::parse("org/name").unwrap().revision, "main");
        assert!(matches!(ModelSpec::parse("./models/x").unwrap(), ModelSpec::Path(_)));
        assert!(matches!(ModelSpec::parse("a/b/c").unwrap(), ModelSpec::Path(_)));
        assert!(matches!(ModelSpec::parse("model.gguf").unwrap(), ModelSpec::Path(_)));
        for bad in ["org/na me", "org/--x", "org/x@", "org/x@a..b", "org/x@a b"] {
            assert!(ModelSpec::parse(bad).is_err(), "{bad}");
        }
        let dir = tempfile::tempdir().unwrap();
        // An existing local path wins.
        let local = dir.path().join("org").join("name");
        std::fs::create_dir_all(&local).unwrap();
        let text = local.display().to_string();
        assert_eq!(ModelSpec::parse(&text).unwrap(), ModelSpec::Path(local));
    }

    #[test]
    fn plans() {
        let l = listing(&["config.json", "tokenizer.json", "model.safetensors", "README.md", "model.Q4_0.gguf"]);
        assert_eq!(
            plan(&l, None).unwrap(),
            Plan::Checkpoint { side: vec!["config.json".into(), "tokenizer.json".into(), "model.safetensors".into()], index: None }
        );
        assert_eq!(plan(&l, Some("Q4_0")).unwrap(), Plan::Gguf("model.Q4_0.gguf".into()));
        let l = listing(&["config.json", "model.safetensors.index.json", "model-00001-of-00002.safetensors"]);
        assert_eq!(plan(&l, None).unwrap(), Plan::Checkpoint { side: vec!["config.json".into()], index: Some("model.safetensors.index.json".into()) });
        let l = listing(&["m-Q4_K_M.gguf", "m-Q4_K_S.gguf", "m-Q8_0.gguf", "m-Q4_K_M_L.gguf"]);
        let e = plan(&l, None).unwrap_err().to_string();
        assert!(e.contains("--gguf-file") && e.contains("m-Q8_0.gguf"), "{e}");
        assert_eq!(plan(&l, Some("q4_k_m")).unwrap(), Plan::Gguf("m-Q4_K_M.gguf".into()));
        assert_eq!(plan(&l, Some("m-Q8_0.gguf")).unwrap(), Plan::Gguf("m-Q8_0.gguf".into()));
        let e = plan(&l, Some("Q2_K")).unwrap_err().to_string();
        assert!(e.contains("no GGUF file matches `Q2_K`"), "{e}");
        let e = plan(&listing(&["README.md"]), None).unwrap_err().to_string();
        assert!(e.contains("no config.json"), "{e}");
        assert_eq!(plan(&listing(&["only.gguf", "README.md"]), None).unwrap(), Plan::Gguf("only.gguf".into()));
    }
}
