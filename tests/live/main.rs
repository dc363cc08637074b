//! Live health and discovery: the prober against real sockets, discovery from the
//! (simulated) dashboard end to end, and the simulator checked against captures of a real
//! Ray 2.60 proxy.

mod discovery;
mod prober;
mod sim_conformance;
