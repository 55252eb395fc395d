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
        Command::Bench { which } => match which.as_ref() {
            BenchCommand::Engine(args) => loraplex::bench::engine::run(args),
            BenchCommand::Lora(args) => loraplex::bench::lora::run(args),
            BenchCommand::Slora(args) => loraplex::bench::slora::run(args),
            BenchCommand::Runtime(args) => loraplex::bench::runtime::run(args),
            BenchCommand::Kernels(args) => loraplex::bench::kernels::run(args),
            BenchCommand::NoisyNeighbor(args) => loraplex::bench::noisy::run(args),
            BenchCommand::Structured(args) => loraplex::bench::structured::run(args),
            BenchCommand::Cluster(args) => loraplex::bench::cluster::run(args),
        },
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}
