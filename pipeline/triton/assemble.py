"""`pipeline assemble`: an engine folder from `pipeline compile` -> a Triton model repository that serves it.

Three kinds of engine folder, told apart by what compile wrote in them:
- portable engine (engine.json): preprocessing -> speculation_gate -> postprocessing, torch_engine;
- TensorRT-LLM engine route (compile.json, route "engine"): the same, with tensorrt_llm (target) and
  tensorrt_llm_draft on the tensorrtllm backend; the gate runs the draft -> target loop;
- TensorRT-LLM LLM-API route (compile.json, route "llmapi"): TensorRT-LLM's llmapi model fed model.yaml
  (compile's extra_llm_api_options plus the sizes) behind an ensemble with the client's names.

Every config.pbtxt comes from `pipeline.triton.config` (one function per model, from one RepoSpec);
every python model's source is copied from `pipeline/triton/models/`. The repository is written in a
staging folder beside the target and renamed into place, so a failed run leaves nothing half-written.
"""

from __future__ import annotations

import json
import math
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from pipeline.engine.device import DeviceChoice, DeviceField
from pipeline.errors import ConfigError
from pipeline.policy.gate_policy import GatePolicy
from pipeline.routes import BACKENDS as ALL_BACKENDS
from pipeline.routes import ENGINE, LLMAPI, PORTABLE, TRTLLM_BACKEND, Route, route_named
from pipeline.staging import check_output, staged_output
from pipeline.triton.config import (GATE, LLMAPI_FRONTEND, LLMAPI_MODEL, LLMAPI_MODEL_DIR, LLMAPI_YAML,
                                    POSTPROCESSING, PREPROCESSING, STOP_REQUEST,
                                    TORCH_ENGINE, TRTLLM_DRAFT, TRTLLM_TARGET, RepoSpec, llmapi_model_yaml,
                                    repository_configs, trtllm_models, write_config)
from pipeline.triton.launch import Launch, gpu_device_ids, plan_launch, write_launch
from pipeline.triton.trtllm_template import ContainerTools, check_config, container_config, find_container_tools
from pipeline.trtllm.reference import GUIDE_INFO_FILE
from pipeline.trtllm.upstream import TRITON_CONTAINER

MODEL_SOURCES = Path(__file__).parent / "models"
# model name -> its source in pipeline/triton/models/
PYTHON_MODELS = {PREPROCESSING: "preprocessing.py", POSTPROCESSING: "postprocessing.py",
                 GATE: "speculation_gate.py", TORCH_ENGINE: "torch_engine.py", LLMAPI_FRONTEND: "llmapi_frontend.py",
                 STOP_REQUEST: "stop_request.py"}
LLMAPI_SOURCE = "llmapi.py"  # the llmapi route's tensorrt_llm: a loader for TensorRT-LLM's own model.py
BACKENDS = ("auto", *(b.name for b in ALL_BACKENDS))  # --backend
DEFAULT_KV_FRACTION = 0.9  # TensorRT-LLM's own default free_gpu_memory_fraction
SHARED_KV_FRACTION = 0.5  # examples/draft_target_model/README.md, both models on one GPU
MIN_KV_FRACTION = 0.05
DRAFT_WORKSPACE_BYTES = 2 * 1024 ** 3  # the draft worker's activations, as the memory plan's minimum reserve
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")


def sources_digest() -> str:
    """A digest of the python models' sources a repository gets a copy of: a repository holding older copies is
    stale, and `pipeline build` assembles it again (pipeline.build.plan keys its assemble stage on it). The copies
    import this version's package: after an upgrade a reused repository's gate imported a name that had moved,
    and every model it fed failed to load."""
    import hashlib

    digest = hashlib.sha256()
    for name in sorted({*PYTHON_MODELS.values(), LLMAPI_SOURCE}):
        digest.update(name.encode() + b"\0" + (MODEL_SOURCES / name).read_bytes())
    return digest.hexdigest()[:16]


@dataclass(frozen=True)
class AssembleOptions:
    engine: Path  # a `pipeline compile` folder
    repo: Path = Path("triton_repo")
    backend: str = "auto"  # auto (from the folder) | torch | trtllm
    tokenizer: Path | None = None  # trtllm: default the target checkpoint compile.json names
    llmapi_model_dir: str = LLMAPI_MODEL_DIR  # llmapi route: where TensorRT-LLM's llmapi model.py is at serve time
    gate_batch_size: int = 32  # speculate while at most this many requests are in flight
    gate_hysteresis: int | None = None  # back on at gate_batch_size - this; default gate_batch_size // 8, >= 1
    min_spec_tokens: int = 50  # requests asking for fewer new tokens never speculate
    max_input_bytes: int | None = None  # text_input's byte limit, checked before tokenizing; None: from max_seq_len
    max_queue_size: int | None = None  # torch: requests waiting for a slot before more are refused; None: per slot
    # torch: where the served engine loads when tritonserver starts without `pipeline serve --device` (auto|cpu|
    # cuda|cuda:N, resolved by the model as it loads)
    device: DeviceChoice = DeviceField()
    force: bool = False


@dataclass
class AssembleResult:
    repo: str
    engine: str
    models: list[str] = field(default_factory=list)
    backend: str = "torch"
    route: str = "torch"  # torch | engine | llmapi
    notes: list[str] = field(default_factory=list)  # what still has to happen before serving
    launch: str = "plain"  # how `pipeline serve` launches it (pipeline.triton.launch)
    device: str | None = None  # torch: the device torch_engine's config names (auto: picked as it loads)


@dataclass(frozen=True)
class Plan:
    """What assemble will write: the RepoSpec plus the route's extra files and how to launch it."""

    spec: RepoSpec
    route: Route
    llmapi_yaml: dict | None = None
    notes: tuple[str, ...] = ()
    launch: Launch = Launch(PORTABLE, "plain")


def detect_route(engine: Path, requested: str = "auto") -> Route:
    """The portable engine for a folder with engine.json; for one with compile.json from `compile -b trtllm`, the
    route it names. `requested`: --backend (auto, or the one the folder must be)."""
    from pipeline.compiler.options import MANIFEST_FILE
    from pipeline.engine.folder import ENGINE_FILE

    if requested not in BACKENDS:
        raise ConfigError(f"unknown --backend {requested!r}; pick one of {', '.join(BACKENDS)}")
    manifest = engine / MANIFEST_FILE
    if (engine / ENGINE_FILE).is_file():
        found = PORTABLE
    else:
        compiled = _read_json(manifest) if manifest.is_file() else {}
        if compiled.get("backend") != TRTLLM_BACKEND.name:
            raise ConfigError(f"{engine} has neither engine.json (`pipeline compile -b torch`) nor a TensorRT-LLM "
                              f"compile.json (`pipeline compile -b trtllm`); pass an engine folder that compile wrote")
        found = route_named(compiled.get("route", ENGINE.name))
    if requested not in ("auto", found.backend.name):
        raise ConfigError(f"--backend {requested} but {engine} is a {found.backend.name} engine folder; drop "
                          f"--backend or pass a folder from `pipeline compile -b {requested}`")
    return found


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise ConfigError(f"{path} is unreadable ({err}); rerun `pipeline compile`") from err


def _gate(options: AssembleOptions) -> GatePolicy:
    return GatePolicy.with_ceiling(options.gate_batch_size, options.gate_hysteresis, options.min_spec_tokens)


def repo_spec(options: AssembleOptions) -> RepoSpec:
    return plan_repository(options).spec


def plan_repository(options: AssembleOptions) -> Plan:
    """Read the engine folder and decide everything assemble writes (reads files, writes nothing)."""
    engine = Path(options.engine).expanduser().absolute()
    route = detect_route(engine, options.backend)
    route.check_device(options.device, str(engine))
    if route.portable:
        return Plan(_torch_spec(engine, options), route)
    from pipeline.compiler.options import MANIFEST_FILE

    manifest = _read_json(engine / MANIFEST_FILE)
    if route.upstream_llmapi_model:
        return _llmapi_plan(engine, manifest, options)
    return _engine_plan(engine, manifest, options)


def _torch_spec(engine: Path, options: AssembleOptions) -> RepoSpec:
    """A portable engine folder: sizes from its engine.json, the gate from the options."""
    from pipeline.engine.folder import read_engine_manifest
    from pipeline.models.tokenizer import tokenizer_class

    manifest = read_engine_manifest(engine)
    tokenizer = engine / manifest["tokenizer"]
    return RepoSpec(backend=PORTABLE.repo_backend, tokenizer_dir=str(tokenizer), engine_dir=str(engine),
                    tokenizer_class=tokenizer_class(tokenizer),
                    max_batch_size=manifest["max_batch_size"], max_seq_len=manifest["max_seq_len"],
                    num_draft_tokens=max(1, manifest["num_draft_tokens"]), gate=_gate(options),
                    max_input_bytes=options.max_input_bytes, max_queue_size=options.max_queue_size,
                    device=options.device)


def _tokenizer(manifest: dict, options: AssembleOptions) -> Path:
    folder = Path(options.tokenizer).expanduser().absolute() if options.tokenizer else Path(manifest["target"]["path"])
    if not any((folder / f).is_file() for f in TOKENIZER_FILES):
        raise ConfigError(f"{folder} has no tokenizer ({', '.join(TOKENIZER_FILES)}); pass --tokenizer DIR with the "
                          f"target's Hugging Face tokenizer")
    return folder


@dataclass(frozen=True)
class KvBudget:
    """KV cache settings of the two tensorrt_llm models on shared GPUs."""

    target_fraction: float  # kv_cache_free_gpu_mem_fraction of the target
    draft_fraction: float
    draft_max_tokens: int | None  # max_tokens_in_paged_kv_cache of the draft
    note: str


def kv_budget(plan: dict | None, max_batch_size: int, max_seq_len: int, has_draft: bool) -> KvBudget:
    """How the target and the draft split the GPUs' memory. Pure.

    Each model takes its kv_cache_free_gpu_mem_fraction of the memory free when *it* loads, and Triton
    loads the two at once, in no set order. So the draft's KV is bounded in tokens as well
    (max_tokens_in_paged_kv_cache = max batch x max seq len; the backend takes the smaller of the two
    bounds), and the target's fraction leaves room for the draft's weights, KV, CUDA context and workspace
    even when the target loads first. Without a memory plan: 0.5 each, as examples/draft_target_model's
    README does when both models share a GPU. Alone, the target takes TensorRT-LLM's default 0.9.
    """
    if not has_draft:
        return KvBudget(DEFAULT_KV_FRACTION, DEFAULT_KV_FRACTION, None, "")
    tokens = max_batch_size * max_seq_len
    if not plan:
        return KvBudget(SHARED_KV_FRACTION, SHARED_KV_FRACTION, tokens,
                        f"KV cache: target and draft take {SHARED_KV_FRACTION:g} of the free GPU memory each "
                        f"(no memory plan; pass --gpu to compile to size it), the draft at most {tokens} tokens")
    kv_dtype = plan.get("draft_kv_cache_dtype", plan["kv_cache_dtype"])
    draft_need = (plan["draft_weight_bytes"]["per_gpu"] + plan["kv_cache_bytes"]["draft"][kv_dtype]
                  + plan["reserve_bytes"]["cuda_context"] + DRAFT_WORKSPACE_BYTES)
    free = (plan["gpu_memory_bytes"] - plan["reserve_bytes"]["cuda_context"] - plan["reserve_bytes"]["activations"]
            - plan["target_weight_bytes"][plan["target_qformat"]]["per_gpu"])
    target = math.floor(100 * (1 - draft_need / free)) / 100 if free > 0 else MIN_KV_FRACTION
    target = min(max(target, MIN_KV_FRACTION), DEFAULT_KV_FRACTION)
    return KvBudget(target, target, tokens,
                    f"KV cache: the target takes {target:g} of the GPU memory free after its weights, leaving "
                    f"{draft_need / 1e9:.1f} GB per GPU for the draft (weights, {tokens}-token KV cache, CUDA "
                    f"context, workspace) whichever loads first")


def _engine_plan(engine: Path, manifest: dict, options: AssembleOptions) -> Plan:
    """The trtllm-build route: tensorrt_llm (+ tensorrt_llm_draft) on the tensorrtllm backend under our gate."""
    kind = manifest.get("draft", {}).get("kind", "none")
    if kind not in ("model", "none"):
        raise ConfigError(f"{engine} was compiled with --draft {kind}, which runs on the LLM-API route; rerun "
                          f"`pipeline compile -b trtllm --route llmapi`")
    has_draft = kind == "model"
    target, draft = engine / "target", engine / "draft"
    notes = []
    if manifest.get("dry_run"):
        notes.append(f"the engines are not built yet (compile --dry-run): run {engine / 'build.sh'} in "
                     f"{TRITON_CONTAINER} before serving")
    else:
        for folder in (target, draft) if has_draft else (target,):
            if not (folder / "config.json").is_file():
                raise ConfigError(f"{folder} holds no built engine (config.json); rerun `pipeline compile` or "
                                  f"{engine / 'build.sh'}")
    guide_info = _guide_info(engine, manifest)
    if not guide_info:
        notes.append(f"guided decoding off: {engine} has no {GUIDE_INFO_FILE} (compiled before compile wrote it); "
                     f"rerun `pipeline compile` to serve guided_decoding_guide_type")
    sizes = manifest["sizes"]
    models = (TRTLLM_TARGET, TRTLLM_DRAFT) if has_draft else (TRTLLM_TARGET,)
    world = int(manifest.get("tp_size", 1)) * int(manifest.get("pp_size", 1))
    launch = plan_launch(ENGINE, world_size=world, trtllm_models=models,
                         tensorrt_llm_version=manifest.get("tensorrt_llm_version"))
    kv = kv_budget(manifest.get("plan"), sizes["max_batch_size"], sizes["max_seq_len"], has_draft)
    spec = RepoSpec(backend=ENGINE.repo_backend, tokenizer_dir=str(_tokenizer(manifest, options)), engine_dir=str(target),
                    draft_engine_dir=str(draft) if has_draft else "", max_batch_size=sizes["max_batch_size"],
                    max_seq_len=sizes["max_seq_len"], num_draft_tokens=max(1, sizes["max_draft_len"]),
                    gate=_gate(options), max_input_bytes=options.max_input_bytes,
                    kv_fraction_target=kv.target_fraction, kv_fraction_draft=kv.draft_fraction,
                    draft_max_tokens=kv.draft_max_tokens, gpu_device_ids=gpu_device_ids(launch),
                    guide_tokenizer_info=guide_info)
    notes += [n for n in (kv.note, _launch_note(launch)) if n]
    return Plan(spec, ENGINE, notes=tuple(notes), launch=launch)


def _guide_info(engine: Path, manifest: dict) -> str:
    """The target's guided-decoding vocabulary (compile's build_guide_info), where it is or, after a dry run, will be;
    "" for an engine folder compiled without it."""
    path = engine / GUIDE_INFO_FILE
    planned = manifest.get("dry_run") and "build_guide_info" in manifest.get("commands", {})
    return str(path) if path.is_file() or planned else ""


def _launch_note(launch: Launch) -> str:
    if launch.mode == "orchestrator":
        return (f"launch: orchestrator mode (TRTLLM_ORCHESTRATOR=1, one rank): the backend spawns each model's "
                f"{launch.gpus} worker(s) on GPUs {gpu_device_ids(launch)}; one node")
    if launch.mode == "leader":
        return f"launch: leader mode, mpirun with {launch.world_size} rank(s), one per GPU"
    if launch.mode == "llmapi":
        return f"launch: mpirun with one rank; the LLM API starts {launch.gpus} worker(s)"
    return ""


def _llmapi_plan(engine: Path, manifest: dict, options: AssembleOptions) -> Plan:
    """The PyTorch-backend route: TensorRT-LLM's llmapi model with compile's YAML and sizes."""
    import yaml

    from pipeline.compiler.llmapi import OPTIONS_FILE

    options_file = engine / OPTIONS_FILE
    if not options_file.is_file():
        raise ConfigError(f"{options_file} is missing; rerun `pipeline compile -b trtllm --route llmapi`")
    extra = yaml.safe_load(options_file.read_text()) or {}
    sizes = manifest["sizes"]
    llm_args = {"tensor_parallel_size": manifest.get("tp_size", 1),
                "pipeline_parallel_size": manifest.get("pp_size", 1),
                "max_batch_size": sizes["max_batch_size"], "max_num_tokens": sizes["max_num_tokens"],
                "max_seq_len": sizes["max_seq_len"], **extra}
    model = manifest["target"]["path"]
    spec = RepoSpec(backend=LLMAPI.repo_backend, tokenizer_dir=str(_tokenizer(manifest, options)), engine_dir=str(engine),
                    max_batch_size=sizes["max_batch_size"], max_seq_len=sizes["max_seq_len"],
                    num_draft_tokens=max(1, sizes["max_draft_len"]), gate=_gate(options),
                    max_input_bytes=options.max_input_bytes,
                    llmapi_model_dir=options.llmapi_model_dir)
    notes = [f"serve it in NVIDIA's Triton + TensorRT-LLM container: the tensorrt_llm model loads TensorRT-LLM's "
             f"llmapi model.py from {options.llmapi_model_dir}"]
    spec_cfg = extra.get("speculative_config")
    if spec_cfg:
        schedule = spec_cfg.get("draft_len_schedule")
        ceiling = (f"the draft_len_schedule's last bound, {max(int(b) for b in schedule)} ({schedule})" if schedule
                   else f"speculative_config.max_concurrency={spec_cfg.get('max_concurrency', 'unset (always)')}")
        notes.append(f"speculation is TensorRT-LLM's ({spec_cfg.get('decoding_type')}): on at batch sizes up to "
                     f"{ceiling}; requests can't switch it per request on this route")
    launch = plan_launch(LLMAPI, world_size=int(manifest.get("tp_size", 1)) * int(manifest.get("pp_size", 1)),
                         tensorrt_llm_version=manifest.get("tensorrt_llm_version"))
    notes.append(_launch_note(launch))
    return Plan(spec, LLMAPI, llmapi_model_yaml(model, llm_args), tuple(notes), launch)


def write_repository(folder: Path, spec: RepoSpec, llmapi_yaml: dict | None = None, launch: Launch | None = None,
                     container: ContainerTools | None = None) -> list[str]:
    """Write every model (config.pbtxt, and 1/model.py for python ones) under `folder`, and launch.json;
    returns the model names. `container`: fill the tensorrt_llm models from NVIDIA's own template there."""
    from pipeline.triton.draft_target import SENT_INPUTS

    configs = repository_configs(spec)
    for model in trtllm_models(spec) if spec.route.upstream_engine_models else ():
        if container is not None:
            configs[model.name] = container_config(container, model, max_batch_size=spec.max_batch_size,
                                                   tokenizer_dir=spec.tokenizer_dir)
        check_config(configs[model.name], SENT_INPUTS)
    for name, msg in configs.items():
        write_config(folder / name, msg)
        (folder / name / "1").mkdir()
        if spec.route.upstream_llmapi_model and name == LLMAPI_MODEL:
            import yaml

            shutil.copyfile(MODEL_SOURCES / LLMAPI_SOURCE, folder / name / "1" / "model.py")
            # upstream's model reads it from pb_utils.get_model_dir(): the version folder, beside model.py
            (folder / name / "1" / LLMAPI_YAML).write_text(yaml.safe_dump(llmapi_yaml or {}, sort_keys=False))
        elif name in PYTHON_MODELS:
            shutil.copyfile(MODEL_SOURCES / PYTHON_MODELS[name], folder / name / "1" / "model.py")
    write_launch(folder, launch or Launch(PORTABLE, "plain"))
    return sorted(configs)


def assemble(options: AssembleOptions) -> AssembleResult:
    repo = Path(options.repo).expanduser().absolute()
    check_output(repo, options.force, ConfigError, "--repo")
    plan = plan_repository(options)
    if options.max_queue_size is not None and not plan.route.own_queue:
        raise ConfigError("--max-queue-size bounds the portable engine's queue; on TensorRT-LLM the queue is "
                          "the tensorrt_llm model's own (max_queue_size in its config.pbtxt)")
    container = find_container_tools() if plan.route.upstream_engine_models else None
    notes = list(plan.notes)
    if container is not None:
        notes.append(f"tensorrt_llm config: the container's {container.template}, filled by {container.fill_template}")
    with staged_output(repo, options.force, ConfigError, "--repo") as stage:
        models = write_repository(stage, plan.spec, plan.llmapi_yaml, plan.launch, container)
    engine = plan.spec.engine_dir if plan.route.portable else str(Path(options.engine).expanduser().absolute())
    return AssembleResult(repo=str(repo), engine=engine, models=models, backend=plan.spec.backend,
                          route=plan.route.name, notes=notes, launch=plan.launch.mode,
                          device=plan.spec.device if plan.route.portable else None)
