"""``convert_checkpoint``: plan from headers, prepare the output folder, then execute the plan.

The steps live where their data does: ``plan`` (headers to a plan, no I/O), ``write.out_dir``
(what OUT_DIR holds, its lock, what --resume keeps), ``write.execute`` (shards streamed
through the writer, journalled, renamed into place). docs/reliability.md says what is on
disk at any moment.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

from .errors import ConversionError, DeviceError, FuseSharedError
from .plan import ConversionPlan, ConvertOptions, build_plan
from .source.checkpoint import SourceCheckpoint
from .write.execute import execute
from .files import temporary_tag
from .write.journal import conversion_inputs, fingerprint
from .write.measurements import Measurements
from .write.failures import unexpected_error
from .write.out_dir import (
    OutputLock,
    bytes_still_needed,
    check_free_space,
    check_name_lengths,
    check_out_dir_name,
    check_paths,
    make_out_dir,
    prepare_out_dir,
    remove_if_empty,
    remove_partials,
)
from .write.writer import planned_header


@dataclass
class ConversionResult:
    out_dir: Path
    plan: ConversionPlan
    seconds: float
    files: list[str]
    resumed_shards: int = 0  # shards found complete and kept by --resume
    measurements: Measurements = field(default_factory=Measurements)  # what the format conversions measured


def plan_conversion(model_dir: str | Path, options: ConvertOptions | None = None) -> ConversionPlan:
    """Read headers and config, check them, and plan; nothing is written."""
    return build_plan(SourceCheckpoint.open(model_dir), options)


def convert_checkpoint(
    model_dir: str | Path,
    out_dir: str | Path,
    options: ConvertOptions | None = None,
    *,
    overwrite: bool = False,
    resume: bool = False,
    device: str = "cpu",
    progress: bool = True,
    allow_non_finite: bool = False,
    source_id: str | None = None,
) -> ConversionResult:
    """Convert the checkpoint in ``model_dir`` into the fused-shared layout in ``out_dir``.

    Everything is planned and checked from headers before the first byte is written;
    shards are written under temporary names and journalled as they complete, and
    renamed at the end, config.json last. ``resume=True`` continues an interrupted or
    failed run into the same ``out_dir`` (refused if the inputs or options changed);
    with nothing to resume it is an ordinary run.
    """
    started = time.perf_counter()
    options = options or ConvertOptions()
    check_out_dir_name(out_dir)
    model_dir, out_dir = Path(model_dir), Path(out_dir)
    if resume and overwrite:
        raise ConversionError("--resume continues a conversion and --overwrite starts it over: pass one of them")
    plan = plan_conversion(model_dir, options)
    _check_device(device)
    check_paths(model_dir, out_dir)
    check_name_lengths(plan, out_dir)
    created = False
    try:
        headers = {s.filename: planned_header(s) for s in plan.shards}
        inputs = conversion_inputs(plan, headers, device)
        created = make_out_dir(out_dir)
        with OutputLock(out_dir):
            writing = False
            try:
                journal, kept = prepare_out_dir(out_dir, plan, headers, inputs, overwrite, resume)
                check_free_space(out_dir, bytes_still_needed(plan, headers, journal))
                writing = True
                files, measurements = execute(
                    plan, headers, journal, out_dir, device, progress, allow_non_finite, source_id or str(model_dir)
                )
            except BaseException as e:
                # a run that stopped leaves none of its .partial files; a refusal leaves OUT_DIR as it was
                if writing or isinstance(e, KeyboardInterrupt):
                    remove_partials(out_dir, temporary_tag(fingerprint(inputs)))
                raise
    except BaseException as e:
        if created:
            remove_if_empty(out_dir)
        if isinstance(e, KeyboardInterrupt):
            raise ConversionError("interrupted", file=out_dir) from None
        if isinstance(e, Exception) and not isinstance(e, FuseSharedError):
            raise unexpected_error(e, where=out_dir) from None  # one line naming where, never a bare Python message
        raise
    return ConversionResult(out_dir, plan, time.perf_counter() - started, files, kept, measurements)


def _check_device(device: str) -> None:
    from runtime.devices import check_device

    try:
        check_device(device)
    except DeviceError as e:
        raise ConversionError(f"--device {e.detail}") from None


__all__ = ["ConversionResult", "convert_checkpoint", "plan_conversion"]
