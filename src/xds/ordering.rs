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

/// One held resource as [`Holding::iter`] yields it: name, version, body when known.
pub type HeldEntry<'a> = (&'a Arc<str>, &'a Arc<str>, Option<&'a Arc<Resource>>);

/// Everything one Envoy holds of one type.
#[derive(Clone, Debug)]
pub enum Holding {
    /// Exactly one snapshot's whole set of this type: a shared pointer, so an idle
    /// stream in sync costs no per-resource memory.
    Snapshot {
        type_version: Arc<str>,
        map: Arc<ResourceMap>,
    },
    /// Anything else, resource by resource.
    Own(HeldMap),
}

impl Default for Holding {
    fn default() -> Self {
        Holding::Own(HeldMap::new())
    }
}

impl Holding {
    /// The Envoy holds `snapshot`'s whole set of `ty`.
    pub fn whole(snapshot: &Snapshot, ty: ResourceType) -> Holding {
        Holding::Snapshot {
            type_version: snapshot.type_version(ty).clone(),
            map: snapshot.shared(ty).clone(),
        }
    }

    pub fn from_resources(resources: &ResourceMap) -> Holding {
        Holding::Own(
            resources
                .iter()
                .map(|(n, r)| (n.clone(), Held::sent(r)))
                .collect(),
        )
    }

    /// True when this is exactly the whole set of `ty` in `snapshot`.
    pub fn is_whole(&self, snapshot: &Snapshot, ty: ResourceType) -> bool {
        matches!(self, Holding::Snapshot { type_version, .. } if *type_version == *snapshot.type_version(ty))
    }

    pub fn version_of(&self, name: &str) -> Option<&Arc<str>> {
        match self {
            Holding::Snapshot { map, .. } => map.get(name).map(|r| &r.version),
            Holding::Own(m) => m.get(name).map(|h| &h.version),
        }
    }

    pub fn get(&self, name: &str) -> Option<Held> {
        match self {
            Holding::Snapshot { map, .. } => map.get(name).map(Held::sent),
            Holding::Own(m) => m.get(name).cloned(),
        }
    }

    /// The shared name under which `name` is held, to reuse instead of a new string.
    pub fn key(&self, name: &str) -> Option<Arc<str>> {
        match self {
            Holding::Snapshot { map, .. } => map.get_key_value(name).map(|(k, _)| k.clone()),
            Holding::Own(m) => m.get_key_value(name).map(|(k, _)| k.clone()),
        }
    }

    pub fn contains(&self, name: &str) -> bool {
        self.version_of(name).is_some()
    }

    pub fn len(&self) -> usize {
        match self {
            Holding::Snapshot { map, .. } => map.len(),
            Holding::Own(m) => m.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Every held resource: name, version and (when known) body.
    pub fn iter(&self) -> Box<dyn Iterator<Item = HeldEntry<'_>> + '_> {
        match self {
            Holding::Snapshot { map, .. } => {
                Box::new(map.iter().map(|(n, r)| (n, &r.version, Some(r))))
            }
            Holding::Own(m) => {
                Box::new(m.iter().map(|(n, h)| (n, &h.version, h.resource.as_ref())))
            }
        }
    }

    /// True when this holds the very map `current` (nothing held outside it).
    fn is_whole_of(&self, current: &ResourceMap) -> bool {
        matches!(self, Holding::Snapshot { map, .. } if std::ptr::eq(&**map, current))
    }

    /// The per-resource map, copied out of a shared snapshot set if need be.
    pub fn own(&mut self) -> &mut HeldMap {
        if let Holding::Snapshot { map, .. } = self {
            *self = Holding::from_resources(map);
        }
        match self {
            Holding::Own(m) => m,
            Holding::Snapshot { .. } => unreachable!("converted above"),
        }
    }
}

/// Keeps the entries of `map` whose name is in `names`: a merge of two sorted sequences,
/// linear, where per-name lookups would compare long shared prefixes again and again.
pub fn retain_names<V>(
    map: BTreeMap<Arc<str>, V>,
    names: &BTreeSet<Arc<str>>,
) -> BTreeMap<Arc<str>, V> {
    let mut wanted = names.iter().peekable();
    map.into_iter()
        .filter(|(name, _)| {
            while wanted.next_if(|w| ***w < **name).is_some() {}
            wanted.peek().is_some_and(|w| ***w == **name)
        })
        .collect()
}

/// The resources of `wanted` whose version `held` does not have (a linear merge).
pub fn changed_from(wanted: &ResourceMap, held: &Holding) -> ResourceMap {
    let mut held = held.iter().peekable();
    wanted
        .iter()
        .filter(|(name, r)| {
            while held.next_if(|(h, _, _)| **h < **name).is_some() {}
            match held.peek() {
                Some((h, v, _)) if **h == **name => !Arc::ptr_eq(v, &r.version) && **v != r.version,
                _ => true,
            }
        })
        .map(|(n, r)| (n.clone(), r.clone()))
        .collect()
}

/// When `held` is a whole snapshot set with the same names as `current`'s set of `ty`,
/// the resources that changed; `None` otherwise. The common case after a health or
/// endpoint change, answered by pointer comparisons alone (snapshots share unchanged
/// resources), with no retention or gating to consider: no name left, none is new.
pub fn same_names_change(held: &Holding, current: &ResourceMap) -> Option<ResourceMap> {
    let Holding::Snapshot { map: old, .. } = held else {
        return None;
    };
    if old.len() != current.len() {
        return None;
    }
    let mut changed = ResourceMap::new();
    for ((old_name, old_r), (name, r)) in old.iter().zip(current.iter()) {
        if Arc::ptr_eq(old_r, r) {
            continue;
        }
        if old_name != name {
            return None;
        }
        if old_r.version != r.version {
            changed.insert(name.clone(), r.clone());
        }
    }
    Some(changed)
}

/// A subscribed name as a shared string: the one some holding already uses (cluster
/// and endpoint names coincide), so a thousand Envoys subscribed to the same names do
/// not each keep their own copies.
pub fn intern<'a>(name: &str, holdings: impl IntoIterator<Item = &'a Holding>) -> Arc<str> {
    holdings
        .into_iter()
        .find_map(|h| h.key(name))
        .unwrap_or_else(|| Arc::from(name))
}

/// Whether `wanted` is exactly the snapshot's whole set of `ty` (same resources).
pub fn is_whole_set(wanted: &ResourceMap, snapshot: &Snapshot, ty: ResourceType) -> bool {
    let all = snapshot.resources(ty);
    wanted.len() == all.len()
        && wanted
            .iter()
            .zip(all.iter())
            .all(|((n1, r1), (n2, r2))| n1 == n2 && Arc::ptr_eq(r1, r2))
}

/// Takes resources from `changed`, in name order, until their encoded size passes
/// `budget` bytes (at least one). Small responses keep per-stream gRPC buffers small:
/// tonic keeps a stream's encode buffer at the size of the largest message it sent.
pub fn take_budget(changed: ResourceMap, budget: usize) -> (ResourceMap, bool) {
    let mut taken = ResourceMap::new();
    let mut size = 0;
    let total = changed.len();
    for (name, r) in changed {
        if !taken.is_empty() && size + r.body.value.len() > budget {
            break;
        }
        size += r.body.value.len();
        taken.insert(name, r);
    }
    let complete = taken.len() == total;
    (taken, complete)
}

/// Most bytes of resources carried by one response of a type that may be split.
pub const RESPONSE_BUDGET_BYTES: usize = 16 * 1024;

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
    pub acked: [&'a Holding; 4],
    /// Route configurations sent but not yet ACKed or NACKed.
    pub routes_in_flight: Option<&'a ResourceMap>,
}

impl ClientHolds<'_> {
    /// Clusters some route the Envoy holds or is receiving still names; `None` means
    /// "cannot tell" (a route known only by version), so nothing may be removed.
    fn referenced_clusters(&self) -> Option<BTreeSet<Arc<str>>> {
        let mut names = BTreeSet::new();
        for (_, _, resource) in self.acked[ResourceType::Route.index()].iter() {
            names.extend(resource?.cluster_refs.iter().cloned());
        }
        for r in self.routes_in_flight.into_iter().flat_map(|m| m.values()) {
            names.extend(r.cluster_refs.iter().cloned());
        }
        Some(names)
    }

    fn holds(&self, ty: ResourceType, name: &str) -> bool {
        self.acked[ty.index()].contains(name)
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
            if holds.acked[ty.index()].is_whole_of(current) {
                return out;
            }
            for (name, _, resource) in holds.acked[ty.index()].iter() {
                if !current.contains_key(name) && retain(name) {
                    let keep = match resource {
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
mod tests {
    use super::*;
    use crate::xds::fixtures::{service, snapshot_of};

    fn hold_all(snapshot: &Snapshot, ty: ResourceType) -> Holding {
        Holding::from_resources(snapshot.resources(ty))
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
        let held: Vec<Holding> = ResourceType::ALL
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
        let mut routes = Holding::default();
        routes.own().insert(
            "ray-serve-http".into(),
            Held {
                version: "v-from-before-restart".into(),
                resource: None,
            },
        );
        let empty = Holding::default();
        let holds = ClientHolds {
            acked: [&clusters, &empty, &empty, &routes],
            routes_in_flight: None,
        };
        assert!(desired(&new, ResourceType::Cluster, &holds).contains_key("default/b/b1"));
    }
}
