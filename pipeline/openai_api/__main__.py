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


def settings_from_repo(repo: Path, grpc_url: str, model_name: str | None, metrics_url: str | None,
                       max_body_bytes: int | None = None):
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
    return FrontendSettings(grpc_url=grpc_url, tokenizer_dir=tokenizer_dir,
                            model_name=model_name or default_model_name(tokenizer_dir),
                            max_seq_len=int(params["max_seq_len"]), num_draft_tokens=int(params["num_draft_tokens"]),
                            max_input_bytes=int(params["max_input_bytes"]), metrics_url=metrics_url,
                            api_key=os.environ.get(API_KEY_ENV) or None, max_body_bytes=max_body_bytes)


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
def main(repo, grpc_url, host, port, metrics_url, model_name, max_body_bytes):
    import logging

    import uvicorn

    from pipeline.errors import PipelineError
    from pipeline.openai_api.app import create_app
    from pipeline.openai_api.edge import HEAD_BYTES

    try:
        app = create_app(settings_from_repo(repo, grpc_url, model_name, metrics_url, max_body_bytes))
    except PipelineError as err:
        click.echo(f"error: {err}", err=True)
        sys.exit(2)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # No per-request access log: one line per request at 64 streams drowns the server's own log. h11, named
    # rather than picked (uvicorn takes httptools where it is installed), bounds a head still arriving at
    # HEAD_BYTES; edge.Guard bounds one that came whole.
    uvicorn.run(app, host=host, port=port, log_level="warning", access_log=False, timeout_graceful_shutdown=5,
                http="h11", h11_max_incomplete_event_size=HEAD_BYTES)


if __name__ == "__main__":
    main()
