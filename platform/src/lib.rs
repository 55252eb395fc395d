//! loraplex: one base LLM, many LoRA adapters, many tenants.
//!
//! This crate holds the engine (model, memory, sampling) and the command-line front end.
#![forbid(unsafe_code)]

pub mod actors;
pub mod api;
pub mod bench;
pub mod cli;
pub mod config;
pub mod engine;
pub mod grammar;
pub mod memory;
pub mod model;
pub mod request;
pub mod runtime;
pub mod sampling;
pub mod scheduler;
pub mod store;
pub mod synth;
pub mod tokenizer;
