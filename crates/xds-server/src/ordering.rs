//! Make-before-break: what one Envoy may be sent, given what it already holds.
//!
//! Shared by the state-of-the-world and delta state machines. The rules:
//! - a virtual host is sent only once the Envoy holds (has ACKed) every cluster it names
//!   and that cluster's endpoints; until then the route configuration the Envoy gets keeps
//!   the virtual host as the Envoy has it (or leaves out one it never had), so traffic
//!   never goes to a cluster Envoy has not warmed, and one virtual host whose cluster an
//!   Envoy cannot take (it NACKs it, or never warms it) holds back no other;
//! - a cluster (and its endpoints) that left the snapshot stays with an Envoy while any
//!   route it holds or is being sent still names it, and goes once that route is replaced.
//!
//! Also shared by both: [`SharedNames`], the subscribed names of every stream whose Envoy
//! subscribes to the same ones, kept once (an idle stream holds a pointer, not a copy).

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use super::snapshot::{bare_cluster, Resource, ResourceMap, ResourceType, Snapshot};

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

/// A list of subscribed names, shared by every stream whose client listed the same
/// (see [`SharedNames::of_list`]): a thousand Envoys subscribed to the same 200 endpoint
/// names hold one copy of them, not a thousand.
#[derive(Debug, PartialEq, Eq)]
pub struct SharedNames {
    /// As the client listed them (state of the world), or sorted (delta).
    list: Box<[Arc<str>]>,
    set: BTreeSet<Arc<str>>,
}

impl std::ops::Deref for SharedNames {
    type Target = BTreeSet<Arc<str>>;
    fn deref(&self) -> &BTreeSet<Arc<str>> {
        &self.set
    }
}

/// Every [`SharedNames`] some stream holds, by a hash of its list.
type NamesBook = std::collections::HashMap<u64, Vec<std::sync::Weak<SharedNames>>>;

static SHARED_NAMES: std::sync::Mutex<Option<(NamesBook, usize)>> = std::sync::Mutex::new(None);

fn list_hash<S: AsRef<str>>(list: &[S]) -> u64 {
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    list.len().hash(&mut h);
    for name in list {
        name.as_ref().hash(&mut h);
    }
    h.finish()
}

impl SharedNames {
    /// The shared names of `list`, in its order (what a state-of-the-world request
    /// lists: an ACK repeats it, and [`SharedNames::is_list`] compares it exactly).
    pub fn of_list<S: AsRef<str>>(list: &[S]) -> Arc<SharedNames> {
        let hash = list_hash(list);
        let mut book = SHARED_NAMES.lock().unwrap_or_else(|e| e.into_inner());
        let (book, swept_at) = book.get_or_insert_with(Default::default);
        if let Some(found) = book
            .get(&hash)
            .into_iter()
            .flatten()
            .filter_map(std::sync::Weak::upgrade)
            .find(|n| n.is_list(list))
        {
            return found;
        }
        let list: Box<[Arc<str>]> = list.iter().map(|n| Arc::from(n.as_ref())).collect();
        let set = list.iter().cloned().collect();
        let names = Arc::new(SharedNames { list, set });
        let bucket = book.entry(hash).or_default();
        bucket.retain(|w| w.strong_count() > 0);
        bucket.push(Arc::downgrade(&names));
        // Lists no stream holds any more go when the book has doubled since it was last
        // swept: its size stays within twice the lists in use.
        let entries: usize = book.values().map(Vec::len).sum();
        if entries > 2 * *swept_at + 64 {
            book.retain(|_, bucket| {
                bucket.retain(|w| w.strong_count() > 0);
                !bucket.is_empty()
            });
            *swept_at = book.values().map(Vec::len).sum();
        }
        names
    }

    /// The shared names of `set` (sorted: what a delta stream subscribes to).
    pub fn of_set(set: &BTreeSet<Arc<str>>) -> Arc<SharedNames> {
        let list: Vec<&str> = set.iter().map(|n| &**n).collect();
        SharedNames::of_list(&list)
    }

    /// No names.
    pub fn none() -> Arc<SharedNames> {
        SharedNames::of_list::<&str>(&[])
    }

    /// Whether these are exactly `list`, in its order.
    pub fn is_list<S: AsRef<str>>(&self, list: &[S]) -> bool {
        self.list.len() == list.len() && self.list.iter().zip(list).all(|(a, b)| **a == *b.as_ref())
    }

    /// The names as listed.
    pub fn list(&self) -> &[Arc<str>] {
        &self.list
    }
}

/// A set of subscribed names that streams share (see [`SharedNames`]); changed whole.
#[derive(Clone, Debug, Default)]
pub struct NameSet(Option<Arc<SharedNames>>);

static NO_NAMES: BTreeSet<Arc<str>> = BTreeSet::new();

impl std::ops::Deref for NameSet {
    type Target = BTreeSet<Arc<str>>;
    fn deref(&self) -> &BTreeSet<Arc<str>> {
        self.0.as_deref().map_or(&NO_NAMES, |n| &n.set)
    }
}

impl NameSet {
    /// Changes the set by `change`: a new shared set, not this one changed in place.
    pub fn update(&mut self, change: impl FnOnce(&mut BTreeSet<Arc<str>>)) {
        let mut set = (**self).clone();
        change(&mut set);
        if set != **self {
            self.0 = (!set.is_empty()).then(|| SharedNames::of_set(&set));
        }
    }
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

/// The route configuration `current` with each virtual host whose clusters are all
/// `warm`, and the others as `held` has them (left out where `held` has none), or `held`
/// itself when that is what it comes to. `None` when a body does not decode.
fn merge_warm_virtual_hosts(
    current: &Arc<Resource>,
    held: Option<&Arc<Resource>>,
    warm: impl Fn(&str) -> bool,
    fallback: impl Fn(&str, Option<&str>) -> Option<Arc<str>>,
) -> Option<Arc<Resource>> {
    use envoy_types::pb::envoy::config::route::v3::RouteConfiguration;
    use prost::Message;
    let decode = |r: &Resource| RouteConfiguration::decode(&*r.body.value).ok();
    let mut config = decode(current)?;
    let old = match held {
        Some(h) => Some(decode(h)?),
        None => None,
    };
    config.virtual_hosts = config
        .virtual_hosts
        .into_iter()
        .filter_map(|mut vh| {
            drop_cold_unweighted(&mut vh, &warm);
            if super::snapshot::virtual_host_clusters(&vh)
                .iter()
                .all(|c| warm(c))
            {
                return Some(vh);
            }
            if let Some(o) = &old {
                return o.virtual_hosts.iter().find(|o| o.name == vh.name).cloned();
            }
            // Nothing held to keep (a fresh Envoy, or one that reconnected): a warm
            // cluster of the same virtual host and of the same kind as each route's own
            // (a gRPC route's stand-in is a gRPC cluster), if the Envoy holds one, takes
            // that route's traffic rather than the host going unrouted; a route with none
            // is left out, and a host with no route left is.
            let vhost = vh.name.clone();
            vh.routes.retain_mut(|r| {
                let Some(own) = route_clusters(r).into_iter().next() else {
                    return true; // names no cluster (a direct response): as it is
                };
                match fallback(&vhost, Some(&own)) {
                    Some(stand_in) => {
                        route_to(r, &stand_in);
                        true
                    }
                    None => false,
                }
            });
            (!vh.routes.is_empty()).then_some(vh)
        })
        .collect();
    let merged = Resource::encode(
        &current.name,
        &config,
        super::snapshot::referenced_clusters(&config),
    );
    Some(match held {
        Some(h) if h.version == merged.version => h.clone(),
        _ => Arc::new(merged),
    })
}

/// The clusters one route names.
fn route_clusters(r: &envoy_types::pb::envoy::config::route::v3::Route) -> Vec<String> {
    use envoy_types::pb::envoy::config::route::v3::{route, route_action};
    let Some(route::Action::Route(action)) = &r.action else {
        return Vec::new();
    };
    match &action.cluster_specifier {
        Some(route_action::ClusterSpecifier::WeightedClusters(w)) => {
            w.clusters.iter().map(|c| c.name.clone()).collect()
        }
        Some(route_action::ClusterSpecifier::Cluster(c)) => vec![c.clone()],
        _ => Vec::new(),
    }
}

/// Sends route `r` to `cluster` alone.
fn route_to(r: &mut envoy_types::pb::envoy::config::route::v3::Route, cluster: &str) {
    use envoy_types::pb::envoy::config::route::v3::{
        route, route_action, weighted_cluster::ClusterWeight,
    };
    let Some(route::Action::Route(action)) = &mut r.action else {
        return;
    };
    if let Some(route_action::ClusterSpecifier::WeightedClusters(w)) = &mut action.cluster_specifier
    {
        w.clusters = vec![ClusterWeight {
            name: cluster.into(),
            weight: Some(envoy_types::pb::google::protobuf::UInt32Value { value: 100 }),
            ..Default::default()
        }];
    } else if let Some(route_action::ClusterSpecifier::Cluster(c)) = &mut action.cluster_specifier {
        *c = cluster.into();
    }
}

/// Leaves out of `vh` the weighted clusters that carry no weight and are not warm (a
/// switchover's target before any traffic moves, or one this Envoy rejected): they
/// take no request, and waiting for them would hold back the virtual host's other
/// changes for as long as they stay cold.
fn drop_cold_unweighted(
    vh: &mut envoy_types::pb::envoy::config::route::v3::VirtualHost,
    warm: &impl Fn(&str) -> bool,
) {
    use envoy_types::pb::envoy::config::route::v3::{
        route, route_action, weighted_cluster::ClusterWeight,
    };
    for r in &mut vh.routes {
        let Some(route::Action::Route(action)) = &mut r.action else {
            continue;
        };
        let Some(route_action::ClusterSpecifier::WeightedClusters(w)) =
            &mut action.cluster_specifier
        else {
            continue;
        };
        let carries =
            |c: &ClusterWeight| c.weight.as_ref().is_some_and(|w| w.value > 0) || warm(&c.name);
        if w.clusters
            .iter()
            .any(|c| c.weight.as_ref().is_some_and(|w| w.value > 0))
        {
            w.clusters.retain(carries);
        }
    }
}

/// The names among `changed` (resources of a response the Envoy rejected) that its
/// error message blames, and whether it named any. Envoy applies the resources it can
/// and names each one it could not ("Error adding/updating cluster(s) a: reason, b:
/// reason"), so when it names some, it holds the rest as sent. A message that names none
/// blames them all, and nothing is taken as applied. Blaming at most what was sent, and
/// all of it when in doubt, means a NACK can never make a resource be sent in a loop.
pub fn blamed<'a>(
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

/// Fills in the bodies of resources `held` knows only by version (declared on a
/// reconnect) where `wanted` has the same version: versions are content hashes, so the
/// Envoy holds exactly that body, and what it names can be known.
pub fn learn_bodies(held: &mut Holding, wanted: &ResourceMap) {
    let Holding::Own(map) = held else { return };
    for (name, h) in map.iter_mut() {
        if h.resource.is_none() {
            if let Some(r) = wanted.get(name).filter(|r| r.version == h.version) {
                h.resource = Some(r.clone());
            }
        }
    }
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
/// `budget` bytes (at least one). Each response is framed in a buffer of its own and
/// freed once written (`codec`), so the budget bounds what a stream holds at once while
/// thousands sync together; each part costs the stream a round trip.
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

/// Most bytes of resources carried by one response of a type that may be split. At
/// 16 KiB a 400 KB endpoint sync took 25 round trips and 1,000 streams synced in 2.4 s;
/// at 128 KiB it takes 4 and they sync in 1.2 s (the freed burst is given back by
/// ray-xds's `memory`).
pub const RESPONSE_BUDGET_BYTES: usize = 128 * 1024;

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

/// Versions one Envoy rejected (NACKed), by name: it keeps what it held before.
pub type Rejected = BTreeMap<Arc<str>, Arc<str>>;

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
pub struct Rejections {
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

static NOTHING_REJECTED: Rejections = Rejections {
    rejected: BTreeMap::new(),
    suspects: BTreeMap::new(),
    trying: BTreeSet::new(),
    seen_with: BTreeMap::new(),
};

impl Rejections {
    pub fn is_empty(&self) -> bool {
        self.rejected.is_empty() && self.suspects.is_empty()
    }

    /// Whether `name` at `version` must not be offered now (the Envoy holding `held`): a
    /// version it rejected, or, while suspects are searched, any change but the ones
    /// being tried.
    pub fn holds_back(&self, name: &str, version: &str, held: Option<&Arc<str>>) -> bool {
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
    pub fn prune(&mut self, current: &ResourceMap) {
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
    pub fn on_nack(
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
    pub fn on_ack(&mut self, sent: &ResourceMap) {
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

/// The view of one Envoy that the ordering rules need.
pub struct ClientHolds<'a> {
    /// ACKed resources per type, indexed by [`ResourceType::index`].
    pub acked: [&'a Holding; 4],
    /// Route configurations sent but not yet ACKed or NACKed.
    pub routes_in_flight: Option<&'a ResourceMap>,
    /// What the Envoy rejected, per type.
    pub rejected: [&'a Rejections; 4],
    /// The Envoy may hold routes this stream has not heard of yet (it reconnected and
    /// has not yet declared its routes): nothing it may still use can be removed.
    pub routes_unknown: bool,
    /// Clusters (or their endpoints) that a response in flight removes: no route may
    /// name them, since the Envoy will have dropped them by the time it gets the route.
    pub leaving: BTreeSet<Arc<str>>,
    /// Clusters sent and not yet ACKed, with the endpoints of the snapshot they came
    /// from: Envoy warms them, and ACKs no cluster until they are warm, so each needs its
    /// endpoints even if it has left the snapshot since.
    pub clusters_in_flight: Option<(&'a ResourceMap, &'a ResourceMap)>,
}

impl<'a> ClientHolds<'a> {
    /// An Envoy that holds `acked` and has rejected nothing.
    pub fn new(acked: [&'a Holding; 4], routes_in_flight: Option<&'a ResourceMap>) -> Self {
        ClientHolds {
            acked,
            routes_in_flight,
            rejected: [&NOTHING_REJECTED; 4],
            routes_unknown: false,
            leaving: BTreeSet::new(),
            clusters_in_flight: None,
        }
    }

    /// Clusters some route the Envoy holds or is receiving still names; `None` means
    /// "cannot tell" (a route known only by version, or routes not declared yet after a
    /// reconnect), so nothing may be removed.
    fn referenced_clusters(&self) -> Option<BTreeSet<Arc<str>>> {
        if self.routes_unknown {
            return None;
        }
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
        self.holds(ResourceType::Cluster, cluster)
            && self.holds(ResourceType::Endpoints, cluster)
            && !self.leaving.contains(cluster)
    }

    /// The Envoy cannot warm `cluster` as the snapshot has it: it rejected the cluster or
    /// its endpoints (and does not hold an earlier version).
    fn stuck(&self, cluster: &str) -> bool {
        !self.warmed(cluster)
            && (self.rejected[ResourceType::Cluster.index()]
                .rejected
                .contains_key(cluster)
                || self.rejected[ResourceType::Endpoints.index()]
                    .rejected
                    .contains_key(cluster))
    }

    /// Not offered now: a version the Envoy rejected, or a change held back while the
    /// Envoy's rejections are searched.
    fn is_rejected(&self, ty: ResourceType, resource: &Resource) -> bool {
        self.rejected[ty.index()].holds_back(
            &resource.name,
            &resource.version,
            self.acked[ty.index()].version_of(&resource.name),
        )
    }
}

/// Every resource of `ty` the Envoy should hold now (before subscription filtering): the
/// snapshot's, but what it rejected (it keeps what it holds), clusters and endpoints a
/// route it holds still needs, routes merged per virtual host while some of their
/// clusters are cold, and no content made for it that it rejected.
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
    if !holds.rejected[ty.index()].is_empty() {
        keep_what_it_rejected(&mut out, current, ty, holds);
    }
    match ty {
        ResourceType::Cluster | ResourceType::Endpoints => {
            if ty == ResourceType::Endpoints {
                endpoints_of_warming_clusters(&mut out, holds);
            }
            if holds_whole(current, ty, holds) {
                return out;
            }
            keep_what_routes_need(&mut out, current, ty, holds);
        }
        ResourceType::Listener => {}
        ResourceType::Route => {
            for (name, route) in current {
                if route.cluster_refs.iter().all(|c| holds.warmed(c)) {
                    continue;
                }
                match merged_route(snapshot, name, route, holds) {
                    Some(d) => out.insert(name.clone(), d),
                    None => out.remove(name),
                };
            }
        }
    }
    // Content made for this Envoy (a merged route, a stand-in) that it rejected is not
    // made again until the snapshot changes: it keeps what it holds.
    // (Per-name types only: a state-of-the-world cluster left out is removed.)
    let rejected = &holds.rejected[ty.index()].rejected;
    if !rejected.is_empty() && !ty.is_full_state() {
        for (name, d) in out.iter_mut() {
            let Desired::Send(r) = d else { continue };
            if rejected.get(name).is_some_and(|v| *v == r.version)
                && current.get(name).is_none_or(|c| c.version != r.version)
            {
                *d = match holds.acked[ty.index()].get(name) {
                    Some(Held {
                        resource: Some(held),
                        ..
                    }) => Desired::Send(held),
                    _ => Desired::Keep,
                };
            }
        }
    }
    out
}

/// A version the Envoy rejected is not offered again (nor a suspect held back): it keeps
/// what it holds.
fn keep_what_it_rejected(
    out: &mut BTreeMap<Arc<str>, Desired>,
    current: &ResourceMap,
    ty: ResourceType,
    holds: &ClientHolds<'_>,
) {
    for (name, r) in current {
        if !holds.is_rejected(ty, r) {
            continue;
        }
        match holds.acked[ty.index()].get(name) {
            Some(Held {
                resource: Some(held),
                ..
            }) => {
                out.insert(name.clone(), Desired::Send(held));
            }
            // A cluster a reconnected SotW Envoy holds at a version it did not say, whose
            // snapshot version it rejected or that is held back while a rejection is
            // searched: it must be in every response (a SotW response without it removes
            // it), and sending the snapshot version would fail every response or the
            // search. A bare EDS cluster of that name keeps it serving its endpoints,
            // without its own settings, until its own version is known to be good.
            Some(Held {
                resource: None,
                version,
            }) if version.is_empty() && ty == ResourceType::Cluster => {
                out.insert(name.clone(), Desired::Send(bare_cluster(name)));
            }
            // Held, but we have no body for it (declared on a reconnect). A per-name type
            // is left out: the Envoy keeps what it has. A state-of-the-world listener
            // cannot be left out (that removes it): offer the snapshot's again.
            Some(Held { resource: None, .. }) => {
                if !ty.is_full_state() {
                    out.insert(name.clone(), Desired::Keep);
                }
            }
            None => {
                out.remove(name);
            }
        }
    }
}

/// Whether the Envoy holds the snapshot's whole set of clusters (or endpoints) and has
/// rejected none: then nothing else is kept for it.
fn holds_whole(current: &ResourceMap, ty: ResourceType, holds: &ClientHolds<'_>) -> bool {
    holds.acked[ty.index()].is_whole_of(current) && holds.rejected[ty.index()].is_empty()
}

/// The endpoints of clusters sent and not yet ACKed, from the snapshot they came with:
/// Envoy warms them, and ACKs no cluster until each has its endpoints, even one that has
/// left the snapshot since.
fn endpoints_of_warming_clusters(out: &mut BTreeMap<Arc<str>, Desired>, holds: &ClientHolds<'_>) {
    if let Some((clusters, endpoints_then)) = holds.clusters_in_flight {
        for name in clusters.keys() {
            if !out.contains_key(name) {
                if let Some(r) = endpoints_then.get(name) {
                    out.insert(name.clone(), Desired::Send(r.clone()));
                }
            }
        }
    }
}

/// Clusters (or endpoints) a route the Envoy holds still names, at the version it has.
fn keep_what_routes_need(
    out: &mut BTreeMap<Arc<str>, Desired>,
    current: &ResourceMap,
    ty: ResourceType,
    holds: &ClientHolds<'_>,
) {
    let referenced = holds.referenced_clusters();
    let retain = |name: &str| referenced.as_ref().is_none_or(|r| r.contains(name));
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

/// A route some of whose clusters are cold on this Envoy, merged per virtual host: each
/// virtual host whose clusters are warm goes as it is now, each other one stays as the
/// Envoy will hold it (the route on its way, else the one it holds). `None`: leave it out.
fn merged_route(
    snapshot: &Snapshot,
    name: &Arc<str>,
    route: &Arc<Resource>,
    holds: &ClientHolds<'_>,
) -> Option<Desired> {
    let ty = ResourceType::Route;
    // Not every cluster is warm. Each virtual host whose clusters are warm
    // goes as it is now; each other one stays as the Envoy will hold it (the
    // route on its way, else the one it holds).
    let held = holds
        .routes_in_flight
        .and_then(|m| m.get(name))
        .map(Held::sent)
        .or_else(|| holds.acked[ty.index()].get(name));
    let warm = |c: &str| holds.warmed(c);
    match held {
        Some(Held {
            resource: Some(held),
            ..
        }) => Some(Desired::Send(
            merge_warm_virtual_hosts(route, Some(&held), warm, |_, _| None).unwrap_or(held),
        )),
        // With nothing (or only a version) to fall back on, a virtual host
        // still warming holds the whole route back; one whose clusters this
        // Envoy rejected is left out, so that it holds back no other.
        Some(Held { resource: None, .. }) | None => {
            let waiting = route
                .cluster_refs
                .iter()
                .any(|c| !holds.warmed(c) && !holds.stuck(c));
            match (waiting, &held) {
                (true, Some(_)) => Some(Desired::Keep),
                (true, None) => None,
                (false, _) => {
                    let fallback = |vhost: &str, own: Option<&str>| {
                        let prefix = format!("{vhost}/");
                        // Of the kind of the route's own cluster, where the
                        // snapshot's stand-in patterns say what that is.
                        let kind = own.and_then(|c| snapshot.stand_in_pattern(c));
                        holds.acked[ResourceType::Cluster.index()]
                            .iter()
                            .map(|(n, _, _)| n)
                            .find(|n| {
                                n.starts_with(&prefix)
                                    && kind.is_none_or(|k| super::snapshot::name_matches(k, n))
                                    && holds.warmed(n)
                            })
                            .cloned()
                    };
                    merge_warm_virtual_hosts(route, None, warm, fallback).map(Desired::Send)
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fixtures::{service, snapshot_of};

    fn hold_all(snapshot: &Snapshot, ty: ResourceType) -> Holding {
        Holding::from_resources(snapshot.resources(ty))
    }

    /// A virtual host `v` whose two routes, one per kind, both name cold clusters.
    fn two_kinds_route() -> Arc<Resource> {
        use envoy_types::pb::envoy::config::route::v3 as route;
        let to = |cluster: &str| route::Route {
            action: Some(route::route::Action::Route(route::RouteAction {
                cluster_specifier: Some(route::route_action::ClusterSpecifier::WeightedClusters(
                    route::WeightedCluster {
                        clusters: vec![route::weighted_cluster::ClusterWeight {
                            name: cluster.into(),
                            ..Default::default()
                        }],
                        ..Default::default()
                    },
                )),
                ..Default::default()
            })),
            ..Default::default()
        };
        let config = route::RouteConfiguration {
            name: "r".into(),
            virtual_hosts: vec![route::VirtualHost {
                name: "ns/v".into(),
                routes: vec![to("ns/v/new/grpc"), to("ns/v/new")],
                ..Default::default()
            }],
            ..Default::default()
        };
        Arc::new(Resource::encode("r", &config, Vec::new()))
    }

    fn routed_to(r: &Resource) -> Vec<Vec<String>> {
        use envoy_types::pb::envoy::config::route::v3::RouteConfiguration;
        use prost::Message;
        let config = RouteConfiguration::decode(&*r.body.value).unwrap();
        config
            .virtual_hosts
            .iter()
            .flat_map(|vh| vh.routes.iter().map(route_clusters))
            .collect()
    }

    #[test]
    fn each_route_of_a_cold_host_gets_a_stand_in_of_its_own_kind() {
        use crate::snapshot::name_matches;
        let patterns = ["ns/v/*", "ns/v/*/grpc"];
        let warm_held = ["ns/v/old", "ns/v/old/grpc"];
        let fallback = |vhost: &str, own: Option<&str>| {
            let kind = own.and_then(|c| {
                patterns
                    .iter()
                    .filter(|p| name_matches(p, c))
                    .max_by_key(|p| p.len())
            });
            warm_held
                .iter()
                .find(|n| {
                    n.starts_with(&format!("{vhost}/")) && kind.is_none_or(|k| name_matches(k, n))
                })
                .map(|n| Arc::from(*n))
        };
        let merged =
            merge_warm_virtual_hosts(&two_kinds_route(), None, |_| false, fallback).unwrap();
        assert_eq!(
            routed_to(&merged),
            [
                vec!["ns/v/old/grpc".to_string()],
                vec!["ns/v/old".to_string()]
            ],
            "a gRPC route never stands in on an HTTP/1 cluster, nor the reverse"
        );
        // No warm gRPC cluster held: the gRPC route is left out, HTTP still routed.
        let http_only = |vhost: &str, own: Option<&str>| {
            (!own.is_some_and(|c| c.ends_with("/grpc"))).then(|| Arc::from(format!("{vhost}/old")))
        };
        let merged =
            merge_warm_virtual_hosts(&two_kinds_route(), None, |_| false, http_only).unwrap();
        assert_eq!(routed_to(&merged), [vec!["ns/v/old".to_string()]]);
        // Nothing at all: the host is left out.
        let merged =
            merge_warm_virtual_hosts(&two_kinds_route(), None, |_| false, |_, _| None).unwrap();
        assert_eq!(routed_to(&merged), Vec::<Vec<String>>::new());
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
        let holds = ClientHolds::new(acked, None);
        let routes = desired(&new, ResourceType::Route, &holds);
        let old_route = old.resources(ResourceType::Route).values().next().unwrap();
        let sent = routes.values().next().unwrap().resource().unwrap();
        assert_eq!(sent.version, old_route.version, "still the old route");

        // Once the Envoy holds the new cluster and its endpoints, the new route goes.
        let clusters = hold_all(&new, ResourceType::Cluster);
        let endpoints = hold_all(&new, ResourceType::Endpoints);
        let holds = ClientHolds::new([&clusters, &endpoints, acked[2], acked[3]], None);
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
        let holds = ClientHolds::new([&held[0], &held[1], &held[2], &held[3]], None);
        let clusters = desired(&new, ResourceType::Cluster, &holds);
        assert!(
            clusters.contains_key("default/b/b1"),
            "old route still names b1"
        );
        let endpoints = desired(&new, ResourceType::Endpoints, &holds);
        assert!(endpoints.contains_key("default/b/b1"));

        // While the new route is in flight, the old one may still be in use: keep b1.
        let in_flight = new.resources(ResourceType::Route).clone();
        let holds = ClientHolds::new([&held[0], &held[1], &held[2], &held[3]], Some(&in_flight));
        assert!(desired(&new, ResourceType::Cluster, &holds).contains_key("default/b/b1"));

        // Once the Envoy holds the new route, b1 can go.
        let new_routes = hold_all(&new, ResourceType::Route);
        let holds = ClientHolds::new([&held[0], &held[1], &held[2], &new_routes], None);
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
        let holds = ClientHolds::new([&clusters, &empty, &empty, &routes], None);
        assert!(desired(&new, ResourceType::Cluster, &holds).contains_key("default/b/b1"));
    }

    #[test]
    fn a_cold_cluster_holds_back_only_its_own_virtual_host() {
        use envoy_types::pb::envoy::config::route::v3::RouteConfiguration;
        use prost::Message;
        // Held: a -> a1, b -> b1. Now: a -> a2 (warm), b -> b2 (cold: never ACKed).
        let mut a_old = service("a", "a1", &[8000]);
        a_old
            .clusters
            .push(service("a", "a2", &[8100]).clusters.remove(0));
        let b_old = service("b", "b1", &[9000]);
        let old = snapshot_of(vec![a_old.clone(), b_old.clone()]);
        let mut a_new = a_old.clone();
        a_new.active = "a2".into();
        let mut b_new = b_old.clone();
        b_new
            .clusters
            .push(service("b", "b2", &[9100]).clusters.remove(0));
        b_new.active = "b2".into();
        let new = snapshot_of(vec![a_new, b_new]);
        let held: Vec<Holding> = ResourceType::ALL
            .iter()
            .map(|t| hold_all(&old, *t))
            .collect();
        let holds = ClientHolds::new([&held[0], &held[1], &held[2], &held[3]], None);
        let routes = desired(&new, ResourceType::Route, &holds);
        let sent = routes.values().next().unwrap().resource().unwrap();
        let config = RouteConfiguration::decode(&*sent.body.value).unwrap();
        let target = |name: &str| {
            let vh = config
                .virtual_hosts
                .iter()
                .find(|v| v.name == name)
                .unwrap();
            crate::snapshot::virtual_host_clusters(vh)
        };
        assert_eq!(target("default/a"), ["default/a/a2"], "a moves on");
        assert_eq!(target("default/b"), ["default/b/b1"], "b waits for b2");
        assert_eq!(
            sent.cluster_refs,
            vec![Arc::from("default/a/a2"), Arc::from("default/b/b1")]
        );
        // A brand-new virtual host whose cluster is cold is left out until it is warm.
        let c_new = service("c", "c1", &[7000]);
        let with_c = snapshot_of(vec![a_old, b_old, c_new]);
        let routes = desired(&with_c, ResourceType::Route, &holds);
        let sent = routes.values().next().unwrap().resource().unwrap();
        let config = RouteConfiguration::decode(&*sent.body.value).unwrap();
        let names: Vec<&str> = config
            .virtual_hosts
            .iter()
            .map(|v| v.name.as_str())
            .collect();
        assert_eq!(names, ["default/a", "default/b"]);
    }
}
