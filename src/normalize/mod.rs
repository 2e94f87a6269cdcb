//! The canonical form of a request, computed once before routing (see `docs/normalization.md`).
//!
//! Every spelling of the same resource must meet the same route and the same counter, or a
//! client could reset its own limit by spelling a request differently. So the gateway rewrites
//! each request in place before anything reads it: the path is normalised ([`path`]) and the
//! one authority it is for is written to `Host` ([`host`]). Routing, keys and the upstream then
//! all read the same canonical request. Key values that can be percent-encoded are decoded
//! ([`decode`]) before they name a counter.

pub mod decode;
pub mod host;
pub mod path;

use http::header::HOST;
use http::uri::PathAndQuery;
use http::{HeaderValue, Request, Uri};

pub use host::{canonical_host, request_authority, Authority, HostError};
pub use path::{normalize_path, EscapedSlashes, PathError, PathOptions, PathParameters};

/// Why a request is refused with 400 before routing.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum Rejection {
    #[error(transparent)]
    Path(#[from] PathError),
    #[error(transparent)]
    Host(#[from] HostError),
}

/// Rewrites `req` into its canonical form: a normalised origin-form path (the query as sent) and
/// the canonical authority in `Host`. Allocates only for a request that was not canonical.
pub fn canonicalize<B>(req: &mut Request<B>, opts: PathOptions) -> Result<(), Rejection> {
    let host = match request_authority(req.uri(), req.headers(), req.version())? {
        Authority::None | Authority::HostHeader(_) => None,
        Authority::Rewrite(host) => {
            Some(HeaderValue::from_str(&host).map_err(|_| HostError::Invalid)?)
        }
    };
    if let Some(host) = host {
        req.headers_mut().insert(HOST, host);
    }
    let path = match normalize_path(req.uri().path(), opts)? {
        std::borrow::Cow::Borrowed(_) => return Ok(()),
        std::borrow::Cow::Owned(path) => path,
    };
    let mut target = path;
    if let Some(query) = req.uri().query() {
        target.push('?');
        target.push_str(query);
    }
    // Origin-form: the host is in `Host` now, and the upstream gets origin-form anyway.
    let path_and_query = PathAndQuery::try_from(target).map_err(|_| PathError::BadPercent)?;
    *req.uri_mut() = Uri::from(path_and_query);
    Ok(())
}

#[cfg(test)]
#[path = "tests.rs"]
mod tests;

#[cfg(test)]
#[path = "spelling_tests.rs"]
mod spelling_tests;
