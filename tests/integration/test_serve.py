"""The OpenAI-compatible server on a tiny converted DeepSeek-V3 over real HTTP on the loopback address: completions
and chat completions, streamed and not, tokens equal to generate(); bad requests get a 4xx naming the problem."""

from __future__ import annotations

import http.client
import json
import shutil
import threading

import pytest
import torch

from runtime.integrations.transformers import from_fused_pretrained
from runtime.serve import load_tokenizer, make_server

VOCAB = 96
TIMEOUT_S = 60
PROMPT = [5, 17, 3, 44, 9]


def _write_tokenizer(folder) -> None:
    """A word-level tokenizer over the tiny vocabulary ("t0" .. "t95") with a one-line chat template."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0")
    fast.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    fast.save_pretrained(folder)


@pytest.fixture(scope="module")
def server(converted, tmp_path_factory):
    out = tmp_path_factory.mktemp("serve") / "ckpt"
    shutil.copytree(converted("deepseek_v3", "fp8"), out)
    _write_tokenizer(out)
    model = from_fused_pretrained(out, dtype=torch.float32)
    srv = make_server(model, load_tokenizer(out), "127.0.0.1", 0, model_name="tiny", max_tokens_limit=32)
    thread = threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    yield model, srv.server_address[1]
    srv.shutdown()
    srv.server_close()
    thread.join(TIMEOUT_S)
    assert not thread.is_alive()


def _post(port: int, path: str, body, raw: bytes | None = None):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=TIMEOUT_S)
    try:
        data = raw if raw is not None else json.dumps(body).encode()
        conn.request("POST", path, data, {"Content-Type": "application/json"})
        resp = conn.getresponse()
        return resp.status, resp.getheader("Content-Type"), resp.read().decode()
    finally:
        conn.close()


def _events(text: str) -> list:
    lines = [ln[len("data: ") :] for ln in text.split("\n\n") if ln.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(ln) for ln in lines[:-1]]


def _generate(model, ids, n):
    with torch.no_grad():
        x = torch.tensor([ids])
        return model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, do_sample=False, pad_token_id=0)[
            0, len(ids) :
        ].tolist()


def test_completions_tokens_equal_generate(server):
    model, port = server
    want = _generate(model, PROMPT, 6)
    status, ctype, text = _post(port, "/v1/completions", {"model": "tiny", "prompt": PROMPT, "max_tokens": 6})
    assert status == 200 and ctype == "application/json"
    body = json.loads(text)
    choice = body["choices"][0]
    assert choice["token_ids"] == want and choice["finish_reason"] == "length"
    assert choice["text"] == " ".join(f"t{i}" for i in want)
    assert body["usage"] == {"prompt_tokens": 5, "completion_tokens": 6, "total_tokens": 11}
    # the same prompt as text, through the folder's tokenizer
    status, _, text = _post(port, "/v1/completions", {"prompt": " ".join(f"t{i}" for i in PROMPT), "max_tokens": 6})
    assert status == 200 and json.loads(text)["choices"][0]["token_ids"] == want


def test_streamed_completion_is_the_same_tokens(server):
    model, port = server
    want = _generate(model, PROMPT, 5)
    status, ctype, text = _post(port, "/v1/completions", {"prompt": PROMPT, "max_tokens": 5, "stream": True})
    assert status == 200 and ctype == "text/event-stream"
    chunks = _events(text)
    assert len(chunks) == 6  # one per token, then the finish chunk
    assert [t for c in chunks for t in c["choices"][0]["token_ids"]] == want
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_chat_completions_streamed_and_not(server):
    model, port = server
    msgs = [{"role": "user", "content": "t5 t17 t3"}]
    want = _generate(model, [5, 17, 3], 4)
    status, _, text = _post(port, "/v1/chat/completions", {"messages": msgs, "max_tokens": 4})
    assert status == 200
    msg = json.loads(text)["choices"][0]
    assert msg["token_ids"] == want and msg["message"] == {
        "role": "assistant",
        "content": " ".join(f"t{i}" for i in want),
    }
    status, _, text = _post(port, "/v1/chat/completions", {"messages": msgs, "max_tokens": 4, "stream": True})
    chunks = _events(text)
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert [t for c in chunks for t in c["choices"][0]["token_ids"]] == want


@pytest.mark.parametrize(
    "path, body, status, param",
    [
        ("/v1/completions", {"prompt": [], "max_tokens": 4}, 400, "prompt"),
        ("/v1/completions", {"prompt": [1, VOCAB], "max_tokens": 4}, 400, "prompt"),
        ("/v1/completions", {"prompt": [1, 2], "max_tokens": 0}, 400, "max_tokens"),
        ("/v1/completions", {"prompt": [1, 2], "max_tokens": 33}, 400, "max_tokens"),
        ("/v1/completions", {"prompt": [1, 2], "temperature": "hot"}, 400, "temperature"),
        ("/v1/completions", {"prompt": [1, 2], "n": 2}, 400, "n"),
        ("/v1/chat/completions", {"messages": [{"role": "user"}]}, 400, "messages"),
        ("/v1/chat/completions", {"messages": "hi", "stream": True}, 400, "messages"),
        ("/v1/embeddings", {"input": "x"}, 404, None),
    ],
)
def test_bad_requests_get_a_clear_4xx(server, path, body, status, param):
    _, port = server
    got, ctype, text = _post(port, path, body)
    assert got == status and ctype == "application/json"
    err = json.loads(text)["error"]
    assert err["param"] == param and err["message"]


def test_bad_json_and_the_server_stays_up(server):
    model, port = server
    status, _, text = _post(port, "/v1/completions", None, raw=b"{not json")
    assert status == 400 and "not JSON" in json.loads(text)["error"]["message"]
    status, _, text = _post(port, "/v1/completions", None, raw=b"[1, 2]")
    assert status == 400 and "JSON object" in json.loads(text)["error"]["message"]
    status, _, _ = _post(port, "/v1/completions", {"prompt": PROMPT, "max_tokens": 1})
    assert status == 200


def test_cli_serve_starts_answers_and_stops(converted):
    """``fuse-shared serve OUT_DIR --port 0``: says where it listens, answers, stops on SIGINT."""
    import re
    import signal
    import subprocess
    import sys

    out = converted("deepseek_v3", "fp8")
    cmd = [
        sys.executable,
        "-c",
        "from fuse_tool.cli import main; main()",
        "serve",
        str(out),
        "--port",
        "0",
        "--dtype",
        "float32",
    ]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
    try:
        line = ""
        for _ in range(200):  # bounded: transformers' warnings may come first
            line = proc.stderr.readline()
            if not line or line.startswith("serving "):
                break
        m = re.search(r"http://127\.0\.0\.1:(\d+)/v1", line)
        assert m, f"no 'serving' line: {line!r}"
        status, _, text = _post(int(m.group(1)), "/v1/completions", {"prompt": PROMPT, "max_tokens": 2})
        assert status == 200 and len(json.loads(text)["choices"][0]["token_ids"]) == 2
        proc.send_signal(signal.SIGINT)
        assert proc.wait(TIMEOUT_S) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(TIMEOUT_S)
