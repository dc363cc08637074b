//! The admin HTTP server: health, readiness, Prometheus metrics and debug views.
//!
//! - `/healthz`: the process is up;
//! - `/readyz`: 200 once the source has its first full state (for Kubernetes, every
//!   watch has listed) and the first snapshot is built (503 before), and while no
//!   supervised component is down (503 naming it, until its restart);
//! - `/metrics`: Prometheus text;
//! - `/debug/snapshot`: every resource of the current snapshot with its version, as proto
//!   JSON (as Envoy's `/config_dump`);
//! - `/debug/clients`: every connected Envoy, its subscriptions and ACK/NACK state, and
//!   per resource what it holds against the current snapshot (CSDS `ClientConfig`);
//! - `/debug/state`: per cluster, where its proxies come from (the source, or discovered
//!   from its dashboard), each proxy's probe state and endpoint health with the reason,
//!   and what the cluster's dashboard says (application statuses, staleness);
//!   the source's state (each Kubernetes watch, how stale, what it skipped and why);
//!   the proxies the address policy refused (`refused_proxies`, with the reason: the
//!   first 100, with `refused_proxies_total`, `refused_proxies_shown` and
//!   `refused_proxies_by_reason`, so the page stays small however many there are).

use std::sync::Arc;

use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Json, Router};
use serde_json::json;
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use crate::live::dashboards::DashboardStates;
use crate::live::health::HealthMap;
use crate::live::prober::ProbeStates;
use crate::metrics::Metrics;
use crate::model::Model;
use crate::pipeline::switchover::Switchover;
use crate::source::SourceStatus;
use crate::xds::{Clients, ResourceType, Snapshot};

#[derive(Clone)]
pub struct AdminState {
    /// The supervised components, for `/readyz` and `/debug/state`.
    pub components: Arc<crate::supervisor::Components>,
    pub metrics: Arc<Metrics>,
    pub clients: Arc<Clients>,
    /// `None` until the first snapshot is built.
    pub snapshots: watch::Receiver<Option<Arc<Snapshot>>>,
    pub live: LiveViews,
}

/// What `/debug/state` shows: the latest value of each channel, each written by its own
/// task.
#[derive(Clone)]
pub struct LiveViews {
    /// The effective model.
    pub models: watch::Receiver<Arc<Model>>,
    pub probes: watch::Receiver<Arc<ProbeStates>>,
    pub dashboards: watch::Receiver<Arc<DashboardStates>>,
    pub health: watch::Receiver<Arc<HealthMap>>,
    pub switchover: watch::Receiver<Arc<Switchover>>,
    pub source: watch::Receiver<Arc<SourceStatus>>,
    /// Proxies the address policy left out.
    pub refused: watch::Receiver<Arc<Vec<crate::live::discovery::RefusedProxy>>>,
}

pub fn router(state: AdminState) -> Router {
    Router::new()
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics))
        .route("/debug/snapshot", get(snapshot))
        .route("/debug/clients", get(clients))
        .route("/debug/state", get(live_state))
        .with_state(state)
}

pub async fn serve(
    listener: TcpListener,
    state: AdminState,
    shutdown: CancellationToken,
) -> std::io::Result<()> {
    let listener = crate::admin_listener::BoundedAdminListener::new(
        listener,
        crate::admin_listener::AdminLimits::default(),
    );
    axum::serve(listener, router(state))
        .with_graceful_shutdown(shutdown.cancelled_owned())
        .await
}

async fn readyz(State(state): State<AdminState>) -> Response {
    let version = state
        .snapshots
        .borrow()
        .as_ref()
        .map(|s| s.version().to_string());
    let synced = state.live.source.borrow().synced;
    readiness(&state.components.down(), synced, version.as_deref()).into_response()
}

/// `/readyz`'s answer: every component up, the source synced, a snapshot built.
fn readiness(
    down: &[(&'static str, String)],
    synced: bool,
    version: Option<&str>,
) -> (StatusCode, String) {
    if !down.is_empty() {
        let mut text =
            String::from("not ready: a component is down (restarting; see /debug/state)\n");
        for (name, why) in down {
            text.push_str(&format!("{name}: {why}\n"));
        }
        return (StatusCode::SERVICE_UNAVAILABLE, text);
    }
    match version {
        Some(v) => (StatusCode::OK, format!("ready: snapshot {v}\n")),
        None if !synced => (
            StatusCode::SERVICE_UNAVAILABLE,
            "not ready: the source has not delivered its first full state (see /debug/state)\n"
                .into(),
        ),
        None => (
            StatusCode::SERVICE_UNAVAILABLE,
            "not ready: no snapshot built yet\n".into(),
        ),
    }
}

async fn metrics(State(state): State<AdminState>) -> Response {
    (
        [(
            header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        state.metrics.render(),
    )
        .into_response()
}

async fn snapshot(State(state): State<AdminState>) -> Response {
    let Some(snapshot) = state.snapshots.borrow().clone() else {
        return (
            StatusCode::SERVICE_UNAVAILABLE,
            Json(json!({"error": "no snapshot yet"})),
        )
            .into_response();
    };
    let mut types = serde_json::Map::new();
    for ty in ResourceType::ALL {
        let resources: Vec<_> = snapshot
            .resources(ty)
            .values()
            .map(|r| {
                json!({
                    "name": &*r.name,
                    "version": &*r.version,
                    "cluster_refs": r.cluster_refs.iter().map(|c| &**c).collect::<Vec<_>>(),
                    "resource": r.to_json(),
                })
            })
            .collect();
        types.insert(
            ty.label().into(),
            json!({"type_url": ty.type_url(), "resources": resources}),
        );
    }
    Json(json!({"version": snapshot.version(), "types": types})).into_response()
}

async fn clients(State(state): State<AdminState>) -> Response {
    let snapshot = state.snapshots.borrow().clone();
    Json(json!({"clients": state.clients.report(snapshot.as_deref())})).into_response()
}

async fn live_state(State(state): State<AdminState>) -> Response {
    let live = &state.live;
    let model = live.models.borrow().clone();
    let probes = live.probes.borrow().clone();
    let dashboards = live.dashboards.borrow().clone();
    let health = live.health.borrow().clone();
    let switchover = live.switchover.borrow().clone();
    let mut services = Vec::new();
    for service in model.services() {
        let mut clusters = Vec::new();
        for cluster in &service.clusters {
            let name = service.envoy_cluster_name(&cluster.name);
            let proxies: Vec<_> = cluster
                .proxies
                .iter()
                .map(|p| {
                    json!({
                        "address": p.address.to_string(),
                        "node_type": p.node_type.as_str(),
                        "probe": probes.proxies.get(&p.address),
                        "endpoint": health.endpoints.get(&(name.clone(), p.address)),
                    })
                })
                .collect();
            clusters.push(json!({
                "name": cluster.name,
                "envoy_cluster": name,
                "role": if cluster.name == service.active_cluster { "active" } else if service.pending_cluster.as_deref() == Some(cluster.name.as_str()) { "pending" } else { "other" },
                "fail_open": health.cluster(&name).fail_open,
                "ready_proxies": health.cluster(&name).ready,
                "proxies_from": if cluster.discover { "dashboard" } else { "source" },
                "proxies": proxies,
                "dashboard": dashboards.clusters.get(&name),
            }));
        }
        services.push(json!({
            "name": service.key(),
            "switchover": switchover.services.get(&service.key()),
            "head_proxy": format!("{:?}", service.policy.head_proxy).to_lowercase(),
            "clusters": clusters,
        }));
    }
    let source = live.source.borrow().clone();
    let now = std::time::SystemTime::now()
        .duration_since(std::time::SystemTime::UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0);
    let watches: Vec<_> = source
        .watches
        .iter()
        .map(|w| {
            let mut v = json!(w);
            // How old the state this watch serves may be: since it started failing.
            v["stale_seconds"] = json!(w.failing_since_unix.map(|t| (now - t).max(0.0)));
            v
        })
        .collect();
    let refused = live.refused.borrow().clone();
    let refused = crate::live::discovery::RefusedSummary::of(&refused);
    Json(json!({
        "source": {
            "source": source.source,
            "synced": source.synced,
            "watches": watches,
            "unrouted": source.unrouted,
            "problems": source.problems,
            "kuberay_application_statuses": source.kuberay_application_statuses,
        },
        "components": state.components.report(),
        "rayservices": services,
        "refused_proxies": refused.shown,
        "refused_proxies_shown": refused.shown.len(),
        "refused_proxies_total": refused.total,
        "refused_proxies_by_reason": refused.by_reason,
        "probes_complete": probes.complete,
    }))
    .into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_component_that_is_down_makes_readyz_fail_and_names_it() {
        assert_eq!(readiness(&[], true, Some("v1")).0, StatusCode::OK);
        let (code, text) = readiness(&[("prober", "panicked: boom".into())], true, Some("v1"));
        assert_eq!(code, StatusCode::SERVICE_UNAVAILABLE);
        assert!(text.contains("prober: panicked: boom"), "{text}");
        assert_eq!(
            readiness(&[], false, None).0,
            StatusCode::SERVICE_UNAVAILABLE
        );
        assert!(readiness(&[], true, None).1.contains("no snapshot"));
    }
}
