"""--draft: what proposes tokens for the target. none, ngram, a draft-model folder, or eagle3:FOLDER."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from pipeline.errors import ConfigError

DRAFT_KINDS = ("none", "ngram", "model", "eagle3")
EAGLE3_PREFIX = "eagle3:"


@dataclass(frozen=True)
class DraftSpec:
    kind: str  # none | ngram | model | eagle3
    path: Path | None = None  # the folder, for model and eagle3

    @property
    def speculates(self) -> bool:
        return self.kind != "none"


def parse_draft(value: str | None) -> DraftSpec:
    text = (value or "none").strip()
    if text.lower() in ("none", "ngram"):
        return DraftSpec(text.lower())
    if text.lower().startswith(EAGLE3_PREFIX):
        folder = text[len(EAGLE3_PREFIX):].strip()
        if not folder:
            raise ConfigError("--draft eagle3: needs a folder, e.g. --draft eagle3:models/eagle3-head")
        return DraftSpec("eagle3", Path(folder).expanduser().absolute())
    return DraftSpec("model", Path(text).expanduser().absolute())
