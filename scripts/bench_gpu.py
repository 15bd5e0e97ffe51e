"""The portable engine on one GPU (issue 40, item 4): speed against the HBM floor, the lossless contract's identity
matrix, speculation, transformers eager and the vendor kernels, in one run of under 5 minutes on an H200.

Random-weight models in the shapes of Llama-3.2-1B (tied embeddings) and Llama-3.1-8B (untied), both with llama3
rope scaling, are made with transformers' LlamaForCausalLM directly on the GPU in bf16 and saved to a temp folder
(nothing is downloaded: the GPU machine has no network). Random weights give flat logits, so the output projection
is scaled until the logits spread as a trained model's do (--logit-std, the std over the vocabulary); greedy output
then varies token to token, which the JSON shows (distinct tokens per baseline answer, the median top-1/top-2 gap).
Per shape, each section runs under its own time cap and is recorded on its own (a failure is one line in the JSON,
and the next section runs); the JSON is rewritten after every section, so a run cut short still leaves its numbers.

- copy bandwidth: the best of a few device-to-device copies of a large buffer, read + write bytes; the floor is that
  over the target's weight bytes (every parameter once, tied embeddings once): tokens/s at batch 1 at most.
- plain: greedy, no speculation, 128-token random prompts, batch 1, 8, 32, 64; tok/s over the whole run (prefill in
  one step) and over the decode steps alone, whose rate at batch 1 is compared with the floor. The new tokens per
  row are fitted to the section's time cap after a short warm-up at that batch.
- verify: a batch-1 step verifying k=4 drafts (5 tokens; a free proposer repeats the last token) against a plain
  decode step: median step times and their ratio.
- speculation: batch 1, speculation forced on, with the target as its own draft (--draft = the same folder:
  acceptance must be exactly 1.0), n-gram lookup, a draft model (2 layers of the 1B family, random: it rarely
  agrees) and a random EAGLE-3 head in ModelOpt's layout (as tests/tiny_models.py writes one); tok/s, acceptance.
- identity: 8 prompts x 256 greedy tokens, plain batch 1 (each prompt alone) against, token for token: batch 4, 32,
  64 (the 8 among other prompts), self-draft, n-gram, draft model and EAGLE-3 (all 8 at once, speculation on), a
  prefix-cache hit (the 8 again on the engine that just ran them) and chunked prefill (prefill_chunk 32). Runs that
  won't fit the time left are skipped and named (the 8B shape may run fewer).
- transformers eager `generate` on the same weights (batch 1, greedy, the first identity prompt), and the engine's
  batch-1 tok/s against it.
- vendor: the same target loaded with EngineConfig(gpu_kernels="vendor") (cuBLAS and SDPA), plain at batch 64 and 1.

    PYTHONPATH=. python scripts/bench_gpu.py --out result.json           # both shapes, on the GPU
    PYTHONPATH=. python scripts/bench_gpu.py --shapes 8b --budget-s 200 --json
    PYTHONPATH=. python scripts/bench_gpu.py --smoke --out smoke.json     # tiny shapes on the CPU: the test's run

Only torch, transformers, safetensors (and the engine's triton) are imported: the source tree runs as it is.
With --json the JSON goes to stdout and the table to stderr.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import shutil
import statistics
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, fields, replace
from pathlib import Path

import torch

from pipeline.engine.config import EngineConfig
from pipeline.engine.cuda_graphs import graph_time_ms
from pipeline.engine.llm_engine import LLMEngine
from pipeline.engine.proposers import DraftModelProposer, NgramProposer
from pipeline.engine.sampling import SamplingParams
from pipeline.engine.speculative import Proposal
from pipeline.engine.weights import weight_bytes
from pipeline.errors import one_line

SEED = 0
SECTIONS = ("build", "transformers_eager", "load", "kernels", "plain", "verify", "identity", "speculation", "vendor")
SKIPPABLE = tuple(s for s in SECTIONS if s not in ("build", "load"))  # the others need these two
# Share of a shape's time left (after building and loading) that each measuring section may take, in run order.
CAPS = {"plain": 0.18, "verify": 0.07, "identity": 0.42, "speculation": 0.13, "vendor": 0.20}
# Identity runs, most telling first: when time runs short the last ones are skipped.
IDENTITY_RUNS = ("self_draft", "batch_64", "ngram", "eagle3", "draft_model", "prefix_cache", "chunked_prefill",
                 "batch_32", "batch_4")
SPEC_KINDS = ("self_draft", "ngram", "draft_model", "eagle3")
TARGETS = {  # the bars
    "floor_1b": 0.35, "floor_8b": 0.6, "verify_ratio": 1.15, "vendor_ratio": 0.7, "eager_ratio": 5.0,
}


@dataclass(frozen=True)
class Shape:
    name: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tie: bool
    rope_factor: float  # llama3 rope scaling: 32 for Llama-3.2, 8 for Llama-3.1
    # The weights' std. A tiny shape needs more than the real models' 0.02: with 64 wide layers their outputs are
    # too small beside a tied embedding scaled for --logit-std, and the model repeats its last token.
    init_std: float = 0.02

    def hf_config(self):
        from transformers import LlamaConfig

        special = {"bos_token_id": 128000, "eos_token_id": 128001} if self.vocab > 128001 else {
            "bos_token_id": None, "eos_token_id": None}
        cfg = LlamaConfig(vocab_size=self.vocab, hidden_size=self.hidden, intermediate_size=self.intermediate,
                          num_hidden_layers=self.layers, num_attention_heads=self.heads,
                          num_key_value_heads=self.kv_heads, head_dim=self.head_dim, tie_word_embeddings=self.tie,
                          max_position_embeddings=131072, rms_norm_eps=1e-5, initializer_range=self.init_std,
                          **special)
        cfg.rope_parameters = rope_parameters(self.rope_factor)
        cfg.architectures = ["LlamaForCausalLM"]
        return cfg


def rope_parameters(factor: float) -> dict:
    return {"rope_type": "llama3", "rope_theta": 500000.0, "factor": factor, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


SHAPES = {
    "1b": Shape("llama-3.2-1b", 2048, 16, 32, 8, 64, 8192, 128256, True, 32.0),
    "8b": Shape("llama-3.1-8b", 4096, 32, 32, 8, 128, 14336, 128256, False, 8.0),
}
SMOKE_SHAPES = {
    "1b": Shape("smoke-1b", 64, 2, 4, 2, 16, 128, 512, True, 32.0, init_std=0.25),
    "8b": Shape("smoke-8b", 128, 3, 4, 2, 32, 256, 512, False, 8.0, init_std=0.1),
}


@dataclass(frozen=True)
class Sizes:
    """Token counts; --smoke shrinks them."""

    prompt_len: int = 128
    identity_prompts: int = 8
    identity_tokens: int = 256
    batches: tuple[int, ...] = (1, 8, 32, 64)
    min_tokens: int = 32  # per row, in a throughput measurement
    max_tokens: int = 256
    warmup_tokens: int = 8
    chunk: int = 32  # prefill_chunk of the chunked-prefill identity run
    k: int = 4
    copy_mb: int = 2048
    draft_layers: int = 2
    eagle3_draft_vocab: int = 32000


SMOKE_SIZES = Sizes(prompt_len=32, identity_tokens=64, min_tokens=8, max_tokens=16, warmup_tokens=4, chunk=8,
                    copy_mb=64, draft_layers=1, eagle3_draft_vocab=100)


class OutOfTime(Exception):
    pass


class Skip(Exception):
    pass


class Clock:
    def __init__(self, budget_s: float):
        self.t0, self.budget_s = time.perf_counter(), budget_s

    def now(self) -> float:
        return time.perf_counter() - self.t0

    def left(self, deadline: float) -> float:
        return deadline - self.now()

    def log(self, msg: str) -> None:
        print(f"[{self.now():6.1f}s] {msg}", file=sys.stderr, flush=True)


# ---- models on disk --------------------------------------------------------------------------------------


def make_model(shape: Shape, folder: Path, device: str, dtype: torch.dtype, seed: int, logit_std: float):
    """A random LlamaForCausalLM made on `device` in `dtype` (no fp32 copy, no CPU init), its output projection
    scaled so the logits' std over the vocabulary is about logit_std, saved to folder. Returns the live model."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(shape.hf_config())
    finally:
        torch.set_default_dtype(default)
    g = torch.Generator(device=device).manual_seed(seed + 1)
    with torch.no_grad():
        # The final norm's output has RMS 1, so a head of std s gives logits of std s * sqrt(hidden). A tied head
        # is the embedding too: that only rescales the residual stream's first term, which layer 0 normalizes.
        model.lm_head.weight.normal_(0.0, logit_std / math.sqrt(shape.hidden), generator=g)
    model.eval()
    model.save_pretrained(folder)
    return model


def make_eagle3_head(folder: Path, shape: Shape, device: str, dtype: torch.dtype, seed: int, draft_vocab: int,
                     logit_std: float) -> Path:
    """A random EAGLE-3 head for `shape` in ModelOpt's export layout, as tests/tiny_models.make_tiny_eagle3_head
    writes one, at the target's own sizes (the published Llama-3.1-8B head's: one decoder layer of the target's
    width, a 32000-token draft vocabulary)."""
    from safetensors.torch import save_file

    from pipeline.engine.eagle3 import default_aux_layer_ids

    H, I, heads, kv, hd = shape.hidden, shape.intermediate, shape.heads, shape.kv_heads, shape.head_dim
    aux = default_aux_layer_ids(shape.layers)
    g = torch.Generator(device=device).manual_seed(seed)

    def rand(*size, std=shape.init_std):
        return (torch.randn(*size, generator=g, device=device) * std).to(dtype)

    def ones():  # a tensor per norm: safetensors refuses shared storage
        return torch.ones(H, dtype=dtype, device=device)

    kept = torch.randperm(shape.vocab, generator=torch.Generator().manual_seed(seed))[:draft_vocab].sort().values
    p = "layers.0."
    tensors = {
        "fc.weight": rand(H, len(aux) * H), p + "hidden_norm.weight": ones(), p + "input_layernorm.weight": ones(),
        p + "self_attn.q_proj.weight": rand(heads * hd, 2 * H), p + "self_attn.k_proj.weight": rand(kv * hd, 2 * H),
        p + "self_attn.v_proj.weight": rand(kv * hd, 2 * H), p + "self_attn.o_proj.weight": rand(H, heads * hd),
        p + "post_attention_layernorm.weight": ones(), p + "mlp.gate_proj.weight": rand(I, H),
        p + "mlp.up_proj.weight": rand(I, H), p + "mlp.down_proj.weight": rand(H, I), "norm.weight": ones(),
        "lm_head.weight": rand(draft_vocab, H, std=logit_std / math.sqrt(H)),
        "d2t": kept - torch.arange(draft_vocab),
    }
    cfg = {"model_type": "llama", "architectures": ["LlamaForCausalLMEagle3"], "hidden_size": H,
           "num_attention_heads": heads, "num_key_value_heads": kv, "head_dim": hd, "intermediate_size": I,
           "num_hidden_layers": 1, "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "vocab_size": shape.vocab,
           "max_position_embeddings": 131072, "draft_vocab_size": draft_vocab,
           "rope_scaling": rope_parameters(shape.rope_factor),
           "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(aux), "use_aux_hidden_state": True,
                            "use_input_layernorm_in_first_layer": True, "use_last_layernorm": True}}
    folder.mkdir(parents=True, exist_ok=True)
    save_file({k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(cfg, indent=2))
    return folder


def random_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n, length), generator=g).tolist()


# ---- the engine ------------------------------------------------------------------------------------------


class FixedDrafts:
    """Drafts the last token k times: free, so a step's time is the target's verify of k+1 tokens."""

    name = "fixed"

    def propose(self, reqs, ks):
        return Proposal(tokens=[[r.all_ids[-1]] * k for r, k in zip(reqs, ks)])

    def on_verified(self, req, prev_len, drafted, accepted):
        pass

    def release(self, req):
        pass


def engine_config(base: EngineConfig, **changes) -> EngineConfig:
    """base with changes; a field this engine's EngineConfig doesn't have is an error naming it."""
    known = {f.name for f in fields(EngineConfig)}
    unknown = sorted(set(changes) - known)
    if unknown:
        raise Skip(f"EngineConfig has no field {', '.join(unknown)}")
    return replace(base, **changes)


@dataclass
class Steps:
    wall_s: float
    steps: list[tuple[float, bool, int]]  # (seconds, had a prefill, tokens emitted)

    @property
    def decode(self) -> list[tuple[float, bool, int]]:
        return [s for s in self.steps if not s[1]]

    def decode_tok_s(self) -> float | None:
        dec = self.decode
        secs = sum(s[0] for s in dec)
        return sum(s[2] for s in dec) / secs if secs else None

    def decode_step_s(self) -> float | None:
        times = [s[0] for s in self.decode]
        return sum(times) / len(times) if times else None


def drive(engine: LLMEngine, reqs, deadline: float, clock: Clock) -> Steps:
    """Step the engine until reqs finish; past the deadline, cancel them and raise OutOfTime."""
    steps, t0 = [], time.perf_counter()
    while not all(r.finished for r in reqs):
        if clock.now() > deadline:
            for r in reqs:
                engine.cancel(r)
            raise OutOfTime(f"past the section's time cap after {len(steps)} steps")
        prefills, tokens = engine.stats.prefill_steps, engine.stats.generated_tokens
        t = time.perf_counter()
        engine.step()  # ends in the argmax's .tolist(): the GPU is done when it returns
        steps.append((time.perf_counter() - t, engine.stats.prefill_steps > prefills,
                      engine.stats.generated_tokens - tokens))
    failed = [r for r in reqs if r.error]
    if failed:
        raise RuntimeError(f"request {failed[0].id} failed: {failed[0].error}")
    return Steps(time.perf_counter() - t0, steps)


def generate(engine, prompts, max_tokens, deadline, clock, speculation="off"):
    params = SamplingParams(max_tokens=max_tokens)
    reqs = [engine.add_request(p, params, speculation=speculation) for p in prompts]
    return reqs, drive(engine, reqs, deadline, clock)


def release() -> None:
    """Hand what the caller just dropped back to the device (del the references first)."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def first_diff(a: list[int], b: list[int]) -> int | None:
    """The first index where a and b differ (a length difference counts), None when equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


# ---- one shape -------------------------------------------------------------------------------------------


class ShapeBench:
    def __init__(self, key: str, shape: Shape, args, sizes: Sizes, clock: Clock, deadline: float, report: dict,
                 save):
        self.key, self.shape, self.args, self.sizes, self.clock = key, shape, args, sizes, clock
        self.deadline, self.save = deadline, save
        self.out = report["shapes"][key] = {"shape": shape.__dict__, "sections": {}}
        self.dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
        self.dir = Path(args.work_dir) / key
        self.models: dict = {}
        vocab, n = shape.vocab, sizes.identity_prompts
        self.prompts = random_prompts(n, sizes.prompt_len, vocab, SEED)  # the identity matrix's
        self.fillers = random_prompts(max(sizes.batches) - n, sizes.prompt_len, vocab, SEED + 1)
        self.pool = self.prompts + self.fillers  # throughput prompts: batch b takes the first b
        longest = sizes.prompt_len + max(sizes.identity_tokens, sizes.max_tokens) + sizes.k + 2
        self.max_seq_len = -(-longest // 16) * 16  # whole KV blocks
        self.base = EngineConfig(max_batch_size=max(sizes.batches), max_seq_len=self.max_seq_len, dtype=args.dtype,
                                 device=args.device, num_draft_tokens=sizes.k)
        # Throughput: no prefix cache (a warm-up's prompts would be hits) and every prompt prefilled in one step.
        self.fast = replace(self.base, prefix_caching=False, prefill_chunk=max(sizes.batches) * sizes.prompt_len)

    # -- the frame --

    def section(self, name: str, fn, cap: float | None = None) -> None:
        """Run one section under its deadline; whatever it recorded stays, with its status and one-line error."""
        rec = self.out["sections"][name] = {"status": "running"}
        if name in self.args.skip:
            rec.update(status="skipped", error="--skip")
            return
        deadline = self.deadline if cap is None else min(self.deadline, self.clock.now() + cap)
        self.clock.log(f"{self.key}: {name} (up to {max(0.0, deadline - self.clock.now()):.0f} s)")
        t0 = time.perf_counter()
        try:
            if self.clock.now() >= self.deadline:
                raise OutOfTime("no time left for this shape")
            fn(rec, deadline)
            rec["status"] = "ok"
        except Skip as e:
            rec.update(status="skipped", error=one_line(e))
        except OutOfTime as e:
            rec.update(status="out_of_time", error=one_line(e))
        except Exception as e:  # noqa: BLE001  one section's failure is recorded; the next runs
            rec.update(status="error", error=f"{type(e).__name__}: {one_line(e)}"[:300])
            traceback.print_exc(file=sys.stderr)  # the log keeps the whole story; the JSON its one line
        rec["seconds"] = round(time.perf_counter() - t0, 2)
        if rec["status"] != "ok":
            self.clock.log(f"{self.key}: {name} {rec['status']}: {rec.get('error')}")
        self.save()

    def run(self) -> None:
        if self.deadline - self.clock.now() < self.args.min_shape_s:
            why = f"{max(0.0, self.deadline - self.clock.now()):.0f} s left for this shape, under --min-shape-s"
            self.out["sections"] = {name: {"status": "skipped", "error": why} for name in SECTIONS}
            self.clock.log(f"{self.key}: skipped: {why}")
            return
        self.section("build", self.build)
        self.section("transformers_eager", self.eager, cap=min(30.0, 0.08 * (self.deadline - self.clock.now())))
        self.drop_hf()
        self.section("load", self.load)
        self.section("kernels", self.kernels, cap=min(20.0, 0.08 * (self.deadline - self.clock.now())))
        for name in ("plain", "verify", "identity", "speculation", "vendor"):
            left = self.deadline - self.clock.now()
            share = CAPS[name] / sum(CAPS[n] for n in list(CAPS)[list(CAPS).index(name):])
            self.section(name, getattr(self, name), cap=left * share)
        self.models.clear()
        release()
        if self.args.device.startswith("cuda"):
            self.out["peak_gpu_memory_gb"] = round(torch.cuda.max_memory_allocated() / 1e9, 2)
        if not self.args.keep:
            shutil.rmtree(self.dir, ignore_errors=True)

    def need(self, *names):
        missing = [n for n in names if self.models.get(n) is None]
        if missing:
            raise Skip(f"needs {', '.join(missing)}, which an earlier section didn't make")
        return [self.models[n] for n in names]

    # -- sections --

    def build(self, rec, deadline):
        s, dev, dt = self.shape, self.args.device, self.dtype
        t = time.perf_counter()
        hf = make_model(s, self.dir / "target", dev, dt, SEED, self.args.logit_std)
        self.models["hf"] = hf
        rec["target_s"] = round(time.perf_counter() - t, 2)
        rec["params"] = sum(p.numel() for p in {p.data_ptr(): p for p in hf.parameters()}.values())
        rec["weight_bytes"] = self.out["weight_bytes"] = weight_bytes(hf)
        with torch.inference_mode():
            logits = hf(torch.tensor([self.prompts[0]], device=dev)).logits[0].float()
        top2 = logits.topk(2, dim=-1).values
        rec["logit_std"] = round(logits.std(-1).mean().item(), 3)
        rec["top2_gap_median"] = round((top2[:, 0] - top2[:, 1]).median().item(), 4)
        t = time.perf_counter()
        draft_shape = replace(SHAPES["1b"] if not self.args.smoke else SMOKE_SHAPES["1b"],
                              name="draft", layers=self.sizes.draft_layers)
        draft = make_model(draft_shape, self.dir / "draft", dev, dt, SEED + 2, self.args.logit_std)
        del draft
        release()
        make_eagle3_head(self.dir / "eagle3", s, dev, dt, SEED + 3, self.sizes.eagle3_draft_vocab,
                         self.args.logit_std)
        rec["draft_and_eagle3_s"] = round(time.perf_counter() - t, 2)
        rec["draft"] = {"shape": draft_shape.__dict__}
        bw = self.out.get("copy_bandwidth_gb_s")
        if bw:
            self.out["floor_tok_s"] = round(bw * 1e9 / rec["weight_bytes"], 1)

    def eager(self, rec, deadline):
        (hf,) = self.need("hf")
        ids = torch.tensor([self.prompts[0]], device=self.args.device)

        def gen(n):
            t = time.perf_counter()
            with torch.inference_mode():
                out = hf.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                                  min_new_tokens=n, do_sample=False, pad_token_id=0)
            return out[0, ids.shape[1]:].tolist(), time.perf_counter() - t

        _, warm_s = gen(self.sizes.warmup_tokens)
        per_token = warm_s / self.sizes.warmup_tokens
        fit = int(0.7 * self.clock.left(deadline) / per_token)
        n = max(self.sizes.min_tokens // 4, min(self.sizes.max_tokens, fit))
        tokens, secs = gen(n)
        rec.update(batch=1, new_tokens=len(tokens), seconds_run=round(secs, 3), tok_s=round(len(tokens) / secs, 2),
                   attn_implementation=getattr(hf.config, "_attn_implementation", None), tokens=tokens)

    def drop_hf(self):
        self.models.pop("hf", None)
        release()

    def load(self, rec, deadline):
        t = time.perf_counter()
        # The target and, from --draft = the same folder, its own copy as a draft model: LLMEngine.load's path.
        engine = LLMEngine.load(self.dir / "target", self.base, draft=str(self.dir / "target"))
        rec["target_and_self_draft_s"] = round(time.perf_counter() - t, 2)
        self.models["target"], self.models["self_draft"] = engine.model, engine.proposer.model
        rec["describe"] = engine.describe()
        del engine
        release()

    def loaded(self, name: str, load):
        """models[name], loaded on first use; a load that failed fails again at once, with its error."""
        if name not in self.models:
            try:
                self.models[name] = load()
            except Exception as e:  # noqa: BLE001  kept: the next run that needs it says why it can't
                self.models[name] = e
        if isinstance(self.models[name], Exception):
            raise self.models[name]
        return self.models[name]

    def load_draft(self):
        config = replace(self.base, max_batch_size=1)
        return self.loaded("draft", lambda: LLMEngine.load(self.dir / "draft", config).model)

    def load_eagle3(self):
        from pipeline.engine.eagle3 import load_eagle3_head

        (target,) = self.need("target")
        return self.loaded("eagle3", lambda: load_eagle3_head(self.dir / "eagle3", target.cfg, self.max_seq_len,
                                                              self.base.torch_dtype, self.args.device))

    def engine(self, kind: str, config: EngineConfig) -> LLMEngine:
        """A fresh engine (its own KV cache) over the loaded target, with kind's proposer."""
        from pipeline.engine.eagle3 import Eagle3Proposer

        (target,) = self.need("target")
        slots, seq = config.max_batch_size, config.max_seq_len
        proposer = {
            "plain": lambda: None,
            "fixed": FixedDrafts,
            "ngram": NgramProposer,
            "self_draft": lambda: DraftModelProposer(self.need("self_draft")[0], slots, seq),
            "draft_model": lambda: DraftModelProposer(self.load_draft(), slots, seq),
            "eagle3": lambda: Eagle3Proposer(self.load_eagle3(), target, slots, seq),
        }[kind]()
        engine = LLMEngine(target, config, proposer, eos_token_ids=())
        engine.eos_token_ids = ()  # exactly max_tokens per row: the random model's eos id is just another token
        return engine

    def measure(self, engine, prompts, cap_s, deadline, speculation="off", tokens=None) -> dict:
        """A warm-up at this batch, then `tokens` new tokens per row (default: as many as fit 70% of cap_s)."""
        _, warm = generate(engine, prompts, self.sizes.warmup_tokens, deadline, self.clock, speculation)
        if tokens is None:
            step = warm.decode_step_s() or warm.wall_s / self.sizes.warmup_tokens
            prefill = warm.wall_s - sum(s[0] for s in warm.decode)
            fit = int((0.7 * min(cap_s, self.clock.left(deadline)) - prefill) / step)
            tokens = max(self.sizes.min_tokens, min(self.sizes.max_tokens, fit))
        reqs, run = generate(engine, prompts, tokens, deadline, self.clock, speculation)
        emitted = sum(len(r.output_ids) for r in reqs)
        row = {"batch": len(prompts), "new_tokens_per_row": tokens, "tok_s": round(emitted / run.wall_s, 2),
               "decode_tok_s": _round(run.decode_tok_s(), 2), "step_ms": _round(_ms(run.decode_step_s()), 3),
               "steps": len(run.steps), "seconds_run": round(run.wall_s, 3)}
        if engine.proposer is not None:
            st = engine.stats  # the warm-up's verifications count too: the same rule, a few more samples
            row.update(acceptance=round(st.acceptance_rate, 4), drafted_tokens=st.drafted_tokens,
                       mean_acceptance_length=round(st.mean_acceptance_length, 3))
        return row

    def plain(self, rec, deadline):
        engine = self.engine("plain", self.fast)
        rows = rec["rows"] = []
        floor = self.out.get("floor_tok_s")
        for i, b in enumerate(self.sizes.batches):
            cap = self.clock.left(deadline) / (len(self.sizes.batches) - i)
            row = self.measure(engine, self.pool[:b], cap, deadline)
            if b == 1 and floor:
                row["floor_tok_s"] = floor
                row["floor_fraction"] = round(row["decode_tok_s"] / floor, 4)  # the target's: decode steps only
                row["floor_fraction_overall"] = round(row["tok_s"] / floor, 4)  # prefill included
            rows.append(row)
            self.clock.log(f"{self.key}: plain batch {b}: {row['tok_s']} tok/s ({row['decode_tok_s']} decoding, "
                           f"{row['step_ms']} ms a step, {row['new_tokens_per_row']} tokens a row)")
            forward = replay_ms(engine, b)
            if forward is not None and row.get("step_ms"):
                # What a step spends beyond its forward on the GPU: the host's scheduling, the input copies, the
                # argmax and the wait for it. The replay reruns the last step's inputs (its request is done, and
                # this engine caches no prefix, so the K/V it rewrites belong to no one).
                row["forward_graph_ms"] = round(forward, 4)
                row["beyond_forward_ms"] = round(row["step_ms"] - forward, 4)
            self.save()
        del engine
        release()

    def kernels(self, rec, deadline):
        """Each distinct linear of the target, and attention, on the engine's GPU kernels against the vendor's: whether
        a row gets its bits alone and in calls of 3, 5, 64, 65 and 320 rows, and the time of a 1-row and a 64-row
        call (a 1-row call's weight bytes over its time: how near the copy bandwidth a decode's linears stream)."""
        import torch.nn.functional as F

        from pipeline.engine import gpu_kernels

        (target,) = self.need("target")
        dev = self.args.device
        if not gpu_kernels.runs_here(target.embed.weight):
            raise Skip("the engine's GPU kernels run on a GPU only")
        layer = target.layers[0]
        linears = {"qkv": layer.attn.qkv, "o": layer.attn.o, "gate_up": layer.mlp.gate_up, "down": layer.mlp.down,
                   "lm_head": target.lm_head}
        g = torch.Generator(device=dev).manual_seed(SEED)

        def invariant(fn, x):
            alone = torch.cat([fn(x[i:i + 1]) for i in range(65)])
            return all(torch.equal(fn(x[:n])[:65], alone[:min(n, 65)]) for n in (3, 5, 64, 65, 320))

        def ms(fn, x, repeats=20):
            """A call's time inside a CUDA graph, as the engine's graphed steps run it (cuda_graphs.graph_time_ms)."""
            if not x.is_cuda:  # a CPU under the interpreter (a check of this section, not a measurement)
                fn(x)
                t = time.perf_counter()
                fn(x)
                return (time.perf_counter() - t) * 1e3
            return graph_time_ms(lambda: fn(x), repeats)

        out = rec["linears"] = {}
        for name, lin in linears.items():
            if self.clock.left(deadline) <= 0:
                raise OutOfTime(f"measured {', '.join(out) or 'no linear'} before the section's cap")
            w = lin.weight
            N, K = w.shape
            x = torch.randn(320, K, generator=g, device=dev).to(w.dtype)
            ours, theirs = (lambda t: gpu_kernels.linear(t, w)), (lambda t: F.linear(t, w))
            row = {"n": N, "k": K, "tiles": gpu_kernels.tiles_for(x, w).describe,
                   "invariant": invariant(ours, x), "vendor_invariant": invariant(theirs, x)}
            for m in (1, 64):
                row[f"ms_m{m}"], row[f"vendor_ms_m{m}"] = _round(ms(ours, x[:m]), 4), _round(ms(theirs, x[:m]), 4)
            row["gb_s_m1"] = round(N * K * w.element_size() / (row["ms_m1"] * 1e-3) / 1e9, 1)
            row["vendor_gb_s_m1"] = round(N * K * w.element_size() / (row["vendor_ms_m1"] * 1e-3) / 1e9, 1)
            out[name] = row
        rec["all_invariant"] = all(r["invariant"] for r in out.values())
        for m in (1, 64):  # a decoder layer's four linears: what invariance costs in the GEMMs alone
            ours = sum(out[n][f"ms_m{m}"] for n in ("qkv", "o", "gate_up", "down"))
            theirs = sum(out[n][f"vendor_ms_m{m}"] for n in ("qkv", "o", "gate_up", "down"))
            rec[f"layer_linears_ms_m{m}"], rec[f"vendor_layer_linears_ms_m{m}"] = round(ours, 4), round(theirs, 4)
            rec[f"layer_linears_invariant_over_vendor_m{m}"] = round(theirs / ours, 4)

    def verify(self, rec, deadline):
        """Batch 1: decode steps of a plain engine against steps verifying k drafts (k + 1 tokens) each."""
        k, prompt = self.sizes.k, self.pool[0]
        # Every counted step has room for k drafts: the request asks for more tokens than the steps can emit.
        room = (self.max_seq_len - len(prompt) - 2) // (k + 1) - 1
        n = None
        for kind, speculation in (("plain", "off"), ("fixed", "on")):
            engine = self.engine(kind, replace(self.fast, max_batch_size=1))
            warm = self.steps(engine, prompt, self.sizes.warmup_tokens, speculation, deadline)
            if n is None:  # as many steps as fit a third of the cap; the verify runs as many
                n = max(4, min(room, int(0.3 * self.clock.left(deadline) / statistics.median(warm))))
            times = self.steps(engine, prompt, n, speculation, deadline)
            rec[kind] = {"steps": len(times), "step_ms_median": round(1e3 * statistics.median(times), 3),
                         "step_ms_mean": round(1e3 * statistics.mean(times), 3)}
            del engine
            release()
        rec["verify_tokens"] = k + 1
        rec["decode_ms"], rec["verify_ms"] = rec["plain"]["step_ms_median"], rec["fixed"]["step_ms_median"]
        rec["ratio"] = round(rec["verify_ms"] / rec["decode_ms"], 4)
        self.clock.log(f"{self.key}: verify {k + 1} tokens {rec['verify_ms']} ms against decode {rec['decode_ms']} ms: "
                       f"{rec['ratio']}x")

    def steps(self, engine, prompt, n, speculation, deadline) -> list[float]:
        """Seconds of n decode steps of one request (after its prefill), which is then cancelled."""
        req = engine.add_request(prompt, SamplingParams(max_tokens=self.max_seq_len), speculation=speculation)
        engine.step()  # the prefill
        times = []
        for _ in range(n):
            if self.clock.now() > deadline:
                engine.cancel(req)
                raise OutOfTime(f"past the section's time cap after {len(times)} steps")
            t = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - t)
        if req.error or req.finished:
            raise RuntimeError(f"the request ended early ({req.finish_reason}: {req.error})")
        engine.cancel(req)
        return times

    def identity(self, rec, deadline):
        S, P = self.sizes, self.prompts
        N = S.identity_tokens
        rec.update(prompts=len(P), new_tokens=N, runs={}, skipped={})
        step_ms = {r["batch"]: r["step_ms"] for r in self.out["sections"].get("plain", {}).get("rows", [])
                   if r.get("step_ms")}
        if 1 in step_ms and len(P) * N * step_ms[1] / 1e3 > self.clock.left(deadline):
            raise OutOfTime(f"the batch-1 reference alone needs about {len(P) * N * step_ms[1] / 1e3:.0f} s "
                            f"({step_ms[1]} ms a step), {self.clock.left(deadline):.0f} s left")
        base_engine = self.engine("plain", self.base)
        t = time.perf_counter()
        baseline = []
        for p in P:  # each prompt alone: plain batch-1 greedy, the reference
            reqs, _ = generate(base_engine, [p], N, deadline, self.clock)
            baseline.append(reqs[0].output_ids)
        del base_engine
        release()
        rec["baseline"] = {"seconds": round(time.perf_counter() - t, 2),
                           "distinct_tokens": [len(set(o)) for o in baseline], "first_tokens": baseline[0][:16]}
        eager = self.out["sections"].get("transformers_eager", {}).get("tokens")
        if eager:  # informative only: transformers' bf16 kernels aren't the engine's, so they part somewhere
            rec["baseline"]["transformers_eager_first_diff"] = first_diff(eager, baseline[0][:len(eager)])
        self.save()

        def estimate(run: str) -> float | None:
            """Seconds a run should take, from the plain section's step times (None: unknown)."""
            batch = {"batch_4": 4, "batch_32": 32, "batch_64": 64}.get(run, len(P))
            groups = -(-len(P) // batch)
            near = min(step_ms, key=lambda b: abs(b - batch), default=None)
            if near is None:
                return None
            slow = 1.0 if run.startswith("batch") or run in ("prefix_cache", "chunked_prefill") else 2.5
            return groups * N * step_ms[near] / 1e3 * slow * (2 if run == "prefix_cache" else 1)

        for name in IDENTITY_RUNS:
            est = estimate(name)
            if est is not None and est > self.clock.left(deadline):
                rec["skipped"][name] = f"time: about {est:.0f} s, {self.clock.left(deadline):.0f} s left"
                continue
            t = time.perf_counter()
            try:
                outputs, extra = self.identity_run(name, deadline)
            except OutOfTime as e:
                rec["skipped"][name] = f"out of time: {one_line(e)}"
                continue
            except Exception as e:  # noqa: BLE001  one run's failure is recorded; the others run
                rec["runs"][name] = {"error": f"{type(e).__name__}: {one_line(e)}"[:300]}
                continue
            diffs = [first_diff(o, b) for o, b in zip(outputs, baseline)]
            rec["runs"][name] = {"identical": sum(d is None for d in diffs), "first_diff": diffs,
                                 "seconds": round(time.perf_counter() - t, 2), **extra}
            self.clock.log(f"{self.key}: identity {name}: {rec['runs'][name]['identical']}/{len(P)} identical"
                           + (f", acceptance {extra['acceptance']}" if "acceptance" in extra else ""))
            self.save()
            release()
        if rec["skipped"]:
            rec["note"] = f"{len(rec['skipped'])} of {len(IDENTITY_RUNS)} runs skipped for time: see skipped"

    def identity_run(self, name: str, deadline: float) -> tuple[list[list[int]], dict]:
        P, N = self.prompts, self.sizes.identity_tokens
        if name.startswith("batch_"):
            b = int(name.split("_")[1])
            engine = self.engine("plain", self.base)
            outputs = []
            if b < len(P):  # the 8 in groups of b
                for i in range(0, len(P), b):
                    reqs, _ = generate(engine, P[i:i + b], N, deadline, self.clock)
                    outputs += [r.output_ids for r in reqs]
            else:  # the 8 among b - 8 other prompts
                reqs, _ = generate(engine, P + self.fillers[:b - len(P)], N, deadline, self.clock)
                outputs = [r.output_ids for r in reqs[:len(P)]]
            return outputs, {"batch": b}
        if name == "prefix_cache":  # the 8 run once, then again on the same engine: their prompts' blocks are hits
            engine = self.engine("plain", self.base)
            generate(engine, P, N, deadline, self.clock)
            reqs, _ = generate(engine, P, N, deadline, self.clock)
            cached = [r.num_cached_tokens for r in reqs]
            return [r.output_ids for r in reqs], {"batch": len(P), "cached_prompt_tokens": cached}
        if name == "chunked_prefill":
            engine = self.engine("plain", replace(self.base, prefill_chunk=self.sizes.chunk))
            reqs, run = generate(engine, P, N, deadline, self.clock)
            return [r.output_ids for r in reqs], {"batch": len(P), "prefill_chunk": self.sizes.chunk,
                                                  "prefill_steps": engine.stats.prefill_steps}
        engine = self.engine(name, self.base)  # a proposer: all 8 at once, speculation forced on
        reqs, _ = generate(engine, P, N, deadline, self.clock, speculation="on")
        st = engine.stats
        return [r.output_ids for r in reqs], {"batch": len(P), "acceptance": round(st.acceptance_rate, 4),
                                              "drafted_tokens": st.drafted_tokens,
                                              "accepted_tokens": st.accepted_tokens}

    def speculation(self, rec, deadline):
        rows = rec["rows"] = []
        plain = next((r for r in self.out["sections"].get("plain", {}).get("rows", []) if r["batch"] == 1), None)
        for i, kind in enumerate(SPEC_KINDS):
            cap = self.clock.left(deadline) / (len(SPEC_KINDS) - i)
            try:
                engine = self.engine(kind, replace(self.fast, max_batch_size=1))
                row = {"proposer": kind, **self.measure(engine, self.pool[:1], cap, deadline, speculation="on")}
                del engine
                release()
            except OutOfTime:
                raise
            except Exception as e:  # noqa: BLE001  one proposer's failure is recorded; the others run
                row = {"proposer": kind, "error": f"{type(e).__name__}: {one_line(e)}"[:300]}
            if plain and "tok_s" in row:
                row["vs_plain"] = round(row["tok_s"] / plain["tok_s"], 3)
            rows.append(row)
            self.clock.log(f"{self.key}: speculation {kind}: {row.get('tok_s')} tok/s, "
                           f"acceptance {row.get('acceptance')}"
                           + (f" ({row['error']})" if "error" in row else ""))
            self.save()

    def vendor(self, rec, deadline):
        t = time.perf_counter()
        config = engine_config(self.fast, gpu_kernels="vendor")
        # The loaded target switched to cuBLAS and SDPA (LLMEngine sets each module's choice from its config):
        # no second copy to load (19 s for the 8B shape). The last section, so nothing after it sees the switch.
        engine = self.engine("plain", config)
        rec["load_s"] = round(time.perf_counter() - t, 2)
        rec["describe"] = engine.describe()
        invariant = {r["batch"]: r for r in self.out["sections"].get("plain", {}).get("rows", [])}
        rows = rec["rows"] = []
        for b in (max(self.sizes.batches), 1):
            cap = self.clock.left(deadline) / (2 - len(rows))
            # Tokens fitted to the cap: the vendor path runs eagerly (SDPA's shapes follow the context length, so
            # it isn't captured), many times slower a step than the graphed invariant path.
            row = self.measure(engine, self.pool[:b], cap, deadline)
            if b in invariant and invariant[b].get("decode_tok_s") and row.get("decode_tok_s"):
                row["invariant_decode_tok_s"] = invariant[b]["decode_tok_s"]
                row["invariant_over_vendor"] = round(invariant[b]["decode_tok_s"] / row["decode_tok_s"], 4)
            rows.append(row)
            self.clock.log(f"{self.key}: vendor batch {b}: {row['decode_tok_s']} tok/s decoding, invariant/vendor "
                           f"{row.get('invariant_over_vendor')}")
        target_desc = self.out["sections"].get("load", {}).get("describe", {}).get("target")
        if target_desc is not None and target_desc == rec["describe"].get("target"):
            rec["note"] = "describe() names the same kernels as the invariant engine's: gpu_kernels may not be honored"
        del engine
        release()


def replay_ms(engine: LLMEngine, rows: int) -> float | None:
    """Milliseconds of one replay of the graph a `rows`-row decode step runs (the mean of 10), or None where the
    engine replays no graph (the vendor path, a CPU)."""
    graphed = getattr(engine, "graphed", None)
    if graphed is None or not graphed.replay or graphed.bucket_for(rows) is None:
        return None
    graph = graphed.graphs[(graphed.bucket_for(rows), 1)].graph
    graph.replay()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(10):
        graph.replay()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) / 10


def _ms(s):
    return None if s is None else 1e3 * s


def _round(x, n):
    return None if x is None else round(x, n)


# ---- the run ---------------------------------------------------------------------------------------------


def copy_bandwidth_gbs(device: str, mbytes: int, repeats: int = 5, per_trial: int = 4) -> float:
    """Best of `repeats` trials of `per_trial` back-to-back copies, counting read + write bytes."""
    src = torch.ones(mbytes * 2**20, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    sync = torch.cuda.synchronize if src.is_cuda else (lambda: None)
    dst.copy_(src)
    sync()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        for _ in range(per_trial):
            dst.copy_(src)
        sync()
        best = min(best, (time.perf_counter() - t) / per_trial)
    del src, dst
    release()
    return 2 * mbytes * 2**20 / best / 1e9


def memory_folder() -> str | None:
    """/dev/shm where it has room for the models (the 8B shape is 16 GB, written once and read twice): on an H200
    machine, writing it to /tmp took 23 s of a 280 s run. None (the system's temp folder) elsewhere."""
    try:
        return "/dev/shm" if shutil.disk_usage("/dev/shm").free > 48e9 else None
    except OSError:
        return None


def environment(args) -> dict:
    import transformers

    env = {"torch": torch.__version__, "transformers": transformers.__version__, "device": args.device,
           "dtype": args.dtype, "python": sys.version.split()[0]}
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    if args.device.startswith("cuda"):
        env["gpu"] = torch.cuda.get_device_name(torch.device(args.device))
    return env


def targets(report: dict) -> list[dict]:
    """The issue's bars, per shape: each with its value and met (None, shown n/a, where it wasn't measured)."""
    out = []
    top_batch = max(report["sizes"]["batches"])

    def add(shape, name, value, bar, met):
        out.append({"shape": shape, "target": name, "value": value, "bar": bar, "met": met})

    for key, s in report["shapes"].items():
        sec = s["sections"]
        ident = sec.get("identity", {})
        runs, skipped = ident.get("runs", {}), ident.get("skipped", {})
        same = [n for n, r in runs.items() if r.get("identical") == ident.get("prompts")]
        value = f"{len(same)}/{len(IDENTITY_RUNS)} runs identical" + (f", {len(skipped)} skipped" if skipped else "")
        # A run that differs or fails misses; one skipped for time leaves the verdict open.
        met = None if not runs else (False if len(same) < len(runs) else (None if skipped else True))
        add(key, "identity: every run token for token plain batch 1", value, "all runs", met)
        spec_rows = sec.get("speculation", {}).get("rows", [])
        acc = [r["acceptance"] for r in [runs.get("self_draft", {}), *spec_rows]
               if r.get("proposer", "self_draft") == "self_draft" and "acceptance" in r]
        add(key, "self-draft acceptance", min(acc) if acc else None, "== 1.0", min(acc) == 1.0 if acc else None)
        bar = TARGETS["floor_8b" if key == "8b" else "floor_1b"]
        b1 = next((r for r in sec.get("plain", {}).get("rows", []) if r["batch"] == 1), {})
        frac = b1.get("floor_fraction")
        add(key, "plain batch 1 decoding / bandwidth floor", frac, f">= {bar}", None if frac is None else frac >= bar)
        ratio = sec.get("verify", {}).get("ratio")
        add(key, "verify 5 tokens / decode step, batch 1", ratio,
            f"<= {TARGETS['verify_ratio']}" if key == "8b" else "(8b only)",
            None if ratio is None or key != "8b" else ratio <= TARGETS["verify_ratio"])
        top = next((r for r in sec.get("vendor", {}).get("rows", []) if r["batch"] == top_batch), {})
        inv = top.get("invariant_over_vendor")
        add(key, f"invariant / vendor kernels, batch {top_batch} decoding", inv, f">= {TARGETS['vendor_ratio']}",
            None if inv is None else inv >= TARGETS["vendor_ratio"])
        eager, eng = sec.get("transformers_eager", {}).get("tok_s"), b1.get("tok_s")
        r = round(eng / eager, 2) if eager and eng else None
        add(key, "engine / transformers eager, batch 1 tok/s", r, f">= {TARGETS['eager_ratio']}",
            None if r is None else r >= TARGETS["eager_ratio"])
    return out


VERDICT = {True: "met", False: "MISSED", None: "n/a"}


def table_lines(report: dict) -> list[tuple[str, ...]]:
    """One line per measurement; a line that a target judges carries its bar and verdict."""
    lines = [("all", "copy bandwidth (read + write)", f"{report.get('copy_bandwidth_gb_s')} GB/s", "", "")]
    checks = {(t["shape"], t["target"].split(" ")[0]): t for t in report.get("targets", [])}

    def judged(key, first_word):
        t = checks.get((key, first_word))
        return ("", "") if t is None else (t["bar"], VERDICT[t["met"]])

    for key, s in report["shapes"].items():
        sec = s["sections"]
        lines.append((key, "weights; bandwidth floor at batch 1", f"{s.get('weight_bytes', 0) / 1e9:.2f} GB; "
                      f"{s.get('floor_tok_s')} tok/s", "", ""))
        for name in SECTIONS:
            r = sec.get(name, {})
            if r.get("status") not in (None, "ok"):
                lines.append((key, f"section {name}", f"{r['status']}: {r.get('error', '')}"[:100], "", ""))
        for row in sec.get("plain", {}).get("rows", []):
            text = f"{row['tok_s']} tok/s ({row['decode_tok_s']} decoding), {row['step_ms']} ms a step"
            if "forward_graph_ms" in row:
                text += f" (its forward's graph {row['forward_graph_ms']} ms)"
            if row["batch"] == 1:
                lines.append((key, "plain batch 1", f"{text}; {row.get('floor_fraction')} of the floor",
                              *judged(key, "plain")))
            else:
                lines.append((key, f"plain batch {row['batch']}", text, "", ""))
        kern = sec.get("kernels", {})
        if "layer_linears_ms_m1" in kern:
            lines.append((key, "one layer's linears, 1 / 64 rows (graphed)",
                          f"{kern['layer_linears_ms_m1']} / {kern['layer_linears_ms_m64']} ms; cuBLAS "
                          f"{kern['vendor_layer_linears_ms_m1']} / {kern['vendor_layer_linears_ms_m64']} ms; all "
                          f"invariant: {kern['all_invariant']}", "", ""))
        v = sec.get("verify", {})
        if "ratio" in v:
            lines.append((key, "verify 5 tokens / decode step, batch 1",
                          f"{v['ratio']} ({v['verify_ms']} / {v['decode_ms']} ms)", *judged(key, "verify")))
        for row in sec.get("speculation", {}).get("rows", []):
            text = row.get("error") or (f"{row['tok_s']} tok/s ({row.get('vs_plain')}x plain), "
                                        f"acceptance {row.get('acceptance')}")
            lines.append((key, f"speculation on, {row['proposer']}, batch 1", text[:100],
                          *(judged(key, "self-draft") if row["proposer"] == "self_draft" else ("", ""))))
        ident = sec.get("identity", {})
        for name, run in ident.get("runs", {}).items():
            ok = run.get("identical") == ident["prompts"]
            text = run.get("error") or f"{run['identical']}/{ident['prompts']} identical" + (
                "" if ok else f", first differing tokens {run['first_diff']}")
            if "acceptance" in run:
                text += f", acceptance {run['acceptance']}"
            lines.append((key, f"identity {name}", text[:100], "", "" if ok else "MISSED"))
        for name, why in ident.get("skipped", {}).items():
            lines.append((key, f"identity {name}", f"skipped: {why}"[:100], "", "n/a"))
        if ident:
            t = checks.get((key, "identity:"))
            if t is not None:
                lines.append((key, "identity, all runs", str(t["value"]), t["bar"], VERDICT[t["met"]]))
        e = sec.get("transformers_eager", {})
        if "tok_s" in e:
            t = checks.get((key, "engine"))
            lines.append((key, "transformers eager generate, batch 1",
                          f"{e['tok_s']} tok/s; the engine's {t['value'] if t else None}x", *judged(key, "engine")))
        for row in sec.get("vendor", {}).get("rows", []):
            lines.append((key, f"vendor kernels, batch {row['batch']}", f"{row['decode_tok_s']} tok/s decoding; "
                          f"invariant / vendor {row.get('invariant_over_vendor')}",
                          *(judged(key, "invariant") if row["batch"] != 1 else ("", ""))))
    return lines


def print_table(report: dict, stream) -> None:
    head = ("shape", "measurement", "value", "target", "result")
    lines = table_lines(report)
    widths = [max(len(h), *(len(line[i]) for line in lines)) for i, h in enumerate(head)]
    print(file=stream)
    print("| " + " | ".join(h.ljust(w) for h, w in zip(head, widths)) + " |", file=stream)
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|", file=stream)
    for line in lines:
        print("| " + " | ".join(c.ljust(w) for c, w in zip(line, widths)) + " |", file=stream)
    env = report["environment"]
    print(f"\n{env.get('gpu', env['device'])}, {env['dtype']}, torch {env['torch']}, transformers "
          f"{env['transformers']}, triton {env['triton']}; {report['elapsed_s']} s of a {report['budget_s']} s budget"
          f"{' (smoke: tiny shapes, the targets mean nothing)' if report['smoke'] else ''}. Random weights: the draft "
          "model and the EAGLE-3 head rarely agree with the target, so their acceptance is near 0.", file=stream)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", help="write the JSON here (also after every section)")
    ap.add_argument("--json", action="store_true", help="print the JSON to stdout (the table goes to stderr)")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes and few tokens: a CPU checks the script")
    ap.add_argument("--device", default=None, help="cuda, cuda:N or cpu [default: cuda; cpu with --smoke]")
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"])
    ap.add_argument("--shapes", default="1b,8b", help="comma-separated: 1b, 8b")
    ap.add_argument("--budget-s", type=float, default=None, help="the whole run's time [default: 280; 120 smoke]")
    ap.add_argument("--share-1b", type=float, default=0.4, help="the 1B shape's share of the budget (8B: the rest)")
    ap.add_argument("--logit-std", type=float, default=3.0, help="std of the random target's logits over the vocab")
    ap.add_argument("--work-dir", help="where the random models are written [default: a temp folder, removed]")
    ap.add_argument("--keep", action="store_true", help="keep the random models")
    ap.add_argument("--skip", default="", help="comma-separated sections to leave out: " + ", ".join(SKIPPABLE))
    ap.add_argument("--min-shape-s", type=float, default=None,
                    help="skip a shape given less time than this [default: 60; 0 with --smoke]")
    ap.add_argument("--threads", type=int, default=None, help="CPU threads [default: torch's; 1 with --smoke]")
    args = ap.parse_args()
    args.device = args.device or ("cpu" if args.smoke else "cuda")
    args.skip = {x.strip() for x in args.skip.split(",") if x.strip()}
    if args.skip - set(SKIPPABLE):
        ap.error(f"--skip takes {', '.join(SKIPPABLE)}")
    if args.min_shape_s is None:
        args.min_shape_s = 0.0 if args.smoke else 60.0
    budget = args.budget_s or (120.0 if args.smoke else 280.0)
    clock = Clock(budget)
    sizes = SMOKE_SIZES if args.smoke else Sizes()
    shapes = SMOKE_SHAPES if args.smoke else SHAPES
    keys = [k.strip() for k in args.shapes.split(",") if k.strip()]
    for k in keys:
        if k not in shapes:
            ap.error(f"unknown shape {k!r}; use {', '.join(shapes)}")
    temp = None
    if args.work_dir is None:
        temp = args.work_dir = tempfile.mkdtemp(prefix="bench_gpu_", dir=memory_folder())
    threads = args.threads or (1 if args.smoke else None)
    if threads:  # tiny models gain nothing from threads, and a busy CPU makes their barriers spin
        torch.set_num_threads(threads)

    report = {"script": "scripts/bench_gpu.py", "smoke": args.smoke, "budget_s": budget, "elapsed_s": 0.0,
              "seed": SEED, "logit_std": args.logit_std, "sizes": sizes.__dict__, "environment": {},
              "copy_bandwidth_gb_s": None, "shapes": {}, "targets": []}

    def save():
        report["elapsed_s"] = round(clock.now(), 1)
        report["targets"] = targets(report)
        if args.out:
            tmp = Path(args.out).with_suffix(".tmp")
            tmp.write_text(json.dumps(report, indent=2))
            tmp.replace(args.out)

    try:
        report["environment"] = environment(args)
        clock.log(f"{report['environment']}")
        try:
            report["copy_bandwidth_gb_s"] = round(copy_bandwidth_gbs(args.device, sizes.copy_mb), 1)
            clock.log(f"copy bandwidth {report['copy_bandwidth_gb_s']} GB/s")
        except Exception as e:  # noqa: BLE001
            report["copy_bandwidth_error"] = f"{type(e).__name__}: {one_line(e)}"
        save()
        for i, key in enumerate(keys):
            left = budget - clock.now()
            share = args.share_1b if (key == "1b" and len(keys) > 1 and i == 0) else 1.0 / (len(keys) - i)
            deadline = clock.now() + left * share
            bench = ShapeBench(key, shapes[key], args, sizes, clock, deadline, report, save)
            if report["copy_bandwidth_gb_s"]:
                bench.out["copy_bandwidth_gb_s"] = report["copy_bandwidth_gb_s"]
            bench.run()
            save()
    finally:
        save()
        if temp and not args.keep:
            shutil.rmtree(temp, ignore_errors=True)
    print_table(report, sys.stderr if args.json else sys.stdout)
    if args.json:
        print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
