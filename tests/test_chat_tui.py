"""Drive `edgelite chat` in tmux as a person would: type, read the screen, use slash commands."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
import time

import pytest

from conftest import run_cli
from edgelite.cli.localnodes import TOKEN

pytestmark = pytest.mark.e2e


def _tmux(*args: str) -> str:
    return subprocess.run(["tmux", *args], capture_output=True, text=True, check=True).stdout


def _wait_for(session: str, text: str, timeout: float = 60.0) -> str:
    deadline = time.monotonic() + timeout
    screen = ""
    while time.monotonic() < deadline:
        screen = _tmux("capture-pane", "-p", "-t", session)
        if text in screen:
            return screen
        time.sleep(0.2)
    raise AssertionError(f"{text!r} never appeared; the screen:\n{screen}")


@pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed")
def test_chat_streams_reply_footer_and_slash_commands(exported, node_factory) -> None:
    model = str(exported["llama"])
    nodes = [node_factory(), node_factory()]
    local = json.loads(run_cli("generate", "--model", model, "--json", "--max-tokens", "8",
                               "hello").stdout)
    cmd = [sys.executable, "-m", "edgelite", "chat", "--model", model, "--threads", "1",
           "--nodes", ",".join(n.addr for n in nodes), "--split", "0-0,1-2", "--token", TOKEN,
           "--max-tokens", "8"]
    session = f"edgelite-test-{os.getpid()}"
    _tmux("new-session", "-d", "-s", session, "-x", "180", "-y", "60", shlex.join(cmd))
    try:
        _wait_for(session, "commands: /plan")
        _tmux("send-keys", "-t", session, "hello", "Enter")
        screen = _wait_for(session, f"{len(local['token_ids'])} tokens")  # the final footer
        visible = "".join(c for c in local["text"] if c.isprintable()).strip()  # the tiny model
        assert visible and visible[:12] in screen.replace("\n", "")  # emits control bytes too
        assert "tok/s" in screen and "TTFT" in screen and "links" in screen
        _tmux("send-keys", "-t", session, "/stats", "Enter")
        screen = _wait_for(session, "KV MiB")
        assert "bad frames" in screen
        _tmux("send-keys", "-t", session, "/plan", "Enter")
        _wait_for(session, "no plan")  # --split was given
        _tmux("send-keys", "-t", session, "/quit", "Enter")
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            if subprocess.run(["tmux", "has-session", "-t", session],
                              capture_output=True).returncode != 0:
                break
            time.sleep(0.2)
        else:
            raise AssertionError("/quit did not end the chat")
    finally:
        subprocess.run(["tmux", "kill-session", "-t", session], capture_output=True)
