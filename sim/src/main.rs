//! `ray-serve-sim`: simulated Ray Serve proxies (and optionally a dashboard) of one
//! RayCluster, with a control endpoint to inject faults while it runs. See
//! [`ray_serve_sim::cli`].

fn main() -> anyhow::Result<()> {
    ray_serve_sim::cli::main_with(std::env::args_os())
}
