"""The engine: in-flight batching over a paged KV cache, with gated speculative decoding.

Each step admits waiting requests while the block pool holds their prompts (reusing cached prefix blocks,
block_manager.py), prefills up to prefill_chunk prompt tokens (a long prompt takes several steps: chunked
prefill), then runs one decode iteration over every request already prefilled: the planner (draft_plan.py)
picks each row's number of drafts from the cost model and the row's own acceptance, under the gate's load
ceiling; the proposer drafts for them, and one target forward verifies all rows at once, each with its own
number of drafts (0 for rows that don't speculate). Rows then advance by their own accepted count.
"""

from __future__ import annotations

import contextlib
import dataclasses
import heapq
import sys
import threading
import time
from collections import Counter, defaultdict, deque
from pathlib import Path
from typing import Callable, Sequence

import torch

from pipeline.draft_spec import DraftSpec, parse_draft
from pipeline.engine import gpu_kernels
from pipeline.engine.block_manager import BlockManager
from pipeline.engine.config import EngineConfig
from pipeline.engine.cuda_graphs import GraphedForward
from pipeline.engine.device import is_cuda, kv_pool_blocks
from pipeline.engine.guide import Guide, GuideSpec, apply_refusals, tokenizer_for
from pipeline.engine.kv_cache import ForwardBatch, blocks_for
from pipeline.engine.logit_rules import adjust
from pipeline.engine.logprobs import TokenLogprob, token_logprobs
from pipeline.engine.model import Transformer, choose_kernels
from pipeline.engine.proposers import DraftModelProposer, NgramFirst, NgramProposer, Proposer
from pipeline.engine.request import FinishReason, Request, RequestStatus, TokenCallback
from pipeline.engine.sampling import SamplingParams, probs_from_logits
from pipeline.engine.speculative import accept_greedy, accept_keyed, accept_sampled
from pipeline.engine.stats import EngineStats
from pipeline.engine.stop_strings import Detokenize, StopStrings
from pipeline.errors import ConfigError, DraftMismatchError, RequestError, one_line
from pipeline.policy.cost_model import CostModel, default_cost_model
from pipeline.policy.draft_plan import (ACCEPTANCE, COST, EMPTY, EXPLORE_EVERY, MEMORY, PROPOSER_FAILED, Row,
                                        SharedAcceptance, plan_drafts)
from pipeline.policy.gate import SpeculationGate
from pipeline.policy.sampling_limits import check_logit_bias, check_num_draft_tokens

# Beside other clients' requests, a group of choices (one client's n) adds rows to a step only while the step stays
# within this factor of the others' step alone (_fair_rows). On 2 cores (scripts/front_door.py case 1: a greedy
# request beside 16 sampled choices), half the slots' rows made its steps 1.9x as long as alone and the request
# 2.2x; 1.25 leaves the group 2 rows there, the steps 1.5x and the request 1.95x (the group's rows a second
# 155 -> 96 while such requests come back to back; alone it takes all 8).
FAIR_STEP_GROWTH = 1.25
# When a request ends beside a group holding more slots, its slot waits this many steps for the next request of a
# smaller group before the larger group takes it back (_admit). Without it every back-to-back request of a client
# beside one client's n choices preempted a choice, whose return was a step of 7 rows and a prefill (52-70 ms against
# 13-16 for the steps beside the request) that the next request arrived into: about a quarter of its time.
FAIR_HOLD_STEPS = 4


class LLMEngine:
    def __init__(self, model: Transformer, config: EngineConfig, proposer: Proposer | None = None,
                 eos_token_ids: tuple[int, ...] = (), cost_model: CostModel | None = None):
        self.model, self.config, self.proposer = model, config, proposer
        for module in (model, getattr(proposer, "model", None), getattr(proposer, "head", None)):
            if module is not None:  # the target, a draft model, an EAGLE-3 head: one kernel choice for all
                choose_kernels(module, config.gpu_kernels)
        # A model measured for fewer drafts than this engine may take can't price them: use the default.
        if cost_model is None or cost_model.max_drafts < config.num_draft_tokens:
            cost_model = default_cost_model(config.num_draft_tokens, config.max_batch_size,
                                            proposer.name if proposer is not None else "")
        self.cost_model = cost_model
        self.eos_token_ids = tuple(eos_token_ids)
        probe = model.new_cache(0, config.max_seq_len, num_blocks=0)  # a block's size, before sizing the pool
        # An EAGLE-3 head reads the target's hidden states of every token. A cached prefix skips the target's
        # forward over it, so its states are kept beside its K/V, block for block.
        capture = getattr(proposer, "capture_layers", ())
        state_bytes = probe.block_size * len(capture) * model.cfg.hidden_size * model.embed.weight.element_size()
        num_blocks = self._pool_blocks(config, probe.bytes_per_block(), state_bytes, probe.block_size)
        self.cache = model.new_cache(config.max_batch_size, config.max_seq_len, num_blocks=num_blocks)
        self.blocks = BlockManager(num_blocks, self.cache.block_size, config.prefix_caching)
        self.states = (torch.zeros(num_blocks + 1, self.cache.block_size, len(capture) * model.cfg.hidden_size,
                                   dtype=model.embed.weight.dtype, device=config.device) if capture else None)
        # Decode and verify forwards from CUDA graphs, on a GPU running the invariant kernels: a padded replay
        # gives a row the bits an eager forward does (cuda_graphs.py). Under a CPU test, the same static buffers
        # run eagerly.
        self.graphed: GraphedForward | None = None
        self.graph_error: str | None = None  # why no step replays a graph, where a capture failed
        if model.cfg.moe is not None and config.cuda_graphs and gpu_kernels.runs_here(model.embed.weight):
            # Each expert runs on the tokens that picked it: a launch per expert hit, decided on the host from the
            # router's output, which a graph of fixed launches can't hold.
            self.graph_error = "mixture-of-experts layers route tokens on the host: steps run eagerly"
        elif config.cuda_graphs and config.gpu_kernels == "invariant" and gpu_kernels.runs_here(model.embed.weight):
            replay, width = model.embed.weight.is_cuda, config.num_draft_tokens + 1
            try:
                with self._on_device():  # captured on the engine's GPU
                    self.graphed = GraphedForward(model, self.cache, config.max_batch_size, width, capture,
                                                  replay=replay)
                    self.graphed.capture()
                    if hasattr(proposer, "capture_graphs"):  # a draft model's or an EAGLE-3 head's steps
                        proposer.capture_graphs(config.max_batch_size, width, replay)
            except Exception as err:  # noqa: BLE001  slower without graphs, and as lossless: the same kernels run
                self.graphed = None
                if hasattr(proposer, "capture_graphs"):
                    proposer.graphed = None
                self.graph_error = f"CUDA graph capture failed, steps run eagerly: {one_line(err)}"
                print(self.graph_error, file=sys.stderr)
        self.gate = SpeculationGate(config.gate)
        self.stats = EngineStats()
        self._iteration = 0  # steps so far, as Request.decoded_at counts them
        self._ended_beside_larger = -FAIR_HOLD_STEPS  # the step a request last ended beside a larger group (_admit)
        self._yielded_to_prompts = -2  # the step whose decoding rows last sat out beside prompts (_fair_rows)
        # Per draft source, what first drafts of greedy "auto" requests achieved lately: each greedy request's prior
        # (draft_plan.SharedAcceptance)
        self.shared_acceptance: defaultdict[str, SharedAcceptance] = defaultdict(SharedAcceptance)
        self._explored_at = -EXPLORE_EVERY  # the step a row skipped for cost was last probed (_plan)
        self.free_slots = list(range(config.max_batch_size))  # a heap: lowest slots first keeps the batch contiguous
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        # Running requests per group (group_key), kept with `running` (_run, _unrun): the fair scheduling reads it at
        # every admission and every end, and counting `running` each time was quadratic in the batch (at 512 rows,
        # a third of a tiny model's step).
        self._held: Counter = Counter()
        self._queue_lock = threading.Lock()  # guards `waiting`; add_request never waits for a step
        self._step_lock = threading.RLock()  # held for a whole step; cancel waits for the step to end
        # Token ids -> the answer's text, as the client will see it: needed for stop strings (set by whoever
        # holds the tokenizer: the Triton model, `pipeline generate`).
        self.detokenize: Detokenize | None = None
        # The Hugging Face tokenizer, for guided decoding (set by whoever holds it, as detokenize is); its
        # llguidance tokenizer is made on the first guided request and kept.
        self.tokenizer = None
        self._guide_tokenizer = None

    def _on_device(self) -> contextlib.AbstractContextManager:
        """The engine's GPU as the calling thread's current device: Triton launches its kernels, and CUDA makes
        streams and graphs, on the current device, not on their tensors' (a thread's current device is its own)."""
        device = torch.device(self.config.device)
        return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()

    @staticmethod
    def _pool_blocks(config: EngineConfig, kv_bytes: int, state_bytes: int, block_size: int) -> int:
        """The target's KV pool in blocks: kv_cache_bytes' worth; else, on a GPU, gpu_memory_fraction of the memory
        free now that the weights (and a draft's own cache) are loaded, capped at max_batch_size requests of
        max_seq_len; else (a CPU) exactly that many."""
        if config.kv_cache_bytes is not None:
            num_blocks = config.kv_cache_bytes // kv_bytes
            if num_blocks < 1:
                raise ConfigError(f"kv_cache_bytes {config.kv_cache_bytes} holds no KV block ({kv_bytes} bytes "
                                  f"each); raise it")
            return num_blocks
        if not is_cuda(config.device):
            return config.max_batch_size * blocks_for(config.max_seq_len)
        torch.cuda.empty_cache()  # what loading freed into torch's allocator is free for the pool too
        free, _ = torch.cuda.mem_get_info(torch.device(config.device))
        # The EAGLE-3 states of a block live and die with its K/V: the pool's blocks pay for both.
        return kv_pool_blocks(free, kv_bytes + state_bytes, block_size=block_size,
                              max_batch_size=config.max_batch_size, max_seq_len=config.max_seq_len,
                              fraction=config.gpu_memory_fraction)

    @classmethod
    def load(cls, target: str | Path, config: EngineConfig, draft: DraftSpec | str | Path | None = None,
             eos_token_ids: tuple[int, ...] = (), cost_model: CostModel | None = None) -> "LLMEngine":
        """target: a HF folder. draft: a DraftSpec, or its --draft spelling (none, ngram, eagle3:FOLDER for an
        EAGLE-3 head, or a draft model's HF folder); None for none."""
        from pipeline.engine.weights import load_transformer

        spec = draft if isinstance(draft, DraftSpec) else parse_draft(draft)
        if spec.kind == "eagle3" and spec.path is None:
            raise ConfigError("the engine needs the EAGLE-3 head's folder: --draft eagle3:DIR")
        dtype, device = config.torch_dtype, config.device
        model = load_transformer(target, config.max_seq_len, dtype, device, keep_plain=False, lm_head=config.lm_head)
        proposer: Proposer | None = None
        if spec.kind == "ngram":
            proposer = NgramProposer()
        elif spec.kind == "eagle3":
            from pipeline.engine.eagle3 import Eagle3Proposer, load_eagle3_head

            head = load_eagle3_head(spec.path, model.cfg, config.max_seq_len, dtype, device)
            proposer = Eagle3Proposer(head, model, config.max_batch_size, config.max_seq_len)
            if config.ngram_first:
                proposer = NgramFirst(proposer)
        elif spec.kind == "model":
            draft_model = load_transformer(spec.path, config.max_seq_len, dtype, device, keep_plain=False,
                                           lm_head=config.lm_head)
            if draft_model.cfg.vocab_size != model.cfg.vocab_size:
                raise DraftMismatchError(
                    f"draft vocabulary ({draft_model.cfg.vocab_size}) differs from the target's "
                    f"({model.cfg.vocab_size}); use a draft from the same model family, or --draft ngram")
            proposer = DraftModelProposer(draft_model, config.max_batch_size, config.max_seq_len)
        return cls(model, config, proposer, eos_token_ids or model.cfg.eos_token_ids, cost_model=cost_model)

    def describe(self) -> dict:
        """What runs, for reports and `pipeline generate --json`: the device, the target's (and a draft model's)
        dtype, weight format and kernels, the proposer, and the target's KV pool (trash block included)."""
        desc = {"device": str(self.config.device), "target": self.model.describe(),
                "proposer": self.proposer.name if self.proposer else None,
                "kv_cache": {"blocks": self.blocks.num_blocks, "block_size": self.cache.block_size,
                             "bytes": self.cache.nbytes()}}
        if self.graphed is not None:  # decode and verify steps replayed from CUDA graphs (or their static path)
            desc["cuda_graphs"] = {"batch_buckets": list(self.graphed.buckets), "widths": self.graphed.max_width,
                                   "graphs": len(self.graphed.graphs), "replayed": self.graphed.replay}
            drafting = getattr(self.proposer, "graphed", None)
            if drafting is not None:  # a draft model's or an EAGLE-3 head's steps
                desc["cuda_graphs"]["draft_graphs"] = len(drafting.graphs)
        elif self.graph_error is not None:
            desc["cuda_graphs"] = {"error": self.graph_error}
        if isinstance(self.proposer, DraftModelProposer):
            desc["draft"] = self.proposer.model.describe()
        elif hasattr(self.proposer, "head"):  # an EAGLE-3 head, alone or behind n-gram lookup
            head = self.proposer.head.cfg
            desc["draft"] = {"kind": "eagle3", "layout": head.layout, "aux_layers": list(head.aux_layer_ids),
                             "draft_vocab_size": head.draft_vocab_size,
                             "dtype": str(self.proposer.head.fc.weight.dtype).removeprefix("torch."),
                             "layer": self.proposer.head.kernel_name()}
            if isinstance(self.proposer, NgramFirst):  # rows drafted by lookup and by the head so far
                desc["draft"]["ngram_first"] = dict(self.proposer.sources)
        return desc

    # ---- requests -------------------------------------------------------------------------

    def add_request(self, prompt_ids: list[int], params: SamplingParams, *, speculation: str = "auto",
                    on_tokens: TokenCallback | None = None, num_draft_tokens: int | None = None,
                    group: int | None = None, guide: Guide | None = None, resume: Sequence[int] = (),
                    ahead: bool = False) -> Request:
        """Queue a request; it joins the running batch at the next step. Requests of one `group` (a client request's
        n choices) share the slots fairly with other groups (_admit). `guide`: params.guide already compiled
        (compile_guide), else it is compiled here. `resume`: the answer's tokens a client already has, from a run
        that was cut off (a restart): they are its output so far, counted by max_tokens, the penalties, min_tokens
        and the guide, and only the tokens after them are made and sent; a seeded request then goes on exactly as the
        first run would have (sampling.sample_keyed). A resumed request, or one sent `ahead` (a client's retry of a
        request a lost server held before any of its answer came), queues ahead of the new requests: it was admitted
        once already. Thread-safe."""
        max_len = self.config.max_seq_len
        resume = list(resume)
        if len(prompt_ids) + len(resume) >= max_len:
            raise RequestError(f"prompt is {len(prompt_ids)} tokens" + (f" + {len(resume)} resumed" if resume else "")
                               + f" but the engine's max_seq_len is {max_len}; shorten the prompt or raise "
                               "max_seq_len")
        if blocks_for(len(prompt_ids) + len(resume) + 1) > self.blocks.num_blocks:
            raise RequestError(f"prompt is {len(prompt_ids) + len(resume)} tokens but the KV cache holds "
                               f"{self.blocks.num_blocks * self.cache.block_size}; shorten the prompt or raise "
                               f"kv_cache_bytes")
        if num_draft_tokens is not None:
            check_num_draft_tokens(num_draft_tokens, self.config.num_draft_tokens)
        vocab = self.model.cfg.vocab_size
        if any(not 0 <= t < vocab for t in prompt_ids):
            raise RequestError(f"prompt has token ids outside the vocabulary [0, {vocab}); check the tokenizer")
        if any(not 0 <= t < vocab for t in resume):
            raise RequestError(f"resume has token ids outside the vocabulary [0, {vocab}); send the answer's own ids")
        if len(resume) >= params.max_tokens:
            raise RequestError(f"resume holds {len(resume)} tokens and max_tokens is {params.max_tokens}: nothing is "
                               "left to make; send the answer's first run's max_tokens, or don't resume a finished one")
        req = Request(list(prompt_ids), params, speculation=speculation, on_tokens=on_tokens,
                      num_draft_tokens=num_draft_tokens, group=group, shared_acceptance=self.shared_acceptance,
                      output_ids=resume, num_resumed=len(resume), ahead=bool(resume) or ahead,
                      logprobs=[None] * len(resume) if params.logprobs is not None else [])
        # ignore_eos: the model's end tokens are just tokens (a guide's grammar still ends the answer at one).
        eos = () if params.ignore_eos and params.guide is None else self.eos_token_ids
        req.stop_ids = frozenset(params.stop_token_ids) | frozenset(eos)
        if (ended := next((t for t in resume if t in req.stop_ids), None)) is not None:
            raise RequestError(f"resume holds the stop token {ended}: that answer had ended; send the tokens before it")
        if params.logit_bias:
            check_logit_bias(params.logit_bias, vocab)
        if params.stop:
            if self.detokenize is None:
                raise RequestError("stop strings need the engine's tokenizer (LLMEngine.detokenize); send stop "
                                   "token ids instead")
            req.stop_strings = StopStrings(params.stop, self.detokenize)
        if params.guide is not None:
            if guide is not None and guide.spec != params.guide:
                raise ValueError("add_request: the compiled guide isn't the one params.guide names")
            req.guide = guide or self.compile_guide(params.guide)
            if resume and req.guide.valid_prefix(resume) < len(resume):
                raise RequestError(f"resume holds tokens its guide refuses ({params.guide.type}): send the answer "
                                   "this guide made")
            req.guide.advance(resume, req.stop_ids)
        with self._queue_lock:
            if req.ahead:  # behind the others sent ahead, and preempted ones (serving_gate.queue_is_full)
                at = next((i for i, r in enumerate(self.waiting) if not (r.ahead or r.output_ids)), len(self.waiting))
                self.waiting.insert(at, req)
            else:
                self.waiting.append(req)
        return req

    def compile_guide(self, spec: GuideSpec) -> Guide:
        """A request's guide, compiled and checked (RequestError for one that can't be followed). A large grammar
        takes a while: a server that steps the engine on one thread compiles on another and hands the Guide to
        add_request, so the compile doesn't stall every running request's steps."""
        return Guide(spec, self.guide_tokenizer(), self.model.cfg.vocab_size)

    def guide_tokenizer(self):
        """llguidance's view of the engine's tokenizer, made once (about a second)."""
        if self._guide_tokenizer is None:
            if self.tokenizer is None:
                raise RequestError("guided decoding needs the engine's tokenizer (LLMEngine.tokenizer); send the "
                                   "request without a guide, or load the engine with its tokenizer")
            self._guide_tokenizer = tokenizer_for(self.tokenizer, self.eos_token_ids)
        return self._guide_tokenizer

    def cancel(self, req: Request) -> None:
        """Stop a request and free its slot (after the step in progress, if any). Thread-safe."""
        with self._step_lock:
            with self._queue_lock:
                if req in self.waiting:
                    self.waiting.remove(req)
            if not req.finished:
                self._finish(req, FinishReason.CANCELLED)
                if req.on_tokens:
                    req.on_tokens(req, [])

    def has_unfinished(self) -> bool:
        return bool(self.running or self.waiting)

    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams], *,
                 speculation: str = "auto", on_tokens: TokenCallback | None = None) -> list[Request]:
        """Decode all prompts as one in-flight batch, to completion."""
        plist = params if isinstance(params, list) else [params] * len(prompts)
        reqs = [self.add_request(p, sp, speculation=speculation, on_tokens=on_tokens) for p, sp in zip(prompts, plist)]
        while not all(r.finished for r in reqs):
            self.step()
        return reqs

    # ---- one iteration ----------------------------------------------------------------------

    def step(self) -> list[Request]:
        """Run one engine iteration; return the requests that finished in it."""
        with self._step_lock, self._on_device():
            t0 = time.perf_counter()
            finished: list[Request] = []
            decoding = [r for r in self.running if not r.prefilling]
            self._admit()
            chunks = self._prefill_chunks()
            prefilling = Counter()
            for r, n in chunks:
                prefilling[r.group_key] += n
            decoding = self._fair_rows([r for r in decoding if r.status is RequestStatus.RUNNING],  # _admit may
                                       prefilling)  # give some back
            if chunks:
                self._prefill(chunks, finished)
            if decoding:
                self._decode(decoding, finished)
            if chunks or decoding:
                self.stats.step_time_s += time.perf_counter() - t0
            return finished

    def _admit(self) -> None:
        """Waiting requests join while a batch slot is free and the pool holds their tokens. Next is the oldest
        request of the group holding the fewest slots (requests of no group are groups of one: first come, first
        served). A group holding at least two slots more than that one gives its newest back, to resume later (as
        _reserve's preemption): one client's n choices would otherwise hold every slot for a whole answer while
        the next client waits. With nobody waiting a group takes every slot, but the slot of a request that ended
        beside a larger group waits FAIR_HOLD_STEPS steps for a smaller group's next request first."""
        with self._queue_lock:
            held = self._held
            while self.waiting:
                req = self._least_served()
                if held[req.group_key] and held[req.group_key] == max(held.values()) and self._holding_slot():
                    break  # the largest group waits: the slot is held for the next request of a smaller one
                if self.free_slots and self.blocks.admit(req.blocks, req.all_ids, lookup=not req.scoring):
                    # all_ids: a preempted request resumes with its output so far
                    self.waiting.remove(req)
                    req.slot = heapq.heappop(self.free_slots)
                    req.status = RequestStatus.RUNNING
                    req.target_len = req.num_cached_tokens = req.blocks.cached_tokens
                    req.prefill_target = req.num_tokens
                    self._run(req)
                    continue
                hog = self._newest_of_largest_group()
                if hog is None or held[hog.group_key] < held[req.group_key] + 2:
                    break
                self._preempt(hog, queued=True)

    def _least_served(self) -> Request:
        """The first waiting request of the group holding the fewest slots (first come, first served among them): the
        scan stops at the first one whose group holds none."""
        best, fewest = None, None
        for r in self.waiting:
            n = self._held[r.group_key]
            if fewest is None or n < fewest:
                best, fewest = r, n
                if n == 0:
                    break
        return best

    def _run(self, req: Request) -> None:
        self.running.append(req)
        self._held[req.group_key] += 1

    def _unrun(self, req: Request) -> None:
        self.running.remove(req)
        key = req.group_key
        self._held[key] -= 1
        if not self._held[key]:
            del self._held[key]  # a group of one's key is never seen again: don't keep it

    def _holding_slot(self) -> bool:
        """Whether a slot freed beside a larger group still waits for a smaller group's next request: the
        FAIR_HOLD_STEPS steps after one ended (read in a step before _fair_rows counts it)."""
        return self._iteration - self._ended_beside_larger < FAIR_HOLD_STEPS

    def _newest_of_largest_group(self) -> Request | None:
        """The running request to give back first: the newest of the group holding the most slots (the newest of
        all when every group holds one)."""
        return max(reversed(self.running), key=lambda r: self._held[r.group_key], default=None)

    def _fair_rows(self, decoding: list[Request], prefilling: Counter) -> list[Request]:
        """The rows that decode this step. Beside smaller groups' rows or prefill (`prefilling`: the prompt tokens
        this step reads, by group) a group decodes only as many rows as keep the step within FAIR_STEP_GROWTH of
        the smaller ones' step alone, by the engine's cost model, and at least as many as the largest of them,
        those that waited longest: a request beside one client's many choices then steps nearly as fast as alone.
        Where rows cost nothing (a bandwidth-bound GPU) the group keeps every row; on a compute-bound CPU it
        yields most. Groups of one size never hold each other back. Skipping a step changes no row's output (the
        tests run every batch shape)."""
        # While a slot waits for a smaller group's next request (_admit), the group steps as if that request were
        # already beside it: the request then arrives to a short step, not one of all the group's rows.
        expected = [0] if self._holding_slot() else []
        self._iteration += 1
        rows = decoding
        held = Counter(r.group_key for r in rows)
        load = held + Counter(set(prefilling))  # a prefill chunk counts as one row
        caps = {}
        for g, n in held.items():
            if n == 1:  # at least one row each: a group of one never yields (and most requests are one)
                continue
            below = [h for h in load if h != g and held[h] < n]
            if below or expected:
                # The others' rows by their contexts (a prefill chunk as one short row); this group's in the order
                # they would be kept: those that waited longest first.
                others = [r.target_len for r in rows if r.group_key in below] + \
                    [0] * sum(1 for h in below if h in prefilling) or expected
                mine = sorted((r for r in rows if r.group_key == g), key=lambda r: r.decoded_at)
                # never fewer rows than a group it yields to: a client of 5 choices beside one of 3 keeps 3
                cap = max(self._rows_beside(others, [r.target_len for r in mine]),
                          max((held[h] for h in below), default=1))
                if n > cap:
                    caps[g] = {id(r) for r in mine[:cap]}
        rows = [r for r in rows if r.group_key not in caps or id(r) in caps[r.group_key]]
        if self._yields_to_prompts(rows, held, prefilling):
            rows = []
        self.stats.rows_held_back += len(decoding) - len(rows)
        for r in rows:
            r.decoded_at = self._iteration
        return rows

    def _yields_to_prompts(self, rows: list[Request], held: Counter, prefilling: Counter) -> bool:
        """Whether this step's decoding rows sit out beside smaller groups' prompts. Their decode is a second
        forward after the prompts' (_prefill, then _decode): a whole pass over the weights, which doubled a short
        request's first step beside one client's many choices (34 ms against 15). They do when every decoding row
        is a larger group's (a request of its own never waits), the pass would grow the step by more than
        FAIR_STEP_GROWTH allows, and they didn't sit out the step before (a long prompt's chunks don't starve
        them). `held`: every decoding row's group, before the caps."""
        smallest = min((held[r.group_key] for r in rows), default=0)
        if smallest < 2 or self._iteration - self._yielded_to_prompts <= 1:
            return False
        smaller = sum(n for h, n in prefilling.items() if held[h] < smallest)
        cost = self.cost_model
        decode = cost.decode_s([r.target_len for r in rows])
        if not smaller or decode <= (FAIR_STEP_GROWTH - 1) * cost.step_s(smaller, 1):
            return False
        self._yielded_to_prompts = self._iteration
        return True

    def _rows_beside(self, others: list[int], mine: list[int]) -> int:
        """The most of a group's rows (`mine`: their contexts, in the order they're kept) that decode in a step
        beside other groups' rows (`others`: their contexts), by the cost model, context included: a row that has
        grown long costs a share of the step its table row doesn't show (cost_model.context_token_s)."""
        cost = self.cost_model
        limit = FAIR_STEP_GROWTH * cost.decode_s(others)
        rows = 1
        while rows < len(mine) and cost.decode_s(others + mine[: rows + 1]) <= limit:
            rows += 1
        return rows

    def _prefill_chunks(self) -> list[tuple[Request, int]]:
        """(request, prompt tokens to prefill now), oldest first, within the step's prefill_chunk tokens."""
        chunks, budget = [], self.config.prefill_chunk
        for r in self.running:
            if r.prefilling and budget > 0:
                n = min(r.prefill_target - r.target_len, budget)
                chunks.append((r, n))
                budget -= n
        return chunks

    def _prefill(self, chunks: list[tuple[Request, int]], finished: list[Request]) -> None:
        scoring = [c for c in chunks if c[0].scoring]
        if scoring and len(chunks) > 1:  # a row that wants every position's logits runs alone (see _score)
            rest = [c for c in chunks if not c[0].scoring]  # before: a row's last chunk ends its scoring
            for c in scoring:
                self._prefill([c], finished)
            if rest:
                self._prefill(rest, finished)
            return
        reqs = [r for r, _ in chunks]
        lengths = [n for _, n in chunks]
        starts = [r.target_len for r in reqs]
        feeds = [r.all_ids[s:s + n] for r, s, n in zip(reqs, starts, lengths)]
        T = max(lengths)
        try:
            ids = torch.tensor([f + [0] * (T - len(f)) for f in feeds], device=self.config.device)
            fb = ForwardBatch.paged([r.blocks.blocks for r in reqs], starts, lengths, self.cache, self.config.device)
            if scoring:  # [1, n]: every position's logits
                last = torch.arange(lengths[0], device=self.config.device)[None, :]
            else:
                last = torch.tensor(lengths, device=self.config.device)[:, None] - 1
            logits, hidden = self._target_forward(ids, fb, last)
            if scoring:
                self._score(reqs[0], starts[0], logits[0])
                logits = logits[:, -1:]
        except Exception as err:  # noqa: BLE001  find the row that breaks the batch; the others go on
            self._isolate(reqs, err, finished, lambda r: self._prefill([(r, lengths[reqs.index(r)])], finished))
            return
        logits = logits[:, 0]  # [B, V]
        greedy = logits.argmax(-1).tolist()
        for i, r in enumerate(reqs):
            try:
                if hidden is not None:
                    if starts[i] == r.num_cached_tokens and starts[i]:  # first chunk after a prefix hit
                        self.proposer.on_target_hidden(r, self._cached_states(r))
                    self.proposer.on_target_hidden(r, hidden[i, : lengths[i]])
                r.target_len = starts[i] + lengths[i]
                self.blocks.commit(r.blocks, r.all_ids, r.target_len)
                if r.prefilling:  # more chunks to come: no token yet
                    continue
                row = logits[i:i + 1]
                if r.params.adjusted:
                    row = adjust(row.cpu(), r.params, r.prompt_ids, r.output_ids, r.stop_ids)
                    greedy[i] = int(row[0].argmax())
                if r.guide is not None:  # the grammar's tokens only, after the penalties
                    row = apply_refusals(row.cpu(), r.guide.row_refusals([]))
                    greedy[i] = int(row[0].argmax())
                tok = greedy[i] if r.params.greedy else r.draw(probs_from_logits(row[0].cpu(), r.params), r.num_tokens)
                if r.guide is not None:
                    r.guide.advance([tok], r.stop_ids)
                self._emit(r, [tok], finished, self._logprobs(r, row, [tok]))
            except Exception as err:  # noqa: BLE001  one request's failure ends that request only
                self._fail(r, err, finished)
        self.stats.prefill_steps += 1
        self.stats.prefill_tokens += sum(lengths)

    def _score(self, req: Request, start: int, logits: torch.Tensor) -> None:
        """The prompt tokens this chunk's logits predict, with their log probs: logits [n, V], row j the distribution
        of token start + j + 1. Each row alone (token_logprobs), so a token's numbers don't depend on the chunk."""
        end = min(start + logits.shape[0], len(req.prompt_ids) - 1)  # the last row predicts the first new token
        if end <= start:
            return
        greedy = SamplingParams(logprobs=req.params.prompt_logprobs)  # raw logits: vLLM's prompt_logprobs
        req.prompt_logprobs += token_logprobs(logits[: end - start].float().cpu(),
                                              req.prompt_ids[start + 1: end + 1], greedy)

    def _cached_states(self, req: Request) -> torch.Tensor:
        """The target's captured states of a request's cached prefix: [num_cached_tokens, A]."""
        n = req.num_cached_tokens
        held = self.states[req.blocks.blocks[:blocks_for(n, self.cache.block_size)]]  # [blocks, BS, A]
        return held.reshape(-1, held.shape[-1])[:n]

    def draft_budget(self, req: Request) -> int:
        """Drafts this row may take: a step emits up to k+1 tokens, within max_tokens and max_seq_len."""
        room = min(req.remaining, self.config.max_seq_len - req.num_tokens) - 1
        k = self.config.num_draft_tokens
        if req.num_draft_tokens is not None:  # a request may ask for fewer, never more (add_request)
            k = min(k, req.num_draft_tokens)
        return max(0, min(k, room))

    def _decode(self, reqs: list[Request], finished: list[Request]) -> None:
        ks = self._plan(reqs) if self.proposer is not None else [0] * len(reqs)
        reqs, ks = self._reserve(reqs, ks, finished)
        if not reqs:
            return
        drafts: list[list[int]] = [[] for _ in reqs]
        q_rows: dict[int, torch.Tensor] = {}
        if self.proposer is not None:
            spec = [i for i, k in enumerate(ks) if k > 0]
            if spec:  # while no row drafts, no draft work runs at all
                t0 = time.perf_counter()
                try:
                    prop = self.proposer.propose([reqs[i] for i in spec], [ks[i] for i in spec])
                except Exception:  # noqa: BLE001  drafts are optional: these rows decode without them
                    # The proposer's state for these rows is now unknown, so they stop speculating
                    # for good. Their output is the target's either way: that is the lossless contract.
                    self.stats.proposer_failures += 1
                    for i in spec:
                        reqs[i].proposer_failed = True
                        self._skipped(reqs[i], PROPOSER_FAILED)
                        self.proposer.release(reqs[i])
                else:
                    self.stats.proposer_time_s += time.perf_counter() - t0
                    self.stats.proposals += 1
                    self.stats.proposed_tokens += sum(len(t) for t in prop.tokens)
                    for n, i in enumerate(spec):
                        drafts[i] = prop.tokens[n][: ks[i]]
                        if n in prop.stochastic_rows:
                            q_rows[i] = prop.probs[n]
                        elif reqs[i].guide is not None:  # cut at the first draft the grammar refuses (guide.py)
                            drafts[i] = drafts[i][: reqs[i].guide.valid_prefix(drafts[i])]
                            if not drafts[i] and prop.tokens[n]:  # no verify to report: roll the drafter back now
                                self.proposer.on_verified(reqs[i], reqs[i].num_tokens, 0, 0)
                        reqs[i].acceptance.proposed(bool(drafts[i]))
                        if not drafts[i]:  # an n-gram lookup that found nothing, say
                            self._skipped(reqs[i], EMPTY)
        t0 = time.perf_counter()
        self._verify(reqs, drafts, q_rows, finished)
        took = time.perf_counter() - t0
        self.stats.steps += 1
        if any(drafts):
            self.stats.spec_steps += 1
            self.stats.spec_verify_s += took
            self.stats.spec_verifies += 1
        else:
            self.stats.nonspec_steps += 1
            self.stats.plain_verify_s += took
            self.stats.plain_verifies += 1

    def _reserve(self, reqs: list[Request], ks: list[int], finished: list[Request]
                 ) -> tuple[list[Request], list[int]]:
        """Blocks for each row's pending token and drafts, oldest request first. Short of blocks, a row drafts
        nothing; still short, the newest request gives its blocks back and waits to resume (vLLM's preemption
        by recomputation: its prefix is likely still cached). Returns the rows that go on, and their drafts."""
        ks = list(ks)
        for i, r in enumerate(reqs):
            while not r.finished and r.status is RequestStatus.RUNNING:
                if self.blocks.grow(r.blocks, r.target_len + 1 + ks[i]):
                    break
                if ks[i]:
                    ks[i] = 0
                    self._skipped(r, MEMORY)
                    continue
                victim = self._newest_of_largest_group()
                if victim is r and len(self.running) == 1:
                    self._fail(r, RequestError(
                        f"the KV cache is full: this request alone holds all {self.blocks.num_blocks} blocks; "
                        f"raise kv_cache_bytes or lower max_tokens"), finished)
                    break
                self._preempt(victim)
        kept = [i for i, r in enumerate(reqs) if r.status is RequestStatus.RUNNING]
        return [reqs[i] for i in kept], [ks[i] for i in kept]

    def _preempt(self, req: Request, queued: bool = False) -> None:
        """Give req's blocks and slot back; it waits first in line to resume. `queued`: the caller holds the queue's
        lock."""
        self.stats.preemptions += 1
        self._unrun(req)
        self.blocks.free(req.blocks)
        heapq.heappush(self.free_slots, req.slot)
        if req.scoring:  # its prompt is scored again from the start, uncached: keep no half
            req.prompt_logprobs = []
        req.slot, req.target_len, req.status = None, 0, RequestStatus.WAITING
        if self.proposer is not None:
            self.proposer.release(req)
        with contextlib.nullcontext() if queued else self._queue_lock:
            self.waiting.appendleft(req)

    def _plan(self, reqs: list[Request]) -> list[int]:
        """Each row's drafts this step, under the gate's load ceiling; a row left out gets its reason."""
        load_open = self.gate.update(len(reqs))
        min_tokens = self.config.gate.min_tokens
        # A proposer with two sources (NgramFirst) names each row's this step: the row's estimate is that source's.
        # (Asked only for rows that may draft: under load, a lookup's scan of each context would be wasted.)
        row_sources = getattr(self.proposer, "row_sources", None)
        row_hits = getattr(self.proposer, "row_hits", None)
        known: dict[int, bool] = {}  # id(row) -> whether its proposer has drafts this step, where that is known
        if row_sources is not None or row_hits is not None:
            asked = [r for r in reqs if not r.proposer_failed
                     and (r.speculation == "on" or (r.speculation == "auto" and load_open))]
            for r, source in zip(asked, row_sources(asked) if row_sources is not None else ()):
                r.source = source
            for r, hit in zip(asked, row_hits(asked) if row_hits is not None else ()):
                if hit is not None:
                    known[id(r)] = hit
        free = getattr(self.proposer, "FREE_SOURCES", frozenset())
        rows = [Row(cap=0 if r.proposer_failed else self.draft_budget(r), acceptance=r.acceptance.first,
                    continuation=r.acceptance.continuation,
                    hit=float(known[id(r)]) if id(r) in known else r.acceptance.hit_rate, mode=r.speculation,
                    short=r.params.max_tokens < min_tokens, probe=r.acceptance.probe_due and known.get(id(r), True),
                    free=r.source in free)
                for r in reqs]
        plan = plan_drafts(rows, self.cost_model, load_open)
        # While the engine has little evidence of its drafts, a greedy row skipped for cost is probed every
        # EXPLORE_EVERY steps: the fixed prior may be too low for drafts to pay at this batch, and with no drafts
        # nobody would learn. (A sampled row's drafts consume its random stream: its steps follow its own history.)
        explore = next((i for i, reason in enumerate(plan.reasons) if reason == COST and known.get(id(reqs[i]), True)
                        and reqs[i].params.greedy and self.shared_acceptance[reqs[i].source].thin), None)
        if explore is not None and self._iteration - self._explored_at >= EXPLORE_EVERY:
            self._explored_at = self._iteration
            rows[explore] = dataclasses.replace(rows[explore], probe=True)
            plan = plan_drafts(rows, self.cost_model, load_open)
        for r, reason in zip(reqs, plan.reasons):
            if reason is not None:  # a row whose lookup has nothing this step: empty, as the proposal would say
                empty = known.get(id(r)) is False and reason in (ACCEPTANCE, COST)
                self._skipped(r, PROPOSER_FAILED if r.proposer_failed else EMPTY if empty else reason)
        return list(plan.ks)

    def _skipped(self, req: Request, reason: str) -> None:
        req.skip_reasons[reason] = req.skip_reasons.get(reason, 0) + 1
        self.stats.skip_reasons[reason] = self.stats.skip_reasons.get(reason, 0) + 1
        req.acceptance.skipped_for(reason)

    def _verify(self, reqs: list[Request], drafts: list[list[int]], q_rows: dict[int, torch.Tensor],
                finished: list[Request]) -> None:
        """Feed [pending, d1..dk_i] per row in one target forward and accept per row."""
        dev = self.config.device
        feeds = [[r.all_ids[-1]] + d for r, d in zip(reqs, drafts)]
        lengths = [len(f) for f in feeds]
        T = max(lengths)
        try:
            ids = torch.tensor([f + [0] * (T - len(f)) for f in feeds], device=dev)
            fb = ForwardBatch.paged([r.blocks.blocks for r in reqs], [r.target_len for r in reqs], lengths,
                                    self.cache, dev)
            logits, hidden = self._target_forward(ids, fb)  # [B, T, V]
        except Exception as err:  # noqa: BLE001  find the row that breaks the batch; the others go on
            # Nothing was committed: a row's K/V past its target_len is overwritten by the retry.
            index = {id(r): i for i, r in enumerate(reqs)}
            self._isolate(reqs, err, finished, lambda r: self._verify(
                [r], [drafts[index[id(r)]]], {0: q_rows[index[id(r)]]} if index[id(r)] in q_rows else {}, finished))
            return
        # Greedy rows need only the argmax; sampled rows go to the CPU, where their generators live.
        argmax = logits.argmax(-1).tolist() if any(r.params.greedy for r in reqs) else None

        for i, r in enumerate(reqs):
            try:
                d = drafts[i]
                rows = logits[i, : len(d) + 1]  # [k+1, V]: row j scores the token after d_j
                if r.params.adjusted:  # each row by the sequence plain decoding would have had there
                    rows = adjust(rows.cpu(), r.params, r.prompt_ids, r.output_ids, r.stop_ids, d)
                if r.guide is not None:  # each row masked by the grammar's state after the drafts before it
                    rows = apply_refusals(rows.cpu(), r.guide.row_refusals(d, r.stop_ids))
                if r.params.greedy:
                    own = r.params.adjusted or r.guide is not None
                    m, nxt = accept_greedy(rows.argmax(-1).tolist() if own else argmax[i][: len(d) + 1], d)
                elif r.keyed:
                    m, nxt = accept_keyed(rows.cpu(), d, r)
                else:
                    m, nxt = accept_sampled(rows.cpu(), d, q_rows.get(i), r)
                if r.guide is not None:  # the accepted drafts and the next token; rejected ones were never taken
                    r.guide.advance(d[:m] + [nxt], r.stop_ids)
                prev_len = r.num_tokens
                # The pending token and the m accepted drafts now have valid K/V; rejected entries past
                # this length are stale and get overwritten: that is the per-sequence rollback.
                r.target_len = prev_len + m
                self.blocks.trim(r.blocks, r.target_len + 1)  # blocks only rejected drafts wrote go back
                self.blocks.commit(r.blocks, r.all_ids + d[:m], r.target_len)  # the accepted drafts aren't emitted yet
                if d:
                    r.num_drafted += len(d)
                    r.num_accepted += m
                    r.num_verify_steps += 1
                    r.accepted_per_step[str(m)] = r.accepted_per_step.get(str(m), 0) + 1
                    r.acceptance.update(len(d), m)
                    if r.speculation == "auto" and r.params.greedy:  # what the engine's greedy choices learn from
                        self.shared_acceptance[r.source].update(len(d), m)
                    self.stats.record_verification(len(d), m)
                    self.proposer.on_verified(r, prev_len, len(d), m)
                if hidden is not None:  # the states of the pending token and the accepted drafts
                    self.proposer.on_target_hidden(r, hidden[i, : m + 1])
                self._emit(r, d[:m] + [nxt], finished, self._logprobs(r, rows[: m + 1], d[:m] + [nxt]))
            except Exception as err:  # noqa: BLE001  one request's failure ends that request only
                self._fail(r, err, finished)

    def _target_forward(self, ids: torch.Tensor, fb: ForwardBatch, logits_index: torch.Tensor | None = None
                        ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The target's logits, plus [B, T, A] hidden states of the layers an EAGLE-3 proposer reads
        (None for every other proposer, whose forward captures nothing)."""
        capture = getattr(self.proposer, "capture_layers", ())
        graphed = self.graphed(ids, fb) if self.graphed is not None and logits_index is None else None
        if graphed is not None:  # views of the graphs' static outputs, overwritten by the next replay
            logits, hidden = graphed
            if hidden is not None:
                hidden = hidden.clone()  # the EAGLE-3 proposer keeps these past this step
                block, offset = fb.write_index()
                self.states[block, offset] = hidden
            return logits, hidden
        if not capture:
            return self.model(ids, fb, self.cache, logits_index=logits_index), None
        logits, captured = self.model(ids, fb, self.cache, logits_index=logits_index, capture_layers=capture)
        hidden = torch.cat(captured, dim=-1)  # [B, T, A]
        block, offset = fb.write_index()  # kept where the K/V went, for a later request's prefix hit
        self.states[block, offset] = hidden
        return logits, hidden

    @staticmethod
    def _logprobs(req: Request, rows: torch.Tensor, tokens: list[int]) -> list[TokenLogprob] | None:
        """rows: [len(tokens), V], the (penalised) logits each token was chosen from."""
        return None if req.params.logprobs is None else token_logprobs(rows.cpu(), tokens, req.params)

    def _emit(self, req: Request, tokens: list[int], finished: list[Request],
              logprobs: list[TokenLogprob] | None = None) -> None:
        new: list[int] = []
        reason = None
        for n, t in enumerate(tokens):
            if t in req.stop_ids:
                reason = FinishReason.STOP
                if logprobs is not None and req.params.prompt_logprobs is not None:
                    # A scored prompt's answer reports the token that ended it too, as vLLM's echo does: an
                    # evaluator drops the last entry as the answer's, even where that is the end token.
                    req.stop_logprob = (t, logprobs[n])
                break
            req.output_ids.append(t)
            if logprobs is not None:
                req.logprobs.append(logprobs[n])
            new.append(t)
            if req.stop_strings is not None and len(req.output_ids) >= req.params.min_tokens and (
                    hit := req.stop_strings.check(req.output_ids)) is not None:
                req.stop_text_len, req.stop_reason = hit
                reason = FinishReason.STOP
                break
            if req.remaining <= 0 or req.num_tokens >= self.config.max_seq_len:
                reason = FinishReason.LENGTH
                break
        self.stats.generated_tokens += len(new)
        # One callback per token, so streaming clients see tokens as soon as they are accepted; the
        # request is marked finished just before its last callback.
        if req.on_tokens:
            for t in new[:-1] if reason is not None else new:
                req.on_tokens(req, [t])
        if reason is not None:
            self._finish(req, reason)
            finished.append(req)
            if req.on_tokens:
                req.on_tokens(req, new[-1:])

    def _isolate(self, reqs: list[Request], err: Exception, finished: list[Request],
                 retry_one: Callable[[Request], None]) -> None:
        """A batched forward raised: fail its only row, or retry each row alone, so an error tied to
        one request ends that request and the rest of the batch carries on."""
        if len(reqs) == 1:
            self._fail(reqs[0], err, finished)
            return
        for r in reqs:
            retry_one(r)

    def _fail(self, req: Request, err: Exception, finished: list[Request]) -> None:
        req.error = one_line(err)
        self.stats.failed_requests += 1
        self._finish(req, FinishReason.ERROR)
        if req not in finished:
            finished.append(req)
        if req.on_tokens:
            try:
                req.on_tokens(req, [])
            except Exception:  # noqa: BLE001  the request already failed; its callback failing too changes nothing
                pass

    def _finish(self, req: Request, reason: FinishReason) -> None:
        if req in self.running:
            held = self._held
            if max(held.values()) >= held[req.group_key] + 2:  # beside a larger group: its slot is held (_admit)
                self._ended_beside_larger = self._iteration
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        self.blocks.free(req.blocks)
        if req.slot is not None:
            heapq.heappush(self.free_slots, req.slot)
            req.slot = None
        if req in self.running:
            self._unrun(req)
        if self.proposer is not None:
            self.proposer.release(req)
