"""Which TensorRT-LLM: the release our commands, YAML and repositories follow, and the one installed here.

Names changed between releases: the LLM API's decoding_type strings differ across 1.2 release candidates
and main (DraftTarget/Eagle in 1.2.1, Draft_Target/Eagle3 on later main), trtllm-build's flags move, and an
engine only loads in the TensorRT-LLM that built it. So `pipeline compile` records the version it wrote
for, and `compile`/`serve` refuse, in one line naming both versions, a TensorRT-LLM that differs in a way
that matters. tensorrtllm_backend's Dockerfile pins its own TensorRT-LLM (TENSORRTLLM_VER), which need not
be the one that built the engines: serve checks the engines' version against the container's.
"""

from __future__ import annotations

import importlib.metadata

from pipeline.errors import ConfigError

# The release the tables in pipeline.triton.upstream and pipeline.compiler.reference follow, and the container that
# serves it (triton-inference-server/tensorrtllm_backend dockerfile/Dockerfile.triton.trt_llm_backend:
# TENSORRTLLM_VER=1.2.1, BASE_IMAGE=nvcr.io/nvidia/tritonserver:25.12-py3-min).
TRTLLM_VERSION = "1.2.1"
TRITON_CONTAINER = "nvcr.io/nvidia/tritonserver:25.12-trtllm-python-py3"  # Triton 25.12 + TensorRT-LLM 1.2.1

# NVIDIA's Triton container layout (pipeline.triton.upstream.DOCKERFILE: WORKDIR /app; COPY triton_backend/...)
CONTAINER_APP = "/app"
CONTAINER_TEMPLATES = "all_models/inflight_batcher_llm"  # under /app
CONTAINER_FILL_TEMPLATE = "tools/fill_template.py"  # under /app
CONTAINER_LAUNCH_SCRIPT = "scripts/launch_triton_server.py"  # under /app
CONTAINER_RUN_PY = "examples/run.py"  # under /app (DOCKERFILE copies examples/)
CONTAINER_LLMAPI_MODEL = "all_models/llmapi/tensorrt_llm"  # under /app: config.pbtxt, 1/model.py, 1/helpers.py
CONTAINER_TRITONSERVER = "/opt/tritonserver/bin/tritonserver"  # upstream.LAUNCH_SCRIPT parse_arguments --tritonserver default

# The releases this pipeline's commands and YAML are written for, by major.minor.
SUPPORTED = ("1.2",)


def installed() -> str | None:
    """tensorrt_llm's version where it is installed (NVIDIA's containers), else None. Reads the package
    metadata only: importing tensorrt_llm initializes CUDA."""
    for dist in ("tensorrt_llm", "tensorrt-llm"):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def release(version: str) -> str:
    """'1.2.1' -> '1.2'; '1.2.0rc8' -> '1.2'."""
    parts = version.split(".")
    return ".".join(parts[:2])


def check_supported(version: str, what: str) -> None:
    """Refuse a TensorRT-LLM whose names this pipeline doesn't know."""
    if release(version) not in SUPPORTED:
        raise ConfigError(f"{what}: TensorRT-LLM {version} is installed, but this pipeline writes for "
                          f"{TRTLLM_VERSION} (its flags and decoding_type names differ across releases); "
                          f"run in {TRITON_CONTAINER}")


def check_same(made_with: str | None, running: str | None, what: str, *, exact: bool) -> None:
    """Refuse serving with a TensorRT-LLM other than the one the artifacts were made with.

    exact: engines (TensorRT plans) load only in the version that built them; the LLM-API YAML needs the
    same release (its decoding_type names)."""
    if made_with is None or running is None:
        return
    same = made_with == running if exact else release(made_with) == release(running)
    if not same:
        fix = ("rebuild them here with `pipeline compile` (or `pipeline build`), or serve in the container "
               "that built them" if exact else f"recompile with `pipeline compile` here, or serve in {TRITON_CONTAINER}")
        raise ConfigError(f"{what} were made with TensorRT-LLM {made_with} but this container has {running}; {fix}")
