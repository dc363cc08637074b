//! Whether a RayCluster is ready to take a RayService's traffic, or one application's, and
//! which Envoy clusters every Envoy must warm before it does. Pure.
//!
//! - A whole RayCluster ([`readiness`]): its dashboard answered since the switch began and
//!   says every application serves (`Application::serves`: RUNNING, or DEPLOYING only to
//!   start or stop replicas, as a raised `target_capacity` does); enough of its proxies
//!   ready (probe healthy,
//!   serving every route prefix), and of its gRPC proxies when it serves gRPC.
//! - One application ([`app_readiness`]): the same dashboard, saying *that* application
//!   serves (another may still be deploying, but none has failed); and where its requests would go there
//!   ready: with direct ingress, a ready ingress replica of it, else enough ready proxies
//!   (each protocol it is served over).
//!
//! A RayCluster's dashboard statuses count only from an answer given since the switch
//! began, so a status read before an upgrade is never taken for readiness.

use std::time::SystemTime;

use crate::live::dashboard::{AppStatus, ServeStatus};
use crate::live::dashboards::DashboardStates;
use crate::live::health::HealthMap;
use crate::model::{Protocol, RayService};

/// What a switch moves: a RayService's traffic as a whole, or one application's.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Unit<'a> {
    Service,
    Application(&'a str),
}

/// Whether `cluster` of `service` serves gRPC: the source says so, or (proxies discovered
/// from its dashboard) health has a gRPC cluster for it.
pub(crate) fn serves_grpc(service: &RayService, cluster: &str, health: &HealthMap) -> bool {
    service.cluster(cluster).is_some_and(|c| c.serves_grpc())
        || health
            .clusters
            .contains_key(&service.envoy_grpc_cluster_name(cluster))
}

/// The Envoy clusters a route may send `cluster`'s traffic of `unit` to, each of which
/// every Envoy warms before traffic moves: its HTTP proxies, its gRPC proxies when it
/// serves gRPC, and with direct ingress each application's replicas (`translate`), or the
/// one application's.
pub(crate) fn routed_clusters(
    service: &RayService,
    cluster: &str,
    unit: Unit<'_>,
    health: &HealthMap,
) -> Vec<String> {
    let mut out = vec![service.envoy_cluster_name(cluster)];
    if serves_grpc(service, cluster, health) {
        out.push(service.envoy_grpc_cluster_name(cluster));
    }
    if let Some(c) = service.cluster(cluster).filter(|c| c.direct_ingress) {
        let apps = c.applications.iter().filter(|a| match unit {
            Unit::Service => true,
            Unit::Application(name) => a.name == name,
        });
        for app in apps {
            out.push(service.envoy_app_cluster_name(cluster, &app.name, Protocol::Http));
            if c.serves_grpc() {
                out.push(service.envoy_app_cluster_name(cluster, &app.name, Protocol::Grpc));
            }
        }
    }
    out
}

/// `cluster`'s dashboard answer, if it may be read for readiness: answered, answering
/// now, and since the switch began. `Ok(None)` for a cluster without a dashboard.
fn fresh_status<'a>(
    service: &RayService,
    cluster: &str,
    dashboards: &'a DashboardStates,
    answered_since: Option<SystemTime>,
) -> Result<Option<&'a ServeStatus>, String> {
    let Some(c) = service.cluster(cluster) else {
        return Err(format!("cluster {cluster} is not listed"));
    };
    if c.dashboard.is_none() {
        return Ok(None);
    }
    let d = dashboards
        .clusters
        .get(&service.envoy_cluster_name(cluster));
    let Some(status) = d.and_then(|d| d.status.as_deref()) else {
        return Err("its dashboard has not answered yet".into());
    };
    if d.is_some_and(|d| d.stale) {
        return Err("its dashboard does not answer now".into());
    }
    if let Some(since) = answered_since {
        let since = since
            .duration_since(SystemTime::UNIX_EPOCH)
            .map(|d| d.as_secs_f64())
            .unwrap_or(0.0);
        if d.and_then(|d| d.last_success_unix)
            .is_none_or(|t| t < since)
        {
            return Err("waiting for its dashboard to answer since the switch began".into());
        }
    }
    Ok(Some(status))
}

/// Whether `protocol`'s proxies of `cluster` are ready enough (at least `need`).
fn proxies_ready(
    service: &RayService,
    cluster: &str,
    protocol: Protocol,
    health: &HealthMap,
    need: u32,
) -> Result<(), String> {
    let c = service.cluster(cluster);
    let ready = health
        .cluster(&service.envoy_cluster_name_for(cluster, protocol))
        .ready;
    if ready >= need {
        return Ok(());
    }
    Err(match protocol {
        Protocol::Http => format!(
            "{ready} of {} proxies healthy and serving every route (need {need})",
            c.map_or(0, |c| c.proxies.len()),
        ),
        Protocol::Grpc => format!(
            "{ready} of {} gRPC proxies healthy (need {need})",
            c.map_or(0, |c| c.proxies.iter().filter(|p| p.grpc.is_some()).count()),
        ),
    })
}

/// Whether `cluster` of `service` is ready for traffic, and why not.
pub(crate) fn readiness(
    service: &RayService,
    cluster: &str,
    health: &HealthMap,
    dashboards: &DashboardStates,
    min_ready_proxies: u32,
    answered_since: Option<SystemTime>,
) -> Result<(), String> {
    if let Some(status) = fresh_status(service, cluster, dashboards, answered_since)? {
        if !status.all_serving() {
            let waiting: Vec<String> = status
                .applications
                .iter()
                .filter(|(_, a)| !a.serves())
                .map(|(n, a)| format!("{n} {}", a.status.as_str()))
                .collect();
            return Err(if waiting.is_empty() {
                "no application deployed yet".into()
            } else {
                format!("applications not RUNNING: {}", waiting.join(", "))
            });
        }
    }
    let need = min_ready_proxies.max(1);
    proxies_ready(service, cluster, Protocol::Http, health, need)?;
    // gRPC moves with HTTP (one weight per RayCluster): both must be ready. The source
    // says a cluster serves gRPC, or (proxies discovered from its dashboard) health does.
    if serves_grpc(service, cluster, health) {
        proxies_ready(service, cluster, Protocol::Grpc, health, need)?;
    }
    Ok(())
}

/// Whether `unit` (the RayService, or one application) of `service` is ready on `cluster`
/// ([`readiness`] or [`app_readiness`]).
pub(crate) fn unit_readiness(
    service: &RayService,
    cluster: &str,
    unit: Unit<'_>,
    health: &HealthMap,
    dashboards: &DashboardStates,
    min_ready_proxies: u32,
    answered_since: Option<SystemTime>,
) -> Result<(), String> {
    match unit {
        Unit::Service => readiness(
            service,
            cluster,
            health,
            dashboards,
            min_ready_proxies,
            answered_since,
        ),
        Unit::Application(app) => app_readiness(
            service,
            cluster,
            app,
            health,
            dashboards,
            min_ready_proxies,
            answered_since,
        ),
    }
}

/// Whether application `app` of `service` may move to `cluster`, and why not: its status
/// there RUNNING (the others' may still be deploying, but none DEPLOY_FAILED or UNHEALTHY),
/// and where its requests would go
/// ready, for each protocol the cluster serves: its ingress replicas (direct ingress: at
/// least one ready), else the proxies (`min_ready_proxies`).
pub(crate) fn app_readiness(
    service: &RayService,
    cluster: &str,
    app: &str,
    health: &HealthMap,
    dashboards: &DashboardStates,
    min_ready_proxies: u32,
    answered_since: Option<SystemTime>,
) -> Result<(), String> {
    if let Some(status) = fresh_status(service, cluster, dashboards, answered_since)? {
        match status.applications.get(app) {
            Some(a) if a.serves() => {}
            Some(a) => return Err(format!("{app} is {}", a.status.as_str())),
            None => return Err(format!("{app} is not deployed there")),
        }
        // A failed application says the new cluster's configuration is bad (KubeRay never
        // promotes it): nothing moves to it application by application.
        let failed = failed_in(status);
        if !failed.is_empty() {
            return Err(format!(
                "another application failed there: {}",
                failed.join(", ")
            ));
        }
    }
    let c = service.cluster(cluster);
    let need = min_ready_proxies.max(1);
    let mut protocols = vec![Protocol::Http];
    if serves_grpc(service, cluster, health) {
        protocols.push(Protocol::Grpc);
    }
    for protocol in protocols {
        let replicas = c
            .filter(|c| c.direct_ingress)
            .and_then(|c| c.application(app))
            .is_some_and(|a| !a.replicas(protocol).is_empty());
        if replicas {
            let name = service.envoy_app_cluster_name(cluster, app, protocol);
            if health.cluster(&name).ready >= 1 {
                continue;
            }
        }
        proxies_ready(service, cluster, protocol, health, need)?;
    }
    Ok(())
}

/// The applications of a dashboard answer that failed (`DEPLOY_FAILED`, `UNHEALTHY`), each
/// with its status.
fn failed_in(status: &ServeStatus) -> Vec<String> {
    status
        .applications
        .iter()
        .filter(|(_, a)| matches!(a.status, AppStatus::DeployFailed | AppStatus::Unhealthy))
        .map(|(n, a)| format!("{n} {}", a.status.as_str()))
        .collect()
}

/// Whether `cluster`'s dashboard, answering now, says an application failed there: its
/// configuration is bad, and applications that moved to it on their own go back.
pub(crate) fn has_failed_application(
    service: &RayService,
    cluster: &str,
    dashboards: &DashboardStates,
) -> bool {
    fresh_status(service, cluster, dashboards, None)
        .ok()
        .flatten()
        .is_some_and(|status| !failed_in(status).is_empty())
}
