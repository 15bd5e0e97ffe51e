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


def kernel_cache() -> Path:
    """Where the built C kernels are kept: $PIPELINE_KERNEL_CACHE, else $PIPELINE_HOME/kernels. A folder of its own,
    as Triton's TRITON_CACHE_DIR and torch's TORCHINDUCTOR_CACHE_DIR are, so an image can ship its kernels built or
    many homes share one build (each file is named by the source, flags and CPU it was built for)."""
    env = os.environ.get("PIPELINE_KERNEL_CACHE")
    return Path(env).expanduser() if env else pipeline_home() / "kernels"
