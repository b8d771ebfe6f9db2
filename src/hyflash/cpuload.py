"""How busy the CPU is with other processes, so that decoding does not fight them for cores.

torch's parallel regions (and our kernels, which run in torch's thread pool) wait at their end for every thread.
When another process holds a core, the thread that lands on it waits for a time slice each region, and a decode
step has hundreds of regions: on our 2-core VM with one core kept busy by a busy loop, ``hyflash generate`` ran at
24.2 tok/s with 2 threads and 52.2 with 1 (``benchmarks/bench_busy_cores.py``, 2026-12-08). So the CLI measures,
while the model loads, how many cores others kept busy, and leaves them those cores.

Linux only (``/proc/stat``); elsewhere every function here says "unknown" (``None``) and nothing changes.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass

# /proc/stat's cpu line: user nice system idle iowait irq softirq steal ... (in clock ticks). Steal is time the
# hypervisor gave our virtual CPUs to someone else: as unavailable to us as a core another process holds.
_BUSY_FIELDS = (0, 1, 2, 5, 6, 7)


@dataclass(frozen=True)
class Snapshot:
    """The machine's busy CPU time, this process's own (with its waited-for children, e.g. a kernel build), and the
    wall clock, all in seconds."""
    busy_s: float
    own_s: float
    wall_s: float


def _busy_seconds(stat_text: str, ticks_per_s: float) -> float:
    for line in stat_text.splitlines():
        if line.startswith("cpu "):
            fields = [int(x) for x in line.split()[1:]]
            return sum(fields[i] for i in _BUSY_FIELDS if i < len(fields)) / ticks_per_s
    raise ValueError("no aggregate 'cpu' line in /proc/stat")


def snapshot() -> Snapshot | None:
    """Now's counters, or None where /proc/stat cannot be read (not Linux)."""
    try:
        with open("/proc/stat") as f:
            text = f.read()
        busy = _busy_seconds(text, float(os.sysconf("SC_CLK_TCK")))
    except (OSError, ValueError, AttributeError):
        return None
    t = os.times()
    return Snapshot(busy, t.user + t.system + t.children_user + t.children_system, time.monotonic())


def others_busy_cores(before: Snapshot | None, after: Snapshot | None, min_wall_s: float = 0.2) -> float | None:
    """How many cores other processes kept busy on average between two snapshots: the machine's busy time less
    ours, over the wall time. None where either snapshot is missing or the interval is too short to say."""
    if before is None or after is None or after.wall_s - before.wall_s < min_wall_s:
        return None
    wall = after.wall_s - before.wall_s
    return max(0.0, ((after.busy_s - before.busy_s) - (after.own_s - before.own_s)) / wall)


def available_cores() -> int:
    """The cores this process may run on (its affinity mask where the OS has one)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def threads_for(current: int, cores: int, others_busy: float | None) -> int:
    """The thread count that leaves other processes the cores they were using: ``current`` where the machine has
    room for it (within half a core), else the cores left free, rounded, at least 1."""
    if others_busy is None:
        return current
    free = cores - others_busy
    if free >= current - 0.5:
        return current
    return max(1, math.floor(free + 0.5))  # below ``current``: free < current − ½


def leave_busy_cores(before: Snapshot | None) -> tuple[int, int, float | None]:
    """Lowers torch's threads (``threads_for``) by the cores other processes kept busy since ``before`` (e.g. taken
    before loading the model): returns (threads before, threads now, the cores others kept busy or None)."""
    import torch

    old = torch.get_num_threads()
    busy = others_busy_cores(before, snapshot())
    new = threads_for(old, available_cores(), busy)
    if new != old:
        torch.set_num_threads(new)
    return old, new, busy
