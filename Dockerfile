# syntax=docker/dockerfile:1
#
# The ray-xds image used by deploy/ (placeholder name ghcr.io/ray-xds/ray-xds:0.1.0),
# for a machine with Docker (BuildKit) that can pull base images:
#   docker build -t registry.example.com/ray-xds:0.1.0 .
#
# Without a daemon or pulls, scripts/build-image.sh builds the same image FROM scratch with
# buildah (the release binary, exactly the libraries it links, passwd/group for 65532, the
# same USER, ENTRYPOINT, CMD and ports), and scripts/check-image.sh inspects it and runs it
# read-only as 65532; CI runs both (scripts/test.sh). This Dockerfile itself is not built
# there (its base images cannot be pulled). Only the `ray-xds` binary goes in (no Envoy,
# no simulator).

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
