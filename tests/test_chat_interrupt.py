"""Ctrl-C in `edgelite chat` (a real process, a real SIGINT): during a reply it stops the reply
and the chat goes on; at the prompt it ends the chat; no traceback either way."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e


class Output:
    """A process's stdout, read in a thread so the test can wait for text with a deadline."""

    def __init__(self, stream) -> None:
        self.text = ""
        self._lock = threading.Lock()
        threading.Thread(target=self._read, args=(stream,), daemon=True).start()

    def _read(self, stream) -> None:
        while chunk := os.read(stream.fileno(), 4096):
            with self._lock:
                self.text += chunk.decode(errors="replace")

    def wait_for(self, check, timeout: float = 60) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._lock:
                text = self.text
            if check(text):
                return text
            time.sleep(0.02)
        raise AssertionError(f"timed out; output so far: {text[-600:]!r}")


def test_ctrl_c_in_generate_ends_the_line(smollm2_int4: Path) -> None:
    """Ctrl-C while `generate` streams: exit 130, no traceback, and the text ends its line (the
    shell's prompt used to follow it on the same line)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "edgelite", "generate", "--model", str(smollm2_int4), "--threads", "1",
         "--max-tokens", "1000", "Tell me a very long story about a dragon and a knight."],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout is not None and proc.stderr is not None
    out = Output(proc.stdout)
    try:
        out.wait_for(lambda t: len(t) > 40)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(10) == 130
        text = out.wait_for(lambda t: t.endswith("\n"), 5)
        assert len(text) > 40 and "Traceback" not in proc.stderr.read().decode()
    finally:
        proc.kill()
        proc.wait(10)
        proc.stdout.close()
        proc.stderr.close()


def test_ctrl_c_stops_a_reply_then_quits_at_the_prompt(smollm2_int4: Path) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "edgelite", "chat", "--model", str(smollm2_int4), "--threads", "1",
         "--max-tokens", "1000", "--temperature", "0", "--session", "story"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None
    out = Output(proc.stdout)
    try:
        out.wait_for(lambda t: t.startswith("> "))
        proc.stdin.write(b"Tell me a very long story about a dragon and a knight.\n")
        proc.stdin.flush()
        out.wait_for(lambda t: len(t) > 80)  # the reply is under way (1000 tokens: seconds)
        proc.send_signal(signal.SIGINT)
        text = out.wait_for(lambda t: t.rstrip().endswith("[stopped]\n>") or
                            t.endswith("[stopped]\n> "), 10)
        assert proc.poll() is None  # the chat goes on
        written = text[2:text.index("\n[stopped]")]  # stdout: "> ", the reply, "[stopped]"
        # a second turn still works
        proc.stdin.write(b"/stats\n")
        proc.stdin.flush()
        shown = out.wait_for(lambda t: '"last"' in t and t.endswith("> "), 30)
        line = next(x for x in shown.splitlines() if '"last"' in x).removeprefix("> ")
        assert json.loads(line)["last"]["tokens"] > 0  # the stopped reply's figures
        t0 = time.monotonic()
        proc.send_signal(signal.SIGINT)  # at the prompt: the chat ends at once
        assert proc.wait(10) == 130
        assert time.monotonic() - t0 < 5
        err = proc.stderr.read().decode()
        assert "Traceback" not in err and "Traceback" not in out.text, err
    finally:
        proc.kill()
        proc.wait(10)
        for pipe in (proc.stdin, proc.stdout, proc.stderr):
            pipe.close()
    # the stopped reply is kept in the conversation, as far as it was written
    saved = json.loads((Path(os.environ["EDGELITE_HOME"]) / "sessions" / "story.json").read_text())
    messages = saved["messages"]
    assert [m["role"] for m in messages] == ["user", "assistant"]
    assert messages[1]["content"] and written.startswith(messages[1]["content"])


def test_demo_probes_again_and_ends_cleanly_on_ctrl_c(smollm2_int4: Path, tmp_path: Path) -> None:
    """The interactive demo: /probe measures the emulated links again; Ctrl-C stops a reply, then
    quits at the prompt; its emulators, node processes and temporary folder all go."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    proc = subprocess.Popen(
        [sys.executable, "-m", "edgelite", "demo", "--model", str(smollm2_int4), "--plain",
         "--max-tokens", "1000"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, env={**os.environ, "TMPDIR": str(tmp)})
    assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None
    out = Output(proc.stdout)
    try:
        out.wait_for(lambda t: t.endswith("> "), 180)
        proc.stdin.write(b"/probe\n")
        proc.stdin.flush()
        text = out.wait_for(lambda t: t.count("> ") >= 2 and '"links"' in t, 60)
        probed = json.loads(text.splitlines()[-2].removeprefix("> "))
        assert {d["name"] for d in probed["devices"]} == {"client", "phone-a", "phone-b", "phone-c"}
        assert all(r["reachable"] for r in probed["links"])
        mark = len(text)
        proc.stdin.write(b"Write a long essay about the history of Rome.\n")
        proc.stdin.flush()
        out.wait_for(lambda t: len(t) > mark + 100, 60)
        proc.send_signal(signal.SIGINT)
        out.wait_for(lambda t: t.endswith("[stopped]\n> "), 15)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(20) == 130
        err = proc.stderr.read().decode()
        assert "Traceback" not in err + out.text, err[-3000:]
        assert list(tmp.iterdir()) == []  # the nodes' folders are gone
        left = subprocess.run(["pgrep", "-f", str(tmp)], capture_output=True, text=True).stdout
        assert left == "", left  # no node process outlives the demo
    finally:
        proc.kill()
        proc.wait(10)
        for pipe in (proc.stdin, proc.stdout, proc.stderr):
            pipe.close()
