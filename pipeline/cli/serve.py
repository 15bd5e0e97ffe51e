"""`pipeline serve`: run tritonserver on a model repository until Ctrl-C or SIGTERM."""

from __future__ import annotations

from pathlib import Path

import click

from pipeline.cli.device import device_option
from pipeline.triton.drain import DEFAULT_DRAIN_TIMEOUT_S


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
@click.option("openai_port", "--openai-port", type=int, default=None,
              help="Also serve the OpenAI API (/v1/chat/completions, /v1/completions, /v1/models) on this port, "
                   "on --host, in front of the ensemble.")
@click.option("api_key", "--api-key", envvar="PIPELINE_OPENAI_API_KEY", default=None, show_envvar=True,
              help="Key the OpenAI API asks for (Authorization: Bearer KEY) [default: none on loopback].")
@click.option("served_model_name", "--served-model-name", default=None,
              help="The model name the OpenAI API lists and requests send [default: the model folder's name].")
@click.option("max_body_bytes", "--openai-max-body-bytes", type=click.IntRange(min=1024), default=None, metavar="BYTES",
              help="The largest request body the OpenAI API reads; a larger one is refused with a 413 as it streams "
                   "in [default: 4x the repository's max_input_bytes, at least 1 MiB].")
@device_option("Portable-engine repository: where the served engine runs, over the repository's own (assemble's); "
               "passed to it as $PIPELINE_DEVICE.")
@click.option("drain_timeout", "--drain-timeout", type=click.FloatRange(min=0), default=DEFAULT_DRAIN_TIMEOUT_S,
              show_default=True, metavar="SECONDS",
              help="On SIGTERM, the requests in flight may finish for this long while new ones are refused "
                   "(UNAVAILABLE; the OpenAI port closes); then it stops. 0: stop at once, as Ctrl-C does.")
@click.option("dry_run", "--dry-run", is_flag=True,
              help="Print the launch command and exit (works on any machine, e.g. for a TensorRT-LLM repository).")
def serve(repo, host, grpc_port, http_port, metrics_port, timeout, log_file, log_verbose, openai_port, api_key,
          served_model_name, max_body_bytes, device, drain_timeout, dry_run):
    """Serve a model repository on Triton Inference Server until Ctrl-C or SIGTERM (which drains first).

    Uses `tritonserver` on PATH (NVIDIA's containers), else the CPU server bundled in nvidia-pytriton.
    A TensorRT-LLM repository launches the way its backend needs (the repository's launch.json, written
    by assemble): under mpirun, one rank per GPU of a tp*pp engine (leader mode), or one orchestrator
    rank when a draft and a target engine share the server. It prints the command, waits until every
    model is ready, then prints the endpoints and where the key the admin APIs need is kept (logging, trace,
    model repository, shared memory, model config); the key itself is never printed. With --openai-port it
    also serves the OpenAI API (chat and completions, streaming, /v1/models) in front of the ensemble. It
    restarts the server when it or a model's process dies, saying so in one line. Stopping also reaps the python backend stubs and their shared memory.
    A portable-engine repository's engine runs on --device (auto: cuda:0 where torch sees a GPU, else the
    CPU), said in one line before the launch command.

    \b
    Example:
      pipeline serve --repo ./triton_repo --grpc-port 8001
      pipeline serve --repo ./triton_repo --dry-run      # the launch command only
    """
    from pipeline.errors import ConfigError
    from pipeline.openai_api.process import FrontendOptions, FrontendProcess
    from pipeline.triton.ports import port_in_use
    from pipeline.triton.server import ADMIN_HEADER, ADMIN_KEY_ENV, RESTRICTED_APIS, ServeOptions, planned_command
    from pipeline.triton.supervise import serve as run_server

    options = ServeOptions(repo=repo, host=host, grpc_port=grpc_port, http_port=http_port,
                           metrics_port=metrics_port, log_file=log_file, log_verbose=log_verbose, device=device,
                           drain_timeout_s=drain_timeout)
    frontend = None
    if openai_port is not None:
        if not 0 < openai_port < 65536:
            raise ConfigError(f"--openai-port {openai_port} is not a port; pass 1-65535")
        if openai_port in options.ports.values():
            raise ConfigError(f"--openai-port {openai_port} is also tritonserver's; pass a port of its own")
        if host not in ("127.0.0.1", "localhost", "::1") and not api_key:
            raise ConfigError(f"the OpenAI API on {host} would answer anyone on the network without a key; pass "
                              "--api-key (or set PIPELINE_OPENAI_API_KEY), or keep --host 127.0.0.1")
        frontend = FrontendOptions(port=openai_port, host=host, api_key=api_key, model_name=served_model_name,
                                   max_body_bytes=max_body_bytes, drain_timeout_s=drain_timeout)
        if port_in_use(host, openai_port):
            raise ConfigError(f"OpenAI port {openai_port} on {host} is already in use; stop what holds it or pass "
                              "another --openai-port")
    elif max_body_bytes is not None:
        raise ConfigError("--openai-max-body-bytes is the OpenAI API's limit; pass --openai-port too")
    if dry_run:
        click.echo(planned_command(options))
        return

    def started(server):
        click.echo(f"launch: {server.command}")

    def ready(server):
        click.echo(f"Serving {repo} with {server.binary.path}; Ctrl-C to stop.")
        for line in server.endpoints.lines():
            click.echo(f"  {line}")
        if server.frontend is not None:
            key = " (asks for the --api-key key)" if frontend.key() else ""
            click.echo(f"  OpenAI   {server.frontend.url}/v1{key}")
        click.echo(f"  log      {server.log_path}")
        kept = f"in {server.admin_key_file}" if server.admin_key_file else f"${ADMIN_KEY_ENV}"
        click.echo(f"  admin    {', '.join(RESTRICTED_APIS)} need header {ADMIN_HEADER} (gRPC: "
                   f"triton-grpc-protocol-{ADMIN_HEADER}) with the key {kept}; set {ADMIN_KEY_ENV} to choose it")

    def openai_frontend(server):
        return FrontendProcess(frontend, repo, server.endpoints.grpc, server.endpoints.metrics,
                               server.log_path.with_name("openai-frontend.log"))

    run_server(options, timeout=timeout, on_ready=ready, on_start=started, say=click.echo,
               frontend=openai_frontend if frontend is not None else None)
    click.echo("Stopped.")
