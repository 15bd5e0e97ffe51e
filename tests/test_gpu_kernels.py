"""The engine's GPU kernels give a row the same bits whatever shares its call (gpu_kernels.py).

CI has no GPU, so the kernels run here under Triton's interpreter, which executes the same kernel code, tile by
tile, on the CPU: the order of every sum is the code's, so a break of invariance (a split chosen by the row count,
a key loop bounded by the batch's longest row) fails here. The interpreter can't round bf16 like a GPU, so bits
are compared with the kernels' own, never with torch's. Where torch sees a GPU, the same tests run there too.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

from pipeline.engine import gpu_kernels  # noqa: E402
from pipeline.engine.config import EngineConfig, GatePolicy  # noqa: E402
from pipeline.engine.llm_engine import LLMEngine  # noqa: E402
from pipeline.engine.sampling import SamplingParams  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from tiny_models import make_tiny_eagle3_head, make_tiny_llama  # noqa: E402

ROOT = Path(__file__).parent.parent
NO_GPU = "torch sees no GPU: the CUDA run of these checks is skipped (the interpreter's run is not)"
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_GPU))]
# A whole engine through the interpreter pays about 40 ms a kernel launch, a second a step: CI runs those checks
# (`slow`), the fast loop keeps each kernel's row checks and one engine's prompt alone and batched.
END_TO_END = [pytest.param("cpu", marks=pytest.mark.slow), DEVICES[1]]


@pytest.fixture(params=DEVICES)
def device(request, monkeypatch) -> str:
    if request.param == "cpu":  # the kernels on a CPU, through Triton's interpreter (conftest.py turns it on)
        if not gpu_kernels.interpreting():
            pytest.skip("Triton is compiling for this machine's GPU (no TRITON_INTERPRET): the CUDA run stands in")
        monkeypatch.setenv(gpu_kernels.FORCE_ENV, "1")
    return request.param


def rows_alone_and_together(fn, x: torch.Tensor, counts=(1, 3, 64, 65)) -> bool:
    """Whether fn(x[:n]) gives every row the bits it gets alone, for each n: a decode, a verify, a full tile and
    the first row of the next tile."""
    alone = torch.cat([fn(x[i:i + 1]) for i in range(max(counts))])
    return all(torch.equal(fn(x[:n]), alone[:n]) for n in counts)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("n,k", [(96, 128), (40, 512)])  # one tile pass; K cut in 4 slices summed in order
def test_a_linear_row_has_its_bits_alone_in_a_batch_and_in_a_verify(device, dtype, n, k):
    g = torch.Generator().manual_seed(0)
    w, b, x = (torch.randn(*s, generator=g).to(device=device, dtype=dtype) for s in ((n, k), (n,), (65, k)))
    assert gpu_kernels.linear_tiles(n, k, gpu_kernels.H200_SMS).split == (1 if k == 128 else 4)
    assert rows_alone_and_together(lambda t: gpu_kernels.linear(t, w, b), x)
    ref = torch.nn.functional.linear(x.float(), w.float(), b.float())
    tol = 1e-4 if dtype == torch.float32 else 0.02 * ref.abs().max().item()
    torch.testing.assert_close(gpu_kernels.linear(x, w, b).float(), ref, atol=tol, rtol=0)


def test_a_k_split_chosen_by_the_row_count_is_caught(device, monkeypatch):
    """The negative control: the check above fails for a linear whose reduction order follows the batch."""
    g = torch.Generator().manual_seed(0)
    w, x = torch.randn(40, 512, generator=g).to(device), torch.randn(65, 512, generator=g).to(device)
    monkeypatch.setattr(gpu_kernels, "tiles_for",
                        lambda x, w: gpu_kernels.LinearTiles(16, 64, 1 if x.shape[0] < 4 else 4))
    assert not rows_alone_and_together(lambda t: gpu_kernels.linear(t, w), x)


SHIPPED_TILES = sorted({(t.block_n, t.block_k, t.split) for f in gpu_kernels.TILES_DIR.glob("*.json")
                        for t in gpu_kernels.tuned_tiles(json.loads(f.read_text())["gpu"]).values()})


@pytest.mark.parametrize("block_n,block_k,split", SHIPPED_TILES)
def test_every_shipped_tiling_keeps_a_rows_bits(device, block_n, block_k, split):
    """The tilings timed on GPUs and shipped in gpu_tiles/, each on a weight of two N-tiles and two K-blocks a
    slice: a row alone equals that row in a batch and a verify (an empty list where no table is shipped yet)."""
    n, k = 2 * block_n, 2 * split * block_k
    g = torch.Generator().manual_seed(0)
    w, x = torch.randn(n, k, generator=g).to(device, torch.bfloat16), torch.randn(65, k, generator=g).to(device)
    tiles = gpu_kernels.LinearTiles(block_n, block_k, split)
    assert rows_alone_and_together(lambda t: gpu_kernels.linear(t, w, tiles=tiles), x.to(torch.bfloat16))


def test_a_timed_tiling_table_round_trips_from_the_tuner_and_a_bad_one_is_refused(tmp_path, monkeypatch):
    spec = importlib.util.spec_from_file_location("tune_gpu_kernels", ROOT / "scripts" / "tune_gpu_kernels.py")
    tuner = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tuner)
    monkeypatch.setattr(gpu_kernels, "TILES_DIR", tmp_path)
    gpu_kernels.tuned_tiles.cache_clear()
    pick = {"tiles": gpu_kernels.LinearTiles(64, 128, 2, 8, 4).__dict__, "us_m1": 10.0, "us_m64": 12.0}
    report = {"gpu": "NVIDIA H200", "sms": 132, "repeats": 20, "linears": {
        "8b.o": {"n": 4096, "k": 4096, "pick": pick, "pick_invariant": True, "vendor_us_m1": 9.0,
                 "vendor_us_m64": 9.5},
        "8b.down": {"n": 4096, "k": 14336, "pick": pick, "pick_invariant": False, "vendor_us_m1": 1.0,
                    "vendor_us_m64": 1.0}}}  # a pick that moved a row's bits is never written
    try:
        path = tuner.write_table(report)
        assert path == tmp_path / "NVIDIA_H200.json"
        assert gpu_kernels.tuned_tiles("NVIDIA H200") == {(4096, 4096): gpu_kernels.LinearTiles(64, 128, 2, 8, 4)}
        x = torch.zeros(1, 4096)
        assert gpu_kernels.tiles_for(x, torch.zeros(4096, 4096)) == gpu_kernels.LinearTiles(64, 128, 2, 8, 4)
        assert gpu_kernels.tiles_for(x, torch.zeros(4096 + 16, 4096)) == gpu_kernels.linear_tiles(4112, 4096, 132)
        assert "timed on NVIDIA H200 for 1 shapes" in gpu_kernels.tilings_source(torch.device("cpu"))
        table = json.loads(path.read_text())
        table["tiles"]["4096x4096"]["block_n"] = 48
        path.write_text(json.dumps(table))
        gpu_kernels.tuned_tiles.cache_clear()
        with pytest.raises(ValueError, match="NVIDIA_H200.json: not a tiling table .*powers of two"):
            gpu_kernels.tuned_tiles("NVIDIA H200")
    finally:
        gpu_kernels.tuned_tiles.cache_clear()


@pytest.mark.slow  # the tuner script end to end through the interpreter, ~8 s
def test_the_tuner_runs_end_to_end_in_smoke_mode_and_writes_a_table_the_kernels_read(tmp_path, monkeypatch):
    """scripts/tune_gpu_kernels.py --smoke: its loop, pick, invariance check and table writer, on tiny shapes under
    the interpreter (a GPU session has minutes; a crash there costs them)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "tune_gpu_kernels.py"), "--smoke", "--write",
                           "--tiles-dir", str(tmp_path), "--out", str(tmp_path / "report.json")],
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads((tmp_path / "report.json").read_text())
    assert all(r["pick_invariant"] and r["tried"] == r["of"] > 0 for r in report["linears"].values())
    monkeypatch.setattr(gpu_kernels, "TILES_DIR", tmp_path)
    gpu_kernels.tuned_tiles.cache_clear()
    try:
        table = gpu_kernels.tuned_tiles(report["gpu"])
        assert set(table) == {(r["n"], r["k"]) for r in report["linears"].values()}
    finally:
        gpu_kernels.tuned_tiles.cache_clear()


@pytest.mark.parametrize("dtype,w_dtype", [(torch.bfloat16, None), (torch.float32, None),
                                           (torch.bfloat16, torch.float32)], ids=["bf16", "fp32", "bf16-fp32 weight"])
def test_rms_norm_with_its_residual_add_is_row_invariant_and_right(device, dtype, w_dtype):
    """An fp32 weight on bf16 rows is Gemma's (1 + w): scaled in fp32, rounded once."""
    g = torch.Generator().manual_seed(0)
    x, r = (torch.randn(65, 96, generator=g).to(device=device, dtype=dtype) for _ in range(2))
    w = (1 + torch.randn(96, generator=g) * 0.1).to(device=device, dtype=w_dtype or dtype)
    assert rows_alone_and_together(lambda t: gpu_kernels.rms_norm(t, w, 1e-5)[1], x)
    total, normed = gpu_kernels.rms_norm(x, w, 1e-5, r)
    for n in (1, 5, 64):
        t_n, o_n = gpu_kernels.rms_norm(x[:n], w, 1e-5, r[:n])
        assert torch.equal(t_n, total[:n]) and torch.equal(o_n, normed[:n])
    ref = torch.nn.functional.rms_norm((x + r).float(), (96,), w.float(), 1e-5)
    torch.testing.assert_close(normed.float(), ref, atol=1e-5 if dtype == torch.float32 else 0.05, rtol=0)
    if w_dtype == torch.float32:  # one rounding: the bf16 of the fp32 product, to an ulp (two: the interpreter
        # truncates where a GPU rounds)
        torch.testing.assert_close(normed.float(), ref.to(dtype).float(), atol=0,
                                   rtol=2 ** -7 if device == "cuda" else 2 ** -6)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("window", [0, 20], ids=["global", "window20"])
def test_a_token_attends_alike_in_a_decode_a_verify_a_prefill_and_a_batch(device, dtype, window):
    """Token (row 0, position 41) computed as a one-token decode, inside a 5-token verify, inside a 50-token
    prefill, and beside another row whose keys run past 70: the same bits each time. Pads read nothing. With a
    sliding window of 20 (Gemma 3's local layers), it reads keys 22..41 only, scaled by a scale of its own."""
    g = torch.Generator().manual_seed(0)
    NB, KV, BS, D, H = 12, 2, 16, 32, 6
    ck, cv = (torch.randn(NB + 1, KV, BS, D, generator=g).to(device=device, dtype=dtype) for _ in range(2))
    table = torch.tensor([[3, 1, 7, 0, 5], [2, 4, 6, 8, 9]], device=device)
    q = torch.randn(2, 50, H, D, generator=g).to(device=device, dtype=dtype)
    scale = 0.3 if window else D**-0.5

    def attend(rows: list[int], tokens: slice, positions: list[list[int]]) -> torch.Tensor:
        pos = torch.tensor(positions, device=device)
        return gpu_kernels.paged_attention(q[rows, tokens], ck, cv, table[rows], pos, scale, window)

    decode = attend([0], slice(41, 42), [[41]])[0, 0]
    verify = attend([0], slice(41, 46), [[41, 42, 43, 44, 45]])[0, 0]
    prefill = attend([0], slice(0, 50), [list(range(50))])[0, 41]
    batch = attend([0, 1], slice(41, 44), [[41, -1, -1], [70, 71, 72]])
    assert torch.equal(decode, verify) and torch.equal(decode, prefill) and torch.equal(decode, batch[0, 0])
    assert not batch[0, 1:].any()
    first = 42 - window if window else 0
    keys = ck[table[0]].transpose(0, 1).reshape(KV, -1, D)[:, first:42].float()
    values = cv[table[0]].transpose(0, 1).reshape(KV, -1, D)[:, first:42].float()
    scores = q[0, 41].float().view(KV, H // KV, D) @ keys.transpose(-1, -2) * scale
    ref = (torch.softmax(scores, -1) @ values).reshape(H, D)
    torch.testing.assert_close(decode.float(), ref, atol=1e-5 if dtype == torch.float32 else 0.02, rtol=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rope_and_the_cache_write_match_torchs_ops_and_a_pad_writes_nothing(device, dtype):
    from pipeline.engine.model import apply_rope

    g = torch.Generator().manual_seed(0)
    B, T, NQ, NKV, D, BS, NB = 2, 3, 4, 2, 16, 16, 6
    qkv = torch.randn(B, T, NQ + 2 * NKV, D, generator=g).to(device=device, dtype=dtype)
    cos, sin = (torch.randn(B, T, 1, D, generator=g).to(device=device, dtype=dtype) for _ in range(2))
    ck, cv = (torch.zeros(NB + 1, NKV, BS, D, dtype=dtype, device=device) for _ in range(2))
    table = torch.tensor([[1, 3], [2, 5]], device=device)
    write_pos = torch.tensor([[17, 18, -1], [4, 5, 6]], device=device)
    q = gpu_kernels.rope_and_write(qkv, cos, sin, ck, cv, table, write_pos, NQ, NKV)
    roped = apply_rope(qkv[:, :, :NQ + NKV], cos, sin)
    tol = dict(atol=1e-6, rtol=0) if dtype == torch.float32 else dict(atol=0.02, rtol=0.02)  # 2 bf16 ulps: the interpreter truncates
    torch.testing.assert_close(q.float(), roped[:, :, :NQ].float(), **tol)
    written = torch.zeros(NB + 1, dtype=torch.bool)
    for b, t in [(0, 0), (0, 1), (1, 0), (1, 1), (1, 2)]:
        p = int(write_pos[b, t])
        block = int(table[b, p // BS])
        written[block] = True
        torch.testing.assert_close(ck[block, :, p % BS].float(), roped[b, t, NQ:].float(), **tol)
        assert torch.equal(cv[block, :, p % BS], qkv[b, t, NQ + NKV:])
    assert not ck[~written].any() and not cv[~written].any()  # the pad (row 0, token 2) wrote nowhere


@pytest.fixture(scope="module")
def two_layers(tmp_path_factory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("gpu-target"), seed=0, layers=2)


@pytest.fixture(scope="module")
def eagle_head(tmp_path_factory, two_layers) -> Path:
    return make_tiny_eagle3_head(tmp_path_factory.mktemp("gpu-eagle"), two_layers, seed=0)


def test_a_prompts_greedy_tokens_are_the_same_alone_and_in_a_batch(device, two_layers):
    """The fast loop's end-to-end check: one engine, its graphs and the four kernels, a prompt alone and beside two
    others (the matrix below, in CI, adds speculation, chunks and the prefix cache)."""
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 300, (n,), generator=g).tolist() for n in (5, 12, 21)]
    params = SamplingParams(max_tokens=3)
    engine = LLMEngine.load(two_layers, EngineConfig(dtype="bf16", device=device, max_batch_size=4, max_seq_len=64,
                                                     prefix_caching=False))
    assert engine.graphed is not None and engine.describe()["target"]["gpu_kernels"] == "invariant"
    alone = engine.generate([prompts[1]], params)[0].output_ids
    batched = engine.generate(prompts, params)
    assert batched[1].output_ids == alone
    assert len({tuple(r.output_ids) for r in batched}) == 3  # the prompts' answers differ: the batch means something


@pytest.mark.parametrize("device", END_TO_END, indirect=True)
def test_greedy_output_is_the_same_alone_batched_speculated_chunked_and_cached(device, two_layers, eagle_head):
    """The identity matrix of issue 40 on a tiny bf16 model: plain batch-1 greedy equals a batch, speculation with
    the target as its own draft (acceptance exactly 1.0), n-gram with chunked prefill, an EAGLE-3 head, and
    prompts whose prefix blocks are cached."""
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 300, (n,), generator=g).tolist() for n in (5, 12, 21)]
    params = SamplingParams(max_tokens=6)  # the prefill's token, then at least a whole verify step of 3 drafts
    # and one more step (the interpreter takes about a second a step: every engine below pays each token more)
    config = dict(dtype="bf16", device=device, max_batch_size=4, max_seq_len=128, num_draft_tokens=3,
                  gate=GatePolicy(min_tokens=0))

    plain = LLMEngine.load(two_layers, EngineConfig(**config, prefix_caching=False))
    assert plain.graphed is not None  # decode and verify steps go through the CUDA graphs' static buffers
    described = plain.describe()["target"]
    assert described["gpu_kernels"] == "invariant"
    assert described["kernels"]["dense"] == "gpu_kernels.linear (Triton)"
    alone = [plain.generate([p], params)[0].output_ids for p in prompts]
    assert len({tuple(a) for a in alone}) == 3  # the prompts' answers differ: the comparisons below mean something
    assert [r.output_ids for r in plain.generate(prompts, params)] == alone

    cached = LLMEngine.load(two_layers, EngineConfig(**config))
    cached.generate(prompts[2:], params)  # its 21 tokens fill a block, which the next run reuses
    again = cached.generate([prompts[2], prompts[2][:17] + prompts[0]], params)
    assert cached.blocks.hit_tokens == 16 + 16
    assert again[0].output_ids == alone[2]
    assert again[1].output_ids == plain.generate([prompts[2][:17] + prompts[0]], params)[0].output_ids

    selfdraft = LLMEngine.load(two_layers, EngineConfig(**config), draft=str(two_layers))
    assert [r.output_ids for r in selfdraft.generate(prompts, params, speculation="on")] == alone
    assert selfdraft.stats.drafted_tokens > 0 and selfdraft.stats.accepted_tokens == selfdraft.stats.drafted_tokens

    chunked = LLMEngine.load(two_layers, EngineConfig(**config, prefill_chunk=4), draft="ngram")
    assert [r.output_ids for r in chunked.generate(prompts, params, speculation="on")] == alone

    eagle = LLMEngine.load(two_layers, EngineConfig(**config), draft=f"eagle3:{eagle_head}")
    assert [r.output_ids for r in eagle.generate(prompts, params, speculation="on")] == alone
    assert eagle.stats.drafted_tokens > 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_GPU)
def test_torch_argmax_passes_its_load_check_here():
    assert gpu_kernels.argmax_invariant(torch.device("cuda"), 128256)


def test_the_gpu_kernels_are_off_on_a_cpu_unless_a_test_asks(monkeypatch):
    monkeypatch.delenv(gpu_kernels.FORCE_ENV, raising=False)
    assert not gpu_kernels.runs_here(torch.zeros(1))
    monkeypatch.setenv(gpu_kernels.FORCE_ENV, "1")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert not gpu_kernels.runs_here(torch.zeros(1))  # forcing them needs the interpreter: a CPU has no GPU code
