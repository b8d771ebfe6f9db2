"""GPTQ 4-bit drafter weights: better than rounding to nearest, packed losslessly, loaded by from_pretrained."""

import json

import torch

from conftest import tiny_llama
from hyflash.decoding import generate
from hyflash.drafter.config import DrafterConfig
from hyflash.drafter.model import from_pretrained, new_drafter, save_pretrained
from hyflash.proposers import HyFlashProposer
from hyflash.quant import (calibration_hessians, dequantize_codes, gptq, pack4, quantize_drafter, round_to_nearest,
                           save_quantized, unpack4)


def test_gptq_beats_round_to_nearest_on_correlated_inputs(one_thread):
    g = torch.Generator().manual_seed(0)
    mix = torch.randn(128, 128, generator=g) / 8
    X = torch.randn(2048, 128, generator=g) @ (torch.eye(128) + mix)  # correlated input channels
    W = torch.randn(48, 128, generator=g)
    r = gptq(W, X.double().t() @ X.double(), bits=4, group_size=32)
    assert r["codes"].max() <= 15 and r["scales"].shape == (48, 4)
    for grp in range(4):  # every weight lies on its group's grid
        sl = slice(32 * grp, 32 * grp + 32)
        grid_w = dequantize_codes(r["codes"][:, sl].double(), r["scales"][:, grp], r["zeros"][:, grp])
        assert torch.allclose(grid_w.float(), r["weight"][:, sl], atol=1e-5)
    err_gptq = (X @ (W - r["weight"]).t()).pow(2).mean()
    err_rtn = (X @ (W - round_to_nearest(W, 4, 32)).t()).pow(2).mean()
    assert err_gptq < 0.8 * err_rtn


def test_pack_unpack_round_trip():
    codes = torch.randint(0, 16, (5, 12), dtype=torch.uint8)
    packed = pack4(codes)
    assert packed.shape == (5, 6) and torch.equal(unpack4(packed), codes)


def test_quantized_drafter_saves_loads_and_stays_lossless(tmp_path, one_thread):
    target = tiny_llama(vocab=50, hidden=32, dtype=torch.float32)
    torch.manual_seed(0)
    cfg = DrafterConfig(num_layers=2, block_size=4, window=6, hidden_size=32, num_heads=4, num_kv_heads=2,
                        head_dim=8, intermediate_size=64, memory_heads=2, memory_head_dim=8, memory_state_dim=8)
    drafter = new_drafter(cfg, target, dtype=torch.float32)
    save_pretrained(drafter, tmp_path / "bf16")
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(1, 40, 64, generator=g), torch.randint(1, 49, (1, 40), generator=g),
                torch.tensor([[5, 17, 30]])) for _ in range(4)]
    H = calibration_hessians(drafter, batches)
    packed = quantize_drafter(drafter, H, bits=4, group_size=16)
    info = save_quantized(drafter, packed, tmp_path / "q4", 4, 16, {"test": True})
    assert info["weight_bytes"] < 0.45 * info["bf16_weight_bytes"]
    assert json.loads((tmp_path / "q4" / "quantization.json").read_text())["quantized"]
    loaded = from_pretrained(tmp_path / "q4", target, dtype=torch.float32)
    for (name, a), (_, b) in zip(drafter.state_dict().items(), loaded.state_dict().items()):
        if a.is_floating_point():  # dequantised weights equal the in-place quantised ones (bf16 scales)
            assert torch.allclose(a, b, atol=2e-2, rtol=2e-2), name
    prompt = torch.randint(1, 49, (20,), generator=g).tolist()
    plain = generate(target, prompt, None, max_new_tokens=20)
    spec = generate(target, prompt, HyFlashProposer(loaded), max_new_tokens=20)
    assert spec.token_ids == plain.token_ids
