//! A dashboard answer's JSON into [`ServeStatus`]: bounded in values, entries and string
//! lengths; only the fields read are built (`Shape`); garbage entries left out alone.

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;

use serde_json::{Map, Value};

use super::*;

/// The most JSON values one answer may hold (objects, arrays, strings, numbers...). A
/// parse builds a tree of every value (tens of bytes each, whatever their size in the
/// body), so an 8 MiB body of `[0,0,0,...]` would cost hundreds of MB for a moment; a
/// real answer has about 10 values per proxy and per replica (a 2,000-node cluster with
/// 10,000 replicas: about 130,000).
pub const MAX_JSON_VALUES: usize = 400_000;

/// An upper bound of the number of JSON values in `body`, counted up to `cap + 1`: every
/// value is the first of its container or follows a comma, so values are at most
/// containers + commas + 1 (outside strings). Garbage is counted the same way and left
/// for the parser to refuse.
pub(super) fn json_values_at_most(body: &[u8], cap: usize) -> usize {
    let (mut n, mut in_string, mut escaped) = (1usize, false, false);
    for &b in body {
        if in_string {
            match (escaped, b) {
                (true, _) => escaped = false,
                (false, b'\\') => escaped = true,
                (false, b'"') => in_string = false,
                _ => {}
            }
            continue;
        }
        match b {
            b'"' => in_string = true,
            b',' | b'{' | b'[' => {
                n += 1;
                if n > cap {
                    return n;
                }
            }
            _ => {}
        }
    }
    n
}

/// One entry of `applications`.
fn application(name: &str, app: &Value) -> Result<Application, DashboardError> {
    let Value::Object(app) = app else {
        return Err(DashboardError::Malformed(format!(
            "application `{name}` is not an object"
        )));
    };
    Ok(Application {
        status: AppStatus::from_ray(&string_field(app, "status")),
        route_prefix: app
            .get("route_prefix")
            .and_then(Value::as_str)
            .map(str::to_owned),
        message: string_field(app, "message"),
        capacity: capacity::deployment_sizes(app)
            .and_then(|sizes| capacity::application_capacity(&sizes)),
        deployed_at: app
            .get("last_deployed_time_s")
            .and_then(Value::as_f64)
            .filter(|t| t.is_finite() && *t >= 0.0),
        resizing: capacity::only_resizing(app),
        // An object's digest (`Shape::Digest`); anything else (null for an application
        // not deployed from a config) gives none.
        config_digest: app
            .get("deployed_app_config")
            .and_then(Value::as_str)
            .map(str::to_owned),
    })
}

/// The first 16 hex digits of the SHA-256 of `raw`, a JSON object as Ray sent it: the
/// same for the same application config (Ray writes a config the same way each time), on
/// every replica and version of ray-xds, whatever its depth or numbers.
fn config_digest(raw: &str) -> String {
    use sha2::Digest;
    let digest = sha2::Sha256::digest(raw.as_bytes());
    digest[..8].iter().map(|b| format!("{b:02x}")).collect()
}

/// Parses the body of `GET /api/serve/applications/`.
pub fn parse(body: &[u8]) -> Result<ServeStatus, DashboardError> {
    // The bound comes before the tree is built (see `MAX_JSON_VALUES`).
    if json_values_at_most(body, MAX_JSON_VALUES) > MAX_JSON_VALUES {
        return Err(DashboardError::Malformed(format!(
            "over {MAX_JSON_VALUES} JSON values"
        )));
    }
    // Only the fields read below are built (see `ROOT`); the rest is skipped unbuilt.
    let root: Value = serde::de::DeserializeSeed::deserialize(
        Pruned(&ROOT),
        &mut serde_json::Deserializer::from_slice(body),
    )
    .map_err(|e| {
        DashboardError::Malformed(if e.is_data() {
            e.to_string()
        } else {
            format!("not JSON: {e}")
        })
    })?;
    let Value::Object(root) = root else {
        return Err(malformed("top level is not an object"));
    };

    let mut status = ServeStatus::default();

    if let Some(listed) = root
        .get("applications")
        .and_then(Value::as_object)
        .map(Map::len)
        .filter(|n| *n > MAX_APPLICATIONS)
    {
        return Err(DashboardError::Malformed(format!(
            "{listed} applications listed, over the cap of {MAX_APPLICATIONS}"
        )));
    }
    for (name, app) in object_field(&root, "applications")? {
        status
            .applications
            .insert(name.clone(), application(name, app)?);
    }

    // The caps come before any work on the lists (see `MAX_PROXIES`).
    let proxies = root.get("proxies").and_then(Value::as_object);
    if let Some(listed) = proxies.map(Map::len).filter(|n| *n > MAX_PROXIES) {
        return Err(DashboardError::Malformed(format!(
            "{listed} proxies listed, over the cap of {MAX_PROXIES}"
        )));
    }
    let targets = crate::live::target_groups::targets(&root).count();
    if targets > MAX_TARGETS {
        return Err(DashboardError::Malformed(format!(
            "{targets} targets listed, over the cap of {MAX_TARGETS}"
        )));
    }
    // Node id → the proxy's actor name: a target's `name` says which proxy it is.
    let mut actor_names = BTreeMap::new();
    for (node_id, proxy) in object_field(&root, "proxies")? {
        let Value::Object(proxy) = proxy else {
            return Err(DashboardError::Malformed(format!(
                "proxy `{node_id}` is not an object"
            )));
        };
        let id = string_field(proxy, "node_id");
        let id = if id.is_empty() { node_id.clone() } else { id };
        actor_names.insert(id.clone(), string_field(proxy, "actor_name"));
        status.proxies.insert(
            node_id.clone(),
            ServeProxy {
                node_id: id,
                node_ip: string_field(proxy, "node_ip"),
                status: ProxyStatus::from_ray(&string_field(proxy, "status")),
            },
        );
    }

    status.target_capacity = root.get("target_capacity").and_then(Value::as_f64);
    status.keep_alive_timeout_s = root
        .get("http_options")
        .and_then(|o| o.get("keep_alive_timeout_s"))
        .and_then(Value::as_f64);
    status.http_proxies = http_proxies(&root, &status.proxies, &actor_names);
    status.ingress = crate::live::target_groups::parse(&root);
    let grpc = root.get("grpc_options");
    let serves_grpc = grpc
        .and_then(|o| o.get("grpc_servicer_functions"))
        .and_then(Value::as_array)
        .is_some_and(|f| !f.is_empty());
    status.grpc_port = grpc
        .filter(|_| serves_grpc)
        .and_then(|o| o.get("port"))
        .and_then(port_number);
    // Addresses are outside input: `live::discovery` publishes only those the address
    // policy allows (never the metadata service, broadcast, multicast...).
    Ok(status)
}

/// The most applications one answer may list (Ray Serve instances run tens).
pub const MAX_APPLICATIONS: usize = 1_000;

/// The longest string kept from an answer (names, statuses, messages, addresses): a
/// longer one is cut (at a character boundary), a longer key drops its entry. Ray's are
/// short; an application's message is a sentence or a traceback's last lines.
pub const MAX_STRING_BYTES: usize = 1024;

/// Which parts of an answer are built into the tree `parse` reads; everything else is
/// skipped unbuilt (`serde::de::IgnoredAny`), so a hostile answer's bulk in fields ray-xds
/// never reads (a replica's ids and times, unknown keys) costs a scan, not a tree.
enum Shape {
    /// A scalar (string cut to [`MAX_STRING_BYTES`], number, bool, null); an object or
    /// array here is skipped unbuilt and read as null.
    Scalar,
    /// Any value, never built, so no depth or size of it refuses the answer: an object
    /// is read as the digest of its bytes as sent ([`config_digest`]), a string; anything
    /// else as null.
    Digest,
    /// An object: only these keys, each of its shape.
    Fields(&'static [(&'static str, Shape)]),
    /// An object: every key, each value of this shape; more than `max` entries refuse the
    /// answer as soon as they are read (`what` names them).
    MapOf(&'static Shape, usize, &'static str),
    /// An array: every element of this shape, at most `max` (see `MapOf`).
    ArrayOf(&'static Shape, usize, &'static str),
}

/// The most target groups one answer may list: Ray lists one per protocol, and with direct
/// ingress one per application and protocol.
const MAX_TARGET_GROUPS: usize = 2 * MAX_APPLICATIONS + 2;

/// The most gRPC servicer functions one answer may list (an application has a few).
const MAX_SERVICER_FUNCTIONS: usize = 1_000;

static ROOT: Shape = Shape::Fields(&[
    (
        "applications",
        Shape::MapOf(
            &Shape::Fields(&[
                ("status", Shape::Scalar),
                ("route_prefix", Shape::Scalar),
                ("message", Shape::Scalar),
                ("last_deployed_time_s", Shape::Scalar),
                ("deployed_app_config", Shape::Digest),
                (
                    "deployments",
                    Shape::MapOf(
                        &Shape::Fields(&[
                            ("status", Shape::Scalar),
                            (
                                "replicas",
                                Shape::ArrayOf(
                                    &Shape::Fields(&[("state", Shape::Scalar)]),
                                    capacity::MAX_REPLICAS,
                                    "replicas of one deployment",
                                ),
                            ),
                            (
                                "deployment_config",
                                Shape::Fields(&[
                                    ("num_replicas", Shape::Scalar),
                                    ("max_ongoing_requests", Shape::Scalar),
                                    ("autoscaling_config", Shape::Fields(&[])),
                                ]),
                            ),
                        ]),
                        capacity::MAX_DEPLOYMENTS,
                        "deployments of one application",
                    ),
                ),
            ]),
            MAX_APPLICATIONS,
            "applications listed",
        ),
    ),
    (
        "proxies",
        Shape::MapOf(
            &Shape::Fields(&[
                ("node_id", Shape::Scalar),
                ("node_ip", Shape::Scalar),
                ("status", Shape::Scalar),
                ("actor_name", Shape::Scalar),
            ]),
            MAX_PROXIES,
            "proxies listed",
        ),
    ),
    (
        "target_groups",
        Shape::ArrayOf(
            &Shape::Fields(&[
                ("protocol", Shape::Scalar),
                ("app_name", Shape::Scalar),
                ("route_prefix", Shape::Scalar),
                ("ingress_deployment_name", Shape::Scalar),
                (
                    "targets",
                    Shape::ArrayOf(
                        &Shape::Fields(&[
                            ("ip", Shape::Scalar),
                            ("port", Shape::Scalar),
                            ("name", Shape::Scalar),
                        ]),
                        MAX_TARGETS,
                        "targets in one target group",
                    ),
                ),
            ]),
            MAX_TARGET_GROUPS,
            "target groups",
        ),
    ),
    (
        "controller_info",
        Shape::Fields(&[("node_id", Shape::Scalar), ("node_ip", Shape::Scalar)]),
    ),
    (
        "http_options",
        Shape::Fields(&[
            ("port", Shape::Scalar),
            ("keep_alive_timeout_s", Shape::Scalar),
        ]),
    ),
    (
        "grpc_options",
        Shape::Fields(&[
            ("port", Shape::Scalar),
            (
                "grpc_servicer_functions",
                Shape::ArrayOf(
                    &Shape::Scalar,
                    MAX_SERVICER_FUNCTIONS,
                    "gRPC servicer functions",
                ),
            ),
        ]),
    ),
    ("target_capacity", Shape::Scalar),
]);

/// Deserializes a value of a [`Shape`] into a `Value`. A value of another JSON type than
/// its shape expects is kept as it is (small: its containers are skipped), so `parse`
/// judges it as before.
struct Pruned(&'static Shape);

impl<'de> serde::de::DeserializeSeed<'de> for Pruned {
    type Value = Value;

    fn deserialize<D: serde::Deserializer<'de>>(self, d: D) -> Result<Value, D::Error> {
        if matches!(self.0, Shape::Digest) {
            let raw: Box<serde_json::value::RawValue> = serde::Deserialize::deserialize(d)?;
            let object = raw.get().starts_with('{');
            return Ok(if object {
                Value::String(config_digest(raw.get()))
            } else {
                Value::Null
            });
        }
        d.deserialize_any(PrunedVisitor(self.0))
    }
}

struct PrunedVisitor(&'static Shape);

/// The error that refuses an answer listing more than `max` of `what`.
fn over_cap<E: serde::de::Error>(max: usize, what: &str) -> E {
    E::custom(format!("more than {max} {what}, over the cap of {max}"))
}

/// `text` cut to [`MAX_STRING_BYTES`] at a character boundary.
pub(super) fn cut(text: &str) -> String {
    let mut end = text.len().min(MAX_STRING_BYTES);
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    text[..end].to_string()
}

impl<'de> serde::de::Visitor<'de> for PrunedVisitor {
    type Value = Value;

    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("a JSON value")
    }

    fn visit_bool<E>(self, v: bool) -> Result<Value, E> {
        Ok(Value::Bool(v))
    }
    fn visit_i64<E>(self, v: i64) -> Result<Value, E> {
        Ok(Value::from(v))
    }
    fn visit_u64<E>(self, v: u64) -> Result<Value, E> {
        Ok(Value::from(v))
    }
    fn visit_f64<E>(self, v: f64) -> Result<Value, E> {
        Ok(serde_json::Number::from_f64(v).map_or(Value::Null, Value::Number))
    }
    fn visit_str<E>(self, v: &str) -> Result<Value, E> {
        Ok(Value::String(cut(v)))
    }
    fn visit_unit<E>(self) -> Result<Value, E> {
        Ok(Value::Null)
    }
    fn visit_none<E>(self) -> Result<Value, E> {
        Ok(Value::Null)
    }

    fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut seq: A) -> Result<Value, A::Error> {
        let (element, max, what) = match self.0 {
            Shape::ArrayOf(element, max, what) => (element, *max, *what),
            // Not what its shape wants: skipped, kept as null (a scalar's place) or an
            // empty array (judged by `parse`).
            Shape::Scalar => {
                while seq.next_element::<serde::de::IgnoredAny>()?.is_some() {}
                return Ok(Value::Null);
            }
            // (`Digest` never comes here: `Pruned` reads it.)
            Shape::Fields(_) | Shape::MapOf(..) | Shape::Digest => {
                while seq.next_element::<serde::de::IgnoredAny>()?.is_some() {}
                return Ok(Value::Array(Vec::new()));
            }
        };
        let mut out = Vec::new();
        while let Some(v) = seq.next_element_seed(Pruned(element))? {
            if out.len() == max {
                return Err(over_cap(max, what));
            }
            out.push(v);
        }
        Ok(Value::Array(out))
    }

    fn visit_map<A: serde::de::MapAccess<'de>>(self, mut map: A) -> Result<Value, A::Error> {
        if matches!(self.0, Shape::Scalar) {
            while map
                .next_entry::<serde::de::IgnoredAny, serde::de::IgnoredAny>()?
                .is_some()
            {}
            return Ok(Value::Null);
        }
        let mut out = Map::new();
        while let Some(key) = map.next_key::<std::borrow::Cow<'de, str>>()? {
            let shape = match self.0 {
                Shape::MapOf(value, max, what) => {
                    if out.len() == *max {
                        return Err(over_cap(*max, what));
                    }
                    Some(*value)
                }
                Shape::Fields(fields) => fields.iter().find(|(k, _)| *k == key).map(|(_, s)| s),
                // Not the object its shape wants: kept as an empty one.
                Shape::ArrayOf(..) | Shape::Scalar | Shape::Digest => None,
            };
            match shape {
                Some(shape) if key.len() <= MAX_STRING_BYTES => {
                    let value = map.next_value_seed(Pruned(shape))?;
                    out.insert(key.into_owned(), value);
                }
                _ => {
                    map.next_value::<serde::de::IgnoredAny>()?;
                }
            }
        }
        Ok(Value::Object(out))
    }
}

/// Every entry of the `targets` of the HTTP `target_groups` (gRPC groups are skipped),
/// objects or not.
/// The HTTP targets that are proxies: with direct ingress, a group's targets are an
/// application's replicas (`target_groups`), never proxies.
pub(super) fn http_targets(root: &Map<String, Value>) -> impl Iterator<Item = &Value> {
    crate::live::target_groups::targets(root)
        .filter(|(protocol, _)| *protocol == crate::model::Protocol::Http)
        .map(|(_, target)| target)
        .filter(|t| {
            let name = t.get("name").and_then(Value::as_str).unwrap_or_default();
            !crate::live::target_groups::is_replica(name)
        })
}

/// Who owns a target, looked up in maps built once from `proxies` (a scan of every proxy
/// per target was quadratic): the proxy whose actor name is the target's `name`, else
/// the only proxy on the target's IP.
pub(super) struct Owners<'a> {
    /// Actor name → the first proxy (in `proxies` order) with that name.
    by_name: BTreeMap<&'a str, &'a ServeProxy>,
    /// Node IP → its proxy, or `None` when several proxies share the IP (then only the
    /// name tells them apart).
    by_ip: BTreeMap<IpAddr, Option<&'a ServeProxy>>,
}

impl<'a> Owners<'a> {
    pub(super) fn new(
        proxies: &'a BTreeMap<String, ServeProxy>,
        actor_names: &'a BTreeMap<String, String>,
    ) -> Self {
        let mut by_name = BTreeMap::new();
        let mut by_ip = BTreeMap::new();
        for proxy in proxies.values() {
            if let Some(name) = actor_names.get(&proxy.node_id).filter(|n| !n.is_empty()) {
                by_name.entry(name.as_str()).or_insert(proxy);
            }
            if let Some(ip) = ip_addr(&proxy.node_ip) {
                by_ip
                    .entry(ip)
                    .and_modify(|only: &mut Option<_>| *only = None)
                    .or_insert(Some(proxy));
            }
        }
        Owners { by_name, by_ip }
    }

    pub(super) fn of(&self, name: &str, ip: IpAddr) -> Option<&'a ServeProxy> {
        let by_name = (!name.is_empty())
            .then(|| self.by_name.get(name).copied())
            .flatten();
        by_name.or_else(|| self.by_ip.get(&ip).copied().flatten())
    }
}

/// The HTTP proxies of the answer: see the module doc for the rules.
pub(super) fn http_proxies(
    root: &Map<String, Value>,
    proxies: &BTreeMap<String, ServeProxy>,
    actor_names: &BTreeMap<String, String>,
) -> Vec<HttpProxy> {
    let controller = root.get("controller_info").and_then(Value::as_object);
    let controller_id = controller
        .map(|c| string_field(c, "node_id"))
        .unwrap_or_default();
    let controller_ip = controller
        .map(|c| string_field(c, "node_ip"))
        .unwrap_or_default();
    let is_head = |proxy: &ServeProxy| {
        if !controller_id.is_empty() && !proxy.node_id.is_empty() {
            proxy.node_id == controller_id
        } else {
            !controller_ip.is_empty() && proxy.node_ip == controller_ip
        }
    };
    let node_type = |head: bool| {
        if head {
            NodeType::Head
        } else {
            NodeType::Worker
        }
    };

    let mut out: BTreeMap<SocketAddr, HttpProxy> = BTreeMap::new();
    let mut owning = BTreeSet::new();
    let owners = Owners::new(proxies, actor_names);
    let controller_ip_addr = ip_addr(&controller_ip);
    for target in http_targets(root).filter_map(Value::as_object) {
        let ip = target.get("ip").and_then(Value::as_str).and_then(ip_addr);
        let port = target.get("port").and_then(port_number);
        let (Some(ip), Some(port)) = (ip, port) else {
            continue;
        };
        let address = SocketAddr::new(ip, port);
        if out.contains_key(&address) {
            continue;
        }
        let name = target
            .get("name")
            .and_then(Value::as_str)
            .unwrap_or_default();
        let proxy = match owners.of(name, ip) {
            Some(p) => {
                owning.insert(p.node_id.clone());
                HttpProxy {
                    address,
                    node_id: p.node_id.clone(),
                    node_type: node_type(is_head(p)),
                    status: Some(p.status.clone()),
                }
            }
            None => HttpProxy {
                address,
                node_id: String::new(),
                node_type: node_type(controller_ip_addr == Some(ip)),
                status: None,
            },
        };
        out.insert(address, proxy);
    }

    let http_port = match root.get("http_options").and_then(|o| o.get("port")) {
        None | Some(Value::Null) => Some(DEFAULT_HTTP_PORT),
        Some(port) => port_number(port),
    };
    for proxy in proxies.values() {
        if owning.contains(&proxy.node_id) {
            continue;
        }
        let (Some(ip), Some(port)) = (ip_addr(&proxy.node_ip), http_port) else {
            continue;
        };
        out.entry(SocketAddr::new(ip, port))
            .or_insert_with(|| HttpProxy {
                address: SocketAddr::new(ip, port),
                node_id: proxy.node_id.clone(),
                node_type: node_type(is_head(proxy)),
                status: Some(proxy.status.clone()),
            });
    }
    out.into_values().collect()
}

/// An IP address, or `None` for anything else (a host name, garbage).
pub(super) fn ip_addr(text: &str) -> Option<IpAddr> {
    text.parse().ok()
}

/// A port a proxy can listen on: an integer in 1..=65535.
fn port_number(value: &Value) -> Option<u16> {
    value
        .as_u64()
        .and_then(|p| u16::try_from(p).ok())
        .filter(|p| *p != 0)
}

pub(super) fn malformed(reason: &str) -> DashboardError {
    DashboardError::Malformed(reason.to_string())
}

/// `root[key]` as an object; missing or null is empty, anything else is malformed.
fn object_field<'a>(
    root: &'a Map<String, Value>,
    key: &str,
) -> Result<Box<dyn Iterator<Item = (&'a String, &'a Value)> + 'a>, DashboardError> {
    match root.get(key) {
        None | Some(Value::Null) => Ok(Box::new(std::iter::empty())),
        Some(Value::Object(map)) => Ok(Box::new(map.iter())),
        Some(_) => Err(DashboardError::Malformed(format!(
            "`{key}` is not an object"
        ))),
    }
}

/// `object[key]` as a string; missing, null or not a string is empty.
fn string_field(object: &Map<String, Value>, key: &str) -> String {
    object
        .get(key)
        .and_then(Value::as_str)
        .unwrap_or_default()
        .to_string()
}
