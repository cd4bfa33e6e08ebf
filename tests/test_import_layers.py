"""kserve's imports run downward only and form no cycle: cli, server, engine, the embedded model (tiny), model
and chat (side by side), layers, kernels and distributed, config. Read from the source with `ast`, imports
inside functions included, since a lazy import still ties two modules together."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RANK = {"cli": 0, "server": 1, "engine": 2, "tiny": 3, "model": 4, "chat": 4, "layers": 5, "kernels": 6,
        "distributed": 6, "config": 7}


def _modules() -> dict[str, Path]:
    found = {}
    for package, prefix in ((ROOT / "kserve", ("kserve",)), (ROOT / "kernels", ("kserve", "kernels"))):
        for path in package.rglob("*.py"):
            parts = prefix + path.relative_to(package).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def import_graph() -> dict[str, set[str]]:
    modules = _modules()
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                wanted = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                wanted = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
            else:
                continue
            for target in wanted:
                while target and target not in modules:  # `from kserve.x import name`: the module kserve.x
                    target = target.rpartition(".")[0]
                if target and target != name:
                    targets.add(target)
        graph[name] = targets
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[set[str]]:
    """Strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(component)
    return found


def _layer(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else None  # None: the package's own __init__, above everything


def test_the_graph_is_read_from_every_package():
    graph = import_graph()
    assert {_layer(m) for m in graph} - {None} == set(RANK)
    assert "kserve.engine.tp_workers" in graph["kserve.server.launch"]  # a lazy import, inside run_server
    assert "kserve.kernels.fused_moe" in {t for m in graph if m.startswith("kserve.layers") for t in graph[m]}


def test_no_import_cycles():
    assert _cycles(import_graph()) == []
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [{"a", "b", "c"}]  # the check can fail


def test_imports_run_downward():
    upward = []
    for module, targets in import_graph().items():
        for target in targets:
            here, there = _layer(module), _layer(target)
            if here is not None and here != there and RANK[there] <= RANK[here]:
                upward.append(f"{module} -> {target}")
    assert upward == []
