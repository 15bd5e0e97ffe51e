"""`quantize()` and `pipeline quantize` with real NVIDIA ModelOpt on seeded tiny models (CPU fake quant).

One tiny Llama (hidden 128, intermediate 256: whole AWQ blocks of 128; rope theta 500000, so a
dropped rotary_base shows) is quantized once per format and export, module-scoped: ModelOpt's
import alone takes about 10 s, each run on the tiny model a second or two.
"""

import json
import math
import struct
from pathlib import Path

import pytest
from click.testing import CliRunner
from tiny_models import make_tiny_llama

from pipeline.cli import main
from pipeline.errors import QuantizeError
from pipeline.models.resolve import resolve_model
from pipeline.quantize import QuantizeOptions, quantize
from cli_checks import assert_one_line_error  # noqa: E402

ROPE_THETA = 500000.0
QUANT_ALGO = {"fp8": "FP8", "int4_awq": "W4A16_AWQ", "w4a8_awq": "W4A8_AWQ", "int8_sq": "W8A8_SQ_PER_CHANNEL"}
CALIB = dict(calib_size=4, calib_seq_len=64, eval_size=4)


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("q-src"), seed=3, hidden=128, intermediate=256, heads=4,
                           kv_heads=2, layers=2, rope_scaling={"rope_type": "default"})


@pytest.fixture(scope="module")
def quantized(source, tmp_path_factory):
    """quantized(qformat, **options) -> (output folder, report): each distinct request runs once per module."""
    root, done = tmp_path_factory.mktemp("q-out"), {}

    def run(qformat: str, **options):
        key = (qformat, tuple(sorted(options.items())))
        if key not in done:
            out = root / f"{qformat}-{len(done)}"
            done[key] = out, quantize(QuantizeOptions(model=str(source), qformat=qformat, output=out,
                                                      **{**CALIB, **options}))
        return done[key]

    return run


def tensors(folder: Path) -> dict[str, tuple[str, list[int]]]:
    """name -> (safetensors dtype, shape), from the headers of every *.safetensors in folder."""
    out = {}
    for file in sorted(folder.glob("*.safetensors")):
        with file.open("rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(n))
        out.update({k: (v["dtype"], v["shape"]) for k, v in header.items() if k != "__metadata__"})
    return out


@pytest.mark.parametrize("qformat", ["fp8", "int4_awq", "w4a8_awq", "int8_sq", "none"])
def test_each_format_exports_a_complete_hf_folder_with_a_sane_report(quantized, qformat):
    out, report = quantized(qformat)
    assert resolve_model(str(out)).path == out  # config, safetensors and tokenizer: a model folder
    assert (out / "tokenizer.json").is_file() and (out / "config.json").is_file()
    assert json.loads((out / "report.json").read_text()) == report.to_dict()
    assert report.quant_algo == QUANT_ALGO.get(qformat)
    if qformat == "none":
        assert not (out / "hf_quant_config.json").exists()
        assert report.perplexity_after == report.perplexity_before and report.top1_agreement == 1.0
        assert report.bytes_after == report.bytes_before and report.calib_samples == 0
    else:
        hf_quant = json.loads((out / "hf_quant_config.json").read_text())
        assert hf_quant["quantization"]["quant_algo"] == QUANT_ALGO[qformat]
        assert report.bytes_after < report.bytes_before
        assert report.calib_tokens == 4 * 64 and report.calib_data == "builtin"
    assert math.isfinite(report.perplexity_before) and math.isfinite(report.perplexity_after)
    assert 0 < report.top1_agreement <= 1
    assert report.eval_data == "builtin (held out)" and report.eval_samples == 4


def test_fp8_weights_are_float8_with_weight_and_input_scales(quantized):
    out, _ = quantized("fp8")
    t = tensors(out)
    assert t["model.layers.0.self_attn.q_proj.weight"] == ("F8_E4M3", [128, 128])
    assert "model.layers.0.self_attn.q_proj.weight_scale" in t
    assert "model.layers.0.mlp.down_proj.input_scale" in t
    assert t["lm_head.weight"][0] == "F32"  # lm_head stays unquantized, in the source's dtype


@pytest.mark.parametrize("qformat", ["int4_awq", "w4a8_awq"])
def test_int4_weights_are_packed_uint8_with_per_block_scales(quantized, qformat):
    out, report = quantized(qformat)
    assert report.block_size == 128
    t = tensors(out)
    # [out, in] = [256, 128]: two int4 per byte along out, one scale per 128 input features.
    assert t["model.layers.0.mlp.gate_proj.weight"] == ("U8", [128, 128])
    assert t["model.layers.0.mlp.gate_proj.weight_scale"][1] == [256, 1]
    assert t["model.layers.0.mlp.down_proj.weight_scale"][1] == [128, 2]


def test_int8_smoothquant_weights_are_int8(quantized):
    out, _ = quantized("int8_sq")
    assert tensors(out)["model.layers.0.mlp.up_proj.weight"] == ("I8", [256, 128])


def test_fp8_kv_cache_is_in_the_config_and_has_scales(quantized):
    out, report = quantized("fp8", kv_cache_dtype="fp8")
    assert json.loads((out / "hf_quant_config.json").read_text())["quantization"]["kv_cache_quant_algo"] == "FP8"
    assert report.kv_cache_dtype == "fp8"
    t = tensors(out)
    assert "model.layers.0.self_attn.k_proj.k_scale" in t and "model.layers.0.self_attn.v_proj.v_scale" in t
    plain, _ = quantized("fp8")
    assert json.loads((plain / "hf_quant_config.json").read_text())["quantization"].get("kv_cache_quant_algo") is None


def test_trtllm_export_shards_by_tp_and_keeps_the_source_rope_theta(quantized, source):
    out, report = quantized("fp8", kv_cache_dtype="fp8", export="trtllm", tp_size=2)
    config = json.loads((out / "config.json").read_text())
    assert config["quantization"]["quant_algo"] == "FP8"
    assert config["quantization"]["kv_cache_quant_algo"] == "FP8"
    assert config["mapping"]["tp_size"] == 2 and config["mapping"]["world_size"] == 2
    source_theta = json.loads((source / "config.json").read_text())["rope_parameters"]["rope_theta"]
    assert source_theta == ROPE_THETA
    assert config["rotary_base"] == source_theta
    assert sorted(p.name for p in out.glob("*.safetensors")) == ["rank0.safetensors", "rank1.safetensors"]
    assert report.bytes_after < report.bytes_before


def test_trtllm_export_of_awq_and_pipeline_parallel(quantized):
    out, _ = quantized("int4_awq", export="trtllm", pp_size=2)
    config = json.loads((out / "config.json").read_text())
    assert config["quantization"]["quant_algo"] == "W4A16_AWQ"
    assert config["mapping"]["pp_size"] == 2 and config["rotary_base"] == ROPE_THETA
    assert sorted(p.name for p in out.glob("*.safetensors")) == ["rank0.safetensors", "rank1.safetensors"]


def test_unquantized_tensors_keep_a_bf16_source_dtype(source, tmp_path):
    """Calibration runs in fp32 on CPU; the export casts back, or a bf16 model would grow."""
    import torch
    from transformers import AutoModelForCausalLM

    src16 = tmp_path / "src16"
    AutoModelForCausalLM.from_pretrained(source, dtype=torch.bfloat16).save_pretrained(src16)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (src16 / f).write_bytes((source / f).read_bytes())
    report = quantize(QuantizeOptions(model=str(src16), qformat="fp8", output=tmp_path / "out", **CALIB))
    t = tensors(tmp_path / "out")
    assert t["model.embed_tokens.weight"][0] == "BF16" and t["model.norm.weight"][0] == "BF16"
    assert t["model.layers.0.mlp.up_proj.weight"][0] == "F8_E4M3"
    assert report.bytes_after < report.bytes_before


def test_int4_awq_uses_blocks_of_64_where_128_does_not_divide(tmp_path):
    """SmolLM2-135M's case (hidden 576): ModelOpt's exports refuse partial blocks of 128."""
    src = make_tiny_llama(tmp_path / "src", seed=4, hidden=192, intermediate=320, heads=3, kv_heads=1, layers=1)
    report = quantize(QuantizeOptions(model=str(src), qformat="int4_awq", output=tmp_path / "out", **CALIB))
    assert report.block_size == 64
    assert json.loads((tmp_path / "out" / "hf_quant_config.json").read_text())["quantization"]["group_size"] == 64
    t = tensors(tmp_path / "out")
    assert t["model.layers.0.mlp.down_proj.weight"] == ("U8", [96, 320])
    assert t["model.layers.0.mlp.down_proj.weight_scale"][1] == [192, 5]


def test_awq_on_a_model_without_whole_blocks_fails_before_loading(tiny_target, tmp_path):
    with pytest.raises(QuantizeError, match=r"blocks of 128.*hidden_size \(64\)"):
        quantize(QuantizeOptions(model=str(tiny_target), qformat="w4a8_awq", output=tmp_path / "out"))
    assert not (tmp_path / "out").exists()


# --- the CLI ---------------------------------------------------------------------------------------

def run(*args):
    return CliRunner().invoke(main, ["quantize", *[str(a) for a in args]])


def leftovers(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if ".tmp-" in p.name or ".old-" in p.name)


def test_cli_json_report(source, tmp_path):
    out = tmp_path / "fp8"
    result = run("--model", source, "--qformat", "fp8", "--calib-size", 2, "--calib-seq-len", 32,
                 "--eval-size", 2, "-o", out, "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["qformat"] == "fp8" and report["quant_algo"] == "FP8"
    assert report["calib_tokens"] == 64 and report["eval_seq_len"] == 32
    assert report == json.loads((out / "report.json").read_text())
    assert leftovers(tmp_path) == []


def test_cli_table_report(source, tmp_path):
    result = run("--model", source, "--qformat", "none", "--eval-size", 2, "--calib-seq-len", 32, "-o", tmp_path / "o")
    assert result.exit_code == 0, result.output
    for row in ("format", "weights", "perplexity", "top-1 agreement", "export time"):
        assert row in result.stdout


def test_cli_refuses_existing_output_and_replaces_it_with_force(source, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "old.txt").write_text("old")
    assert_one_line_error(run("--model", source, "--qformat", "none", "-o", out), "already exists", "--force")
    assert (out / "old.txt").is_file()
    result = run("--model", source, "--qformat", "none", "--eval-size", 2, "--calib-seq-len", 32, "-o", out, "--force")
    assert result.exit_code == 0, result.output
    assert not (out / "old.txt").exists() and (out / "report.json").is_file()
    assert leftovers(tmp_path) == []


@pytest.mark.parametrize("force", [False, True])
def test_cli_failure_mid_way_leaves_no_folder_and_no_temp_dir(source, tmp_path, monkeypatch, force):
    import pipeline.quantize.export as export

    def broken(*args, **kwargs):
        raise QuantizeError("export exploded; this is a test")

    monkeypatch.setattr(export, "export_hf", broken)
    out = tmp_path / "out"
    if force:
        out.mkdir()
        (out / "keep.txt").write_text("old")
    result = run("--model", source, "--qformat", "none", "--eval-size", 2, "--calib-seq-len", 32, "-o", out,
                 *(["--force"] if force else []))
    assert_one_line_error(result, "export exploded")
    assert out.exists() == force and (not force or (out / "keep.txt").read_text() == "old")
    assert leftovers(tmp_path) == []


def test_cli_unknown_format(source, tmp_path):
    assert_one_line_error(run("--model", source, "--qformat", "int3", "-o", tmp_path / "o"), "int3", "fp8")


def test_cli_format_the_architecture_cannot_take(tiny_target, tmp_path):
    assert_one_line_error(run("--model", tiny_target, "--qformat", "w4a8_awq", "-o", tmp_path / "o"),
                          "blocks of 128", "--qformat fp8")


def test_cli_empty_calibration_file(source, tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    assert_one_line_error(run("--model", source, "--qformat", "fp8", "--calib-data", empty, "-o", tmp_path / "o"),
                          "is empty")
    assert not (tmp_path / "o").exists()


def test_cli_unreadable_calibration_file(source, tmp_path):
    assert_one_line_error(run("--model", source, "--qformat", "fp8", "--calib-data", tmp_path / "missing.jsonl",
                              "-o", tmp_path / "o"), "can't read")


def test_cli_user_calibration_file(source, tmp_path):
    data = tmp_path / "calib.jsonl"
    data.write_text("".join(json.dumps({"text": f"def f{i}(x):\n    return x * {i}\n" * 4}) + "\n" for i in range(20)))
    result = run("--model", source, "--qformat", "int8_sq", "--calib-data", data, "--calib-size", 2,
                 "--calib-seq-len", 64, "--eval-size", 2, "-o", tmp_path / "o", "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["calib_data"] == str(data)


def test_cli_too_little_calibration_text(source, tmp_path):
    data = tmp_path / "short.txt"
    data.write_text("just a few words")
    assert_one_line_error(run("--model", source, "--qformat", "fp8", "--calib-data", data, "-o", tmp_path / "o"),
                          "fewer than", "--calib-size")


def test_cli_tp_without_trtllm_export(source, tmp_path):
    assert_one_line_error(run("--model", source, "--qformat", "fp8", "--tp-size", 2, "-o", tmp_path / "o"),
                          "--export trtllm")


def test_output_folder_has_ordinary_permissions(quantized):
    import os
    import stat

    out, _ = quantized("none")
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE(out.stat().st_mode) == 0o777 & ~umask
