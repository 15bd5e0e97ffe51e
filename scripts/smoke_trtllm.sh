#!/usr/bin/env bash
# The first thing to run in NVIDIA's TensorRT-LLM Triton container (nvcr.io/nvidia/tritonserver:26.07-trtllm-python-py3,
# TensorRT-LLM 1.2.1: pipeline.trtllm.version.TRITON_CONTAINER), on one GPU, downloading nothing: builds a tiny
# draft-target pair with `pipeline build`, serves it with `pipeline serve` and checks speculation over gRPC
# (scripts/smoke_trtllm.py says what). The engine route it builds needs a release with trtllm-build (1.2.1).
#
#   docker run --rm --gpus all -v "$PWD":/work -w /work nvcr.io/nvidia/tritonserver:26.07-trtllm-python-py3 \
#       scripts/smoke_trtllm.sh [--keep] [--json] [--target DIR --draft DIR] ...
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."

die() {
    echo "smoke_trtllm: $*" >&2
    exit 1
}

for arg in "$@"; do
    if [[ "$arg" == "-h" || "$arg" == "--help" ]]; then
        exec python3 scripts/smoke_trtllm.py --help
    fi
done

# Tried from /, so that this checkout's folder on sys.path doesn't pass for an install.
if ! (cd / && python3 -c 'import pipeline' 2>/dev/null); then
    echo "smoke_trtllm: installing this project into the container's Python (pip install --no-deps -e .)" >&2
    # --no-deps: pyproject pins the CPU wheel torch==2.13.0, which must never replace the container's CUDA torch;
    # the image brings the rest. --no-build-isolation: build with the image's setuptools, fetching nothing.
    python3 -m pip install --no-deps --no-build-isolation -e . >&2 \
        || die "pip install --no-deps --no-build-isolation -e . failed (its output is above)"
fi

missing=$(cd / && python3 -c 'import importlib.util as u, sys; print(" ".join(m for m in sys.argv[1:] if u.find_spec(m) is None))' \
    click transformers modelopt tritonclient)
[[ -z "$missing" ]] || die "Python packages missing from this image: $missing; install them without touching torch (e.g. pip install 'tritonclient[grpc]')"

command -v nvidia-smi >/dev/null || die "no nvidia-smi: run inside NVIDIA's container on a GPU machine"
nvidia-smi -L >/dev/null 2>&1 || die "nvidia-smi sees no GPU: start the container with --gpus all"
# The container the release tables name, so this line can't drift from them.
container=$(cd / && python3 -c 'from pipeline.trtllm.version import TRITON_CONTAINER; print(TRITON_CONTAINER)')
command -v trtllm-build >/dev/null || die "no trtllm-build on PATH (TensorRT-LLM 1.3.0rc21 and later have none): run in $container"
command -v tritonserver >/dev/null || [[ -x /opt/tritonserver/bin/tritonserver ]] \
    || die "no tritonserver on PATH or at /opt/tritonserver/bin/tritonserver: run in NVIDIA's Triton container"
command -v mpirun >/dev/null || die "no mpirun on PATH: TensorRT-LLM's Triton backend serves under MPI; run in NVIDIA's container"

exec python3 scripts/smoke_trtllm.py "$@"
