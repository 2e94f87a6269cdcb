# Turnstile's container image. Built in the official Rust image, run on distroless (glibc and CA
# certificates, no shell, no package manager) as a non-root user.
#
#   docker build -t turnstile .
#   docker run --rm -p 8080:8080 -p 127.0.0.1:9901:9901 \
#     -v "$PWD/policies.yaml:/etc/turnstile/policies.yaml:ro" turnstile
#
# A configuration must listen on 0.0.0.0 (not 127.0.0.1) to be reachable from outside the
# container. Logging: TURNSTILE_LOG (e.g. debug). See docs/observability.md for docker-compose.

# The crate's rust-version (Cargo.toml), which is also the highest the locked dependencies need.
ARG RUST_VERSION=1.88

FROM rust:${RUST_VERSION}-slim-bookworm AS builder
WORKDIR /build

# Dependencies first, in a layer of their own, so that editing the sources does not rebuild them:
# build the locked dependency graph against placeholder sources.
COPY Cargo.toml Cargo.lock ./
RUN mkdir src \
 && echo 'fn main() {}' > src/main.rs \
 && touch src/lib.rs \
 && cargo build --release --locked --bin turnstile \
 && rm -rf src

COPY . .
# COPY keeps the files' own modification times, which can be older than the placeholder build:
# touch the crate roots so that cargo rebuilds the crate itself.
RUN touch src/main.rs src/lib.rs \
 && cargo build --release --locked --bin turnstile \
 && install -D -m 0755 target/release/turnstile /out/turnstile

# The default configuration is the repository's example with both listeners on all of the
# container's interfaces: a container's loopback is reachable from nowhere else, so an admin
# listener there would answer neither `docker run -p 127.0.0.1:9901:9901` nor the kubelet's probes.
# Publish 9901 on the host's loopback only (or not at all). Fail the build if the example no
# longer has the lines to change, and check the result.
RUN sed -e 's/^listen: 127\.0\.0\.1:/listen: 0.0.0.0:/' \
        -e 's/^admin_listen: 127\.0\.0\.1:/admin_listen: 0.0.0.0:/' policies.yaml > /out/policies.yaml \
 && grep -q '^listen: 0\.0\.0\.0:8080' /out/policies.yaml \
 && grep -q '^admin_listen: 0\.0\.0\.0:9901' /out/policies.yaml \
 && /out/turnstile check --config /out/policies.yaml

FROM gcr.io/distroless/cc-debian12:nonroot
COPY --from=builder /out/turnstile /usr/local/bin/turnstile
# The repository's example, so that the image runs as is; mount your own over it.
COPY --from=builder /out/policies.yaml /etc/turnstile/policies.yaml
# distroless' nonroot user, by number so that runtimes can check runAsNonRoot without /etc/passwd.
USER 65532:65532
# 8080: the public proxy listener. 9901: the admin listener (/metrics, /healthz, /readyz, /config,
# /debug/top-limited), never to be published publicly.
EXPOSE 8080 9901
# No shell in the image: the binary is its own probe (exit 0 when /readyz answers 2xx).
HEALTHCHECK --interval=10s --timeout=3s --start-period=5s --retries=3 \
  CMD ["/usr/local/bin/turnstile", "healthcheck", "--url", "http://127.0.0.1:9901/readyz"]
# SIGTERM: stop accepting, drain in-flight requests, exit 0.
STOPSIGNAL SIGTERM
ENTRYPOINT ["/usr/local/bin/turnstile"]
CMD ["run", "--config", "/etc/turnstile/policies.yaml"]
