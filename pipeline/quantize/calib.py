"""Calibration and evaluation text, and the fixed-length token samples made from it.

The built-in set (data/calib.jsonl) ships with the package, so calibration never needs the network:
English prose from the Python language reference and Python code from the standard library, in
alternating records. Every HELDOUT_EVERY-th record is held out for evaluation and never calibrates.
A user file (--calib-data FILE) replaces the calibration part; evaluation stays on the built-in
held-out records, so quality numbers compare across calibration choices.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from pipeline.errors import CalibrationError
from pipeline.records import read_records

BUILTIN = "builtin"
BUILTIN_FILE = Path(__file__).parent / "data" / "calib.jsonl"
HELDOUT_EVERY = 10  # record i is held out when i % 10 == 9: about 10%, spread over prose and code
SEPARATOR = "\n\n"  # joins records before they are cut into samples


@dataclass(frozen=True)
class TextSet:
    records: tuple[str, ...]
    source: str  # "builtin", "builtin (held out)" or the file path


def split_records(records: list[str]) -> tuple[list[str], list[str]]:
    """(calibration, held out): deterministic, by position."""
    calib = [r for i, r in enumerate(records) if i % HELDOUT_EVERY != HELDOUT_EVERY - 1]
    heldout = [r for i, r in enumerate(records) if i % HELDOUT_EVERY == HELDOUT_EVERY - 1]
    return calib, heldout


def builtin_records() -> list[str]:
    return read_records(BUILTIN_FILE, "text", "built-in calibration file", error=CalibrationError, blocks=True)


def builtin_split() -> tuple[TextSet, TextSet]:
    calib, heldout = split_records(builtin_records())
    return TextSet(tuple(calib), BUILTIN), TextSet(tuple(heldout), f"{BUILTIN} (held out)")


def calibration_text(spec: str | Path) -> TextSet:
    """The calibration part of the built-in set, or every sample in a user file (.jsonl or text)."""
    if str(spec) == BUILTIN:
        return builtin_split()[0]
    path = Path(spec).expanduser()
    records = read_records(path, "text", "calibration file (--calib-data)", error=CalibrationError, blocks=True)
    return TextSet(tuple(records), str(path))


def evaluation_text() -> TextSet:
    return builtin_split()[1]


def make_samples(tokenizer, text: TextSet, num_samples: int, seq_len: int, *, what: str = "calibration"):
    """`num_samples` non-overlapping windows of `seq_len` tokens, cut from the records joined in order.

    Returns an int64 tensor [num_samples, seq_len]. Records are encoded one at a time (no special
    tokens) and only until there are enough tokens.
    """
    import torch

    if num_samples < 1 or seq_len < 2:
        raise CalibrationError(f"{what} needs at least 1 sample of at least 2 tokens "
                               f"(got {num_samples} x {seq_len}); raise the size or the sequence length")
    need = num_samples * seq_len
    ids: list[int] = []
    for record in text.records:
        ids += tokenizer(record + SEPARATOR, add_special_tokens=False).input_ids
        if len(ids) >= need:
            break
    if len(ids) < need:
        flag = "--calib-size/--calib-seq-len" if what == "calibration" else "--eval-size/--calib-seq-len"
        raise CalibrationError(
            f"{what} text ({text.source}) has {len(ids)} tokens, fewer than {num_samples} x {seq_len} = {need}; "
            f"lower {flag}" + (" or pass a longer --calib-data FILE" if what == "calibration" else ""))
    return torch.tensor(ids[:need], dtype=torch.long).view(num_samples, seq_len)
