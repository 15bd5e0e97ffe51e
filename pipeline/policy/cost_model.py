"""What a decode step costs on the machine that serves: the table the per-request draft planner reads.

A step is one target forward over the running batch, each row fed its pending token plus its drafts,
padded to the widest row. So its time is a function of the decoding rows B and the width W = k + 1. At
small B that forward is bound by memory bandwidth and W barely matters; at large B it is compute-bound
and the time grows with B * W. The proposer adds its own time, which grows with the drafted length.

Both are measured (pipeline/engine/calibrate.py) on a grid of B and every W up to K + 1, and read back
here by linear interpolation in B (extrapolated from the last two points past the grid). Pure: no torch,
so the Triton models and configs can read it too.

The grid is timed with every row attending to a short context. A row's attention grows with its own
context (on 2 cores, bf16, SmolLM2-135M: three rows at 1000 cached tokens step in 20.6 ms, at 16 in
10.8), so the model also carries what each cached token past that context adds to a one-token row
(`context_token_s`). The fair share of a step (LLMEngine._fair_rows) reads it: a client's many choices
grow long while another client's short requests come and go.
"""

from __future__ import annotations

import bisect
import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

from pipeline.errors import ConfigError

FILENAME = "cost_model.json"
FORMAT = 1
DEFAULT_SOURCE = "default (not measured)"


@dataclass(frozen=True)
class CostModel:
    rows: tuple[int, ...]  # decoding rows B, ascending, from 1
    widths: tuple[int, ...]  # tokens per row W: every width 1..K+1
    target_s: tuple[tuple[float, ...], ...]  # target_s[i][j]: one forward at rows[i] x widths[j]
    draft_fixed_s: tuple[float, ...]  # per rows[i]: a proposal's cost that doesn't grow with k
    draft_per_token_s: tuple[float, ...]  # per rows[i]: what each drafted position adds
    proposer: str = ""  # the draft kind the proposal costs were measured with
    source: str = ""  # where the numbers come from: "measured on ...", or "default"
    context: int = 0  # the cached tokens each row attended to while target_s was timed
    context_token_s: float = 0.0  # what each cached token past `context` adds to a one-token row's step

    def __post_init__(self):
        n = len(self.rows)
        if not n or list(self.rows) != sorted(set(self.rows)) or self.rows[0] < 1:
            raise ConfigError("cost model rows must be distinct, ascending and >= 1")
        if list(self.widths) != list(range(1, len(self.widths) + 1)):
            raise ConfigError("cost model widths must be 1, 2, ..., K+1")
        if len(self.target_s) != n or any(len(r) != len(self.widths) for r in self.target_s):
            raise ConfigError("cost model target_s must have one row per batch size and one column per width")
        if len(self.draft_fixed_s) != n or len(self.draft_per_token_s) != n:
            raise ConfigError("cost model draft costs must have one entry per batch size")
        values = [v for r in self.target_s for v in r] + [*self.draft_fixed_s, *self.draft_per_token_s]
        if any(not (v >= 0.0 and v < float("inf")) for v in values + [self.context_token_s]):
            raise ConfigError("cost model times must be finite and >= 0")
        if self.context < 0:
            raise ConfigError("cost model context must be >= 0")

    @property
    def measured(self) -> bool:
        """False for the rule of thumb an engine falls back on (default_cost_model)."""
        return not self.source.startswith(DEFAULT_SOURCE)

    @property
    def max_drafts(self) -> int:
        return len(self.widths) - 1

    def step_s(self, rows: int, width: int) -> float:
        """One target forward over `rows` decoding rows, each `width` tokens wide."""
        if rows <= 0:
            return 0.0
        j = min(max(width, 1), len(self.widths)) - 1
        return _interpolate(self.rows, [r[j] for r in self.target_s], rows)

    def context_s(self, contexts) -> float:
        """What one-token rows attending to `contexts` cached tokens (one length a row) add to step_s, which was
        timed at `context` tokens a row."""
        return self.context_token_s * sum(max(0, c - self.context) for c in contexts)

    def decode_s(self, contexts: list[int]) -> float:
        """One decode step of one-token rows attending to `contexts` cached tokens (one length a row)."""
        return self.step_s(len(contexts), 1) + self.context_s(contexts)

    def draft_s(self, rows: int, k: int) -> float:
        """One proposal of k tokens for each of `rows` rows."""
        if rows <= 0 or k <= 0:
            return 0.0
        return (_interpolate(self.rows, self.draft_fixed_s, rows)
                + k * _interpolate(self.rows, self.draft_per_token_s, rows))

    # ---- files -----------------------------------------------------------------------------------

    def to_json(self) -> dict:
        return {"format": FORMAT, **asdict(self)}

    @classmethod
    def from_json(cls, data: dict) -> CostModel:
        if data.get("format") != FORMAT:
            raise ConfigError(f"cost model format {data.get('format')!r} is not {FORMAT}; run the calibration again")
        try:
            return cls(rows=tuple(int(x) for x in data["rows"]), widths=tuple(int(x) for x in data["widths"]),
                       target_s=tuple(tuple(float(v) for v in r) for r in data["target_s"]),
                       draft_fixed_s=tuple(float(v) for v in data["draft_fixed_s"]),
                       draft_per_token_s=tuple(float(v) for v in data["draft_per_token_s"]),
                       proposer=str(data.get("proposer", "")), source=str(data.get("source", "")),
                       # absent from files written before the context term: the table alone, as then
                       context=int(data.get("context", 0)),
                       context_token_s=float(data.get("context_token_s", 0.0)))
        except (KeyError, TypeError, ValueError) as err:
            raise ConfigError(f"cost model is malformed ({err}); run the calibration again") from None

    def save(self, folder: str | Path) -> Path:
        """Written whole: a temp file renamed over the old one, so a reader never sees half a file."""
        path = Path(folder) / FILENAME
        tmp = path.with_name(f".{FILENAME}.tmp")
        tmp.write_text(json.dumps(self.to_json(), indent=1) + "\n")
        os.replace(tmp, path)
        return path

    @classmethod
    def load(cls, folder: str | Path) -> CostModel | None:
        """The folder's measured model, or None when it has none."""
        path = Path(folder) / FILENAME
        if not path.is_file():
            return None
        try:
            data = json.loads(path.read_text())
        except ValueError as err:
            raise ConfigError(f"{path} is not JSON ({err}); run the calibration again") from None
        return cls.from_json(data)


def default_cost_model(max_drafts: int, max_rows: int = 64, proposer: str = "") -> CostModel:
    """The design card's rule of thumb, for an engine nobody measured: a forward costs a fixed part
    (reading the weights) plus a part that grows with the tokens it computes, equal at 32 tokens. A
    proposal by a model (a draft model, an EAGLE-3 head) costs a tenth of a one-row forward plus a fiftieth
    per row and token; an n-gram lookup, a two-hundredth per row. Measure instead: the build's calibration
    (`pipeline compile --calibrate`)."""
    rows = tuple(r for r in (1, 2, 4, 8, 16, 32, 64, 128) if r <= max(max_rows, 1)) or (1,)
    widths = tuple(range(1, max_drafts + 2))
    target = tuple(tuple(1.0 + r * w / 32.0 for w in widths) for r in rows)
    if proposer == "ngram":
        fixed, per_token = tuple(0.005 * r for r in rows), tuple(0.0 for _ in rows)
    else:
        fixed, per_token = tuple(0.1 for _ in rows), tuple(0.02 * r for r in rows)
    return CostModel(rows, widths, target, fixed, per_token, proposer=proposer, source=DEFAULT_SOURCE)


def gpu_profile(weight_bytes_per_gpu: float, params: float, tp: int, bandwidth_tb_s: float, tflops: float, *,
                max_drafts: int = 4, max_rows: int = 128, bandwidth_efficiency: float = 0.8,
                compute_efficiency: float = 0.5, overhead_s: float = 0.002) -> CostModel:
    """A roofline step time for a GPU nobody measured here: the weight reads of one GPU at a share of its
    bandwidth, or 2 x params FLOPs per token over tp GPUs at a share of their dense peak, whichever is longer,
    plus a fixed launch overhead. The same table `pipeline bench` measures, so both feed the simulation."""
    rows = tuple(r for r in (1, 2, 4, 8, 16, 32, 64, 128) if r <= max_rows)
    widths = tuple(range(1, max_drafts + 2))
    memory_s = weight_bytes_per_gpu / (bandwidth_tb_s * 1e12 * bandwidth_efficiency)

    def step(tokens: int) -> float:
        return max(memory_s, 2 * params * tokens / (tp * tflops * 1e12 * compute_efficiency)) + overhead_s

    target = tuple(tuple(step(r * w) for w in widths) for r in rows)
    zeros = tuple(0.0 for _ in rows)  # an EAGLE-3 head's cost rides inside the target's step on TensorRT-LLM
    return CostModel(rows, widths, target, zeros, zeros, proposer="eagle3", source="roofline profile (not measured)")


def _interpolate(xs: tuple[int, ...], ys: list[float] | tuple[float, ...], x: float) -> float:
    """Piecewise linear through (xs, ys); past either end, the line through the two nearest points
    (held at or above 0)."""
    if len(xs) == 1:
        return ys[0] * x / xs[0]  # one point: proportional to the rows
    i = bisect.bisect_left(xs, x)
    i = min(max(i, 1), len(xs) - 1)
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    return max(0.0, y0 + (y1 - y0) * (x - x0) / (x1 - x0))
