//! One HTTP request to the fake API server: its path read as a collection or an object
//! (`Target`), its query (`Params`), and the `Status` answers of the real server for
//! what it cannot serve.
//!
//! Invariant: anything not served gets a `Status` object with the real server's code and
//! reason, never a panic.

use super::*;

pub(super) fn metadata_mut(object: &mut Value) -> &mut Map<String, Value> {
    object
        .get_mut("metadata")
        .and_then(Value::as_object_mut)
        .expect("the object's metadata is an object")
}

/// An RFC 3339 time, `offset_seconds` from now.
pub(super) fn now(offset_seconds: i64) -> String {
    (Utc::now() + TimeDelta::seconds(offset_seconds)).to_rfc3339_opts(SecondsFormat::Secs, true)
}

// ---- HTTP ----

pub(super) fn status(code: StatusCode, reason: &str, message: impl Into<String>) -> Response {
    (code, axum::Json(status_object(code, reason, message))).into_response()
}

pub(super) fn status_object(code: StatusCode, reason: &str, message: impl Into<String>) -> Value {
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

pub(super) fn not_found() -> Response {
    status(
        StatusCode::NOT_FOUND,
        "NotFound",
        "the server could not find the requested resource",
    )
}

pub(super) fn unavailable() -> Response {
    status(
        StatusCode::SERVICE_UNAVAILABLE,
        "ServiceUnavailable",
        "the fake API server is unavailable",
    )
}

pub(super) fn bad_request(message: impl Into<String>) -> Response {
    status(StatusCode::BAD_REQUEST, "BadRequest", message)
}

pub(super) async fn handle(
    State(shared): State<Arc<Shared>>,
    method: Method,
    uri: Uri,
    headers: axum::http::HeaderMap,
    body: Bytes,
) -> Response {
    {
        let mut requests = lock(&shared.requests);
        if requests.len() < MAX_LOGGED_REQUESTS {
            requests.push(format!("{method} {uri}"));
        }
    }
    if shared.unavailable.load(Ordering::SeqCst) {
        return unavailable();
    }
    if method == Method::PATCH {
        return patch(&shared, uri.path(), &headers, &body);
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

pub(super) fn version() -> Value {
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
pub(super) struct Target {
    pub(super) resource: ResourceType,
    pub(super) namespace: Option<String>,
    pub(super) name: Option<String>,
}

impl Target {
    pub(super) fn parse(path: &str) -> Option<Target> {
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

    pub(super) fn contains(&self, key: &ObjectKey) -> bool {
        key.resource == self.resource
            && self
                .namespace
                .as_ref()
                .is_none_or(|namespace| *namespace == key.namespace)
    }
}

/// The query parameters that matter for list and watch.
#[derive(Default)]
pub(super) struct Params {
    pub(super) watch: bool,
    pub(super) resource_version: Option<String>,
    pub(super) timeout: Option<Duration>,
    pub(super) bookmarks: bool,
    pub(super) send_initial_events: bool,
    pub(super) labels: LabelSelector,
    pub(super) fields: FieldSelector,
    pub(super) limit: Option<usize>,
    pub(super) continue_token: Option<String>,
}

impl Params {
    pub(super) fn parse(query: &[(String, String)]) -> Result<Params, String> {
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
    pub(super) fn watch_start(&self) -> Result<Option<u64>, String> {
        match self.resource_version.as_deref() {
            None | Some("0") => Ok(None),
            Some(rv) => parse_number("resourceVersion", rv).map(Some),
        }
    }
}

pub(super) fn parse_bool(name: &str, value: &str) -> Result<bool, String> {
    match value.to_ascii_lowercase().as_str() {
        "true" | "1" | "t" => Ok(true),
        "" | "false" | "0" | "f" => Ok(false),
        _ => Err(format!("invalid {name}: {value:?}")),
    }
}

pub(super) fn parse_number<T: std::str::FromStr>(name: &str, value: &str) -> Result<T, String> {
    value
        .parse()
        .map_err(|_| format!("invalid {name}: {value:?}"))
}
