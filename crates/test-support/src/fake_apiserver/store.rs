//! The fake API server's state: objects by kind and key, every change as an event in one
//! history under the one resourceVersion counter, and what the tests count.
//!
//! Invariant: every change takes the next resourceVersion and is appended to the history
//! in that order; a watch reads the history at its own pace.

use super::*;

/// A resource type: what a collection URL names. The core group is `""`.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub(super) struct ResourceType {
    pub(super) group: String,
    pub(super) version: String,
    pub(super) plural: String,
}

impl ResourceType {
    pub(super) fn of(api_version: &str, kind: &str) -> ResourceType {
        let (group, version) = api_version.split_once('/').unwrap_or(("", api_version));
        ResourceType {
            group: group.into(),
            version: version.into(),
            plural: plural_of(kind),
        }
    }

    pub(super) fn api_version(&self) -> String {
        if self.group.is_empty() {
            self.version.clone()
        } else {
            format!("{}/{}", self.group, self.version)
        }
    }
}

/// Where an object is stored. Ordered by namespace then name within a resource type, which
/// is also the order of lists and of `continue` tokens.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub(super) struct ObjectKey {
    pub(super) resource: ResourceType,
    pub(super) namespace: String,
    pub(super) name: String,
}

impl ObjectKey {
    pub(super) fn new(api_version: &str, kind: &str, namespace: &str, name: &str) -> ObjectKey {
        ObjectKey {
            resource: ResourceType::of(api_version, kind),
            namespace: namespace.into(),
            name: name.into(),
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum EventType {
    Added,
    Modified,
    Deleted,
}

impl EventType {
    pub(super) fn as_str(self) -> &'static str {
        match self {
            EventType::Added => "ADDED",
            EventType::Modified => "MODIFIED",
            EventType::Deleted => "DELETED",
        }
    }
}

/// One change, as kept in the history that watches replay.
pub(super) struct Event {
    pub(super) rv: u64,
    pub(super) kind: EventType,
    pub(super) key: ObjectKey,
    pub(super) object: Value,
    /// The state before a `MODIFIED`, to tell a watch that the object left (or entered)
    /// its selection.
    pub(super) previous: Option<Value>,
}

/// Objects, their history and the resourceVersion counter.
pub(super) struct Store {
    pub(super) rv: u64,
    pub(super) objects: BTreeMap<ObjectKey, Value>,
    /// Every event after `compacted`, oldest first.
    pub(super) history: Vec<Event>,
    /// Events up to this resourceVersion are forgotten; a watch from before it gets 410.
    pub(super) compacted: u64,
    /// The kind served by each resource type.
    pub(super) kinds: HashMap<ResourceType, String>,
    pub(super) uids: u64,
}

impl Store {
    pub(super) fn new() -> Store {
        let kinds = BUILTIN_KINDS
            .iter()
            .map(|(api_version, kind)| (ResourceType::of(api_version, kind), kind.to_string()))
            .collect();
        Store {
            // Starts well above zero so that "0" (any version) is never a real one.
            rv: 1000,
            objects: BTreeMap::new(),
            history: Vec::new(),
            compacted: 0,
            kinds,
            uids: 0,
        }
    }

    pub(super) fn next_rv(&mut self) -> u64 {
        self.rv += 1;
        self.rv
    }

    pub(super) fn record(
        &mut self,
        kind: EventType,
        key: ObjectKey,
        object: Value,
        previous: Option<Value>,
    ) {
        self.history.push(Event {
            rv: self.rv,
            kind,
            key,
            object,
            previous,
        });
    }

    /// Stores an object whose resourceVersion is the current one; records `ADDED` or
    /// `MODIFIED`.
    pub(super) fn put(&mut self, key: ObjectKey, object: Value) {
        let previous = self.objects.insert(key.clone(), object.clone());
        let kind = if previous.is_some() {
            EventType::Modified
        } else {
            EventType::Added
        };
        self.record(kind, key, object, previous);
    }

    pub(super) fn new_uid(&mut self) -> String {
        self.uids += 1;
        format!("00000000-0000-4000-8000-{:012x}", self.uids)
    }
}

#[derive(Default)]
pub(super) struct Counts {
    pub(super) lists: usize,
    pub(super) watches: usize,
    pub(super) open_watches: usize,
    pub(super) patches: usize,
}

/// State shared by the handle and the HTTP handlers.
pub(super) struct Shared {
    pub(super) store: Mutex<Store>,
    pub(super) counts: Mutex<HashMap<String, Counts>>,
    pub(super) requests: Mutex<Vec<String>>,
    /// The latest resourceVersion, to wake watches.
    pub(super) changed: watch::Sender<u64>,
    pub(super) unavailable: AtomicBool,
    /// Cancelled (and replaced) by `drop_watches`; a child of `shutdown`.
    pub(super) drop_watches: Mutex<CancellationToken>,
    pub(super) shutdown: CancellationToken,
}

/// Locks a mutex even if a panicking test poisoned it.
pub(super) fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

impl Shared {
    pub(super) fn count(&self, plural: &str, update: impl FnOnce(&mut Counts)) {
        update(lock(&self.counts).entry(plural.to_string()).or_default());
    }

    pub(super) fn counts<T>(&self, plural: &str, read: impl FnOnce(&Counts) -> T) -> T {
        read(lock(&self.counts).get(plural).unwrap_or(&Counts::default()))
    }

    /// Changes the store, then wakes every watch.
    pub(super) fn change<T>(&self, f: impl FnOnce(&mut Store) -> T) -> T {
        let (result, rv) = {
            let mut store = lock(&self.store);
            let result = f(&mut store);
            (result, store.rv)
        };
        self.changed.send_replace(rv);
        result
    }

    pub(super) fn drop_watches(&self) {
        let mut token = lock(&self.drop_watches);
        let old = std::mem::replace(&mut *token, self.shutdown.child_token());
        old.cancel();
    }
}
