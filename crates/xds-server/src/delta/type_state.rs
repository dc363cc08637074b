//! One resource type's state on a delta stream: its subscription (wildcard, names, what
//! the client was told does not exist), its [`TypeLedger`] (what the Envoy holds and
//! rejected), its response in flight, and the subscription and reconnect steps.
//!
//! Invariant: a response's content is named by a hash of what it carries
//! ([`content_key`]), so a NACKed one is not sent again until the Envoy ACKs something.

use super::*;

#[derive(Debug)]
pub(super) struct InFlight {
    pub(super) nonce: String,
    pub(super) sent: ResourceMap,
    pub(super) removed: Vec<Arc<str>>,
    /// What the Envoy holds once it ACKs, when that is a snapshot's whole set.
    pub(super) then_whole: Option<Holding>,
    /// Clusters: the endpoints of the snapshot they came from, for the ones the Envoy
    /// warms (it does not ACK them until they are warm, even if they are gone since).
    pub(super) endpoints_then: Option<Arc<ResourceMap>>,
    /// Names (and versions) taken out of `sent` by `forget_endpoints` after sending:
    /// still suspects if the Envoy rejects this response.
    pub(super) forgotten: Vec<(Arc<str>, Arc<str>)>,
    /// [`content_key`] of the response as sent.
    pub(super) content: u64,
}

#[derive(Debug, Default)]
pub(super) struct TypeState {
    pub(super) subscribed: bool,
    pub(super) wildcard: bool,
    /// Shared with every stream subscribed to the same names.
    pub(super) names: NameSet,
    /// Subscribed names that do not exist and that the client was told so (in
    /// `removed_resources`), once each.
    pub(super) told_absent: BTreeSet<Arc<str>>,
    /// Names were subscribed (or a response telling some absent was NACKed) since a
    /// plan last looked for subscribed names that do not exist: until one looks, the
    /// stream is not in sync, even holding the snapshot's whole set.
    pub(super) absent_unchecked: bool,
    /// What the Envoy holds and rejected, the counts; the content of the response last
    /// NACKed is not sent again until the Envoy ACKs something of this type (a NACK of
    /// a removal alone would otherwise loop).
    pub(super) ledger: TypeLedger<u64>,
    pub(super) in_flight: Option<InFlight>,
    pub(super) last_acked_version: Option<String>,
}

/// What a response carries, as a hash: its resources' names and versions, and removals.
pub(super) fn content_key(sent: &ResourceMap, removed: &[Arc<str>]) -> u64 {
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    for (name, r) in sent {
        name.hash(&mut h);
        r.version.hash(&mut h);
    }
    0xff_u8.hash(&mut h);
    removed.hash(&mut h);
    h.finish()
}

impl TypeState {
    pub(super) fn wants(&self, name: &str) -> bool {
        self.wildcard || self.names.contains(name)
    }
}

impl TypeState {
    /// What a reconnecting client declares it holds (`initial_resource_versions`), but
    /// endpoints, which are sent again whatever version the Envoy declares: a cluster it
    /// was warming when the stream broke waits for a ClusterLoadAssignment sent after it,
    /// which it would otherwise never get.
    pub(super) fn declare_initial(
        &mut self,
        ty: ResourceType,
        versions: &std::collections::HashMap<String, String>,
    ) {
        let known = self.ledger.held.own();
        for (name, version) in versions {
            let version = if ty == ResourceType::Endpoints {
                ""
            } else {
                version.as_str()
            };
            known.insert(
                name.as_str().into(),
                Held {
                    version: version.into(),
                    resource: None,
                },
            );
        }
    }

    /// Names subscribed (`wildcard`: `*` among them) and unsubscribed.
    pub(super) fn subscribe(
        &mut self,
        first: bool,
        subscribed: Vec<Arc<str>>,
        wildcard: bool,
        unsubscribe: &[String],
    ) {
        if wildcard {
            self.wildcard = true;
        }
        // A name subscribed to again must be sent again, even if the client seems to hold
        // it: it may have dropped it meanwhile (not so for the versions a reconnecting
        // client declares).
        if !first {
            for name in &subscribed {
                if self.ledger.held.contains(name) {
                    self.ledger.held.own().remove(name);
                }
            }
        }
        for name in &subscribed {
            self.told_absent.remove(name);
        }
        self.absent_unchecked |= !subscribed.is_empty();
        let unsubscribed = || unsubscribe.iter().filter(|n| *n != "*").map(String::as_str);
        if subscribed.iter().any(|n| !self.names.contains(n))
            || unsubscribed().any(|n| self.names.contains(n))
        {
            self.names.update(|names| {
                names.extend(subscribed);
                for name in unsubscribed() {
                    names.remove(name);
                }
            });
        }
        for name in unsubscribe {
            if name == "*" {
                self.wildcard = false;
            } else {
                self.told_absent.remove(name.as_str());
            }
            // The client forgets it; a later subscribe must send it again. One it still
            // gets through a wildcard is sent again, so that it knows to keep it.
            if self.ledger.held.contains(name) {
                self.ledger.held.own().remove(name.as_str());
            }
        }
        // What came only through the wildcard gets no more updates: forgotten, as an
        // unsubscribed name is (sent again if subscribed again). So everything held is
        // wanted, which the plans' shortcuts rely on. Looked at only when `*` goes: not on
        // every request (each ACK comes through here).
        let wildcard_gone = !self.wildcard && unsubscribe.iter().any(|n| n == "*");
        if wildcard_gone
            && self
                .ledger
                .held
                .iter()
                .any(|(n, _, _)| !self.names.contains(n))
        {
            let names = &self.names;
            self.ledger.held.own().retain(|n, _| names.contains(n));
        }
        // A response on its way that would leave the Envoy holding a whole set: with
        // less wanted now, its ACK records only what is still wanted of what it carried.
        if !unsubscribe.is_empty() {
            if let Some(f) = &mut self.in_flight {
                f.then_whole = None;
            }
        }
    }
}
