"""`pipeline deploy kubernetes`: manifests for the 70B plans and the CPU default, validated against the Kubernetes
API's published schemas (kubernetes-validate) and, for the PodMonitor CRD, prometheus-operator's."""

from __future__ import annotations

import json
from pathlib import Path

import kubernetes_validate
import pytest
import yaml
from click.testing import CliRunner

from cli_checks import assert_one_line_error
from pipeline.cli import main

K8S_VERSION = "1.35"  # a recent release; kubernetes-validate ships its schemas
SCHEMAS = Path(__file__).parent / "schemas"  # CRDs, trimmed from their projects (source in each "$comment")


def deploy(tmp_path, *args) -> tuple[Path, dict[str, dict]]:
    out = tmp_path / "deploy"
    result = CliRunner().invoke(main, ["deploy", "kubernetes", *args, "-o", str(out), "--json"])
    assert result.exit_code == 0, result.output
    docs = {p.name: yaml.safe_load(p.read_text()) for p in out.glob("*.yaml")}
    return out, docs


def validate(docs: dict[str, dict]) -> None:
    import jsonschema

    for name, doc in docs.items():
        if doc.get("kind") in ("Kustomization",) or name == "prometheus-adapter-rules.yaml":
            continue
        if doc["apiVersion"] == "monitoring.coreos.com/v1":
            schema = json.loads((SCHEMAS / "podmonitor.json").read_text())
            jsonschema.validate(doc, schema)
        elif doc["kind"] == "LeaderWorkerSet":
            jsonschema.validate(doc, json.loads((SCHEMAS / "leaderworkerset.json").read_text()))
            # The CRD's pod templates are whole core PodTemplateSpecs: check them as such.
            for role in ("leaderTemplate", "workerTemplate"):
                template = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": role.lower()},
                            "template": doc["spec"]["leaderWorkerTemplate"][role]}
                kubernetes_validate.validate(template, K8S_VERSION, strict=True)
        else:
            kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def pod_spec(docs) -> dict:
    return docs["deployment.yaml"]["spec"]["template"]["spec"]


def server(docs) -> dict:
    return pod_spec(docs)["containers"][0]


def build_job_plan(docs) -> dict:
    """The build Job's command, run here with --dry-run: `pipeline build` must take it, and plan what we reviewed."""
    command = docs["build-job.yaml"]["spec"]["template"]["spec"]["containers"][0]["command"]
    assert command[:2] == ["pipeline", "build"]
    result = CliRunner().invoke(main, [*command[1:], "--dry-run", "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.output)["settings"]


def check_wiring(docs) -> None:
    """What must agree across the manifests, whatever the route."""
    kust = docs["kustomization.yaml"]
    assert sorted(kust["resources"]) == sorted(n for n in docs if n not in ("kustomization.yaml",
                                                                               "prometheus-adapter-rules.yaml"))
    pod_labels = docs["deployment.yaml"]["spec"]["template"]["metadata"]["labels"]
    for name in ("service.yaml", "pdb.yaml"):
        selector = docs[name]["spec"].get("selector")
        selector = selector.get("matchLabels", selector)
        assert selector.items() <= pod_labels.items(), name
    assert docs["podmonitor.yaml"]["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    ports = {p["name"] for p in server(docs)["ports"]}
    assert {"http", "grpc", "metrics"} == ports
    assert docs["podmonitor.yaml"]["spec"]["podMetricsEndpoints"][0]["port"] in ports
    for probe, path in (("startupProbe", "/v2/health/ready"), ("readinessProbe", "/v2/health/ready"),
                        ("livenessProbe", "/v2/health/live")):
        assert server(docs)[probe]["httpGet"] == {"path": path, "port": "http"}
    claim = pod_spec(docs)["volumes"][0]["persistentVolumeClaim"]["claimName"]
    assert claim == docs["pvc.yaml"]["metadata"]["name"]
    assert docs["hpa.yaml"]["spec"]["scaleTargetRef"]["name"] == docs["deployment.yaml"]["metadata"]["name"]
    for doc in docs.values():
        if "metadata" in doc:
            labels = doc["metadata"]["labels"]
            assert {"app.kubernetes.io/name", "app.kubernetes.io/instance", "app.kubernetes.io/component",
                    "app.kubernetes.io/part-of", "app.kubernetes.io/managed-by"} <= labels.keys()
    # The admin APIs stay restricted, with the key the kubelet expands from the Secret.
    env = {e["name"]: e for e in server(docs)["env"]}
    assert env["PIPELINE_ADMIN_KEY"]["valueFrom"]["secretKeyRef"]["key"] == "admin-key"
    check_openai(pod_spec(docs), docs)


def check_openai(pod: dict, docs: dict) -> None:
    """The OpenAI frontend beside tritonserver: a command the frontend's own CLI takes, pointed at this pod's
    gRPC and metrics ports, its key from the <name>-openai Secret, and a port on the Service."""
    from pipeline.openai_api.__main__ import main as frontend
    from pipeline.openai_api.protocol import API_KEY_ENV

    tritonserver, openai = pod["containers"]
    assert openai["name"] == "openai" and openai["command"][:3] == ["python3", "-m", "pipeline.openai_api"]
    params = frontend.make_context("openai", list(openai["command"][3:])).params  # refuses an option it lacks
    ports = {p["name"]: p["containerPort"] for p in tritonserver["ports"]}
    assert params["grpc_url"] == f"127.0.0.1:{ports['grpc']}" and params["host"] == "0.0.0.0"
    assert params["metrics_url"] == f"http://127.0.0.1:{ports['metrics']}/metrics"
    assert str(params["repo"]) == "/models/triton_repo"
    service = {p["name"]: p for p in docs["service.yaml"]["spec"]["ports"]}
    assert service["openai"]["port"] == params["port"] == openai["ports"][0]["containerPort"]
    assert openai["readinessProbe"]["httpGet"] == {"path": "/health", "port": "openai"}
    env = {e["name"]: e for e in openai["env"]}
    name = docs["service.yaml"]["metadata"]["name"]
    assert env[API_KEY_ENV]["valueFrom"]["secretKeyRef"] == {"name": f"{name}-openai", "key": "api-key"}


def test_70b_eagle3_on_two_h100s(tmp_path):
    out, docs = deploy(tmp_path, "--target", "llama-70b", "--draft", "eagle3", "--gpu", "h100", "--namespace", "llm",
                       "--gpu-type", "NVIDIA-H100-80GB-HBM3")
    validate(docs)
    check_wiring(docs)
    container = server(docs)
    assert container["resources"]["limits"] == {"nvidia.com/gpu": 2}  # TP 2, as the memory plan picks
    assert docs["build-job.yaml"]["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"] == \
        {"nvidia.com/gpu": 2}
    # The LLM-API route: one rank under mpirun, its tp x pp workers started by TensorRT-LLM.
    assert container["command"][:5] == ["mpirun", "--allow-run-as-root", "-n", "1", "/opt/tritonserver/bin/tritonserver"]
    assert "--grpc-address=0.0.0.0" in container["command"] and "--model-repository=/models/triton_repo" in \
        container["command"]
    assert any("$(PIPELINE_ADMIN_KEY)" in a for a in container["command"])
    assert pod_spec(docs)["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}
    startup = container["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 600  # 75 GB of weights: minutes, not seconds
    metric = docs["hpa.yaml"]["spec"]["metrics"][0]["pods"]
    assert metric["metric"]["name"] == "pipeline_gate_in_flight" and metric["target"]["averageValue"] == "32"
    assert docs["kustomization.yaml"]["namespace"] == "llm"
    # The scale-down the simulation (scripts/simulate_scale.py) assumes is the one written.
    from pipeline.deploy.simulate import SCALE_DOWN_PERIOD_S, SCALE_DOWN_PODS, SCALE_DOWN_WINDOW_S

    down = docs["hpa.yaml"]["spec"]["behavior"]["scaleDown"]
    assert down["stabilizationWindowSeconds"] == SCALE_DOWN_WINDOW_S
    assert down["policies"] == [{"type": "Pods", "value": SCALE_DOWN_PODS, "periodSeconds": SCALE_DOWN_PERIOD_S}]
    build = docs["build-job.yaml"]["spec"]["template"]["spec"]["containers"][0]["command"]
    assert build[:2] == ["pipeline", "build"] and {"--backend", "trtllm", "--tp-size", "2", "--gpu"} <= set(build)
    assert build[build.index("--draft") + 1] == "eagle3:yuhuili/EAGLE3-LLaMA3.3-Instruct-70B"
    settings = build_job_plan(docs)
    assert (settings["backend"], settings["tp_size"], settings["target_qformat"], settings["gate_batch_size"]) == \
        ("trtllm", 2, "fp8", 32)
    dockerfile = (out / "Dockerfile").read_text()
    assert "FROM nvcr.io/nvidia/tritonserver:26.07-trtllm-python-py3" in dockerfile and "--no-deps" in dockerfile
    # --no-deps keeps the container's torch; the OpenAI frontend's web stack is added, as pyproject pins it.
    import tomllib

    from pipeline.deploy.kubernetes import WEB_STACK

    pins = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())["project"]["dependencies"]
    assert set(WEB_STACK) <= set(pins) and all(f"'{r}'" in dockerfile for r in WEB_STACK)


def test_the_grafana_dashboard_ships_as_a_configmap_and_as_json(tmp_path):
    from pipeline.deploy.dashboard import dashboard, metric_names

    out, docs = deploy(tmp_path)
    configmap = docs["grafana-dashboard.yaml"]
    assert configmap["kind"] == "ConfigMap" and configmap["metadata"]["labels"]["grafana_dashboard"] == "1"
    [text] = configmap["data"].values()
    assert json.loads(text) == json.loads((out / "grafana-dashboard.json").read_text()) == dashboard()
    panels = dashboard()["panels"]
    assert len({p["id"] for p in panels}) == len(panels)
    assert len({(p["gridPos"]["x"], p["gridPos"]["y"]) for p in panels}) == len(panels)  # none drawn over another
    assert all(t["expr"] for p in panels for t in p["targets"])
    # What a serving dashboard plots (issue 28): latency histograms, tokens, KV cache and queue.
    assert {"pipeline_time_to_first_token_seconds_bucket", "pipeline_inter_token_latency_seconds_bucket",
            "pipeline_e2e_request_latency_seconds_bucket", "pipeline_prompt_tokens_total",
            "pipeline_generation_tokens_total", "pipeline_engine_kv_cache_usage_ratio",
            "pipeline_engine_requests_waiting"} <= metric_names()


def test_the_schema_check_catches_a_misspelled_field(tmp_path):
    _, docs = deploy(tmp_path)
    server(docs)["livenesProbe"] = server(docs).pop("livenessProbe")
    with pytest.raises(kubernetes_validate.ValidationError, match="livenesProbe"):
        kubernetes_validate.validate(docs["deployment.yaml"], K8S_VERSION, strict=True)


def test_70b_draft_target_runs_both_engines_under_the_orchestrator(tmp_path):
    _, docs = deploy(tmp_path, "--target", "llama-70b", "--draft", "llama-1b", "--gpu", "h100", "--backend", "trtllm")
    validate(docs)
    check_wiring(docs)
    container = server(docs)
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env.get("TRTLLM_ORCHESTRATOR") == "1"  # two TensorRT-LLM models in one server
    gpus = container["resources"]["limits"]["nvidia.com/gpu"]
    annotation = docs["deployment.yaml"]["metadata"]["annotations"]["specdec-pipeline/launch"]
    assert gpus >= 2 and "TRTLLM_ORCHESTRATOR=1" in annotation


def run_leader_script(script: str, tmp_path: Path) -> list[str]:
    """The leader's shell, run here as the kubelet would start it: $(VAR) expanded, then sh -c. kubectl says every
    worker pod runs; mpirun prints the argv it was given, one argument per line."""
    import os
    import stat
    import subprocess

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fakes = {"kubectl": 'echo "$@" >> "$KUBECTL_LOG"; echo Running',
             "mpirun": 'for a in "$@"; do printf "%s\\n" "$a"; done'}
    for name, body in fakes.items():
        (bin_dir / name).write_text(f"#!/bin/sh\n{body}\n")
        (bin_dir / name).chmod(stat.S_IRWXU)
    expanded = script.replace("$(POD_NAME)", "llama-0").replace("$(PIPELINE_ADMIN_KEY)", "k3y")
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "KUBECTL_LOG": str(tmp_path / "kubectl.log")}
    out = subprocess.run(["sh", "-c", expanded], env=env, capture_output=True, text=True, timeout=30, check=True)
    return out.stdout.splitlines()


def test_a_replica_bigger_than_a_node_is_a_leader_worker_set(tmp_path):
    out, docs = deploy(tmp_path, "--target", "llama-70b", "--draft", "eagle3", "--gpu", "h100", "--tp-size", "8",
                       "--gpus-per-node", "4", "--name", "llama")
    validate(docs)
    assert "deployment.yaml" not in docs
    assert sorted(docs["kustomization.yaml"]["resources"]) == sorted(
        n for n in docs if n not in ("kustomization.yaml", "prometheus-adapter-rules.yaml"))
    lws = docs["leaderworkerset.yaml"]["spec"]
    group = lws["leaderWorkerTemplate"]
    assert group["size"] == 2 and group["restartPolicy"] == "RecreateGroupOnPodRestart"
    leader, worker = group["leaderTemplate"], group["workerTemplate"]
    for pod in (leader, worker):  # 8 GPUs of TP, 4 on each node
        assert pod["spec"]["containers"][0]["resources"]["limits"] == {"nvidia.com/gpu": 4}
        assert pod["spec"]["serviceAccountName"] == "llama-mpi"
    server_container = leader["spec"]["containers"][0]
    check_openai(leader["spec"], docs)
    assert [c["name"] for c in worker["spec"]["containers"]] == ["worker"]
    env = {e["name"]: e for e in server_container["env"]}
    assert env["POD_NAME"]["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.name"}}

    # The leader waits for its worker, then starts all 8 ranks from its own pod through kubessh.
    argv = run_leader_script(server_container["command"][2], tmp_path)
    assert "get pod llama-0-1" in (tmp_path / "kubectl.log").read_text()
    assert argv[:9] == ["--allow-run-as-root", "-mca", "plm_rsh_agent", "kubessh", "-np", "8", "--host",
                        "llama-0:4,llama-0-1:4", "trtllm-llmapi-launch"]
    assert argv[9] == "/opt/tritonserver/bin/tritonserver" and "--grpc-address=0.0.0.0" in argv
    assert any(a.endswith("pipeline-admin-key=k3y") for a in argv)

    # Only the leader serves: the Service and the PodMonitor select it and not the worker; the budget counts both;
    # the autoscaler scales the LeaderWorkerSet.
    leader_labels, worker_labels = leader["metadata"]["labels"], worker["metadata"]["labels"]
    for name in ("service.yaml", "podmonitor.yaml"):
        selector = docs[name]["spec"]["selector"]
        selector = selector.get("matchLabels", selector)
        assert selector.items() <= leader_labels.items() and not selector.items() <= worker_labels.items(), name
    pdb = docs["pdb.yaml"]["spec"]["selector"]
    assert pdb["matchExpressions"][0]["values"] == ["server", "worker"]
    assert pdb["matchLabels"].items() <= worker_labels.items()
    assert docs["hpa.yaml"]["spec"]["scaleTargetRef"] == {"apiVersion": "leaderworkerset.x-k8s.io/v1",
                                                          "kind": "LeaderWorkerSet", "name": "llama"}
    # kubessh's kubectl exec is allowed for the pods' account, and the image carries kubectl and kubessh.
    rules = docs["role.yaml"]["rules"]
    assert any("pods/exec" in r["resources"] and "create" in r["verbs"] for r in rules)
    binding = docs["rolebinding.yaml"]
    assert binding["roleRef"]["name"] == docs["role.yaml"]["metadata"]["name"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": docs["serviceaccount.yaml"]["metadata"]["name"]}]
    dockerfile = (out / "Dockerfile").read_text()
    assert "install --yes kubectl" in dockerfile and "/usr/local/bin/kubessh" in dockerfile


def test_leader_mode_spreads_its_ranks_over_the_hosts():
    from pipeline.triton.launch import Launch, multinode_command

    launch = Launch("engine", "leader", 4, 4, ("tensorrt_llm",))
    argv = multinode_command(launch, "tritonserver", ["--model-repository=/r"], "p", ["a", "b"], 2, "kubessh")
    assert argv[:9] == ["mpirun", "--allow-run-as-root", "-mca", "plm_rsh_agent", "kubessh", "-np", "4", "--host",
                        "a:2,b:2"]
    ranks = " ".join(argv[9:]).split(" : ")
    assert len(ranks) == 4 and all(r.startswith("-n 1 tritonserver") for r in ranks)
    assert "--load-model=tensorrt_llm" in ranks[3] and "--load-model" not in ranks[0]


@pytest.mark.parametrize("args, needles", [
    # Draft-target runs under the orchestrator, which spawns its workers on its own node.
    (["--draft", "llama-1b", "--backend", "trtllm", "--tp-size", "8", "--gpus-per-node", "4"],
     ("spawns its workers on one node", "--draft eagle3")),
    # 8 GPUs over 3-GPU nodes: 3 pods, which can't hold the same number of ranks each.
    (["--draft", "eagle3", "--tp-size", "8", "--gpus-per-node", "3"], ("needs 8 GPUs per replica", "split evenly")),
])
def test_a_multi_node_replica_that_cant_be_launched_is_refused_in_one_line(tmp_path, args, needles):
    result = CliRunner().invoke(main, ["deploy", "kubernetes", "--target", "llama-70b", "--gpu", "h100", *args,
                                       "-o", str(tmp_path / "d")])
    assert_one_line_error(result, *needles)
    assert not (tmp_path / "d").exists()


def test_a_release_no_triton_container_ships_needs_a_base_image(tmp_path):
    """No NVIDIA Triton container ships the 1.4 pre-release (server docs/introduction/compatibility.md): refused in
    one line naming both fixes; with --base-image the Dockerfile starts from it and the Job builds for 1.4."""
    result = CliRunner().invoke(main, ["deploy", "kubernetes", "--target", "llama-70b", "--draft", "eagle3", "--gpu",
                                       "h100", "--trtllm-version", "1.4", "-o", str(tmp_path / "d")])
    assert_one_line_error(result, "no NVIDIA Triton container ships TensorRT-LLM 1.4.0rc4", "--base-image",
                          "--trtllm-version 1.2.1")
    assert not (tmp_path / "d").exists()
    out, docs = deploy(tmp_path, "--target", "llama-70b", "--draft", "eagle3", "--gpu", "h100", "--trtllm-version",
                       "1.4", "--base-image", "registry.example/triton-trtllm:1.4.0rc4")
    assert "FROM registry.example/triton-trtllm:1.4.0rc4" in (out / "Dockerfile").read_text()
    build = docs["build-job.yaml"]["spec"]["template"]["spec"]["containers"][0]["command"]
    assert build[build.index("--trtllm-version") + 1] == "1.4.0rc4"


def test_cpu_default_serves_the_portable_engine_without_gpus(tmp_path):
    out, docs = deploy(tmp_path)
    validate(docs)
    check_wiring(docs)
    container = server(docs)
    assert "limits" not in container["resources"] and "tolerations" not in pod_spec(docs)
    assert container["command"] == ["pipeline", "serve", "--repo", "/models/triton_repo", "--host", "0.0.0.0"]
    metric = docs["hpa.yaml"]["spec"]["metrics"][0]["pods"]
    assert metric["target"]["averageValue"] == "4"  # the portable engine's gate ceiling
    build = docs["build-job.yaml"]["spec"]["template"]["spec"]["containers"][0]["command"]
    assert build[build.index("--backend") + 1] == "torch" and build[build.index("--draft") + 1] == "ngram"
    assert build_job_plan(docs)["backend"] == "torch"
    assert "FROM python:3.11-slim" in (out / "Dockerfile").read_text()


def test_queue_policy_scales_on_triton_queue_to_compute_ratio(tmp_path):
    _, docs = deploy(tmp_path, "--policy", "queue", "--replicas", "2:8", "--prometheus-release", "prometheus")
    validate(docs)
    hpa = docs["hpa.yaml"]["spec"]
    assert (hpa["minReplicas"], hpa["maxReplicas"]) == (2, 8)
    assert hpa["metrics"][0]["pods"]["metric"]["name"] == "triton_queue_compute_ratio"
    rule = docs["prometheus-adapter-rules.yaml"]["rules"][0]
    assert "nv_inference_queue_duration_us" in rule["metricsQuery"]
    assert "nv_inference_compute_infer_duration_us" in rule["metricsQuery"]
    assert rule["name"]["as"] == "triton_queue_compute_ratio"
    assert docs["podmonitor.yaml"]["metadata"]["labels"]["release"] == "prometheus"


@pytest.mark.parametrize("args, needle", [
    (["--replicas", "3:1"], "1 <= min <= max"),
    (["--replicas", "a:b"], "MIN:MAX"),
    (["--name", "Bad_Name"], "not a DNS label"),
    (["--policy", "cpu"], "unknown --policy 'cpu'"),
])
def test_bad_options_are_one_line_errors(tmp_path, args, needle):
    assert_one_line_error(CliRunner().invoke(main, ["deploy", "kubernetes", *args, "-o", str(tmp_path / "d")]),
                          needle)


def test_an_existing_output_needs_force(tmp_path):
    deploy(tmp_path)
    again = CliRunner().invoke(main, ["deploy", "kubernetes", "-o", str(tmp_path / "deploy")])
    assert_one_line_error(again, "already exists", "--force")
    assert CliRunner().invoke(main, ["deploy", "kubernetes", "-o", str(tmp_path / "deploy"), "--force"]).exit_code == 0


def test_a_pod_being_deleted_drains_within_its_grace_period(tmp_path, capsys, monkeypatch):
    """A rolling update loses nothing: each container waits for the endpoints to go, then drains (the portable
    route's `pipeline serve` and the OpenAI frontend on their SIGTERM, a bare tritonserver in its hook, before its
    SIGTERM stalls the streams it holds), all within the pod's grace period."""
    import shlex

    from pipeline.deploy.kubernetes import DRAIN_S, PRESTOP_SLEEP_S
    from pipeline.triton import drain

    _, docs = deploy(tmp_path / "cpu")
    validate(docs)
    pod = pod_spec(docs)
    serve, openai = pod["containers"]
    assert serve["command"][:2] == ["pipeline", "serve"] and "--drain-timeout" not in serve["command"]
    assert drain.DEFAULT_DRAIN_TIMEOUT_S == DRAIN_S  # serve's own default is the drain the pod plans for
    assert openai["command"][openai["command"].index("--drain-timeout") + 1] == str(DRAIN_S)
    for container in (serve, openai):
        assert container["lifecycle"]["preStop"]["exec"]["command"] == ["sleep", str(PRESTOP_SLEEP_S)]
    assert pod["terminationGracePeriodSeconds"] > PRESTOP_SLEEP_S + DRAIN_S

    _, docs = deploy(tmp_path / "trt", "--target", "llama-70b", "--draft", "eagle3", "--gpu", "h100")
    validate(docs)
    hook = server(docs)["lifecycle"]["preStop"]["exec"]["command"]
    assert hook[:2] == ["sh", "-c"] and hook[2].startswith(f"sleep {PRESTOP_SLEEP_S}; exec ")
    argv = shlex.split(hook[2].split("exec ", 1)[1])
    assert argv[:3] == ["python3", "-m", "pipeline.triton.drain"]
    monkeypatch.setattr(drain, "tritonserver_pids", list)  # not the servers other tests run beside this one
    assert drain.main(argv[3:]) == 0  # the module takes the hook's flags (with no tritonserver: nothing to do)
    assert "no tritonserver process here" in capsys.readouterr().out
    assert pod_spec(docs)["terminationGracePeriodSeconds"] > PRESTOP_SLEEP_S + DRAIN_S
