"""The frontend's process: `python -m pipeline.openai_api --repo DIR --grpc-url HOST:PORT --port N`.

`pipeline serve --openai-port` starts it and restarts it if it dies; it can also run on its own in front of
any tritonserver serving a repository of ours. The API key comes from $PIPELINE_OPENAI_API_KEY, never the
command line, which every user of the machine can read.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import click

from pipeline.openai_api.connections import BODY_TIMEOUT_S, HEAD_TIMEOUT_S
from pipeline.triton.drain import DEFAULT_DRAIN_TIMEOUT_S


def settings_from_repo(repo: Path, grpc_url: str, model_name: str | None, metrics_url: str | None,
                       max_body_bytes: int | None = None, body_timeout_s: float | None = None):
    """The frontend's settings from the repository's request-reading model (its tokenizer, context and k)."""
    from pipeline.errors import ConfigError
    from pipeline.openai_api.app import FrontendSettings
    from pipeline.openai_api.protocol import API_KEY_ENV
    from pipeline.triton.config import LLMAPI_FRONTEND, PREPROCESSING, read_config

    for name in (PREPROCESSING, LLMAPI_FRONTEND):
        path = Path(repo) / name / "config.pbtxt"
        if path.is_file():
            params = {k: v.string_value for k, v in read_config(path).parameters.items()}
            break
    else:
        raise ConfigError(f"{repo} has no {PREPROCESSING} model; pass a repository made by `pipeline assemble`")
    tokenizer_dir = Path(params["tokenizer_dir"])
    kv_pool_tokens = engine_pool_tokens(tokenizer_dir)
    return FrontendSettings(grpc_url=grpc_url, tokenizer_dir=tokenizer_dir,
                            tokenizer_class=params.get("tokenizer_class", ""),
                            model_name=model_name or default_model_name(tokenizer_dir),
                            max_seq_len=int(params["max_seq_len"]), num_draft_tokens=int(params["num_draft_tokens"]),
                            max_input_bytes=int(params["max_input_bytes"]), metrics_url=metrics_url,
                            api_key=os.environ.get(API_KEY_ENV) or None, max_body_bytes=max_body_bytes,
                            kv_pool_tokens=kv_pool_tokens,
                            **({} if body_timeout_s is None else {"body_timeout_s": body_timeout_s}))


def engine_pool_tokens(tokenizer_dir: Path) -> int | None:
    """A portable engine's KV pool in tokens (its slots of max_seq_len each, what compile sizes it for), or None for
    another route's. A pool cut by kv_cache_bytes is smaller: the engine then preempts, and refuses what can't fit."""
    from pipeline.engine.folder import read_engine_manifest
    from pipeline.errors import PipelineError

    try:
        manifest = read_engine_manifest(tokenizer_dir.parent)
        return int(manifest["max_batch_size"]) * int(manifest["max_seq_len"])
    except (PipelineError, ValueError, KeyError, TypeError):
        return None


def default_model_name(tokenizer_dir: Path) -> str:
    """The model's own name: a portable engine keeps its target in `<engine>/target`, and engine.json names the
    folder it was compiled from (SmolLM2's: smollm2-135m); other routes' tokenizer is the model's folder."""
    from pipeline.engine.folder import read_engine_manifest
    from pipeline.errors import PipelineError

    try:
        source = read_engine_manifest(tokenizer_dir.parent)["target"].get("source")
    except (PipelineError, ValueError, KeyError):  # not a portable engine's target, or an unreadable engine.json
        source = None
    return Path(source).name if source else tokenizer_dir.name


@click.command()
@click.option("--repo", type=click.Path(path_type=Path), required=True)
@click.option("grpc_url", "--grpc-url", default="127.0.0.1:8001", show_default=True)
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", type=int, default=9000, show_default=True)
@click.option("metrics_url", "--metrics-url", default=None)
@click.option("model_name", "--served-model-name", default=None)
@click.option("max_body_bytes", "--max-body-bytes", type=click.IntRange(min=1024), default=None)
@click.option("head_timeout", "--head-timeout", type=click.FloatRange(min=0.1), default=HEAD_TIMEOUT_S,
              show_default=True, help="Seconds a request head may take to arrive (a 408 and the close past it).")
@click.option("body_timeout", "--body-timeout", type=click.FloatRange(min=0.1), default=BODY_TIMEOUT_S,
              show_default=True, help="Seconds a request body may take to arrive (a 408 past it).")
@click.option("max_connections", "--max-connections", type=click.IntRange(min=16), default=None,
              help="Open connections at most [default: half the open-file limit, at most 8192].")
@click.option("drain_timeout", "--drain-timeout", type=click.FloatRange(min=0), default=DEFAULT_DRAIN_TIMEOUT_S,
              show_default=True, help="On SIGTERM: seconds the requests in flight may take to finish (new "
                                      "connections are refused at once); past it they are cut.")
def main(repo, grpc_url, host, port, metrics_url, model_name, max_body_bytes, head_timeout, body_timeout,
         max_connections, drain_timeout):
    import logging

    import uvicorn

    from pipeline.errors import PipelineError
    from pipeline.openai_api.app import create_app
    from pipeline.openai_api.connections import (ConnectionLimits, RateLimitedLog, max_connections_for,
                                                 protocol_class, raise_file_limit)
    from pipeline.openai_api.edge import HEAD_BYTES

    try:
        app = create_app(settings_from_repo(repo, grpc_url, model_name, metrics_url, max_body_bytes, body_timeout))
    except PipelineError as err:
        click.echo(f"error: {err}", err=True)
        sys.exit(2)
    limits = ConnectionLimits(head_timeout_s=head_timeout,
                              max_connections=max_connections or max_connections_for(raise_file_limit()))
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # No per-request access log: one line per request at 64 streams drowns the server's own log. h11 (uvicorn
    # would take httptools where it is installed) bounds a head still arriving at HEAD_BYTES, edge.Guard one that
    # came whole, and connections.EdgeProtocol one that never completes, and the number of connections.
    config = uvicorn.Config(app, host=host, port=port, log_level="warning", access_log=False,
                            timeout_graceful_shutdown=drain_timeout, http=protocol_class(limits),
                            h11_max_incomplete_event_size=HEAD_BYTES, timeout_keep_alive=limits.keep_alive_s)
    # uvicorn's loggers have handlers of their own (set up by Config): every handler gets the rate limit.
    limiter = RateLimitedLog()
    for name in (None, "uvicorn", "uvicorn.error", "uvicorn.access", "asyncio"):
        for handler in logging.getLogger(name).handlers:
            handler.addFilter(limiter)
    uvicorn.Server(config).run()


if __name__ == "__main__":
    main()
