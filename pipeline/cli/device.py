"""`--device`, one spelling on every command that runs the portable engine (compile, build, generate, serve)."""

from __future__ import annotations

import click

from pipeline.engine.device import DEVICE_CHOICES, DeviceChoice


class _DeviceType(click.ParamType):
    """Reads --device once, into the DeviceChoice the command's options carry on. A misspelling's ConfigError goes
    up as it is, to PipelineGroup's one line (click's own usage error would add its usage lines)."""

    name = "device"

    def convert(self, value, param, ctx) -> DeviceChoice:
        return DeviceChoice(value)


def device_option(what: str):
    """The --device option; `what` says where the device is used on this command."""
    return click.option("--device", type=_DeviceType(), default="auto", show_default=True, metavar=DEVICE_CHOICES,
                        help=f"{what} auto: cuda:0 where torch sees a GPU, else cpu; said in one line.")
