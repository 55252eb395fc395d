//! The adversarial suite: the real `loraplex serve` binary, driven over HTTP the way a hostile
//! tenant would, on SQLite and (when a server is available) PostgreSQL. Each module is a table
//! of cases; a run reports every case that broke.

mod auth;
mod batches;
mod bodies;
mod business;
mod chat;
mod common;
mod crash;
mod deep;
mod limits;
mod pace;
mod races;
mod restarts;
mod uploads;
