"""Valid Python that once crashed ddpify, code CPython rejects, and ddpify's own bugs: each is one
line naming the file (convert), or that file's error or finding while the others are checked."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
HOST = (ROOT / "examples" / "mnist.py").read_text()  # a real training script: the passes run

# name -> (first line of the script, what convert does with it)
CASES = {
    "sum_330_terms": ("x = " + " + ".join(["1"] * 330), "converts"),
    "attribute_chain_500": ("x = a" + ".b" * 500, "converts"),
    "call_chain_500": ("x = f" + "()" * 500, "converts"),
    "and_chain_8000": ("x = " + " and ".join(["a"] * 8000), "converts"),
    "and_chain_20000": ("x = " + " and ".join(["a"] * 20000), "code nested 20,003 levels deep; ddpify reads at most 10,000"),
    "joined_strings_5000": ("x = (" + " ".join(['"a"'] * 5000) + ")", "libcst cannot parse this valid Python"),
    "parentheses_1000": ("x = " + "(" * 1000 + "1" + ")" * 1000, "syntax error: too many nested parentheses"),
    "sum_3000_terms": ("x = " + " + ".join(["1"] * 3000), "too deeply nested for Python to compile (RecursionError)"),
    "unary_minus_100000": ("x = " + "-" * 100000 + "1", "too deeply nested for Python to compile"),
}
NOT_PYTHON = {"parentheses_1000", "sum_3000_terms", "unary_minus_100000"}  # CPython cannot compile them


def ddpify(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ddpify", *args], capture_output=True, text=True, cwd=cwd, timeout=300)


@pytest.fixture(scope="module")
def hostile(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("hostile")
    for name, (line, _) in CASES.items():
        (folder / f"{name}.py").write_text(f"{line}\n{HOST}")
    (folder / "zz_plain.py").write_text(
        "import torch\nimport torch.distributed as dist\nfrom torch.nn.parallel import DistributedDataParallel as DDP\n\n"
        "dist.init_process_group('gloo')\nmodel = DDP(torch.nn.Linear(2, 2))\ntorch.save(model.state_dict(), 'm.pt')\n"
        "dist.destroy_process_group()\n"
    )
    return folder


@pytest.mark.parametrize("name", list(CASES))
def test_convert_gives_a_script_or_one_line(hostile: Path, name: str, tmp_path: Path) -> None:
    expected = CASES[name][1]
    out = tmp_path / "out.py"
    result = ddpify("convert", str(hostile / f"{name}.py"), "-o", str(out))
    assert "Traceback" not in result.stderr
    if expected == "converts":
        assert result.returncode == 0, result.stderr
        code = out.read_text()
        compile(code, str(out), "exec")
        again = ddpify("convert", str(out))
        assert again.returncode == 0 and "already distributed" in again.stderr and again.stdout == code
        return
    assert result.returncode == 1 and not out.exists()
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {hostile / name}.py:1: {expected}"), result.stderr


def test_check_reports_each_file_and_checks_the_others(hostile: Path) -> None:
    result = ddpify("check", str(hostile), "-j", "2")
    assert "Traceback" not in result.stderr + result.stdout
    assert result.returncode == 2  # files it could not check
    for name, (_, expected) in CASES.items():
        path = f"{hostile / name}.py"
        if name in NOT_PYTHON:  # a syntax error is a finding, as for any file that does not compile
            assert re.search(rf"{re.escape(path)}:1:\d+: DDP000 cannot parse file: {re.escape(expected)}", result.stdout), name
        elif expected != "converts":  # Python ddpify cannot read: that file's error
            assert f"error: {path}:1: {expected}" in result.stderr, name
        else:
            assert path not in result.stdout + result.stderr, name  # a single-GPU script: nothing to flag
    assert f"{hostile / 'zz_plain.py'}:7:" in result.stdout  # the other files are still checked


def test_an_internal_error_is_one_line_and_its_traceback_comes_with_verbose(tmp_path: Path) -> None:
    """A bug in ddpify (here a conversion that raises) is one line and a request to report it."""
    script = tmp_path / "train.py"
    script.write_text(HOST)
    crash = (
        "import sys, ddpify.engine as engine, ddpify.cli as cli\n"
        "def broken(*args, **kwargs): raise KeyError('no such pass')\n"
        "engine.convert_file = broken\n"
        "cli.main(sys.argv[1:])\n"
    )
    quiet = subprocess.run([sys.executable, "-c", crash, "convert", str(script)], capture_output=True, text=True)
    assert quiet.returncode == 2 and quiet.stdout == ""
    assert quiet.stderr.splitlines() == [
        "error: internal error (KeyError: 'no such pass'); run again with --verbose for the traceback",
        "This is a bug in ddpify: please report it, with the input.",
    ]
    verbose = subprocess.run(
        [sys.executable, "-c", crash, "convert", str(script), "--verbose"], capture_output=True, text=True
    )
    assert verbose.returncode == 2
    assert verbose.stderr.startswith("Traceback") and "in broken" in verbose.stderr
    assert "error: internal error (KeyError: 'no such pass')\n" in verbose.stderr


@pytest.mark.parametrize("command", ["", "convert", "check", "verify", "rules", "rule"])
def test_help_has_no_type_labels(command: str) -> None:
    result = ddpify(*([command] if command else []), "--help")
    assert result.returncode == 0, result.stderr
    text = result.stdout
    for noise in ("<bool>", "<path>", "<str>", "<int", "<float", "list[", "range>", "[x>=", "{"):
        assert noise not in text, (noise, text)
    assert text.startswith(f"Usage: ddpify {command}".rstrip() + " ")


def test_convert_works_where_a_deep_stack_cannot_be_reserved(tmp_path: Path) -> None:
    """Under `ulimit -v` below the 1 GiB stack, the conversion runs on the caller's thread."""
    import resource

    script = tmp_path / "train.py"
    script.write_text(HOST)
    limit = 900 * 2**20
    result = subprocess.run(
        [sys.executable, "-m", "ddpify", "convert", str(script), "-o", str(tmp_path / "out.py")],
        capture_output=True, text=True, timeout=300,
        preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_AS, (limit, limit)),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    compile((tmp_path / "out.py").read_text(), "out.py", "exec")
