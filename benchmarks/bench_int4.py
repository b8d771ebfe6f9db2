"""Would 4-bit target weights pay on this CPU? The target's matmuls at 4 and 16 bits, for 1 and for k tokens.

Runs every linear layer of a decoder with the target's shapes (weights of those shapes; timing does not depend on
their values), once as bf16 weights packed for oneDNN (what our fast path uses) and once as 4-bit weights with
bf16 scales and zero points per group of 32 (torch's CPU int4 kernel, ``_weight_int4pack_mm_for_cpu``; the layout
of a Q4_1 GGUF such as the default target's), for M = 1 token (a plain decoding step) and M = k tokens (a verify).
The weights are far larger than the caches, so each pass streams them from memory, as decoding does.

    python benchmarks/bench_int4.py [--tokens 1,8,13] [--repeats 9]
"""

import argparse

import torch

from common import machine_line, time_median
from hyflash.packed import PackedLinear
from hyflash.target import Target

GROUP = 32


def linear_shapes(target) -> list[tuple[int, int]]:
    """(out, in) of every matmul of one forward: per layer q|k|v, o, gate|up, down; then the LM head."""
    c = target.text_config
    hd = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    d, inter = c.hidden_size, c.intermediate_size
    qkv = (c.num_attention_heads + 2 * c.num_key_value_heads) * hd
    per_layer = [(qkv, d), (d, c.num_attention_heads * hd), (2 * inter, d), (d, inter)]
    return per_layer * c.num_hidden_layers + [(target.vocab_size, d)]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--tokens", default="1,8,13")
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    target = Target.load(args.target, dtype="bf16")
    shapes = linear_shapes(target)
    del target
    g = torch.Generator().manual_seed(0)
    bf16, int4 = [], []
    for n, k in shapes:
        bf16.append(PackedLinear(torch.randn(n, k, generator=g).to(torch.bfloat16)))
        q = torch.randint(0, 16, (n, k), dtype=torch.int32, generator=g)
        scales_zeros = torch.rand(k // GROUP, n, 2, generator=g).to(torch.bfloat16)
        int4.append((torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1), scales_zeros, k))
    bytes16 = sum(2 * n * k for n, k in shapes)
    bytes4 = sum(n * k // 2 + 2 * 2 * n * k // GROUP for n, k in shapes)

    def run16(x):
        for lin in bf16:
            lin(x[lin.w.shape[1]])

    def run4(x):
        for packed, sz, k in int4:
            torch.ops.aten._weight_int4pack_mm_for_cpu(x[k], packed, GROUP, sz)

    print(machine_line())
    print(f"# {args.target}: {len(shapes)} matmuls per forward; weights bf16 {bytes16 / 2**20:.0f} MiB, "
          f"4-bit (group {GROUP}, bf16 scale+zero) {bytes4 / 2**20:.0f} MiB; median of {args.repeats}")
    print(f"{'tokens':>6}  {'bf16 ms':>8}  {'int4 ms':>8}  {'int4/bf16':>9}  {'bf16 GB/s':>9}  {'int4 GB/s':>9}")
    for m in [int(t) for t in args.tokens.split(",")]:
        x = {k: torch.randn(m, k, generator=g).to(torch.bfloat16) for k in {k for _, k in shapes}}
        times = {}
        for name, fn in (("bf16", run16), ("int4", run4)):
            times[name] = time_median(lambda: fn(x), args.repeats)
        print(f"{m:>6}  {1e3 * times['bf16']:>8.1f}  {1e3 * times['int4']:>8.1f}  "
              f"{times['int4'] / times['bf16']:>8.2f}x  {bytes16 / times['bf16'] / 1e9:>9.1f}  "
              f"{bytes4 / times['int4'] / 1e9:>9.1f}")


if __name__ == "__main__":
    main()
