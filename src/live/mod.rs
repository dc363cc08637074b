//! Live state: what ray-xds learns from the running Ray clusters themselves, as opposed
//! to what a source says should exist.
//!
//! - [`dashboard`]: each cluster's Ray dashboard, the authority on application status.

pub mod dashboard;
