//! Make-before-break: what one Envoy may be sent, given what it already holds.
//!
//! Shared by the state-of-the-world and delta state machines. The rules:
//! - a route configuration is sent only once the Envoy holds (has ACKed) every cluster it
//!   names and that cluster's endpoints; until then it keeps the route it has, so traffic
//!   never goes to a cluster Envoy has not warmed;
//! - a cluster (and its endpoints) that left the snapshot stays with an Envoy while any
//!   route it holds or is being sent still names it, and goes once that route is replaced.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use super::snapshot::{Resource, ResourceMap, ResourceType, Snapshot};

/// A resource one Envoy holds: its version, and its body when this stream sent it
/// (after a reconnect the Envoy declares versions we may have no body for).
#[derive(Clone, Debug)]
pub struct Held {
    pub version: Arc<str>,
    pub resource: Option<Arc<Resource>>,
}

impl Held {
    pub fn sent(resource: &Arc<Resource>) -> Held {
        Held {
            version: resource.version.clone(),
            resource: Some(resource.clone()),
        }
    }
}

pub type HeldMap = BTreeMap<Arc<str>, Held>;

/// What a stream should make the Envoy hold for one type.
#[derive(Clone, Debug)]
pub enum Desired {
    /// This resource, at this version.
    Send(Arc<Resource>),
    /// Whatever the Envoy already holds under this name: keep it, but we cannot resend it.
    Keep,
}

impl Desired {
    pub fn resource(&self) -> Option<&Arc<Resource>> {
        match self {
            Desired::Send(r) => Some(r),
            Desired::Keep => None,
        }
    }
}

/// The view of one Envoy that the ordering rules need.
pub struct ClientHolds<'a> {
    /// ACKed resources per type, indexed by [`ResourceType::index`].
    pub acked: [&'a HeldMap; 4],
    /// Route configurations sent but not yet ACKed or NACKed.
    pub routes_in_flight: Option<&'a ResourceMap>,
}

impl ClientHolds<'_> {
    /// Clusters some route the Envoy holds or is receiving still names; `None` means
    /// "cannot tell" (a route known only by version), so nothing may be removed.
    fn referenced_clusters(&self) -> Option<BTreeSet<Arc<str>>> {
        let mut names = BTreeSet::new();
        for held in self.acked[ResourceType::Route.index()].values() {
            names.extend(held.resource.as_ref()?.cluster_refs.iter().cloned());
        }
        for r in self.routes_in_flight.into_iter().flat_map(|m| m.values()) {
            names.extend(r.cluster_refs.iter().cloned());
        }
        Some(names)
    }

    fn holds(&self, ty: ResourceType, name: &str) -> bool {
        self.acked[ty.index()].contains_key(name)
    }

    fn warmed(&self, cluster: &str) -> bool {
        self.holds(ResourceType::Cluster, cluster) && self.holds(ResourceType::Endpoints, cluster)
    }
}

/// Every resource of `ty` the Envoy should hold now (before subscription filtering).
pub fn desired(
    snapshot: &Snapshot,
    ty: ResourceType,
    holds: &ClientHolds<'_>,
) -> BTreeMap<Arc<str>, Desired> {
    let current = snapshot.resources(ty);
    let mut out: BTreeMap<Arc<str>, Desired> = current
        .iter()
        .map(|(name, r)| (name.clone(), Desired::Send(r.clone())))
        .collect();
    match ty {
        ResourceType::Cluster | ResourceType::Endpoints => {
            // Retain what a held route still needs, at the version the Envoy has.
            let referenced = holds.referenced_clusters();
            let retain = |name: &str| referenced.as_ref().is_none_or(|r| r.contains(name));
            for (name, held) in holds.acked[ty.index()] {
                if !current.contains_key(name) && retain(name) {
                    let keep = match &held.resource {
                        Some(r) => Desired::Send(r.clone()),
                        None => Desired::Keep,
                    };
                    out.insert(name.clone(), keep);
                }
            }
        }
        ResourceType::Listener => {}
        ResourceType::Route => {
            for (name, route) in current {
                if route.cluster_refs.iter().all(|c| holds.warmed(c)) {
                    continue;
                }
                // Not every cluster is warm: keep what is on its way, else what it holds.
                let fallback = holds
                    .routes_in_flight
                    .and_then(|m| m.get(name))
                    .map(|r| Desired::Send(r.clone()))
                    .or_else(|| {
                        holds.acked[ty.index()]
                            .get(name)
                            .map(|h| match &h.resource {
                                Some(r) => Desired::Send(r.clone()),
                                None => Desired::Keep,
                            })
                    });
                match fallback {
                    Some(d) => out.insert(name.clone(), d),
                    None => out.remove(name),
                };
            }
        }
    }
    out
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::config::GatewaySettings;
    use crate::model::test_support::service;
    use crate::model::Model;
    use crate::translate::translate;

    pub fn snapshot_of(services: Vec<crate::model::RayService>) -> Snapshot {
        Snapshot::from_resources(&translate(
            &Model::new(services).unwrap(),
            &GatewaySettings::default(),
        ))
    }

    fn hold_all(snapshot: &Snapshot, ty: ResourceType) -> HeldMap {
        snapshot
            .resources(ty)
            .iter()
            .map(|(n, r)| (n.clone(), Held::sent(r)))
            .collect()
    }

    #[test]
    fn a_route_waits_for_its_cluster_to_be_warm() {
        let old = snapshot_of(vec![service("a", "a1", &[8000])]);
        let mut moved = service("a", "a2", &[8100]);
        moved
            .clusters
            .push(service("a", "a1", &[8000]).clusters.remove(0));
        let new = snapshot_of(vec![moved]);
        let acked = [
            &hold_all(&old, ResourceType::Cluster),
            &hold_all(&old, ResourceType::Endpoints),
            &hold_all(&old, ResourceType::Listener),
            &hold_all(&old, ResourceType::Route),
        ];
        let holds = ClientHolds {
            acked,
            routes_in_flight: None,
        };
        let routes = desired(&new, ResourceType::Route, &holds);
        let old_route = old.resources(ResourceType::Route).values().next().unwrap();
        let sent = routes.values().next().unwrap().resource().unwrap();
        assert_eq!(sent.version, old_route.version, "still the old route");

        // Once the Envoy holds the new cluster and its endpoints, the new route goes.
        let clusters = hold_all(&new, ResourceType::Cluster);
        let endpoints = hold_all(&new, ResourceType::Endpoints);
        let holds = ClientHolds {
            acked: [&clusters, &endpoints, acked[2], acked[3]],
            routes_in_flight: None,
        };
        let routes = desired(&new, ResourceType::Route, &holds);
        let new_route = new.resources(ResourceType::Route).values().next().unwrap();
        assert_eq!(
            routes.values().next().unwrap().resource().unwrap().version,
            new_route.version
        );
    }

    #[test]
    fn a_removed_cluster_stays_while_a_held_route_names_it() {
        let old = snapshot_of(vec![
            service("a", "a1", &[8000]),
            service("b", "b1", &[9000]),
        ]);
        let new = snapshot_of(vec![service("a", "a1", &[8000])]);
        let held: Vec<HeldMap> = ResourceType::ALL
            .iter()
            .map(|t| hold_all(&old, *t))
            .collect();
        let holds = ClientHolds {
            acked: [&held[0], &held[1], &held[2], &held[3]],
            routes_in_flight: None,
        };
        let clusters = desired(&new, ResourceType::Cluster, &holds);
        assert!(
            clusters.contains_key("default/b/b1"),
            "old route still names b1"
        );
        let endpoints = desired(&new, ResourceType::Endpoints, &holds);
        assert!(endpoints.contains_key("default/b/b1"));

        // While the new route is in flight, the old one may still be in use: keep b1.
        let in_flight = new.resources(ResourceType::Route).clone();
        let holds = ClientHolds {
            acked: [&held[0], &held[1], &held[2], &held[3]],
            routes_in_flight: Some(&in_flight),
        };
        assert!(desired(&new, ResourceType::Cluster, &holds).contains_key("default/b/b1"));

        // Once the Envoy holds the new route, b1 can go.
        let new_routes = hold_all(&new, ResourceType::Route);
        let holds = ClientHolds {
            acked: [&held[0], &held[1], &held[2], &new_routes],
            routes_in_flight: None,
        };
        assert!(!desired(&new, ResourceType::Cluster, &holds).contains_key("default/b/b1"));
        assert!(!desired(&new, ResourceType::Endpoints, &holds).contains_key("default/b/b1"));
    }

    #[test]
    fn a_route_known_only_by_version_keeps_every_cluster() {
        let old = snapshot_of(vec![
            service("a", "a1", &[8000]),
            service("b", "b1", &[9000]),
        ]);
        let new = snapshot_of(vec![service("a", "a1", &[8000])]);
        let clusters = hold_all(&old, ResourceType::Cluster);
        let mut routes = HeldMap::new();
        routes.insert(
            "ray-serve-http".into(),
            Held {
                version: "v-from-before-restart".into(),
                resource: None,
            },
        );
        let empty = HeldMap::new();
        let holds = ClientHolds {
            acked: [&clusters, &empty, &empty, &routes],
            routes_in_flight: None,
        };
        assert!(desired(&new, ResourceType::Cluster, &holds).contains_key("default/b/b1"));
    }
}
