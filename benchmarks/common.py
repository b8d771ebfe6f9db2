"""What every benchmark prints next to its figures: machine, date, commit, threads."""

import datetime
import os
import platform
import subprocess

import torch


def machine_line() -> str:
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                cwd=os.path.dirname(__file__)).stdout.strip()
    except OSError:
        commit = "?"
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return (f"# {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC | {cpu} | {os.cpu_count()} cores, "
            f"torch threads {torch.get_num_threads()} | torch {torch.__version__} | commit {commit}")


def median(xs):
    xs = sorted(xs)
    n = len(xs)
    return xs[n // 2] if n % 2 else 0.5 * (xs[n // 2 - 1] + xs[n // 2])
