"""`pipeline serve`: run tritonserver on a model repository until Ctrl-C or SIGTERM."""

from __future__ import annotations

from pathlib import Path

import click


@click.command()
@click.option("--repo", "-r", type=click.Path(path_type=Path), default=Path("triton_repo"), show_default=True,
              help="Triton model repository (made by `pipeline assemble` / `pipeline build`).")
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Address to bind gRPC, HTTP and metrics to; 0.0.0.0 opens them to the network.")
@click.option("grpc_port", "--grpc-port", type=int, default=8001, show_default=True)
@click.option("http_port", "--http-port", type=int, default=8000, show_default=True)
@click.option("metrics_port", "--metrics-port", type=int, default=8002, show_default=True)
@click.option("--timeout", type=float, default=None,
              help="Seconds to wait for every model to become ready [default: 120; 1800 for TensorRT-LLM engines, "
                   "which take minutes to load].")
@click.option("log_file", "--log-file", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Write the server log here (default: a temp file, printed at start).")
@click.option("log_verbose", "--log-verbose", type=int, default=0, show_default=True, help="tritonserver log verbosity.")
@click.option("dry_run", "--dry-run", is_flag=True,
              help="Print the launch command and exit (works on any machine, e.g. for a TensorRT-LLM repository).")
def serve(repo, host, grpc_port, http_port, metrics_port, timeout, log_file, log_verbose, dry_run):
    """Serve a model repository on Triton Inference Server until Ctrl-C or SIGTERM.

    Uses `tritonserver` on PATH (NVIDIA's containers), else the CPU server bundled in nvidia-pytriton.
    A TensorRT-LLM repository launches the way its backend needs (the repository's launch.json, written
    by assemble): under mpirun, one rank per GPU of a tp*pp engine (leader mode), or one orchestrator
    rank when a draft and a target engine share the server. It prints the command, waits until every
    model is ready, then prints the endpoints and the key the admin APIs need (logging, trace, model
    repository, shared memory, model config). It restarts the server when it or a model's process dies,
    saying so in one line. Stopping also reaps the python backend stubs and their shared memory.

    \b
    Example:
      pipeline serve --repo ./triton_repo --grpc-port 8001
      pipeline serve --repo ./triton_repo --dry-run      # the launch command only
    """
    from pipeline.triton.server import (ADMIN_HEADER, ADMIN_KEY_ENV, RESTRICTED_APIS, ServeOptions, planned_command,
                                        serve as run_server)

    options = ServeOptions(repo=repo, host=host, grpc_port=grpc_port, http_port=http_port,
                           metrics_port=metrics_port, log_file=log_file, log_verbose=log_verbose)
    if dry_run:
        click.echo(planned_command(options))
        return

    def started(server):
        click.echo(f"launch: {server.command}")

    def ready(server):
        click.echo(f"Serving {repo} with {server.binary.path}; Ctrl-C to stop.")
        for line in server.endpoints.lines():
            click.echo(f"  {line}")
        click.echo(f"  log      {server.log_path}")
        click.echo(f"  admin    {', '.join(RESTRICTED_APIS)} need header {ADMIN_HEADER}: {server.options.admin_key} "
                   f"(gRPC: triton-grpc-protocol-{ADMIN_HEADER}; set {ADMIN_KEY_ENV} to choose it)")

    run_server(options, timeout=timeout, on_ready=ready, on_start=started, say=click.echo)
    click.echo("Stopped.")
