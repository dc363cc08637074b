#![no_main]

#[path = "../bodies.rs"]
mod fuzz_bodies;

libfuzzer_sys::fuzz_target!(|data: &[u8]| fuzz_bodies::xds_requests(data));
