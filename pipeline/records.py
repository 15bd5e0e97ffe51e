"""Records from a user's file, by one rule for every command that takes one: prompts (`generate --prompts-file`,
`bench -p FILE`, `draft train --data`) and calibration text (`quantize --calib-data`).

- A .jsonl or .json file is JSONL: one {"<field>": "..."} object per line.
- Any other file is JSONL when every non-blank line is such an object; otherwise it is plain text: one record
  per line (prompts), or per block between blank lines (calibration text, whose samples span lines).
Blank lines and blank records are skipped. Every error is one line that names the file (and the line) and the fix.
"""

from __future__ import annotations

import json
from pathlib import Path

from pipeline.errors import ConfigError, PipelineError


class _NotJsonl(Exception):
    def __init__(self, n: int):
        self.n = n


def read_records(path: str | Path, field: str, what: str, *, error: type[PipelineError] = ConfigError,
                 blocks: bool = False) -> list[str]:
    """The file's records. field: the JSONL key ("prompt", "text"); what: the file as the user knows it
    ("prompts file", "calibration file (--calib-data)"), for messages; error: the exception to raise;
    blocks: plain text splits at blank lines rather than at every line."""
    path = Path(path).expanduser()
    form = f'one {{"{field}": "..."}} per line, or plain text ({"blocks between blank lines" if blocks else "one per line"})'
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise error(f"can't read {what} {path} ({type(err).__name__}); pass a readable UTF-8 file: {form}") from None
    lines = [(n, line) for n, line in enumerate(text.splitlines(), 1) if line.strip()]
    try:
        records = [_field(line, n, field) for n, line in lines]
    except _NotJsonl as bad:
        if path.suffix.lower() in (".jsonl", ".json"):
            raise error(f'{path}:{bad.n} is not a JSON object with a string "{field}"; write one '
                        f'{{"{field}": "..."}} per line') from None
        records = ([b.strip("\n") for b in text.split("\n\n")] if blocks else [line for _, line in lines])
    records = [r for r in records if r.strip()]
    if not records:
        raise error(f"{what} {path} is empty; put {form} in it")
    return records


def _field(line: str, n: int, field: str) -> str:
    try:
        obj = json.loads(line)
    except json.JSONDecodeError:
        obj = None
    if not isinstance(obj, dict) or not isinstance(obj.get(field), str):
        raise _NotJsonl(n)
    return obj[field]
