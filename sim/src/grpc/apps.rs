//! What the simulated applications answer over gRPC: `ray.serve.RayServeAPIService`
//! (`ListApplications`, `Healthz`) on a proxy that takes traffic, and the demo
//! application `ray_xds.demo.Echo`, whose every answer says who served it.
//!
//! Invariant: an answer names the node and application that served it, so tests can
//! tell where a call went.

use super::*;

/// `ray.serve.RayServeAPIService` on a proxy that takes traffic (the modes that say
/// otherwise answered before the call got here).
pub(super) struct RayServeApi {
    pub(super) node: Arc<Node>,
}

#[tonic::async_trait]
impl RayServeApiService for RayServeApi {
    async fn list_applications(
        &self,
        _: tonic::Request<ListApplicationsRequest>,
    ) -> Result<tonic::Response<ListApplicationsResponse>, Status> {
        Ok(tonic::Response::new(ListApplicationsResponse {
            application_names: self.node.applications.clone(),
        }))
    }

    async fn healthz(
        &self,
        _: tonic::Request<HealthzRequest>,
    ) -> Result<tonic::Response<HealthzResponse>, Status> {
        Ok(tonic::Response::new(HealthzResponse {
            message: HEALTHY_MESSAGE.into(),
        }))
    }
}

/// The demo application, `ray_xds.demo.Echo`: every answer says who served it.
pub(super) struct EchoApp {
    pub(super) node: Arc<Node>,
}

pub(super) type Answers = Pin<Box<dyn Stream<Item = Result<Served, Status>> + Send + 'static>>;

impl EchoApp {
    /// The application [`call`] routed the call to.
    fn app<T>(request: &tonic::Request<T>) -> Result<String, Status> {
        request
            .extensions()
            .get::<SelectedApp>()
            .map(|a| a.0.clone())
            .ok_or_else(|| Status::internal("no application was selected for this call"))
    }

    /// Makes the answers of a call to `app`.
    fn server(&self, app: String) -> impl Fn(String, u32) -> Served + Send + Sync + 'static {
        let node = self.node.clone();
        move |text, index| Served {
            cluster: node.config.cluster.clone(),
            proxy: node.address.to_string(),
            node_type: node.config.node_type.as_str().into(),
            app: app.clone(),
            text,
            index,
        }
    }
}

#[tonic::async_trait]
impl Echo for EchoApp {
    async fn say(
        &self,
        request: tonic::Request<SayRequest>,
    ) -> Result<tonic::Response<Served>, Status> {
        let served = self.server(Self::app(&request)?);
        Ok(tonic::Response::new(served(request.into_inner().text, 0)))
    }

    type SayManyStream = Answers;

    async fn say_many(
        &self,
        request: tonic::Request<SayManyRequest>,
    ) -> Result<tonic::Response<Answers>, Status> {
        let served = self.server(Self::app(&request)?);
        let SayManyRequest {
            text,
            count,
            every_ms,
        } = request.into_inner();
        let every = Duration::from_millis(every_ms.into());
        let answers = futures_util::stream::unfold(0u32, move |index| {
            let answer = (index < count).then(|| served(text.clone(), index));
            async move {
                let answer = answer?;
                if index > 0 {
                    tokio::time::sleep(every).await;
                }
                Some((Ok(answer), index + 1))
            }
        });
        Ok(tonic::Response::new(Box::pin(answers)))
    }

    type ChatStream = Answers;

    async fn chat(
        &self,
        request: tonic::Request<tonic::Streaming<SayRequest>>,
    ) -> Result<tonic::Response<Answers>, Status> {
        let served = self.server(Self::app(&request)?);
        let answers = request.into_inner().enumerate().map(move |(index, said)| {
            let index = u32::try_from(index).unwrap_or(u32::MAX);
            said.map(|said| served(said.text, index))
        });
        Ok(tonic::Response::new(Box::pin(answers)))
    }
}
