"""`pipeline serve` and pipeline.triton.server against a real tritonserver (the CPU one in nvidia-pytriton)."""

from __future__ import annotations

import re
import signal
import socket
import subprocess
import sys
import textwrap
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from pipeline.cli import main
from pipeline.errors import ServeError
from pipeline.triton.ports import free_ports
from pipeline.triton.server import (
    SHM_PREFIX, ServeOptions, ServerBinary, TritonServer, failure_from_log, find_tritonserver, group_members,
    server_command,
)

ECHO_CONFIG = """
name: "{name}"
backend: "python"
max_batch_size: 0
input [ {{ name: "INPUT" data_type: TYPE_FP32 dims: [ -1 ] }} ]
output [ {{ name: "OUTPUT" data_type: TYPE_FP32 dims: [ -1 ] }} ]
instance_group [ {{ kind: KIND_CPU count: 1 }} ]
"""

ECHO_MODEL = """
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.Tensor(
                    "OUTPUT", pb_utils.get_input_tensor_by_name(request, "INPUT").as_numpy())])
                for request in requests]
"""

BROKEN_MODEL = """
class TritonPythonModel:
    def initialize(self, args):
        raise RuntimeError("broken on purpose")
"""


def write_model(repo: Path, name: str, source: str) -> None:
    (repo / name / "1").mkdir(parents=True)
    (repo / name / "config.pbtxt").write_text(ECHO_CONFIG.format(name=name))
    (repo / name / "1" / "model.py").write_text(textwrap.dedent(source))


def options_for(repo: Path, **kwargs) -> ServeOptions:
    grpc, http, metrics = free_ports()
    return ServeOptions(repo=repo, grpc_port=grpc, http_port=http, metrics_port=metrics, **kwargs)


def our_shm(server: TritonServer) -> list[Path]:
    return list(Path("/dev/shm").glob(f"{server.shm_prefix}*"))


@pytest.fixture(scope="module")
def echo_repo(tmp_path_factory) -> Path:
    repo = tmp_path_factory.mktemp("triton_repo")
    write_model(repo, "echo", ECHO_MODEL)
    return repo


@pytest.fixture(scope="module")
def echo_server(echo_repo):
    server = TritonServer(options_for(echo_repo))
    try:
        server.start()
        server.wait_ready(60)
        yield server
    finally:
        server.stop()


def test_command_binds_every_endpoint_to_the_host_and_points_at_the_stub_backends():
    binary = ServerBinary(Path("/opt/tritonserver/bin/tritonserver"))
    options = ServeOptions(repo=Path("/models"), grpc_port=9001, http_port=9000, metrics_port=9002)
    cmd = server_command(options, binary, Path("/ws/backends"), shm_prefix="p_")
    assert cmd[0] == "/opt/tritonserver/bin/tritonserver"
    for flag in ["--model-repository=/models", "--grpc-address=127.0.0.1", "--grpc-port=9001",
                 "--http-address=127.0.0.1", "--http-port=9000", "--metrics-address=127.0.0.1",
                 "--metrics-port=9002", "--backend-directory=/ws/backends", "--exit-on-error=true",
                 "--backend-config=python,shm-region-prefix-name=p_",
                 f"--backend-config=python,shm-default-byte-size={16 << 20}",
                 f"--backend-config=python,shm-growth-byte-size={16 << 20}"]:
        assert flag in cmd
    opened = server_command(ServeOptions(repo=Path("/models"), host="0.0.0.0"), binary)
    assert "--grpc-address=0.0.0.0" in opened and not any(a.startswith("--backend-directory") for a in opened)


def test_the_portable_route_runs_with_two_malloc_arenas_unless_the_user_chose(monkeypatch):
    """Fewer glibc arenas keep the gate's RSS from creeping (docs/reliability.md, Soak); printed in the command,
    and a value the user exported is left alone. TensorRT-LLM's launch stays upstream's."""
    from pipeline.triton.launch import Launch
    from pipeline.triton.server import launch_argv

    binary, options = ServerBinary(Path("/opt/tritonserver/bin/tritonserver")), ServeOptions(repo=Path("/m"))
    monkeypatch.delenv("MALLOC_ARENA_MAX", raising=False)
    assert launch_argv(options, binary)[1] == {"MALLOC_ARENA_MAX": "2", "PIPELINE_DEVICE": "auto"}
    assert launch_argv(options, binary, launch=Launch("engine", "plain"))[1] == {}
    monkeypatch.setenv("MALLOC_ARENA_MAX", "8")
    assert launch_argv(options, binary)[1] == {"PIPELINE_DEVICE": "auto"}


def test_bundled_server_has_the_stub_for_this_python():
    binary = find_tritonserver()
    assert binary.path.is_file()
    if binary.bundled:
        assert f"{sys.version_info[0]}.{sys.version_info[1]}" in str(binary.stub)
        assert binary.stub.is_file() and (binary.python_backend / "libtriton_python.so").is_file()


def test_failure_from_log_names_the_model_and_its_log_line():
    log = ('I1129 model_lifecycle.cc:472] "loading: broken:1"\n'
           'E1129 19:03:03.685465 24584 model_lifecycle.cc:642] "failed to load \'broken\' version 1: Internal: '
           'RuntimeError: broken on purpose\\n\\nAt:\\n  /r/broken/1/model.py(3): initialize\\n"\n'
           "error: creating server: Internal - failed to load all models\n")
    reason = failure_from_log(log)
    assert reason.startswith("model 'broken' failed to load:") and "broken on purpose" in reason
    assert "\\n" not in reason and "model_lifecycle.cc:642" in reason
    socket_log = 'E1129 grpc_server.cc:2463] "Failed to listen on 127.0.0.1:8001: Socket already in use"\n'
    assert "Socket already in use" in failure_from_log(socket_log)


def test_server_serves_echo_over_grpc_on_localhost(echo_server):
    import tritonclient.grpc as grpcclient

    assert echo_server.endpoints.grpc == f"127.0.0.1:{echo_server.options.grpc_port}"
    client = grpcclient.InferenceServerClient(echo_server.endpoints.grpc)
    assert client.is_model_ready("echo")
    data = np.array([1.5, -2.0, 3.25], dtype=np.float32)
    tensor = grpcclient.InferInput("INPUT", list(data.shape), "FP32")
    tensor.set_data_from_numpy(data)
    result = client.infer("echo", [tensor], outputs=[grpcclient.InferRequestedOutput("OUTPUT")])
    np.testing.assert_array_equal(result.as_numpy("OUTPUT"), data)


def test_metrics_port_answers(echo_server):
    with urllib.request.urlopen(echo_server.endpoints.metrics, timeout=5) as response:
        assert "nv_inference_request_success" in response.read().decode()


@pytest.mark.slow
def test_stop_leaves_no_stub_processes_or_shared_memory(echo_repo):
    server = TritonServer(options_for(echo_repo))
    try:
        server.start()
        pid = server.process.pid
        server.wait_ready(60)
        assert len(group_members(pid)) >= 2  # the server and the echo model's stub
        assert our_shm(server)
    finally:
        server.stop()
    assert group_members(pid) == [] and our_shm(server) == []
    assert server.shm_prefix.startswith(SHM_PREFIX)


@pytest.mark.slow
def test_broken_model_error_names_the_model_and_its_log_line(tmp_path):
    write_model(tmp_path / "repo", "broken", BROKEN_MODEL)
    server = TritonServer(options_for(tmp_path / "repo", log_file=tmp_path / "server.log"))
    try:
        server.start()
        pid = server.process.pid
        with pytest.raises(ServeError, match=r"model 'broken' failed to load: .*broken on purpose") as err:
            server.wait_ready(60)
    finally:
        server.stop()
    assert "\n" not in str(err.value) and "model_lifecycle" in str(err.value)
    assert str(tmp_path / "server.log") in str(err.value)
    assert group_members(pid) == []


@pytest.mark.slow
def test_port_in_use_is_a_one_line_error(echo_repo):
    options = options_for(echo_repo)
    with socket.socket() as held:
        held.bind(("127.0.0.1", options.grpc_port))
        held.listen()
        server = TritonServer(options)
        try:
            with pytest.raises(ServeError, match=rf"grpc port {options.grpc_port} on 127.0.0.1 is already in use"):
                server.start()
        finally:
            server.stop()
        assert server.process is None


@pytest.mark.slow
def test_a_port_taken_while_the_models_load_is_an_error_not_a_server_without_that_endpoint(echo_repo, monkeypatch):
    """tritonserver binds its ports after loading the models, and without the metrics port it logs an error
    and serves on: a port taken after our check must fail the start, in one line naming the flag."""
    import pipeline.triton.server as server_module

    options = options_for(echo_repo)
    monkeypatch.setattr(server_module, "port_in_use", lambda host, port: False)  # taken after the check
    with socket.socket() as held:
        held.bind(("127.0.0.1", options.metrics_port))
        held.listen()
        server = TritonServer(options)
        try:
            server.start()
            with pytest.raises(ServeError, match=r"started without an endpoint: its metrics service did not start: "
                                                 r".*already in use; pass another --metrics-port") as err:
                server.wait_ready(60)
        finally:
            server.stop()
    assert "\n" not in str(err.value) and server.process is None


def test_cli_missing_repo_is_a_one_line_error(tmp_path):
    result = CliRunner().invoke(main, ["serve", "--repo", str(tmp_path / "missing")])
    assert result.exit_code == 1
    assert result.output.count("\n") == 1 and "does not exist" in result.output
    assert "pipeline assemble" in result.output and "pipeline build" in result.output


def test_cli_body_limit_without_the_openai_api_is_a_one_line_error(tmp_path):
    result = CliRunner().invoke(main, ["serve", "--repo", str(tmp_path), "--openai-max-body-bytes", "65536"])
    assert result.exit_code == 2 and result.output.count("\n") == 1 and "pass --openai-port too" in result.output
    assert "FrontendOptions(" not in result.output
    from pipeline.openai_api.process import FrontendOptions, frontend_argv

    argv = frontend_argv(FrontendOptions(port=9000, max_body_bytes=65536), tmp_path, "127.0.0.1:8001", None)
    assert argv[-2:] == ["--max-body-bytes", "65536"]


def test_cli_empty_repo_is_a_one_line_error(tmp_path):
    (tmp_path / "README.md").write_text("models go here\n")
    result = CliRunner().invoke(main, ["serve", "--repo", str(tmp_path)])
    assert result.exit_code == 1 and "has no models" in result.output and result.output.count("\n") == 1


def test_admin_apis_need_the_servers_key_and_inference_does_not(echo_server):
    """Raising log verbosity or reading a model's config (it holds engine paths) takes the key that serve
    made; health, metadata, statistics and inference stay open, over HTTP and gRPC."""
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    from pipeline.triton.server import ADMIN_HEADER

    def http(path, data=None, key=None):
        request = urllib.request.Request(echo_server.endpoints.http + path, data=data,
                                         headers={ADMIN_HEADER: key} if key else {})
        try:
            with urllib.request.urlopen(request, timeout=5) as response:
                return response.status
        except urllib.error.HTTPError as err:
            return err.code

    key = echo_server.options.admin_key
    assert len(key) >= 16
    raise_verbosity = b'{"log_verbose_level": 1}'
    assert http("/v2/logging", raise_verbosity) == 403 and http("/v2/logging", raise_verbosity, key="wrong") == 403
    assert http("/v2/models/echo/config") == 403 and http("/v2/repository/index", b"{}") == 403
    assert http("/v2/models/echo/config", key=key) == 200
    assert http("/v2/logging", b'{"log_verbose_level": 0}', key=key) == 200
    for open_path in ("/v2/health/ready", "/v2/models/echo", "/v2/models/echo/stats"):
        assert http(open_path) == 200, open_path
    client = grpcclient.InferenceServerClient(echo_server.endpoints.grpc)
    with pytest.raises(InferenceServerException, match="restricted"):
        client.get_model_config("echo")
    assert client.get_model_config("echo", headers={f"triton-grpc-protocol-{ADMIN_HEADER}": key}).config.name == "echo"
    assert client.is_model_ready("echo")


def test_a_bad_admin_key_from_the_environment_is_a_one_line_error(monkeypatch, echo_repo):
    from pipeline.triton.server import ADMIN_KEY_ENV

    monkeypatch.setenv(ADMIN_KEY_ENV, "a:b=c")
    with pytest.raises(ServeError, match=f"set {ADMIN_KEY_ENV} to such a key"):
        TritonServer(options_for(echo_repo))
    monkeypatch.setenv(ADMIN_KEY_ENV, "team-key-0123456789")
    assert TritonServer(options_for(echo_repo)).options.admin_key == "team-key-0123456789"


DIES_SOON_MODEL = """
import os, signal, threading
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        # Dies 2 s after it starts, every time: a model that can't stay up.
        threading.Timer(2.0, os.kill, (os.getpid(), signal.SIGKILL)).start()

    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.Tensor(
                    "OUTPUT", pb_utils.get_input_tensor_by_name(request, "INPUT").as_numpy())])
                for request in requests]
"""


@pytest.mark.slow
def test_a_dead_stub_is_restarted_and_a_crash_loop_ends_with_its_reason(tmp_path):
    from pipeline.triton.supervise import RestartBudget, python_stubs, supervise

    repo = tmp_path / "repo"
    write_model(repo, "doomed", DIES_SOON_MODEL)
    said: list[str] = []
    with TritonServer(options_for(repo)) as server:
        assert [s.model for s in python_stubs(server.process.pid)] == ["doomed"]
        with pytest.raises(ServeError, match=r"the python stub of doomed \(pid \d+\) died, after 1 restarts"):
            supervise(server, said.append, ready_timeout=60, budget=RestartBudget(limit=1), poll_s=0.1)
        assert server.process.poll() is None  # serve's finally stops it; supervise only restarts
    assert len(said) == 2 and "restarting tritonserver" in said[0] and said[1].startswith("ready again after")


def test_what_died_names_a_dead_stub_and_the_server_it_took_down():
    """A killed stub can take tritonserver with it inside one poll: the line names both, the stub first."""
    import os
    from types import SimpleNamespace

    from pipeline.triton.supervise import Stub, what_died

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    up = SimpleNamespace(process=SimpleNamespace(poll=lambda: None), log=lambda: "")
    down = SimpleNamespace(process=SimpleNamespace(poll=lambda: 1), log=lambda: "")
    alive = Stub(os.getpid(), "gate")
    assert what_died(up, [alive]) is None
    assert what_died(up, [alive, Stub(gone.pid, "torch_engine")]) == \
        f"the python stub of torch_engine (pid {gone.pid}) died"
    assert what_died(down, [alive]) == "tritonserver exited with code 1"
    assert what_died(down, [Stub(gone.pid, "torch_engine")]) == \
        f"the python stub of torch_engine (pid {gone.pid}) died; tritonserver exited with code 1"


def test_a_restarted_servers_death_is_named_from_its_own_runs_log(tmp_path):
    """A restart appends to the same log file; a death is named from the lines of the run that died. An earlier
    run's "Signal (6) received." (a stub's death can abort tritonserver) once named a later SIGKILL a SIGABRT."""
    import signal

    from pipeline.triton.supervise import what_died

    repo = tmp_path / "repo"
    write_model(repo, "echo", ECHO_MODEL)
    with TritonServer(options_for(repo)) as server:
        with open(server.log_path, "a") as log:  # what an earlier run's crash handler printed
            log.write("Signal (6) received.\n")
        server.restart()
        server.wait_ready(60)
        assert "Signal (6) received." in server.log_path.read_text() and "Signal (6)" not in server.log()
        server.process.send_signal(signal.SIGKILL)
        server.process.wait(10)
        assert what_died(server, []) == "tritonserver exited with code -9"


# ---- the portable engine's device -------------------------------------------------------------------------------


def test_serve_hands_the_portable_engine_its_device_in_the_servers_environment():
    from pipeline.triton.launch import Launch
    from pipeline.triton.server import launch_argv

    binary = ServerBinary(Path("/opt/tritonserver/bin/tritonserver"))
    for device, env in (("cuda:1", "cuda:1"), ("cuda", "cuda:0"), ("cpu", "cpu"), ("auto", "auto")):
        assert launch_argv(ServeOptions(repo=Path("/m"), device=device), binary)[1]["PIPELINE_DEVICE"] == env
    engine = Launch("engine", "leader", 1, 1, ("tensorrt_llm",))
    assert "PIPELINE_DEVICE" not in launch_argv(ServeOptions(repo=Path("/m")), binary, launch=engine)[1]


def test_serve_picks_the_device_as_it_starts_and_refuses_one_for_tensorrt_llm(monkeypatch):
    import torch

    from pipeline.errors import ConfigError
    from pipeline.triton.launch import Launch
    from pipeline.triton.server import engine_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.version, "cuda", None)
    torch_repo, engine = Launch("torch", "plain"), Launch("engine", "leader", 1, 1, ("tensorrt_llm",))
    assert engine_device(ServeOptions(), torch_repo) == (
        "cpu", "device: cpu (auto: torch sees no GPU; this torch is a CPU-only build)")
    assert engine_device(ServeOptions(device="cuda:1"), torch_repo, check=False) == ("cuda:1", "")  # a dry run
    with pytest.raises(ConfigError, match="torch sees no GPU"):
        engine_device(ServeOptions(device="cuda"), torch_repo)
    assert engine_device(ServeOptions(), engine) == ("", "")
    with pytest.raises(ConfigError, match="this repository \\(engine route\\) is for TensorRT-LLM, .* drop --device"):
        engine_device(ServeOptions(device="cuda:0"), engine, check=False)


def test_cli_dry_run_shows_the_device_and_checks_only_its_spelling(echo_repo):
    result = CliRunner().invoke(main, ["serve", "--repo", str(echo_repo), "--dry-run", "--device", "cuda:3"])
    assert result.exit_code == 0, result.output
    assert result.output.startswith("PIPELINE_DEVICE=cuda:3 ")  # for the machine it will run on: no GPU needed here
    bad = CliRunner().invoke(main, ["serve", "--repo", str(echo_repo), "--dry-run", "--device", "tpu"])
    assert bad.exit_code == 2 and "unknown device 'tpu'" in bad.output


def test_the_known_upstream_cancellation_crash_is_named_and_no_other():
    """The stack tritonserver 2.51 printed when a soak's cancelled stream crashed it (frames trimmed): named as the
    upstream bug. Another segfault, or one long before the last start, is not."""
    from pipeline.triton.supervise import CANCEL_RACE, known_crash

    crash = """I1204 21:51:32.428612 18392 http_server.cc:362] "Started Metrics Service at 127.0.0.1:22849"
Signal (11) received.
 0# 0x0000563BD9F3952D in /venv/lib/python3.11/site-packages/pytriton/tritonserver/bin/tritonserver
 1# 0x00007FDCA185A050 in /lib/x86_64-linux-gnu/libc.so.6
 2# pthread_mutex_lock in /lib/x86_64-linux-gnu/libc.so.6
 3# 0x0000563BD9FAF140 in /venv/lib/python3.11/site-packages/pytriton/tritonserver/bin/tritonserver
10# TRITONBACKEND_ResponseFactorySendFlags in /venv/lib/python3.11/site-packages/nvidia_pytriton.libs/libtritonserver.so
11# 0x00007FDC9A922536 in /tmp/pipeline-serve-zez2kwrk/backends/python/libtriton_python.so
"""
    other = "Signal (11) received.\n 0# 0x0000563BD9F3952D in tritonserver\n 1# free in libc.so.6\n"
    started = 'I1204 21:52:40.1 18500 grpc_server.cc:2558] "Started GRPCInferenceService at 127.0.0.1:26906"\n'
    assert known_crash(crash) == CANCEL_RACE
    assert known_crash(other) is None and known_crash(started) is None
    assert known_crash(crash + started + other) is None  # the last crash decides


def test_a_segfault_in_the_grpc_stream_handlers_process_is_named_from_the_binarys_own_symbols():
    """The stack a clean CI run's soak saw (2026-12-07): frames in the tritonserver binary only, unnamed in the log;
    the bundled binary's symbol table names frame 2 ModelStreamInferHandler::Process (the upstream cancellation
    family). The same frames moved into another function, or a binary that isn't there, are not named."""
    from pipeline.triton.server import find_tritonserver
    from pipeline.triton.supervise import CANCEL_RACE, known_crash

    binary = find_tritonserver().path

    def stack(frame2: int, path=binary) -> str:
        return (f"Signal (11) received.\n 0# 0x000055ED896B952D in {path}\n"
                f" 1# 0x00007FFB2E05A050 in /lib/x86_64-linux-gnu/libc.so.6\n 2# 0x{frame2:016X} in {path}\n"
                f" 3# 0x000055ED8971388B in {path}\n 4# 0x00007FFB2DED44A3 in /lib/x86_64-linux-gnu/libstdc++.so.6\n")

    assert known_crash(stack(0x55ED89728B25)) == CANCEL_RACE
    assert known_crash(stack(0x55ED8971388B)) is None  # frame 3's function (the handler's Start lambda) instead
    assert known_crash(stack(0x55ED89728B25, "/no/such/tritonserver")) is None
    # Any crash is named where it happened, in the supervisor's one line: known or not.
    from types import SimpleNamespace

    from pipeline.triton.backtrace import crash_site
    from pipeline.triton.supervise import what_died

    assert crash_site(stack(0x55ED89728B25)) == "SIGSEGV in triton::server::grpc::ModelStreamInferHandler::Process"
    elsewhere = crash_site(stack(0x55ED8971388B))
    assert elsewhere.startswith("SIGSEGV in ") and "7ProcessE" not in elsewhere and "::Process" not in elsewhere
    assert crash_site(stack(0x55ED89728B25, "/no/such/tritonserver")) == "SIGSEGV"  # no symbols: the signal alone
    assert crash_site("I1207 model loaded\n") is None
    dead = SimpleNamespace(process=SimpleNamespace(poll=lambda: -11), log=lambda: stack(0x55ED89728B25))
    assert what_died(dead, []) == ("tritonserver died of SIGSEGV in "
                                   "triton::server::grpc::ModelStreamInferHandler::Process")


@pytest.mark.slow
def test_an_engine_that_fails_to_load_fails_its_model_with_the_loaders_error(tiny_target, tmp_path):
    """The portable engine loads on its scheduler thread (one OpenMP team: torch_engine's docstring); an error
    there still fails the model's load, in one line that names it."""
    from pipeline.triton.assemble import AssembleOptions, assemble
    from serving_checks import ngram_engine

    engine = ngram_engine(tiny_target, tmp_path, slots=2)
    repo = Path(assemble(AssembleOptions(engine=engine, repo=tmp_path / "repo")).repo)
    for weights in engine.rglob("*.safetensors"):
        weights.unlink()
    server = TritonServer(options_for(repo, log_file=tmp_path / "server.log"))
    try:
        server.start()
        with pytest.raises(ServeError, match=r"model 'torch_engine' failed to load: ") as err:
            server.wait_ready(120)
    finally:
        server.stop()
    assert "\n" not in str(err.value) and "ModelFormatError: no *.safetensors in" in str(err.value)


@pytest.mark.slow
def test_cli_serves_until_sigterm_drains_what_it_holds_and_reaps_its_children(tiny_target, tmp_path):
    """`pipeline serve` prints its endpoints and where its admin key is kept (never the key); on SIGTERM (a rolling
    update's stop) it lets the gRPC and OpenAI streams it holds finish, each with the text it would have had (its
    prompt's answer alone, before), refuses a new request with UNAVAILABLE (a client retries it elsewhere), exits
    once they are done, long before its drain timeout, and leaves no process of the server behind. Without the drain
    (--drain-timeout 0), tritonserver's own SIGTERM cuts all three ("Stream removed"; pipeline.triton.drain)."""
    import contextlib
    import queue
    import threading

    import numpy as np
    import tritonclient.grpc as grpcclient
    from openai import OpenAI
    from serving_checks import inputs, ngram_engine, responses, tensor

    from pipeline.triton.assemble import AssembleOptions, assemble

    engine = ngram_engine(tiny_target, tmp_path, slots=4, max_seq_len=1024)
    repo = Path(assemble(AssembleOptions(engine=engine, repo=tmp_path / "repo")).repo)
    grpc, http, metrics, openai_port = free_ports(4)
    cli = subprocess.Popen(
        [sys.executable, "-c", "from pipeline.cli import main; main()", "serve", "--repo", str(repo), "--grpc-port",
         str(grpc), "--http-port", str(http), "--metrics-port", str(metrics), "--openai-port", str(openai_port),
         "--served-model-name", "tiny", "--drain-timeout", "60", "--log-file", str(tmp_path / "server.log")],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    # 800 tokens each, end tokens ignored: long answers, so all three are still streaming when the SIGTERM comes and
    # when the new request after it arrives (with 400, under a light load, they had all ended 0.5 s after it)
    prompts, max_tokens = ["List every prime.", "Write a poem."], 800
    answers: dict[str, str] = {}
    after_term: dict[str, int] = {}  # chunks each stream got after the SIGTERM: it was in flight then
    term = [float("inf")]
    first = queue.Queue()

    def grpc_stream(prompt, key):
        client = grpcclient.InferenceServerClient(f"127.0.0.1:{grpc}")
        got = queue.Queue()
        client.start_stream(callback=lambda result, error: got.put((result, error)))
        client.async_stream_infer("ensemble", inputs(prompt, max_tokens, True) + [
            tensor("ignore_eos", np.array([[True]]), "BOOL")], enable_empty_final_response=True)
        text = []
        try:
            while True:
                result, error = got.get(timeout=60)
                if error is not None:
                    answers[key] = f"error: {error}"
                    return
                response = result.get_response()
                if response.outputs:
                    text.append(result.as_numpy("text_output")[0, 0].decode())
                    after_term[key] = after_term.get(key, 0) + (time.monotonic() > term[0])
                    first.put(key)
                if response.parameters["triton_final_response"].bool_param:
                    answers[key] = "".join(text)
                    return
        finally:
            client.stop_stream()
            client.close()

    def chat_stream():
        api = OpenAI(base_url=f"http://127.0.0.1:{openai_port}/v1", api_key="unused", max_retries=0, timeout=60)
        text = []
        try:
            for chunk in api.chat.completions.create(model="tiny", messages=[{"role": "user", "content": prompts[0]}],
                                                     max_tokens=max_tokens, temperature=0, stream=True,
                                                     extra_body={"ignore_eos": True}):
                if chunk.choices and chunk.choices[0].delta.content:
                    text.append(chunk.choices[0].delta.content)
                    after_term["chat"] = after_term.get("chat", 0) + (time.monotonic() > term[0])
                    first.put("chat")
            answers["chat"] = "".join(text)
        except Exception as err:  # noqa: BLE001  the assertion below names it
            answers["chat"] = f"error: {err}"

    try:
        lines = []
        while not any("OpenAI" in line for line in lines) and cli.poll() is None:
            lines.append(cli.stdout.readline())
        assert cli.poll() is None, "".join(lines) + cli.stdout.read()
        while not any(line.strip().startswith("admin") for line in lines):
            lines.append(cli.stdout.readline())
        output = "".join(lines)
        assert f"127.0.0.1:{grpc}" in output and f"http://127.0.0.1:{metrics}/metrics" in output, output
        # The admin key is kept in a file only its owner reads, and printed nowhere (launch line included).
        key_file = Path(re.search(r"with the key in (\S+);", output).group(1))
        key = key_file.read_text().strip()
        assert len(key) >= 16 and key not in output and key_file.stat().st_mode & 0o777 == 0o600
        server_pids = [int(p) for p in subprocess.run(["pgrep", "-f", f"tritonserver.*grpc-port={grpc}"],
                                                      capture_output=True, text=True).stdout.split()]
        assert server_pids
        for prompt in prompts:  # each prompt's answer alone: what the drained streams must still say
            grpc_stream(prompt, f"alone: {prompt}")
        after_term.clear()
        while not first.empty():
            first.get()
        started, deadline = set(), time.monotonic() + 60
        failed = lambda: any(a.startswith("error") for a in answers.values())  # noqa: E731

        def wait_for(n):  # until n streams have their first tokens: they are in the engine
            while len(started) < n and time.monotonic() < deadline and not failed():
                with contextlib.suppress(queue.Empty):
                    started.add(first.get(timeout=0.1))
            assert len(started) == n, answers

        # The OpenAI stream first, and the gRPC ones once its first chunk is out: the frontend's first answer can take
        # longer under CI's load than a whole gRPC stream (one started beside it had ended before it), so only this
        # order has all three in flight at the SIGTERM
        threads = [threading.Thread(target=chat_stream, daemon=True)]
        threads[0].start()
        wait_for(1)
        threads += [threading.Thread(target=grpc_stream, args=(p, p), daemon=True) for p in prompts]
        for thread in threads[1:]:
            thread.start()
        wait_for(3)
        term[0] = time.monotonic()
        cli.send_signal(signal.SIGTERM)
        time.sleep(0.1)  # serve marks the server as draining as the signal arrives
        client = grpcclient.InferenceServerClient(f"127.0.0.1:{grpc}")
        with pytest.raises(Exception, match="the server is stopping"):  # noqa: PT011  tritonclient's own type
            responses(client, "A new request.", 8)
        client.close()
        for thread in threads:
            thread.join(90)
        rest, _ = cli.communicate(timeout=90)
        stopped_after = time.monotonic() - term[0]
    finally:
        if cli.poll() is None:
            cli.kill()
            cli.wait()
    alone = [answers.pop(f"alone: {p}") for p in prompts]
    assert min(len(a) for a in alone) > 300, alone  # 800 byte tokens each, some of them parts of one character
    assert answers == {prompts[0]: alone[0], prompts[1]: alone[1], "chat": alone[0]}, rest
    # Both gRPC streams were streaming at the SIGTERM, shown by chunks after it: they start together and the signal
    # follows their first tokens. The OpenAI stream, started first, may have ended by then under CI's load (800
    # tokens while the gRPC ones started); its answer is checked whole above either way.
    assert all(after_term.get(p, 0) > 0 for p in prompts), after_term
    assert "drained: every request in flight finished" in rest and "Stopped." in rest and cli.returncode == 0, rest
    assert stopped_after < 40, rest
    assert all(group_members(pid) == [] for pid in server_pids)
    assert "Started GRPCInferenceService" in (tmp_path / "server.log").read_text()


def test_a_drain_marks_the_server_and_waits_until_its_gates_hold_nothing(monkeypatch, tmp_path):
    """The gauge is summed over the gate models and read at 0 twice before the drain ends; past the timeout it says
    how many are left; with no gate on the metrics page there is nothing to wait for."""
    import http.server
    import threading

    from pipeline.triton import cancel_marks, drain

    pages = ["pipeline_gate_in_flight{model=\"a\"} 2\npipeline_gate_in_flight{model=\"b\"} 1\n"]

    class Metrics(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = pages[0].encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Metrics)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{httpd.server_address[1]}/metrics"
    monkeypatch.setattr(cancel_marks, "marks_dir", lambda pid=None: tmp_path / f"marks-{pid}")
    try:
        assert drain.in_flight(url) == 3
        said = []
        result = drain.drain([4242], url, 0.5, say=said.append)
        assert (tmp_path / "marks-4242" / cancel_marks.DRAINING).exists()
        assert result.in_flight == 3 and "3 requests still in flight get an error" in result.line()
        assert "waiting up to 0.5 s for 3 in flight" in said[0]
        threading.Timer(0.3, lambda: pages.__setitem__(0, "pipeline_gate_in_flight{model=\"a\"} 0\n")).start()
        result = drain.drain([4242], url, 10)
        assert result.in_flight == 0 and 0.3 < result.waited_s < 3, result
        pages[0] = "nv_inference_count 7\n"  # no gate: nothing we can wait for
        assert drain.in_flight(url) is None and drain.drain([4242], url, 10).waited_s < 1
    finally:
        httpd.shutdown()
