"""What a user waits for: one `ddpify` command in a fresh interpreter, against `import libcst`.

    python benchmarks/bench_startup.py [--runs 7]

Every figure is wall time, best of `--runs` fresh interpreters, with bytecode caches written
first (as an installed package has them):

- `python -c 'import libcst'`: the yardstick (1.0x).
- the convert pipeline's import (`import ddpify.engine, ddpify.convert`): target <= 2x.
- `ddpify --help`: target <= 2x (it imports neither libcst nor the engine).
- `ddpify convert` of a 300-line script (examples/mnist.py grown to 300 lines, as
  bench_scaling.py grows it), written to a temporary file: target <= 0.4 s.
- the same run split in one interpreter: import, the conversion (first and second call).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_scaling import grown  # noqa: E402

PIPELINE = "import ddpify.engine, ddpify.convert"
SPLIT = """
import json, sys, time
start = time.perf_counter()
import ddpify.engine, ddpify.convert
imported = time.perf_counter()
from pathlib import Path
ddpify.engine.convert_file(Path(sys.argv[1]))
first = time.perf_counter()
ddpify.engine.convert_file(Path(sys.argv[1]))
print(json.dumps([imported - start, first - imported, time.perf_counter() - first]))
"""


def best(cmd: list[str], runs: int, env: dict[str, str]) -> float:
    """The shortest wall time of `runs` runs of cmd."""
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True, env=env)
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=7)
    args = parser.parse_args()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    env["OMP_NUM_THREADS"] = "1"
    exe = shutil.which("ddpify")
    ddpify = [exe] if exe else [sys.executable, "-m", "ddpify"]
    with tempfile.TemporaryDirectory() as tmp:
        script, out = Path(tmp, "train.py"), Path(tmp, "train_ddp.py")
        script.write_text(grown(300))
        lines = script.read_text().count("\n")
        convert = [*ddpify, "convert", str(script), "-o", str(out)]
        subprocess.run([sys.executable, "-c", PIPELINE], check=True, env=env)  # writes the bytecode caches
        subprocess.run(convert, stdout=subprocess.DEVNULL, check=True, env=env)
        t_libcst = best([sys.executable, "-c", "import libcst"], args.runs, env)
        t_python = best([sys.executable, "-c", "pass"], args.runs, env)
        t_pipeline = best([sys.executable, "-c", PIPELINE], args.runs, env)
        t_help = best([*ddpify, "--help"], args.runs, env)
        t_convert = best(convert, args.runs, env)
        splits = [
            json.loads(subprocess.run([sys.executable, "-c", SPLIT, str(script)], capture_output=True, text=True, check=True, env=env).stdout)
            for _ in range(args.runs)
        ]
    split = [min(s[i] for s in splits) for i in range(3)]
    print(f"start-up, wall time, best of {args.runs} fresh interpreters")
    print(f"  python -c pass                       : {t_python * 1000:6.0f} ms")
    print(f"  python -c 'import libcst'            : {t_libcst * 1000:6.0f} ms  1.0x")
    print(f"  import of the convert pipeline       : {t_pipeline * 1000:6.0f} ms  {t_pipeline / t_libcst:.1f}x (target 2x)")
    print(f"  ddpify --help                        : {t_help * 1000:6.0f} ms  {t_help / t_libcst:.1f}x (target 2x)")
    print(f"  ddpify convert, {lines}-line script     : {t_convert * 1000:6.0f} ms  (target 400 ms)")
    print(f"    in one interpreter: import {split[0] * 1000:.0f} ms, first conversion {split[1] * 1000:.0f} ms, second {split[2] * 1000:.0f} ms")


if __name__ == "__main__":
    main()
