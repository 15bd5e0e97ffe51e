"""Write docs/cli.md from the `pipeline` command's own --help, so the reference can't drift from the code.

    python scripts/cli_docs.py           rewrite docs/cli.md
    python scripts/cli_docs.py --check   exit 1 if docs/cli.md is stale (tests/test_docs.py runs this)
"""

from __future__ import annotations

import sys
from pathlib import Path

import click

OUT = Path(__file__).resolve().parent.parent / "docs" / "cli.md"
WIDTH = 110  # fixed, so the text doesn't depend on the terminal that runs this


def _commands(group: click.Group, ctx: click.Context):
    for name in sorted(group.list_commands(ctx)):
        cmd = group.get_command(ctx, name)
        sub = click.Context(cmd, info_name=name, parent=ctx, terminal_width=WIDTH,
                            max_content_width=WIDTH)
        yield sub.command_path, cmd.get_help(sub)
        if isinstance(cmd, click.Group):
            yield from _commands(cmd, sub)


def render() -> str:
    from pipeline.cli import main

    ctx = click.Context(main, info_name="pipeline", terminal_width=WIDTH, max_content_width=WIDTH)
    lines = ["# `pipeline` command reference", "",
             "Generated from each command's `--help` by `python scripts/cli_docs.py`; a test fails when it is stale.",
             "What the commands do together, with real output: [guide.md](guide.md).", ""]
    for path, text in [("pipeline", main.get_help(ctx)), *_commands(main, ctx)]:
        lines += [f"## `{path}`", "", "```", text.rstrip(), "```", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    text = render()
    if "--check" in sys.argv[1:]:
        if not OUT.is_file() or OUT.read_text() != text:
            sys.exit(f"{OUT} is stale: run `python scripts/cli_docs.py` and commit it")
    else:
        OUT.write_text(text)
        print(f"wrote {OUT}")
