"""pipeline.quantize.calib and .formats: the built-in text, user files, samples, and the format rules (no ModelOpt)."""

import json

import pytest
from tiny_models import byte_tokenizer

from pipeline.errors import CalibrationError, QuantizeError
from pipeline.models.presets import PRESETS
from pipeline.models.shape import ModelShape
from pipeline.quantize.calib import (BUILTIN_FILE, HELDOUT_EVERY, builtin_records, builtin_split, calibration_text,
                                     evaluation_text, make_samples, split_records)
from pipeline.quantize.formats import FORMATS, block_size_for, check_model_fits, check_request, get_format

SMOLLM2_SHAPE = PRESETS["smollm2-135m"].shape
TINY_128 = ModelShape(vocab_size=1000, hidden_size=128, intermediate_size=256, num_heads=4, num_kv_heads=2, head_dim=32,
                      num_layers=2)


def test_builtin_set_is_small_offline_and_mixes_prose_and_code():
    assert BUILTIN_FILE.stat().st_size < 400_000
    rows = [json.loads(line) for line in BUILTIN_FILE.read_text(encoding="utf-8").splitlines()]
    kinds = [r["kind"] for r in rows]
    assert kinds[:4] == ["prose", "code", "prose", "code"]
    assert kinds.count("prose") > 50 and kinds.count("code") > 50
    assert any("def " in r["text"] for r in rows if r["kind"] == "code")
    assert len(builtin_records()) == len(rows)


def test_builtin_split_is_deterministic_and_disjoint():
    calib, heldout = builtin_split()
    again_calib, again_heldout = builtin_split()
    assert calib.records == again_calib.records and heldout.records == again_heldout.records
    assert not set(calib.records) & set(heldout.records)
    assert len(heldout.records) == len(builtin_records()) // HELDOUT_EVERY
    assert evaluation_text().records == heldout.records
    assert calibration_text("builtin").records == calib.records


def test_split_records_holds_out_every_tenth():
    calib, heldout = split_records([str(i) for i in range(25)])
    assert heldout == ["9", "19"]
    assert len(calib) == 23


def test_user_txt_is_split_on_blank_lines(tmp_path):
    f = tmp_path / "c.txt"
    f.write_text("first sample\nstill first\n\n\nsecond sample\n\nthird\n")
    assert calibration_text(str(f)).records == ("first sample\nstill first", "second sample", "third")


def test_user_jsonl_reads_text_fields(tmp_path):
    f = tmp_path / "c.jsonl"
    f.write_text('{"text": "alpha"}\n\n{"text": "beta", "other": 1}\n')
    assert calibration_text(str(f)).records == ("alpha", "beta")


@pytest.mark.parametrize("name,content,needle", [
    ("empty.txt", "\n \n", "is empty"),
    ("empty.jsonl", "", "is empty"),
    ("bad.jsonl", '{"text": "ok"}\nnot json\n', ":2 is not a JSON object"),
    ("latin1.txt", b"caf\xe9", "can't read"),
])
def test_bad_user_files_raise_calibration_error(tmp_path, name, content, needle):
    f = tmp_path / name
    f.write_bytes(content) if isinstance(content, bytes) else f.write_text(content)
    with pytest.raises(CalibrationError, match=needle):
        calibration_text(str(f))


def test_missing_user_file_raises_calibration_error(tmp_path):
    with pytest.raises(CalibrationError, match="can't read"):
        calibration_text(str(tmp_path / "nope.txt"))


def test_make_samples_cuts_fixed_windows_and_refuses_too_little_text():
    tok = byte_tokenizer()
    samples = make_samples(tok, calibration_text("builtin"), 5, 64)
    assert tuple(samples.shape) == (5, 64)
    assert make_samples(tok, calibration_text("builtin"), 5, 64).equal(samples)
    with pytest.raises(CalibrationError, match="fewer than"):
        make_samples(tok, evaluation_text(), 10_000, 512, what="evaluation")


def test_every_format_has_a_modelopt_config_and_trtllm_algo():
    assert set(FORMATS) == {"fp8", "int4_awq", "w4a8_awq", "int8_sq", "none"}
    for fmt in FORMATS.values():
        assert (fmt.modelopt_cfg is None) == (fmt.trtllm_algo is None) == (not fmt.quantized)


def test_unknown_format_names_the_choices():
    with pytest.raises(QuantizeError, match="unknown --qformat 'int3'.*fp8, int4_awq"):
        get_format("int3")


def test_awq_blocks_are_128_and_int4_falls_back_to_64_where_128_does_not_divide():
    assert block_size_for(get_format("int4_awq"), TINY_128) == 128
    assert block_size_for(get_format("int4_awq"), SMOLLM2_SHAPE) == 64  # hidden 576 = 4.5 x 128
    assert block_size_for(get_format("w4a8_awq"), TINY_128) == 128
    with pytest.raises(QuantizeError, match=r"blocks of 128.*hidden_size \(576\).*--qformat fp8.*int4_awq"):
        check_model_fits(get_format("w4a8_awq"), SMOLLM2_SHAPE)
    odd = ModelShape(vocab_size=1000, hidden_size=96, intermediate_size=256, num_heads=3, num_kv_heads=1, head_dim=32,
                     num_layers=1)
    with pytest.raises(QuantizeError, match=r"blocks of 128 or 64.*hidden_size \(96\)"):
        check_model_fits(get_format("int4_awq"), odd)
    assert block_size_for(get_format("fp8"), odd) is None
    check_model_fits(get_format("fp8"), SMOLLM2_SHAPE)
    check_model_fits(get_format("int8_sq"), SMOLLM2_SHAPE)


def test_awq_blocks_must_fit_each_tensor_parallel_shard():
    assert block_size_for(get_format("int4_awq"), TINY_128, "trtllm", tp_size=2) == 64
    assert block_size_for(get_format("int4_awq"), TINY_128, "hf", tp_size=2) == 128  # hf is never sharded
    with pytest.raises(QuantizeError, match=r"split 2 ways.*smaller --tp-size"):
        check_model_fits(get_format("w4a8_awq"), TINY_128, "trtllm", tp_size=2)


def test_fp8_needs_multiples_of_16():
    odd = ModelShape(vocab_size=1000, hidden_size=72, intermediate_size=144, num_heads=2, num_kv_heads=1, head_dim=36,
                     num_layers=1)
    with pytest.raises(QuantizeError, match="multiples of 16.*--qformat none"):
        check_model_fits(get_format("fp8"), odd)
    check_model_fits(get_format("none"), odd)


def test_tp_must_divide_heads_and_trtllm_needs_a_known_decoder():
    with pytest.raises(QuantizeError, match="--tp-size 2 does not divide num_attention_heads"):
        check_model_fits(get_format("fp8"), SMOLLM2_SHAPE, "trtllm", tp_size=2)
    gpt2 = ModelShape(model_type="gpt2", vocab_size=1000, hidden_size=128, intermediate_size=512,
                      num_heads=4, num_kv_heads=4, head_dim=32, num_layers=2)
    with pytest.raises(QuantizeError, match="--export hf"):
        check_model_fits(get_format("fp8"), gpt2, "trtllm")


@pytest.mark.parametrize("args,needle", [
    (("none", "fp8", "hf", 1, 1), "needs a quantized --qformat"),
    (("fp8", "int4", "hf", 1, 1), "unknown --kv-cache-dtype"),
    (("fp8", "none", "onnx", 1, 1), "unknown --export"),
    (("fp8", "none", "hf", 2, 1), "--export trtllm"),
    (("fp8", "none", "trtllm", 0, 1), ">= 1"),
])
def test_check_request_rejects_inconsistent_flags(args, needle):
    qformat, *rest = args
    with pytest.raises(QuantizeError, match=needle):
        check_request(get_format(qformat), *rest)
