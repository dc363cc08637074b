//! The fake Kubernetes API server against the real kube-rs client: lists, the watcher's
//! list-then-watch cycle, and its recovery from dropped watches, 410 Gone and an outage.

use std::collections::BTreeMap;
use std::fmt::Debug;
use std::time::{Duration, Instant};

use futures::stream::BoxStream;
use futures::{Stream, StreamExt};
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, ApiResource, DynamicObject, GroupVersionKind, ListParams};
use kube::runtime::watcher::Event;
use kube::runtime::{watcher, WatchStreamExt};
use kube::{Resource, ResourceExt};
use serde_json::{json, Value};
use support::fake_apiserver::FakeApiServer;
use support::{eventually, http_get, project_root};
use tokio_stream::wrappers::UnboundedReceiverStream;

const DEADLINE: Duration = Duration::from_secs(15);

fn pod(name: &str, labels: Value) -> Value {
    json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": "default", "labels": labels},
        "spec": {"containers": [{"name": "ray", "image": "rayproject/ray:2.52.0"}]},
        "status": {"phase": "Running", "podIP": "10.0.0.1"},
    })
}

fn rayservice(name: &str) -> Value {
    json!({
        "apiVersion": "ray.io/v1",
        "kind": "RayService",
        "metadata": {"name": name, "namespace": "ray"},
        "spec": {"serveConfigV2": "applications: []"},
    })
}

fn rayservice_resource() -> ApiResource {
    ApiResource::from_gvk_with_plural(
        &GroupVersionKind::gvk("ray.io", "v1", "RayService"),
        "rayservices",
    )
}

type Events<K> = BoxStream<'static, watcher::Result<Event<K>>>;

/// Aborts a task when dropped.
struct AbortOnDrop(tokio::task::AbortHandle);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Runs a watcher in its own task, as the Kubernetes source does, so that it reconnects
/// while the test is busy elsewhere; the task stops when the returned stream is dropped.
fn run<K, S>(stream: S) -> Events<K>
where
    K: Send + 'static,
    S: Stream<Item = watcher::Result<Event<K>>> + Send + 'static,
{
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    let task = tokio::spawn(async move {
        let mut stream = std::pin::pin!(stream);
        while let Some(item) = stream.next().await {
            if tx.send(item).is_err() {
                break;
            }
        }
    });
    let guard = AbortOnDrop(task.abort_handle());
    UnboundedReceiverStream::new(rx)
        .map(move |item| {
            let _running = &guard;
            item
        })
        .boxed()
}

fn pod_watcher(server: &FakeApiServer, config: watcher::Config) -> Events<Pod> {
    let api = Api::<Pod>::namespaced(server.client(), "default");
    run(watcher(api, config).default_backoff())
}

fn dynamic_watcher(api: Api<DynamicObject>) -> Events<DynamicObject> {
    run(watcher(api, watcher::Config::default()).default_backoff())
}

async fn next<K>(events: &mut Events<K>) -> watcher::Result<Event<K>> {
    tokio::time::timeout(DEADLINE, events.next())
        .await
        .expect("timed out waiting for a watcher event")
        .expect("the watcher stream ended")
}

/// The watcher's next event, which must not be an error.
async fn next_ok<K>(events: &mut Events<K>) -> Event<K> {
    next(events).await.expect("watcher error")
}

fn applied<K: Debug>(event: Event<K>) -> K {
    match event {
        Event::Apply(object) => object,
        other => panic!("expected Apply, got {other:?}"),
    }
}

/// What a consumer of a watcher knows: the objects by name, rebuilt on every (re)list, and
/// the errors seen on the way.
struct Mirror<K> {
    objects: BTreeMap<String, K>,
    relisting: Option<BTreeMap<String, K>>,
    errors: Vec<String>,
    relists: usize,
}

impl<K: Resource> Mirror<K> {
    fn new() -> Mirror<K> {
        Mirror {
            objects: BTreeMap::new(),
            relisting: None,
            errors: Vec::new(),
            relists: 0,
        }
    }

    fn update(&mut self, item: watcher::Result<Event<K>>) {
        match item {
            Ok(Event::Init) => self.relisting = Some(BTreeMap::new()),
            Ok(Event::InitApply(object)) => {
                if let Some(relisting) = &mut self.relisting {
                    relisting.insert(object.name_any(), object);
                }
            }
            Ok(Event::InitDone) => {
                self.objects = self.relisting.take().unwrap_or_default();
                self.relists += 1;
            }
            Ok(Event::Apply(object)) => {
                self.objects.insert(object.name_any(), object);
            }
            Ok(Event::Delete(object)) => {
                self.objects.remove(&object.name_any());
            }
            Err(error) => self.errors.push(error.to_string()),
        }
    }

    fn names(&self) -> Vec<String> {
        self.objects.keys().cloned().collect()
    }

    /// Feeds events until `done` holds.
    async fn until(&mut self, events: &mut Events<K>, what: &str, done: impl Fn(&Self) -> bool)
    where
        K: Debug,
    {
        let start = Instant::now();
        while !done(self) {
            let left = DEADLINE.saturating_sub(start.elapsed());
            match tokio::time::timeout(left, events.next()).await {
                Ok(Some(item)) => self.update(item),
                Ok(None) => panic!("the watcher stream ended while waiting for: {what}"),
                Err(_) => panic!(
                    "timed out waiting for: {what}; have {:?}, errors {:?}",
                    self.names(),
                    self.errors
                ),
            }
        }
    }

    /// Feeds events for a while.
    async fn run_for(&mut self, events: &mut Events<K>, duration: Duration) {
        let _ = tokio::time::timeout(duration, async {
            while let Some(item) = events.next().await {
                self.update(item);
            }
        })
        .await;
    }
}

#[tokio::test]
async fn typed_list_honours_label_and_field_selectors() {
    let server = FakeApiServer::start().await;
    server.apply(pod(
        "head",
        json!({"ray.io/node-type": "head", "ray.io/cluster": "a"}),
    ));
    server.apply(pod(
        "worker-1",
        json!({"ray.io/node-type": "worker", "ray.io/cluster": "a"}),
    ));
    server.apply(pod(
        "worker-2",
        json!({"ray.io/node-type": "worker", "ray.io/cluster": "b"}),
    ));
    let mut elsewhere = pod(
        "other",
        json!({"ray.io/node-type": "worker", "ray.io/cluster": "a"}),
    );
    elsewhere["metadata"]["namespace"] = "other".into();
    server.apply(elsewhere);

    let pods = Api::<Pod>::namespaced(server.client(), "default");
    let names = |list: kube::core::ObjectList<Pod>| -> Vec<String> {
        list.items.iter().map(|p| p.name_any()).collect()
    };
    let list = pods
        .list(&ListParams::default().labels("ray.io/node-type=worker"))
        .await
        .unwrap();
    let rv = list
        .metadata
        .resource_version
        .clone()
        .expect("a list has a resourceVersion");
    assert_eq!(rv, server.resource_version().to_string());
    assert_eq!(names(list), ["worker-1", "worker-2"]);

    let cases = [
        (
            "ray.io/node-type==worker,ray.io/cluster=a",
            vec!["worker-1"],
        ),
        ("ray.io/node-type!=worker", vec!["head"]),
        (
            "ray.io/cluster in (a, b),ray.io/node-type notin (head)",
            vec!["worker-1", "worker-2"],
        ),
        ("ray.io/cluster", vec!["head", "worker-1", "worker-2"]),
        ("!ray.io/cluster", vec![]),
    ];
    for (selector, expected) in cases {
        let list = pods
            .list(&ListParams::default().labels(selector))
            .await
            .unwrap();
        assert_eq!(names(list), expected, "labelSelector {selector}");
    }
    let list = pods
        .list(&ListParams::default().fields("metadata.name=head"))
        .await
        .unwrap();
    assert_eq!(names(list), ["head"]);

    let all = Api::<Pod>::all(server.client());
    let list = all.list(&ListParams::default()).await.unwrap();
    assert_eq!(names(list), ["head", "worker-1", "worker-2", "other"]);

    // Pages of two, as the watcher would page with its limit of 500.
    let first = all.list(&ListParams::default().limit(2)).await.unwrap();
    let token = first.metadata.continue_.clone().expect("a continue token");
    assert_eq!(names(first), ["head", "worker-1"]);
    let second = all
        .list(&ListParams::default().limit(2).continue_token(&token))
        .await
        .unwrap();
    assert_eq!(second.metadata.continue_, None);
    assert_eq!(second.metadata.resource_version, Some(rv));
    assert_eq!(names(second), ["worker-2", "other"]);

    let head = pods.get("head").await.unwrap();
    assert!(head.metadata.uid.is_some() && head.metadata.creation_timestamp.is_some());
    match pods.get("absent").await {
        Err(kube::Error::Api(status)) => {
            assert_eq!((status.code, status.reason.as_str()), (404, "NotFound"))
        }
        other => panic!("expected 404, got {other:?}"),
    }
    assert_eq!(server.lists("pods"), 10);
}

#[tokio::test]
async fn pod_watcher_sees_initial_state_then_changes() {
    let server = FakeApiServer::start().await;
    server.apply(pod("b", json!({})));
    server.apply(pod("a", json!({})));
    let mut events = pod_watcher(&server, watcher::Config::default());

    assert!(matches!(next_ok(&mut events).await, Event::Init));
    let initial: Vec<String> = [next_ok(&mut events).await, next_ok(&mut events).await]
        .into_iter()
        .map(|e| match e {
            Event::InitApply(p) => p.name_any(),
            other => panic!("expected InitApply, got {other:?}"),
        })
        .collect();
    assert_eq!(initial, ["a", "b"]);
    assert!(matches!(next_ok(&mut events).await, Event::InitDone));

    server.apply(pod("c", json!({})));
    assert_eq!(applied(next_ok(&mut events).await).name_any(), "c");

    server.begin_delete("v1", "Pod", "default", "a").unwrap();
    let dying = applied(next_ok(&mut events).await);
    assert_eq!(dying.name_any(), "a");
    assert!(dying.metadata.deletion_timestamp.is_some());
    assert_eq!(dying.metadata.deletion_grace_period_seconds, Some(30));

    let last_rv =
        server.delete("v1", "Pod", "default", "a").unwrap()["metadata"]["resourceVersion"].clone();
    match next_ok(&mut events).await {
        Event::Delete(p) => {
            assert_eq!(p.name_any(), "a");
            assert_eq!(
                Some(last_rv.as_str().unwrap().to_string()),
                p.resource_version()
            );
        }
        other => panic!("expected Delete, got {other:?}"),
    }
    assert_eq!((server.lists("pods"), server.watches("pods")), (1, 1));
    assert_eq!(server.open_watches("pods"), 1);
    eprintln!("requests kube-rs sent: {:#?}", server.requests());
}

#[tokio::test]
async fn dynamic_rayservice_watcher_across_namespaces() {
    let server = FakeApiServer::start().await;
    server.apply(rayservice("one"));
    let api = Api::<DynamicObject>::all_with(server.client(), &rayservice_resource());
    let mut events = dynamic_watcher(api);

    assert!(matches!(next_ok(&mut events).await, Event::Init));
    match next_ok(&mut events).await {
        Event::InitApply(rs) => {
            assert_eq!(
                (rs.name_any(), rs.namespace()),
                ("one".into(), Some("ray".into()))
            );
            assert_eq!(rs.data["spec"]["serveConfigV2"], "applications: []");
            assert_eq!(rs.types.unwrap().kind, "RayService");
        }
        other => panic!("expected InitApply, got {other:?}"),
    }
    assert!(matches!(next_ok(&mut events).await, Event::InitDone));

    let mut two = rayservice("two");
    two["metadata"]["namespace"] = "elsewhere".into();
    server.apply(two);
    let rs = applied(next_ok(&mut events).await);
    assert_eq!(
        (rs.name_any(), rs.namespace()),
        ("two".into(), Some("elsewhere".into()))
    );

    server.begin_delete("ray.io/v1", "RayService", "ray", "one");
    assert!(applied(next_ok(&mut events).await)
        .metadata
        .deletion_timestamp
        .is_some());
    server.delete("ray.io/v1", "RayService", "ray", "one");
    assert!(matches!(next_ok(&mut events).await, Event::Delete(rs) if rs.name_any() == "one"));
    assert_eq!(server.watches("rayservices"), 1);
    assert_eq!(server.lists("pods"), 0);
}

#[tokio::test]
async fn watch_label_selector_deletes_objects_that_stop_matching() {
    let server = FakeApiServer::start().await;
    server.apply(pod("a", json!({"app": "ray"})));
    let mut events = pod_watcher(&server, watcher::Config::default().labels("app=ray"));
    let mut mirror = Mirror::new();
    mirror
        .until(&mut events, "initial list", |m| m.relists == 1)
        .await;
    assert_eq!(mirror.names(), ["a"]);

    server.apply(pod("other", json!({"app": "web"})));
    server.apply(pod("a", json!({"app": "web"})));
    assert!(matches!(next_ok(&mut events).await, Event::Delete(p) if p.name_any() == "a"));
    server.apply(pod("other", json!({"app": "ray"})));
    assert_eq!(applied(next_ok(&mut events).await).name_any(), "other");
}

#[tokio::test]
async fn watcher_reconnects_after_watches_are_dropped() {
    let server = FakeApiServer::start().await;
    server.apply(pod("a", json!({})));
    let mut events = pod_watcher(&server, watcher::Config::default());
    let mut mirror = Mirror::new();
    mirror
        .until(&mut events, "initial list", |m| m.relists == 1)
        .await;
    eventually("the watch is open", DEADLINE, || async {
        (server.open_watches("pods") == 1).then_some(())
    })
    .await;

    server.drop_watches();
    server.apply(pod("b", json!({})));
    mirror
        .until(&mut events, "b after the reconnect", |m| {
            m.objects.contains_key("b")
        })
        .await;
    server.delete("v1", "Pod", "default", "a");
    mirror
        .until(&mut events, "a deleted", |m| !m.objects.contains_key("a"))
        .await;

    eprintln!(
        "watcher errors around the dropped watch: {:?}",
        mirror.errors
    );
    assert!(
        server.watches("pods") >= 2,
        "watches: {}",
        server.watches("pods")
    );
    // The history was kept, so the watcher resumed without listing again.
    assert_eq!((server.lists("pods"), mirror.relists), (1, 1));
    assert_eq!(mirror.names(), ["b"]);

    drop(events);
    eventually("the server notices the closed watch", DEADLINE, || async {
        (server.open_watches("pods") == 0).then_some(())
    })
    .await;
}

#[tokio::test]
async fn watcher_relists_after_410_gone() {
    let server = FakeApiServer::start().await;
    server.apply(pod("a", json!({})));
    server.apply(pod("b", json!({})));
    let mut events = pod_watcher(&server, watcher::Config::default());
    let mut mirror = Mirror::new();
    mirror
        .until(&mut events, "initial list", |m| m.relists == 1)
        .await;

    // Changes the watcher has not read yet, then the history is compacted away: resuming
    // from the watcher's resourceVersion is impossible.
    server.apply(pod("c", json!({})));
    server.delete("v1", "Pod", "default", "a");
    server.expire_history();
    server.drop_watches();

    mirror
        .until(&mut events, "the relist", |m| m.relists == 2)
        .await;
    assert_eq!(mirror.names(), ["b", "c"]);
    assert!(
        mirror
            .errors
            .iter()
            .any(|e| e.contains("410") || e.contains("too old resource version")),
        "errors: {:?}",
        mirror.errors
    );
    assert_eq!(server.lists("pods"), 2);

    server.apply(pod("d", json!({})));
    mirror
        .until(&mut events, "d after the relist", |m| {
            m.objects.contains_key("d")
        })
        .await;
}

#[tokio::test]
async fn watcher_recovers_from_an_outage() {
    let server = FakeApiServer::start().await;
    server.apply(pod("a", json!({})));
    let mut events = pod_watcher(&server, watcher::Config::default());
    let mut mirror = Mirror::new();
    mirror
        .until(&mut events, "initial list", |m| m.relists == 1)
        .await;

    server.set_unavailable(true);
    server.apply(pod("b", json!({})));
    mirror
        .run_for(&mut events, Duration::from_millis(1500))
        .await;
    assert!(
        !mirror.errors.is_empty(),
        "the outage should surface as watcher errors"
    );
    assert!(
        mirror
            .errors
            .iter()
            .any(|e| e.contains("503") || e.contains("unavailable")),
        "{:?}",
        mirror.errors
    );
    assert_eq!(server.open_watches("pods"), 0);

    server.set_unavailable(false);
    mirror
        .until(&mut events, "b after the outage", |m| {
            m.objects.contains_key("b")
        })
        .await;
    assert_eq!(mirror.names(), ["a", "b"]);
}

/// A Pod whose `spec` is a string: a typed `Api<Pod>` cannot decode it, so one such object
/// fails every list of its namespace (and the event carrying it), while `DynamicObject`
/// carries it through. This is why the Kubernetes source decodes `DynamicObject`s itself.
#[tokio::test]
async fn malformed_object_breaks_typed_watchers_but_not_dynamic_ones() {
    let server = FakeApiServer::start().await;
    server.apply(pod("good", json!({})));
    let malformed = json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "bad", "namespace": "default"},
        "spec": "not a pod spec",
    });

    // A typed watcher that is already watching gets an error for the event and goes on.
    let mut typed = pod_watcher(&server, watcher::Config::default());
    let mut mirror = Mirror::new();
    mirror
        .until(&mut typed, "initial list", |m| m.relists == 1)
        .await;
    server.apply_raw("v1", "Pod", "default", "bad", malformed.clone());
    let error = next(&mut typed)
        .await
        .expect_err("a typed watcher cannot decode the event");
    eprintln!("typed watcher, malformed watch event: {error}");
    assert!(
        matches!(
            error,
            watcher::Error::WatchFailed(kube::Error::SerdeError(_))
        ),
        "{error:?}"
    );
    server.apply(pod("later", json!({})));
    assert_eq!(applied(next_ok(&mut typed).await).name_any(), "later");

    // A typed watcher that starts now cannot even list.
    let mut fresh = pod_watcher(&server, watcher::Config::default());
    assert!(matches!(next_ok(&mut fresh).await, Event::Init));
    let error = next(&mut fresh)
        .await
        .expect_err("a typed list cannot decode the object");
    eprintln!("typed watcher, malformed list item: {error}");
    assert!(
        matches!(
            error,
            watcher::Error::InitialListFailed(kube::Error::SerdeError(_))
        ),
        "{error:?}"
    );

    // A DynamicObject watcher lists and watches it like any other.
    let api = Api::<DynamicObject>::namespaced_with(
        server.client(),
        "default",
        &ApiResource::erase::<Pod>(&()),
    );
    let mut dynamic = dynamic_watcher(api);
    let mut mirror = Mirror::new();
    mirror
        .until(&mut dynamic, "initial list", |m| m.relists == 1)
        .await;
    assert_eq!(mirror.names(), ["bad", "good", "later"]);
    assert_eq!(mirror.objects["bad"].data["spec"], "not a pod spec");
    server.apply_raw(
        "v1",
        "Pod",
        "default",
        "bad",
        json!({
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": "bad", "namespace": "default"},
            "spec": 42,
        }),
    );
    let bad = applied(next_ok(&mut dynamic).await);
    assert_eq!(bad.data["spec"], 42);
}

#[tokio::test]
async fn kuberay_sample_reads_back_as_dynamic_object() {
    let server = FakeApiServer::start().await;
    let yaml = std::fs::read_to_string(
        project_root().join("tests/fixtures/kuberay-1.7/ray-service.sample.yaml"),
    )
    .unwrap();
    let stored = server.apply_yaml(&yaml);
    assert_eq!(stored.len(), 1);
    assert_eq!(stored[0]["metadata"]["namespace"], "default");

    let api =
        Api::<DynamicObject>::namespaced_with(server.client(), "default", &rayservice_resource());
    let rs = api.get("rayservice-sample").await.unwrap();
    assert_eq!(
        rs.metadata.resource_version,
        stored[0]["metadata"]["resourceVersion"]
            .as_str()
            .map(String::from)
    );
    assert_eq!(rs.data["spec"]["rayClusterConfig"]["rayVersion"], "2.52.0");
    assert!(rs.data["spec"]["serveConfigV2"]
        .as_str()
        .unwrap()
        .contains("route_prefix: /fruit"));
    assert_eq!(
        api.list(&ListParams::default()).await.unwrap().items.len(),
        1
    );
}

/// The wire format itself, for what the watcher hides: bookmarks, the end of a watch at
/// `timeoutSeconds`, the 410 event, and Status errors.
#[tokio::test]
async fn wire_format() {
    let server = FakeApiServer::start().await;
    server.apply(pod("a", json!({})));
    let rv = server.resource_version();
    let url = server.url();
    let lines = |body: &str| -> Vec<Value> {
        body.lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect()
    };

    // From the current version: nothing but bookmarks, the last just before the end.
    let watch = format!("{url}/api/v1/namespaces/default/pods?watch=1&timeoutSeconds=2&allowWatchBookmarks=true&resourceVersion={rv}");
    let (status, body) = http_get(&watch).await.unwrap();
    assert_eq!(status, 200);
    let events = lines(&body);
    assert!(events.len() >= 2, "{body}");
    for event in &events {
        assert_eq!(event["type"], "BOOKMARK");
        assert_eq!(
            event["object"],
            json!({"apiVersion": "v1", "kind": "Pod", "metadata": {"resourceVersion": rv.to_string()}})
        );
    }

    // Without a version: the current objects as ADDED.
    let (_, body) = http_get(&format!("{url}/api/v1/pods?watch=true&timeoutSeconds=1"))
        .await
        .unwrap();
    let events = lines(&body);
    assert_eq!(events.len(), 1, "{body}");
    assert_eq!(
        (
            events[0]["type"].as_str(),
            events[0]["object"]["metadata"]["name"].as_str()
        ),
        (Some("ADDED"), Some("a"))
    );

    // A streaming list ends its initial events with a marked bookmark.
    let (_, body) = http_get(&format!(
        "{url}/api/v1/pods?watch=true&timeoutSeconds=1&sendInitialEvents=true&allowWatchBookmarks=true&resourceVersionMatch=NotOlderThan&resourceVersion="
    ))
    .await
    .unwrap();
    let events = lines(&body);
    assert_eq!(events[1]["type"], "BOOKMARK");
    assert_eq!(
        events[1]["object"]["metadata"]["annotations"]["k8s.io/initial-events-end"],
        "true"
    );

    server.apply(pod("b", json!({})));
    server.expire_history();
    let (status, body) = http_get(&format!(
        "{url}/api/v1/pods?watch=true&resourceVersion={rv}"
    ))
    .await
    .unwrap();
    assert_eq!(status, 200);
    let now = server.resource_version();
    assert_eq!(
        lines(&body),
        [json!({"type": "ERROR", "object": {
            "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
            "message": format!("too old resource version: {rv} ({now})"), "reason": "Expired", "code": 410,
        }})]
    );

    for (path, code) in [
        ("/nope", 404),
        ("/api/v1/widgets", 404),
        ("/api/v1/namespaces/default/pods/a/status", 404),
        ("/api/v1/pods?labelSelector=a%20in%20(", 400),
        ("/api/v1/pods?labelSelector=%3D%3D%3D", 400),
        ("/api/v1/pods?watch=maybe", 400),
        ("/api/v1/pods?limit=-1", 400),
        ("/api/v1/pods?continue=garbage", 400),
        ("/api/v1/pods?watch=true&resourceVersion=abc", 400),
        ("/api/v1/pods?%zz=%%", 200),
    ] {
        let (status, body) = http_get(&format!("{url}{path}")).await.unwrap();
        assert_eq!(status, code, "{path}: {body}");
        if code != 200 {
            let body: Value = serde_json::from_str(&body).unwrap();
            assert_eq!(
                (body["kind"].as_str(), body["code"].as_u64()),
                (Some("Status"), Some(code as u64)),
                "{path}"
            );
        }
    }

    server.set_unavailable(true);
    let (status, _) = http_get(&format!("{url}/api/v1/pods")).await.unwrap();
    assert_eq!(status, 503);
}
