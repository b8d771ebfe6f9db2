"""Training on two processes under PyTorch's launcher: gradients are synchronised, only rank 0 writes."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import torch

TESTS = Path(__file__).resolve().parent

SCRIPT = textwrap.dedent("""
    import os, sys
    import torch
    sys.path.insert(0, {tests!r})
    torch.set_num_threads(1)
    from test_train import FakeStore, tiny_config, tiny_target
    from hyflash.train import train

    target = tiny_target()
    store = FakeStore(target)
    drafter = train(tiny_config(steps=4, ckpt_every=2, eval_every=2), {out!r}, target, store)
    torch.save(drafter.state_dict(), os.path.join({out!r}, "..", "rank%s.pt" % os.environ["RANK"]))
""")


def test_two_processes_end_with_identical_weights_and_rank0_writes(tmp_path):
    out = tmp_path / "run"
    script = tmp_path / "ddp_train.py"
    script.write_text(SCRIPT.format(tests=str(TESTS), out=str(out)))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(script)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rank0, rank1 = (torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1))
    assert rank0.keys() == rank1.keys()
    assert all(torch.equal(rank0[k], rank1[k]) for k in rank0)
    ckpts = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert ckpts == ["step_0000002.pt", "step_0000004.pt"]
    ckpt = torch.load(out / "checkpoints" / ckpts[-1], weights_only=False)
    assert all(torch.equal(ckpt["model"][k], rank0[k]) for k in rank0)
    assert ckpt["data_position"] == 4 * 2 * 2  # steps · processes · sequences per process
    steps = [json.loads(line)["step"] for line in (out / "log.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4]  # one writer
    assert (out / "final" / "model.safetensors").exists()
