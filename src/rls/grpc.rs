//! The gRPC listener: `envoy.service.ratelimit.v3.RateLimitService` (the server trait generated
//! in `envoy-types`) and the standard health service, which reports the service name
//! `ratelimit` (as envoyproxy/ratelimit does) and the empty name (the whole server).

use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_server::{
    RateLimitService, RateLimitServiceServer,
};
use envoy_types::pb::envoy::service::ratelimit::v3::{RateLimitRequest, RateLimitResponse};
use tokio::net::TcpListener;
use tokio::sync::watch;
use tonic::transport::server::TcpIncoming;
use tonic::{Request, Response, Status};
use tonic_health::ServingStatus;

use super::decide::{RlsError, RlsService};

/// The service name health checks ask about.
pub const HEALTH_SERVICE_NAME: &str = "ratelimit";

#[tonic::async_trait]
impl RateLimitService for RlsService {
    async fn should_rate_limit(
        &self,
        request: Request<RateLimitRequest>,
    ) -> Result<Response<RateLimitResponse>, Status> {
        match RlsService::should_rate_limit(self, request.get_ref()).await {
            Ok(response) => Ok(Response::new(response)),
            Err(e) => Err(status(&e)),
        }
    }
}

/// The gRPC status of an error. `UNAVAILABLE` lets Envoy apply its `failure_mode_deny`.
fn status(e: &RlsError) -> Status {
    match e {
        RlsError::Invalid(message) => Status::invalid_argument(message.clone()),
        RlsError::Store(_) | RlsError::NotConfigured => Status::unavailable(e.to_string()),
    }
}

/// Serves the rate limit and health services on `listener` until `shutdown` changes. Health turns
/// `NOT_SERVING` as soon as shutdown begins, so Envoy stops routing to us before we stop.
pub async fn serve(
    listener: TcpListener,
    service: RlsService,
    mut shutdown: watch::Receiver<bool>,
) -> Result<(), tonic::transport::Error> {
    let (reporter, health) = tonic_health::server::health_reporter();
    reporter
        .set_service_status(HEALTH_SERVICE_NAME, ServingStatus::Serving)
        .await;
    reporter
        .set_service_status("", ServingStatus::Serving)
        .await;
    let incoming = TcpIncoming::from(listener).with_nodelay(Some(true));
    let signal = async move {
        let _ = shutdown.changed().await;
        reporter
            .set_service_status(HEALTH_SERVICE_NAME, ServingStatus::NotServing)
            .await;
        reporter
            .set_service_status("", ServingStatus::NotServing)
            .await;
    };
    tonic::transport::Server::builder()
        .add_service(health)
        .add_service(RateLimitServiceServer::new(service))
        .serve_with_incoming_shutdown(incoming, signal)
        .await
}
