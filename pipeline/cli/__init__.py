"""The `pipeline` command line: a thin layer over the library.

Commands parse options, call one library function and print its result. Library errors
(pipeline.errors.PipelineError) become one-line click errors here, in one place: `PipelineGroup`.
Commands import torch/transformers inside their bodies so `pipeline --help` stays fast.
"""

from __future__ import annotations

import click

from pipeline import __version__
from pipeline.errors import PipelineError


class PipelineGroup(click.Group):
    """A click group that turns every PipelineError raised by a command into `Error: <message>`."""

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except PipelineError as err:
            raise click.ClickException(" ".join(str(err).split()) or type(err).__name__) from None


@click.group(cls=PipelineGroup)
@click.version_option(__version__, "--version", "-V", prog_name="pipeline")
def main():
    """Speculative decoding build-and-serve pipeline.

    quantize (ModelOpt) -> plan / compile (TensorRT-LLM or the portable engine) -> serve (Triton);
    `generate` runs the portable engine in process.
    """


from pipeline.cli.generate import generate  # noqa: E402  (registers on `main`)
from pipeline.cli.quantize import quantize  # noqa: E402
from pipeline.cli.compile import compile  # noqa: E402,A004
from pipeline.cli.plan import plan  # noqa: E402
from pipeline.cli.serve import serve  # noqa: E402
from pipeline.cli.assemble import assemble  # noqa: E402
from pipeline.cli.build import build  # noqa: E402
from pipeline.cli.draft import draft  # noqa: E402
from pipeline.cli.bench import bench  # noqa: E402

main.add_command(generate)
main.add_command(quantize)
main.add_command(compile)
main.add_command(plan)
main.add_command(serve)
main.add_command(assemble)
main.add_command(build)
main.add_command(draft)
main.add_command(bench)
