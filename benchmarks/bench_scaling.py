"""Does the cost per line stay flat as a script grows? `check` and `convert` on one training script
grown to N lines, against libcst's bare parse.

    python benchmarks/bench_scaling.py [--sizes 300 2000 50000] [--repeat 1]

The script is examples/mnist.py with its `train`/`test` pair repeated (renamed `train_2`,
`test_2`, ...) until it has N lines: every copy holds a step loop, an evaluation loop and
side effects, so every pass and rule has work in every copy. Times are CPU seconds in this
process (no start-up), best of `--repeat`; each size is run in a fresh interpreter so memory
from one size does not slow the next.

Target (issue 12): the cost per line at 2,000 and 50,000 lines within 2x of the cost at 300.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "mnist.py"


def grown(lines: int) -> str:
    """examples/mnist.py with its train/test pair repeated until the script has `lines` lines."""
    source = EXAMPLE.read_text().splitlines(keepends=True)
    start = next(i for i, text in enumerate(source) if text.startswith("def train("))
    end = next(i for i, text in enumerate(source) if text.startswith("def main("))
    head, pair, tail = source[:start], "".join(source[start:end]), source[end:]
    copies, count = [], len(head) + len(tail)
    while count < lines:
        k = len(copies) + 2
        copies.append(re.sub(r"^def (train|test)\(", rf"def \1_{k}(", pair, flags=re.M))
        count += pair.count("\n")
    return "".join(head) + pair + "".join(copies) + "".join(tail)


def measure(lines: int, repeat: int) -> dict:
    """Seconds of CPU for parse, check and convert of the grown script (this process)."""
    import gc

    import libcst as cst

    from ddpify.check.runner import check_source
    from ddpify.engine import convert_source
    from ddpify.engine import parse as engine_parse

    source = grown(lines)
    n = source.count("\n")
    out = {"lines": n}
    for name, run in (
        ("parse", lambda: cst.parse_module(source)),
        ("check", lambda: check_source(source, "grown.py")),
        ("convert", lambda: (engine_parse.cache_clear(), convert_source(source, "grown.py"))),  # cold: no kept tree
    ):
        best = float("inf")
        for _ in range(repeat):
            gc.collect()
            start = time.process_time()
            run()
            best = min(best, time.process_time() - start)
        out[name] = best
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[300, 2000, 50000])
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--one", type=int, help=argparse.SUPPRESS)  # a child: measure one size
    args = parser.parse_args()
    if args.one:
        print(json.dumps(measure(args.one, args.repeat)))
        return
    rows = []
    for size in args.sizes:
        child = subprocess.run(
            [sys.executable, __file__, "--one", str(size), "--repeat", str(args.repeat)],
            capture_output=True, text=True, check=True, cwd=ROOT,
        )  # fmt: skip
        rows.append(json.loads(child.stdout))
    base = rows[0]
    print(f"{'lines':>7} {'parse µs/line':>14} {'check µs/line':>14} {'convert µs/line':>16}"
          f" {'check/parse':>12} {'convert/parse':>14} {'check vs first':>15} {'convert vs first':>17}")  # fmt: skip
    for row in rows:
        per = {k: row[k] / row["lines"] * 1e6 for k in ("parse", "check", "convert")}
        first = {k: base[k] / base["lines"] * 1e6 for k in ("parse", "check", "convert")}
        print(
            f"{row['lines']:>7} {per['parse']:>14.0f} {per['check']:>14.0f} {per['convert']:>16.0f}"
            f" {row['check'] / row['parse']:>12.1f} {row['convert'] / row['parse']:>14.1f}"
            f" {per['check'] / first['check']:>14.2f}x {per['convert'] / first['convert']:>16.2f}x"
        )
    print("target: check and convert per line within 2x of the first size at every size")


if __name__ == "__main__":
    main()
