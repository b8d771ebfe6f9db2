"""Weights packed once for fast inference on CPU (the target's fast path and the drafter).

Two layouts, chosen once per weight: on x86-64 CPUs with AMX, AVX-512 BF16 or AVX2, our kernel's tile layout (``hyflash.kernels``),
used for the 1-16 rows that decoding, verification and drafting multiply (larger inputs, i.e. prefill, take torch's own matmul);
elsewhere oneDNN's blocked layout for every input.
"""

from __future__ import annotations

import torch
from torch import nn

from hyflash import kernels

AMX_MAX_ROWS = 16
UPCAST_CHUNK = 1 << 22  # weight elements converted to fp32 at once (16 MB) by PackedLinear's fp32 fallback


class PackedLinear:
    """``x @ w.T`` for a bf16 weight on CPU, packed once. Values are those of a bf16 matmul up to rounding (fp32
    accumulation in another order). Inference only (no autograd); anything else (fp32/fp64, another device, shapes
    the kernels do not take) falls back to the plain matmul.

    Measured for SmolLM2's shapes on this project's CPU (2 cores with AMX): oneDNN's packed layout reads a weight
    1.4-1.7x faster than an unpacked bf16 matmul at 1 and 8 rows; our AMX kernel is 1.2-3.5x faster again at 1-16 rows
    and nearly flat in the row count (``benchmarks/bench_kernels.py``)."""

    def __init__(self, w: torch.Tensor, pack: bool = True):
        self.w, self.packed, self.amx = w.detach(), None, None
        self.out_features, self.in_features = w.shape
        # Rows our kernels do not take (a prefill's) on a CPU without bf16 dot products, where torch's bf16 matmul
        # converts every operand and runs ~5x slower than fp32: there they are an fp32 matmul of the bf16 values
        # (exact products, fp32 sums, one rounding: a bf16 matmul's values up to summation order), the weight
        # converted per call rather than kept twice
        self.upcast = (w.dtype == torch.bfloat16 and w.device.type == "cpu" and not kernels.cpu_has_fast_bf16()
                       and (bool(kernels.cpu_flags()) or kernels.cpu_is_aarch64_linux()))
        if not (pack and w.dtype == torch.bfloat16 and w.device.type == "cpu"):
            return
        module = kernels.amx() if self.in_features % 32 == 0 else None
        if module is not None:
            self.amx = module.pack(self.w)  # out_features padded with zero rows to whole 16-column tiles
            self._amx_linear = module.linear if self.out_features % 16 == 0 else self._amx_padded
            self._amx_unpadded = module.linear
        elif torch.backends.mkldnn.is_available():
            try:
                self.packed = torch.ops.mkldnn._reorder_linear_weight(w.contiguous(), 1)
            except (RuntimeError, AttributeError):  # a torch build without the op: keep the plain matmul
                self.packed = None

    def _amx_padded(self, x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
        return self._amx_unpadded(x, packed)[:, : self.out_features]

    @property
    def is_packed(self) -> bool:
        """Whether the weight was packed (for our AMX kernel or for oneDNN); False: the plain matmul every time."""
        return self.amx is not None or self.packed is not None

    @property
    def kernel(self) -> str:
        """Which matmul serves 1-16 rows: our kernels' build (``kernels.BUILDS``: "amx", "avx512-bf16", "avx2" or "neon"), "onednn" or "plain"."""
        return kernels.isa() if self.amx is not None else "onednn" if self.packed is not None else "plain"

    def _plain(self, x: torch.Tensor) -> torch.Tensor:
        """The matmul for the rows the kernels do not take: torch's, or where its bf16 is slow, an fp32 one."""
        if not self.upcast:  # (x is bf16 here: __call__ sends other dtypes to the plain matmul first)
            return x @ self.w.t()
        xf = x.float()
        if self.w.numel() <= UPCAST_CHUNK:
            return (xf @ self.w.float().t()).to(torch.bfloat16)
        # a large weight (an LM head: 671 MB in fp32 for Gemma 3) is converted a block of outputs at a time
        y = torch.empty(*x.shape[:-1], self.out_features, dtype=torch.bfloat16)
        step = max(1, UPCAST_CHUNK // self.in_features)
        for j in range(0, self.out_features, step):
            y[..., j:j + step] = xf @ self.w[j:j + step].float().t()
        return y

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.bfloat16 or x.device.type != "cpu":
            return x @ self.w.t()
        if self.amx is not None:
            if x.dim() == 2:  # the common case, kept short: this runs ~150 times per decoding step
                if 0 < x.shape[0] <= AMX_MAX_ROWS:
                    return self._amx_linear(x.contiguous(), self.amx)
                return self._plain(x)
            x2 = x.reshape(-1, x.shape[-1])
            if not 0 < x2.shape[0] <= AMX_MAX_ROWS:
                return self._plain(x)
            return self._amx_linear(x2.contiguous(), self.amx).view(*x.shape[:-1], self.out_features)
        x2 = x.reshape(-1, x.shape[-1])
        if self.packed is None:
            return self._plain(x)
        y = torch.ops.mkldnn._linear_pointwise(x2, self.packed, None, "none", [], "")
        return y.view(*x.shape[:-1], self.out_features)


def gather_on_huge_pages(linears: list[PackedLinear]) -> int:
    """Move the AMX tiles of ``linears`` into one buffer advised for 2 MiB pages (``huge_empty`` of our kernels),
    page-aligned each, so that streaming them costs far fewer TLB misses (a decoding step ~5% faster here). The
    values are unchanged; each ``linear.amx`` becomes a view of the buffer and the old copies are freed. A no-op
    without our kernels. Returns the bytes moved."""
    module = kernels.amx()
    tiles = [lin for lin in linears if lin.amx is not None]
    if module is None or not tiles or not hasattr(module, "huge_empty"):
        return 0
    page = 4096
    sizes = [lin.amx.numel() * lin.amx.element_size() for lin in tiles]
    arena = module.huge_empty(sum((n + page - 1) // page * page for n in sizes))
    offset = 0
    for lin, n in zip(tiles, sizes):
        view = arena[offset:offset + n].view(lin.amx.dtype).view(lin.amx.shape)
        view.copy_(lin.amx)
        lin.amx = view
        offset += (n + page - 1) // page * page
    return sum(sizes)


def pack_linears(module: nn.Module) -> int:
    """Route every bias-free bf16 ``nn.Linear`` inside ``module`` through a ``PackedLinear`` of its current weight
    (for inference: a later change of the weights is not seen until ``unpack_linears``). Returns how many."""
    n = 0
    for m in module.modules():
        if isinstance(m, nn.Linear) and m.bias is None and m.weight.dtype == torch.bfloat16:
            packed = PackedLinear(m.weight)
            if packed.is_packed:
                m.forward = packed  # an instance attribute: nn.Module.__call__ finds it before the class's forward
                n += 1
    return n


def unpack_linears(module: nn.Module) -> None:
    for m in module.modules():
        if isinstance(m, nn.Linear) and "forward" in m.__dict__:
            del m.forward
