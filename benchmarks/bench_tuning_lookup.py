"""What ``DEEPINFER_OPS_BACKEND=auto`` adds to a call on a shape seen before: the bucket lookup of
``tuning.auto_call`` over a do-nothing kernel, beside the same wrapper without the lookup, in short
interleaved rounds (``torch_kernels/bench/tune.py:lookup_cost_us``). Runs on any machine, GPU or not.

    python benchmarks/bench_tuning_lookup.py [--rounds 31]
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from torch_kernels.bench import tune  # noqa: E402

# 0.37 µs added on a 2-core CPU machine, 0.40 on the H200 host: above 0.5 is worth a look
GOAL_ADDED_US = 0.5


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=31, help="interleaved rounds (default 31)")
    args = parser.parse_args(argv)
    cost = tune.lookup_cost_us(args.rounds)
    added = cost.auto_us - cost.bare_us
    print(f"auto: {cost.auto_us:.3f} µs a call, the same wrapper without the lookup {cost.bare_us:.3f}: the lookup adds "
          f"{added:.3f} µs ({cost.added_ratio:.2f} bare calls, median of {args.rounds} rounds); "
          f"goal under {GOAL_ADDED_US} µs: {'met' if added < GOAL_ADDED_US else 'not met'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
