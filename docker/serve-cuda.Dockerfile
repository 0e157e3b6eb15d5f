# vae-parallel serve on NVIDIA GPUs (the CUDA driver API, NVRTC and NCCL are loaded at run time).
# Build from the repository root (the CUDA kernels are built by `cargo xtask kernels` where nvcc
# exists; without them the work runs on the CPU, with a warning):
#   docker build -f docker/serve-cuda.Dockerfile -t vae-parallel-serve:cuda .
# Run:
#   docker run --gpus all -p 8000:8000 -v /models/wan-vae:/models/wan:ro -v $PWD/token:/run/token:ro \
#       vae-parallel-serve:cuda --model wan=/models/wan --token-file /run/token --device cuda --dtype bf16
FROM nvidia/cuda:12.9.1-devel-ubuntu24.04 AS build
RUN apt-get update && apt-get install -y --no-install-recommends curl ca-certificates build-essential \
    && rm -rf /var/lib/apt/lists/*
RUN curl -sSf https://sh.rustup.rs | sh -s -- -y --profile minimal --default-toolchain 1.89
ENV PATH=/root/.cargo/bin:$PATH
WORKDIR /src
COPY . .
RUN cargo xtask kernels || echo "no CUDA kernels built: the image will compute on the CPU"
RUN cargo build --release -p vae-parallel --bin vae-parallel

FROM nvidia/cuda:12.9.1-runtime-ubuntu24.04
RUN apt-get update && apt-get install -y --no-install-recommends libnccl2 && rm -rf /var/lib/apt/lists/* \
    && useradd --system --uid 10001 --no-create-home vae
COPY --from=build /src/target/release/vae-parallel /usr/local/bin/vae-parallel
USER 10001
EXPOSE 8000
ENTRYPOINT ["vae-parallel", "serve", "--listen", "0.0.0.0:8000"]
