"""`pipeline draft train --method eagle3`: train an EAGLE-3 head for a target with NVIDIA ModelOpt.

1. Data: the target's own answers to the prompts (self-distillation), generated with this project's
   engine; every 10th prompt is held out.
2. Features: the aux layers' outputs and the final pre-norm state of every token, recorded by the engine
   while it generates the answers (data.StateRecorder), and from one target forward per sample of the
   built-in text; they are cached, so epochs (and a resumed run) never rerun the target.
3. Training: ModelOpt's EAGLE-3 (modelopt.torch.speculative) in offline mode, which drops the base
   layers and trains the head on the cached states with its training-time-test unrolling. The head is
   sized from the target (one layer, the target's hidden size, heads and intermediate size) and starts as the
   target's last layer, final norm and lm_head rows. Steps run in bf16 autocast where this CPU multiplies bf16
   faster than fp32 (train_precision), at a learning rate that falls to LR_FLOOR by the end of the run.
4. Export: ModelOpt's export_speculative_decoding into the output folder (staged, then renamed),
   plus train_report.json with acceptance on the held-out prompts.

The budget (--budget-minutes) is the whole run's wall time; pipeline.draft.budget splits it into phases
so training always gets at least half. A run that can't train MIN_TRAIN_STEPS steps in it fails with one
line and exports nothing.

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
import os
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from pipeline.draft import budget
from pipeline.errors import ConfigError, MissingDependencyError, PipelineError

if TYPE_CHECKING:
    from pipeline.draft.budget import PhasePlan
    from pipeline.models.families import Features

METHODS = ("eagle3",)
CHECKPOINT_EVERY_S = 60.0
ANSWER_BATCH = 32  # answers decoding at once: 16% more tokens/s than 16 on 2 cores (SmolLM2, bf16)
ANSWER_CHUNK = 128  # prompts per in-flight batch, saved after each (so a rerun resumes there)
# Answers per training prompt: the first greedy, the others sampled at ANSWER_TEMPERATURE (each request its own
# seed), as many rounds as the answer phase's share of the budget allows, up to MAX_ANSWER_ROUNDS. A 10-minute head
# trained on one answer a prompt ran 15 epochs in bf16 and fit its training text (first-draft accuracy 0.64) far
# better than held-out prompts (0.44): more of the target's own text, not more steps, is what it lacked. At 8 rounds
# a 60-minute run ran out of answers in its first 7 minutes and trained 16 epochs on them; the states of 24 rounds
# of SmolLM2's answers fit FEATURE_MEMORY_BYTES.
MAX_ANSWER_ROUNDS = 24
ANSWER_TEMPERATURE = 0.8
# The cached hidden states are held in memory while training: the automatic answers stop where more would take
# them past this (SmolLM2: about 0.84 MB an answer, so about 5,100, more than 24 rounds of the built-in prompts; a
# Llama-3.1-8B target: about 6 MB, so about 720, 3.5 rounds). A --data set larger than that stops partway through.
FEATURE_MEMORY_BYTES = 4 << 30
# And at one sampled round per this many minutes of budget: a short run's data phase then ends early and leaves
# training its time (a 0.4-minute build stage that spent 10 s on rounds reached 1 of its 20 minimum steps). The
# answer phase's share stops longer runs first.
MINUTES_PER_ROUND = 2.0
WARMUP_STEPS = 20  # linear learning-rate warmup
# After it the learning rate follows a cosine from its peak down to LR_FLOOR of it, over this run's training phase
# (by time, or by steps where --epochs ends it first): a budget-bound run ends on small steps instead of noisy ones.
# On the same 10-minute data and training time, against a constant rate: held-out mean acceptance length 1.84
# against 1.75, on the code prompts 1.88 against 1.83 (k = 4). A resumed run starts a new cosine (a warm restart).
LR_FLOOR = 0.05
# A head that hasn't finished the warmup has moved little from its initialisation (random layers, the
# target's lm_head rows): exporting it only gives acceptance near 0. A run that can't reach this many
# steps (or all the steps its --epochs ask for, if fewer) fails and exports nothing.
MIN_TRAIN_STEPS = WARMUP_STEPS
# Train in bf16 autocast (fp32 master weights and optimizer) where the CPU multiplies bf16 that much faster than
# fp32: matmuls are 80% of a step. AVX512_BF16 (this EPYC) ran a step in 0.43 s against 1.0; a CPU without bf16
# dot-product instructions emulates them, and keeps fp32.
BF16_MIN_GAIN = 1.3


class DraftTrainError(PipelineError):
    """A draft head can't be trained: bad options, an output in the way, ModelOpt missing."""


@dataclass(frozen=True)
class TrainOptions:
    target: str
    output: Path
    method: str = "eagle3"
    data: str = "builtin"
    budget_minutes: float = 10.0  # the whole command's wall time: setup, data, training, export, acceptance
    draft_vocab_size: int | None = None  # default: data.default_draft_vocab_size
    max_new_tokens: int = 128  # answer length per prompt
    max_epochs: int = 50
    batch_size: int = 4
    learning_rate: float = 1e-3
    seed: int = 0
    eval_tokens: int = 64  # new tokens per held-out prompt when measuring acceptance
    text_samples: int = 128  # plus this many 256-token samples of built-in text (0: answers only)
    answer_rounds: int | None = None  # answers per prompt; None: as many as the budget's answer phase allows
    force: bool = False
    progress: bool = True
    budget_flag: str = "--budget-minutes"  # named in errors: `pipeline build` sets its own flag's name

    def validate(self) -> None:
        if self.method not in METHODS:
            raise ConfigError(f"unknown --method {self.method!r}; supported: {', '.join(METHODS)}")
        if self.budget_minutes <= 0:
            raise ConfigError("--budget-minutes must be > 0")
        if self.max_new_tokens < 2 or self.batch_size < 1 or self.max_epochs < 1:
            raise ConfigError("--max-new-tokens must be >= 2, batch size and epochs >= 1")
        if self.answer_rounds is not None and not 1 <= self.answer_rounds <= MAX_ANSWER_ROUNDS:
            raise ConfigError(f"--answer-rounds must be between 1 and {MAX_ANSWER_ROUNDS}")


@dataclass
class TrainResult:
    output: str
    target: str
    method: str
    work_dir: str
    train_prompts: int
    heldout_prompts: int
    answers: int  # the target's answers trained on: train_prompts per round, the last round maybe cut short
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
    train_precision: str = "fp32"  # "bf16" (autocast) where the CPU multiplies bf16 faster: train_precision()
    phase_seconds: dict = field(default_factory=dict)  # setup, data, train, eval
    acceptance: dict | None = None  # None: the budget left no time to measure it

    def to_dict(self) -> dict:
        return asdict(self)


def _work_dir(target: Path, opts: TrainOptions, prompts: list[str], draft_vocab_size: int) -> Path:
    """Keyed by the draft vocabulary's resolved size, not the flag: a folder's d2t.pt and checkpoint hold a head over
    that many tokens, and a new default must not resume one trained over another."""
    from pipeline.home import pipeline_home

    key = json.dumps([str(target), prompts, opts.max_new_tokens, draft_vocab_size, opts.batch_size,
                      opts.learning_rate, opts.seed, opts.method])
    return pipeline_home() / "draft-train" / hashlib.sha256(key.encode()).hexdigest()[:16]


def _bar(total: int, desc: str, enabled: bool):
    """A bar on stderr, shown only on a terminal: a log file or a pipe gets the summary alone."""
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, disable=not (enabled and sys.stderr.isatty()), file=sys.stderr,
                dynamic_ncols=True, leave=True)


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


def _import_modelopt():
    """ModelOpt's speculative module and what it needs from transformers, or a MissingDependencyError."""
    try:
        import modelopt.torch.speculative as mtsp
        from modelopt.torch.speculative.config import EAGLE3_DEFAULT_CFG
        from transformers import AutoModelForCausalLM
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
    except ImportError as err:
        raise MissingDependencyError(f"training a draft head needs nvidia-modelopt and transformers ({err}); "
                                     f"pip install nvidia-modelopt transformers accelerate") from None
    return mtsp, EAGLE3_DEFAULT_CFG, AutoModelForCausalLM, LlamaRotaryEmbedding


def _modelopt_eagle(target: Path, arch: dict, d2t: torch.Tensor):
    mtsp, EAGLE3_DEFAULT_CFG, AutoModelForCausalLM, LlamaRotaryEmbedding = _import_modelopt()
    from transformers.utils import logging as hf_logging

    # transformers draws its own "Loading weights" bar on stderr, between ours (or under --json, alone).
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32)
    finally:
        if bars:
            hf_logging.enable_progress_bar()
    if not getattr(model.config, "architectures", None):
        model.config.architectures = [type(model).__name__]
    from pipeline.engine.config import ModelConfig

    features = ModelConfig.from_hf_dict(model.config.to_dict()).features
    # offline mode drops the base layers: take the last one's weights first, as a Llama layer reads them
    donor = _as_llama_layer(_last_layer(model), features)
    cfg = copy.deepcopy(EAGLE3_DEFAULT_CFG["config"])
    cfg["eagle_architecture_config"].update(arch)
    # On CPU torch.compile makes the first step take minutes; a yarn rope_scaling is injected into the
    # export unless this is empty. Offline: train on cached target states, base layers dropped.
    cfg.update(eagle_use_torch_compile=False, eagle_export_rope_scaling={}, eagle_offline=True)
    mtsp.convert(model, [("eagle", cfg)])
    em = model.eagle_module
    # ModelOpt 0.47 builds this lazily with a `device=` argument transformers 5 no longer takes. Its config is the
    # target's with the head's sizes over it, so a Gemma 3 target leaves rope_parameters per layer type, which
    # the head's one Llama layer can't read: it gets the one rope the architecture asks for.
    rope_config = copy.copy(em.config)
    rope_config.rope_parameters = {"rope_type": "default", "rope_theta": arch["rope_theta"]}
    em.rotary_emb = LlamaRotaryEmbedding(config=rope_config)
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
            em.norm.weight.copy_(norm.weight + 1 if features.norm_offset else norm.weight)
        _init_from_layer(em.layers[0], donor)
        if hasattr(em, "fc"):
            _init_fc(em.fc, arch["hidden_size"])
        # The distillation targets over the draft vocabulary alone (_draft_logits): ModelOpt's offline forward
        # computes the target's whole lm_head each step, then keeps the draft vocabulary's columns.
        model.pipeline_draft_rows = model.get_output_embeddings().weight[ids].detach().clone()
    if len(d2t) != model.get_output_embeddings().weight.shape[0]:
        model._map_logits_to_draft_vocab = lambda logits: logits  # _draft_logits gives them mapped already
    return model


def _last_layer(model) -> dict[str, torch.Tensor]:
    """The target's last decoder layer's weights (a copy), or {} where the model doesn't expose its layers."""
    layers = getattr(model.get_decoder(), "layers", None)
    return {k: v.detach().clone() for k, v in layers[-1].state_dict().items()} if layers else {}


def _as_llama_layer(donor: dict[str, torch.Tensor], features: Features) -> dict[str, torch.Tensor]:
    """A target layer's weights under the names and meaning of the head's Llama layer: Gemma's norms scale by
    (1 + w) where a Llama norm scales by w, and its norm before the MLP is pre_feedforward_layernorm (its
    post_attention_layernorm norms attention's output, which a Llama layer doesn't)."""
    donor = dict(donor)
    if features.sandwich_norms:
        for name in ("post_attention_layernorm.weight", "post_feedforward_layernorm.weight"):
            donor.pop(name, None)
        if "pre_feedforward_layernorm.weight" in donor:
            donor["post_attention_layernorm.weight"] = donor.pop("pre_feedforward_layernorm.weight")
    if features.norm_offset:
        donor = {k: v + 1 if k.endswith("layernorm.weight") else v for k, v in donor.items()}
    return donor


def _init_from_layer(layer, donor: dict[str, torch.Tensor]) -> None:
    """Start the head's decoder layer as the target's last one: on the same 10-minute data and training time,
    held-out mean acceptance length 1.94 against 1.84 from random, 2.01 against 1.88 on the code prompts (k = 4).
    The layer then already reads this model's residual space, and a few hundred CPU steps adjust it instead of
    building it. Its q/k/v read two normed inputs side by side (the next token's embedding, the fused state):
    each half starts as half the target's projection. A weight whose shape differs keeps its random start."""
    for name, param in layer.state_dict(keep_vars=True).items():
        w = donor.get(name)
        if name == "hidden_norm.weight":
            w = donor.get("input_layernorm.weight")
        elif name in ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight") \
                and w is not None and param.shape[1] == 2 * w.shape[1]:
            w = torch.cat([w / 2, w / 2], dim=1)
        if w is not None and w.shape == param.shape:
            param.data.copy_(w)


def _init_fc(fc, hidden: int) -> None:
    """Start the fusion as a pass-through of the highest captured layer's state (its block of fc the identity, the
    lower layers' zero): the layer above, the target's last, then starts from a state of the residual stream it was
    trained on, as the layer itself starts from the target's. On the 10-minute data and training time: training loss
    5.14 against 5.94 from random, code prompts 2.17 against 2.05 at k = 4, held-out prompts 1.97 against 1.98."""
    w = torch.zeros_like(fc.weight)
    w[:, -hidden:] = torch.eye(hidden)
    fc.weight.copy_(w)
    if fc.bias is not None:
        fc.bias.zero_()


def _draft_logits(model, batch: dict) -> None:
    """The target's logits over the draft vocabulary, into the batch's base_model_outputs: what ModelOpt's offline
    forward computes when they are missing (the target's final norm, its lm_head, then the draft vocabulary's
    columns), from the draft rows of the lm_head alone. For SmolLM2 the whole lm_head (49152 rows against 8192 then)
    took a quarter of a training step's time on a CPU. A test checks them against ModelOpt's own."""
    base = batch["base_model_outputs"]
    with torch.no_grad():
        base["base_model_logits"] = model._base_model_norm(base["base_model_hidden_states"]) @ \
            model.pipeline_draft_rows.t()


def train_precision(hidden: int, draft_vocab: int) -> str:
    """"bf16" where a training-sized matmul (a batch's tokens by the head's lm_head) runs BF16_MIN_GAIN times
    faster in bf16 than in fp32 on this CPU, else "fp32". Measured, not read from CPU flags: what counts is
    whether torch's kernels use bf16 dot products here (AVX512_BF16, AMX, Arm's BF16) or emulate them."""
    import time

    x, w = torch.randn(1024, hidden), torch.randn(draft_vocab, hidden)

    def best(a: torch.Tensor, b: torch.Tensor) -> float:
        times = []
        for _ in range(4):
            t0 = time.perf_counter()
            a @ b.t()
            times.append(time.perf_counter() - t0)
        return min(times[1:])  # the first call pays one-time setup

    return "bf16" if best(x, w) >= BF16_MIN_GAIN * best(x.bfloat16(), w.bfloat16()) else "fp32"


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
    # ModelOpt reports its progress with print(): to stderr beside our bars, dropped without them (stdout
    # is for our own result under --json; a build draws its own bar). Gradients on whatever mode an
    # earlier caller in this process left (a quantize run turns them off).
    with open(os.devnull, "w") as devnull, torch.enable_grad(), \
            contextlib.redirect_stdout(sys.stderr if opts.progress else devnull):
        return _train_draft(opts)


@dataclass
class _Setup:
    """What every phase reads: the target, its tokenizer and shapes, the prompt split and the work folder."""

    target: Path
    target_cfg: dict
    vocab_size: int
    draft_vocab_size: int
    train_prompts: list[str]
    heldout_prompts: list[str]
    work: Path
    tokenizer: object
    stops: tuple[int, ...]
    aux_layers: tuple[int, ...]


@dataclass
class _Progress:
    """The training loop's state; all but step_s and stopped_by go into the checkpoint, so an interrupted run
    resumes where it stopped."""

    step: int = 0
    epoch: int = 0
    in_epoch: int = 0  # batches of the current epoch already trained
    train_s: float = 0.0
    loss: float | None = None
    accs: list[float] = field(default_factory=list)
    resumed_from: int = 0
    step_s: float | None = None  # seconds per step, smoothed: when the next one would overrun the budget
    stopped_by: str = "epochs"  # "epochs" | "budget"

    def save(self, file: Path, model, opt, num_seqs: int) -> None:
        _save({"head": model.eagle_module.state_dict(), "optimizer": opt.state_dict(), "step": self.step,
               "epoch": self.epoch, "in_epoch": self.in_epoch, "num_seqs": num_seqs, "train_seconds": self.train_s,
               "loss": self.loss, "train_acc": self.accs}, file)

    @classmethod
    def resume(cls, file: Path, model, opt, num_seqs: int) -> "_Progress":
        if not file.is_file():
            return cls()
        ck = torch.load(file)
        model.eagle_module.load_state_dict(ck["head"])
        opt.load_state_dict(ck["optimizer"])
        # Same data: continue the epoch; more data since (a rerun added answers): start a new one.
        in_epoch = ck.get("in_epoch", 0) if ck.get("num_seqs") == num_seqs else 0
        return cls(step=ck["step"], epoch=ck["epoch"], in_epoch=in_epoch, train_s=ck["train_seconds"],
                   loss=ck.get("loss"), accs=ck.get("train_acc", []), resumed_from=ck["step"])


def _train_draft(opts: TrainOptions) -> TrainResult:
    from pipeline.draft.budget import PhasePlan
    from pipeline.staging import check_output

    t_start = budget.now()
    deadline = t_start + opts.budget_minutes * 60
    opts.validate()
    check_output(opts.output, opts.force, DraftTrainError, "-o")
    _import_modelopt()  # 7-10 s on 2 cores: inside the budget, and a missing one fails before any work
    setup = _setup(opts)
    plan = PhasePlan(start=budget.now(), deadline=deadline)
    phase_s = {"setup": round(plan.start - t_start, 1)}

    # 1-2. answers and hidden states, cached in the work folder; a rerun continues where this one stopped.
    seqs, feats, answers = _collect_data(setup.target, setup.tokenizer, setup.stops, setup.train_prompts,
                                         setup.aux_layers, setup.work, opts, plan, setup.target_cfg)
    phase_s["data"] = round(budget.now() - plan.start, 1)
    if not seqs:
        raise DraftTrainError(f"no training data within {opts.budget_minutes:g} min ({_timings(phase_s)}): "
                              f"raise {opts.budget_flag}; a rerun keeps the data made so far")

    # 3. train with ModelOpt.
    t_train = budget.now()
    arch = head_architecture(setup.target_cfg, setup.draft_vocab_size)
    model = _head_model(setup, arch, seqs)
    precision = train_precision(arch["hidden_size"], setup.draft_vocab_size)
    progress = _train_head(model, seqs, feats, setup.work / "checkpoint.pt", opts, plan.train_end, precision)
    phase_s["train"] = round(budget.now() - t_train, 1)
    needed = min(MIN_TRAIN_STEPS, opts.max_epochs * _per_epoch(seqs, opts))
    if progress.step < needed:
        pace = f" at {progress.step_s:.1f} s/step" if progress.step_s else ""
        raise DraftTrainError(f"trained {progress.step} of the {needed} steps a head needs in "
                              f"{opts.budget_minutes:g} min ({_timings(phase_s)}{pace}): raise {opts.budget_flag}; "
                              "a rerun keeps the data and the steps made so far")

    # 4. export (staged), then measure acceptance on the held-out prompts until the deadline.
    return _export_and_measure(model, arch, setup, seqs, answers, progress, opts, phase_s, t_start, deadline,
                               precision)


def _setup(opts: TrainOptions) -> _Setup:
    from pipeline.draft.data import default_draft_vocab_size, load_prompts, split_prompts
    from pipeline.engine.config import ModelConfig
    from pipeline.engine.eagle3 import default_aux_layer_ids
    from pipeline.models.resolve import resolve_model
    from pipeline.models.tokenizer import load_tokenizer, stop_token_ids

    target = resolve_model(opts.target).path
    target_cfg = json.loads((target / "config.json").read_text())
    mc = ModelConfig.from_hf_dict(target_cfg)
    prompts = load_prompts(opts.data)
    train_p, held_p = split_prompts(prompts)
    dv = opts.draft_vocab_size or default_draft_vocab_size(mc.hidden_size, mc.num_heads, mc.num_kv_heads, mc.head_dim,
                                                           mc.intermediate_size, mc.vocab_size)
    if not 1 <= dv <= mc.vocab_size:
        raise ConfigError(f"--draft-vocab-size must be between 1 and the target's vocabulary ({mc.vocab_size})")
    work = _work_dir(target, opts, prompts, dv)
    work.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(opts.seed)
    tok = load_tokenizer(target)
    return _Setup(target=target, target_cfg=target_cfg, vocab_size=mc.vocab_size, draft_vocab_size=dv,
                  train_prompts=train_p, heldout_prompts=held_p, work=work, tokenizer=tok,
                  stops=stop_token_ids(tok, mc.eos_token_ids), aux_layers=default_aux_layer_ids(mc.num_layers))


def _head_model(setup: _Setup, arch: dict, seqs: list[list[int]]):
    """The target with a fresh ModelOpt EAGLE-3 head over the draft vocabulary.

    The draft vocabulary is fixed when training first starts, so a resumed run (maybe with more answers by
    then) keeps the head's output rows meaning the same tokens."""
    from pipeline.draft.data import draft_vocab

    vocab_file = setup.work / "d2t.pt"
    if not vocab_file.is_file():
        _save(draft_vocab(seqs, setup.vocab_size, setup.draft_vocab_size), vocab_file)
    model = _modelopt_eagle(setup.target, arch, torch.load(vocab_file))
    if tuple(model.eagle_config.eagle_aux_hidden_state_layer_ids) != setup.aux_layers:
        raise DraftTrainError(f"ModelOpt picked aux layers {model.eagle_config.eagle_aux_hidden_state_layer_ids}, "
                              f"the engine {list(setup.aux_layers)}; set eagle_aux_hidden_state_layer_ids explicitly")
    return model


def _per_epoch(seqs: list, opts: TrainOptions) -> int:
    return math.ceil(len(seqs) / opts.batch_size)


def _train_head(model, seqs: list[list[int]], feats: list[dict], ckpt_file: Path, opts: TrainOptions,
                train_end: float, precision: str = "fp32") -> _Progress:
    """Train until max_epochs or until the next step would pass train_end; checkpointed every epoch and every
    CHECKPOINT_EVERY_S seconds, and once more at the end (kept even when the run then fails: a rerun with a
    larger budget resumes from it). precision "bf16" runs each step under bf16 autocast (train_precision)."""
    params = [p for p in model.eagle_module.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=opts.learning_rate, weight_decay=0.0)
    progress = _Progress.resume(ckpt_file, model, opt, len(seqs))
    per_epoch = _per_epoch(seqs, opts)
    run_start, run_step = budget.now(), progress.step
    run_steps = max(1, opts.max_epochs * per_epoch - (progress.epoch * per_epoch + progress.in_epoch))

    def lr() -> float:
        by_time = (budget.now() - run_start) / max(train_end - run_start, 1e-9)
        return opts.learning_rate * lr_factor(progress.step, max(by_time, (progress.step - run_step) / run_steps))

    model.train()
    last_ck = budget.now()
    with _bar(opts.max_epochs * per_epoch, "train eagle3 head", opts.progress) as bar:
        bar.update(progress.epoch * per_epoch + progress.in_epoch)
        while progress.epoch < opts.max_epochs:
            batches = _batches(len(seqs), opts.batch_size, progress.epoch, opts.seed)
            for b in batches[progress.in_epoch:]:
                if budget.now() + (progress.step_s or 0.0) > train_end:
                    progress.stopped_by = "budget"
                    break
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
                    _train_step(model, params, opt, lr(), [(seqs[i], feats[i]) for i in b], progress)
                left = max(0.0, train_end - budget.now())
                # The bar's total (and so its ETA) is what the budget allows, not max_epochs' steps.
                done = progress.epoch * per_epoch + progress.in_epoch
                fits = int(left / progress.step_s) if progress.step_s > 0 else opts.max_epochs * per_epoch
                bar.total = min(opts.max_epochs * per_epoch, done + fits)
                bar.set_postfix(loss=f"{progress.loss:.3f}", acc=progress.accs[0] if progress.accs else None,
                                budget_left=f"{left:.0f}s")
                bar.update(1)
                if budget.now() - last_ck > CHECKPOINT_EVERY_S:
                    progress.save(ckpt_file, model, opt, len(seqs))
                    last_ck = budget.now()
            else:
                progress.epoch, progress.in_epoch = progress.epoch + 1, 0
                progress.save(ckpt_file, model, opt, len(seqs))
                last_ck = budget.now()
                continue
            break
    progress.save(ckpt_file, model, opt, len(seqs))
    return progress


def lr_factor(step: int, done: float) -> float:
    """The learning rate's share of its peak at a step (counted over the head's life, so a resumed run doesn't warm up
    again), `done` (0..1) of the way through this run's training phase: WARMUP_STEPS linear, then a cosine to
    LR_FLOOR."""
    warm = min(1.0, (step + 1) / WARMUP_STEPS)
    cos = 0.5 * (1 + math.cos(math.pi * min(1.0, max(0.0, done))))
    return warm * (LR_FLOOR + (1 - LR_FLOOR) * cos)


def _train_step(model, params, opt, lr: float, batch: list[tuple[list[int], dict]], progress: _Progress) -> None:
    t0 = budget.now()
    for group in opt.param_groups:
        group["lr"] = lr
    # ModelOpt caches its training-time-test masks per step index only, assuming one sequence length for the
    # whole run; our batches vary, so rebuild them per batch.
    model._cached_attn_blk_masks = {}
    inputs = _collate(batch)
    _draft_logits(model, inputs)
    out = model(**inputs)
    out.loss.backward()
    torch.nn.utils.clip_grad_norm_(params, 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)
    dt = budget.now() - t0
    progress.step_s = dt if progress.step_s is None else 0.8 * progress.step_s + 0.2 * dt
    progress.train_s += dt
    progress.step += 1
    progress.in_epoch += 1
    progress.loss, progress.accs = float(out.loss.detach()), [round(float(a), 4) for a in out.train_acc[0]]


def _export_and_measure(model, arch: dict, setup: _Setup, seqs: list[list[int]], answers: int, progress: _Progress,
                        opts: TrainOptions, phase_s: dict, t_start: float, deadline: float,
                        precision: str) -> TrainResult:
    from modelopt.torch.export import export_speculative_decoding

    from pipeline.draft.report import measure_acceptance
    from pipeline.models.tokenizer import encode_prompt
    from pipeline.staging import staged_output

    t_eval = budget.now()
    model.eval()
    held_ids = [encode_prompt(setup.tokenizer, p, raw=False) for p in setup.heldout_prompts]
    with staged_output(opts.output, opts.force, DraftTrainError, "-o") as stage:
        export_speculative_decoding(model, export_dir=stage)
        _fix_export_config(stage, arch)
        acceptance = measure_acceptance(setup.target, stage, held_ids, ks=(6,), max_new_tokens=opts.eval_tokens,
                                        eos_token_ids=setup.stops, deadline=deadline)
        phase_s["eval"] = round(budget.now() - t_eval, 1)
        result = TrainResult(
            output=str(opts.output), target=str(setup.target), method=opts.method, work_dir=str(setup.work),
            train_prompts=len(setup.train_prompts), heldout_prompts=len(setup.heldout_prompts),
            answers=answers, train_tokens=sum(len(s) for s in seqs), draft_vocab_size=setup.draft_vocab_size,
            aux_layers=list(setup.aux_layers),
            head={k: arch[k] for k in ("hidden_size", "num_attention_heads", "num_key_value_heads",
                                       "intermediate_size", "num_hidden_layers")},
            text_samples=opts.text_samples,
            epochs=round(progress.epoch + progress.in_epoch / _per_epoch(seqs, opts), 2), steps=progress.step,
            resumed_from_step=progress.resumed_from, train_seconds=round(progress.train_s, 1),
            total_seconds=round(budget.now() - t_start, 1), budget_minutes=opts.budget_minutes,
            stopped_by=progress.stopped_by, final_loss=progress.loss, train_acc=progress.accs,
            train_precision=precision, phase_seconds=phase_s, acceptance=acceptance)
        (stage / "train_report.json").write_text(json.dumps(result.to_dict(), indent=2) + "\n")
    return result


def _collect_data(target: Path, tok, stops, train_p: list[str], aux_layers, work: Path, opts: TrainOptions,
                  plan: PhasePlan, target_cfg: dict) -> tuple[list[list[int]], list[dict], int]:
    """(sequences, their target hidden states, how many of them are answers): the target's answers to the
    training prompts with their states, round after round (MAX_ANSWER_ROUNDS), until the plan's answers_end,
    then the built-in text's states, until its data_end. Each is cached batch by batch in the work folder, so a rerun
    continues where this run stopped, and a rerun with a larger budget adds rounds."""
    from pipeline.draft.data import answer_engine, generate_answers, target_features
    from pipeline.models.tokenizer import encode_prompt

    def before(t: float) -> bool:
        return budget.now() < t

    ans_file, states_dir = work / "answers.pt", work / "answer-states"
    seqs: list[list[int]] = torch.load(ans_file) if ans_file.is_file() else []
    feats = _load_answer_states(states_dir, len(seqs))
    # Answers saved without their states (a run stopped between the two saves) are answered again: the same text,
    # since round 0 is greedy and the others seeded.
    seqs = seqs[:len(feats)]
    ids = [encode_prompt(tok, p, raw=False) for p in train_p]
    wanted = (len(ids) * opts.answer_rounds if opts.answer_rounds else
              _auto_answers(ids, opts.max_new_tokens, len(aux_layers), target_cfg, opts.budget_minutes))
    if len(seqs) < wanted and before(plan.answers_end):
        max_len = max(len(i) for i in ids) + opts.max_new_tokens + 1
        model, config = _load_target(target, max_len)
        engine = answer_engine(model, config, stops, aux_layers)
        with _bar(wanted, "answers (target)", opts.progress) as bar:
            bar.update(len(seqs))
            while len(seqs) < wanted and before(plan.answers_end):
                rnd, at = divmod(len(seqs), len(ids))
                chunk = ids[at:at + min(ANSWER_CHUNK, wanted - len(seqs))]
                # Round 0 greedy (what the engine answers by default); later rounds sampled, request i of round r
                # seeded r * prompts + i, so a rerun regenerates the same text.
                new_seqs, new_feats = generate_answers(
                    engine, chunk, opts.max_new_tokens, deadline=plan.answers_end,
                    temperature=ANSWER_TEMPERATURE if rnd else 0.0, seed=rnd * len(ids) + at)
                # Each chunk's states saved once, in a file of their own named by the first answer's index (the
                # whole list rewritten after every chunk grew past 1 GB and was saved ~26 times in a 60-minute run);
                # then the answers, which name how many of those states count.
                if new_seqs:
                    _save(new_feats, states_dir / f"{len(seqs):07d}.pt")
                seqs += new_seqs
                feats += new_feats
                _save(seqs, ans_file)
                bar.update(len(new_seqs))
        del engine, model
    answers = len(seqs)
    if opts.text_samples:
        # Built-in text, distilled on the target's soft labels: many positions for one prefill each.
        # Its features are cached apart, so the answers' cache stays valid for any --text-samples.
        from pipeline.draft.data import text_samples

        text_file = work / f"text-{opts.text_samples}.pt"
        texts, text_feats = torch.load(text_file) if text_file.is_file() else (text_samples(tok, opts.text_samples), [])
        if len(text_feats) < len(texts) and before(plan.data_end):
            model, _ = _load_target(target, max(len(t) for t in texts) + 1)
            with _bar(len(texts) - len(text_feats), "target hidden states (text)", opts.progress) as bar:
                text_feats += target_features(model, texts[len(text_feats):], aux_layers, on_seq=bar.update,
                                              deadline=plan.data_end)
            _save((texts, text_feats), text_file)
            del model
        seqs, feats = seqs + texts[:len(text_feats)], feats + text_feats
    return seqs, feats, answers


def _load_answer_states(folder: Path, answers: int) -> list[dict]:
    """The cached states of the first `answers` answers, chunk by chunk. A chunk saved after the answers' last save
    (a run stopped between the two) starts at `answers` or later: it is dropped, and answered again."""
    folder.mkdir(exist_ok=True)
    whole = folder.parent / "features.pt"  # the one file of earlier versions: its states become the first chunk
    if whole.is_file():
        _save(torch.load(whole), folder / f"{0:07d}.pt")
        whole.unlink()
    feats: list[dict] = []
    for shard in sorted(folder.glob("*.pt")):
        if int(shard.stem) == len(feats) < answers:
            feats += torch.load(shard)
        else:
            shard.unlink()
    return feats[:answers]


def _auto_answers(ids: list[list[int]], max_new_tokens: int, num_aux: int, target_cfg: dict,
                  budget_minutes: float) -> int:
    """How many answers to collect when --answer-rounds isn't given: MAX_ANSWER_ROUNDS a prompt, fewer at one sampled
    round per MINUTES_PER_ROUND of budget, and no more than keep their hidden states (bf16, the aux layers' and the
    final one per token, for answers of max_new_tokens) within FEATURE_MEMORY_BYTES. That cap counts answers, not
    rounds: a large prompt set on a wide target stops partway through its first round."""
    from pipeline.engine.config import ModelConfig

    hidden = ModelConfig.from_hf_dict(target_cfg).hidden_size
    per_answer = (sum(len(i) for i in ids) / len(ids) + max_new_tokens) * (num_aux + 1) * hidden * 2
    rounds = min(MAX_ANSWER_ROUNDS, 1 + int(budget_minutes // MINUTES_PER_ROUND))
    return max(1, min(len(ids) * rounds, int(FEATURE_MEMORY_BYTES // per_answer)))


def _timings(phase_s: dict) -> str:
    return ", ".join(f"{name} {s:.0f} s" for name, s in phase_s.items())


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
    return load_transformer(target, max_seq_len, torch.bfloat16, keep_plain=False), config
