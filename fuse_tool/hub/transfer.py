"""Read source checkpoints from, and publish converted checkpoints to, the Hugging Face Hub.

Everything goes through huggingface_hub's own machinery and settings:

- token: ``HF_TOKEN`` or the token saved by ``hf auth login`` (``huggingface_hub.get_token``);
- endpoint: ``HF_ENDPOINT`` (``huggingface_hub.constants.ENDPOINT``, read at call time);
- offline mode: ``HF_HUB_OFFLINE=1`` (downloads are served from the cache, pushes refuse to start).

Downloads use ``snapshot_download`` (files already in the cache are not fetched again; the
snapshot folder it returns is read in place, its files are symlinks into ``blobs/``). Uploads
use ``HfApi.upload_folder``: with hf_xet installed (the default) that is the streamed multi-commit
pipeline, where a rerun skips committed files and deduplicates uploaded chunks; without hf_xet it
is one commit over the LFS protocol, where a rerun skips every LFS object the server already
holds. Either way an interrupted push is resumed by running it again.

Every failure is raised as :class:`HubError` with a one-line message; a token is never printed.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import sys
from pathlib import Path
from typing import Callable, Iterator

from runtime.paths import CheckpointPaths

from ..errors import HubError, VerifyError
from ..files import CONFIG_NAME, INDEX_NAME, MANIFEST_NAME, MODEL_CARD_NAME, TAG_LENGTH, temporary_tag
from .model_card import human_bytes, render_model_card
from .timeouts import bound_hub_requests
from ..durable import sha256_file, write_atomically
from ..manifest import Manifest
from ..verify.integrity import CheckedOutput, check_output, list_checkpoint_files

# What conversion needs from a source repo: weights and index, config / generation config /
# tokenizer JSON, other tokenizer formats, chat templates, and code for trust_remote_code configs.
SOURCE_ALLOW_PATTERNS = ["*.safetensors", "*.json", "*.model", "*.tiktoken", "*.txt", "*.jinja", "*.py"]

# Never part of an upload (huggingface_hub adds .git/ and .cache/huggingface/ itself).
UPLOAD_IGNORE_PATTERNS = [".cache/*", "*/.cache/*", ".git/*", "*/.git/*"]

# Uploaded in a last commit, after every weight file is on the Hub.
LAST_FILES = (CONFIG_NAME, INDEX_NAME, MANIFEST_NAME, MODEL_CARD_NAME)

NO_TOKEN_MESSAGE = "no Hugging Face token: set HF_TOKEN or run `hf auth login`"

_REF_SHAPE = re.compile(r"^(?P<repo>\w[\w.\-]*/\w[\w.\-]*)(?:@(?P<rev>[^@\s]+))?$")
# Anything shaped like owner/name[@rev] that is not a local path is treated as a Hub reference, then validated.
_LOOSE_REF = re.compile(r"^(?![.~/])[^/\s@]+/[^/\s@]+(?:@\S*)?$")


# ----------------------------------------------------------------------------- helpers


def _endpoint(endpoint: str | None = None) -> str:
    from huggingface_hub import constants

    return (endpoint or constants.ENDPOINT).rstrip("/")


def _offline() -> bool:
    from huggingface_hub import constants

    return bool(constants.is_offline_mode())


def _one_line(text: str, limit: int = 300) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _scrub(text: str, token: str | None) -> str:
    if token:
        text = text.replace(token, "***")
    return re.sub(r"(?i)(bearer\s+)\S+", r"\1***", text)


def _card_tag(checked: CheckedOutput) -> str:
    """The tag of the model card's temporary name: the conversion's own (its manifest's fingerprint), so a later
    convert --overwrite can prove it wrote a card a killed push left staged; a folder without a manifest gets a random
    one, which nothing proves (left behind, it is named by convert and verify, never deleted silently)."""
    fingerprint = checked.manifest.inputs_fingerprint if checked.manifest is not None else None
    return temporary_tag(fingerprint) or secrets.token_hex(TAG_LENGTH // 2)


def _refuse_links_out(root: Path) -> None:
    """upload_folder follows a symlinked file: one leading out of OUT_DIR (a note linked to a private file) would be
    published. Refused before anything is sent or written; a Hub cache snapshot's links into its own blobs/ pass."""
    inside = CheckpointPaths(root)
    for name in list_checkpoint_files(root):
        real = inside.outside(root / name)
        if real is not None:
            raise HubError(
                f"not pushing: {root / name} is a symlink to {str(real)!r}, outside OUT_DIR, and would be uploaded; "
                "remove the link, or copy the file into OUT_DIR if it belongs to the checkpoint"
            )


def _validate_repo_id(repo_id: str, *, need_namespace: bool) -> str:
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    if not isinstance(repo_id, str) or not repo_id.strip():
        raise HubError("malformed repo id '': expected 'owner/name'")
    repo_id = repo_id.strip()
    try:
        validate_repo_id(repo_id)
    except HFValidationError:
        raise HubError(
            f"malformed repo id {repo_id!r}: expected 'owner/name' made of letters, digits, '-', '_' and '.' "
            "(no '--' or '..', not starting or ending with '-' or '.', at most 96 characters each)"
        ) from None
    if need_namespace and "/" not in repo_id:
        raise HubError(f"malformed repo id {repo_id!r}: expected 'owner/name'")
    return repo_id


def _validate_revision(revision: str | None) -> str | None:
    if revision is None:
        return None
    if not revision.strip() or any(c.isspace() for c in revision) or ".." in revision or revision.startswith("/"):
        raise HubError(f"malformed revision {revision!r}: expected a branch, tag or commit id")
    return revision


def parse_hub_reference(source: str) -> tuple[str, str | None]:
    """Split ``owner/name`` or ``owner/name@revision`` into ``(repo_id, revision)``, validating both."""
    repo, _, rev = source.strip().partition("@")
    repo_id = _validate_repo_id(repo, need_namespace=True)
    if _ and not rev:
        raise HubError(f"malformed Hub reference {source!r}: empty revision after '@'")
    return repo_id, _validate_revision(rev or None)


def is_hub_reference(source: str) -> bool:
    """True when ``source`` is not an existing local path and looks like ``owner/name`` or ``owner/name@rev``."""
    if not isinstance(source, (str, os.PathLike)):
        return False
    s = os.fspath(source)
    if not s or os.path.exists(os.path.expanduser(s)):
        return False
    return _REF_SHAPE.match(s) is not None


@contextlib.contextmanager
def _progress_bars(enabled: bool) -> Iterator[None]:
    from huggingface_hub.utils import are_progress_bars_disabled, disable_progress_bars, enable_progress_bars

    if enabled or are_progress_bars_disabled():
        yield
        return
    disable_progress_bars()
    try:
        yield
    finally:
        enable_progress_bars()


def _chain(exc: BaseException) -> list[BaseException]:
    seen: list[BaseException] = []
    cur: BaseException | None = exc
    while cur is not None and cur not in seen:
        seen.append(cur)
        cur = cur.__cause__ or cur.__context__
    return seen


def _server_says(err: BaseException) -> str:
    msg = getattr(err, "server_message", None)
    if not msg:
        resp = getattr(err, "response", None)
        try:
            msg = resp.headers.get("X-Error-Message") if resp is not None else None
        except Exception:
            msg = None
    return f": {_one_line(msg, 160)}" if msg else ""


def _reason(err: BaseException) -> str:
    text = _one_line(str(err), 160)
    return f"{type(err).__name__}: {text}" if text else type(err).__name__


def _translate(
    exc: BaseException,
    *,
    action: str,
    endpoint: str,
    repo_id: str | None = None,
    revision: str | None = None,
    writing: bool = False,
    token: str | None = None,
) -> HubError:
    """Map a huggingface_hub / httpx error (anywhere in the cause chain) to a one-line HubError."""
    import httpx2
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        HFValidationError,
        LocalTokenNotFoundError,
        OfflineModeIsEnabled,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    chain = _chain(exc)

    def find(*types: type) -> BaseException | None:
        return next((e for e in chain if isinstance(e, types)), None)

    repo = repo_id or "the repository"
    if find(OfflineModeIsEnabled):
        msg = f"offline mode is on (HF_HUB_OFFLINE=1), so cannot {action}: unset HF_HUB_OFFLINE to reach {endpoint}"
    elif find(LocalTokenNotFoundError):
        msg = NO_TOKEN_MESSAGE
    elif (e := find(HFValidationError)) is not None:
        msg = f"malformed repo id or revision for {repo}: {_one_line(str(e), 200)}"
    elif (e := find(RevisionNotFoundError)) is not None:
        msg = f"revision {revision!r} not found in {repo} on {endpoint}"
    elif (e := find(GatedRepoError)) is not None:
        msg = f"{repo} is gated on {endpoint}: accept its conditions on the Hub with the account of your token"
    elif (e := find(RepositoryNotFoundError)) is not None:
        if writing:
            msg = (
                f"cannot {action}: {repo} not found on {endpoint}, or the token has no write access to it "
                "(use a token with write permission for that namespace)"
            )
        else:
            msg = f"{repo} not found on {endpoint} (or it is private and the token cannot read it)"
    elif (e := find(HfHubHTTPError)) is not None:
        status = getattr(getattr(e, "response", None), "status_code", None)
        if status == 401:
            msg = (
                f"the Hugging Face token was rejected by {endpoint} (401: invalid or expired){_server_says(e)}; "
                "set HF_TOKEN or run `hf auth login`"
            )
        elif status == 403:
            what = f"write access to {repo}" if writing else f"access to {repo}"
            msg = f"no {what} with this token (403 Forbidden{_server_says(e)}); use a token with write permission for that namespace"
        else:
            msg = f"cannot {action}: {endpoint} answered HTTP {status}{_server_says(e)}"
    elif (e := find(httpx2.TimeoutException, TimeoutError)) is not None:
        from .timeouts import hub_timeouts

        t = hub_timeouts()
        which, var = (
            ("connect", "HF_HUB_ETAG_TIMEOUT")
            if isinstance(e, httpx2.ConnectTimeout)
            else ("read", "HF_HUB_DOWNLOAD_TIMEOUT")
        )
        msg = (
            f"the Hub at {endpoint} did not answer within {t[which]:g} s ({which} timeout) to {action}; "
            f"check the network and HF_ENDPOINT, or raise {var}"
        )
    elif (e := find(httpx2.TransportError, ConnectionError, TimeoutError)) is not None:
        msg = f"cannot reach the Hub at {endpoint} to {action} ({_reason(e)}); check the network and HF_ENDPOINT"
    else:
        msg = f"cannot {action}: {_reason(exc)}"
    return HubError(_scrub(_one_line(msg, 400), token))


# ----------------------------------------------------------------------------- download


def resolve_model_source(
    source: str | os.PathLike,
    *,
    cache_dir: str | os.PathLike | None = None,
    progress: bool = True,
    token: str | None = None,
    endpoint: str | None = None,
) -> Path:
    """Local folder: returned unchanged. Hub repo id (``owner/name`` or ``owner/name@revision``): the files
    conversion needs are downloaded with ``snapshot_download`` (only what is not cached yet) and the cache's
    snapshot folder is returned, to be read in place (its files are symlinks into ``blobs/``)."""
    s = os.fspath(source)
    local = Path(s).expanduser()
    if local.exists():
        return Path(s)
    if _LOOSE_REF.match(s) is None:
        raise HubError(f"{s}: no such local folder, and not a Hub repo id ('owner/name' or 'owner/name@revision')")
    bound_hub_requests()
    repo_id, revision = parse_hub_reference(s)
    ep = _endpoint(endpoint)

    from huggingface_hub import constants, snapshot_download

    cache = os.fspath(cache_dir) if cache_dir is not None else constants.HF_HUB_CACHE
    try:
        with _progress_bars(progress):
            folder = snapshot_download(
                repo_id,
                revision=revision,
                cache_dir=cache_dir,
                allow_patterns=SOURCE_ALLOW_PATTERNS,
                token=token,
                endpoint=ep,
            )
    except Exception as e:
        from huggingface_hub.errors import LocalEntryNotFoundError, OfflineModeIsEnabled

        chain = _chain(e)
        ref = f"{repo_id}@{revision}" if revision else repo_id
        offline_hit = any(isinstance(x, OfflineModeIsEnabled) for x in chain)
        if offline_hit or (_offline() and any(isinstance(x, LocalEntryNotFoundError) for x in chain)):
            raise HubError(
                f"{ref} is not (completely) in the cache {cache} and offline mode is on (HF_HUB_OFFLINE=1): "
                "unset HF_HUB_OFFLINE to download it"
            ) from None
        err = _translate(
            e, action=f"download {ref}", endpoint=ep, repo_id=repo_id, revision=revision or "main", token=token
        )
        if str(err).startswith(f"{repo_id} not found"):
            err = HubError(f"{err}; and there is no local folder named {s}")
        raise err from None
    path = Path(folder)
    if not (path / CONFIG_NAME).exists():
        raise HubError(f"{repo_id}: the repo has no config.json at its root (not a transformers model repo?)")
    if not any(p.name.endswith(".safetensors") for p in path.iterdir()):
        raise HubError(
            f"{repo_id}: the repo has no .safetensors weights at its root (only safetensors checkpoints can be converted)"
        )
    return path


# ----------------------------------------------------------------------------- upload


def _expected_sha256(out_dir: Path, rel: str, size: int, manifest: Manifest | None) -> str:
    """sha256 of a local file: from the converter's manifest when it records this file at this size, else computed."""
    return (manifest.sha256_of(rel, size) if manifest is not None else None) or sha256_file(out_dir / rel)


def verify_remote(
    api,
    repo_id: str,
    out_dir: Path,
    files: dict[str, int],
    *,
    revision: str | None,
    manifest: Manifest | None,
    token: str | None,
) -> tuple[list[str], list[str]]:
    """Compare remote files with local ones: size always, sha256 for LFS files, git blob id for the others.

    Returns ``(problems, extra_remote_paths)``.
    """
    from huggingface_hub import RepoFile
    from huggingface_hub.utils import sha as hf_sha

    remote = {
        f.path: f
        for f in api.list_repo_tree(repo_id, revision=revision, recursive=True, token=token)
        if isinstance(f, RepoFile)
    }
    problems: list[str] = []
    for rel, size in sorted(files.items()):
        r = remote.get(rel)
        if r is None:
            problems.append(f"{rel} is missing on the Hub")
            continue
        if r.size != size:
            problems.append(f"{rel} is {r.size} bytes on the Hub, {size} locally")
            continue
        if r.lfs is not None:
            want = _expected_sha256(out_dir, rel, size, manifest)
            if r.lfs.sha256.lower() != want:
                problems.append(f"{rel}: Hub sha256 {r.lfs.sha256[:12]}... differs from {want[:12]}...")
        elif size <= 64 * 1024 * 1024:
            with open(out_dir / rel, "rb") as f:
                want = hf_sha.git_hash(f.read())
            if r.blob_id != want:
                problems.append(f"{rel}: Hub blob {r.blob_id[:12]}... differs from local {want[:12]}...")
    extra = sorted(p for p in remote if p not in files and p != ".gitattributes")
    return problems, extra


def check_push_access(
    repo_id: str, *, revision: str | None = None, token: str | None = None, endpoint: str | None = None
) -> str:
    """What ``push_checkpoint`` checks before it sends anything, without a folder: the repo id and revision are
    well-formed, the Hub is reachable and the token is there and may write. ``convert --push-to`` calls it before
    converting (hours at real size). Returns the full repo id (``owner/name``); raises HubError in one line."""
    bound_hub_requests()
    repo_id = _validate_repo_id(repo_id, need_namespace=False)
    return _push_access(repo_id, _validate_revision(revision), token, endpoint)[1]


def _push_access(repo_id: str, revision: str | None, token: str | None, endpoint: str | None):
    """(api, full repo id, token, endpoint) for a push: offline mode, the token and its write role checked."""
    ep = _endpoint(endpoint)
    if _offline():
        raise HubError(f"offline mode is on (HF_HUB_OFFLINE=1): pushing needs {ep}; unset HF_HUB_OFFLINE")

    from huggingface_hub import HfApi, get_token

    token = token or get_token()
    if not token:
        raise HubError(NO_TOKEN_MESSAGE)
    api = HfApi(endpoint=ep, token=token)
    try:
        me = api.whoami()
    except Exception as e:
        raise _translate(
            e, action="check the token", endpoint=ep, repo_id=repo_id, revision=revision, writing=False, token=token
        ) from None
    role = ((me.get("auth") or {}).get("accessToken") or {}).get("role")
    if role == "read":
        raise HubError(
            f"the token of {me.get('name', 'this user')} is read-only: pushing to {repo_id} needs a token "
            "with write access"
        )
    if "/" not in repo_id:
        repo_id = f"{me['name']}/{repo_id}"
    return api, repo_id, token, ep


def push_checkpoint(
    out_dir: str | os.PathLike,
    repo_id: str,
    *,
    private: bool = False,
    revision: str | None = None,
    commit_message: str | None = None,
    progress: bool = True,
    base_model: str | None = None,
    write_card: bool = True,
    verify: bool = True,
    token: str | None = None,
    endpoint: str | None = None,
    log: Callable[[str], None] | None = None,
) -> str:
    """Publish a converted checkpoint to the Hub and return the repo URL.

    Order: the repo id is validated and OUT_DIR checked to be complete (nothing is sent otherwise); the
    model card README.md is written into OUT_DIR; the repo is created if needed (``exist_ok``) and the
    branch ``revision`` too; ``upload_folder`` sends what the Hub does not have yet (rerun to resume);
    then the remote file list is checked against the local files (size, sha256 of LFS files).
    """
    say = (
        log
        if log is not None
        else ((lambda m: print(m, file=sys.stderr, flush=True)) if progress else (lambda m: None))
    )
    bound_hub_requests()
    repo_id = _validate_repo_id(repo_id, need_namespace=False)
    revision = _validate_revision(revision)
    root = Path(out_dir)
    try:
        checked: CheckedOutput = check_output(root, require_manifest=False)
    except VerifyError as e:
        raise HubError(f"not pushing, OUT_DIR is not a complete converted checkpoint: {e}") from None
    _refuse_links_out(root)
    api, repo_id, token, ep = _push_access(repo_id, revision, token, endpoint)

    def fail(e: BaseException, action: str, writing: bool = True) -> HubError:
        return _translate(
            e, action=action, endpoint=ep, repo_id=repo_id, revision=revision, writing=writing, token=token
        )

    if write_card:
        card = render_model_card(checked, repo_id=repo_id, base_model=base_model, revision=revision)
        write_atomically(root / MODEL_CARD_NAME, card.encode(), _card_tag(checked))
        say(f"wrote model card {root / MODEL_CARD_NAME}")
    files = list_checkpoint_files(root)

    try:
        repo_url = api.create_repo(repo_id, repo_type="model", private=True if private else None, exist_ok=True)
    except Exception as e:
        raise fail(e, f"create {repo_id}") from None
    if revision and revision != "main" and not revision.startswith("refs/"):
        try:
            api.create_branch(repo_id, branch=revision, exist_ok=True)
        except Exception as e:
            raise fail(e, f"create branch {revision!r} in {repo_id}") from None

    where = f"{repo_id}@{revision}" if revision else repo_id
    say(
        f"uploading {len(files)} files ({human_bytes(sum(files.values()))}, {len(checked.shards)} shards) to {ep}/{repo_id}"
        + (f" (branch {revision})" if revision else "")
        + "; files the Hub already has are skipped"
    )
    message = (
        commit_message
        or f"Upload fused-shared checkpoint ({len(checked.shards)} shards, {human_bytes(checked.total_size)})"
    )
    # Weights first, then the files that make the repo look loadable (config, index, manifest, card): a
    # push interrupted midway never leaves a config.json on the Hub that points at missing shards.
    last = [p for p in LAST_FILES if p in files]
    phases = [
        (f"{message} (weights)", None, list(UPLOAD_IGNORE_PATTERNS) + last),
        (message, last, list(UPLOAD_IGNORE_PATTERNS)),
    ]
    for msg, allow, ignore in phases:
        try:
            with _progress_bars(progress):
                api.upload_folder(
                    repo_id=repo_id,
                    folder_path=root,
                    repo_type="model",
                    revision=revision,
                    commit_message=msg,
                    commit_description="Converted with fuse-shared (shared experts fused into trailing routed-expert slots).",
                    allow_patterns=allow,
                    ignore_patterns=ignore,
                )
        except Exception as e:
            err = fail(e, f"upload to {where}")
            raise HubError(
                f"{err}; the upload is resumable: rerun the same push to send only what is missing"
            ) from None

    if verify:
        say(f"verifying {len(files)} files on {ep}/{repo_id}")
        try:
            problems, extra = verify_remote(
                api, repo_id, root, files, revision=revision, manifest=checked.manifest, token=token
            )
        except Exception as e:
            raise fail(e, f"list the files of {where}", writing=False) from None
        if problems:
            more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
            raise HubError(
                f"upload verification failed for {where}: {'; '.join(problems[:3])}{more}; rerun the push to resend them"
            )
        if extra:
            shown = ", ".join(extra[:5]) + (" ..." if len(extra) > 5 else "")
            say(f"note: {where} also holds {len(extra)} file(s) not in OUT_DIR, left untouched: {shown}")
        say(f"verified: {len(files)} files match")
    return str(repo_url)


__all__ = [
    "HubError",
    "NO_TOKEN_MESSAGE",
    "SOURCE_ALLOW_PATTERNS",
    "is_hub_reference",
    "parse_hub_reference",
    "push_checkpoint",
    "resolve_model_source",
    "verify_remote",
]
