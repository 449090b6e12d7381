"""The cluster page's chat script run by node.js over a stand-in DOM and storage: a reload
restores the conversation and the settings, a message goes with the system prompt, max tokens
and temperature, and "New chat" forgets the conversation (issue 66, item 12)."""

from __future__ import annotations

import json
import shutil
import subprocess

import pytest

from edgelite.serve.page import page_html

STUB = """
const els = {};
function el(id) {
  if (!els[id]) els[id] = {id, value: {"max-tokens": "256", temperature: "0"}[id] || "", textContent: "",
    disabled: false, scrollTop: 0, scrollHeight: 0, children: [], listeners: {},
    appendChild(c) { this.children.push(c); }, addEventListener(t, f) { this.listeners[t] = f; }};
  return els[id];
}
global.document = {getElementById: el, createElement: () => ({className: "", textContent: ""})};
const store = {"edgelite-chat": JSON.stringify([{role: "user", content: "hi"},
                                               {role: "assistant", content: "hello"}]),
               "edgelite-max-tokens": "32"};
global.localStorage = {getItem: (k) => (k in store ? store[k] : null), setItem: (k, v) => { store[k] = v; }};
let sent = null;
global.fetch = async (url, opts) => {
  if (url.includes("chat")) sent = JSON.parse(opts.body);
  return {ok: false, status: 503, statusText: "no", json: async () => ({error: {message: "no"}})};
};
global.setInterval = () => 0;
global.AbortController = class { constructor() { this.signal = {}; } abort() {} };
"""
DRIVE = """
setTimeout(async () => {
  const restored = el("log").children.length, most = el("max-tokens").value;
  el("system").value = "Be brief.";
  el("prompt").value = "again";
  await el("chat").listeners.submit({preventDefault() {}});
  el("new-chat").listeners.click();
  console.log(JSON.stringify({restored, most, sent, after: store["edgelite-chat"]}));
}, 10);
"""


@pytest.mark.unit
def test_the_chat_keeps_its_transcript_and_sends_its_settings(tmp_path) -> None:
    if shutil.which("node") is None:
        pytest.skip("node.js is not installed")
    script = page_html().decode().split("<script>", 1)[1].split("</script>", 1)[0]
    (tmp_path / "page.js").write_text(STUB + script + DRIVE)
    res = subprocess.run(["node", str(tmp_path / "page.js")], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["restored"] == 2 and out["most"] == "32"
    assert out["sent"]["messages"] == [{"role": "system", "content": "Be brief."},
                                       {"role": "user", "content": "hi"},
                                       {"role": "assistant", "content": "hello"},
                                       {"role": "user", "content": "again"}]
    assert out["sent"]["max_tokens"] == 32 and out["sent"]["temperature"] == 0
    assert out["after"] == "[]"
