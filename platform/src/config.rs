//! The command line: one typed tree of options, parsed once (flags or `LORAPLEX_*` environment
//! variables) and handed down as sub-structs. Library code never reads the environment.

use std::path::PathBuf;

use clap::{Args, Parser, Subcommand};

use loraplex_adapters::AdapterLimits;
use loraplex_kernels::cpu::{CpuBackend, MatmulInputs};
use loraplex_kernels::{DType, RowDType};

use crate::engine::EngineConfig;
use crate::memory::LoaderConfig;
use crate::model::source::ModelSpec;
use crate::sampling::SamplingParams;
use crate::synth::{AdapterTargets, FileDType, Preset};

#[derive(Debug, Parser)]
#[command(name = "loraplex", version, about = "Serve one base LLM with many LoRA adapters")]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Generate a continuation of one prompt.
    Generate(Box<GenerateArgs>),
    /// Write a random model in the HuggingFace layout.
    Synth(SynthArgs),
    /// Logits of given token sequences (teacher forced), for parity checks.
    Logits(Box<LogitsArgs>),
    /// Run the HTTP server: OpenAI- and LoRAX-compatible inference, adapters, tenants, billing.
    Serve(Box<ServeArgs>),
    /// Measure performance.
    Bench {
        #[command(subcommand)]
        which: Box<BenchCommand>,
    },
}

/// Options of the compute device and the engine's memory and batching.
#[derive(Debug, Clone, Args)]
pub struct EngineArgs {
    /// Device memory for the page pool (KV blocks and adapter weights), in MiB.
    #[arg(long, env = "LORAPLEX_POOL_MB", default_value_t = 1024)]
    pub pool_mb: usize,
    /// Host memory for loaded adapters waiting to enter (or re-enter) the pool, in MiB.
    #[arg(long, env = "LORAPLEX_HOST_CACHE_MB", default_value_t = 4096)]
    pub host_cache_mb: u64,
    /// Percent of `--host-cache-mb` one tenant's adapters may hold: a load beyond it drops that
    /// tenant's own oldest adapters from host memory, not other tenants' (100: no share).
    #[arg(long, env = "LORAPLEX_HOST_TENANT_PERCENT", default_value_t = 50, value_parser = clap::value_parser!(u32).range(1..=100))]
    pub host_tenant_percent: u32,
    /// Threads that read and validate adapters from disk.
    #[arg(long, env = "LORAPLEX_ADAPTER_LOADERS", default_value_t = 2)]
    pub adapter_loaders: usize,
    /// Highest LoRA rank accepted.
    #[arg(long, env = "LORAPLEX_MAX_LORA_RANK", default_value_t = 256)]
    pub max_lora_rank: usize,
    /// Tokens per KV block.
    #[arg(long, env = "LORAPLEX_BLOCK_SIZE", default_value_t = 16)]
    pub block_size: usize,
    /// Element type of keys and values in the page pool. bf16 halves the bytes per cached
    /// token (twice the tokens in `--pool-mb`, half the bytes attention reads), rounding each
    /// key and value once when it is written; f32 is exact. On CUDA, bf16 pages go with
    /// `--matmul-dtype bf16` (and f32 pages with f32). Default: f32 on the CPU; on CUDA, the
    /// type of `--matmul-dtype` (bf16 unless that says f32).
    #[arg(long, env = "LORAPLEX_KV_DTYPE", value_enum)]
    pub kv_dtype: Option<KvDType>,
    /// What activations enter the matmuls of bf16 weights as (see [`MatmulDType`]). Default:
    /// f32 on the CPU (exact); on CUDA bf16, the whole forward in bf16 as deployments run it,
    /// unless `--kv-dtype f32` asks for the f32 model.
    #[arg(long, env = "LORAPLEX_MATMUL_DTYPE", value_enum)]
    pub matmul_dtype: Option<MatmulDType>,
    /// Most tokens in one forward step (prompt chunks plus decodes).
    #[arg(long, env = "LORAPLEX_MAX_BATCH_TOKENS", default_value_t = 2048)]
    pub max_batch_tokens: usize,
    /// Most sequences generating at once.
    #[arg(long, env = "LORAPLEX_MAX_RUNNING", default_value_t = 256)]
    pub max_running: usize,
    /// CPU threads (default: all cores).
    #[arg(long, env = "LORAPLEX_THREADS")]
    pub threads: Option<usize>,
    /// Do not keep computed prompt blocks for reuse by later requests.
    #[arg(long, env = "LORAPLEX_NO_PREFIX_CACHE")]
    pub no_prefix_cache: bool,
    /// Percent of the KV pool one tenant's idle cached prompt blocks may hold when the pool is
    /// short: beyond it, that tenant's own oldest blocks are evicted before anyone else's, so a
    /// tenant sending many distinct prompts cannot push out the prefixes others reuse (100: one
    /// LRU for every tenant).
    #[arg(long, env = "LORAPLEX_PREFIX_TENANT_PERCENT", default_value_t = 25, value_parser = clap::value_parser!(u32).range(1..=100))]
    pub prefix_tenant_percent: u32,
    /// What attending to one cached token costs relative to a token's other work, in the step's
    /// budget of `--max-batch-tokens` (0: count tokens only). Default: from the model's shapes
    /// and the backend's attention speed, so a chunk of a long prompt takes as much of a step
    /// as it takes time.
    #[arg(long, env = "LORAPLEX_ATTENTION_COST", value_parser = non_negative)]
    pub attention_cost: Option<f64>,
    /// How much longer a tenant's prompt work may make a step that also serves a tenant ahead
    /// of it in the fair order, as a fraction of a step's fixed time (`inf`: no limit). Keeps a
    /// light tenant's decodes from waiting on a heavy tenant's long prompts.
    #[arg(long, env = "LORAPLEX_SHARED_SLOWDOWN", default_value_t = 0.25, value_parser = non_negative)]
    pub shared_slowdown: f64,
    /// When the decodes of tenants behind another one in the fair order would lengthen a step
    /// that runs that tenant's prompt by at least this fraction of the step's fixed time, they
    /// wait for the next step (never two in a row; `inf`: never). On a CPU, where each row of
    /// a step costs time, a light tenant's first token then does not wait for a heavy tenant's
    /// batch as well.
    #[arg(long, env = "LORAPLEX_DEFER_DECODES", default_value_t = 0.5, value_parser = non_negative)]
    pub defer_decodes: f64,
    /// A step's fixed time in units of a token's cost (default: measured from the steps run).
    #[arg(long, env = "LORAPLEX_STEP_OVERHEAD", value_parser = non_negative)]
    pub step_overhead: Option<f64>,
}

/// How the page pool stores keys and values.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum KvDType {
    F32,
    /// bfloat16, rounded to nearest even.
    Bf16,
}

impl KvDType {
    /// The matmul type the CUDA backend pairs with these pages.
    pub fn cuda_matmul(self) -> MatmulDType {
        match self {
            KvDType::F32 => MatmulDType::F32,
            KvDType::Bf16 => MatmulDType::Bf16,
        }
    }

    pub fn row_dtype(self) -> RowDType {
        match self {
            KvDType::F32 => RowDType::F32,
            KvDType::Bf16 => RowDType::Bf16,
        }
    }
}

/// What the backend multiplies weights with.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum MatmulDType {
    /// Activations in f32: exact, bf16 weights give the same bits as f32 weights. On CUDA the
    /// weights are widened to f32 (twice the memory and bytes read of bf16).
    F32,
    /// CPU: activations rounded to bf16 at each matmul of a bf16 weight, products summed in f32
    /// (as PyTorch and llama.cpp run bf16 models); on CPUs with a bf16 dot product (AVX-512 BF16,
    /// Arm's BF16 extension) it does twice the multiply-adds of f32. Other weights stay exact.
    /// CUDA: the whole forward in bf16, as transformers runs a bf16 model (weights, activations,
    /// the residual stream and, with `--kv-dtype bf16`, the KV pages; every kernel and GEMM sums
    /// in f32; logits in f32).
    Bf16,
}

/// Whether the CUDA backend runs with these types: its attention reads KV pages of the type it
/// computes in, so bf16 compute keeps bf16 pages and f32 compute f32 pages.
pub fn check_cuda_dtypes(matmul: MatmulDType, kv: KvDType) -> Result<(), String> {
    match (matmul, kv) {
        (MatmulDType::F32, KvDType::F32) | (MatmulDType::Bf16, KvDType::Bf16) => Ok(()),
        (MatmulDType::Bf16, KvDType::F32) => {
            Err("on CUDA, --matmul-dtype bf16 runs the whole model in bf16 and keeps its KV pages in bf16: add --kv-dtype bf16".into())
        }
        (MatmulDType::F32, KvDType::Bf16) => Err("on CUDA, bf16 KV pages go with --matmul-dtype bf16 (the whole model in bf16)".into()),
    }
}

impl MatmulDType {
    /// The KV pages the CUDA backend pairs with this choice (its attention reads pages of the
    /// type it computes in).
    pub fn cuda_kv(self) -> KvDType {
        match self {
            MatmulDType::F32 => KvDType::F32,
            MatmulDType::Bf16 => KvDType::Bf16,
        }
    }

    /// The element type the CUDA backend computes in with this choice.
    pub fn cuda_compute(self) -> DType {
        match self {
            MatmulDType::F32 => DType::F32,
            MatmulDType::Bf16 => DType::Bf16,
        }
    }

    pub fn inputs(self) -> MatmulInputs {
        match self {
            MatmulDType::F32 => MatmulInputs::F32,
            MatmulDType::Bf16 => MatmulInputs::Bf16,
        }
    }

    /// The CPU backend on the widest instruction set, multiplying bf16 weights this way.
    pub fn cpu_backend(self) -> CpuBackend {
        CpuBackend::new().with_matmul_inputs(self.inputs())
    }
}

/// A number that is not negative (or NaN); `inf` is allowed.
/// A count that must be at least one (clap's range check, for `usize` flags).
fn positive() -> clap::builder::RangedU64ValueParser<usize> {
    clap::builder::RangedU64ValueParser::new().range(1..)
}

fn non_negative(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(v) if v >= 0.0 => Ok(v),
        Ok(_) => Err("must not be negative".to_string()),
        Err(e) => Err(e.to_string()),
    }
}

impl EngineArgs {
    /// The matmul and KV types on the CPU (`cuda` false) or on CUDA, from the flags given and
    /// the defaults of each device: f32 and f32 on the CPU; bf16 and bf16 on CUDA, where the two
    /// go together, so that naming one picks the other.
    pub fn dtypes(&self, cuda: bool) -> Result<(MatmulDType, KvDType), String> {
        if !cuda {
            return Ok((self.matmul_dtype.unwrap_or(MatmulDType::F32), self.kv_dtype.unwrap_or(KvDType::F32)));
        }
        let (matmul, kv) = match (self.matmul_dtype, self.kv_dtype) {
            (None, None) => (MatmulDType::Bf16, KvDType::Bf16),
            (Some(m), None) => (m, m.cuda_kv()),
            (None, Some(k)) => (k.cuda_matmul(), k),
            (Some(m), Some(k)) => (m, k),
        };
        check_cuda_dtypes(matmul, kv)?;
        Ok((matmul, kv))
    }

    /// The engine's settings, its KV pages stored as `kv` (from [`EngineArgs::dtypes`]).
    pub fn engine_config(&self, kv: KvDType) -> EngineConfig {
        EngineConfig {
            block_size: self.block_size,
            kv_dtype: kv.row_dtype(),
            pool_bytes: self.pool_mb.saturating_mul(1 << 20),
            max_batch_tokens: self.max_batch_tokens,
            max_running: self.max_running,
            adapters: LoaderConfig {
                host_cache_bytes: self.host_cache_mb.saturating_mul(1 << 20),
                threads: self.adapter_loaders,
                limits: AdapterLimits { max_rank: self.max_lora_rank, ..AdapterLimits::default() },
                tenant_percent: self.host_tenant_percent,
            },
            prefix_cache: !self.no_prefix_cache,
            prefix_tenant_percent: self.prefix_tenant_percent,
            pinned_percent: 0,
            attention_cost: self.attention_cost,
            shared_slowdown: self.shared_slowdown.is_finite().then_some(self.shared_slowdown),
            defer_decodes: self.defer_decodes.is_finite().then_some(self.defer_decodes),
            step_overhead: self.step_overhead,
        }
    }
}

/// How tokens are chosen.
#[derive(Debug, Clone, Args)]
pub struct SamplingArgs {
    /// 0 means greedy.
    #[arg(long, default_value_t = 0.0)]
    pub temperature: f32,
    #[arg(long, default_value_t = 1.0)]
    pub top_p: f32,
    /// 0 means off.
    #[arg(long, default_value_t = 0)]
    pub top_k: usize,
    #[arg(long, default_value_t = 0.0)]
    pub min_p: f32,
    #[arg(long, default_value_t = 1.0)]
    pub repetition_penalty: f32,
    #[arg(long, default_value_t = 0.0)]
    pub presence_penalty: f32,
    #[arg(long, default_value_t = 0.0)]
    pub frequency_penalty: f32,
    /// Makes sampling reproducible.
    #[arg(long)]
    pub seed: Option<u64>,
    /// Also report the top-N alternatives' log-probabilities of each token.
    #[arg(long)]
    pub logprobs: Option<usize>,
}

impl SamplingArgs {
    pub fn params(&self) -> SamplingParams {
        SamplingParams {
            temperature: self.temperature,
            top_k: self.top_k,
            top_p: self.top_p,
            min_p: self.min_p,
            repetition_penalty: self.repetition_penalty,
            presence_penalty: self.presence_penalty,
            frequency_penalty: self.frequency_penalty,
            seed: self.seed,
            logprobs: self.logprobs,
        }
    }
}

#[derive(Debug, Clone, Args)]
#[group(id = "input", required = true, multiple = false)]
pub struct PromptArgs {
    /// Prompt text (tokenized with the model's tokenizer, BOS added as it specifies).
    #[arg(long, group = "input")]
    pub prompt: Option<String>,
    /// Prompt token ids, comma-separated.
    #[arg(long, group = "input", value_delimiter = ',')]
    pub prompt_ids: Option<Vec<u32>>,
    /// Chat messages as JSON, `[{"role": "user", "content": "..."}]`, rendered with the model's
    /// chat template.
    #[arg(long, group = "input")]
    pub chat: Option<String>,
    /// A JSON-lines file of requests, all run together in one continuous batch; one output line
    /// per input line, in input order. Each line: `{"id", "prompt" | "prompt_ids", "adapter",
    /// "max_new_tokens", "temperature", "top_p", "top_k", "seed", "stop", "ignore_eos"}` (only
    /// `id` and a prompt are required; the rest default to the command-line values).
    #[arg(long, group = "input")]
    pub batch: Option<PathBuf>,
}

/// Where hub ids given as `--model` come from, and where they are kept. The `HF_*` variables
/// are the ones Python's `huggingface_hub` reads, so both share one cache.
#[derive(Debug, Clone, Args)]
pub struct HubArgs {
    /// In a hub repository of GGUF files, the one to load: its file name, or its quantization
    /// (`Q4_K_M`, `Q8_0`).
    #[arg(long, env = "LORAPLEX_GGUF_FILE")]
    pub gguf_file: Option<String>,
    /// Token for gated and private hub repositories (default: the one `hf auth login` saved).
    #[arg(long, env = "HF_TOKEN", hide_env_values = true)]
    pub hf_token: Option<String>,
    /// The hub's address (a mirror, or a hub of your own).
    #[arg(long, env = "HF_ENDPOINT", default_value = DEFAULT_HUB)]
    pub hf_endpoint: String,
    /// Never reach the hub: hub ids are served from the cache alone.
    #[arg(long, env = "HF_HUB_OFFLINE", value_parser = clap::builder::BoolishValueParser::new(), num_args = 0..=1, default_value_t = false, default_missing_value = "true", action = clap::ArgAction::Set)]
    pub hf_offline: bool,
    /// The hub cache (default: `$HF_HOME/hub`, else `~/.cache/huggingface/hub`).
    #[arg(long, env = "HF_HUB_CACHE")]
    pub hf_hub_cache: Option<PathBuf>,
    /// The hub's home directory, holding the cache and the saved token.
    #[arg(long, env = "HF_HOME")]
    pub hf_home: Option<PathBuf>,
}

impl Default for HubArgs {
    /// The public hub, its cache found from the environment as `huggingface_hub` finds it.
    fn default() -> Self {
        Self { gguf_file: None, hf_token: None, hf_endpoint: DEFAULT_HUB.into(), hf_offline: false, hf_hub_cache: None, hf_home: None }
    }
}

/// The hub's address unless `--hf-endpoint` says otherwise.
pub const DEFAULT_HUB: &str = "https://huggingface.co";

impl HubArgs {
    /// Resolves `spec` to files on disk, fetching a hub id's into the cache.
    pub fn resolve(&self, spec: &ModelSpec) -> Result<crate::model::source::ResolvedModel, crate::model::source::SourceError> {
        crate::model::source::resolve(spec, self.gguf_file.as_deref(), &self.hub(std::env::home_dir().as_deref()))
    }

    /// The hub client these arguments describe (`home` is the user's home directory).
    pub fn hub(&self, home: Option<&std::path::Path>) -> crate::model::hub::Hub {
        use crate::model::hub::{Hub, HubOptions};
        Hub::new(HubOptions {
            endpoint: self.hf_endpoint.clone(),
            token: self.hf_token.clone(),
            offline: self.hf_offline,
            cache_dir: HubOptions::cache_dir(self.hf_hub_cache.as_deref(), self.hf_home.as_deref(), home),
            progress: true,
        })
    }
}

#[derive(Debug, Clone, Args)]
pub struct GenerateArgs {
    /// The model: a HuggingFace directory (config.json, safetensors, tokenizer.json), a .gguf
    /// file, or a hub id (`org/name`, `org/name@revision`).
    #[arg(long, env = "LORAPLEX_MODEL")]
    pub model: ModelSpec,
    #[command(flatten)]
    pub hub: HubArgs,
    #[command(flatten)]
    pub input: PromptArgs,
    /// A PEFT LoRA adapter directory (adapter_config.json + adapter_model.safetensors) to apply.
    #[arg(long, conflicts_with = "batch")]
    pub adapter: Option<PathBuf>,
    #[arg(long, default_value_t = 64)]
    pub max_new_tokens: u32,
    /// Keep generating past end-of-sequence tokens.
    #[arg(long)]
    pub ignore_eos: bool,
    /// Stop strings (repeatable); the output ends before the first one.
    #[arg(long = "stop")]
    pub stop: Vec<String>,
    /// Print one JSON object instead of streaming text.
    #[arg(long)]
    pub json: bool,
    #[command(flatten)]
    pub sampling: SamplingArgs,
    #[command(flatten)]
    pub engine: EngineArgs,
}

#[derive(Debug, Clone, Args)]
pub struct LogitsArgs {
    /// The model: a HuggingFace directory, a .gguf file, or a hub id (`org/name[@revision]`).
    #[arg(long)]
    pub model: ModelSpec,
    #[command(flatten)]
    pub hub: HubArgs,
    /// JSON lines, one case each: {"name", "prompt_ids": [...], "follow": [...], "rows": N,
    /// "adapter": "DIR"} (follow, rows and adapter optional).
    #[arg(long)]
    pub cases: PathBuf,
    /// Where the JSON report goes: each case's name and its rows of logits.
    #[arg(long)]
    pub out: PathBuf,
    /// cpu, or cuda / cuda:N.
    #[arg(long, default_value = "cpu")]
    pub device: Device,
    /// What the matmuls multiply in (see `serve --matmul-dtype`).
    #[arg(long, value_enum, default_value_t = MatmulDType::F32)]
    pub matmul_dtype: MatmulDType,
    /// Element type of the KV pages (see `serve --kv-dtype`).
    #[arg(long, value_enum, default_value_t = KvDType::F32)]
    pub kv_dtype: KvDType,
}

#[derive(Debug, Clone, Args)]
pub struct SynthArgs {
    /// Directory to write (created if missing).
    #[arg(long)]
    pub out: PathBuf,
    #[arg(long, value_enum, default_value_t = Preset::Tiny)]
    pub preset: Preset,
    /// Key/value heads instead of the preset's (grouped-query attention; must divide the
    /// attention heads), e.g. 8 for a 7b with Llama 3's grouping.
    #[arg(long)]
    pub kv_heads: Option<usize>,
    /// Element type of the model's saved weights.
    #[arg(long, value_enum, default_value_t = FileDType::F32)]
    pub dtype: FileDType,
    /// Seeds the weights of the model and of its adapters.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Also write this many random LoRA adapters for the model, in the PEFT layout.
    #[arg(long, default_value_t = 0)]
    pub adapters: usize,
    /// Adapter ranks, comma-separated, cycled over the adapters. No rank may exceed the
    /// smaller side of a targeted projection (32 for the tiny preset, whose k/v map 128 to 32).
    #[arg(long, value_delimiter = ',', default_value = "8,16")]
    pub ranks: Vec<usize>,
    /// Projections the adapters adapt: q_proj and v_proj, or all seven.
    #[arg(long, value_enum, default_value_t = AdapterTargets::All)]
    pub targets: AdapterTargets,
    /// Element type of the adapters' saved weights.
    #[arg(long, value_enum, default_value_t = FileDType::F32)]
    pub adapter_dtype: FileDType,
    /// Directory for the adapters, one sub-directory each (default: OUT/adapters).
    #[arg(long)]
    pub adapters_out: Option<PathBuf>,
}

#[derive(Debug, Clone, Args)]
pub struct ServeArgs {
    /// The model: a HuggingFace directory, a .gguf file, or a hub id (`org/name[@revision]`,
    /// fetched into the hub cache). Without one, a synthetic tiny model is generated in the
    /// data directory on first start (for trying the server out offline; its text is gibberish).
    #[arg(long, env = "LORAPLEX_MODEL")]
    pub model: Option<ModelSpec>,
    #[command(flatten)]
    pub hub: HubArgs,
    /// The name clients use for the base model (default: the hub id, or the directory's or
    /// GGUF file's name).
    #[arg(long, env = "LORAPLEX_SERVED_MODEL_NAME")]
    pub served_model_name: Option<String>,
    /// The compute device: cpu, cuda (the first GPUs, one per worker), cuda:N, or auto (the
    /// GPUs when CUDA is usable, else the CPU).
    #[arg(long, env = "LORAPLEX_DEVICE", default_value = "cpu")]
    pub device: Device,
    /// Device workers (one per GPU; on the CPU, workers share the cores).
    #[arg(long, env = "LORAPLEX_WORKERS", default_value_t = 1)]
    pub workers: usize,
    /// Where the database (by default) and adapter files live.
    #[arg(long, env = "LORAPLEX_DATA_DIR", default_value = "./data")]
    pub data_dir: PathBuf,
    /// sqlite://PATH or postgres://...; default: a SQLite file in the data directory.
    #[arg(long, env = "LORAPLEX_DATABASE_URL")]
    pub database_url: Option<String>,
    #[arg(long, env = "LORAPLEX_HOST", default_value = "127.0.0.1")]
    pub host: String,
    /// 0 picks a free port (printed at start).
    #[arg(long, env = "LORAPLEX_PORT", default_value_t = 8080)]
    pub port: u16,
    /// The operator's key. Without one, a key is generated on first start and printed once.
    #[arg(long, env = "LORAPLEX_ADMIN_KEY")]
    pub admin_key: Option<String>,
    /// Largest adapter weights file an upload may send, in MiB.
    #[arg(long, env = "LORAPLEX_MAX_UPLOAD_MB", default_value_t = 1024)]
    pub max_upload_mb: u64,
    /// HTTP worker threads (default: one per core).
    #[arg(long, env = "LORAPLEX_HTTP_WORKERS")]
    pub http_workers: Option<usize>,
    /// On SIGINT (Ctrl-C) or SIGTERM, how long requests in flight may take to finish, in
    /// seconds; a second signal stops the server at once.
    #[arg(long, env = "LORAPLEX_SHUTDOWN_TIMEOUT", default_value_t = 30)]
    pub shutdown_timeout: u64,
    /// Admission: sequences (prompts times samples) queued or running on the whole server;
    /// past it, 503 (or 429 for a tenant holding more than its share).
    #[arg(long, env = "LORAPLEX_MAX_PENDING", default_value_t = 4096)]
    pub max_pending: u32,
    /// Admission: sequences queued or running for one tenant; past it, 429.
    #[arg(long, env = "LORAPLEX_MAX_PENDING_PER_TENANT", default_value_t = 1024)]
    pub max_pending_per_tenant: u32,
    /// Threads for tokenizing, chat templates, adapter validation and file I/O (default: one
    /// per core), and the most jobs that may wait for one before requests get 503.
    #[arg(long, env = "LORAPLEX_BLOCKING_THREADS")]
    pub blocking_threads: Option<usize>,
    #[arg(long, env = "LORAPLEX_BLOCKING_QUEUE", default_value_t = 1024)]
    pub blocking_queue: usize,
    /// A request body that sends nothing for this many seconds is cut with 408.
    #[arg(long, env = "LORAPLEX_BODY_TIMEOUT", default_value_t = 30)]
    pub body_timeout: u64,
    /// Live keys a tenant may hold when it mints its own (`POST /v1/keys`); keys the operator
    /// creates for it are not refused by this cap, but count toward it.
    #[arg(long, env = "LORAPLEX_MAX_KEYS_PER_TENANT", default_value_t = 10, value_parser = clap::value_parser!(u32).range(1..=10_000))]
    pub max_keys_per_tenant: u32,
    /// Bytes a second a request body must keep up, on average, once its first
    /// `--body-timeout` seconds have passed (each second past them is earned by this many
    /// bytes); a body that falls behind is cut with 408.
    #[arg(long, env = "LORAPLEX_BODY_MIN_RATE", default_value_t = 1024, value_parser = clap::value_parser!(u64).range(1..))]
    pub body_min_rate: u64,
    /// An interactive request still running after this many milliseconds has its ledger row
    /// opened (`running`, behind its tokens), so that a crash leaves an uncharged `interrupted`
    /// row for it; one that ends sooner is written once, when it ends. 0: every request's row
    /// is opened, durably, before it is queued (a database round trip before each request).
    #[arg(long, env = "LORAPLEX_OPEN_ROW_AFTER_MS", default_value_t = 1000, value_parser = clap::value_parser!(u64).range(0..=3_600_000))]
    pub open_row_after_ms: u64,
    /// While ledger rows arrive back to back (the last commit ended less than this long ago),
    /// the ledger's writer gathers rows this long before committing them together: fewer
    /// commits (each a write to the database's log) for at most this much more wait at a
    /// request's end. 0: commit whatever is waiting at once.
    #[arg(long, env = "LORAPLEX_LEDGER_GATHER_MS", default_value_t = 2, value_parser = clap::value_parser!(u64).range(0..=1000))]
    pub ledger_gather_ms: u64,
    /// Percent of each pool that adapter loads (pins) may take together; the rest stays for
    /// requests, and a request that could need more than the rest is refused when it arrives.
    #[arg(long, env = "LORAPLEX_MAX_PINNED_PERCENT", default_value_t = 25, value_parser = clap::value_parser!(u32).range(0..=90))]
    pub max_pinned_percent: u32,
    /// Uploads one key may run at once.
    #[arg(long, env = "LORAPLEX_MAX_UPLOADS_PER_KEY", default_value_t = 2)]
    pub max_uploads_per_key: u32,
    /// Percent of each pool a tenant may pin with adapter loads, unless its own
    /// `max_pinned_pages` limit says otherwise.
    #[arg(long, env = "LORAPLEX_TENANT_PINNED_PERCENT", default_value_t = 10, value_parser = clap::value_parser!(u32).range(0..=100))]
    pub tenant_pinned_percent: u32,
    #[command(flatten)]
    pub cluster: ClusterArgs,
    #[command(flatten)]
    pub batch: BatchArgs,
    #[command(flatten)]
    pub engine: EngineArgs,
}

/// Running several replicas on one PostgreSQL database.
#[derive(Debug, Clone, Args)]
pub struct ClusterArgs {
    /// Where adapter files live: s3://bucket/prefix (endpoint, region and credentials from the
    /// usual AWS_* variables; AWS_ALLOW_HTTP=true for a plain-HTTP endpoint) or file:///path (a
    /// filesystem every replica mounts); each replica keeps copies under its data directory.
    /// Default: the data directory itself (one server).
    #[arg(long, env = "LORAPLEX_ADAPTER_STORE")]
    pub adapter_store: Option<String>,
    /// Also serve /metrics without a key on this port (for scrapers inside the cluster, such as
    /// an inference gateway's endpoint picker), with /health.
    #[arg(long, env = "LORAPLEX_METRICS_PORT")]
    pub metrics_port: Option<u16>,
    /// How often to look for adapters deleted through other replicas, in milliseconds.
    #[arg(long, env = "LORAPLEX_CLUSTER_SYNC_MS", default_value_t = 1000, value_parser = clap::value_parser!(u64).range(10..=3_600_000))]
    pub cluster_sync_ms: u64,
}

/// The Batch API's bounds.
#[derive(Debug, Clone, Args)]
pub struct BatchArgs {
    /// Largest batch input file an upload may send, in MiB.
    #[arg(long, env = "LORAPLEX_MAX_FILE_MB", default_value_t = 200)]
    pub max_file_mb: u64,
    /// Most bytes one tenant's files (inputs and outputs) may hold together, in MiB.
    #[arg(long, env = "LORAPLEX_MAX_TENANT_FILES_MB", default_value_t = 2048)]
    pub max_tenant_files_mb: u64,
    /// Batches one tenant may have running at once.
    #[arg(long, env = "LORAPLEX_MAX_ACTIVE_BATCHES", default_value_t = 16)]
    pub max_active_batches: u32,
    /// Lines of batches in flight on the server at once (queued or running in the batch class).
    #[arg(long, env = "LORAPLEX_BATCH_CONCURRENCY", default_value_t = 32)]
    pub batch_concurrency: u32,
}

impl BatchArgs {
    pub fn settings(&self) -> crate::api::BatchSettings {
        crate::api::BatchSettings {
            max_file_bytes: self.max_file_mb.saturating_mul(1 << 20),
            max_tenant_file_bytes: self.max_tenant_files_mb.saturating_mul(1 << 20),
            max_active: self.max_active_batches.max(1),
            concurrency: self.batch_concurrency.max(1),
        }
    }
}

/// Where the model runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Device {
    /// CUDA when it is usable here, else the CPU.
    Auto,
    Cpu,
    /// CUDA devices: one given ordinal, or the first ones (one per worker).
    Cuda(Option<usize>),
}

impl std::str::FromStr for Device {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "auto" => Ok(Device::Auto),
            "cpu" => Ok(Device::Cpu),
            "cuda" => Ok(Device::Cuda(None)),
            _ => match s.strip_prefix("cuda:").map(str::parse::<usize>) {
                Some(Ok(n)) => Ok(Device::Cuda(Some(n))),
                _ => Err(format!("`{s}` is not a device: use auto, cpu, cuda or cuda:N")),
            },
        }
    }
}

impl std::fmt::Display for Device {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Device::Auto => f.write_str("auto"),
            Device::Cpu => f.write_str("cpu"),
            Device::Cuda(None) => f.write_str("cuda"),
            Device::Cuda(Some(n)) => write!(f, "cuda:{n}"),
        }
    }
}

/// The devices a run uses once `--device` is resolved against the machine.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Resolved {
    Cpu,
    /// One CUDA ordinal per worker.
    Cuda(Vec<usize>),
}

impl Device {
    /// Resolves against what [`loraplex_kernels::cuda::probe`] found (the device count, or why
    /// CUDA is unusable). `auto` falls back to the CPU; asking for CUDA where there is none, or
    /// for more devices than exist, is an error that says why.
    pub fn resolve(self, workers: usize, cuda: Result<usize, String>) -> Result<Resolved, String> {
        let ordinals = |first: usize, count: usize| -> Result<Vec<usize>, String> {
            let want: Vec<usize> = (first..first + workers).collect();
            match want.last() {
                Some(&last) if last >= count => {
                    Err(format!("--device {self} with {workers} worker(s) needs cuda:{last}, but this machine has {count} CUDA device(s)"))
                }
                _ => Ok(want),
            }
        };
        match (self, cuda) {
            (Device::Cpu, _) => Ok(Resolved::Cpu),
            (Device::Auto, Err(_)) => Ok(Resolved::Cpu),
            (Device::Cuda(_), Err(why)) => Err(format!("--device {self}: CUDA is not usable on this machine: {why}")),
            (Device::Auto | Device::Cuda(None), Ok(count)) => Ok(Resolved::Cuda(ordinals(0, count)?)),
            (Device::Cuda(Some(n)), Ok(count)) => {
                if workers != 1 {
                    return Err(format!("--device {self} names one GPU; use --workers 1, or --device cuda for one worker per GPU"));
                }
                Ok(Resolved::Cuda(ordinals(n, count)?))
            }
        }
    }
}

#[cfg(test)]
mod device_tests {
    use super::*;

    #[test]
    fn devices_parse_and_print() {
        for s in ["auto", "cpu", "cuda", "cuda:0", "cuda:3"] {
            assert_eq!(s.parse::<Device>().unwrap().to_string(), s);
        }
        for bad in ["gpu", "cuda:", "cuda:x", "cuda:-1", "CPU"] {
            assert!(bad.parse::<Device>().is_err(), "{bad}");
        }
    }

    #[test]
    fn auto_falls_back_to_the_cpu_and_cuda_without_cuda_is_an_error() {
        let none = || Err("the CUDA driver library (libcuda) cannot be loaded".to_string());
        assert_eq!(Device::Auto.resolve(1, none()), Ok(Resolved::Cpu));
        let err = Device::Cuda(Some(0)).resolve(1, none()).unwrap_err();
        assert!(err.contains("--device cuda:0") && err.contains("libcuda"), "{err}");
        assert!(Device::Cuda(None).resolve(1, none()).is_err());
        assert_eq!(Device::Cpu.resolve(4, none()), Ok(Resolved::Cpu));
    }

    #[test]
    fn cuda_devices_are_one_per_worker() {
        assert_eq!(Device::Auto.resolve(1, Ok(8)), Ok(Resolved::Cuda(vec![0])));
        assert!(Device::Auto.resolve(4, Ok(2)).unwrap_err().contains("needs cuda:3"));
        assert_eq!(Device::Cuda(None).resolve(2, Ok(2)), Ok(Resolved::Cuda(vec![0, 1])));
        assert!(Device::Cuda(None).resolve(3, Ok(2)).unwrap_err().contains("needs cuda:2"));
        assert_eq!(Device::Cuda(Some(1)).resolve(1, Ok(2)), Ok(Resolved::Cuda(vec![1])));
        assert!(Device::Cuda(Some(2)).resolve(1, Ok(2)).is_err());
        assert!(Device::Cuda(Some(0)).resolve(2, Ok(2)).is_err());
    }
}

#[derive(Debug, Subcommand)]
pub enum BenchCommand {
    /// Decode and prefill throughput of the base model, with MFU and MBU.
    Engine(BenchEngineArgs),
    /// Batched multi-adapter decode against the base model and one adapter at a time, and
    /// adapter residency times.
    Lora(BenchLoraArgs),
    /// The serving runtime: tenant fairness, prefix caching, adapter churn, preemption.
    Runtime(BenchRuntimeArgs),
    /// S-LoRA's workload: Poisson arrivals over 5 to 1,000 adapters of mixed ranks, the
    /// throughput of the serving runtime, and of transformers + PEFT on the same trace.
    Slora(BenchSloraArgs),
    /// The CUDA kernels (needs a GPU): SGMV/BGMV and paged attention against the copy bandwidth
    /// and against PyTorch baselines.
    Kernels(BenchKernelsArgs),
    /// The HTTP server under an abusive tenant: a steady tenant's latency alone, then while
    /// another sends each abusive pattern at its limits.
    #[command(name = "noisy-neighbor")]
    NoisyNeighbor(BenchNoisyArgs),
    /// What sharing state costs: tiny requests against one server on SQLite, then against
    /// replicas sharing one PostgreSQL database (their limits shared through it).
    Cluster(BenchClusterArgs),
    /// Decode throughput with every row of the batch following a JSON schema, against the same
    /// batch unconstrained, and the grammar masks' time per step.
    Structured(BenchStructuredArgs),
}

#[derive(Debug, Clone, Args)]
pub struct BenchStructuredArgs {
    /// Synthesized model size to measure (ignored with --model).
    #[arg(long, value_enum, default_value_t = Preset::Bench)]
    pub preset: Preset,
    /// Element type the synthesized model is saved in.
    #[arg(long, value_enum, default_value_t = FileDType::F32)]
    pub model_dtype: FileDType,
    /// What activations enter the matmuls of bf16 weights as (see `serve --matmul-dtype`).
    #[arg(long, value_enum, default_value_t = MatmulDType::F32)]
    pub matmul_dtype: MatmulDType,
    /// Measure this model (a directory, a .gguf file or a hub id) instead of a synthesized one.
    #[arg(long)]
    pub model: Option<ModelSpec>,
    #[command(flatten)]
    pub hub: HubArgs,
    /// Rows of the decode batch.
    #[arg(long, default_value_t = 32)]
    pub batch: usize,
    /// Prompt length of each row.
    #[arg(long, default_value_t = 64)]
    pub context: usize,
    /// Decode steps timed per round and mode.
    #[arg(long, default_value_t = 32)]
    pub steps: usize,
    /// Rounds of the two modes, alternating.
    #[arg(long, default_value_t = 3)]
    pub rounds: usize,
    #[arg(long, env = "LORAPLEX_THREADS")]
    pub threads: Option<usize>,
    /// Where the JSON report goes.
    #[arg(long, default_value = "bench-structured.json")]
    pub out: PathBuf,
}

#[derive(Debug, Clone, Args)]
pub struct BenchKernelsArgs {
    /// The GPU to measure: cuda or cuda:N.
    #[arg(long, default_value = "cuda")]
    pub device: Device,
    /// A Python with PyTorch to run the baselines with (they are skipped without one).
    #[arg(long)]
    pub torch_python: Option<String>,
    /// Seed of the random inputs.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Write the rows as JSON here too.
    #[arg(long)]
    pub out: Option<PathBuf>,
}

#[derive(Debug, Clone, Args)]
pub struct BenchRuntimeArgs {
    /// Synthesized model size to measure (ignored with --model).
    #[arg(long, value_enum, default_value_t = Preset::Bench)]
    pub preset: Preset,
    /// Element type the synthesized model is saved in (bf16 weights stay bf16 in memory on the
    /// CPU, half the bytes read per token).
    #[arg(long, value_enum, default_value_t = FileDType::F32)]
    pub model_dtype: FileDType,
    /// What activations enter the matmuls of bf16 weights as (see `serve --matmul-dtype`).
    #[arg(long, value_enum, default_value_t = MatmulDType::F32)]
    pub matmul_dtype: MatmulDType,
    /// Measure this model (a directory, a .gguf file or a hub id) instead of a synthesized one.
    #[arg(long)]
    pub model: Option<ModelSpec>,
    #[command(flatten)]
    pub hub: HubArgs,
    /// Scenarios to run: fairness, prefix, churn, preemption or all.
    #[arg(long, value_delimiter = ',', default_value = "all")]
    pub scenarios: Vec<String>,
    /// Prompt tokens of each request (fairness, churn, preemption).
    #[arg(long, default_value_t = 64, value_parser = positive())]
    pub prompt: usize,
    /// Tokens generated per request (twice this in the preemption scenario).
    #[arg(long, default_value_t = 32, value_parser = positive())]
    pub max_new_tokens: usize,
    /// Most tokens per step.
    #[arg(long, default_value_t = 512, value_parser = positive())]
    pub max_batch_tokens: usize,
    /// Most sequences running at once.
    #[arg(long, default_value_t = 32, value_parser = positive())]
    pub max_running: usize,
    /// Page pool for the fairness and prefix scenarios, in MiB (churn and preemption size
    /// their own).
    #[arg(long, default_value_t = 1024, value_parser = positive())]
    pub pool_mb: usize,
    /// Fairness: tenant B's requests, and its offered load as a fraction of the capacity the
    /// run measures first (fairness-shaped requests, the server kept full).
    #[arg(long, default_value_t = 100, value_parser = positive())]
    pub b_requests: usize,
    #[arg(long, default_value_t = 0.15)]
    pub b_fraction: f64,
    /// Fairness: tenant A sends this many requests for each of B's.
    #[arg(long, default_value_t = 25, value_parser = positive())]
    pub a_factor: usize,
    /// Fairness: prompt tokens per request, and the server's limits (a latency-oriented
    /// setting: a step's length bounds every newcomer's wait).
    #[arg(long, default_value_t = 16, value_parser = positive())]
    pub fairness_prompt: usize,
    #[arg(long, default_value_t = 8, value_parser = positive())]
    pub fairness_max_running: usize,
    #[arg(long, default_value_t = 24, value_parser = positive())]
    pub fairness_batch_tokens: usize,
    /// Prefix: tokens of the shared system prompt.
    #[arg(long, default_value_t = 1024)]
    pub system_prompt: usize,
    /// Churn: adapters, their popularity exponent, and how many fit in the pool.
    #[arg(long, default_value_t = 1000, value_parser = positive())]
    pub adapters: usize,
    #[arg(long, default_value_t = 1.0)]
    pub zipf: f64,
    #[arg(long, default_value_t = 100, value_parser = positive())]
    pub adapter_room: usize,
    /// Churn: rank of every adapter (on q and v).
    #[arg(long, default_value_t = 8, value_parser = positive())]
    pub rank: usize,
    /// Churn: requests in the run.
    #[arg(long, default_value_t = 512, value_parser = positive())]
    pub churn_requests: usize,
    /// Where the JSON report goes.
    #[arg(long, default_value = "bench-runtime.json")]
    pub out: PathBuf,
    #[arg(long, env = "LORAPLEX_THREADS")]
    pub threads: Option<usize>,
}

#[derive(Debug, Clone, Args)]
pub struct BenchClusterArgs {
    /// A PostgreSQL server to create the replicas' database on (postgres://user@host:port/db).
    #[arg(long, env = "LORAPLEX_BENCH_POSTGRES")]
    pub postgres: Option<String>,
    /// Replicas sharing the PostgreSQL database (on 127.0.0.1, .2, ...).
    #[arg(long, default_value_t = 3, value_parser = positive())]
    pub replicas: usize,
    /// Clients sending requests back to back.
    #[arg(long, default_value_t = 200, value_parser = positive())]
    pub clients: usize,
    /// Tenants the clients are spread over.
    #[arg(long, default_value_t = 20, value_parser = positive())]
    pub tenants: usize,
    /// Tokens each request generates.
    #[arg(long, default_value_t = 1)]
    pub max_tokens: u32,
    /// Compute and HTTP threads of each replica (`--threads`, `--http-workers`); default: the
    /// machine's cores divided among the replicas, at least one, as pods with CPU limits would
    /// have. The one SQLite server has all the cores.
    #[arg(long)]
    pub replica_threads: Option<usize>,
    /// Seconds each phase is measured (after a warm-up of a fifth of it).
    #[arg(long, default_value_t = 20.0)]
    pub seconds: f64,
    /// The paced phases' offered loads, as fractions of the smaller capacity the run measures.
    #[arg(long, value_delimiter = ',', default_value = "0.25,0.5")]
    pub loads: Vec<f64>,
    /// Times each offered load runs its phases (SQLite, PostgreSQL, PostgreSQL without limits,
    /// in turn); the overhead reported is the median round's, so that one stall of the
    /// machine's disk in one phase does not decide it (every round's is reported too).
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u32).range(1..=20))]
    pub rounds: u32,
    #[arg(long, default_value = "bench-cluster.json")]
    pub out: PathBuf,
}

#[derive(Debug, Clone, Args)]
pub struct BenchNoisyArgs {
    /// Synthesized model size to serve (ignored with --model).
    #[arg(long, value_enum, default_value_t = Preset::Bench)]
    pub preset: Preset,
    /// Element type the synthesized model is saved in (bf16 weights stay bf16 in memory on the
    /// CPU, half the bytes read per token).
    #[arg(long, value_enum, default_value_t = FileDType::F32)]
    pub model_dtype: FileDType,
    /// Serve this model (a directory, a .gguf file or a hub id) instead of a synthesized one.
    #[arg(long)]
    pub model: Option<ModelSpec>,
    #[command(flatten)]
    pub hub: HubArgs,
    /// Abusive patterns to run, in order: plain, huge-prompts, stop-lists, adapter-configs,
    /// pin-storms, disconnects, stalled-bodies, batch, or all.
    #[arg(long, value_delimiter = ',', default_value = "all")]
    pub patterns: Vec<String>,
    /// Tenant B's offered load, as a fraction of the capacity the run measures.
    #[arg(long, default_value_t = 0.15)]
    pub b_fraction: f64,
    /// Tenant B's requests per phase (p99 by nearest rank: of 200 the third largest, of 100 the
    /// second, which one stray request moves).
    #[arg(long, default_value_t = 200)]
    pub b_requests: usize,
    /// How B sends its prompt: `text` (tokenized by the server) or `ids` (token ids, which the
    /// server does not tokenize).
    #[arg(long, default_value = "text")]
    pub b_prompt: String,
    /// Tokens each of B's requests generates (streamed, end-of-sequence ignored).
    #[arg(long, default_value_t = 16)]
    pub max_tokens: u32,
    /// How long the capacity is measured (after a warm-up of a fifth of it), in seconds.
    #[arg(long, default_value_t = 15.0)]
    pub capacity_seconds: f64,
    /// Tenant A's requests per minute and tokens per minute allow this fraction of the
    /// measured capacity.
    #[arg(long, default_value_t = 0.5)]
    pub a_share: f64,
    /// Tenant A's `max_concurrent` limit, and how many connections it drives at once.
    #[arg(long, default_value_t = 8)]
    pub a_concurrent: u32,
    /// After a refusal, tenant A waits this long before its next request (it ignores
    /// Retry-After).
    #[arg(long, default_value_t = 20)]
    pub a_retry_ms: u64,
    /// How long A abuses before B's first request of a phase, in milliseconds.
    #[arg(long, default_value_t = 2000)]
    pub a_warmup_ms: u64,
    /// Stalled-bodies: connections A holds open with part of a body sent.
    #[arg(long, default_value_t = 1000)]
    pub stalled: usize,
    /// Pin-storms: adapters A uploads and then loads and unloads in a loop (rank 16, all
    /// seven projections).
    #[arg(long, default_value_t = 16)]
    pub pin_adapters: usize,
    /// Batch: lines of A's batch (long generations; more than the phase can run).
    #[arg(long, default_value_t = 4000)]
    pub batch_lines: usize,
    /// Server limits the run relies on (each passed to `serve` explicitly).
    #[arg(long, default_value_t = 16)]
    pub max_running: usize,
    #[arg(long, default_value_t = 64)]
    pub max_batch_tokens: usize,
    /// More `serve` flags, as `--flag=value`; one given here replaces the bench's own value.
    #[arg(long = "serve-arg", allow_hyphen_values = true)]
    pub serve_args: Vec<String>,
    /// One tenant B for the whole run, instead of a new one per phase: B's service counter
    /// (and so its place in the fair order) then carries over from phase to phase.
    #[arg(long)]
    pub shared_b: bool,
    /// Measure B alone again after the last pattern, as a check of the machine's drift.
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    pub repeat_alone: bool,
    /// Where the JSON report goes.
    #[arg(long, default_value = "bench-noisy.json")]
    pub out: PathBuf,
}

#[derive(Debug, Clone, Args)]
pub struct BenchLoraArgs {
    /// Synthesized model size to measure (ignored with --model).
    #[arg(long, value_enum, default_value_t = Preset::Bench)]
    pub preset: Preset,
    /// Element type the synthesized model is saved in (bf16 weights stay bf16 in memory on the
    /// CPU, half the bytes read per token).
    #[arg(long, value_enum, default_value_t = FileDType::F32)]
    pub model_dtype: FileDType,
    /// What activations enter the matmuls of bf16 weights as (see `serve --matmul-dtype`).
    #[arg(long, value_enum, default_value_t = MatmulDType::F32)]
    pub matmul_dtype: MatmulDType,
    /// Measure this model (a directory, a .gguf file or a hub id) instead of a synthesized one (adapters are synthesized for it).
    #[arg(long)]
    pub model: Option<ModelSpec>,
    #[command(flatten)]
    pub hub: HubArgs,
    /// Key/value heads of the synthesized model instead of the preset's (see `synth --kv-heads`).
    #[arg(long)]
    pub kv_heads: Option<usize>,
    /// The device to measure: cpu, or cuda / cuda:N.
    #[arg(long, default_value = "cpu")]
    pub device: Device,
    /// Decode batch size; also the number of distinct adapters.
    #[arg(long, default_value_t = 32, value_parser = positive())]
    pub batch: usize,
    /// Rank of every adapter (all seven modules targeted).
    #[arg(long, default_value_t = 16, value_parser = positive())]
    pub rank: usize,
    /// Element type the adapters are saved in (bf16 rows are stored as bf16 in the pool; the
    /// distinct-adapter scenario is also run with f32 adapters for comparison).
    #[arg(long, value_enum, default_value_t = FileDType::Bf16)]
    pub adapter_dtype: FileDType,
    /// Prompt length of each sequence.
    #[arg(long, default_value_t = 64, value_parser = positive())]
    pub context: usize,
    /// Sets how long the requests run: each asks for `2 * steps + batch + 3` tokens, and every
    /// decode step while all of a batch's rows are still decoding is timed (at least `steps`,
    /// per adapter group in the naive scenario).
    #[arg(long, default_value_t = 8, value_parser = positive())]
    pub steps: usize,
    /// Rounds of (a), (b), (c) and (e), taken in turn; each reports its median round, so that a
    /// machine whose speed drifts over seconds moves them all alike.
    #[arg(long, default_value_t = 3, value_parser = positive())]
    pub rounds: usize,
    /// Page pool size, in MiB.
    #[arg(long, default_value_t = 1024, value_parser = positive())]
    pub pool_mb: usize,
    /// Where the JSON report goes.
    #[arg(long, default_value = "bench-lora.json")]
    pub out: PathBuf,
    #[arg(long, env = "LORAPLEX_THREADS")]
    pub threads: Option<usize>,
}

#[derive(Debug, Clone, Args)]
pub struct BenchSloraArgs {
    /// Synthesized model size to measure (ignored with --model).
    #[arg(long, value_enum, default_value_t = Preset::Bench)]
    pub preset: Preset,
    /// Element type the synthesized model is saved in.
    #[arg(long, value_enum, default_value_t = FileDType::F32)]
    pub model_dtype: FileDType,
    /// What the matmuls multiply in (see `serve --matmul-dtype`); on CUDA, bf16 runs the model
    /// and its KV pages in bf16.
    #[arg(long, value_enum, default_value_t = MatmulDType::F32)]
    pub matmul_dtype: MatmulDType,
    /// Measure this model (a directory, a .gguf file or a hub id) instead of a synthesized one (adapters are synthesized for it).
    #[arg(long)]
    pub model: Option<ModelSpec>,
    #[command(flatten)]
    pub hub: HubArgs,
    /// Key/value heads of the synthesized model instead of the preset's.
    #[arg(long)]
    pub kv_heads: Option<usize>,
    /// The device to measure: cpu, or cuda / cuda:N.
    #[arg(long, default_value = "cpu")]
    pub device: Device,
    /// Adapter counts, one phase each.
    #[arg(long, value_delimiter = ',', default_value = "5,100,1000")]
    pub adapters: Vec<usize>,
    /// Ranks, cycled over the adapters (q, k, v and o projections targeted, bf16 rows).
    #[arg(long, value_delimiter = ',', default_value = "8,16,32,64")]
    pub ranks: Vec<usize>,
    /// Most adapter files synthesized: larger counts serve each file under several names, each
    /// a separate adapter to the server (its own loads, host copy and pool pages).
    #[arg(long, default_value_t = 100)]
    pub adapter_files: usize,
    /// Zipf exponent of adapter popularity (0: uniform).
    #[arg(long, default_value_t = 1.0)]
    pub alpha: f64,
    /// Prompt lengths, drawn uniformly from this range.
    #[arg(long, value_delimiter = ',', default_values_t = [8, 512])]
    pub input_len: Vec<usize>,
    /// Output lengths, drawn uniformly from this range (end-of-sequence ignored).
    #[arg(long, value_delimiter = ',', default_values_t = [8, 512])]
    pub output_len: Vec<usize>,
    /// Seconds of arrivals per phase; throughput counts what completes within them.
    #[arg(long, default_value_t = 30.0)]
    pub duration: f64,
    /// Offered requests per second; without it, `--load` times the capacity measured first.
    #[arg(long)]
    pub rate: Option<f64>,
    /// Offered load relative to the capacity measured first (above 1: saturated).
    #[arg(long, default_value_t = 2.0)]
    pub load: f64,
    /// Page pool size, in MiB.
    #[arg(long, default_value_t = 1024)]
    pub pool_mb: usize,
    /// Most sequences in one batch.
    #[arg(long, default_value_t = 256)]
    pub max_running: usize,
    /// Threads reading and packing adapters.
    #[arg(long, default_value_t = 4)]
    pub adapter_loaders: usize,
    /// A Python with torch, transformers and peft: runs the same traces through
    /// transformers + PEFT on the same device (S-LoRA's baseline), for the counts up to
    /// `--peft-max-adapters`.
    #[arg(long)]
    pub peft_python: Option<PathBuf>,
    #[arg(long, default_value_t = 100)]
    pub peft_max_adapters: usize,
    /// Most same-adapter requests the PEFT baseline batches together.
    #[arg(long, default_value_t = 16)]
    pub peft_max_batch: usize,
    /// Where the JSON report goes.
    #[arg(long, default_value = "bench-slora.json")]
    pub out: PathBuf,
    #[arg(long, env = "LORAPLEX_THREADS")]
    pub threads: Option<usize>,
}

#[derive(Debug, Clone, Args)]
pub struct BenchEngineArgs {
    /// Synthesized model size to measure (ignored with --model).
    #[arg(long, value_enum, default_value_t = Preset::Bench)]
    pub preset: Preset,
    /// Element type the synthesized model is saved in (bf16 weights stay bf16 in memory on the
    /// CPU, half the bytes read per token).
    #[arg(long, value_enum, default_value_t = FileDType::F32)]
    pub model_dtype: FileDType,
    /// What activations enter the matmuls of bf16 weights as (see `serve --matmul-dtype`).
    #[arg(long, value_enum, default_value_t = MatmulDType::F32)]
    pub matmul_dtype: MatmulDType,
    /// Measure this model (a directory, a .gguf file or a hub id) instead of a synthesized one.
    #[arg(long)]
    pub model: Option<ModelSpec>,
    #[command(flatten)]
    pub hub: HubArgs,
    /// Key/value heads of the synthesized model instead of the preset's (see `synth --kv-heads`).
    #[arg(long)]
    pub kv_heads: Option<usize>,
    /// Element type of the KV pool (see `serve --kv-dtype`).
    #[arg(long, value_enum, default_value_t = KvDType::F32)]
    pub kv_dtype: KvDType,
    /// The device to measure: cpu, or cuda / cuda:N (the CUDA backend computes in f32, or bf16 with --matmul-dtype bf16).
    #[arg(long, default_value = "cpu")]
    pub device: Device,
    /// Decode batch sizes to measure.
    #[arg(long, value_delimiter = ',', default_value = "1,16,64", value_parser = positive())]
    pub batches: Vec<usize>,
    /// Context length of each sequence when decoding is measured.
    #[arg(long, default_value_t = 128, value_parser = positive())]
    pub context: usize,
    /// Decode steps timed per batch size.
    #[arg(long, default_value_t = 16, value_parser = positive())]
    pub steps: usize,
    /// Prompt tokens per prefill measurement (0: no prefill measurement).
    #[arg(long, default_value_t = 512)]
    pub prefill_tokens: usize,
    /// CUDA: decode attention a block per query head, not through the grouped kernels (a block
    /// per KV head for the query heads that share it), which are the default where the model's
    /// grouping has one.
    #[arg(long)]
    pub no_grouped_decode: bool,
    /// Where the JSON report goes.
    #[arg(long, default_value = "bench-engine.json")]
    pub out: PathBuf,
    #[arg(long, env = "LORAPLEX_THREADS")]
    pub threads: Option<usize>,
}

/// Sizes rayon's global pool (`--threads`); `None` keeps one thread per core.
pub fn init_threads(threads: Option<usize>) -> anyhow::Result<()> {
    if let Some(n) = threads {
        if n == 0 {
            anyhow::bail!("--threads must be at least 1");
        }
        rayon::ThreadPoolBuilder::new().num_threads(n).build_global()?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::*;

    #[derive(Parser)]
    struct Flags {
        #[command(flatten)]
        engine: EngineArgs,
    }

    fn dtypes(flags: &[&str], cuda: bool) -> Result<(MatmulDType, KvDType), String> {
        Flags::try_parse_from(std::iter::once("t").chain(flags.iter().copied())).unwrap().engine.dtypes(cuda)
    }

    /// The CPU stays exact by default; CUDA runs the bf16 model unless told otherwise, and one
    /// flag there picks its partner; a pair CUDA cannot run is refused with what to add.
    #[test]
    fn each_device_has_its_default_types_and_cuda_pairs_them() {
        use KvDType as K;
        use MatmulDType as M;
        assert_eq!(dtypes(&[], false), Ok((M::F32, K::F32)));
        assert_eq!(dtypes(&["--kv-dtype", "bf16"], false), Ok((M::F32, K::Bf16)));
        assert_eq!(dtypes(&["--matmul-dtype", "bf16"], false), Ok((M::Bf16, K::F32)));
        assert_eq!(dtypes(&[], true), Ok((M::Bf16, K::Bf16)));
        assert_eq!(dtypes(&["--kv-dtype", "f32"], true), Ok((M::F32, K::F32)));
        assert_eq!(dtypes(&["--matmul-dtype", "f32"], true), Ok((M::F32, K::F32)));
        assert_eq!(dtypes(&["--matmul-dtype", "bf16", "--kv-dtype", "bf16"], true), Ok((M::Bf16, K::Bf16)));
        let err = dtypes(&["--matmul-dtype", "bf16", "--kv-dtype", "f32"], true).unwrap_err();
        assert!(err.contains("add --kv-dtype bf16"), "{err}");
    }

    #[derive(Parser)]
    struct BenchFlags {
        #[command(flatten)]
        bench: BenchEngineArgs,
    }

    /// `bench engine` refuses an empty batch, context or step count when it parses its flags,
    /// not after synthesizing and loading a model; no prefill tokens skips the prefill row.
    #[test]
    fn bench_engine_counts_are_checked_when_parsed() {
        let parse = |flags: &[&str]| BenchFlags::try_parse_from(std::iter::once("t").chain(flags.iter().copied())).map(|f| f.bench);
        for bad in [&["--batches", "1,0"][..], &["--context", "0"], &["--steps", "0"]] {
            let err = parse(bad).err().unwrap_or_else(|| panic!("{bad:?} parsed")).to_string();
            assert!(err.contains(bad[0]), "{bad:?}: {err}");
        }
        let ok = parse(&["--batches", "1,32", "--context", "1", "--steps", "1", "--prefill-tokens", "0"]).unwrap();
        assert_eq!((ok.batches, ok.context, ok.steps, ok.prefill_tokens), (vec![1, 32], 1, 1, 0));
    }

    #[derive(Parser)]
    struct RuntimeFlags {
        #[command(flatten)]
        bench: BenchRuntimeArgs,
    }

    #[derive(Parser)]
    struct ClusterFlags {
        #[command(flatten)]
        bench: BenchClusterArgs,
    }

    /// `bench runtime` and `bench cluster` refuse a count of zero where zero means nothing (no
    /// requests, no sequences, no replicas) when they parse their flags, not after a scenario or
    /// two have run; the shared system prompt may be empty.
    #[test]
    fn bench_runtime_and_cluster_counts_are_checked_when_parsed() {
        let runtime = |flags: &[&str]| RuntimeFlags::try_parse_from(std::iter::once("t").chain(flags.iter().copied())).map(|f| f.bench);
        let cluster = |flags: &[&str]| ClusterFlags::try_parse_from(std::iter::once("t").chain(flags.iter().copied())).map(|f| f.bench);
        for flag in ["--prompt", "--max-new-tokens", "--max-batch-tokens", "--max-running", "--pool-mb", "--b-requests", "--a-factor", "--fairness-prompt"] {
            let err = runtime(&[flag, "0"]).err().unwrap_or_else(|| panic!("{flag} 0 parsed")).to_string();
            assert!(err.contains(flag), "{flag}: {err}");
        }
        for flag in ["--fairness-max-running", "--fairness-batch-tokens", "--adapters", "--adapter-room", "--rank", "--churn-requests"] {
            assert!(runtime(&[flag, "0"]).is_err(), "{flag} 0 parsed");
        }
        assert_eq!(runtime(&["--system-prompt", "0", "--rank", "1"]).map(|a| (a.system_prompt, a.rank)).unwrap(), (0, 1));
        for flag in ["--replicas", "--clients", "--tenants"] {
            assert!(cluster(&[flag, "0"]).is_err(), "{flag} 0 parsed");
            assert!(cluster(&[flag, "1"]).is_ok(), "{flag} 1 refused");
        }
    }
}
