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
from pipeline.engine.speculative import Proposal  # noqa: E402
from pipeline.engine.weights import load_transformer  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from tiny_models import make_tiny_eagle3_head, make_tiny_llama  # noqa: E402

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


def test_an_eagle3_heads_graphed_forward_gives_its_eager_logits_and_cache(device, tmp_path):
    """GraphedHead over a ragged catch-up (3, 1 and 2 tokens) and then a draft step, padded to a bucket of 4."""
    from pipeline.engine.cuda_graphs import GraphedHead
    from pipeline.engine.eagle3 import load_eagle3_head

    folder = make_tiny_llama(tmp_path / "m", seed=0, layers=2)
    target = load_transformer(folder, 64, torch.bfloat16, device)
    head = load_eagle3_head(make_tiny_eagle3_head(tmp_path / "h", folder, seed=0), target.cfg, 64, torch.bfloat16,
                            device)
    eager_cache, graph_cache = head.new_cache(4, 64), head.new_cache(4, 64)
    graphed = GraphedHead(head, target.embed_tokens, graph_cache, max_batch=4, max_width=3, replay=device == "cuda")
    graphed.capture()
    g = torch.Generator().manual_seed(0)
    H = head.cfg.hidden_size
    for starts, lengths in (([0, 4, 9], [3, 1, 2]), ([3, 5, 11], [1, 1, 1])):
        T = max(lengths)
        ids = torch.randint(3, 300, (3, T), generator=g).to(device)
        hidden = torch.randn(3, T, H, generator=g).to(device, torch.bfloat16)
        last = torch.tensor(lengths, device=device)[:, None] - 1
        fb_e = ForwardBatch.build([0, 2, 3], starts, lengths, eager_cache, device)
        fb_g = ForwardBatch.build([0, 2, 3], starts, lengths, graph_cache, device)
        logits, out = head(target.embed(ids), hidden, fb_e, eager_cache, last)
        g_logits, g_out = graphed(ids, hidden, fb_g, last)
        assert torch.equal(g_logits, logits) and torch.equal(g_out, out)
        live = slice(0, eager_cache.trash_block)
        assert torch.equal(graph_cache.k[:, live], eager_cache.k[:, live])
        assert torch.equal(graph_cache.v[:, live], eager_cache.v[:, live])


@pytest.mark.parametrize("device", [pytest.param("cpu", marks=pytest.mark.slow),  # two engines, ~40 s interpreted
                                    pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(),
                                                                                  reason=NO_GPU))], indirect=True)
def test_an_engines_eagle3_drafts_are_the_same_graphed_or_not(device, tmp_path, monkeypatch):
    """The engine's EAGLE-3 proposer through its graphs drafts exactly what it drafts eagerly, one sync a proposal."""
    from pipeline.engine.config import EngineConfig, GatePolicy
    from pipeline.engine.llm_engine import LLMEngine
    from pipeline.engine.sampling import SamplingParams

    target = make_tiny_llama(tmp_path / "m", seed=0, layers=2)
    head = make_tiny_eagle3_head(tmp_path / "h", target, seed=0)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 300, (n,), generator=g).tolist() for n in (4, 9, 17)]
    drafts, outputs, replays = {}, {}, []
    for graphs in (False, True):
        engine = LLMEngine.load(target, EngineConfig(dtype="bf16", device=device, max_batch_size=4, max_seq_len=128,
                                                     num_draft_tokens=3, cuda_graphs=graphs,
                                                     gate=GatePolicy(min_tokens=0)), draft=f"eagle3:{head}")
        proposer = engine.proposer
        assert (proposer.graphed is not None) == graphs
        if graphs:
            assert engine.describe()["cuda_graphs"]["draft_graphs"] == len(proposer.graphed.buckets) * 4
            run = proposer.graphed._run
            monkeypatch.setattr(proposer.graphed, "_run", lambda entry: (replays.append(entry.width), run(entry)))
        seen = drafts[graphs] = []
        propose = proposer.propose
        monkeypatch.setattr(proposer, "propose", lambda reqs, ks, propose=propose, seen=seen:
                            seen.append(propose(reqs, ks).tokens) or Proposal(tokens=seen[-1]))
        outputs[graphs] = [r.output_ids for r in engine.generate(prompts, SamplingParams(max_tokens=7),
                                                                 speculation="on")]
    assert drafts[True] == drafts[False] and len(drafts[True]) > 2
    assert outputs[True] == outputs[False]
    # Each proposal but the first (whose catch-up is the prompts, wider than any graph) replays its draft steps.
    assert len(replays) >= 2 * (len(drafts[True]) - 1)
