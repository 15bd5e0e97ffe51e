"""`pipeline deploy kubernetes`, decided: what the manifests need, from the build that `pipeline build` plans
for the same flags. Pure: no cluster, no files; the renderer (deploy/kubernetes.py) turns it into manifests.

How it runs in the cluster:
- a PersistentVolumeClaim holds the Hugging Face cache, the build and the Triton repository (/models);
- a Job runs `pipeline build` once, with every `auto` of the plan made here pinned, so the cluster builds what
  was reviewed here (TensorRT-LLM engines must be built on the GPU kind that serves them);
- a Deployment serves it: each pod waits for the build's repository, then starts tritonserver with the launch
  `pipeline serve --dry-run` prints for the repository (mpirun with the world size on TensorRT-LLM), the GPUs it
  needs, probes on Triton's health endpoints, and the admin APIs restricted by a key from a Secret;
- a Service, a PodMonitor, a HorizontalPodAutoscaler on a per-pod metric (through prometheus-adapter, whose
  rule is written too) and a PodDisruptionBudget.
A replica that needs more GPUs than a node has (tp x pp > --gpus-per-node) is a LeaderWorkerSet group of pods
instead: the leader runs rank 0 and an mpirun that starts every rank through kubectl exec, as
kubernetes-sigs/lws's Triton + TensorRT-LLM example does.

Why a build Job and not an init container per pod: a 70B build (download, FP8 calibration, engines) takes the
better part of an hour, and an autoscaler's new replica must be ready in minutes, so pods only read what one
Job built. The price: the volume must be ReadWriteMany (NFS, EFS, Filestore, CephFS) for replicas on many
nodes, and a rebuild is a new Job (delete the old one and apply again).
"""

from __future__ import annotations

import math
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

from pipeline.errors import ConfigError
from pipeline.routes import PORTABLE, PORTABLE_BACKEND, TRTLLM_BACKEND, route_named

POLICIES = ("gate", "queue")
MODELS_MOUNT = "/models"  # the volume, in every container
ENGINES_DIR = f"{MODELS_MOUNT}/engines"
REPO_DIR = f"{MODELS_MOUNT}/triton_repo"
PORTS = {"http": 8000, "grpc": 8001, "metrics": 8002}
OPENAI_PORT = 9000  # the OpenAI-compatible frontend's, in its own container beside tritonserver
OPENAI_SECRET_KEY = "api-key"  # in the Secret <name>-openai: the key the OpenAI API asks for
GPU_RESOURCE = "nvidia.com/gpu"
GPU_PRODUCT_LABEL = "nvidia.com/gpu.product"  # set on every GPU node by NVIDIA's GPU feature discovery
GPUS_PER_NODE = 8  # an HGX H100/H200 node
KUBESSH = "kubessh"  # mpirun's rsh agent across pods: `kubectl exec POD -- /bin/sh -c CMD` (the Dockerfile installs it)
CPU_BASE_IMAGE = "python:3.11-slim"
ADMIN_SECRET_KEY = "admin-key"
HF_SECRET_KEY = "token"
# Start-up budget: the weights read from a network volume at READ_BYTES_PER_S, plus a fixed part (TensorRT-LLM
# loads engines, allocates the KV cache and captures CUDA graphs; the portable engine starts Python stubs),
# doubled so a slow volume or a cold node doesn't get the pod killed while it loads.
READ_BYTES_PER_S = 500e6
FIXED_START_S = {TRTLLM_BACKEND: 180, PORTABLE_BACKEND: 60}
PROBE_PERIOD_S = 10
# The queue policy's target: scale out when requests wait in Triton's queue longer than they compute. NVIDIA's
# Triton autoscaling tutorial (triton-inference-server/tutorials, Deployment/Kubernetes/
# TensorRT-LLM_Autoscaling_and_Load_Balancing: chart/templates/horizontal-pod-autoscaler.yaml) targets 1000m.
QUEUE_RATIO_TARGET = "1"


@dataclass(frozen=True)
class DeployOptions:
    name: str | None = None  # default: the build's name, made a DNS label
    namespace: str | None = None
    min_replicas: int = 1
    max_replicas: int = 4
    image: str | None = None  # default: what deploy/<name>/Dockerfile builds, tagged for this build
    base_image: str | None = None  # default: NVIDIA's Triton + TensorRT-LLM container (GPU), python slim (CPU)
    storage_class: str | None = None  # default: the cluster's default class
    storage_size: str | None = None  # default: sized from the plan
    gpu_type: str | None = None  # a nvidia.com/gpu.product value to pin the pods to, e.g. NVIDIA-H100-80GB-HBM3
    gpus_per_node: int = GPUS_PER_NODE
    policy: str = "gate"  # gate: in-flight requests per pod <= the gate's ceiling; queue: Triton's queue:compute
    prometheus_release: str | None = None  # kube-prometheus-stack selects PodMonitors labelled release=<its release>
    output: Path | None = None  # default: deploy/<name>
    force: bool = False

    def validate(self) -> None:
        if self.policy not in POLICIES:
            raise ConfigError(f"unknown --policy {self.policy!r}; pick one of {', '.join(POLICIES)}")
        if not 1 <= self.min_replicas <= self.max_replicas:
            raise ConfigError(f"--replicas {self.min_replicas}:{self.max_replicas} needs 1 <= min <= max")
        if self.gpus_per_node < 1:
            raise ConfigError("--gpus-per-node must be >= 1")
        if self.name is not None and not _DNS_LABEL.fullmatch(self.name):
            raise ConfigError(f"--name {self.name!r} is not a DNS label (lowercase letters, digits and '-', at most "
                              "40 characters, starting with a letter); pick another")
        if self.namespace is not None and not _DNS_LABEL.fullmatch(self.namespace):
            raise ConfigError(f"--namespace {self.namespace!r} is not a DNS label; pick another")
        if self.prometheus_release is not None and not re.fullmatch(r"[A-Za-z0-9]([A-Za-z0-9._-]{0,61}[A-Za-z0-9])?",
                                                                     self.prometheus_release):
            raise ConfigError(f"--prometheus-release {self.prometheus_release!r} is not a label value; pass the "
                              "Helm release name of kube-prometheus-stack")


_DNS_LABEL = re.compile(r"[a-z]([a-z0-9-]{0,38}[a-z0-9])?")  # 40 leaves room for the longest suffix ("-models")


@dataclass(frozen=True)
class DeployPlan:
    name: str
    namespace: str | None
    labels: dict[str, str]  # the recommended labels every manifest carries
    backend: str  # trtllm | torch
    route: str  # engine | llmapi | torch
    image: str
    base_image: str
    gpus: int  # per pod: tp x pp on TensorRT-LLM (split over the pods of a multi-node replica), 0 on the portable engine
    serve_command: list[str]  # the container's command: what `pipeline serve --dry-run` prints, pod-side
    serve_env: dict[str, str]
    launch_line: str  # the same, as one shell line, for people reading the manifests
    build_command: list[str]  # `pipeline build` with every auto pinned, for the build Job
    gate_batch_size: int
    policy: str
    min_replicas: int
    max_replicas: int
    startup_budget_s: int
    memory_request: str
    cpu_request: str
    storage_size: str
    storage_class: str | None
    gpu_type: str | None
    prometheus_release: str | None
    output: Path
    notes: tuple[str, ...] = field(default_factory=tuple)
    pods_per_replica: int = 1  # > 1: a LeaderWorkerSet group, the leader's mpirun reaching its workers' GPUs

    @property
    def multinode(self) -> bool:
        return self.pods_per_replica > 1

    @property
    def ready_file(self) -> str:
        """What the serving pods wait for: assemble writes launch.json into the repository, which appears whole
        (staged, then renamed) once the build's last stage is done."""
        return f"{REPO_DIR}/launch.json"

    @property
    def metric(self) -> str:
        """The per-pod metric the autoscaler reads (served by prometheus-adapter under this name)."""
        return "pipeline_gate_in_flight" if self.policy == "gate" else "triton_queue_compute_ratio"

    @property
    def metric_target(self) -> str:
        return str(self.gate_batch_size) if self.policy == "gate" else QUEUE_RATIO_TARGET


def dns_label(text: str) -> str:
    """A build name ("llama-3.3-70b") as a DNS label ("llama-3-3-70b"): Services and labels take no dots."""
    label = re.sub(r"[^a-z0-9-]+", "-", text.lower()).strip("-")[:40].rstrip("-")
    return label if label and label[0].isalpha() else f"m-{label}"[:40].rstrip("-")


def plan_deploy(build, options: DeployOptions) -> DeployPlan:
    """build: the pipeline.build.BuildPlan `pipeline build` makes for the same flags."""
    from pipeline import __version__
    from pipeline.trtllm.version import for_version

    options.validate()
    s = build.settings
    name = options.name or dns_label(build.name)
    trt = s.runs_on.trtllm_release
    route = route_named(build.preview.route) if trt else PORTABLE
    gpus = _gpus(build) if trt else 0
    pods = _pods_per_replica(build.name, gpus, options.gpus_per_node)
    version = s.trtllm_version if trt else __version__
    container = for_version(s.trtllm_version).container if trt else CPU_BASE_IMAGE
    if options.base_image is None and container is None:
        # No NVIDIA Triton container ships a pre-release (server docs/introduction/compatibility.md).
        raise ConfigError(f"no NVIDIA Triton container ships TensorRT-LLM {version}; pass --base-image with a "
                          f"Triton + TensorRT-LLM {version} image you built, or --trtllm-version "
                          f"{for_version(None).version} ({for_version(None).container})")
    base = options.base_image or container
    image = options.image or f"specdec-pipeline-{'trtllm' if trt else 'cpu'}:{version}"
    command, env, line = _serve_command(build, trt, pods, gpus // pods)
    weight_bytes = _weight_bytes(build)
    startup = 2 * (FIXED_START_S[s.runs_on] + weight_bytes / READ_BYTES_PER_S)
    labels = {
        "app.kubernetes.io/name": "triton-speculative",
        "app.kubernetes.io/instance": name,
        "app.kubernetes.io/version": _label_value(version),
        "app.kubernetes.io/part-of": "specdec-pipeline",
        "app.kubernetes.io/managed-by": "kustomize",
    }
    notes = []
    if options.policy == "gate" and route.gates_in_trtllm:
        notes.append("the LLM-API route gates inside TensorRT-LLM (max_concurrency), so the gate policy reads our "
                     "frontend's in-flight count; TensorRT-LLM turns speculation off at the same ceiling")
    if pods > 1:
        notes.append(f"a replica spans {pods} nodes: the manifests use a LeaderWorkerSet, so the LWS controller "
                     "(kubernetes-sigs/lws) must be installed in the cluster")
    return DeployPlan(
        name=name, namespace=options.namespace, labels=labels, backend=s.backend, route=route.name, image=image,
        base_image=base, gpus=gpus // pods, serve_command=command, serve_env=env, launch_line=line,
        build_command=_build_command(build), gate_batch_size=s.gate_batch_size, policy=options.policy,
        min_replicas=options.min_replicas, max_replicas=options.max_replicas,
        startup_budget_s=int(math.ceil(startup / PROBE_PERIOD_S) * PROBE_PERIOD_S),
        memory_request=_memory_request(build, weight_bytes), cpu_request="8" if trt else "2",
        storage_size=options.storage_size or _storage_size(weight_bytes, trt), storage_class=options.storage_class,
        gpu_type=options.gpu_type, prometheus_release=options.prometheus_release, output=Path(options.output or Path("deploy") / name), notes=tuple(notes),
        pods_per_replica=pods)


def _gpus(build) -> int:
    launch = build.preview.launch
    return max(1, int(launch.get("gpus") or launch.get("world_size") or build.settings.tp_size))


def _pods_per_replica(name: str, gpus: int, per_node: int) -> int:
    """One pod per node a replica needs. The ranks split evenly, so every pod asks for the same GPUs."""
    pods = math.ceil(gpus / per_node) if gpus else 1
    if gpus % pods:
        raise ConfigError(f"{name} needs {gpus} GPUs per replica (tp x pp), which don't split evenly over {pods} nodes "
                          f"of {per_node}; pick a --tp-size that is a multiple of the pods' GPUs, or --gpus-per-node")
    return pods


def _serve_command(build, trt: bool, pods: int = 1, gpus_per_pod: int = 0) -> tuple[list[str], dict[str, str], str]:
    """The pod's command. TensorRT-LLM: the launch `pipeline serve --dry-run` prints for the repository at
    REPO_DIR, listening on every address, with the admin key Kubernetes expands from the Secret ($(VAR) in a
    command is the kubelet's substitution); across `pods` pods, the leader's (_multinode_command). The portable
    engine: `pipeline serve` itself, which finds the CPU tritonserver bundled in the image's nvidia-pytriton and
    sets up its Python stubs."""
    from pipeline.triton.launch import Launch
    from pipeline.triton.server import (ADMIN_KEY_ENV, SHM_PREFIX, ServeOptions, ServerBinary, launch_argv,
                                        shell_line)
    from pipeline.trtllm.version import CONTAINER_TRITONSERVER

    options = ServeOptions(repo=Path(REPO_DIR), host="0.0.0.0", grpc_port=PORTS["grpc"], http_port=PORTS["http"],
                           metrics_port=PORTS["metrics"], admin_key=f"$({ADMIN_KEY_ENV})")
    if not trt:
        argv = ["pipeline", "serve", "--repo", REPO_DIR, "--host", "0.0.0.0"]
        return argv, {}, shlex.join(argv)
    launch = Launch.from_dict(build.preview.launch)
    argv, env = launch_argv(options, ServerBinary(Path(CONTAINER_TRITONSERVER)), None, SHM_PREFIX, launch)
    if pods > 1:
        script = _multinode_command(launch, options, pods, gpus_per_pod)
        return ["sh", "-c", script], dict(env), script
    return argv, dict(env), shell_line(argv, env)


def _multinode_command(launch, options, pods: int, gpus_per_pod: int) -> str:
    """The leader pod's shell: wait until every worker pod of its group runs, then start every rank from here
    with mpirun, through kubessh (kubectl exec) rather than ssh, as kubernetes-sigs/lws's Triton + TensorRT-LLM
    example does (pipeline.trtllm.upstream LAUNCH_FACTS "hosts", "kubessh"). LeaderWorkerSet names a group's pods
    <leader>, <leader>-1, ..., so the hosts are known before they exist; the kubelet expands $(POD_NAME) (the
    leader's own name, from the downward API) in the command, so the script holds no shell substitution of
    its own for it to misread."""
    from pipeline.triton.launch import multinode_command
    from pipeline.triton.server import SHM_PREFIX, server_args, ServerBinary
    from pipeline.trtllm.version import CONTAINER_TRITONSERVER

    hosts = ["$(POD_NAME)", *[f"$(POD_NAME)-{i}" for i in range(1, pods)]]
    binary = ServerBinary(Path(CONTAINER_TRITONSERVER))
    argv = multinode_command(launch, str(binary.path), server_args(options, binary, None), SHM_PREFIX, hosts,
                             gpus_per_pod, KUBESSH)
    wait = (f'for pod in {" ".join(hosts[1:])}; do\n'
            f'  until kubectl get pod "$pod" -o jsonpath="{{.status.phase}}" 2>/dev/null | grep -qx Running; do\n'
            f'    echo "waiting for worker pod $pod"; sleep 5\n'
            f'  done\n'
            f'done\n')
    return wait + "exec " + shlex.join(argv)


def _build_command(build) -> list[str]:
    """`pipeline build` for the Job, every auto of this plan pinned: the cluster builds what was reviewed."""
    s, o = build.settings, build.options
    argv = ["pipeline", "build", "--target", o.target, "--draft", str(s.draft), "--backend", s.backend,
            "--target-qformat", s.target_qformat, "--draft-qformat", s.draft_qformat, "--kv-cache-dtype",
            s.kv_cache_dtype, "--num-draft-tokens", str(s.num_draft_tokens), "--gate-batch-size",
            str(s.gate_batch_size), "--max-batch-size", str(s.max_batch_size), "--tp-size", str(s.tp_size)]
    argv += ["--max-input-len", str(s.max_input_len)] if s.max_input_len else []
    argv += ["--max-seq-len", str(s.max_seq_len)] if s.max_seq_len else []
    argv += ["--gpu", s.gpu] if s.gpu else []
    argv += ["--trtllm-version", s.trtllm_version] if s.trtllm_version else []
    argv += ["--draft-budget-minutes", f"{o.draft_budget_minutes:g}"] if s.draft.kind == "eagle3" else []
    return argv + ["--engines-dir", ENGINES_DIR, "--repo", REPO_DIR, "--quiet"]


def _weight_bytes(build) -> float:
    """The served weights, target and draft, in their planned formats."""
    plan = build.memory_plan
    if plan is not None:
        return float(plan.target_weights[plan.inputs.target_qformat].total + plan.draft_weights.total)
    from pipeline.models.presets import get_preset

    preset = get_preset(build.options.target)
    return 2.0 * preset.shape.param_count if preset is not None and preset.shape is not None else 2e9


def _memory_request(build, weight_bytes: float) -> str:
    """Host memory: TensorRT-LLM stages an engine through host memory rank by rank (a tenth of the weights
    is plenty with mmap'd engines; 32 GiB at least); the portable engine holds its weights there (2.5x, for
    the loading copy and the KV cache), 2 GiB at least."""
    if build.settings.runs_on.trtllm_release:
        return f"{max(32, math.ceil(weight_bytes / 10 / 2**30))}Gi"
    return f"{max(2, math.ceil(2.5 * weight_bytes / 2**30))}Gi"


def _storage_size(weight_bytes: float, trt: bool) -> str:
    """The volume: the downloaded bf16 weights, the quantized checkpoint and the engines (about 3x the served
    weights on TensorRT-LLM), plus the Hugging Face cache's slack; 10 GiB at least."""
    return f"{max(10, math.ceil((4 if trt else 3) * weight_bytes / 2**30 / 10) * 10)}Gi"


def _label_value(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]", "-", text)[:63].strip("-._") or "unknown"
