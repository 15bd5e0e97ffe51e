"""What a TensorRT-LLM build will run, derived before any weights or checkpoints exist: for `build --dry-run`.

The quantize stages haven't written their checkpoints yet, so each is described from the model's
architecture (a preset's, or a local config.json) and the stage's settings: layout, TP, quant_algo, KV
quantization. Those descriptions go through the very functions `pipeline compile` runs
(pipeline.compiler.compiler.resolve and route_files), and the launch through `pipeline serve`'s
(pipeline.triton.launch), so a user planning a 70B deployment on a laptop reviews exactly the trtllm-build
lines, the LLM-API YAML and the server command that will run in the container. Pure.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field
from pathlib import Path

from pipeline.compiler.checkpoint import Checkpoint


@dataclass
class Preview:
    route: str  # engine | llmapi
    tensorrt_llm_version: str
    commands: dict[str, str] = field(default_factory=dict)  # name -> shell line (trtllm-build, run.py, trtllm-serve)
    files: dict[str, str] = field(default_factory=dict)  # compile's files (build.sh, the YAML) -> text
    launch: dict = field(default_factory=dict)  # pipeline.triton.launch.Launch as a dict
    serve_command: str = ""  # what `pipeline serve` runs for the repository
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return dict(self.__dict__)


def describe_checkpoint(path: Path, shape, *, layout: str, qformat: str, kv_fp8: bool, tp: int,
                        max_position_embeddings: int | None, is_eagle3: bool = False) -> Checkpoint:
    """The Checkpoint `pipeline quantize` will write at `path`, as compile would read it back."""
    from pipeline.quantize.formats import FORMATS

    fmt = FORMATS.get(qformat)
    path = Path(path) if "<" in str(path) else Path(path).absolute()  # "<llama-70b weights>": not here yet
    return Checkpoint(path=path, layout=layout, vocab_size=shape.vocab_size, dtype="bfloat16",
                      tp_size=tp if layout == "trtllm" else 1, pp_size=1,
                      max_position_embeddings=max_position_embeddings,
                      quant_algo=fmt.trtllm_algo if fmt is not None else None,
                      kv_cache_quant_algo="FP8" if kv_fp8 else None, is_eagle3=is_eagle3,
                      model_type=shape.model_type)


def preview_trtllm(compile_options, settings, target_shape, draft_shape, quant_kv: dict[str, str],
                   repo: Path) -> Preview:
    """compile_options: the compile stage's CompileOptions; quant_kv: role -> the KV dtype its quantize stage
    writes ("fp8" | "none"); target_shape/draft_shape: ModelShape (draft_shape None unless a draft model)."""
    from pipeline.compiler.compiler import route_files
    from pipeline.compiler.job import resolve
    from pipeline.triton.config import TRTLLM_DRAFT, TRTLLM_TARGET
    from pipeline.triton.launch import plan_launch
    from pipeline.triton.server import ServeOptions, ServerBinary, launch_argv, shell_line
    from pipeline.trtllm.version import CONTAINER_TRITONSERVER

    o, s = compile_options, settings
    layout = s.export
    max_pos = s.max_seq_len  # the real compile checks it against the checkpoint's max_position_embeddings
    target = describe_checkpoint(o.target, target_shape, layout=layout, qformat=s.target_qformat,
                                 kv_fp8=quant_kv.get("target") == "fp8", tp=s.tp_size, max_position_embeddings=max_pos)
    draft = o.draft  # a "<...>" placeholder for weights not written yet stays as it is (DraftSpec.path)
    draft_ckpt = None
    if draft.kind == "model":
        draft_ckpt = describe_checkpoint(draft.path, draft_shape, layout=layout, qformat=s.draft_qformat,
                                         kv_fp8=quant_kv.get("draft") == "fp8", tp=s.tp_size,
                                         max_position_embeddings=max_pos)
    elif draft.kind == "eagle3":
        draft_ckpt = describe_checkpoint(draft.path, target_shape, layout="hf", qformat="none", kv_fp8=False, tp=1,
                                         max_position_embeddings=max_pos, is_eagle3=True)
    r = resolve(o, Path(o.output).absolute(), target, draft, draft_ckpt)
    generated = route_files(r, target_shape)
    models = (TRTLLM_TARGET, TRTLLM_DRAFT) if draft.kind == "model" else (TRTLLM_TARGET,)
    launch = plan_launch(r.route, world_size=r.tp * r.pp, trtllm_models=models,
                         tensorrt_llm_version=r.tensorrt_llm_version)
    argv, env = launch_argv(ServeOptions(repo=repo), ServerBinary(Path(CONTAINER_TRITONSERVER)), None,
                            "triton_python_backend_shm_region_pipeline_", launch)
    return Preview(route=r.route.name, tensorrt_llm_version=r.tensorrt_llm_version,
                   commands={k: shlex.join(v) for k, v in generated.commands.items()}, files=generated.files,
                   launch=launch.to_dict(), serve_command=shell_line(argv, env), notes=list(generated.notes))
