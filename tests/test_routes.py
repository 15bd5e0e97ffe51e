"""The routes package is the one place that knows the routes' and backends' names (issue 53): everywhere else holds a
Route or Backend object and asks it. And the objects say what the files they're read from say."""

from __future__ import annotations

import ast
from pathlib import Path
from types import SimpleNamespace

import pytest

from pipeline.engine.device import DeviceChoice
from pipeline.errors import ConfigError
from pipeline.routes import (ENGINE, LLMAPI, PORTABLE, PORTABLE_BACKEND, ROUTES, TRTLLM_BACKEND, backend_named,
                             pick_route, route_named)

PACKAGE = Path(__file__).resolve().parent.parent / "pipeline"
NAMES = {route.name for route in ROUTES} | {route.repo_backend for route in ROUTES} | {"torch", "trtllm"}


def _names_in(node: ast.AST) -> bool:
    if isinstance(node, ast.Constant):
        return node.value in NAMES
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return any(_names_in(e) for e in node.elts)
    return False


def name_comparisons(source: str) -> list[int]:
    """Lines that compare a route or backend with a name (==, !=, in, not in): a name on one side, something called
    route or backend on the other. ("trtllm" is also a checkpoint layout and an export format: `layout ==
    "trtllm"` compares a layout.)"""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
            sides = (node.left, *node.comparators)
            if any(_names_in(n) for n in sides) and any(
                    not _names_in(n) and any(w in ast.unparse(n).lower() for w in ("route", "backend")) for n in sides):
                lines.append(node.lineno)
    return sorted(lines)


# A linear's kernel back end (PIPELINE_LINEAR: auto, onednn or torch) is not a route.
OTHER_BACKENDS = {"pipeline/engine/linear.py": 1}


def test_no_module_outside_the_routes_package_compares_a_route_or_backend_name():
    found = {str(f.relative_to(PACKAGE.parent)): len(lines) for f in sorted(PACKAGE.rglob("*.py"))
             if "routes" not in f.relative_to(PACKAGE).parts and (lines := name_comparisons(f.read_text()))}
    assert found == OTHER_BACKENDS


def test_the_count_sees_a_comparison():
    assert name_comparisons('if r.route == "engine" or backend in ("torch", "x"):\n    pass\n') == [1, 1]
    assert name_comparisons('if spec.get("backend") != "llmapi":\n    pass\n') == [1]
    assert name_comparisons('if device == "cpu" or layout == "trtllm":\n    pass\n') == []


def test_names_read_from_files_give_the_route_they_name():
    assert route_named("torch") is PORTABLE and route_named("engine") is ENGINE and route_named("llmapi") is LLMAPI
    assert route_named("trtllm") is ENGINE  # a repository's `backend` for the engine route
    assert backend_named("torch") is PORTABLE_BACKEND and backend_named("trtllm") is TRTLLM_BACKEND
    with pytest.raises(ConfigError, match="unknown route 'tensorrt'"):
        route_named("tensorrt")
    with pytest.raises(ConfigError, match="unknown --backend 'vllm'; pick one of torch, trtllm"):
        backend_named("vllm")


def _ckpt(layout):
    return SimpleNamespace(layout=layout, path=Path(f"/m/{layout}"))


@pytest.mark.parametrize("backend, route, layout, draft, picked", [
    ("torch", "auto", "hf", "eagle3", PORTABLE),
    ("trtllm", "auto", "trtllm", "model", ENGINE),
    ("trtllm", "auto", "trtllm", "none", ENGINE),
    ("trtllm", "auto", "hf", "model", LLMAPI),
    ("trtllm", "auto", "hf", "ngram", LLMAPI),
    ("trtllm", "llmapi", "hf", "eagle3", LLMAPI),
    ("trtllm", "engine", "trtllm", "model", ENGINE),
])
def test_the_route_picked_for_a_backend_a_layout_and_a_draft(backend, route, layout, draft, picked):
    assert pick_route(backend, route, _ckpt(layout), SimpleNamespace(kind=draft)) is picked


@pytest.mark.parametrize("backend, route, layout, draft, says", [
    ("torch", "auto", "trtllm", "none", "--backend torch loads Hugging Face checkpoints"),
    ("trtllm", "engine", "hf", "model", "--route engine builds from a TensorRT-LLM checkpoint"),
    ("trtllm", "engine", "trtllm", "eagle3", "--draft eagle3 runs on TensorRT-LLM's PyTorch backend"),
    ("trtllm", "auto", "trtllm", "ngram", "--route llmapi \\(PyTorch backend\\) loads Hugging Face checkpoints"),
    ("trtllm", "fast", "hf", "none", "unknown --route 'fast'; pick one of auto, engine, llmapi"),
])
def test_a_route_that_cant_take_the_checkpoint_or_draft_says_why(backend, route, layout, draft, says):
    with pytest.raises(ConfigError, match=says):
        pick_route(backend, route, _ckpt(layout), SimpleNamespace(kind=draft))


def test_only_the_portable_engine_takes_a_device():
    PORTABLE.check_device(DeviceChoice("cuda:0"), "x")
    for route in (ENGINE, LLMAPI):
        route.check_device(DeviceChoice("auto"), "x")
        with pytest.raises(ConfigError, match="--device cpu places the portable engine, and /e is for TensorRT-LLM, "
                                              "which runs its engines on the GPUs of their tp/pp mapping: drop"):
            route.check_device(DeviceChoice("cpu"), "/e")
