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
if os.environ.get("PYTEST_XDIST_WORKER"):
    # The servers the tests start compute on both cores (two threads an engine), beside the other worker: an
    # OpenMP team's idle thread then spins (libgomp's default, right for a server alone on its machine) on a core
    # the other worker needs. Passive waiting sleeps instead; every process the tests start inherits it.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


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


def run_folder(tmp_path_factory) -> Path:
    """The temp folder the whole run shares: under xdist, the workers' common parent (xdist's own recipe for a
    session fixture made once)."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


@pytest.fixture(scope="session", autouse=True)
def kernel_cache(tmp_path_factory):
    """One folder of built C kernels for the run: both xdist workers, the ISA caps' runs, and every server stub and
    CLI process they start. In each test's own home, every tritonserver's engine and every `pipeline` subprocess
    built them again (3 s of a core each, on the path of each server's start). A run started by a run (the ISA caps'
    pytest) keeps the folder it was handed (PIPELINE_TEST_KERNELS): each build's file is named by its source, flags
    and CPU. A user's own $PIPELINE_KERNEL_CACHE is never written."""
    folder = Path(os.environ.get("PIPELINE_TEST_KERNELS") or run_folder(tmp_path_factory) / "kernels")
    folder.mkdir(exist_ok=True)  # each build is renamed into place whole (cpu_kernels._build): workers may race
    old = {name: os.environ.get(name) for name in ("PIPELINE_KERNEL_CACHE", "PIPELINE_TEST_KERNELS")}
    os.environ["PIPELINE_KERNEL_CACHE"] = os.environ["PIPELINE_TEST_KERNELS"] = str(folder)
    yield folder
    for name, value in old.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


@pytest.fixture(scope="session")
def smollm2(tmp_path_factory) -> Path:
    """The embedded default, converted once per test run (about 20 s) for the slow end-to-end tests. Under xdist
    the workers share one conversion: the first converts it under a file lock in the run's common temp folder
    (xdist's own recipe for a session fixture made once), the other waits and reads it."""
    from filelock import FileLock

    from pipeline.models.resolve import resolve_model

    root = run_folder(tmp_path_factory)
    home = root / "smollm2-home"
    old = os.environ.get("PIPELINE_HOME")
    os.environ["PIPELINE_HOME"] = str(home)
    try:
        with FileLock(str(root / "smollm2-home.lock")):
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


# Seconds a file's tests take on one of CI's two xdist workers (a clean run's --durations, summed per file), for
# the order files are handed out in: longest first, so the last file a worker takes is a short one and the two
# finish together (xdist's own order, most tests first, left one worker idle for a minute at the end). Only the
# order matters: a stale number costs balance, never a test. Files not listed are shorter than the last here.
FILE_SECONDS = {
    "test_serving.py": 255, "test_openai_api.py": 190, "test_isa_caps.py": 150, "test_draft_target.py": 100,
    "test_engine.py": 100, "test_speculative.py": 95, "test_gpu_kernels.py": 90, "test_soak.py": 70,
    "test_serve.py": 85, "test_smoke_trtllm.py": 45, "test_build.py": 38, "test_cuda_graphs.py": 35,
    "test_cli.py": 32, "test_bench_gpu_script.py": 31, "test_openai_edge.py": 29, "test_client.py": 29,
    "test_bench.py": 35, "test_assemble.py": 26, "test_triton_config.py": 23, "test_cpu_kernels.py": 20,
    "test_families.py": 50, "test_draft_train.py": 19, "test_eagle3.py": 10, "test_model.py": 7,
}


# The two files the workers start with, one each: the longest with servers beside the longest without. The two
# longest (test_serving, test_openai_api) both run servers; started together, each took a third longer.
FIRST = ("test_serving.py", "test_isa_caps.py")


def pytest_collection_modifyitems(items):
    for item in items:
        if SLOW_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)
    # A stable sort: a file's own tests keep their order (its module fixtures are made once either way).
    items.sort(key=lambda item: (item.path.name not in FIRST, -FILE_SECONDS.get(item.path.name, 0)))
