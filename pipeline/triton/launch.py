"""How a repository must be launched: plain tritonserver, or under MPI the way TensorRT-LLM's backend needs.

Pure: `plan_launch` decides from the route and the engines' world size; `launch_command` turns that into
an argv and environment. `pipeline assemble` writes the decision into the repository (LAUNCH_FILE, a
top-level file Triton ignores); `pipeline serve` reads it, prints the command, and runs it.

The modes, from TensorRT-LLM's scripts/launch_triton_server.py and its backend's docs (each step is
referenced in pipeline.trtllm.upstream.LAUNCH_FACTS):
- plain: the portable engine, one tritonserver (the CPU server bundled in nvidia-pytriton, or the
  container's).
- leader: one TensorRT-LLM model of world size N = tp*pp. mpirun starts N tritonservers; rank 0 loads
  every model and serves, ranks > 0 load only the TensorRT-LLM model (explicit model control) and block
  inside its initialization as workers.
- orchestrator: two TensorRT-LLM models (draft + target) in one server. One rank with
  TRTLLM_ORCHESTRATOR=1: the backend spawns each model's tp*pp workers itself (trtllmExecutorWorker),
  on the GPUs its gpu_device_ids parameter names. One node.
- llmapi: TensorRT-LLM's LLM-API model, one rank; the LLM API starts its own tp*pp workers.
We build the command ourselves rather than call launch_triton_server.py, which starts the server in the
background and returns: `pipeline serve` must own the process to wait for readiness, stop it and reap
its stubs. The command is the one that script builds, plus our ports, addresses and the python backend's
shared-memory prefix and size.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from pipeline.errors import ConfigError
from pipeline.routes import PORTABLE, Route, route_named

LAUNCH_FILE = "launch.json"
MODES = ("plain", "leader", "orchestrator", "llmapi")
ORCHESTRATOR_ENV = {"TRTLLM_ORCHESTRATOR": "1", "TRTLLM_ORCHESTRATOR_SPAWN_PROCESSES": "1"}


# Each python model instance moves its tensors through a shared-memory region of its own, created at 1 MB and grown
# in 1 MB steps by default; each growth maps the whole region again, in the stub and in tritonserver, and keeps the
# old mapping (python_backend's SharedMemoryManager::GrowIfNeeded), so both processes counted the same pages several
# times. After 16 choices of 1020 tokens the gate's region had grown 8 times: 13-14 MiB of shared RSS in the gate and
# in tritonserver for 3 MiB of pages. Created at 16 MiB, it never grew (tmpfs pages are taken only when touched).
PYTHON_SHM_BYTES = 16 << 20


def python_backend_args(shm_prefix: str) -> list[str]:
    """The python backend's settings on a tritonserver command line (LAUNCH_FACTS "shm_prefix", "python_shm")."""
    return [f"--backend-config=python,shm-region-prefix-name={shm_prefix}",
            f"--backend-config=python,shm-default-byte-size={PYTHON_SHM_BYTES}",
            f"--backend-config=python,shm-growth-byte-size={PYTHON_SHM_BYTES}"]


@dataclass(frozen=True)
class Launch:
    route: Route  # given as the object or its name (launch.json's spelling: torch | engine | llmapi)
    mode: str  # plain | leader | orchestrator | llmapi
    world_size: int = 1  # MPI ranks mpirun starts (leader: tp*pp; the others: 1)
    gpus: int = 0  # GPUs the models use (each TensorRT-LLM model's tp*pp; the draft shares the target's)
    trtllm_models: tuple[str, ...] = ()  # tensorrtllm-backend models, which worker ranks load
    tensorrt_llm_version: str | None = None  # the TensorRT-LLM the engines / YAML were made with

    def __post_init__(self):
        if isinstance(self.route, str):
            object.__setattr__(self, "route", route_named(self.route))
        if self.mode not in MODES:
            raise ConfigError(f"unknown launch mode {self.mode!r}; one of {', '.join(MODES)}")
        if self.world_size < 1:
            raise ConfigError("world_size must be >= 1")
        if self.mode != "leader" and self.world_size != 1:
            raise ConfigError(f"{self.mode} mode runs one rank (got world_size {self.world_size})")

    @property
    def mpi(self) -> bool:
        return self.mode != "plain"

    def to_dict(self) -> dict:
        return {**asdict(self), "route": self.route.name, "trtllm_models": list(self.trtllm_models)}

    @classmethod
    def from_dict(cls, d: dict) -> Launch:
        return cls(**{**d, "trtllm_models": tuple(d.get("trtllm_models", ()))})


def plan_launch(route: Route, *, world_size: int = 1, trtllm_models: tuple[str, ...] = (),
                tensorrt_llm_version: str | None = None) -> Launch:
    """The launch a route needs. world_size: the target engine's tp*pp (the draft's is the same)."""
    mode = route.launch_mode
    if mode == "leader" and len(trtllm_models) > 1:
        # Two TensorRT-LLM models in one server need the orchestrator (LAUNCH_FACTS["two_models"]).
        mode = "orchestrator"
    if mode == "plain":
        return Launch(route, mode)
    # leader: mpirun starts a rank per GPU; orchestrator and llmapi: one rank, which starts the workers itself
    return Launch(route, mode, world_size if mode == "leader" else 1, world_size,
                  trtllm_models if route.upstream_engine_models else (), tensorrt_llm_version)


def gpu_device_ids(launch: Launch) -> str | None:
    """The tensorrt_llm models' gpu_device_ids: the orchestrator's spawned workers need their GPUs named
    (draft and target share them: examples/draft_target_model/README.md finds one GPU for both faster);
    in leader mode each rank takes its own GPU, and the parameter stays unset."""
    if launch.mode != "orchestrator":
        return None
    return ",".join(str(i) for i in range(launch.gpus))


def rank_command(tritonserver: str, base_args: list[str], rank: int, launch: Launch, shm_prefix: str) -> list[str]:
    """One rank's tritonserver command, as launch_triton_server.py get_cmd builds it."""
    cmd = [tritonserver, *base_args]
    if rank > 0:
        # Worker ranks load only the TensorRT-LLM models and never serve; the ports stay closed (the
        # Kubernetes tutorial's server.py does the same) so nothing but rank 0 can answer.
        cmd += ["--model-control-mode=explicit", *[f"--load-model={m}" for m in launch.trtllm_models],
                "--allow-http=false", "--allow-grpc=false", "--allow-metrics=false"]
    if launch.mode == "orchestrator":
        cmd += ["--pinned-memory-pool-byte-size=0", "--enable-peer-access=false",
                *[f"--cuda-memory-pool-byte-size={g}:0" for g in range(max(launch.gpus, 1))]]
    cmd += ["--disable-auto-complete-config", *python_backend_args(f"{shm_prefix}{rank}_")]
    return cmd


def launch_command(launch: Launch, tritonserver: str, base_args: list[str], shm_prefix: str,
                   mpirun: str = "mpirun") -> tuple[list[str], dict[str, str]]:
    """argv and the environment variables to add. Pure.

    base_args: the server's own arguments (repository, addresses, ports, exit/readiness flags); the plain
    mode adds only its shared-memory prefix."""
    if not launch.mpi:
        # Our config.pbtxt files are complete. With auto-complete on, the python backend starts one more stub per
        # model before its instances, only to ask it for a config (python_backend src/python_be.cc,
        # ModelState::Create): a tiny repository took 12.4 s to start and 9.0 s without (Triton's known issues
        # say the same). TensorRT-LLM's launch passes it on every rank (LAUNCH_FACTS["disable_auto_complete"]).
        return [tritonserver, *base_args, "--disable-auto-complete-config", *python_backend_args(shm_prefix)], {}
    argv = [mpirun, "--allow-run-as-root"]
    for rank in range(launch.world_size):
        argv += ["-n", "1", *rank_command(tritonserver, base_args, rank, launch, shm_prefix)]
        if rank < launch.world_size - 1:
            argv.append(":")
    env = dict(ORCHESTRATOR_ENV) if launch.mode == "orchestrator" else {}
    return argv, env


LLMAPI_LAUNCHER = "trtllm-llmapi-launch"


def multinode_command(launch: Launch, tritonserver: str, base_args: list[str], shm_prefix: str, hosts: list[str],
                      slots: int, rsh_agent: str, mpirun: str = "mpirun") -> list[str]:
    """One replica across hosts (pods): mpirun starts every rank on `hosts` (`slots` ranks, one per GPU, on each;
    the first host runs rank 0, which serves) and reaches them through `rsh_agent` instead of ssh. Pure.

    As kubernetes-sigs/lws docs/examples/tensorrt-llm runs Triton + TensorRT-LLM across pods (LAUNCH_FACTS
    "hosts" and "kubessh"). Per mode:
    - leader: the ranks of the one-node launch, spread over the hosts;
    - llmapi: one rank per GPU instead of one, each under trtllm-llmapi-launch: rank 0 runs tritonserver and
      the LLM API's MPI leader, every other rank becomes one of its workers and ignores the command
      (LAUNCH_FACTS "llmapi_ranks"), so one command serves for all: `-np N trtllm-llmapi-launch tritonserver ...`;
    - orchestrator: refused; it spawns its workers itself, on its own node (LAUNCH_FACTS "spawn").
    """
    if launch.mode == "orchestrator":
        raise ConfigError("draft-target serving (two TensorRT-LLM models under the orchestrator) spawns its workers "
                          "on one node, so it can't span nodes; use --draft eagle3 or ngram, or a smaller --tp-size")
    if launch.mode not in ("leader", "llmapi"):
        raise ConfigError(f"a {launch.mode} launch runs on one machine")
    ranks = launch.world_size if launch.mode == "leader" else launch.gpus
    if ranks != slots * len(hosts):
        raise ConfigError(f"{ranks} ranks don't fill {len(hosts)} hosts of {slots} GPUs each")
    argv = [mpirun, "--allow-run-as-root", "-mca", "plm_rsh_agent", rsh_agent, "-np", str(ranks),
            "--host", ",".join(f"{host}:{slots}" for host in hosts)]
    if launch.mode == "llmapi":
        return argv + [LLMAPI_LAUNCHER, *rank_command(tritonserver, base_args, 0, launch, shm_prefix)]
    for rank in range(ranks):
        argv += ["-n", "1", *rank_command(tritonserver, base_args, rank, launch, shm_prefix)]
        if rank < ranks - 1:
            argv.append(":")
    return argv


def write_launch(repo: Path, launch: Launch) -> Path:
    path = Path(repo) / LAUNCH_FILE
    path.write_text(json.dumps(launch.to_dict(), indent=2) + "\n")
    return path


def read_launch(repo: Path) -> Launch:
    """The repository's launch; a repository without one (written by hand, or before launch.json) is plain."""
    path = Path(repo) / LAUNCH_FILE
    if not path.is_file():
        return Launch(PORTABLE, "plain")
    try:
        return Launch.from_dict(json.loads(path.read_text()))
    except (ValueError, TypeError) as err:
        raise ConfigError(f"{path} is unreadable ({err}); rerun `pipeline assemble`") from None
