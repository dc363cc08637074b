//! Models derived from a valid [`Model`]: its proxies or its applications replaced by
//! what live discovery found, or some proxies removed.
//!
//! Each result is valid again without [`Model::new`]'s check: what would break an
//! invariant (an address listed twice, one address for two protocols, an invalid
//! application name or route prefix) is dropped, never kept first come, first served.

use std::collections::BTreeSet;
use std::net::SocketAddr;

use super::names::{check_application_name, check_route_prefix};
use super::{Application, Model, Proxy, RayCluster};

impl Model {
    #[cfg(test)]
    /// This model with the proxies of every discovering cluster replaced by
    /// `found(envoy cluster name, cluster)`, sorted and deduplicated by address (the
    /// first of equal addresses stays), so the model stays valid.
    pub(crate) fn with_discovered_proxies(
        &self,
        mut found: impl FnMut(&str, &RayCluster) -> Vec<Proxy>,
    ) -> Model {
        self.with_proxies(|name, cluster| {
            if cluster.discover {
                found(name, cluster)
            } else {
                cluster.proxies.clone()
            }
        })
    }

    /// This model with each cluster's proxies replaced by what `proxies` gives for it
    /// (its Envoy cluster name and the cluster); sorted and each address once, so the
    /// model stays valid.
    pub(crate) fn with_proxies(
        &self,
        mut proxies: impl FnMut(&str, &RayCluster) -> Vec<Proxy>,
    ) -> Model {
        let mut m = self.clone();
        for service in &mut m.services {
            for i in 0..service.clusters.len() {
                let name = service.envoy_cluster_name(&service.clusters[i].name);
                let mut list = proxies(&name, &service.clusters[i]);
                list.sort_by_key(|p| p.address);
                list.dedup_by_key(|p| p.address);
                service.clusters[i].proxies = list;
            }
        }
        // One address is one protocol everywhere, and each gRPC address one proxy's: a
        // gRPC address that breaks this is dropped (the proxy keeps serving HTTP).
        // `live::discovery` refuses such addresses first, with a reason.
        let http: BTreeSet<SocketAddr> = m.proxies().map(|p| p.address).collect();
        let mut grpc_seen = BTreeSet::new();
        for proxy in m
            .services
            .iter_mut()
            .flat_map(|s| &mut s.clusters)
            .flat_map(|c| &mut c.proxies)
        {
            if let Some(g) = proxy.grpc {
                if http.contains(&g) || !grpc_seen.insert(g) {
                    proxy.grpc = None;
                }
            }
        }
        m
    }

    /// This model with each cluster's applications (and whether Ray's direct ingress is on
    /// there) replaced by what `applications` gives for it (its Envoy cluster name and the
    /// cluster), made valid: sorted by name, each name and route prefix once (the first
    /// stays), an invalid name or prefix dropped (the prefix alone), replicas sorted, never
    /// a proxy's address, and an address listed twice in the whole model (two applications,
    /// clusters or RayServices claim it) dropped everywhere: never first come, first
    /// served, so one RayService's dashboard cannot take another's replica
    /// (`live::discovery` refuses such addresses first, with a reason).
    pub(crate) fn with_applications(
        &self,
        mut applications: impl FnMut(&str, &RayCluster) -> (bool, Vec<Application>),
    ) -> Model {
        let mut m = self.clone();
        let proxies = m.proxy_addresses();
        let mut lists = Vec::new();
        for service in &m.services {
            for cluster in &service.clusters {
                let name = service.envoy_cluster_name(&cluster.name);
                let (direct, mut list) = applications(&name, cluster);
                list.sort_by(|a, b| a.name.cmp(&b.name));
                list.dedup_by(|a, b| a.name == b.name);
                list.retain(|a| check_application_name(&a.name).is_ok());
                for app in &mut list {
                    for replicas in [&mut app.http_replicas, &mut app.grpc_replicas] {
                        replicas.sort();
                        replicas.dedup();
                    }
                }
                lists.push((direct, list));
            }
        }
        let contested = contested_replicas(lists.iter().flat_map(|(_, l)| l));
        let mut lists = lists.into_iter();
        for service in &mut m.services {
            for cluster in &mut service.clusters {
                let (direct, mut list) = lists.next().unwrap_or_default();
                let mut prefixes = BTreeSet::new();
                for app in &mut list {
                    if let Some(p) = &app.route_prefix {
                        if check_route_prefix(p).is_err() || !prefixes.insert(p.clone()) {
                            app.route_prefix = None;
                        }
                    }
                    for replicas in [&mut app.http_replicas, &mut app.grpc_replicas] {
                        replicas.retain(|r| !proxies.contains(r) && !contested.contains(r));
                    }
                }
                cluster.direct_ingress = direct;
                cluster.applications = list;
            }
        }
        m
    }
}

/// The replica addresses listed by more than one (application, protocol) of `apps`, in
/// one cluster or across clusters and RayServices: none of them may have it.
pub fn contested_replicas<'a>(
    apps: impl IntoIterator<Item = &'a Application>,
) -> BTreeSet<SocketAddr> {
    let mut seen = BTreeSet::new();
    let mut twice = BTreeSet::new();
    for app in apps {
        for replicas in [&app.http_replicas, &app.grpc_replicas] {
            let own: BTreeSet<SocketAddr> = replicas.iter().copied().collect();
            for r in own {
                if !seen.insert(r) {
                    twice.insert(r);
                }
            }
        }
    }
    twice
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::test_support::{self, service};
    use crate::model::NodeType;

    #[test]
    fn applications_are_made_valid_and_each_replica_address_is_one_endpoint() {
        use test_support::app;
        let m = Model::new(vec![
            service("a", "a1", &[8000]),
            service("b", "b1", &[9000]),
        ])
        .unwrap();
        let m = m.with_applications(|name, _| {
            if name != "default/a/a1" {
                return (true, vec![app("other", Some("/"), &[30009])]);
            }
            (
                true,
                vec![
                    app("work", Some("/work"), &[30002, 30001, 30001]),
                    app("work", Some("/dup-name"), &[]),
                    app("copy", Some("/work"), &[]),
                    app("", Some("/empty"), &[]),
                    app("bad", Some("no-slash"), &[]),
                    app("proxy", Some("/p"), &[8000, 9000]),
                    // Another RayService's replica too: neither gets it (never first
                    // come, first served).
                    app("clash", Some("/c"), &[30009]),
                ],
            )
        });
        let apps = &m.services()[0].clusters[0].applications;
        let summary: Vec<(&str, Option<&str>, Vec<u16>)> = apps
            .iter()
            .map(|a| {
                let ports = a.http_replicas.iter().map(|r| r.port()).collect();
                (a.name.as_str(), a.route_prefix.as_deref(), ports)
            })
            .collect();
        assert_eq!(
            summary,
            [
                ("bad", None, vec![]),
                ("clash", Some("/c"), vec![]),
                ("copy", Some("/work"), vec![]),
                ("proxy", Some("/p"), vec![]),
                ("work", None, vec![30001, 30002]),
            ]
        );
        assert!(m.services()[1].clusters[0].applications[0]
            .http_replicas
            .is_empty());
        assert!(Model::new(m.services().to_vec()).is_ok());

        // Model::new refuses what with_applications would have mended.
        let mut s = service("a", "a1", &[8000]);
        s.clusters[0].applications = vec![app("x", Some("/x"), &[]), app("y", Some("/x"), &[])];
        let err = Model::new(vec![s.clone()]).unwrap_err().to_string();
        assert!(err.contains("route prefix \"/x\" is listed twice"), "{err}");
        s.clusters[0].applications = vec![app("x", Some("/x?y"), &[])];
        let err = Model::new(vec![s.clone()]).unwrap_err().to_string();
        assert!(err.contains("holds '?'"), "{err}");
        s.clusters[0].applications = vec![app("x", Some("/x"), &[8000])];
        let err = Model::new(vec![s]).unwrap_err().to_string();
        assert!(err.contains("also a proxy's"), "{err}");
    }

    #[test]
    fn discovered_proxies_are_sorted_and_deduplicated() {
        let mut a = service("a", "a1", &[]);
        a.clusters[0].discover = true;
        a.clusters[0].dashboard = Some("http://127.0.0.1:8265".into());
        let listed = service("b", "b1", &[9000]);
        let m = Model::new(vec![a, listed]).unwrap();
        let proxy = |port: u16, node_type| Proxy {
            address: SocketAddr::from(([127, 0, 0, 1], port)),
            grpc: None,
            node_type,
            draining: false,
            host_network: false,
        };
        let mut asked = Vec::new();
        let found = m.with_discovered_proxies(|name, _| {
            asked.push(name.to_string());
            vec![
                proxy(8001, NodeType::Worker),
                proxy(8000, NodeType::Worker),
                proxy(8001, NodeType::Head),
            ]
        });
        assert_eq!(asked, ["default/a/a1"]);
        let ports: Vec<(u16, NodeType)> = found.services()[0].clusters[0]
            .proxies
            .iter()
            .map(|p| (p.address.port(), p.node_type))
            .collect();
        assert_eq!(ports, [(8000, NodeType::Worker), (8001, NodeType::Worker)]);
        // A listed cluster is left alone.
        assert_eq!(found.services()[1], m.services()[1]);
    }
}
