//! What one stream keeps of one resource type, whatever its protocol (state of the world
//! or delta): what the Envoy holds ([`Holding`]), what it rejected and the search for what
//! it rejected without saying ([`Rejections`]), and the rest of a type's ledger
//! ([`TypeLedger`]: the response not to send again, the last NACK, the counts shown in
//! `/debug/clients`). Each protocol's own state (its subscription, its response in
//! flight) wraps one ledger per type.
//!
//! Invariants: a NACK never makes a resource be sent in a loop (it blames at most what
//! was sent, and all of it when in doubt; the response NACKed is not sent again until an
//! ACK of that type); a whole snapshot set is held by pointer, not copied.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use super::snapshot::{Resource, ResourceMap, ResourceType, Snapshot};
use super::TypeStatus;

/// A resource one Envoy holds: its version, and its body when this stream sent it
/// (after a reconnect the Envoy declares versions we may have no body for).
#[derive(Clone, Debug)]
pub(crate) struct Held {
    pub version: Arc<str>,
    pub resource: Option<Arc<Resource>>,
}

impl Held {
    pub(crate) fn sent(resource: &Arc<Resource>) -> Held {
        Held {
            version: resource.version.clone(),
            resource: Some(resource.clone()),
        }
    }
}

pub(crate) type HeldMap = BTreeMap<Arc<str>, Held>;

/// One held resource as [`Holding::iter`] yields it: name, version, body when known.
pub(crate) type HeldEntry<'a> = (&'a Arc<str>, &'a Arc<str>, Option<&'a Arc<Resource>>);

/// Everything one Envoy holds of one type.
#[derive(Clone, Debug)]
pub(crate) enum Holding {
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
    pub(crate) fn whole(snapshot: &Snapshot, ty: ResourceType) -> Holding {
        Holding::Snapshot {
            type_version: snapshot.type_version(ty).clone(),
            map: snapshot.shared(ty).clone(),
        }
    }

    pub(crate) fn from_resources(resources: &ResourceMap) -> Holding {
        Holding::Own(
            resources
                .iter()
                .map(|(n, r)| (n.clone(), Held::sent(r)))
                .collect(),
        )
    }

    /// True when this is exactly the whole set of `ty` in `snapshot`.
    pub(crate) fn is_whole(&self, snapshot: &Snapshot, ty: ResourceType) -> bool {
        matches!(self, Holding::Snapshot { type_version, .. } if *type_version == *snapshot.type_version(ty))
    }

    pub(crate) fn version_of(&self, name: &str) -> Option<&Arc<str>> {
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
    pub(crate) fn key(&self, name: &str) -> Option<Arc<str>> {
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

    pub(crate) fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Every held resource: name, version and (when known) body.
    pub(crate) fn iter(&self) -> Box<dyn Iterator<Item = HeldEntry<'_>> + '_> {
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
    pub(crate) fn is_whole_of(&self, current: &ResourceMap) -> bool {
        matches!(self, Holding::Snapshot { map, .. } if std::ptr::eq(&**map, current))
    }

    /// The per-resource map, copied out of a shared snapshot set if need be.
    pub(crate) fn own(&mut self) -> &mut HeldMap {
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
pub(crate) fn retain_names<V>(
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
pub(crate) fn changed_from(wanted: &ResourceMap, held: &Holding) -> ResourceMap {
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

/// When `held` names nothing outside `current`, the resources of `current` the stream
/// wants (every one, or those among `names`) at a version `held` lacks, and whether it
/// wants every one; `None` when `held` has a name `current` lacks. One walk of both.
///
/// Then nothing is kept for the Envoy's sake beyond the snapshot (no route it holds can
/// name a resource the snapshot lacks) and nothing it holds is to be removed: what it
/// should hold is exactly what it wants of the snapshot. This is every round of a sync
/// from nothing (and of a reconnect that declared only current names).
pub(crate) fn change_within(
    held: &Holding,
    current: &ResourceMap,
    names: Option<&BTreeSet<Arc<str>>>,
) -> Option<(ResourceMap, bool)> {
    let mut held = held.iter().peekable();
    let mut names = names.map(|n| n.iter().peekable());
    let mut changed = ResourceMap::new();
    let mut wants_every_one = true;
    for (name, r) in current {
        if held.next_if(|(h, _, _)| ***h < **name).is_some() {
            return None;
        }
        let held_version = held.next_if(|(h, _, _)| ***h == **name).map(|(_, v, _)| v);
        let wanted = match &mut names {
            None => true,
            Some(names) => {
                while names.next_if(|n| ***n < **name).is_some() {}
                names.peek().is_some_and(|n| ***n == **name)
            }
        };
        if !wanted {
            wants_every_one = false;
        } else if held_version.is_none_or(|v| !Arc::ptr_eq(v, &r.version) && **v != *r.version) {
            changed.insert(name.clone(), r.clone());
        }
    }
    if held.next().is_some() {
        return None;
    }
    Some((changed, wants_every_one))
}

/// When `held` is a whole snapshot set with the same names as `current`'s set of `ty`,
/// the resources that changed; `None` otherwise. The common case after a health or
/// endpoint change, answered by pointer comparisons alone (snapshots share unchanged
/// resources), with no retention or gating to consider: no name left, none is new.
pub(crate) fn same_names_change(held: &Holding, current: &ResourceMap) -> Option<ResourceMap> {
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

/// Versions one Envoy rejected (NACKed), by name: it keeps what it held before.
pub(crate) type Rejected = BTreeMap<Arc<str>, Arc<str>>;

/// What one Envoy rejected of one type, and the search for what it rejected when it did
/// not say.
///
/// Envoy names the clusters it could not add ("Error adding/updating cluster(s) a:
/// ..."), and applies the rest; but a resource that fails proto validation fails the
/// whole response, and the message names nothing. Then the resources that response
/// changed become suspects, and the next responses change only half of them at a time
/// (every other change waits): an ACK clears that half, a NACK of one resource convicts
/// it, a NACK of several halves them again. One bad resource among n is found in about
/// log2(n) round trips; the search never repeats itself, since every NACK either
/// convicts or halves.
#[derive(Debug, Default)]
pub(crate) struct Rejections {
    /// Versions the Envoy rejected: it keeps what it held before.
    pub rejected: Rejected,
    /// Versions sent together in a response rejected without naming any.
    suspects: BTreeMap<Arc<str>, Arc<str>>,
    /// The suspects the next response may change: the first half.
    trying: BTreeSet<Arc<str>>,
    /// For a rejected version the snapshot never had: the snapshot's version of that
    /// name when the rejection was first pruned.
    seen_with: BTreeMap<Arc<str>, Arc<str>>,
}

#[cfg(test)]
pub(crate) static NOTHING_REJECTED: Rejections = Rejections {
    rejected: BTreeMap::new(),
    suspects: BTreeMap::new(),
    trying: BTreeSet::new(),
    seen_with: BTreeMap::new(),
};

impl Rejections {
    pub(crate) fn is_empty(&self) -> bool {
        self.rejected.is_empty() && self.suspects.is_empty()
    }

    /// Whether `name` at `version` must not be offered now (the Envoy holding `held`): a
    /// version it rejected, or, while suspects are searched, any change but the ones
    /// being tried.
    pub(crate) fn holds_back(&self, name: &str, version: &str, held: Option<&Arc<str>>) -> bool {
        if self.rejected.get(name).is_some_and(|v| **v == *version) {
            return true;
        }
        // (A version the Envoy declared on a reconnect is unknown: it may be a change.)
        !self.suspects.is_empty()
            && !self.trying.contains(name)
            && held.is_none_or(|h| h.is_empty() || **h != *version)
    }

    /// Forgets rejections and suspicions of versions `current` no longer has: changed
    /// content is offered afresh. A rejected version that was never the snapshot's own
    /// (a route merged for this Envoy, a stand-in) is forgotten once the snapshot's
    /// version of that name changes: until then the same merge would be rejected again.
    pub(crate) fn prune(&mut self, current: &ResourceMap) {
        if self.is_empty() && self.seen_with.is_empty() {
            return; // (The common case: nothing to prune, on every poll of every stream.)
        }
        let live =
            |name: &Arc<str>, v: &mut Arc<str>| current.get(name).is_some_and(|r| r.version == *v);
        let seen = &mut self.seen_with;
        self.rejected.retain(|name, v| match current.get(name) {
            None => false,
            Some(r) if r.version == *v => true,
            Some(r) => match seen.get(name) {
                None => {
                    seen.insert(name.clone(), r.version.clone());
                    true
                }
                Some(then) => *then == r.version,
            },
        });
        let rejected = &self.rejected;
        seen.retain(|name, _| rejected.contains_key(name));
        let before = self.suspects.len();
        self.suspects.retain(live);
        if self.suspects.len() != before {
            // The search goes on where it was: the half being tried keeps what is left
            // of it. (Splitting the suspects afresh could offer again a set the Envoy
            // just rejected whole, which is not sent twice: the search would stall.)
            let suspects = &self.suspects;
            self.trying.retain(|n| suspects.contains_key(n));
            if self.trying.is_empty() {
                self.split();
            }
        }
    }

    /// A NACK of a response that changed `changed` (name and version), with `message`.
    /// Returns the names the Envoy applied nonetheless (it named the others), if any.
    pub(crate) fn on_nack(
        &mut self,
        changed: Vec<(Arc<str>, Arc<str>)>,
        message: &str,
    ) -> Option<BTreeSet<Arc<str>>> {
        let (blamed, named) = blamed(changed.iter().map(|(n, _)| n), message);
        if named || changed.len() <= 1 {
            let blamed: BTreeSet<Arc<str>> = blamed.into_iter().collect();
            let mut applied = BTreeSet::new();
            for (name, version) in changed {
                self.suspects.remove(&name);
                if blamed.contains(&name) {
                    self.rejected.insert(name, version);
                } else {
                    applied.insert(name);
                }
            }
            self.split();
            return named.then_some(applied);
        }
        // The culprit is among `changed`: try half of them next. Suspects not in this
        // response stay suspects (untried, not cleared).
        let half = changed.len().div_ceil(2);
        self.trying = changed.iter().take(half).map(|(n, _)| n.clone()).collect();
        self.suspects.extend(changed);
        None
    }

    /// An ACK of a response that carried `sent`: those versions are fine.
    pub(crate) fn on_ack(&mut self, sent: &ResourceMap) {
        let fine =
            |name: &Arc<str>, v: &mut Arc<str>| sent.get(name).is_none_or(|r| r.version != *v);
        self.rejected.retain(fine);
        let before = self.suspects.len();
        self.suspects.retain(fine);
        if self.suspects.len() != before {
            self.split();
        }
    }

    /// Tries the first half of the suspects next.
    fn split(&mut self) {
        let tried = self.suspects.len().div_ceil(2);
        self.trying = self.suspects.keys().take(tried).cloned().collect();
    }
}

/// The names among `changed` (resources of a response the Envoy rejected) that its
/// error message blames, and whether it named any. Envoy applies the resources it can
/// and names each one it could not ("Error adding/updating cluster(s) a: reason, b:
/// reason"), so when it names some, it holds the rest as sent. A message that names none
/// blames them all, and nothing is taken as applied. Blaming at most what was sent, and
/// all of it when in doubt, means a NACK can never make a resource be sent in a loop.
pub(crate) fn blamed<'a>(
    changed: impl IntoIterator<Item = &'a Arc<str>>,
    message: &str,
) -> (Vec<Arc<str>>, bool) {
    let changed: Vec<&Arc<str>> = changed.into_iter().collect();
    let named: Vec<Arc<str>> = changed
        .iter()
        .filter(|name| mentions(message, name))
        .map(|n| (*n).clone())
        .collect();
    if named.is_empty() {
        (changed.into_iter().cloned().collect(), false)
    } else {
        (named, true)
    }
}

/// `message` names `name` as a whole word followed by a colon (Envoy's "name: reason").
fn mentions(message: &str, name: &str) -> bool {
    message.match_indices(name).any(|(at, _)| {
        let before = message[..at].chars().next_back();
        let after = message[at + name.len()..].chars().next();
        before.is_none_or(|c| c.is_whitespace() || c == ',' || c == '(') && after == Some(':')
    })
}

/// One type's ledger on one stream: what the Envoy holds, what it rejected, the response
/// not to send again (`K`: how a protocol names a response: its version in the state of
/// the world, a hash of its content in delta), the last NACK and the counts.
#[derive(Debug, Default)]
pub(crate) struct TypeLedger<K> {
    pub held: Holding,
    pub rejected: Rejections,
    /// The response last NACKed, not to be sent again until the Envoy ACKs something of
    /// this type.
    pub not_again: Option<K>,
    pub last_nacked_version: Option<String>,
    pub last_nack_message: Option<String>,
    pub pushes: u64,
    pub acks: u64,
    pub nacks: u64,
}

impl<K> TypeLedger<K> {
    /// An ACK of a response that carried `sent`: nothing is held back for it any more.
    pub(crate) fn on_ack(&mut self, sent: &ResourceMap) {
        self.acks += 1;
        self.not_again = None;
        self.rejected.on_ack(sent);
    }

    /// A NACK of the response `version` (`key` names it), which changed `changed`: the
    /// names its message says the Envoy applied, when it names any (see
    /// [`Rejections::on_nack`]).
    pub(crate) fn on_nack(
        &mut self,
        version: String,
        key: K,
        changed: Vec<(Arc<str>, Arc<str>)>,
        message: &str,
    ) -> Option<BTreeSet<Arc<str>>> {
        self.nacks += 1;
        self.last_nack_message = Some(super::clip(message, 1024));
        self.last_nacked_version = Some(version);
        self.not_again = Some(key);
        self.rejected.on_nack(changed, message)
    }

    /// Whether the Envoy rejected `name` (it keeps what it held before).
    pub(crate) fn rejects(&self, name: &str) -> bool {
        self.rejected.rejected.contains_key(name)
    }

    /// The names and versions the Envoy holds.
    pub(crate) fn held_versions(&self) -> Vec<(Arc<str>, Arc<str>)> {
        self.held
            .iter()
            .map(|(n, v, _)| (n.clone(), v.clone()))
            .collect()
    }

    /// The ledger as `/debug/clients` shows it.
    pub(crate) fn status(
        &self,
        subscribed: Vec<String>,
        last_acked_version: Option<String>,
    ) -> TypeStatus {
        TypeStatus {
            subscribed,
            last_acked_version,
            last_nacked_version: self.last_nacked_version.clone(),
            last_nack_message: self.last_nack_message.clone(),
            pushes: self.pushes,
            acks: self.acks,
            nacks: self.nacks,
            resources_held: self.held.len(),
            holds_snapshot_set: matches!(self.held, Holding::Snapshot { .. }),
            rejected: self
                .rejected
                .rejected
                .keys()
                .map(|n| n.to_string())
                .collect(),
        }
    }
}
