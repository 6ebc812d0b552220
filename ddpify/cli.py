"""The `ddpify` command line: `convert` here, `check`/`rules`/`rule` from ddpify.check."""

from __future__ import annotations

import dataclasses
import difflib
import os
import sys
import traceback
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

import typer

from ddpify.check.cli import register as register_check

if TYPE_CHECKING:  # the engine loads when a command runs
    from ddpify.launch_files import LaunchPlan
    from ddpify.results import ConvertResult

# The engine (libcst, the analysis, the passes) is imported by the command that needs it, so
# `ddpify --help` starts in about the time of `import typer`.

class Device(str, Enum):
    auto = "auto"
    cpu = "cpu"


class Format(str, Enum):
    text = "text"
    json = "json"


class Target(str, Enum):
    ddp = "ddp"
    fsdp2 = "fsdp2"


TO_HELP = "ddp (DistributedDataParallel), or fsdp2: shard the model over the processes with fully_shard."
SHARD_HELP = "fsdp2: the class of the blocks that become their own units (when the choice is ambiguous)."


class Launcher(str, Enum):
    torchrun = "torchrun"
    spawn = "spawn"


class LaunchWith(str, Enum):
    slurm = "slurm"
    torchrun = "torchrun"


class PlainHelp(typer.core.TyperCommand):
    """Help as black and ruff print it: `SRC`, not `{SRC}`; a metavar instead of a type label
    (`-o FILE`, not `<path>`); no `[x>=1]`."""

    def collect_usage_pieces(self, ctx: Any) -> list[str]:
        pieces = [self.options_metavar] if self.options_metavar else []
        for param in self.get_params(ctx):
            if param.param_type_name == "argument":
                name = _metavar(param)
                pieces.append((name if param.required else f"[{name}]") + ("..." if param.nargs != 1 else ""))
        return pieces

    def format_options(self, ctx: Any, formatter: Any) -> None:
        params = [p for p in self.get_params(ctx) if not getattr(p, "hidden", False)]
        arguments = [(_metavar(p), p.help or "") for p in params if p.param_type_name == "argument"]
        options = [_option_row(p) for p in params if p.param_type_name == "option"]
        for title, rows in (("Arguments", arguments), ("Options", options)):
            if rows:
                with formatter.section(title):
                    formatter.write_dl(rows)


def _metavar(param: Any) -> str:
    if param.metavar:
        return param.metavar
    choices = getattr(getattr(param, "type_descriptor", None), "choices", None)  # typer's own types
    choices = choices or getattr(param.type, "choices", None)  # click's Choice (typer before 0.29)
    if choices:
        return "[" + "|".join(str(getattr(c, "value", c)) for c in choices) + "]"
    return (param.name or "value").upper()


def _option_row(option: Any) -> tuple[str, str]:
    names = ", ".join(sorted(option.opts, key=len))
    if option.secondary_opts:
        names += " / " + ", ".join(option.secondary_opts)
    if not option.is_flag:
        names += " " + _metavar(option)
    default = getattr(option.default, "value", option.default)
    extra = f"  [default: {default}]" if option.show_default and default not in (None, False, "", ()) else ""
    return names, (option.help or "") + extra


app = typer.Typer(
    name="ddpify",
    rich_markup_mode=None,
    help="Turn single-GPU PyTorch training scripts into DDP scripts, and lint DDP pitfalls.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)


def _version(value: bool) -> None:
    if value:
        from ddpify import __version__

        typer.echo(f"ddpify {__version__}")  # the code that runs, installed or not
        raise typer.Exit()


@app.callback()
def _main(
    show_version: bool = typer.Option(
        False, "--version", callback=_version, is_eager=True, help="Print the version and exit."
    ),
    verbose: bool = typer.Option(False, "--verbose", help="Show the traceback of an internal error."),
) -> None:
    """Turn single-GPU PyTorch training scripts into DDP scripts, and lint DDP pitfalls."""


def _fail(message: str, code: int = 1) -> None:
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(code)


def _write(target: Path, data: bytes) -> None:
    """An atomic write, or one line naming the target and why it failed (exit 1)."""
    from ddpify.files import write_atomic

    try:
        write_atomic(target, data)
    except OSError as exc:
        _fail(f"{target}: {exc.strerror or exc}")


def _stdout(data: bytes) -> None:
    """The script to stdout in its own encoding (a latin-1 file stays latin-1 under its cookie)."""
    sys.stdout.flush()
    sys.stdout.buffer.write(data)
    sys.stdout.buffer.flush()


@app.command()
def convert(
    srcs: list[Path] = typer.Argument(
        ..., metavar="SRC", show_default=False,
        help="The single-GPU training script; several are each converted in this one process (with --in-place, --diff, or -o DIR/).",
    ),
    output_arg: Optional[str] = typer.Option(
        None, "-o", "--output", metavar="PATH", help="Write the DDP script here (DIR/: a converted copy of the project)."
    ),
    in_place: bool = typer.Option(False, "--in-place", help="Overwrite SRC with the DDP script."),
    diff: bool = typer.Option(False, "--diff", help="Print a unified diff instead; exit 1 if it is not empty."),
    check: bool = typer.Option(
        False, "--check", help="Write nothing: exit 1 with a diff when OUTPUT is not what converting SRC gives now."
    ),
    strict: bool = typer.Option(False, "--strict", help="Exit 1 when the conversion left TODOs."),
    sync_batchnorm: bool = typer.Option(
        False, "--sync-batchnorm", help="Convert BatchNorm layers to SyncBatchNorm before wrapping."
    ),
    global_batch: bool = typer.Option(
        False, "--global-batch", help="Treat the script's batch size as global: divide it by the world size."
    ),
    launcher: Launcher = typer.Option(
        Launcher.torchrun, "--launcher", help="torchrun, or spawn: also start processes with mp.spawn without torchrun."
    ),
    eval_on_rank0: bool = typer.Option(
        False, "--eval-on-rank0", help="Evaluate on rank 0 through model.module instead of on every rank."
    ),
    launch: Optional[LaunchWith] = typer.Option(
        None, "--launch", help="Also write a Slurm batch file beside -o, or print multi-node torchrun commands."
    ),
    nodes: Optional[int] = typer.Option(None, "--nodes", min=1, metavar="N", help="Nodes for --launch (default 2)."),
    nproc_per_node: Optional[int] = typer.Option(
        None, "--nproc-per-node", min=1, metavar="N", help="Processes (GPUs) per node for --launch (default 8)."
    ),
    shared_fs: bool = typer.Option(
        False, "--shared-fs", help="Every node sees the same files: download data once per job, not once per node."
    ),
    to: Target = typer.Option(Target.ddp, "--to", help=TO_HELP),
    shard: Optional[str] = typer.Option(None, "--shard", metavar="CLASS", help=SHARD_HELP),
    sharded_checkpoints: bool = typer.Option(
        False, "--sharded-checkpoints", help="fsdp2: save torch.distributed.checkpoint folders (each rank its shard)."
    ),
    run: bool = typer.Option(
        False, "--run", help="Run the original briefly first and convert from what it did; then verify the result."
    ),
    steps: int = typer.Option(4, "--steps", min=1, metavar="K", help="--run: optimizer steps per epoch of each run."),
    timeout: float = typer.Option(120.0, "--timeout", min=1, metavar="SECONDS", help="--run: seconds each run may take."),
    device: Device = typer.Option(Device.auto, "--device", help="--run: auto (GPUs with NCCL when there are enough) or cpu."),
    python: Optional[str] = typer.Option(None, "--python", help="--run: the Python with torch that runs the scripts."),
) -> None:
    """Convert SRC (each SRC) into a script that trains with DistributedDataParallel under torchrun.

    Without -o, --in-place or --diff the converted script goes to stdout. Arguments after `--`
    go to the script in the launch commands: ddpify convert train.py -o out.py --launch slurm -- --epochs 10.
    With --run they also go to the script in its runs: ddpify convert train.py -o out.py --run -- --epochs 1

    Several scripts, in one process: ddpify convert a.py b.py -o converted/ (or --in-place, --diff; --check with -o DIR/).
    """
    options = dict(locals())
    del options["srcs"]
    if len(srcs) == 1:
        _convert_one(srcs[0], **options)
        return
    if run:
        _fail("--run converts one script at a time", 2)
    if output_arg is not None and not output_arg.endswith(("/", os.sep)):
        _fail("several scripts go to a folder (-o DIR/), --in-place or --diff", 2)
    if output_arg is None and not (in_place or diff):
        _fail("several scripts: pass -o DIR/, --in-place or --diff", 2)
    names = [src.name for src in srcs]
    if output_arg is not None and len(set(names)) < len(names):
        _fail(f"two scripts named {next(n for n in names if names.count(n) > 1)} would write one file in {output_arg}", 2)
    if output_arg is not None and not check:
        try:
            Path(output_arg).mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            _fail(f"{output_arg}: {exc.strerror or exc}")
    worst = 0
    for src in srcs:  # one process: the pipeline is imported once
        if output_arg is not None:
            options["output_arg"] = os.path.join(output_arg, src.name)
        try:
            _convert_one(src, **options)
        except typer.Exit as exc:
            worst = max(worst, exc.exit_code)
    if worst:
        raise typer.Exit(worst)


def _convert_one(
    src: Path, output_arg, in_place, diff, check, strict, sync_batchnorm, global_batch, launcher, eval_on_rank0, launch,
    nodes, nproc_per_node, shared_fs, to, shard, sharded_checkpoints, run, steps, timeout, device, python,
) -> None:
    """One script: what `ddpify convert SRC` does."""
    output = Path(output_arg) if output_arg else None
    # `-o out/` is a folder (pathlib drops the slash), also when only the entry changes
    folder = output is not None and output_arg.endswith(("/", os.sep))
    if sum(bool(x) for x in (output, in_place, diff)) > 1:
        _fail("use only one of -o/--output, --in-place and --diff", 2)
    if check and output is None:
        _fail("--check compares the converted script with -o OUTPUT; pass -o", 2)
    if output is not None and src.exists() and output.exists() and os.path.samefile(output, src):
        _fail(f"{src}: refusing to overwrite the input ({output} is the same file); pass --in-place to do that", 2)
    plan = dataclasses.replace(_launch_plan(launch, nodes, nproc_per_node, output, in_place, diff), shared_fs=shared_fs)
    from ddpify.engine import ConvertError, ConvertOptions, convert_file
    from ddpify.projects import is_project

    options = ConvertOptions(sync_batchnorm=sync_batchnorm, global_batch=global_batch, eval_on_rank0=eval_on_rank0,
                             launcher=launcher.value, shared_fs=shared_fs, target=to.value, shard=shard,
                             sharded_checkpoints=sharded_checkpoints)  # fmt: skip
    proof = None
    if run:
        if check:
            _fail("--run proves a new conversion; --check compares one already written: use one of them", 2)
        options, proof = _run_and_prove(src, options, steps, timeout, device, python)
    try:
        if folder or is_project(src):
            _convert_project(src, options, output, in_place, diff, strict, global_batch, launcher, check, plan=plan,
                             folder=folder, proof=proof)  # fmt: skip
            return
        result, encoding = convert_file(src, options)
    except ConvertError as exc:
        location = f"{exc.path}:{exc.line}" if exc.line else exc.path
        _fail(f"{location}: {exc.message}")
        return
    if proof is not None:
        result.code = _proof_header(proof) + result.code
    launch_files = _launch_files(plan, src, output or (src if in_place else None))
    if check:
        expected = src.read_bytes() if result.already_distributed else result.code.encode(encoding)
        _up_to_date({output: expected, **launch_files}, encoding)
    if result.already_distributed:
        note = result.changes[0]
        if output is not None:  # an identical copy, as black leaves a file it does not change
            _write(output, src.read_bytes())
        elif not (in_place or diff):
            _stdout(src.read_bytes())  # unchanged, so `ddpify convert x.py > y.py` still gives a script
        typer.echo(f"{src}:{note.line}: already distributed; nothing to convert", err=True)
        for name, line, what in result.pending:  # what a conversion would still add: the user decides
            typer.echo(f"{src}:{line}: note: not converted: {what} ({name})", err=True)
        if plan.kind:  # the script runs as it is: how to launch it still helps
            _write_all(launch_files)
            typer.echo("\n".join(plan.summary(str(output or (src if in_place else "OUT.py")))), err=True)
        return
    source = src.read_bytes().decode(encoding)
    if diff:
        lines = difflib.unified_diff(
            source.splitlines(keepends=True), result.code.splitlines(keepends=True), f"a/{src}", f"b/{src}"
        )
        sys.stdout.write("".join(lines))
        raise typer.Exit(1 if result.code != source else 0)
    target = src if in_place else output
    if target is None:
        _stdout(result.code.encode(encoding))
        _summary(src, None, result, global_batch, launcher, err=True, plan=plan)
    else:
        _write(target, result.code.encode(encoding))
        _write_all(launch_files)
        _summary(src, target, result, global_batch, launcher, err=False, plan=plan)
    _show_proof(proof, options, err=target is None)
    if strict and result.todos:
        raise typer.Exit(1)


def _run_and_prove(src: Path, options, steps: int, timeout: float, device: Device, python: Optional[str]):
    """`--run`: run the original briefly as one process (exit 2 when it fails on its own, before
    anything is written), convert from the facts of that run, and verify that conversion.
    Returns the options with the facts, and the verification."""
    from ddpify.verify.session import VerifyError, VerifyOptions, observe, verify as run_verify

    verify_options = VerifyOptions(steps=steps, timeout=timeout, device=device.value, python=python or sys.executable,
                                   args=list(_SCRIPT_ARGS))  # fmt: skip
    try:
        observation = observe(src, verify_options)
    except VerifyError as exc:
        _fail(str(exc), 2)
    options = dataclasses.replace(options, run=observation.facts())
    try:
        proof = run_verify(src, None, dataclasses.replace(verify_options, convert_options=options), observation)
    except VerifyError as exc:
        observation.discard(verify_options)
        _fail(str(exc), 1 if exc.refused else 2)
    return options, proof


def _proof_header(proof) -> str:
    """The converted script's first line when it failed verification: what failed, and how to see it."""
    if not proof.failures:
        return ""
    first = proof.failures[0]
    return (f"# ddpify: this conversion FAILED verification: {first.number} {first.title}: {first.summary} "
            "(`ddpify verify` on the original shows the runs)\n")  # fmt: skip


def _show_proof(proof, options, err: bool) -> None:
    """`--run`: the facts the run gave, verify's table, and exit 1 when an invariant failed."""
    if proof is None:
        return
    from ddpify.verify import report

    facts = options.run.summary()
    typer.echo("\n".join(["Facts from the run:", *[f"  {line}" for line in facts], "", report.text(proof)]), err=err)
    if proof.failures:
        first = proof.failures[0]
        typer.echo(f"error: the conversion failed verification: {first.number} {first.title}: {first.summary}", err=True)
        raise typer.Exit(1)


def _launch_plan(launch, nodes, nproc_per_node, output, in_place, diff) -> LaunchPlan:
    """`--launch`, `--nodes`, `--nproc-per-node` and `-- ARGS`, or one line on a usage error (exit 2)."""
    from ddpify.launch_files import LaunchPlan

    if launch is None:
        if nodes is not None or nproc_per_node is not None:
            _fail("--nodes and --nproc-per-node go with --launch slurm|torchrun", 2)
        return LaunchPlan(args=tuple(_SCRIPT_ARGS))
    if launch == LaunchWith.slurm and output is None and not in_place:
        _fail("--launch slurm needs -o OUT.py", 2)
    if diff:
        _fail("--launch torchrun prints its commands in the summary, which --diff does not print", 2)
    return LaunchPlan(launch.value, nodes or 2, nproc_per_node or 8, tuple(_SCRIPT_ARGS))


def _launch_files(plan: LaunchPlan, src: Path, script: Optional[Path]) -> dict[Path, bytes]:
    """The files `--launch` writes beside the converted `script` (the Slurm batch file), by
    path; one line (exit 2) when one would overwrite the input or the script."""
    if plan.kind != "slurm" or script is None:
        return {}
    sbatch = plan.sbatch_path(script)
    if sbatch == script:
        _fail(f"{script}: the Slurm batch file would be the script itself; name the script -o NAME.py", 2)
    if sbatch.exists() and src.exists() and os.path.samefile(sbatch, src):
        _fail(f"{src}: refusing to overwrite the input with the Slurm batch file {sbatch}", 2)
    return {sbatch: plan.sbatch(str(script)).encode("utf-8")}


def _write_all(files: dict[Path, bytes]) -> None:
    for target, data in files.items():
        _write(target, data)


def _up_to_date(expected: dict[Path, bytes], encoding: str) -> None:
    """`--check`: a diff for each file that is not what the conversion gives now, then exit 1;
    exit 0 when every one is."""
    stale = []
    for target, data in expected.items():
        current = target.read_bytes() if target.is_file() else b""
        if current != data:
            stale.append(target)
            sys.stdout.write("".join(difflib.unified_diff(
                current.decode(encoding, "replace").splitlines(keepends=True),
                data.decode(encoding).splitlines(keepends=True), str(target), str(target),
            )))  # fmt: skip
    for target in stale:
        typer.echo(f"would rewrite {target}" if target.exists() else f"would write {target}: it does not exist", err=True)
    if not stale:
        typer.echo(f"{', '.join(map(str, expected))}: up to date", err=True)
    raise typer.Exit(1 if stale else 0)


def _convert_project(src, options, output, in_place, diff, strict, global_batch, launcher, check=False, plan=None,
                     folder=False, proof=None) -> None:  # fmt: skip
    """The entry and the project modules it imports: one diff, a copy of the project in a
    folder (`folder`: the user named one, `-o out/`), or the changed modules rewritten in place."""
    from ddpify.launch_files import LaunchPlan
    from ddpify.projects import convert_project, copy_project, reads_left_out

    plan = plan or LaunchPlan()
    result = convert_project(src, options)
    project, changed = result.project, result.changed
    if proof is not None and project.entry in changed:
        changed[project.entry][0].code = _proof_header(proof) + changed[project.entry][0].code
    if result.already_distributed:  # left alone (a -o DIR/ copy is the project as it is)
        typer.echo(f"{src}: already distributed; nothing to convert", err=True)
    entry = project.entry
    shown = {path: _shown(path, src, entry) for path in changed}
    if diff:
        for path, (converted, source, _) in changed.items():
            name = shown[path]
            sys.stdout.write("".join(difflib.unified_diff(
                source.splitlines(keepends=True), converted.code.splitlines(keepends=True), f"a/{name}", f"b/{name}"
            )))  # fmt: skip
        raise typer.Exit(1 if changed else 0)
    others = [shown[p] for p in changed if p != entry]
    directory = output is not None and (folder or output.is_dir() or not output.suffix)
    if check and changed and (directory or not others):  # the files the conversion writes, as they would be
        where = {path: output / path.relative_to(project.root) for path in changed} if directory else {entry: output}
        expected = {where[p]: c.code.encode(e) for p, (c, _, e) in changed.items() if p in where}
        _up_to_date({**expected, **_launch_files(plan, src, where.get(entry))}, "utf-8")
    if not others and not in_place and not directory:  # only the entry changes: one file, as for a script
        if entry not in changed and result.already_distributed:
            if output is not None:  # an identical copy, as for a script distributed already
                _write(output, entry.read_bytes())
            elif not diff:
                _stdout(entry.read_bytes())
            return
        if entry not in changed:
            typer.echo(f"{src}: nothing to convert, nothing written", err=True)
            return
        converted, _, encoding = changed[entry]
        launch_files = _launch_files(plan, src, output)
        if output is None:
            _stdout(converted.code.encode(encoding))
        else:
            _write(output, converted.code.encode(encoding))
            _write_all(launch_files)
        _summary(src, output, converted, global_batch, launcher, err=output is None, plan=plan)
        _show_proof(proof, options, err=output is None)
        if strict and converted.todos:
            raise typer.Exit(1)
        return
    if not in_place and not directory:
        where = f"-o {output}" if output is not None else "stdout"
        _fail(
            f"{src}: converting it changes other modules of its project too ({', '.join(others)}): {where} holds one "
            f"file; pass -o DIR/ for a converted copy of the project, or --in-place",
            2,
        )
    entry_target = (src if in_place else output / entry.relative_to(project.root)) if entry in changed else None
    if not in_place and plan.kind == "slurm":  # the copy imports its own modules from its root
        plan = dataclasses.replace(plan, pythonpath=str(output))
    launch_files = _launch_files(plan, src, entry_target)
    if in_place:
        for path, (converted, _, encoding) in changed.items():
            _write(path, converted.code.encode(encoding))
        targets = {path: shown[path] for path in changed}
    else:
        if output.resolve() == project.root:
            _fail(f"{output}: is the project itself; pass --in-place to rewrite it", 2)
        left_out = copy_project(project, output, {path: c.code for path, (c, _, _) in changed.items()})
        targets = {path: str(output / path.relative_to(project.root)) for path in changed}
        if left_out:
            shown_out = [f"{p} (all but its Python modules)" if (output / p).is_dir() else str(p) for p in left_out]
            typer.echo(f"Not copied into {output} (data, caches, environments): {', '.join(shown_out)}")
        for path, where, line in reads_left_out(project, left_out):
            typer.echo(f"  {_shown(where, src, entry)}:{line} reads {path}/ relative to where it runs: copy or link it into {output}")
    _write_all(launch_files)
    if not changed:
        copied = "" if in_place else f"; {output} holds an unchanged copy of its project"
        typer.echo(f"{src}: nothing to convert{copied}", err=True)
    for path, (converted, _, _) in changed.items():
        if path != entry:
            _summary(Path(shown[path]), Path(targets[path]), converted, global_batch, launcher, err=False, launch=False)
    if entry in changed:
        _summary(Path(shown[entry]), Path(targets[entry]), changed[entry][0], global_batch, launcher, err=False, plan=plan)
    _show_proof(proof, options, err=False)
    if strict and any(c.todos for c, _, _ in changed.values()):
        raise typer.Exit(1)


def _shown(path: Path, src: Path, entry: Path) -> str:
    """A project file as the user would name it: relative to the folder they ran in, if under it."""
    if path == entry:
        return str(src)
    try:
        return str(path.relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)


def _summary(
    src: Path, target: Optional[Path], result: ConvertResult, global_batch: bool, launcher: Launcher, err: bool,
    launch: bool = True, plan: Optional[LaunchPlan] = None,
) -> None:
    """What changed (with lines), what is left to the user, and how to launch."""
    out = target or "<stdout>"
    lines = [f"{src} -> {out}: {len(result.changes)} change(s), {len(result.todos)} TODO(s)"]
    lines += [f"  {src}:{n.line}: {n.message}" for n in result.changes]
    lines += [f"  {out if n.in_output else src}:{n.line}: TODO(ddpify): {n.message}" for n in result.todos]
    lines += [f"  {src}:{n.line}: note: {n.message}" for n in result.notes]
    if not launch:
        typer.echo("\n".join(lines), err=err)
        return
    if not result.per_process_batches:
        pass  # every process trains on all of the data, or on what the TODOs leave to the user
    elif global_batch:
        lines.append("The script's batch size is the global batch: each process takes batch_size / processes.")
    else:
        lines += [
            "Each process keeps the script's batch size: the global batch is batch_size x processes;",
            "  scale the learning rate if you want the single-GPU schedule (e.g. linearly).",
        ]
    from ddpify.launch_files import LaunchPlan, shell_join

    out = target or "OUT.py"
    plan = plan or LaunchPlan()
    args = shell_join(list(plan.args)) if plan.args else "[script args]"
    launch_lines = plan.summary(str(out)) if plan.kind else []
    if plan.kind != "torchrun":  # --launch torchrun prints this one with the process count
        launch_lines.insert(0, f"Launch: torchrun --nproc-per-node=N {out} {args}")
    lines.append(launch_lines[0])
    if launcher == Launcher.spawn:
        lines.append(f"    or: python {out} {args}  (one process per GPU; NPROC_PER_NODE=N on CPU)")
    lines += launch_lines[1:]
    typer.echo("\n".join(lines), err=err)


_SCRIPT_ARGS: list[str] = []  # what follows `--` on a `ddpify verify` or `ddpify convert` command line


@app.command()
def verify(
    original: Path = typer.Argument(..., help="The single-GPU training script.", show_default=False),
    converted: Optional[Path] = typer.Argument(
        None, help="A DDP version to check (default: convert ORIGINAL in memory).", show_default=False
    ),
    nproc: int = typer.Option(2, "--nproc", min=1, metavar="N", help="Processes under torchrun."),
    steps: int = typer.Option(4, "--steps", min=1, metavar="K", help="Optimizer steps per epoch before a run moves on."),
    timeout: float = typer.Option(120.0, "--timeout", min=1, metavar="SECONDS", help="Seconds each run may take; then it counts as hung."),
    device: Device = typer.Option(Device.auto, "--device", help="auto: GPUs with NCCL when there are enough; cpu: gloo."),
    output_format: Format = typer.Option(Format.text, "--format", help="text or json."),
    python: Optional[str] = typer.Option(None, "--python", help="The Python with torch that runs the scripts."),
    keep: Optional[Path] = typer.Option(None, "--keep", metavar="DIR", help="Keep the runs' folders and traces in this folder."),
    sync_batchnorm: bool = typer.Option(False, "--sync-batchnorm", help="Convert as `convert --sync-batchnorm` would."),
    global_batch: bool = typer.Option(False, "--global-batch", help="Convert as `convert --global-batch` would."),
    eval_on_rank0: bool = typer.Option(False, "--eval-on-rank0", help="Convert as `convert --eval-on-rank0` would."),
    launcher: Launcher = typer.Option(Launcher.torchrun, "--launcher", help="Convert as `convert --launcher` would."),
    to: Target = typer.Option(Target.ddp, "--to", help="Convert as `convert --to` would."),
    shard: Optional[str] = typer.Option(None, "--shard", metavar="CLASS", help="Convert as `convert --shard` would."),
) -> None:
    """Run the DDP version of ORIGINAL briefly under torchrun, and the original as one process,
    and report which DDP invariants hold: exit 0 all hold, 1 one fails, 2 verification could not run.

    Arguments after `--` go to the script: ddpify verify train.py -- --epochs 1
    """
    from ddpify.results import ConvertOptions
    from ddpify.verify import report
    from ddpify.verify.session import VerifyError, VerifyOptions, verify as run_verify

    options = VerifyOptions(
        nproc=nproc, steps=steps, timeout=timeout, device=device.value, python=python or sys.executable,
        args=list(_SCRIPT_ARGS), keep=keep,
        convert_options=ConvertOptions(sync_batchnorm=sync_batchnorm, global_batch=global_batch,
                                       eval_on_rank0=eval_on_rank0, launcher=launcher.value, target=to.value,
                                       shard=shard),
    )  # fmt: skip
    try:
        result = run_verify(original, converted, options)
    except VerifyError as exc:
        _fail(str(exc), 2)
        return
    typer.echo(report.as_json(result) if output_format == Format.json else report.text(result))
    raise typer.Exit(result.exit_code)


def main(argv: Optional[list[str]] = None) -> None:
    """The `ddpify` entry point: `ddpify verify|convert ... -- ARGS` hands ARGS to the script untouched;
    an internal error is one line (the traceback with --verbose, anywhere before `--`)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    _SCRIPT_ARGS.clear()  # a second call in one process (the tests) starts afresh
    if argv[:1] in (["verify"], ["convert"]) and "--" in argv:
        at = argv.index("--")
        _SCRIPT_ARGS[:] = argv[at + 1 :]
        argv = argv[:at]
    verbose = "--verbose" in argv
    argv = [a for a in argv if a != "--verbose"]
    try:
        app(args=argv, prog_name="ddpify")
    except Exception as exc:  # noqa: BLE001 - a bug in ddpify: never a traceback unless asked
        if verbose:
            traceback.print_exc()
        where = "" if verbose else "; run again with --verbose for the traceback"
        typer.echo(f"error: internal error ({type(exc).__name__}: {_first_line(exc)}){where}", err=True)
        typer.echo("This is a bug in ddpify: please report it, with the input.", err=True)
        sys.exit(2)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else "no message"


register_check(app)
for _info in app.registered_commands:
    _info.cls = PlainHelp
