//! Endpoint health: the pure combination of everything ray-xds knows about a proxy into
//! the `health_status` Envoy gets for it.
//!
//! For each proxy, in order:
//! 1. its probe state (unknown until first probed; Envoy treats unknown as healthy);
//! 2. DRAINING if its cluster's dashboard lists its proxy (by address, else its node's IP)
//!    as DRAINING;
//! 3. DRAINING ("no new traffic") if it is healthy but does not serve every route prefix
//!    of its cluster's RUNNING applications (from the dashboard) in its `/-/routes`, while
//!    another healthy proxy of the cluster does (a proxy that just started and has not
//!    loaded its route table yet; if no proxy serves them all, the routes are simply not
//!    re-read yet, and nobody is held back);
//! 4. fail-open: if every proxy of a cluster that is not draining is unhealthy, ray-xds
//!    cannot tell a dead cluster from a broken path between itself and the proxies, so it
//!    publishes those proxies healthy and lets Envoy's own outlier detection decide;
//!    publishing them unhealthy could only cause an outage of its own making;
//! 5. the RayService's `head_proxy` policy: `exclude` drains the head proxy, `include`
//!    leaves it alone, `fallback` drains it while any worker proxy of its cluster is
//!    healthy (or unknown).
//!
//! DRAINING keeps in-flight requests and takes no new ones.

use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;

use serde::Serialize;

use super::dashboard::{AppStatus, ProxyStatus};
use super::dashboards::DashboardStates;
use super::probe::ProbeState;
use super::prober::ProbeStates;
use crate::model::{HeadProxy, Model, NodeType};

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum EndpointHealth {
    Unknown,
    Healthy,
    Unhealthy,
    Draining,
}

/// An endpoint's health and the reason for it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Verdict {
    pub health: EndpointHealth,
    pub reason: String,
}

/// The health of every endpoint, keyed by Envoy cluster name and proxy address.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct HealthMap {
    pub endpoints: BTreeMap<(String, SocketAddr), Verdict>,
    /// Envoy clusters published fail-open.
    pub fail_open: BTreeSet<String>,
}

impl HealthMap {
    pub fn health(&self, cluster: &str, address: SocketAddr) -> EndpointHealth {
        self.endpoints
            .get(&(cluster.to_string(), address))
            .map_or(EndpointHealth::Unknown, |v| v.health)
    }
}

pub fn assess(model: &Model, probes: &ProbeStates, dashboards: &DashboardStates) -> HealthMap {
    let mut out = HealthMap::default();
    for service in model.services() {
        for cluster in &service.clusters {
            let name = service.envoy_cluster_name(&cluster.name);
            let dashboard = dashboards
                .clusters
                .get(&name)
                .and_then(|d| d.status.as_ref());
            // Route prefixes of the applications the dashboard says are RUNNING; enforced
            // only while some healthy proxy of the cluster serves them all, so that a new
            // application (or routes not re-read yet) never drains the whole cluster.
            let required: BTreeSet<String> = dashboard
                .map(|d| {
                    d.applications
                        .values()
                        .filter(|a| a.status == AppStatus::Running)
                        .filter_map(|a| a.route_prefix.clone())
                        .collect()
                })
                .unwrap_or_default();
            let someone_serves_all = cluster.proxies.iter().any(|p| {
                probes.proxies.get(&p.address).is_some_and(|probe| {
                    probe.state == ProbeState::Healthy
                        && probe.routes.as_ref().is_some_and(|r| required.is_subset(r))
                })
            });
            let required = if someone_serves_all {
                required
            } else {
                BTreeSet::new()
            };
            let mut verdicts: Vec<(SocketAddr, NodeType, Verdict)> = cluster
                .proxies
                .iter()
                .map(|proxy| {
                    let probe = probes.proxies.get(&proxy.address);
                    let mut v = match probe.map(|p| p.state) {
                        None | Some(ProbeState::Unknown) => {
                            verdict(EndpointHealth::Unknown, "not probed yet")
                        }
                        Some(ProbeState::Healthy) => {
                            verdict(EndpointHealth::Healthy, "probe healthy")
                        }
                        Some(ProbeState::Unhealthy) => Verdict {
                            health: EndpointHealth::Unhealthy,
                            reason: format!(
                                "probe: {}",
                                probe.map(|p| p.reason.as_str()).unwrap_or("")
                            ),
                        },
                        Some(ProbeState::Draining) => {
                            verdict(EndpointHealth::Draining, "proxy says it is draining")
                        }
                    };
                    if proxy.draining {
                        v = verdict(
                            EndpointHealth::Draining,
                            "the source says it is going away (pod terminating)",
                        );
                    }
                    if let Some(ProxyStatus::Draining) =
                        dashboard.and_then(|d| d.proxy_status_at(proxy.address))
                    {
                        v = verdict(
                            EndpointHealth::Draining,
                            "dashboard lists its proxy as DRAINING",
                        );
                    }
                    if v.health == EndpointHealth::Healthy && !required.is_empty() {
                        match probe.and_then(|p| p.routes.as_ref()) {
                            Some(routes) if required.is_subset(routes) => {}
                            Some(routes) => {
                                let missing: Vec<&String> = required.difference(routes).collect();
                                v = Verdict {
                                    health: EndpointHealth::Draining,
                                    reason: format!(
                                        "does not serve route prefixes {missing:?} yet"
                                    ),
                                };
                            }
                            None => {
                                v = verdict(
                                    EndpointHealth::Draining,
                                    "its routes are not known yet",
                                )
                            }
                        }
                    }
                    (proxy.address, proxy.node_type, v)
                })
                .collect();

            let serving = verdicts
                .iter()
                .filter(|(_, _, v)| v.health != EndpointHealth::Draining);
            let (mut candidates, mut all_unhealthy) = (0, true);
            for (_, _, v) in serving {
                candidates += 1;
                all_unhealthy &= v.health == EndpointHealth::Unhealthy;
            }
            if candidates > 0 && all_unhealthy {
                for (_, _, v) in verdicts
                    .iter_mut()
                    .filter(|(_, _, v)| v.health == EndpointHealth::Unhealthy)
                {
                    *v = Verdict {
                        health: EndpointHealth::Healthy,
                        reason: format!(
                            "fail-open: every proxy of the cluster fails its probe ({})",
                            v.reason
                        ),
                    };
                }
                out.fail_open.insert(name.clone());
            }

            let worker_up = verdicts.iter().any(|(_, t, v)| {
                *t == NodeType::Worker
                    && matches!(v.health, EndpointHealth::Healthy | EndpointHealth::Unknown)
            });
            for (_, node_type, v) in verdicts.iter_mut() {
                if *node_type != NodeType::Head || v.health == EndpointHealth::Draining {
                    continue;
                }
                match service.policy.head_proxy {
                    HeadProxy::Include => {}
                    HeadProxy::Exclude => {
                        *v = verdict(EndpointHealth::Draining, "head_proxy: exclude")
                    }
                    HeadProxy::Fallback if worker_up => {
                        *v = verdict(
                            EndpointHealth::Draining,
                            "head_proxy: fallback, a worker proxy is healthy",
                        )
                    }
                    HeadProxy::Fallback => {}
                }
            }
            for (address, _, v) in verdicts {
                out.endpoints.insert((name.clone(), address), v);
            }
        }
    }
    out
}

fn verdict(health: EndpointHealth, reason: &str) -> Verdict {
    Verdict {
        health,
        reason: reason.into(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::live::dashboard::{parse, ServeStatus};
    use crate::live::dashboards::ClusterDashboard;
    use crate::live::probe::ProxyProbe;
    use crate::model::test_support::service;
    use std::time::SystemTime;

    const CLUSTER: &str = "default/a/a1";

    fn model(policy: HeadProxy) -> Model {
        let mut s = service("a", "a1", &[8000, 8001, 8002]);
        s.policy.head_proxy = policy;
        Model::new(vec![s]).unwrap()
    }

    fn addr(port: u16) -> SocketAddr {
        SocketAddr::from(([127, 0, 0, 1], port))
    }

    fn probes(states: &[(u16, ProbeState)]) -> ProbeStates {
        let mut out = ProbeStates::default();
        for (port, state) in states {
            let mut p = ProxyProbe::new(SystemTime::UNIX_EPOCH);
            p.state = *state;
            p.routes = Some(["/".to_string()].into());
            out.proxies.insert(addr(*port), p);
        }
        out
    }

    fn health(map: &HealthMap, port: u16) -> EndpointHealth {
        map.health(CLUSTER, addr(port))
    }

    use EndpointHealth::*;
    use ProbeState as P;

    #[test]
    fn head_proxy_policies() {
        let all_up = probes(&[(8000, P::Healthy), (8001, P::Healthy), (8002, P::Healthy)]);
        let none = DashboardStates::default();
        let m = assess(&model(HeadProxy::Include), &all_up, &none);
        assert_eq!(health(&m, 8000), Healthy);
        let m = assess(&model(HeadProxy::Exclude), &all_up, &none);
        assert_eq!(health(&m, 8000), Draining);
        let m = assess(&model(HeadProxy::Fallback), &all_up, &none);
        assert_eq!(health(&m, 8000), Draining, "a worker is healthy");
        assert_eq!(health(&m, 8001), Healthy);
        // Workers down: the head takes the traffic.
        let workers_down = probes(&[
            (8000, P::Healthy),
            (8001, P::Unhealthy),
            (8002, P::Unhealthy),
        ]);
        let m = assess(&model(HeadProxy::Fallback), &workers_down, &none);
        assert_eq!(health(&m, 8000), Healthy);
        assert_eq!(health(&m, 8001), Unhealthy);
        assert!(m.fail_open.is_empty());
    }

    #[test]
    fn fail_open_when_every_serving_proxy_fails() {
        let down = probes(&[
            (8000, P::Unhealthy),
            (8001, P::Unhealthy),
            (8002, P::Draining),
        ]);
        let m = assess(
            &model(HeadProxy::Include),
            &down,
            &DashboardStates::default(),
        );
        assert_eq!(health(&m, 8000), Healthy);
        assert_eq!(health(&m, 8001), Healthy);
        assert_eq!(health(&m, 8002), Draining, "draining stays draining");
        assert!(m.fail_open.contains(CLUSTER));
        assert!(m.endpoints[&(CLUSTER.to_string(), addr(8001))]
            .reason
            .starts_with("fail-open"));
        // One proxy healthy: no fail-open.
        let one = probes(&[
            (8000, P::Unhealthy),
            (8001, P::Healthy),
            (8002, P::Unhealthy),
        ]);
        let m = assess(
            &model(HeadProxy::Include),
            &one,
            &DashboardStates::default(),
        );
        assert_eq!(health(&m, 8000), Unhealthy);
        assert!(m.fail_open.is_empty());
    }

    fn dashboard(status: ServeStatus) -> DashboardStates {
        let mut d = DashboardStates::default();
        d.clusters.insert(
            CLUSTER.to_string(),
            ClusterDashboard {
                status: Some(status),
                ..ClusterDashboard::new("http://x".into())
            },
        );
        d
    }

    #[test]
    fn dashboard_draining_and_missing_routes_take_no_new_traffic() {
        let fixture = std::fs::read(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tests/fixtures/ray-serve-2.60/02-running.json"
        ))
        .unwrap();
        let mut status = parse(&fixture).unwrap();
        // The capture's one proxy runs on 192.0.2.2; make it ours and draining.
        let proxy = status.proxies.values_mut().next().unwrap();
        proxy.node_ip = "127.0.0.1".into();
        proxy.status = ProxyStatus::Draining;
        let up = probes(&[(8000, P::Healthy), (8001, P::Healthy), (8002, P::Healthy)]);
        let m = assess(&model(HeadProxy::Include), &up, &dashboard(status.clone()));
        assert_eq!(health(&m, 8001), Draining);

        // Healthy in the dashboard, but the proxies serve "/" while the app is at "/hello".
        status.proxies.values_mut().next().unwrap().status = ProxyStatus::Healthy;
        // Nobody serves /hello: nobody is held back for it.
        let m = assess(&model(HeadProxy::Include), &up, &dashboard(status.clone()));
        assert_eq!(health(&m, 8001), Healthy);
        // One proxy serves it: the others, lagging behind, take no new traffic.
        let mut one = up.clone();
        one.proxies.get_mut(&addr(8002)).unwrap().routes = Some(["/hello".to_string()].into());
        let m = assess(&model(HeadProxy::Include), &one, &dashboard(status.clone()));
        assert_eq!(health(&m, 8001), Draining);
        assert_eq!(health(&m, 8002), Healthy);
        assert!(m.endpoints[&(CLUSTER.to_string(), addr(8001))]
            .reason
            .contains("/hello"));
        // A DEPLOYING application's prefix is not required.
        let mut deploying = status.clone();
        deploying.applications.get_mut("hello").unwrap().status = AppStatus::Deploying;
        let m = assess(&model(HeadProxy::Include), &one, &dashboard(deploying));
        assert_eq!(health(&m, 8001), Healthy);
        let mut serving = up.clone();
        for p in serving.proxies.values_mut() {
            p.routes = Some(["/hello".to_string()].into());
        }
        let m = assess(&model(HeadProxy::Include), &serving, &dashboard(status));
        assert_eq!(health(&m, 8001), Healthy);
    }

    #[test]
    fn unprobed_proxies_are_unknown() {
        let m = assess(
            &model(HeadProxy::Include),
            &ProbeStates::default(),
            &DashboardStates::default(),
        );
        assert_eq!(health(&m, 8001), Unknown);
        assert!(m.fail_open.is_empty());
    }
}
