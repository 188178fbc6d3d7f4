"""``python -m torch_kernels [check|inventory|build|docs|bench|tune]``

* ``check`` (the default): the inventory below, then every usable backend against the reference on
  fresh random inputs. Exits 1 on a mismatch.
* ``inventory``: the platform, the selection, what this platform can run, and one row per op (the
  backends that implement it, the order in which they serve it here, its route under torch.compile).
* ``build``: compile the ops' C++ entry (``fast_path.py``) for this torch
  and TVM-FFI; later imports load it.
* ``docs``: the op reference from the registered schemas and the wrappers' docstrings: written to
  ``docs/ops.md`` of a source checkout, else printed (``--output FILE`` writes it there); ``--check``
  exits 1 if that file is out of date.
* ``bench``: every op x every usable backend x the peers over the shape set
  (``torch_kernels/bench/suite.py``; ``bench --help`` lists its options).
* ``tune``: every usable backend of every op over the shape buckets on this GPU, the winners stored for
  ``DEEPINFER_OPS_BACKEND=auto`` (``torch_kernels/bench/tune.py``; ``tune --help``).
"""

import argparse
import inspect
import os
import sys
import textwrap
import warnings
from pathlib import Path
from typing import List, Optional, Tuple

import torch

import torch_kernels
from torch_kernels import dispatch, fast_path, ops, registry
from torch_kernels.bench import source_checkout
from torch_kernels.spec import FRAMEWORK_PACKAGE, Backend, Capability, Platform
from torch_kernels.testing import as_dispatched, compare_outputs, mutated_args, outputs_of

#: The terminal width the inventory is laid out for.
WIDTH = 100
#: The inventory's marks for a backend of an op.
NOT_IMPLEMENTED, NOT_USABLE, NOT_SELECTED = "-", "no", "off"


def _compiled_route(op: str, platform: Platform) -> Tuple[str, Optional[str]]:
    """The op's route under torch.compile on CUDA (docs/compile.md), resolved against ``platform``
    when it has CUDA, and the notice when it is not the route asked for ("opaque (note)", the notice
    under the table saying which route was asked and why it is not taken):
    "(forced)" when set by DEEPINFER_OPS_COMPILE_ROUTE or configure(), "*" for the ops of
    registry.DECOMPOSE_AFTER_POINTWISE."""
    forced = dispatch.selection().forced_route(op)
    asked = forced or registry.COMPILE_ROUTE[op]
    route, notice = dispatch.compile_route(op, "cuda", platform) if platform.is_cuda else (asked, None)
    if route != asked:
        return f"{route} (note)", notice
    return asked + (" (forced)" if forced else "*" if op in registry.DECOMPOSE_AFTER_POINTWISE else ""), notice


def _backends() -> List[Backend]:
    """The backends of the inventory, in the default CUDA order (the table's columns)."""
    return [b for b in registry.DEFAULT_CUDA_PRIORITY if registry.ops_of(b)]


def _usable_here(platform: Platform) -> List[str]:
    """What this platform can run, said once: each backend usable here, and why the others are not
    (for every op they implement, or for those named)."""
    usable, unusable = [], {}
    for b in _backends():
        ops_of = registry.ops_of(b)
        reasons = {}
        for op in ops_of:
            why = registry.BY_OP[op][b].unavailable_reason(platform)
            if why is not None:
                reasons.setdefault(why, []).append(op)
        runs = len(ops_of) - sum(len(o) for o in reasons.values())
        if runs:
            usable.append(f"{b.value} ({'every op' if runs == len(registry.OPS) else f'{runs} ops'})")
        for why, o in reasons.items():
            unusable.setdefault(why + ("" if len(o) == len(ops_of) else f" (for {', '.join(o)})"), []).append(b.value)
    lines = [f"usable here: {', '.join(usable) or 'nothing'}"]
    lines += [f"not usable here: {', '.join(backends)}: {why}" for why, backends in unusable.items()]
    if not platform.is_cuda:
        lines.append(f"on {platform.device_type} every op is served by the torch reference (CUDA tensors go to the "
                     "backends above)")
    return lines


def _inventory(platform: Platform) -> List[tuple]:
    """The per-op table: a header row, then per op its name, one cell per backend (its place in the
    order the op's dispatch tries them here, 1 first; "no": implemented, not usable here; "off":
    usable but not selected; "-": not implemented) and its compiled route."""
    backends = _backends()
    rows = [("op", *(b.value for b in backends), "compiled route")]
    for op in registry.OPS:
        chain, _ = dispatch.plan(op, platform)
        order = {k.backend: str(i + 1) for i, k in enumerate(chain)}
        cells = []
        for b in backends:
            spec = registry.BY_OP[op].get(b)
            cells.append(NOT_IMPLEMENTED if spec is None else order.get(b) or
                         (NOT_USABLE if not spec.is_available(platform) else NOT_SELECTED))
        rows.append((op, *cells, _compiled_route(op, platform)[0]))
    return rows


def _inventory_notes(platform: Platform) -> List[str]:
    """The notices of the table's rows (an op served otherwise than selected, a route not taken), one
    line for the ops that share a notice."""
    shared = {}
    for op in registry.OPS:
        chain, notice = dispatch.plan(op, platform)
        for text in (notice if chain else notice and f"{op!r}: served by nothing: {notice}",
                     _compiled_route(op, platform)[1]):
            if text:
                shared.setdefault(text.replace(f"op {op!r}", "{}").replace(repr(op), "{}"), []).append(op)
    return [(template if "{}" in template else "{}: " + template).format(
        "every op" if len(o) == len(registry.OPS) else ("op " if len(o) == 1 else "ops ") + ", ".join(map(repr, o)))
        for template, o in shared.items()]


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


def _wrap(text: str, indent: str = "") -> str:
    return textwrap.fill(text, WIDTH, initial_indent=indent, subsequent_indent=" " * len(indent) + "  ",
                         break_on_hyphens=False, break_long_words=False)


def inventory(platform: Platform) -> None:
    """Print the platform, the selection, what this platform can run and the per-op table."""
    sel = dispatch.selection()
    print(f"torch_kernels {torch_kernels.__version__}, torch {torch.__version__}, platform: {platform}")
    print(_wrap(f"selection: backend={'auto' if sel.auto else sel.backend.value if sel.backend else 'platform default'}"
                f" fallback={','.join(sorted(sel.fallback)) or '-'} strict={sel.strict} trace={sel.trace_path or '-'}"
                f"{' (with args)' if sel.trace_args else ''}"
                f" compile_route={','.join(f'{op}={r}' for op, r in sel.compile_route) or 'measured'}"))
    print("\n".join(_wrap(line) for line in _usable_here(platform)) + "\n")
    print(_table(_inventory(platform)))
    print(_wrap(f"1, 2, ...: the order in which the op's dispatch tries its backends here; {NOT_USABLE}: not usable here "
                f"(above); {NOT_SELECTED}: usable, not selected; {NOT_IMPLEMENTED}: not implemented. Compiled route: "
                "under torch.compile on CUDA; * decomposes where a pointwise op computes its input"
                + ("" if platform.is_cuda else "; elsewhere inductor_triton decomposes and the in-place norms stay "
                   "opaque") + " (docs/compile.md)"))
    for note in _inventory_notes(platform) + [n for f in registry.FAMILIES for n in f.notes]:
        print(_wrap(note, "  note: "))
    print()
    print(_wrap(f"C++ entry: {fast_path.status()}; serves the eager CUDA calls TileLang serves of {', '.join(fast_path.SERVED)}, "
                f"and by recorded Triton launches those of {', '.join(fast_path.RECORDED)}"))
    written = [op for op in registry.OPS if any(k.out for k in registry.implementations(op))]
    print(_wrap(f"out overloads the CUDA kernels write themselves: {', '.join(written)}; the others, and calls "
                "whose outputs are strided, misaligned or meet an input, copy the result (docs/ops.md)"))
    if sel.auto:
        print(_auto_choices(platform))


CHECK_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _compile_tilelang_in_parallel(platform: Platform, device: str) -> int:
    """Run every TileLang kernel of the self-check once, from a pool of threads, before the check: each
    first call compiles (nvcc, ~3 s), a subprocess, so threads overlap them (6 kernels on 2 cores: 11.7 s
    against 19.0 in turn). Errors are left to the check, which calls the same kernels again (from the
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
    print()
    print(_wrap(f"self-check on {device}: each row runs fp32, fp16 and bf16 samples through one implementation and "
                "compares its outputs with the torch reference's"))
    if not platform.is_cuda:
        print(_wrap(f"on {device} the registered op (torch.ops.deepinfer.*) is served by the reference itself: its "
                    "rows check the registration (schema, wrapper, dispatch), not a kernel"
                    + ("; Triton's kernels run in its interpreter" if interpret_triton else
                       "; with triton installed (the triton extra) its kernels would run in its interpreter"
                       if "triton" not in sys.modules else "")))
    checks = []
    for op in ops.ALL:
        overload = getattr(torch.ops.deepinfer, op.name).default
        chain, _ = dispatch.plan(op.name, platform)
        serves = chain[0].backend.value if chain else "nothing"
        # backends called directly, the calls they refuse going to the reference as in the dispatcher
        candidates = [("registered op", f"registered op (serves {serves}) vs reference", overload)] + [
            (k.backend.value, f"{k.backend.value} vs reference", as_dispatched(k))
            for k in registry.implementations(op.name) if k.backend is not Backend.TORCH and k.is_available(platform)]
        if interpret_triton and Backend.TRITON in registry.BY_OP[op.name]:
            candidates.append(("triton (interpreted)", "triton (interpreted) vs reference",
                               registry.BY_OP[op.name][Backend.TRITON].load()))
        for name, label, fn in candidates:
            if (op.name, name) in own_stream:
                label = f"{name}: ids in the reference's kept set"
            checks.append((op, name, label, fn))
    width = max(len(label) for _, _, label, _ in checks)
    for op in ops.ALL:
        mutated = mutated_args(getattr(torch.ops.deepinfer, op.name).default)
        reference = registry.BY_OP[op.name][Backend.TORCH].load()
        for _, name, label, fn in (c for c in checks if c[0] is op):
            bad = []
            for dtype in CHECK_DTYPES:
                for args in op.samples(device, dtype):
                    try:
                        if (op.name, name) in own_stream:  # its own random stream: what the op may draw
                            op.check_draw(args, fn(*args))
                            continue
                        compare_outputs(op, outputs_of(fn, args, mutated), outputs_of(reference, args, mutated), dtype)
                    except AssertionError as e:
                        bad.append(f"{dtype} {tuple(args[op.data_arg].shape)}: {str(e).splitlines()[0]}")
            failures += bool(bad)
            status = "ok" if not bad else "MISMATCH " + ", ".join(bad)
            print(f"  {op.name:31s}  {label:{width}s}  {status}")
    print(f"\nFAILED: {failures} of {len(checks)} rows mismatch" if failures else
          f"\nall backends match the reference ({len(checks)} rows)")
    return failures


def check() -> int:
    platform = Platform.detect()
    dispatch.set_platform(platform)
    inventory(platform)
    return 1 if _self_check(platform) else 0


def render_ops_doc() -> str:
    """docs/ops.md: the registered schema and the wrapper's docstring of every op."""
    out = ["# Op reference", "",
           "Generated by `python -m torch_kernels docs` from the registered schemas and the wrappers'",
           "docstrings; `tests/test_registration.py` fails when it is out of date. Do not edit by hand.", "",
           "Every op that returns tensors also has an `out` overload (aten's convention), listed under it:",
           "`torch.ops.deepinfer.<op>.out(*args, out=t)` writes the op's result into `t` (of its shape, dtype",
           "and device, checked first) and returns it. On CUDA the kernel writes `t` itself where the serving",
           "backend does (`Out: written by` below) and `t` is contiguous (FP8 group scales: in the layout",
           "`column_major_scales` asks), 16-byte aligned and apart from the inputs; otherwise, on other devices",
           "and compiled, the default overload's result is copied into `t`. An op that also writes an argument",
           "(the fused-add FP8 norms' `residual`) still writes it, and refuses a `t` sharing memory with it.", ""]
    for op in ops.ALL:
        schema = str(getattr(torch.ops.deepinfer, op.name).default._schema)
        if op.out_names:
            schema += "\n" + str(getattr(torch.ops.deepinfer, op.name).out._schema)
        impls = ", ".join(k.backend.value for k in registry.implementations(op.name))
        writers = ", ".join(k.backend.value for k in registry.implementations(op.name) if k.out)
        written = [f"Out: written by {writers}" if writers else "Out: a copy of the result"] if op.out_names else []
        out += [f"## `{op.name}`", "", "```", schema, "```", "",
                f"Python: `torch_kernels.{op.name}{inspect.signature(op.wrapper)}`  ",
                f"Backends: {impls}" + ("  " if written else ""), *written, "",
                inspect.cleandoc(op.wrapper.__doc__), ""]
        for alias in op.aliases:
            out += [f"Also `torch_kernels.{alias.__name__}{inspect.signature(alias)}`: "
                    + inspect.cleandoc(alias.__doc__), ""]
    return "\n".join(out)


def docs(check_only: bool, output: Optional[str]) -> int:
    """Write the op reference to ``output`` ("-": stdout), else to docs/ops.md of the source checkout,
    else to stdout; ``check_only``: exit 1 if that file differs (outside a checkout a file must be named)."""
    root = source_checkout()
    path = Path(output) if output and output != "-" else root / "docs" / "ops.md" if root and not output else None
    if check_only:
        if path is None:
            print("docs --check compares docs/ops.md of a source checkout, and this installation has none (the file is "
                  "not part of the package): name a file to compare with --output FILE", file=sys.stderr)
            return 2
        if (path.read_text() if path.is_file() else "") != render_ops_doc():
            again = "python -m torch_kernels docs" + (f" --output {output}" if output else "")
            print(f"{path} is out of date: `{again}` rewrites it", file=sys.stderr)
            return 1
        print(f"{path} is up to date")
        return 0
    text = render_ops_doc()
    if path is None:
        sys.stdout.write(text)
        if not output:
            print("\n[docs] no source checkout here (docs/ops.md is not part of the package): printed the op "
                  "reference; --output FILE writes it to a file", file=sys.stderr)
        return 0
    path.write_text(text)
    print(f"wrote {path}")
    return 0


def build(verbose: bool) -> int:
    """Build the C++ entry; what is missing, or the compiler's error, in a message instead of a traceback."""
    if fast_path.library_path() is None:
        print("build: the C++ entry calls TileLang's kernels through TVM-FFI, which is not installed: "
              "pip install apache-tvm-ffi (the tilelang extra brings it)", file=sys.stderr)
        return 1
    try:
        path = fast_path.build(verbose)
    except FileNotFoundError as e:  # no compiler at $CXX / c++
        print(f"build: no C++ compiler: {e.filename or e} not found (set $CXX, or install g++)", file=sys.stderr)
        return 1
    except RuntimeError as e:
        print(f"build: {e}", file=sys.stderr)
        return 1
    print(f"C++ entry: {path} (loaded by the next import of torch_kernels)")
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m torch_kernels", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command")
    sub.add_parser("check", help="the inventory, then a self-check of every usable backend (the default)")
    sub.add_parser("inventory", help="platform, selection and one row per op, without the self-check")
    b = sub.add_parser("build", help="compile the ops' C++ entry for this torch and TVM-FFI")
    b.add_argument("--verbose", action="store_true", help="show the compiler's commands")
    d = sub.add_parser("docs", help="the op reference: docs/ops.md of a source checkout, else printed")
    d.add_argument("--output", metavar="FILE", help="write it to FILE ('-': print it) instead")
    d.add_argument("--check", action="store_true", help="exit 1 if docs/ops.md (or --output FILE) is out of date")
    sub.add_parser("bench", add_help=False, help="benchmark every op and backend against the peers (bench --help)")
    sub.add_parser("tune", add_help=False, help="measure the backends per shape bucket for DEEPINFER_OPS_BACKEND=auto "
                                                "(tune --help)")
    args, rest = parser.parse_known_args(argv)
    if args.command == "bench":
        from torch_kernels.bench import suite

        return suite.main(rest)
    if args.command == "tune":
        from torch_kernels.bench import tune

        return tune.main(rest)
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    if args.command == "build":
        return build(args.verbose)
    if args.command == "docs":
        return docs(args.check, args.output)
    if args.command == "inventory":
        platform = Platform.detect()
        dispatch.set_platform(platform)
        inventory(platform)
        return 0
    return check()


if __name__ == "__main__":
    sys.exit(main())
