"""The sizes and the gate that commands, engine folders, repositories and plans share, each declared once: the name
options objects, engine.json and config.pbtxt use, the flag, the least value it may take and what it means.

Every config that holds one checks it with `Setting.check` (one message, naming the flag or the field), and every
command's option reads the flag, bound and meaning from here (pipeline.cli.setting.setting_option); a command says
only its own default, which differs on purpose (`pipeline plan` sizes a server, `generate` one batch of prompts).
"""

from __future__ import annotations

from dataclasses import dataclass

from pipeline.errors import ConfigError, PipelineError


@dataclass(frozen=True)
class Setting:
    name: str  # the options' field, engine.json's and config.pbtxt's key
    flag: str  # its command-line spelling
    minimum: int
    meaning: str  # the first sentence of its help
    short: str | None = None

    def check(self, value: int, *, by_flag: bool = True, fix: str = "", minimum: int | None = None,
              error: type[PipelineError] = ConfigError) -> int:
        """The value, if a whole number at least `minimum` (the declared one unless a caller gives smaller values
        a meaning); else a one-line error naming the flag (by_flag) or the field, the bound, the value and `fix`."""
        least = self.minimum if minimum is None else minimum
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise error(f"{self.flag if by_flag else self.name} must be >= {least} (got {value!r})"
                        + (f"; {fix}" if fix else ""))
        return value


NUM_DRAFT_TOKENS = Setting("num_draft_tokens", "--num-draft-tokens", 1, "K: the most tokens drafted per step.", "-k")
MAX_BATCH_SIZE = Setting("max_batch_size", "--max-batch-size", 1, "Requests decoding at once.")
MAX_SEQ_LEN = Setting("max_seq_len", "--max-seq-len", 2, "Prompt + output tokens per request.")
GATE_BATCH_SIZE = Setting("gate_batch_size", "--gate-batch-size", 1,
                          "Speculate only while at most this many requests decode.")
MAX_QUEUE_SIZE = Setting("max_queue_size", "--max-queue-size", 0,
                         "Requests that may wait for a free slot; past that a request is refused at once as busy "
                         "(UNAVAILABLE, retry later) instead of queueing; 0: no bound.")
SETTINGS = (NUM_DRAFT_TOKENS, MAX_BATCH_SIZE, MAX_SEQ_LEN, GATE_BATCH_SIZE, MAX_QUEUE_SIZE)
