"""Our own CPU kernels, compiled at first use (csrc/): a bf16 matmul on AMX tiles for 1-16 rows (amx_linear.cpp), and
a Llama decoder's whole forward over up to 16 new tokens built on it (lean_llama.cpp, used by ``fast.LeanLlama``), and
the HyFlash drafter's commit and draft (drafter.cpp, used by ``drafter.state.DrafterState``).

``amx()`` returns the compiled module, or None where it cannot run — not x86-64 Linux, no AMX-BF16 in the CPU's flags,
no C++ compiler, a failed build, or ``HYFLASH_KERNELS=0`` — and callers then use oneDNN (``hyflash.packed``). The
build (under a minute on 2 cores, once) goes to torch's extension cache (``TORCH_EXTENSIONS_DIR``, by default under ~/.cache).
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


def cpu_has_amx() -> bool:
    """AMX tiles with bf16 dot products, as the kernel needs (read from /proc/cpuinfo; False elsewhere)."""
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        return False
    try:
        flags = next((line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")), "")
    except OSError:
        return False
    return {"amx_tile", "amx_bf16", "avx512_bf16"} <= set(flags.split())


@functools.cache
def amx():
    """The compiled module (``init``, ``pack``, ``linear``, ``llama_forward``, ``drafter_commit``, ``drafter_draft``), or None when it is unavailable (see the module)."""
    if os.environ.get("HYFLASH_KERNELS", "1") == "0" or not cpu_has_amx():
        return None
    try:
        from torch.utils import cpp_extension
        from torch.utils.cpp_extension import load

        try:  # say so when this is the one-time build rather than a load from the cache
            built = (Path(cpp_extension._get_build_directory(NAME, verbose=False)) / f"{NAME}.so").exists()
        except Exception:  # a private helper of torch's: its absence only costs the message
            built = True
        if not built:
            print("hyflash: building our C++ kernels once (about a minute; HYFLASH_KERNELS=0 skips them)", file=sys.stderr)
        module = load(name=NAME, sources=[str(CSRC / name) for name in ("amx_linear.cpp", "lean_llama.cpp", "drafter.cpp")],
                      extra_cflags=["-O3", "-mavx512f", "-mavx512bf16", "-mamx-tile", "-mamx-bf16", "-fopenmp"],
                      extra_ldflags=["-fopenmp"], verbose=False)  # OpenMP: torch's own runtime and thread count
        if not module.init():
            raise RuntimeError("the OS refused the AMX tile state (arch_prctl)")
    except Exception as e:  # no compiler, an old one, a sandbox: the oneDNN path still works
        warnings.warn(f"hyflash: the AMX matmul kernel is unavailable ({type(e).__name__}: {e}); using oneDNN. "
                      "Set HYFLASH_KERNELS=0 to skip the attempt.", RuntimeWarning, stacklevel=2)
        return None
    return module
