"""`pipeline deploy kubernetes`: manifests for serving a build on Kubernetes, written without a cluster."""

from __future__ import annotations

import json
from pathlib import Path

import click

from pipeline.cli.build_flags import build_flags, build_options
from pipeline.errors import ConfigError


@click.group()
def deploy():
    """Write what it takes to run a build elsewhere."""


def _replicas(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition(":")
    try:
        return int(lo), int(hi or lo)
    except ValueError:
        raise ConfigError(f"--replicas {text!r} is not MIN:MAX (or one number); e.g. --replicas 1:4") from None


@deploy.command("kubernetes")
@build_flags
@click.option("--name", help="Name of every resource [default: the build's name, as a DNS label].")
@click.option("--namespace", "-n", help="Namespace for the kustomization [default: kubectl's current one].")
@click.option("--replicas", default="1:4", show_default=True,
              help="MIN:MAX serving pods for the autoscaler (one number: a fixed count).")
@click.option("--image", help="The image every pod runs [default: specdec-pipeline-trtllm:<TensorRT-LLM version> "
                              "(GPU) or specdec-pipeline-cpu:<version>, built from the Dockerfile written beside "
                              "the manifests].")
@click.option("base_image", "--base-image", help="The Dockerfile's base [default: NVIDIA's Triton container for the "
                                                 "TensorRT-LLM release the engines target; python:3.11-slim on CPU].")
@click.option("storage_class", "--storage-class", help="StorageClass of the models volume (ReadWriteMany) "
                                                       "[default: the cluster's default].")
@click.option("storage_size", "--storage-size", help="Size of the models volume [default: sized from the plan].")
@click.option("gpu_type", "--gpu-type", help="Pin the pods to nodes with this nvidia.com/gpu.product label, e.g. "
                                             "NVIDIA-H100-80GB-HBM3.")
@click.option("gpus_per_node", "--gpus-per-node", type=int, default=8, show_default=True,
              help="GPUs on one node; a replica needing more spans nodes, as a LeaderWorkerSet (kubernetes-sigs/lws, "
                   "installed in the cluster) whose leader starts every rank with mpirun.")
@click.option("--policy", default="gate", show_default=True,
              help="gate: autoscale on in-flight requests per pod against the gate's ceiling (speculation keeps "
                   "paying); queue: on Triton's queue-to-compute time ratio.")
@click.option("prometheus_release", "--prometheus-release",
              help="Label the PodMonitor release=NAME, which kube-prometheus-stack's Prometheus selects by default.")
@click.option("--output", "-o", type=click.Path(path_type=Path), help="Folder to write [default: deploy/<name>].")
@click.option("--force", "-f", is_flag=True, help="Replace an existing output folder.")
@click.option("json_", "--json", is_flag=True, help="Print what was written as JSON.")
def kubernetes(name, namespace, replicas, image, base_image, storage_class, storage_size, gpu_type, gpus_per_node,
               policy, prometheus_release, output, force, json_, **flags):
    """Plan the build for these flags (as `pipeline build --dry-run` does) and write Kubernetes manifests
    that build it once in the cluster and serve it, autoscaled: a volume, a build Job, a Deployment, a
    Service, a PodMonitor, an HPA, a PodDisruptionBudget, a kustomization.yaml, prometheus-adapter's rule
    and the image's Dockerfile. A replica bigger than a node is a LeaderWorkerSet (and the service account
    its mpirun's kubectl exec needs) instead of the Deployment. Needs no cluster.

    \b
    Examples:
      pipeline deploy kubernetes --target llama-70b --draft eagle3 --gpu h100 --namespace llm
      kubectl apply -k deploy/llama-3-3-70b
    """
    from pipeline.build import detect_environment, plan_build
    from pipeline.deploy.kubernetes import write
    from pipeline.deploy.plan import DeployOptions, plan_deploy

    lo, hi = _replicas(replicas)
    options = DeployOptions(name=name, namespace=namespace, min_replicas=lo, max_replicas=hi, image=image,
                            base_image=base_image, storage_class=storage_class, storage_size=storage_size,
                            gpu_type=gpu_type, gpus_per_node=gpus_per_node, policy=policy,
                            prometheus_release=prometheus_release, output=output,
                            force=force)
    build_opts = build_options(**flags)
    build = plan_build(build_opts, detect_environment(build_opts))  # refuses a memory plan that doesn't fit
    plan = plan_deploy(build, options)
    folder = write(plan, force)
    if json_:
        click.echo(json.dumps({"output": str(folder), "files": sorted(p.name for p in folder.iterdir()),
                               "name": plan.name,
                               "gpus_per_pod": plan.gpus, "pods_per_replica": plan.pods_per_replica,
                               "launch": plan.launch_line,
                               "build": plan.build_command, "notes": list(plan.notes)}, indent=2))
        return
    pods = f" x {plan.pods_per_replica} pods (LeaderWorkerSet)" if plan.multinode else ""
    click.echo(f"wrote {folder}: {plan.name}, {plan.backend} ({plan.route}), {plan.gpus or 'no'} GPU(s) per pod{pods}, "
               f"{plan.min_replicas}-{plan.max_replicas} replicas on {plan.metric} <= {plan.metric_target}")
    for note in plan.notes:
        click.echo(f"note: {note}")
    click.echo(f"next: docker build -f {plan.output}/Dockerfile -t {plan.image} . && docker push {plan.image}")
    click.echo(f"      kubectl create secret generic {plan.name}-admin --from-literal=admin-key=$(openssl rand -hex 16)")
    click.echo(f"      kubectl create secret generic {plan.name}-openai --from-literal=api-key=$(openssl rand -hex 16)")
    click.echo(f"      kubectl apply -k {plan.output}")
