"""The portable engine folder: what `pipeline compile --backend torch` writes and `load_engine` reads.

Layout:
  engine.json    sizes (max batch, max sequence length, max draft length), dtypes, gate, draft kind
  target/        the target's Hugging Face checkpoint files: config, *.safetensors, tokenizer
  draft/         a draft model's checkpoint, or an EAGLE-3 head's (only with one of those)

Weights stay in the checkpoint's own (Hugging Face, maybe ModelOpt-quantized) layout rather than the
engine's fused one: the loader's HF path is the tested one for quantized tensors and their scales, and
fusing q/k/v and gate/up at load takes milliseconds. Files are copied (cloned copy-on-write where the
filesystem can), never hard-linked: a hard link shares the bytes, so damage to the engine's file would be
damage to the model cache it came from. The folder never depends on the source staying put or intact.
"""

from __future__ import annotations

import fcntl
import json
import shutil
from pathlib import Path

from pipeline.compile.checkpoint import Checkpoint
from pipeline.compile.draft import DraftSpec
from pipeline.errors import ModelFormatError

ENGINE_FILE = "engine.json"
FORMAT = "pipeline-torch-engine"
FORMAT_VERSION = 1
RUNTIME_DTYPES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}
FICLONE = 0x40049409  # linux/fs.h: the destination shares the source's blocks until either is written


def runtime_dtype(ckpt: Checkpoint, requested: str = "auto") -> str:
    return RUNTIME_DTYPES.get(ckpt.dtype, "fp32") if requested == "auto" else requested


def engine_manifest(target: Checkpoint, draft: DraftSpec, draft_ckpt: Checkpoint | None, *, max_batch_size: int,
                    max_seq_len: int, num_draft_tokens: int, dtype: str, gate_batch_size: int | None) -> dict:
    """engine.json's content: pure."""
    draft_entry: dict = {"kind": draft.kind}
    if draft_ckpt is not None:
        draft_entry.update(path="draft", source=str(draft_ckpt.path), checkpoint_dtype=draft_ckpt.dtype,
                           quant_algo=draft_ckpt.quant_algo)
    return {
        "format": FORMAT, "format_version": FORMAT_VERSION,
        "max_batch_size": max_batch_size, "max_seq_len": max_seq_len,
        "num_draft_tokens": num_draft_tokens if draft.speculates else 0,
        "dtype": dtype,  # compute dtype of the engine (EngineConfig.dtype)
        "gate_batch_size": gate_batch_size,  # speculate while the running batch is at or below this
        "target": {"path": "target", "source": str(target.path), "checkpoint_dtype": target.dtype,
                   "quant_algo": target.quant_algo, "weights": "hf-safetensors"},
        "draft": draft_entry,
        "tokenizer": "target",
    }


def write_engine_dir(stage: Path, manifest: dict, target: Checkpoint, draft_ckpt: Checkpoint | None) -> None:
    _copy_files(target.path, stage / "target")
    if draft_ckpt is not None:
        _copy_files(draft_ckpt.path, stage / "draft")
    (stage / ENGINE_FILE).write_text(json.dumps(manifest, indent=2) + "\n")


def _copy_files(source: Path, dest: Path) -> None:
    dest.mkdir(parents=True)
    for f in sorted(source.iterdir()):
        if f.is_file():
            _clone_or_copy(f, dest / f.name)


def _clone_or_copy(src: Path, dst: Path) -> None:
    """A reflink (btrfs, XFS: instant, no extra disk until a write) where the filesystem has them, else bytes."""
    try:
        with open(src, "rb") as s, open(dst, "wb") as d:
            fcntl.ioctl(d.fileno(), FICLONE, s.fileno())
        shutil.copystat(src, dst)
    except OSError:  # ext4, tmpfs, overlayfs, another filesystem: copy2 rewrites the empty dst
        shutil.copy2(src, dst)


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


def engine_config(manifest: dict, device: str | None = None, dtype: str | None = None):
    from pipeline.engine.config import EngineConfig, GatePolicy

    gate = manifest.get("gate_batch_size")
    policy = GatePolicy() if gate is None else GatePolicy(max_batch_size=gate, hysteresis=min(4, gate))
    return EngineConfig(max_batch_size=manifest["max_batch_size"], max_seq_len=manifest["max_seq_len"],
                        dtype=dtype or manifest["dtype"], device=device or "cpu",
                        num_draft_tokens=max(1, manifest["num_draft_tokens"]), gate=policy)


def load_engine(path: str | Path, device: str | None = None, dtype: str | None = None,
                max_batch_size: int | None = None, gate=None):
    """The LLMEngine an engine folder describes (device, dtype, the KV-cache slots and the gate's GatePolicy may
    be overridden at load)."""
    from dataclasses import replace

    from pipeline.engine.cost_model import CostModel
    from pipeline.engine.llm_engine import LLMEngine

    folder = Path(path)
    manifest = read_engine_manifest(folder)
    config = engine_config(manifest, device, dtype)
    if max_batch_size is not None:
        config = replace(config, max_batch_size=max_batch_size)
    if gate is not None:
        config = replace(config, gate=gate)
    draft = manifest["draft"]
    draft_arg = {"none": None, "ngram": "ngram"}.get(draft["kind"])
    if draft["kind"] == "model":
        draft_arg = folder / draft["path"]
    elif draft["kind"] == "eagle3":  # draft/ holds the head's checkpoint, in whichever layout it came
        draft_arg = f"eagle3:{folder / draft['path']}"
    return LLMEngine.load(folder / manifest["target"]["path"], config, draft=draft_arg, cost_model=CostModel.load(folder))
