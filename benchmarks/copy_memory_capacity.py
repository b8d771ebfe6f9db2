"""How many writes back can a copy memory still give a passage back? A delta-rule state's recall by age, measured.

The copy memory (DrafterConfig.copy_memory) keeps one gated-delta-rule state per slot: every committed token writes
the key of the bigram before it and the value of what followed, and a draft reads the state with its own bigram as
the query. A far copy is drafted only if the source's write survives every write since. This measures that alone,
with no training: streams of random tokens (embeddings of unit variance, as the copy head's normalised ones), keys
and values built as the copy head builds them at initialisation (orthonormal projections of [token; token before]
and of the next token), written with the exact recurrence of ``hyflash.drafter.memory`` (write strength β fixed),
then every position queried with its own key at the end. Reported by age (writes since): the share of queries whose
read decodes to the right next token among the whole vocabulary, and the cosine of read and value.

Key maps: ``linear<r>``: rank r keys and values (the copy memory as built, state r × r); ``dpfp<r>x<nu>``: rank r
keys expanded to 2·r·nu dimensions by the parameter-free map of Schlag, Irie & Schmidhuber 2021 ("Linear
Transformers Are Secretly Fast Weight Programmers", DPFP), values of rank r (state 2·r·nu × r): sparser, less
overlapping keys, which their paper shows raise a delta-rule memory's capacity (DrafterConfig.copy_memory_dpfp).

    python benchmarks/copy_memory_capacity.py --maps linear128,linear256,dpfp128x2,dpfp128x4 --writes 2048
"""

import argparse
import re

import torch
import torch.nn.functional as F

from hyflash.drafter import memory as mem
from hyflash.drafter.model import dpfp  # the copy memory's key map with DrafterConfig.copy_memory_dpfp


def parse_map(name: str) -> tuple[int, int]:
    """'linear128' → (128, 0); 'dpfp128x4' → (128, 4)."""
    m = re.fullmatch(r"linear(\d+)|dpfp(\d+)x(\d+)", name)
    if not m:
        raise SystemExit(f"unknown key map {name!r}: linear<r> or dpfp<r>x<nu>")
    return (int(m[1]), 0) if m[1] else (int(m[2]), int(m[3]))


def recall_by_age(key_map: str, writes: int, streams: int = 4, vocab: int = 8192, dim: int = 576, beta: float = 1.0,
                  seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(hit [streams, writes], cosine [streams, writes], state floats): for the position written ``writes − 1 − age``
    in each stream, whether the final state's read with its key decodes to its next token, and their cosine."""
    r, nu = parse_map(key_map)
    g = torch.Generator().manual_seed(seed)
    emb = torch.randn(vocab, dim, generator=g)
    wk = torch.cat([torch.nn.init.orthogonal_(torch.empty(r, dim), generator=g) for _ in range(2)], dim=1)
    wv = torch.nn.init.orthogonal_(torch.empty(r, dim), generator=g)
    ids = torch.randint(vocab, (streams, writes + 2), generator=g)
    e = emb[ids]  # [B, T + 2, dim]: position t's key reads tokens t+1 and t (the one before), its value token t+2
    k = torch.cat([e[:, 1:-1], e[:, :-2]], dim=-1) @ wk.T
    if nu:
        k = dpfp(k, nu)
    k = F.normalize(k, dim=-1)
    values = emb @ wv.T  # every token's value [vocab, r]
    v = values[ids[:, 2:]]
    B, T = streams, writes
    _, S = mem.chunked("gdn", k[:, :, None], v[:, :, None], torch.zeros(B, T, 1), torch.full((B, T, 1), beta))
    y = mem.read(S, k[:, None])[:, 0]  # [B, T, r]
    hit = (y @ values.T).argmax(-1) == ids[:, 2:]
    cos = F.cosine_similarity(y, v, dim=-1)
    return hit.flip(1), cos.flip(1), S.shape[-2] * S.shape[-1]  # flipped: index = age


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--maps", default="linear128,linear256,dpfp128x2,dpfp128x4")
    ap.add_argument("--writes", type=int, default=2048, help="tokens written (SmolLM2's training length: 2,048)")
    ap.add_argument("--streams", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--dim", type=int, default=576, help="token embedding size (SmolLM2's: 576)")
    ap.add_argument("--beta", type=float, default=1.0, help="write strength of every write")
    ap.add_argument("--ages", default="0,16,64,128,256,512,1024,2000")
    args = ap.parse_args()
    from common import machine_line

    torch.set_num_threads(1)
    ages = [int(a) for a in args.ages.split(",")]
    if max(ages) >= args.writes:
        raise SystemExit(f"--ages: the oldest age must be below --writes ({args.writes})")
    print(f"{machine_line()} | copy memory recall: {args.streams} streams x {args.writes} writes, vocab {args.vocab}, "
          f"dim {args.dim}, beta {args.beta}; each age averaged over 16 positions from it on")
    print(f"# {'key map':>11} {'state':>9}  " + " ".join(f"{a:>11}" for a in ages) + "   (top-1 recall / cosine)")
    for name in args.maps.split(","):
        hit, cos, floats = recall_by_age(name, args.writes, args.streams, args.vocab, args.dim, args.beta)
        cells = [f"{hit[:, a:a + 16].float().mean():5.2f}/{cos[:, a:a + 16].mean():5.2f}" for a in ages]
        print(f"  {name:>11} {floats:>9,}  " + " ".join(f"{c:>11}" for c in cells), flush=True)


if __name__ == "__main__":
    main()
