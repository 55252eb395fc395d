#![forbid(unsafe_code)]

use std::process::ExitCode;

use clap::Parser;
use loraplex::cli;
use loraplex::config::{BenchCommand, Cli, Command};

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match &cli.command {
        Command::Generate(args) => cli::generate::run(args),
        Command::Serve(args) => cli::serve::run(args),
        Command::Synth(args) => cli::synth(args),
        Command::Logits(args) => cli::logits::run(args),
        Command::Bench { which: BenchCommand::Engine(args) } => loraplex::bench::engine::run(args),
        Command::Bench { which: BenchCommand::Lora(args) } => loraplex::bench::lora::run(args),
        Command::Bench { which: BenchCommand::Slora(args) } => loraplex::bench::slora::run(args),
        Command::Bench { which: BenchCommand::Runtime(args) } => loraplex::bench::runtime::run(args),
        Command::Bench { which: BenchCommand::Kernels(args) } => loraplex::bench::kernels::run(args),
        Command::Bench { which: BenchCommand::NoisyNeighbor(args) } => loraplex::bench::noisy::run(args),
        Command::Bench { which: BenchCommand::Structured(args) } => loraplex::bench::structured::run(args),
        Command::Bench { which: BenchCommand::Cluster(args) } => loraplex::bench::cluster::run(args),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}
