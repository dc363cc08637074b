//! Where each replica keeps its switchover view, so that a restart of every replica at
//! once finds what no input can give again: when a shift started, a rollback decision, a
//! move completed that the source has not caught up with, the clusters still draining.
//!
//! The store is a directory (a file per replica; any source) or one ConfigMap of ray-xds's
//! own namespace (a key per replica; the Kubernetes source's client). What is kept is the
//! view a replica answers its peers ([`ReplicaView`]) less what derives from inputs
//! ([`kept`]). At start the peer poller reads every entry written within the `ttl` and
//! takes each as one more peer's view, with a peer's limits: a kept view never opens a
//! gate, it can give an earlier start of the same shift, a move done (followed only once
//! this replica's own gates pass), a rollback on the same version, or a drain's end.
//!
//! Invariants: a replica writes only its own entry (replica ids are random per start, so
//! replicas never write the same key) and removes only entries last written more than
//! `ttl` ago, or unreadable ones; an entry is at most [`MAX_ENTRY_BYTES`], and at most
//! [`MAX_ENTRIES`] are read; garbage in the store is logged and skipped; a store that
//! cannot be read or written costs only this memory (logged, counted), never serving.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use k8s_openapi::api::core::v1::ConfigMap;
use kube::api::{Api, Patch, PatchParams};
use serde::{Deserialize, Serialize};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use super::peers::{from_unix, to_unix, ReplicaView};
use crate::config::{ReplicaStateConfig, ReplicaStateStore, SourceConfig};
use crate::metrics::{Metrics, StoreLabels};

/// The largest entry written or read.
pub const MAX_ENTRY_BYTES: usize = 128 * 1024;

/// The most entries read (replicas × restarts within the ttl).
pub const MAX_ENTRIES: usize = 64;

/// The least time between two writes of a replica's entry (changes in between fold into
/// the next write).
pub const WRITE_EVERY: Duration = Duration::from_secs(1);

/// How soon a write that failed is tried again.
pub const RETRY_AFTER: Duration = Duration::from_secs(5);

/// How long a read or a write of the store may take.
pub const STORE_TIMEOUT: Duration = Duration::from_secs(2);

/// One replica's entry: its view, and when it was written (unix seconds, by its clock).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct KeptView {
    pub written_unix: f64,
    pub view: ReplicaView,
}

/// The store: a directory or a ConfigMap.
#[derive(Clone)]
pub enum StateStore {
    Dir(PathBuf),
    ConfigMap { api: Api<ConfigMap>, name: String },
}

impl std::fmt::Display for StateStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            StateStore::Dir(dir) => write!(f, "directory {}", dir.display()),
            StateStore::ConfigMap { name, .. } => write!(f, "ConfigMap {name}"),
        }
    }
}

/// An entry's key (a file name, a ConfigMap data key) for a replica id.
pub fn entry_key(replica_id: &str) -> String {
    format!("replica-{replica_id}.json")
}

impl StateStore {
    /// The store `config` names; a ConfigMap through the Kubernetes source's client.
    pub async fn connect(
        config: &ReplicaStateConfig,
        source: &SourceConfig,
    ) -> anyhow::Result<StateStore> {
        Ok(match (&config.store, source) {
            (ReplicaStateStore::Dir(dir), _) => StateStore::Dir(dir.clone()),
            (ReplicaStateStore::ConfigMap { namespace, name }, SourceConfig::Kubernetes(k)) => {
                let client = crate::source::kubernetes::client(k).await?;
                StateStore::ConfigMap {
                    api: Api::namespaced(client, namespace),
                    name: name.clone(),
                }
            }
            (ReplicaStateStore::ConfigMap { .. }, _) => {
                anyhow::bail!("replicas.state.configmap needs the Kubernetes source")
            }
        })
    }

    /// Every entry by key: its view, or why it cannot be read.
    pub async fn read(&self) -> Result<Vec<(String, Result<KeptView, String>)>, String> {
        let raw = match tokio::time::timeout(STORE_TIMEOUT, self.read_raw()).await {
            Ok(raw) => raw?,
            Err(_) => return Err(format!("no answer within {STORE_TIMEOUT:?}")),
        };
        Ok(raw
            .into_iter()
            .take(MAX_ENTRIES)
            .map(|(key, text)| {
                let entry = if text.len() > MAX_ENTRY_BYTES {
                    Err(format!("{} bytes, over {MAX_ENTRY_BYTES}", text.len()))
                } else {
                    serde_json::from_str::<KeptView>(&text).map_err(|e| e.to_string())
                };
                (key, entry)
            })
            .collect())
    }

    async fn read_raw(&self) -> Result<Vec<(String, String)>, String> {
        match self {
            StateStore::Dir(dir) => {
                let dir = dir.clone();
                tokio::task::spawn_blocking(move || read_dir(&dir))
                    .await
                    .map_err(|e| e.to_string())?
            }
            StateStore::ConfigMap { api, name } => {
                let map = api
                    .get_opt(name)
                    .await
                    .map_err(|e| format!("reading ConfigMap {name}: {e}"))?
                    .ok_or_else(|| {
                        format!("ConfigMap {name} does not exist (deploy/ creates it)")
                    })?;
                Ok(map
                    .data
                    .unwrap_or_default()
                    .into_iter()
                    .filter(|(key, _)| key.starts_with("replica-"))
                    .collect())
            }
        }
    }

    /// Writes `key`'s entry and removes the entries `remove` names, at once where the
    /// store can (a ConfigMap's merge patch touches only those keys).
    pub async fn write(
        &self,
        key: &str,
        entry: &KeptView,
        remove: &[String],
    ) -> Result<(), String> {
        let text = serde_json::to_string(entry).map_err(|e| e.to_string())?;
        if text.len() > MAX_ENTRY_BYTES {
            return Err(format!(
                "this replica's entry is {} bytes, over {MAX_ENTRY_BYTES}: not written",
                text.len()
            ));
        }
        let write = async {
            match self {
                StateStore::Dir(dir) => {
                    let (dir, key, remove) = (dir.clone(), key.to_string(), remove.to_vec());
                    tokio::task::spawn_blocking(move || write_dir(&dir, &key, &text, &remove))
                        .await
                        .map_err(|e| e.to_string())?
                }
                StateStore::ConfigMap { api, name } => {
                    let mut data = serde_json::Map::new();
                    data.insert(key.to_string(), text.into());
                    for gone in remove {
                        data.insert(gone.clone(), serde_json::Value::Null);
                    }
                    let patch = serde_json::json!({ "data": data });
                    api.patch(name, &PatchParams::default(), &Patch::Merge(&patch))
                        .await
                        .map(|_| ())
                        .map_err(|e| format!("patching ConfigMap {name}: {e}"))
                }
            }
        };
        tokio::time::timeout(STORE_TIMEOUT, write)
            .await
            .unwrap_or_else(|_| Err(format!("no answer within {STORE_TIMEOUT:?}")))
    }
}

fn read_dir(dir: &std::path::Path) -> Result<Vec<(String, String)>, String> {
    let entries = match std::fs::read_dir(dir) {
        Ok(entries) => entries,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(format!("listing {}: {e}", dir.display())),
    };
    let mut names: Vec<String> = entries
        .filter_map(Result::ok)
        .filter_map(|e| e.file_name().into_string().ok())
        .filter(|n| n.starts_with("replica-") && n.ends_with(".json"))
        .collect();
    names.sort();
    let mut read = Vec::new();
    for name in names.into_iter().take(MAX_ENTRIES) {
        let path = dir.join(&name);
        let too_big = std::fs::metadata(&path).is_ok_and(|m| m.len() > MAX_ENTRY_BYTES as u64);
        let text = if too_big {
            // Read as too big, without reading it whole.
            "x".repeat(MAX_ENTRY_BYTES + 1)
        } else {
            match std::fs::read_to_string(&path) {
                Ok(text) => text,
                Err(e) => format!("unreadable: {e}"),
            }
        };
        read.push((name, text));
    }
    Ok(read)
}

fn write_dir(
    dir: &std::path::Path,
    key: &str,
    text: &str,
    remove: &[String],
) -> Result<(), String> {
    std::fs::create_dir_all(dir).map_err(|e| format!("creating {}: {e}", dir.display()))?;
    let path = dir.join(key);
    let tmp = dir.join(format!(".{key}.tmp"));
    std::fs::write(&tmp, text).map_err(|e| format!("writing {}: {e}", tmp.display()))?;
    std::fs::rename(&tmp, &path).map_err(|e| format!("renaming to {}: {e}", path.display()))?;
    for gone in remove {
        let _ = std::fs::remove_file(dir.join(gone));
    }
    Ok(())
}

/// What of `view` is kept: switches under way, rollback decisions, moves completed within
/// `ttl`, and drains not ended; not the load reports (the outcome window is shorter than a
/// restart), nor the clock (an entry says when it was written).
pub fn kept(mut view: ReplicaView, now: SystemTime, ttl: Duration) -> ReplicaView {
    let recent = to_unix(now) - ttl.as_secs_f64();
    view.services.retain(|_, s| {
        s.target.is_some()
            || s.rollback.is_some()
            || (s.moved && s.serving_since_unix.is_some_and(|t| t >= recent))
    });
    let now_unix = to_unix(now);
    view.departed.retain(|d| d.until_unix > now_unix);
    view.loads.clear();
    view.now_unix = None;
    view
}

/// The entries read at start that count: written within `ttl` of `now`, each with when it
/// stops counting. The others are logged and skipped.
pub fn remembered(
    entries: Vec<(String, Result<KeptView, String>)>,
    now: SystemTime,
    ttl: Duration,
) -> Vec<(SystemTime, ReplicaView)> {
    let mut views = Vec::new();
    for (key, entry) in entries {
        match entry {
            Ok(kept) => {
                let until = from_unix(kept.written_unix).map(|w| w + ttl);
                match until {
                    Some(until) if until > now => {
                        let mut view = kept.view;
                        // Its times are absolute: no clock to move them by.
                        view.now_unix = None;
                        view.loads.clear();
                        views.push((until, view));
                    }
                    _ => tracing::info!(
                        entry = key,
                        "replica state: an entry older than the ttl is left out"
                    ),
                }
            }
            Err(why) => {
                tracing::warn!(entry = key, %why, "replica state: an unreadable entry is left out")
            }
        }
    }
    views
}

/// Writes this replica's entry whenever its view changes (at most every
/// [`WRITE_EVERY`]), renews it every quarter of the `ttl`, and then removes the entries
/// that expired or cannot be read.
pub struct StateKeeper {
    pub store: StateStore,
    pub replica_id: String,
    pub ttl: Duration,
    pub metrics: Arc<Metrics>,
}

impl StateKeeper {
    pub async fn run<T: Send + Sync + 'static>(
        self,
        mut views: watch::Receiver<T>,
        view_of: impl Fn(&T) -> ReplicaView,
        shutdown: CancellationToken,
    ) {
        let key = entry_key(&self.replica_id);
        let renew = self.ttl / 4;
        let mut written: Option<(ReplicaView, SystemTime)> = None;
        let mut failing: Option<String> = None;
        let mut wait = renew;
        loop {
            let now = SystemTime::now();
            let mut view = kept(view_of(&views.borrow_and_update()), now, self.ttl);
            view.replica = Some(self.replica_id.clone());
            let due = match &written {
                None => true,
                Some((last, at)) => *last != view || now >= *at + renew,
            };
            if due {
                let renewal = written.as_ref().is_none_or(|(_, at)| now >= *at + renew);
                let remove = if renewal {
                    self.expired(&key, now).await
                } else {
                    Vec::new()
                };
                let entry = KeptView {
                    written_unix: to_unix(now),
                    view: view.clone(),
                };
                let result = self.store.write(&key, &entry, &remove).await;
                let label = StoreLabels {
                    op: "write",
                    result: if result.is_ok() { "ok" } else { "error" },
                };
                self.metrics.state_store_ops.get_or_create(&label).inc();
                match result {
                    Ok(()) => {
                        if failing.take().is_some() {
                            tracing::info!(store = %self.store, "replica state: written again");
                        }
                        written = Some((view, now));
                        wait = renew;
                    }
                    Err(e) => {
                        if failing.as_ref() != Some(&e) {
                            tracing::warn!(store = %self.store, error = %e, "replica state: this replica's view could not be kept; a restart of every replica would start its switches over");
                            failing = Some(e);
                        }
                        // Tried again at the next change, or soon.
                        written = Some((ReplicaView::default(), now - renew));
                        wait = RETRY_AFTER;
                    }
                }
            }
            tokio::select! {
                _ = shutdown.cancelled() => return,
                _ = tokio::time::sleep(WRITE_EVERY) => {}
            }
            tokio::select! {
                _ = shutdown.cancelled() => return,
                changed = views.changed() => if changed.is_err() { return },
                _ = tokio::time::sleep(wait) => {}
            }
        }
    }

    /// The entries of other replicas written more than `ttl` ago, or unreadable.
    async fn expired(&self, own: &str, now: SystemTime) -> Vec<String> {
        let Ok(entries) = self.store.read().await else {
            return Vec::new();
        };
        entries
            .into_iter()
            .filter(|(key, entry)| {
                key != own
                    && match entry {
                        Ok(kept) => {
                            from_unix(kept.written_unix).is_none_or(|w| w + self.ttl <= now)
                        }
                        Err(_) => true,
                    }
            })
            .map(|(key, _)| key)
            .collect()
    }
}

/// Reads the store once at start: the entries that count ([`remembered`]); none when it
/// cannot be read (logged, counted).
pub async fn read_at_start(
    store: &StateStore,
    ttl: Duration,
    metrics: &Metrics,
) -> Vec<(SystemTime, ReplicaView)> {
    let read = store.read().await;
    let label = StoreLabels {
        op: "read",
        result: if read.is_ok() { "ok" } else { "error" },
    };
    metrics.state_store_ops.get_or_create(&label).inc();
    match read {
        Ok(entries) => {
            let views = remembered(entries, SystemTime::now(), ttl);
            tracing::info!(store = %store, entries = views.len(), "replica state: read what the replicas kept");
            views
        }
        Err(e) => {
            tracing::warn!(store = %store, error = %e, "replica state: not read; switches start from the source and the peers");
            Vec::new()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::live::peers::{DepartedCluster, PeerSwitch, Rollback};

    fn switch(target: Option<&str>, moved_at: Option<f64>) -> PeerSwitch {
        PeerSwitch {
            serving: "a".into(),
            target: target.map(str::to_string),
            target_since_unix: None,
            shift_started_unix: None,
            serving_since_unix: moved_at,
            moved: moved_at.is_some(),
            rollback: None,
        }
    }

    fn at(secs: u64) -> SystemTime {
        SystemTime::UNIX_EPOCH + Duration::from_secs(1_800_000_000 + secs)
    }

    fn view(replica: &str) -> ReplicaView {
        ReplicaView {
            services: [("ns/shifting".to_string(), switch(Some("b"), None))].into(),
            replica: Some(replica.into()),
            ..Default::default()
        }
    }

    #[test]
    fn only_what_no_input_gives_again_is_kept() {
        let ttl = Duration::from_secs(600);
        let t = |secs| to_unix(at(secs));
        let mut rolled_back = switch(None, None);
        rolled_back.rollback = Some(Rollback {
            cluster: "b".into(),
            version: None,
            why: "failed".into(),
            at_unix: 1,
        });
        let full = ReplicaView {
            services: [
                ("ns/stable".to_string(), switch(None, None)),
                ("ns/shifting".to_string(), switch(Some("b"), None)),
                ("ns/moved-long-ago".to_string(), switch(None, Some(t(0)))),
                ("ns/moved".to_string(), switch(None, Some(t(500)))),
                ("ns/rolled-back".to_string(), rolled_back),
            ]
            .into(),
            departed: vec![
                DepartedCluster {
                    service: "ns/x".into(),
                    cluster: "ended".into(),
                    until_unix: t(900),
                    proxies: vec![],
                },
                DepartedCluster {
                    service: "ns/x".into(),
                    cluster: "draining".into(),
                    until_unix: t(1_100),
                    proxies: vec![],
                },
            ],
            now_unix: Some(t(1_000)),
            replica: Some("r1".into()),
            loads: [("ns/b".to_string(), Default::default())].into(),
        };
        let kept = kept(full, at(1_000), ttl);
        let services: Vec<&str> = kept.services.keys().map(String::as_str).collect();
        assert_eq!(services, ["ns/moved", "ns/rolled-back", "ns/shifting"]);
        assert_eq!(kept.departed.len(), 1);
        assert_eq!(kept.departed[0].cluster, "draining");
        assert!(kept.loads.is_empty());
        assert_eq!(kept.now_unix, None);
        assert_eq!(kept.replica.as_deref(), Some("r1"));
    }

    #[tokio::test]
    async fn a_directory_keeps_an_entry_per_replica_and_skips_garbage() {
        let dir = tempfile::tempdir().unwrap();
        let store = StateStore::Dir(dir.path().join("state"));
        // Nothing yet (the directory does not exist): nothing read, no error.
        assert!(store.read().await.unwrap().is_empty());
        let entry = |replica: &str, written: u64| KeptView {
            written_unix: to_unix(at(written)),
            view: view(replica),
        };
        store
            .write(&entry_key("r1"), &entry("r1", 0), &[])
            .await
            .unwrap();
        store
            .write(&entry_key("r2"), &entry("r2", 100), &[])
            .await
            .unwrap();
        let state = dir.path().join("state");
        std::fs::write(state.join("replica-garbage.json"), "{not json").unwrap();
        std::fs::write(
            state.join("replica-huge.json"),
            "x".repeat(MAX_ENTRY_BYTES + 1),
        )
        .unwrap();
        std::fs::write(state.join("unrelated.txt"), "ignored").unwrap();
        let read = store.read().await.unwrap();
        let keys: Vec<&str> = read.iter().map(|(k, _)| k.as_str()).collect();
        assert_eq!(
            keys,
            [
                "replica-garbage.json",
                "replica-huge.json",
                "replica-r1.json",
                "replica-r2.json"
            ]
        );
        assert!(read[0].1.is_err() && read[1].1.is_err());
        assert_eq!(read[2].1.as_ref().unwrap(), &entry("r1", 0));
        // At 650 s with a ttl of 600 s: r1's entry (written at 0) no longer counts.
        let views = remembered(read, at(650), Duration::from_secs(600));
        assert_eq!(views.len(), 1);
        assert_eq!(views[0].1.replica.as_deref(), Some("r2"));
        assert_eq!(views[0].0, at(700));
        // A write removes what it is told to, and an entry over the bound is refused.
        store
            .write(
                &entry_key("r2"),
                &entry("r2", 200),
                &["replica-r1.json".into()],
            )
            .await
            .unwrap();
        assert!(!state.join("replica-r1.json").exists());
        let mut big = entry("r3", 0);
        for i in 0..5_000 {
            big.view
                .services
                .insert(format!("ns/s{i}"), switch(Some("b"), None));
        }
        let refused = store.write(&entry_key("r3"), &big, &[]).await.unwrap_err();
        assert!(refused.contains("over"), "{refused}");
        assert!(!state.join("replica-r3.json").exists());
    }

    /// The keeper writes its replica's view on a change, folds changes into one write a
    /// second, and at its first write removes the entries that expired or cannot be read,
    /// never a fresh one of another replica.
    #[tokio::test(start_paused = true)]
    async fn the_keeper_writes_on_change_and_removes_only_expired_entries() {
        let dir = tempfile::tempdir().unwrap();
        let store = StateStore::Dir(dir.path().to_path_buf());
        let now = SystemTime::now();
        let ttl = Duration::from_secs(600);
        let written = |secs_ago: u64| KeptView {
            written_unix: to_unix(now - Duration::from_secs(secs_ago)),
            view: view("other"),
        };
        store
            .write("replica-fresh.json", &written(10), &[])
            .await
            .unwrap();
        store
            .write("replica-expired.json", &written(700), &[])
            .await
            .unwrap();
        std::fs::write(dir.path().join("replica-garbage.json"), "[]").unwrap();
        let (tx, rx) = watch::channel(ReplicaView::default());
        let keeper = StateKeeper {
            store: store.clone(),
            replica_id: "me".into(),
            ttl,
            metrics: Arc::new(Metrics::new()),
        };
        let shutdown = CancellationToken::new();
        let task = tokio::spawn(keeper.run(rx, |v: &ReplicaView| v.clone(), shutdown.clone()));
        let mine = || async {
            let read = store.read().await.unwrap();
            read.into_iter()
                .find(|(k, _)| k == "replica-me.json")
                .map(|(_, e)| e.unwrap().view)
        };
        tokio::time::sleep(Duration::from_millis(100)).await;
        let first = mine().await.expect("written at start");
        assert!(first.services.is_empty());
        assert_eq!(first.replica.as_deref(), Some("me"));
        let keys: Vec<String> = store
            .read()
            .await
            .unwrap()
            .into_iter()
            .map(|(k, _)| k)
            .collect();
        assert_eq!(keys, ["replica-fresh.json", "replica-me.json"]);
        // A switch begins: written within the second; a stable service is not kept.
        let mut shifting = view("ignored");
        shifting
            .services
            .insert("ns/stable".into(), switch(None, None));
        tx.send(shifting).unwrap();
        tokio::time::sleep(Duration::from_millis(1_500)).await;
        let second = mine().await.unwrap();
        let services: Vec<&String> = second.services.keys().collect();
        assert_eq!(services, ["ns/shifting"]);
        assert_eq!(
            second.replica.as_deref(),
            Some("me"),
            "its own id, whatever the view says"
        );
        shutdown.cancel();
        task.await.unwrap();
    }
}
