"""What a phone has: a venv with only the core dependencies and the onnxruntime Termux ships
(1.29.0; no highspy, uvloop, torch, onnx, transformers) runs node processes, plans (with the
exact DP, saying so), deploys and generates the same ids as the full install (the int4 fast
export's: up to a near tie, which each onnxruntime's rounding breaks its own way); the int4 export
(MatMulNBits, GroupQueryAttention, GatherBlockQuantized, ...) loads and runs on it too."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import venv
from pathlib import Path

import pytest

from conftest import run_cli
from edgelite.cli.localnodes import READY, TOKEN
from models import as_if_large

pytestmark = pytest.mark.e2e
REPO = Path(__file__).parent.parent
CORE = ["onnxruntime==1.29.0", "numpy", "msgpack", "rich", "tokenizers", "jinja2"]


@pytest.fixture(scope="session")
def core_python(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("core-venv")
    venv.create(root, with_pip=True)
    py = root / "bin" / "python"
    res = subprocess.run([str(py), "-m", "pip", "install", "-q", "--disable-pip-version-check",
                          *CORE], capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    absent = subprocess.run([str(py), "-c", "import importlib.util as u; print([m for m in "
                             "('highspy', 'uvloop', 'torch', 'onnx', 'transformers') "
                             "if u.find_spec(m)])"], capture_output=True, text=True)
    assert absent.stdout.strip() == "[]", absent.stdout
    return py


# onnxruntime 1.29 and 1.32 compute the int4 fast export's int8-activation products with other
# kernels: measured, the same position's top-two logit margin differs by up to 0.2 between them
NEAR_TIE = 0.3


def _same_until_a_near_tie(model: Path, prompt: list[int], core: list[int], full: list[int]) -> None:
    """The two installs' ids are the same, or part where the full install itself had its two
    likeliest tokens within NEAR_TIE logits (a tie either rounding may break its own way)."""
    import numpy as np

    from edgelite import manifest as mf
    from edgelite.config import RuntimeConfig
    from edgelite.engine.runtime import LocalChain

    if core == full:
        return
    same = [a == b for a, b in zip(core, full, strict=False)]
    at = same.index(False) if False in same else len(same)
    logits = LocalChain(mf.load(model), RuntimeConfig(threads=1)).logits_all(
        "tie", np.array([prompt + full[:at]]))
    top = np.sort(np.asarray(logits, np.float64).reshape(len(prompt) + at, -1)[-1])[-2:]
    assert top[1] - top[0] < NEAR_TIE, (at, core, full, float(top[1] - top[0]))


def _core(py: Path, *args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO), "EDGELITE_TOKEN": TOKEN}
    return subprocess.run([str(py), "-m", "edgelite", *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


def test_core_install_runs_the_int4_export(core_python: Path, smollm2_int4: Path) -> None:
    version = subprocess.run([str(core_python), "-c", "import onnxruntime; print(onnxruntime.__version__)"],
                             capture_output=True, text=True)
    assert version.stdout.strip() == "1.29.0"
    # (each computes its own KV: a KV store entry one install wrote would be read by the other,
    # whose own rounding then meets the first's at a near tie)
    args = ("generate", "--model", str(smollm2_int4), "--json", "--max-tokens", "16",
            "--threads", "1", "--kv-store-mb", "0", "What is a phone?")
    core = _core(core_python, *args)
    assert core.returncode == 0, core.stderr[-2000:]
    full = run_cli(*args)
    from edgelite import manifest as mf
    from edgelite.reply.tokenizer import Tokenizer

    prompt = Tokenizer(mf.load(smollm2_int4)).chat_prompt([{"role": "user", "content": "What is a phone?"}])
    _same_until_a_near_tie(smollm2_int4, prompt, json.loads(core.stdout)["token_ids"],
                           json.loads(full.stdout)["token_ids"])


def test_core_install_runs_gguf_widths(core_python: Path, ggufs: dict[str, Path],
                                       tmp_path: Path) -> None:
    """Termux's onnxruntime runs the 2-bit products of 5-bit blocks and the K-quants' scales
    computed at load: the same ids as the full install."""
    from edgelite_export import build

    for kind in ("Q5_0", "Q4_K+Q6_K", "Q2_K+Q3_K+Q5_K"):
        out = build.run(str(ggufs[kind]), tmp_path / kind, build.Options(steps=4)).out
        args = ("generate", "--model", str(out), "--json", "--max-tokens", "12", "--threads", "1",
                "--kv-store-mb", "0", "--raw", "hello world")
        core = _core(core_python, *args)
        assert core.returncode == 0, core.stderr[-2000:]
        assert json.loads(core.stdout)["token_ids"] == json.loads(run_cli(*args).stdout)["token_ids"]


def test_core_install_plans_and_runs_nodes(core_python: Path, exported, tmp_path: Path) -> None:
    model = as_if_large(exported["llama"], tmp_path / "big")  # one layer a process
    env = {**os.environ, "PYTHONPATH": str(REPO), "EDGELITE_TOKEN": TOKEN}
    procs = []
    try:
        addrs = []
        for i in range(2):
            p = subprocess.Popen([str(core_python), "-m", "edgelite", "node", "--host", "127.0.0.1",
                                  "--port", "0", "--data-dir", str(tmp_path / f"n{i}"), "--threads",
                                  "1", "--memory-mb", "2000"], stdout=subprocess.PIPE,
                                 stderr=subprocess.DEVNULL, text=True, env=env)
            procs.append(p)
            assert p.stdout is not None
            for _ in range(20):
                if found := READY.search(p.stdout.readline()):
                    addrs.append(f"127.0.0.1:{found.group(2)}")
                    break
        assert len(addrs) == 2
        res = _core(core_python, "generate", "--model", str(model), "--nodes", ",".join(addrs),
                    "--json", "--max-tokens", "8", "--client-memory-mb", "2000", "hello")
    finally:
        for p in procs:
            p.kill()
            p.wait(10)
            if p.stdout is not None:
                p.stdout.close()
    assert res.returncode == 0, res.stderr[-2000:]
    out = json.loads(res.stdout)
    local = json.loads(run_cli("generate", "--model", str(model), "--json", "--max-tokens", "8",
                               "hello").stdout)
    assert out["token_ids"] == local["token_ids"]
    assert any(s.get("addr") for s in out["plan"]["stages"])  # the nodes run layers
    assert out["plan"]["solver"] == "dp"
    assert len(re.findall("highspy is not installed", res.stderr)) == 1
    assert "Traceback" not in res.stderr


def test_export_on_a_phone_install_names_the_extra(core_python: Path, tmp_path: Path) -> None:
    """edgelite-export where torch is absent: one line naming edgelite[export], no traceback."""
    (tmp_path / "edgelite_export").symlink_to(REPO / "exporter")
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{tmp_path}"}
    res = subprocess.run([str(core_python), "-m", "edgelite_export", "smollm2-135m", "--out",
                          str(tmp_path / "out")], capture_output=True, text=True, timeout=120, env=env)
    assert res.returncode == 1, res.stderr
    assert re.fullmatch(r"error: edgelite-export needs the PC-side packages \((torch|onnx|"
                        r"transformers|gguf) is missing\): pip install torch==2\.13\.0 "
                        r"'edgelite\[export\]'", res.stderr.strip()), res.stderr


def test_milp_without_highspy_is_one_line_naming_the_extra(core_python: Path, exported) -> None:
    res = _core(core_python, "plan", "--model", str(exported["llama"]), "--cluster",
                str(REPO / "examples" / "phones.json"), "--solver", "milp")
    assert res.returncode == 1, res.stderr
    assert res.stderr.strip() == ("error: --solver milp needs HiGHS: pip install 'edgelite[plan]' "
                                  "(or use --solver dp, the exact DP)"), res.stderr


def test_a_wheel_from_the_checkout_runs_a_node_with_the_kernel(core_python: Path, smollm2_int4: Path,
                                                               tmp_path: Path) -> None:
    """The wheel carries every kernel source; installed with the core dependencies only (no source
    tree on the path), a node from it builds (or finds) the library and runs the int4 export's
    products and attention in it."""
    import zipfile

    listed = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True,
                            check=True).stdout.split()
    src = tmp_path / "src"
    for name in listed:
        (src / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / name, src / name)
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                            "-w", str(tmp_path / "wheel"), str(src)], capture_output=True, text=True,
                           timeout=300)
    assert built.returncode == 0, built.stderr[-2000:]
    [wheel] = (tmp_path / "wheel").glob("edgelite-*.whl")
    inside = set(zipfile.ZipFile(wheel).namelist())
    sources = {n for n in listed if n.startswith("edgelite/") and n.endswith((".c", ".h"))}
    assert sources and sources <= inside, sources - inside
    done = subprocess.run([str(core_python), "-m", "pip", "install", "-q", "--no-deps", "--force-reinstall",
                           str(wheel)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"EDGELITE_TOKEN": TOKEN}
    where = subprocess.run([str(core_python), "-c", "import edgelite.engine.kernels.build as b; "
                            "print(b.cpu.SRC, len(b.sources()))"], cwd=tmp_path, env=env, capture_output=True,
                           text=True)
    assert "site-packages" in where.stdout and where.stdout.split()[1] == str(len(sources)), where
    node = subprocess.Popen([str(core_python), "-m", "edgelite", "node", "--host", "127.0.0.1", "--port", "0",
                             "--data-dir", str(tmp_path / "n"), "--threads", "1"], stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True, env=env, cwd=tmp_path)
    try:
        assert node.stdout is not None
        port = next(int(found.group(2)) for _ in range(20) if (found := READY.search(node.stdout.readline())))
        res = run_cli("generate", "--model", str(smollm2_int4), "--nodes", f"127.0.0.1:{port}", "--split",
                      "0-29", "--token", TOKEN, "--json", "--max-tokens", "4", "--kv-store-mb", "0", "hello",
                      timeout=240)
        assert res.returncode == 0, res.stderr[-2000:]
        from test_kernel_build import _node_stats

        kernel = _node_stats(port)["kernel"]
        assert "MatMul4=" in kernel and "Attend16=" in kernel and "MatMul4=ref" not in kernel, kernel
    finally:
        node.kill()
        node.wait(10)
        if node.stdout is not None:
            node.stdout.close()
