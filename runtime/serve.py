"""An OpenAI-compatible HTTP endpoint on a converted checkpoint (``fuse-shared serve OUT_DIR``).

    server = make_server(model, tokenizer, "127.0.0.1", 8000, model_name="DeepSeek-V3-fused")
    server.serve_forever()                     # POST /v1/completions, POST /v1/chat/completions, GET /v1/models

Why not ``transformers serve``: in transformers 5.25 it needs fastapi and uvicorn and loads the model with
``AutoModelForCausalLM.from_pretrained(repo)``, which cannot read the fused-shared layout (the fused MoE blocks
come from :func:`runtime.integrations.transformers.from_fused_pretrained`). So this is the Python standard library's
threaded HTTP server around the model's own ``generate()``: one request generates at a time (a lock), tokens stream
as server-sent events (``"stream": true``) through a transformers streamer.

Requests: ``prompt`` a string (needs the folder's tokenizer) or a list of token ids; ``messages`` (chat, needs a
tokenizer with a chat template); ``max_tokens`` (default 16, at most ``max_tokens_limit``); ``temperature`` (0, the
default: greedy; above 0: sampling with ``top_p``); ``seed``. Each choice carries the generated ``token_ids`` besides
``text`` / ``message`` (vLLM's ``return_token_ids`` field, always on). Malformed requests get a 400 with an OpenAI
``{"error": {"message", "type", "param"}}`` body; unknown paths 404; a wrong method 405.
"""

from __future__ import annotations

import json
import queue
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Iterator

import torch

MAX_BODY_BYTES = 1 << 20


class BadRequest(ValueError):
    """A request the server refuses with 400, naming the field (``param``)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


def _int_field(body: dict, name: str, default: int, lo: int, hi: int) -> int:
    v = body.get(name, default)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise BadRequest(f"'{name}' must be an integer from {lo} to {hi}, got {v!r}", name)
    return v


def _float_field(body: dict, name: str, default: float, lo: float, hi: float) -> float:
    v = body.get(name, default)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not lo <= v <= hi:
        raise BadRequest(f"'{name}' must be a number from {lo:g} to {hi:g}, got {v!r}", name)
    return float(v)


class _QueueStreamer:
    """transformers' streamer protocol (``put`` / ``end``): new token ids into a queue, prompt ids skipped."""

    def __init__(self):
        self.queue: queue.Queue = queue.Queue()
        self._prompt_seen = False

    def put(self, value: torch.Tensor) -> None:
        if not self._prompt_seen:
            self._prompt_seen = True
            return
        self.queue.put([int(t) for t in value.reshape(-1).tolist()])

    def end(self) -> None:
        self.queue.put(None)


class CompletionEngine:
    """Turns an OpenAI request body into ``generate()`` calls on one model (one at a time)."""

    def __init__(self, model, tokenizer=None, model_name: str = "fused", max_tokens_limit: int = 4096):
        self.model, self.tokenizer, self.model_name = model, tokenizer, model_name
        self.max_tokens_limit = max_tokens_limit
        self.vocab_size = int(model.config.get_text_config().vocab_size)
        self.device = next(p.device for p in model.parameters() if not p.is_meta)
        self._lock = threading.Lock()

    # -- request -> prompt ids and generate() arguments
    def prompt_ids(self, body: dict, chat: bool) -> list[int]:
        if chat:
            msgs = body.get("messages")
            if (
                not isinstance(msgs, list)
                or not msgs
                or not all(
                    isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                    for m in msgs
                )
            ):
                raise BadRequest("'messages' must be a non-empty list of {'role': str, 'content': str}", "messages")
            if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
                raise BadRequest(
                    "this checkpoint has no tokenizer with a chat template: use /v1/completions with "
                    "'prompt' as a list of token ids",
                    "messages",
                )
            ids = self.tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
            ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
        else:
            prompt = body.get("prompt")
            if isinstance(prompt, str) and prompt:
                if self.tokenizer is None:
                    raise BadRequest("this checkpoint has no tokenizer: send 'prompt' as a list of token ids", "prompt")
                ids = self.tokenizer(prompt)["input_ids"]
            elif (
                isinstance(prompt, list)
                and prompt
                and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
            ):
                ids = prompt
            else:
                raise BadRequest("'prompt' must be a non-empty string or a non-empty list of token ids", "prompt")
        ids = [int(t) for t in ids]
        bad = next((t for t in ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise BadRequest(f"token id {bad} is outside the vocabulary [0, {self.vocab_size})", "prompt")
        return ids

    def generate_kwargs(self, body: dict) -> dict[str, Any]:
        n = _int_field(body, "n", 1, 1, 1)
        del n  # one choice per request
        kw: dict[str, Any] = {"max_new_tokens": _int_field(body, "max_tokens", 16, 1, self.max_tokens_limit)}
        temperature = _float_field(body, "temperature", 0.0, 0.0, 2.0)
        if temperature > 0:
            kw.update(do_sample=True, temperature=temperature, top_p=_float_field(body, "top_p", 1.0, 1e-6, 1.0))
        else:
            kw["do_sample"] = False
        kw["seed"] = _int_field(body, "seed", 0, 0, 2**63 - 1)
        return kw

    def _run(self, ids: list[int], kw: dict, streamer=None) -> list[int]:
        seed = kw.pop("seed")
        x = torch.tensor([ids], device=self.device)
        with self._lock, torch.no_grad():
            torch.manual_seed(seed)
            out = self.model.generate(
                x, attention_mask=torch.ones_like(x), streamer=streamer, pad_token_id=self._pad_id(), **kw
            )
        return out[0, len(ids) :].tolist()

    def _pad_id(self) -> int:
        gc = getattr(self.model, "generation_config", None)
        for v in (getattr(gc, "pad_token_id", None), getattr(gc, "eos_token_id", None)):
            if isinstance(v, list) and v:
                v = v[0]
            if isinstance(v, int):
                return v
        return 0

    def _text(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True) if self.tokenizer is not None else ""

    def complete(self, body: dict, chat: bool) -> dict:
        ids, kw = self.prompt_ids(body, chat), self.generate_kwargs(body)
        new = self._run(ids, kw)
        finish = "length" if len(new) >= kw["max_new_tokens"] else "stop"
        choice: dict[str, Any] = {"index": 0, "finish_reason": finish, "token_ids": new}
        if chat:
            choice["message"] = {"role": "assistant", "content": self._text(new)}
        else:
            choice["text"] = self._text(new)
        return self._envelope(chat, [choice]) | {
            "usage": {"prompt_tokens": len(ids), "completion_tokens": len(new), "total_tokens": len(ids) + len(new)}
        }

    def stream(self, body: dict, chat: bool) -> Iterator[dict]:
        """Validates at once (raising :class:`BadRequest`), then yields one chunk per generated token."""
        ids, kw = self.prompt_ids(body, chat), self.generate_kwargs(body)
        return self._stream(ids, kw, chat)

    def _stream(self, ids: list[int], kw: dict, chat: bool) -> Iterator[dict]:
        streamer = _QueueStreamer()
        failure: list[BaseException] = []

        def run():
            try:
                self._run(ids, dict(kw), streamer)
            except BaseException as e:  # noqa: BLE001 - reported to the client after the last chunk
                failure.append(e)
                streamer.end()

        worker = threading.Thread(target=run, daemon=True)
        worker.start()
        count = 0
        while (toks := streamer.queue.get()) is not None:
            count += len(toks)
            delta = {"content": self._text(toks)} if chat else None
            choice = {"index": 0, "finish_reason": None, "token_ids": toks}
            choice |= {"delta": delta} if chat else {"text": self._text(toks)}
            yield self._envelope(chat, [choice], chunk=True)
        worker.join()
        if failure:
            raise failure[0]
        done = {"index": 0, "finish_reason": "length" if count >= kw["max_new_tokens"] else "stop", "token_ids": []}
        done |= {"delta": {}} if chat else {"text": ""}
        yield self._envelope(chat, [done], chunk=True)

    def _envelope(self, chat: bool, choices: list, chunk: bool = False) -> dict:
        obj = ("chat.completion.chunk" if chunk else "chat.completion") if chat else "text_completion"
        return {
            "id": f"cmpl-{uuid.uuid4().hex}",
            "object": obj,
            "created": int(time.time()),
            "model": self.model_name,
            "choices": choices,
        }


def _handler(engine: CompletionEngine):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        server_version = "fuse-shared"

        def log_message(self, fmt, *args):  # quiet: no line per request on stderr
            pass

        def _json(self, status: int, obj: dict) -> None:
            data = json.dumps(obj).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _error(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error"):
            self._json(status, {"error": {"message": message, "type": kind, "param": param, "code": None}})

        def do_GET(self):
            if self.path.rstrip("/") == "/v1/models":
                self._json(
                    200,
                    {
                        "object": "list",
                        "data": [{"id": engine.model_name, "object": "model", "owned_by": "fuse-shared"}],
                    },
                )
            elif self.path.rstrip("/") in ("/v1/completions", "/v1/chat/completions"):
                self._error(405, f"{self.path} takes POST")
            else:
                self._error(404, f"no route {self.path}")

        def do_POST(self):
            route = self.path.rstrip("/")
            if route not in ("/v1/completions", "/v1/chat/completions"):
                return self._error(404, f"no route {self.path}")
            chat = route.endswith("chat/completions")
            try:
                length = int(self.headers.get("Content-Length") or -1)
            except ValueError:
                length = -1
            if not 0 < length <= MAX_BODY_BYTES:
                self.close_connection = True
                return self._error(
                    400 if length <= 0 else 413,
                    f"the body must be JSON of 1 to {MAX_BODY_BYTES} bytes with a Content-Length header",
                )
            try:
                body = json.loads(self.rfile.read(length))
            except (ValueError, UnicodeDecodeError) as e:
                return self._error(400, f"the body is not JSON: {e}")
            if not isinstance(body, dict):
                return self._error(400, "the body must be a JSON object")
            try:
                if body.get("stream"):
                    chunks = engine.stream(body, chat)
                else:
                    return self._json(200, engine.complete(body, chat))
            except BadRequest as e:
                return self._error(400, str(e), e.param)
            except Exception as e:  # noqa: BLE001 - the model failed: a 500 naming it, the server stays up
                return self._error(500, f"generation failed: {type(e).__name__}: {e}", kind="server_error")
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Cache-Control", "no-cache")
            self.send_header("Connection", "close")
            self.end_headers()
            self.close_connection = True
            try:
                for chunk in chunks:
                    self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
                    self.wfile.flush()
            except Exception as e:  # noqa: BLE001 - headers are gone: report in-band, as OpenAI does
                self.wfile.write(
                    f"data: {json.dumps({'error': {'message': str(e), 'type': 'server_error'}})}\n\n".encode()
                )
            self.wfile.write(b"data: [DONE]\n\n")
            self.wfile.flush()

    return Handler


def make_server(
    model,
    tokenizer=None,
    host: str = "127.0.0.1",
    port: int = 8000,
    model_name: str = "fused",
    max_tokens_limit: int = 4096,
) -> ThreadingHTTPServer:
    """A threaded HTTP server (not started: call ``serve_forever()``; ``server_address`` has the bound port when
    ``port=0``) answering the OpenAI completions and chat completions APIs with ``model.generate()``."""
    server = ThreadingHTTPServer(
        (host, port), _handler(CompletionEngine(model, tokenizer, model_name, max_tokens_limit))
    )
    server.daemon_threads = True
    return server


def load_tokenizer(path):
    """The folder's tokenizer, or None when it has none (prompts must then be token ids)."""
    import os

    if not any(
        os.path.exists(os.path.join(os.fspath(path), f))
        for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
    ):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(os.fspath(path))
