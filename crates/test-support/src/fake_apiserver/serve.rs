//! Get, list and watch, served: a list's pages under one resourceVersion, and a watch's events
//! from the history (initial events, bookmarks, selectors turning into `ADDED`/`DELETED`,
//! `410 Gone` for an expired resourceVersion) until its timeout.
//!
//! Invariant: a slow or stuck watch blocks only itself.

use super::*;

pub(super) fn get(shared: &Shared, target: &Target, name: &str) -> Response {
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

/// A JSON merge patch (RFC 7386; `application/merge-patch+json`, or a strategic merge
/// patch, which is the same for the maps tests patch) of one existing object: the next
/// resourceVersion and a `MODIFIED` event, as on the real server. A patch may not
/// change the object's name, namespace or kind.
pub(super) fn patch(
    shared: &Shared,
    path: &str,
    headers: &axum::http::HeaderMap,
    body: &[u8],
) -> Response {
    let Some(target) = Target::parse(path) else {
        return not_found();
    };
    let Some(name) = target.name.clone() else {
        return status(
            StatusCode::METHOD_NOT_ALLOWED,
            "MethodNotAllowed",
            "PATCH names one object",
        );
    };
    let content_type = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default();
    if !matches!(
        content_type,
        "application/merge-patch+json" | "application/strategic-merge-patch+json"
    ) {
        return status(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "UnsupportedMediaType",
            format!("the fake API server patches only with merge patches, not {content_type:?}"),
        );
    }
    let Ok(patch) = serde_json::from_slice::<Value>(body) else {
        return bad_request("the patch is not JSON");
    };
    let key = ObjectKey {
        resource: target.resource.clone(),
        namespace: target.namespace.clone().unwrap_or_default(),
        name: name.clone(),
    };
    shared.count(&target.resource.plural, |c| c.patches += 1);
    shared.change(|store| {
        let Some(current) = store.objects.get(&key).cloned() else {
            let message = format!("{} \"{name}\" not found", target.resource.plural);
            return status(StatusCode::NOT_FOUND, "NotFound", message);
        };
        let mut next = current.clone();
        merge_patch(&mut next, &patch);
        for field in [
            "/kind",
            "/apiVersion",
            "/metadata/name",
            "/metadata/namespace",
        ] {
            if next.pointer(field) != current.pointer(field) {
                return bad_request(format!("a patch may not change {field}"));
            }
        }
        let rv = store.next_rv();
        metadata_mut(&mut next).insert("resourceVersion".into(), rv.to_string().into());
        store.put(key, next.clone());
        axum::Json(next).into_response()
    })
}

/// RFC 7386: an object merges key by key, `null` removes, anything else replaces.
fn merge_patch(target: &mut Value, patch: &Value) {
    let Value::Object(fields) = patch else {
        *target = patch.clone();
        return;
    };
    if !target.is_object() {
        *target = Value::Object(Map::new());
    }
    let object = target.as_object_mut().expect("an object");
    for (key, value) in fields {
        if value.is_null() {
            object.remove(key);
        } else {
            merge_patch(object.entry(key.clone()).or_insert(Value::Null), value);
        }
    }
}

pub(super) fn list(shared: &Shared, target: &Target, kind: &str, params: &Params) -> Response {
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

pub(super) fn json_line(value: &Value) -> Vec<u8> {
    let mut line = serde_json::to_vec(value).expect("serializing a watch event");
    line.push(b'\n');
    line
}

/// The 410 event the real server sends to a watch from a compacted resourceVersion.
pub(super) fn gone_line(requested: u64, oldest: u64) -> Vec<u8> {
    json_line(&json!({
        "type": "ERROR",
        "object": status_object(
            StatusCode::GONE,
            "Expired",
            format!("too old resource version: {requested} ({oldest})"),
        ),
    }))
}

pub(super) fn watch_response(body: Body) -> Response {
    Response::builder()
        .status(StatusCode::OK)
        .header(header::CONTENT_TYPE, "application/json")
        .body(body)
        .expect("watch response")
}

pub(super) fn start_watch(
    shared: &Arc<Shared>,
    target: Target,
    kind: String,
    params: Params,
) -> Response {
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
pub(super) struct OpenWatch {
    pub(super) shared: Arc<Shared>,
    pub(super) plural: String,
}

impl OpenWatch {
    pub(super) fn new(shared: Arc<Shared>, plural: String) -> OpenWatch {
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
pub(super) struct Watch {
    pub(super) shared: Arc<Shared>,
    pub(super) target: Target,
    pub(super) api_version: String,
    pub(super) kind: String,
    pub(super) labels: LabelSelector,
    pub(super) fields: FieldSelector,
    /// Every event up to this resourceVersion has been sent (or skipped).
    pub(super) cursor: u64,
    pub(super) bookmarks: bool,
    pub(super) deadline: Instant,
    pub(super) next_bookmark: Instant,
    pub(super) changed: watch::Receiver<u64>,
    pub(super) dropped: CancellationToken,
    /// Sent before anything else: initial events, or nothing.
    pub(super) first: Vec<u8>,
    pub(super) finished: bool,
    pub(super) _open: OpenWatch,
}

impl Watch {
    pub(super) fn selects(&self, key: &ObjectKey, object: &Value) -> bool {
        self.target.contains(key) && self.labels.matches(object) && self.fields.matches(object)
    }

    /// What this watch sees of an event: its type and object, or nothing.
    pub(super) fn translate<'e>(&self, event: &'e Event) -> Option<(&'static str, &'e Value)> {
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
    pub(super) fn bookmark(&self, initial_events_end: bool) -> Vec<u8> {
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
    pub(super) fn collect(&mut self) -> Vec<u8> {
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

    pub(super) async fn next_chunk(&mut self) -> Option<Result<Bytes, io::Error>> {
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
