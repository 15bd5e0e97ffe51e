"""What `pipeline build` is asked (BuildOptions) and what the machine offers (Environment).

BuildOptions is what the user typed; `auto` fields are filled per backend and GPU by `plan_build`.
Environment is detected once, at the edge (`detect_environment`): a GPU, TensorRT-LLM, host memory and
where each model's weights are. Planning reads only these two, so tests plan the 70B-on-H100 build on a CPU.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from pipeline.draft_spec import AUTO, EAGLE3, DraftField, DraftSpec
from pipeline.engine.device import Device, DeviceChoice, DeviceField
from pipeline.home import pipeline_home
from pipeline.models.presets import DEFAULT_MODEL
from pipeline.plan.gpus import GPU
from pipeline.routes import BACKENDS as ALL_BACKENDS
from pipeline.routes import backend_named

BACKENDS = ("auto", *(b.name for b in ALL_BACKENDS))  # --backend
KV_CACHE_DTYPES = ("auto", "bf16", "fp8")


@dataclass(frozen=True)
class BuildOptions:
    target: str = DEFAULT_MODEL  # preset, HF folder, .gguf file or hub id
    draft: DraftSpec = DraftField("auto", allow_auto=True)  # auto | eagle3 | eagle3:DIR | ngram | none | a draft model (preset/folder)
    target_qformat: str = "auto"  # auto | fp8 | int4_awq | w4a8_awq | int8_sq | none
    draft_qformat: str = "auto"
    kv_cache_dtype: str = "auto"  # auto (bf16) | bf16 | fp8
    num_draft_tokens: int = 4
    gate_batch_size: int | None = None  # None: the backend's default
    backend: str = "auto"  # auto | torch | trtllm
    max_batch_size: int | None = None  # None: the backend's default
    max_input_len: int | None = None
    max_seq_len: int | None = None
    tp_size: int | None = None  # None: 1 on torch, the smallest TP the memory plan fits on trtllm
    gpu: str | None = None  # plan for this GPU kind; None: the detected one (else h100-80gb on trtllm)
    engines_dir: Path = Path("engines")
    repo: Path = Path("triton_repo")
    calib_size: int = 32  # quantize stages: calibration samples of 256 tokens
    draft_budget_minutes: float = 10.0  # train_draft stage (EAGLE-3 on the portable engine without a head)
    trtllm_version: str | None = None  # trtllm: the release to write for; None: installed, else newest stable
    # torch: where compile calibrates and the repository's engine loads (auto|cpu|cuda|cuda:N); `run_build` picks it
    # on this machine (Environment.device), a plan alone (--dry-run, deploy's pods) keeps it as given
    device: DeviceChoice = DeviceField()
    force: bool = False  # rebuild every stage, and build even if the memory plan doesn't fit


@dataclass(frozen=True)
class Weights:
    """Where a model's files are, or how to get them; located without converting or downloading anything."""

    ref: str
    path: Path | None  # a local folder (or a .gguf file the build converts); None: not here
    how_to_get: str = ""  # one clause, for the "missing" line

    @property
    def present(self) -> bool:
        return self.path is not None


@dataclass(frozen=True)
class Environment:
    gpu: GPU | None = None  # the GPU nvidia-smi reports (catalog entry), None without one
    trtllm: bool = False  # tensorrt_llm importable or trtllm-build on PATH
    host_memory_bytes: int = 0
    weights: dict[str, Weights] = field(default_factory=dict)  # model ref -> where its files are
    trained_head: Path | None = None  # an EAGLE-3 head for the target in $PIPELINE_HOME/heads (draft train)
    # The portable engine's compute dtype on this CPU, and why (cpu_kernels.fast_lossless_dtype).
    engine_dtype: tuple[str, str] = ("bf16", "the default")
    # The device --device picks here, with its line (DeviceChoice.choose): set by `run_build` for a portable-engine
    # build, which runs here; None for a plan, which keeps --device as given.
    device: Device | None = None

    def weights_of(self, ref: str) -> Weights:
        return self.weights.get(ref) or Weights(ref, None, f"make {ref} available locally")


def detect_environment(options: BuildOptions) -> Environment:
    """The one place that looks at the machine. Reads only; creates nothing."""
    from pipeline.compiler.job import trtllm_available
    from pipeline.plan.gpus import detect_gpu

    draft = options.draft
    refs = [options.target]
    if draft.kind in (EAGLE3, AUTO) and not draft.ref:  # the target's own head (auto may pick its published one)
        refs.append(_eagle3_ref(options.target))
    elif draft.ref:
        refs.append(draft.ref)
    weights = {ref: locate_weights(ref) for ref in refs if ref}
    head = trained_head(options.target) if draft == DraftSpec(EAGLE3) else None
    if head is not None:
        weights[str(head)] = Weights(str(head), head)
    return Environment(gpu=detect_gpu(), trtllm=trtllm_available(), host_memory_bytes=_host_memory(),
                       weights=weights, trained_head=head, engine_dtype=_engine_dtype(options))


def _engine_dtype(options: BuildOptions) -> tuple[str, str]:
    """The portable engine's dtype here (without building its kernels: this probe creates nothing)."""
    if options.backend != "auto" and not backend_named(options.backend).places_device:
        return Environment.engine_dtype
    from pipeline.engine.cpu_kernels import fast_lossless_dtype

    return fast_lossless_dtype(build=False)


def model_name(ref: str) -> str:
    """The build's folder name: the preset's name, else the folder's (or .gguf's) name."""
    from pipeline.models.presets import get_preset

    preset = get_preset(ref)
    if preset is not None:
        return preset.name
    path = Path(ref.rstrip("/"))
    return (path.stem if path.suffix.lower() == ".gguf" else path.name) or "model"


def trained_head(target: str) -> Path | None:
    """A head `pipeline draft train` left in the cache for this target: $PIPELINE_HOME/heads/<name>-eagle3."""
    folder = pipeline_home(create=False) / "heads" / f"{model_name(target)}-eagle3"
    return folder if (folder / "config.json").is_file() else None


def _eagle3_ref(target: str) -> str:
    from pipeline.models.presets import get_preset

    preset = get_preset(target)
    return preset.eagle3_head if preset is not None and preset.eagle3_head else ""


def locate_weights(ref: str) -> Weights:
    """A local folder or .gguf as is; the embedded preset's converted folder (or its GGUF); a hub model
    only from the local Hugging Face cache. Nothing is converted or downloaded here."""
    from pipeline.errors import ModelNotFoundError
    from pipeline.models.presets import get_preset
    from pipeline.models.resolve import EMBEDDED_INSTALL, PRESETS, unknown_model

    path = Path(ref).expanduser()
    if path.is_dir() or (path.is_file() and path.suffix.lower() == ".gguf"):
        return Weights(ref, path.absolute())
    preset = get_preset(ref)
    if preset is not None and preset.embedded:
        folder = pipeline_home(create=False) / "models" / PRESETS[preset.name].name
        if (folder / "config.json").is_file() and (folder / "model.safetensors").is_file():
            return Weights(ref, folder)
        from pipeline.models.resolve import embedded_gguf

        try:
            return Weights(ref, embedded_gguf())  # converted once, at build time
        except ModelNotFoundError:
            return Weights(ref, None, f"install the embedded model: {EMBEDDED_INSTALL}")
    hub_id = preset.hub_id if preset is not None else ref
    # Not here, and not fetchable either: an error now, even for --dry-run (a plan for nothing would mislead).
    if path.is_absolute() or ref.startswith((".", "~")):
        raise ModelNotFoundError(f"{ref}: no such folder; pass an existing model folder, a .gguf file or a preset")
    if "/" not in hub_id:
        raise ModelNotFoundError(unknown_model(ref))
    how = f"huggingface-cli download {hub_id} --local-dir DIR, then pass DIR"  # the plan names the flag
    return Weights(ref, _hub_cache(hub_id), how)


def _hub_cache(repo_id: str) -> Path | None:
    try:
        from huggingface_hub import snapshot_download

        from pipeline.models.resolve import HUB_PATTERNS

        folder = Path(snapshot_download(repo_id, local_files_only=True, allow_patterns=HUB_PATTERNS))
    except Exception:  # noqa: BLE001  not cached (or huggingface_hub missing): not here
        return None
    return folder if (folder / "config.json").is_file() else None


def _host_memory() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0
