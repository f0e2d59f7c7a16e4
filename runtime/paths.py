"""Every path a checkpoint names, resolved inside its folder: the one resolver of the project.

A model folder names files in several places: the index's ``weight_map`` (shard per tensor), the fixed names
(config.json, the index, generation_config.json, README.md), the files found by ``*.safetensors``, and, in an output
folder, the manifest's and the resume journal's entries. A checkpoint handed over by someone else may name anything
there, so each of them is resolved here before it is opened, deleted or trusted:

    paths = CheckpointPaths(folder)
    shard = paths.resolve(weight_map[name], named_by=folder / INDEX_NAME, tensor=name, what="weight_map")

A name is refused (:class:`~runtime.errors.CheckpointError`, one line naming the file that gave the name, or the
file itself, and what to do) when it is not a string, empty, absolute, has a ``..``, ``.`` or empty component, a
backslash, a NUL, is not valid UTF-8 (a lone surrogate, as ``json`` and ``os.listdir`` produce for undecodable
bytes), has a component over 255 bytes or is over 4096 bytes in all; and when the path, its symlinks resolved by the
kernel (``os.path.realpath``), leaves the folder. The one place a link may lead is a Hugging Face cache snapshot's own
repo folder: ``.../models--o--n/snapshots/<rev>/x`` links into ``.../models--o--n/blobs/``.

The check is made on the path as it is at the time of the call: a folder another process rewrites while it is read
is not what this guards against (nor can a check before ``open`` be); a folder someone handed over is.
"""

from __future__ import annotations

import os
from pathlib import Path

from .errors import CheckpointError

# Linux's NAME_MAX and PATH_MAX: no file system takes longer names, so a longer one is no real file's name, only work.
MAX_NAME_BYTES = 255
MAX_PATH_BYTES = 4096
_HUB_REPO_PREFIXES = ("models--", "datasets--", "spaces--")
_JSON_KINDS = {int: "a number", float: "a number", bool: "true or false", list: "a list", dict: "an object"}
_JSON_KINDS[type(None)] = "null"


def name_problem(name: object, *, subfolders: bool = True) -> str | None:
    """Why ``name`` cannot be a file of a model folder (a phrase that follows "which"), or None when it can.

    Args:
        name: a path relative to the folder, as a checkpoint's file gives it (any JSON value).
        subfolders: whether ``a/b`` is allowed; False for names that must be files of the folder itself.
    """
    if not isinstance(name, str):
        kind = _JSON_KINDS.get(type(name), type(name).__name__)
        return f"is not a file name but {kind}"
    if not name:
        return "is empty, not a file name"
    if "\0" in name:
        return "holds a NUL character (no file name has one)"
    try:
        encoded = name.encode("utf-8")
    except UnicodeEncodeError:
        return "is not valid UTF-8 (a checkpoint's file names are UTF-8 text)"
    if len(encoded) > MAX_PATH_BYTES:
        return f"is {len(encoded)} bytes long, over the {MAX_PATH_BYTES} bytes a path may have"
    if name.startswith("/"):
        return "is an absolute path, outside the model folder (a checkpoint names its files relative to its folder)"
    if "\\" in name:
        return "holds a backslash (a checkpoint names its files with '/' only)"
    parts = name.split("/")
    if ".." in parts:
        return "is outside the model folder (a '..' component leaves it)"
    if any(p in ("", ".") for p in parts):
        return "has an empty or '.' component (expected a plain relative path such as model-00001-of-00002.safetensors)"
    if not subfolders and len(parts) > 1:
        return "is in a subfolder (expected a file of the folder itself)"
    longest = max(len(p.encode("utf-8")) for p in parts)
    if longest > MAX_NAME_BYTES:
        return f"has a component of {longest} bytes, over the {MAX_NAME_BYTES} bytes a file name may have"
    return None


class CheckpointPaths:
    """Where the files of one model folder may be read from (and, for an output folder, deleted).

    Args:
        root: the folder (a source checkpoint, a converted one, or OUT_DIR).
    """

    def __init__(self, root: str | os.PathLike):
        self.root = Path(root)
        real = Path(os.path.realpath(self.root))
        self.allowed = [real]
        if real.parent.name == "snapshots" and real.parent.parent.name.startswith(_HUB_REPO_PREFIXES):
            self.allowed.append(real.parent.parent)  # a Hub cache snapshot's links lead into its repo's blobs/

    def outside(self, path: str | os.PathLike) -> Path | None:
        """Where ``path`` resolves (symlinks followed) when that is outside the folder; None when it stays inside."""
        real = Path(os.path.realpath(path))
        if any(real == a or a in real.parents for a in self.allowed):
            return None
        return real

    def problem(self, name: object, *, subfolders: bool = True) -> str | None:
        """Why ``root / name`` may not be read (a phrase following "which"), or None: :func:`name_problem`, then where
        the path leads with its symlinks resolved."""
        why = name_problem(name, subfolders=subfolders)
        if why is not None:
            return why
        real = self.outside(self.root / name)
        if real is not None:
            return f"is a symlink to {str(real)!r}, outside the model folder"
        return None

    def resolve(
        self,
        name: object,
        *,
        named_by: str | os.PathLike | None = None,
        tensor: str | None = None,
        what: str = "the checkpoint",
        subfolders: bool = True,
        links: bool = True,
        advice: str = " (copy the file into the model folder, or convert the folder it belongs to)",
    ) -> Path:
        """``root / name``, once :meth:`problem` finds nothing wrong with it (the path as named, not its target, so a
        Hub cache snapshot's files keep their names).

        Args:
            name: the relative path (str) a checkpoint's file gives, or a fixed name such as ``config.json``.
            named_by: the file that gives the name (the index, the manifest, the journal); None for a fixed name or a
                name found by listing the folder.
            tensor: the tensor whose entry gives the name, for the message about the name.
            what: who names it, for the message ("weight_map", "the manifest").
            subfolders: whether ``a/b`` is allowed.
            links: also check where the path leads (False: the name alone, for a caller that first says the file is
                missing, and checks the links before it opens it).
            advice: what to do about a symlink leading outside, appended to its refusal (the caller's own where it
                knows better: a journal is not copied into a folder).
        Returns:
            ``root / name``.
        Raises:
            CheckpointError: one line naming ``named_by`` (else the path) and what to do.
        """
        why = name_problem(name, subfolders=subfolders)
        if why is not None:
            raise CheckpointError(
                f"{what} names {_quoted(name)}, which {why}: refusing to read it (fix the entry, or convert the folder "
                "that holds the file)",
                file=named_by if named_by is not None else self.root,
                tensor=tensor,
            )
        path = self.root / name  # type: ignore[operator]
        real = self.outside(path) if links else None
        if real is not None:
            raise CheckpointError(
                f"is a symlink to {str(real)!r}, outside the model folder: refusing to read it{advice}", file=path
            )
        return path


def _quoted(name: object) -> str:
    """``repr`` of a name, cut in the middle when long, so a refusal of a 5000-byte name stays one readable line."""
    text = repr(name)
    return text if len(text) <= 200 else f"{text[:90]} [... {len(text) - 180} characters cut ...] {text[-90:]}"


__all__ = ["MAX_NAME_BYTES", "MAX_PATH_BYTES", "CheckpointPaths", "name_problem"]
