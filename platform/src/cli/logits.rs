//! `loraplex logits`: the logits of given token sequences, one decode forward per token after
//! the prompt's prefill (teacher forcing), as a JSON report. What a parity check against another
//! implementation compares: both read the same tokens, so their logits meet row by row even
//! where their argmaxes part (as bf16 rounding makes them do on near ties).

use std::path::PathBuf;
use std::sync::Arc;

use anyhow::{Context, bail, ensure};
use loraplex_adapters::LoraAdapter;
use loraplex_kernels::{Backend, Memory, cuda};
use serde::{Deserialize, Serialize};

use crate::config::{Device, LogitsArgs, check_cuda_dtypes};
use crate::engine::scoring;
use crate::model::{self, Model};

/// One line of `--cases`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Case {
    pub name: String,
    pub prompt_ids: Vec<u32>,
    /// The tokens fed after the prompt, one per decode forward.
    #[serde(default)]
    pub follow: Vec<u32>,
    /// Rows of logits to return: the last prompt position's, then one per fed token
    /// (default: `follow`'s length, at least 1).
    #[serde(default)]
    pub rows: Option<usize>,
    /// A PEFT adapter directory applied to every token.
    #[serde(default)]
    pub adapter: Option<PathBuf>,
}

/// One case's result.
#[derive(Debug, Serialize)]
pub struct CaseLogits {
    pub name: String,
    /// `[rows][vocab]`: row 0 is the last prompt position, row `k` follows `follow[k - 1]`.
    pub logits: Vec<Vec<f32>>,
}

#[derive(Debug, Serialize)]
struct Report {
    device: String,
    compute_dtype: String,
    kv_dtype: String,
    cases: Vec<CaseLogits>,
}

/// Most rows one case may ask for.
const MAX_ROWS: usize = 4096;

pub fn run(args: &LogitsArgs) -> anyhow::Result<()> {
    let text = std::fs::read_to_string(&args.cases).with_context(|| format!("reading {}", args.cases.display()))?;
    let mut cases = Vec::new();
    for (i, line) in text.lines().enumerate().filter(|(_, l)| !l.trim().is_empty()) {
        let case: Case = serde_json::from_str(line).with_context(|| format!("{} line {}", args.cases.display(), i + 1))?;
        ensure!(!case.prompt_ids.is_empty(), "case {}: prompt_ids is empty", case.name);
        ensure!(case.rows.unwrap_or(1) <= MAX_ROWS, "case {}: at most {MAX_ROWS} rows", case.name);
        cases.push(case);
    }
    let kv = args.kv_dtype.row_dtype();
    let model_path = args.hub.resolve(&args.model)?.files.path().to_path_buf();
    let (device, results) = match args.device {
        Device::Cpu => {
            let model = model::load(Arc::new(args.matmul_dtype.cpu_backend()), &model_path)?;
            ("cpu".to_string(), run_cases(&model, &cases, kv)?)
        }
        Device::Cuda(n) => {
            check_cuda_dtypes(args.matmul_dtype, args.kv_dtype).map_err(anyhow::Error::msg)?;
            cuda::probe().map_err(|why| anyhow::anyhow!("--device {} needs CUDA, which is not usable here: {why}", args.device))?;
            let backend = cuda::CudaBackend::open(n.unwrap_or(0), args.matmul_dtype.cuda_compute())?;
            let model = model::load(Arc::new(backend), &model_path)?;
            (model.backend().device_name(), run_cases(&model, &cases, kv)?)
        }
        Device::Auto => bail!("loraplex logits runs on one named device: use --device cpu, cuda or cuda:N"),
    };
    let report = Report { device, compute_dtype: format!("{:?}", args.matmul_dtype).to_lowercase(), kv_dtype: kv.dtype().to_string(), cases: results };
    std::fs::write(&args.out, serde_json::to_vec(&report)?).with_context(|| format!("writing {}", args.out.display()))?;
    println!("{} case(s) written to {}", report.cases.len(), args.out.display());
    Ok(())
}

/// The logits of every case on `model`.
pub fn run_cases<B: Backend>(model: &Model<B>, cases: &[Case], kv: loraplex_kernels::RowDType) -> anyhow::Result<Vec<CaseLogits>> {
    let mut out = Vec::with_capacity(cases.len());
    for case in cases {
        let adapter = match &case.adapter {
            Some(dir) => Some(
                LoraAdapter::load(dir, &model.base_shape(), &Default::default()).with_context(|| format!("case {}: adapter {}", case.name, dir.display()))?,
            ),
            None => None,
        };
        let rows = case.rows.unwrap_or(case.follow.len()).max(1);
        let logits =
            scoring::forced_logits(model, &case.prompt_ids, &case.follow, rows, 16, kv, adapter.as_ref()).with_context(|| format!("case {}", case.name))?;
        out.push(CaseLogits { name: case.name.clone(), logits });
    }
    Ok(out)
}
