"""Our C++ attention (csrc/lean_llama.cpp, class Attention) at this checkout against the same kernel built from an
earlier revision, side by side in one process: the kernel alone on Gemma 3's and SmolLM2's head geometry, then Gemma
3 270M's whole forward of k new tokens (a plain step for k = 1, a verify for more) after prompts of ``--contexts``
tokens, the model switching between the two builds' attention call by call. Every output is checked bit for bit
against the other build's (the kernels promise the same sums in the same order), so a faster build that rounds
differently fails here rather than shows a speedup.

    python benchmarks/bench_attention.py [--base HEAD~1] [--contexts 4096,16384] [--tokens 1,3,8] [--repeats 15]

The earlier revision's three kernel sources are taken with ``git show`` and built once (about a minute) under another
module name, with this CPU's build flags.
"""

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from common import machine_line, median
from hyflash import kernels
from hyflash.decoding import prompt_forward
from hyflash.target import Target

SOURCES = ("amx_linear.cpp", "lean_llama.cpp", "drafter.cpp", "amx.h", "simd.h")
GEOMETRIES = {"gemma3-270m": (4, 1, 256), "smollm2-135m": (9, 3, 64)}  # query heads, kv heads, head dim


def build_revision(rev: str):
    """The kernel module compiled from ``rev``'s sources, with this CPU's flags."""
    from torch.utils.cpp_extension import load

    build = kernels.isa()
    if build is None:
        raise SystemExit("our kernels do not serve this CPU (or HYFLASH_KERNELS=0): nothing to compare")
    sha = subprocess.run(["git", "rev-parse", "--short", rev], capture_output=True, text=True, check=True).stdout.strip()
    src = Path(tempfile.mkdtemp(prefix=f"hyflash-kernels-{sha}-"))
    for name in SOURCES:
        text = subprocess.run(["git", "show", f"{rev}:src/hyflash/csrc/{name}"], capture_output=True, text=True,
                              check=True).stdout
        (src / name).write_text(text)
    print(f"# building the {build} kernels of {sha} for comparison", file=sys.stderr)
    module = load(name=f"{kernels.MODULE_NAMES[build]}_{sha}", sources=[str(src / f) for f in SOURCES[:3]],
                  extra_cflags=["-O3", *kernels.FLAGS[build], "-fopenmp"], extra_ldflags=["-fopenmp"], verbose=False)
    if not module.init():
        raise SystemExit("the OS refused the AMX tile state")
    return sha, module


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.contiguous().view(torch.int32 if a.dtype == torch.float32 else torch.int16),
                                              b.contiguous().view(torch.int32 if b.dtype == torch.float32 else torch.int16))


def kernel_alone(builds: dict, contexts: list[int], tokens: list[int], repeats: int) -> bool:
    """llama_attention of k new tokens (a chain) after ``context`` cached keys; both builds interleaved."""
    ok = True
    g = torch.Generator().manual_seed(0)
    for target, (H, Hkv, hd) in GEOMETRIES.items():
        print(f"# the kernel alone, {target}'s heads ({H} query, {Hkv} kv, {hd} dims): ms, median of {repeats}")
        for context in contexts:
            cap = context + max(tokens)
            k = torch.randn(Hkv, cap, hd, generator=g).to(torch.bfloat16)
            v = torch.randn(Hkv, cap, hd, generator=g).to(torch.bfloat16)
            cells = []
            for n in tokens:
                q = torch.randn(n, H * hd, generator=g).mul(2).to(torch.bfloat16)
                sees = torch.ones(n, n, dtype=torch.bool).tril().contiguous()
                times = {name: [] for name in builds}
                outs = {}
                for _ in range(repeats):
                    for name, module in builds.items():
                        t0 = time.perf_counter()
                        outs[name] = module.llama_attention(q, k, v, context, sees, H, hd ** -0.5, 0)
                        times[name].append(time.perf_counter() - t0)
                (a, ta), (b, tb) = times.items()
                same = same_bits(outs[a], outs[b])
                ok &= same
                cells.append(f"{n}: {1e3 * median(ta):6.2f} / {1e3 * median(tb):6.2f} = {median(ta) / median(tb):4.2f}x"
                             + ("" if same else " DIFFERENT BITS"))
            print(f"context {context:>6}  tokens " + "   ".join(cells))
    return ok


def whole_forward(builds: dict, contexts: list[int], tokens: list[int], repeats: int) -> bool:
    """Gemma 3 270M's forward of k new tokens (features on, as in decoding) after a prompt of ``context`` tokens."""
    target = Target.load("gemma3-270m", dtype="bf16", fast=True)
    lean = target.lean
    if lean is None or lean.cpp_attention is None:
        raise SystemExit("Gemma 3 does not attend through our C++ attention here: nothing to compare")
    print(f"# {target.name} bf16, forward of k new tokens (features on) after the context: ms, median of {repeats}, "
          f"both builds' attention interleaved")
    ok = True
    g = torch.Generator().manual_seed(1)
    for context in contexts:
        ids = torch.randint(1000, 100000, (context + max(tokens),), generator=g).tolist()
        cache = target.new_cache(context + max(tokens) + 1)
        t0 = time.perf_counter()
        prompt_forward(target, ids[:context], cache, features=True)
        prefill = time.perf_counter() - t0
        cells = []
        for n in tokens:
            new = torch.tensor(ids[context:context + n])
            times = {name: [] for name in builds}
            outs = {}
            for _ in range(repeats):
                for name, module in builds.items():
                    lean.cpp_attention = module
                    t0 = time.perf_counter()
                    outs[name] = target.forward(new, cache, features=True)
                    times[name].append(time.perf_counter() - t0)
                    target.rollback(cache, context)
            (a, ta), (b, tb) = times.items()
            same = all(same_bits(x, y) for x, y in zip(_tensors(outs[a]), _tensors(outs[b])))
            ok &= same
            cells.append(f"{n}: {1e3 * median(ta):6.1f} / {1e3 * median(tb):6.1f} = {median(ta) / median(tb):4.2f}x"
                         + ("" if same else " DIFFERENT BITS"))
        print(f"context {context:>6} (prefill {prefill:5.1f} s)  tokens " + "   ".join(cells))
    lean.cpp_attention = builds[next(iter(builds))]
    return ok


def _tensors(out) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (tuple, list)):
        return [t for x in out for t in _tensors(x)]
    if hasattr(out, "__dict__"):
        return [t for x in vars(out).values() for t in _tensors(x)]
    return []


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", default="HEAD", help="the revision whose kernels this checkout's are compared with")
    ap.add_argument("--kernel-contexts", default="512,4096,24576")
    ap.add_argument("--contexts", default="4096,16384", help="prompt lengths for Gemma 3's whole forward ('' skips it)")
    ap.add_argument("--tokens", default="1,3,8")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    sha, base = build_revision(args.base)
    now = kernels.amx()
    builds = {"this checkout": now, sha: base}
    print(machine_line())
    print(f"# each cell: tokens: this checkout's ms / {sha}'s ms = ratio (below 1: this checkout faster)")
    tokens = [int(t) for t in args.tokens.split(",")]
    ok = kernel_alone(builds, [int(c) for c in args.kernel_contexts.split(",")], tokens, args.repeats)
    if args.contexts:
        ok &= whole_forward(builds, [int(c) for c in args.contexts.split(",")], tokens, args.repeats)
    print("outputs identical bit for bit in every cell" if ok else "SOME OUTPUTS DIFFER (see the cells marked)")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
