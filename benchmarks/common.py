"""What every benchmark prints next to its figures: machine, date, commit, threads."""

import datetime

from hyflash.evaluation.report import cpu_name
from hyflash.evaluation.runner import git_commit, machine


def machine_line() -> str:
    m = machine()  # the same description `hyflash eval` records in run.json
    return (f"# {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC | {cpu_name(m)} | {m['cores']} cores, "
            f"torch threads {m['torch_threads']} | torch {m['torch']} | kernels {m['kernels']} | commit {git_commit()}")


def median(xs):
    xs = sorted(xs)
    n = len(xs)
    return xs[n // 2] if n % 2 else 0.5 * (xs[n // 2 - 1] + xs[n // 2])


def time_median(fn, repeats: int) -> float:
    """Seconds of fn(), median of ``repeats`` calls after one warm-up call."""
    import time

    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return median(times)
