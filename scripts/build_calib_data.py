"""Build pipeline/quantize/data/calib.jsonl: the built-in offline calibration and evaluation text.

Half English prose (the Python language reference as shipped in `pydoc_data.topics`), half Python
code (stdlib module sources). Both come with CPython under the PSF license (see the NOTICE next to
the data). Records alternate prose/code, each about RECORD_CHARS characters, so any prefix of the
file is a mix of both. Run once with a fixed CPython; the output is committed, not rebuilt in CI.

    python scripts/build_calib_data.py            # writes pipeline/quantize/data/calib.jsonl
"""

from __future__ import annotations

import json
import platform
import sysconfig
from pathlib import Path

OUT = Path(__file__).resolve().parent.parent / "pipeline" / "quantize" / "data" / "calib.jsonl"
RECORD_CHARS = 1500
BUDGET_CHARS = 150_000  # per kind: about 300 KB in all
# Plain-Python stdlib modules with ordinary, readable code (no generated tables, no huge literals).
MODULES = (
    "textwrap.py", "heapq.py", "bisect.py", "functools.py", "dataclasses.py", "shlex.py", "fractions.py",
    "statistics.py", "string.py", "queue.py", "contextlib.py", "abc.py", "copy.py", "fnmatch.py",
    "graphlib.py", "operator.py", "pprint.py", "reprlib.py", "sched.py", "difflib.py", "argparse.py",
    "json/encoder.py", "json/decoder.py", "csv.py", "enum.py", "ipaddress.py", "calendar.py", "base64.py",
)


def chunks(text: str, limit: int = RECORD_CHARS) -> list[str]:
    """Consecutive blank-line-separated blocks, grouped up to `limit` characters (a longer block stays whole)."""
    out, cur = [], ""
    for block in text.split("\n\n"):
        if not block.strip():
            continue
        if cur and len(cur) + len(block) + 2 > limit:
            out.append(cur)
            cur = ""
        cur = f"{cur}\n\n{block}" if cur else block
    if cur:
        out.append(cur)
    return [c.strip("\n") for c in out if len(c.strip()) >= 200]


def take(records: list[tuple[str, str]], budget: int) -> list[tuple[str, str]]:
    kept, total = [], 0
    for source, text in records:
        if total >= budget:
            break
        kept.append((source, text))
        total += len(text)
    return kept


def prose_records() -> list[tuple[str, str]]:
    from pydoc_data.topics import topics

    return [(f"pydoc_data.topics:{name}", c) for name in sorted(topics) for c in chunks(topics[name])]


def code_records() -> list[tuple[str, str]]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    out = []
    for name in MODULES:
        out += [(f"stdlib:{name}", c) for c in chunks((stdlib / name).read_text(encoding="utf-8"))]
    return out


def main() -> None:
    prose, code = take(prose_records(), BUDGET_CHARS), take(code_records(), BUDGET_CHARS)
    OUT.parent.mkdir(parents=True, exist_ok=True)
    with OUT.open("w", encoding="utf-8") as f:
        for i in range(max(len(prose), len(code))):
            for kind, recs in (("prose", prose), ("code", code)):
                if i < len(recs):
                    source, text = recs[i]
                    f.write(json.dumps({"text": text, "kind": kind, "source": source}, ensure_ascii=False) + "\n")
    print(f"{OUT}: {len(prose)} prose + {len(code)} code records, {OUT.stat().st_size} bytes "
          f"(CPython {platform.python_version()})")


if __name__ == "__main__":
    main()
