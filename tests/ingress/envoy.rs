//! Envoy ext_authz: to come.
