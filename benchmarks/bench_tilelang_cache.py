"""What TileLang's disk cache saves a process: one kernel compiled for sm_90 into an empty cache by a
fresh process, then loaded from that cache by another, each timed by the trace line of its first use
(``tilelang-compile|<name>|<key>|<seconds>s``). Needs TileLang and nvcc, no GPU.

    python benchmarks/bench_tilelang_cache.py [--rounds 3]
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from torch_kernels import dispatch  # noqa: E402
from torch_kernels.backends import tilelang_jit as _jit  # noqa: E402

_FIRST_USE = """
from torch_kernels.backends import tilelang_jit as _jit
from torch_kernels.families.norm import tilelang as norm
_jit.compiled("rmsnorm", norm._build, 384, "float16", "float32", True, True)
"""


def _first_use_seconds(cache: str, trace: str) -> float:
    env = {**os.environ, "PYTHONPATH": ROOT, _jit.ENV_TARGET: json.dumps(_jit.SM90), "TILELANG_CACHE_DIR": cache,
           dispatch.ENV_TRACE: trace}
    subprocess.run([sys.executable, "-c", _FIRST_USE], cwd=ROOT, env=env, check=True)
    return float(open(trace).read().splitlines()[-1].rsplit("|", 1)[1].rstrip("s"))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3, help="fresh caches (default 3)")
    args = parser.parse_args(argv)
    compiled, loaded = [], []
    for _ in range(args.rounds):
        with tempfile.TemporaryDirectory() as tmp:
            cache, trace = os.path.join(tmp, "cache"), os.path.join(tmp, "trace.txt")
            compiled.append(_first_use_seconds(cache, trace))
            loaded.append(_first_use_seconds(cache, trace))
    print(f"rmsnorm 384 fp16 (fused, gemma) for sm_90: compile {min(compiled):.2f} s, load from the cache "
          f"{min(loaded):.2f} s (best of {args.rounds})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
