//! The commands behind the `loraplex` binary.

pub mod generate;
pub mod logits;
pub mod serve;

use anyhow::Context;

/// `loraplex synth`: writes a random model, and its adapters when asked, and says what it wrote.
pub fn synth(args: &crate::config::SynthArgs) -> anyhow::Result<()> {
    use crate::synth::{AdapterSynthOptions, SynthOptions};

    let dims = args.preset.dims().with_kv_heads(args.kv_heads)?;
    let adapters = AdapterSynthOptions {
        out: args.adapters_out.clone().unwrap_or_else(|| args.out.join("adapters")),
        dims,
        count: args.adapters,
        ranks: args.ranks.clone(),
        targets: args.targets,
        seed: args.seed,
        dtype: args.adapter_dtype,
    };
    // Refuse bad adapter options before spending time on the model.
    crate::synth::check_adapter_options(&adapters).context("--adapters/--ranks/--targets")?;
    let summary = crate::synth::synthesize_model(&SynthOptions {
        out: args.out.clone(),
        preset: args.preset,
        seed: args.seed,
        dtype: args.dtype,
        kv_heads: args.kv_heads,
    })?;
    println!(
        "wrote a {} model ({:.1} M parameters, {:.1} MB) to {}",
        clap::ValueEnum::to_possible_value(&args.preset).map_or_else(|| format!("{:?}", args.preset), |v| v.get_name().to_string()),
        summary.parameters as f64 / 1e6,
        summary.bytes as f64 / 1e6,
        args.out.display()
    );
    if adapters.count > 0 {
        let dirs = crate::synth::synthesize_adapters(&adapters)?;
        let ranks: Vec<String> = args.ranks.iter().take(dirs.len()).map(ToString::to_string).collect();
        println!("wrote {} LoRA adapters (ranks {}, targets {}) to {}", dirs.len(), ranks.join(","), args.targets.name(), adapters.out.display());
    }
    Ok(())
}
