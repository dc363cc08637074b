//! The demo's gRPC client: calls `ray_xds.demo.Echo` through Envoy and prints who served
//! each call, as the demo's `curl` loop does for HTTP.
//!
//! `cargo run --example grpc_call -- <envoy ip:port> <calls>` prints one line per call,
//! `<proxy> (<node type>)` or `FAILED <code>`; `... <envoy> stream <n>` makes one
//! server-streaming call of `n` answers and prints each.

use ray_serve_sim::grpc::pb::demo::echo_client::EchoClient;
use ray_serve_sim::grpc::pb::demo::{SayManyRequest, SayRequest};
use std::time::Duration;

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let usage = "usage: grpc_call <ip:port> <calls> | grpc_call <ip:port> stream <answers>";
    let (Some(target), Some(what)) = (args.first(), args.get(1)) else {
        return Err(usage.into());
    };
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{target}"))?
        .timeout(Duration::from_secs(5))
        .connect_lazy();
    let mut client = EchoClient::new(channel);
    if what == "stream" {
        let count: u32 = args.get(2).ok_or(usage)?.parse()?;
        let request = SayManyRequest {
            text: "hi".into(),
            count,
            every_ms: 100,
        };
        let mut stream = client.say_many(request).await?.into_inner();
        while let Some(m) = stream.message().await? {
            println!("answer {} from {} ({})", m.index, m.proxy, m.node_type);
        }
        return Ok(());
    }
    let calls: usize = what.parse().map_err(|_| usage)?;
    for _ in 0..calls {
        let request = SayRequest { text: "hi".into() };
        match client.say(request).await {
            Ok(m) => {
                let m = m.into_inner();
                println!("{} ({})", m.proxy, m.node_type);
            }
            Err(e) => println!("FAILED {:?}", e.code()),
        }
    }
    Ok(())
}
