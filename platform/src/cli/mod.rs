//! The commands behind the `loraplex` binary.

pub mod generate;

/// Sizes rayon's global pool; `None` keeps one thread per core.
pub fn init_threads(threads: Option<usize>) -> anyhow::Result<()> {
    if let Some(n) = threads {
        if n == 0 {
            anyhow::bail!("--threads must be at least 1");
        }
        rayon::ThreadPoolBuilder::new().num_threads(n).build_global()?;
    }
    Ok(())
}

/// `loraplex synth`: writes a random model and says what it wrote.
pub fn synth(args: &crate::config::SynthArgs) -> anyhow::Result<()> {
    let summary = crate::synth::synthesize_model(&crate::synth::SynthOptions {
        out: args.out.clone(),
        preset: args.preset,
        seed: args.seed,
    })?;
    println!(
        "wrote a {:?} model ({:.1} M parameters, {:.1} MB) to {}",
        args.preset,
        summary.parameters as f64 / 1e6,
        summary.bytes as f64 / 1e6,
        args.out.display()
    );
    Ok(())
}
