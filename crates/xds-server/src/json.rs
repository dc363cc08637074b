//! Envoy messages as proto JSON, with proto field names (snake_case) as Envoy's own
//! `/config_dump` prints them, typed configs inside `Any`s expanded.
//!
//! The descriptors come from `proto/envoy-descriptors.bin` (see
//! `tests/xds/descriptors.rs` for how it is made and checked), compiled in. A message
//! whose type the descriptors do not know is shown as its type URL and size, never a
//! panic.

use std::sync::LazyLock;

use envoy_types::pb::google::protobuf::Any;
use prost_reflect::{DescriptorPool, DynamicMessage, SerializeOptions};
use serde_json::{json, Value};

static POOL: LazyLock<Result<DescriptorPool, String>> = LazyLock::new(|| {
    DescriptorPool::decode(&include_bytes!("../../../proto/envoy-descriptors.bin")[..])
        .map_err(|e| format!("proto/envoy-descriptors.bin: {e}"))
});

/// The message in `any` as proto JSON.
pub(crate) fn any_to_json(any: &Any) -> Value {
    let name = any.type_url.rsplit('/').next().unwrap_or_default();
    to_json(name, &any.value)
}

/// The message `M` as proto JSON.
pub(crate) fn message_to_json<M: prost::Message + prost::Name>(message: &M) -> Value {
    to_json(&M::full_name(), &message.encode_to_vec())
}

fn to_json(full_name: &str, bytes: &[u8]) -> Value {
    let unknown = || json!({"@type": full_name, "bytes": bytes.len()});
    let pool = match &*POOL {
        Ok(pool) => pool,
        Err(e) => return json!({"@type": full_name, "error": e}),
    };
    let Some(descriptor) = pool.get_message_by_name(full_name) else {
        return unknown();
    };
    let message = match DynamicMessage::decode(descriptor, bytes) {
        Ok(m) => m,
        Err(e) => return json!({"@type": full_name, "error": e.to_string()}),
    };
    let options = SerializeOptions::new()
        .use_proto_field_name(true)
        .stringify_64_bit_integers(false);
    match message.serialize_with_options(serde_json::value::Serializer, &options) {
        Ok(v) => v,
        Err(e) => json!({"@type": full_name, "error": e.to_string()}),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fixtures::{resources_of, service};
    use crate::{ResourceType, Snapshot};

    #[test]
    fn every_resource_and_the_configs_inside_it_print_as_proto_json() {
        let snapshot = Snapshot::from_resources(&resources_of(&[service("a", "a1", &[8000])]));
        let cluster = any_to_json(&snapshot.resources(ResourceType::Cluster)["default/a/a1"].body);
        assert_eq!(cluster["name"], "default/a/a1");
        assert_eq!(cluster["type"], "EDS");
        let cla = any_to_json(&snapshot.resources(ResourceType::Endpoints)["default/a/a1"].body);
        let host = &cla["endpoints"][0]["lb_endpoints"][0];
        assert_eq!(
            host["endpoint"]["address"]["socket_address"]["port_value"],
            8000
        );
        assert_eq!(host["health_status"], "HEALTHY");
        let listener =
            any_to_json(&snapshot.resources(ResourceType::Listener)["ray-serve-http"].body);
        let hcm = &listener["filter_chains"][0]["filters"][0]["typed_config"];
        assert_eq!(
            hcm["@type"],
            "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager"
        );
        assert_eq!(hcm["rds"]["route_config_name"], "ray-serve-http");
    }

    #[test]
    fn an_unknown_or_broken_message_is_described_not_fatal() {
        let unknown = Any {
            type_url: "type.googleapis.com/example.Nope".into(),
            value: vec![1, 2, 3],
        };
        assert_eq!(
            any_to_json(&unknown),
            json!({"@type": "example.Nope", "bytes": 3})
        );
        let broken = Any {
            type_url: "type.googleapis.com/envoy.config.cluster.v3.Cluster".into(),
            value: vec![0xff, 0xff, 0xff],
        };
        assert!(any_to_json(&broken)["error"].is_string());
    }
}
