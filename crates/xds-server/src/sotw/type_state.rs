//! One resource type's state on a state-of-the-world stream: its subscription, its
//! [`TypeLedger`] (what the Envoy holds and rejected), its response in flight, and the
//! steps of its ACK, NACK, subscription and change.

use std::sync::Arc;

use envoy_types::pb::google::rpc::Status;

use super::request::Subscription;
use crate::holding::{changed_from, Held, HeldMap, Holding, TypeLedger};
use crate::names::SharedNames;
use crate::ordering::{learn_bodies, take_budget, RESPONSE_BUDGET_BYTES};
use crate::snapshot::{bare_cluster, set_version, ResourceMap, ResourceType, Snapshot};
use crate::Event;

#[derive(Debug)]
pub(super) struct InFlight {
    pub(super) nonce: String,
    pub(super) version: String,
    pub(super) resources: ResourceMap,
    /// What the Envoy holds once it ACKs, when that is a snapshot's whole set.
    pub(super) then_whole: Option<Holding>,
    /// Clusters: the endpoints of the snapshot they came from, for the ones the Envoy
    /// warms (it does not ACK them until they are warm, even if they are gone since).
    pub(super) endpoints_then: Option<Arc<ResourceMap>>,
    /// Names (and versions) taken out of `resources` by `forget` after sending: still
    /// suspects if the Envoy rejects this response.
    pub(super) forgotten: Vec<(Arc<str>, Arc<str>)>,
}

#[derive(Debug, Default)]
pub(super) struct TypeState {
    pub(super) subscription: Option<Subscription>,
    /// The `resource_names` list that set the subscription: every ACK repeats the list,
    /// and comparing it is far cheaper than building the set again.
    pub(super) listed: Option<Arc<SharedNames>>,
    /// The client has named a resource (or `*`) of this type on this stream: from then
    /// on an empty list means "none", not the legacy wildcard.
    pub(super) named: bool,
    /// What the Envoy holds and rejected, the counts; the response version last NACKed
    /// is not sent again until the Envoy ACKs something of this type (after an ACK the
    /// same versions may mean a new test: one suspect of a search, alone).
    pub(super) ledger: TypeLedger<String>,
    /// The version the Envoy holds ("" for none); on reconnect, the one it reports.
    pub(super) acked_version: String,
    pub(super) in_flight: Option<InFlight>,
    pub(super) last_nonce: Option<String>,
    /// Something was forgotten (to be sent again) while a response was in flight.
    pub(super) forgot_in_flight: bool,
}

impl TypeState {
    /// A NACK of `f`: what the Envoy holds after it, and the search for what it
    /// rejected (see `Rejections`).
    pub(super) fn nacked(&mut self, ty: ResourceType, f: InFlight, status: &Status) -> Event {
        // What the message blames keeps the Envoy's old version until it
        // changes; when it names them, it applied the rest; when it names
        // none, the search for the culprit begins (see `Rejections`).
        // Suspects are what the response changed, and what the Envoy declared
        // on a reconnect (its version unknown, it may be the culprit).
        let mut changed: Vec<(Arc<str>, Arc<str>)> = f
            .resources
            .iter()
            // What the Envoy held already (by version, or the body it
            // accepted before, sent again after `forget`) is no suspect.
            .filter(|(n, r)| match self.ledger.held.get(n) {
                None => true,
                Some(h) => {
                    *h.version != *r.version
                        && h.resource.as_ref().is_none_or(|b| b.version != r.version)
                }
            })
            // A bare stand-in (see `desired`) is valid by construction.
            .filter(|(n, r)| ty != ResourceType::Cluster || bare_cluster(n).version != r.version)
            .map(|(n, r)| (n.clone(), r.version.clone()))
            .collect();
        changed.extend(f.forgotten.iter().cloned());
        let (version, message) = (f.version.clone(), &status.message);
        if let Some(applied) = self
            .ledger
            .on_nack(version.clone(), version, changed, message)
        {
            // It holds what was sent, but its old version (or nothing) of
            // each blamed resource.
            let mut held = HeldMap::new();
            for (name, r) in &f.resources {
                let unchanged = self.ledger.held.version_of(name) == Some(&r.version);
                if applied.contains(name) || unchanged {
                    held.insert(name.clone(), Held::sent(r));
                } else if let Some(old) = self.ledger.held.get(name) {
                    held.insert(name.clone(), old);
                }
            }
            if !ty.is_full_state() {
                // Per-name types: what was not in the response stays.
                for (name, version, body) in self.ledger.held.iter() {
                    if !f.resources.contains_key(name) {
                        held.insert(
                            name.clone(),
                            Held {
                                version: version.clone(),
                                resource: body.cloned(),
                            },
                        );
                    }
                }
            }
            self.ledger.held = Holding::Own(held);
            self.acked_version = held_version(&self.ledger.held);
        }
        Event::Nack {
            ty,
            version: f.version,
            message: status.message.clone(),
        }
    }

    /// An ACK of `f`: the Envoy holds what it was sent.
    pub(super) fn acked_response(&mut self, ty: ResourceType, f: InFlight) -> Event {
        self.ledger.on_ack(&f.resources);
        if let Some(whole) = f.then_whole {
            self.ledger.held = whole;
        } else if ty.is_full_state() {
            self.ledger.held = Holding::from_resources(&f.resources);
        } else {
            let held = self.ledger.held.own();
            for (name, r) in &f.resources {
                held.insert(name.clone(), Held::sent(r));
            }
        }
        self.acked_version = if std::mem::take(&mut self.forgot_in_flight) {
            held_version(&self.ledger.held)
        } else {
            f.version.clone()
        };
        Event::Ack {
            ty,
            version: f.version,
        }
    }

    /// The subscription `names` sets (an ACK repeats it: compared before a new one is
    /// built); what the Envoy holds beyond it is forgotten.
    pub(super) fn subscribe(&mut self, names: &[&str]) {
        let same =
            self.subscription.is_some() && self.listed.as_ref().is_some_and(|l| l.is_list(names));
        if !same {
            let first = self.subscription.is_none();
            let listed = SharedNames::of_list(names);
            let subscription = Subscription::from_names(&listed, self.named);
            self.listed = Some(listed);
            self.named |= !names.is_empty();
            if let Subscription::Names(_) = &subscription {
                let before = self.ledger.held.len();
                self.ledger
                    .held
                    .own()
                    .retain(|name, _| subscription.wants(name));
                // What the Envoy holds now (its version) is what the subscription kept:
                // names it dropped and asks for again must be sent again.
                if !first && self.ledger.held.len() != before {
                    self.acked_version = held_version(&self.ledger.held);
                }
                if !first && self.ledger.held.is_empty() {
                    self.acked_version = String::new();
                }
            }
            self.subscription = Some(subscription);
        }
    }

    /// Whether the Envoy already holds `wanted` (under `version`), recording that it
    /// does. After a rejection it keeps what it had, which the rules may give again under
    /// another version string: no response then, unless this stream has never answered
    /// the type (Envoy waits for a first one, even empty, to finish initializing), or it
    /// declared on a reconnect a name of a full-state type that `wanted` lacks.
    /// (Compared name by name only where it can matter: full-state types, a version
    /// that differs. This runs on every poll of every stream.)
    pub(super) fn holds_already(
        &mut self,
        ty: ResourceType,
        snapshot: &Snapshot,
        wanted: &ResourceMap,
        kept: &[Arc<str>],
        version: &str,
        whole: bool,
    ) -> bool {
        let holds_exactly = ty.is_full_state()
            && version != self.acked_version
            && self.last_nonce.is_some()
            && !self.ledger.held.iter().any(|(_, v, _)| v.is_empty())
            && self.ledger.held.iter().count() == wanted.len()
            && wanted.iter().all(|(n, r)| {
                self.ledger
                    .held
                    .version_of(n)
                    .is_some_and(|v| *v == r.version)
            });
        if holds_exactly {
            self.acked_version = version.to_string();
        }
        if version != self.acked_version {
            return false;
        }
        // A full-state type whose Envoy declared on a reconnect a name `wanted` lacks (a
        // cluster its EDS request names, kept from a response it rejected in part, which
        // its version does not tell): only a response removes it, even an empty one.
        if ty.is_full_state()
            && self
                .ledger
                .held
                .iter()
                .any(|(n, v, _)| v.is_empty() && !wanted.contains_key(n))
        {
            return false;
        }
        self.ledger.held = if whole {
            Holding::whole(snapshot, ty)
        } else {
            // What it holds: what we would send, and what it keeps that we have no body
            // for (declared on a reconnect).
            let mut held = Holding::from_resources(wanted);
            for name in kept {
                if let Some(h) = self.ledger.held.get(name) {
                    held.own().insert(name.clone(), h);
                }
            }
            held
        };
        true
    }

    /// For a per-name type: what of `wanted` the Envoy does not hold yet, within the
    /// response budget, with the version naming what it will hold after it (and the
    /// whole holding when it will then hold the snapshot's whole set). `None` when only
    /// unsubscriptions changed: it holds everything it wants.
    pub(super) fn change_to_send(
        &mut self,
        ty: ResourceType,
        snapshot: &Snapshot,
        wanted: ResourceMap,
        version: String,
        whole: bool,
    ) -> Option<(ResourceMap, String, Option<Holding>)> {
        learn_bodies(&mut self.ledger.held, |n| wanted.get(n));
        let changed = changed_from(&wanted, &self.ledger.held);
        if changed.is_empty() {
            self.acked_version = version;
            return None;
        }
        let (chunk, complete) = take_budget(changed, RESPONSE_BUDGET_BYTES);
        if complete {
            return Some((chunk, version, whole.then(|| Holding::whole(snapshot, ty))));
        }
        // Part of the change: the version names what the Envoy will hold after it.
        let partial = set_version(wanted.keys().filter_map(|n| {
            let v = chunk
                .get(n)
                .map(|r| &r.version)
                .or_else(|| self.ledger.held.version_of(n))?;
            Some((&**n, &**v))
        }));
        Some((chunk, partial, None))
    }
}

/// Records that a reconnected Envoy holds `names` (versions and bodies unknown).
pub(super) fn declare_held<S: AsRef<str>>(held: &mut Holding, names: &[S]) {
    let map = held.own();
    for name in names.iter().map(AsRef::as_ref).filter(|n| *n != "*") {
        map.entry(name.into()).or_insert(Held {
            version: "".into(),
            resource: None,
        });
    }
}

/// The `version_info` of what a holding holds (the empty version for nothing).
pub(super) fn held_version(held: &Holding) -> String {
    if held.is_empty() {
        return String::new();
    }
    set_version(held.iter().map(|(n, v, _)| (&**n, &**v)))
}
