"""`--device`, one spelling on every command that runs the portable engine (compile, build, generate, serve)."""

from __future__ import annotations

import click

from pipeline.engine.device import DEVICE_CHOICES


def device_option(what: str):
    """The --device option; `what` says where the device is used on this command."""
    return click.option("--device", default="auto", show_default=True, metavar=DEVICE_CHOICES,
                        help=f"{what} auto: cuda:0 where torch sees a GPU, else cpu; said in one line.")
