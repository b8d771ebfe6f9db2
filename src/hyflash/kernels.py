"""Our own CPU kernels, compiled at first use (csrc/): a bf16 matmul for 1-16 rows (amx_linear.cpp), and a Llama
decoder's whole forward over up to 16 new tokens built on it (lean_llama.cpp, used by ``fast.LeanLlama``), and the
HyFlash drafter's commit and draft (drafter.cpp, used by ``drafter.state.DrafterState``).

They come in two builds, chosen by the CPU: on AMX tiles (Intel Sapphire Rapids and later), or, where a CPU has
AVX-512 BF16 but no tiles (AMD Zen 4 and later, Intel Cooper Lake), on VDPBF16PS. Either way every output element
is one fp32 sum taken in the same order whatever the number of rows, so verifying k drafted tokens gives each token
the bits a 1-token step would: greedy speculative decoding in bf16 is token-identical to plain decoding.

``amx()`` returns the compiled module, or None where it cannot run — not x86-64 Linux, neither AMX-BF16 nor
AVX-512 BF16 in the CPU's flags, no C++ compiler, a failed build, or ``HYFLASH_KERNELS=0`` — and callers then use
oneDNN (``hyflash.packed``). ``isa()`` says which build. The build (under a minute on 2 cores, once) goes to torch's
extension cache (``TORCH_EXTENSIONS_DIR``, by default under ~/.cache).
"""

from __future__ import annotations

import functools
import os
import platform
import sys
import warnings
from pathlib import Path

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


def isa() -> str | None:
    """Which build of the kernels this CPU gets: "amx", "avx512-bf16", or None (no kernels; oneDNN)."""
    return "amx" if cpu_has_amx() else "avx512-bf16" if cpu_has_avx512_bf16() else None


@functools.cache
def amx():
    """The compiled module (``init``, ``pack``, ``linear``, ``llama_forward``, ``drafter_commit``, ``drafter_draft``), or None when it is unavailable (see the module)."""
    build = isa()
    if os.environ.get("HYFLASH_KERNELS", "1") == "0" or build is None:
        return None
    name, flags = (NAME, ["-mavx512f", "-mavx512bf16", "-mamx-tile", "-mamx-bf16"]) if build == "amx" else \
        (NAME + "_avx512bf16", ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16"])
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
