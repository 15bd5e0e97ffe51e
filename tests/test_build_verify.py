"""`pipeline build` trusts no folder whose bytes changed after it was written: the engine owns its weights (no
hard link into the model cache), a damaged stage output is rebuilt, and --force re-hashes the cached sources."""

from __future__ import annotations

import dataclasses
import hashlib
import io
import os
import shutil
from pathlib import Path

import pytest
from test_build import cpu_env, statuses, tiny_options
from test_gguf import write_tiny_gguf

from pipeline.build import run_build
from pipeline.engine import load_engine
from pipeline.models.resolve import resolve_model

WEIGHTS = "model.safetensors"


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> Path:
    """Built from a .gguf, the target's weights live in $PIPELINE_HOME/models: the cache the issue damaged."""
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny-llama.gguf")


def truncate(path: Path) -> None:
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size // 2)


def flip_a_byte_keeping_size_and_mtime(path: Path) -> None:
    """Damage only a hash can see."""
    st = path.stat()
    with open(path, "r+b") as f:
        f.seek(st.st_size // 2)
        byte = f.read(1)
        f.seek(st.st_size // 2)
        f.write(bytes([byte[0] ^ 0xFF]))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def test_engine_weights_are_copies_so_damaging_the_engine_leaves_the_model_cache_intact(tiny_gguf, tmp_path):
    result = run_build(tiny_options(tiny_gguf, tmp_path), cpu_env(tiny_gguf))
    cached = resolve_model(str(tiny_gguf)).path / WEIGHTS
    engine = Path(result.engine) / "target" / WEIGHTS
    assert engine.stat().st_ino != cached.stat().st_ino and engine.stat().st_nlink == 1
    good = cached.read_bytes()
    truncate(engine)
    assert cached.read_bytes() == good


def test_a_damaged_engine_file_is_rebuilt_by_the_next_build_and_loads(tiny_target, tmp_path):
    target = shutil.copytree(tiny_target, tmp_path / "target")
    options = tiny_options(target, tmp_path)
    first = run_build(options, cpu_env(target))
    weights = Path(first.engine) / "target" / WEIGHTS
    weights.touch()  # a new mtime over the same bytes: hashed once, still reused
    assert statuses(run_build(options, cpu_env(target))) == {"compile": "reused", "assemble": "reused"}

    truncate(weights)
    said = io.StringIO()
    again = run_build(options, cpu_env(target), quiet=False, stream=said)
    assert statuses(again) == {"compile": "built", "assemble": "reused"}
    assert said.getvalue() == f"compile: target/{WEIGHTS} changed since it was built; rebuilding\n"
    assert weights.read_bytes() == (tiny_target / WEIGHTS).read_bytes()
    assert load_engine(again.engine).config.max_batch_size == 2


def test_force_rehashes_the_cached_conversion_and_converts_a_damaged_one_again(tiny_gguf, tmp_path):
    options = tiny_options(tiny_gguf, tmp_path)
    first = run_build(options, cpu_env(tiny_gguf))
    cached = resolve_model(str(tiny_gguf)).path / WEIGHTS
    good = cached.read_bytes()
    flip_a_byte_keeping_size_and_mtime(cached)
    assert statuses(run_build(options, cpu_env(tiny_gguf))) == {"compile": "reused", "assemble": "reused"}

    said = io.StringIO()
    forced = run_build(dataclasses.replace(options, force=True), cpu_env(tiny_gguf), quiet=False, stream=said)
    assert cached.read_bytes() == good
    assert statuses(forced) == {"compile": "built", "assemble": "built"}
    assert f"{WEIGHTS} changed since it was converted; converting again" in said.getvalue()
    assert (Path(first.engine) / "target" / WEIGHTS).read_bytes() == good
    load_engine(forced.engine)


def test_a_truncated_cached_conversion_is_converted_again_without_force(tiny_gguf, tmp_path):
    """A size check costs a stat, so every resolve makes it."""
    options = tiny_options(tiny_gguf, tmp_path)
    run_build(options, cpu_env(tiny_gguf))
    cached = resolve_model(str(tiny_gguf)).path / WEIGHTS
    good = cached.read_bytes()
    truncate(cached)
    again = run_build(options, cpu_env(tiny_gguf))
    assert cached.read_bytes() == good
    assert statuses(again) == {"compile": "reused", "assemble": "reused"}  # the same bytes as before: same key


def test_verify_checks_hub_weights_against_their_blob_hash_and_refetches(tiny_target, tmp_path, monkeypatch):
    """huggingface_hub names a weight file's blob by its sha256: a damaged one is downloaded again (offline here,
    so the error says which file and why, instead of building from it)."""
    from huggingface_hub import constants

    from pipeline.errors import ModelNotFoundError

    repo = tmp_path / "hf-cache" / "models--someorg--tiny"
    commit = "0123456789abcdef0123456789abcdef01234567"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    snapshot = shutil.copytree(tiny_target, repo / "snapshots" / commit)
    blob = repo / "blobs" / hashlib.sha256((tiny_target / WEIGHTS).read_bytes()).hexdigest()
    blob.parent.mkdir()
    (snapshot / WEIGHTS).rename(blob)
    (snapshot / WEIGHTS).symlink_to(os.path.relpath(blob, snapshot))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf-cache"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)

    assert resolve_model("someorg/tiny", verify=True).path == snapshot
    flip_a_byte_keeping_size_and_mtime(blob)
    assert resolve_model("someorg/tiny").path == snapshot  # without verify: no weights are read
    with pytest.raises(ModelNotFoundError, match=f"someorg/tiny's {WEIGHTS} in the local Hugging Face cache "
                                                 "changed since it was downloaded and HF_HUB_OFFLINE is set"):
        resolve_model("someorg/tiny", verify=True)
