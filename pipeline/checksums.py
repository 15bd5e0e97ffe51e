"""A record of a folder's files (size, mtime, sha256 each) and the first file that no longer matches it.

A build keeps one per stage output in build.json, and a GGUF conversion keeps one in the cache folder it
writes, so neither trusts a folder whose bytes changed after it was written (a truncated engine, a damaged
cache). Sizes are always compared; a file is hashed only when its size matches and its mtime moved, or when
the caller asks (--force), so checking an untouched folder reads no weights.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

HASH_CHUNK = 8 << 20


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(HASH_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def record_files(folder: Path, mtimes: bool = True) -> dict[str, dict]:
    """{path under `folder`: {size, mtime_ns, sha256}} for every file under it.

    Without `mtimes` the record depends on the bytes alone (a model folder's record is part of the model, and
    so of a build's input key); such a record is hashed against only when the caller asks.
    """
    out = {}
    for f in sorted(p for p in folder.rglob("*") if p.is_file()):
        st = f.stat()
        entry = {"size": st.st_size, "mtime_ns": st.st_mtime_ns} if mtimes else {"size": st.st_size}
        out[f.relative_to(folder).as_posix()] = {**entry, "sha256": sha256_file(f)}
    return out


def first_change(folder: Path, record: dict[str, dict], rehash: bool = False) -> str | None:
    """The first recorded file that is gone or whose bytes differ from `record`, or None when all match.

    A file is hashed when its mtime moved (never, for a record kept without mtimes) or with `rehash`. One whose
    bytes still match under a new mtime gets that mtime in `record`, so a caller that saves the record will not
    hash it again.
    """
    for rel, want in record.items():
        try:
            st = (folder / rel).stat()
        except OSError:
            return rel
        if st.st_size != want["size"]:
            return rel
        moved = "mtime_ns" in want and st.st_mtime_ns != want["mtime_ns"]
        if rehash or moved:
            if sha256_file(folder / rel) != want["sha256"]:
                return rel
            if moved:
                want["mtime_ns"] = st.st_mtime_ns
    return None
