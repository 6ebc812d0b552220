"""Time `check` and `convert` as multiples of libcst's bare parse.

    python benchmarks/bench_speed.py [--repeat 5]

File sets: the bundled training scripts (fixtures/corpus/*.py, fixtures/patterns/*.in.py,
examples/*.py) and, when present, the shared corpus of public scripts
(/work/shared/corpus/files/*.py, read only). For each set: libcst's `parse_module`, `check`
(every default rule, one process, `ddpify.check.runner.check_source`) and `convert`
(`ddpify.engine.convert_source` with the case's options; the second, fixed-point conversion
only under DDPIFY_SELF_CHECK=1), best of `--repeat` runs over the whole set. Start-up:
bench_startup.py.

Targets (issue 9): check <= 3x the parse, convert <= 8x.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SHARED = Path("/work/shared/corpus/files")


def bundled() -> list[Path]:
    files = sorted((ROOT / "fixtures" / "corpus").glob("*.py"))
    files += sorted((ROOT / "fixtures" / "patterns").glob("*.in.py"))
    files += sorted((ROOT / "examples").glob("*.py"))
    return files


def shared(folder: Path = SHARED) -> list[Path]:
    """The folder's scripts that libcst parses (a public script may be Python 2)."""
    import libcst

    readable = []
    for path in sorted(folder.glob("*.py")) if folder.is_dir() else []:
        try:
            libcst.parse_module(path.read_text(encoding="utf-8"))
        except Exception:  # noqa: BLE001 - left out of the measure, named below
            print(f"  (left out, libcst cannot parse it: {path.name})")
            continue
        readable.append(path)
    return readable


def best_of(repeat: int, fn) -> float:
    """The least CPU time of `repeat` runs (CPU time: a busy neighbour on a shared machine
    stretches wall-clock time, and the ratios with it)."""
    best = float("inf")
    for _ in range(repeat):
        start = time.process_time()
        fn()
        best = min(best, time.process_time() - start)
    return best


def options_for(path: Path):
    """The case's convert options (`<case>.args`, as the golden tests read them)."""
    from ddpify.results import ConvertOptions

    args = path.with_name(path.name.replace(".in.py", ".args"))
    if not path.name.endswith(".in.py") or not args.exists():
        return ConvertOptions()
    words = args.read_text().split()
    return ConvertOptions(
        sync_batchnorm="--sync-batchnorm" in words,
        global_batch="--global-batch" in words,
        eval_on_rank0="--eval-on-rank0" in words,
        launcher="spawn" if "spawn" in words else "torchrun",
    )


def measure(name: str, files: list[Path], repeat: int) -> dict[str, float]:
    import libcst as cst

    from ddpify.check.rule import select_rules
    from ddpify.check.runner import check_source
    from ddpify.engine import convert_source
    from ddpify.engine import parse as engine_parse

    sources = [(str(p), p.read_text(encoding="utf-8"), options_for(p)) for p in files]
    lines = sum(s.count("\n") + 1 for _, s, _ in sources)
    codes = sorted(select_rules(None))
    failures: list[str] = []

    def parse():
        for _, s, _ in sources:
            cst.parse_module(s)

    def check():
        for p, s, _ in sources:
            check_source(s, p, codes)

    def convert():
        failures.clear()
        engine_parse.cache_clear()  # a cold conversion: the engine keeps its last few trees
        for p, s, o in sources:
            try:
                convert_source(s, p, o)
            except Exception as exc:  # a script convert refuses (ConvertError) still costs its analysis
                failures.append(f"{Path(p).name}: {type(exc).__name__}")

    check()  # warm up imports and caches once
    t_parse = best_of(repeat, parse)
    t_check = best_of(repeat, check)
    t_convert = best_of(repeat, convert)
    kloc = lines / 1000
    print(f"{name}: {len(sources)} files, {lines} lines (best of {repeat})")
    print(f"  libcst parse : {t_parse / kloc * 1000:8.1f} ms per 1000 lines  {1.0:5.1f}x")
    print(f"  check        : {t_check / kloc * 1000:8.1f} ms per 1000 lines  {t_check / t_parse:5.1f}x parse (target 3x)")
    note = f"  [{len(failures)} refused: {', '.join(failures[:4])}{', ...' if len(failures) > 4 else ''}]" if failures else ""
    print(f"  convert      : {t_convert / kloc * 1000:8.1f} ms per 1000 lines  {t_convert / t_parse:5.1f}x parse (target 8x){note}")
    return {"parse": t_parse, "check": t_check, "convert": t_convert}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--corpus", type=Path, default=SHARED, help=f"folder of public scripts (default {SHARED}; "
                        "run_corpus.py rebuilds them under /tmp/ddpify-corpus/files)")
    args = parser.parse_args()
    measure("bundled scripts", bundled(), args.repeat)
    corpus = shared(args.corpus)
    if corpus:
        measure(f"shared corpus ({args.corpus})", corpus, args.repeat)


if __name__ == "__main__":
    main()
