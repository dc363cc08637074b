# syntax=docker/dockerfile:1
#
# The ray-xds image used by deploy/ (placeholder name ghcr.io/ray-xds/ray-xds:0.1.0):
#   docker build -t registry.example.com/ray-xds:0.1.0 .
#
# NOT built on the development machine: it cannot pull base images, so this file is
# untested there. Only the `ray-xds` binary goes in (no Envoy, no simulator).

# Build: the release binary, with the dependency registry and the target folder cached
# between builds (BuildKit cache mounts).
FROM rust:1-bookworm AS build
WORKDIR /src
COPY . .
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/src/target \
    cargo build --release --locked --bin ray-xds \
    && cp target/release/ray-xds /ray-xds

# Run: glibc and libgcc only (TLS to the API server is rustls), no shell, user 65532.
FROM gcr.io/distroless/cc-debian12:nonroot
COPY --from=build /ray-xds /ray-xds
USER 65532:65532
# 18000: xDS (ADS gRPC); 19000: admin (/healthz, /readyz, /metrics, /debug/*).
EXPOSE 18000 19000
ENTRYPOINT ["/ray-xds"]
CMD ["serve", "--config", "/etc/ray-xds/ray-xds.yaml"]
