//! `proto/envoy-descriptors.bin`: the protobuf descriptors of the Envoy messages ray-xds
//! serves and shows, so that `/debug/snapshot` and `/debug/clients` print them as the
//! proto JSON Envoy's own `/config_dump` uses.
//!
//! The file is cut from the descriptor set envoy-types ships (`src/generated/types.bin`,
//! the same protos its Rust types come from) down to the files these messages need:
//! `bash scripts/gen-envoy-descriptors.sh` runs the ignored test below. The other test
//! checks, on every run, that the committed file still describes every message ray-xds
//! emits.

use std::collections::{BTreeSet, VecDeque};

use prost::Message;
use prost_types::FileDescriptorSet;

/// Every message ray-xds puts on the wire or in an `Any` (its own resources, the typed
/// configs inside them, and what `/debug/clients` renders).
const ROOTS: &[&str] = &[
    "envoy.config.cluster.v3.Cluster",
    "envoy.config.endpoint.v3.ClusterLoadAssignment",
    "envoy.config.listener.v3.Listener",
    "envoy.config.route.v3.RouteConfiguration",
    "envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
    "envoy.extensions.filters.http.router.v3.Router",
    "envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
    "envoy.extensions.load_balancing_policies.least_request.v3.LeastRequest",
    "envoy.extensions.retry.host.previous_hosts.v3.PreviousHostsPredicate",
    "envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext",
    "envoy.extensions.transport_sockets.tls.v3.DownstreamTlsContext",
    "envoy.extensions.filters.http.grpc_stats.v3.FilterConfig",
    "envoy.service.status.v3.ClientConfig",
    "envoy.service.discovery.v3.DiscoveryResponse",
    "envoy.service.discovery.v3.DeltaDiscoveryResponse",
];

fn committed() -> Vec<u8> {
    std::fs::read(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/proto/envoy-descriptors.bin"
    ))
    .expect("proto/envoy-descriptors.bin (bash scripts/gen-envoy-descriptors.sh makes it)")
}

#[test]
fn the_committed_descriptors_describe_every_message_ray_xds_emits() {
    let pool = prost_reflect::DescriptorPool::decode(&committed()[..]).unwrap();
    for root in ROOTS {
        assert!(
            pool.get_message_by_name(root).is_some(),
            "{root} is missing"
        );
    }
}

/// The files that define `roots`, with everything they import.
fn closure(set: &FileDescriptorSet, roots: &[&str]) -> BTreeSet<String> {
    let package_of = |file: &prost_types::FileDescriptorProto| file.package().to_string();
    let mut wanted = BTreeSet::new();
    let mut queue: VecDeque<String> = VecDeque::new();
    for root in roots {
        let (package, message) = root.rsplit_once('.').unwrap();
        let file = set
            .file
            .iter()
            .find(|f| {
                package_of(f) == package && f.message_type.iter().any(|m| m.name() == message)
            })
            .unwrap_or_else(|| panic!("no file defines {root}"));
        queue.push_back(file.name().to_string());
    }
    while let Some(name) = queue.pop_front() {
        if !wanted.insert(name.clone()) {
            continue;
        }
        let file = set.file.iter().find(|f| f.name() == name).unwrap();
        queue.extend(file.dependency.iter().cloned());
    }
    wanted
}

#[test]
#[ignore = "regenerates proto/envoy-descriptors.bin: run through scripts/gen-envoy-descriptors.sh"]
fn regenerate() {
    let dir =
        std::env::var("ENVOY_TYPES_DIR").expect("ENVOY_TYPES_DIR: envoy-types' source folder");
    let bytes = std::fs::read(format!("{dir}/src/generated/types.bin")).unwrap();
    let set = FileDescriptorSet::decode(&bytes[..]).unwrap();
    let keep = closure(&set, ROOTS);
    // In dependency order, as the set lists them (a pool decodes files in order).
    let mut cut = FileDescriptorSet {
        file: set
            .file
            .into_iter()
            .filter(|f| keep.contains(f.name()))
            .collect(),
    };
    for f in &mut cut.file {
        // Comments and source positions are not needed to print JSON.
        f.source_code_info = None;
    }
    let out = cut.encode_to_vec();
    std::fs::write(
        concat!(env!("CARGO_MANIFEST_DIR"), "/proto/envoy-descriptors.bin"),
        &out,
    )
    .unwrap();
    eprintln!("{} files, {} bytes", cut.file.len(), out.len());
}
