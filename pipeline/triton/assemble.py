"""`pipeline assemble`: a portable engine folder -> a Triton model repository that serves it.

Every config.pbtxt comes from `pipeline.triton.config` (one function per model, from one RepoSpec);
every python model's source is copied from `pipeline/triton/models/`. The repository is written in a
staging folder beside the target and renamed into place, so a failed run leaves nothing half-written.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass, field
from pathlib import Path

from pipeline.engine.gate_policy import GatePolicy
from pipeline.errors import ConfigError
from pipeline.staging import check_output, staged_output
from pipeline.triton.config import (GATE, POSTPROCESSING, PREPROCESSING, TORCH_ENGINE, RepoSpec, repository_configs,
                                    write_config)

MODEL_SOURCES = Path(__file__).parent / "models"
# model name -> its source in pipeline/triton/models/
PYTHON_MODELS = {PREPROCESSING: "preprocessing.py", POSTPROCESSING: "postprocessing.py",
                 GATE: "speculation_gate.py", TORCH_ENGINE: "torch_engine.py"}


@dataclass(frozen=True)
class AssembleOptions:
    engine: Path  # a `pipeline compile --backend torch` folder
    repo: Path = Path("triton_repo")
    gate_batch_size: int = 32  # speculate while at most this many requests are in flight
    gate_hysteresis: int = 4
    min_spec_tokens: int = 50  # requests asking for fewer new tokens never speculate
    acceptance_floor: float = 0.5  # auto requests stop speculating while the rolling acceptance is below; 0 = off
    force: bool = False


@dataclass
class AssembleResult:
    repo: str
    engine: str
    models: list[str] = field(default_factory=list)


def repo_spec(options: AssembleOptions) -> RepoSpec:
    """The RepoSpec for a portable engine folder: sizes from its engine.json, the gate from the options."""
    from pipeline.compile.torch_engine import read_engine_manifest

    engine = Path(options.engine).expanduser().absolute()
    manifest = read_engine_manifest(engine)
    gate = GatePolicy(max_batch_size=options.gate_batch_size,
                      hysteresis=min(options.gate_hysteresis, max(options.gate_batch_size, 0)),
                      min_tokens=options.min_spec_tokens)
    return RepoSpec(backend="torch", tokenizer_dir=str(engine / manifest["tokenizer"]), engine_dir=str(engine),
                    max_batch_size=manifest["max_batch_size"], max_seq_len=manifest["max_seq_len"],
                    num_draft_tokens=max(1, manifest["num_draft_tokens"]), gate=gate,
                    acceptance_floor=options.acceptance_floor)


def write_repository(folder: Path, spec: RepoSpec) -> list[str]:
    """Write every model (config.pbtxt, and 1/model.py for python ones) under `folder`; returns the names."""
    configs = repository_configs(spec)
    for name, msg in configs.items():
        write_config(folder / name, msg)
        (folder / name / "1").mkdir()
        if name in PYTHON_MODELS:
            shutil.copyfile(MODEL_SOURCES / PYTHON_MODELS[name], folder / name / "1" / "model.py")
    return sorted(configs)


def assemble(options: AssembleOptions) -> AssembleResult:
    repo = Path(options.repo).expanduser().absolute()
    check_output(repo, options.force, ConfigError, "--repo")
    spec = repo_spec(options)
    with staged_output(repo, options.force, ConfigError, "--repo") as stage:
        models = write_repository(stage, spec)
    return AssembleResult(repo=str(repo), engine=spec.engine_dir, models=models)
