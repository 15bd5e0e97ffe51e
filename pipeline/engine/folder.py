"""The portable engine folder, read: engine.json and the checkpoints beside it, into an LLMEngine.

`pipeline compile --backend torch` writes it (pipeline/compiler/engine_folder.py); the engine owns the format,
so reading it needs nothing from compile. Layout:
  engine.json    sizes (max batch, max sequence length, max draft length), dtypes, gate, draft kind
  target/        the target's Hugging Face checkpoint files: config, *.safetensors, tokenizer
  draft/         a draft model's checkpoint, or an EAGLE-3 head's (only with one of those)
  cost_model.json  the calibration (pipeline/policy/cost_model.py), when compile measured one
"""

from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path

from pipeline.draft_spec import DraftSpec
from pipeline.errors import ModelFormatError
from pipeline.policy.gate_policy import GatePolicy

ENGINE_FILE = "engine.json"
FORMAT = "pipeline-torch-engine"
FORMAT_VERSION = 1


def read_engine_manifest(path: str | Path) -> dict:
    folder = Path(path)
    file = folder / ENGINE_FILE
    if not file.is_file():
        raise ModelFormatError(f"{folder} has no {ENGINE_FILE}; build it with `pipeline compile --backend torch`")
    manifest = json.loads(file.read_text())
    if manifest.get("format") != FORMAT or manifest.get("format_version") != FORMAT_VERSION:
        raise ModelFormatError(f"{file} is not a version-{FORMAT_VERSION} portable engine; rebuild it with "
                               f"`pipeline compile --backend torch --force`")
    if not (folder / manifest["target"]["path"]).is_dir():
        raise ModelFormatError(f"{folder} has engine.json but no weights (a --dry-run?); run `pipeline compile` "
                               f"without --dry-run")
    return manifest


def write_engine_manifest(folder: str | Path, manifest: dict) -> Path:
    """engine.json, written whole (a temp file renamed over it): compile writes it, `pipeline bench --apply` edits
    it in a folder an engine may be loading from."""
    path = Path(folder) / ENGINE_FILE
    tmp = path.with_name(f".{ENGINE_FILE}.tmp")
    tmp.write_text(json.dumps(manifest, indent=2) + "\n")
    os.replace(tmp, path)
    return path


def engine_config(manifest: dict, device: str | None = None, dtype: str | None = None):
    """The EngineConfig engine.json describes (device and dtype may be overridden). device: cpu (None), cuda,
    cuda:N, or auto (pipeline.engine.device.resolve_device: cuda:0 where torch sees a GPU, else cpu)."""
    from pipeline.engine.config import EngineConfig
    from pipeline.engine.device import DEFAULT_GPU_MEMORY_FRACTION, resolve_device

    gate = manifest.get("gate_batch_size")
    policy = GatePolicy() if gate is None else GatePolicy.with_ceiling(gate)
    return EngineConfig(max_batch_size=manifest["max_batch_size"], max_seq_len=manifest["max_seq_len"],
                        dtype=dtype or manifest["dtype"], device=resolve_device(device) if device else "cpu",
                        num_draft_tokens=max(1, manifest["num_draft_tokens"]), gate=policy,
                        lm_head=manifest.get("lm_head", "auto"), kv_cache_bytes=manifest.get("kv_cache_bytes"),
                        gpu_memory_fraction=manifest.get("gpu_memory_fraction", DEFAULT_GPU_MEMORY_FRACTION),
                        prefill_chunk=manifest.get("prefill_chunk", 256),
                        prefix_caching=manifest.get("prefix_caching", True),
                        ngram_first=manifest.get("ngram_first", True))


def load_engine(path: str | Path, device: str | None = None, dtype: str | None = None,
                max_batch_size: int | None = None, gate: GatePolicy | None = None):
    """The LLMEngine an engine folder describes (device, dtype, the KV-cache slots and the gate's GatePolicy may
    be overridden at load). device: auto, cpu, cuda or cuda:N (None: cpu); a GPU torch doesn't see raises
    ConfigError. On a GPU the KV pool takes engine.json's gpu_memory_fraction of the memory free after the weights,
    up to max_batch_size requests of max_seq_len."""
    from pipeline.engine.llm_engine import LLMEngine
    from pipeline.policy.cost_model import CostModel

    folder = Path(path)
    manifest = read_engine_manifest(folder)
    config = engine_config(manifest, device, dtype)
    if max_batch_size is not None:
        config = replace(config, max_batch_size=max_batch_size)
    if gate is not None:
        config = replace(config, gate=gate)
    return LLMEngine.load(folder / manifest["target"]["path"], config, draft=manifest_draft(folder, manifest),
                          cost_model=CostModel.load(folder))


def manifest_draft(folder: Path, manifest: dict) -> DraftSpec:
    """The folder's draft: draft/ holds a draft model's or an EAGLE-3 head's checkpoint (in whichever layout it
    came), beside engine.json."""
    kind = manifest["draft"]["kind"]
    return DraftSpec(kind, str(Path(folder).absolute() / manifest["draft"]["path"]) if kind in ("model", "eagle3") else "")
