"""The pipeline's cache root: converted models and other derived artifacts live here."""

from __future__ import annotations

import os
from pathlib import Path


def pipeline_home() -> Path:
    """$PIPELINE_HOME, else ~/.cache/pipeline; created on first use."""
    env = os.environ.get("PIPELINE_HOME")
    home = Path(env).expanduser() if env else Path.home() / ".cache" / "pipeline"
    home.mkdir(parents=True, exist_ok=True)
    return home
