"""An unexpected error met while writing, reported like the converter's own: what, where, what was expected.

The converter refuses bad input at plan time with its own errors; anything else raised while
shards are written (an OSError from a disk or a source file, a KeyError for a dtype nothing
planned for, a bug) reaches the user through :func:`unexpected_error` as one line naming the
source file and tensor being converted, never as ``error: 'U16'``. An OSError is transient
(the disk, the network file system): completed shards are worth keeping for ``--resume``.
Anything else would happen again on a rerun of the same input: :func:`is_transient` tells
``execute`` which advice to give.
"""

from __future__ import annotations

from pathlib import Path

from runtime.safetensors_io import FLOAT_DTYPES, FP8_DTYPE_CODE, TORCH_DTYPES

from ..errors import ConversionError
from ..plan import CastTask, ConstantTask, CopyTask, ProjectionTask

_CONVERTIBLE = "/".join(FLOAT_DTYPES) + f" or {FP8_DTYPE_CODE}"


def _source_of(task) -> tuple[Path | None, str | None, str | None]:
    """(file, tensor name, dtype) of the source tensor a task reads."""
    if isinstance(task, (CopyTask, CastTask)):
        return task.source.file, task.source.name, task.source.dtype
    if isinstance(task, ProjectionTask):
        info = task.source.weight.info
        return info.file, info.name, info.dtype
    return None, None, None


def _expected(task) -> str:
    if isinstance(task, CastTask):
        return f"a float tensor ({'/'.join(FLOAT_DTYPES)}) to cast to {task.out_dtype}"
    if isinstance(task, ProjectionTask):
        return f"a weight in {_CONVERTIBLE} to write as {task.out_dtype}"
    if isinstance(task, CopyTask):
        return f"{task.source.nbytes} readable bytes to copy"
    if isinstance(task, ConstantTask):
        return "a constant tensor"
    return "a tensor the plan describes"


def unexpected_error(
    e: BaseException, task=None, shard: str | None = None, where: Path | None = None
) -> ConversionError:
    """``e`` as a one-line ConversionError naming the source file and tensor of ``task`` (or ``where``)."""
    file, tensor, dtype = _source_of(task)
    target = getattr(getattr(task, "target", None) or getattr(task, "weight", None), "tensor", None)
    if tensor is None:
        tensor = target
    into = f" (writing {shard})" if shard else ""
    if isinstance(e, OSError):
        return ConversionError(
            f"I/O error: {e.strerror or e}{into}; expected a readable source and a writable output folder",
            file=e.filename or file or where,
            tensor=tensor,
        )
    if isinstance(e, KeyError) and dtype is not None and e.args == (dtype,) and dtype not in TORCH_DTYPES:
        return ConversionError(
            f"has dtype {dtype}, which the converter cannot read{into}; expected {_expected(task)}",
            file=file,
            tensor=tensor,
        )
    detail = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
    expected = f"; expected {_expected(task)}" if task is not None else ""
    err = ConversionError(f"unexpected failure ({detail}){into}{expected}", file=file or where, tensor=tensor)
    err.transient = isinstance(e, MemoryError) or type(e).__name__ == "OutOfMemoryError"  # CUDA out of memory
    return err


def is_transient(e: BaseException) -> bool:
    """False for a failure a rerun of the same input meets again (an unreadable dtype, a bug): resuming alone cannot help.
    The converter's own mid-run errors (a full disk, non-finite values, an interrupt) and I/O errors are transient."""
    return getattr(e, "transient", True)


__all__ = ["unexpected_error", "is_transient"]
