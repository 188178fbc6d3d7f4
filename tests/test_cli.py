"""``python -m torch_kernels``, the front door: ``inventory`` (no self-check) fits 100 columns and says
once what the platform can run; the self-check says what each row compares; ``docs`` and ``build``
say what they did or what is missing, in a checkout or not; and a wheel built from the sources carries
what every command needs, which an install of it then runs (docs, docs --check, inventory, bench, tune)."""

import json
import os
import shutil
import subprocess
import sys
import types
import zipfile
from pathlib import Path

import pytest

import torch_kernels
from torch_kernels import __main__ as cli
from torch_kernels import bench, dispatch, fast_path, ops, registry
from torch_kernels.spec import Capability, Platform

ROOT = Path(__file__).resolve().parent.parent
H200 = Platform("cuda", (9, 0), "pretend H200")


def _inventory_text(platform, capsys) -> str:
    dispatch.set_platform(platform)
    cli.inventory(platform)
    return capsys.readouterr().out


def _widest(text: str) -> int:
    """The widest line, file paths aside (a cache path is as long as the user's directories make it)."""
    return max(len(line) for line in text.splitlines() if not line.lstrip(" (").startswith("/"))


def test_inventory_on_cpu_says_once_what_runs_here(capsys):
    assert cli.main(["inventory"]) == 0
    out = capsys.readouterr().out
    assert "self-check" not in out
    text = _inventory_text(Platform(), capsys)
    assert _widest(text) <= cli.WIDTH
    assert text.count("needs cuda, this is cpu") == 1
    assert "usable here: torch (every op)" in text
    assert "on cpu every op is served by the torch reference" in text
    rows = {r[0]: r[1:] for r in cli._inventory(Platform())}
    assert rows["op"] == ("tilelang", "triton", "flashinfer", "torch", "compiled route")
    assert rows["rmsnorm"] == ("no", "no", "no", "1", "opaque*")
    assert rows["topk_softmax"] == ("-", "no", "-", "1", "opaque")
    assert set(rows) == {"op", *registry.OPS}


def test_inventory_on_cuda_orders_the_backends_and_notes_once(capsys, monkeypatch):
    monkeypatch.setattr(Capability, "missing_package", lambda self: None)  # every framework installed
    rows = {r[0]: r[1:] for r in cli._inventory(H200)}
    assert rows["rmsnorm"] == ("1", "2", "3", "4", "opaque*")
    assert rows["qk_rmsnorm_rope"][:4] == ("2", "1", "-", "3")  # Triton first (registry.CUDA_PRIORITY)
    assert rows["per_token_group_quant_fp8"][:4] == ("1", "2", "-", "3")

    torch_kernels.configure(backend="torch", compile_route="rmsnorm=opaque,topk_softmax=inductor_triton")
    text = _inventory_text(H200, capsys)
    assert _widest(text) <= cli.WIDTH
    rows = {r[0]: r[1:] for r in cli._inventory(H200)}
    assert rows["rmsnorm"] == ("2", "3", "4", "1", "opaque (forced)")
    assert rows["topk_softmax"][-1] == "opaque (note)"
    family_notes = sum(len(f.notes) for f in registry.FAMILIES)  # what a manifest says under the table
    assert text.count("note: ") == 1 + family_notes and "note: op 'topk_softmax' compiled as 'opaque'" in text

    # strict, with the selected backend unusable: one note per shared reason, every op cell "off" or "no"
    torch_kernels.configure(backend="tilelang", strict=True, compile_route=None)
    t4 = Platform("cuda", (7, 5), "pretend T4")
    text = _inventory_text(t4, capsys)
    assert _widest(text) <= cli.WIDTH
    assert "not usable here: tilelang, flashinfer: needs compute capability >= 8.0, this is 7.5" in text
    assert text.count("note: ") == 2 + family_notes and " ".join(text.split()).count("served by nothing") == 2
    assert all(set(r[1:5]) <= {"no", "off", "-"} for r in cli._inventory(t4)[1:])


def test_self_check_says_what_each_row_compares(capsys, monkeypatch):
    monkeypatch.setattr(cli, "ops", types.SimpleNamespace(ALL=(ops.BY_NAME["rmsnorm"],)))
    assert cli._self_check(Platform()) == 0
    out = capsys.readouterr().out
    assert "served by the reference itself: its rows check the registration" in " ".join(out.split())
    lines = [line.split() for line in out.splitlines() if line.startswith("  rmsnorm")]
    assert ["rmsnorm", "registered", "op", "(serves", "torch)", "vs", "reference", "ok"] in lines
    assert out.splitlines()[-1] == f"all backends match the reference ({len(lines)} rows)"
    assert _widest(out) <= cli.WIDTH


def test_docs_to_a_file_and_its_check(tmp_path, capsys):
    target = tmp_path / "ops.md"
    assert cli.main(["docs", "--output", str(target)]) == 0
    assert target.read_text() == cli.render_ops_doc() and f"wrote {target}" in capsys.readouterr().out
    assert cli.main(["docs", "--check", "--output", str(target)]) == 0
    target.write_text("stale")
    assert cli.main(["docs", "--check", "--output", str(target)]) == 1
    assert f"`python -m torch_kernels docs --output {target}` rewrites it" in capsys.readouterr().err


def test_docs_outside_a_checkout_prints_and_check_asks_for_a_file(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(bench, "PARENT", tmp_path / "site-packages")
    assert cli.main(["docs"]) == 0
    captured = capsys.readouterr()
    assert captured.out == cli.render_ops_doc()
    assert "no source checkout here (docs/ops.md is not part of the package)" in captured.err
    assert cli.main(["docs", "--check"]) == 2
    assert "name a file to compare with --output FILE" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_build_says_what_is_missing(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(fast_path, "library_path", lambda: None)  # TVM-FFI not installed
    assert cli.main(["build"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "not installed: pip install apache-tvm-ffi" in err

    monkeypatch.setattr(fast_path, "library_path", lambda: tmp_path / "entry.so")
    for raised, said in ((FileNotFoundError(2, "No such file or directory", "c++"), "build: no C++ compiler: c++ not found"),
                         (RuntimeError("building the C++ entry failed (c++ exit 1):\nerror: x"),
                          "build: building the C++ entry failed (c++ exit 1)")):
        def fail(verbose, raised=raised):
            raise raised
        monkeypatch.setattr(fast_path, "build", fail)
        assert cli.main(["build"]) == 1
        assert capsys.readouterr().err.startswith(said)


def test_help_imports_nothing_the_package_did_not():
    """``--help`` lists ``inventory`` and imports no module beyond ``import torch_kernels``'s but the
    front door's own and the test kit its self-check compares with (stdlib aside)."""
    script = ("import sys, torch_kernels; before = set(sys.modules)\n"
              "from torch_kernels import __main__ as cli\n"
              "try:\n    cli.main(['--help'])\nexcept SystemExit:\n    pass\n"
              "new = sorted(m for m in set(sys.modules) - before if m.split('.')[0] not in sys.stdlib_module_names)\n"
              "print('NEW', *new)\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "inventory" in done.stdout
    new = next(line for line in done.stdout.splitlines() if line.startswith("NEW")).split()[1:]
    assert set(new) <= {"torch_kernels.__main__", "torch_kernels.bench", "torch_kernels.testing"}, new


# ------------------------------------------------------------------------------------------------
# The wheel, and an install of it

#: What a wheel must carry for its commands, beside the Python modules (relative to its root).
PACKAGE_DATA = ("torch_kernels/py.typed", "torch_kernels/csrc/fast_path.cpp", "torch_kernels/bench/suite.py",
                "torch_kernels/bench/tune.py", "torch_kernels/bench/cases.py", "torch_kernels/bench/harness.py")

#: Run in an interpreter that imports the package from the unpacked wheel: each command's exit status,
#: stdout and stderr, in one process (one import of torch).
DRIVER = """
import contextlib, io, json, sys
from torch_kernels import __main__ as cli
results = {}
for argv in json.loads(sys.argv[1]):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = cli.main(argv)
        except SystemExit as e:
            rc = e.code
    results[" ".join(argv)] = [rc, out.getvalue(), err.getvalue()]
print(json.dumps(results))
"""


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The wheel of these sources, built from a copy (the checkout is left as it is)."""
    src, out = tmp_path_factory.mktemp("src"), tmp_path_factory.mktemp("wheel")
    for name in ("pyproject.toml", "setup.cfg", "README.md", "LICENSE"):
        shutil.copy(ROOT / name, src / name)
    shutil.copytree(ROOT / "torch_kernels", src / "torch_kernels", ignore=shutil.ignore_patterns("__pycache__"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out),
                    str(src)], check=True, capture_output=True, timeout=300)
    (path,) = out.glob("torch_kernels-*.whl")
    return path


def test_the_wheel_carries_what_the_commands_need(wheel):
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        info = f"torch_kernels-{torch_kernels.__version__}.dist-info"
        metadata = z.read(f"{info}/METADATA").decode()
        assert z.read(f"{info}/licenses/LICENSE") == (ROOT / "LICENSE").read_bytes()
        entry_points = z.read(f"{info}/entry_points.txt").decode()
    assert set(PACKAGE_DATA) <= names
    tuned = {f"torch_kernels/tuned/{p.name}" for p in (ROOT / "torch_kernels" / "tuned").glob("*.json")}
    assert tuned and tuned <= names
    assert not {n for n in names if n.split("/")[0] in ("docs", "benchmarks", "tests")}
    headers = [line for line in metadata.splitlines() if ": " in line]
    assert f"Version: {torch_kernels.__version__}" in headers  # the one version, torch_kernels.__version__
    assert "License-Expression: Apache-2.0" in headers and "License-File: LICENSE" in headers
    assert "Classifier: Typing :: Typed" in headers and any(h.startswith("Keywords: ") for h in headers)
    assert "torch-kernels = torch_kernels.__main__:main" in entry_points
    assert (ROOT / "LICENSE").read_text().lstrip().startswith("Apache License\n                           Version 2.0")


def test_an_install_of_the_wheel_runs_every_command(wheel, tmp_path):
    site, work = tmp_path / "site-packages", tmp_path / "work"
    work.mkdir()
    with zipfile.ZipFile(wheel) as z:
        z.extractall(site)
    env = {**os.environ, "PYTHONPATH": str(site), "DEEPINFER_OPS_TUNE_DIR": str(tmp_path / "tune")}
    done = subprocess.run([sys.executable, "-m", "torch_kernels", "docs"], cwd=work, env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout == cli.render_ops_doc() and "no source checkout here" in done.stderr
    commands = [["docs", "--check"], ["docs", "--output", "ops.md"], ["docs", "--check", "--output", "ops.md"],
                ["inventory"], ["bench", "--help"], ["tune", "--help"],
                ["bench", "--cpu", "--ops", "rmsnorm", "--backends", "op,torch", "--shapes", "2", "--no-plots"]]
    done = subprocess.run([sys.executable, "-c", DRIVER, json.dumps(commands)], cwd=work, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    got = json.loads(done.stdout.splitlines()[-1])
    assert got["docs --check"][0] == 2 and "--output FILE" in got["docs --check"][2]
    assert got["docs --output ops.md"][0] == 0 and (work / "ops.md").read_text() == cli.render_ops_doc()
    assert got["docs --check --output ops.md"][0] == 0
    rc, out, _ = got["inventory"]
    assert rc == 0 and all(op in out for op in registry.OPS)
    for command in ("bench --help", "tune --help"):
        rc, out, _ = got[command]
        assert rc == 0 and out.startswith(f"usage: python -m torch_kernels {command.split()[0]}"), command
    rc, _, err = got["bench --cpu --ops rmsnorm --backends op,torch --shapes 2 --no-plots"]
    assert rc == 0, err
    result = json.loads((work / "torch_kernels_bench" / "suite" / "cpu.json").read_text())
    assert {(r["shape"], r["key"]) for r in result["rows"]} == {("2x512", "op"), ("2x512", "torch")}
    assert not (site / "docs").exists() and not (site / "torch_kernels_bench").exists()
