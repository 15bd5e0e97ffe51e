"""The kernel set (pipeline/engine/kernels.py): chosen once for the device, handed to every layer, and the only thing
the forwards ask which kernels to run (issue 53's "device checks in the model's forwards: 0")."""

from __future__ import annotations

import ast
import inspect

import pytest
import torch

from pipeline.engine import cpu_kernels, eagle3, linear, model, moe, quant, swiglu
from pipeline.engine.config import ModelConfig
from pipeline.engine.kernels import AUTO, Chosen, for_device, use_kernels
from pipeline.engine.kv_cache import ForwardBatch
from pipeline.engine.model import Transformer, choose_kernels

FORWARD_MODULES = (model, linear, swiglu, quant, moe, eagle3)


def forward_methods():
    for module in FORWARD_MODULES:
        for _, cls in inspect.getmembers(module, inspect.isclass):
            if cls.__module__ == module.__name__ and issubclass(cls, torch.nn.Module):
                for name in ("forward", "add_forward"):
                    if name in cls.__dict__:
                        yield f"{module.__name__}.{cls.__name__}.{name}", inspect.getsource(cls.__dict__[name])


def device_questions(source: str) -> list[str]:
    """Where a forward branches on a device: a comparison that reads `.device`, `.is_cuda`, or the per-tensor
    choosers (gpu_kernels.runs_here, cpu_kernels.for_tensor). Making a tensor on another's device is no question."""
    tree = ast.parse(inspect.cleandoc("\n" + source) if source[:1].isspace() else source)
    found = []
    for n in ast.walk(tree):
        if isinstance(n, ast.Compare) and any(isinstance(a, ast.Attribute) and a.attr == "device"
                                               for a in ast.walk(n)):
            found.append(ast.unparse(n))
        elif isinstance(n, ast.Attribute) and n.attr in ("is_cuda", "runs_here", "for_tensor"):
            found.append(ast.unparse(n))
    return found


def test_no_forward_asks_a_tensor_which_device_it_is_on():
    asked = {name: found for name, source in forward_methods() if (found := device_questions(source))}
    assert asked == {}
    assert len(list(forward_methods())) >= 10  # it reads the forwards


def test_the_scan_sees_a_device_question():
    assert device_questions("def forward(self, x):\n    if x.device.type == 'cpu' or gpu_kernels.runs_here(x):\n"
                            "        return torch.arange(3, device=x.device)\n") == [
        "x.device.type == 'cpu'", "gpu_kernels.runs_here"]


def tiny(layers=2) -> Transformer:
    cfg = ModelConfig(model_type="llama", vocab_size=64, hidden_size=96, intermediate_size=160, num_layers=layers,
                      num_heads=6, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-5, rope_theta=10000.0,
                      rope_scaling=None, max_position_embeddings=256, tie_word_embeddings=False, qkv_bias=False)
    torch.manual_seed(0)
    m = Transformer(cfg, 64).to(torch.bfloat16)
    for p in m.parameters():
        torch.nn.init.normal_(p, std=0.05)
    return m.pack_weights()


def logits(m: Transformer) -> torch.Tensor:
    cache = m.new_cache(1, 64)
    ids = torch.tensor([[1, 5, 9, 2, 7]])
    return m(ids, ForwardBatch.build([0], [0], [5], cache), cache)


def test_a_model_hands_one_set_to_every_layer_that_runs_one():
    m = tiny()
    assert all(getattr(x, "kernels", AUTO) is AUTO for x in m.modules())
    choose_kernels(m)
    chosen = m.kernels
    assert isinstance(chosen, Chosen) and chosen == for_device("cpu")
    holders = [x for x in m.modules() if hasattr(x, "kernels")]
    assert len(holders) > 10 and all(x.kernels is chosen for x in holders)


@pytest.mark.skipif(not cpu_kernels.usable(), reason=f"no C kernels: {cpu_kernels.status()}")
def test_the_forwards_run_the_set_they_were_handed(monkeypatch):
    """The torch set runs torch's ops where the C kernels are built; the C set runs them, and gives the bits a
    layer with no set of its own (AUTO) gives."""
    assert for_device("cpu").name == "c"
    m = tiny()
    auto = logits(m)
    choose_kernels(m)
    assert torch.equal(logits(m), auto)
    use_kernels(m, Chosen("torch"))
    calls = []
    real = cpu_kernels.for_dtype
    monkeypatch.setattr(cpu_kernels, "for_dtype", lambda x: calls.append(1) or real(x))
    torch_ops = logits(m)
    assert calls == [] and torch_ops.shape == auto.shape
    use_kernels(m, for_device("cpu"))
    assert torch.equal(logits(m), auto) and len(calls) > 0
