"""A Hugging Face Hub-compatible HTTP server on loopback, for tests of the real huggingface_hub client.

It implements what huggingface_hub 2.x calls for the non-Xet paths (``HF_HUB_DISABLE_XET=1``):

    GET  /api/whoami-v2
    POST /api/validate-yaml
    POST /api/repos/create
    GET  /api/models/{repo}                      GET /api/models/{repo}/revision/{rev}
    GET  /api/models/{repo}/tree/{rev}[/{path}]  POST /api/models/{repo}/paths-info/{rev}
    GET  /api/models/{repo}/refs                 POST /api/models/{repo}/branch/{branch}
    POST /api/models/{repo}/preupload/{rev}      POST /api/models/{repo}/commit/{rev}   (NDJSON)
    POST /{repo}.git/info/lfs/objects/batch      (git-lfs batch API: basic and multipart transfers)
    POST /{repo}.git/info/lfs/objects/verify     POST /{repo}.git/info/lfs/objects/complete/{oid}
    HEAD/GET /{repo}/resolve/{rev}/{path}        (ETag, X-Repo-Commit, Content-Length, Range;
                                                  LFS files: 302 to the "CDN" with X-Linked-Etag/-Size)

LFS objects are PUT to, and downloaded from, a second server (another port, so another origin: the
client treats it like the real Hub's CDN, sends it no token, and stops redirects there).

Everything received is kept in memory (LFS objects by sha256, regular blobs by git sha1, commits per
repo), every request is logged, and hooks can cut LFS uploads off: ``fail_lfs_puts_from = N`` answers
the N-th and later PUTs with HTTP 507 (not retried by the client); ``stall_lfs_put = N`` makes the N-th
PUT read half its body, set ``stalled`` and hang until ``release`` is set, then drop the connection;
``cut_body_after = N`` sends only the first N bytes of the next whole-file download longer than N, then drops the
connection (``range_log`` records the Range header of every file body GET).
"""

from __future__ import annotations

import base64
import datetime as _dt
import fnmatch
import hashlib
import hmac
import itertools
import json
import re
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, quote, unquote, urlsplit

import yaml

DEFAULT_GITATTRIBUTES = """\
*.7z filter=lfs diff=lfs merge=lfs -text
*.bin filter=lfs diff=lfs merge=lfs -text
*.ckpt filter=lfs diff=lfs merge=lfs -text
*.gz filter=lfs diff=lfs merge=lfs -text
*.h5 filter=lfs diff=lfs merge=lfs -text
*.model filter=lfs diff=lfs merge=lfs -text
*.msgpack filter=lfs diff=lfs merge=lfs -text
*.npy filter=lfs diff=lfs merge=lfs -text
*.onnx filter=lfs diff=lfs merge=lfs -text
*.pt filter=lfs diff=lfs merge=lfs -text
*.pth filter=lfs diff=lfs merge=lfs -text
*.safetensors filter=lfs diff=lfs merge=lfs -text
*.tar filter=lfs diff=lfs merge=lfs -text
*.zip filter=lfs diff=lfs merge=lfs -text
*.zst filter=lfs diff=lfs merge=lfs -text
"""

_NAME = re.compile(r"^(?![.-])[\w.\-]{1,96}(?<![.-])$")

# Tokens the fake Hub knows: alice may write, her read token may not, bob writes only his own repos.
WRITE_TOKEN = "hf_fake_write_alice_0123456789"
READ_TOKEN = "hf_fake_read_alice_0123456789"
BOB_TOKEN = "hf_fake_write_bob_0123456789"


def git_blob_sha1(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def lfs_pointer(oid: str, size: int) -> bytes:
    return f"version https://git-lfs.github.com/spec/v1\noid sha256:{oid}\nsize {size}\n".encode()


@dataclass
class FileEntry:
    size: int
    blob_id: str  # git sha1 of the content (regular) or of the LFS pointer (LFS)
    lfs_sha256: str | None = None

    def tree_json(self, path: str) -> dict[str, Any]:
        d: dict[str, Any] = {"type": "file", "oid": self.blob_id, "size": self.size, "path": path}
        if self.lfs_sha256:
            d["lfs"] = {
                "oid": self.lfs_sha256,
                "size": self.size,
                "pointerSize": len(lfs_pointer(self.lfs_sha256, self.size)),
            }
        return d


@dataclass
class Commit:
    id: str
    parent: str | None
    title: str
    description: str
    files: dict[str, FileEntry]
    date: str


@dataclass
class Repo:
    repo_id: str
    private: bool
    branches: dict[str, str] = field(default_factory=dict)
    tags: dict[str, str] = field(default_factory=dict)
    commits: dict[str, Commit] = field(default_factory=dict)
    created_at: str = ""

    @property
    def owner(self) -> str:
        return self.repo_id.split("/")[0]


@dataclass
class Request:
    server: str  # "hub" or "cdn"
    method: str
    path: str
    status: int = 0
    bytes_in: int = 0
    authenticated: bool = False


class HttpError(Exception):
    def __init__(self, status: int, message: str, code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.code, self.headers = status, message, code, headers or {}


def _now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.000Z")


class FakeHub:
    """The state and the two servers. Use ``start()``/``stop()`` or a ``with`` block."""

    def __init__(
        self,
        *,
        lfs_threshold: int = 10 * 1024 * 1024,
        multipart_threshold: int | None = None,
        multipart_chunk_size: int = 5 * 1024 * 1024,
        tree_page_size: int = 1000,
    ):
        self.lfs_threshold = lfs_threshold
        self.multipart_threshold = multipart_threshold
        self.multipart_chunk_size = multipart_chunk_size
        self.tree_page_size = tree_page_size
        self.tokens: dict[str, dict[str, Any]] = {}
        self.repos: dict[str, Repo] = {}
        self.lfs_objects: dict[str, bytes] = {}
        self.blobs: dict[str, bytes] = {}
        self.requests: list[Request] = []
        self.lfs_put_log: list[tuple[str, int]] = []  # (oid, status) per LFS PUT, in arrival order
        self.download_log: list[tuple[str, str]] = []  # (repo_id, path) per GET of a file body (hub or CDN)
        self.validated_yaml: list[str] = []
        self.fail_lfs_puts_from: int | None = None
        self.stall_lfs_put: int | None = None
        self.cut_body_after: int | None = (
            None  # the next file body sent stops after this many bytes (connection dropped)
        )
        self.range_log: list[str | None] = []  # the Range header of every GET of a file body
        self.stalled = threading.Event()
        self.release = threading.Event()
        self._puts = itertools.count(1)
        self._parts: dict[str, dict[int, bytes]] = {}
        self._secret = hashlib.sha256(repr(id(self)).encode()).hexdigest().encode()
        self._commit_counter = itertools.count(1)
        self.lock = threading.RLock()
        self._hub: ThreadingHTTPServer | None = None
        self._cdn: ThreadingHTTPServer | None = None
        self._threads: list[threading.Thread] = []

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> "FakeHub":
        self._hub = _Server(("127.0.0.1", 0), _HubHandler, self, "hub")
        self._cdn = _Server(("127.0.0.1", 0), _CdnHandler, self, "cdn")
        for srv in (self._hub, self._cdn):
            t = threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
            t.start()
            self._threads.append(t)
        return self

    def stop(self) -> None:
        self.release.set()
        for srv in (self._hub, self._cdn):
            if srv is not None:
                srv.shutdown()
                srv.server_close()
        for t in self._threads:
            t.join(timeout=5)

    def __enter__(self) -> "FakeHub":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    @property
    def url(self) -> str:
        assert self._hub is not None
        return f"http://127.0.0.1:{self._hub.server_address[1]}"

    @property
    def cdn_url(self) -> str:
        assert self._cdn is not None
        return f"http://127.0.0.1:{self._cdn.server_address[1]}"

    # ------------------------------------------------------------------ test helpers

    def add_token(self, token: str, user: str, *, role: str = "write", orgs: tuple[str, ...] = ()) -> None:
        self.tokens[token] = {"user": user, "role": role, "orgs": tuple(orgs)}

    def create_repo_direct(self, repo_id: str, *, private: bool = False) -> Repo:
        with self.lock:
            return self._create_repo(repo_id, private)

    def head(self, repo_id: str, rev: str = "main") -> Commit:
        repo = self.repos[repo_id]
        return repo.commits[self._resolve_rev(repo, rev)]

    def files(self, repo_id: str, rev: str = "main") -> dict[str, FileEntry]:
        return dict(self.head(repo_id, rev).files)

    def file_bytes(self, repo_id: str, path: str, rev: str = "main") -> bytes:
        entry = self.head(repo_id, rev).files[path]
        return self.lfs_objects[entry.lfs_sha256] if entry.lfs_sha256 else self.blobs[entry.blob_id]

    def commit_count(self, repo_id: str) -> int:
        return len(self.repos[repo_id].commits)

    def reset_log(self) -> None:
        with self.lock:
            self.requests.clear()
            self.lfs_put_log.clear()
            self.download_log.clear()

    def puts_of(self, oid: str) -> int:
        return sum(1 for o, _ in self.lfs_put_log if o == oid)

    def api_requests(self) -> list[Request]:
        """Requests that are part of an operation (not huggingface_hub's agent-registry fetch)."""
        return [r for r in self.requests if r.path != "/api/agent-harnesses"]

    def bytes_put(self) -> int:
        return sum(r.bytes_in for r in self.requests if r.server == "cdn" and r.method == "PUT")

    # ------------------------------------------------------------------ internals

    def _sign(self, what: str) -> str:
        return hmac.new(self._secret, what.encode(), "sha256").hexdigest()[:32]

    def _check_sig(self, what: str, query: dict[str, list[str]]) -> None:
        if not hmac.compare_digest(query.get("sig", [""])[0], self._sign(what)):
            raise HttpError(403, "Signature does not match")

    def _create_repo(self, repo_id: str, private: bool) -> Repo:
        repo = Repo(repo_id=repo_id, private=private, created_at=_now())
        data = DEFAULT_GITATTRIBUTES.encode()
        sha = git_blob_sha1(data)
        self.blobs[sha] = data
        files = {".gitattributes": FileEntry(len(data), sha)}
        c = self._new_commit(repo, None, "initial commit", "", files)
        repo.branches["main"] = c.id
        self.repos[repo_id] = repo
        return repo

    def _new_commit(
        self, repo: Repo, parent: str | None, title: str, description: str, files: dict[str, FileEntry]
    ) -> Commit:
        n = next(self._commit_counter)
        digest = hashlib.sha1(
            json.dumps([repo.repo_id, parent, title, n, sorted((p, e.blob_id) for p, e in files.items())]).encode()
        )
        c = Commit(digest.hexdigest(), parent, title, description, files, _now())
        repo.commits[c.id] = c
        return c

    def _resolve_rev(self, repo: Repo, rev: str) -> str:
        if rev in repo.branches:
            return repo.branches[rev]
        if rev in repo.tags:
            return repo.tags[rev]
        if re.fullmatch(r"[0-9a-f]{40}", rev) and rev in repo.commits:
            return rev
        raise HttpError(404, f"Invalid rev id: {rev}", "RevisionNotFound")

    def _user(self, token: str | None) -> dict[str, Any] | None:
        if token is None:
            return None
        info = self.tokens.get(token)
        if info is None:
            raise HttpError(401, "Invalid credentials in Authorization header")
        return info

    def _can_write_namespace(self, user: dict[str, Any] | None, namespace: str) -> bool:
        return user is not None and (namespace == user["user"] or namespace in user["orgs"])

    def _repo_for_read(self, repo_id: str, token: str | None) -> Repo:
        user = self._user(token)
        repo = self.repos.get(repo_id)
        if repo is None or (repo.private and not self._can_write_namespace(user, repo_id.split("/")[0])):
            raise HttpError(404, "Repository not found", "RepoNotFound")
        return repo

    def _repo_for_write(self, repo_id: str, token: str | None) -> Repo:
        repo = self._repo_for_read(repo_id, token)
        user = self._user(token)
        if user is None:
            raise HttpError(401, "You must be authenticated to write to a repository")
        if user["role"] != "write":
            raise HttpError(403, "Forbidden: you must use a write token to upload to a repository")
        if not self._can_write_namespace(user, repo.owner):
            raise HttpError(403, f"You don't have write access to {repo_id}")
        return repo

    def _is_lfs(self, repo: Repo, files: dict[str, FileEntry], path: str, size: int) -> bool:
        if size >= self.lfs_threshold:
            return True
        entry = files.get(".gitattributes")
        text = (self.blobs.get(entry.blob_id, b"") if entry else b"").decode(errors="replace")
        base = path.rsplit("/", 1)[-1]
        for line in text.splitlines():
            parts = line.split()
            if len(parts) >= 2 and "filter=lfs" in parts[1:]:
                pat = parts[0]
                if fnmatch.fnmatch(path if "/" in pat else base, pat):
                    return True
        return False

    # ------------------------------------------------------------------ hub API

    def api_whoami(self, token: str | None) -> dict[str, Any]:
        user = self._user(token)
        if user is None:
            raise HttpError(401, "Invalid credentials in Authorization header")
        return {
            "type": "user",
            "id": hashlib.md5(user["user"].encode()).hexdigest()[:24],
            "name": user["user"],
            "fullname": user["user"].title(),
            "email": f"{user['user']}@example.invalid",
            "orgs": [{"type": "org", "name": o, "roleInOrg": "write"} for o in user["orgs"]],
            "auth": {"type": "access_token", "accessToken": {"displayName": "test", "role": user["role"]}},
        }

    def api_validate_yaml(self, body: dict[str, Any]) -> dict[str, Any]:
        content = body.get("content", "")
        self.validated_yaml.append(content)
        m = re.match(r"^---\s*\n(.*?)\n---\s*(\n|$)", content, re.S)
        if m:
            try:
                meta = yaml.safe_load(m.group(1))
            except yaml.YAMLError as e:
                raise HttpError(400, "Invalid YAML", headers={"X-Fake-Errors": json.dumps([{"message": str(e)}])})
            if meta is not None and not isinstance(meta, dict):
                raise HttpError(400, "YAML metadata must be a mapping")
        return {"errors": [], "warnings": []}

    def api_create_repo(self, body: dict[str, Any], token: str | None) -> tuple[int, dict[str, Any]]:
        user = self._user(token)
        if user is None:
            raise HttpError(401, "You must be authenticated to create a repository")
        name, org = body.get("name"), body.get("organization") or user["user"]
        if body.get("type") not in (None, "model"):
            raise HttpError(400, "this fake hub only hosts models")
        if not isinstance(name, str) or not _NAME.match(name) or "--" in name or ".." in name:
            raise HttpError(400, f"Invalid repo name: {name!r}")
        if user["role"] != "write" or not self._can_write_namespace(user, org):
            raise HttpError(403, f'You don\'t have the rights to create a model under the namespace "{org}"')
        repo_id = f"{org}/{name}"
        url = f"{self.url}/{repo_id}"
        if repo_id in self.repos:
            raise HttpError(409, "You already created this model repo", headers={"X-Fake-Url": url})
        self._create_repo(repo_id, body.get("visibility") == "private" or bool(body.get("private")))
        return 200, {"url": url, "name": repo_id, "id": hashlib.md5(repo_id.encode()).hexdigest()[:24]}

    def api_repo_info(self, repo_id: str, rev: str, token: str | None, query: dict[str, list[str]]) -> dict[str, Any]:
        repo = self._repo_for_read(repo_id, token)
        commit = repo.commits[self._resolve_rev(repo, rev)]
        blobs = query.get("blobs", ["false"])[0].lower() in ("1", "true")
        siblings = []
        for p, e in sorted(commit.files.items()):
            s: dict[str, Any] = {"rfilename": p}
            if blobs:
                s["size"], s["blobId"] = e.size, e.blob_id
                if e.lfs_sha256:
                    s["lfs"] = {
                        "size": e.size,
                        "sha256": e.lfs_sha256,
                        "pointerSize": len(lfs_pointer(e.lfs_sha256, e.size)),
                    }
            siblings.append(s)
        return {
            "_id": hashlib.md5(repo_id.encode()).hexdigest()[:24],
            "id": repo_id,
            "modelId": repo_id,
            "author": repo.owner,
            "sha": commit.id,
            "lastModified": commit.date,
            "createdAt": repo.created_at,
            "private": repo.private,
            "disabled": False,
            "gated": False,
            "downloads": 0,
            "likes": 0,
            "tags": [],
            "siblings": siblings,
        }

    def api_tree(
        self, repo_id: str, rev: str, path: str, token: str | None, query: dict[str, list[str]]
    ) -> tuple[list, str | None]:
        repo = self._repo_for_read(repo_id, token)
        commit = repo.commits[self._resolve_rev(repo, rev)]
        recursive = query.get("recursive", ["false"])[0].lower() in ("1", "true")
        prefix = path.strip("/")
        entries: dict[str, dict[str, Any]] = {}
        found = not prefix
        for p, e in commit.files.items():
            if prefix and not (p == prefix or p.startswith(prefix + "/")):
                continue
            found = True
            rel = p[len(prefix) + 1 :] if prefix else p
            parts = rel.split("/")
            for i in range(1, len(parts)):  # parent folders
                d = "/".join(([prefix] if prefix else []) + parts[:i])
                if recursive or i == 1:
                    entries.setdefault(
                        d, {"type": "directory", "oid": hashlib.sha1(d.encode()).hexdigest(), "size": 0, "path": d}
                    )
            if recursive or len(parts) == 1:
                entries[p] = e.tree_json(p)
        if not found:
            raise HttpError(404, f"{path} does not exist on {rev}", "EntryNotFound")
        items = [entries[k] for k in sorted(entries)]
        start = int(query.get("cursor", ["0"])[0])
        page = items[start : start + self.tree_page_size]
        nxt = None
        if start + self.tree_page_size < len(items):
            nxt = f"recursive={str(recursive).lower()}&cursor={start + self.tree_page_size}"
        return page, nxt

    def api_paths_info(self, repo_id: str, rev: str, token: str | None, form: dict[str, list[str]]) -> list:
        repo = self._repo_for_read(repo_id, token)
        commit = repo.commits[self._resolve_rev(repo, rev)]
        out = []
        for p in form.get("paths", []):
            p = p.strip("/")
            if p in commit.files:
                out.append(commit.files[p].tree_json(p))
            elif any(f.startswith(p + "/") for f in commit.files):
                out.append({"type": "directory", "oid": hashlib.sha1(p.encode()).hexdigest(), "size": 0, "path": p})
        return out

    def api_refs(self, repo_id: str, token: str | None) -> dict[str, Any]:
        repo = self._repo_for_read(repo_id, token)
        return {
            "branches": [
                {"name": b, "ref": f"refs/heads/{b}", "targetCommit": c} for b, c in sorted(repo.branches.items())
            ],
            "tags": [{"name": t, "ref": f"refs/tags/{t}", "targetCommit": c} for t, c in sorted(repo.tags.items())],
            "converts": [],
        }

    def api_create_branch(self, repo_id: str, branch: str, body: dict[str, Any], token: str | None) -> dict[str, Any]:
        repo = self._repo_for_write(repo_id, token)
        if branch in repo.branches:
            raise HttpError(409, f"Reference refs/heads/{branch} already exists")
        start = body.get("startingPoint") or "main"
        repo.branches[branch] = self._resolve_rev(repo, start)
        return {}

    def api_preupload(self, repo_id: str, rev: str, body: dict[str, Any], token: str | None) -> dict[str, Any]:
        repo = self._repo_for_write(repo_id, token)
        files = repo.commits[self._resolve_rev(repo, rev)].files
        out = []
        for f in body.get("files", []):
            path, size = f["path"], int(f["size"])
            lfs = self._is_lfs(repo, files, path, size)
            existing = files.get(path)
            oid = None
            if existing is not None:
                oid = existing.lfs_sha256 if existing.lfs_sha256 else existing.blob_id
            out.append({"path": path, "uploadMode": "lfs" if lfs else "regular", "shouldIgnore": False, "oid": oid})
        return {"files": out, "commitOid": repo.branches.get(rev, rev)}

    def api_commit(
        self, repo_id: str, rev: str, raw: bytes, token: str | None, query: dict[str, list[str]]
    ) -> dict[str, Any]:
        repo = self._repo_for_write(repo_id, token)
        if query.get("create_pr"):
            raise HttpError(400, "pull requests are not supported by the fake hub")
        if rev not in repo.branches:
            self._resolve_rev(repo, rev)
            raise HttpError(400, f"Cannot commit to {rev}: not a branch")
        head = repo.commits[repo.branches[rev]]
        lines = [json.loads(x) for x in raw.decode().splitlines() if x.strip()]
        if not lines or lines[0].get("key") != "header":
            raise HttpError(400, "first line of the commit payload must be the header")
        header = lines[0]["value"]
        parent = header.get("parentCommit")
        if parent and not head.id.startswith(parent):
            raise HttpError(412, "A commit has happened since. Please refresh and try again.")
        files = dict(head.files)
        for item in lines[1:]:
            key, v = item.get("key"), item.get("value", {})
            if key == "file":
                data = base64.b64decode(v["content"]) if v.get("encoding") == "base64" else v["content"].encode()
                sha = git_blob_sha1(data)
                self.blobs[sha] = data
                files[v["path"]] = FileEntry(len(data), sha)
            elif key == "lfsFile":
                oid = v["oid"]
                if oid not in self.lfs_objects:
                    raise HttpError(
                        422,
                        f"Your push was rejected because an LFS pointer pointed to a file that does not exist ({v['path']})",
                    )
                size = len(self.lfs_objects[oid])
                if v.get("size") is not None and int(v["size"]) != size:
                    raise HttpError(422, f"LFS object size mismatch for {v['path']}")
                files[v["path"]] = FileEntry(size, git_blob_sha1(lfs_pointer(oid, size)), oid)
            elif key == "deletedFile":
                if v["path"] not in files:
                    raise HttpError(404, f"A file with this name doesn't exist: {v['path']}")
                del files[v["path"]]
            elif key == "deletedFolder":
                prefix = v["path"].rstrip("/") + "/"
                for p in [p for p in files if p.startswith(prefix)]:
                    del files[p]
            else:
                raise HttpError(400, f"unknown commit operation {key!r}")
        c = self._new_commit(repo, head.id, header.get("summary", ""), header.get("description", ""), files)
        repo.branches[rev] = c.id
        return {
            "success": True,
            "commitOid": c.id,
            "commitUrl": f"{self.url}/{repo_id}/commit/{c.id}",
            "hookOutput": "",
            "pullRequestUrl": None,
        }

    def api_lfs_batch(self, repo_id: str, body: dict[str, Any], token: str | None) -> dict[str, Any]:
        self._repo_for_write(repo_id, token)
        if body.get("operation") != "upload":
            raise HttpError(400, "only uploads are supported")
        transfers = body.get("transfers") or ["basic"]
        multipart = self.multipart_threshold is not None and "multipart" in transfers
        out = []
        for o in body.get("objects", []):
            oid, size = o["oid"], int(o["size"])
            obj: dict[str, Any] = {"oid": oid, "size": size, "authenticated": True}
            if oid in self.lfs_objects and len(self.lfs_objects[oid]) == size:
                out.append(obj)  # already there: no actions, the client skips it
                continue
            verify = {"href": f"{self.url}/{repo_id}.git/info/lfs/objects/verify", "header": {}}
            if multipart and size >= self.multipart_threshold:
                cs = self.multipart_chunk_size
                n = -(-size // cs)
                header: dict[str, str] = {"chunk_size": str(cs)}
                for k in range(1, n + 1):
                    header[str(k)] = f"{self.cdn_url}/upload/{oid}/part/{k}?sig={self._sign(f'{oid}/{k}')}"
                upload = {"href": f"{self.url}/{repo_id}.git/info/lfs/objects/complete/{oid}", "header": header}
            else:
                upload = {"href": f"{self.cdn_url}/upload/{oid}?size={size}&sig={self._sign(oid)}", "header": {}}
            obj["actions"] = {"upload": upload, "verify": verify}
            out.append(obj)
        return {"transfer": "multipart" if multipart else "basic", "objects": out, "hash_algo": "sha256"}

    def api_lfs_verify(self, repo_id: str, body: dict[str, Any], token: str | None) -> dict[str, Any]:
        self._repo_for_write(repo_id, token)
        oid, size = body.get("oid"), body.get("size")
        if oid not in self.lfs_objects or len(self.lfs_objects[oid]) != int(size):
            raise HttpError(404, f"LFS object {oid} not found")
        return {}

    def api_lfs_complete(self, repo_id: str, oid: str, body: dict[str, Any]) -> dict[str, Any]:
        parts = self._parts.get(oid, {})
        numbers = [int(p["partNumber"]) for p in body.get("parts", [])]
        if not numbers or any(n not in parts for n in numbers):
            raise HttpError(400, "missing parts")
        for p in body["parts"]:
            if p.get("etag") != hashlib.md5(parts[int(p["partNumber"])]).hexdigest():
                raise HttpError(400, f"bad etag for part {p['partNumber']}")
        data = b"".join(parts[n] for n in sorted(numbers))
        if hashlib.sha256(data).hexdigest() != oid:
            raise HttpError(400, "sha256 of the assembled parts does not match the oid")
        self.lfs_objects[oid] = data
        self._parts.pop(oid, None)
        return {}


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, addr, handler, hub: FakeHub, name: str):
        super().__init__(addr, handler)
        self.hub, self.name = hub, name


class _Base(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _Server

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - silence the default stderr log
        pass

    @property
    def hub(self) -> FakeHub:
        return self.server.hub

    # -- request parts

    def _token(self) -> str | None:
        auth = self.headers.get("Authorization") or ""
        return auth[7:].strip() if auth.lower().startswith("bearer ") else None

    def _read_body(self, limit: int | None = None) -> bytes:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            out = bytearray()
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    self.rfile.readline()
                    break
                out += self.rfile.read(size)
                self.rfile.readline()
            return bytes(out)
        n = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(n if limit is None else min(n, limit))

    def _json_body(self) -> dict[str, Any]:
        raw = self._read_body()
        self._rec.bytes_in = len(raw)
        return json.loads(raw or b"{}")

    # -- responses

    def _send(
        self,
        status: int,
        body: bytes = b"",
        headers: dict[str, str] | None = None,
        content_type: str = "application/json",
    ) -> None:
        self._rec.status = status
        self.send_response(status)
        hdrs = {"Content-Type": content_type, "Content-Length": str(len(body)), "X-Request-Id": f"fake-{id(self)}"}
        hdrs.update(headers or {})
        for k, v in hdrs.items():
            self.send_header(k, v)
        self.end_headers()
        if self.command != "HEAD" and body:
            self.wfile.write(body)

    def _send_json(
        self, obj: Any, status: int = 200, headers: dict[str, str] | None = None, content_type: str = "application/json"
    ) -> None:
        self._send(status, json.dumps(obj).encode(), headers, content_type)

    def _send_error(self, e: HttpError) -> None:
        headers = {"X-Error-Message": e.message}
        if e.code:
            headers["X-Error-Code"] = e.code
        body: dict[str, Any] = {"error": e.message}
        if "X-Fake-Errors" in e.headers:
            body["errors"] = json.loads(e.headers.pop("X-Fake-Errors"))
        if "X-Fake-Url" in e.headers:
            body["url"] = e.headers.pop("X-Fake-Url")
        headers.update(e.headers)
        self._send_json(body, e.status, headers)

    def _serve_bytes(self, data: bytes, headers: dict[str, str]) -> None:
        rng = self.headers.get("Range")
        if self.command == "GET":
            with self.hub.lock:
                self.hub.range_log.append(rng)
                cut, self.hub.cut_body_after = self.hub.cut_body_after, None
            if cut is not None and not rng and len(data) > cut:  # a whole-file GET of a file longer than the cut:
                # send the headers and part of the body, then hang up (a shorter file, which the client may fetch
                # first as it downloads several at once, would arrive whole and leave the cut unused)
                self._rec.status = 200
                self.send_response(200)
                for k, v in {
                    **headers,
                    "Accept-Ranges": "bytes",
                    "Content-Length": str(len(data)),
                    "Content-Type": "application/octet-stream",
                }.items():
                    self.send_header(k, v)
                self.end_headers()
                self.wfile.write(data[:cut])
                self.wfile.flush()
                self.close_connection = True
                return
            if cut is not None:
                with self.hub.lock:
                    self.hub.cut_body_after = cut  # not used up by a ranged GET or a file shorter than the cut
        m = re.fullmatch(r"bytes=(\d*)-(\d*)", rng.strip()) if rng else None
        if m and (m.group(1) or m.group(2)):
            size = len(data)
            if m.group(1):
                start = int(m.group(1))
                end = int(m.group(2)) if m.group(2) else size - 1
            else:
                start, end = max(size - int(m.group(2)), 0), size - 1
            if start >= size:
                self._send(416, b"", {**headers, "Content-Range": f"bytes */{size}"})
                return
            end = min(end, size - 1)
            self._send(
                206,
                data[start : end + 1],
                {**headers, "Content-Range": f"bytes {start}-{end}/{size}", "Accept-Ranges": "bytes"},
                "application/octet-stream",
            )
        else:
            self._send(200, data, {**headers, "Accept-Ranges": "bytes"}, "application/octet-stream")

    # -- dispatch

    def _dispatch(self) -> None:
        parts = urlsplit(self.path)
        self._query = parse_qs(parts.query, keep_blank_values=True)
        self._segments = [unquote(s) for s in parts.path.split("/")[1:]]
        self._rec = Request(self.server.name, self.command, parts.path, authenticated=self._token() is not None)
        with self.hub.lock:
            self.hub.requests.append(self._rec)
        try:
            self.route()
        except HttpError as e:
            self._send_error(e)
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True
        except Exception as e:  # a bug in the fake: say so loudly (500 would be retried by the client)
            self._send_error(HttpError(418, f"fake hub crashed: {type(e).__name__}: {e}"))

    do_GET = do_HEAD = do_POST = do_PUT = do_DELETE = _dispatch

    def route(self) -> None:  # pragma: no cover - overridden
        raise HttpError(404, "not found")


class _HubHandler(_Base):
    def route(self) -> None:
        s, m, hub, tok = self._segments, self.command, self.hub, self._token()
        if s[:1] == ["api"]:
            return self._route_api(s[1:], m, tok)
        # /{owner}/{name}.git/info/lfs/objects/...
        if len(s) >= 6 and s[1].endswith(".git") and s[2:5] == ["info", "lfs", "objects"]:
            repo_id = f"{s[0]}/{s[1][:-4]}"
            body = self._json_body()
            with hub.lock:
                if s[5] == "batch" and m == "POST":
                    return self._send_json(
                        hub.api_lfs_batch(repo_id, body, tok), content_type="application/vnd.git-lfs+json"
                    )
                if s[5] == "verify" and m == "POST":
                    return self._send_json(hub.api_lfs_verify(repo_id, body, tok))
                if s[5] == "complete" and m == "POST" and len(s) == 7:
                    return self._send_json(hub.api_lfs_complete(repo_id, s[6], body))
            raise HttpError(404, "unknown LFS route")
        # /{owner}/{name}/resolve/{rev}/{path...}
        if len(s) >= 5 and s[2] == "resolve" and m in ("GET", "HEAD"):
            return self._resolve(f"{s[0]}/{s[1]}", s[3], "/".join(s[4:]), tok)
        raise HttpError(404, f"no route for {m} {self.path}")

    def _route_api(self, s: list[str], m: str, tok: str | None) -> None:
        hub = self.hub
        if s == ["whoami-v2"] and m == "GET":
            with hub.lock:
                return self._send_json(hub.api_whoami(tok))
        if s == ["agent-harnesses"] and m == "GET":
            return self._send_json({"standardEnvVars": [], "harnesses": {}})
        if s == ["validate-yaml"] and m == "POST":
            body = self._json_body()
            with hub.lock:
                return self._send_json(hub.api_validate_yaml(body))
        if s == ["repos", "create"] and m == "POST":
            body = self._json_body()
            with hub.lock:
                status, out = hub.api_create_repo(body, tok)
            return self._send_json(out, status)
        if len(s) >= 3 and s[0] == "models":
            repo_id, rest = f"{s[1]}/{s[2]}", s[3:]
            with hub.lock:
                if not rest and m == "GET":
                    return self._send_json(hub.api_repo_info(repo_id, "main", tok, self._query))
                if rest[:1] == ["revision"] and len(rest) == 2 and m == "GET":
                    return self._send_json(hub.api_repo_info(repo_id, rest[1], tok, self._query))
                if rest[:1] == ["tree"] and len(rest) >= 2 and m == "GET":
                    page, nxt = hub.api_tree(repo_id, rest[1], "/".join(rest[2:]), tok, self._query)
                    headers = {}
                    if nxt:
                        base = f"{hub.url}/api/models/{repo_id}/tree/{quote(rest[1], safe='')}"
                        if rest[2:]:
                            base += "/" + quote("/".join(rest[2:]))
                        headers["Link"] = f'<{base}?{nxt}>; rel="next"'
                    return self._send_json(page, headers=headers)
                if rest == ["refs"] and m == "GET":
                    return self._send_json(hub.api_refs(repo_id, tok))
            if rest[:1] == ["paths-info"] and len(rest) == 2 and m == "POST":
                raw = self._read_body()
                ctype = self.headers.get("Content-Type", "")
                form = json.loads(raw) if "json" in ctype else parse_qs(raw.decode())
                if isinstance(form.get("paths"), str):
                    form["paths"] = [form["paths"]]
                with hub.lock:
                    return self._send_json(hub.api_paths_info(repo_id, rest[1], tok, form))
            if rest[:1] == ["branch"] and len(rest) == 2 and m == "POST":
                body = self._json_body()
                with hub.lock:
                    return self._send_json(hub.api_create_branch(repo_id, rest[1], body, tok))
            if rest[:1] == ["preupload"] and len(rest) == 2 and m == "POST":
                body = self._json_body()
                with hub.lock:
                    return self._send_json(hub.api_preupload(repo_id, rest[1], body, tok))
            if rest[:1] == ["commit"] and len(rest) == 2 and m == "POST":
                raw = self._read_body()
                self._rec.bytes_in = len(raw)
                with hub.lock:
                    return self._send_json(hub.api_commit(repo_id, rest[1], raw, tok, self._query))
        raise HttpError(404, f"no API route for {m} /api/{'/'.join(s)}")

    def _resolve(self, repo_id: str, rev: str, path: str, tok: str | None) -> None:
        hub = self.hub
        with hub.lock:
            repo = hub._repo_for_read(repo_id, tok)
            commit_id = hub._resolve_rev(repo, rev)
            entry = repo.commits[commit_id].files.get(path)
            if entry is None:
                raise HttpError(404, f"Entry not found: {path}", "EntryNotFound", {"X-Repo-Commit": commit_id})
            data = None if entry.lfs_sha256 else hub.blobs[entry.blob_id]
            if self.command == "GET":
                hub.download_log.append((repo_id, path))
        headers = {"X-Repo-Commit": commit_id, "ETag": f'"{entry.blob_id}"'}
        if entry.lfs_sha256:
            oid = entry.lfs_sha256
            headers.update(
                {
                    "Location": f"{hub.cdn_url}/download/{oid}?repo={quote(repo_id, safe='')}&path={quote(path, safe='')}"
                    f"&sig={hub._sign('dl/' + oid)}",
                    "X-Linked-Etag": f'"{oid}"',
                    "X-Linked-Size": str(entry.size),
                }
            )
            return self._send(302, b"", headers, "text/plain")
        assert data is not None
        self._serve_bytes(data, headers)


class _CdnHandler(_Base):
    def route(self) -> None:
        s, m, hub = self._segments, self.command, self.hub
        if s[:1] == ["upload"] and m == "PUT":
            if len(s) == 2:
                return self._put_object(s[1])
            if len(s) == 4 and s[2] == "part":
                return self._put_part(s[1], int(s[3]))
        if s[:1] == ["download"] and len(s) == 2 and m in ("GET", "HEAD"):
            oid = s[1]
            hub._check_sig("dl/" + oid, self._query)
            with hub.lock:
                data = hub.lfs_objects.get(oid)
                if data is not None and m == "GET":
                    hub.download_log.append((self._query.get("repo", [""])[0], self._query.get("path", [oid])[0]))
            if data is None:
                raise HttpError(404, "NoSuchKey")
            return self._serve_bytes(data, {"ETag": f'"{oid}"'})
        raise HttpError(404, f"no CDN route for {m} {self.path}")

    def _put_object(self, oid: str) -> None:
        hub = self.hub
        hub._check_sig(oid, self._query)
        with hub.lock:
            n = next(hub._puts)
        total = int(self.headers.get("Content-Length") or 0)
        if hub.stall_lfs_put == n:
            got = self._read_body(limit=max(total // 2, 1))
            self._rec.bytes_in = len(got)
            with hub.lock:
                hub.lfs_put_log.append((oid, 0))
            for _ in range(200):  # let an earlier PUT finish first, so the cut leaves one object complete
                with hub.lock:
                    if any(st == 200 for _, st in hub.lfs_put_log):
                        break
                hub.release.wait(timeout=0.05)
            hub.stalled.set()
            hub.release.wait(timeout=60)
            self.close_connection = True  # the client is gone: drop the half-received object
            return
        data = self._read_body()
        self._rec.bytes_in = len(data)
        if hub.fail_lfs_puts_from is not None and n >= hub.fail_lfs_puts_from:
            with hub.lock:
                hub.lfs_put_log.append((oid, 507))
            raise HttpError(507, "Insufficient Storage (simulated outage of the LFS storage)")
        if hashlib.sha256(data).hexdigest() != oid:
            with hub.lock:
                hub.lfs_put_log.append((oid, 400))
            raise HttpError(400, "content does not match the sha256 oid")
        with hub.lock:
            hub.lfs_objects[oid] = data
            hub.lfs_put_log.append((oid, 200))
        self._send(200, b"", {"ETag": f'"{hashlib.md5(data).hexdigest()}"'}, "text/plain")

    def _put_part(self, oid: str, k: int) -> None:
        hub = self.hub
        hub._check_sig(f"{oid}/{k}", self._query)
        data = self._read_body()
        self._rec.bytes_in = len(data)
        with hub.lock:
            hub._parts.setdefault(oid, {})[k] = data
            hub.lfs_put_log.append((f"{oid}#part{k}", 200))
        self._send(200, b"", {"ETag": hashlib.md5(data).hexdigest()}, "text/plain")
