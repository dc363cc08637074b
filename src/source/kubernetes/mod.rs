//! The Kubernetes source: watches RayServices (`ray.io/v1`) and Ray pods, and publishes
//! the [`Model`] they describe.
//!
//! - [`objects`]: the fields we read, decoded one object at a time (a malformed object is
//!   skipped alone; the rest of the list still counts);
//! - [`annotations`]: `ray-xds.io/*` overrides on a RayService;
//! - [`build`]: objects → model, pure, one RayService at a time;
//! - [`index`]: the objects and each RayService's part of the model, updated per object
//!   (apply, delete, reset) so that a change rebuilds only the RayServices it touches.
//!
//! This module is the IO around them: kube-rs watchers (list, then watch; on 410 Gone or a
//! dropped connection they re-list or resume, with back-off), one per resource and
//! namespace, merged into one task that is the single writer of the model channel and
//! of [`SourceStatus`]. ray-xds never writes to the cluster: it needs get/list/watch on
//! rayservices and pods, nothing else.
//!
//! Invariants: nothing is published until every watch has delivered its first full list
//! (an empty model from a half-listed cluster would withdraw every route); after that, a
//! failing watch keeps its last state, which keeps being served, and says so in the status.

pub mod annotations;
pub mod build;
pub mod index;
pub mod objects;

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use futures::stream::{BoxStream, SelectAll};
use futures::{FutureExt, StreamExt};
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, ApiResource, DynamicObject};
use kube::runtime::watcher::{self, watcher};
use kube::runtime::WatchStreamExt;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use self::objects::{PodObject, RayServiceObject, CLUSTER_LABEL};
use super::{SourceStatus, WatchState, WatchStatus};
use crate::config::KubernetesSourceConfig;
use crate::metrics::{Metrics, ObjectProblemLabels, ResourceLabels, SourceLabels};
use crate::model::Model;

/// `ray.io/v1` RayService.
pub(crate) fn rayservice_resource() -> ApiResource {
    ApiResource {
        group: "ray.io".into(),
        version: "v1".into(),
        api_version: "ray.io/v1".into(),
        kind: "RayService".into(),
        plural: "rayservices".into(),
    }
}

/// A client for the configured API server: `api_server` if set, else the kubeconfig or
/// the pod's service account ([`credentials`]).
pub(crate) async fn client(config: &KubernetesSourceConfig) -> anyhow::Result<kube::Client> {
    let (kube_config, _) = credentials(config).await?;
    client_of(kube_config)
}

/// Where the source's credentials come from, as `check` names it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum CredentialsFrom {
    /// `source.kubernetes.api_server`, without credentials (a proxy such as `kubectl proxy`).
    ApiServerSetting,
    /// `KUBECONFIG` or `~/.kube/config`.
    Kubeconfig,
    /// The pod's service account.
    InCluster,
}

/// The API server and credentials the source uses, read as `kube::Config::infer` reads
/// them (the kubeconfig first, then the pod's service account, then kube's
/// `KUBE_RS_DEBUG_*` overrides), without contacting anything or running an auth plugin.
pub(crate) async fn credentials(
    config: &KubernetesSourceConfig,
) -> anyhow::Result<(kube::Config, CredentialsFrom)> {
    use anyhow::Context;
    if let Some(url) = &config.api_server {
        let url = url
            .parse()
            .with_context(|| format!("source.kubernetes.api_server {url:?} is not a URL"))?;
        return Ok((kube::Config::new(url), CredentialsFrom::ApiServerSetting));
    }
    let (mut found, from) =
        match kube::Config::from_kubeconfig(&kube::config::KubeConfigOptions::default()).await {
            Ok(found) => (found, CredentialsFrom::Kubeconfig),
            Err(kubeconfig) => match kube::Config::incluster() {
                Ok(found) => (found, CredentialsFrom::InCluster),
                Err(in_cluster) => anyhow::bail!(
                    "Kubernetes source: no in-cluster service account ({:#}) and no usable \
                     kubeconfig ({:#})",
                    anyhow::Error::new(in_cluster),
                    anyhow::Error::new(kubeconfig)
                ),
            },
        };
    found.apply_debug_overrides();
    Ok((found, from))
}

/// The command a kubeconfig's credentials run to get a token (an `exec` plugin or an
/// auth provider's `cmd-path`), which building a client runs at once.
pub(crate) fn auth_command(kube_config: &kube::Config) -> Option<String> {
    let auth = &kube_config.auth_info;
    if let Some(exec) = &auth.exec {
        return Some(format!(
            "exec plugin {}",
            exec.command.as_deref().unwrap_or("(none named)")
        ));
    }
    auth.auth_provider
        .as_ref()
        .map(|p| format!("auth provider {}", p.name))
}

/// A client of `kube_config`: its certificates and keys parsed, and its auth plugin (if it
/// names one, [`auth_command`]) run for a first token; no request sent yet.
pub(crate) fn client_of(kube_config: kube::Config) -> anyhow::Result<kube::Client> {
    use anyhow::Context;
    kube::Client::try_from(kube_config).context("Kubernetes source: building the client")
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Resource {
    RayServices,
    Pods,
}

impl Resource {
    fn label(self) -> &'static str {
        match self {
            Resource::RayServices => "rayservices",
            Resource::Pods => "pods",
        }
    }
}

type Key = (String, String);

/// What a rebuild found: problems (message, metric reason), unrouted RayServices and
/// KubeRay's application statuses.
type Found = (Vec<(String, &'static str)>, Vec<String>, build::Hints);

/// A decoded object of either kind (each watch holds one kind).
#[derive(Clone, Debug, PartialEq)]
enum Object {
    RayService(RayServiceObject),
    Pod(PodObject),
}

/// One watch's objects and progress.
struct Watch {
    resource: Resource,
    status: WatchStatus,
    objects: BTreeMap<Key, Object>,
    /// During a (re-)list: what it has delivered so far.
    listing: Option<BTreeMap<Key, Object>>,
    /// Objects that failed to decode, by key, with why.
    malformed: BTreeMap<Key, String>,
    listing_malformed: BTreeMap<Key, String>,
}

#[derive(Clone)]
pub(crate) struct KubernetesSource {
    pub config: KubernetesSourceConfig,
    pub metrics: Arc<Metrics>,
}

impl KubernetesSource {
    pub async fn run(
        self,
        client: kube::Client,
        models: watch::Sender<Arc<Model>>,
        status: watch::Sender<Arc<SourceStatus>>,
        shutdown: CancellationToken,
    ) {
        let namespaces: Vec<Option<String>> = if self.config.namespaces.is_empty() {
            vec![None]
        } else {
            self.config.namespaces.iter().cloned().map(Some).collect()
        };
        let mut watches = Vec::new();
        let mut streams: SelectAll<BoxStream<'static, (usize, WatchItem)>> = SelectAll::new();
        for ns in &namespaces {
            let where_ = ns
                .as_ref()
                .map_or("all namespaces".to_string(), |n| format!("namespace {n}"));
            for resource in [Resource::RayServices, Resource::Pods] {
                let id = watches.len();
                let (api, config) = match resource {
                    Resource::RayServices => {
                        let ar = rayservice_resource();
                        let mut c = watcher::Config::default();
                        if let Some(sel) = self.config.rayservice_selector.as_deref() {
                            if !sel.is_empty() {
                                c = c.labels(sel);
                            }
                        }
                        (api_for(&client, ns.as_deref(), &ar), c)
                    }
                    Resource::Pods => {
                        let ar = ApiResource::erase::<Pod>(&());
                        (
                            api_for(&client, ns.as_deref(), &ar),
                            watcher::Config::default().labels(CLUSTER_LABEL),
                        )
                    }
                };
                streams.push(
                    watcher(api, config)
                        .default_backoff()
                        .map(move |item| (id, item.map_err(|e| e.to_string())))
                        .boxed(),
                );
                watches.push(Watch {
                    resource,
                    status: WatchStatus {
                        watch: format!("{} in {where_}", resource.label()),
                        state: WatchState::Listing,
                        synced: false,
                        objects: 0,
                        last_event_unix: None,
                        failing_since_unix: None,
                        last_error: None,
                        errors: 0,
                        relists: 0,
                    },
                    objects: BTreeMap::new(),
                    listing: None,
                    malformed: BTreeMap::new(),
                    listing_malformed: BTreeMap::new(),
                });
            }
        }
        let mut state = State {
            watches,
            index: index::Index::new(self.config.host_policy().unwrap_or_else(|e| {
                // Checked when the config was loaded; the strictest policy otherwise.
                tracing::error!(error = %e, "source.kubernetes.allowed_hosts: refused; only each RayService's own names may be claimed");
                Default::default()
            })),
            reported: BTreeSet::new(),
            last_model: None,
            metrics: self.metrics,
        };
        state.publish_status(&status, None);
        loop {
            let first = tokio::select! {
                _ = shutdown.cancelled() => return,
                item = streams.next() => item,
            };
            let Some((id, item)) = first else {
                tracing::error!("every Kubernetes watch ended; keeping the last state");
                shutdown.cancelled().await;
                return;
            };
            let mut dirty = state.apply(id, item);
            // Take whatever else is ready before rebuilding: a burst is one rebuild.
            while let Some(Some((id, item))) = streams.next().now_or_never() {
                dirty |= state.apply(id, item);
            }
            if dirty && state.synced() {
                state.rebuild(&models, &status);
            } else {
                state.publish_status(&status, None);
            }
        }
    }
}

type WatchItem = Result<watcher::Event<DynamicObject>, String>;

fn api_for(client: &kube::Client, ns: Option<&str>, ar: &ApiResource) -> Api<DynamicObject> {
    match ns {
        Some(ns) => Api::namespaced_with(client.clone(), ns, ar),
        None => Api::all_with(client.clone(), ar),
    }
}

struct State {
    watches: Vec<Watch>,
    index: index::Index,
    /// Problems already logged and counted (each is reported once while it lasts).
    reported: BTreeSet<String>,
    last_model: Option<Arc<Model>>,
    metrics: Arc<Metrics>,
}

fn now_unix() -> f64 {
    SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .unwrap_or(Duration::ZERO)
        .as_secs_f64()
}

impl State {
    fn synced(&self) -> bool {
        self.watches.iter().all(|w| w.status.synced)
    }

    /// Applies one watcher item; true when the objects changed.
    fn apply(&mut self, id: usize, item: WatchItem) -> bool {
        let w = &mut self.watches[id];
        let event = match item {
            Ok(event) => event,
            Err(error) => {
                tracing::warn!(watch = w.status.watch, %error, "Kubernetes watch failed; retrying with back-off, serving the last state");
                self.metrics
                    .source_watch_errors
                    .get_or_create(&ResourceLabels {
                        resource: w.resource.label(),
                    })
                    .inc();
                w.status.errors += 1;
                w.status.last_error = Some(error);
                w.status.state = WatchState::Retrying;
                w.status.failing_since_unix.get_or_insert_with(now_unix);
                return false;
            }
        };
        w.status.last_event_unix = Some(now_unix());
        w.status.failing_since_unix = None;
        match event {
            watcher::Event::Init => {
                if w.status.synced {
                    w.status.relists += 1;
                }
                w.status.state = WatchState::Listing;
                w.listing = Some(Default::default());
                w.listing_malformed.clear();
                false
            }
            watcher::Event::InitApply(obj) => {
                w.decode_into_listing(&obj);
                false
            }
            watcher::Event::InitDone => {
                let listed = w.listing.take().unwrap_or_default();
                for key in w.objects.keys().filter(|k| !listed.contains_key(*k)) {
                    remove(&mut self.index, w.resource, key);
                }
                for (key, object) in &listed {
                    if w.objects.get(key) != Some(object) {
                        insert(&mut self.index, object.clone());
                    }
                }
                w.objects = listed;
                w.malformed = std::mem::take(&mut w.listing_malformed);
                w.status.synced = true;
                w.status.state = WatchState::Watching;
                w.status.objects = w.objects.len();
                true
            }
            watcher::Event::Apply(obj) => {
                w.status.state = WatchState::Watching;
                if let Some(object) = w.decode_applied(&obj) {
                    insert(&mut self.index, object);
                }
                w.status.objects = w.objects.len();
                true
            }
            watcher::Event::Delete(obj) => {
                w.status.state = WatchState::Watching;
                let key = key_of(&obj);
                if w.objects.remove(&key).is_some() {
                    remove(&mut self.index, w.resource, &key);
                }
                w.malformed.remove(&key);
                w.status.objects = w.objects.len();
                true
            }
        }
    }

    fn rebuild(
        &mut self,
        models: &watch::Sender<Arc<Model>>,
        status: &watch::Sender<Arc<SourceStatus>>,
    ) {
        let built = self.index.built();
        let mut problems: Vec<(String, &'static str)> = built
            .problems
            .iter()
            .map(|p| (format!("{}: {}", p.object, p.message), p.reason))
            .collect();
        for w in &self.watches {
            for ((ns, name), why) in &w.malformed {
                let kind = match w.resource {
                    Resource::RayServices => "rayservice",
                    Resource::Pods => "pod",
                };
                problems.push((
                    format!("{kind} {ns}/{name}: malformed, skipped (its last good state is kept): {why}"),
                    "malformed_object",
                ));
            }
        }
        let model = Arc::new(built.model);
        if self.last_model.as_deref() != Some(&*model) {
            self.metrics
                .source_updates
                .get_or_create(&SourceLabels {
                    source: "kubernetes",
                })
                .inc();
            models.send_replace(model.clone());
            self.last_model = Some(model);
        }
        self.publish_status(status, Some((problems, built.unrouted, built.hints)));
    }

    /// Publishes the status; `found` is what the last rebuild found (`None` keeps the
    /// previous problems). Each problem is logged and counted once, when it first appears.
    fn publish_status(&mut self, status: &watch::Sender<Arc<SourceStatus>>, found: Option<Found>) {
        let previous = status.borrow().clone();
        let (problems, unrouted, hints) = match found {
            Some((problems, unrouted, hints)) => {
                for (problem, reason) in &problems {
                    if !self.reported.contains(problem) {
                        tracing::warn!(reason, "Kubernetes source: {problem}");
                        self.metrics
                            .source_objects_skipped
                            .get_or_create(&ObjectProblemLabels {
                                source: "kubernetes",
                                reason,
                            })
                            .inc();
                    }
                }
                self.reported = problems.into_iter().map(|(p, _)| p).collect();
                (self.reported.iter().cloned().collect(), unrouted, hints)
            }
            None => (
                previous.problems.clone(),
                previous.unrouted.clone(),
                previous.kuberay_application_statuses.clone(),
            ),
        };
        let synced = self.synced();
        self.metrics.source_synced.set(synced as i64);
        status.send_replace(Arc::new(SourceStatus {
            source: "kubernetes",
            synced,
            watches: self.watches.iter().map(|w| w.status.clone()).collect(),
            unrouted,
            problems,
            kuberay_application_statuses: hints,
        }));
    }
}

fn key_of(obj: &DynamicObject) -> Key {
    (
        obj.metadata.namespace.clone().unwrap_or_default(),
        obj.metadata.name.clone().unwrap_or_default(),
    )
}

impl Watch {
    /// One object decoded as this watch's kind.
    fn decode(&self, obj: &DynamicObject) -> Result<Object, String> {
        match self.resource {
            Resource::RayServices => RayServiceObject::decode(obj).map(Object::RayService),
            Resource::Pods => PodObject::decode(obj).map(Object::Pod),
        }
    }

    fn decode_into_listing(&mut self, obj: &DynamicObject) {
        let key = key_of(obj);
        let decoded = self.decode(obj);
        let Some(listing) = self.listing.as_mut() else {
            return;
        };
        match decoded {
            Ok(object) => {
                listing.insert(key, object);
            }
            Err(why) => {
                // Keep what we had for it: a bad write must not withdraw a good object.
                if let Some(object) = self.objects.get(&key) {
                    listing.insert(key.clone(), object.clone());
                }
                self.listing_malformed.insert(key, why);
            }
        }
    }

    /// Decodes an applied object into this watch; the object when it decoded (a
    /// malformed one keeps the last good state of its key).
    fn decode_applied(&mut self, obj: &DynamicObject) -> Option<Object> {
        let key = key_of(obj);
        match self.decode(obj) {
            Ok(object) => {
                self.objects.insert(key.clone(), object.clone());
                self.malformed.remove(&key);
                Some(object)
            }
            Err(why) => {
                self.malformed.insert(key, why);
                None
            }
        }
    }
}

fn insert(index: &mut index::Index, object: Object) {
    match object {
        Object::RayService(r) => index.apply_rayservice(r),
        Object::Pod(p) => index.apply_pod(p),
    }
}

fn remove(index: &mut index::Index, resource: Resource, key: &Key) {
    match resource {
        Resource::RayServices => index.delete_rayservice(key),
        Resource::Pods => index.delete_pod(key),
    }
}
