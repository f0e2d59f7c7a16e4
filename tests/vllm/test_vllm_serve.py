"""README's serving example, as written: ``fuse-shared serve`` (vLLM's OpenAI server with the plugin) on the quick
start's output, answered by its curl requests and by the official ``openai`` client, streamed and not."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

from fuse_tool.convert import convert_checkpoint
from fuse_tool.plan import ConvertOptions
from vllm_checkpoints import EXAMPLE, ROOT

README = (ROOT / "README.md").read_text()


def readme_block(name: str) -> str:
    m = re.search(rf"^<!-- {name}[ :-].*?-->\n```bash\n(.*?)^```\n<!-- /{name} -->", README, re.M | re.S)
    assert m, f"README.md has no <!-- {name} --> block"
    return m.group(1)


@pytest.fixture(scope="module")
def server():
    command = readme_block("serve-command").strip()
    out = Path(re.search(r"fuse-shared serve (\S+)", command).group(1))
    model = re.search(r"--served-model-name (\S+)", command).group(1)
    port = int(re.search(r"--port (\d+)", command).group(1))
    if not (out / "config.json").exists():  # the quick start's output
        convert_checkpoint(EXAMPLE, out, ConvertOptions(), progress=False)
    log = open(out.parent / "tiny-fused-serve.log", "w")
    proc = subprocess.Popen(["bash", "-c", command], stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 600
        while True:
            assert proc.poll() is None, Path(log.name).read_text()[-4000:]
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=5)
                break
            except OSError:
                assert time.monotonic() < deadline, Path(log.name).read_text()[-4000:]
                time.sleep(2)
        yield model, port
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=60)
        log.close()


def test_readme_requests_get_text(server):
    out = subprocess.run(["bash", "-c", readme_block("serve-requests")], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.count('"text"') == 1 and out.stdout.count('"content"') >= 1, out.stdout


def test_openai_client_streamed_and_not(server):
    import openai

    model, port = server
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none")
    whole = client.completions.create(model=model, prompt="the shared expert", max_tokens=8, temperature=0)
    assert whole.choices[0].text and whole.usage.completion_tokens == 8
    parts = client.completions.create(model=model, prompt="the shared expert", max_tokens=8, temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in parts) == whole.choices[0].text
    chunks = list(
        client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "hello"}], max_tokens=8, stream=True
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert len({c.id for c in chunks}) == 1
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
