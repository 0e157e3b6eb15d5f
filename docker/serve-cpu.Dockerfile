# vae-parallel serve on the CPU. Build from the repository root:
#   docker build -f docker/serve-cpu.Dockerfile -t vae-parallel-serve:cpu .
# Run (models mounted read-only, the token from a file; any non-loopback address needs one):
#   docker run -p 8000:8000 -v /models/sd-vae:/models/sd:ro -v $PWD/token:/run/token:ro \
#       vae-parallel-serve:cpu --model sd=/models/sd --token-file /run/token --ranks 2 --vae-patch-parallel-size 2
FROM rust:1.89-slim-bookworm AS build
WORKDIR /src
COPY . .
RUN cargo build --release -p vae-parallel --bin vae-parallel

FROM debian:bookworm-slim
RUN useradd --system --uid 10001 --no-create-home vae
COPY --from=build /src/target/release/vae-parallel /usr/local/bin/vae-parallel
USER 10001
EXPOSE 8000
ENTRYPOINT ["vae-parallel", "serve", "--listen", "0.0.0.0:8000"]
