"""Run a real tritonserver on a model repository: find the binary, build its command line, start, wait, stop.

`tritonserver` on PATH wins (NVIDIA's containers). Otherwise the server bundled in the nvidia-pytriton wheel
runs, on CPU: its libraries sit in `nvidia_pytriton.libs`, and its python backend ships without a stub, since
the stub is built per Python version. We link the backend into a per-server workspace and copy in the stub
for the running Python there, as pytriton itself does.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import shlex
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, replace
from pathlib import Path

from pipeline.engine.device import DeviceChoice, DeviceField
from pipeline.errors import ServeError
from pipeline.polling import wait_until
from pipeline.routes import PORTABLE
from pipeline.triton.config import DEVICE_ENV
from pipeline.triton.drain import DEFAULT_DRAIN_TIMEOUT_S
from pipeline.triton.launch import Launch, launch_command, read_launch
from pipeline.triton.ports import port_in_use
from pipeline.trtllm.upstream import CONTAINER_TRITONSERVER, TRITON_CONTAINER

STUB_NAME = "triton_python_backend_stub"
EXIT_TIMEOUT_S = 10
SHM_PREFIX = "triton_python_backend_shm_region_"
# Admin APIs answer only a request carrying this header with the server's key: raising log verbosity,
# tracing, loading models, mapping shared memory and reading configs (which hold engine paths) are not for
# every client. Inference, health, metadata and statistics stay open. A gRPC client sends the header as
# `triton-grpc-protocol-<ADMIN_HEADER>` (tritonserver 2.51's --grpc-restricted-protocol).
ADMIN_HEADER = "pipeline-admin-key"
ADMIN_KEY_ENV = "PIPELINE_ADMIN_KEY"
RESTRICTED_APIS = ("logging", "trace", "model-repository", "shared-memory", "model-config")


@dataclass(frozen=True)
class ServeOptions:
    repo: Path = Path("triton_repo")
    host: str = "127.0.0.1"
    grpc_port: int = 8001
    http_port: int = 8000
    metrics_port: int = 8002
    log_file: Path | None = None
    log_verbose: int = 0
    admin_key: str | None = None  # None: $PIPELINE_ADMIN_KEY, else a new random key per server
    # A portable-engine repository: where torch_engine loads (auto|cpu|cuda|cuda:N). The server resolves it as it
    # starts and hands it to the model in DEVICE_ENV, over the repository's own `device` parameter.
    device: DeviceChoice = DeviceField()
    # SIGTERM: how long `pipeline serve` lets the requests in flight finish before it stops (pipeline.triton.drain)
    drain_timeout_s: float = DEFAULT_DRAIN_TIMEOUT_S

    @property
    def ports(self) -> dict[str, int]:
        return {"grpc": self.grpc_port, "http": self.http_port, "metrics": self.metrics_port}


@dataclass(frozen=True)
class ServerBinary:
    """A tritonserver executable and what the bundled one needs around it (None for a container install)."""

    path: Path
    lib_dir: Path | None = None
    python_backend: Path | None = None  # folder with libtriton_python.so
    stub: Path | None = None  # the triton_python_backend_stub built for the running Python

    @property
    def bundled(self) -> bool:
        return self.python_backend is not None


@dataclass(frozen=True)
class Endpoints:
    grpc: str
    http: str
    metrics: str

    def lines(self) -> list[str]:
        return [f"gRPC     {self.grpc}", f"HTTP     {self.http}", f"metrics  {self.metrics}"]


def find_tritonserver() -> ServerBinary:
    """`tritonserver` on PATH, else the one bundled in nvidia-pytriton with the stub for this Python."""
    on_path = shutil.which("tritonserver")
    if on_path:
        return ServerBinary(Path(on_path))
    try:
        import pytriton
    except ImportError:
        raise ServeError("no tritonserver: none on PATH and nvidia-pytriton is not installed "
                         "(pip install nvidia-pytriton==0.7.0, or run in NVIDIA's Triton container)") from None
    dist = Path(pytriton.__file__).parent / "tritonserver"
    version = f"{sys.version_info[0]}.{sys.version_info[1]}"
    binary = ServerBinary(
        path=dist / "bin" / "tritonserver",
        lib_dir=Path(pytriton.__file__).parent.parent / "nvidia_pytriton.libs",
        python_backend=dist / "backends" / "python",
        stub=dist / "python_backend_stubs" / version / STUB_NAME,
    )
    for need in (binary.path, binary.python_backend, binary.stub):
        if not need.exists():
            raise ServeError(f"nvidia-pytriton has no {need} (Python {version}); reinstall nvidia-pytriton==0.7.0")
    return binary


def server_binary(launch: Launch) -> ServerBinary:
    """The tritonserver for this launch. A TensorRT-LLM repository needs NVIDIA's container: its tritonserver
    (on PATH, or where launch_triton_server.py expects it) has the tensorrtllm backend; the bundled CPU
    server doesn't."""
    if not launch.mpi:
        return find_tritonserver()
    on_path = shutil.which("tritonserver")
    return ServerBinary(Path(on_path or CONTAINER_TRITONSERVER))


def check_launchable(launch: Launch, binary: ServerBinary) -> None:
    """One line, before anything starts, when this machine can't run the launch."""
    if not launch.mpi:
        return
    what = launch.route.label
    where = (f"serve it in NVIDIA's container {TRITON_CONTAINER}; `pipeline serve --dry-run` prints the command")
    if not binary.path.is_file():
        raise ServeError(f"this repository serves {what} and there is no tritonserver with the tensorrtllm backend "
                         f"here ({binary.path}); {where}")
    if shutil.which("mpirun") is None:
        raise ServeError(f"this repository serves {what} under MPI and mpirun is not installed; {where}")
    from pipeline.trtllm import version as trtllm_version

    running = trtllm_version.installed()
    # TensorRT engines run only on the release that built them; the LLM API's options are read by any same-minor one
    built = launch.route.builds_engines
    trtllm_version.check_same(launch.tensorrt_llm_version, running, "the engines" if built else "the LLM-API options",
                              exact=built)


def shell_line(argv: list[str], env: dict[str, str] | None = None) -> str:
    """The command as one shell line, environment first: what `pipeline serve` prints and --dry-run shows."""
    return " ".join([f"{k}={shlex.quote(v)}" for k, v in (env or {}).items()] + [shlex.join(argv)])


def model_names(repo: Path) -> list[str]:
    """The model folders of a Triton repository (each holds a config.pbtxt or a version folder)."""
    if not repo.is_dir():
        return []
    return sorted(p.name for p in repo.iterdir()
                  if p.is_dir() and not p.name.startswith(".")
                  and ((p / "config.pbtxt").is_file() or any(c.is_dir() and c.name.isdigit() for c in p.iterdir())))


def check_repository(repo: Path) -> list[str]:
    names = model_names(repo)
    if not names:
        what = "does not exist" if not repo.exists() else "has no models"
        raise ServeError(f"model repository {repo} {what}; create it with `pipeline assemble` "
                         f"(or `pipeline build`), or pass --repo")
    return names


def admin_key(options: ServeOptions) -> str:
    """The key for the restricted APIs: the options', $PIPELINE_ADMIN_KEY's, or a new random one."""
    key = options.admin_key or os.environ.get(ADMIN_KEY_ENV) or secrets.token_urlsafe(18)
    if not re.fullmatch(r"[A-Za-z0-9_.~-]{8,}", key):
        raise ServeError(f"the admin key must be 8 or more letters, digits or _.~- (tritonserver splits its flag on "
                         f"',', ':' and '='); set {ADMIN_KEY_ENV} to such a key, or unset it for a random one")
    return key


def server_args(options: ServeOptions, binary: ServerBinary, backend_directory: Path | None = None) -> list[str]:
    """tritonserver's own arguments: repository, addresses, ports, exit, readiness and the restricted
    APIs (when options.admin_key is set). Pure."""
    args = [
        f"--model-repository={Path(options.repo).resolve()}",
        f"--grpc-address={options.host}", f"--grpc-port={options.grpc_port}",
        f"--http-address={options.host}", f"--http-port={options.http_port}",
        f"--metrics-address={options.host}", f"--metrics-port={options.metrics_port}",
        "--exit-on-error=true", "--strict-readiness=true",
        # Stop within seconds on Ctrl-C even if a request is stuck in flight (Triton waits 30 s by default).
        f"--exit-timeout-secs={EXIT_TIMEOUT_S}",
        f"--log-verbose={options.log_verbose}",
    ]
    if options.admin_key:
        restricted = f"{','.join(RESTRICTED_APIS)}:{ADMIN_HEADER}={options.admin_key}"
        args += [f"--http-restricted-api={restricted}", f"--grpc-restricted-protocol={restricted}"]
    if binary.bundled:
        args.append("--allow-gpu-metrics=false")  # no GPU on the bundled CPU route: NVML would only warn
    if backend_directory is not None:
        args.append(f"--backend-directory={backend_directory}")
    return args


def server_command(options: ServeOptions, binary: ServerBinary, backend_directory: Path | None = None,
                   shm_prefix: str = SHM_PREFIX, launch: Launch | None = None) -> list[str]:
    """The full command line (mpirun and all, for a TensorRT-LLM repository). Pure: nothing is read or run.
    A shared-memory prefix of our own, so cleanup after a crash removes only this server's regions."""
    return launch_argv(options, binary, backend_directory, shm_prefix, launch)[0]


# glibc gives threads arenas of their own, up to 8 per core, and memory freed in one arena serves only that one.
# The gate runs each stream on a fresh thread: over a 10-minute soak its stub's RSS grew 10-11% after warm-up
# with its live heap flat, and +3.2% with 2 arenas. The portable route only (TensorRT-LLM's launch is upstream's);
# a value the user exported wins.
ARENA_ENV, ARENA_MAX = "MALLOC_ARENA_MAX", "2"


def launch_argv(options: ServeOptions, binary: ServerBinary, backend_directory: Path | None = None,
                shm_prefix: str = SHM_PREFIX, launch: Launch | None = None) -> tuple[list[str], dict[str, str]]:
    """argv and the environment to add, for the repository's launch (plain when None)."""
    launch = launch or Launch(PORTABLE, "plain")
    argv, env = launch_command(launch, str(binary.path), server_args(options, binary, backend_directory), shm_prefix)
    if launch.route.portable:
        env = {DEVICE_ENV: options.device, **({} if ARENA_ENV in os.environ else {ARENA_ENV: ARENA_MAX}),
               **env}
    return argv, env


def engine_device(options: ServeOptions, launch: Launch, check: bool = True) -> tuple[str, str]:
    """(device, the line saying what was picked and why) the portable engine serves on, checked against what torch
    sees here (check=False, for a dry run: the spelling only, and no line); ("", "") for a TensorRT-LLM repository,
    which refuses a --device other than auto: its engines run on the GPUs of their tp/pp mapping."""
    if not launch.route.portable:
        launch.route.check_device(options.device, f"this repository ({launch.route.name} route)")
        return "", ""
    return options.device.choose() if check else (options.device, "")


def server_env(binary: ServerBinary, base: dict[str, str] | None = None) -> dict[str, str]:
    """The stub runs the first `python3` on PATH: put this interpreter's bin first so models see our packages.

    The bundled stub links the system's libpython3.X. With another build of the same Python (pyenv here),
    extension modules such as _ssl then miss symbols and transformers fails to import inside the models;
    this interpreter's own libpython, found first, fixes that.
    """
    env = dict(os.environ if base is None else base)
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    libs = [str(binary.lib_dir)] if binary.lib_dir is not None else []
    if binary.bundled:
        libs.append(sysconfig.get_config_var("LIBDIR") or "")
    env["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in [*libs, env.get("LD_LIBRARY_PATH")] if p)
    return env


_FAILED_MODEL = re.compile(r"failed to load '([^']+)' version")
# tritonserver 2.51 logs this and keeps running without that endpoint (seen with the metrics port taken
# between our port check and its bind, which comes after the models load).
_FAILED_SERVICE = re.compile(r"failed to start (\S+) service: (.*)")
_UNAVAILABLE = re.compile(r"^\|\s*(\S+)\s*\|\s*\d+\s*\|\s*(UNAVAILABLE: .*?)\s*\|\s*$")


def _log_message(line: str) -> str:
    # A log line's message (pipeline.errors.one_line folds an exception instead). Triton quotes messages and
    # escapes their newlines: keep the first line of the message.
    return " ".join(line.split("\\n", 1)[0].split()).rstrip('"').rstrip()


def missing_service(log: str) -> str | None:
    """The one line naming an endpoint that a running server failed to start, or None."""
    for line in log.splitlines():
        if match := _FAILED_SERVICE.search(line):
            service = match.group(1).lower()
            flag = f"; pass another --{service}-port" if service in ("grpc", "http", "metrics") else ""
            return f"its {service} service did not start: {_log_message(match.group(2))}{flag}"
    return None


def failure_from_log(log: str) -> str | None:
    """The one line that says why the server did not come up: a model that failed to load, or a taken port."""
    lines = log.splitlines()
    for line in lines:
        if match := _FAILED_MODEL.search(line):
            return f"model '{match.group(1)}' failed to load: {_log_message(line)}"
    for line in lines:
        if match := _UNAVAILABLE.search(line):
            return f"model '{match.group(1)}' failed to load: {match.group(2)}"
    for line in lines:
        if "Socket already in use" in line or "Address already in use" in line:
            return f"a port is already in use: {_log_message(line)}"
    for line in lines:
        if line.startswith("error:"):
            return _log_message(line)
    return None


class TritonServer:
    """A tritonserver process on a repository. Use as a context manager: start + wait_ready, then stop.

    The server runs in its own process group, so stop() can also kill the python backend stubs it forked,
    which a crashed server leaves behind.
    """

    def __init__(self, options: ServeOptions, binary: ServerBinary | None = None):
        self.options = replace(options, admin_key=admin_key(options))
        self.binary = binary
        self.process: subprocess.Popen | None = None
        self.workspace: Path | None = None
        self.log_path: Path | None = None
        # Where this run's lines start in log_path: a restart appends, and a death is named from its own run's
        # lines (a stub's death once left "Signal (6) received." there, and the next SIGKILL read as a SIGABRT).
        self.log_offset = 0
        self.shm_prefix = f"{SHM_PREFIX}pipeline{os.getpid()}_{id(self):x}_"
        self.command = ""  # the launch command, as a shell line, once started
        self.launch: Launch | None = None
        self.backends: Path | None = None
        self.frontend = None  # the OpenAI frontend `serve` runs beside it (pipeline.openai_api.process)
        self.admin_key_file: Path | None = None  # where a generated admin key is kept (never printed)
        self.device_line = ""  # a portable-engine repository: the device the engine serves on, and why

    @property
    def endpoints(self) -> Endpoints:
        o = self.options
        return Endpoints(grpc=f"{o.host}:{o.grpc_port}", http=f"http://{o.host}:{o.http_port}",
                         metrics=f"http://{o.host}:{o.metrics_port}/metrics")

    def start(self) -> TritonServer:
        check_repository(Path(self.options.repo))
        launch = self.launch = read_launch(Path(self.options.repo))
        device, self.device_line = engine_device(self.options, launch)
        if device:
            self.options = replace(self.options, device=device)
        binary = self.binary = self.binary or server_binary(launch)
        check_launchable(launch, binary)
        for name, port in self.options.ports.items():
            if port_in_use(self.options.host, port):
                raise ServeError(f"{name} port {port} on {self.options.host} is already in use; "
                                 f"stop what holds it or pass --{name}-port")
        self.workspace = Path(tempfile.mkdtemp(prefix="pipeline-serve-"))
        self.backends = self._prepare_backends(binary)
        self.log_path = Path(self.options.log_file) if self.options.log_file else self.workspace / "tritonserver.log"
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        if self.options.admin_key != os.environ.get(ADMIN_KEY_ENV):
            # A generated key is kept in a file only its owner reads, not printed: printed, it lands in every
            # captured log. The workspace (mkdtemp: mode 700) goes when the server stops.
            self.admin_key_file = self.workspace / "admin-key"
            fd = os.open(self.admin_key_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(self.options.admin_key + "\n")
        self._spawn("wb")
        return self

    def restart(self) -> None:
        """Kill the server at once (its clients get an error now, not after the exit timeout) and start it
        again on the same workspace, ports and key; its log continues in the same file."""
        self._kill(graceful=False)
        self._spawn("ab")

    def _spawn(self, log_mode: str) -> None:
        argv, extra_env = launch_argv(self.options, self.binary, self.backends, self.shm_prefix, self.launch)
        self.command = shell_line(argv, extra_env).replace(self.options.admin_key, "<admin-key>")
        with open(self.log_path, log_mode) as log:
            self.log_offset = log.tell()
            self.process = subprocess.Popen(
                argv, env={**server_env(self.binary), **extra_env},
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                preexec_fn=terminate_with_parent)

    def _prepare_backends(self, binary: ServerBinary) -> Path | None:
        if not binary.bundled:
            return None
        python = self.workspace / "backends" / "python"
        python.mkdir(parents=True)
        for item in binary.python_backend.iterdir():
            if item.is_file():
                (python / item.name).symlink_to(item)
        shutil.copy2(binary.stub, python / STUB_NAME)
        return self.workspace / "backends"

    def log(self) -> str:
        """This run's log: since the last start or restart (the file keeps every run's)."""
        if self.log_path is None or not self.log_path.exists():
            return ""
        with open(self.log_path, "rb") as f:
            f.seek(self.log_offset)
            return f.read().decode(errors="replace")

    def wait_ready(self, timeout: float = 120.0) -> Endpoints:
        """Poll /v2/health/ready until every model is ready; a server that exits raises with its log line."""
        url = f"http://{_connect_host(self.options.host)}:{self.options.http_port}/v2/health/ready"

        def probe() -> Endpoints | None:
            code = self.process.poll()
            if code is not None:
                self.stop(keep_log=True)
                reason = failure_from_log(self.log()) or f"tritonserver exited with code {code}"
                raise ServeError(f"tritonserver did not start: {reason} (log: {self.log_path})")
            with contextlib.suppress(OSError, urllib.error.URLError):
                with urllib.request.urlopen(url, timeout=1) as response:
                    ready = response.status == 200
                # Ready comes before the metrics service starts: wait for it too, and don't take a server that
                # runs on without it.
                if missing := ready and missing_service(self.log()):
                    self.stop(keep_log=True)
                    raise ServeError(f"tritonserver started without an endpoint: {missing} (log: {self.log_path})")
                if ready:
                    with urllib.request.urlopen(self.endpoints.metrics, timeout=1):
                        return self.endpoints
            return None

        if (endpoints := wait_until(probe, timeout, 0.25)) is not None:
            return endpoints
        reason = failure_from_log(self.log())
        self.stop(keep_log=True)
        raise ServeError(f"tritonserver not ready after {timeout:g} s"
                         + (f": {reason}" if reason else "") + f" (log: {self.log_path})")

    def stop(self, timeout: float = 30.0, keep_log: bool = False) -> None:
        """SIGTERM the server, SIGKILL what is left of its process group, remove our shared memory.

        A log in the temp workspace goes with it unless keep_log (a failure the user should read).
        """
        self._kill(graceful=True, timeout=timeout)
        if self.workspace is not None:
            if keep_log and self.log_path is not None and self.workspace in self.log_path.parents:
                shutil.rmtree(self.workspace / "backends", ignore_errors=True)  # the log says why it failed
            else:
                shutil.rmtree(self.workspace, ignore_errors=True)
            self.workspace = None

    def _kill(self, graceful: bool, timeout: float = 30.0) -> None:
        """Stop the process (SIGTERM first when graceful), SIGKILL what is left of its group, and remove
        its shared memory and cancel marks."""
        process, self.process = self.process, None
        if process is not None:
            if process.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    if graceful:
                        process.terminate()
                    else:
                        process.kill()
                try:
                    process.wait(timeout)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()
            # Stubs share the server's process group (it is its own session); a crash orphans them.
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(process.pid, signal.SIGKILL)
            _wait_group_gone(process.pid)
            from pipeline.triton import cancel_marks

            cancel_marks.clear(process.pid)  # postprocessing may mark a cancel after the gate's last clear
        for region in Path("/dev/shm").glob(f"{self.shm_prefix}*"):
            with contextlib.suppress(OSError):
                region.unlink()

    def __enter__(self) -> TritonServer:
        self.start()
        try:
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def planned_command(options: ServeOptions, binary: ServerBinary | None = None) -> str:
    """The command `serve` would run for this repository, as one shell line; starts nothing, needs no GPU.
    The bundled CPU server's backend folder is made per run: shown as <workspace>/backends."""
    check_repository(Path(options.repo))
    launch = read_launch(Path(options.repo))
    engine_device(options, launch, check=False)  # the spelling, and no --device on a TensorRT-LLM repository
    binary = binary or server_binary(launch)
    backends = Path("<workspace>") / "backends" if binary.bundled else None
    options = replace(options, admin_key=options.admin_key or "<admin-key>")  # made when the server starts
    argv, env = launch_argv(options, binary, backends, f"{SHM_PREFIX}pipeline_", launch)
    return shell_line(argv, env)


def group_members(pgid: int) -> list[int]:
    """Live processes in a process group (zombies excluded), read from /proc."""
    members = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[2]) == pgid and fields[0] != "Z":
                members.append(int(stat.parent.name))
    return members


def _wait_group_gone(pgid: int, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while group_members(pgid) and time.monotonic() < deadline:
        time.sleep(0.05)


def terminate_with_parent() -> None:
    """In the child: SIGTERM it when we die, even by SIGKILL; the server is in its own session, so no Ctrl-C reaches it."""
    with contextlib.suppress(OSError, AttributeError):
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _connect_host(host: str) -> str:
    return "127.0.0.1" if host in ("0.0.0.0", "") else ("::1" if host == "::" else host)
