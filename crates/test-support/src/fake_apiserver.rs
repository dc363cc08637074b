//! A fake Kubernetes API server that speaks the real list/watch HTTP protocol, so tests can
//! point the real kube-rs client (`Api`, `kube::runtime::watcher`) at it.
//!
//! What it serves (GET only):
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
//! Limits (what it does not implement): writes through HTTP (POST/PUT/PATCH/DELETE get 405),
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

/// A resource type: what a collection URL names. The core group is `""`.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
struct ResourceType {
    group: String,
    version: String,
    plural: String,
}

impl ResourceType {
    fn of(api_version: &str, kind: &str) -> ResourceType {
        let (group, version) = api_version.split_once('/').unwrap_or(("", api_version));
        ResourceType {
            group: group.into(),
            version: version.into(),
            plural: plural_of(kind),
        }
    }

    fn api_version(&self) -> String {
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
struct ObjectKey {
    resource: ResourceType,
    namespace: String,
    name: String,
}

impl ObjectKey {
    fn new(api_version: &str, kind: &str, namespace: &str, name: &str) -> ObjectKey {
        ObjectKey {
            resource: ResourceType::of(api_version, kind),
            namespace: namespace.into(),
            name: name.into(),
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum EventType {
    Added,
    Modified,
    Deleted,
}

impl EventType {
    fn as_str(self) -> &'static str {
        match self {
            EventType::Added => "ADDED",
            EventType::Modified => "MODIFIED",
            EventType::Deleted => "DELETED",
        }
    }
}

/// One change, as kept in the history that watches replay.
struct Event {
    rv: u64,
    kind: EventType,
    key: ObjectKey,
    object: Value,
    /// The state before a `MODIFIED`, to tell a watch that the object left (or entered)
    /// its selection.
    previous: Option<Value>,
}

/// Objects, their history and the resourceVersion counter.
struct Store {
    rv: u64,
    objects: BTreeMap<ObjectKey, Value>,
    /// Every event after `compacted`, oldest first.
    history: Vec<Event>,
    /// Events up to this resourceVersion are forgotten; a watch from before it gets 410.
    compacted: u64,
    /// The kind served by each resource type.
    kinds: HashMap<ResourceType, String>,
    uids: u64,
}

impl Store {
    fn new() -> Store {
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

    fn next_rv(&mut self) -> u64 {
        self.rv += 1;
        self.rv
    }

    fn record(&mut self, kind: EventType, key: ObjectKey, object: Value, previous: Option<Value>) {
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
    fn put(&mut self, key: ObjectKey, object: Value) {
        let previous = self.objects.insert(key.clone(), object.clone());
        let kind = if previous.is_some() {
            EventType::Modified
        } else {
            EventType::Added
        };
        self.record(kind, key, object, previous);
    }

    fn new_uid(&mut self) -> String {
        self.uids += 1;
        format!("00000000-0000-4000-8000-{:012x}", self.uids)
    }
}

#[derive(Default)]
struct Counts {
    lists: usize,
    watches: usize,
    open_watches: usize,
}

/// State shared by the handle and the HTTP handlers.
struct Shared {
    store: Mutex<Store>,
    counts: Mutex<HashMap<String, Counts>>,
    requests: Mutex<Vec<String>>,
    /// The latest resourceVersion, to wake watches.
    changed: watch::Sender<u64>,
    unavailable: AtomicBool,
    /// Cancelled (and replaced) by `drop_watches`; a child of `shutdown`.
    drop_watches: Mutex<CancellationToken>,
    shutdown: CancellationToken,
}

/// Locks a mutex even if a panicking test poisoned it.
fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

impl Shared {
    fn count(&self, plural: &str, update: impl FnOnce(&mut Counts)) {
        update(lock(&self.counts).entry(plural.to_string()).or_default());
    }

    fn counts<T>(&self, plural: &str, read: impl FnOnce(&Counts) -> T) -> T {
        read(lock(&self.counts).get(plural).unwrap_or(&Counts::default()))
    }

    /// Changes the store, then wakes every watch.
    fn change<T>(&self, f: impl FnOnce(&mut Store) -> T) -> T {
        let (result, rv) = {
            let mut store = lock(&self.store);
            let result = f(&mut store);
            (result, store.rv)
        };
        self.changed.send_replace(rv);
        result
    }

    fn drop_watches(&self) {
        let mut token = lock(&self.drop_watches);
        let old = std::mem::replace(&mut *token, self.shutdown.child_token());
        old.cancel();
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

fn metadata_mut(object: &mut Value) -> &mut Map<String, Value> {
    object
        .get_mut("metadata")
        .and_then(Value::as_object_mut)
        .expect("the object's metadata is an object")
}

/// An RFC 3339 time, `offset_seconds` from now.
fn now(offset_seconds: i64) -> String {
    (Utc::now() + TimeDelta::seconds(offset_seconds)).to_rfc3339_opts(SecondsFormat::Secs, true)
}

// ---- HTTP ----

fn status(code: StatusCode, reason: &str, message: impl Into<String>) -> Response {
    (code, axum::Json(status_object(code, reason, message))).into_response()
}

fn status_object(code: StatusCode, reason: &str, message: impl Into<String>) -> Value {
    json!({
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message.into(),
        "reason": reason,
        "code": code.as_u16(),
    })
}

fn not_found() -> Response {
    status(
        StatusCode::NOT_FOUND,
        "NotFound",
        "the server could not find the requested resource",
    )
}

fn unavailable() -> Response {
    status(
        StatusCode::SERVICE_UNAVAILABLE,
        "ServiceUnavailable",
        "the fake API server is unavailable",
    )
}

fn bad_request(message: impl Into<String>) -> Response {
    status(StatusCode::BAD_REQUEST, "BadRequest", message)
}

async fn handle(State(shared): State<Arc<Shared>>, method: Method, uri: Uri) -> Response {
    {
        let mut requests = lock(&shared.requests);
        if requests.len() < MAX_LOGGED_REQUESTS {
            requests.push(format!("{method} {uri}"));
        }
    }
    if shared.unavailable.load(Ordering::SeqCst) {
        return unavailable();
    }
    if method != Method::GET {
        return status(
            StatusCode::METHOD_NOT_ALLOWED,
            "MethodNotAllowed",
            format!("the fake API server does not serve {method}"),
        );
    }
    if uri.path() == "/version" {
        return axum::Json(version()).into_response();
    }
    let Some(target) = Target::parse(uri.path()) else {
        return not_found();
    };
    let params = match Query::<Vec<(String, String)>>::try_from_uri(&uri)
        .map_err(|e| e.body_text())
        .and_then(|Query(query)| Params::parse(&query))
    {
        Ok(params) => params,
        Err(message) => return bad_request(message),
    };
    let Some(kind) = lock(&shared.store).kinds.get(&target.resource).cloned() else {
        return not_found();
    };
    match (&target.name, params.watch) {
        (Some(name), _) => get(&shared, &target, name),
        (None, false) => list(&shared, &target, &kind, &params),
        (None, true) => start_watch(&shared, target, kind, params),
    }
}

fn version() -> Value {
    json!({
        "major": "1",
        "minor": "32",
        "gitVersion": "v1.32.0-fake",
        "gitCommit": "0000000000000000000000000000000000000000",
        "gitTreeState": "clean",
        "buildDate": "2025-01-01T00:00:00Z",
        "goVersion": "go1.23",
        "compiler": "gc",
        "platform": "linux/amd64",
    })
}

/// What a request path names: a collection (optionally in one namespace) or one object.
struct Target {
    resource: ResourceType,
    namespace: Option<String>,
    name: Option<String>,
}

impl Target {
    fn parse(path: &str) -> Option<Target> {
        let segments: Vec<&str> = path.strip_prefix('/')?.split('/').collect();
        if segments.iter().any(|s| s.is_empty()) {
            return None;
        }
        let (group, version, rest) = match segments.as_slice() {
            ["api", version, rest @ ..] => ("", *version, rest),
            ["apis", group, version, rest @ ..] => (*group, *version, rest),
            _ => return None,
        };
        let (namespace, plural, name) = match rest {
            [plural] => (None, *plural, None),
            [plural, name] => (None, *plural, Some(*name)),
            ["namespaces", namespace, plural] => (Some(*namespace), *plural, None),
            ["namespaces", namespace, plural, name] => (Some(*namespace), *plural, Some(*name)),
            _ => return None,
        };
        Some(Target {
            resource: ResourceType {
                group: group.into(),
                version: version.into(),
                plural: plural.into(),
            },
            namespace: namespace.map(str::to_string),
            name: name.map(str::to_string),
        })
    }

    fn contains(&self, key: &ObjectKey) -> bool {
        key.resource == self.resource
            && self
                .namespace
                .as_ref()
                .is_none_or(|namespace| *namespace == key.namespace)
    }
}

/// The query parameters that matter for list and watch.
#[derive(Default)]
struct Params {
    watch: bool,
    resource_version: Option<String>,
    timeout: Option<Duration>,
    bookmarks: bool,
    send_initial_events: bool,
    labels: LabelSelector,
    fields: FieldSelector,
    limit: Option<usize>,
    continue_token: Option<String>,
}

impl Params {
    fn parse(query: &[(String, String)]) -> Result<Params, String> {
        let mut params = Params::default();
        for (name, value) in query {
            let value = value.as_str();
            match name.as_str() {
                "watch" => params.watch = parse_bool(name, value)?,
                "allowWatchBookmarks" => params.bookmarks = parse_bool(name, value)?,
                "sendInitialEvents" => params.send_initial_events = parse_bool(name, value)?,
                "resourceVersion" if !value.is_empty() => {
                    params.resource_version = Some(value.into())
                }
                "timeoutSeconds" => {
                    let seconds: u64 = parse_number(name, value)?;
                    params.timeout = Some(Duration::from_secs(seconds));
                }
                "limit" => params.limit = Some(parse_number(name, value)?).filter(|l| *l > 0),
                "continue" if !value.is_empty() => params.continue_token = Some(value.into()),
                "labelSelector" => params.labels = LabelSelector::parse(value)?,
                "fieldSelector" => params.fields = FieldSelector::parse(value)?,
                _ => {}
            }
        }
        Ok(params)
    }

    /// The resourceVersion a watch starts after, or `None` for "now, with the current
    /// objects first".
    fn watch_start(&self) -> Result<Option<u64>, String> {
        match self.resource_version.as_deref() {
            None | Some("0") => Ok(None),
            Some(rv) => parse_number("resourceVersion", rv).map(Some),
        }
    }
}

fn parse_bool(name: &str, value: &str) -> Result<bool, String> {
    match value.to_ascii_lowercase().as_str() {
        "true" | "1" | "t" => Ok(true),
        "" | "false" | "0" | "f" => Ok(false),
        _ => Err(format!("invalid {name}: {value:?}")),
    }
}

fn parse_number<T: std::str::FromStr>(name: &str, value: &str) -> Result<T, String> {
    value
        .parse()
        .map_err(|_| format!("invalid {name}: {value:?}"))
}

fn labels_of(object: &Value) -> Option<&Map<String, Value>> {
    object
        .pointer("/metadata/labels")
        .and_then(Value::as_object)
}

/// One requirement of a label selector.
enum Requirement {
    Exists(String),
    NotExists(String),
    In(String, Vec<String>),
    NotIn(String, Vec<String>),
}

impl Requirement {
    fn parse(text: &str) -> Result<Requirement, String> {
        let invalid = || format!("invalid label selector requirement {text:?}");
        let key = |k: &str| {
            let k = k.trim();
            let ok = !k.is_empty()
                && k.chars()
                    .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.' | '/'));
            ok.then(|| k.to_string()).ok_or_else(invalid)
        };
        let value = |v: &str| {
            let v = v.trim();
            v.chars()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
                .then(|| v.to_string())
                .ok_or_else(invalid)
        };
        let text = text.trim();
        if let Some(k) = text.strip_prefix('!') {
            return Ok(Requirement::NotExists(key(k)?));
        }
        if let Some((head, set)) = text.split_once('(') {
            let set = set.strip_suffix(')').ok_or_else(invalid)?;
            let values = set.split(',').map(value).collect::<Result<Vec<_>, _>>()?;
            return match head.split_whitespace().collect::<Vec<_>>().as_slice() {
                [k, "in"] => Ok(Requirement::In(key(k)?, values)),
                [k, "notin"] => Ok(Requirement::NotIn(key(k)?, values)),
                _ => Err(invalid()),
            };
        }
        if let Some((k, v)) = text.split_once("!=") {
            return Ok(Requirement::NotIn(key(k)?, vec![value(v)?]));
        }
        if let Some((k, v)) = text.split_once("==").or_else(|| text.split_once('=')) {
            return Ok(Requirement::In(key(k)?, vec![value(v)?]));
        }
        Ok(Requirement::Exists(key(text)?))
    }

    fn matches(&self, labels: Option<&Map<String, Value>>) -> bool {
        let get = |k: &str| labels.and_then(|l| l.get(k)).and_then(Value::as_str);
        match self {
            Requirement::Exists(k) => get(k).is_some(),
            Requirement::NotExists(k) => get(k).is_none(),
            Requirement::In(k, values) => get(k).is_some_and(|v| values.iter().any(|x| x == v)),
            Requirement::NotIn(k, values) => get(k).is_none_or(|v| values.iter().all(|x| x != v)),
        }
    }
}

/// A label selector: `key`, `!key`, `key=value`, `key==value`, `key!=value`,
/// `key in (a,b)`, `key notin (a,b)`, joined by commas (all must hold).
#[derive(Default)]
struct LabelSelector(Vec<Requirement>);

impl LabelSelector {
    fn parse(text: &str) -> Result<LabelSelector, String> {
        if text.trim().is_empty() {
            return Ok(LabelSelector::default());
        }
        // Split at the commas outside parentheses.
        let (mut parts, mut start, mut depth) = (Vec::new(), 0, 0i32);
        for (i, c) in text.char_indices() {
            match c {
                '(' => depth += 1,
                ')' => depth -= 1,
                ',' if depth == 0 => {
                    parts.push(&text[start..i]);
                    start = i + 1;
                }
                _ => {}
            }
        }
        parts.push(&text[start..]);
        parts
            .into_iter()
            .map(Requirement::parse)
            .collect::<Result<_, _>>()
            .map(LabelSelector)
    }

    fn matches(&self, object: &Value) -> bool {
        let labels = labels_of(object);
        self.0.iter().all(|r| r.matches(labels))
    }
}

/// A field selector: `path=value`, `path==value`, `path!=value` joined by commas, where
/// `path` is any dotted path into the object (`metadata.name`, `status.phase`).
#[derive(Default)]
struct FieldSelector(Vec<(String, bool, String)>);

impl FieldSelector {
    fn parse(text: &str) -> Result<FieldSelector, String> {
        if text.trim().is_empty() {
            return Ok(FieldSelector::default());
        }
        text.split(',')
            .map(|part| {
                let (path, equal, value) = if let Some((p, v)) = part.split_once("!=") {
                    (p, false, v)
                } else if let Some((p, v)) = part.split_once("==").or_else(|| part.split_once('='))
                {
                    (p, true, v)
                } else {
                    return Err(format!("invalid field selector requirement {part:?}"));
                };
                let pointer = format!("/{}", path.trim().replace('.', "/"));
                Ok((pointer, equal, value.trim().to_string()))
            })
            .collect::<Result<_, _>>()
            .map(FieldSelector)
    }

    fn matches(&self, object: &Value) -> bool {
        self.0.iter().all(|(pointer, equal, expected)| {
            let actual = match object.pointer(pointer) {
                None | Some(Value::Null) => String::new(),
                Some(Value::String(s)) => s.clone(),
                Some(other) => other.to_string(),
            };
            (actual == *expected) == *equal
        })
    }
}

fn get(shared: &Shared, target: &Target, name: &str) -> Response {
    let key = ObjectKey {
        resource: target.resource.clone(),
        namespace: target.namespace.clone().unwrap_or_default(),
        name: name.to_string(),
    };
    if let Some(object) = lock(&shared.store).objects.get(&key) {
        return axum::Json(object.clone()).into_response();
    }
    let resource = &target.resource;
    let mut body = status_object(
        StatusCode::NOT_FOUND,
        "NotFound",
        format!("{} \"{name}\" not found", resource.plural),
    );
    body["details"] = json!({"name": name, "group": resource.group, "kind": resource.plural});
    (StatusCode::NOT_FOUND, axum::Json(body)).into_response()
}

fn list(shared: &Shared, target: &Target, kind: &str, params: &Params) -> Response {
    shared.count(&target.resource.plural, |c| c.lists += 1);
    let store = lock(&shared.store);
    // A continue token is "<list resourceVersion>/<namespace>/<name of the last item>".
    let (list_rv, after) = match &params.continue_token {
        None => (store.rv, None),
        Some(token) => {
            let mut parts = token.splitn(3, '/');
            let (Some(rv), Some(namespace), Some(name)) =
                (parts.next(), parts.next(), parts.next())
            else {
                return bad_request(format!("invalid continue token {token:?}"));
            };
            let Ok(rv) = rv.parse::<u64>() else {
                return bad_request(format!("invalid continue token {token:?}"));
            };
            if rv < store.compacted {
                return status(
                    StatusCode::GONE,
                    "Expired",
                    "The provided continue parameter is too old to display a consistent list result. \
                     You can start a new list without the continue parameter.",
                );
            }
            (rv, Some((namespace.to_string(), name.to_string())))
        }
    };
    let mut matching = store
        .objects
        .iter()
        .filter(|(key, object)| {
            target.contains(key) && params.labels.matches(object) && params.fields.matches(object)
        })
        .filter(|(key, _)| {
            after
                .as_ref()
                .is_none_or(|(ns, name)| (&key.namespace, &key.name) > (ns, name))
        })
        .peekable();
    // The real server answers resourceVersion=0 from its cache, in one page.
    let limit = params
        .limit
        .filter(|_| params.resource_version.as_deref() != Some("0"))
        .unwrap_or(usize::MAX);
    let mut items = Vec::new();
    let mut last = None;
    while items.len() < limit {
        let Some((key, object)) = matching.next() else {
            break;
        };
        items.push(object.clone());
        last = Some(key);
    }
    let mut metadata = json!({"resourceVersion": list_rv.to_string()});
    if let (Some(last), Some(_)) = (last, matching.peek()) {
        metadata["continue"] = format!("{list_rv}/{}/{}", last.namespace, last.name).into();
        metadata["remainingItemCount"] = matching.count().into();
    }
    axum::Json(json!({
        "apiVersion": target.resource.api_version(),
        "kind": format!("{kind}List"),
        "metadata": metadata,
        "items": items,
    }))
    .into_response()
}

fn json_line(value: &Value) -> Vec<u8> {
    let mut line = serde_json::to_vec(value).expect("serializing a watch event");
    line.push(b'\n');
    line
}

/// The 410 event the real server sends to a watch from a compacted resourceVersion.
fn gone_line(requested: u64, oldest: u64) -> Vec<u8> {
    json_line(&json!({
        "type": "ERROR",
        "object": status_object(
            StatusCode::GONE,
            "Expired",
            format!("too old resource version: {requested} ({oldest})"),
        ),
    }))
}

fn watch_response(body: Body) -> Response {
    Response::builder()
        .status(StatusCode::OK)
        .header(header::CONTENT_TYPE, "application/json")
        .body(body)
        .expect("watch response")
}

fn start_watch(shared: &Arc<Shared>, target: Target, kind: String, params: Params) -> Response {
    let plural = target.resource.plural.clone();
    shared.count(&plural, |c| c.watches += 1);
    let start = match params.watch_start() {
        Ok(start) => start,
        Err(message) => return bad_request(message),
    };
    let dropped = lock(&shared.drop_watches).clone();
    if shared.unavailable.load(Ordering::SeqCst) {
        // Went down after this request was let in, but perhaps before `dropped` was taken.
        return unavailable();
    }
    let mut changed = shared.changed.subscribe();
    changed.borrow_and_update();
    let store = lock(&shared.store);
    if let Some(rv) = start.filter(|rv| *rv < store.compacted) {
        return watch_response(Body::from(gone_line(rv, store.compacted)));
    }
    let mut watch = Watch {
        shared: shared.clone(),
        api_version: target.resource.api_version(),
        target,
        kind,
        labels: params.labels,
        fields: params.fields,
        cursor: start.unwrap_or(store.rv),
        bookmarks: params.bookmarks,
        deadline: Instant::now() + params.timeout.unwrap_or(DEFAULT_WATCH_TIMEOUT),
        next_bookmark: Instant::now() + BOOKMARK_INTERVAL,
        changed,
        dropped,
        first: Vec::new(),
        finished: false,
        _open: OpenWatch::new(shared.clone(), plural),
    };
    if start.is_none() || params.send_initial_events {
        watch.cursor = store.rv;
        for (key, object) in &store.objects {
            if watch.selects(key, object) {
                let added = json_line(&json!({"type": "ADDED", "object": object}));
                watch.first.extend(added);
            }
        }
        if params.send_initial_events {
            let end = watch.bookmark(true);
            watch.first.extend(end);
        }
    }
    drop(store);
    let stream = futures::stream::unfold(watch, |mut watch| async move {
        let chunk = watch.next_chunk().await?;
        Some((chunk, watch))
    });
    watch_response(Body::from_stream(stream))
}

/// Counts a watch as open until its response body is dropped.
struct OpenWatch {
    shared: Arc<Shared>,
    plural: String,
}

impl OpenWatch {
    fn new(shared: Arc<Shared>, plural: String) -> OpenWatch {
        shared.count(&plural, |c| c.open_watches += 1);
        OpenWatch { shared, plural }
    }
}

impl Drop for OpenWatch {
    fn drop(&mut self) {
        self.shared.count(&self.plural, |c| c.open_watches -= 1);
    }
}

/// One watch response in progress.
struct Watch {
    shared: Arc<Shared>,
    target: Target,
    api_version: String,
    kind: String,
    labels: LabelSelector,
    fields: FieldSelector,
    /// Every event up to this resourceVersion has been sent (or skipped).
    cursor: u64,
    bookmarks: bool,
    deadline: Instant,
    next_bookmark: Instant,
    changed: watch::Receiver<u64>,
    dropped: CancellationToken,
    /// Sent before anything else: initial events, or nothing.
    first: Vec<u8>,
    finished: bool,
    _open: OpenWatch,
}

impl Watch {
    fn selects(&self, key: &ObjectKey, object: &Value) -> bool {
        self.target.contains(key) && self.labels.matches(object) && self.fields.matches(object)
    }

    /// What this watch sees of an event: its type and object, or nothing.
    fn translate<'e>(&self, event: &'e Event) -> Option<(&'static str, &'e Value)> {
        if !self.target.contains(&event.key) {
            return None;
        }
        let now = self.labels.matches(&event.object) && self.fields.matches(&event.object);
        let before = event
            .previous
            .as_ref()
            .map(|p| self.labels.matches(p) && self.fields.matches(p));
        let kind = match (event.kind, before, now) {
            (EventType::Modified, Some(false), true) => EventType::Added,
            (EventType::Modified, Some(true), false) => EventType::Deleted,
            (_, _, false) => return None,
            (kind, _, true) => kind,
        };
        Some((kind.as_str(), &event.object))
    }

    /// A bookmark at the cursor; `initial_events_end` marks the end of a streaming list.
    fn bookmark(&self, initial_events_end: bool) -> Vec<u8> {
        let mut metadata = json!({"resourceVersion": self.cursor.to_string()});
        if initial_events_end {
            metadata["annotations"] = json!({"k8s.io/initial-events-end": "true"});
        }
        json_line(&json!({
            "type": "BOOKMARK",
            "object": {"apiVersion": self.api_version, "kind": self.kind, "metadata": metadata},
        }))
    }

    /// The events after the cursor, or the 410 event if some of them were forgotten.
    fn collect(&mut self) -> Vec<u8> {
        let store = lock(&self.shared.store);
        if self.cursor < store.compacted {
            self.finished = true;
            return gone_line(self.cursor, store.compacted);
        }
        let first_new = store.history.partition_point(|e| e.rv <= self.cursor);
        let mut lines = Vec::new();
        for event in &store.history[first_new..] {
            if let Some((kind, object)) = self.translate(event) {
                lines.extend(json_line(&json!({"type": kind, "object": object})));
            }
        }
        self.cursor = self.cursor.max(store.rv);
        lines
    }

    async fn next_chunk(&mut self) -> Option<Result<Bytes, io::Error>> {
        if !self.first.is_empty() {
            return Some(Ok(std::mem::take(&mut self.first).into()));
        }
        while !self.finished {
            self.changed.borrow_and_update();
            let lines = self.collect();
            if !lines.is_empty() {
                return Some(Ok(lines.into()));
            }
            tokio::select! {
                biased;
                _ = self.dropped.cancelled() => {
                    self.finished = true;
                    return Some(Err(io::Error::other("watch dropped by the fake API server")));
                }
                _ = sleep_until(self.deadline) => {
                    self.finished = true;
                    if self.bookmarks {
                        return Some(Ok(self.bookmark(false).into()));
                    }
                }
                _ = sleep_until(self.next_bookmark), if self.bookmarks => {
                    self.next_bookmark = Instant::now() + BOOKMARK_INTERVAL;
                    return Some(Ok(self.bookmark(false).into()));
                }
                changed = self.changed.changed() => {
                    if changed.is_err() {
                        self.finished = true;
                    }
                }
            }
        }
        None
    }
}
