"""`pipeline draft train --method eagle3`: train an EAGLE-3 head for a target with NVIDIA ModelOpt.

1. Data: the target's own greedy answers to the prompts (self-distillation), generated with this
   project's engine; every 10th prompt is held out.
2. Features: one target forward per sequence captures the aux layers' outputs and the final pre-norm
   state; they are cached, so epochs (and a resumed run) never rerun the target.
3. Training: ModelOpt's EAGLE-3 (modelopt.torch.speculative) in offline mode, which drops the base
   layers and trains the head on the cached states with its training-time-test unrolling. The head is
   sized from the target (one layer, the target's hidden size, heads and intermediate size).
4. Export: ModelOpt's export_speculative_decoding into the output folder (staged, then renamed),
   plus train_report.json with acceptance on the held-out prompts.

Everything lives in a work folder under $PIPELINE_HOME/draft-train/, keyed by target and settings:
answers, features, and a checkpoint after every epoch (and every CHECKPOINT_EVERY_S seconds), so an
interrupted run resumes where it stopped.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import json
import math
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from pipeline.errors import ConfigError, MissingDependencyError, PipelineError

METHODS = ("eagle3",)
CHECKPOINT_EVERY_S = 60.0
EXPORT_RESERVE_S = 5.0  # left in the budget for export + report
# On a loaded 2-core box the target's answers and hidden states can eat the whole budget; these caps
# keep at least half of it for training. A rerun with the same settings adds more data.
ANSWER_SHARE = 0.3  # answers stop being generated after this share of the budget
FEATURE_DEADLINE = 0.5  # hidden states stop being computed after this share
ANSWER_BATCH = 16


class DraftTrainError(PipelineError):
    """A draft head can't be trained: bad options, an output in the way, ModelOpt missing."""


@dataclass(frozen=True)
class TrainOptions:
    target: str
    output: Path
    method: str = "eagle3"
    data: str = "builtin"
    budget_minutes: float = 10.0  # the whole command: answers, features, training, export
    draft_vocab_size: int | None = None  # default: min(target vocab, 8192)
    max_new_tokens: int = 128  # answer length per prompt
    max_epochs: int = 50
    batch_size: int = 4
    learning_rate: float = 1e-3
    seed: int = 0
    eval_tokens: int = 64  # new tokens per held-out prompt when measuring acceptance
    text_samples: int = 128  # plus this many 256-token samples of built-in text (0: answers only)
    force: bool = False
    progress: bool = True

    def validate(self) -> None:
        if self.method not in METHODS:
            raise ConfigError(f"unknown --method {self.method!r}; supported: {', '.join(METHODS)}")
        if self.budget_minutes <= 0:
            raise ConfigError("--budget-minutes must be > 0")
        if self.max_new_tokens < 2 or self.batch_size < 1 or self.max_epochs < 1:
            raise ConfigError("--max-new-tokens must be >= 2, batch size and epochs >= 1")


@dataclass
class TrainResult:
    output: str
    target: str
    method: str
    work_dir: str
    train_prompts: int
    heldout_prompts: int
    train_tokens: int
    draft_vocab_size: int
    aux_layers: list[int]
    text_samples: int
    head: dict
    epochs: float
    steps: int
    resumed_from_step: int
    train_seconds: float
    total_seconds: float
    budget_minutes: float
    stopped_by: str  # "epochs" | "budget"
    final_loss: float | None
    train_acc: list[float]
    acceptance: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)


def _work_dir(target: Path, opts: TrainOptions, prompts: list[str]) -> Path:
    from pipeline.home import pipeline_home

    key = json.dumps([str(target), prompts, opts.max_new_tokens, opts.draft_vocab_size, opts.batch_size,
                      opts.learning_rate, opts.seed, opts.method])
    return pipeline_home() / "draft-train" / hashlib.sha256(key.encode()).hexdigest()[:16]


def _bar(total: int, desc: str, enabled: bool):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, disable=not enabled, file=sys.stderr, dynamic_ncols=True, leave=True)


def _save(obj, path: Path) -> None:
    tmp = path.with_suffix(".tmp")
    torch.save(obj, tmp)
    tmp.replace(path)  # a checkpoint is whole or absent


def head_architecture(target_cfg: dict, draft_vocab_size: int) -> dict:
    """ModelOpt's eagle_architecture_config, sized from the target (its default is 8B-sized)."""
    from pipeline.engine.config import ModelConfig

    mc = ModelConfig.from_hf_dict(target_cfg)
    return {
        "hidden_size": mc.hidden_size, "num_attention_heads": mc.num_heads, "num_key_value_heads": mc.num_kv_heads,
        "head_dim": mc.head_dim, "intermediate_size": mc.intermediate_size, "num_hidden_layers": 1,
        "rms_norm_eps": mc.rms_norm_eps, "draft_vocab_size": draft_vocab_size,
        # ModelOpt's draft rope_theta defaults to 10000 whatever the target uses; follow the target.
        # transformers 5 reads it from rope_scaling (rope_parameters), 4.x from the top level: set both.
        "rope_theta": mc.rope_theta, "rope_scaling": {"rope_type": "default", "rope_theta": mc.rope_theta},
        "max_position_embeddings": mc.max_position_embeddings,
    }


def _modelopt_eagle(target: Path, arch: dict, d2t: torch.Tensor):
    try:
        import modelopt.torch.speculative as mtsp
        from modelopt.torch.speculative.config import EAGLE3_DEFAULT_CFG
        from transformers import AutoModelForCausalLM
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
    except ImportError as err:
        raise MissingDependencyError(f"training a draft head needs nvidia-modelopt and transformers ({err}); "
                                     f"pip install nvidia-modelopt transformers accelerate") from None
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32)
    if not getattr(model.config, "architectures", None):
        model.config.architectures = [type(model).__name__]
    cfg = copy.deepcopy(EAGLE3_DEFAULT_CFG["config"])
    cfg["eagle_architecture_config"].update(arch)
    # On CPU torch.compile makes the first step take minutes; a yarn rope_scaling is injected into the
    # export unless this is empty. Offline: train on cached target states, base layers dropped.
    cfg.update(eagle_use_torch_compile=False, eagle_export_rope_scaling={}, eagle_offline=True)
    mtsp.convert(model, [("eagle", cfg)])
    em = model.eagle_module
    # ModelOpt 0.47 builds this lazily with a `device=` argument transformers 5 no longer takes.
    em.rotary_emb = LlamaRotaryEmbedding(config=em.config)
    hd = arch["head_dim"]
    if not torch.allclose(em.rotary_emb.inv_freq[1:2].double(), torch.tensor([arch["rope_theta"] ** (-2 / hd)]).double()):
        raise DraftTrainError("ModelOpt built the head's rope with another rope_theta than the target's; "
                              "this ModelOpt/transformers pair is not supported")
    with torch.no_grad():
        if hasattr(em, "d2t"):
            em.d2t.copy_(d2t)
        # Start the head's output side as the target's own: its final norm, and the lm_head rows of
        # the draft vocabulary. The head then first has to learn to predict the target's next final
        # state, which a few hundred CPU steps can start to do; from random it learns token statistics.
        ids = torch.arange(len(d2t)) + d2t
        if hasattr(em, "lm_head"):  # absent when the draft vocabulary is the target's whole vocabulary
            em.lm_head.weight.copy_(model.get_output_embeddings().weight[ids])
        norm = model._base_model_norm if hasattr(model, "_base_model_norm") else None
        if norm is not None and hasattr(em, "norm"):
            em.norm.weight.copy_(norm.weight)
    return model


def _batches(n: int, batch_size: int, epoch: int, seed: int) -> list[list[int]]:
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed * 1000 + epoch)).tolist()
    return [order[i:i + batch_size] for i in range(0, n, batch_size)]


def _collate(items: list[tuple[list[int], dict]]) -> dict:
    T = max(len(s) for s, _ in items)
    B = len(items)
    ids = torch.zeros(B, T, dtype=torch.long)
    mask = torch.zeros(B, T, dtype=torch.long)
    A, H = items[0][1]["aux"].shape[-1], items[0][1]["final"].shape[-1]
    aux, final = torch.zeros(B, T, A), torch.zeros(B, T, H)
    for i, (s, f) in enumerate(items):
        n = len(s)
        ids[i, :n], mask[i, :n] = torch.tensor(s), 1
        aux[i, :n], final[i, :n] = f["aux"].float(), f["final"].float()
    return {"input_ids": ids, "attention_mask": mask, "loss_mask": mask,
            "base_model_outputs": {"aux_hidden_states": aux, "base_model_hidden_states": final,
                                   "base_hidden_prenorm": True}}


def train_draft(opts: TrainOptions) -> TrainResult:
    # ModelOpt reports its progress with print(); keep stdout for our own result (--json). Gradients on
    # whatever mode an earlier caller in this process left (a quantize run turns them off).
    with contextlib.redirect_stdout(sys.stderr), torch.enable_grad():
        return _train_draft(opts)


def _train_draft(opts: TrainOptions) -> TrainResult:
    from pipeline.draft.data import draft_vocab, generate_answers, load_prompts, split_prompts, target_features
    from pipeline.engine.config import ModelConfig
    from pipeline.engine.eagle3 import default_aux_layer_ids
    from pipeline.engine.llm_engine import LLMEngine
    from pipeline.models.resolve import resolve_model
    from pipeline.models.tokenizer import encode_prompt, load_tokenizer, stop_token_ids
    from pipeline.staging import check_output, staged_output

    t_start = time.monotonic()
    deadline = t_start + opts.budget_minutes * 60
    opts.validate()
    check_output(opts.output, opts.force, DraftTrainError, "-o")
    target = resolve_model(opts.target).path
    target_cfg = json.loads((target / "config.json").read_text())
    mc = ModelConfig.from_hf_dict(target_cfg)
    prompts = load_prompts(opts.data)
    train_p, held_p = split_prompts(prompts)
    dv = opts.draft_vocab_size or min(mc.vocab_size, 8192)
    if not 1 <= dv <= mc.vocab_size:
        raise ConfigError(f"--draft-vocab-size must be between 1 and the target's vocabulary ({mc.vocab_size})")
    work = _work_dir(target, opts, prompts)
    work.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(opts.seed)

    tok = load_tokenizer(target)
    stops = stop_token_ids(tok, mc.eos_token_ids)
    aux_layers = default_aux_layer_ids(mc.num_layers)

    # 1-2. answers and features, cached in the work folder batch by batch: answers may take at most
    # ANSWER_SHARE of the budget (on a loaded 2-core box they can eat all of it), and a rerun
    # continues where this one stopped.
    ans_file, feat_file = work / "answers.pt", work / "features.pt"
    seqs: list[list[int]] = torch.load(ans_file) if ans_file.is_file() else []
    if len(seqs) < len(train_p):
        ids = [encode_prompt(tok, p, raw=False) for p in train_p]
        max_len = max(len(i) for i in ids) + opts.max_new_tokens + 1
        engine = LLMEngine(*_load_target(target, max_len), eos_token_ids=stops)
        answer_deadline = t_start + ANSWER_SHARE * opts.budget_minutes * 60
        with _bar(len(ids), "answers (target)", opts.progress) as bar:
            bar.update(len(seqs))
            while len(seqs) < len(ids) and (not seqs or time.monotonic() < answer_deadline):
                chunk = ids[len(seqs):len(seqs) + ANSWER_BATCH]
                seqs += generate_answers(engine, chunk, opts.max_new_tokens, batch_size=ANSWER_BATCH)
                _save(seqs, ans_file)
                bar.update(len(chunk))
        del engine
    feats: list = torch.load(feat_file) if feat_file.is_file() else []
    if len(feats) < len(seqs):
        model, _ = _load_target(target, max(len(s) for s in seqs) + 1)
        feature_deadline = t_start + FEATURE_DEADLINE * opts.budget_minutes * 60
        with _bar(len(seqs) - len(feats), "target hidden states", opts.progress) as bar:
            for i in range(len(feats), len(seqs), ANSWER_BATCH):
                if feats and time.monotonic() > feature_deadline:
                    break
                feats += target_features(model, seqs[i:i + ANSWER_BATCH], aux_layers, on_seq=bar.update)
                _save(feats, feat_file)
        del model
    seqs = seqs[:len(feats)]
    if opts.text_samples:
        # Built-in text, distilled on the target's soft labels: many positions for one prefill each.
        # Its features are cached apart, so the answers' cache stays valid for any --text-samples.
        text_file = work / f"text-{opts.text_samples}.pt"
        if not text_file.is_file():
            from pipeline.draft.data import text_samples

            texts = text_samples(tok, opts.text_samples)
            model, _ = _load_target(target, max(len(t) for t in texts) + 1)
            with _bar(len(texts), "target hidden states (text)", opts.progress) as bar:
                _save((texts, target_features(model, texts, aux_layers, on_seq=bar.update)), text_file)
            del model
        texts, text_feats = torch.load(text_file)
        seqs, feats = seqs + texts, feats + text_feats

    # 3. train with ModelOpt.
    # The draft vocabulary is fixed when training first starts, so a resumed run (maybe with more
    # answers by then) keeps the head's output rows meaning the same tokens.
    vocab_file = work / "d2t.pt"
    if not vocab_file.is_file():
        _save(draft_vocab(seqs, mc.vocab_size, dv), vocab_file)
    d2t = torch.load(vocab_file)
    arch = head_architecture(target_cfg, dv)
    model = _modelopt_eagle(target, arch, d2t)
    if tuple(model.eagle_config.eagle_aux_hidden_state_layer_ids) != aux_layers:
        raise DraftTrainError(f"ModelOpt picked aux layers {model.eagle_config.eagle_aux_hidden_state_layer_ids}, "
                              f"the engine {list(aux_layers)}; set eagle_aux_hidden_state_layer_ids explicitly")
    params = [p for p in model.eagle_module.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=opts.learning_rate, weight_decay=0.0)
    ckpt_file = work / "checkpoint.pt"
    step = epoch = in_epoch = 0  # in_epoch: batches of the current epoch already trained
    train_s = 0.0
    if ckpt_file.is_file():
        ck = torch.load(ckpt_file)
        model.eagle_module.load_state_dict(ck["head"])
        opt.load_state_dict(ck["optimizer"])
        step, epoch, train_s = ck["step"], ck["epoch"], ck["train_seconds"]
        # Same data: continue the epoch; more data since (a rerun added answers): start a new one.
        in_epoch = ck.get("in_epoch", 0) if ck.get("num_seqs") == len(seqs) else 0
    resumed_from = step
    per_epoch = math.ceil(len(seqs) / opts.batch_size)
    warmup = 20
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warmup), last_epoch=-1)
    for _ in range(step):
        sched.step()

    def checkpoint():
        _save({"head": model.eagle_module.state_dict(), "optimizer": opt.state_dict(), "step": step,
               "epoch": epoch, "in_epoch": in_epoch, "num_seqs": len(seqs), "train_seconds": train_s}, ckpt_file)

    model.train()
    loss_v, accs, stopped_by = None, [], "epochs"
    bar_start = epoch * per_epoch + in_epoch
    last_ck = time.monotonic()
    step_s = None
    with _bar(opts.max_epochs * per_epoch, "train eagle3 head", opts.progress) as bar:
        bar.update(bar_start)
        while epoch < opts.max_epochs:
            batches = _batches(len(seqs), opts.batch_size, epoch, opts.seed)
            for b in batches[in_epoch:]:
                reserve = EXPORT_RESERVE_S + (step_s or 0.0)
                if time.monotonic() + reserve > deadline:
                    stopped_by = "budget"
                    break
                t0 = time.monotonic()
                # ModelOpt caches its training-time-test masks per step index only, assuming one
                # sequence length for the whole run; our batches vary, so rebuild them per batch.
                model._cached_attn_blk_masks = {}
                out = model(**_collate([(seqs[i], feats[i]) for i in b]))
                out.loss.backward()
                torch.nn.utils.clip_grad_norm_(params, 1.0)
                opt.step()
                sched.step()
                opt.zero_grad(set_to_none=True)
                dt = time.monotonic() - t0
                step_s = dt if step_s is None else 0.8 * step_s + 0.2 * dt
                train_s += dt
                step += 1
                in_epoch += 1
                loss_v, accs = float(out.loss), [round(float(a), 4) for a in out.train_acc[0]]
                left = max(0.0, deadline - time.monotonic() - EXPORT_RESERVE_S)
                # The bar's total (and so its ETA) is what the budget allows, not max_epochs' steps.
                done = epoch * per_epoch + in_epoch
                bar.total = min(opts.max_epochs * per_epoch, done + int(left / step_s))
                bar.set_postfix(loss=f"{loss_v:.3f}", acc=accs[0] if accs else None, budget_left=f"{left:.0f}s")
                bar.update(1)
                if time.monotonic() - last_ck > CHECKPOINT_EVERY_S:
                    checkpoint()
                    last_ck = time.monotonic()
            else:
                epoch, in_epoch = epoch + 1, 0
                checkpoint()
                last_ck = time.monotonic()
                continue
            break
    checkpoint()

    # 4. export (staged), then measure acceptance on the held-out prompts.
    from modelopt.torch.export import export_speculative_decoding

    model.eval()
    held_ids = [encode_prompt(tok, p, raw=False) for p in held_p]
    with staged_output(opts.output, opts.force, DraftTrainError, "-o") as stage:
        export_speculative_decoding(model, export_dir=stage)
        _fix_export_config(stage, arch)
        from pipeline.draft.report import measure_acceptance

        acceptance = measure_acceptance(target, stage, held_ids, ks=(6,), max_new_tokens=opts.eval_tokens,
                                        eos_token_ids=stops)
        result = TrainResult(
            output=str(opts.output), target=str(target), method=opts.method, work_dir=str(work),
            train_prompts=len(train_p), heldout_prompts=len(held_p), train_tokens=sum(len(s) for s in seqs),
            draft_vocab_size=dv, aux_layers=list(aux_layers),
            head={k: arch[k] for k in ("hidden_size", "num_attention_heads", "num_key_value_heads",
                                       "intermediate_size", "num_hidden_layers")},
            text_samples=opts.text_samples,
            epochs=round(epoch + in_epoch / per_epoch, 2), steps=step, resumed_from_step=resumed_from,
            train_seconds=round(train_s, 1), total_seconds=round(time.monotonic() - t_start, 1),
            budget_minutes=opts.budget_minutes, stopped_by=stopped_by, final_loss=loss_v, train_acc=accs,
            acceptance=acceptance)
        (stage / "train_report.json").write_text(json.dumps(result.to_dict(), indent=2) + "\n")
    return result


def _fix_export_config(folder: Path, arch: dict) -> None:
    """ModelOpt's export writes the template's rope_theta for the head; record the one it was trained with."""
    path = folder / "config.json"
    cfg = json.loads(path.read_text())
    cfg["rope_theta"] = arch["rope_theta"]
    if isinstance(cfg.get("rope_scaling"), dict):
        cfg["rope_scaling"]["rope_theta"] = arch["rope_theta"]
    path.write_text(json.dumps(cfg, indent=2) + "\n")


def _load_target(target: Path, max_seq_len: int):
    """The target as the engine runs it by default (bf16): the answers are then the ones a user gets,
    and bf16 costs about half of fp32 per step on this CPU class."""
    from pipeline.engine.config import EngineConfig, GatePolicy
    from pipeline.engine.weights import load_transformer

    config = EngineConfig(max_batch_size=ANSWER_BATCH, max_seq_len=max_seq_len, dtype="bf16",
                          gate=GatePolicy(min_tokens=0))
    return load_transformer(target, max_seq_len, torch.bfloat16), config
