//! Shared helpers of the integration tests.

#![allow(dead_code)]

pub mod gateway;
pub mod prometheus;
pub mod tools;
