//! `ray-xds status`: what a running replica serves and what each Envoy holds, read from
//! its admin API (`/debug/state` and `/debug/clients`), as a table or as JSON.
//!
//! Per RayService: the cluster serving it, the one traffic moves to, the switch's phase,
//! the weights and why it waits. Per connected Envoy (like `istioctl proxy-status`): its
//! node id, the version it ACKed of each type, whether it holds the current snapshot,
//! and anything it NACKed. `render` is pure (the page texts in, the output out); `run`
//! only fetches.
//!
//! Invariant: every field read may be missing or of another type (an older or newer
//! replica, a page cut short): it shows as `-`, never a panic. A page that cannot be
//! read or is not JSON is named with its error where its part would be (`services_error`
//! or `envoys_error` in JSON, its list `null`), and the other page is still shown, with
//! exit status 3: `status` fails (1) only when neither page could be read.

use std::fmt::Write as _;
use std::time::Duration;

use serde_json::{json, Value};

pub use crate::config::{StatusArgs, StatusOutput as Output};

/// How long each page may take to arrive whole (a 16 MiB page through `kubectl
/// port-forward` takes seconds).
const PAGE_TIMEOUT: Duration = Duration::from_secs(30);

/// The most of an error page's text shown.
const ERROR_TEXT_SHOWN: usize = 1024;

/// The largest page read (`/debug/clients` stops at 16 MiB; `/debug/state` is smaller).
const MAX_PAGE_BYTES: usize = 64 * 1024 * 1024;

/// What `status` prints, and whether a page was missing from it.
#[derive(Debug)]
pub struct Rendered {
    pub text: String,
    /// One page could not be read: its part shows why instead.
    pub partial: bool,
}

/// Fetches both pages from `args.admin` and renders them.
pub async fn run(args: &StatusArgs) -> anyhow::Result<Rendered> {
    let base = args.admin.trim_end_matches('/');
    let (state_url, clients_url) = (
        format!("{base}/debug/state"),
        format!("{base}/debug/clients"),
    );
    let (state, clients) = tokio::join!(fetch(&state_url), fetch(&clients_url));
    render(
        state.as_deref().map_err(|e| format!("{e:#}")),
        clients.as_deref().map_err(|e| format!("{e:#}")),
        args.output,
    )
}

async fn fetch(url: &str) -> anyhow::Result<String> {
    use anyhow::Context as _;
    use http_body_util::{BodyExt, Empty, Limited};
    let uri: http::Uri = url.parse().with_context(|| format!("{url}: not a URL"))?;
    anyhow::ensure!(
        uri.scheme_str() == Some("http"),
        "{url}: the admin port speaks plain HTTP only (http://host:port)"
    );
    let client = hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
        .build_http::<Empty<bytes::Bytes>>();
    let page = async {
        let response = client
            .get(uri)
            .await
            .with_context(|| format!("{url}: no answer"))?;
        let status = response.status();
        let body = Limited::new(response.into_body(), MAX_PAGE_BYTES)
            .collect()
            .await
            .map_err(|e| anyhow::anyhow!("{url}: reading the page: {e}"))?
            .to_bytes();
        let text = String::from_utf8_lossy(&body).into_owned();
        anyhow::ensure!(
            status.is_success(),
            "{url}: {status}: {}",
            printable(text.trim())
                .chars()
                .take(ERROR_TEXT_SHOWN)
                .collect::<String>()
        );
        Ok(text)
    };
    tokio::time::timeout(PAGE_TIMEOUT, page)
        .await
        .map_err(|_| anyhow::anyhow!("{url}: no whole page within {PAGE_TIMEOUT:?}"))?
}

/// The two pages' texts (or why each could not be read) as `output`; an error only when
/// neither page is readable JSON.
pub fn render(
    state: Result<&str, String>,
    clients: Result<&str, String>,
    output: Output,
) -> anyhow::Result<Rendered> {
    let parse = |page: &str, text: Result<&str, String>| -> Result<Value, String> {
        let text = text?;
        serde_json::from_str(text).map_err(|e| format!("/debug/{page} is not JSON: {e}"))
    };
    let state = parse("state", state);
    let clients = parse("clients", clients);
    if let (Err(state), Err(clients)) = (&state, &clients) {
        anyhow::bail!("{state}; {clients}");
    }
    let empty = Value::Null;
    let clients_page = clients.as_ref().unwrap_or(&empty);
    let partial = state.is_err() || clients.is_err();
    // A page that could not be read lists nothing: `null`, not an empty list, so that a
    // script's "every Envoy is in sync" does not hold over Envoys it never saw.
    let services: Option<Vec<Value>> = state
        .as_ref()
        .ok()
        .map(|page| list(&page["rayservices"]).iter().map(service).collect());
    let envoys: Option<Vec<Value>> = clients
        .as_ref()
        .ok()
        .map(|page| list(&page["clients"]).iter().map(envoy).collect());
    let status = json!({
        "services": services,
        "services_error": state.as_ref().err(),
        "envoys": envoys,
        "envoys_error": clients.as_ref().err(),
        "envoys_total": clients_page["total"],
        "envoys_truncated": clients_page["truncated"],
    });
    let text = match output {
        Output::Json => format!("{status:#}\n"),
        Output::Table => table(&status),
    };
    Ok(Rendered { text, partial })
}

fn list(v: &Value) -> &[Value] {
    v.as_array().map(Vec::as_slice).unwrap_or_default()
}

/// A field as the table prints it: `-` when missing, control characters (a newline that
/// would fake a row, a terminal escape) as `?`.
fn text(v: &Value) -> String {
    match v {
        Value::String(s) => printable(s),
        Value::Null => "-".into(),
        other => printable(&other.to_string()),
    }
}

fn printable(s: &str) -> String {
    s.chars()
        .map(|c| if c.is_control() { '?' } else { c })
        .collect()
}

/// One RayService of `/debug/state`, as `status` reports it.
fn service(s: &Value) -> Value {
    let switch = &s["switchover"];
    let weights: Vec<Value> = list(&switch["weights"])
        .iter()
        .map(|w| json!({"cluster": w[0], "percent": w[1]}))
        .collect();
    json!({
        "name": s["name"],
        "serving": switch["serving"],
        "target": switch["target"],
        "phase": switch["phase"],
        "reason": switch["reason"],
        "weights": weights,
        "control": switch["control"],
        "rolled_back": !switch["rollback"].is_null(),
        "applications_switching": s["application_switchovers"].as_object().map_or(0, |a| a.len()),
    })
}

/// One client of `/debug/clients`, as `status` reports it.
fn envoy(c: &Value) -> Value {
    let types = c["types"].as_object();
    let acked: serde_json::Map<String, Value> = types
        .into_iter()
        .flatten()
        .map(|(ty, t)| (ty.clone(), t["last_acked_version"].clone()))
        .collect();
    let nacked: serde_json::Map<String, Value> = types
        .into_iter()
        .flatten()
        .filter(|(_, t)| !t["last_nacked_version"].is_null())
        .map(|(ty, t)| {
            (
                ty.clone(),
                json!({"version": t["last_nacked_version"], "message": t["last_nack_message"]}),
            )
        })
        .collect();
    json!({
        "node": c["node"]["id"],
        "stream_id": c["stream_id"],
        "protocol": c["protocol"],
        "in_sync": c["in_sync"],
        "acked": acked,
        "nacked": nacked,
    })
}

/// A version as the table shows it: its first 12 characters (versions are hashes).
fn short(v: &Value) -> String {
    let t = text(v);
    t.chars().take(12).collect()
}

fn table(status: &Value) -> String {
    let mut rows = vec![vec![
        "RAYSERVICE".to_string(),
        "PHASE".into(),
        "SERVING".into(),
        "TARGET".into(),
        "WEIGHTS".into(),
    ]];
    let mut reasons = Vec::new();
    for s in list(&status["services"]) {
        let weights: Vec<String> = list(&s["weights"])
            .iter()
            .map(|w| format!("{}={}%", text(&w["cluster"]), text(&w["percent"])))
            .collect();
        let mut phase = text(&s["phase"]);
        if !s["control"].is_null() {
            phase = format!("{phase} ({})", text(&s["control"]));
        }
        rows.push(vec![
            text(&s["name"]),
            phase,
            text(&s["serving"]),
            text(&s["target"]),
            weights.join(" "),
        ]);
        reasons.push(format!("{}: {}", text(&s["name"]), text(&s["reason"])));
    }
    let mut out = columns(&rows);
    if let Some(error) = status["services_error"].as_str() {
        let _ = writeln!(out, "(unavailable: {})", printable(error));
    }
    if !reasons.is_empty() {
        out.push('\n');
        for r in reasons {
            let _ = writeln!(out, "{r}");
        }
    }
    out.push('\n');
    let types = ["cds", "eds", "lds", "rds"];
    let mut rows = vec![["ENVOY", "STREAM", "PROTOCOL", "SYNCED"]
        .iter()
        .map(|h| h.to_string())
        .chain(types.iter().map(|t| t.to_uppercase()))
        .chain(std::iter::once("NACKED".to_string()))
        .collect::<Vec<_>>()];
    for e in list(&status["envoys"]) {
        let nacked: Vec<String> = e["nacked"]
            .as_object()
            .into_iter()
            .flatten()
            .map(|(ty, n)| {
                let message = text(&n["message"]);
                let message: String = message.chars().take(80).collect();
                format!("{ty} {}: {message}", short(&n["version"]))
            })
            .collect();
        let synced = match e["in_sync"].as_bool() {
            Some(true) => "SYNCED",
            Some(false) => "STALE",
            None => "-",
        };
        let mut row = vec![
            text(&e["node"]),
            text(&e["stream_id"]),
            text(&e["protocol"]),
            synced.to_string(),
        ];
        row.extend(types.iter().map(|t| short(&e["acked"][*t])));
        row.push(if nacked.is_empty() {
            "-".into()
        } else {
            nacked.join("; ")
        });
        rows.push(row);
    }
    out.push_str(&columns(&rows));
    if let Some(error) = status["envoys_error"].as_str() {
        let _ = writeln!(out, "(unavailable: {})", printable(error));
    }
    if status["envoys_truncated"] == true {
        let _ = writeln!(
            out,
            "(the page was cut: {} of {} Envoys shown)",
            list(&status["envoys"]).len(),
            text(&status["envoys_total"])
        );
    }
    out
}

/// Rows as left-aligned columns two spaces apart; the last column unpadded.
fn columns(rows: &[Vec<String>]) -> String {
    let width = rows.iter().map(Vec::len).max().unwrap_or(0);
    let widths: Vec<usize> = (0..width)
        .map(|i| {
            rows.iter()
                .filter_map(|r| r.get(i))
                .map(|c| c.chars().count())
                .max()
                .unwrap_or(0)
        })
        .collect();
    let mut out = String::new();
    for row in rows {
        let last = row.len().saturating_sub(1);
        for (i, cell) in row.iter().enumerate() {
            if i == last {
                out.push_str(cell);
            } else {
                let _ = write!(out, "{cell:<w$}  ", w = widths[i]);
            }
        }
        out.push('\n');
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    const STATE: &str = r#"{"rayservices": [
        {"name": "ml/text", "switchover": {"serving": "text-a", "target": "text-b",
          "phase": "shifting", "reason": "text-b has 25% by ready capacity",
          "weights": [["text-a", 75], ["text-b", 25]], "control": "hold"},
         "application_switchovers": {}},
        {"name": "default/demo", "switchover": {"serving": "demo-a", "target": null,
          "phase": "stable", "reason": "serving demo-a", "weights": [["demo-a", 100]]}}
    ]}"#;
    const CLIENTS: &str = r#"{"total": 3, "clients": [
        {"stream_id": 1, "protocol": "sotw", "node": {"id": "gw-1"}, "in_sync": true,
         "types": {"cds": {"last_acked_version": "0123456789abcdef"},
                   "eds": {"last_acked_version": "fedcba9876543210"}}},
        {"stream_id": 2, "protocol": "delta", "node": {"id": "gw-2"}, "in_sync": false,
         "types": {"cds": {"last_acked_version": "0123456789abcdef",
                           "last_nacked_version": "aaaabbbbccccdddd",
                           "last_nack_message": "cannot bind 0.0.0.0:80"}}}
    ], "shown": 2, "truncated": true}"#;

    #[test]
    fn a_table_shows_each_service_and_envoy_with_what_it_nacked() {
        let out = render(Ok(STATE), Ok(CLIENTS), Output::Table).unwrap().text;
        let lines: Vec<&str> = out.lines().collect();
        assert!(lines[0].starts_with("RAYSERVICE    PHASE"), "{out}");
        assert!(
            lines[1].contains("ml/text")
                && lines[1].contains("shifting (hold)")
                && lines[1].ends_with("text-a=75% text-b=25%"),
            "{out}"
        );
        assert!(
            lines[2].contains("default/demo") && lines[2].contains("stable"),
            "{out}"
        );
        assert!(
            out.contains("ml/text: text-b has 25% by ready capacity"),
            "{out}"
        );
        let gw1 = lines.iter().find(|l| l.starts_with("gw-1")).unwrap();
        assert!(
            gw1.contains("SYNCED") && gw1.contains("0123456789ab  fedcba987654"),
            "{out}"
        );
        assert!(gw1.ends_with('-'), "{out}");
        let gw2 = lines.iter().find(|l| l.starts_with("gw-2")).unwrap();
        assert!(
            gw2.contains("STALE") && gw2.ends_with("cds aaaabbbbcccc: cannot bind 0.0.0.0:80"),
            "{out}"
        );
        assert!(
            out.contains("(the page was cut: 2 of 3 Envoys shown)"),
            "{out}"
        );
    }

    #[test]
    fn json_keeps_every_field_for_scripts() {
        let out: Value =
            serde_json::from_str(&render(Ok(STATE), Ok(CLIENTS), Output::Json).unwrap().text)
                .unwrap();
        assert_eq!(
            out["services"][0]["weights"][1],
            json!({"cluster": "text-b", "percent": 25})
        );
        assert_eq!(out["services"][0]["control"], "hold");
        assert_eq!(
            out["envoys"][1]["nacked"]["cds"]["message"],
            "cannot bind 0.0.0.0:80"
        );
        assert_eq!(out["envoys"][0]["acked"]["eds"], "fedcba9876543210");
        assert_eq!(out["envoys_truncated"], true);
    }

    #[test]
    fn pages_of_another_shape_show_dashes_and_garbage_is_an_error_naming_the_page() {
        for (state, clients) in [
            ("{}", "{}"),
            (
                r#"{"rayservices": 3}"#,
                r#"{"clients": [1, "x", null, {"types": 5}]}"#,
            ),
            (
                r#"{"rayservices": [{"switchover": {"weights": [[1], "x"]}}]}"#,
                r#"{"clients": [{}]}"#,
            ),
        ] {
            render(Ok(state), Ok(clients), Output::Table).unwrap();
            render(Ok(state), Ok(clients), Output::Json).unwrap();
        }
        let err = render(Ok("<html>"), Ok(""), Output::Table).unwrap_err();
        assert!(
            err.to_string().starts_with("/debug/state is not JSON")
                && err.to_string().contains("; /debug/clients is not JSON"),
            "{err}"
        );
        // A node id that would fake a row or drive the terminal prints as one line.
        let hostile =
            r#"{"clients": [{"node": {"id": "evil\nfake-row\u001b[2J"}, "stream_id": 9}]}"#;
        let out = render(Ok("{}"), Ok(hostile), Output::Table).unwrap().text;
        assert!(out.contains("evil?fake-row?[2J"), "{out}");
        assert!(!out.lines().any(|l| l.starts_with("fake-row")), "{out}");
    }

    /// One page unreadable (a replica killed mid-read, a proxy's error page): the other
    /// is still shown, and the missing part says why in its place.
    #[test]
    fn one_unreadable_page_leaves_the_other_shown_with_the_reason() {
        let no_clients = Err("http://x/debug/clients: 503 Service Unavailable: busy".to_string());
        let table = render(Ok(STATE), no_clients.clone(), Output::Table).unwrap();
        assert!(table.partial);
        let out = table.text;
        assert!(
            out.contains("ml/text") && out.contains("shifting (hold)"),
            "{out}"
        );
        let mut envoys = out.lines().skip_while(|l| !l.starts_with("ENVOY"));
        let header = envoys.next().unwrap();
        assert!(
            header.starts_with("ENVOY  STREAM"),
            "the header keeps its widths: {out}"
        );
        assert_eq!(
            envoys.next(),
            Some("(unavailable: http://x/debug/clients: 503 Service Unavailable: busy)"),
            "{out}"
        );
        let json = render(Ok(STATE), no_clients, Output::Json).unwrap();
        assert!(json.partial);
        let json: Value = serde_json::from_str(&json.text).unwrap();
        assert_eq!(json["services"][1]["name"], "default/demo");
        assert!(json["services_error"].is_null());
        assert!(json["envoys"].is_null(), "unknown, not none: {json}");
        assert_eq!(
            json["envoys_error"],
            "http://x/debug/clients: 503 Service Unavailable: busy"
        );
        let out = render(Ok("<html>"), Ok(CLIENTS), Output::Table).unwrap();
        assert!(out.partial);
        assert!(
            out.text.contains("(unavailable: /debug/state is not JSON"),
            "{}",
            out.text
        );
        assert!(
            out.text.lines().any(|l| l.starts_with("gw-1")),
            "{}",
            out.text
        );
        let whole = render(Ok(STATE), Ok(CLIENTS), Output::Json).unwrap();
        assert!(!whole.partial);
    }
}
