"""The pipeline's cache root: converted models and other derived artifacts live here."""

from __future__ import annotations

import os
from pathlib import Path


def pipeline_home(create: bool = True) -> Path:
    """$PIPELINE_HOME, else ~/.cache/pipeline; created on first use (create=False: only named, for code that
    looks without writing, as a build's --dry-run)."""
    env = os.environ.get("PIPELINE_HOME")
    home = Path(env).expanduser() if env else Path.home() / ".cache" / "pipeline"
    if create:
        home.mkdir(parents=True, exist_ok=True)
    return home
