"""4-bit weight quantisation of a drafter with GPTQ (Frantar et al., 2022), written for our own modules.

Maintained GPTQ libraries (GPTQModel, AutoGPTQ, llm-compressor) quantise transformers architectures they know and
run their int4 kernels on GPUs; our drafter is its own ``nn.Module``, so the algorithm is implemented here, on CPU:

- calibration: inputs of every ``nn.Linear`` of the drafter, collected by hooks while it drafts blocks on target
  features from the training store (``calibration_inputs``);
- per layer, ``H = XᵀX`` (+ 1% damping), and columns are quantised left to right, each column's rounding error
  spread over the columns not yet quantised through the upper Cholesky factor of ``H⁻¹`` (lazy batch updates in
  blocks of 128 columns); asymmetric min–max grid per row and group of ``group_size`` input columns;
- storage: two 4-bit codes per byte plus a bf16 scale and zero point per (row, group); ``load_quantized``
  dequantises to the drafter's dtype (weights at rest are 4-bit; the kernels stay bf16 on CPU).

Embedding and LM head are the target's (shared, not stored); norms, the conv, gates and biases stay in bf16.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn as nn

from hyflash import HyflashError

QUANT_NAME = "quantization.json"


# ----------------------------------------------------------------------------------------------- the grid
def grid(w: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Asymmetric min–max grid per row of w [rows, cols]: (scale [rows], zero [rows]) with q = round(w/s) + z."""
    qmax = 2 ** bits - 1
    lo = w.min(dim=1).values.clamp(max=0)
    hi = w.max(dim=1).values.clamp(min=0)
    scale = (hi - lo) / qmax
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    zero = torch.round(-lo / scale)
    return scale, zero


def quantize_codes(w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int) -> torch.Tensor:
    return torch.clamp(torch.round(w / scale[:, None]) + zero[:, None], 0, 2 ** bits - 1)


def dequantize_codes(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    return (q - zero[:, None]) * scale[:, None]


def round_to_nearest(w: torch.Tensor, bits: int = 4, group_size: int = 64) -> torch.Tensor:
    """The baseline GPTQ improves on: each group rounded on its own grid, no error feedback."""
    out = torch.empty_like(w, dtype=torch.float32)
    for g in range(0, w.shape[1], group_size):
        blk = w[:, g:g + group_size].float()
        s, z = grid(blk, bits)
        out[:, g:g + group_size] = dequantize_codes(quantize_codes(blk, s, z, bits), s, z)
    return out


def gptq(w: torch.Tensor, H: torch.Tensor, bits: int = 4, group_size: int = 64, damp: float = 0.01,
         block: int = 128) -> dict:
    """GPTQ on one weight w [rows, cols] with Hessian H = XᵀX [cols, cols] (float64 inside).

    Returns codes [rows, cols] (uint8 0..2^bits−1), scales/zeros [rows, n_groups] and the dequantised weight."""
    W = w.detach().double().clone()
    rows, cols = W.shape
    if cols % group_size:
        raise HyflashError(f"group_size {group_size} must divide the input width {cols}")
    H = H.detach().double().clone()
    dead = torch.diag(H) == 0
    H[dead, dead] = 1.0
    W[:, dead] = 0.0
    H += damp * torch.mean(torch.diag(H)) * torch.eye(cols, dtype=H.dtype)
    L = torch.linalg.cholesky(H)
    Hinv = torch.linalg.cholesky(torch.cholesky_inverse(L), upper=True)  # upper factor of H⁻¹
    n_groups = cols // group_size
    block = max(block // group_size, 1) * group_size  # a group never straddles two blocks
    Q = torch.zeros_like(W)
    codes = torch.zeros(rows, cols, dtype=torch.uint8)
    scales = torch.zeros(rows, n_groups, dtype=torch.float64)
    zeros = torch.zeros(rows, n_groups, dtype=torch.float64)
    for i1 in range(0, cols, block):
        i2 = min(i1 + block, cols)
        W1, Hinv1 = W[:, i1:i2].clone(), Hinv[i1:i2, i1:i2]
        Err1 = torch.zeros_like(W1)
        for i in range(i2 - i1):
            c = i1 + i
            if c % group_size == 0:  # the group's grid from the weights as updated so far (GPTQ's static groups)
                g = c // group_size
                s, z = grid(W1[:, i:i + group_size], bits)
                scales[:, g], zeros[:, g] = s, z
            g = c // group_size
            col = W1[:, i]
            q = quantize_codes(col[:, None], scales[:, g], zeros[:, g], bits)[:, 0]
            codes[:, c] = q.to(torch.uint8)
            deq = (q - zeros[:, g]) * scales[:, g]
            Q[:, c] = deq
            err = (col - deq) / Hinv1[i, i]
            W1[:, i:] -= err[:, None] * Hinv1[i, i:][None]
            Err1[:, i] = err
        W[:, i2:] -= Err1 @ Hinv[i1:i2, i2:]
    return {"codes": codes, "scales": scales, "zeros": zeros, "weight": Q.to(w.dtype)}


def pack4(codes: torch.Tensor) -> torch.Tensor:
    """[rows, cols] uint8 codes 0..15 → [rows, cols/2] bytes (low nibble first)."""
    return (codes[:, 0::2] | (codes[:, 1::2] << 4)).to(torch.uint8)


def unpack4(packed: torch.Tensor) -> torch.Tensor:
    out = torch.empty(packed.shape[0], packed.shape[1] * 2, dtype=torch.uint8)
    out[:, 0::2] = packed & 0x0F
    out[:, 1::2] = packed >> 4
    return out


# ------------------------------------------------------------------------------------------ calibration
def linear_layers(drafter: nn.Module) -> dict[str, nn.Linear]:
    return {name: m for name, m in drafter.named_modules() if isinstance(m, nn.Linear)}


@torch.no_grad()
def calibration_hessians(drafter: nn.Module, batches) -> dict[str, torch.Tensor]:
    """XᵀX of every Linear's inputs while the drafter runs ``forward_train`` on each batch (features, input_ids,
    anchors)."""
    H, hooks = {}, []
    for name, mod in linear_layers(drafter).items():
        def hook(m, inputs, _out, name=name):
            x = inputs[0].detach().reshape(-1, inputs[0].shape[-1]).double()
            H[name] = H.get(name, 0) + x.t() @ x
        hooks.append(mod.register_forward_hook(hook))
    try:
        for features, input_ids, anchors in batches:
            drafter.forward_train(features, input_ids, anchors, return_hidden=True)
    finally:
        for h in hooks:
            h.remove()
    return H


def store_batches(store, n_sequences: int, anchors: int = 64, seq_len: int = 2048, seed: int = 0):
    """Calibration batches from a training feature store: one sequence at a time, random supervised anchors."""
    import numpy as np

    from hyflash.train import sample_anchors, supervised_labels

    rng = np.random.default_rng(seed)
    order = rng.permutation(len(store))[:n_sequences]
    for i in order:
        item = store[int(i)]
        T = min(len(item["input_ids"]), seq_len)
        sup = supervised_labels(item["spans"], T)
        a = sample_anchors(sup, anchors, rng)
        if len(a):
            yield item["features"][:T][None], item["input_ids"][:T][None], a[None]


# ----------------------------------------------------------------------------------------- checkpoints
def quantize_drafter(drafter: nn.Module, hessians: dict, bits: int = 4, group_size: int = 64) -> dict:
    """GPTQ every Linear in place (the drafter then computes with the dequantised weights); returns the packed
    tensors to save."""
    if bits != 4:
        raise HyflashError("only 4-bit packing is implemented")
    packed = {}
    for name, mod in linear_layers(drafter).items():
        if name not in hessians:
            raise HyflashError(f"no calibration inputs reached {name}")
        r = gptq(mod.weight.float(), hessians[name], bits, group_size)
        with torch.no_grad():
            mod.weight.copy_(r["weight"].to(mod.weight.dtype))
        packed[f"{name}.weight.qcodes"] = pack4(r["codes"])
        packed[f"{name}.weight.qscales"] = r["scales"].to(torch.bfloat16)
        packed[f"{name}.weight.qzeros"] = r["zeros"].to(torch.uint8)
    return packed


def save_quantized(drafter, packed: dict, path, bits: int, group_size: int, calibration: dict) -> dict:
    """config.json + model.safetensors (4-bit codes, scales, zeros; other tensors bf16) + quantization.json."""
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    quantized = {k.rsplit(".weight.", 1)[0] + ".weight" for k in packed}
    state = {k: (v.to(torch.bfloat16) if v.is_floating_point() else v).contiguous()
             for k, v in drafter.state_dict().items() if k not in quantized}
    state.update({k: v.contiguous() for k, v in packed.items()})
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt", "hyflash": "drafter-gptq"})
    drafter.config.save(path / "config.json")
    info = {"method": "gptq", "bits": bits, "group_size": group_size, "quantized": sorted(quantized),
            "calibration": calibration,
            "weight_bytes": sum(v.numel() * v.element_size() for v in state.values()),
            "bf16_weight_bytes": sum(v.numel() * 2 for k, v in drafter.state_dict().items()
                                     if v.is_floating_point())}
    (path / QUANT_NAME).write_text(json.dumps(info, indent=1) + "\n")
    return info


def dequantized_state(path) -> dict:
    """The state dict of a quantised checkpoint with every quantised weight dequantised (float32)."""
    from safetensors.torch import load_file

    path = Path(path)
    info = json.loads((path / QUANT_NAME).read_text())
    raw = load_file(str(path / "model.safetensors"))
    state = {k: v for k, v in raw.items() if ".weight.q" not in k}
    g = info["group_size"]
    for name in info["quantized"]:
        codes = unpack4(raw[f"{name}.qcodes"]).float()
        s = raw[f"{name}.qscales"].float().repeat_interleave(g, dim=1)
        z = raw[f"{name}.qzeros"].float().repeat_interleave(g, dim=1)
        state[name] = (codes - z) * s
    return state


def is_quantized(path) -> bool:
    return (Path(path) / QUANT_NAME).exists()



def quantize_command_impl(drafter_path, out, target_spec, data, n_sequences, group_size, seed) -> dict:
    """Load a bf16 drafter, calibrate on `n_sequences` sequences of a training feature store, GPTQ, save."""
    from hyflash.data.features import FeatureStore
    from hyflash.drafter.model import from_pretrained
    from hyflash.target import Target

    target = Target.load(target_spec, dtype="bf16")
    drafter = from_pretrained(drafter_path, target, dtype=torch.float32)
    store = FeatureStore(data)
    H = calibration_hessians(drafter, store_batches(store, n_sequences, seed=seed))
    packed = quantize_drafter(drafter, H, 4, group_size)
    return save_quantized(drafter, packed, out, 4, group_size,
                          {"store": str(data), "sequences": n_sequences, "seed": seed, "from": str(drafter_path)})
