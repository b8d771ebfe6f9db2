"""Our own CPU kernels, compiled at first use (csrc/): a bf16 matmul for 1-16 rows (amx_linear.cpp), and a Llama
decoder's whole forward over up to 16 new tokens built on it (lean_llama.cpp, used by ``fast.LeanLlama``), and the
HyFlash drafter's commit and draft (drafter.cpp, used by ``drafter.state.DrafterState``).

They come in four builds, chosen by the CPU: on AMX tiles (Intel Sapphire Rapids and later); where a CPU has
AVX-512 BF16 but no tiles (AMD Zen 4 and later, Intel Cooper Lake), on VDPBF16PS; on AVX2 with FMA (x86-64-v3:
most laptops' Intel and AMD CPUs since 2013–2015), where each bf16 pair product is two FMAs on widened values; and
on NEON (64-bit Arm Linux: phones, Arm boards and servers), the AVX2 build's scheme on 128-bit registers, which gives
the AVX2 build's bits (csrc/simd.h). In every build each output element is one fp32 sum taken in the same order
whatever the number of rows, so verifying k drafted tokens gives each token the bits a 1-token step would: greedy
speculative decoding in bf16 is token-identical to plain decoding. (The AMX build may differ from the others in the
last bit: TDPBF16PS adds a pair's even product first, VDPBF16PS its odd one. The other three agree with a committed
reference. Tests check both.) macOS is not built: Apple's compiler has no OpenMP, which the build uses.

``amx()`` returns the compiled module, or None where it cannot run — neither x86-64 nor AArch64 Linux, an x86 CPU
without AVX2 and FMA in its flags, no C++ compiler, a failed build, or ``HYFLASH_KERNELS=0`` — and callers then use oneDNN
(``hyflash.packed``). ``HYFLASH_KERNELS=avx2`` (or ``avx512-bf16``) picks a lesser build than the CPU's best, to
test it. ``isa()`` says which build. The build (under a minute on 2 cores, once) goes to torch's extension cache
(``TORCH_EXTENSIONS_DIR``, by default under ~/.cache).
"""

from __future__ import annotations

import functools
import os
import platform
import sys
import warnings
from pathlib import Path

from hyflash import HyflashError

CSRC = Path(__file__).resolve().parent / "csrc"
NAME = "hyflash_amx_linear"


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags (from /proc/cpuinfo, read once; empty off x86-64 Linux)."""
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        return frozenset()
    try:
        flags = next((line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")), "")
    except OSError:
        return frozenset()
    return frozenset(flags.split(":", 1)[-1].split())


def cpu_has_amx() -> bool:
    """AMX tiles with bf16 dot products, as the tile build needs."""
    return {"amx_tile", "amx_bf16", "avx512_bf16"} <= cpu_flags()


def cpu_has_avx512_bf16() -> bool:
    """AVX-512 with bf16 dot products (VDPBF16PS), as the build without tiles needs."""
    return {"avx512f", "avx512bw", "avx512vl", "avx512_bf16"} <= cpu_flags()


def cpu_has_avx2() -> bool:
    """AVX2 with FMA, as the third build needs."""
    return {"avx2", "fma"} <= cpu_flags()


def cpu_has_fast_bf16() -> bool:
    """Whether torch's bf16 matmuls run at least as fast as fp32 on this CPU: x86 with bf16 dot products (AVX-512 BF16
    or AMX), or Arm Linux with the BF16 extension. Elsewhere torch converts every operand and a bf16 matmul is several
    times slower than fp32 (on a 2-core AVX2 EPYC: a drafter's training step 111 s vs 7 s, Gemma 3 270M's feature
    pass 14.8 vs 102.7 tokens/s). ``HYFLASH_FAST_BF16`` 0 or 1 overrides the answer: with 0 a newer CPU takes the
    fp32 paths an AVX2-only one does (with ``HYFLASH_KERNELS=avx2`` and torch's, MKL's and oneDNN's ISA capped to AVX2,
    its bits too: see reports/README.md)."""
    forced = os.environ.get("HYFLASH_FAST_BF16")
    if forced is not None:
        if forced not in ("0", "1"):
            raise HyflashError(f"HYFLASH_FAST_BF16={forced!r}: use 0 or 1 (unset: decided by the CPU)")
        return forced == "1"
    if cpu_is_aarch64_linux():
        return "bf16" in arm_features()
    return bool({"avx512_bf16", "amx_bf16"} & cpu_flags())


@functools.cache
def arm_features() -> frozenset[str]:
    """An Arm CPU's feature names (the "Features" line of /proc/cpuinfo, read once; empty where there is none)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    line = next((line for line in text.splitlines() if line.startswith("Features")), "")
    return frozenset(line.split(":", 1)[-1].split())


def cpu_is_aarch64_linux() -> bool:
    """64-bit Arm Linux, where NEON (Advanced SIMD, with FMA) is part of the base architecture."""
    return platform.system() == "Linux" and platform.machine() in ("aarch64", "arm64")


BUILDS = ("amx", "avx512-bf16", "avx2", "neon")  # best first (an x86 CPU runs some of the first three, Arm the last)
FLAGS = {"amx": ["-mavx512f", "-mavx512bf16", "-mamx-tile", "-mamx-bf16"],
         "avx512-bf16": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16"],
         "avx2": ["-mavx2", "-mfma"],
         "neon": []}  # the AArch64 baseline
MODULE_NAMES = {"amx": NAME, "avx512-bf16": NAME + "_avx512bf16", "avx2": NAME + "_avx2", "neon": NAME + "_neon"}
# Builds whose bf16 pair product is two FMAs (no bf16 dot-product instruction): on AVX2 a verify's cost grows with
# its rows (2-core AMD EPYC: SmolLM2's forward 9.1 ms for 1 token, 9.7 for 3, 12.0 for 5), so drafters there send a
# smaller tree by default (``proposers.default_tree``); NEON has the same arithmetic (its speed on an Arm CPU is not
# yet measured), so it does too.
PAIRS_BY_FMA = ("avx2", "neon")


def builds() -> list[str]:
    """The builds this CPU can run, best first (empty off x86-64 and AArch64 Linux, or on x86 without AVX2 and FMA)."""
    runs = {"amx": cpu_has_amx, "avx512-bf16": cpu_has_avx512_bf16, "avx2": cpu_has_avx2, "neon": cpu_is_aarch64_linux}
    return [b for b in BUILDS if runs[b]()]


def isa() -> str | None:
    """Which build of the kernels this process gets: "amx", "avx512-bf16", "avx2", or None (no kernels; oneDNN).

    The CPU's best, the build ``HYFLASH_KERNELS`` names when the CPU can run it, or None when it is 0."""
    wanted = os.environ.get("HYFLASH_KERNELS", "1")
    if wanted == "0":
        return None
    runnable = builds()
    if wanted in BUILDS:
        if wanted not in runnable:
            raise HyflashError(f"HYFLASH_KERNELS={wanted}: this CPU cannot run that build "
                               f"(it can run: {', '.join(runnable) or 'none'})")
        return wanted
    if wanted not in ("0", "1"):
        raise HyflashError(f"HYFLASH_KERNELS={wanted!r}: use 0 (off), 1 (the CPU's best) or one of {', '.join(BUILDS)}")
    return runnable[0] if runnable else None


@functools.cache
def amx():
    """The compiled module (``init``, ``pack``, ``linear``, ``llama_forward``, ``drafter_commit``, ``drafter_draft``), or None when it is unavailable (see the module)."""
    build = isa()
    if build is None:
        return None
    name, flags = MODULE_NAMES[build], FLAGS[build]
    try:
        from torch.utils import cpp_extension
        from torch.utils.cpp_extension import load

        try:  # say so when this is the one-time build rather than a load from the cache
            built = (Path(cpp_extension._get_build_directory(name, verbose=False)) / f"{name}.so").exists()
        except Exception:  # a private helper of torch's: its absence only costs the message
            built = True
        if not built:
            print(f"hyflash: building our C++ kernels ({build}) once (about a minute; HYFLASH_KERNELS=0 skips them)",
                  file=sys.stderr)
        module = load(name=name, sources=[str(CSRC / f) for f in ("amx_linear.cpp", "lean_llama.cpp", "drafter.cpp")],
                      extra_cflags=["-O3", *flags, "-fopenmp"],
                      extra_ldflags=["-fopenmp"], verbose=False)  # OpenMP: torch's own runtime and thread count
        if not module.init():
            raise RuntimeError("the OS refused the AMX tile state (arch_prctl)")
    except Exception as e:  # no compiler, an old one, a sandbox: the oneDNN path still works
        warnings.warn(f"hyflash: our {build} matmul kernel is unavailable ({type(e).__name__}: {e}); using oneDNN. "
                      "Set HYFLASH_KERNELS=0 to skip the attempt.", RuntimeWarning, stacklevel=2)
        return None
    return module
