"""--draft, parsed once for every command: what proposes tokens for the target.

  none          no speculation
  ngram         n-gram lookup in the request's own text (no weights)
  eagle3        the target's EAGLE-3 head: its published one, or on the portable engine one the build trains
  eagle3:REF    an EAGLE-3 head: a folder (or, for build, a hub id)
  REF           a draft model: a folder, a preset name or a hub id, of the target's family
  auto          build only: eagle3 on TensorRT-LLM where the target has a published head, else ngram

Pure: no torch. build resolves `auto` and a bare `eagle3` to one of the others (pipeline/build/settings.py);
compile, the engine and generate take a resolved spec.
"""

from __future__ import annotations

from pathlib import Path

from pipeline.errors import ConfigError

NONE, NGRAM, MODEL, EAGLE3, AUTO = "none", "ngram", "model", "eagle3", "auto"
DRAFT_KINDS = (NONE, NGRAM, MODEL, EAGLE3)
EAGLE3_PREFIX = f"{EAGLE3}:"


class DraftSpec(str):
    """A --draft as read: its kind (none | ngram | model | eagle3, or auto for build) and ref (model: a folder, preset
    or hub id; eagle3: a head's folder or hub id, "" for the target's own). A `str`, spelled as --draft takes it
    back, so options holding one go into JSON, a stage's key or a command line as the text they were given."""

    kind: str
    ref: str

    def __new__(cls, kind: str, ref: str = "") -> DraftSpec:
        spelled = ref if kind == MODEL else f"{EAGLE3_PREFIX}{ref}" if kind == EAGLE3 and ref else kind
        spec = super().__new__(cls, spelled)
        spec.kind, spec.ref = kind, ref
        return spec

    def __getnewargs__(self) -> tuple[str, str]:  # pickled and copied (a build's stages, asdict) as itself
        return self.kind, self.ref

    def __repr__(self) -> str:
        return f"DraftSpec({self.kind!r}, {self.ref!r})"

    @property
    def speculates(self) -> bool:
        return self.kind != NONE

    @property
    def path(self) -> Path | None:
        """The weights' folder, absolute, for a model or a head given by reference (None otherwise). A build
        preview's "<...>" placeholder, for weights a later stage writes, stays as it is."""
        if self.kind not in (MODEL, EAGLE3) or not self.ref:
            return None
        return Path(self.ref) if "<" in self.ref else Path(self.ref).expanduser().absolute()


def parse_draft(value: str | Path | None, *, allow_auto: bool = False) -> DraftSpec:
    """--draft read, once: the CLI's option type and the options' field (DraftField) call this; a DraftSpec given
    is that one (only checked: auto where the command takes it)."""
    if isinstance(value, DraftSpec):
        if value.kind == AUTO and not allow_auto:
            raise ConfigError(_AUTO_IS_BUILDS)
        return value
    text = str(value if value is not None else NONE).strip()
    word = text.lower()
    if word in (NONE, NGRAM, EAGLE3) or (word == AUTO and allow_auto):
        return DraftSpec(word)
    if word == AUTO:
        raise ConfigError(_AUTO_IS_BUILDS)
    if word.startswith(EAGLE3_PREFIX):
        ref = text[len(EAGLE3_PREFIX):].strip()
        if not ref:
            raise ConfigError("--draft eagle3: needs a folder after the colon, e.g. --draft eagle3:heads/my-head")
        return DraftSpec(EAGLE3, ref)
    if not text:
        raise ConfigError("--draft is empty; pass none, ngram, eagle3, eagle3:DIR or a draft model")
    return DraftSpec(MODEL, text)


_AUTO_IS_BUILDS = ("--draft auto is for `pipeline build`, which picks one; name the draft: ngram, none, eagle3:DIR or "
                   "a draft model")


class DraftField:
    """An options dataclass's `draft` field: what it is given is read there, once, into a DraftSpec (None stays None
    where the command gives None a meaning: generate's "the engine folder's own"). A data descriptor, as
    pipeline.engine.device.DeviceField, so a library caller's text is checked where it enters as the CLI's is."""

    def __init__(self, default: str | None, allow_auto: bool = False):
        self._allow_auto = allow_auto
        self._default = None if default is None else parse_draft(default, allow_auto=allow_auto)

    def __set_name__(self, owner, name: str) -> None:
        self._slot = f"_{name}_spec"

    def __get__(self, obj, owner=None) -> DraftSpec | None:
        if obj is None:  # dataclasses reads the class attribute once, as the field's default
            return self._default
        return getattr(obj, self._slot)

    def __set__(self, obj, value: str | Path | DraftSpec | None) -> None:
        spec = None if value is None else parse_draft(value, allow_auto=self._allow_auto)
        object.__setattr__(obj, self._slot, spec)
