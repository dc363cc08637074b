//! The simulated Ray Serve proxy answers like the real one: checked against the captures
//! of a real Ray 2.60 proxy in `tests/fixtures/ray-serve-2.60/`.

mod support;

use std::collections::BTreeMap;
use std::path::PathBuf;

use ray_xds::model::NodeType;
use ray_xds::sim::{serve_proxy, ProxyConfig};

struct Capture {
    status: u16,
    headers: BTreeMap<String, String>,
    body: String,
}

fn capture(name: &str) -> Capture {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/ray-serve-2.60")
        .join(name);
    let text = std::fs::read_to_string(&path).unwrap();
    let (head, body) = text
        .split_once("\n\n")
        .or_else(|| text.split_once("\r\n\r\n"))
        .unwrap();
    let mut lines = head.lines();
    let status = lines
        .next()
        .unwrap()
        .split_whitespace()
        .nth(1)
        .unwrap()
        .parse()
        .unwrap();
    let headers = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_ascii_lowercase(), v.trim().to_string()))
        .collect();
    Capture {
        status,
        headers,
        body: body.trim_end_matches('\n').to_string(),
    }
}

async fn get(addr: std::net::SocketAddr, path: &str) -> (u16, BTreeMap<String, String>, String) {
    use http_body_util::BodyExt;
    let stream = tokio::net::TcpStream::connect(addr).await.unwrap();
    let (mut sender, conn) =
        hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream))
            .await
            .unwrap();
    tokio::spawn(conn);
    let req = hyper::Request::get(path)
        .header("host", "x")
        .body(http_body_util::Empty::<hyper::body::Bytes>::new())
        .unwrap();
    let resp = sender.send_request(req).await.unwrap();
    let status = resp.status().as_u16();
    let headers = resp
        .headers()
        .iter()
        .map(|(k, v)| (k.as_str().to_string(), v.to_str().unwrap().to_string()))
        .collect();
    let body = String::from_utf8(
        resp.into_body()
            .collect()
            .await
            .unwrap()
            .to_bytes()
            .to_vec(),
    )
    .unwrap();
    (status, headers, body)
}

async fn sim_with_hello() -> std::net::SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let config = ProxyConfig {
        cluster: "c".into(),
        node_type: NodeType::Head,
        // The captured proxy served one application, `hello`, at `/hello`.
        routes: BTreeMap::from([("/hello".to_string(), "hello".to_string())]),
    };
    tokio::spawn(serve_proxy(listener, config, Default::default()));
    addr
}

#[tokio::test]
async fn healthz_matches_the_capture() {
    let want = capture("02-healthz.txt");
    let (status, headers, body) = get(sim_with_hello().await, "/-/healthz").await;
    assert_eq!(status, want.status);
    assert_eq!(body, want.body);
    for h in ["content-type", "server"] {
        assert_eq!(headers.get(h), want.headers.get(h), "{h}");
    }
}

#[tokio::test]
async fn routes_matches_the_capture() {
    let want = capture("02-routes.txt");
    let (status, headers, body) = get(sim_with_hello().await, "/-/routes").await;
    assert_eq!(status, want.status);
    let got: serde_json::Value = serde_json::from_str(&body).unwrap();
    let expected: serde_json::Value = serde_json::from_str(&want.body).unwrap();
    assert_eq!(got, expected);
    for h in ["content-type", "server"] {
        assert_eq!(headers.get(h), want.headers.get(h), "{h}");
    }
}

#[tokio::test]
async fn unknown_paths_are_404_and_apps_say_who_served() {
    let addr = sim_with_hello().await;
    let (status, _, _) = get(addr, "/nope").await;
    assert_eq!(status, 404);
    let (status, _, body) = get(addr, "/hello/world").await;
    assert_eq!(status, 200);
    let served: ray_xds::sim::Served = serde_json::from_str(&body).unwrap();
    assert_eq!(
        (
            served.app.as_str(),
            served.cluster.as_str(),
            served.node_type.as_str()
        ),
        ("hello", "c", "head")
    );
    assert_eq!(served.proxy, addr.to_string());
}
