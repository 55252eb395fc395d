//! Benchmarks behind `loraplex bench`. Each prints a table, writes a JSON report, and compares
//! what it measured against limits measured on the same machine in the same run.

pub mod engine;
pub mod lora;
