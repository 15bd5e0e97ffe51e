"""The device a run takes (pipeline/engine/device.py): auto|cpu|cuda|cuda:N checked against what torch sees (mocked
here, so each branch runs on any machine), the KV pool a GPU's free memory holds, the engine's config and load, and
--device on compile, generate, serve and build through CliRunner."""

import json
import pickle

import pytest
import torch
from click.testing import CliRunner

from cli_checks import assert_one_line_error
from pipeline.cli import main
from pipeline.compiler import CompileOptions, compile_model
from pipeline.engine import llm_engine
from pipeline.engine.config import EngineConfig, GatePolicy
from pipeline.engine import device as device_module
from pipeline.engine.device import Device, DeviceChoice, choose_device, kv_pool_blocks, resolve_device
from pipeline.engine.folder import load_engine
from pipeline.engine.kv_cache import BLOCK_SIZE
from pipeline.engine.llm_engine import LLMEngine
from pipeline.engine.sampling import SamplingParams
from pipeline.errors import ConfigError


def see_gpus(monkeypatch, *names: str, cuda_build: bool = True) -> None:
    """torch, as it would be on a machine with these GPUs (none: no GPU; cuda_build=False: a CPU-only wheel)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: bool(names))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: len(names))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=0: names[i])
    monkeypatch.setattr(torch.version, "cuda", "12.8" if cuda_build else None)
    monkeypatch.setattr(device_module, "_cpu_only_build", lambda: not cuda_build)  # torch/version.py's view too


@pytest.fixture
def no_gpu(monkeypatch):
    """This CPU box, whatever machine the tests run on: a CPU-only torch that sees no GPU."""
    see_gpus(monkeypatch, cuda_build=False)


def run(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


# ---- resolve_device ---------------------------------------------------------------------------------------------


def test_auto_picks_the_cpu_where_torch_sees_no_gpu_and_says_why(no_gpu):
    assert resolve_device("auto") == "cpu"
    assert choose_device("auto") == ("cpu", "device: cpu (auto: torch sees no GPU; this torch is a CPU-only build)")


def test_auto_picks_the_first_gpu_where_torch_sees_any(monkeypatch):
    see_gpus(monkeypatch, "NVIDIA H200", "NVIDIA H200")
    assert choose_device("auto") == ("cuda:0", "device: cuda:0 (NVIDIA H200, auto: torch sees 2 GPUs)")
    see_gpus(monkeypatch, "NVIDIA H200")
    assert choose_device("auto")[1] == "device: cuda:0 (NVIDIA H200, auto: torch sees 1 GPU)"


def test_cuda_is_cuda0_and_an_index_picks_that_gpu(monkeypatch):
    see_gpus(monkeypatch, "NVIDIA H100 80GB HBM3", "NVIDIA L40S")
    assert resolve_device("cuda") == resolve_device(" CUDA:0 ") == "cuda:0"
    assert choose_device("cuda:1") == ("cuda:1", "device: cuda:1 (NVIDIA L40S, asked for; torch sees 2 GPUs)")
    assert choose_device("cpu") == ("cpu", "device: cpu (asked for)")


def test_cpu_never_asks_torch_about_gpus(monkeypatch):
    def broken():
        raise AssertionError("asked torch about GPUs")

    monkeypatch.setattr(torch.cuda, "is_available", broken)
    assert resolve_device("cpu") == "cpu"
    monkeypatch.setattr(device_module, "_cpu_only_build", lambda: False)  # a CUDA build: auto must ask
    with pytest.raises(AssertionError):  # the control: auto does ask
        resolve_device("auto")


@pytest.mark.parametrize("text, cpu_only", [
    ("__version__ = '2.13.0+cpu'\ncuda: Optional[str] = None\nhip: Optional[str] = None\n", True),
    ("cuda: Optional[str] = '12.8'\nhip: Optional[str] = None\n", False),
    ("cuda = None\nhip = '6.2.4'\n", False),
    ("cuda = None\n", False),  # a file that doesn't say both: torch is asked
    ("cuda = (\n", False),
])
def test_a_cpu_only_torch_is_known_from_its_version_file_without_importing_it(tmp_path, text, cpu_only):
    """`pipeline serve`'s supervisor picks auto -> cpu on a CPU-only wheel without importing torch (2 s, 230 MB)."""
    (tmp_path / "version.py").write_text(text)
    assert device_module._cpu_only_build(tmp_path / "version.py") is cpu_only
    assert device_module._cpu_only_build(tmp_path / "missing.py") is False
    # This machine's own torch: the file says what the imported module does.
    assert device_module._cpu_only_build() is (torch.version.cuda is None and torch.version.hip is None)


@pytest.mark.parametrize("cuda_build, needle", [(False, "CPU-only build"), (True, "CUDA_VISIBLE_DEVICES")])
def test_a_gpu_torch_does_not_see_is_a_one_line_error_naming_why_and_the_fix(monkeypatch, cuda_build, needle):
    see_gpus(monkeypatch, cuda_build=cuda_build)
    for choice in ("cuda", "cuda:0", "cuda:3"):
        with pytest.raises(ConfigError) as err:
            resolve_device(choice)
        message = str(err.value)
        assert "\n" not in message and f"device {choice!r}" in message and "torch sees no GPU" in message
        assert needle in message and "--device cpu or auto" in message


def test_a_gpu_index_past_the_count_names_the_ones_there(monkeypatch):
    see_gpus(monkeypatch, "NVIDIA H200", "NVIDIA H200")
    with pytest.raises(ConfigError, match=r"torch sees 2 GPUs \(cuda:0 to cuda:1\); use --device cuda:0 to cuda:1"):
        resolve_device("cuda:2")
    assert resolve_device("cuda:1") == "cuda:1"  # the last one is there


@pytest.mark.parametrize("name", ["gpu", "cuda:", "cuda:-1", "cuda:x", "cuda0", "mps", "", "auto:0"])
def test_a_malformed_name_is_refused_before_torch_is_asked(monkeypatch, name):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: pytest.fail("asked torch"))
    with pytest.raises(ConfigError, match="unknown device .*; use auto, cpu, cuda or cuda:N"):
        resolve_device(name)
    with pytest.raises(ConfigError):
        DeviceChoice(name)


# ---- the KV pool on a GPU ---------------------------------------------------------------------------------------


def test_kv_pool_takes_the_fraction_of_free_memory_in_whole_blocks():
    # 10_000 free bytes x 0.9 = 9_000 bytes = 90 blocks of 100; room for 100 requests of 4 blocks: not the limit.
    assert kv_pool_blocks(10_000, 100, block_size=16, max_batch_size=100, max_seq_len=64) == 90
    assert kv_pool_blocks(10_000, 100, block_size=16, max_batch_size=100, max_seq_len=64, fraction=0.5) == 50
    assert kv_pool_blocks(10_099, 110, block_size=16, max_batch_size=100, max_seq_len=64) == 82  # 9089 // 110


def test_kv_pool_is_capped_at_max_batch_size_requests_of_max_seq_len():
    # 2 requests of 65 tokens: 5 blocks each (65 / 16, rounded up), so 10 blocks though 90 would fit.
    assert kv_pool_blocks(10_000, 100, block_size=16, max_batch_size=2, max_seq_len=65) == 10
    assert kv_pool_blocks(10**15, 100, block_size=16, max_batch_size=64, max_seq_len=2048) == 64 * 128


def test_kv_pool_refuses_when_not_one_request_of_max_seq_len_fits():
    # 1 request of 64 tokens needs 4 blocks: 400 bytes x 1.0 is exactly enough, 399 is not, nor 400 x 0.9.
    assert kv_pool_blocks(400, 100, block_size=16, max_batch_size=8, max_seq_len=64, fraction=1.0) == 4
    for free, fraction in ((399, 1.0), (400, 0.9), (0, 0.9), (-5, 0.9)):
        with pytest.raises(ConfigError) as err:
            kv_pool_blocks(free, 100, block_size=16, max_batch_size=8, max_seq_len=64, fraction=fraction)
        assert "\n" not in str(err.value) and "max_seq_len 64 needs 4" in str(err.value)
        assert "lower max_seq_len" in str(err.value)


@pytest.mark.parametrize("fraction", [0.0, -0.1, 1.01, 2])
def test_kv_pool_fraction_must_be_in_zero_to_one(fraction):
    with pytest.raises(ConfigError, match=r"must be in \(0, 1\]"):
        kv_pool_blocks(10_000, 100, block_size=16, max_batch_size=8, max_seq_len=64, fraction=fraction)


# ---- the engine's config and pool -------------------------------------------------------------------------------


def test_engine_config_takes_cpu_and_cuda_and_refuses_auto_and_bad_fractions():
    for device in ("cpu", "cuda", "cuda:1"):
        assert EngineConfig(device=device).device == device
    with pytest.raises(ConfigError, match=r"resolve a choice first: .*resolve_device\('auto'\)"):
        EngineConfig(device="auto")
    with pytest.raises(ConfigError, match="unknown device 'gpu'"):
        EngineConfig(device="gpu")
    assert EngineConfig(gpu_memory_fraction=1.0).gpu_memory_fraction == 1.0
    for fraction in (0.0, 1.5):
        with pytest.raises(ConfigError, match="gpu_memory_fraction must be in"):
            EngineConfig(gpu_memory_fraction=fraction)


def pool_config(**kw) -> EngineConfig:
    return EngineConfig(**{"max_batch_size": 8, "max_seq_len": 64, "gate": GatePolicy(min_tokens=0), **kw})


@pytest.fixture
def fake_gpu_memory(monkeypatch):
    """The engine's GPU branch on this CPU: its device counts as CUDA, and mem_get_info reports `free[0]` bytes."""
    free = [0]
    asked = []
    monkeypatch.setattr(llm_engine, "is_cuda", lambda device: True)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: asked.append(device) or (free[0], 10**12))
    return free, asked


def test_on_a_gpu_the_pool_takes_the_fraction_of_free_memory_after_the_weights(tiny_target, fake_gpu_memory):
    free, asked = fake_gpu_memory
    free[0] = 10**12  # plenty: capped at max_batch_size x max_seq_len, as on a CPU
    plenty = LLMEngine.load(tiny_target, pool_config())
    assert asked and plenty.blocks.num_blocks == 8 * (64 // BLOCK_SIZE)
    bytes_per_block = plenty.cache.bytes_per_block()
    free[0] = 20 * bytes_per_block  # x 0.5: 10 blocks, under the 8 x 4 the batch could use
    engine = LLMEngine.load(tiny_target, pool_config(gpu_memory_fraction=0.5))
    assert asked and engine.blocks.num_blocks == 10 and engine.describe()["kv_cache"]["blocks"] == 10
    assert engine.cache.k.shape[1] == 11  # the pool and its trash block
    [req] = engine.generate([[1, 2, 3]], SamplingParams(max_tokens=8))  # a request runs in the smaller pool
    assert len(req.output_ids) == 8
    free[0] = 3 * bytes_per_block  # not one request of 64 tokens (4 blocks)
    with pytest.raises(ConfigError, match="max_seq_len 64 needs 4"):
        LLMEngine.load(tiny_target, pool_config())


def test_kv_cache_bytes_still_sets_the_pool_on_a_gpu(tiny_target, fake_gpu_memory):
    free, asked = fake_gpu_memory
    free[0] = 10**12
    bytes_per_block = LLMEngine.load(tiny_target, pool_config()).cache.bytes_per_block()
    asked.clear()
    engine = LLMEngine.load(tiny_target, pool_config(kv_cache_bytes=5 * bytes_per_block))
    assert engine.blocks.num_blocks == 5 and not asked


def test_on_a_cpu_the_pool_is_max_batch_size_requests_and_free_memory_is_never_asked(tiny_target, monkeypatch):
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: pytest.fail("asked for GPU memory"))
    engine = LLMEngine.load(tiny_target, pool_config())
    assert engine.blocks.num_blocks == 8 * (64 // BLOCK_SIZE)
    assert engine.describe()["device"] == "cpu"


def test_pool_blocks_pay_for_the_eagle3_states_kept_beside_each_block(fake_gpu_memory):
    free, _ = fake_gpu_memory
    free[0] = 1000
    config = pool_config(max_seq_len=16, gpu_memory_fraction=1.0)
    assert LLMEngine._pool_blocks(config, 100, 0, 16) == 8  # 10 would fit: capped at 8 x 1 block
    assert LLMEngine._pool_blocks(pool_config(max_batch_size=64, max_seq_len=16, gpu_memory_fraction=1.0),
                                  100, 0, 16) == 10
    assert LLMEngine._pool_blocks(pool_config(max_batch_size=64, max_seq_len=16, gpu_memory_fraction=1.0),
                                  100, 150, 16) == 4  # 1000 // (100 + 150)


# ---- load_engine and the engine folder --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def engine_dir(tiny_target, tmp_path_factory):
    out = tmp_path_factory.mktemp("engine") / "e"
    compile_model(CompileOptions("torch", tiny_target, out, max_batch_size=2, max_seq_len=64,
                                 free_gpu_memory_fraction=0.5, calibrate=False, device="cpu"))
    return out


def test_load_engine_takes_auto_and_the_folders_gpu_memory_fraction(engine_dir, no_gpu):
    assert json.loads((engine_dir / "engine.json").read_text())["gpu_memory_fraction"] == 0.5
    engine = load_engine(engine_dir, device="auto")
    assert engine.config.device == "cpu" and engine.config.gpu_memory_fraction == 0.5
    assert load_engine(engine_dir).config.device == "cpu"  # None: the CPU, as before
    with pytest.raises(ConfigError, match="torch sees no GPU"):
        load_engine(engine_dir, device="cuda")


# ---- --device on the command line -------------------------------------------------------------------------------


@pytest.fixture
def repo(tmp_path):
    """A repository serve accepts (a model folder with a config), enough to get as far as choosing the device."""
    (tmp_path / "repo" / "ensemble").mkdir(parents=True)
    (tmp_path / "repo" / "ensemble" / "config.pbtxt").write_text('name: "ensemble"\n')
    return tmp_path / "repo"


def test_device_cuda_on_a_machine_without_a_gpu_is_one_line_for_every_command(tiny_target, tmp_path, repo, no_gpu):
    commands = {
        "generate": ["generate", "hi", "--model", tiny_target, "--max-tokens", 2],
        "compile": ["compile", "-b", "torch", "-t", tiny_target, "-o", tmp_path / "engine"],
        "serve": ["serve", "--repo", repo],
        "build": ["build", "--target", tiny_target, "--backend", "torch", "--draft", "none",
                  "--engines-dir", tmp_path / "engines", "--repo", tmp_path / "built"],
    }
    for name, args in commands.items():
        result = run(*args, "--device", "cuda")
        assert result.exit_code == 2, (name, result.output)
        assert_one_line_error(result, "device 'cuda'", "torch sees no GPU", "--device cpu or auto")
    assert not any((tmp_path / p).exists() for p in ("engine", "engines", "built"))  # refused before any output


def test_a_gpu_past_the_count_is_one_line_before_anything_loads(tiny_target, monkeypatch):
    see_gpus(monkeypatch, "NVIDIA H200")
    result = run("generate", "hi", "--model", tiny_target, "--device", "cuda:1")
    assert_one_line_error(result, "device 'cuda:1' is past the GPUs here", "--device cuda:0 to cuda:0, or auto")


def test_a_malformed_device_is_one_line_naming_the_choices(tiny_target, tmp_path):
    result = run("compile", "-b", "torch", "-t", tiny_target, "-o", tmp_path / "e", "--device", "gpu0")
    assert_one_line_error(result, "unknown device 'gpu0'", "auto, cpu, cuda or cuda:N")


def test_generate_device_auto_picks_the_cpu_here_and_says_so_once(tiny_target, no_gpu):
    result = run("generate", "hi", "--model", tiny_target, "--max-tokens", 2)
    assert result.exit_code == 0, result.output
    lines = [line for line in result.stderr.splitlines() if line.startswith("device:")]
    assert lines == ["device: cpu (auto: torch sees no GPU; this torch is a CPU-only build)"]
    data = json.loads(run("generate", "hi", "--model", tiny_target, "--max-tokens", 2, "--json").stdout)
    assert data["config"]["device"] == "cpu" and data["config"]["engine"]["device"] == "cpu"
    assert data["config"]["device_line"] == lines[0]


def test_generate_refuses_device_with_url():
    result = run("generate", "hi", "--url", "127.0.0.1:1", "--device", "cpu")
    assert_one_line_error(result, "--device", "served repository fixes")


def test_compile_device_auto_picks_the_cpu_here_and_says_so(tiny_target, tmp_path, no_gpu):
    result = run("compile", "-b", "torch", "-t", tiny_target, "-o", tmp_path / "e", "--no-calibrate")
    assert result.exit_code == 0, result.output
    assert result.output.splitlines()[1] == "device: cpu (auto: torch sees no GPU; this torch is a CPU-only build)"
    data = json.loads(run("compile", "-b", "torch", "-t", tiny_target, "-o", tmp_path / "j", "--no-calibrate",
                          "--json").stdout)
    assert data["device"] == "cpu" and data["manifest"]["device"] == "cpu"


def test_a_chosen_device_chooses_itself_and_keeps_its_line_across_processes(monkeypatch, no_gpu):
    device, line = choose_device("auto")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: pytest.fail("asked torch again"))
    assert choose_device(device) == (device, line) and resolve_device(device) is device
    assert DeviceChoice(device) is device and isinstance(device, Device)
    again = pickle.loads(pickle.dumps(device))  # a build's stages, a spawned process
    assert (again, again.line, type(again)) == ("cpu", line, Device)
    read = pickle.loads(pickle.dumps(DeviceChoice(" CUDA ")))
    assert (read, read.asked, type(read)) == ("cuda:0", " CUDA ", DeviceChoice)


def test_each_command_chooses_its_device_once_and_the_engine_takes_it_as_chosen(tiny_target, tmp_path, monkeypatch,
                                                                                 no_gpu):
    """--device is read at the command line and chosen once (asking torch); what loads the engine and picks its
    kernels takes that Device as it is. The control: load_engine given the spelling chooses once more."""
    import pipeline.engine.device as device_module

    chosen = []
    real = device_module.pick_device

    def counting(choice, *args, **kwargs):
        chosen.append(str(choice))
        return real(choice, *args, **kwargs)

    monkeypatch.setattr(device_module, "pick_device", counting)
    assert run("generate", "hi", "--model", tiny_target, "--max-tokens", 2).exit_code == 0
    assert chosen == ["auto"]
    chosen.clear()
    result = run("compile", "-b", "torch", "-t", tiny_target, "-o", tmp_path / "e", "-d", "ngram", "--max-seq-len",
                 64, "--max-batch-size", 2)  # calibrates: loads the engine it wrote, on the chosen device
    assert result.exit_code == 0 and "cost model measured" in result.output, result.output
    assert chosen == ["auto"]
    chosen.clear()
    load_engine(tmp_path / "e", device="auto")
    assert chosen == ["auto"]


def test_compile_refuses_a_device_for_tensorrt_llm(tiny_target, tmp_path):
    result = run("compile", "-b", "trtllm", "-t", tiny_target, "--dry-run", "-o", tmp_path / "t", "--device", "cuda:0")
    assert_one_line_error(result, "--device cuda:0 places the portable engine, and --backend trtllm is for "
                                  "TensorRT-LLM", "drop --device")
