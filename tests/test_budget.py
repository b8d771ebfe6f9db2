"""The memory-budget calculator: the paper's derivable figures, and computed bytes equal to what our runtime holds."""

import subprocess
import sys

import pytest
import torch

from conftest import tiny_gemma3, tiny_llama
from hyflash import HyflashError
from hyflash.budget import (GiB, MiB, Budget, DrafterGeometry, TargetGeometry, load_target_geometry,
                            measure_drafter_context, measure_target_kv, paper_drafter_for)
from hyflash.drafter.config import DrafterConfig
from hyflash.drafter.model import HyFlashDrafter


def test_paper_figures_for_the_phi4_reasoning_geometry():
    t = load_target_geometry("phi-4-reasoning")
    assert (t.layers, t.kv_heads, t.head_dim, t.tied) == (40, 10, 128, False)
    assert abs(t.params() / 1e9 - 14.66) < 0.01          # Phi-4 is a 14.7B-parameter model
    assert t.kv_bytes(32768) == 6.25 * GiB                # target KV at 32K (DESIGN §5)
    d = paper_drafter_for(t)
    assert d.window_kv_bytes(32768) == 2.5 * MiB          # drafter local KV
    assert d.memory_bytes() == 2.5 * MiB                  # drafter fp32 recurrent state
    assert d.context_bytes(512) == d.context_bytes(32768)  # constant in the context length
    b = Budget(t, d, 32768, weight_bits=2, budget_gib=12)
    assert b.left() == pytest.approx(12 * GiB - b.total) and 0 < b.left() < 12 * GiB
    assert any("not counted" in a for a in b.assumptions())


def test_sliding_layers_hold_at_most_their_window():
    cfg = {"num_hidden_layers": 4, "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 1,
           "head_dim": 16, "intermediate_size": 128, "vocab_size": 100, "sliding_window": 8,
           "layer_types": ["sliding_attention", "full_attention"] * 2}
    t = TargetGeometry.from_config({"text_config": cfg})
    assert t.layer_windows == [8, None, 8, None]
    per = 2 * 1 * 16 * 2  # k and v, one KV head of 16, bf16
    assert t.kv_bytes(100) == per * (8 + 100 + 8 + 100)
    with pytest.raises(HyflashError):
        TargetGeometry.from_config({"hidden_size": 8})


@pytest.mark.parametrize("make", [tiny_llama, tiny_gemma3])
def test_computed_target_bytes_equal_what_the_model_holds(make):
    target = make(dtype=torch.float32)
    t = TargetGeometry.from_config(target.model.config.to_dict(), name=target.name)
    assert t.params() == sum(p.numel() for p in target.model.parameters())
    # The transformers path keeps the full history on sliding-window layers too (past recording, so that a rejected
    # block can be rolled back exactly): measured bytes are the all-global figure, above the calculator's windowed
    # one. (Our lean path's static cache drops what the windows no longer see: tests/test_native.py.)
    held = TargetGeometry(**{**t.__dict__, "layer_windows": [None] * t.layers})
    for n in (5, 40):
        assert measure_target_kv(target, n) == held.kv_bytes(n, kv_bits=32) >= t.kv_bytes(n, kv_bits=32)
    if any(t.layer_windows):
        assert held.kv_bytes(40, kv_bits=32) > t.kv_bytes(40, kv_bits=32)


EXTRAS = {"plain": {}, "lags-copy": dict(context_lags=3, copy_head_rank=4),
          "copymem": dict(copy_head_rank=4, copy_memory=True),  # the copy memory needs a memory: hyflash only
          "copymem-dpfp": dict(copy_head_rank=4, copy_memory=True, copy_memory_dpfp=3),
          "copytok": dict(copy_head_rank=4, copy_head_tokens=True)}


@pytest.mark.parametrize("variant,memory,extra", [
    (v, m, e) for v in ("hyflash", "swa", "full") for m in ("mamba2", "gdn") for e in EXTRAS
    if not e.startswith("copymem") or v == "hyflash"])
def test_computed_drafter_bytes_equal_the_runtime_state(variant, memory, extra):
    cfg = DrafterConfig(variant=variant, memory=memory, num_layers=2, window=6, hidden_size=32, num_heads=4,
                        num_kv_heads=2, head_dim=8, intermediate_size=64, memory_heads=2, memory_head_dim=8,
                        memory_state_dim=4, target_layers=[0, 1], target_hidden_size=32, vocab_size=40, **EXTRAS[extra])
    emb = torch.randn(40, 32)
    drafter = HyFlashDrafter(cfg, emb, emb).to(torch.bfloat16)
    g = DrafterGeometry.from_drafter_config(cfg, drafter.num_parameters())
    for n in (3, 50):
        assert measure_drafter_context(drafter, n) == g.context_bytes(n)


def test_cli_prints_assumptions_and_what_is_left(tmp_path):
    run = subprocess.run([sys.executable, "-m", "hyflash.cli", "budget", "--target", "phi-4-reasoning", "--drafter",
                          "paper", "--context", "32768", "--weight-bits", "2", "--budget-gib", "12"],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert "assumptions:" in run.stdout and "6,400.00 MiB" in run.stdout and "left of 12 GiB" in run.stdout
    bad = subprocess.run([sys.executable, "-m", "hyflash.cli", "budget", "--target", str(tmp_path / "nope.json")],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "error:" in bad.stderr
    with pytest.raises(HyflashError):
        Budget(load_target_geometry("phi-4-reasoning"), None, context=0)
