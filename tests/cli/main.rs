//! The `ray-xds` binary as a user runs it, and the documentation's reference tables
//! against the code.

mod commands;
mod docs;
