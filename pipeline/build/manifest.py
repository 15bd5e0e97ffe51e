"""engines/<name>/build.json: what a build read, what it ran with, and what each stage produced.

It is also the build's memory between runs: a stage whose input key is unchanged is reused when its output
still matches the size, mtime and sha256 recorded per file when it was written (pipeline.checksums), and model
file hashes are cached by (path, size, mtime) so a re-run hashes nothing it hashed before.
Written whole to a temp file and renamed, so an interrupted run never leaves half a manifest.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

from pipeline.checksums import sha256_file

FORMAT = "pipeline-build"
FORMAT_VERSION = 1
# The bundled tritonserver has no --version flag (only a running server reports it), so its version is
# taken from the wheel that carries it: nvidia-pytriton 0.7.0 bundles tritonserver 2.51.
BUNDLED_TRITONSERVER = {"0.7.0": "2.51"}


def new_manifest(name: str) -> dict:
    return {"format": FORMAT, "format_version": FORMAT_VERSION, "name": name, "created": _now(),
            "stages": {}, "file_hashes": {}}


def read_manifest(path: Path) -> dict | None:
    """The manifest at `path`, or None when there is none (or it is unreadable: the build starts over)."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None
    if data.get("format") != FORMAT or data.get("format_version") != FORMAT_VERSION:
        return None
    return data


def write_manifest(path: Path, manifest: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    manifest["updated"] = _now()
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps(manifest, indent=2) + "\n")
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes it 0600; build.json should read like any written file
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def model_files(folder: Path) -> list[Path]:
    """The files a model folder's build depends on: every regular file at its top level."""
    if folder.is_file():
        return [folder]
    return sorted(p for p in folder.iterdir() if p.is_file())


def hash_files(files: list[Path], cache: dict) -> dict[str, dict]:
    """{file name: {size, sha256}} for `files`; `cache` (path -> size, mtime_ns, sha256) is read and updated."""
    out = {}
    for f in files:
        st = f.stat()
        key = str(f.absolute())
        hit = cache.get(key)
        if not (hit and hit["size"] == st.st_size and hit["mtime_ns"] == st.st_mtime_ns):
            hit = {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": sha256_file(f)}
            cache[key] = hit
        out[f.name] = {"size": hit["size"], "sha256": hit["sha256"]}
    return out


def input_key(config_key: str, dep_keys: list[str], model_hashes: list[dict]) -> str:
    """A stage's input key: its configuration, what its dependencies were built from, and its models' bytes."""
    blob = json.dumps({"config": config_key, "deps": dep_keys, "models": model_hashes}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def tool_versions() -> dict[str, str | None]:
    """torch, modelopt, tensorrt_llm (None when absent) and tritonserver, read from package metadata."""
    def version(dist: str) -> str | None:
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            return None

    pytriton = version("nvidia-pytriton")
    if shutil.which("tritonserver"):  # NVIDIA's containers set TRITON_SERVER_VERSION
        triton = os.environ.get("TRITON_SERVER_VERSION") or "on PATH (version unknown)"
    elif pytriton:
        triton = f"{BUNDLED_TRITONSERVER.get(pytriton, 'unknown')} (bundled in nvidia-pytriton {pytriton})"
    else:
        triton = None
    return {"pipeline": version("specdec-pipeline"), "torch": version("torch"), "modelopt": version("nvidia-modelopt"),
            "transformers": version("transformers"), "tensorrt_llm": version("tensorrt_llm") or version("tensorrt-llm"),
            "tritonserver": triton}


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
