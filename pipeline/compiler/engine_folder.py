"""The portable route's compile steps: the engine folder `pipeline compile --backend torch` writes, and the cost
model measured on it (the folder's reader, and the format's name, version and layout, are the engine's own:
pipeline/engine/folder.py).

Weights stay in the checkpoint's own (Hugging Face, maybe ModelOpt-quantized) layout rather than the
engine's fused one: the loader's HF path is the tested one for quantized tensors and their scales, and
fusing q/k/v and gate/up at load takes milliseconds. Files are copied (cloned copy-on-write where the
filesystem can), never hard-linked: a hard link shares the bytes, so damage to the engine's file would be
damage to the model cache it came from. The folder never depends on the source staying put or intact.
"""

from __future__ import annotations

import fcntl
import shutil
from pathlib import Path

from pipeline.compiler.checkpoint import Checkpoint
from pipeline.compiler.job import CompileJob
from pipeline.compiler.options import CompileResult
from pipeline.draft_spec import DraftSpec
from pipeline.engine.folder import ENGINE_FILE, FORMAT, FORMAT_VERSION, write_engine_manifest

RUNTIME_DTYPES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}
FICLONE = 0x40049409  # linux/fs.h: the destination shares the source's blocks until either is written


def compile_into(stage: Path, job: CompileJob, result: CompileResult, manifest: dict) -> None:
    """engine.json, and unless a dry run the checkpoints' files beside it and the cost model measured on them."""
    o, sizes = job.options, job.sizes
    engine = engine_manifest(
        job.target, job.draft, job.draft_ckpt, max_batch_size=sizes.max_batch_size, max_seq_len=sizes.max_seq_len,
        num_draft_tokens=sizes.max_draft_len, dtype=runtime_dtype(job.target, o.dtype),
        gate_batch_size=o.gate_batch_size, kv_cache_bytes=o.kv_cache_bytes, prefill_chunk=o.prefill_chunk,
        prefix_caching=o.prefix_caching, gpu_memory_fraction=o.free_gpu_memory_fraction, ngram_first=o.ngram_first)
    if o.dry_run:
        write_engine_manifest(stage, engine)
    else:
        write_engine_dir(stage, engine, job.target, job.draft_ckpt)
        result.files += ["target/"] + (["draft/"] if job.draft_ckpt is not None else [])
        if o.calibrate and job.draft.speculates:
            _calibrate(stage, result, manifest, job.device)
    result.files.insert(0, ENGINE_FILE)
    result.commands["load"] = ["python", "-c", f'from pipeline.engine import load_engine; '
                                               f'engine = load_engine("{result.output}")']
    manifest["configs"] = {ENGINE_FILE: engine}


def _calibrate(stage: Path, result: CompileResult, manifest: dict, device: str) -> None:
    """Measure the staged engine's cost model on the device compile chose, and store it with the engine."""
    from pipeline.engine.calibrate import calibrate
    from pipeline.engine.folder import load_engine
    from pipeline.policy.cost_model import FILENAME

    cal = calibrate(load_engine(stage, device=device))
    cal.cost.save(stage)
    result.files.append(FILENAME)
    result.notes.append(f"cost model measured in {cal.seconds:.0f} s ({cal.cost.source})"
                        + (f"; {cal.note}" if cal.note else ""))
    manifest["cost_model"] = {"seconds": round(cal.seconds, 1), "source": cal.cost.source, "note": cal.note}


def runtime_dtype(ckpt: Checkpoint, requested: str = "auto") -> str:
    return RUNTIME_DTYPES.get(ckpt.dtype, "fp32") if requested == "auto" else requested


def engine_manifest(target: Checkpoint, draft: DraftSpec, draft_ckpt: Checkpoint | None, *, max_batch_size: int,
                    max_seq_len: int, num_draft_tokens: int, dtype: str, gate_batch_size: int | None,
                    kv_cache_bytes: int | None = None, prefill_chunk: int = 256, prefix_caching: bool = True,
                    gpu_memory_fraction: float = 0.9, ngram_first: bool = True) -> dict:
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
        # the target's KV block pool (null: max_batch_size x max_seq_len tokens), chunked prefill, prefix reuse
        "kv_cache_bytes": kv_cache_bytes, "prefill_chunk": prefill_chunk, "prefix_caching": prefix_caching,
        "ngram_first": ngram_first,  # an EAGLE-3 head drafts where n-gram lookup finds no match (EngineConfig)
        # on a GPU with kv_cache_bytes null: the share of the memory free after the weights the pool may take
        "gpu_memory_fraction": gpu_memory_fraction,
        "target": {"path": "target", "source": str(target.path), "checkpoint_dtype": target.dtype,
                   "quant_algo": target.quant_algo, "weights": "hf-safetensors"},
        "draft": draft_entry,
        "tokenizer": "target",
    }


def write_engine_dir(stage: Path, manifest: dict, target: Checkpoint, draft_ckpt: Checkpoint | None) -> None:
    _copy_files(target.path, stage / "target")
    if draft_ckpt is not None:
        _copy_files(draft_ckpt.path, stage / "draft")
    write_engine_manifest(stage, manifest)


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
