"""The package's import graph (read with ast, nothing imported): dependencies go one way.

Layers, lowest first (a module may import its own package and lower layers only; packages on
one layer do not import each other):
  0 config, errors, heap, ids, manifest, paths, topk
  1 engine (ONNX execution), reply (logits to a reply: no ONNX), net (wire), planner (pure
    placement)
  2 node (the stage node), prober (measuring a cluster)
  3 client (the public API's machinery), serve (gateway and scheduler)
  4 edgelite/__init__ (the public API)
  5 cli (argparse, views, the demo), then __main__
Layer 0 is one set of small modules that may import each other.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

PKG = Path(__file__).parent.parent / "edgelite"
LAYERS = {"config": 0, "errors": 0, "heap": 0, "ids": 0, "manifest": 0, "paths": 0, "topk": 0,
          "engine": 1, "reply": 1, "net": 1, "planner": 1, "node": 2, "prober": 2, "client": 3, "serve": 3,
          "__init__": 4, "cli": 5, "__main__": 6}
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


def test_the_node_imports_nothing_of_the_reply_side_and_the_reply_side_nothing_of_onnx() -> None:
    for module in (m for m in MODULES if _area(m) == "node"):
        assert "reply" not in {_area(m) for m in _closure(module)}, module
    for module in (m for m in MODULES if _area(m) == "reply"):
        reach = {module} | _closure(module)
        assert not {_area(m) for m in reach} & {"engine", "net", "node"}, module
        assert not set().union(*(EXTERNAL[m] for m in reach)) & {"onnxruntime", "onnx"}, module


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


def _calls_and_names(path: Path) -> set[str]:
    """Every name a module calls or reads, bare or as an attribute's last part."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Name):
            out.add(node.id)
        elif isinstance(node, ast.Attribute):
            out.add(node.attr)
    return out


def test_sampling_stops_and_eos_live_in_the_reply_loop_only() -> None:
    """One home for the reply's rules (reply/loop.py): no other module samples, matches stop
    strings or tests for EOS; the library, generate, chat and both gateway doors reach it."""
    home = "edgelite.reply.loop"
    for module, path in MODULES.items():
        if module == home:
            continue
        assert "edgelite.reply.sampling" not in GRAPH[module] or module == "edgelite.reply.sampling", \
            f"{module} samples"
        used = _calls_and_names(path)
        assert not used & {"StopMatcher", "sample"}, (module, used & {"StopMatcher", "sample"})
        # the EOS ids go from the manifest to a ReplyLoop, nowhere else (client/llm.py only
        # compares a draft model's with the model's)
        if "eos_token_ids" in used and module not in ("edgelite.manifest", "edgelite.client.llm"):
            assert home in GRAPH[module] and "ReplyLoop" in used, module
        text = path.read_text()
        assert ".find(s) for s in" not in text and "endswith(s[:" not in text, (module, "stop matching")
    drivers = {m for m, deps in GRAPH.items() if home in deps and "ReplyLoop" in _calls_and_names(MODULES[m])}
    assert drivers == {"edgelite.reply.driver", "edgelite.reply.generate", "edgelite.serve.gateway"}, drivers
    for module in ("edgelite.client.llm", "edgelite.serve.native", "edgelite.serve.http",
                   "edgelite.cli.generate", "edgelite.cli.chat"):
        assert _closure(module) & {"edgelite.reply.generate", "edgelite.serve.gateway"}, module


def test_the_step_layout_is_defined_in_stepframe_only() -> None:
    """Outside net/stepframe.py, step frames are built and read only through its functions
    (the frame's length prefix and its first byte aside): no module packs or reads the
    header's fields by hand."""
    import edgelite.net.stepframe as sf

    public = {n for n, v in vars(sf).items() if callable(v) and getattr(v, "__module__", "") == sf.__name__
              and not n.startswith("_")}
    allowed = public | {"LEN", "MAGIC"}
    for module, path in MODULES.items():
        if module == "edgelite.net.stepframe":
            continue
        tree = ast.parse(path.read_text())
        aliases = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module == "edgelite.net.stepframe":
                assert {a.name for a in node.names} <= allowed, (module, [a.name for a in node.names])
            if isinstance(node, ast.ImportFrom) and node.module == "edgelite.net":
                aliases |= {a.asname or a.name for a in node.names if a.name == "stepframe"}
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                    and node.value.id in aliases):
                assert node.attr in allowed, (module, node.attr)


def test_no_class_is_over_300_lines() -> None:
    root = PKG.parent
    for path in [*PKG.rglob("*.py"), *(root / "exporter").rglob("*.py")]:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                size = node.end_lineno - node.lineno + 1  # type: ignore[operator]
                assert size <= 300, f"{path.relative_to(root)}: class {node.name} has {size} lines"


# pieces of the exporter's tensor names (exporter/graph.py): the node learns which product is
# which from the manifest (FileEntry.products, exporter/products.py), never by rebuilding them
EXPORTER_NAMES = ("MatMulNBits/output_0", "/output_0", "base_fp16", ".scales", ".minima", "block_sums",
                  ".6bit", ".qweight", ".shift", ".mult")


def test_no_exporter_tensor_name_is_rebuilt_in_edgelite() -> None:
    for path in PKG.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                hits = [f for f in EXPORTER_NAMES if f in node.value]
                assert not hits, f"{path.relative_to(PKG.parent)}:{node.lineno}: {hits}"


def test_no_module_is_over_600_lines() -> None:
    for path in [*PKG.rglob("*.py"), *PKG.rglob("*.c"), *PKG.rglob("*.h")]:
        lines = len(path.read_text().splitlines())
        assert lines <= 600, f"{path.relative_to(PKG.parent)} has {lines} lines"


def test_every_package_is_in_the_wheel() -> None:
    """Each folder of edgelite/ with an __init__.py is listed in pyproject's packages (a package
    left out installs without it: tests/test_core_install.py found engine/passes so)."""
    import tomllib

    listed = set(tomllib.loads((PKG.parent / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {".".join(p.parent.relative_to(PKG.parent).parts) for p in PKG.rglob("__init__.py")}
    assert found <= listed, sorted(found - listed)
