"""The backends and routes a build can take, one object each, made once from the options and asked for what differs.

A **backend** is what `--backend` names: the portable engine (`torch`) or TensorRT-LLM (`trtllm`). A **route** is
how a build runs on it: the portable engine (`torch`), TensorRT engines built by trtllm-build (`engine`), or
TensorRT-LLM's LLM API on its PyTorch backend (`llmapi`). The names are what the files say (compile.json's
`backend` and `route`, launch.json's `route`, the gate's `backend` parameter); everywhere else the code holds one of
these objects and asks it, as vLLM's `current_platform` is asked, so no module outside this package compares a
route's or a backend's name (tests/test_routes.py counts them).

Torch-free (it reads the pipeline's errors, draft kinds and device spellings only): the compiler, the repository
writer, the server, the gate model, the builder and the deploy planner all import it.
"""

from __future__ import annotations

from dataclasses import dataclass

from pipeline.draft_spec import EAGLE3, NGRAM
from pipeline.engine.device import DeviceChoice
from pipeline.errors import ConfigError


@dataclass(frozen=True)
class Backend:
    """What `--backend` picks: an engine family, and the build defaults that go with it."""

    name: str  # --backend's spelling; compile.json's `backend`
    label: str  # for messages
    places_device: bool  # --device applies (torch: cpu or cuda:N); TensorRT-LLM places engines by its tp/pp mapping
    plans_gpu_memory: bool  # `pipeline plan`'s memory plan picks TP and checks the fit
    kv_fp8: bool  # an FP8 KV cache is possible (the portable engine keeps KV in its compute dtype)
    one_device: bool  # no tensor or pipeline parallelism
    trtllm_release: bool  # builds for a TensorRT-LLM release (--trtllm-version applies)
    # `pipeline build --draft eagle3` without a head trains one (ModelOpt) for the portable engine; on TensorRT-LLM
    # it takes the published head, and `--draft auto` picks that head where one is published
    trains_heads: bool
    # the sizes a build takes when the options leave them out (TensorRT-LLM: `pipeline plan`'s defaults)
    max_batch_size: int
    max_seq_len: int

    def check_device(self, device: DeviceChoice, where: str) -> None:
        """Refuse a --device (as read: auto, cpu, cuda:N) this backend can't place; `where` says what was
        asked for (`--backend trtllm`, a folder, a repository), for the message."""
        if not device.auto and not self.places_device:
            raise ConfigError(f"--device {device.asked} places the portable engine, and {where} is for {self.label}, which "
                              f"runs its engines on the GPUs of their tp/pp mapping: drop --device")


@dataclass(frozen=True)
class Route:
    """One way from a checkpoint to served tokens."""

    name: str  # compile.json's and launch.json's `route`
    backend: Backend
    repo_backend: str  # the repository's `backend` (RepoSpec, the gate's config parameter): torch, trtllm, llmapi
    label: str  # for messages: what serves the tokens
    layout: str  # the checkpoint layout it loads: hf (a Hugging Face folder) or trtllm (ModelOpt's TensorRT-LLM export)
    refused_drafts: frozenset[str]  # the --draft kinds it can't run (one-model drafts need the PyTorch flow)
    builds_engines: bool  # trtllm-build writes TensorRT engines; the release must still have that route
    kv_from_checkpoint: bool  # each engine's KV dtype is its checkpoint's (trtllm-build reads kv_cache_quant_algo)
    int4_fp8_kv: bool  # attention kernels exist for INT4-AWQ weights beside an FP8 KV cache
    parallel_from_checkpoint: bool  # TP/PP are the checkpoint's mapping, not options
    probes_installed_trtllm: bool  # the version written for is the installed TensorRT-LLM's, where there is one
    launch_mode: str  # how tritonserver starts: plain, llmapi, or (leader | orchestrator) over MPI
    guide_tokenizer_info: bool  # guided decoding needs the tokenizer's info file beside the engines
    own_queue: bool  # our engine's queue, bounded by --max-queue-size (TensorRT-LLM's is its model's max_queue_size)
    upstream_engine_models: bool  # tensorrt_llm models from upstream's templates (target, and a draft's)
    upstream_llmapi_model: bool  # upstream's llmapi model behind our frontend step
    gates_in_trtllm: bool  # speculation is switched by TensorRT-LLM's own settings, not per request by the gate

    @property
    def portable(self) -> bool:
        """The portable engine: a device to place, a KV cache in the compute dtype, the cost model."""
        return self.backend.places_device

    def check_device(self, device: DeviceChoice, where: str) -> None:
        """Refuse a --device (as read) that this route can't take; `where` says what was asked for (the folder or
        command), for the message."""
        self.backend.check_device(device, where)


PORTABLE_BACKEND = Backend("torch", "the portable engine", places_device=True, plans_gpu_memory=False, kv_fp8=False,
                           one_device=True, trtllm_release=False, trains_heads=True, max_batch_size=8, max_seq_len=2048)
TRTLLM_BACKEND = Backend("trtllm", "TensorRT-LLM", places_device=False, plans_gpu_memory=True, kv_fp8=True,
                         one_device=False, trtllm_release=True, trains_heads=False, max_batch_size=16, max_seq_len=4096)
BACKENDS = (PORTABLE_BACKEND, TRTLLM_BACKEND)
BACKEND_NAMES = tuple(backend.name for backend in BACKENDS)  # --backend's choices

PORTABLE = Route(
    "torch", PORTABLE_BACKEND, repo_backend="torch", label="the portable engine", layout="hf",
    refused_drafts=frozenset(), builds_engines=False, kv_from_checkpoint=False, int4_fp8_kv=True,
    parallel_from_checkpoint=False, probes_installed_trtllm=False, launch_mode="plain", guide_tokenizer_info=False,
    own_queue=True, upstream_engine_models=False, upstream_llmapi_model=False, gates_in_trtllm=False)
ENGINE = Route(
    "engine", TRTLLM_BACKEND, repo_backend="trtllm", label="TensorRT-LLM engines", layout="trtllm",
    refused_drafts=frozenset({EAGLE3, NGRAM}), builds_engines=True, kv_from_checkpoint=True, int4_fp8_kv=True,
    parallel_from_checkpoint=True, probes_installed_trtllm=True, launch_mode="leader", guide_tokenizer_info=True,
    own_queue=False, upstream_engine_models=True, upstream_llmapi_model=False, gates_in_trtllm=False)
# The PyTorch flow has no attention kernels for INT4-AWQ with an FP8 KV cache ("FMHA kernels are not found",
# NVIDIA/TensorRT-LLM#8862).
LLMAPI = Route(
    "llmapi", TRTLLM_BACKEND, repo_backend="llmapi", label="TensorRT-LLM's LLM API", layout="hf",
    refused_drafts=frozenset(), builds_engines=False, kv_from_checkpoint=False, int4_fp8_kv=False,
    parallel_from_checkpoint=False, probes_installed_trtllm=True, launch_mode="llmapi", guide_tokenizer_info=False,
    own_queue=False, upstream_engine_models=False, upstream_llmapi_model=True, gates_in_trtllm=True)
ROUTES = (PORTABLE, ENGINE, LLMAPI)
ROUTE_CHOICES = ("auto", ENGINE.name, LLMAPI.name)  # --route, on the trtllm backend


def backend_named(name: str) -> Backend:
    for backend in BACKENDS:
        if backend.name == name:
            return backend
    raise ConfigError(f"unknown --backend {name!r}; pick one of {', '.join(b.name for b in BACKENDS)}")


def route_named(name: str) -> Route:
    """The route a file names: compile.json's and launch.json's `route`, or a repository's `backend` (the engine
    route's is `trtllm` there)."""
    for route in ROUTES:
        if name in (route.name, route.repo_backend):
            return route
    raise ConfigError(f"unknown route {name!r}; one of {', '.join(r.name for r in ROUTES)}")


def pick_route(backend: str, route: str, target, draft) -> Route:
    """The route that will run, checked against the target's layout and the draft's kind.

    target: a compiler Checkpoint (its `layout` and `path`); draft: a DraftSpec (its `kind`)."""
    chosen_backend = backend_named(backend)
    if route not in ROUTE_CHOICES:
        raise ConfigError(f"unknown --route {route!r}; pick one of {', '.join(ROUTE_CHOICES)}")
    if chosen_backend is PORTABLE_BACKEND:
        if target.layout != PORTABLE.layout:
            raise ConfigError(f"--backend torch loads Hugging Face checkpoints, and {target.path} is a TensorRT-LLM "
                              f"checkpoint; quantize with --export hf for the portable engine")
        return PORTABLE
    if route == "auto":  # a Hugging Face folder, or a one-model draft, goes to the LLM API
        chosen = ENGINE if target.layout == ENGINE.layout and draft.kind not in ENGINE.refused_drafts else LLMAPI
    else:
        chosen = route_named(route)
    if chosen is ENGINE:
        if target.layout != ENGINE.layout:
            raise ConfigError(f"--route engine builds from a TensorRT-LLM checkpoint, and {target.path} is a Hugging "
                              f"Face folder; quantize with --export trtllm, or use --route llmapi")
        if draft.kind in ENGINE.refused_drafts:
            raise ConfigError(f"--draft {draft.kind} runs on TensorRT-LLM's PyTorch backend; use --route llmapi")
    elif target.layout != LLMAPI.layout:
        raise ConfigError(f"--route llmapi (PyTorch backend) loads Hugging Face checkpoints, and {target.path} is a "
                          f"TensorRT-LLM checkpoint; quantize with --export hf, or use --route engine")
    return chosen
