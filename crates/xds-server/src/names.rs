//! Subscribed names, kept once: [`SharedNames`], the names of every stream whose Envoy
//! subscribes to the same ones (an idle stream holds a pointer, not a copy), and
//! [`intern`], a name as the string some holding already uses.
//!
//! Invariant: a list is shared only with lists equal to it; the book of shared lists
//! holds weak pointers, so a list goes when its last stream does.

use std::collections::BTreeSet;
use std::sync::Arc;

use super::holding::Holding;

/// A list of subscribed names, shared by every stream whose client listed the same
/// (see [`SharedNames::of_list`]): a thousand Envoys subscribed to the same 200 endpoint
/// names hold one copy of them, not a thousand.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct SharedNames {
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
    pub(crate) fn of_list<S: AsRef<str>>(list: &[S]) -> Arc<SharedNames> {
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
    pub(crate) fn of_set(set: &BTreeSet<Arc<str>>) -> Arc<SharedNames> {
        let list: Vec<&str> = set.iter().map(|n| &**n).collect();
        SharedNames::of_list(&list)
    }

    /// Whether these are exactly `list`, in its order.
    pub(crate) fn is_list<S: AsRef<str>>(&self, list: &[S]) -> bool {
        self.list.len() == list.len() && self.list.iter().zip(list).all(|(a, b)| **a == *b.as_ref())
    }

    /// The names as listed.
    pub(crate) fn list(&self) -> &[Arc<str>] {
        &self.list
    }
}

/// A set of subscribed names that streams share (see [`SharedNames`]); changed whole.
#[derive(Clone, Debug, Default)]
pub(crate) struct NameSet(Option<Arc<SharedNames>>);

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
pub(crate) fn intern<'a>(name: &str, holdings: impl IntoIterator<Item = &'a Holding>) -> Arc<str> {
    holdings
        .into_iter()
        .find_map(|h| h.key(name))
        .unwrap_or_else(|| Arc::from(name))
}
