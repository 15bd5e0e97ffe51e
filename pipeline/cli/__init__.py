"""The `pipeline` command line: a thin layer over the library.

Commands parse options, call one library function and print its result. Library errors
(pipeline.errors.PipelineError) become one-line click errors here, in one place: `PipelineGroup`.
Commands import torch/transformers inside their bodies so `pipeline --help` stays fast.

A short flag means one thing on every command: -t --target, -m --model (generate and quantize run or quantize
one model), -d --draft, -k --num-draft-tokens, -n --max-tokens, -b --backend, -g --gpu, -e --engine,
-r --repo, -o --output, -u --url, -p --prompts, -c --concurrency, -f --force, -q --quiet. Spellings that
meant something else before still parse, hidden from --help (cli/aliased.py).
"""

from __future__ import annotations

import click

from pipeline import __version__
from pipeline.errors import PipelineError, one_line


class _Failed(click.ClickException):
    def __init__(self, message: str, exit_code: int):
        super().__init__(message)
        self.exit_code = exit_code


class PipelineGroup(click.Group):
    """A click group that turns every PipelineError raised by a command into `Error: <message>` with the error's
    exit status (2 for a bad option or value, as click's own usage errors; 1 otherwise), and Ctrl-C into one line
    and 130 (128 + SIGINT, as a shell reports it)."""

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except PipelineError as err:
            raise _Failed(one_line(err), err.exit_code) from None
        except KeyboardInterrupt:
            click.echo("Interrupted.", err=True)
            raise click.exceptions.Exit(130) from None


@click.group(cls=PipelineGroup)
@click.version_option(__version__, "--version", "-V", prog_name="pipeline")
def main():
    """Speculative decoding build-and-serve pipeline.

    quantize (ModelOpt) -> plan / compile (TensorRT-LLM or the portable engine) -> serve (Triton);
    `generate` runs the portable engine in process.
    """
    quiet_progress_bars()


def quiet_progress_bars() -> None:
    """No third-party progress bars (transformers' "Loading weights", safetensors' shards) when stderr isn't a
    terminal: in a pipe or a log file each redraw is a line of noise. Set before transformers is imported, which
    reads them once; a value the user exported wins."""
    import os
    import sys

    if not sys.stderr.isatty():
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
        os.environ.setdefault("TQDM_DISABLE", "1")


from pipeline.cli.generate import generate  # noqa: E402  (registers on `main`)
from pipeline.cli.quantize import quantize  # noqa: E402
from pipeline.cli.compile import compile_command  # noqa: E402
from pipeline.cli.plan import plan  # noqa: E402
from pipeline.cli.serve import serve  # noqa: E402
from pipeline.cli.assemble import assemble  # noqa: E402
from pipeline.cli.build import build  # noqa: E402
from pipeline.cli.draft import draft  # noqa: E402
from pipeline.cli.bench import bench  # noqa: E402
from pipeline.cli.deploy import deploy  # noqa: E402

main.add_command(generate)
main.add_command(quantize)
main.add_command(compile_command)
main.add_command(plan)
main.add_command(serve)
main.add_command(assemble)
main.add_command(build)
main.add_command(draft)
main.add_command(bench)
main.add_command(deploy)
