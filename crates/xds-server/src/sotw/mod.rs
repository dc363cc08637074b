//! The state-of-the-world ADS state machine for one stream (`StreamAggregatedResources`).
//!
//! Invariants:
//! - at most one response per type is in flight; the next waits for its ACK or NACK, so
//!   a slow Envoy is only ever sent the latest state, never a queue of old ones;
//! - an ACK is a request whose nonce is the one in flight and has no `error_detail`; a
//!   request with any older nonce is stale and ignored;
//! - a NACKed version is not sent again until the content (and so its version) changes;
//! - clusters and listeners go as complete sets; endpoints and routes only for the
//!   subscribed names, and only the ones whose version the Envoy does not hold;
//! - `version_info` is a hash of what the Envoy will hold, so a reconnecting Envoy that
//!   reports the version we would send is sent nothing.
//!
//! `request` reads what a request asks for; `type_state` keeps each type's state and
//! its ACK, NACK, subscription and change steps; this module sequences them per stream.

use std::sync::Arc;

use envoy_types::pb::envoy::service::discovery::v3::{DiscoveryRequest, DiscoveryResponse};

mod request;
mod type_state;

use request::Subscription;
pub use request::WireRequest;
use type_state::{declare_held, held_version, InFlight, TypeState};

use super::holding::{retain_names, same_names_change, Holding};
use super::ordering::{
    desired, is_whole_set, take_budget, ClientHolds, Desired, RESPONSE_BUDGET_BYTES,
};
use super::snapshot::{set_version, ResourceMap, ResourceType, Snapshot};
use super::{AdsProtocol, Event, NodeInfo, ProtocolError, TypeStatus};

#[derive(Debug, Default)]
pub struct SotwStream {
    types: [TypeState; 4],
    next_nonce: u64,
    node: Option<NodeInfo>,
    /// The Envoy reported versions it held from an earlier stream (a reconnect).
    reconnected: bool,
    /// The wait for a reconnected Envoy to declare what it holds is over.
    reconnect_settled: bool,
}

impl SotwStream {
    pub fn new() -> SotwStream {
        SotwStream::default()
    }

    /// Forgets the versions of `names` of `ty` the Envoy holds, so that they are sent
    /// again.
    fn forget(&mut self, ty: ResourceType, names: &[Arc<str>]) {
        let st = &mut self.types[ty.index()];
        // (One only in flight matters too: its ACK would record it as held.)
        let in_flight = st.in_flight.as_ref().is_some_and(|f| {
            names.iter().any(|n| {
                f.resources.contains_key(n) || f.then_whole.as_ref().is_some_and(|w| w.contains(n))
            })
        });
        if !in_flight && names.iter().all(|n| !st.ledger.held.contains(n)) {
            return;
        }
        let held = st.ledger.held.own();
        for name in names {
            // Still held (a route may name it), at a version to be sent again.
            if let Some(h) = held.get_mut(name) {
                h.version = "".into();
            }
        }
        st.acked_version = held_version(&st.ledger.held);
        // A response in flight was versioned with these names held: its ACK must not
        // bring their versions (or that version) back.
        if let Some(f) = &mut st.in_flight {
            f.then_whole = None;
            for name in names {
                if let Some(r) = f.resources.remove(name) {
                    f.forgotten.push((name.clone(), r.version.clone()));
                }
            }
            st.forgot_in_flight = true;
        }
    }
}

impl SotwStream {
    /// A reconnected Envoy has not yet declared (by its EDS request) the clusters it
    /// holds, and the wait for it is not over.
    fn awaiting_declarations(&self) -> bool {
        self.reconnected
            && !self.reconnect_settled
            && self.types[ResourceType::Endpoints.index()]
                .subscription
                .is_none()
    }
}

impl SotwStream {
    /// Moves an Envoy that holds an earlier whole set of `ty` to `snapshot`'s whole set,
    /// given what changed between them.
    fn send_whole(
        &mut self,
        ty: ResourceType,
        snapshot: &Snapshot,
        changed: ResourceMap,
    ) -> Option<(ResourceType, usize, DiscoveryResponse)> {
        let st = &mut self.types[ty.index()];
        let version = snapshot.type_version(ty).to_string();
        if changed.is_empty() {
            st.ledger.held = Holding::whole(snapshot, ty);
            st.acked_version = version;
            return None;
        }
        if st.ledger.not_again.as_deref() == Some(version.as_str()) {
            return None;
        }
        let (resources, version, then_whole) = if ty.is_full_state() {
            let all = snapshot.resources(ty).clone();
            (all, version, Some(Holding::whole(snapshot, ty)))
        } else {
            let (chunk, complete) = take_budget(changed, RESPONSE_BUDGET_BYTES);
            if complete {
                (chunk, version, Some(Holding::whole(snapshot, ty)))
            } else {
                let partial = set_version(snapshot.resources(ty).iter().map(|(n, r)| {
                    let v = chunk.get(n).map_or_else(
                        || st.ledger.held.version_of(n).unwrap_or(&r.version),
                        |c| &c.version,
                    );
                    (&**n, &**v)
                }));
                (chunk, partial, None)
            }
        };
        Some(self.respond(ty, snapshot, version, resources, then_whole))
    }

    fn respond(
        &mut self,
        ty: ResourceType,
        snapshot: &Snapshot,
        version: String,
        resources: ResourceMap,
        then_whole: Option<Holding>,
    ) -> (ResourceType, usize, DiscoveryResponse) {
        if ty == ResourceType::Cluster {
            // A cluster whose settings change is warmed anew: Envoy waits for a
            // ClusterLoadAssignment sent after it, even an unchanged one, and ACKs the
            // clusters only once they are warm. So its endpoints go again right behind it.
            let held = &self.types[ty.index()].ledger.held;
            let changed: Vec<Arc<str>> = resources
                .iter()
                // New to this stream counts too: after a reconnect the Envoy may hold (or
                // warm) a cluster this stream never recorded, and its endpoints already.
                .filter(|(n, r)| held.version_of(n).is_none_or(|v| **v != *r.version))
                .map(|(n, _)| n.clone())
                .collect();
            if !changed.is_empty() {
                self.forget(ResourceType::Endpoints, &changed);
            }
        }
        self.next_nonce += 1;
        let nonce = self.next_nonce.to_string();
        let response = DiscoveryResponse {
            version_info: version.clone(),
            resources: resources.values().map(|r| r.body.clone()).collect(),
            type_url: ty.type_url().to_string(),
            nonce: nonce.clone(),
            ..Default::default()
        };
        let count = resources.len();
        let st = &mut self.types[ty.index()];
        st.ledger.pushes += 1;
        st.last_nonce = Some(nonce.clone());
        st.in_flight = Some(InFlight {
            nonce,
            version,
            resources,
            then_whole,
            endpoints_then: (ty == ResourceType::Cluster)
                .then(|| snapshot.shared(ResourceType::Endpoints).clone()),
            forgotten: Vec::new(),
        });
        (ty, count, response)
    }

    /// The response `ty` needs now, if any: nothing while not asked for or awaiting an
    /// ACK, or while the Envoy holds the snapshot's whole set; else what `desired` lets
    /// this Envoy hold next, as state of the world can say it.
    fn poll_one(
        &mut self,
        ty: ResourceType,
        snapshot: &Snapshot,
    ) -> Option<(ResourceType, usize, DiscoveryResponse)> {
        let current = snapshot.resources(ty);
        let st = &mut self.types[ty.index()];
        // A rejection matters while the snapshot still has the version rejected.
        st.ledger.rejected.prune(current);
        if st.subscription.is_none() || st.in_flight.is_some() {
            return None; // Not asked for, or waiting for an ACK.
        }
        // Endpoints of clusters being warmed that have left the snapshot since.
        let warming_gone = ty == ResourceType::Endpoints
            && self.types[ResourceType::Cluster.index()]
                .in_flight
                .as_ref()
                .is_some_and(|f| f.resources.keys().any(|n| !current.contains_key(n)));
        let st = &self.types[ty.index()];
        if st.ledger.held.is_whole(snapshot, ty) && !warming_gone {
            return None; // It holds this snapshot's whole set.
        }
        if ty == ResourceType::Cluster && self.awaiting_declarations() {
            // A reconnected Envoy names the clusters it holds in its EDS request; a
            // cluster set sent before that could remove one its route still uses.
            return None;
        }
        if ty != ResourceType::Route && st.ledger.rejected.is_empty() && !warming_gone {
            if let Some(changed) = same_names_change(&st.ledger.held, current) {
                return self.send_whole(ty, snapshot, changed);
            }
        }
        let (wanted, kept) = self.sendable(ty, snapshot)?;
        let whole = is_whole_set(&wanted, snapshot, ty);
        let version = if whole {
            snapshot.type_version(ty).to_string()
        } else {
            set_version(wanted.iter().map(|(n, r)| (&**n, &*r.version)))
        };
        let st = &mut self.types[ty.index()];
        if st.holds_already(ty, snapshot, &wanted, &kept, &version, whole) {
            return None;
        }
        if st.ledger.not_again.as_deref() == Some(version.as_str()) {
            return None;
        }
        let (resources, version, then_whole) = if ty.is_full_state() {
            (wanted, version, whole.then(|| Holding::whole(snapshot, ty)))
        } else {
            st.change_to_send(ty, snapshot, wanted, version, whole)?
        };
        Some(self.respond(ty, snapshot, version, resources, then_whole))
    }

    /// What this Envoy holds and is being sent, as `desired` reads it for `ty`.
    fn client_holds(&self, ty: ResourceType) -> ClientHolds<'_> {
        let clusters = &self.types[ResourceType::Cluster.index()];
        let routes = &self.types[ResourceType::Route.index()];
        ClientHolds {
            acked: [
                &self.types[0].ledger.held,
                &self.types[1].ledger.held,
                &self.types[2].ledger.held,
                &self.types[3].ledger.held,
            ],
            routes_in_flight: routes.in_flight.as_ref().map(|f| &f.resources),
            rejected: [
                &self.types[0].ledger.rejected,
                &self.types[1].ledger.rejected,
                &self.types[2].ledger.rejected,
                &self.types[3].ledger.rejected,
            ],
            routes_unknown: self.reconnected
                && !self.reconnect_settled
                && routes.subscription.is_none(),
            clusters_in_flight: clusters
                .in_flight
                .as_ref()
                .and_then(|f| Some((&f.resources, &**f.endpoints_then.as_ref()?))),
            // A cluster set in flight removes every held cluster it leaves out.
            leaving: match &clusters.in_flight {
                Some(f) if ty == ResourceType::Route => clusters
                    .ledger
                    .held
                    .iter()
                    .filter(|(n, _, _)| !f.resources.contains_key(*n))
                    .map(|(n, _, _)| n.clone())
                    .collect(),
                _ => Default::default(),
            },
        }
    }

    /// What `ty` should hold next within its subscription, with a body for each name
    /// (state of the world sends whole resources), and the names the Envoy keeps that
    /// have no body here. `None` when `ty` is not subscribed.
    fn sendable(
        &self,
        ty: ResourceType,
        snapshot: &Snapshot,
    ) -> Option<(ResourceMap, Vec<Arc<str>>)> {
        let current = snapshot.resources(ty);
        let mut wanted = desired(snapshot, ty, &self.client_holds(ty));
        let mut kept = Vec::new();
        let st = &self.types[ty.index()];
        let subscription = st.subscription.as_ref()?;
        if let Subscription::Names(names) = subscription {
            wanted = retain_names(wanted, names);
            if ty == ResourceType::Endpoints {
                // Endpoints asked for that the snapshot lacks and that the Envoy may never
                // have had: their cluster may be warming (Envoy ACKs no cluster until
                // every one is warm), and state of the world cannot say "there is none".
                // A stand-in assignment warms it. One the Envoy has keeps what it has
                // (else, left out of what it holds, it was sent again at every wake).
                for name in names.iter() {
                    let had = st
                        .ledger
                        .held
                        .version_of(name)
                        .is_some_and(|v| !v.is_empty());
                    if !wanted.contains_key(name) && !current.contains_key(name) {
                        if had {
                            kept.push(name.clone());
                        } else if let Some(stand_in) = snapshot.stand_in(ty, name) {
                            wanted.insert(name.clone(), Desired::Send(stand_in));
                        }
                    }
                }
            }
        }
        // State of the world cannot send a resource it has no body for: a cluster the
        // Envoy must keep (a route it holds may name it) goes as a stand-in, and so do
        // its endpoints; a route is per name, and leaving it out leaves it as it is.
        let wanted: ResourceMap = wanted
            .into_iter()
            .filter_map(|(name, d)| match d {
                Desired::Send(r) => Some((name, r)),
                Desired::Keep => match snapshot.stand_in(ty, &name) {
                    Some(stand_in) if !snapshot.resources(ty).contains_key(&name) => {
                        Some((name, stand_in))
                    }
                    _ => {
                        kept.push(name);
                        None
                    }
                },
            })
            .collect();
        Some((wanted, kept))
    }
}

impl AdsProtocol for SotwStream {
    type Request = DiscoveryRequest;
    type Wire = WireRequest;
    type Response = DiscoveryResponse;
    const NAME: &'static str = "sotw";

    fn on_request(&mut self, req: DiscoveryRequest) -> Result<Event, ProtocolError> {
        self.on_wire(req.into())
    }

    fn on_wire(&mut self, wire: WireRequest) -> Result<Event, ProtocolError> {
        let names: Vec<&str> = wire.resource_names().collect();
        let names = &names[..];
        let req = &wire.request;
        let ty = ResourceType::from_type_url(&req.type_url)
            .ok_or_else(|| ProtocolError::UnknownType(req.type_url.clone()))?;
        if names.len() > super::MAX_NAMES_PER_TYPE {
            return Err(ProtocolError::TooManyNames(names.len()));
        }
        super::check_name_lengths(names)?;
        if self.node.is_none() {
            if let Some(node) = &req.node {
                self.node = Some(NodeInfo::from_node(node));
            }
        }
        let mut reconnected = false;
        let clusters_unanswered = self.types[ResourceType::Cluster.index()]
            .last_nonce
            .is_none();
        let st = &mut self.types[ty.index()];

        let answers_latest = match &st.last_nonce {
            // Nothing sent on this stream yet: whatever nonce it carries (one from a
            // previous server), this is the initial request.
            None => true,
            Some(last) => req.response_nonce.is_empty() || *last == req.response_nonce,
        };
        if !answers_latest {
            return Ok(Event::Stale(ty));
        }
        let in_flight = st
            .in_flight
            .take_if(|f| f.nonce == req.response_nonce && !req.response_nonce.is_empty());
        let event = match in_flight {
            Some(f) => match &req.error_detail {
                Some(status) => st.nacked(ty, f, status),
                None => st.acked_response(ty, f),
            },
            None => {
                if st.last_nonce.is_none() && st.acked_version.is_empty() {
                    // A reconnecting Envoy reports what it holds. Not so for clusters and
                    // endpoints, which it is sent again: a cluster it was warming when the
                    // stream broke waits for a ClusterLoadAssignment sent after it, and
                    // after a NACK Envoy still reports its last accepted cluster version
                    // though it applied every cluster it could from the rejected response.
                    if !matches!(ty, ResourceType::Cluster | ResourceType::Endpoints) {
                        st.acked_version = req.version_info.clone();
                    }
                    // So is one that asks for endpoints before this stream sent it any
                    // cluster: only clusters it holds (or warms) make it ask, whatever
                    // versions it reports (none, when it never accepted a whole cluster
                    // response but applied part of one).
                    reconnected = !req.version_info.is_empty()
                        || (ty == ResourceType::Endpoints
                            && clusters_unanswered
                            && !names.is_empty());
                }
                Event::Subscribed(ty)
            }
        };
        if reconnected {
            self.reconnected = true;
            // It holds the names it asks for (per-name types); which clusters it holds,
            // its EDS request tells (every cluster ray-xds makes is an EDS cluster).
            if !ty.is_full_state() {
                declare_held(&mut self.types[ty.index()].ledger.held, names);
            }
        }
        if ty == ResourceType::Endpoints && self.reconnected {
            // Every cluster it asks endpoints for, it holds (or warms: then it may never
            // have had endpoints, and reports no version).
            let [clusters, endpoints, ..] = &mut self.types;
            if clusters.last_nonce.is_none() {
                declare_held(&mut clusters.ledger.held, names);
            }
            if endpoints.last_nonce.is_none() {
                declare_held(&mut endpoints.ledger.held, names);
            }
        }
        self.types[ty.index()].subscribe(names);
        Ok(event)
    }

    fn poll_type(
        &mut self,
        ty: ResourceType,
        snapshot: &Snapshot,
    ) -> Option<(ResourceType, usize, DiscoveryResponse)> {
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
        self.awaiting_declarations()
            || (self.reconnected
                && !self.reconnect_settled
                && self.types[ResourceType::Route.index()]
                    .subscription
                    .is_none())
    }

    fn settle_reconnect(&mut self) {
        self.reconnect_settled = true;
    }

    fn warmed(&self, cluster: &str) -> Option<bool> {
        let clusters = &self.types[ResourceType::Cluster.index()];
        if !clusters.subscription.as_ref()?.wants(cluster) {
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
        Some(match self.types[ty.index()].subscription.as_ref()? {
            Subscription::Wildcard => None,
            Subscription::Names(names) => Some(names.iter().cloned().collect()),
        })
    }

    fn status(&self) -> Vec<(ResourceType, TypeStatus)> {
        ResourceType::ALL
            .iter()
            .zip(&self.types)
            .filter(|(_, st)| st.subscription.is_some())
            .map(|(ty, st)| {
                let subscribed = match &st.subscription {
                    Some(Subscription::Names(names)) => {
                        super::shown_names(names.iter().map(|n| n.to_string()))
                    }
                    _ => vec!["*".to_string()],
                };
                let acked = Some(st.acked_version.clone()).filter(|v| !v.is_empty());
                let status = st.ledger.status(subscribed, acked);
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

    fn request(ty: ResourceType, names: &[&str], version: &str, nonce: &str) -> DiscoveryRequest {
        DiscoveryRequest {
            type_url: ty.type_url().into(),
            resource_names: names.iter().map(|s| s.to_string()).collect(),
            version_info: version.into(),
            response_nonce: nonce.into(),
            ..Default::default()
        }
    }

    fn ack(r: &DiscoveryResponse, names: &[&str]) -> DiscoveryRequest {
        let ty = ResourceType::from_type_url(&r.type_url).unwrap();
        request(ty, names, &r.version_info, &r.nonce)
    }

    fn nack(r: &DiscoveryResponse, names: &[&str], held_version: &str) -> DiscoveryRequest {
        let mut req = ack(r, names);
        req.version_info = held_version.into();
        req.error_detail = Some(Status {
            code: 3,
            message: "rejected for a test".into(),
            details: vec![],
        });
        req
    }

    const EDS: &str = "default/a/a1";
    const RDS: &str = "ray-serve-http";

    /// Drives a stream the way Envoy does until it holds everything; returns the last
    /// response of each type.
    fn converge(s: &mut SotwStream, snap: &Snapshot) -> Vec<DiscoveryResponse> {
        let mut last: Vec<DiscoveryResponse> = Vec::new();
        for _ in 0..10 {
            let out = s.poll(snap);
            if out.is_empty() {
                break;
            }
            for (ty, _, r) in out {
                let names: Vec<&str> = match ty {
                    ResourceType::Endpoints => vec![EDS],
                    ResourceType::Route => vec![RDS],
                    _ => vec![],
                };
                assert_eq!(
                    s.on_request(ack(&r, &names)).unwrap(),
                    Event::Ack {
                        ty,
                        version: r.version_info.clone()
                    }
                );
                last.retain(|l| l.type_url != r.type_url);
                last.push(r);
            }
        }
        last
    }

    #[test]
    fn names_are_bounded_in_number_and_length() {
        let long = "n".repeat(crate::MAX_NAME_BYTES + 1);
        let err = SotwStream::new()
            .on_request(request(ResourceType::Endpoints, &[&long], "", ""))
            .unwrap_err();
        assert_eq!(err, ProtocolError::NameTooLong(long.len()));
        let many: Vec<String> = (0..=crate::MAX_NAMES_PER_TYPE)
            .map(|i| format!("n{i}"))
            .collect();
        let many: Vec<&str> = many.iter().map(String::as_str).collect();
        let err = SotwStream::new()
            .on_request(request(ResourceType::Endpoints, &many, "", ""))
            .unwrap_err();
        assert!(matches!(err, ProtocolError::TooManyNames(_)), "{err}");
        SotwStream::new()
            .on_request(request(ResourceType::Endpoints, &many[1..], "", ""))
            .unwrap();
    }

    #[test]
    fn initial_sync_goes_in_make_before_break_order() {
        let snap = snapshot_of(vec![service("a", "a1", &[8000])]);
        let mut s = SotwStream::new();
        // Envoy asks for clusters and listeners (wildcard) first.
        s.on_request(request(ResourceType::Cluster, &[], "", ""))
            .unwrap();
        s.on_request(request(ResourceType::Listener, &[], "", ""))
            .unwrap();
        let out = s.poll(&snap);
        let types: Vec<_> = out.iter().map(|(t, _, _)| *t).collect();
        assert_eq!(types, [ResourceType::Cluster, ResourceType::Listener]);
        // Nothing more until something is ACKed.
        assert!(s.poll(&snap).is_empty());
        let (_, _, cds) = &out[0];
        let (_, _, lds) = &out[1];
        // The route is asked for but must wait for the cluster's endpoints.
        s.on_request(ack(cds, &[])).unwrap();
        s.on_request(ack(lds, &[])).unwrap();
        s.on_request(request(ResourceType::Route, &[RDS], "", ""))
            .unwrap();
        assert!(
            s.poll(&snap).is_empty(),
            "route waits for the cluster to warm"
        );
        s.on_request(request(ResourceType::Endpoints, &[EDS], "", ""))
            .unwrap();
        let out = s.poll(&snap);
        assert_eq!(out.len(), 1);
        assert_eq!(out[0].0, ResourceType::Endpoints);
        s.on_request(ack(&out[0].2, &[EDS])).unwrap();
        let out = s.poll(&snap);
        assert_eq!(out.len(), 1);
        assert_eq!(out[0].0, ResourceType::Route);
    }

    #[test]
    fn an_ack_needs_the_nonce_in_flight_and_stale_nonces_are_ignored() {
        let snap1 = snapshot_of(vec![service("a", "a1", &[8000])]);
        let snap2 = snapshot_of(vec![service("a", "a1", &[8001])]);
        let mut s = SotwStream::new();
        s.on_request(request(ResourceType::Endpoints, &[EDS], "", ""))
            .unwrap();
        let first = s.poll(&snap1).remove(0).2;
        // A request carrying a nonce we never sent is stale.
        assert_eq!(
            s.on_request(request(ResourceType::Endpoints, &[EDS], "x", "999"))
                .unwrap(),
            Event::Stale(ResourceType::Endpoints)
        );
        assert!(s.poll(&snap2).is_empty(), "still waiting for the ACK");
        s.on_request(ack(&first, &[EDS])).unwrap();
        let second = s.poll(&snap2).remove(0).2;
        assert_ne!(second.version_info, first.version_info);
        // An ACK of the older response now is stale.
        assert_eq!(
            s.on_request(ack(&first, &[EDS])).unwrap(),
            Event::Stale(ResourceType::Endpoints)
        );
    }

    fn cluster_names(r: &DiscoveryResponse) -> Vec<String> {
        use envoy_types::pb::envoy::config::cluster::v3::Cluster;
        use prost::Message;
        r.resources
            .iter()
            .map(|a| Cluster::decode(&*a.value).unwrap().name)
            .collect()
    }

    #[test]
    fn a_nacked_version_is_not_resent_until_content_changes() {
        let snap1 = snapshot_of(vec![service("a", "a1", &[8000])]);
        let mut s = SotwStream::new();
        s.on_request(request(ResourceType::Cluster, &[], "", ""))
            .unwrap();
        let r = s.poll(&snap1).remove(0).2;
        let ev = s.on_request(nack(&r, &[], "")).unwrap();
        assert!(matches!(
            ev,
            Event::Nack {
                ty: ResourceType::Cluster,
                ..
            }
        ));
        // At most one more response: the set without what was rejected (here nothing,
        // which the Envoy holds already: no response). Then nothing.
        let follow = s.poll(&snap1);
        assert!(follow.len() <= 1);
        for f in &follow {
            assert!(f.2.resources.is_empty());
            s.on_request(ack(&f.2, &[])).unwrap();
        }
        for _ in 0..3 {
            assert!(s.poll(&snap1).is_empty(), "no NACK loop");
        }
        let status = s.status();
        assert_eq!(status[0].1.nacks, 1);
        assert_eq!(
            status[0].1.last_nacked_version.as_deref(),
            Some(r.version_info.as_str())
        );
        // New content: sent again.
        let snap2 = snapshot_of(vec![
            service("a", "a1", &[8000]),
            service("b", "b1", &[9000]),
        ]);
        let again = s.poll(&snap2);
        assert_eq!(again.len(), 1);
        assert_eq!(
            cluster_names(&again[0].2),
            ["default/b/b1"],
            "a1 as it was rejected stays out; b1 is new"
        );
        s.on_request(ack(&again[0].2, &[])).unwrap();
        // a1's settings changed: it is offered again.
        let mut policy_changed = service("a", "a1", &[8000]);
        policy_changed.clusters[0].connect_timeout_ms = 7;
        let snap3 = snapshot_of(vec![policy_changed, service("b", "b1", &[9000])]);
        let again = s.poll(&snap3);
        assert_eq!(cluster_names(&again[0].2), ["default/a/a1", "default/b/b1"]);
    }

    #[test]
    fn named_types_send_only_subscribed_and_changed_resources() {
        let snap1 = snapshot_of(vec![
            service("a", "a1", &[8000]),
            service("b", "b1", &[9000]),
        ]);
        let mut s = SotwStream::new();
        s.on_request(request(ResourceType::Endpoints, &[EDS], "", ""))
            .unwrap();
        let r = s.poll(&snap1).remove(0).2;
        assert_eq!(r.resources.len(), 1, "only the subscribed name");
        // Subscribing to one more name sends only that one.
        s.on_request(ack(&r, &[EDS, "default/b/b1"])).unwrap();
        let r2 = s.poll(&snap1).remove(0).2;
        assert_eq!(r2.resources.len(), 1);
        s.on_request(ack(&r2, &[EDS, "default/b/b1"])).unwrap();
        // A change to b's endpoints sends b's assignment only.
        let snap2 = snapshot_of(vec![
            service("a", "a1", &[8000]),
            service("b", "b1", &[9001]),
        ]);
        let r3 = s.poll(&snap2).remove(0).2;
        assert_eq!(r3.resources.len(), 1);
        assert_eq!(
            r3.resources[0],
            snap2.resources(ResourceType::Endpoints)["default/b/b1"].body
        );
        s.on_request(ack(&r3, &[EDS, "default/b/b1"])).unwrap();
        // Unsubscribing sends nothing.
        s.on_request(request(
            ResourceType::Endpoints,
            &[EDS],
            &r3.version_info,
            &r3.nonce,
        ))
        .unwrap();
        assert!(s.poll(&snap2).is_empty());
        assert_eq!(s.status()[0].1.resources_held, 1);
    }

    #[test]
    fn full_state_types_send_everything_and_an_empty_set_removes() {
        let snap1 = snapshot_of(vec![
            service("a", "a1", &[8000]),
            service("b", "b1", &[9000]),
        ]);
        let mut s = SotwStream::new();
        s.on_request(request(ResourceType::Cluster, &["*"], "", ""))
            .unwrap();
        let r = s.poll(&snap1).remove(0).2;
        assert_eq!(r.resources.len(), 2);
        s.on_request(ack(&r, &["*"])).unwrap();
        let snap2 = snapshot_of(vec![]);
        let r2 = s.poll(&snap2).remove(0).2;
        assert!(r2.resources.is_empty(), "no route names them: both go");
    }

    #[test]
    fn a_reconnecting_envoy_is_resent_only_its_clusters_and_endpoints() {
        let snap = snapshot_of(vec![service("a", "a1", &[8000])]);
        let mut first = SotwStream::new();
        for (ty, names) in [
            (ResourceType::Cluster, vec![]),
            (ResourceType::Listener, vec![]),
            (ResourceType::Endpoints, vec![EDS]),
            (ResourceType::Route, vec![RDS]),
        ] {
            first.on_request(request(ty, &names, "", "")).unwrap();
        }
        let held = converge(&mut first, &snap);
        assert_eq!(held.len(), 4);

        // A new stream (a restarted server): Envoy reports its versions and old nonces.
        let mut second = SotwStream::new();
        for r in &held {
            let ty = ResourceType::from_type_url(&r.type_url).unwrap();
            let names: Vec<&str> = match ty {
                ResourceType::Endpoints => vec![EDS],
                ResourceType::Route => vec![RDS],
                _ => vec![],
            };
            assert_eq!(
                second.on_request(ack(r, &names)).unwrap(),
                Event::Subscribed(ty)
            );
        }
        // Only the clusters and endpoints go again: a cluster it was warming when the
        // stream broke waits for a ClusterLoadAssignment sent after it, and the version it
        // reports for clusters may not be what it holds (after a NACK).
        let again = second.poll(&snap);
        let types: Vec<_> = again.iter().map(|(t, _, _)| *t).collect();
        assert_eq!(types, [ResourceType::Cluster, ResourceType::Endpoints]);
        second.on_request(ack(&again[1].2, &[EDS])).unwrap();
        second.on_request(ack(&again[0].2, &[])).unwrap();
        assert!(second.poll(&snap).is_empty(), "nothing more to send");
        // And it still follows changes.
        let changed = snapshot_of(vec![service("a", "a1", &[8001])]);
        let out = second.poll(&changed);
        assert_eq!(out.len(), 1);
        assert_eq!(out[0].0, ResourceType::Endpoints);
    }

    #[test]
    fn a_cluster_leaves_only_after_the_route_stops_naming_it() {
        let before = snapshot_of(vec![service("a", "a1", &[8000])]);
        let mut s = SotwStream::new();
        for (ty, names) in [
            (ResourceType::Cluster, vec![]),
            (ResourceType::Listener, vec![]),
            (ResourceType::Endpoints, vec![EDS]),
            (ResourceType::Route, vec![RDS]),
        ] {
            s.on_request(request(ty, &names, "", "")).unwrap();
        }
        converge(&mut s, &before);
        // The service moves to a new cluster a2; a1 leaves the snapshot.
        let after = snapshot_of(vec![service("a", "a2", &[8100])]);
        let out = s.poll(&after);
        assert_eq!(out.len(), 1);
        let cds = &out[0].2;
        assert_eq!(
            cds.resources.len(),
            2,
            "a1 kept while the held route names it, a2 added"
        );
        s.on_request(ack(cds, &[])).unwrap();
        // Envoy subscribes to a2's endpoints; the route waits for them.
        let eds_names = [EDS, "default/a/a2"];
        s.on_request(request(
            ResourceType::Endpoints,
            &eds_names,
            &s.status()[1].1.last_acked_version.clone().unwrap(),
            "",
        ))
        .unwrap();
        let out = s.poll(&after);
        assert_eq!(
            out.iter().map(|o| o.0).collect::<Vec<_>>(),
            [ResourceType::Endpoints]
        );
        s.on_request(ack(&out[0].2, &eds_names)).unwrap();
        let out = s.poll(&after);
        assert_eq!(
            out.iter().map(|o| o.0).collect::<Vec<_>>(),
            [ResourceType::Route]
        );
        s.on_request(ack(&out[0].2, &[RDS])).unwrap();
        // Now nothing names a1: it goes.
        let out = s.poll(&after);
        assert_eq!(
            out.iter().map(|o| o.0).collect::<Vec<_>>(),
            [ResourceType::Cluster]
        );
        assert_eq!(out[0].2.resources.len(), 1);
    }

    fn many_services(n: usize, proxies: usize) -> Vec<crate::fixtures::Service> {
        (0..n)
            .map(|i| {
                let ports: Vec<u16> = (0..proxies as u16).map(|p| 8000 + p).collect();
                let mut s = service(&format!("s{i}"), "c", &ports);
                s.hosts = vec![format!("s{i}.example")];
                s
            })
            .collect()
    }

    /// The names of every assignment of `snap`.
    fn endpoint_names(snap: &Snapshot) -> Vec<String> {
        snap.resources(ResourceType::Endpoints)
            .keys()
            .map(|n| n.to_string())
            .collect()
    }

    #[test]
    fn a_large_endpoint_set_is_split_and_ends_whole() {
        let snap = snapshot_of(many_services(1200, 20));
        let names = endpoint_names(&snap);
        let refs: Vec<&str> = names.iter().map(String::as_str).collect();
        let mut s = SotwStream::new();
        s.on_request(request(ResourceType::Endpoints, &refs, "", ""))
            .unwrap();
        let mut received = 0;
        let mut responses = 0;
        loop {
            let mut out = s.poll(&snap);
            if out.is_empty() {
                break;
            }
            let (_, count, r) = out.remove(0);
            let bytes: usize = r.resources.iter().map(|a| a.value.len()).sum();
            assert!(
                count == 1 || bytes <= RESPONSE_BUDGET_BYTES,
                "{bytes} bytes in one response"
            );
            received += count;
            responses += 1;
            s.on_request(ack(&r, &refs)).unwrap();
        }
        assert_eq!(received, 1200, "every assignment once");
        assert!(responses > 2, "split into several responses: {responses}");
        // The last ACK leaves the stream holding the snapshot's whole set, at its version.
        assert!(s.types[1]
            .ledger
            .held
            .is_whole(&snap, ResourceType::Endpoints));
        assert_eq!(
            s.types[1].acked_version,
            **snap.type_version(ResourceType::Endpoints)
        );
    }

    /// What one poll sends never passes the room a stream reserves for it
    /// (`Snapshot::response_room`): the whole cluster set at once, and the endpoints a
    /// budget at a time.
    #[test]
    fn every_poll_fits_the_snapshot_s_response_room() {
        let snap = snapshot_of(many_services(1200, 20));
        let names = endpoint_names(&snap);
        let refs: Vec<&str> = names.iter().map(String::as_str).collect();
        let mut s = SotwStream::new();
        s.on_request(request(ResourceType::Cluster, &[], "", ""))
            .unwrap();
        s.on_request(request(ResourceType::Endpoints, &refs, "", ""))
            .unwrap();
        let polls = crate::fixtures::assert_every_poll_fits_the_room(&mut s, &snap, |ty, r| {
            let names: &[&str] = if ty == ResourceType::Endpoints {
                &refs
            } else {
                &[]
            };
            ack(r, names)
        });
        assert!(polls > 2, "{polls}");
    }

    #[test]
    fn an_in_sync_stream_only_answers_the_type_that_changed() {
        let before = snapshot_of(many_services(3, 2));
        let mut s = SotwStream::new();
        let eds: Vec<String> = before
            .resources(ResourceType::Endpoints)
            .keys()
            .map(|n| n.to_string())
            .collect();
        let eds: Vec<&str> = eds.iter().map(String::as_str).collect();
        for (ty, names) in [
            (ResourceType::Cluster, vec![]),
            (ResourceType::Listener, vec![]),
            (ResourceType::Endpoints, eds.clone()),
            (ResourceType::Route, vec![RDS]),
        ] {
            s.on_request(request(ty, &names, "", "")).unwrap();
        }
        for _ in 0..10 {
            let out = s.poll(&before);
            if out.is_empty() {
                break;
            }
            for (ty, _, r) in out {
                let names = if ty == ResourceType::Endpoints {
                    eds.clone()
                } else if ty == ResourceType::Route {
                    vec![RDS]
                } else {
                    vec![]
                };
                s.on_request(ack(&r, &names)).unwrap();
            }
        }
        for ty in ResourceType::ALL {
            assert!(
                s.types[ty.index()].ledger.held.is_whole(&before, ty),
                "{ty}"
            );
        }
        let mut changed = many_services(3, 2);
        changed[1].clusters[0].ports[0] = 9999;
        let after = snapshot_of(changed);
        let out = s.poll(&after);
        assert_eq!(out.len(), 1);
        assert_eq!(out[0].0, ResourceType::Endpoints);
        assert_eq!(out[0].1, 1, "only the changed assignment");
    }

    #[test]
    fn a_full_sync_ends_with_every_type_whole() {
        let snap = snapshot_of(many_services(200, 20));
        let eds: Vec<String> = snap
            .resources(ResourceType::Endpoints)
            .keys()
            .map(|n| n.to_string())
            .collect();
        let eds: Vec<&str> = eds.iter().map(String::as_str).collect();
        let mut s = SotwStream::new();
        for (ty, names) in [
            (ResourceType::Cluster, vec![]),
            (ResourceType::Listener, vec![]),
            (ResourceType::Endpoints, eds.clone()),
            (ResourceType::Route, vec![RDS]),
        ] {
            s.on_request(request(ty, &names, "", "")).unwrap();
        }
        for _ in 0..100 {
            let out = s.poll(&snap);
            if out.is_empty() {
                break;
            }
            for (ty, _, r) in out {
                let names = match ty {
                    ResourceType::Endpoints => eds.clone(),
                    ResourceType::Route => vec![RDS],
                    _ => vec![],
                };
                s.on_request(ack(&r, &names)).unwrap();
            }
        }
        for ty in ResourceType::ALL {
            assert!(
                s.types[ty.index()].ledger.held.is_whole(&snap, ty),
                "{ty}: {:?}",
                matches!(s.types[ty.index()].ledger.held, Holding::Own(_))
            );
        }
    }

    #[test]
    fn unknown_type_urls_are_refused() {
        let mut s = SotwStream::new();
        let err = s
            .on_request(DiscoveryRequest {
                type_url: "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.Secret"
                    .into(),
                ..Default::default()
            })
            .unwrap_err();
        assert!(matches!(err, ProtocolError::UnknownType(_)));
    }

    #[test]
    fn an_empty_list_after_names_unsubscribes_and_names_again_are_sent_again() {
        let snap = snapshot_of(vec![service("a", "a1", &[8000])]);
        let mut s = SotwStream::new();
        s.on_request(request(ResourceType::Endpoints, &[EDS], "", ""))
            .unwrap();
        let first = s.poll(&snap).remove(0).2;
        s.on_request(ack(&first, &[EDS])).unwrap();
        // Envoy's last EDS cluster goes: it asks for nothing (not for everything).
        s.on_request(request(
            ResourceType::Endpoints,
            &[],
            &first.version_info,
            &first.nonce,
        ))
        .unwrap();
        assert!(
            s.poll(&snap).is_empty(),
            "nothing to send to a client that wants none"
        );
        assert!(s.status()[0].1.subscribed.is_empty(), "{:?}", s.status());
        // It wants it again: it must be sent again, unchanged as it is.
        s.on_request(request(
            ResourceType::Endpoints,
            &[EDS],
            &first.version_info,
            &first.nonce,
        ))
        .unwrap();
        let out = s.poll(&snap);
        assert_eq!(out.len(), 1, "resent after the resubscription");
        assert_eq!(out[0].2.resources.len(), 1);
    }

    #[test]
    fn an_empty_first_request_is_the_legacy_wildcard() {
        let snap = snapshot_of(vec![
            service("a", "a1", &[8000]),
            service("b", "b1", &[9000]),
        ]);
        let mut s = SotwStream::new();
        s.on_request(request(ResourceType::Endpoints, &[], "", ""))
            .unwrap();
        let out = s.poll(&snap).remove(0).2;
        assert_eq!(out.resources.len(), 2, "every assignment");
        // An ACK repeating the empty list keeps the wildcard.
        s.on_request(ack(&out, &[])).unwrap();
        assert_eq!(s.status()[0].1.subscribed, ["*"]);
    }

    #[test]
    fn a_changed_cluster_gets_its_unchanged_endpoints_again() {
        let snap = snapshot_of(vec![service("a", "a1", &[8000])]);
        let mut s = SotwStream::new();
        s.on_request(request(ResourceType::Cluster, &[], "", ""))
            .unwrap();
        s.on_request(request(ResourceType::Endpoints, &[EDS], "", ""))
            .unwrap();
        converge(&mut s, &snap);
        let mut resources = crate::fixtures::resources_of(&[service("a", "a1", &[8000])]);
        resources.clusters[0].connect_timeout = Some(envoy_types::pb::google::protobuf::Duration {
            seconds: 3,
            nanos: 0,
        });
        let changed = Snapshot::build(&resources, Some(&snap)).unwrap();
        // Envoy warms the changed cluster and ACKs it only once warm: the unchanged
        // assignment goes right behind it, without waiting for that ACK.
        let out = s.poll(&changed);
        let types: Vec<_> = out.iter().map(|(t, _, _)| *t).collect();
        assert_eq!(types, [ResourceType::Cluster, ResourceType::Endpoints]);
        s.on_request(ack(&out[1].2, &[EDS])).unwrap();
        s.on_request(ack(&out[0].2, &[])).unwrap();
        assert!(s.poll(&changed).is_empty(), "once");
    }

    #[test]
    fn a_requested_name_that_appears_later_is_sent_when_it_does() {
        // Spec: "Management servers must remember the set of resources being requested
        // by the client, and if one of those resources springs into existence later, the
        // server must send an update to the client informing it of the new resource."
        let snap = snapshot_of(vec![service("a", "a1", &[8000])]);
        let mut s = SotwStream::new();
        s.on_request(request(
            ResourceType::Endpoints,
            &[EDS, "default/b/b1"],
            "",
            "",
        ))
        .unwrap();
        let r = s.poll(&snap).remove(0).2;
        s.on_request(ack(&r, &[EDS, "default/b/b1"])).unwrap();
        let later = snapshot_of(vec![
            service("a", "a1", &[8000]),
            service("b", "b1", &[9000]),
        ]);
        let out = s.poll(&later);
        assert_eq!(out.len(), 1);
        use envoy_types::pb::envoy::config::endpoint::v3::ClusterLoadAssignment;
        use prost::Message;
        let cla = ClusterLoadAssignment::decode(&*out[0].2.resources[0].value).unwrap();
        assert_eq!(cla.cluster_name, "default/b/b1");
        assert_eq!(
            cla.endpoints[0].lb_endpoints.len(),
            1,
            "the real assignment"
        );
    }

    #[test]
    fn an_absent_name_gets_one_stand_in_not_one_per_wake() {
        // Found by fuzzing (fuzz/regressions/xds_requests/sotw-absent-eds-name): the
        // stand-in assignment of an EDS name the snapshot lacks was left out of what the
        // Envoy holds after its ACK, so every later poll sent it again.
        let snap = snapshot_of(vec![service("a", "a1", &[8000])]);
        let mut s = SotwStream::new();
        s.on_request(request(ResourceType::Endpoints, &["default/b/b1"], "", ""))
            .unwrap();
        let r = s.poll(&snap).remove(0).2;
        s.on_request(ack(&r, &["default/b/b1"])).unwrap();
        let changed = snapshot_of(vec![service("a", "a1", &[8001])]);
        for snap in [&snap, &snap, &changed, &changed] {
            assert!(s.poll(snap).is_empty(), "nothing changed for this Envoy");
        }
    }

    #[test]
    fn only_the_first_request_needs_the_node() {
        // Spec: "Only the first request on a stream is guaranteed to carry the node
        // identifier."
        let snap = snapshot_of(vec![service("a", "a1", &[8000])]);
        let mut s = SotwStream::new();
        let mut first = request(ResourceType::Cluster, &[], "", "");
        first.node = Some(envoy_types::pb::envoy::config::core::v3::Node {
            id: "envoy-1".into(),
            ..Default::default()
        });
        s.on_request(first).unwrap();
        let r = s.poll(&snap).remove(0).2;
        s.on_request(ack(&r, &[])).unwrap();
        s.on_request(request(ResourceType::Listener, &[], "", ""))
            .unwrap();
        assert_eq!(s.node().unwrap().id, "envoy-1");
    }

    #[test]
    fn an_unnamed_rejection_after_a_reconnect_is_searched_to_its_culprit() {
        use envoy_types::pb::envoy::config::endpoint::v3::ClusterLoadAssignment;
        // A reconnected Envoy declares four assignments (versions unknown); one of them
        // as the snapshot has it fails the whole response without a name. The search
        // must narrow down to it (not resend the same response, not blame another),
        // and every other assignment must reach the Envoy.
        use prost::Message;
        let snap = snapshot_of(vec![
            service("a", "a1", &[8000]),
            service("b", "b1", &[8100]),
            service("c", "c1", &[8200]),
            service("d", "d1", &[8300]),
        ]);
        let names = [
            "default/a/a1",
            "default/b/b1",
            "default/c/c1",
            "default/d/d1",
        ];
        let mut s = SotwStream::new();
        s.on_request(request(
            ResourceType::Endpoints,
            &names,
            "old",
            "nonce-of-before",
        ))
        .unwrap();
        s.settle_reconnect();
        let culprit = "default/c/c1";
        let mut accepted = std::collections::BTreeSet::new();
        let mut sent = Vec::new();
        for _ in 0..12 {
            let out = s.poll(&snap);
            if out.is_empty() {
                break;
            }
            for (_, _, r) in out {
                let carried: Vec<String> = r
                    .resources
                    .iter()
                    .map(|a| {
                        ClusterLoadAssignment::decode(&*a.value)
                            .unwrap()
                            .cluster_name
                    })
                    .collect();
                assert!(!sent.contains(&r.version_info), "the same response twice");
                sent.push(r.version_info.clone());
                if carried.iter().any(|n| n == culprit) {
                    s.on_request(nack(&r, &names, "")).unwrap();
                } else {
                    accepted.extend(carried);
                    s.on_request(ack(&r, &names)).unwrap();
                }
            }
        }
        let status = s.status();
        let eds = &status
            .iter()
            .find(|(ty, _)| *ty == ResourceType::Endpoints)
            .unwrap()
            .1;
        assert_eq!(eds.rejected, [culprit], "{eds:?}");
        for n in names.iter().filter(|n| **n != culprit) {
            assert!(accepted.contains(*n), "{n} never reached the Envoy");
        }
    }
}
