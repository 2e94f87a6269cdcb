//! Shared helpers for the integration tests: real servers on free loopback ports, stopped by PID
//! when the helper is dropped (also when a test fails).

#![allow(dead_code)]

pub mod gateway;
pub mod http;
pub mod redis;

/// A free loopback port: bind port 0, read it, release it. The caller binds it again at once.
pub fn free_port() -> u16 {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind 127.0.0.1:0");
    listener.local_addr().expect("local_addr").port()
}

/// Fails loudly when a server binary the test needs is missing (CI installs them all).
pub fn require_binary(name: &str, package: &str) -> std::path::PathBuf {
    let found = std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths)
            .chain(["/usr/sbin".into(), "/sbin".into()])
            .map(|dir| dir.join(name))
            .find(|p| p.is_file())
    });
    found.unwrap_or_else(|| {
        panic!("`{name}` not found: install {package} (apt-get install {package})")
    })
}
