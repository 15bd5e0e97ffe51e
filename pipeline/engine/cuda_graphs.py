"""Decode and verify forwards replayed from CUDA graphs captured at load, over static input buffers.

At batch 1 a GPU step is launch-bound: about 480 kernel launches and 190 allocations a token took 20+ ms where
the GPU was busy 2 (an H200, before these graphs). A graph replays a whole forward's launches in one call. It
needs fixed shapes and fixed addresses, so each (batch bucket, width) pair gets its own graph over views of one
set of static buffers (token ids, positions, write positions, block table), and a step copies its inputs into them
and replays the graph of the smallest bucket that holds its rows.

The padding costs nothing in the bits: the rows past the step's own are pads (write position -1), which the
engine's GPU kernels never let into a real row's result (gpu_kernels.py: no tile, split or key loop depends on
the row count, and a pad reads no key and writes its K/V to the trash block). So a replay gives the bits an eager
forward of the unpadded batch gives: tests/test_cuda_graphs.py checks that with the graphs' static path run
eagerly on a CPU, under Triton's interpreter. Only the invariant path is graphed: the vendor path's SDPA reads a
key count that changes every step. A draft model's steps and an EAGLE-3 head's (GraphedHead) are graphed the
same way.

A forward whose shape no graph holds (a prefill, a batch past the largest bucket) runs eagerly.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from pipeline.engine.kv_cache import ForwardBatch, KVCache

# Batch buckets: powers of two up to 64, then steps of 32; a step pads its rows up to the next one.
SMALL_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
BUCKET_STEP = 32


def batch_buckets(max_batch: int) -> tuple[int, ...]:
    """The bucket sizes for a model decoding at most max_batch rows (the largest is max_batch)."""
    buckets = [b for b in SMALL_BUCKETS if b < max_batch]
    b = SMALL_BUCKETS[-1] + BUCKET_STEP
    while b < max_batch:
        buckets.append(b)
        b += BUCKET_STEP
    return (*buckets, max_batch)


@dataclass
class _Graph:
    graph: "torch.cuda.CUDAGraph | None"  # None: the static path run eagerly (a CPU test)
    bucket: int
    width: int


class _StaticGraphs:
    """The machinery a graphed forward shares: static token ids, positions, write positions and block table over
    up to max_batch rows of max_width tokens, a graph per (bucket, width) captured over their corners, and a call
    that copies a step's inputs in, pads the bucket and replays. A subclass says what its forward is."""

    def __init__(self, device: torch.device, cache: KVCache, max_batch: int, max_width: int, replay: bool):
        self.cache, self.max_batch, self.max_width, self.replay = cache, max_batch, max_width, replay
        self.buckets = batch_buckets(max_batch)
        B, T = max_batch, max_width
        self.max_blocks = cache.blocks_per_slot  # a row never holds more blocks than max_seq_len needs
        self.ids = torch.zeros(B, T, dtype=torch.long, device=device)
        self.positions = torch.zeros(B, T, dtype=torch.long, device=device)
        self.write_pos = torch.full((B, T), -1, dtype=torch.long, device=device)
        self.table = torch.full((B, self.max_blocks), cache.trash_block, dtype=torch.long, device=device)
        self.graphs: dict[tuple[int, int], _Graph] = {}
        self.pool = None

    def bucket_for(self, rows: int) -> int | None:
        return next((b for b in self.buckets if b >= rows), None)

    def _batch(self, bucket: int, width: int) -> ForwardBatch:
        """The static buffers' corner as a ForwardBatch. A new object each forward: it memoizes its write index,
        which an eager run must work out again from the buffers' new values (a graph replays the kernels that do)."""
        return ForwardBatch(block_table=self.table[:bucket], positions=self.positions[:bucket, :width],
                            # Contiguous once a forward (a copy the graph replays), not once a kernel a layer.
                            write_pos=self.write_pos[:bucket, :width].contiguous(),
                            kv_len=self.max_blocks * self.cache.block_size, block_size=self.cache.block_size,
                            trash_block=self.cache.trash_block)

    def _forward(self, bucket: int, width: int) -> None:
        """The forward a graph holds, over the static corner, its outputs copied into static outputs."""
        raise NotImplementedError

    @torch.inference_mode()
    def capture(self) -> int:
        """Capture a graph per (bucket, width), largest first so the pool is sized by the first. Returns how many.
        The pads' K/V go to the trash block, so capturing writes nothing a request owns."""
        self.write_pos.fill_(-1)
        self.table.fill_(self.cache.trash_block)
        if not self.replay:
            self.graphs = {(b, w): _Graph(None, b, w) for b in self.buckets for w in range(1, self.max_width + 1)}
            return len(self.graphs)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        # Warm every shape up off the capture: Triton compiles a kernel on its first call with each specialization
        # (an argument equal to 1 or a multiple of 16, say), and a compile can't happen inside a capture.
        with torch.cuda.stream(stream):
            for b in self.buckets:
                for w in range(1, self.max_width + 1):
                    self._forward(b, w)
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        for b in reversed(self.buckets):
            for w in range(self.max_width, 0, -1):
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self.pool):
                    self._forward(b, w)
                self.pool = graph.pool()
                self.graphs[(b, w)] = _Graph(graph, b, w)
        torch.cuda.synchronize()
        return len(self.graphs)

    def _load(self, ids: torch.Tensor, fb: ForwardBatch) -> _Graph | None:
        """Copy a step's ids and batch into the static buffers, pads past its rows; None where no graph holds it
        (the caller then runs its forward eagerly)."""
        B, T = ids.shape
        bucket = self.bucket_for(B)
        if bucket is None or T > self.max_width or fb.block_table.shape[1] > self.max_blocks:
            return None
        entry = self.graphs.get((bucket, T))
        if entry is None:
            return None
        width = fb.block_table.shape[1]
        self.ids[:B, :T].copy_(ids)
        self.positions[:B, :T].copy_(fb.positions)
        self.write_pos[:B, :T].copy_(fb.write_pos)
        self.table[:B, :width].copy_(fb.block_table)
        self.table[:B, width:].fill_(self.cache.trash_block)
        if bucket > B:  # pads: no key read, K/V into the trash block
            self.ids[B:bucket, :T].zero_()
            self.positions[B:bucket, :T].zero_()
            self.write_pos[B:bucket, :T].fill_(-1)
            self.table[B:bucket].fill_(self.cache.trash_block)
        return entry

    def _run(self, entry: _Graph) -> None:
        if entry.graph is not None:
            entry.graph.replay()
        else:
            self._forward(entry.bucket, entry.width)


class GraphedForward(_StaticGraphs):
    """model(ids, fb, cache) for decode and verify steps of up to max_batch rows and max_width tokens a row,
    replayed from CUDA graphs on a GPU (replay=True) or run eagerly over the same static buffers (replay=False:
    what a CPU test checks the padding with). capture_layers: the hidden states an EAGLE-3 head reads, returned
    beside the logits as the model returns them."""

    def __init__(self, model: torch.nn.Module, cache: KVCache, max_batch: int, max_width: int,
                 capture_layers: tuple[int, ...] = (), replay: bool = True):
        dev = model.embed.weight.device
        super().__init__(dev, cache, max_batch, max_width, replay)
        self.model, self.capture_layers = model, capture_layers
        B, T, V = max_batch, max_width, model.cfg.vocab_size
        # One output buffer for every graph: each graph copies its logits into its corner of it, so the graphs'
        # outputs don't each hold [bucket, width, V] fp32 of the pool (about 1 GB for a 128k vocabulary).
        self.logits = torch.zeros(B, T, V, dtype=torch.float32, device=dev)
        self.hidden = (torch.zeros(B, T, len(capture_layers) * model.cfg.hidden_size, dtype=model.embed.weight.dtype,
                                   device=dev) if capture_layers else None)

    def _forward(self, bucket: int, width: int) -> None:
        fb = self._batch(bucket, width)
        ids = self.ids[:bucket, :width]
        if self.capture_layers:
            logits, captured = self.model(ids, fb, self.cache, capture_layers=self.capture_layers)
            self.hidden[:bucket, :width].copy_(torch.cat(captured, dim=-1))
        else:
            logits = self.model(ids, fb, self.cache)
        self.logits[:bucket, :width].copy_(logits)

    @torch.inference_mode()
    def __call__(self, ids: torch.Tensor, fb: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """(logits [B, T, V], hidden [B, T, A] or None) of ids [B, T] at fb, or None where no graph holds the shape
        (the caller then runs the model eagerly). The outputs are views of the static buffers, valid until the
        next call."""
        entry = self._load(ids, fb)
        if entry is None:
            return None
        self._run(entry)
        B, T = ids.shape
        hidden = self.hidden[:B, :T] if self.hidden is not None else None
        return self.logits[:B, :T], hidden


class GraphedHead(_StaticGraphs):
    """An EAGLE-3 head's drafting forward, head(embed(ids), hidden, fb, cache, last), for up to max_batch rows of up
    to max_width tokens (a catch-up after a verify, then one token a draft step), replayed like GraphedForward.
    A pad's hidden state is zeros and its `last` 0; it reads no key and writes to the trash block."""

    def __init__(self, head: torch.nn.Module, embed: Callable[[torch.Tensor], torch.Tensor], cache: KVCache,
                 max_batch: int, max_width: int, replay: bool = True):
        dev = head.fc.weight.device
        super().__init__(dev, cache, max_batch, max_width, replay)
        self.head, self.embed = head, embed
        B, T, H = max_batch, max_width, head.cfg.hidden_size
        self.hidden_in = torch.zeros(B, T, H, dtype=head.fc.weight.dtype, device=dev)
        self.last = torch.zeros(B, 1, dtype=torch.long, device=dev)
        self.logits = torch.zeros(B, 1, head.cfg.draft_vocab_size, dtype=torch.float32, device=dev)
        self.out = torch.zeros(B, 1, H, dtype=head.fc.weight.dtype, device=dev)

    def _forward(self, bucket: int, width: int) -> None:
        fb = self._batch(bucket, width)
        logits, out = self.head(self.embed(self.ids[:bucket, :width]), self.hidden_in[:bucket, :width], fb,
                                self.cache, self.last[:bucket])
        self.logits[:bucket].copy_(logits)
        self.out[:bucket].copy_(out)

    @torch.inference_mode()
    def __call__(self, ids: torch.Tensor, hidden: torch.Tensor, fb: ForwardBatch,
                 last: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(draft logits [B, 1, Vd], pre-norm outputs [B, 1, H]) as the head returns them, or None where no graph
        holds the shape. Views of the static buffers, valid until the next call."""
        entry = self._load(ids, fb)
        if entry is None:
            return None
        B, T = ids.shape
        self.hidden_in[:B, :T].copy_(hidden)
        self.last[:B].copy_(last)
        if entry.bucket > B:
            self.hidden_in[B:entry.bucket, :T].zero_()
            self.last[B:entry.bucket].zero_()
        self._run(entry)
        return self.logits[:B], self.out[:B]


def graph_time_ms(fn, repeats: int, trials: int = 3) -> float:
    """Milliseconds a call of fn takes inside a CUDA graph of `repeats` calls, the best of `trials` replays: a
    kernel's time as a graphed step runs it, without its launch's CPU cost (a timed eager call of a small Triton
    linear measured its launch, about 80 us). fn runs once eagerly first, to compile and allocate."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(repeats):
            fn()
    graph.replay()
    best = float("inf")
    for _ in range(trials):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        torch.cuda.synchronize()
        best = min(best, a.elapsed_time(b) / repeats)
    return best
