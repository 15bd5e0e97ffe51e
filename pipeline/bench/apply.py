"""`pipeline bench --apply`: write what the bench measured where the server reads it.

- the fitted gate ceiling into a repository's speculation_gate (gate_max_batch_size, and its hysteresis by
  the usual rule), read at the server's next start;
- the cost model measured for the bench's largest concurrency into the engine folder (cost_model.json),
  which the engine reads at load, and the fitted ceiling into its engine.json (gate_batch_size), which
  `pipeline generate --model ENGINE` runs under (a served engine leaves load to the repository's gate).
Each file is written whole (a temp file renamed over it). A later `pipeline build` rewrites both from its
own flags, so the closing line says which flag keeps the ceiling.
"""

from __future__ import annotations

import os
from pathlib import Path

from pipeline.errors import ConfigError
from pipeline.policy.cost_model import FILENAME, CostModel


def apply_threshold(repo: Path, threshold: int) -> str:
    from pipeline.policy.gate_policy import default_hysteresis
    from pipeline.triton.config import CONFIG_FILE, GATE, config_text, read_config

    gate_dir = Path(repo) / GATE
    if not (gate_dir / CONFIG_FILE).is_file():
        raise ConfigError(f"{repo} has no {GATE} model (an LLM-API repository gates inside TensorRT-LLM); set "
                          f"--gate-batch-size {threshold} when compiling it instead")
    msg = read_config(gate_dir)
    old = msg.parameters["gate_max_batch_size"].string_value
    msg.parameters["gate_max_batch_size"].string_value = str(threshold)
    msg.parameters["gate_hysteresis"].string_value = str(default_hysteresis(threshold))
    _write_whole(gate_dir / CONFIG_FILE, config_text(msg))
    return f"{gate_dir / CONFIG_FILE}: gate_max_batch_size {old} -> {threshold} (restart the server to use it)"


def apply_engine_threshold(engine_dir: Path, threshold: int) -> str:
    from pipeline.engine.folder import read_engine_manifest, write_engine_manifest

    manifest = read_engine_manifest(engine_dir)
    old = manifest.get("gate_batch_size")
    manifest["gate_batch_size"] = threshold
    return f"{write_engine_manifest(engine_dir, manifest)}: gate_batch_size {old} -> {threshold}"


def apply_cost_model(engine_dir: Path, cost: CostModel) -> str:
    cost.save(Path(engine_dir))
    return f"{Path(engine_dir) / FILENAME}: cost model for up to {cost.rows[-1]} rows ({cost.source})"


def _write_whole(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
