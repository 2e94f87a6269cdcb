//! The protocol's messages: the shares' actions as `BucketAction`s.

use envoy_types::pb::envoy::r#type::v3::rate_limit_strategy::{BlanketRule, Strategy};
use envoy_types::pb::envoy::r#type::v3::{RateLimitStrategy, TokenBucket};
use envoy_types::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_response::bucket_action::{
    AbandonAction, BucketAction as Kind, QuotaAssignmentAction,
};
use envoy_types::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_response::BucketAction;
use envoy_types::pb::envoy::service::rate_limit_quota::v3::{BucketId, RateLimitQuotaResponse};
use envoy_types::pb::google::protobuf::{Duration as PbDuration, UInt32Value};

use crate::limiter::quota::{Action, Assignment, BucketKey, Push, Timing};

/// Bounds on a bucket id before it becomes a key.
pub const MAX_ENTRIES: usize = 16;
pub const MAX_KEY: usize = 128;
pub const MAX_VALUE: usize = 256;

fn bucket_id(key: &BucketKey) -> BucketId {
    BucketId {
        bucket: key.iter().cloned().collect(),
    }
}

fn seconds(s: u32) -> PbDuration {
    PbDuration {
        seconds: i64::from(s),
        nanos: 0,
    }
}

/// The strategy for an assignment: a token bucket (Envoy ignores `requests_per_time_unit`), or
/// a blanket `DENY_ALL` for a share of zero.
fn strategy(assignment: Assignment, timing: Timing) -> RateLimitStrategy {
    let strategy = match assignment {
        Assignment::Deny => Strategy::BlanketRule(BlanketRule::DenyAll as i32),
        Assignment::Bucket {
            tokens_per_fill,
            max_tokens,
        } => Strategy::TokenBucket(TokenBucket {
            max_tokens,
            tokens_per_fill: Some(UInt32Value {
                value: tokens_per_fill,
            }),
            fill_interval: Some(seconds(timing.fill_interval_s)),
        }),
    };
    RateLimitStrategy {
        strategy: Some(strategy),
    }
}

fn assign(key: &BucketKey, strategy: RateLimitStrategy, ttl_s: u32) -> BucketAction {
    BucketAction {
        bucket_id: Some(bucket_id(key)),
        bucket_action: Some(Kind::QuotaAssignmentAction(QuotaAssignmentAction {
            assignment_time_to_live: Some(seconds(ttl_s)),
            rate_limit_strategy: Some(strategy),
        })),
    }
}

/// One response carrying every push for one stream.
pub fn response(pushes: &[Push], timing: Timing) -> RateLimitQuotaResponse {
    let bucket_action = pushes
        .iter()
        .map(|push| match &push.action {
            Action::Assign {
                assignment, ttl_s, ..
            } => assign(&push.bucket, strategy(*assignment, timing), *ttl_s),
            Action::Abandon => BucketAction {
                bucket_id: Some(bucket_id(&push.bucket)),
                bucket_action: Some(Kind::AbandonAction(AbandonAction {})),
            },
        })
        .collect();
    RateLimitQuotaResponse { bucket_action }
}

/// `DENY_ALL` for a bucket the service does not track (no budget, or `max_buckets` reached),
/// given back as it came.
pub fn deny(bucket: BucketId, ttl_s: u32) -> BucketAction {
    let strategy = RateLimitStrategy {
        strategy: Some(Strategy::BlanketRule(BlanketRule::DenyAll as i32)),
    };
    BucketAction {
        bucket_id: Some(bucket),
        bucket_action: Some(Kind::QuotaAssignmentAction(QuotaAssignmentAction {
            assignment_time_to_live: Some(seconds(ttl_s)),
            rate_limit_strategy: Some(strategy),
        })),
    }
}
