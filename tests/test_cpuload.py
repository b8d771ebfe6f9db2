"""hyflash.cpuload: how many cores other processes keep busy, and the thread count that leaves them those cores."""

import json
import subprocess
import sys
import time

import pytest
import torch

from hyflash import cpuload

BUSY_LOOP = "import time\nt = time.time()\nwhile time.time() - t < {s}: pass\n"


def test_busy_time_is_read_from_the_aggregate_cpu_line():
    stat = ("cpu  100 20 30 1000 50 5 5 40 0 0\n"  # user nice system idle iowait irq softirq steal guest guest_nice
            "cpu0 50 10 15 500 25 2 3 20 0 0\n")
    # busy = user + nice + system + irq + softirq + steal; idle and iowait are free time
    assert cpuload._busy_seconds(stat, 100.0) == pytest.approx((100 + 20 + 30 + 5 + 5 + 40) / 100)
    with pytest.raises(ValueError):
        cpuload._busy_seconds("intr 1 2 3\n", 100.0)


def test_others_busy_cores_is_the_machines_busy_time_less_ours_over_the_wall_time():
    before = cpuload.Snapshot(busy_s=10.0, own_s=1.0, wall_s=100.0)
    after = cpuload.Snapshot(busy_s=14.0, own_s=2.0, wall_s=102.0)  # 4 s busy in 2 s, 1 s of it ours
    assert cpuload.others_busy_cores(before, after) == pytest.approx(1.5)
    # our own work is never someone else's (counters sampled at slightly different moments can cross)
    assert cpuload.others_busy_cores(before, cpuload.Snapshot(10.5, 1.6, 101.0)) == 0.0
    assert cpuload.others_busy_cores(None, after) is None
    assert cpuload.others_busy_cores(before, cpuload.Snapshot(14.0, 2.0, 100.1)) is None  # too short to say


def test_threads_leave_other_processes_their_cores():
    assert cpuload.threads_for(2, 2, None) == 2  # unknown: unchanged
    assert cpuload.threads_for(2, 2, 0.3) == 2  # a little background noise: unchanged
    assert cpuload.threads_for(2, 2, 0.9) == 1
    assert cpuload.threads_for(2, 2, 2.0) == 1  # never below one
    assert cpuload.threads_for(8, 8, 2.2) == 6
    assert cpuload.threads_for(4, 16, 3.0) == 4  # room enough for what torch would use


@pytest.mark.skipif(cpuload.snapshot() is None, reason="needs /proc/stat (Linux)")
def test_a_busy_process_beside_us_is_measured():
    busy = subprocess.Popen([sys.executable, "-c", BUSY_LOOP.format(s=5)])
    try:
        time.sleep(0.5)  # let it start
        before = cpuload.snapshot()
        time.sleep(1.0)
        others = cpuload.others_busy_cores(before, cpuload.snapshot())
    finally:
        busy.kill()
        busy.wait()
    assert others is not None and others >= 0.5  # it holds a whole core; any other load only adds


@pytest.mark.slow
@pytest.mark.skipif(cpuload.snapshot() is None or not 2 <= cpuload.available_cores() <= 8 or torch.get_num_threads() < 2,
                    reason="needs /proc/stat and 2-8 cores that torch uses")
def test_generate_decodes_with_fewer_threads_when_the_cores_are_busy(smollm2_fp32):
    cores = cpuload.available_cores()
    busy = [subprocess.Popen([sys.executable, "-c", BUSY_LOOP.format(s=120)]) for _ in range(cores)]
    try:
        proc = subprocess.run([sys.executable, "-m", "hyflash.cli", "generate", "Name two fruits.", "--json",
                               "--max-new-tokens", "4", "--drafter", "none"], capture_output=True, text=True,
                              timeout=300)
    finally:
        for p in busy:
            p.kill()
            p.wait()
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["stats"]["threads"] == 1
    assert "other processes kept" in proc.stderr and "--threads chooses" in proc.stderr


@pytest.mark.skipif(cpuload.snapshot() is None or cpuload.available_cores() < 2, reason="needs /proc/stat, 2 cores")
def test_leave_busy_cores_lowers_torchs_threads_and_says_by_how_much():
    old = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        now = cpuload.snapshot()
        # a made-up second before now in which others kept every core busy
        before = cpuload.Snapshot(now.busy_s - cpuload.available_cores(), now.own_s, now.wall_s - 1.0)
        was, threads, busy = cpuload.leave_busy_cores(before)
        assert (was, threads) == (2, 1) and torch.get_num_threads() == 1
        assert busy >= cpuload.available_cores() - 0.5
        # nothing known (not Linux): nothing changes
        torch.set_num_threads(2)
        assert cpuload.leave_busy_cores(None) == (2, 2, None) and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(old)
