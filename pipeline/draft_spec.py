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

from dataclasses import dataclass
from pathlib import Path

from pipeline.errors import ConfigError

NONE, NGRAM, MODEL, EAGLE3, AUTO = "none", "ngram", "model", "eagle3", "auto"
DRAFT_KINDS = (NONE, NGRAM, MODEL, EAGLE3)
EAGLE3_PREFIX = f"{EAGLE3}:"


@dataclass(frozen=True)
class DraftSpec:
    kind: str  # none | ngram | model | eagle3, or auto (build only)
    ref: str = ""  # model: a folder, preset or hub id; eagle3: a head's folder or hub id ("" = the target's own)

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

    def __str__(self) -> str:
        """The spelling --draft takes back."""
        if self.kind == MODEL:
            return self.ref
        return f"{EAGLE3_PREFIX}{self.ref}" if self.kind == EAGLE3 and self.ref else self.kind


def parse_draft(value: str | Path | None, *, allow_auto: bool = False) -> DraftSpec:
    text = str(value if value is not None else NONE).strip()
    word = text.lower()
    if word in (NONE, NGRAM, EAGLE3) or (word == AUTO and allow_auto):
        return DraftSpec(word)
    if word == AUTO:
        raise ConfigError("--draft auto is for `pipeline build`, which picks one; name the draft: ngram, none, "
                          "eagle3:DIR or a draft model")
    if word.startswith(EAGLE3_PREFIX):
        ref = text[len(EAGLE3_PREFIX):].strip()
        if not ref:
            raise ConfigError("--draft eagle3: needs a folder after the colon, e.g. --draft eagle3:heads/my-head")
        return DraftSpec(EAGLE3, ref)
    if not text:
        raise ConfigError("--draft is empty; pass none, ngram, eagle3, eagle3:DIR or a draft model")
    return DraftSpec(MODEL, text)
