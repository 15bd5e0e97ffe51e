"""Write an output folder all at once: into a staging folder beside it, renamed into place at the end.

An interrupted or failed run then never leaves a half-written model, engine or repository where a later
step would load it. Used by `pipeline quantize`, `compile` and `assemble`.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from pipeline.errors import PipelineError


def check_output(output: Path, force: bool, error: type[PipelineError], flag: str) -> None:
    """Cheap, up front: refuse an existing output (unless force) and a parent we can't write."""
    if output.exists() and not force:
        raise error(f"output folder {output} already exists; pass --force to replace it, or pick another {flag}")
    if output.exists() and not output.is_dir():
        raise error(f"output {output} is a file; pick a folder path for {flag}")
    existing = next(p for p in output.parents if p.exists())  # the parent is made only when writing
    if not existing.is_dir() or not os.access(existing, os.W_OK):
        raise error(f"can't write under {existing}; pick a writable {flag}")


@contextlib.contextmanager
def staged_output(output: Path, force: bool, error: type[PipelineError], flag: str) -> Iterator[Path]:
    """Yield an empty staging folder beside `output`; on success it becomes `output`, on error it is removed.

    With force, an existing output is renamed aside, the new one renamed in, then the old one deleted:
    `output` is the complete old folder, then (for an instant) absent, then the complete new one.
    """
    check_output(output, force, error, flag)
    output.parent.mkdir(parents=True, exist_ok=True)
    stage = Path(tempfile.mkdtemp(prefix=f".{output.name}.tmp-", dir=output.parent))
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(stage, 0o777 & ~umask)  # mkdtemp makes it 0700; the output should read like any mkdir'd folder
    try:
        yield stage
        if output.exists():
            if not force:  # appeared while we worked
                raise error(f"output folder {output} appeared while writing it; pass --force to replace it")
            old = Path(tempfile.mkdtemp(prefix=f".{output.name}.old-", dir=output.parent))
            os.replace(output, old / output.name)
            os.replace(stage, output)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(stage, output)
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise
