//! Ray Serve's own gRPC API (`proto/ray/serve/serve.proto`, compiled by `build.rs`): the
//! `ray.serve.RayServeAPIService` that every Ray Serve gRPC proxy answers (`Healthz`,
//! `ListApplications`). The prober calls it; the simulator serves it. Wire-compatible
//! with Ray 2.60: the package, service, method names and field numbers are Ray's.

#![allow(clippy::all, clippy::too_many_lines, missing_docs)]

tonic::include_proto!("ray.serve");

/// The gRPC path of `Healthz`, as Ray's proxy recognises it (the tests check the
/// generated client against it).
#[cfg(test)]
const HEALTHZ_PATH: &str = "/ray.serve.RayServeAPIService/Healthz";
/// The gRPC path of `ListApplications`.
#[cfg(test)]
const LIST_APPLICATIONS_PATH: &str = "/ray.serve.RayServeAPIService/ListApplications";

#[cfg(test)]
mod tests {
    use super::*;
    use prost::Message;

    #[test]
    fn messages_have_ray_s_field_numbers() {
        // Field 1, length-delimited: tag 0x0a.
        let healthz = HealthzResponse {
            message: "success".into(),
        };
        assert_eq!(healthz.encode_to_vec(), b"\x0a\x07success");
        let apps = ListApplicationsResponse {
            application_names: vec!["a".into(), "bc".into()],
        };
        assert_eq!(apps.encode_to_vec(), b"\x0a\x01a\x0a\x02bc");
        assert!(HealthzRequest {}.encode_to_vec().is_empty());
    }

    #[tokio::test]
    async fn a_client_and_a_server_meet_on_ray_s_paths() {
        use ray_serve_api_service_server::{RayServeApiService, RayServeApiServiceServer};
        struct Healthy;
        #[tonic::async_trait]
        impl RayServeApiService for Healthy {
            async fn list_applications(
                &self,
                _: tonic::Request<ListApplicationsRequest>,
            ) -> Result<tonic::Response<ListApplicationsResponse>, tonic::Status> {
                Ok(tonic::Response::new(ListApplicationsResponse {
                    application_names: vec!["hello".into()],
                }))
            }
            async fn healthz(
                &self,
                _: tonic::Request<HealthzRequest>,
            ) -> Result<tonic::Response<HealthzResponse>, tonic::Status> {
                Ok(tonic::Response::new(HealthzResponse {
                    message: "success".into(),
                }))
            }
        }
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let address = listener.local_addr().unwrap();
        let server = tokio::spawn(
            tonic::transport::Server::builder()
                .add_service(RayServeApiServiceServer::new(Healthy))
                .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener)),
        );
        // The path on the wire is Ray's: call it by hand, as a prober that knows only the
        // path would.
        let channel = tonic::transport::Endpoint::from_shared(format!("http://{address}"))
            .unwrap()
            .connect()
            .await
            .unwrap();
        let mut grpc = tonic::client::Grpc::new(channel);
        grpc.ready().await.unwrap();
        let answer: tonic::Response<HealthzResponse> = grpc
            .unary(
                tonic::Request::new(HealthzRequest {}),
                HEALTHZ_PATH.parse().unwrap(),
                tonic_prost::ProstCodec::default(),
            )
            .await
            .unwrap();
        assert_eq!(answer.into_inner().message, "success");
        let mut client = ray_serve_api_service_client::RayServeApiServiceClient::connect(format!(
            "http://{address}"
        ))
        .await
        .unwrap();
        let apps = client
            .list_applications(ListApplicationsRequest {})
            .await
            .unwrap()
            .into_inner();
        assert_eq!(apps.application_names, ["hello"]);
        assert_eq!(
            LIST_APPLICATIONS_PATH,
            "/ray.serve.RayServeAPIService/ListApplications"
        );
        server.abort();
    }
}
