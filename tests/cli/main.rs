//! The `ray-xds` binary as a user runs it, and the documentation's reference tables
//! against the code.

#[path = "../support/mod.rs"]
mod support;

mod commands;
mod docs;
