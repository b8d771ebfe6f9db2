"""Our matmul kernel (hyflash.kernels, csrc/amx_linear.cpp): bf16 x @ w.T for 1-16 rows on x86-64 CPUs with AMX,
AVX-512 BF16 or AVX2 and FMA, and on 64-bit Arm (NEON), each test once per build the CPU runs. Skipped where the kernel cannot run; the
fallback that every machine takes is tested here too."""

import pytest
import torch

from hyflash import kernels
from hyflash.packed import AMX_MAX_ROWS, PackedLinear



def needs_amx(test):
    """Skipped without our kernels; else run once per build this CPU can run (tests/conftest.py ``each_build``)."""
    test = pytest.mark.usefixtures("each_build")(test)
    return pytest.mark.skipif(kernels.amx() is None, reason="no C++ kernels on this machine (CPU, compiler or OS)")(test)


def _exact(x, w):
    return x.double() @ w.double().t()


@needs_amx
@pytest.mark.parametrize("out_features,in_features", [(16, 32), (48, 64), (80, 96), (1728, 576), (576, 1536),
                                                      (968, 576), (10, 64)])  # the last two: padded to 16 columns
@pytest.mark.parametrize("rows", [1, 2, 7, 13, 16])
def test_amx_matmul_is_a_bf16_rounding_of_the_exact_product(out_features, in_features, rows):
    g = torch.Generator().manual_seed(out_features * 100 + rows)
    w = torch.randn(out_features, in_features, generator=g).bfloat16()
    x = torch.randn(rows, in_features, generator=g).bfloat16()
    lin = PackedLinear(w)
    assert lin.kernel == kernels.isa()
    got, exact = lin(x), _exact(x, w)
    assert got.shape == (rows, out_features) and got.dtype == torch.bfloat16
    # fp32 accumulation rounded once to bf16: within bf16's relative step of each exact entry (plus fp32 noise)
    assert ((got.double() - exact).abs() <= exact.abs() * 2 ** -8 + 1e-3 * exact.abs().max()).all()
    # and as close to the exact product as torch's own bf16 matmul
    assert (got.double() - exact).abs().max() <= 2 * ((x @ w.t()).double() - exact).abs().max() + 1e-6


@needs_amx
def test_amx_rows_do_not_depend_on_how_many_are_multiplied_together_or_on_threads():
    """Each output row is accumulated in the same order whatever the row count and thread count, so verifying a
    block of k tokens produces, row for row, the bits that k single-token steps would."""
    g = torch.Generator().manual_seed(1)
    w = torch.randn(1728, 576, generator=g).bfloat16()
    x = torch.randn(16, 576, generator=g).bfloat16()
    lin = PackedLinear(w)
    together = lin(x)
    for i in range(16):
        assert torch.equal(lin(x[i:i + 1])[0], together[i])
    for m in range(2, 16):  # every row count: the AVX2 build multiplies 5 or 6 rows with a loop of their own
        assert torch.equal(lin(x[:m]), together[:m])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one_thread = lin(x)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one_thread, together)


@needs_amx
def test_each_pair_of_k_is_added_in_its_instructions_order_with_a_rounding_after_each():
    """The order VDPBF16PS is specified with (and the AVX2 and NEON builds copy): per pair of k, the sum so far plus
    the odd product, rounded, plus the even product, rounded. Sums chosen so that each other order gives 1 instead
    of 0: even first (column 0), or a pair's two products added before the sum so far (column 1). TDPBF16PS, the
    AMX build's, is specified even product first (Intel's SDM), so there column 0 gives 1 and column 1 still 0: why
    the AMX build may differ from the others in the last bit (seen on a Xeon with AMX, 2026-12-04)."""
    w = torch.zeros(16, 32)
    w[0, 0], w[0, 2], w[0, 3] = 2.0 ** 30, -2.0 ** 30, 1.0  # pairs (even, odd): (2^30, 0), (-2^30, 1)
    w[1, 0], w[1, 2], w[1, 3] = 1.0, 2.0 ** 30, -2.0 ** 30  # (1, 0), (2^30, -2^30)
    w[2, 0] = 3.0
    amx = kernels.amx()
    expected = [1.0, 0.0, 3.0] if kernels.isa() == "amx" else [0.0, 0.0, 3.0]
    for rows in range(1, 9):  # each of the AVX2 build's loops (1-4 rows, 5-6, groups)
        got = amx.linear(torch.ones(rows, 32).bfloat16(), amx.pack(w.bfloat16()))[:, :3]
        assert got.tolist() == [expected] * rows


@needs_amx
def test_larger_inputs_and_odd_shapes_take_the_plain_matmul():
    g = torch.Generator().manual_seed(2)
    w = torch.randn(64, 64, generator=g).bfloat16()
    x = torch.randn(AMX_MAX_ROWS + 1, 64, generator=g).bfloat16()
    assert torch.equal(PackedLinear(w)(x), x @ w.t())  # prefill-sized inputs: torch's matmul
    odd = PackedLinear(torch.randn(10, 48, generator=g).bfloat16())  # 48 inputs: not whole 32-row tiles
    assert odd.amx is None
    batched = torch.randn(2, 3, 64, generator=g).bfloat16()  # leading dimensions are flattened and restored
    assert torch.equal(PackedLinear(w)(batched), PackedLinear(w)(batched.reshape(6, 64)).view(2, 3, 64))


def test_kernels_can_be_switched_off_and_then_onednn_or_the_plain_matmul_serves(monkeypatch):
    monkeypatch.setenv("HYFLASH_KERNELS", "0")
    kernels.amx.cache_clear()
    try:
        assert kernels.amx() is None
        w = torch.randn(64, 64).bfloat16()
        x = torch.randn(3, 64).bfloat16()
        lin = PackedLinear(w)
        assert lin.kernel in ("onednn", "plain")
        exact = _exact(x, w)
        assert (lin(x).double() - exact).abs().max() < 0.02 * exact.abs().max()
    finally:
        monkeypatch.delenv("HYFLASH_KERNELS")
        kernels.amx.cache_clear()


def _on_x86_linux(monkeypatch):
    """As if on x86-64 Linux, whatever runs the tests (the x86 builds are chosen by the flags ``cpu_flags`` reads)."""
    monkeypatch.setattr(kernels.platform, "system", lambda: "Linux")
    monkeypatch.setattr(kernels.platform, "machine", lambda: "x86_64")


def test_the_cpu_flags_choose_the_build_and_none_means_no_kernel(monkeypatch):
    monkeypatch.delenv("HYFLASH_KERNELS", raising=False)
    _on_x86_linux(monkeypatch)
    amx = {"amx_tile", "amx_bf16", "avx512_bf16", "avx512f", "avx512bw", "avx512vl", "avx2", "fma"}
    for flags, build in ((amx, "amx"), (amx - {"amx_tile", "amx_bf16"}, "avx512-bf16"), ({"avx2", "fma"}, "avx2"),
                         ({"avx2"}, None), ({"avx", "sse4_2"}, None)):
        monkeypatch.setattr(kernels, "cpu_flags", lambda f=flags: f)
        assert kernels.isa() == build
    assert kernels.builds() == []
    monkeypatch.setattr(kernels, "cpu_flags", lambda: frozenset())  # as it reads off x86
    for system, machine, build in (("Linux", "aarch64", "neon"), ("Darwin", "arm64", None), ("Linux", "armv7l", None)):
        monkeypatch.setattr(kernels.platform, "system", lambda s=system: s)
        monkeypatch.setattr(kernels.platform, "machine", lambda m=machine: m)
        assert kernels.isa() == build and kernels.builds() == ([build] if build else [])
    kernels.amx.cache_clear()
    try:
        assert kernels.amx() is None
    finally:
        monkeypatch.undo()
        kernels.amx.cache_clear()


def test_hyflash_kernels_names_a_lesser_build_and_refuses_one_the_cpu_cannot_run(monkeypatch):
    from hyflash import HyflashError

    _on_x86_linux(monkeypatch)
    monkeypatch.setattr(kernels, "cpu_flags", lambda: frozenset({"avx512_bf16", "avx512f", "avx512bw", "avx512vl",
                                                                  "avx2", "fma"}))
    assert kernels.builds() == ["avx512-bf16", "avx2"]
    monkeypatch.setenv("HYFLASH_KERNELS", "avx2")
    assert kernels.isa() == "avx2"
    monkeypatch.setenv("HYFLASH_KERNELS", "amx")
    with pytest.raises(HyflashError, match="cannot run that build.*avx512-bf16, avx2"):
        kernels.isa()
    monkeypatch.setenv("HYFLASH_KERNELS", "avx3")
    with pytest.raises(HyflashError, match="use 0 .* or one of amx, avx512-bf16, avx2"):
        kernels.isa()


@needs_amx
@pytest.mark.parametrize("out_features,in_features", [(1984, 576), (576, 1088), (40, 64)])  # the last: padded
@pytest.mark.parametrize("rows", [1, 7, 16])
def test_int8_weights_multiply_as_their_dequantised_values(out_features, in_features, rows):
    """pack_q8: int8 codes with a scale per output column (within half a step of each weight), multiplied on AMX
    as bf16 integers with the scale applied to the fp32 sums: a bf16 rounding of the exact product with the
    dequantised weights."""
    amx = kernels.amx()
    g = torch.Generator().manual_seed(out_features + rows)
    w = (torch.randn(out_features, in_features, generator=g) * 0.05).bfloat16()
    x = torch.randn(rows, in_features, generator=g).bfloat16()
    packed = amx.pack_q8(w)
    blocks = (out_features + 15) // 16  # one byte a weight, plus 16 fp32 scales a block of 16 columns
    assert packed.dtype == torch.int8 and packed.shape == (blocks, in_features * 16 + 64)
    dq = amx.dequantise_q8(packed, in_features)[:out_features]
    step = w.float().abs().amax(1, keepdim=True) / 127
    assert ((dq - w.float()).abs() <= step / 2 + 1e-7).all()
    got = amx.linear(x, packed)[:, :out_features]
    exact = x.double() @ dq.double().t()
    assert ((got.double() - exact).abs() <= exact.abs() * 2 ** -8 + 1e-3 * exact.abs().max()).all()
    lin = PackedLinear(w)
    lin.amx = packed  # the int8 tiles through PackedLinear (how the drafter's C++ path gets them)
    assert torch.equal(lin(x), got)
