"""Which TensorRT-LLM: the releases our commands, YAML and repositories are written for, and the one installed here.

Names change between releases: the LLM API's decoding_type strings (DraftTarget/Eagle in 1.2.1, Draft_Target/Eagle3
in the 1.3/1.4 pre-releases), its speculative_config fields, and from 1.3.0rc21 on the whole TensorRT engine route
(trtllm-build, the tensorrtllm C++ backend, examples/run.py) is gone. An engine only loads in the TensorRT-LLM that
built it. So every release we write for is a `Release` here, with its tables in pipeline.trtllm.reference
(LLM API, trtllm-build) and pipeline.trtllm.upstream (the Triton backend); `pipeline compile` records the version it
wrote for, and `compile`/`serve` refuse, in one line naming both versions, a TensorRT-LLM that differs in a way that
matters.

Where each fact comes from (docs/trtllm.md has the table):
- Which Triton container ships which TensorRT-LLM: triton-inference-server/server docs/introduction/compatibility.md
  @e1db8a60 ("| 26.07 | nvcr.io/nvidia/tritonserver:26.07-trtllm-python-py3 | ... | 1.2.1 |"; 25.12-26.02 ship
  1.1.0, 26.03 1.2.0, 26.04-26.07 1.2.1, and no row ships a 1.3 or 1.4). tensorrtllm_backend's Dockerfile names
  nvcr.io/nvidia/tritonserver:25.12-py3-min only as the image it builds *from*.
- Stable vs pre-release: PyPI's tensorrt-llm index (1.2.1 the newest non-pre release; 1.3.0rc0-rc29, 1.4.0rc0-rc1
  pre-releases) and NVIDIA's docs builds (nvidia.github.io/TensorRT-LLM/1.4.0rc4/).
- The engine route's removal: NVIDIA/TensorRT-LLM release notes v1.3.0rc20 ("This RC version will be the last one
  supporting the TensorRT backend"), PRs #15907 (the Triton C++ backend and its inflight_batcher_llm templates; the
  llmapi model and launch_triton_server.py kept), #15918 (commands/build.py, plugin.py) and #16610 (examples/run.py).
"""

from __future__ import annotations

import importlib.metadata
from dataclasses import dataclass

from packaging.version import Version

from pipeline.errors import ConfigError

# NVIDIA's Triton container layout (pipeline.trtllm.upstream.DOCKERFILE: WORKDIR /app; COPY triton_backend/...)
CONTAINER_APP = "/app"
CONTAINER_TEMPLATES = "all_models/inflight_batcher_llm"  # under /app
CONTAINER_FILL_TEMPLATE = "tools/fill_template.py"  # under /app
CONTAINER_LAUNCH_SCRIPT = "scripts/launch_triton_server.py"  # under /app
CONTAINER_RUN_PY = "examples/run.py"  # under /app (DOCKERFILE copies examples/)
CONTAINER_LLMAPI_MODEL = "all_models/llmapi/tensorrt_llm"  # under /app: config.pbtxt, 1/model.py, 1/helpers.py
CONTAINER_TRITONSERVER = "/opt/tritonserver/bin/tritonserver"  # upstream.LAUNCH_SCRIPT parse_arguments --tritonserver default


def release(version: str) -> str:
    """'1.2.1' -> '1.2'; '1.2.0rc8' -> '1.2'."""
    parts = version.split(".")
    return ".".join(parts[:2])


@dataclass(frozen=True)
class Release:
    """One TensorRT-LLM release this pipeline writes for."""

    version: str  # the version the tables were read at
    stable: bool  # a release PyPI lists without --pre; pre-releases are picked only by name
    container: str | None  # NVIDIA's Triton container that ships it; None: none does (a self-built image)
    engine_route: bool  # trtllm-build and the tensorrtllm C++ backend exist

    @property
    def key(self) -> str:
        return release(self.version)


RELEASES: dict[str, Release] = {r.key: r for r in (
    # 26.04-26.07 ship 1.2.1; 26.07 (Triton 2.71.0) is the newest Triton container with TensorRT-LLM in it.
    Release("1.2.1", stable=True, container="nvcr.io/nvidia/tritonserver:26.07-trtllm-python-py3", engine_route=True),
    # The newest TensorRT-LLM whose LLM-API reference was readable (nvidia.github.io/TensorRT-LLM/1.4.0rc4/). No
    # Triton container ships it; the Triton llmapi model it serves through is kept upstream (PR #15907).
    Release("1.4.0rc4", stable=False, container=None, engine_route=False),
)}
# The default for dry runs and manifests: the newest stable release, the one NVIDIA's newest Triton + TensorRT-LLM
# container ships. A pre-release is written for only when asked (--trtllm-version) or installed.
DEFAULT = max((r for r in RELEASES.values() if r.stable), key=lambda r: Version(r.version))
TRTLLM_VERSION = DEFAULT.version
TRITON_CONTAINER = DEFAULT.container  # Triton 26.07 + TensorRT-LLM 1.2.1


def installed() -> str | None:
    """tensorrt_llm's version where it is installed (NVIDIA's containers), else None. Reads the package
    metadata only: importing tensorrt_llm initializes CUDA."""
    for dist in ("tensorrt_llm", "tensorrt-llm"):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def supported_versions() -> str:
    return ", ".join(f"{r.version}{'' if r.stable else ' (pre-release)'}" for r in RELEASES.values())


def check_supported(version: str, what: str) -> Release:
    """The Release whose names this version takes; a one-line refusal for one this pipeline doesn't know."""
    r = RELEASES.get(release(version))
    if r is None:
        raise ConfigError(f"{what}: TensorRT-LLM {version} is not one this pipeline writes for (its flags and "
                          f"speculative_config names differ across releases); supported: {supported_versions()}. "
                          f"Run in {TRITON_CONTAINER}, or pass --trtllm-version")
    return r


def pick(requested: str | None, found: str | None, what: str) -> str:
    """The version to write for: the installed one (NVIDIA's container), which --trtllm-version must agree with,
    else --trtllm-version, else the default release. A bare "1.4" means that release's recorded version."""
    if requested is not None:
        wanted = check_supported(requested, what)
        requested = wanted.version if requested == wanted.key else requested
        if found is not None and release(found) != wanted.key:
            raise ConfigError(f"{what}: --trtllm-version {requested} but TensorRT-LLM {found} is installed here; "
                              f"drop --trtllm-version, or run where {requested} is installed")
    if found is not None:
        check_supported(found, what)
        return found
    return requested or TRTLLM_VERSION


def for_version(version: str | None) -> Release:
    """The Release of a recorded version (a manifest's tensorrt_llm_version); the default when none is recorded."""
    return DEFAULT if version is None else check_supported(version, "TensorRT-LLM")


def check_same(made_with: str | None, running: str | None, what: str, *, exact: bool) -> None:
    """Refuse serving with a TensorRT-LLM other than the one the artifacts were made with.

    exact: engines (TensorRT plans) load only in the version that built them; the LLM-API YAML needs the
    same release (its decoding_type names)."""
    if made_with is None or running is None:
        return
    same = made_with == running if exact else release(made_with) == release(running)
    if not same:
        container = for_version(made_with).container if release(made_with) in RELEASES else None
        fix = ("rebuild them here with `pipeline compile` (or `pipeline build`), or serve in the container "
               "that built them" if exact else
               f"recompile with `pipeline compile` here, or serve in {container or 'an image with TensorRT-LLM ' + made_with}")
        raise ConfigError(f"{what} were made with TensorRT-LLM {made_with} but this container has {running}; {fix}")
