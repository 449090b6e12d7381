"""The package's import graph (read with ast, nothing imported): dependencies go one way.

Layers, lowest first (a module may import its own package and lower layers only; packages on
one layer do not import each other):
  0 config, errors, heap, ids, manifest, paths
  1 engine (ONNX execution), net (wire), planner (pure placement)
  2 node (the stage node), prober (measuring a cluster)
  3 client (the public API's machinery), serve (gateway and scheduler)
  4 edgelite/__init__ (the public API)
  5 cli (argparse, views, the demo), then __main__
Layer 0 is one set of small modules that may import each other.
"""

from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).parent.parent / "edgelite"
LAYERS = {"config": 0, "errors": 0, "heap": 0, "ids": 0, "manifest": 0, "paths": 0, "engine": 1,
          "net": 1, "planner": 1, "node": 2, "prober": 2, "client": 3, "serve": 3, "__init__": 4,
          "cli": 5, "__main__": 6}
NETWORKING = {"socket", "selectors", "asyncio", "ssl", "http", "urllib"}


def _modules() -> dict[str, Path]:  # "edgelite.net.frames" -> its file
    out = {}
    for path in PKG.rglob("*.py"):
        parts = path.relative_to(PKG.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def _imports(path: Path, name: str) -> set[str]:
    """Every module this one imports (at any depth of the file, lazy imports included)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            base = node.module
            if node.level:
                base = ".".join([*name.split(".")[:-node.level], node.module])
            for a in node.names:  # `from pkg import module` depends on the module only
                found.add(f"{base}.{a.name}" if f"{base}.{a.name}" in ALL else base)
    return found


MODULES = _modules()
ALL = set(MODULES)
GRAPH = {n: {i for i in _imports(p, n) if i in MODULES and i != n} for n, p in MODULES.items()}
EXTERNAL = {n: {i.split(".")[0] for i in _imports(p, n) if not i.startswith("edgelite")}
            for n, p in MODULES.items()}


def _area(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _closure(module: str) -> set[str]:
    seen, todo = set(), [module]
    while todo:
        for dep in GRAPH[todo.pop()]:
            if dep not in seen:
                seen.add(dep)
                todo.append(dep)
    return seen


def test_every_module_is_in_a_layer() -> None:
    assert {_area(m) for m in MODULES} <= set(LAYERS), {_area(m) for m in MODULES} - set(LAYERS)


def test_no_import_cycle() -> None:
    for module in MODULES:
        assert module not in _closure(module), f"{module} imports itself through others"


def test_imports_go_down_the_layers() -> None:
    bad = []
    for module, deps in GRAPH.items():
        mine = _area(module)
        for dep in deps:
            theirs = _area(dep)
            if theirs == mine or LAYERS[theirs] == LAYERS[mine] == 0:
                continue
            if LAYERS[theirs] >= LAYERS[mine]:
                bad.append(f"{module} -> {dep}")
    assert not bad, bad


def test_planner_and_scheduler_use_no_networking_and_no_onnxruntime() -> None:
    pure = [m for m in MODULES if _area(m) == "planner"] + ["edgelite.serve.scheduler"]
    for module in pure:
        reach = {module} | _closure(module)
        assert not {_area(m) for m in reach} & {"net", "node", "client", "engine", "prober"}, module
        used = set().union(*(EXTERNAL[m] for m in reach))
        assert not used & (NETWORKING | {"onnxruntime"}), (module, used)


def test_node_imports_nothing_of_client_or_cli() -> None:
    for module in (m for m in MODULES if _area(m) == "node"):
        assert not {_area(m) for m in _closure(module)} & {"client", "cli", "serve", "__init__"}


def test_only_the_cli_uses_argparse() -> None:
    users = {m for m, ext in EXTERNAL.items() if "argparse" in ext}
    assert users and all(_area(m) == "cli" for m in users), users


def test_phone_side_never_imports_torch_onnx_or_transformers() -> None:
    heavy = {"torch", "onnx", "transformers", "gguf"}
    for module in MODULES:
        assert not EXTERNAL[module] & heavy, (module, EXTERNAL[module] & heavy)


def test_examples_use_only_the_public_api_and_the_standard_library() -> None:
    import sys

    examples = Path(__file__).parent.parent / "examples"
    for path in examples.glob("*.py"):
        tops = {i.split(".")[0] for i in _imports(path, "example")}
        assert "edgelite" in tops, path
        assert all(t == "edgelite" or t in sys.stdlib_module_names for t in tops), (path, tops)
        for node in ast.walk(ast.parse(path.read_text())):  # `import edgelite`, never a submodule
            if isinstance(node, ast.ImportFrom) and node.module:
                assert not node.module.startswith("edgelite"), (path, node.module)
            if isinstance(node, ast.Import):
                assert all(a.name == "edgelite" or "." not in a.name for a in node.names), path
