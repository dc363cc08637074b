//! `rcp-peer`: rust-control-plane 0.1.2 serving ADS (state of the world only; its delta
//! handler is `unimplemented!()`) from a resources file, for the fan-out benchmark.
//!
//! `rcp-peer --listen 127.0.0.1:PORT --resources FILE --expect-nodes N`
//!
//! FILE holds length-delimited `DeltaDiscoveryResponse`s, one per type: `type_url`,
//! `system_version_info` (the type's version) and every resource with its name. The
//! benchmark writes what ray-xds served, so both servers serve the same resources. The file
//! is watched with inotify (the folder, as ray-xds watches its services file) and read
//! again on every change in the folder that is not an access; a changed file becomes a
//! new `Snapshot`, set for every node the cache knows. That is how rust-control-plane is
//! used: its cache is keyed by node id (not pluggable), so a fleet of N Envoys holds N
//! snapshots, and `set_snapshot` clones the snapshot it is given. It has no callback for
//! a new node (go-control-plane's `OnStreamRequest`), so a task looks for new nodes in
//! `node_status()` every 5 ms and gives each the current snapshot, until
//! `--expect-nodes` are known (then it stops, so it costs nothing while changes are
//! timed).
//!
//! The cache is built with `ads: false`: in 0.1.2, `ads: true` answers a first wildcard
//! request (CDS, LDS) only at the next `set_snapshot`, never from the snapshot it
//! already holds. Over ADS the flag changes nothing else.
//!
//! Resources are decoded into rust-control-plane's typed `Resource` (its API takes typed
//! messages and encodes them again for every response). A field its protos do not know
//! would be dropped; the peer prints how many bytes decoding lost: 600 bytes of the
//! fan-out benchmark's snapshot (3 per cluster, a field newer than its protos), so the
//! peer sends a hair less than ray-xds.

use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;

use tokio::sync::Mutex;

use data_plane_api::envoy::config::cluster::v3::Cluster;
use data_plane_api::envoy::config::endpoint::v3::ClusterLoadAssignment;
use data_plane_api::envoy::config::listener::v3::Listener;
use data_plane_api::envoy::config::route::v3::RouteConfiguration;
use data_plane_api::envoy::service::discovery::v3::aggregated_discovery_service_server::AggregatedDiscoveryServiceServer;
use data_plane_api::envoy::service::discovery::v3::DeltaDiscoveryResponse;
use prost::Message;
use rust_control_plane::cache::Cache;
use rust_control_plane::service::common::Service;
use rust_control_plane::snapshot::{type_url, Resource, Resources, Snapshot};

struct Args {
    listen: SocketAddr,
    resources: PathBuf,
    expect_nodes: usize,
}

fn args() -> Args {
    let mut listen = None;
    let mut resources = None;
    let mut expect_nodes = 0;
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = || it.next().unwrap_or_else(|| panic!("{flag} needs a value"));
        match flag.as_str() {
            "--listen" => listen = Some(value().parse().expect("--listen ADDR:PORT")),
            "--resources" => resources = Some(PathBuf::from(value())),
            "--expect-nodes" => expect_nodes = value().parse().expect("--expect-nodes N"),
            other => panic!("unknown argument {other}"),
        }
    }
    Args {
        listen: listen.expect("--listen is required"),
        resources: resources.expect("--resources is required"),
        expect_nodes,
    }
}

/// The snapshot in `bytes`, and the bytes decoding dropped (fields the protos lack).
fn parse(mut bytes: &[u8]) -> Result<(Snapshot, usize), String> {
    let mut snapshot = Snapshot::new();
    let mut lost = 0;
    while !bytes.is_empty() {
        let response = DeltaDiscoveryResponse::decode_length_delimited(&mut bytes)
            .map_err(|e| format!("bad response: {e}"))?;
        let mut resources = Resources::new(response.system_version_info.clone());
        for r in response.resources {
            let any = r.resource.ok_or("a resource without a body")?;
            let value = &any.value[..];
            let bad = |e: prost::DecodeError| format!("{}: {e}", r.name);
            let resource = match response.type_url.as_str() {
                type_url::CLUSTER => Resource::Cluster(Cluster::decode(value).map_err(bad)?),
                type_url::ENDPOINT => {
                    Resource::Endpoint(ClusterLoadAssignment::decode(value).map_err(bad)?)
                }
                type_url::LISTENER => Resource::Listener(Listener::decode(value).map_err(bad)?),
                type_url::ROUTE => Resource::Route(RouteConfiguration::decode(value).map_err(bad)?),
                other => return Err(format!("unexpected type {other}")),
            };
            lost += value.len().saturating_sub(resource.into_any().value.len());
            resources.items.insert(r.name, resource);
        }
        snapshot.insert(response.type_url, resources);
    }
    Ok((snapshot, lost))
}

/// Sets `snapshot` for every node the cache knows.
async fn publish(cache: &Cache, snapshot: &Snapshot) {
    for node in cache.node_status().await.into_keys() {
        cache.set_snapshot(&node, snapshot.clone()).await;
    }
}

/// Gives each new node the current snapshot, until `expect` nodes are known.
async fn greet_new_nodes(cache: Arc<Cache>, current: Arc<Mutex<Snapshot>>, expect: usize) {
    let mut greeted = BTreeSet::new();
    while greeted.len() < expect {
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
        // Hold `current` while setting, so a change cannot be overtaken by an old snapshot.
        let snapshot = current.lock().await;
        for node in cache.node_status().await.into_keys() {
            if !greeted.contains(&node) {
                cache.set_snapshot(&node, snapshot.clone()).await;
                greeted.insert(node);
            }
        }
    }
}

#[tokio::main]
async fn main() {
    let args = Arc::new(args());
    let cache = Arc::new(Cache::new(false));
    let read = |path: &PathBuf| -> Option<Vec<u8>> { std::fs::read(path).ok() };
    let mut last = read(&args.resources).expect("the resources file is readable");
    let (snapshot, lost) = parse(&last).expect("the resources file is valid");
    println!("rcp-peer: decoding lost {lost} bytes");
    let current = Arc::new(Mutex::new(snapshot));
    tokio::spawn(greet_new_nodes(
        cache.clone(),
        current.clone(),
        args.expect_nodes,
    ));

    let (tx, mut changed) = tokio::sync::mpsc::channel::<()>(1);
    let mut watcher = notify::recommended_watcher(move |e: notify::Result<notify::Event>| {
        if e.is_ok_and(|e| !e.kind.is_access()) {
            let _ = tx.try_send(());
        }
    })
    .expect("inotify");
    use notify::Watcher;
    let folder = args
        .resources
        .parent()
        .expect("a file in a folder")
        .to_path_buf();
    watcher
        .watch(&folder, notify::RecursiveMode::NonRecursive)
        .expect("watch the folder");
    let (c, a, cur) = (cache.clone(), args.clone(), current.clone());
    tokio::spawn(async move {
        let _watcher = watcher;
        while changed.recv().await.is_some() {
            let Some(bytes) = read(&a.resources) else {
                continue;
            };
            if bytes == last {
                continue;
            }
            match parse(&bytes) {
                Ok((snapshot, _)) => {
                    let mut current = cur.lock().await;
                    publish(&c, &snapshot).await;
                    *current = snapshot;
                }
                Err(e) => eprintln!("rcp-peer: {e}"),
            }
            last = bytes;
        }
    });

    tonic::transport::Server::builder()
        .add_service(AggregatedDiscoveryServiceServer::new(Service::new(cache)))
        .serve(args.listen)
        .await
        .expect("serve");
}
