"""What compile needs to know about a checkpoint folder, read from its config files without loading weights.

Two layouts come out of `pipeline quantize`: a TensorRT-LLM checkpoint (config.json with "architecture"
and "mapping", plus rank{N}.safetensors) and a (unified) Hugging Face checkpoint (config.json with
"model_type", *.safetensors, maybe hf_quant_config.json).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from pipeline.draft_spec import DraftSpec
from pipeline.errors import ConfigError, DraftMismatchError, ModelFormatError, ModelNotFoundError

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")


@dataclass(frozen=True)
class Checkpoint:
    path: Path
    layout: str  # "trtllm" | "hf"
    vocab_size: int
    dtype: str  # "float16" | "bfloat16" | "float32"
    tp_size: int = 1  # from the TRT-LLM mapping; 1 for HF folders
    pp_size: int = 1
    max_position_embeddings: int | None = None
    quant_algo: str | None = None
    kv_cache_quant_algo: str | None = None  # "FP8" when the KV cache is quantized
    is_eagle3: bool = False
    model_type: str | None = None  # the Hugging Face config's (a TensorRT-LLM checkpoint names an architecture instead)

    @property
    def world_size(self) -> int:
        return self.tp_size * self.pp_size

    @property
    def has_tokenizer(self) -> bool:
        return any((self.path / f).is_file() for f in TOKENIZER_FILES)

    @property
    def qformat(self) -> str:
        """The `pipeline quantize --qformat` its quant_algo came from ("none": unquantized)."""
        from pipeline.quantize.formats import FORMATS

        by_algo = {f.trtllm_algo: name for name, f in FORMATS.items() if f.trtllm_algo}
        return by_algo.get(self.quant_algo, "none")

    def read_shape(self):
        """Its ModelShape (pipeline.models.shape), read from its config.json."""
        from pipeline.models.shape import ModelShape

        return ModelShape.from_folder(self.path)

    def describe(self) -> dict:
        """What compile.json says of it."""
        return {"path": str(self.path), "layout": self.layout, "dtype": self.dtype, "vocab_size": self.vocab_size,
                "tp_size": self.tp_size, "pp_size": self.pp_size, "quant_algo": self.quant_algo,
                "kv_cache_quant_algo": self.kv_cache_quant_algo}


def read_pair(target: str | Path, draft: DraftSpec) -> tuple[Checkpoint, DraftSpec, Checkpoint | None]:
    """The target's checkpoint, the draft and its checkpoint (a draft model or an EAGLE-3 head; None for n-gram or
    none), checked against each other."""
    if draft.kind == "eagle3" and not draft.ref:
        raise ConfigError("compile needs the head's folder: --draft eagle3:DIR (`pipeline build --draft eagle3` "
                          "finds the published head, or trains one)")
    target_ckpt = read_checkpoint(target)
    draft_ckpt = read_checkpoint(draft.path) if draft.path is not None else None
    check_draft_matches(target_ckpt, draft, draft_ckpt)
    return target_ckpt, draft, draft_ckpt


def check_draft_matches(target: Checkpoint, draft: DraftSpec, draft_ckpt: Checkpoint | None) -> None:
    """Same vocabulary (and tokenizer, where both folders carry one); same TP/PP for draft-target engines."""
    if draft_ckpt is None:
        return
    if draft.kind == "model" and draft_ckpt.is_eagle3:
        raise ConfigError(f"{draft_ckpt.path.name} is an EAGLE-3 head, not a draft model; pass "
                          f"--draft eagle3:{draft_ckpt.path}")
    if draft.kind == "eagle3" and not draft_ckpt.is_eagle3:
        raise ConfigError(f"{draft_ckpt.path.name} is not an EAGLE-3 head (its config.json names no Eagle3 "
                          f"architecture or eagle_config); pass a head folder, e.g. from `pipeline draft train`")
    fix = "pick a draft from the target's model family, or use --draft ngram"
    if draft_ckpt.vocab_size != target.vocab_size:
        raise DraftMismatchError(f"draft '{draft_ckpt.path.name}' has vocab_size {draft_ckpt.vocab_size} but the "
                                 f"target has {target.vocab_size}; {fix}")
    if draft.kind == "model" and target.has_tokenizer and draft_ckpt.has_tokenizer:
        from pipeline.models.tokenizer import check_draft_compatible

        check_draft_compatible(target.path, draft_ckpt.path)
    if draft.kind == "model" and (draft_ckpt.tp_size, draft_ckpt.pp_size) != (target.tp_size, target.pp_size):
        raise ConfigError(f"draft checkpoint is split tp {draft_ckpt.tp_size} x pp {draft_ckpt.pp_size} but the "
                          f"target tp {target.tp_size} x pp {target.pp_size}; re-export the draft with "
                          f"`pipeline quantize --export trtllm --tp-size {target.tp_size} --pp-size {target.pp_size}`")



def read_checkpoint(folder: str | Path) -> Checkpoint:
    path = Path(folder).expanduser().absolute()
    if not path.is_dir():
        raise ModelNotFoundError(f"checkpoint folder {path} does not exist; pass the -o folder of `pipeline quantize`")
    config_file = path / "config.json"
    if not config_file.is_file():
        raise ModelFormatError(f"{config_file} is missing; pass a folder written by `pipeline quantize`")
    try:
        cfg = json.loads(config_file.read_text())
    except (OSError, ValueError) as err:
        raise ModelFormatError(f"can't read {config_file} ({err}); re-export the checkpoint") from None
    if "vocab_size" not in cfg and isinstance(cfg.get("transformer_layer_config"), dict):
        # vLLM speculators' EAGLE-3 heads keep the decoder's sizes one level down.
        cfg = {**cfg, "vocab_size": cfg["transformer_layer_config"].get("vocab_size")}
    if cfg.get("vocab_size") is None:
        raise ModelFormatError(f"{config_file} has no vocab_size; is this a decoder checkpoint?")
    if "mapping" in cfg and "architecture" in cfg:
        return _trtllm(path, cfg)
    return _hf(path, cfg)


def _trtllm(path: Path, cfg: dict) -> Checkpoint:
    mapping = cfg["mapping"]
    tp, pp = int(mapping.get("tp_size", 1)), int(mapping.get("pp_size", 1))
    world = int(mapping.get("world_size", tp * pp))
    if world != tp * pp:
        raise ModelFormatError(f"{path}/config.json mapping says world_size {world} but tp_size*pp_size is "
                               f"{tp * pp}; re-export with `pipeline quantize --export trtllm`")
    missing = [f"rank{r}.safetensors" for r in range(world) if not (path / f"rank{r}.safetensors").is_file()]
    if missing:
        raise ModelFormatError(f"TensorRT-LLM checkpoint {path} lacks {', '.join(missing)}; re-export it")
    quant = cfg.get("quantization") or {}
    return Checkpoint(path=path, layout="trtllm", vocab_size=int(cfg["vocab_size"]),
                      dtype=str(cfg.get("dtype", "float16")), tp_size=tp, pp_size=pp, max_position_embeddings=cfg.get("max_position_embeddings"),
                      quant_algo=quant.get("quant_algo"), kv_cache_quant_algo=quant.get("kv_cache_quant_algo"))


def _hf(path: Path, cfg: dict) -> Checkpoint:
    arch = " ".join(cfg.get("architectures") or []).lower()
    is_eagle3 = "eagle3" in arch or "eagle_config" in cfg or cfg.get("speculators_model_type") == "eagle3"
    # The published yuhuili/EAGLE3-* heads ship a pytorch_model.bin (the engine reads it weights_only).
    if not any(path.glob("*.safetensors")) and not (is_eagle3 and (path / "pytorch_model.bin").is_file()):
        raise ModelFormatError(f"no *.safetensors in {path}; pass a folder written by `pipeline quantize`")
    quant: dict = {}
    qfile = path / "hf_quant_config.json"
    if qfile.is_file():
        quant = json.loads(qfile.read_text()).get("quantization", {})
    return Checkpoint(path=path, layout="hf", vocab_size=int(cfg["vocab_size"]),
                      dtype=str(cfg.get("dtype") or cfg.get("torch_dtype") or "float32"),
                      max_position_embeddings=cfg.get("max_position_embeddings"),
                      quant_algo=quant.get("quant_algo"), kv_cache_quant_algo=quant.get("kv_cache_quant_algo"),
                      is_eagle3=is_eagle3, model_type=cfg.get("model_type"))
