"""Measured backend choice: the table behind ``DEEPINFER_OPS_BACKEND=auto``.

``python -m torch_kernels tune`` (``torch_kernels/bench/tune.py``) times every usable backend of every op over
shape buckets on this GPU and stores the winners here; with ``DEEPINFER_OPS_BACKEND=auto`` each op's
CUDA entry dispatches every call to the winner of its bucket (``dispatch.OpSlot``).

A bucket is (dtype, width, rows) of the op's data argument: the dtype, the last dimension, and the
number of rows, ``numel // width`` (tokens for the norms, activations, quant and rope, tokens x heads
for the merge, batch rows for sampling). A call takes the winner of the nearest tuned width (on a log
scale) of its dtype, and of the nearest tuned row count (boundaries at the geometric means between
the tuned counts); a dtype never tuned takes the platform default.

The table is one JSON file per GPU model, ``<gpu>-sm<cc>.json``, looked up in ``DEEPINFER_OPS_TUNE_DIR``
(default ``~/.cache/torch_kernels/tune``), then among the tables shipped in ``torch_kernels/tuned/``. It
is keyed by the GPU name, the compute capability and the versions of torch, torch_kernels and each
backend: a table whose key differs (stale), that does not parse (corrupt), that misses fields, has
fields of the wrong type or names unknown ops or backends (partial), that is not a regular file (a FIFO,
a device) or that is larger than :data:`MAX_TABLE_BYTES` is ignored with one notice when it is looked
up, once per selection, and the platform default serves. Writers merge into the file under an exclusive
lock (a ``.lock`` file beside it, never followed if it is a link, never truncated) and replace it
atomically, so two processes tuning at once leave one complete table.

Each entry records the fingerprint (``fingerprints.py``: its source and launch config) of every backend
timed for it. An entry measured another kernel than the one installed, its winner's fingerprint absent
(a schema-1 table) or different, is stale: under ``auto`` its bucket takes the platform default, and the
first call of the op says so in one notice naming the op and the backends.
"""

from __future__ import annotations

import bisect
import errno
import fcntl
import json
import math
import os
import re
import stat
import tempfile
from importlib import metadata
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from . import fingerprints, registry
from ._files import open_regular
from .spec import Backend, Platform, __version__

ENV_TUNE_DIR = "DEEPINFER_OPS_TUNE_DIR"
SCHEMA = 2
#: schema 1: entries without fingerprints, read as stale
READ_SCHEMAS = (1, 2)
PACKAGED_DIR = Path(__file__).resolve().parent / "tuned"
#: A backend other than the platform default's wins a bucket only when it is faster by more than this
#: fraction: below it the two are within the run-to-run spread of graph replay (about 1% on the H200),
#: and the default keeps the bucket.
MIN_GAIN = 0.01
_DISTRIBUTIONS = {Backend.TRITON: "triton", Backend.TILELANG: "tilelang", Backend.FLASHINFER: "flashinfer-python"}
_MEMO_LIMIT = 1 << 16  # (dtype, shape) pairs remembered per op, then forgotten all at once
#: the largest table file read: the shipped H200 table is 31 KB (1780 lines) for 232 buckets
MAX_TABLE_BYTES = 8 << 20
_MAX_EXTENT = 1 << 62  # width and rows: the product of two stays a float for the bucket bounds
_NOTICE_CHARS = 200  # of a field quoted in a notice


class TableError(ValueError):
    """Why a table file cannot be used (corrupt, partial, stale): the notice names the file."""


def _version(distribution: str) -> Optional[str]:
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


def table_key(platform: Platform) -> Dict[str, object]:
    """What a table was measured on: a table answers only the same GPU and versions."""
    key: Dict[str, object] = {"gpu": platform.device_name,
                              "capability": ".".join(map(str, platform.compute_capability or ())),
                              "torch_kernels": __version__}
    import torch

    key["torch"] = torch.__version__  # the running build (a local version suffix included)
    for backend in (Backend.TRITON, Backend.TILELANG, Backend.FLASHINFER):
        key[backend.value] = _version(_DISTRIBUTIONS[backend])
    return key


def file_name(platform: Platform) -> str:
    gpu = re.sub(r"[^a-z0-9]+", "-", platform.device_name.lower()).strip("-") or "gpu"
    return f"{gpu}-sm{''.join(map(str, platform.compute_capability or ()))}.json"


def user_dir() -> Path:
    env = os.environ.get(ENV_TUNE_DIR)
    if env:
        return Path(env)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "torch_kernels" / "tune"


def bucket_features(x) -> Tuple[str, int, int]:
    """(dtype, width, rows) of a data argument: the axes of the table."""
    width = int(x.shape[-1]) if x.dim() else 1
    return str(x.dtype).replace("torch.", ""), width, x.numel() // (width or 1)


def current_fingerprint(op: str, backend: str) -> str:
    """The fingerprint of the installed implementation of ``op`` by ``backend``."""
    return fingerprints.of(registry.BY_OP[op][Backend(backend)])


class Table:
    """A validated table: per op, per dtype, per tuned width, the tuned row counts and their winners
    (``None`` where the entry is stale, once :meth:`stale` has checked the op)."""

    def __init__(self, key: dict, entries: List[dict], path: Optional[Path] = None) -> None:
        self.key, self.entries, self.path = key, entries, path
        self.ops: Dict[str, Dict[str, Dict[int, List[Tuple[int, Optional[str]]]]]] = {}
        self._stale: Dict[str, Dict[str, int]] = {}
        for e in entries:
            per_width = self.ops.setdefault(e["op"], {}).setdefault(e["dtype"], {})
            per_width.setdefault(e["width"], []).append((e["rows"], e))
        for per_dtype in self.ops.values():
            for per_width in per_dtype.values():
                for w, points in per_width.items():
                    per_width[w] = sorted(dict(points).items())

    def stale(self, op: str) -> Dict[str, int]:
        """{backend: buckets} of the entries of ``op`` whose winner's recorded fingerprint is not the
        installed implementation's; checked once per op (the op's files read then), after which those
        buckets' winners are ``None``: the platform default."""
        found = self._stale.get(op)
        if found is None:
            found, current = {}, {}
            for per_width in self.ops.get(op, {}).values():
                for w, points in per_width.items():
                    checked = []
                    for rows, e in points:
                        winner = e["winner"]
                        if winner not in current:
                            current[winner] = current_fingerprint(op, winner)
                        if (e.get("fingerprints") or {}).get(winner) != current[winner]:
                            found[winner] = found.get(winner, 0) + 1
                            winner = None
                        checked.append((rows, winner))
                    per_width[w] = checked
            self._stale[op] = found
        return found

    def stale_notice(self, op: str) -> Optional[str]:
        """The one line that says which winners of ``op`` are stale, or ``None``."""
        stale = self.stale(op)
        if not stale:
            return None
        where = ", ".join(f"{b} ({n} bucket{'s' * (n > 1)})" for b, n in sorted(stale.items()))
        return (f"tuned table {self.path or '(in memory)'}: op {op!r}: entries of {where} were measured on another "
                "kernel than the one installed (its fingerprint differs or is not recorded) and are ignored: those "
                "buckets take the platform default (python -m torch_kernels tune measures them again)")

    @classmethod
    def from_json(cls, data: object, path: Optional[Path] = None) -> "Table":
        """Validate a parsed table whole (every field a lookup reads, of its type and range) and index it;
        :class:`TableError` says what is wrong, so that no call under ``auto`` can fail on the table."""
        if not isinstance(data, dict) or type(data.get("schema")) is not int or data["schema"] not in READ_SCHEMAS:
            raise TableError(f"not a schema-{'/'.join(map(str, READ_SCHEMAS))} table")
        key, entries = data.get("key"), data.get("entries")
        if not isinstance(key, dict) or not isinstance(entries, list):
            raise TableError("partial: no key or no entries")
        if not all(isinstance(k, str) and (v is None or isinstance(v, str)) for k, v in key.items()):
            raise TableError("partial: the key's fields are not all strings")
        known = {b.value for b in Backend}
        for i, e in enumerate(entries):
            if not isinstance(e, dict):
                raise TableError(f"partial: entry {i} is not an object")
            op, winner = e.get("op"), e.get("winner")
            if not isinstance(op, str) or op not in registry.BY_OP:
                raise TableError(f"entry {i} names unknown op {_quote(op)}")
            if not isinstance(winner, str) or winner not in known or Backend(winner) not in registry.BY_OP[op]:
                raise TableError(f"entry {i} ({op}) names backend {_quote(winner)}, which does not implement it")
            if not (isinstance(e.get("dtype"), str) and _extent(e.get("width"), 1) and _extent(e.get("rows"), 0)):
                raise TableError(f"partial: entry {i} ({op}) lacks dtype, width or rows")
            prints = e.get("fingerprints")
            if prints is not None and not (isinstance(prints, dict) and all(
                    isinstance(b, str) and isinstance(f, str) for b, f in prints.items())):
                raise TableError(f"partial: entry {i} ({op}): fingerprints is not an object of strings")
        return cls(key, entries, path)

    def to_json(self) -> dict:
        return {"schema": SCHEMA, "key": self.key, "entries": self.entries}

    def summary(self, op: str) -> str:
        """One line: the winners of ``op`` per dtype and width, by tuned row count (``stale`` where ignored)."""
        self.stale(op)
        parts = []
        for dtype, per_width in sorted(self.ops.get(op, {}).items()):
            for width, points in sorted(per_width.items()):
                parts.append(f"{dtype} w{width}: " + " ".join(f"{r}:{b or 'stale'}" for r, b in points))
        return "; ".join(parts)


def _clip(text: str) -> str:
    return text if len(text) <= _NOTICE_CHARS else text[:_NOTICE_CHARS] + "..."


def _quote(value: object) -> str:
    return _clip(repr(value))


def _extent(value: object, least: int) -> bool:
    """A width (``least`` 1) or row count (0): an int, not a bool, in range."""
    return type(value) is int and least <= value <= _MAX_EXTENT


def _read_bytes(path: Path) -> bytes:
    """The file's bytes, refusing what is not a regular file (a FIFO or ``/dev/zero`` would block or never
    end) or is larger than :data:`MAX_TABLE_BYTES`, without blocking: a link to a regular file is read."""
    try:
        fd = open_regular(path, MAX_TABLE_BYTES)
    except ValueError as e:
        raise TableError(str(e)) from None
    with os.fdopen(fd, "rb") as f:
        try:
            data = f.read(MAX_TABLE_BYTES + 1)
        except OSError as e:
            raise TableError(f"unreadable: {e.strerror or e}") from None
    if len(data) > MAX_TABLE_BYTES:  # it grew after the fstat
        raise TableError(f"larger than the {MAX_TABLE_BYTES} bytes read")
    return data


def _read(path: Path, key: dict) -> Table:
    data = _read_bytes(path)
    try:
        parsed = json.loads(data.decode("utf-8"))
    # ValueError: JSONDecodeError, or an int of more than sys.get_int_max_str_digits() (4300) digits;
    # RecursionError: nesting deeper than the interpreter's recursion limit
    except (UnicodeDecodeError, ValueError, RecursionError, MemoryError) as e:
        raise TableError(f"corrupt: {type(e).__name__}: {str(e)[:120]}") from None
    table = Table.from_json(parsed, path)
    if table.key != key:
        diff = sorted(k for k in set(key) | set(table.key) if key.get(k) != table.key.get(k))
        raise TableError("stale: tuned for " + ", ".join(f"{k} {_clip(str(table.key.get(k)))}" for k in diff)
                         + "; here " + ", ".join(f"{k} {key.get(k)}" for k in diff))
    return table


def find(platform: Platform) -> Tuple[Optional[Table], List[str]]:
    """The table for this platform (the user's, else a shipped one) and the notices of the files
    looked at and ignored; ``(None, [why])`` when there is none."""
    key, name, notices = table_key(platform), file_name(platform), []
    for folder in (user_dir(), PACKAGED_DIR):
        path = folder / name
        if not os.path.lexists(path):
            continue
        try:
            return _read(path, key), notices
        except TableError as e:
            notices.append(f"tuned table {path} ignored ({e})")
        except Exception as e:  # a table never makes a call fail: whatever was missed, the default serves
            notices.append(f"tuned table {path} ignored (unusable: {type(e).__name__}: {_clip(str(e))})")
    if not notices:
        notices.append(f"no tuned table for {platform.device_name} sm_{''.join(map(str, platform.compute_capability or ()))}"
                       f" in {user_dir()} or {PACKAGED_DIR}")
    return None, notices


def save(entries: List[dict], key: dict, path: Path) -> Table:
    """Merge ``entries`` into the table at ``path`` (kept where its key matches; a new measurement of a
    bucket replaces the old) under an exclusive lock, and replace the file atomically."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with _lock_file(Path(str(path) + ".lock")) as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        merged: Dict[tuple, dict] = {}
        if path.exists():
            try:
                old = _read(path, key)
                merged = {(e["op"], e["dtype"], e["width"], e["rows"]): e for e in old.entries}
            except TableError:
                pass  # stale or corrupt: replaced whole
        merged.update({(e["op"], e["dtype"], e["width"], e["rows"]): e for e in entries})
        table = Table.from_json({"schema": SCHEMA, "key": key, "entries": sorted(merged.values(), key=lambda e: (
            e["op"], e["dtype"], e["width"], e["rows"]))}, path)
        text = json.dumps(table.to_json(), indent=1)
        if len(text.encode()) > MAX_TABLE_BYTES:
            raise ValueError(f"tuned table {path}: {len(table.entries)} entries are more than the {MAX_TABLE_BYTES} bytes read back")
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
        try:
            with os.fdopen(fd, "w") as f:
                f.write(text)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            os.unlink(tmp)
            raise
    return table


def _lock_file(path: Path):
    """The lock beside a table, opened for writing without following a link (whose target ``"w"`` would
    truncate), without truncating, and without blocking on a FIFO; refused unless a regular file."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o644)
    except OSError as e:
        why = "it is a symbolic link" if e.errno == errno.ELOOP else "it is a FIFO" if e.errno == errno.ENXIO else e.strerror
        raise OSError(e.errno, f"tuning lock {path} not opened: {why}") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise OSError(errno.EINVAL, f"tuning lock {path} not opened: not a regular file")
    return os.fdopen(fd, "w")


def _bounds(rows: Sequence[int]) -> List[float]:
    """Boundaries between consecutive tuned row counts: their geometric means (rows 0 counts as 1)."""
    return [math.sqrt(max(a, 1) * max(b, 1)) for a, b in zip(rows, rows[1:])]


def winner(table: Table, op: str, x) -> Optional[Tuple[str, str]]:
    """(backend, bucket) the table names for data argument ``x`` of ``op``, or ``None`` (dtype or op
    not tuned, or the bucket's entry stale): the nearest tuned width of its dtype (log scale), the nearest
    tuned row count."""
    table.stale(op)
    dtype, width, rows = bucket_features(x)
    widths = table.ops.get(op, {}).get(dtype)
    if not widths:
        return None
    nearest = min(widths, key=lambda w: (abs(math.log(w) - math.log(max(width, 1))), w))
    points = widths[nearest]
    bounds = _bounds([r for r, _ in points])
    i = bisect.bisect_right(bounds, rows)
    lo = 0 if i == 0 else math.ceil(bounds[i - 1])
    hi = "" if i == len(bounds) else math.ceil(bounds[i]) - 1
    if points[i][1] is None:
        return None
    return points[i][1], f"{dtype} width {nearest} rows {lo}..{hi} (tuned at {points[i][0]})"


def auto_call(table: Table, op: str, data_arg: int,
              chains: Dict[Backend, Tuple[Callable, Callable[[tuple], Optional[Callable]]]], default: Callable,
              trace: Callable[[str, str], None], notice: Callable[[str], None] = lambda line: None
              ) -> Optional[Callable]:
    """The CUDA entry's per-call function under ``auto``: each call to its bucket's winner. ``chains``:
    per usable backend, the chain with that backend first and ``direct(args)``, the backend function
    itself when it takes every call of that dtype (else ``None``); ``default``: the platform default's
    chain, for buckets with no winner usable here. ``trace(backend, bucket)`` runs when a bucket is
    first chosen; ``notice(line)`` once, here, when entries of ``op`` are stale (:meth:`Table.stale`).
    ``None`` if the table has nothing for ``op``.

    The choice is remembered per (dtype, shape) of the data argument, as the backend function itself
    where it can be, so a shape seen before costs one dict lookup: it added 0.37 µs a call on the CPU
    machine (``benchmarks/bench_tuning_lookup.py``), where computing the bucket each call added 0.6
    (``x.shape[-1]`` and ``x.numel()`` take 0.1-0.2 µs each there)."""
    if not table.ops.get(op):
        return None
    line = table.stale_notice(op)
    if line:
        notice(line)
    traced: set = set()
    memo: Dict[tuple, Callable] = {}

    def resolve(x, args: tuple) -> Callable:
        chosen = winner(table, op, x)
        if chosen is None:
            fn = default
        else:
            backend, bucket = chosen
            chain, direct = chains.get(Backend(backend), (default, None))
            fn = (direct and direct(args)) or chain
            if bucket not in traced:
                traced.add(bucket)
                trace(backend if chain is not default else "platform default", bucket)
        if len(memo) >= _MEMO_LIMIT:
            memo.clear()
        memo[(x.dtype, x.shape)] = fn
        return fn

    get = memo.get

    def call(*args):
        x = args[data_arg]
        fn = get((x.dtype, x.shape))
        if fn is None:
            fn = resolve(x, args)
        return fn(*args)
    return call
