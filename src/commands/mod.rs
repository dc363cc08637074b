//! The operator's commands beside `serve`: `check` (the config and what it names, without
//! serving) and `status` (what a running replica serves and what each Envoy holds, from
//! its admin API). Each is a function from its arguments to the text it prints, so tests
//! call it as the binary does.

pub mod check;
pub mod status;
