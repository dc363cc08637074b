//! The delta (incremental) ADS state machine for one stream (`DeltaAggregatedResources`).
//!
//! Invariants:
//! - subscriptions: `*` (or an empty first request, the legacy form) is a wildcard;
//!   `resource_names_subscribe`/`unsubscribe` are honoured on every request, even one
//!   with a stale nonce;
//! - what the Envoy holds starts from `initial_resource_versions` on reconnect, so it is
//!   sent only what changed, and told in `removed_resources` about what is gone;
//! - at most one response per type is in flight; an ACK commits what it carried, a NACK
//!   commits nothing and marks each carried `(name, version)` rejected until it changes;
//! - the same make-before-break ordering as state of the world ([`super::ordering`]).

use std::collections::BTreeSet;
use std::sync::Arc;

use envoy_types::pb::envoy::service::discovery::v3::{
    DeltaDiscoveryRequest, DeltaDiscoveryResponse, Resource as DeltaResource,
};

use super::holding::{
    change_within, changed_from, retain_names, same_names_change, Held, Holding, TypeLedger,
};
use super::names::{intern, NameSet};
use super::ordering::{
    desired, is_whole_set, learn_bodies, take_budget, ClientHolds, Desired, RESPONSE_BUDGET_BYTES,
};
use super::snapshot::{ResourceMap, ResourceType, Snapshot};
use super::{AdsProtocol, Event, NodeInfo, ProtocolError, TypeStatus};

#[cfg(test)]
mod random_requests;
mod type_state;

use type_state::{content_key, InFlight, TypeState};

/// What one round sends of a type, what it tells removed, and whether the Envoy then
/// holds the snapshot's whole set of it.
type Plan = (ResourceMap, Vec<Arc<str>>, bool);

#[derive(Debug, Default)]
pub struct DeltaStream {
    types: [TypeState; 4],
    next_nonce: u64,
    node: Option<NodeInfo>,
    /// The Envoy declared resources it held from an earlier stream (a reconnect).
    reconnected: bool,
    /// The wait for a reconnected Envoy to declare its routes is over.
    reconnect_settled: bool,
}

impl DeltaStream {
    pub fn new() -> DeltaStream {
        DeltaStream::default()
    }
}

impl DeltaStream {
    fn poll_one(
        &mut self,
        ty: ResourceType,
        snapshot: &Snapshot,
    ) -> Option<(ResourceType, usize, DeltaDiscoveryResponse)> {
        let current = snapshot.resources(ty);
        let st = &mut self.types[ty.index()];
        // A rejection matters while the snapshot still has the version rejected.
        st.ledger.rejected.prune(current);
        // Endpoints of clusters being warmed that have left the snapshot since.
        let warming_gone = ty == ResourceType::Endpoints
            && self.types[ResourceType::Cluster.index()]
                .in_flight
                .as_ref()
                .is_some_and(|f| f.sent.keys().any(|n| !current.contains_key(n)));
        let st = &self.types[ty.index()];
        if !st.subscribed
            || st.in_flight.is_some()
            || (st.ledger.held.is_whole(snapshot, ty) && !warming_gone && !st.absent_unchecked)
        {
            return None;
        }
        // The fast path (the same names as the snapshot, some changed) does not look for
        // subscribed names that do not exist: take it only when none can be untold.
        if ty != ResourceType::Route && !st.absent_unchecked && !warming_gone {
            if let Some(changed) = same_names_change(&st.ledger.held, snapshot.resources(ty)) {
                let planned = (changed, Vec::new(), true);
                // (Rejected versions are held back by `respond`, not by this plan.)
                #[cfg(test)]
                if self.types[ty.index()].ledger.rejected.is_empty() {
                    self.check_plan(ty, snapshot, &planned);
                }
                let (sent, removed, whole) = planned;
                return self.respond(ty, snapshot, sent, removed, whole);
            }
        }
        // Either plan tells every subscribed name that does not exist.
        self.types[ty.index()].absent_unchecked = false;
        let planned = match self.plan_within_snapshot(ty, snapshot, warming_gone) {
            Some(planned) => {
                #[cfg(test)]
                self.check_plan(ty, snapshot, &planned);
                planned
            }
            None => self.plan(ty, snapshot),
        };
        let (changed, removed, whole) = planned;
        self.respond(ty, snapshot, changed, removed, whole)
    }

    /// What to send and remove, when the Envoy holds nothing of `ty` outside the
    /// snapshot, rejected nothing of it, and no cluster it warms has left the snapshot
    /// (see [`change_within`]): one walk, where [`DeltaStream::plan`] builds and filters
    /// the desired set. `None` otherwise, and for routes (merged per Envoy).
    fn plan_within_snapshot(
        &mut self,
        ty: ResourceType,
        snapshot: &Snapshot,
        warming_gone: bool,
    ) -> Option<Plan> {
        let current = snapshot.resources(ty);
        let st = &mut self.types[ty.index()];
        if ty == ResourceType::Route || warming_gone || !st.ledger.rejected.is_empty() {
            return None;
        }
        let names = (!st.wildcard).then_some(&*st.names);
        let (changed, whole) = change_within(&st.ledger.held, current, names)?;
        let wants = |name: &str| st.wildcard || st.names.contains(name);
        learn_bodies(&mut st.ledger.held, |name| {
            current.get(name).filter(|_| wants(name))
        });
        let removed = st
            .names
            .iter()
            .filter(|n| !current.contains_key(*n) && !st.told_absent.contains(*n))
            .cloned()
            .collect();
        Some((changed, removed, whole))
    }

    /// Test builds: a shortcut's plan equals the general one. (The general plan may
    /// learn bodies the shortcut already learned: that it learned them is not checked.)
    #[cfg(test)]
    fn check_plan(&mut self, ty: ResourceType, snapshot: &Snapshot, planned: &Plan) {
        let general = self.plan(ty, snapshot);
        let versions = |m: &ResourceMap| -> Vec<(Arc<str>, Arc<str>)> {
            m.iter()
                .map(|(n, r)| (n.clone(), r.version.clone()))
                .collect()
        };
        assert_eq!(versions(&planned.0), versions(&general.0), "{ty:?} changed");
        assert_eq!(planned.1, general.1, "{ty:?} removed");
        assert_eq!(planned.2, general.2, "{ty:?} whole");
    }

    /// What to send and remove, in general: the desired set (what the Envoy should hold,
    /// kept where make-before-break or a rejection says so), its subscribed part, and the
    /// difference from what it holds.
    fn plan(&mut self, ty: ResourceType, snapshot: &Snapshot) -> Plan {
        let current = snapshot.resources(ty);
        let st = &self.types[ty.index()];
        let holds = ClientHolds {
            acked: [
                &self.types[0].ledger.held,
                &self.types[1].ledger.held,
                &self.types[2].ledger.held,
                &self.types[3].ledger.held,
            ],
            routes_in_flight: self.types[ResourceType::Route.index()]
                .in_flight
                .as_ref()
                .map(|f| &f.sent),
            rejected: [
                &self.types[0].ledger.rejected,
                &self.types[1].ledger.rejected,
                &self.types[2].ledger.rejected,
                &self.types[3].ledger.rejected,
            ],
            routes_unknown: self.reconnected
                && !self.reconnect_settled
                && !self.types[ResourceType::Route.index()].subscribed,
            clusters_in_flight: self.types[ResourceType::Cluster.index()]
                .in_flight
                .as_ref()
                .and_then(|f| Some((&f.sent, &**f.endpoints_then.as_ref()?))),
            leaving: [ResourceType::Cluster, ResourceType::Endpoints]
                .iter()
                .filter(|_| ty == ResourceType::Route)
                .filter_map(|t| self.types[t.index()].in_flight.as_ref())
                .flat_map(|f| f.removed.iter().cloned())
                .collect(),
        };
        let mut wanted = desired(snapshot, ty, &holds);
        if !st.wildcard {
            wanted = retain_names(wanted, &st.names);
        }
        if ty == ResourceType::Endpoints {
            // Endpoints the Envoy must keep that the snapshot lacks (declared on a
            // reconnect; a route it holds may name the cluster): their cluster may be
            // warming, waiting for an assignment sent after it, and Envoy ACKs no cluster
            // until it is warm. Send the stand-in's.
            for (name, d) in wanted.iter_mut() {
                if matches!(d, Desired::Keep) && !current.contains_key(name) {
                    if let Some(stand_in) = snapshot.stand_in(ty, name) {
                        *d = Desired::Send(stand_in);
                    }
                }
            }
        }
        let wanted_bodies: ResourceMap = wanted
            .iter()
            .filter_map(|(n, d)| d.resource().map(|r| (n.clone(), r.clone())))
            .collect();
        learn_bodies(&mut self.types[ty.index()].ledger.held, |n| {
            wanted_bodies.get(n)
        });
        let st = &self.types[ty.index()];
        let whole =
            wanted_bodies.len() == wanted.len() && is_whole_set(&wanted_bodies, snapshot, ty);
        let changed = changed_from(&wanted_bodies, &st.ledger.held);
        let mut removed: Vec<Arc<str>> = st
            .ledger
            .held
            .iter()
            .map(|(name, _, _)| name)
            .filter(|name| !wanted.contains_key(*name) && st.wants(name))
            .cloned()
            .collect();
        // A name the client asked for that does not exist: say so at once, so it does
        // not wait for its initial fetch timeout.
        removed.extend(
            st.names
                .iter()
                .filter(|n| !current.contains_key(*n) && !wanted.contains_key(*n))
                .filter(|n| !st.ledger.held.contains(n))
                .filter(|n| !st.told_absent.contains(*n))
                .cloned(),
        );
        removed.sort();
        removed.dedup();
        (changed, removed, whole)
    }

    /// Sends `changed` (within the response budget) and `removed`, skipping resources
    /// whose version the Envoy rejected; `whole` says the Envoy then holds the
    /// snapshot's whole set of `ty`.
    fn respond(
        &mut self,
        ty: ResourceType,
        snapshot: &Snapshot,
        changed: ResourceMap,
        removed: Vec<Arc<str>>,
        mut whole: bool,
    ) -> Option<(ResourceType, usize, DeltaDiscoveryResponse)> {
        let st = &mut self.types[ty.index()];
        let changed: ResourceMap = if st.ledger.rejected.is_empty() {
            changed
        } else {
            changed
                .into_iter()
                .filter(|(name, r)| {
                    let rejected = st.ledger.rejected.holds_back(
                        name,
                        &r.version,
                        st.ledger.held.version_of(name),
                    );
                    // The Envoy keeps its old version of a rejected resource.
                    whole &= !rejected;
                    !rejected
                })
                .collect()
        };
        if changed.is_empty() && removed.is_empty() {
            if whole {
                st.ledger.held = Holding::whole(snapshot, ty);
            }
            return None;
        }
        let (sent, complete) = take_budget(changed, RESPONSE_BUDGET_BYTES);
        let content = content_key(&sent, &removed);
        if st.ledger.not_again == Some(content) {
            return None;
        }
        let then_whole = (whole && complete).then(|| Holding::whole(snapshot, ty));
        // A cluster whose settings change is warmed anew: Envoy waits for a
        // ClusterLoadAssignment sent after it, even an unchanged one, and ACKs the clusters
        // only once they are warm. So its endpoints go again right behind it.
        let changed_clusters = self.changed_clusters(ty, &sent);
        self.forget_endpoints(&changed_clusters);
        let st = &mut self.types[ty.index()];
        self.next_nonce += 1;
        let nonce = self.next_nonce.to_string();
        let response = DeltaDiscoveryResponse {
            system_version_info: snapshot.version().to_string(),
            resources: sent
                .values()
                .map(|r| DeltaResource {
                    name: r.name.to_string(),
                    version: r.version.to_string(),
                    resource: Some(r.body.clone()),
                    ..Default::default()
                })
                .collect(),
            type_url: ty.type_url().to_string(),
            removed_resources: removed.iter().map(|n| n.to_string()).collect(),
            nonce: nonce.clone(),
            ..Default::default()
        };
        st.ledger.pushes += 1;
        let count = sent.len() + removed.len();
        st.in_flight = Some(InFlight {
            nonce,
            sent,
            removed,
            then_whole,
            endpoints_then: (ty == ResourceType::Cluster)
                .then(|| snapshot.shared(ResourceType::Endpoints).clone()),
            forgotten: Vec::new(),
            content,
        });
        Some((ty, count, response))
    }
}

impl DeltaStream {
    /// Clusters among `sent` whose settings differ from the ones the Envoy holds.
    fn changed_clusters(&self, ty: ResourceType, sent: &ResourceMap) -> Vec<Arc<str>> {
        if ty != ResourceType::Cluster {
            return Vec::new();
        }
        let known = &self.types[ty.index()].ledger.held;
        sent.iter()
            // New to this stream counts too: after a reconnect the Envoy may hold (or
            // warm) a cluster it did not declare, and its endpoints sent before it.
            .filter(|(n, r)| known.version_of(n).is_none_or(|v| **v != *r.version))
            .map(|(n, _)| n.clone())
            .collect()
    }

    /// Records that the Envoy applied `sent` and `removed`.
    fn commit(&mut self, ty: ResourceType, sent: &ResourceMap, removed: &[Arc<str>]) {
        let st = &mut self.types[ty.index()];
        for name in removed {
            if st.names.contains(name) {
                st.told_absent.insert(name.clone());
            }
        }
        let wants: Vec<bool> = sent.keys().map(|n| st.wants(n)).collect();
        let known = st.ledger.held.own();
        for ((name, r), wanted) in sent.iter().zip(wants) {
            if wanted {
                known.insert(name.clone(), Held::sent(r));
            }
        }
        for name in removed {
            known.remove(name);
        }
    }

    /// A cluster whose settings changed is warmed anew: Envoy waits for its endpoints
    /// again, even unchanged ones, so they must be sent again.
    fn forget_endpoints(&mut self, clusters: &[Arc<str>]) {
        let endpoints = &mut self.types[ResourceType::Endpoints.index()];
        for name in clusters {
            if endpoints.ledger.held.contains(name) {
                // Still held, at a version to be sent again.
                if let Some(h) = endpoints.ledger.held.own().get_mut(name) {
                    h.version = "".into();
                }
            }
            // A response in flight (which the Envoy applies before this cluster) must
            // not bring its version back when ACKed: neither as one it carries nor
            // through the whole set it would complete (found by the proptest: an
            // assignment not in that response came back with its ACK, and the cluster
            // warmed forever).
            if let Some(f) = &mut endpoints.in_flight {
                if let Some(r) = f.sent.remove(name) {
                    f.forgotten.push((name.clone(), r.version.clone()));
                }
                f.then_whole = None;
            }
        }
    }
}

impl DeltaStream {
    /// A NACK of `f`: what the message blames keeps the Envoy's old version until it
    /// changes; when it names them, it applied the rest; when it names none, the search
    /// for the culprit begins (see `Rejections`).
    fn nacked(&mut self, ty: ResourceType, f: InFlight, message: &str) -> Event {
        let version = f.nonce.clone();
        let st = &mut self.types[ty.index()];
        // Names it was told absent may not count as told: look again.
        st.absent_unchecked |= !f.removed.is_empty();
        let changed = f
            .sent
            .iter()
            .map(|(n, r)| (n.clone(), r.version.clone()))
            .chain(f.forgotten.iter().cloned())
            .collect();
        if let Some(applied) = st
            .ledger
            .on_nack(version.clone(), f.content, changed, message)
        {
            let applied: ResourceMap = f
                .sent
                .iter()
                .filter(|(n, _)| applied.contains(*n))
                .map(|(n, r)| (n.clone(), r.clone()))
                .collect();
            self.commit(ty, &applied, &f.removed);
        }
        Event::Nack {
            ty,
            version,
            message: message.to_string(),
        }
    }

    /// An ACK of `f`: the Envoy holds what it was sent, and no longer what it removed.
    fn acked_response(&mut self, ty: ResourceType, f: InFlight) -> Event {
        let version = f.nonce.clone();
        let st = &mut self.types[ty.index()];
        st.ledger.on_ack(&f.sent);
        st.last_acked_version = Some(version.clone());
        match f.then_whole {
            Some(whole) => {
                for name in &f.removed {
                    if st.names.contains(name) {
                        st.told_absent.insert(name.clone());
                    }
                }
                st.ledger.held = whole;
            }
            None => self.commit(ty, &f.sent, &f.removed),
        }
        Event::Ack { ty, version }
    }
}

impl AdsProtocol for DeltaStream {
    type Request = DeltaDiscoveryRequest;
    type Wire = DeltaDiscoveryRequest;
    type Response = DeltaDiscoveryResponse;
    const NAME: &'static str = "delta";

    fn on_request(&mut self, req: DeltaDiscoveryRequest) -> Result<Event, ProtocolError> {
        let ty = ResourceType::from_type_url(&req.type_url)
            .ok_or_else(|| ProtocolError::UnknownType(req.type_url.clone()))?;
        super::check_name_lengths(
            req.resource_names_subscribe
                .iter()
                .chain(&req.resource_names_unsubscribe)
                .chain(req.initial_resource_versions.keys()),
        )?;
        if self.node.is_none() {
            if let Some(node) = &req.node {
                self.node = Some(NodeInfo::from_node(node));
            }
        }
        let subscribed: Vec<Arc<str>> = req
            .resource_names_subscribe
            .iter()
            .filter(|n| *n != "*")
            .map(|n| intern(n, self.types.iter().map(|t| &t.ledger.held)))
            .collect();
        let st = &mut self.types[ty.index()];
        let new_names = subscribed.iter().filter(|n| !st.names.contains(*n)).count();
        if st.names.len() + new_names > super::MAX_NAMES_PER_TYPE {
            return Err(ProtocolError::TooManyNames(st.names.len() + new_names));
        }
        // The versions a reconnecting client declares are held per name too: the same cap.
        if req.initial_resource_versions.len() > super::MAX_NAMES_PER_TYPE {
            return Err(ProtocolError::TooManyNames(
                req.initial_resource_versions.len(),
            ));
        }
        let first = !st.subscribed;
        if first {
            st.subscribed = true;
            st.wildcard = req.resource_names_subscribe.is_empty();
            st.declare_initial(ty, &req.initial_resource_versions);
            if !req.initial_resource_versions.is_empty() {
                self.reconnected = true;
            }
        }
        let st = &mut self.types[ty.index()];
        let wildcard = req.resource_names_subscribe.iter().any(|n| n == "*");
        st.subscribe(first, subscribed, wildcard, &req.resource_names_unsubscribe);
        if req.response_nonce.is_empty() {
            return Ok(Event::Subscribed(ty));
        }
        let Some(f) = st.in_flight.take_if(|f| f.nonce == req.response_nonce) else {
            return Ok(Event::Stale(ty));
        };
        Ok(match &req.error_detail {
            Some(status) => self.nacked(ty, f, &status.message),
            None => self.acked_response(ty, f),
        })
    }

    fn on_wire(&mut self, request: DeltaDiscoveryRequest) -> Result<Event, ProtocolError> {
        self.on_request(request)
    }

    fn poll_type(
        &mut self,
        ty: ResourceType,
        snapshot: &Snapshot,
    ) -> Option<(ResourceType, usize, DeltaDiscoveryResponse)> {
        self.poll_one(ty, snapshot)
    }

    fn node(&self) -> Option<&NodeInfo> {
        self.node.as_ref()
    }

    fn rejected(&self, cluster: &str) -> bool {
        [ResourceType::Cluster, ResourceType::Endpoints]
            .iter()
            .any(|ty| self.types[ty.index()].ledger.rejects(cluster))
    }

    fn awaiting_reconnect(&self) -> bool {
        self.reconnected
            && !self.reconnect_settled
            && !self.types[ResourceType::Route.index()].subscribed
    }

    fn settle_reconnect(&mut self) {
        self.reconnect_settled = true;
    }

    fn warmed(&self, cluster: &str) -> Option<bool> {
        let clusters = &self.types[ResourceType::Cluster.index()];
        if !clusters.subscribed || !clusters.wants(cluster) {
            return None;
        }
        let endpoints = &self.types[ResourceType::Endpoints.index()];
        Some(clusters.ledger.held.contains(cluster) && endpoints.ledger.held.contains(cluster))
    }

    fn held(&self, ty: ResourceType) -> Vec<(Arc<str>, Arc<str>)> {
        self.types[ty.index()].ledger.held_versions()
    }

    fn holds(&self, ty: ResourceType, name: &str) -> Option<Arc<str>> {
        self.types[ty.index()].ledger.held.version_of(name).cloned()
    }

    fn subscription(&self, ty: ResourceType) -> Option<Option<Vec<Arc<str>>>> {
        let st = &self.types[ty.index()];
        if !st.subscribed {
            return None;
        }
        Some((!st.wildcard).then(|| st.names.iter().cloned().collect()))
    }

    fn status(&self) -> Vec<(ResourceType, TypeStatus)> {
        ResourceType::ALL
            .iter()
            .zip(&self.types)
            .filter(|(_, st)| st.subscribed)
            .map(|(ty, st)| {
                let mut subscribed = super::shown_names(st.names.iter().map(|n| n.to_string()));
                if st.wildcard {
                    subscribed.insert(0, "*".into());
                }
                let status = st.ledger.status(subscribed, st.last_acked_version.clone());
                (*ty, status)
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fixtures::service;
    use crate::fixtures::snapshot_of;
    use envoy_types::pb::google::rpc::Status;

    fn subscribe(ty: ResourceType, names: &[&str]) -> DeltaDiscoveryRequest {
        DeltaDiscoveryRequest {
            type_url: ty.type_url().into(),
            resource_names_subscribe: names.iter().map(|s| s.to_string()).collect(),
            ..Default::default()
        }
    }

    fn ack(r: &DeltaDiscoveryResponse) -> DeltaDiscoveryRequest {
        DeltaDiscoveryRequest {
            type_url: r.type_url.clone(),
            response_nonce: r.nonce.clone(),
            ..Default::default()
        }
    }

    fn nack(r: &DeltaDiscoveryResponse) -> DeltaDiscoveryRequest {
        DeltaDiscoveryRequest {
            error_detail: Some(Status {
                code: 3,
                message: "bad cluster".into(),
                details: vec![],
            }),
            ..ack(r)
        }
    }

    fn names(r: &DeltaDiscoveryResponse) -> Vec<&str> {
        r.resources.iter().map(|r| r.name.as_str()).collect()
    }

    const EDS: &str = "default/a/a1";

    /// Subscribes like Envoy and ACKs until quiet.
    fn converge(s: &mut DeltaStream, snap: &Snapshot, eds: &[&str]) {
        s.on_request(subscribe(ResourceType::Cluster, &[])).unwrap();
        s.on_request(subscribe(ResourceType::Listener, &[]))
            .unwrap();
        s.on_request(subscribe(ResourceType::Endpoints, eds))
            .unwrap();
        s.on_request(subscribe(ResourceType::Route, &["ray-serve-http"]))
            .unwrap();
        for _ in 0..10 {
            let out = s.poll(snap);
            if out.is_empty() {
                return;
            }
            for (_, _, r) in out {
                s.on_request(ack(&r)).unwrap();
            }
        }
        panic!("did not converge");
    }

    #[test]
    fn legacy_empty_first_request_is_a_wildcard() {
        let snap = snapshot_of(vec![
            service("a", "a1", &[8000]),
            service("b", "b1", &[9000]),
        ]);
        let mut s = DeltaStream::new();
        s.on_request(subscribe(ResourceType::Cluster, &[])).unwrap();
        let r = s.poll(&snap).remove(0).2;
        assert_eq!(names(&r), ["default/a/a1", "default/b/b1"]);
        assert_eq!(r.system_version_info, snap.version());
        let mut s = DeltaStream::new();
        s.on_request(subscribe(ResourceType::Cluster, &["*"]))
            .unwrap();
        assert_eq!(s.poll(&snap).remove(0).2.resources.len(), 2);
    }

    #[test]
    fn sends_only_what_changed() {
        let snap1 = snapshot_of(vec![
            service("a", "a1", &[8000]),
            service("b", "b1", &[9000]),
        ]);
        let mut s = DeltaStream::new();
        converge(&mut s, &snap1, &[EDS, "default/b/b1"]);
        let snap2 = snapshot_of(vec![
            service("a", "a1", &[8000]),
            service("b", "b1", &[9001]),
        ]);
        let out = s.poll(&snap2);
        assert_eq!(out.len(), 1);
        assert_eq!(out[0].0, ResourceType::Endpoints);
        assert_eq!(names(&out[0].2), ["default/b/b1"]);
        assert!(out[0].2.removed_resources.is_empty());
    }

    #[test]
    fn initial_resource_versions_avoid_resending_and_reveal_removals() {
        let snap = snapshot_of(vec![service("a", "a1", &[8000])]);
        let mut s = DeltaStream::new();
        let mut req = subscribe(ResourceType::Cluster, &["*"]);
        let current = &snap.resources(ResourceType::Cluster)[EDS];
        req.initial_resource_versions
            .insert(EDS.into(), current.version.to_string());
        req.initial_resource_versions
            .insert("default/gone/x".into(), "old".into());
        s.on_request(req).unwrap();
        // A route the Envoy still holds may name x: until it declares its routes, x stays.
        assert!(s.poll(&snap).is_empty(), "a1 is already held; x waits");
        assert!(s.awaiting_reconnect());
        s.on_request(subscribe(ResourceType::Route, &["*"]))
            .unwrap();
        let out = s.poll(&snap);
        assert_eq!(out[0].0, ResourceType::Cluster);
        let r = &out[0].2;
        assert!(r.resources.is_empty(), "a1 is already held");
        assert_eq!(r.removed_resources, ["default/gone/x"]);
    }

    #[test]
    fn a_reconnected_envoy_that_declares_no_routes_loses_removed_clusters_after_the_wait() {
        let snap = snapshot_of(vec![service("a", "a1", &[8000])]);
        let mut s = DeltaStream::new();
        let mut req = subscribe(ResourceType::Cluster, &["*"]);
        req.initial_resource_versions
            .insert("default/gone/x".into(), "old".into());
        s.on_request(req).unwrap();
        let out = s.poll(&snap);
        assert_eq!(names(&out[0].2), [EDS], "new clusters go at once");
        s.on_request(ack(&out[0].2)).unwrap();
        assert!(s.poll(&snap).is_empty());
        s.settle_reconnect();
        assert!(!s.awaiting_reconnect());
        let out = s.poll(&snap);
        assert_eq!(out[0].2.removed_resources, ["default/gone/x"]);
    }

    #[test]
    fn unsubscribe_and_resubscribe() {
        let snap = snapshot_of(vec![
            service("a", "a1", &[8000]),
            service("b", "b1", &[9000]),
        ]);
        let mut s = DeltaStream::new();
        s.on_request(subscribe(ResourceType::Endpoints, &[EDS]))
            .unwrap();
        let r = s.poll(&snap).remove(0).2;
        assert_eq!(names(&r), [EDS]);
        // A subscription change rides on the ACK.
        let mut req = ack(&r);
        req.resource_names_subscribe = vec!["default/b/b1".into()];
        s.on_request(req).unwrap();
        let r = s.poll(&snap).remove(0).2;
        assert_eq!(names(&r), ["default/b/b1"]);
        s.on_request(ack(&r)).unwrap();
        let mut req = subscribe(ResourceType::Endpoints, &[]);
        req.resource_names_unsubscribe = vec![EDS.into()];
        s.on_request(req).unwrap();
        assert!(s.poll(&snap).is_empty(), "unsubscribing sends nothing");
        s.on_request(subscribe(ResourceType::Endpoints, &[EDS]))
            .unwrap();
        assert_eq!(
            names(&s.poll(&snap).remove(0).2),
            [EDS],
            "resubscribing sends it again"
        );
    }

    #[test]
    fn subscription_changes_count_even_with_a_stale_nonce() {
        let snap = snapshot_of(vec![
            service("a", "a1", &[8000]),
            service("b", "b1", &[9000]),
        ]);
        let mut s = DeltaStream::new();
        s.on_request(subscribe(ResourceType::Endpoints, &[EDS]))
            .unwrap();
        let r = s.poll(&snap).remove(0).2;
        let mut stale = subscribe(ResourceType::Endpoints, &["default/b/b1"]);
        stale.response_nonce = "12345".into();
        assert_eq!(
            s.on_request(stale).unwrap(),
            Event::Stale(ResourceType::Endpoints)
        );
        s.on_request(ack(&r)).unwrap();
        assert_eq!(names(&s.poll(&snap).remove(0).2), ["default/b/b1"]);
    }

    #[test]
    fn a_nack_is_not_answered_with_the_same_resource() {
        let snap = snapshot_of(vec![service("a", "a1", &[8000])]);
        let mut s = DeltaStream::new();
        s.on_request(subscribe(ResourceType::Cluster, &["*"]))
            .unwrap();
        let r = s.poll(&snap).remove(0).2;
        assert!(matches!(
            s.on_request(nack(&r)).unwrap(),
            Event::Nack { .. }
        ));
        assert!(s.poll(&snap).is_empty(), "no NACK loop");
        assert_eq!(s.status()[0].1.nacks, 1);
        let changed = snapshot_of(vec![
            service("a", "a1", &[8000]),
            service("b", "b1", &[9000]),
        ]);
        let r = s.poll(&changed).remove(0).2;
        assert_eq!(
            names(&r),
            ["default/b/b1"],
            "a1 unchanged stays rejected; b1 is new"
        );
    }

    #[test]
    fn a_large_initial_sync_is_split_and_ends_whole() {
        // About 2.4 MB of endpoints: several times the response budget.
        let services: Vec<_> = (0..1200)
            .map(|i| {
                let mut s = service(&format!("s{i}"), "c", &(8000..8020).collect::<Vec<u16>>());
                s.hosts = vec![format!("s{i}.example")];
                s
            })
            .collect();
        let snap = snapshot_of(services);
        let mut s = DeltaStream::new();
        s.on_request(subscribe(ResourceType::Endpoints, &["*"]))
            .unwrap();
        let (mut received, mut responses) = (0, 0);
        loop {
            let mut out = s.poll(&snap);
            if out.is_empty() {
                break;
            }
            let r = out.remove(0).2;
            let bytes: usize = r
                .resources
                .iter()
                .map(|x| x.resource.as_ref().unwrap().value.len())
                .sum();
            assert!(r.resources.len() == 1 || bytes <= RESPONSE_BUDGET_BYTES);
            received += r.resources.len();
            responses += 1;
            s.on_request(ack(&r)).unwrap();
        }
        assert_eq!(received, 1200);
        assert!(responses > 2, "{responses}");
        assert!(s.types[1]
            .ledger
            .held
            .is_whole(&snap, ResourceType::Endpoints));
    }

    #[test]
    fn a_nacked_resource_keeps_the_stream_out_of_sync() {
        let snap = snapshot_of(vec![service("a", "a1", &[8000])]);
        let mut s = DeltaStream::new();
        s.on_request(subscribe(ResourceType::Cluster, &["*"]))
            .unwrap();
        let r = s.poll(&snap).remove(0).2;
        s.on_request(nack(&r)).unwrap();
        assert!(s.poll(&snap).is_empty());
        assert!(
            !s.types[0]
                .ledger
                .held
                .is_whole(&snap, ResourceType::Cluster),
            "the Envoy does not hold a1"
        );
    }

    #[test]
    fn removal_waits_until_no_held_route_names_the_cluster() {
        let before = snapshot_of(vec![service("a", "a1", &[8000])]);
        let mut s = DeltaStream::new();
        converge(&mut s, &before, &[EDS]);
        let after = snapshot_of(vec![service("a", "a2", &[8100])]);
        let out = s.poll(&after);
        assert_eq!(out.len(), 1, "{out:?}");
        let cds = &out[0].2;
        assert_eq!(names(cds), ["default/a/a2"]);
        assert!(
            cds.removed_resources.is_empty(),
            "the held route still names a1"
        );
        s.on_request(ack(cds)).unwrap();
        let mut req = subscribe(ResourceType::Endpoints, &["default/a/a2"]);
        req.response_nonce = String::new();
        s.on_request(req).unwrap();
        let out = s.poll(&after);
        assert_eq!(
            out.iter().map(|o| o.0).collect::<Vec<_>>(),
            [ResourceType::Endpoints]
        );
        s.on_request(ack(&out[0].2)).unwrap();
        let out = s.poll(&after);
        assert_eq!(
            out.iter().map(|o| o.0).collect::<Vec<_>>(),
            [ResourceType::Route]
        );
        s.on_request(ack(&out[0].2)).unwrap();
        let out = s.poll(&after);
        assert_eq!(
            out.iter().map(|o| o.0).collect::<Vec<_>>(),
            [ResourceType::Cluster, ResourceType::Endpoints]
        );
        assert_eq!(out[0].2.removed_resources, ["default/a/a1"]);
        assert_eq!(out[1].2.removed_resources, ["default/a/a1"]);
    }

    fn removed(r: &DeltaDiscoveryResponse) -> Vec<&str> {
        r.removed_resources.iter().map(|n| n.as_str()).collect()
    }

    #[test]
    fn a_name_that_does_not_exist_is_answered_removed_once() {
        let snap = snapshot_of(vec![service("a", "a1", &[8000])]);
        let mut s = DeltaStream::new();
        s.on_request(subscribe(ResourceType::Endpoints, &[EDS, "default/nope/x"]))
            .unwrap();
        let out = s.poll(&snap);
        assert_eq!(out.len(), 1);
        let r = &out[0].2;
        assert_eq!(names(r), [EDS]);
        assert_eq!(
            removed(r),
            ["default/nope/x"],
            "told at once, not left to time out"
        );
        s.on_request(ack(r)).unwrap();
        assert!(s.poll(&snap).is_empty(), "and only once");
        // It appears later: sent then.
        let later = snapshot_of(vec![
            service("a", "a1", &[8000]),
            service("nope", "x", &[9000]),
        ]);
        let out = s.poll(&later);
        assert_eq!(names(&out[0].2), ["default/nope/x"]);
    }

    #[test]
    fn a_name_subscribed_again_is_sent_again() {
        let snap = snapshot_of(vec![service("a", "a1", &[8000])]);
        let mut s = DeltaStream::new();
        converge(&mut s, &snap, &[EDS]);
        // Envoy subscribes again to what it seems to hold (it may have dropped it).
        s.on_request(subscribe(ResourceType::Endpoints, &[EDS]))
            .unwrap();
        let out = s.poll(&snap);
        assert_eq!(out.len(), 1);
        assert_eq!(names(&out[0].2), [EDS]);
        // So is a wildcard member whose own name is unsubscribed: the client must learn
        // it still gets it through the wildcard.
        let mut s = DeltaStream::new();
        converge(&mut s, &snap, &[EDS]);
        s.on_request(DeltaDiscoveryRequest {
            type_url: ResourceType::Cluster.type_url().into(),
            resource_names_unsubscribe: vec!["default/a/a1".into()],
            ..Default::default()
        })
        .unwrap();
        let out = s.poll(&snap);
        assert_eq!(names(&out[0].2), ["default/a/a1"]);
    }

    #[test]
    fn a_changed_cluster_gets_its_unchanged_endpoints_again() {
        let snap = snapshot_of(vec![service("a", "a1", &[8000])]);
        let mut s = DeltaStream::new();
        converge(&mut s, &snap, &[EDS]);
        let mut resources = crate::fixtures::resources_of(&[service("a", "a1", &[8000])]);
        resources.clusters[0].connect_timeout = Some(envoy_types::pb::google::protobuf::Duration {
            seconds: 3,
            nanos: 0,
        });
        let changed = Snapshot::build(&resources, Some(&snap)).unwrap();
        // Envoy warms the changed cluster and ACKs it only once warm: the assignment goes
        // right behind it, without waiting for that ACK.
        let out = s.poll(&changed);
        let types: Vec<_> = out.iter().map(|(t, _, _)| *t).collect();
        assert_eq!(types, [ResourceType::Cluster, ResourceType::Endpoints]);
        assert_eq!(names(&out[1].2), [EDS], "the same assignment, sent again");
        assert!(s.poll(&changed).is_empty(), "once");
        s.on_request(ack(&out[1].2)).unwrap();
        s.on_request(ack(&out[0].2)).unwrap();
        assert!(s.poll(&changed).is_empty(), "and no more");
    }

    #[test]
    fn phantom_unsubscriptions_are_ignored() {
        // Spec: "A resource_names_unsubscribe field may contain superfluous resource
        // names, which the server thought the client was already not subscribed to. The
        // server must cleanly process such a request."
        let snap = snapshot_of(vec![service("a", "a1", &[8000])]);
        let mut s = DeltaStream::new();
        converge(&mut s, &snap, &[EDS]);
        let mut req = subscribe(ResourceType::Endpoints, &[]);
        req.resource_names_unsubscribe = vec!["default/never/subscribed".into()];
        s.on_request(req).unwrap();
        assert!(
            s.poll(&snap).is_empty(),
            "nothing to send, nothing forgotten"
        );
        let changed = snapshot_of(vec![service("a", "a1", &[8001])]);
        let out = s.poll(&changed);
        assert_eq!(names(&out[0].2), [EDS], "still subscribed to what it was");
    }

    #[test]
    fn only_the_first_request_needs_the_node() {
        let snap = snapshot_of(vec![service("a", "a1", &[8000])]);
        let mut s = DeltaStream::new();
        let mut first = subscribe(ResourceType::Cluster, &[]);
        first.node = Some(envoy_types::pb::envoy::config::core::v3::Node {
            id: "envoy-1".into(),
            ..Default::default()
        });
        s.on_request(first).unwrap();
        let r = s.poll(&snap).remove(0).2;
        s.on_request(ack(&r)).unwrap();
        s.on_request(subscribe(ResourceType::Listener, &[]))
            .unwrap();
        assert_eq!(s.node().unwrap().id, "envoy-1");
    }

    #[test]
    fn unknown_type_urls_are_refused() {
        let mut s = DeltaStream::new();
        let err = s
            .on_request(DeltaDiscoveryRequest {
                type_url: "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.Secret"
                    .into(),
                ..Default::default()
            })
            .unwrap_err();
        assert!(matches!(err, ProtocolError::UnknownType(_)));
    }

    #[test]
    fn a_rejected_merged_route_is_not_made_again() {
        // Service b moves to a cluster the Envoy has not warmed while service a's
        // virtual host changes: the Envoy gets a route made for it (a new, b as held).
        // When it rejects that route, the same merge is not sent again in a loop.
        let snap1 = snapshot_of(vec![
            service("a", "a1", &[8000]),
            service("b", "b1", &[9000]),
        ]);
        let mut s = DeltaStream::new();
        converge(&mut s, &snap1, &[EDS, "default/b/b1"]);
        let mut a = service("a", "a1", &[8000]);
        a.hosts = vec!["a.example".into(), "a2.example".into()];
        let snap2 = snapshot_of(vec![a, service("b", "b2", &[9100])]);
        let snapshot_route = snap2.resources(ResourceType::Route)["ray-serve-http"]
            .version
            .to_string();
        let out = s.poll(&snap2);
        let route = out
            .iter()
            .find(|(ty, _, _)| *ty == ResourceType::Route)
            .map(|(_, _, r)| r.clone())
            .expect("a merged route goes while b2 is cold");
        assert_ne!(route.resources[0].version, snapshot_route, "a merge");
        let merged = route.resources[0].version.clone();
        for (ty, _, r) in &out {
            if *ty != ResourceType::Route {
                s.on_request(ack(r)).unwrap();
            }
        }
        s.on_request(nack(&route)).unwrap();
        // Endpoints change elsewhere, the route does not.
        let mut a = service("a", "a1", &[8001]);
        a.hosts = vec!["a.example".into(), "a2.example".into()];
        let snap3 = snapshot_of(vec![a, service("b", "b2", &[9100])]);
        for snap in [&snap2, &snap3, &snap3] {
            for (ty, _, r) in s.poll(snap) {
                assert!(
                    ty != ResourceType::Route || r.resources[0].version != merged,
                    "the rejected merge is sent again"
                );
                s.on_request(ack(&r)).unwrap();
            }
        }
    }

    #[test]
    fn a_stream_subscribes_to_a_bounded_number_of_names() {
        let mut s = DeltaStream::new();
        let names: Vec<String> = (0..15_000).map(|i| format!("n{i}")).collect();
        let refs: Vec<&str> = names.iter().map(String::as_str).collect();
        s.on_request(subscribe(ResourceType::Endpoints, &refs))
            .unwrap();
        // The same names again: still 15,000.
        s.on_request(subscribe(ResourceType::Endpoints, &refs))
            .unwrap();
        let more: Vec<String> = (0..15_000).map(|i| format!("m{i}")).collect();
        let more: Vec<&str> = more.iter().map(String::as_str).collect();
        let err = s
            .on_request(subscribe(ResourceType::Endpoints, &more))
            .unwrap_err();
        assert!(matches!(err, ProtocolError::TooManyNames(_)), "{err}");
    }

    #[test]
    fn a_name_is_bounded_in_length() {
        let long = "n".repeat(crate::MAX_NAME_BYTES + 1);
        let err = DeltaStream::new()
            .on_request(subscribe(ResourceType::Endpoints, &[&long]))
            .unwrap_err();
        assert_eq!(err, ProtocolError::NameTooLong(long.len()));
        let mut req = subscribe(ResourceType::Cluster, &[]);
        req.initial_resource_versions
            .insert(long.clone(), "v".into());
        let err = DeltaStream::new().on_request(req).unwrap_err();
        assert_eq!(err, ProtocolError::NameTooLong(long.len()));
        let fits = "n".repeat(crate::MAX_NAME_BYTES);
        DeltaStream::new()
            .on_request(subscribe(ResourceType::Endpoints, &[&fits]))
            .unwrap();
    }

    #[test]
    fn a_reconnecting_client_declares_a_bounded_number_of_versions() {
        let mut req = subscribe(ResourceType::Cluster, &[]);
        req.initial_resource_versions = (0..super::super::MAX_NAMES_PER_TYPE)
            .map(|i| (format!("c{i}"), "v".to_string()))
            .collect();
        DeltaStream::new().on_request(req.clone()).unwrap();
        req.initial_resource_versions
            .insert("one-more".into(), "v".into());
        let err = DeltaStream::new().on_request(req).unwrap_err();
        assert!(matches!(err, ProtocolError::TooManyNames(_)), "{err}");
    }

    #[test]
    fn a_rejected_removal_is_not_sent_again_in_a_loop() {
        let snap = snapshot_of(vec![service("a", "a1", &[8000])]);
        let mut s = DeltaStream::new();
        s.on_request(subscribe(ResourceType::Endpoints, &["default/nope/x"]))
            .unwrap();
        let r = s.poll(&snap).remove(0).2;
        assert_eq!(r.removed_resources, ["default/nope/x"]);
        s.on_request(nack(&r)).unwrap();
        for _ in 0..3 {
            assert!(s.poll(&snap).is_empty(), "the same answer again");
        }
    }
}
