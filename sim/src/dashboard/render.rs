//! The dashboard's answer as Ray 2.60 renders it, from the simulated state: applications,
//! proxies, target groups (the proxies', or with direct ingress each application's
//! replicas), the controller's metrics, and the ids and times Ray would put there.
//!
//! Invariants: the answer's shape is the captures' (see the parent module); generated
//! ids are deterministic functions of node IPs and application names.

use std::net::SocketAddr;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use serde_json::{json, Map, Value};

use super::{AppSize, SimApp, SimDashboard, SimState};

impl SimDashboard {
    /// The controller's health metrics as Ray 2.60 reports them: plausible figures, only
    /// their shape matters to ray-xds.
    fn controller_health_metrics(&self, uptime_s: f64, apps: usize) -> Value {
        let stats = |mean: f64| json!({"mean": mean, "std": mean / 2.0, "min": mean / 10.0, "max": mean * 5.0});
        json!({
            "timestamp": unix_now(),
            "controller_start_time": unix_time(self.shared.started),
            "uptime_s": uptime_s,
            "last_control_loop_time": unix_now(),
            "num_control_loops": (uptime_s * 10.0) as u64,
            "loop_duration_s": stats(0.006),
            "loops_per_second": 8.9,
            "last_sleep_duration_s": 0.1,
            "expected_sleep_duration_s": 0.1,
            "event_loop_delay_s": 0.0007,
            "num_asyncio_tasks": 8 + 2 * apps,
            "handle_ingest_duration_ms": {},
            "replica_ingest_duration_ms": {},
            "metrics_decompress_duration_ms": {},
            "columnar_decode_duration_ms": {},
            "handle_reports_received": 0,
            "replica_reports_received": 0,
            "ingest_reports_received": 0,
            "ingest_cpu_fraction": 0.0,
            "deployment_state_update_duration_s": stats(0.001),
            "application_state_update_duration_s": stats(0.001),
            "proxy_state_update_duration_s": stats(0.00006),
            "node_update_duration_s": stats(0.00005),
            "handle_metrics_delay_ms": {},
            "replica_metrics_delay_ms": {},
            "process_memory_mb": 140.0,
        })
    }

    /// The Serve status as the dashboard would answer it now.
    pub(super) fn render(&self) -> Value {
        let now = Instant::now();
        let state = self.state();
        if state.apps.is_empty() && state.proxies.is_empty() {
            // Serve not started (01-no-serve.json).
            return json!({
                "controller_info": {},
                "proxies": {},
                "applications": {},
                "target_capacity": null,
            });
        }

        let (head_key, head_ip) = state
            .proxies
            .iter()
            .find(|(_, p)| p.head)
            .or_else(|| state.proxies.iter().next())
            .map(|(key, _)| (node(key), key.0.clone()))
            .unwrap_or_else(|| ("127.0.0.1".to_string(), "127.0.0.1".to_string()));
        let head_id = node_id_for(&head_key);

        let grpc_enabled = state.grpc_port > 0 && !state.grpc_servicer_functions.is_empty();
        let (proxies, targets, grpc_targets) = proxy_entries(&state);

        let applications: Map<String, Value> = state
            .apps
            .iter()
            .map(|(name, app)| {
                let status = app.status_at(now);
                (
                    name.clone(),
                    render_app(name, app, status, state.target_capacity),
                )
            })
            .collect();

        let uptime_s = SystemTime::now()
            .duration_since(self.shared.started)
            .unwrap_or_default()
            .as_secs_f64();
        // One group per protocol, HTTP first, as Ray's `get_target_groups`.
        let group = |targets: Vec<Value>, protocol: &str| {
            json!({
                "targets": targets,
                "route_prefix": "/",
                "protocol": protocol,
                "app_name": "",
                "ingress_request_router_targets": [],
                "ingress_deployment_name": "",
            })
        };
        let mut target_groups = vec![group(targets.clone(), "HTTP")];
        if grpc_enabled {
            target_groups.push(group(grpc_targets.clone(), "gRPC"));
        }
        if state.direct_ingress && !state.apps.is_empty() {
            target_groups = direct_ingress_groups(&state, &targets, &grpc_targets, grpc_enabled);
        }

        json!({
            "controller_info": {
                "node_id": head_id,
                "node_ip": head_ip,
                "node_instance_id": "",
                "actor_id": actor_id_for("controller", &head_key),
                "actor_name": "SERVE_CONTROLLER_ACTOR",
                "worker_id": hex_id(&format!("worker/controller/{head_key}"), 56),
                "log_file_path": "/serve/controller_11660.log",
            },
            "proxy_location": "EveryNode",
            "http_options": {
                "host": "0.0.0.0",
                "port": state.http_port,
                "root_path": "",
                "request_timeout_s": null,
                "keep_alive_timeout_s": 90,
                "ssl_keyfile": null,
                "ssl_certfile": null,
                "ssl_keyfile_password": null,
                "ssl_ca_certs": null,
            },
            "grpc_options": {
                "port": state.grpc_port,
                "grpc_servicer_functions": state.grpc_servicer_functions,
                "request_timeout_s": null,
                "enable_reflection": true,
            },
            "proxies": proxies,
            "applications": applications,
            "target_capacity": state.target_capacity,
            "target_groups": target_groups,
            "controller_health_metrics": self.controller_health_metrics(uptime_s, state.apps.len()),
            "restores_unset_config_options": true,
        })
    }
}

/// A proxy's node: its IP, or `ip:port` for one placed at its own port.
fn node((ip, port): &(String, Option<u16>)) -> String {
    match port {
        Some(port) => format!("{ip}:{port}"),
        None => ip.clone(),
    }
}

/// The `proxies` map, and the HTTP and gRPC targets of the proxies that are HEALTHY.
fn proxy_entries(state: &SimState) -> (Map<String, Value>, Vec<Value>, Vec<Value>) {
    let mut proxies = Map::new();
    let mut targets = Vec::new();
    let mut grpc_targets = Vec::new();
    for (key, proxy) in &state.proxies {
        let (ip, node_key) = (&key.0, node(key));
        let node_id = node_id_for(&node_key);
        let actor_name = format!("SERVE_PROXY_ACTOR-{node_id}");
        if proxy.status == "HEALTHY" {
            targets.push(json!({
                "ip": ip,
                "port": key.1.unwrap_or(state.http_port),
                "instance_id": "",
                "name": actor_name,
            }));
            grpc_targets.push(json!({
                "ip": ip,
                "port": proxy.grpc_port.unwrap_or(state.grpc_port),
                "instance_id": "",
                "name": actor_name,
            }));
        }
        proxies.insert(
            node_id.clone(),
            json!({
                "node_id": node_id,
                "node_ip": ip,
                "node_instance_id": "",
                "actor_id": actor_id_for("proxy", &node_key),
                "actor_name": actor_name,
                "worker_id": hex_id(&format!("worker/proxy/{node_key}"), 56),
                "log_file_path": format!("/serve/proxy_{ip}.log"),
                "status": proxy.status,
            }),
        );
    }
    (proxies, targets, grpc_targets)
}

/// Ray's `get_target_groups` with direct ingress: per application its replicas, or while
/// it has none the proxies' `targets` (HTTP, and `grpc_targets` when gRPC is on).
fn direct_ingress_groups(
    state: &SimState,
    targets: &[Value],
    grpc_targets: &[Value],
    grpc_enabled: bool,
) -> Vec<Value> {
    let mut target_groups = Vec::new();
    for (name, app) in &state.apps {
        let app_group = |targets: Vec<Value>, protocol: &str| {
            json!({
                "targets": targets,
                "route_prefix": app.route_prefix,
                "protocol": protocol,
                "app_name": name,
                "ingress_request_router_targets": [],
                "ingress_deployment_name": deployment_name(name),
            })
        };
        if app.replicas.is_empty() {
            if !targets.is_empty() {
                target_groups.push(app_group(targets.to_vec(), "HTTP"));
            }
            if grpc_enabled && !grpc_targets.is_empty() {
                target_groups.push(app_group(grpc_targets.to_vec(), "gRPC"));
            }
            continue;
        }
        // One id per replica (its HTTP port), the same for its gRPC target.
        let replica = |http: SocketAddr, address: SocketAddr| {
            let id = hex_id(&format!("replica/{name}/{http}"), 8);
            json!({
                "ip": address.ip().to_string(),
                "port": address.port(),
                "instance_id": "",
                "name": format!("SERVE_REPLICA::{name}#{}#{id}", deployment_name(name)),
            })
        };
        let http = app.replicas.iter().map(|r| replica(r.0, r.0)).collect();
        target_groups.push(app_group(http, "HTTP"));
        if grpc_enabled {
            let grpc: Vec<Value> = app
                .replicas
                .iter()
                .filter_map(|r| r.1.map(|g| replica(r.0, g)))
                .collect();
            target_groups.push(app_group(grpc, "gRPC"));
        }
    }
    target_groups
}

/// One application entry, with one ingress deployment named after the application
/// (`hello` → `Hello`, as in the captures).
fn render_app(name: &str, app: &SimApp, status: &str, target_capacity: Option<f64>) -> Value {
    let target_replicas = capacity_adjusted(app.size.num_replicas, target_capacity);
    let deployment = deployment_name(name);
    let (deployment_status, trigger, deployment_message) = match status {
        "RUNNING" => ("HEALTHY", "CONFIG_UPDATE_COMPLETED", String::new()),
        "DEPLOYING" => ("UPDATING", "CONFIG_UPDATE_STARTED", String::new()),
        "DEPLOY_FAILED" => (
            "DEPLOY_FAILED",
            "REPLICA_STARTUP_FAILED",
            "The deployment failed to start 3 times in a row. This may be due to a problem \
             with its constructor or initial health check failing. See controller logs for \
             details. Error:\nRuntimeError: simulated constructor failure"
                .to_string(),
        ),
        "UNHEALTHY" => (
            "UNHEALTHY",
            "HEALTH_CHECK_FAILED",
            "A replica's health check failed. This deployment will be UNHEALTHY until the \
             replica recovers or a new deploy happens."
                .to_string(),
        ),
        "DELETING" => ("UPDATING", "DELETING", String::new()),
        _ => ("UPDATING", "CONFIG_UPDATE_STARTED", String::new()),
    };
    json!({
        "name": name,
        "route_prefix": app.route_prefix,
        "docs_path": null,
        "status": status,
        "message": app_message(status, &deployment),
        "last_deployed_time_s": app.last_deployed_time_s,
        // Every deploy of an application here is a new config (as a new version is in
        // Ray: new args, a new import path); a target_capacity change is not a deploy.
        "deployed_app_config": {
            "name": name,
            "route_prefix": app.route_prefix,
            "import_path": format!("apps:{name}"),
            "args": { "deployed": app.last_deployed_time_s },
        },
        "source": "declarative",
        "deployments": {
            deployment.clone(): {
                "name": deployment,
                "status": deployment_status,
                "status_trigger": trigger,
                "message": deployment_message,
                "deployment_config": {
                    "name": deployment,
                    "num_replicas": app.size.num_replicas,
                    "max_ongoing_requests": app.size.max_ongoing_requests,
                    "max_queued_requests": -1,
                    "user_config": null,
                    "graceful_shutdown_wait_loop_s": 2.0,
                    "graceful_shutdown_timeout_s": 20.0,
                    "health_check_period_s": 10.0,
                    "health_check_timeout_s": 30.0,
                    "ray_actor_options": {"num_cpus": 0.1},
                },
                "target_num_replicas": target_replicas,
                "required_resources": {"CPU": 0.1},
                "replicas": replicas(name, &deployment, &app.size, target_replicas, status),
                "recent_dead_replicas": [],
            }
        },
        "external_scaler_enabled": false,
        "deployment_topology": {
            "app_name": name,
            "nodes": {
                deployment.clone(): {
                    "name": deployment,
                    "app_name": name,
                    "outbound_deployments": [],
                    "is_ingress": true,
                }
            },
            "ingress_deployment": deployment,
        },
    })
}

/// `num_replicas` scaled by Serve's `target_capacity` (percent), as Ray 2.60's
/// `get_capacity_adjusted_num_replicas`: rounded half up, at least 1 unless the capacity
/// or the count is 0.
fn capacity_adjusted(num_replicas: u32, target_capacity: Option<f64>) -> u32 {
    match target_capacity {
        None => num_replicas,
        Some(t) if t >= 100.0 => num_replicas,
        Some(t) if t <= 0.0 || num_replicas == 0 => 0,
        Some(t) => ((f64::from(num_replicas) * t / 100.0 + 0.5).floor() as u32).max(1),
    }
}

/// The replicas of an application's deployment in `status`, as the captures list them:
/// RUNNING ones while it runs, STARTING while it deploys (03-deploying), one STOPPING and
/// one STARTING while unhealthy (05-unhealthy), none when it failed or goes away.
fn replicas(app: &str, deployment: &str, size: &AppSize, target: u32, status: &str) -> Vec<Value> {
    let states: Vec<&str> = match status {
        "RUNNING" => vec!["RUNNING"; size.running.min(target) as usize],
        "DEPLOYING" | "NOT_STARTED" => vec!["STARTING"; target as usize],
        "UNHEALTHY" => vec!["STOPPING", "STARTING"],
        _ => Vec::new(),
    };
    states
        .into_iter()
        .enumerate()
        .map(|(i, state)| {
            let id = hex_id(&format!("replica/{app}/{i}"), 8);
            json!({
                "node_id": node_id_for("127.0.0.1"),
                "node_ip": "127.0.0.1",
                "node_instance_id": "",
                "actor_id": actor_id_for("replica", &format!("{app}/{i}")),
                "actor_name": format!("SERVE_REPLICA::{app}#{deployment}#{id}"),
                "worker_id": hex_id(&format!("worker/replica/{app}/{i}"), 56),
                "log_file_path": format!("/serve/replica_{app}_{deployment}_{id}.log"),
                "replica_id": id,
                "state": state,
                "pid": 11759 + i,
                "start_time_s": 1795966900.5,
            })
        })
        .collect()
}

/// The application message Ray gives for `status` (04-mixed-settled, 05-unhealthy).
fn app_message(status: &str, deployment: &str) -> String {
    match status {
        "DEPLOY_FAILED" => format!("Failed to update the deployments ['{deployment}']."),
        "UNHEALTHY" => format!("The deployments ['{deployment}'] are UNHEALTHY."),
        _ => String::new(),
    }
}

/// `hello` → `Hello`.
fn deployment_name(app: &str) -> String {
    let mut chars = app.chars();
    match chars.next() {
        Some(first) => first.to_uppercase().chain(chars).collect(),
        None => "Ingress".to_string(),
    }
}

/// The Ray node id the simulator gives the node with IP `node_ip` (or, for a proxy
/// placed with [`SimDashboard::add_proxy`], `ip:port`): 56 hex characters, a
/// deterministic function of it.
pub fn node_id_for(node_ip: &str) -> String {
    hex_id(&format!("node/{node_ip}"), 56)
}

/// A Ray actor id: 24 hex characters of hash, then a job id `01000000` as in the captures.
fn actor_id_for(kind: &str, key: &str) -> String {
    format!("{}01000000", hex_id(&format!("actor/{kind}/{key}"), 24))
}

/// `len` hex characters derived from `seed` with FNV-1a (stable across Rust versions,
/// unlike `DefaultHasher`).
fn hex_id(seed: &str, len: usize) -> String {
    let mut out = String::with_capacity(len + 16);
    let mut block = 0u64;
    while out.len() < len {
        let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
        for byte in block.to_le_bytes().iter().chain(seed.as_bytes()) {
            hash ^= u64::from(*byte);
            hash = hash.wrapping_mul(0x0000_0100_0000_01b3);
        }
        out.push_str(&format!("{hash:016x}"));
        block += 1;
    }
    out.truncate(len);
    out
}

fn unix_time(t: SystemTime) -> f64 {
    t.duration_since(UNIX_EPOCH)
        .unwrap_or_default()
        .as_secs_f64()
}

pub(super) fn unix_now() -> f64 {
    unix_time(SystemTime::now())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_are_deterministic_and_shaped_like_ray() {
        let id = node_id_for("192.0.2.2");
        assert_eq!(id.len(), 56);
        assert!(id
            .bytes()
            .all(|b| b.is_ascii_hexdigit() && !b.is_ascii_uppercase()));
        assert_eq!(id, node_id_for("192.0.2.2"));
        assert_ne!(id, node_id_for("192.0.2.3"));
        let actor = actor_id_for("proxy", "192.0.2.2");
        assert_eq!(actor.len(), 32);
        assert!(actor.ends_with("01000000"));
        assert_eq!(deployment_name("hello"), "Hello");
    }
}
