//! A fake Kubernetes API server that speaks the real list/watch HTTP protocol, so tests can
//! point the real kube-rs client (`Api`, `kube::runtime::watcher`) at it.
//!
//! What it serves (GET, and PATCH as a merge patch of one existing object):
//! - collections: `/api/v1/{plural}`, `/api/v1/namespaces/{ns}/{plural}`,
//!   `/apis/{group}/{version}/{plural}` and `/apis/{group}/{version}/namespaces/{ns}/{plural}`;
//!   a list answers `{kind: <Kind>List, metadata: {resourceVersion, continue?}, items}`, a
//!   watch (`watch=true`) streams one `{"type", "object"}` JSON event per line;
//! - single objects below a collection (`.../{plural}/{name}`), and `/version`;
//! - a `Status` object with the right code for everything else (404, 400, 405, 410, 503).
//!
//! Invariants, as on the real server:
//! - one global resourceVersion counter; every change takes the next value, and a list's
//!   `metadata.resourceVersion` is the counter at the time of the list;
//! - a watch from resourceVersion `R` gets every event after `R` that matches its namespace,
//!   `labelSelector` and `fieldSelector`, in order; a watch with no resourceVersion or `"0"`
//!   (or with `sendInitialEvents=true`) first gets a synthetic `ADDED` per current object
//!   (then, for `sendInitialEvents`, a `BOOKMARK` annotated `k8s.io/initial-events-end`);
//! - an object that stops (or starts) matching a watch's selectors is sent as `DELETED`
//!   (or `ADDED`);
//! - after [`FakeApiServer::expire_history`], a watch (or a list `continue` token) from an
//!   older resourceVersion gets `410 Gone`: for a watch, an HTTP 200 whose only event is an
//!   `ERROR` carrying a `Status` with code 410 and reason `Expired`;
//! - `allowWatchBookmarks=true` gets a `BOOKMARK` every second and one just before the stream
//!   ends at `timeoutSeconds` (default 1800 s);
//! - `limit`/`continue` paginate (except with `resourceVersion=0`, which the real server
//!   also answers in one page); a later page shows the current state of the remaining
//!   objects, under the first page's resourceVersion;
//! - a slow or stuck watch never blocks [`FakeApiServer::apply`]: events are kept in a
//!   history that every watch reads at its own pace.
//!
//! Limits (what it does not implement): writes through HTTP other than a merge patch (POST,
//! PUT and DELETE get 405; a JSON patch 415),
//! subresources (`/status`, `/log`), discovery (`/api`, `/apis`), authentication, protobuf,
//! table output, multiple versions of one resource, finalizers, garbage collection, a list at
//! an older resourceVersion (lists always show the current state), and the real server's
//! per-type restrictions on `fieldSelector` (any dotted path of the object is accepted and
//! compared as a string; a missing field compares as `""`). The kinds a collection can serve
//! are those in [`BUILTIN_KINDS`] and those of objects applied so far; any other collection
//! answers 404, as for a CRD that is not installed. An object applied without
//! `metadata.namespace` goes to `default` (as `kubectl apply` does), unless its kind is one of
//! the few cluster-scoped kinds known here.

use std::collections::{BTreeMap, HashMap};
use std::io;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::{Query, State};
use axum::http::{header, Method, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use axum::Router;
use k8s_openapi::chrono::{SecondsFormat, TimeDelta, Utc};
use serde::Deserialize;
use serde_json::{json, Map, Value};
use tokio::sync::watch;
use tokio::time::{sleep_until, Instant};
use tokio_util::sync::{CancellationToken, DropGuard};

mod request;
mod selectors;
mod serve;
mod store;

use request::*;
use selectors::*;
use serve::*;
use store::*;

/// How often a watch that asked for bookmarks gets one.
const BOOKMARK_INTERVAL: Duration = Duration::from_secs(1);
/// A watch's length when it gives no `timeoutSeconds` (the real server picks 30–60 minutes).
const DEFAULT_WATCH_TIMEOUT: Duration = Duration::from_secs(1800);
/// The grace period [`FakeApiServer::begin_delete`] gives, as for a pod by default.
const DELETION_GRACE_SECONDS: i64 = 30;
/// How many request lines [`FakeApiServer::requests`] keeps.
const MAX_LOGGED_REQUESTS: usize = 10_000;

/// Kinds served even before an object of them is applied: (apiVersion, kind).
pub const BUILTIN_KINDS: &[(&str, &str)] = &[
    ("v1", "Pod"),
    ("v1", "Service"),
    ("v1", "Endpoints"),
    ("v1", "Node"),
    ("v1", "Namespace"),
    ("v1", "ConfigMap"),
    ("v1", "Secret"),
    ("discovery.k8s.io/v1", "EndpointSlice"),
    ("ray.io/v1", "RayService"),
    ("ray.io/v1", "RayCluster"),
    ("ray.io/v1", "RayJob"),
];

/// Kinds whose objects have no namespace.
const CLUSTER_SCOPED_KINDS: &[&str] = &[
    "Namespace",
    "Node",
    "PersistentVolume",
    "CustomResourceDefinition",
    "ClusterRole",
    "ClusterRoleBinding",
    "StorageClass",
    "PriorityClass",
];

/// The plural resource name of a kind: `Pod` → `pods`, `RayService` → `rayservices`,
/// `EndpointSlice` → `endpointslices`, `Endpoints` → `endpoints`, `NetworkPolicy` →
/// `networkpolicies`.
pub fn plural_of(kind: &str) -> String {
    let lower = kind.to_ascii_lowercase();
    if lower == "endpoints" {
        lower
    } else if let Some(stem) = lower
        .strip_suffix('y')
        .filter(|stem| !stem.ends_with(['a', 'e', 'i', 'o', 'u']))
    {
        format!("{stem}ies")
    } else if lower.ends_with('s') || lower.ends_with('x') || lower.ends_with("ch") {
        format!("{lower}es")
    } else {
        format!("{lower}s")
    }
}

/// A fake Kubernetes API server on 127.0.0.1; it stops when the last clone of the handle is
/// dropped (and with the test's runtime in any case).
#[derive(Clone)]
pub struct FakeApiServer {
    shared: Arc<Shared>,
    addr: SocketAddr,
    _stop: Arc<DropGuard>,
}

impl FakeApiServer {
    /// Binds 127.0.0.1:0 and serves in a task of the current runtime.
    pub async fn start() -> FakeApiServer {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("binding the fake API server");
        let addr = listener.local_addr().expect("fake API server address");
        let shutdown = CancellationToken::new();
        let shared = Arc::new(Shared {
            store: Mutex::new(Store::new()),
            counts: Mutex::new(HashMap::new()),
            requests: Mutex::new(Vec::new()),
            changed: watch::Sender::new(0),
            unavailable: AtomicBool::new(false),
            drop_watches: Mutex::new(shutdown.child_token()),
            shutdown: shutdown.clone(),
        });
        let app = Router::new().fallback(handle).with_state(shared.clone());
        let stopped = shutdown.clone();
        tokio::spawn(async move {
            let _ = axum::serve(listener, app)
                .with_graceful_shutdown(stopped.cancelled_owned())
                .await;
        });
        FakeApiServer {
            shared,
            addr,
            _stop: Arc::new(shutdown.drop_guard()),
        }
    }

    /// The base URL, e.g. `http://127.0.0.1:PORT`.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// A kube client for this server, with default namespace `default` (call it inside a
    /// Tokio runtime).
    pub fn client(&self) -> kube::Client {
        let uri = self.url().parse().expect("fake API server URL");
        kube::Client::try_from(kube::Config::new(uri)).expect("kube client for the fake API server")
    }

    /// Creates or replaces an object (`apiVersion`, `kind` and `metadata.name` required;
    /// `metadata.namespace` defaults to `default` for namespaced kinds). Sets
    /// `metadata.resourceVersion`, and `uid`, `creationTimestamp` and `generation` when
    /// absent (kept from the stored object on a replace; `generation` goes up when `spec`
    /// changes). Emits `ADDED` or `MODIFIED`; returns the stored object.
    pub fn apply(&self, mut object: Value) -> Value {
        let text = |field: &str| {
            object
                .pointer(field)
                .and_then(Value::as_str)
                .map(str::to_string)
                .unwrap_or_else(|| panic!("FakeApiServer::apply: {field} missing in {object}"))
        };
        let (api_version, kind, name) =
            (text("/apiVersion"), text("/kind"), text("/metadata/name"));
        let namespace = match object
            .pointer("/metadata/namespace")
            .and_then(Value::as_str)
        {
            Some(namespace) => namespace.to_string(),
            None if CLUSTER_SCOPED_KINDS.contains(&kind.as_str()) => String::new(),
            None => "default".to_string(),
        };
        let key = ObjectKey::new(&api_version, &kind, &namespace, &name);
        self.shared.change(|store| {
            store.kinds.insert(key.resource.clone(), kind.clone());
            let previous = store.objects.get(&key);
            let kept = |field: &str| previous.and_then(|p| p["metadata"].get(field)).cloned();
            let (uid, created) = (kept("uid"), kept("creationTimestamp"));
            let generation = previous.map_or(1, |p| {
                let changed = p.get("spec") != object.get("spec");
                p["metadata"]["generation"].as_i64().unwrap_or(1) + i64::from(changed)
            });
            let rv = store.next_rv();
            let meta = metadata_mut(&mut object);
            if !namespace.is_empty() {
                meta.insert("namespace".into(), namespace.into());
            }
            meta.insert("resourceVersion".into(), rv.to_string().into());
            meta.entry("uid")
                .or_insert_with(|| uid.unwrap_or_else(|| store.new_uid().into()));
            meta.entry("creationTimestamp")
                .or_insert_with(|| created.unwrap_or_else(|| now(0).into()));
            meta.entry("generation").or_insert(generation.into());
            store.put(key, object.clone());
            object
        })
    }

    /// [`apply`](Self::apply) for each document of a YAML text (documents separated by
    /// `---`; empty ones skipped).
    pub fn apply_yaml(&self, yaml: &str) -> Vec<Value> {
        serde_yaml::Deserializer::from_str(yaml)
            .map(|document| {
                Value::deserialize(document).expect("FakeApiServer::apply_yaml: bad YAML")
            })
            .filter(|document| !document.is_null())
            .map(|document| self.apply(document))
            .collect()
    }

    /// Starts a graceful deletion, as the real server does for a pod: sets
    /// `metadata.deletionTimestamp` (now plus the grace period, 30 s) and
    /// `deletionGracePeriodSeconds`, and emits `MODIFIED`. `None` if the object is absent;
    /// an object already being deleted is returned unchanged.
    pub fn begin_delete(
        &self,
        api_version: &str,
        kind: &str,
        namespace: &str,
        name: &str,
    ) -> Option<Value> {
        let key = ObjectKey::new(api_version, kind, namespace, name);
        self.shared.change(|store| {
            let previous = store.objects.get(&key)?.clone();
            if previous["metadata"].get("deletionTimestamp").is_some() {
                return Some(previous);
            }
            let rv = store.next_rv();
            let mut object = previous.clone();
            let meta = metadata_mut(&mut object);
            meta.insert(
                "deletionTimestamp".into(),
                now(DELETION_GRACE_SECONDS).into(),
            );
            meta.insert(
                "deletionGracePeriodSeconds".into(),
                DELETION_GRACE_SECONDS.into(),
            );
            meta.insert("resourceVersion".into(), rv.to_string().into());
            store.put(key, object.clone());
            Some(object)
        })
    }

    /// Removes an object; emits `DELETED` with its last state under a new resourceVersion.
    pub fn delete(
        &self,
        api_version: &str,
        kind: &str,
        namespace: &str,
        name: &str,
    ) -> Option<Value> {
        let key = ObjectKey::new(api_version, kind, namespace, name);
        self.shared.change(|store| {
            let mut object = store.objects.remove(&key)?;
            let rv = store.next_rv();
            if let Some(meta) = object.get_mut("metadata").and_then(Value::as_object_mut) {
                meta.insert("resourceVersion".into(), rv.to_string().into());
            }
            store.record(EventType::Deleted, key, object.clone(), None);
            Some(object)
        })
    }

    /// Stores and serves an object exactly as given, except for `metadata.resourceVersion`
    /// (set when `metadata` is an object), even if its fields have the wrong types. Emits
    /// `ADDED` or `MODIFIED`.
    pub fn apply_raw(
        &self,
        api_version: &str,
        kind: &str,
        namespace: &str,
        name: &str,
        mut object: Value,
    ) {
        let key = ObjectKey::new(api_version, kind, namespace, name);
        self.shared.change(|store| {
            store
                .kinds
                .entry(key.resource.clone())
                .or_insert_with(|| kind.to_string());
            let rv = store.next_rv();
            if let Some(meta) = object.get_mut("metadata").and_then(Value::as_object_mut) {
                meta.insert("resourceVersion".into(), rv.to_string().into());
            }
            store.put(key, object);
        });
    }

    /// Ends every open watch abruptly: the response body fails mid-stream, so the
    /// connection closes without the final chunk and without a last event.
    pub fn drop_watches(&self) {
        self.shared.drop_watches();
    }

    /// Forgets the event history: a watch (or `continue` token) from any resourceVersion
    /// older than the current one gets 410 Gone, as after an etcd compaction. Open watches
    /// that have events left to read get the 410 too.
    pub fn expire_history(&self) {
        self.shared.change(|store| {
            store.history.clear();
            store.compacted = store.rv;
        });
    }

    /// While `down`, every request gets 503 ServiceUnavailable; going down also ends every
    /// open watch abruptly.
    pub fn set_unavailable(&self, down: bool) {
        self.shared.unavailable.store(down, Ordering::SeqCst);
        if down {
            self.shared.drop_watches();
        }
    }

    /// List requests answered (not counting 503s), for a plural such as `pods`.
    pub fn lists(&self, plural: &str) -> usize {
        self.shared.counts(plural, |c| c.lists)
    }

    /// Watch requests answered (not counting 503s), including those answered 410.
    pub fn watches(&self, plural: &str) -> usize {
        self.shared.counts(plural, |c| c.watches)
    }

    /// How many PATCH requests reached objects of `plural` (found or not).
    pub fn patches(&self, plural: &str) -> usize {
        self.shared.counts(plural, |c| c.patches)
    }

    /// Watch responses still streaming.
    pub fn open_watches(&self, plural: &str) -> usize {
        self.shared.counts(plural, |c| c.open_watches)
    }

    /// Every request so far (the latest 10 000), as `METHOD path?query`.
    pub fn requests(&self) -> Vec<String> {
        lock(&self.shared.requests).clone()
    }

    /// The current resourceVersion.
    pub fn resource_version(&self) -> u64 {
        lock(&self.shared.store).rv
    }
}
