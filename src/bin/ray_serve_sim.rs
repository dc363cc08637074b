//! `ray-serve-sim`: runs simulated Ray Serve proxies (see `ray_xds::sim`).
//!
//! `ray-serve-sim --cluster demo-a --proxy 127.0.0.1:8000=head --proxy 127.0.0.1:8001=worker`

use std::collections::BTreeMap;
use std::net::SocketAddr;

use clap::Parser;
use ray_xds::model::NodeType;
use ray_xds::sim::{serve_proxy, ProxyConfig};
use tokio_util::sync::CancellationToken;

/// Simulated Ray Serve HTTP proxies that answer like Ray 2.60's.
#[derive(Parser)]
struct Args {
    /// RayCluster name the proxies report in their answers.
    #[arg(long)]
    cluster: String,
    /// A proxy to run, as `ip:port=head|worker`; repeat for several.
    #[arg(long = "proxy", required = true, value_parser = parse_proxy)]
    proxies: Vec<(SocketAddr, NodeType)>,
    /// An application, as `route_prefix=name`; repeat for several [default: /=app].
    #[arg(long = "app", value_parser = parse_app)]
    apps: Vec<(String, String)>,
}

fn parse_proxy(s: &str) -> Result<(SocketAddr, NodeType), String> {
    let (addr, kind) = s.split_once('=').ok_or("expected ip:port=head|worker")?;
    let addr = addr.parse().map_err(|e| format!("{addr}: {e}"))?;
    let kind = match kind {
        "head" => NodeType::Head,
        "worker" => NodeType::Worker,
        other => return Err(format!("node type {other:?} is neither head nor worker")),
    };
    Ok((addr, kind))
}

fn parse_app(s: &str) -> Result<(String, String), String> {
    let (prefix, name) = s.split_once('=').ok_or("expected route_prefix=name")?;
    if !prefix.starts_with('/') {
        return Err(format!("route prefix {prefix:?} must start with '/'"));
    }
    Ok((prefix.into(), name.into()))
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let routes: BTreeMap<String, String> = if args.apps.is_empty() {
        [("/".to_string(), "app".to_string())].into()
    } else {
        args.apps.into_iter().collect()
    };
    let shutdown = CancellationToken::new();
    let mut tasks = tokio::task::JoinSet::new();
    for (addr, node_type) in args.proxies {
        let listener = tokio::net::TcpListener::bind(addr).await?;
        println!(
            "ray-serve-sim: cluster {} {node_type} proxy on {}",
            args.cluster,
            listener.local_addr()?
        );
        let config = ProxyConfig {
            cluster: args.cluster.clone(),
            node_type,
            routes: routes.clone(),
        };
        tasks.spawn(serve_proxy(listener, config, shutdown.clone()));
    }
    tokio::select! {
        _ = tokio::signal::ctrl_c() => shutdown.cancel(),
        Some(done) = tasks.join_next() => { done??; }
    }
    Ok(())
}
