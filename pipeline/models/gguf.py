"""Convert a GGUF checkpoint into a plain Hugging Face folder (config.json + model.safetensors + tokenizer).

transformers dequantizes a GGUF on load, but the model it returns refuses `save_pretrained`
("quantized with gguf and is not serializable"), so the tensors, config and tokenizer are
written here by hand. The folder appears atomically: it is built in a temp folder beside
`out_dir` and renamed into place, so an interrupted conversion never leaves a half-written cache. The folder
records what it wrote (conversion.json: size and sha256 per file), so a cache damaged later is noticed.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import sys
import tempfile
from contextlib import contextmanager
from functools import partial
from pathlib import Path

from pipeline.checksums import first_change, record_files
from pipeline.errors import MissingDependencyError, ModelFormatError, ModelNotFoundError

# Config keys that describe the GGUF source, not the architecture: a dense copy must not carry them.
_SOURCE_ONLY_KEYS = ("quantization_config", "_model_name_or_path", "transformers_version")
RECORD = "conversion.json"
_bars = True  # transformers' per-tensor bar during a conversion; off under quiet_conversion()


@contextmanager
def quiet_conversion():
    """No conversion bar inside: for a caller that shows its own (build's stage bar) or was asked to be quiet."""
    global _bars
    was, _bars = _bars, False
    try:
        yield
    finally:
        _bars = was


def is_converted(folder: Path) -> bool:
    return (folder / "config.json").is_file() and (folder / "model.safetensors").is_file()


def conversion_damage(folder: Path, rehash: bool = False) -> str | None:
    """Why a converted folder can't be trusted ("model.safetensors changed since it was converted"), or None.

    Sizes are compared always (a stat per file), hashes only with `rehash` (--force). A folder converted before
    records were kept has nothing to check against: taken as it is, unless `rehash` asks for proof.
    """
    try:
        record = json.loads((folder / RECORD).read_text())["files"]
    except (OSError, ValueError, KeyError, TypeError):
        return f"it has no readable {RECORD} to check it against" if rehash else None
    changed = first_change(folder, record, rehash)
    return f"{changed} changed since it was converted" if changed else None


def convert_gguf(gguf_file: Path, out_dir: Path) -> Path:
    """Dequantize `gguf_file` to fp32 safetensors in `out_dir`; returns `out_dir` at once when already there."""
    gguf_file, out_dir = Path(gguf_file).resolve(), Path(out_dir)
    if is_converted(out_dir):
        return out_dir
    if not gguf_file.is_file():
        raise ModelNotFoundError(f"{gguf_file}: no such GGUF file; pass an existing .gguf file or a model folder")
    if out_dir.exists() and any(out_dir.iterdir()):
        raise ModelFormatError(f"{out_dir} holds an incomplete conversion; delete it and retry")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    _remove_abandoned_temps(out_dir)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-{os.getpid()}-", dir=out_dir.parent))
    try:
        _write_hf_folder(gguf_file, tmp)
        record = {"source": str(gguf_file), "files": record_files(tmp, mtimes=False)}
        (tmp / RECORD).write_text(json.dumps(record, indent=2) + "\n")
        try:
            os.replace(tmp, out_dir)  # atomic; replaces an empty leftover folder too
        except OSError:
            if not is_converted(out_dir):  # not a concurrent conversion that finished first
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


def _write_hf_folder(gguf_file: Path, folder: Path) -> None:
    try:
        import gguf  # noqa: F401  (transformers needs it to read the file)
        import torch
        from safetensors.torch import save_file
        import transformers.modeling_gguf_pytorch_utils as gguf_utils
        from transformers import AutoModelForCausalLM, AutoTokenizer
    except ImportError as err:
        raise MissingDependencyError(
            f"converting a GGUF needs {err.name}; install it with: pip install gguf transformers safetensors"
        ) from None

    src_dir, name = str(gguf_file.parent), gguf_file.name
    # Its tqdm ignores transformers' own progress-bar switch: a bar only on a terminal, and never under
    # quiet_conversion().
    bar = gguf_utils.tqdm
    gguf_utils.tqdm = partial(bar, disable=not (_bars and sys.stderr.isatty()))
    try:
        model = AutoModelForCausalLM.from_pretrained(src_dir, gguf_file=name, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(src_dir, gguf_file=name)
    except (ValueError, KeyError, OSError) as err:
        first_line = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ModelFormatError(
            f"{gguf_file} could not be read as a GGUF checkpoint ({first_line}); "
            "use a Llama-family GGUF or a Hugging Face folder"
        ) from None
    finally:
        gguf_utils.tqdm = bar

    save_file(_dense_state_dict(model), str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(_hf_config(model), indent=2, sort_keys=True) + "\n")
    tokenizer.save_pretrained(str(folder))
    if tokenizer.chat_template and not _saved_chat_template(folder):
        # Older transformers kept the template only in memory for GGUF tokenizers; keep it on disk.
        (folder / "chat_template.jinja").write_text(tokenizer.chat_template)


def _dense_state_dict(model) -> dict:
    """Contiguous fp32 tensors, each stored once: tied lm_head.weight shares the embedding."""
    state, seen = {}, {}
    for key, tensor in model.state_dict().items():
        ptr = (tensor.data_ptr(), tuple(tensor.shape))
        if ptr in seen:  # a tied alias (lm_head.weight -> model.embed_tokens.weight)
            continue
        seen[ptr] = key
        state[key] = tensor.detach().contiguous()
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    return state


def _hf_config(model) -> dict:
    cfg = model.config.to_dict()
    for key in _SOURCE_ONLY_KEYS:
        cfg.pop(key, None)
    cfg["architectures"] = [type(model).__name__]
    cfg["tie_word_embeddings"] = bool(model.config.tie_word_embeddings)
    cfg["dtype"] = "float32"
    # transformers 5 keeps rope_theta inside rope_parameters; older readers (and TRT-LLM export) look at the top.
    rope = cfg.get("rope_parameters") or {}
    if "rope_theta" in rope:
        cfg.setdefault("rope_theta", rope["rope_theta"])
    return cfg


def _saved_chat_template(folder: Path) -> bool:
    if (folder / "chat_template.jinja").is_file():
        return True
    config = folder / "tokenizer_config.json"
    return config.is_file() and bool(json.loads(config.read_text()).get("chat_template"))


def _remove_abandoned_temps(out_dir: Path) -> None:
    """Temp folders left by a conversion that was killed (its process is gone)."""
    for tmp in out_dir.parent.glob(f".{glob.escape(out_dir.name)}.tmp-*"):
        try:
            pid = int(tmp.name.split(".tmp-")[1].split("-")[0])
            os.kill(pid, 0)
        except (ValueError, IndexError, ProcessLookupError):
            shutil.rmtree(tmp, ignore_errors=True)
        except PermissionError:
            pass  # a live process of another user
