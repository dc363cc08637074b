//! The xDS server on its own: the gRPC protocol driven by envoy-types' client (both
//! protocols, misbehaving clients), mTLS on its port under attack, the golden resources
//! `translate` produces, the Envoy descriptors `/debug` prints with, and the fuzzers' corpus.

mod descriptors;
mod fuzz_corpus;
mod golden;
mod grpc;
mod load_reports;
mod tls_hostile;
