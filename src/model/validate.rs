//! [`Model::new`]: a set of RayServices sorted and checked into a [`Model`].
//!
//! What it checks is what Envoy would otherwise reject, or what would make two inputs
//! route alike but differ: every name a DNS label and every host a virtual-host domain;
//! each RayService, host, cluster, proxy address, application and route prefix once; an
//! active (and pending) cluster that exists; a discovering cluster with a dashboard; one
//! address one protocol everywhere. The order of the input never matters.

use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;

use super::names::{check_application_name, check_route_prefix, is_dns_label, validate_host};
use super::{Model, Protocol, RayCluster, RayService};

/// Why a set of RayServices cannot become a [`Model`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ModelError {
    #[error("rayservice {service}: {reason}")]
    InvalidService { service: String, reason: String },
    #[error("rayservice {service} and {other} both claim host {host:?}; each host must route to one RayService")]
    DuplicateHost {
        service: String,
        other: String,
        host: String,
    },
    #[error("rayservice {service} is defined twice")]
    DuplicateService { service: String },
}

impl RayService {
    fn validate(&self) -> Result<(), String> {
        for (what, value) in [("namespace", &self.namespace), ("name", &self.name)] {
            if !is_dns_label(value) {
                return Err(format!(
                    "{what} {value:?} is not a DNS label (lowercase letters, digits and '-', at most 63)"
                ));
            }
        }
        if self.hosts.is_empty() {
            return Err("hosts is empty: it would be unreachable".into());
        }
        let mut seen = BTreeSet::new();
        for host in &self.hosts {
            validate_host(host)?;
            if !seen.insert(host.to_ascii_lowercase()) {
                return Err(format!("host {host:?} is listed twice"));
            }
        }
        let mut names = BTreeSet::new();
        for cluster in &self.clusters {
            if !names.insert(cluster.name.as_str()) {
                return Err(format!("cluster {} is defined twice", cluster.name));
            }
            validate_cluster(cluster)?;
        }
        if self.cluster(&self.active_cluster).is_none() {
            return Err(format!(
                "active_cluster {:?} is not one of its clusters",
                self.active_cluster
            ));
        }
        if let Some(pending) = &self.pending_cluster {
            if pending == &self.active_cluster {
                return Err(format!(
                    "pending_cluster {pending:?} is also the active cluster"
                ));
            }
            if self.cluster(pending).is_none() {
                return Err(format!(
                    "pending_cluster {pending:?} is not one of its clusters"
                ));
            }
        }
        // (A cap with no pending cluster, left behind by a promotion, caps nothing.)
        match self.pending_traffic_cap {
            Some(cap) if cap > 100 => Err(format!("pending_traffic_percent {cap} is over 100")),
            _ => Ok(()),
        }
    }
}

/// One cluster's own invariants: a DNS-label name, a dashboard when it discovers, each
/// address once (proxies, gRPC proxies, replicas), each application and route prefix once.
fn validate_cluster(cluster: &RayCluster) -> Result<(), String> {
    if !is_dns_label(&cluster.name) {
        return Err(format!(
            "cluster name {:?} is not a DNS label",
            cluster.name
        ));
    }
    if cluster.discover && cluster.dashboard.is_none() {
        return Err(format!(
            "cluster {} discovers its proxies from its dashboard but has no dashboard",
            cluster.name
        ));
    }
    let mut addrs = BTreeSet::new();
    for proxy in &cluster.proxies {
        if !addrs.insert(proxy.address) {
            return Err(format!(
                "cluster {}: proxy {} is listed twice",
                cluster.name, proxy.address
            ));
        }
    }
    for grpc in cluster.proxies.iter().filter_map(|p| p.grpc) {
        if !addrs.insert(grpc) {
            return Err(format!(
                "cluster {}: gRPC address {grpc} is listed twice, or is also an HTTP proxy's",
                cluster.name
            ));
        }
    }
    let (mut apps, mut prefixes) = (BTreeSet::new(), BTreeSet::new());
    for app in &cluster.applications {
        check_application_name(&app.name)
            .map_err(|why| format!("cluster {}: {why}", cluster.name))?;
        if !apps.insert(app.name.as_str()) {
            return Err(format!(
                "cluster {}: application {:?} is listed twice",
                cluster.name, app.name
            ));
        }
        if let Some(prefix) = &app.route_prefix {
            check_route_prefix(prefix).map_err(|why| format!("cluster {}: {why}", cluster.name))?;
            if !prefixes.insert(prefix.as_str()) {
                return Err(format!(
                    "cluster {}: route prefix {prefix:?} is listed twice",
                    cluster.name
                ));
            }
        }
        for replica in app.http_replicas.iter().chain(&app.grpc_replicas) {
            if !addrs.insert(*replica) {
                return Err(format!(
                    "cluster {}: replica {replica} of {:?} is listed twice, or is also a proxy's",
                    cluster.name, app.name
                ));
            }
        }
    }
    Ok(())
}

impl Model {
    /// Builds a model, checking every invariant. Order of the input does not matter:
    /// the model is sorted so that equal inputs give equal models (and equal versions).
    pub fn new(mut services: Vec<RayService>) -> Result<Model, ModelError> {
        for service in &mut services {
            service.clusters.sort_by(|a, b| a.name.cmp(&b.name));
            for cluster in &mut service.clusters {
                cluster.proxies.sort();
                cluster.applications.sort_by(|a, b| a.name.cmp(&b.name));
                for app in &mut cluster.applications {
                    app.http_replicas.sort();
                    app.grpc_replicas.sort();
                }
            }
        }
        services.sort_by(|a, b| (&a.namespace, &a.name).cmp(&(&b.namespace, &b.name)));
        let mut hosts: BTreeMap<String, String> = BTreeMap::new();
        for (i, service) in services.iter().enumerate() {
            if i > 0
                && services[i - 1].namespace == service.namespace
                && services[i - 1].name == service.name
            {
                return Err(ModelError::DuplicateService {
                    service: service.key(),
                });
            }
            service
                .validate()
                .map_err(|reason| ModelError::InvalidService {
                    service: service.key(),
                    reason,
                })?;
            for host in &service.hosts {
                if let Some(other) = hosts.insert(host.to_ascii_lowercase(), service.key()) {
                    return Err(ModelError::DuplicateHost {
                        service: service.key(),
                        other,
                        host: host.clone(),
                    });
                }
            }
        }
        // Probes are keyed by address: one address is one protocol everywhere.
        let mut protocols: BTreeMap<SocketAddr, Protocol> = BTreeMap::new();
        for service in &services {
            for cluster in &service.clusters {
                let endpoints = cluster
                    .endpoints(Protocol::Http)
                    .map(|(a, _)| (a, Protocol::Http))
                    .chain(
                        cluster
                            .endpoints(Protocol::Grpc)
                            .map(|(a, _)| (a, Protocol::Grpc)),
                    )
                    .chain(cluster.replica_endpoints());
                for (address, protocol) in endpoints {
                    if *protocols.entry(address).or_insert(protocol) != protocol {
                        return Err(ModelError::InvalidService {
                            service: service.key(),
                            reason: format!(
                                "cluster {}: {address} is both an HTTP and a gRPC endpoint",
                                cluster.name
                            ),
                        });
                    }
                }
            }
        }
        Ok(Model { services })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::test_support::service;

    #[test]
    fn sorts_so_equal_inputs_give_equal_models() {
        let a = service("a", "a1", &[8001, 8000]);
        let b = service("b", "b1", &[9000]);
        let m1 = Model::new(vec![a.clone(), b.clone()]).unwrap();
        let m2 = Model::new(vec![b, a]).unwrap();
        assert_eq!(m1, m2);
        assert_eq!(m1.services()[0].clusters[0].proxies[0].address.port(), 8000);
    }

    #[test]
    fn rejects_a_host_claimed_by_two_services() {
        let a = service("a", "a1", &[8000]);
        let mut b = service("b", "b1", &[9000]);
        b.hosts = vec!["A.example".into()];
        let err = Model::new(vec![a, b]).unwrap_err();
        assert!(matches!(err, ModelError::DuplicateHost { .. }), "{err}");
    }

    #[test]
    fn rejects_unknown_active_and_pending_clusters() {
        let mut a = service("a", "a1", &[8000]);
        a.active_cluster = "nope".into();
        assert!(Model::new(vec![a])
            .unwrap_err()
            .to_string()
            .contains("active_cluster"));
        let mut a = service("a", "a1", &[8000]);
        a.pending_cluster = Some("gone".into());
        assert!(Model::new(vec![a])
            .unwrap_err()
            .to_string()
            .contains("pending_cluster"));
        let mut a = service("a", "a1", &[8000]);
        a.pending_cluster = Some("a1".into());
        assert!(Model::new(vec![a])
            .unwrap_err()
            .to_string()
            .contains("also the active"));
        let mut a = service("a", "a1", &[8000]);
        a.pending_traffic_cap = Some(10);
        assert!(
            Model::new(vec![a]).is_ok(),
            "left behind by a promotion: harmless"
        );
        let mut a = service("a", "a1", &[8000]);
        a.clusters
            .push(service("a", "b1", &[9000]).clusters.remove(0));
        a.pending_cluster = Some("b1".into());
        a.pending_traffic_cap = Some(101);
        assert!(Model::new(vec![a.clone()])
            .unwrap_err()
            .to_string()
            .contains("over 100"));
        a.pending_traffic_cap = Some(100);
        assert!(Model::new(vec![a]).is_ok());
    }

    #[test]
    fn rejects_bad_names_hosts_and_duplicates() {
        let mut a = service("a", "a1", &[8000]);
        a.name = "Bad_Name".into();
        assert!(Model::new(vec![a]).is_err());
        let mut a = service("a", "a1", &[8000]);
        a.hosts = vec!["*.*".into()];
        assert!(Model::new(vec![a]).is_err());
        let mut a = service("a", "a1", &[8000]);
        a.hosts = vec![];
        assert!(Model::new(vec![a]).is_err());
        let a = service("a", "a1", &[8000, 8000]);
        assert!(Model::new(vec![a])
            .unwrap_err()
            .to_string()
            .contains("twice"));
        let a = service("a", "a1", &[8000]);
        let err = Model::new(vec![a.clone(), a]).unwrap_err();
        assert_eq!(
            err,
            ModelError::DuplicateService {
                service: "default/a".into()
            }
        );
    }

    #[test]
    fn a_discovering_cluster_needs_a_dashboard() {
        let mut a = service("a", "a1", &[]);
        a.clusters[0].discover = true;
        let err = Model::new(vec![a.clone()]).unwrap_err().to_string();
        assert!(err.contains("has no dashboard"), "{err}");
        a.clusters[0].dashboard = Some("http://127.0.0.1:8265".into());
        let m = Model::new(vec![a]).unwrap();
        assert!(m.discovers());
        assert!(!Model::new(vec![service("b", "b1", &[8000])])
            .unwrap()
            .discovers());
    }

    #[test]
    fn one_address_is_one_protocol_everywhere() {
        let with_grpc = |mut s: RayService, port: u16| {
            s.clusters[0].proxies[0].grpc = Some(SocketAddr::from(([127, 0, 0, 1], port)));
            s
        };
        let m = Model::new(vec![with_grpc(service("a", "a1", &[8000, 8001]), 9000)]).unwrap();
        let endpoints: Vec<_> = m.endpoints().map(|(a, p)| (a.port(), p)).collect();
        assert_eq!(
            endpoints,
            [
                (8000, Protocol::Http),
                (9000, Protocol::Grpc),
                (8001, Protocol::Http)
            ]
        );
        // Its own cluster's HTTP address.
        let err = Model::new(vec![with_grpc(service("a", "a1", &[8000, 8001]), 8001)])
            .unwrap_err()
            .to_string();
        assert!(err.contains("gRPC address 127.0.0.1:8001"), "{err}");
        // Another RayService's HTTP address: probes are keyed by address.
        let err = Model::new(vec![
            with_grpc(service("a", "a1", &[8000]), 9100),
            service("b", "b1", &[9100]),
        ])
        .unwrap_err()
        .to_string();
        assert!(err.contains("both an HTTP and a gRPC endpoint"), "{err}");
    }

    #[test]
    fn accepts_wildcards_envoy_accepts() {
        for host in ["*", "*.example.com", "api.*", "svc.ns:8080"] {
            let mut a = service("a", "a1", &[8000]);
            a.hosts = vec![host.into()];
            assert!(Model::new(vec![a]).is_ok(), "{host}");
        }
    }
}
