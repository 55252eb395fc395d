//! loraplex: one base LLM, many LoRA adapters, many tenants.
//!
//! This crate holds the engine (model, memory, sampling) and the command-line front end.
#![forbid(unsafe_code)]

pub mod sampling;
pub mod synth;
