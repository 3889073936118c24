"""--threads for the side-by-side benchmarks: read from argv and applied BEFORE torch and jax are imported (their
thread pools are fixed at import). Import this module first:

    from bench_threads import N_THREADS   # then import jax, torch, ...; torch.set_num_threads(N_THREADS)

1 (the default, for a shared machine): XLA's CPU client single-threaded (--xla_cpu_multi_thread_eigen=false
intra_op_parallelism_threads=1), and the caller sets torch to one thread. 0: all CPUs this process may use.
"""

from __future__ import annotations

import argparse
import os
import sys


def threads_from_argv(argv) -> int:
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--threads", type=int, default=1)
    n = pre.parse_known_args(argv)[0].threads
    return n if n > 0 else (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count())


N_THREADS = threads_from_argv(sys.argv[1:])
if N_THREADS == 1:
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               " --xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1").strip()
