# Turnstile's container image. Built in the official Rust image, run on distroless (glibc and CA
# certificates, no shell, no package manager) as a non-root user.
#
#   docker build -t turnstile .
#   docker run --rm -p 8080:8080 -v "$PWD/policies.yaml:/etc/turnstile/policies.yaml:ro" turnstile
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

# The default configuration is the repository's example, with the public listener on all of the
# container's interfaces (the admin listener stays on the container's loopback). Fail the build if
# the example no longer has the line to change, and check the result.
RUN sed 's/^listen: 127\.0\.0\.1:/listen: 0.0.0.0:/' policies.yaml > /out/policies.yaml \
 && grep -q '^listen: 0\.0\.0\.0:' /out/policies.yaml \
 && /out/turnstile check --config /out/policies.yaml

FROM gcr.io/distroless/cc-debian12:nonroot
COPY --from=builder /out/turnstile /usr/local/bin/turnstile
# The repository's example, so that the image runs as is; mount your own over it.
COPY --from=builder /out/policies.yaml /etc/turnstile/policies.yaml
# distroless' nonroot user, by number so that runtimes can check runAsNonRoot without /etc/passwd.
USER 65532:65532
# 8080: the public proxy listener. 9901: the admin listener (/metrics, /healthz, /readyz,
# /debug/top-limited), never to be published publicly.
EXPOSE 8080 9901
# SIGTERM: stop accepting, drain in-flight requests, exit 0.
STOPSIGNAL SIGTERM
ENTRYPOINT ["/usr/local/bin/turnstile"]
CMD ["run", "--config", "/etc/turnstile/policies.yaml"]
