import os
import sys
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    # The engine's GPU kernels run here through Triton's interpreter (tests/test_gpu_kernels.py). Triton reads
    # this when it is first imported, so it is set before anything imports it.
    os.environ.setdefault("TRITON_INTERPRET", "1")

sys.path.insert(0, str(Path(__file__).parent))
from tiny_models import make_tiny_llama  # noqa: E402

# Under pytest-xdist (`-n 2`) each of the two workers computes on one core; two threads each would
# leave OpenMP teams spinning for a core the other worker holds.
torch.set_num_threads(1 if os.environ.get("PYTEST_XDIST_WORKER") else 2)


@pytest.fixture(scope="session")
def tiny_target(tmp_path_factory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("target"), seed=0, layers=3)


@pytest.fixture(scope="session")
def tiny_draft(tmp_path_factory) -> Path:
    """A smaller, unrelated random model with the same tokenizer: a poor draft, which is the point."""
    return make_tiny_llama(tmp_path_factory.mktemp("draft"), seed=1, layers=1, hidden=32, heads=2,
                           kv_heads=1, intermediate=64)


@pytest.fixture(autouse=True)
def pipeline_home(tmp_path, monkeypatch):
    """Point the pipeline's cache at a temp dir so tests never touch the user's."""
    monkeypatch.setenv("PIPELINE_HOME", str(tmp_path / "home"))


@pytest.fixture(scope="session")
def smollm2(tmp_path_factory) -> Path:
    """The embedded default, converted once per test session (about 25 s) for the slow end-to-end tests."""
    import os

    from pipeline.models.resolve import resolve_model

    home = tmp_path_factory.mktemp("smollm2-home")
    old = os.environ.get("PIPELINE_HOME")
    os.environ["PIPELINE_HOME"] = str(home)
    try:
        return resolve_model("smollm2-135m").path
    finally:
        if old is None:
            os.environ.pop("PIPELINE_HOME", None)
        else:
            os.environ["PIPELINE_HOME"] = old


# The fast loop (`pytest -m "not slow"`) leaves out every test that starts a tritonserver (5-40 s each on two
# cores) or runs the embedded SmolLM2. Tests that reach them through these fixtures are marked here; tests that
# start a server inline carry @pytest.mark.slow themselves.
SLOW_FIXTURES = {"smollm2", "server", "url", "served", "echo_server", "llmapi_server", "served_repo"}


def pytest_collection_modifyitems(items):
    for item in items:
        if SLOW_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)
