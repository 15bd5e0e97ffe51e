"""The memory planner (pure numbers, by hand where it matters) and `pipeline plan` through CliRunner."""

import json

import pytest
from click.testing import CliRunner

from pipeline.cli import main
from pipeline.errors import ModelNotFoundError, PlanError
from pipeline.models.presets import PRESETS
from pipeline.plan import GPUS, check_fits, get_gpu, plan_inputs, plan_memory
from pipeline.plan.memory import GB, TP_SIZES
from pipeline.plan.weights import eagle3_weight_bytes, kv_bytes_per_token, linear_bytes, model_weight_bytes
from cli_checks import assert_one_line_error  # noqa: E402

LLAMA_70B = PRESETS["llama-3.3-70b"].shape
LLAMA_8B = PRESETS["llama-3.1-8b"].shape


def plan(**kw):
    kw.setdefault("target", "llama-70b")
    kw.setdefault("gpu", "h100-80gb")
    return plan_memory(plan_inputs(**kw))


def run(*args):
    return CliRunner().invoke(main, ["plan", *map(str, args)])


def test_preset_architectures_add_up_to_the_published_parameter_counts():
    for preset in PRESETS.values():
        assert preset.shape.param_count / 1e9 == pytest.approx(preset.params_b, rel=0.01), preset.name


def test_gpu_catalog_records_memory_bandwidth_fp8_and_architecture():
    assert {"a100-40gb", "a100-80gb", "l40s", "h100-80gb", "h200-141gb", "b200-180gb"} <= set(GPUS)
    assert [g.key for g in GPUS.values() if not g.fp8] == ["a100-40gb", "a100-80gb"]
    assert get_gpu("H100").arch == "Hopper" and get_gpu("b200").arch == "Blackwell"
    assert get_gpu("h200").memory_bytes / GB == pytest.approx(150.8, abs=0.1)  # 141 GiB
    assert all(g.bandwidth_tb_s > 0 for g in GPUS.values())


def test_llama_70b_bf16_weights_are_141_gb_and_fp8_about_half():
    weights = model_weight_bytes(LLAMA_70B, "none")
    assert weights.total / GB == pytest.approx(141.1, abs=0.1)
    embedding_and_head = 2 * 2 * 128256 * 8192  # both stay 16-bit
    fp8 = model_weight_bytes(LLAMA_70B, "fp8").total
    assert fp8 == pytest.approx((weights.total - embedding_and_head) / 2 + embedding_and_head, rel=1e-4)
    int4 = model_weight_bytes(LLAMA_70B, "int4_awq").total
    assert int4 < fp8 < weights.total


def test_linear_bytes_per_format():
    assert linear_bytes("none", 128, 256) == 2 * 128 * 256
    assert linear_bytes("fp8", 128, 256) == 128 * 256 + 8
    # INT4: half a byte each, one fp16 scale per 128 input features per output, the AWQ pre-quant scale.
    assert linear_bytes("int4_awq", 256, 64) == 256 * 64 // 2 + 2 * 64 * 2 + 2 * 256


def test_kv_bytes_per_token_by_hand():
    # Llama-3.1-8B: 2 (K and V) x 32 layers x 8 kv heads x 128 head_dim x 2 bytes
    assert kv_bytes_per_token(LLAMA_8B, 32, "bf16") == 2 * 32 * 8 * 128 * 2 == 131072
    assert kv_bytes_per_token(LLAMA_8B, 32, "bf16", tp=4) == 131072 // 4
    # tp 16 > 8 kv heads: each GPU holds one replicated head, not half of one
    assert kv_bytes_per_token(LLAMA_8B, 32, "bf16", tp=16) == 131072 // 8
    p = plan(target="llama-8b", max_batch_size=4, max_seq_len=1000)
    assert p.kv_cache("target") == 131072 * 4 * 1000


def test_fp8_kv_halves_the_kv_cache():
    bf16, fp8 = plan(draft="eagle3"), plan(draft="eagle3", kv_cache_dtype="fp8")
    assert fp8.kv_per_gpu * 2 == bf16.kv_per_gpu
    assert bf16.kv_cache("target") / GB == pytest.approx(21.5, abs=0.1)  # 16 x 4096 tokens
    assert fp8.used < bf16.used


def test_eagle3_head_is_small_and_has_one_layer_of_kv():
    head = eagle3_weight_bytes(LLAMA_70B, "none").total
    assert head < 0.03 * model_weight_bytes(LLAMA_70B, "none").total
    # The yuhuili 8B head (no embedding: it shares the target's) is a ~0.85 GB checkpoint.
    assert eagle3_weight_bytes(LLAMA_8B, "none").total / GB == pytest.approx(0.85, abs=0.05)
    p = plan(draft="eagle3")
    assert p.kv_per_token["draft"]["bf16"] * 80 == p.kv_per_token["target"]["bf16"]


def test_ngram_and_none_drafts_cost_nothing():
    for draft in ("ngram", "none"):
        p = plan(draft=draft)
        assert p.draft_weights.total == 0 and p.kv_cache("draft") == 0


def test_draft_model_is_sharded_with_the_target_tp():
    p1, p2 = plan(target="llama-8b", draft="llama-1b"), plan(target="llama-8b", draft="llama-1b", tp=2)
    assert p1.draft_weights_per_gpu > p2.draft_weights_per_gpu > p1.draft_weights_per_gpu / 2
    assert p2.kv_cache("draft") * 2 == p1.kv_cache("draft")


def test_llama_70b_bf16_does_not_fit_one_h100_and_smallest_tp_is_4():
    p = plan(draft="eagle3")
    assert not p.fits and p.min_tp == 4
    assert not plan(draft="eagle3", tp=2).fits and plan(draft="eagle3", tp=4).fits


def test_llama_70b_fp8_fits_on_two_h100s():
    p = plan(draft="eagle3", target_qformat="fp8")
    assert not p.fits and p.min_tp == 2
    assert plan(draft="eagle3", target_qformat="fp8", tp=2).fits


@pytest.mark.parametrize("gpu", list(GPUS))
def test_min_tp_is_the_smallest_that_fits(gpu):
    p = plan(gpu=gpu, draft="eagle3", target_qformat="int4_awq")
    fitting = [tp for tp in TP_SIZES if plan(gpu=gpu, draft="eagle3", target_qformat="int4_awq", tp=tp).fits]
    assert p.min_tp == (fitting[0] if fitting else None)


def test_nothing_fits_means_min_tp_none():
    p = plan(gpu="a100-40gb", max_batch_size=512, max_seq_len=131072)
    assert p.min_tp is None and not p.fits


@pytest.mark.parametrize("kw, needle", [
    ({"target_qformat": "fp8"}, "--target-qformat fp8"),
    ({"target_qformat": "w4a8_awq"}, "--target-qformat w4a8_awq"),
    ({"kv_cache_dtype": "fp8"}, "--kv-cache-dtype fp8"),
    ({"draft": "eagle3", "draft_qformat": "fp8"}, "--draft-qformat fp8"),
])
def test_a100_refuses_fp8(kw, needle):
    with pytest.raises(PlanError, match="no FP8") as err:
        plan(gpu="a100-80gb", **kw)
    assert needle in str(err.value) and "int4_awq" in str(err.value)
    plan(gpu="a100-80gb", target_qformat="int4_awq")  # no FP8 needed


def test_tp_must_divide_the_heads():
    with pytest.raises(PlanError, match="--tp-size 3 does not divide llama-3.3-70b's 64 attention heads"):
        plan(tp=3)
    with pytest.raises(PlanError, match="9 attention heads"):
        plan(target="smollm2", tp=2)


def test_bad_names_are_refused():
    with pytest.raises(PlanError, match="a100-40gb, a100-80gb"):
        plan(gpu="tpu-v5")
    with pytest.raises(ModelNotFoundError, match="llama-3.3-70b"):
        plan(target="gpt-5")
    with pytest.raises(PlanError, match="--target-qformat"):
        plan(target_qformat="int3")
    with pytest.raises(PlanError, match="bf16 or fp8"):
        plan(kv_cache_dtype="int8")


def test_local_folder_is_read_from_config_json(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "llama", "vocab_size": 1000, "hidden_size": 256, "intermediate_size": 512,
        "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 2}))
    p = plan(target=str(tmp_path), draft="ngram")
    assert p.kv_per_token["target"]["bf16"] == 2 * 4 * 2 * 32 * 2
    assert p.fits and p.min_tp == 1


def test_check_fits_names_the_shortfall_and_the_fixes():
    with pytest.raises(PlanError) as err:
        check_fits(plan(draft="eagle3"))
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith("llama-3.3-70b bf16 needs 141.1 GB for weights + 2.8 GB eagle3 draft")
    assert "21.7 GB KV" in message and "1 x H100 80GB" in message and "short" in message
    assert "--tp-size 4" in message and "--target-qformat int4_awq" in message
    check_fits(plan(draft="eagle3", tp=4))  # fits: no error


def test_check_fits_suggests_a_smaller_batch_when_weights_fit():
    p = plan(target="llama-8b", max_batch_size=256, max_seq_len=8192)
    assert not p.fits
    assert 1 <= p.max_batch_size_that_fits < 256
    assert plan(target="llama-8b", max_batch_size=p.max_batch_size_that_fits, max_seq_len=8192).fits
    assert not plan(target="llama-8b", max_batch_size=p.max_batch_size_that_fits + 1, max_seq_len=8192).fits
    assert f"--max-batch-size {p.max_batch_size_that_fits}" in p.fixes()


def test_cli_json_has_the_plan():
    result = run("--target", "llama-70b", "--draft", "eagle3", "--gpu", "h100-80gb", "--json")
    assert result.exit_code == 1, result.output  # the JSON is printed whole; the exit says DOES NOT FIT
    data = json.loads(result.stdout)
    assert {"target", "draft", "gpu", "tp", "target_weight_bytes", "draft_weight_bytes", "kv_bytes_per_token",
            "kv_cache_bytes", "reserve_bytes", "used_bytes", "headroom_bytes", "fits", "min_tp", "fixes",
            "assumptions"} <= set(data)
    assert set(data["target_weight_bytes"]) == {"none", "fp8", "int4_awq", "w4a8_awq", "int8_sq"}
    assert set(data["kv_cache_bytes"]["target"]) == {"bf16", "fp8"}
    assert (data["fits"], data["min_tp"], data["target"]) == (False, 4, "llama-3.3-70b")


def test_cli_table_shows_every_format_and_the_verdict():
    result = run("--target", "llama-70b", "--draft", "eagle3", "--gpu", "h100", "--target-qformat", "fp8",
                 "--tp", "2")
    assert result.exit_code == 0, result.output
    for needle in ("none", "int4_awq", "w4a8_awq", "int8_sq", "fp8 *", "target bf16", "target fp8",
                   "activations/workspace", "headroom", "verdict: FITS on 2 x H100 80GB", "smallest TP that fits: 2"):
        assert needle in result.output, needle
    too_big = run("--target", "llama-70b", "--gpu", "h100")
    assert "DOES NOT FIT" in too_big.output and too_big.exit_code == 1  # so a script can branch on the verdict


@pytest.mark.parametrize("args, needle, status", [
    (("--target", "llama-70b", "--gpu", "tpu"), "unknown --gpu", 2),
    (("--target", "gpt-5", "--gpu", "h100"), "unknown model", 1),  # a well-formed name that names nothing
    (("--target", "llama-70b", "--gpu", "h100", "--tp", "3"), "does not divide", 2),
    (("--target", "llama-70b", "--gpu", "a100-80gb", "--target-qformat", "fp8"), "no FP8", 2),
    (("--target", "llama-70b", "--gpu", "h100", "--max-batch-size", "0"), "--max-batch-size must be >= 1", 2),
])
def test_cli_bad_input_is_one_line(args, needle, status):
    """A bad option or value exits 2, as click's own usage errors do; a model that isn't there exits 1."""
    result = run(*args)
    assert result.exit_code == status
    assert_one_line_error(result, needle)


# ---- the portable engine on one GPU (--backend torch) -----------------------------------------------------------


def portable(fraction=0.9, **kw):
    from pipeline.plan import plan_portable

    kw.setdefault("target", "llama-8b")
    kw.setdefault("gpu", "h100-80gb")
    return plan_portable(plan_inputs(**kw), fraction)


def test_portable_plan_block_size_is_the_engines():
    from pipeline.engine.kv_cache import BLOCK_SIZE
    from pipeline.plan.portable import KV_BLOCK_TOKENS

    assert KV_BLOCK_TOKENS == BLOCK_SIZE


def test_portable_plan_by_hand_bf16_weights_then_the_capped_kv_pool():
    p = portable()  # llama-3.1-8b, 16 x 4096 tokens, on an H100 (81559 MiB)
    weights = 2 * LLAMA_8B.param_count  # bf16, the tied-or-not head as Hugging Face counts it
    assert p.target_weights == weights and p.draft_weights == p.draft_cache == 0
    assert p.kv_bytes_per_block == 16 * 131072  # 16 tokens x (2 x 32 layers x 8 kv heads x 128 x 2 bytes)
    free = 81559 * 2**20 - 2**30 - weights
    assert p.free_for_kv == free
    assert p.blocks_free_memory_holds == int(free * 0.9) // (16 * 131072)
    assert p.kv_blocks == 16 * 256 and p.capped and p.requests_that_fit == 16 and p.fits  # 4096 tokens: 256 blocks
    assert p.kv_pool_bytes / GB == pytest.approx(8.59, abs=0.01)


def test_portable_plan_past_the_cap_holds_what_the_fraction_of_free_memory_holds():
    p = portable(max_batch_size=1024)
    assert not p.capped and p.kv_blocks == p.blocks_free_memory_holds
    assert p.requests_that_fit == p.kv_blocks // 256 < 1024
    half = portable(fraction=0.45, max_batch_size=1024)
    assert half.kv_blocks == int(p.free_for_kv * 0.45) // p.kv_bytes_per_block  # the fraction is what moves it


def test_portable_plan_counts_a_draft_models_weights_and_cache_and_eagle3_states_per_block():
    model = portable(draft="llama-1b")
    draft = PRESETS["llama-3.2-1b"].shape
    assert model.draft_weights == 2 * draft.param_count
    assert model.draft_cache == kv_bytes_per_token(draft, draft.num_layers, "bf16") * 16 * 4096
    assert model.free_for_kv == portable().free_for_kv - model.draft_weights - model.draft_cache
    eagle = portable(draft="eagle3")
    assert eagle.kv_bytes_per_block - portable().kv_bytes_per_block == 16 * 3 * LLAMA_8B.hidden_size * 2
    assert eagle.draft_weights == eagle3_weight_bytes(LLAMA_8B, "none").total


def test_portable_plan_that_holds_no_request_does_not_fit_and_names_fixes():
    too_big = portable(target="llama-70b")  # 141 GB of bf16 weights on an 80 GB GPU
    assert not too_big.fits and too_big.free_for_kv < 0 and too_big.kv_blocks == 0
    assert too_big.fixes()[0].startswith("--backend trtllm")
    long = portable(gpu="a100-40gb", max_batch_size=1, max_seq_len=200_000)
    assert not long.fits and long.requests_that_fit == 0
    fix = next(f for f in long.fixes() if f.startswith("--max-seq-len"))
    assert portable(gpu="a100-40gb", max_batch_size=1, max_seq_len=int(fix.split()[1])).fits
    assert not portable(gpu="a100-40gb", max_batch_size=1, max_seq_len=int(fix.split()[1]) + 16).fits


def test_portable_plan_refuses_tp_and_an_fp8_kv_cache():
    with pytest.raises(PlanError, match="one GPU; drop --tp-size 2"):
        portable(tp=2)
    with pytest.raises(PlanError, match="compute dtype"):
        portable(kv_cache_dtype="fp8")
    with pytest.raises(PlanError, match="--free-gpu-memory-fraction must be in"):
        portable(fraction=1.5)


def test_cli_backend_torch_prints_the_weights_the_kv_pool_and_the_requests_that_fit():
    result = run("--target", "llama-8b", "--gpu", "h200", "--backend", "torch")
    assert result.exit_code == 0, result.output
    for needle in ("portable engine (--backend torch) on cuda", "target weights", "16.1 GB", "4096 blocks: 0.9 of free",
                   "capped at 16 x 4096 tokens", "verdict: FITS on 1 x H200 141GB: 16 requests of 4096 tokens"):
        assert needle in result.output, needle
    data = json.loads(run("--target", "llama-8b", "--gpu", "h200", "-b", "torch", "--free-gpu-memory-fraction", "0.5",
                          "--max-batch-size", "4096", "--json").stdout)
    assert (data["backend"], data["device"], data["free_gpu_memory_fraction"]) == ("torch", "cuda", 0.5)
    assert data["kv_blocks"] == data["blocks_free_memory_holds"] and not data["kv_capped_at_max_batch"]
    assert data["requests_of_max_seq_len"] == data["kv_blocks"] // 256
    assert data["target_weight_bytes"] == 2 * LLAMA_8B.param_count
    too_big = run("--target", "llama-70b", "--gpu", "h100", "--backend", "torch")
    assert too_big.exit_code == 1 and "DOES NOT FIT on 1 x H100 80GB" in too_big.output


def test_cli_fraction_is_for_the_portable_engine_only():
    result = run("--target", "llama-8b", "--gpu", "h100", "--free-gpu-memory-fraction", "0.5")
    assert result.exit_code == 2
    assert_one_line_error(result, "--free-gpu-memory-fraction", "--backend torch")
