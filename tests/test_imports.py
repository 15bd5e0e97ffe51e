"""The package's shape: no import cycle between its parts or between its modules, and the torch-free modules stay
torch-free."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "pipeline"


def part_imports() -> dict[str, set[str]]:
    """pipeline.<part> -> the other parts it imports (anywhere in its files, function bodies included)."""
    graph: dict[str, set[str]] = {}
    for f in PACKAGE.rglob("*.py"):
        rel = f.relative_to(PACKAGE.parent).with_suffix("").parts
        part = ".".join(rel[:2]) if len(rel) > 1 else rel[0]
        for node in ast.walk(ast.parse(f.read_text())):
            names = ([node.module] if isinstance(node, ast.ImportFrom) and node.module and node.level == 0
                     else [a.name for a in node.names] if isinstance(node, ast.Import) else [])
            for name in names:
                if name.startswith("pipeline."):
                    other = ".".join(name.split(".")[:2])
                    if other != part:
                        graph.setdefault(part, set()).add(other)
    return graph


def module_imports() -> dict[str, set[str]]:
    """pipeline.x.y -> the modules of the package it imports, function bodies included: an import moved inside a
    function hides a cycle from Python at load time, not from a reader."""
    def name(f: Path) -> str:
        rel = f.relative_to(PACKAGE.parent).with_suffix("").parts
        return ".".join(rel[:-1] if rel[-1] == "__init__" else rel)

    files = {name(f): f for f in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for module, f in files.items():
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                # `from pipeline.trtllm import upstream` names a module; `from pipeline.engine import X`, the package
                targets = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in files else node.module
                           for a in node.names]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                continue
            graph.setdefault(module, set()).update(t for t in targets if t in files and t != module)
    return graph


def cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(node: str, path: list[str]) -> list[str] | None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt] if nxt in path else [node, nxt]
            if nxt not in state and (found := visit(nxt, path + [nxt])):
                return found
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (found := visit(start, [start])):
            return found
    return None


def test_the_parts_import_each_other_one_way_only():
    assert cycle(part_imports()) is None, " -> ".join(cycle(part_imports()))


def test_the_modules_import_each_other_one_way_only():
    graph = module_imports()
    assert len(graph) > 100 and "pipeline.trtllm.upstream" in graph["pipeline.triton.config"]  # it reads the imports
    assert cycle(graph) is None, " -> ".join(cycle(graph))


def test_the_cycle_check_sees_a_cycle():
    assert cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert cycle({"a": {"b"}, "b": set()}) is None


def test_the_policy_the_routes_and_the_draft_vocabulary_load_without_torch():
    """Every module of pipeline.policy (the gate, the draft planner, the cost model, the serving gate), the routes and
    the draft vocabulary: the Triton configs and every command's planning read them; `pipeline.engine`'s own names
    load lazily."""
    policy = sorted(f"pipeline.policy.{f.stem}" for f in (PACKAGE / "policy").glob("*.py") if f.stem != "__init__")
    assert len(policy) >= 6
    code = (f"import sys; import {', '.join(policy)}, pipeline.draft_spec, pipeline.engine, pipeline.routes; "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def design_layers() -> list[list[str]]:
    """The package picture in docs/design.md, top floor first: each line's parts (`engine/`, `generate.py`)."""
    text = (PACKAGE.parent / "docs" / "design.md").read_text()
    block = text.split("## The packages", 1)[1].split("```", 2)[1]
    return [[name.rstrip("/").removesuffix(".py") for name in line.split("  ")[0].split()]
            for line in block.strip("\n").splitlines() if line and not line.startswith(" ")]


def test_each_part_imports_only_the_parts_below_it_in_the_design_picture():
    """docs/design.md's picture is the layer order: a part may import only parts on lower lines (import-linter's
    `layers` contract, held here), and every part of the package is on it."""
    layers = design_layers()
    floor = {part: i for i, line in enumerate(layers) for part in line}
    graph = part_imports()
    parts = {p.split(".")[1] for p in graph} | {q.split(".")[1] for deps in graph.values() for q in deps}
    assert parts <= set(floor), f"not in docs/design.md's picture: {sorted(parts - set(floor))}"
    upward = sorted(f"{a} -> {b}" for a, deps in graph.items() for b in deps
                    if floor[b.split(".")[1]] <= floor[a.split(".")[1]])
    assert upward == []


def test_the_layer_reading_sees_the_picture():
    layers = design_layers()
    assert layers[0] == ["cli"] and ["routes"] in layers and layers[-1][0] == "errors" and len(layers) >= 10
