"""``DEEPINFER_OPS_BACKEND=auto``: the tuned table (torch_kernels/tuning.py), its lookup per call, and
``python -m torch_kernels tune``'s choice of winners (torch_kernels/bench/tune.py).

The dispatch runs here as on an sm_90 machine (``cuda_platform``) on CPU tensors, in a world of the
reference and Triton (interpreted), as tests/test_dispatch.py does.
"""

import json
import multiprocessing
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from torch_kernels import dispatch, registry, tuning
from torch_kernels.dispatch import Selection
from torch_kernels.spec import Backend, Platform
from torch_kernels.testing import assert_close

from torch_kernels.bench import tune

from conftest import TORCH_BLOCKED_PRELUDE

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(autouse=True)
def _triton_world(triton_world, monkeypatch, tmp_path):
    monkeypatch.setenv(tuning.ENV_TUNE_DIR, str(tmp_path / "tune"))
    yield
    dispatch.configure(Selection())


def _entry(op, dtype, width, rows, winner, fingerprint=None):
    """A table entry for the installed ``winner`` (its fingerprint), or for another kernel (``fingerprint``)."""
    return {"op": op, "dtype": dtype, "width": width, "rows": rows, "winner": winner,
            "fingerprints": {winner: fingerprint or tuning.current_fingerprint(op, winner)}}


def _save(platform, entries, key=None):
    path = tuning.user_dir() / tuning.file_name(platform)
    return tuning.save(entries, key or tuning.table_key(platform), path)


RMSNORM_TABLE = [_entry("rmsnorm", "float32", 96, 1, "torch"), _entry("rmsnorm", "float32", 96, 64, "triton"),
                 _entry("rmsnorm", "float32", 1024, 1, "triton")]


# --- the table ---------------------------------------------------------------------------------------


def test_table_round_trip_and_summary(cuda_platform):
    saved = _save(cuda_platform, RMSNORM_TABLE)
    table, notices = tuning.find(cuda_platform)
    assert notices == [] and table.entries == saved.entries and table.path == saved.path
    assert table.summary("rmsnorm") == "float32 w96: 1:torch 64:triton; float32 w1024: 1:triton"
    assert table.summary("silu_and_mul") == ""


@pytest.mark.parametrize("damage, why", [
    (lambda p: p.write_text('{"schema": 1, "key": {'), "corrupt"),
    (lambda p: p.write_bytes(b"\xff\xfe"), "corrupt"),
    (lambda p: p.write_text(json.dumps({"schema": 1, "key": {}})), "partial: no key or no entries"),
    (lambda p: _rewrite(p, lambda d: d["entries"][0].pop("width")), "lacks dtype, width or rows"),
    (lambda p: _rewrite(p, lambda d: d["entries"][0].update(winner="cuda")), "names backend 'cuda'"),
    (lambda p: _rewrite(p, lambda d: d["entries"][0].update(op="rms")), "unknown op 'rms'"),
    (lambda p: _rewrite(p, lambda d: d["key"].update(torch="1.0")), "stale: tuned for torch 1.0; here torch"),
    (lambda p: _rewrite(p, lambda d: d.update(schema=0)), "not a schema-1/2 table"),
    (lambda p: _rewrite(p, lambda d: d["entries"][0].update(fingerprints=["x"])), "fingerprints is not an object"),
])
def test_a_damaged_table_is_ignored_with_a_notice(cuda_platform, damage, why):
    saved = _save(cuda_platform, RMSNORM_TABLE)
    damage(saved.path)
    table, notices = tuning.find(cuda_platform)
    assert table is None and len(notices) == 1
    assert str(saved.path) in notices[0] and why in notices[0], notices


def _rewrite(path, change):
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data))


def _within(seconds, fn):
    """``fn()``, failing rather than hanging the suite if it blocks (a FIFO opened for reading would)."""
    out = {}

    def run():
        try:
            out["value"] = fn()
        except BaseException as e:  # raised here, in the test's thread
            out["error"] = e
    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(seconds)
    assert not t.is_alive(), f"{fn} still blocked after {seconds} s"
    if "error" in out:
        raise out["error"]
    return out["value"]


def _replace_with(path, make):
    path.unlink()
    make(path)


_HOSTILE = {
    "op a list": lambda p: _rewrite(p, lambda d: d["entries"][0].update(op=["rmsnorm"])),
    "winner a list": lambda p: _rewrite(p, lambda d: d["entries"][0].update(winner=["triton"])),
    "width a float": lambda p: _rewrite(p, lambda d: d["entries"][0].update(width=96.0)),
    "width a bool": lambda p: _rewrite(p, lambda d: d["entries"][0].update(width=True)),
    "rows beyond a float": lambda p: _rewrite(p, lambda d: d["entries"][1].update(rows=10 ** 300)),
    "key nested": lambda p: _rewrite(p, lambda d: d["key"].update(torch={"v": [1]})),
    "5000-digit int": lambda p: p.write_text(p.read_text().replace('"rows": 64', '"rows": ' + "9" * 5000)),
    "deep nesting": lambda p: p.write_text(p.read_text().replace('"rows": 64', '"rows": ' + "[" * 100000 + "]" * 100000)),
    "oversized": lambda p: p.write_text(p.read_text() + " " * tuning.MAX_TABLE_BYTES),
    "fifo": lambda p: _replace_with(p, os.mkfifo),
    "link to /dev/zero": lambda p: _replace_with(p, lambda q: q.symlink_to("/dev/zero")),
    "a directory": lambda p: _replace_with(p, os.mkdir),
}
_HOSTILE_WHY = {"op a list": "unknown op ['rmsnorm']", "winner a list": "names backend ['triton']",
                "width a float": "lacks dtype, width or rows", "width a bool": "lacks dtype, width or rows",
                "rows beyond a float": "lacks dtype, width or rows", "key nested": "key's fields are not all strings",
                "5000-digit int": "corrupt: ValueError", "deep nesting": "corrupt: RecursionError",
                "oversized": f"larger than the {8 << 20} read", "fifo": "not a regular file",
                "link to /dev/zero": "not a regular file", "a directory": "not a regular file"}


@pytest.mark.parametrize("damage", sorted(_HOSTILE))
def test_a_hostile_table_is_refused_once_and_auto_still_serves(cuda_platform, capfd, damage):
    saved = _save(cuda_platform, RMSNORM_TABLE)
    _HOSTILE[damage](saved.path)
    table, notices = _within(30, lambda: tuning.find(cuda_platform))
    assert table is None and len(notices) == 1
    assert str(saved.path) in notices[0] and _HOSTILE_WHY[damage] in notices[0] and len(notices[0]) < 1000, notices
    capfd.readouterr()
    dispatch.configure(backend="auto")
    reference = registry.BY_OP["rmsnorm"][Backend.TORCH].load()
    w = torch.randn(96)
    for rows in (3, 100, 3, 100):  # each bucket the table named, twice: the refusal is not read again
        x = torch.randn(rows, 96)
        assert_close(_within(60, lambda: dispatch.slot("rmsnorm").call(x, w, 1e-6)), reference(x, w, 1e-6))
    err = capfd.readouterr().err
    assert err.count(f"tuned table {saved.path} ignored") == 1 and _HOSTILE_WHY[damage] in err, err
    assert "the platform default serves every op" in err


def test_the_shipped_tables_are_well_under_the_size_read():
    sizes = [p.stat().st_size for p in tuning.PACKAGED_DIR.glob("*.json")]
    assert sizes and max(sizes) * 16 < tuning.MAX_TABLE_BYTES


def test_a_link_to_a_regular_table_is_read(cuda_platform, tmp_path):
    saved = _save(cuda_platform, RMSNORM_TABLE)
    elsewhere = tmp_path / "elsewhere.json"
    saved.path.rename(elsewhere)
    saved.path.symlink_to(elsewhere)
    table, notices = tuning.find(cuda_platform)
    assert notices == [] and table.entries == saved.entries


def test_save_never_follows_or_truncates_through_its_lock(cuda_platform, tmp_path):
    path = tuning.user_dir() / tuning.file_name(cuda_platform)
    path.parent.mkdir(parents=True)
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    lock = path.with_name(path.name + ".lock")
    lock.symlink_to(victim)
    with pytest.raises(OSError, match="tuning lock .* not opened: it is a symbolic link"):
        _save(cuda_platform, RMSNORM_TABLE)
    assert victim.read_text() == "precious" and not path.exists()
    lock.unlink()
    os.mkfifo(lock)
    with pytest.raises(OSError, match="tuning lock .* not opened: it is a FIFO"):
        _within(30, lambda: _save(cuda_platform, RMSNORM_TABLE))
    lock.unlink()
    lock.write_text("held by someone")  # a regular lock is locked, not emptied
    _save(cuda_platform, RMSNORM_TABLE)
    assert lock.read_text() == "held by someone" and tuning.find(cuda_platform)[0] is not None


def test_save_replaces_a_hostile_table_in_place_of_the_link(cuda_platform):
    path = tuning.user_dir() / tuning.file_name(cuda_platform)
    path.parent.mkdir(parents=True)
    path.symlink_to("/dev/zero")
    _within(30, lambda: _save(cuda_platform, RMSNORM_TABLE))
    assert not path.is_symlink() and len(tuning.find(cuda_platform)[0].entries) == 3


def test_no_table_says_where_it_looked(cuda_platform):
    table, notices = tuning.find(cuda_platform)
    assert table is None and notices == [
        f"no tuned table for pretend H200 sm_90 in {tuning.user_dir()} or {tuning.PACKAGED_DIR}"]


def test_save_merges_and_a_new_measurement_replaces_its_bucket(cuda_platform):
    _save(cuda_platform, RMSNORM_TABLE)
    table = _save(cuda_platform, [_entry("rmsnorm", "float32", 96, 64, "torch"), _entry("silu_and_mul", "float32", 8, 1, "triton")])
    assert len(table.entries) == 4
    assert table.summary("rmsnorm").startswith("float32 w96: 1:torch 64:torch")
    # a stale table is replaced whole, not merged
    stale = dict(tuning.table_key(cuda_platform), torch="0.0")
    assert len(_save(cuda_platform, RMSNORM_TABLE[:1], key=stale).entries) == 1


def _tune_many(path, key, worker, n):
    for i in range(n):
        tuning.save([_entry("rmsnorm", "float32", 96 + worker, i, "triton")], key, path)


def test_two_processes_tuning_at_once_leave_one_complete_table(cuda_platform, tmp_path):
    path, key = tmp_path / "shared.json", tuning.table_key(cuda_platform)
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=_tune_many, args=(path, key, w, 40)) for w in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    table = tuning.Table.from_json(json.loads(path.read_text()))
    assert len(table.entries) == 80  # nothing lost: each write merged under the lock
    assert not [f for f in os.listdir(tmp_path) if f.endswith(".tmp")]


# --- auto in the dispatcher ------------------------------------------------------------------------


def test_selection_auto_from_env_and_configure():
    assert Selection.from_env({"DEEPINFER_OPS_BACKEND": " Auto "}) == Selection(auto=True)
    dispatch.configure(backend="auto")
    assert dispatch.selection().auto and dispatch.selection().backend is None
    dispatch.configure(backend="triton")
    assert not dispatch.selection().auto and dispatch.selection().backend is Backend.TRITON
    with pytest.raises(ValueError, match=r"configure\(backend='auto'\) chooses among the usable backends per call.*"
                                         r"configure\(strict=\.\.\.\)"):
        dispatch.configure(backend="auto", strict=True)


def test_auto_serves_each_bucket_from_its_winner_and_traces_it(cuda_platform, tmp_path):
    _save(cuda_platform, RMSNORM_TABLE)
    trace = tmp_path / "trace.txt"
    dispatch.configure(backend="auto", trace_path=str(trace))
    w = torch.randn(96)
    reference = registry.BY_OP["rmsnorm"][Backend.TORCH].load()
    calls = [torch.randn(3, 96), torch.randn(100, 96), torch.randn(2, 5, 96), torch.randn(3, 128)[:, :96]]
    for x in calls:
        assert_close(dispatch.slot("rmsnorm").call(x, w, 1e-6), reference(x, w, 1e-6))
    lines = trace.read_text().splitlines()
    # 3 rows and 2x5 rows: the bucket of 1 (up to sqrt(1*64) = 8); 100: the bucket of 64
    assert "rmsnorm|torch|auto float32 width 96 rows 0..7 (tuned at 1)" in lines
    assert "rmsnorm|triton|auto float32 width 96 rows 8.. (tuned at 64)" in lines
    assert sum("|auto " in line for line in lines) == 2  # each bucket traced once
    # an untuned dtype: the platform default (Triton first), no bucket line
    trace.write_text("")
    x = torch.randn(3, 96, dtype=torch.float16)
    assert_close(dispatch.slot("rmsnorm").call(x, w.half(), 1e-6), reference(x, w.half(), 1e-6))
    assert "|auto " not in trace.read_text()


def test_auto_nearest_width_and_refusal_falls_back(cuda_platform, tmp_path):
    _save(cuda_platform, [_entry("rmsnorm", "float32", 1024, 1, "triton")])
    trace = tmp_path / "trace.txt"
    dispatch.configure(backend="auto", trace_path=str(trace))
    x, w = torch.randn(2, 700, dtype=torch.float64), torch.randn(700, dtype=torch.float64)
    dispatch.configure(backend="auto", trace_path=str(trace))
    # float64 is not tuned: platform default, whose Triton refuses fp64: the reference serves
    assert_close(dispatch.slot("rmsnorm").call(x, w, 1e-6), registry.BY_OP["rmsnorm"][Backend.TORCH].load()(x, w, 1e-6))
    x, w = x.float(), w.float()
    dispatch.slot("rmsnorm").call(x, w, 1e-6)
    assert "rmsnorm|triton|auto float32 width 1024 rows 0.. (tuned at 1)" in trace.read_text().splitlines()


def test_auto_without_a_table_serves_the_platform_default_and_says_so_once(cuda_platform, capfd):
    dispatch.configure(backend="auto")
    x, w = torch.randn(3, 96), torch.randn(96)
    for op in ("rmsnorm", "gemma_rmsnorm", "rmsnorm"):
        dispatch.slot(op).call(x, w, 1e-6)
    err = capfd.readouterr().err
    assert err.count("no tuned table for pretend H200 sm_90") == 1
    assert "DEEPINFER_OPS_BACKEND=auto: the platform default serves every op" in err


def test_a_shape_seen_before_is_not_looked_up_again(monkeypatch):
    """The lookup's cost is measured in benchmarks/bench_tuning_lookup.py; here, that it is memoized."""
    table = tuning.Table.from_json({"schema": tuning.SCHEMA, "key": {}, "entries": RMSNORM_TABLE})
    served, looked_up = [], []
    lookup = tuning.winner
    monkeypatch.setattr(tuning, "winner", lambda *a: looked_up.append(a) or lookup(*a))
    kernel = lambda name: lambda x, w, eps: served.append(name)  # noqa: E731
    call = tuning.auto_call(table, "rmsnorm", 0, {Backend.TRITON: (kernel("chain"), lambda args: kernel("direct"))},
                            kernel("default"), lambda backend, bucket: None)
    w = torch.empty(96)
    for x in [torch.empty(100, 96)] * 3 + [torch.empty(3, 96)] * 2:
        call(x, w, 1e-6)
    assert len(looked_up) == 2  # once per (dtype, shape)
    assert served == ["direct"] * 3 + ["default"] * 2


def test_inventory_shows_the_auto_choices(cuda_platform, capsys):
    from torch_kernels.__main__ import _auto_choices

    dispatch.configure(backend="auto")
    assert "no usable tuned table here" in _auto_choices(cuda_platform)
    _save(cuda_platform, RMSNORM_TABLE)
    dispatch.configure(backend="auto")
    text = _auto_choices(cuda_platform)
    assert "(3 buckets;" in text
    assert any(line.split() == ["rmsnorm", "float32", "w96:", "1:torch", "64:triton;", "float32", "w1024:", "1:triton"]
               for line in text.splitlines())
    assert any(line.split()[:2] == ["silu_and_mul", "not"] for line in text.splitlines())


# --- tune ----------------------------------------------------------------------------------------------


def _row(op, key, us, bucket=("bfloat16", 4096, 32), check="ok"):
    return {"op": op, "key": key, "device_us": us, "check": check, "bucket": list(bucket)}


def test_tune_winners_keep_the_default_within_the_spread():
    result = {"header": {"cuda_key_serves": {"rmsnorm": ["tilelang", "triton", "torch"],
                                             "top_k_top_p_sampling_from_probs": ["triton", "flashinfer", "torch"]}},
              "rows": [_row("rmsnorm", "tilelang", 10.0), _row("rmsnorm", "triton", 9.95),  # within 1%: default
                       _row("rmsnorm", "tilelang", 10.0, ("bfloat16", 4096, 4096)),
                       _row("rmsnorm", "triton", 9.0, ("bfloat16", 4096, 4096)),  # 10% faster: wins
                       _row("rmsnorm", "triton", 5.0, ("bfloat16", 7168, 1)),  # TileLang refused: Triton is the default
                       _row("rmsnorm", "flashinfer", 1.0, ("bfloat16", 7168, 1), check="MISMATCH: x"),  # never a winner
                       _row("top_k_top_p_sampling_from_probs", "triton", 100.0, ("float32", 128256, 64)),
                       _row("top_k_top_p_sampling_from_probs", "flashinfer", 50.0, ("float32", 128256, 64))]}
    got = {(e["op"], e["width"], e["rows"]): (e["winner"], e["default"]) for e in tune.winners(result)}
    assert got == {("rmsnorm", 4096, 32): ("tilelang", "tilelang"), ("rmsnorm", 4096, 4096): ("triton", "tilelang"),
                   ("rmsnorm", 7168, 1): ("triton", "triton"),
                   # FlashInfer samples from its own random stream: auto never switches an op's samples
                   ("top_k_top_p_sampling_from_probs", 128256, 64): ("triton", "triton")}
    assert "| rmsnorm | bfloat16 | 4096 | 4096 | triton | tilelang | 1.111 |" in tune.winners_table(tune.winners(result))


def test_tune_reads_the_suite_results_and_writes_the_table(monkeypatch, tmp_path):
    """``tune``'s own steps on a stand-in GPU: the suite's JSON read back, the winners merged into the
    table and listed (the suite itself stubbed: it times CUDA kernels)."""
    from torch_kernels.bench import report

    gpu = Platform(device_type="cuda", compute_capability=(9, 0), device_name="NVIDIA H200")
    monkeypatch.setattr(Platform, "detect", classmethod(lambda cls: gpu))
    result = {"header": {"cuda_key_serves": {"rmsnorm": ["tilelang", "triton", "torch"]}},
              "rows": [_row("rmsnorm", "tilelang", 10.0), _row("rmsnorm", "triton", 5.0)]}

    def suite_main(argv):
        out = Path(argv[argv.index("--out") + 1])
        out.mkdir(parents=True)
        (out / f"{report.slug(gpu.device_name)}.json").write_text(json.dumps(result))
        return 0
    monkeypatch.setattr(tune.suite, "main", suite_main)
    monkeypatch.setattr(tune, "lookup_cost_us", lambda: tune.LookupCost(1.0, 0.5, 1.0))
    table = tmp_path / "table.json"
    assert tune.main(["--ops", "rmsnorm", "--table", str(table), "--out", str(tmp_path / "tune")]) == 0
    (entry,) = json.loads(table.read_text())["entries"]
    assert (entry["op"], entry["winner"]) == ("rmsnorm", "triton")
    assert "| rmsnorm | bfloat16 | 4096 | 32 | triton |" in (tmp_path / "tune" / "winners.md").read_text()


def test_tune_needs_a_gpu():
    r = subprocess.run([sys.executable, "-m", "torch_kernels", "tune"], cwd=ROOT, capture_output=True, text=True,
                       timeout=300, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert r.returncode == 2 and "this machine has no CUDA GPU" in r.stderr


# --- fingerprints: an entry holds only for the kernel it measured ------------------------------------


def _package_copy(tmp_path):
    """The package's sources under ``tmp_path``, to edit without touching the installed ones."""
    import shutil

    from torch_kernels import fingerprints

    root = tmp_path / "torch_kernels"
    shutil.copytree(fingerprints.PACKAGE_ROOT, root, ignore=shutil.ignore_patterns("__pycache__", "*.so", "csrc"))
    return root


def test_a_fingerprint_changes_with_its_kernel_source_or_a_shared_module(tmp_path):
    from torch_kernels import fingerprints

    specs = {(op, b): registry.BY_OP[op][b] for op in ("rmsnorm", "silu_and_mul") for b in (Backend.TRITON, Backend.TORCH)}
    real = {k: fingerprints.of(s) for k, s in specs.items()}
    root = _package_copy(tmp_path)
    assert {k: fingerprints.of(s, root) for k, s in specs.items()} == real  # the text, not where it lies
    assert len(set(real.values())) == len(real) and all(len(f) == fingerprints.DIGITS for f in real.values())

    def after(edit):
        path = root / edit
        text = path.read_text()
        path.write_text(text + "\n# a changed launch config\n")
        fingerprints.clear()
        changed = {k for k, s in specs.items() if fingerprints.of(s, root) != real[k]}
        path.write_text(text)
        return changed

    assert after("families/norm/triton.py") == {("rmsnorm", Backend.TRITON)}
    # a shared module both Triton kernels import: both change, the references do not
    assert after("backends/triton_fp8.py") == {("rmsnorm", Backend.TRITON), ("silu_and_mul", Backend.TRITON)}
    assert after("fp8.py") == set(specs)  # a core module every one of them imports
    assert after("opdef.py") == after("families/rope/triton.py") == set()  # imported by fp8 only; another family
    fingerprints.clear()
    assert {k: fingerprints.of(s) for k, s in specs.items()} == real  # the installed files untouched


def test_fingerprints_need_no_torch_and_no_import_of_a_kernel():
    """Read from the files, with torch and every framework blocked, the same as in this process."""
    import textwrap

    from torch_kernels import fingerprints

    r = subprocess.run([sys.executable, "-c", TORCH_BLOCKED_PRELUDE + textwrap.dedent("""
        from torch_kernels import fingerprints, registry
        for k in registry.KERNELS:
            print(k.op, k.backend.value, fingerprints.of(k))
        assert not [m for m in sys.modules if m.startswith("torch_kernels.families.") and not m.endswith("manifest")
                    and m.count(".") > 2]
    """)], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == [f"{k.op} {k.backend.value} {fingerprints.of(k)}" for k in registry.KERNELS]


def test_a_stale_entry_is_ignored_with_one_notice_and_a_fresh_one_serves(cuda_platform, tmp_path, capfd):
    _save(cuda_platform, [_entry("rmsnorm", "float32", 96, 1, "torch", fingerprint="0" * 12),  # another kernel
                          _entry("rmsnorm", "float32", 96, 64, "triton"),  # the installed one
                          _entry("gemma_rmsnorm", "float32", 96, 1, "torch")])
    trace = tmp_path / "trace.txt"
    capfd.readouterr()
    dispatch.configure(backend="auto", trace_path=str(trace))
    reference = registry.BY_OP["rmsnorm"][Backend.TORCH].load()
    w = torch.randn(96)
    for rows in (3, 100, 2, 5, 100, 3):
        x = torch.randn(rows, 96)
        assert_close(dispatch.slot("rmsnorm").call(x, w, 1e-6), reference(x, w, 1e-6))
    dispatch.slot("gemma_rmsnorm").call(torch.randn(3, 96), w, 1e-6)
    lines = trace.read_text().splitlines()
    # the stale bucket: the platform default (Triton, traced as a first use), not the table's torch
    assert "rmsnorm|triton|auto float32 width 96 rows 8.. (tuned at 64)" in lines
    assert not any(line.startswith("rmsnorm|torch") for line in lines), lines
    assert "gemma_rmsnorm|torch|auto float32 width 96 rows 0.. (tuned at 1)" in lines  # fresh: served
    err = capfd.readouterr().err
    assert err.count("were measured on another kernel") == 1, err
    assert "op 'rmsnorm': entries of torch (1 bucket) were measured on another kernel" in err
    assert "platform default" in err


def test_a_table_without_fingerprints_is_all_stale(cuda_platform, capfd):
    """A schema-1 table (before fingerprints) is read, and every entry of it is stale."""
    saved = _save(cuda_platform, RMSNORM_TABLE)
    _rewrite(saved.path, lambda d: [d.update(schema=1)] + [e.pop("fingerprints") for e in d["entries"]])
    table, notices = tuning.find(cuda_platform)
    assert notices == [] and table.summary("rmsnorm") == "float32 w96: 1:stale 64:stale; float32 w1024: 1:stale"
    assert table.stale("rmsnorm") == {"torch": 1, "triton": 2}
    assert tuning.winner(table, "rmsnorm", torch.empty(100, 96)) is None
    capfd.readouterr()
    dispatch.configure(backend="auto")
    for rows in (3, 100, 3):
        dispatch.slot("rmsnorm").call(torch.randn(rows, 96), torch.randn(96), 1e-6)
    err = capfd.readouterr().err
    assert err.count("op 'rmsnorm': entries of torch (1 bucket), triton (2 buckets) were measured on another") == 1, err


def test_tune_records_every_timed_backends_fingerprint(monkeypatch):
    from torch_kernels import fingerprints

    monkeypatch.undo()  # the whole inventory, TileLang included
    result = {"header": {"cuda_key_serves": {"rmsnorm": ["tilelang", "triton", "torch"]}},
              "rows": [_row("rmsnorm", "triton", 10.0), _row("rmsnorm", "tilelang", 5.0)]}
    (entry,) = tune.winners(result)
    real = registry.BY_OP["rmsnorm"]
    assert entry["winner"] == "tilelang" and entry["fingerprints"] == {
        "tilelang": fingerprints.of(real[Backend.TILELANG]), "triton": fingerprints.of(real[Backend.TRITON])}


@pytest.mark.parametrize("name", sorted(p.name for p in tuning.PACKAGED_DIR.glob("*.json")))
def test_a_shipped_table_names_only_the_installed_kernels(name, monkeypatch):
    monkeypatch.undo()  # the whole inventory, not the Triton world
    data = json.loads((tuning.PACKAGED_DIR / name).read_text())
    table = tuning.Table.from_json(data)
    stale = {op: table.stale(op) for op in table.ops if table.stale(op)}
    assert data["schema"] == tuning.SCHEMA and not stale, (
        f"{name}: a kernel changed since it was tuned (op: stale backend and buckets): {stale}; re-tune on that GPU "
        f"(python -m torch_kernels tune --table torch_kernels/tuned/{name})")


def test_auto_function_is_what_auto_calls_whatever_the_selection(cuda_platform, tmp_path, capfd):
    """dispatch.auto_function, which the benchmark suite times as ``auto``: the table's winner per bucket under
    the platform default's selection too, a stale bucket the platform default, one notice."""
    _save(cuda_platform, [_entry("rmsnorm", "float32", 96, 1, "torch"),
                          _entry("rmsnorm", "float32", 96, 64, "torch", fingerprint="0" * 12)])
    trace = tmp_path / "trace.txt"
    dispatch.configure(trace_path=str(trace))  # not auto
    capfd.readouterr()
    fn = dispatch.auto_function("rmsnorm", 0)
    reference = registry.BY_OP["rmsnorm"][Backend.TORCH].load()
    w = torch.randn(96)
    for rows in (2, 100, 2, 100):
        x = torch.randn(rows, 96)
        assert_close(fn(x, w, 1e-6), reference(x, w, 1e-6))
    assert set(trace.read_text().splitlines()) == {"rmsnorm|torch", "rmsnorm|triton"}  # 2 rows: torch; 100: default
    assert capfd.readouterr().err.count("op 'rmsnorm': entries of torch (1 bucket) were measured on another") == 1
    trace.write_text("")
    off_cuda = dispatch.auto_function("rmsnorm", 0, Platform())  # no table looked up: the reference
    assert_close(off_cuda(x, w, 1e-6), reference(x, w, 1e-6))
    assert "|auto " not in trace.read_text()
