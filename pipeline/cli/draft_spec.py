"""`--draft`, read once where a command takes it (compile, build, generate, plan) into the DraftSpec its options carry."""

from __future__ import annotations

import click

from pipeline.draft_spec import DraftSpec, parse_draft


class DraftType(click.ParamType):
    """A misspelling's ConfigError goes up as it is, to PipelineGroup's one line (as cli/device.py's type does).
    allow_auto: build's `auto`, which the build resolves; other commands refuse it, naming build."""

    name = "draft"

    def __init__(self, allow_auto: bool = False):
        self.allow_auto = allow_auto

    def convert(self, value, param, ctx) -> DraftSpec:
        return parse_draft(value, allow_auto=self.allow_auto)
