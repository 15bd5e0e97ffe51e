"""pipeline.models.shape: the one shape every stage reads, from either config.json spelling."""

import json

import pytest

from pipeline.engine.config import ModelConfig
from pipeline.errors import ModelFormatError
from pipeline.models.shape import ModelShape
from pipeline.plan.resolve import model_shape


def test_the_engine_config_planner_and_shape_agree_on_a_real_folder(tiny_target):
    shape = ModelShape.from_folder(tiny_target)
    assert ModelConfig.from_folder(tiny_target).shape == shape
    assert model_shape(str(tiny_target))[1] == shape
    cfg = json.loads((tiny_target / "config.json").read_text())
    assert (shape.num_layers, shape.hidden_size, shape.vocab_size) == (
        cfg["num_hidden_layers"], cfg["hidden_size"], cfg["vocab_size"])


def test_a_tensorrt_llm_checkpoint_config_reads_the_same():
    hf = {"model_type": "llama", "vocab_size": 1000, "hidden_size": 256, "intermediate_size": 512,
          "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 80,
          "tie_word_embeddings": True}
    trtllm = {k: v for k, v in hf.items() if k not in ("head_dim", "tie_word_embeddings")}
    trtllm.update(head_size=80, share_embedding_table=True)
    assert ModelShape.from_hf_config(trtllm) == ModelShape.from_hf_config(hf)
    assert ModelShape.from_hf_config(hf).head_dim == 80  # not hidden // heads = 64


def test_a_config_without_the_shape_names_the_missing_keys(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_embd": 768, "vocab_size": 50257}))
    with pytest.raises(ModelFormatError, match="no hidden_size, intermediate_size, num_hidden_layers, "
                                               "num_attention_heads; the pipeline reads Llama-family"):
        ModelShape.from_folder(tmp_path)
    with pytest.raises(ModelFormatError, match="config.json is missing"):
        ModelShape.from_folder(tmp_path / "nowhere")
