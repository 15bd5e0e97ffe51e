"""A graphed decode or verify forward gives the bits of an eager one (cuda_graphs.py).

A graph replays a padded batch from static buffers; the engine's GPU kernels make the padding invisible to a real
row. Here the graphs' static path runs eagerly on the CPU, under Triton's interpreter: the copy into the buffers,
the bucket's pads and the trash block are what's checked; the replay itself needs a GPU (the CUDA run below).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

from pipeline.engine import gpu_kernels  # noqa: E402
from pipeline.engine.cuda_graphs import GraphedForward, batch_buckets  # noqa: E402
from pipeline.engine.kv_cache import ForwardBatch  # noqa: E402
from pipeline.engine.weights import load_transformer  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from tiny_models import make_tiny_llama  # noqa: E402

NO_GPU = "torch sees no GPU: the CUDA replay is skipped (the static path's eager run is not)"


def test_buckets_are_powers_of_two_then_steps_of_32_ending_at_the_batch():
    assert batch_buckets(1) == (1,)
    assert batch_buckets(48) == (1, 2, 4, 8, 16, 32, 48)
    assert batch_buckets(64) == (1, 2, 4, 8, 16, 32, 64)
    assert batch_buckets(200) == (1, 2, 4, 8, 16, 32, 64, 96, 128, 160, 192, 200)


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(),
                                                                                reason=NO_GPU))])
def device(request, monkeypatch) -> str:
    if request.param == "cpu":
        if not gpu_kernels.interpreting():
            pytest.skip("Triton is compiling for this machine's GPU: the CUDA run stands in")
        monkeypatch.setenv(gpu_kernels.FORCE_ENV, "1")
    return request.param


def test_a_padded_static_forward_gives_the_eager_forwards_logits_and_cache(device, tmp_path):
    model = load_transformer(make_tiny_llama(tmp_path / "m", seed=0, layers=2), 64, torch.bfloat16, device)
    g = torch.Generator().manual_seed(0)
    eager_cache, graph_cache = model.new_cache(4, 64), model.new_cache(4, 64)
    # Rows 0-2 of slots 0, 2, 3, with some history in the cache (the same in both).
    eager_cache.k.copy_(torch.randn(eager_cache.k.shape, generator=g).to(eager_cache.k))
    eager_cache.v.copy_(torch.randn(eager_cache.v.shape, generator=g).to(eager_cache.v))
    graph_cache.k.copy_(eager_cache.k)
    graph_cache.v.copy_(eager_cache.v)
    graphed = GraphedForward(model, graph_cache, max_batch=4, max_width=3, replay=device == "cuda")
    assert graphed.capture() == len(graphed.buckets) * 3
    for starts, lengths in (([5, 17, 30], [1, 1, 1]), ([6, 18, 31], [3, 1, 2])):  # a decode, then a ragged verify
        T = max(lengths)
        ids = torch.randint(3, 300, (3, T), generator=g).to(device)
        fb_eager = ForwardBatch.build([0, 2, 3], starts, lengths, eager_cache, device)
        fb_graph = ForwardBatch.build([0, 2, 3], starts, lengths, graph_cache, device)
        eager = model(ids, fb_eager, eager_cache)
        logits, hidden = graphed(ids, fb_graph)
        assert graphed.bucket_for(3) == 4 and hidden is None
        real = fb_eager.write_pos >= 0
        assert torch.equal(logits[real], eager[real])
        live = slice(0, eager_cache.trash_block)  # the pads' K/V went to the trash block, and only there
        assert torch.equal(graph_cache.k[:, live], eager_cache.k[:, live])
        assert torch.equal(graph_cache.v[:, live], eager_cache.v[:, live])


def test_a_shape_no_graph_holds_runs_eagerly(device, tmp_path):
    model = load_transformer(make_tiny_llama(tmp_path / "m", seed=0, layers=1), 64, torch.bfloat16, device)
    cache = model.new_cache(2, 64)
    graphed = GraphedForward(model, cache, max_batch=2, max_width=2, replay=device == "cuda")
    graphed.capture()
    ids = torch.zeros(1, 3, dtype=torch.long, device=device)  # wider than any graph: a prefill chunk, say
    assert graphed(ids, ForwardBatch.build([0], [0], [3], cache, device)) is None
    ids = torch.zeros(3, 1, dtype=torch.long, device=device)  # more rows than the largest bucket
    assert graphed(ids, ForwardBatch.build([0, 1, 1], [0, 0, 0], [1, 1, 1], cache, device)) is None


def test_a_failed_capture_leaves_an_engine_that_runs_eagerly_and_says_why(device, tmp_path, monkeypatch, capsys):
    from pipeline.engine import cuda_graphs
    from pipeline.engine.config import EngineConfig
    from pipeline.engine.llm_engine import LLMEngine
    from pipeline.engine.sampling import SamplingParams

    def fail(self):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(cuda_graphs.GraphedForward, "capture", fail)
    target = make_tiny_llama(tmp_path / "m", seed=0, layers=1)
    engine = LLMEngine.load(target, EngineConfig(dtype="bf16", device=device, max_batch_size=2, max_seq_len=64))
    assert engine.graphed is None
    assert "stream is capturing" in engine.describe()["cuda_graphs"]["error"]
    assert "CUDA graph capture failed, steps run eagerly" in capsys.readouterr().err
    [req] = engine.generate([[5, 6, 7]], SamplingParams(max_tokens=3))
    assert len(req.output_ids) == 3
