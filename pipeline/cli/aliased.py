"""Options that keep their old spellings working, out of --help."""

from __future__ import annotations

import click


class Aliased(click.Option):
    """An option whose old spellings (`hidden`) still parse but no longer show in --help."""

    def __init__(self, param_decls, hidden: tuple[str, ...] = (), **kwargs):
        super().__init__([*param_decls, *hidden], **kwargs)
        self.hidden_spellings = tuple(hidden)

    def get_help_record(self, ctx):
        opts = self.opts
        self.opts = [o for o in opts if o not in self.hidden_spellings]
        try:
            return super().get_help_record(ctx)
        finally:
            self.opts = opts
