"""Weights packed once (bf16 inference on CPU: our AMX kernel or oneDNN): the same function as the plain matmul up to
bf16 rounding, for the target's fast path and the drafter; fp32/fp64 fall back to the plain matmul exactly."""

import pytest
import torch
from torch import nn

from conftest import tiny_llama
from hyflash.decoding import generate
from hyflash.drafter.config import DrafterConfig
from hyflash.drafter.model import new_drafter
from hyflash.drafter.state import DrafterState
from hyflash.packed import PackedLinear, pack_linears, unpack_linears
from hyflash.proposers import HyFlashProposer

needs_onednn = pytest.mark.skipif(not PackedLinear(torch.zeros(16, 32, dtype=torch.bfloat16)).is_packed,
                                  reason="neither our AMX kernel nor oneDNN can pack bf16 weights here")


@needs_onednn
@pytest.mark.parametrize("rows", [1, 8, 37])
def test_packed_matmul_matches_plain_bf16_matmul(rows):
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(384, 576, generator=g).bfloat16()
    x = torch.randn(2, rows, 576, generator=g).bfloat16()
    got, want = PackedLinear(w)(x), x @ w.t()
    exact = x.double() @ w.double().t()
    assert got.shape == want.shape == (2, rows, 384) and got.dtype == torch.bfloat16
    # both are bf16 roundings of the exact product: each within bf16's relative precision of it
    scale = exact.abs().max()
    assert (got.double() - exact).abs().max() < 0.02 * scale
    assert (want.double() - exact).abs().max() < 0.02 * scale


@pytest.mark.parametrize("fast_bf16", [True, False], ids=["bf16-dot-cpu", "avx2-cpu"])
def test_rows_the_kernels_do_not_take_run_in_fp32_where_bf16_matmuls_are_slow(monkeypatch, fast_bf16):
    """A prefill's rows (over 16) take torch's matmul. On a CPU without bf16 dot products that is an fp32 matmul of
    the bf16 values (~3-5x faster there; benchmarks/bench_prefill.py), a large weight converted a block at a time."""
    import hyflash.kernels
    import hyflash.packed

    monkeypatch.setattr(hyflash.kernels, "cpu_has_fast_bf16", lambda: fast_bf16)
    monkeypatch.setattr(hyflash.kernels, "cpu_flags", lambda: frozenset({"avx2", "fma"}))
    g = torch.Generator().manual_seed(0)
    w = torch.randn(96, 64, generator=g).bfloat16()
    x = torch.randn(2, 37, 64, generator=g).bfloat16()
    lin = PackedLinear(w)
    assert lin.upcast is not fast_bf16
    fp32 = (x.float() @ w.float().t()).bfloat16()
    got = lin(x)
    assert got.dtype == torch.bfloat16 and got.shape == (2, 37, 96)
    if fast_bf16:
        assert torch.equal(got, x @ w.t())
        return
    assert torch.equal(got, fp32)
    monkeypatch.setattr(hyflash.packed, "UPCAST_CHUNK", 64 * 10)  # 10 outputs at a time: 10 blocks, the last short
    blocked = lin(x)
    exact = x.double() @ w.double().t()
    assert (blocked.double() - exact).abs().max() < 0.01 * exact.abs().max()
    assert (blocked.float() - fp32.float()).abs().max() <= 0.01 * fp32.float().abs().max()
    assert torch.equal(lin(x[0, :5]), lin(x[0, :5]))  # rows our kernels take are not affected (or the plain matmul)


def test_other_dtypes_fall_back_to_the_plain_matmul():
    w = torch.randn(5, 7, dtype=torch.float64)
    x = torch.randn(3, 7, dtype=torch.float64)
    p = PackedLinear(w)
    assert not p.is_packed and torch.equal(p(x), x @ w.t())


@needs_onednn
def test_pack_linears_routes_modules_and_unpack_restores():
    torch.manual_seed(0)
    # 32 inputs: what our kernels take (an AVX2 CPU's oneDNN packs no bf16 weight), as the skip condition checks
    net = nn.Sequential(nn.Linear(32, 32, bias=False), nn.Linear(32, 8, bias=True)).bfloat16()
    x = torch.randn(4, 32).bfloat16()
    before = net(x)
    assert pack_linears(net) == 1  # the bias-free one
    assert "forward" in net[0].__dict__ and "forward" not in net[1].__dict__
    assert (net(x).float() - before.float()).abs().max() < 0.05 * before.float().abs().max()
    unpack_linears(net)
    assert torch.equal(net(x), before)


@needs_onednn
def test_packed_bf16_drafter_drafts_like_the_unpacked_one_and_stays_lossless():
    target = tiny_llama(vocab=50, hidden=32)  # float64 target, bf16 drafter: verification is exact
    torch.manual_seed(0)
    cfg = DrafterConfig(num_layers=2, block_size=4, window=6, hidden_size=32, num_heads=4, num_kv_heads=2,
                        head_dim=8, intermediate_size=48, memory_heads=2, memory_head_dim=8, memory_state_dim=8,
                        vocab_size=50, target_hidden_size=32, target_layers=[0, 1])
    drafter = new_drafter(cfg, target, dtype=torch.bfloat16).eval()
    prompt = torch.randint(1, 49, (20,)).tolist()
    feats = target.forward(torch.tensor(prompt), target.new_cache()).features
    with torch.no_grad():
        state = DrafterState(drafter)
        state.commit(feats)
        plain = drafter.logits(state.draft_hidden(3)).float()
        assert drafter.pack_for_inference() > 0
        state = DrafterState(drafter)
        state.commit(feats)
        packed = drafter.logits(state.draft_hidden(3)).float()
    assert (packed - plain).abs().max() < 0.1 * plain.abs().max()
    reference = generate(target, prompt, None, max_new_tokens=30)
    spec = generate(target, prompt, HyFlashProposer(drafter), max_new_tokens=30)
    assert spec.token_ids == reference.token_ids


@pytest.mark.slow
@needs_onednn
def test_smollm2_fast_path_packed_matches_unpacked_bf16():
    from hyflash.fast import LeanLlama
    from hyflash.target import Target

    smollm2 = Target.load("smollm2-135m", dtype="bf16")
    ids = torch.tensor(smollm2.encode("Name three rivers in Europe."))
    out = {}
    for pack in (False, True):
        lean = LeanLlama(smollm2.model, pack=pack)
        logits, feats, _ = lean.forward(ids, lean.new_cache(256), [1, 8])
        out[pack] = logits
    a, b = out[False], out[True]
    assert (a - b).abs().max() < 0.05 * a.abs().max()
    assert (a.argmax(-1) == b.argmax(-1)).float().mean() > 0.9
