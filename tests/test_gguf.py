import json
import os
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from pipeline.errors import ModelFormatError, ModelNotFoundError
from pipeline.home import pipeline_home
from pipeline.models.gguf import convert_gguf
from pipeline.models.resolve import resolve_model

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["h e", "Ġ t", "Ġt he", "l l", "e ll"]


def write_tiny_gguf(path: Path, seed: int = 0, *, layers: int = 2, hidden: int = 64, heads: int = 4,
                    kv_heads: int = 2, intermediate: int = 96, tie: bool = True) -> Path:
    """A seeded random Llama GGUF (f32 tensors) with a byte-level BPE tokenizer and a chat template,
    carrying the metadata transformers' GGUF loader needs."""
    from gguf import GGUFWriter, TokenType
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    byte_tokens = list(bytes_to_unicode().values())
    merged = ["".join(m.split(" ")) for m in MERGES]
    tokens = byte_tokens + merged + SPECIALS
    types = [TokenType.NORMAL] * (len(tokens) - len(SPECIALS)) + [TokenType.CONTROL] * len(SPECIALS)
    vocab = len(tokens)
    eos = tokens.index("<|im_end|>")

    w = GGUFWriter(str(path), "llama")
    w.add_name("tiny-llama")
    w.add_context_length(256)
    w.add_block_count(layers)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(intermediate)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_dimension_count(hidden // heads)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(vocab)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(MERGES)
    w.add_bos_token_id(tokens.index("<|im_start|>"))
    w.add_eos_token_id(eos)
    w.add_add_bos_token(False)
    w.add_chat_template(CHAT_TEMPLATE)

    rng = np.random.default_rng(seed)

    def rand(*shape):  # numpy in torch layout [out, in]; the writer reverses dims the way llama.cpp does
        return (rng.standard_normal(shape) * 0.1).astype(np.float32)

    head_dim = hidden // heads
    w.add_tensor("token_embd.weight", rand(vocab, hidden))
    w.add_tensor("output_norm.weight", 1 + rand(hidden))
    if not tie:
        w.add_tensor("output.weight", rand(vocab, hidden))
    for i in range(layers):
        b = f"blk.{i}."
        w.add_tensor(b + "attn_norm.weight", 1 + rand(hidden))
        w.add_tensor(b + "attn_q.weight", rand(heads * head_dim, hidden))
        w.add_tensor(b + "attn_k.weight", rand(kv_heads * head_dim, hidden))
        w.add_tensor(b + "attn_v.weight", rand(kv_heads * head_dim, hidden))
        w.add_tensor(b + "attn_output.weight", rand(hidden, heads * head_dim))
        w.add_tensor(b + "ffn_norm.weight", 1 + rand(hidden))
        w.add_tensor(b + "ffn_gate.weight", rand(intermediate, hidden))
        w.add_tensor(b + "ffn_up.weight", rand(intermediate, hidden))
        w.add_tensor(b + "ffn_down.weight", rand(hidden, intermediate))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> Path:
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny-llama.gguf")


def engine_logits(folder: Path, ids: list[int]) -> torch.Tensor:
    from pipeline.engine.kv_cache import ForwardBatch
    from pipeline.engine.weights import load_transformer

    model = load_transformer(folder, max_seq_len=64)
    cache = model.new_cache(1, 64)
    fb = ForwardBatch.build([0], [0], [len(ids)], cache)
    with torch.no_grad():
        return model(torch.tensor([ids]), fb, cache)[0]  # [T, V]


def gguf_reference_logits(gguf_file: Path, ids: list[int]) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(str(gguf_file.parent), gguf_file=gguf_file.name,
                                               dtype=torch.float32)
    with torch.no_grad():
        return ref(torch.tensor([ids])).logits[0]


@pytest.mark.parametrize("tie", [True, False])
def test_converted_folder_matches_transformers_gguf_logits(tmp_path, tie):
    gguf_file = write_tiny_gguf(tmp_path / "m.gguf", seed=3, tie=tie)
    folder = convert_gguf(gguf_file, tmp_path / "out")

    cfg = json.loads((folder / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    assert cfg["tie_word_embeddings"] is tie
    assert "quantization_config" not in cfg
    from safetensors import safe_open
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        assert ("lm_head.weight" in f.keys()) is not tie

    ids = [5, 80, 200, 7, 263, 41]
    diff = (engine_logits(folder, ids) - gguf_reference_logits(gguf_file, ids)).abs().max().item()
    assert diff < 1e-3


def test_converted_tokenizer_keeps_chat_template_and_specials(tmp_path, tiny_gguf):
    from transformers import AutoTokenizer

    folder = convert_gguf(tiny_gguf, tmp_path / "out")
    tok = AutoTokenizer.from_pretrained(str(folder))
    assert tok.chat_template == CHAT_TEMPLATE
    assert tok.eos_token == "<|im_end|>"
    assert tok.convert_ids_to_tokens(tok("<|im_end|>", add_special_tokens=False).input_ids) == ["<|im_end|>"]
    assert tok.decode(tok("hello the world").input_ids) == "hello the world"


def test_second_conversion_returns_cached_folder_without_work(tmp_path, tiny_gguf):
    out = tmp_path / "out"
    convert_gguf(tiny_gguf, out)
    stamp = (out / "model.safetensors").stat().st_mtime_ns
    start = time.perf_counter()
    assert convert_gguf(tiny_gguf, out) == out
    assert time.perf_counter() - start < 0.5
    assert (out / "model.safetensors").stat().st_mtime_ns == stamp


def test_failed_conversion_leaves_no_folder_behind(tmp_path):
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + b"\x00" * 64)  # a header with nothing behind it
    with pytest.raises(ModelFormatError, match="could not be read as a GGUF"):
        convert_gguf(bad, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    assert list(tmp_path.glob(".out.tmp-*")) == []


def test_damaged_cache_folder_is_reported_not_overwritten(tmp_path, tiny_gguf):
    out = tmp_path / "out"
    out.mkdir()
    (out / "config.json").write_text("{}")
    with pytest.raises(ModelFormatError, match="incomplete conversion.*delete it"):
        convert_gguf(tiny_gguf, out)


def test_abandoned_temp_folder_of_a_dead_process_is_swept(tmp_path, tiny_gguf):
    stale = tmp_path / ".out.tmp-999999999-abc"  # no such pid
    stale.mkdir()
    (stale / "model.safetensors").write_bytes(b"half")
    convert_gguf(tiny_gguf, tmp_path / "out")
    assert not stale.exists()


def test_resolve_gguf_caches_under_pipeline_home_keyed_by_file(tmp_path, tiny_gguf):
    first = resolve_model(str(tiny_gguf))
    assert first.source == "gguf" and first.name == "tiny-llama"
    assert first.path.parent == pipeline_home() / "models"
    assert first.path.name.startswith("tiny-llama-")
    assert resolve_model(str(tiny_gguf)).path == first.path

    copy = tmp_path / "tiny-llama.gguf"  # same stem, different file: its own cache entry
    copy.write_bytes(tiny_gguf.read_bytes())
    assert resolve_model(str(copy)).path != first.path


def test_missing_gguf_file_is_a_not_found_error(tmp_path):
    with pytest.raises(ModelNotFoundError, match="no such file"):
        resolve_model(str(tmp_path / "nope.gguf"))


@pytest.mark.slow
def test_embedded_smollm2_resolves_converts_once_and_keeps_chat_template(smollm2, monkeypatch):
    from transformers import AutoTokenizer

    from pipeline.engine.config import ModelConfig

    # The session fixture converted the embedded GGUF into its own home; resolve against that home.
    monkeypatch.setenv("PIPELINE_HOME", str(smollm2.parent.parent))
    resolved = resolve_model("smollm2-135m")
    assert resolved.source == "preset" and resolved.name == "smollm2-135m"
    assert resolved.path == pipeline_home() / "models" / "smollm2-135m" == smollm2
    cfg = ModelConfig.from_folder(resolved.path)
    assert (cfg.num_layers, cfg.hidden_size, cfg.vocab_size) == (30, 576, 49152)
    assert (cfg.num_heads, cfg.num_kv_heads) == (9, 3)
    assert cfg.tie_word_embeddings

    start = time.perf_counter()
    assert resolve_model("SmolLM2").path == resolved.path
    assert time.perf_counter() - start < 2

    tok = AutoTokenizer.from_pretrained(str(resolved.path))
    assert "<|im_start|>" in tok.chat_template
    assert [p for p in os.listdir(resolved.path.parent) if ".tmp-" in p] == []
