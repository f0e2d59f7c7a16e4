"""Every Hub request has connect and read timeouts, whatever huggingface_hub passes.

huggingface_hub gives some requests a timeout (file metadata ``HF_HUB_ETAG_TIMEOUT``, file bodies
``HF_HUB_DOWNLOAD_TIMEOUT``, 10 s each by default) but builds its shared ``httpx2.Client`` with
``timeout=None`` and passes ``timeout=None`` explicitly for others (``repo_info``/``model_info``,
``whoami``, commits, LFS uploads): against an endpoint that accepts the connection and never
answers, those wait forever. The bound is enforced where every request is sent: a request hook on
huggingface_hub's client fills each timeout left unset (``None``) before the transport opens or
reads the connection:

- connect: ``HF_HUB_ETAG_TIMEOUT`` (huggingface_hub's bound for its metadata calls);
- read, write, pool: ``HF_HUB_DOWNLOAD_TIMEOUT`` (huggingface_hub's documented default "for other
  requests if not specified").

Both are read from the environment at each request, so they can be set per run; an explicit timeout
huggingface_hub chose is left alone. Retries stay huggingface_hub's own, each bounded: metadata
calls are not retried, a file body is resumed with a Range request up to 5 times without progress,
uploads are retried 5 times with 1-8 s backoff. So a stalled endpoint ends within
6 x 10 s + 23 s = 83 s at the defaults (the LFS upload path, the longest), under two minutes.

Not covered: transfers that hf_xet (Rust) makes itself; they follow hf_xet's own settings.
"""

from __future__ import annotations

import os
import threading

# How the request hook is recognised on a client (so it is added once).
_MARK = "_fuse_shared_bounded"
_lock = threading.Lock()


TIMEOUT_VARIABLES = ("HF_HUB_ETAG_TIMEOUT", "HF_HUB_DOWNLOAD_TIMEOUT")


def check_timeout_variables() -> None:
    """One line naming the variable when a timeout variable is not a whole number of seconds above 0.

    huggingface_hub parses them with ``int()`` when it is imported, so a bad value would otherwise end
    in a raw ``invalid literal for int()``; this runs before the first import of huggingface_hub.
    """
    from ..errors import HubError

    for env in TIMEOUT_VARIABLES:
        raw = os.environ.get(env)
        if raw is None:
            continue
        if not raw.strip().isdigit() or int(raw) < 1 or int(raw) > 86400:
            raise HubError(f"{env}={raw!r}: expected a whole number of seconds from 1 to 86400")


def _seconds(env: str, default: float) -> float:
    raw = os.environ.get(env, "").strip()
    return float(raw) if raw.isdigit() and int(raw) > 0 else float(default)


def hub_timeouts() -> dict[str, float]:
    """The timeouts given to a Hub request that has none: ``{"connect", "read", "write", "pool"}`` in seconds."""
    from huggingface_hub import constants

    connect = _seconds("HF_HUB_ETAG_TIMEOUT", constants.HF_HUB_ETAG_TIMEOUT)
    read = _seconds("HF_HUB_DOWNLOAD_TIMEOUT", constants.HF_HUB_DOWNLOAD_TIMEOUT)
    return {"connect": connect, "read": read, "write": read, "pool": read}


def _fill_timeouts(request) -> None:
    """httpx2 request hook: every timeout left ``None`` gets its bound; explicit ones are kept."""
    current = request.extensions.get("timeout")
    bounds = hub_timeouts()
    if not isinstance(current, dict):
        request.extensions["timeout"] = bounds
        return
    request.extensions["timeout"] = {k: (bounds[k] if current.get(k) is None else current[k]) for k in bounds} | {
        k: v for k, v in current.items() if k not in bounds
    }


setattr(_fill_timeouts, _MARK, True)


def _bounded(client):
    hooks = client.event_hooks
    if not any(getattr(h, _MARK, False) for h in hooks.get("request", [])):
        hooks["request"] = [*hooks.get("request", []), _fill_timeouts]
        client.event_hooks = hooks
    return client


def bound_hub_requests() -> None:
    """Make every request of huggingface_hub's shared client time out (idempotent).

    The client factory in place (huggingface_hub's default, or one the caller set with
    ``huggingface_hub.set_client_factory``) is wrapped, not replaced: its proxies, certificates and
    hooks are kept, and a client recreated later (after a connection error, in a forked child) is
    bounded too.
    """
    check_timeout_variables()
    from huggingface_hub import set_client_factory
    from huggingface_hub.utils import _http

    with _lock:
        current = getattr(_http, "_GLOBAL_CLIENT_FACTORY", None) or _http.default_client_factory
        if getattr(current, _MARK, False):
            return

        def factory():
            return _bounded(current())

        setattr(factory, _MARK, True)
        set_client_factory(factory)  # closes the current client: the next request gets a bounded one


__all__ = ["TIMEOUT_VARIABLES", "bound_hub_requests", "check_timeout_variables", "hub_timeouts"]
