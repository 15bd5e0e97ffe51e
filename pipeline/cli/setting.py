"""A shared setting's option (pipeline.setting): its flag, bound and meaning from the one declaration, the
command's own default and what the command adds to the help. The value is checked as it is read, by the
declaration, so a value out of bounds is the same one-line error on every command."""

from __future__ import annotations

import click

from pipeline.errors import ConfigError
from pipeline.setting import Setting


class _SettingType(click.ParamType):
    """A whole number checked against the setting's bound (or the command's own, lower one); "none" where the
    command gives it a meaning. A bad value's ConfigError goes up to PipelineGroup's one line."""

    name = "integer"

    def __init__(self, setting: Setting, minimum: int, allows_none: bool):
        self.setting, self.minimum, self.allows_none = setting, minimum, allows_none

    def convert(self, value, param, ctx) -> int | None:
        if isinstance(value, str):
            text = value.strip().lower()
            if self.allows_none and text == "none":
                return None
            try:
                value = int(text)
            except ValueError:
                raise ConfigError(f"{self.setting.flag} takes a whole number" + (" or none" if self.allows_none else "")
                                  + f" (got {value!r})") from None
        return self.setting.check(value, minimum=self.minimum)


def setting_option(setting: Setting, default: int | str | None = None, more: str = "", *, minimum: int | None = None,
                   allows_none: bool = False, **kw):
    """click.option for `setting`. minimum: a command's own lower bound where it gives a value below the declared
    one a meaning (generate's --gate-batch-size 0: never speculate); allows_none: "none" reads as None."""
    names = [setting.name, setting.flag, *([setting.short] if setting.short else [])]
    kind = _SettingType(setting, setting.minimum if minimum is None else minimum, allows_none)
    return click.option(*names, type=kind, default=default, show_default=default is not None,
                        help=f"{setting.meaning} {more}".strip(), **kw)
