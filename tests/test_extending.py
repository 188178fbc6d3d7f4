"""docs/extending.md, followed as written: its example family lands in a copy of the source tree, and
the package, the inventory (torch blocked too), the schema golden, the registration and compile tests,
the self-check, the op reference and the benchmark take the new op up, with no other file touched."""

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "extending.md"
OP = "logit_softcap"
SCHEMA = "deepinfer::logit_softcap(Tensor input, float cap) -> Tensor"
#: a file of the example: its path in backquotes and a colon, a blank line, then the whole file
_FILE = re.compile(r"^`(torch_kernels/[\w/]+\.py)`:\n\n```python\n(.*?)^```$", re.M | re.S)
_NOT_COPIED = shutil.ignore_patterns(".git", ".venv*", ".gpu-pkgs", ".whl", "__pycache__", "*.egg-info", "build",
                                     ".pytest_cache", "results", "torch_kernels_bench")


def example_files(text: str) -> dict:
    return dict(_FILE.findall(text))


@pytest.fixture(scope="module")
def tree(tmp_path_factory):
    """A copy of the source tree with the page's example files written into it, and nothing else."""
    root = tmp_path_factory.mktemp("extending") / "src"
    shutil.copytree(ROOT, root, ignore=_NOT_COPIED)
    files = example_files(DOC.read_text())
    for path, body in files.items():
        assert not (root / path).exists(), f"the example's {path} is already in the tree"
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_text(body)
    return root, files


def run(root: Path, *args: str, env: dict = None, timeout: int = 600) -> subprocess.CompletedProcess:
    environ = {**os.environ, "PYTHONPATH": str(root), "TRITON_INTERPRET": "1", **(env or {})}
    environ.pop("DEEPINFER_OPS_BACKEND", None)
    r = subprocess.run([sys.executable, *args], cwd=root, env=environ, capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, f"{' '.join(args)} exited {r.returncode}:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    return r


def test_the_page_gives_every_file_of_the_example_family(tree):
    _, files = tree
    family = "torch_kernels/families/logits/"
    assert sorted(files) == [family + f for f in ("__init__.py", "manifest.py", "ops.py", "reference.py", "triton.py")]


def test_the_package_registers_and_exports_the_new_op(tree):
    root, _ = tree
    code = ("import torch, torch_kernels as tk\n"
            "x = torch.randn(5, 77, dtype=torch.float64) * 80\n"
            f"out = tk.{OP}(x, 30.0)\n"
            "assert torch.allclose(out, 30.0 * torch.tanh(x / 30.0)), (out - 30.0 * torch.tanh(x / 30.0)).abs().max()\n"
            f"assert torch.ops.deepinfer.{OP}.default(x, 30.0).equal(out)\n"
            "try:\n    tk.logit_softcap(x, -1.0)\nexcept ValueError as e:\n    print(e)\n"
            "print(tk.__file__)")
    error, where = run(root, "-c", code).stdout.splitlines()[-2:]
    assert error.startswith(f"deepinfer::{OP}: argument 'cap'") and Path(where).is_relative_to(root)


def test_the_inventory_lists_it_with_and_without_torch(tree):
    root, _ = tree
    lines = run(root, "-m", "torch_kernels", "inventory").stdout.splitlines()
    header = next(line.split() for line in lines if line.startswith("op "))
    row = dict(zip(header, next(line.split() for line in lines if line.startswith(OP + " "))))
    assert row["tilelang"] == row["flashinfer"] == "-" and row["triton"] != "-" and row["torch"] != "-", row
    code = ("import sys; sys.modules['torch'] = None\n"
            "from torch_kernels import registry\n"
            f"print(sorted(k.backend.value for k in registry.BY_OP[{OP!r}].values()), registry.COMPILE_ROUTE[{OP!r}])")
    assert run(root, "-c", code).stdout.split() == ["['torch',", "'triton']", "decompose"]


def test_the_schema_golden_takes_the_new_schema(tree):
    root, _ = tree
    golden = root / "tests" / "test_registration.py"
    assert SCHEMA not in golden.read_text()
    run(root, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_registration.py", "-k", "registered_schemas",
        env={"EXPECTTEST_ACCEPT": "1"})
    assert SCHEMA in golden.read_text()
    run(root, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_registration.py", "-k", "registered_schemas")


def test_the_registration_and_compile_tests_run_it(tree):
    root, _ = tree
    r = run(root, "-m", "pytest", "-v", "-p", "no:cacheprovider", "tests/test_registration.py", "tests/test_compile.py",
            "-k", OP, "-m", "not gpu")
    passed = re.findall(r"^tests/(test_\w+)\.py::(\w+)\[[^\]]*\] PASSED", r.stdout, re.M)
    assert {"test_registration", "test_compile"} <= {f for f, _ in passed} and "FAILED" not in r.stdout, r.stdout[-3000:]
    assert "test_opcheck" in {t for _, t in passed}, passed


def test_the_self_check_compares_each_backend_with_the_reference(tree):
    root, _ = tree
    rows = [line.split() for line in run(root, "-m", "torch_kernels").stdout.splitlines() if " vs reference " in line]
    checked = {row[1]: row[-1] for row in rows if row[0] == OP}
    assert checked == {"registered": "ok", "triton": "ok"}, rows


def test_the_op_reference_documents_it(tree):
    root, _ = tree
    run(root, "-m", "torch_kernels", "docs")
    text = (root / "docs" / "ops.md").read_text()
    assert SCHEMA in text and "Gemma 2's soft-capping of logits" in text


def test_the_benchmark_times_it(tree, tmp_path):
    root, _ = tree
    run(root, "-m", "torch_kernels", "bench", "--ops", OP, "--out", str(tmp_path / "bench"))
    (result,) = list((tmp_path / "bench").glob("*.json"))
    rows = [row for row in json.loads(result.read_text())["rows"] if row["op"] == OP]
    assert rows and {row["shape"] for row in rows} >= {"1x1024", "16x1024"} and all(row["check"] == "ok" for row in rows), rows
