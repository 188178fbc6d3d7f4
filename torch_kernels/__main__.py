"""``python -m torch_kernels [check|docs|bench|tune]``

* ``check`` (the default): the platform, the selection, one row per op (the backends that implement
  it, which are usable here and why the others are not, which one the CUDA key selects), then every
  usable backend against the reference on fresh random inputs. Exits 1 on a mismatch.
* ``build``: compile the C++ entry of the norm and activation ops (``fast_path.py``) for this torch and TVM-FFI;
  later imports load it.
* ``docs``: regenerate ``docs/ops.md`` from the registered schemas and the wrappers' docstrings
  (``--check``: exit 1 if the file is out of date instead).
* ``bench``: every op x every usable backend x the peers over the shape set (``benchmarks/suite.py`` of
  the source checkout; ``bench --help`` lists its options).
* ``tune``: every usable backend of every op over the shape buckets, the winners stored for
  ``DEEPINFER_OPS_BACKEND=auto`` (``benchmarks/tune.py``; ``tune --help``).
"""

import argparse
import inspect
import os
import sys
import warnings
from pathlib import Path

import torch

import torch_kernels
from torch_kernels import dispatch, fast_path, ops, registry
from torch_kernels.spec import FRAMEWORK_PACKAGE, Backend, Capability, Platform
from torch_kernels.testing import TOP_P_SLACK, as_dispatched, assert_ids_kept, compare_outputs, mutated_args, outputs_of

DOCS_OPS = Path(__file__).resolve().parent.parent / "docs" / "ops.md"


def _compiled_route(op: str, platform: Platform) -> str:
    """The op's route under torch.compile on CUDA (docs/compile.md), resolved against ``platform``
    when it has CUDA; "(forced)" when set by DEEPINFER_OPS_COMPILE_ROUTE or configure(), "decompose
    after pointwise" for the ops of registry.DECOMPOSE_AFTER_POINTWISE."""
    forced = dispatch.selection().forced_route(op)
    asked = forced or registry.COMPILE_ROUTE[op]
    route, notice = dispatch.compile_route(op, "cuda", platform) if platform.is_cuda else (asked, None)
    text = asked + (" (forced)" if forced else ", decompose after pointwise" if op in registry.DECOMPOSE_AFTER_POINTWISE else "")
    return text if route == asked and notice is None else f"{text} -> {route}  [{notice}]"


def _inventory(platform: Platform) -> list:
    rows = [("op", "implemented by", "usable here", "CUDA key serves", "compiled route")]
    for op in registry.OPS:
        impls = registry.implementations(op)
        usable = []
        for k in impls:
            why = k.unavailable_reason(platform)
            usable.append(k.backend.value if why is None else f"{k.backend.value}: no ({why})")
        chain, notice = dispatch.plan(op, platform)
        serves = " > ".join(k.backend.value for k in chain) or f"nothing: {notice}"
        if notice and chain:
            serves += f"  [{notice}]"
        rows.append((op, ", ".join(k.backend.value for k in impls), "; ".join(usable), serves,
                     _compiled_route(op, platform)))
    return rows


def _auto_choices(platform: Platform) -> str:
    """Under DEEPINFER_OPS_BACKEND=auto: the table in use and each op's winners (rows:backend)."""
    table = dispatch.tuned_table(platform) if platform.is_cuda else None
    if table is None:
        return "\nauto: no usable tuned table here (the line above says why): the platform default serves every op"
    lines = [f"\nauto: {table.path} ({len(table.entries)} buckets; per dtype and width, the winner from each tuned "
             "row count on)"]
    lines += [f"  {op:32s} {table.summary(op) or 'not tuned: the platform default'}" for op in registry.OPS]
    return "\n".join(lines)


def _table(rows: list) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)


CHECK_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _compile_tilelang_in_parallel(platform: Platform, device: str) -> int:
    """Run every TileLang kernel of the self-check once, from a pool of threads, before the check
    itself: each first call compiles a specialisation (nvcc, ~3 s on the H200 host), and the ~60 of
    them took the check past 110 s one at a time there (2026-11-29). nvcc runs as a subprocess, so
    threads compile side by side: 6 norm kernels took 11.7 s from 6 threads on the 2-core CPU machine
    against 19.0 in turn. Errors are left to the check, which calls the same kernels again (from the
    memo). Returns how many calls were made."""
    calls = []
    for op in ops.ALL:
        spec = registry.BY_OP[op.name].get(Backend.TILELANG)
        if spec is None or not spec.is_available(platform):
            continue
        fn = as_dispatched(spec)
        calls += [(fn, args) for dtype in CHECK_DTYPES for args in op.samples(device, dtype)]
    if not calls:
        return 0
    from concurrent.futures import ThreadPoolExecutor

    def run(fn, args):
        try:
            fn(*args)
        except Exception:  # noqa: BLE001  (the check reports it)
            pass
    with ThreadPoolExecutor(max_workers=min(len(calls), os.cpu_count() or 1)) as pool:
        list(pool.map(lambda call: run(*call), calls))
    if device == "cuda":
        torch.cuda.synchronize()
    return len(calls)


def _self_check(platform: Platform) -> int:
    device = "cuda" if platform.is_cuda else "cpu"
    # Without a GPU, Triton kernels still run on CPU tensors in Triton's interpreter, as in CI; it
    # must be switched on before Triton is first imported.
    interpret_triton = (not platform.is_cuda and "triton" not in sys.modules
                        and Capability(package=FRAMEWORK_PACKAGE[Backend.TRITON]).missing_package() is None)
    if interpret_triton:
        os.environ["TRITON_INTERPRET"] = "1"
        # the interpreter evaluates masked-off lanes (inf - inf on -inf LSE rows) in numpy
        warnings.filterwarnings("ignore", category=RuntimeWarning, module="triton.runtime.interpreter")
    failures = 0
    own_stream = {(op, backend.value) for op, backend in registry.OWN_RANDOM_STREAM}
    _compile_tilelang_in_parallel(platform, device)
    torch.manual_seed(0)
    print(f"\nself-check on {device}: every usable backend against the reference, fp32/fp16/bf16")
    for op in ops.ALL:
        overload = getattr(torch.ops.deepinfer, op.name).default
        mutated = mutated_args(overload)
        reference = registry.BY_OP[op.name][Backend.TORCH].load()
        # backends called directly, the calls they refuse going to the reference as in the dispatcher
        candidates = [("registered op", overload)] + [
            (k.backend.value, as_dispatched(k)) for k in registry.implementations(op.name)
            if k.backend is not Backend.TORCH and k.is_available(platform)]
        if interpret_triton and Backend.TRITON in registry.BY_OP[op.name]:
            candidates.append(("triton (interpreted)", registry.BY_OP[op.name][Backend.TRITON].load()))
        for name, fn in candidates:
            bad = []
            for dtype in CHECK_DTYPES:
                for args in op.samples(device, dtype):
                    try:
                        if (op.name, name) in own_stream:  # its own random stream: held to the kept set
                            assert_ids_kept(*args[:3], fn(*args), TOP_P_SLACK)
                            continue
                        compare_outputs(op, outputs_of(fn, args, mutated), outputs_of(reference, args, mutated), dtype)
                    except AssertionError as e:
                        bad.append(f"{dtype} {tuple(args[op.data_arg].shape)}: {str(e).splitlines()[0]}")
            failures += bool(bad)
            status = "ok" if not bad else "MISMATCH " + ", ".join(bad)
            print(f"  {op.name:32s} {name:21s} {status}")
    return failures


def check() -> int:
    platform = Platform.detect()
    dispatch.set_platform(platform)
    sel = dispatch.selection()
    print(f"torch_kernels {torch_kernels.__version__}, torch {torch.__version__}, platform: {platform}")
    print(f"selection: backend={'auto' if sel.auto else sel.backend.value if sel.backend else 'platform default'}"
          f" fallback={sorted(sel.fallback) or '-'} strict={sel.strict} trace={sel.trace_path or '-'}"
          f"{' (with args)' if sel.trace_args else ''}"
          f" compile_route={','.join(f'{op}={r}' for op, r in sel.compile_route) or 'measured'}")
    print("every device other than CUDA is served by the torch reference; compiled routes are those of CUDA"
          " (elsewhere inductor_triton decomposes and the in-place norms stay opaque: docs/compile.md)\n")
    print(_table(_inventory(platform)))
    print(f"\nC++ entry of {', '.join(fast_path.OPS)} (eager CUDA calls TileLang serves): {fast_path.status()}")
    if sel.auto:
        print(_auto_choices(platform))
    failures = _self_check(platform)
    print(f"\n{'FAILED: ' + str(failures) + ' mismatch(es)' if failures else 'all backends match the reference'}")
    return 1 if failures else 0


def render_ops_doc() -> str:
    """docs/ops.md: the registered schema and the wrapper's docstring of every op."""
    out = ["# Op reference", "",
           "Generated by `python -m torch_kernels docs` from the registered schemas and the wrappers'",
           "docstrings; `tests/test_registration.py` fails when it is out of date. Do not edit by hand.", ""]
    for op in ops.ALL:
        schema = str(getattr(torch.ops.deepinfer, op.name).default._schema)
        impls = ", ".join(k.backend.value for k in registry.implementations(op.name))
        out += [f"## `{op.name}`", "", "```", schema, "```", "",
                f"Python: `torch_kernels.{op.name}{inspect.signature(op.wrapper)}`  ", f"Backends: {impls}", "",
                inspect.cleandoc(op.wrapper.__doc__), ""]
    return "\n".join(out)


def docs(check_only: bool) -> int:
    text = render_ops_doc()
    if check_only:
        current = DOCS_OPS.read_text() if DOCS_OPS.exists() else ""
        if current != text:
            print(f"{DOCS_OPS} is out of date: run `python -m torch_kernels docs`", file=sys.stderr)
            return 1
        return 0
    DOCS_OPS.write_text(text)
    print(f"wrote {DOCS_OPS}")
    return 0


def benchmark_script(name: str, argv: list) -> int:
    """Run ``benchmarks/<name>.py`` of the source checkout this package sits in (not part of a wheel)."""
    root = Path(__file__).resolve().parent.parent
    if not (root / "benchmarks" / f"{name}.py").is_file():
        print(f"python -m torch_kernels runs benchmarks/{name}.py of a source checkout; this installation "
              f"({root}) has no benchmarks/ folder next to the package: clone the repository and "
              "`pip install -e .` it", file=sys.stderr)
        return 2
    sys.path.insert(0, str(root))
    import importlib

    return importlib.import_module(f"benchmarks.{name}").main(argv)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m torch_kernels", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command")
    sub.add_parser("check", help="platform, inventory, selection and a self-check (default)")
    b = sub.add_parser("build", help="compile the C++ entry of the norm and activation ops for this torch and TVM-FFI")
    b.add_argument("--verbose", action="store_true", help="show the compiler's commands")
    d = sub.add_parser("docs", help="regenerate docs/ops.md")
    d.add_argument("--check", action="store_true", help="exit 1 if docs/ops.md is out of date")
    sub.add_parser("bench", add_help=False, help="benchmark every op and backend against the peers (bench --help)")
    sub.add_parser("tune", add_help=False, help="measure the backends per shape bucket for DEEPINFER_OPS_BACKEND=auto "
                                                "(tune --help)")
    args, rest = parser.parse_known_args(argv)
    if args.command in ("bench", "tune"):
        return benchmark_script("suite" if args.command == "bench" else "tune", rest)
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    if args.command == "build":
        print(f"C++ entry: {fast_path.build(args.verbose)} (loaded by the next import of torch_kernels)")
        return 0
    if args.command == "docs":
        return docs(args.check)
    return check()


if __name__ == "__main__":
    sys.exit(main())
