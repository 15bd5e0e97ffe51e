"""What `pipeline compile` is asked for (CompileOptions) and what it reports (CompileResult)."""

from __future__ import annotations

import shlex
from dataclasses import asdict, dataclass, field
from pathlib import Path

from pipeline.draft_spec import DraftField, DraftSpec
from pipeline.engine.device import DeviceChoice, DeviceField

MANIFEST_FILE = "compile.json"
KV_CACHE_DTYPES = ("auto", "fp8")
DEFAULT_ENGINES_DIR = Path("engines")


@dataclass(frozen=True)
class CompileOptions:
    backend: str  # trtllm | torch
    target: Path  # a checkpoint folder from `pipeline quantize`
    output: Path  # the engine folder to write
    draft: DraftSpec = DraftField("none")  # none | ngram | DIR | eagle3:DIR
    route: str = "auto"  # trtllm only: auto | engine (trtllm-build) | llmapi (PyTorch backend)
    num_draft_tokens: int = 4  # K: max draft length
    max_batch_size: int = 64
    max_input_len: int | None = None  # default: max_seq_len // 2
    max_seq_len: int | None = None  # default: min(4096, the target's max_position_embeddings)
    max_num_tokens: int | None = None  # default: max_batch_size * (K+1) + one context chunk
    gate_batch_size: int | None = 32  # speculate only at or below this batch size; None: always
    kv_cache_dtype: str = "auto"  # auto (the checkpoint's) | fp8
    free_gpu_memory_fraction: float = 0.9
    tp_size: int | None = None  # llmapi route; the engine route reads the checkpoint's mapping
    pp_size: int | None = None
    dtype: str = "auto"  # torch backend compute dtype: auto (the checkpoint's) | fp32 | bf16 | fp16
    # torch backend: the target's KV pool in bytes (None: max_batch_size x max_seq_len tokens), prompt tokens
    # prefilled per step (chunked prefill), and reuse of cached prefix blocks (EngineConfig's fields)
    kv_cache_bytes: int | None = None
    prefill_chunk: int = 256
    prefix_caching: bool = True
    ngram_first: bool = True  # torch backend, EAGLE-3 heads: n-gram lookup drafts where it matches (EngineConfig)
    gpu: str | None = None  # check the sizes against `pipeline plan` for this GPU
    # torch backend: where compile loads the engine to calibrate (auto|cpu|cuda|cuda:N)
    device: DeviceChoice = DeviceField()
    # torch backend with a draft: measure the cost model the draft planner reads (engine/calibrate.py)
    calibrate: bool = True
    # trtllm: the TensorRT-LLM release to write for (pipeline.trtllm.version.RELEASES); None: the installed one in
    # NVIDIA's container, else the newest stable release
    trtllm_version: str | None = None
    dry_run: bool = False
    force: bool = False


@dataclass
class CompileResult:
    backend: str
    route: str
    output: str
    dry_run: bool
    commands: dict[str, list[str]] = field(default_factory=dict)
    files: list[str] = field(default_factory=list)
    manifest: dict = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)  # choices worth knowing (the gate, its cost)
    device: str | None = None  # torch backend: where the engine loads to calibrate; None on TensorRT-LLM
    device_line: str = ""  # what was picked and why (DeviceChoice.choose)

    def to_dict(self) -> dict:
        return asdict(self)

    def render(self) -> str:
        what = "dry run: nothing built" if self.dry_run else "compiled"
        lines = [f"{what}; {self.backend}/{self.route} -> {self.output}"]
        lines += [self.device_line] if self.device_line else []
        lines += [f"  wrote {f}" for f in self.files]
        lines += [f"note: {n}" for n in self.notes]
        for name, cmd in self.commands.items():
            lines += [f"# {name}", shlex.join(cmd)]
        return "\n".join(lines)


@dataclass
class RouteFiles:
    """A TensorRT-LLM route's product, as text: the commands, the files compile writes, the configs."""

    commands: dict[str, list[str]] = field(default_factory=dict)
    files: dict[str, str] = field(default_factory=dict)  # file name in the output folder -> its text
    configs: dict[str, dict] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def write_into(self, stage: Path, result: CompileResult, manifest: dict) -> None:
        for name, text in self.files.items():
            (stage / name).write_text(text)
        result.commands, result.files, result.notes = self.commands, list(self.files), self.notes
        if self.configs:
            manifest["configs"] = self.configs
