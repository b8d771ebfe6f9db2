"""Can the drafter learn to copy at all? A toy where copying is all there is to learn, in minutes of CPU.

Sequences of uniformly random tokens (512 of them) hold one passage of 24 tokens copied from ``d`` tokens earlier:
*near* (the source inside the drafter's window) or *far* (the whole source further back than the window, where only
the recurrent memory can carry it). The "target features" of position t are a fixed random embedding of token t and
nothing else, so unlike a real target's they say nothing about the tokens before t: to draft the copy, a drafter must
find where its anchor occurred before and read what followed, itself. Blocks are anchored inside the copies; slot j
learns token a + 1 + j. Every variant trains on the same batches from the same seed; held-out τ̂ = 1 + the mean
all-correct prefix of the argmax drafts over fixed held-out sequences (as ``hyflash.train`` validates).

What it separates: attention can only match a source whose key says which token came before it, which these features
do not say unless the drafter adds it (``context_lags``); the memory's short causal convolution puts the last few
tokens into its write keys, so a memory could match without lags, but only from within its reach (``memory_limit``
cuts it). The toy is ours; the task is the associative-recall literature's (Zoology, Arora et al. 2023).

    python benchmarks/copy_toy.py --task near --variants hyflash,hyflash-lags --steps 3000 --seed 2
    python benchmarks/copy_toy.py --task far --variants hyflash-lags,swa-lags,mem-cut-lags --steps 3000
    python benchmarks/copy_toy.py --task near --variants hyflash-copy,swa-copy,noslot-copy --steps 600
    python benchmarks/copy_toy.py --task far --variants hyflash-copymem,mem-cut-copymem,swa-copy,hyflash-copy \
        --steps 800
    python benchmarks/copy_toy.py --task near --variants hyflash-copytok,noslot-copytok,swa-copytok,hyflash-copy \
        --steps 300 --eval-every 50
    python benchmarks/copy_toy.py --task far --variants hyflash-copymemtok,hyflash-copymemtok128 --steps 300 \
        --eval-every 50
    python benchmarks/copy_toy.py --task far --variants mem-cut-copymemtok128,swa-copytok --steps 150 --eval-every 50
    python benchmarks/copy_toy.py --task far --far-back 256:384 --variants hyflash-copymemtok128,hyflash-copymemtok256 \
        --steps 300 --eval-every 50
    python benchmarks/copy_toy.py --task far --far-back 96:184 --length 432 --variants hyflash-copymemtok128 \
        --steps 300 --eval-every 50

About 0.1 s a step per variant on one core of the 2-core EPYC (several seconds with the rank-128 and -256 copy
memories); results in benchmarks/results/copy_toy_2026-12-02/ and copy_toy_2026-12-03/.
"""

import argparse
import time

import torch
import torch.nn.functional as F

from common import machine_line
from hyflash.drafter.config import DrafterConfig
from hyflash.drafter.model import HyFlashDrafter
from hyflash.train import accepted_prefix

# name -> DrafterConfig fields on top of TOY (mem-cut: the memory folds only as many features as the window holds)
VARIANTS = {
    "hyflash": dict(variant="hyflash"),
    "hyflash-lags": dict(variant="hyflash", context_lags=4),
    "noslot-lags": dict(variant="hyflash", context_lags=4, slot_attention=False),
    "swa": dict(variant="swa"),
    "swa-lags": dict(variant="swa", context_lags=4),
    "full-lags": dict(variant="full", context_lags=4),
    "mem-cut-lags": dict(variant="hyflash", context_lags=4, memory_limit=64),
    "gdn-lags": dict(variant="hyflash", memory="gdn", context_lags=4),
    "hyflash-lags-slots": dict(variant="hyflash", context_lags=4, slot_embeddings=True),
    "noslot-lags-slots": dict(variant="hyflash", context_lags=4, slot_embeddings=True, slot_attention=False),
    "swa-lags-slots": dict(variant="swa", context_lags=4, slot_embeddings=True),
    "mem-cut-lags-slots": dict(variant="hyflash", context_lags=4, slot_embeddings=True, memory_limit=64),
    "hyflash-lags-slotq": dict(variant="hyflash", context_lags=4, slot_query_scales=True),
    "hyflash-lags-slots-slotq": dict(variant="hyflash", context_lags=4, slot_embeddings=True, slot_query_scales=True),
    # the copy head (DrafterConfig.copy_head_rank): one hop from the anchor to each slot's token
    "hyflash-copy": dict(variant="hyflash", copy_head_rank=32),
    "noslot-copy": dict(variant="hyflash", copy_head_rank=32, slot_attention=False),
    "swa-copy": dict(variant="swa", copy_head_rank=32),
    "full-copy": dict(variant="full", copy_head_rank=32),
    "mem-cut-copy": dict(variant="hyflash", copy_head_rank=32, memory_limit=64),
    # ... reading the committed tokens too, an exact bigram lookup at initialisation (DrafterConfig.copy_head_tokens)
    "hyflash-copytok": dict(variant="hyflash", copy_head_rank=32, copy_head_tokens=True),
    "noslot-copytok": dict(variant="hyflash", copy_head_rank=32, copy_head_tokens=True, slot_attention=False),
    "swa-copytok": dict(variant="swa", copy_head_rank=32, copy_head_tokens=True),
    # ... and its memory (DrafterConfig.copy_memory), for copies from past the window
    "hyflash-copymem": dict(variant="hyflash", copy_head_rank=32, copy_memory=True),
    "gdn-copymem": dict(variant="hyflash", memory="gdn", copy_head_rank=32, copy_memory=True),
    "mem-cut-copymem": dict(variant="hyflash", copy_head_rank=32, copy_memory=True, memory_limit=64),
    "hyflash-copymem128": dict(variant="hyflash", copy_head_rank=128, copy_memory=True),  # 4x the keys a state holds
    "hyflash-copymemtok": dict(variant="hyflash", copy_head_rank=32, copy_memory=True, copy_head_tokens=True),
    "hyflash-copymemtok128": dict(variant="hyflash", copy_head_rank=128, copy_memory=True, copy_head_tokens=True),
    "hyflash-copymemtok256": dict(variant="hyflash", copy_head_rank=256, copy_memory=True, copy_head_tokens=True),
    # ... with its keys DPFP-expanded to 2 x 128 x nu dimensions (DrafterConfig.copy_memory_dpfp)
    "hyflash-copymemtok128-dpfp2": dict(variant="hyflash", copy_head_rank=128, copy_memory=True, copy_head_tokens=True,
                                        copy_memory_dpfp=2),
    "hyflash-copymemtok128-dpfp4": dict(variant="hyflash", copy_head_rank=128, copy_memory=True, copy_head_tokens=True,
                                        copy_memory_dpfp=4),
    "mem-cut-copymemtok128": dict(variant="hyflash", copy_head_rank=128, copy_memory=True, copy_head_tokens=True,
                                  memory_limit=64),
}
TOY = dict(num_layers=2, block_size=4, window=64, hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16,
           intermediate_size=128, memory_heads=4, memory_head_dim=16, memory_state_dim=16, vocab_size=512,
           target_hidden_size=64, target_layers=[0], context_lag_rank=32)


def make_batch(n: int, task: str, g: torch.Generator, L: int = 24, V: int = 512, window: int = 64,
               far_back: tuple[int, int] | None = None, T: int | None = None):
    """n sequences [n, T] of random tokens with one copy each, and the copy's [start, end) per sequence (T 192 for
    near copies, 256 for far ones, whose source lies 96–183 tokens back; ``far_back`` (lo, hi): far sources lo to
    hi − 1 tokens back instead, in sequences of ``T`` tokens)."""
    T = T or (192 if task == "near" else 256)
    ids = torch.randint(V, (n, T), generator=g)
    spans = []
    for i in range(n):
        if task == "near":
            d = int(torch.randint(L + 1, window - 8, (1,), generator=g))
        else:  # the whole source past the window: d - L >= window
            lo, hi = far_back or (window + L + 8, 2 * window + L + 32)
            d = int(torch.randint(lo, hi, (1,), generator=g))
        start = int(torch.randint(d, T - L, (1,), generator=g))
        ids[i, start:start + L] = ids[i, start - d:start - d + L]
        spans.append((start, start + L))
    return ids, spans


def anchors_and_targets(ids, spans, per_seq: int, S: int, g: torch.Generator):
    """Anchors inside each copy (offset ≥ 1: the anchor is itself a copied token) and the block's labels and mask."""
    n, T = ids.shape
    anchors = torch.stack([torch.randint(s + 1, e - 1, (per_seq,), generator=g) for s, e in spans])  # [n, k]
    pos = anchors[..., None] + 1 + torch.arange(S)  # slot j: token a + 1 + j
    ends = torch.tensor([e for _, e in spans])[:, None, None]
    mask = pos < ends
    labels = torch.gather(ids, 1, pos.clamp(max=T - 1).flatten(1)).view_as(pos)
    return anchors, labels, mask


def tau_hat(logits, labels, mask) -> tuple[float, list[float]]:
    """1 + the mean accepted prefix (as ``hyflash.train`` validates), and each slot's accuracy."""
    right = (logits.argmax(-1) == labels) & mask
    acc = (right.sum((0, 1)) / mask.sum((0, 1)).clamp(min=1)).tolist()
    return 1 + accepted_prefix(logits, labels, mask).float().mean().item(), acc


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--task", choices=["near", "far"], default="near")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--steps", type=int, default=1500)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--anchors", type=int, default=8)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--eval-every", type=int, default=250)
    ap.add_argument("--layers", type=int, default=TOY["num_layers"], help="drafter layers (chaining a fetch needs depth)")
    ap.add_argument("--far-back", default=None, metavar="LO:HI",
                    help="far task: sources LO to HI-1 tokens back (default 96:184, in sequences of 256 tokens)")
    ap.add_argument("--length", type=int, default=None, help="tokens a sequence (default 192 near, 256 far)")
    args = ap.parse_args()
    far_back = None
    if args.far_back:
        lo, hi = far_back = tuple(int(x) for x in args.far_back.split(":"))
        if not (TOY["window"] + 24 <= lo < hi):
            raise SystemExit(f"--far-back {args.far_back}: need {TOY['window'] + 24} <= LO < HI (the whole source "
                             f"past the window of {TOY['window']})")
        length = args.length or hi + 48
        if length < hi + 26:
            raise SystemExit(f"--length {length}: a copy from up to {hi - 1} tokens back needs at least {hi + 26}")
    else:
        length = args.length
    batch = lambda n, gen: make_batch(n, args.task, gen, far_back=far_back, T=length)  # near copies ignore far_back
    torch.set_num_threads(1)
    names = args.variants.split(",")
    unknown = [v for v in names if v not in VARIANTS]
    if unknown:
        raise SystemExit(f"unknown variants {unknown}; choose from {list(VARIANTS)}")
    torch.manual_seed(args.seed)
    emb = torch.randn(TOY["vocab_size"], TOY["hidden_size"])  # the features, anchor embeddings and LM head
    models, opts = {}, {}
    for v in names:
        torch.manual_seed(args.seed + 1)
        models[v] = HyFlashDrafter(DrafterConfig(**{**TOY, **VARIANTS[v], "num_layers": args.layers}), emb, emb)
        opts[v] = torch.optim.AdamW(models[v].parameters(), lr=args.lr, weight_decay=0.01)
    S = TOY["block_size"]
    g_val = torch.Generator().manual_seed(10_000 + args.seed)
    val_ids, val_spans = batch(256, g_val)
    val_anchors, val_labels, val_mask = anchors_and_targets(val_ids, val_spans, args.anchors, S, g_val)
    print(f"{machine_line()} | copy toy, task {args.task}"
          f"{f' (sources {far_back[0]}-{far_back[1] - 1} back)' if far_back and args.task == 'far' else ''}"
          f"{f', {length} tokens' if length else ''}, {args.layers} layers: {args.steps} steps x {args.batch} sequences x "
          f"{args.anchors} anchors, lr {args.lr}, seed {args.seed}; held-out: 256 sequences, "
          f"{int(val_mask[..., 0].sum())} anchors")
    print("# step " + " ".join(f"{v:>13}" for v in names) + "   (held-out τ̂; block of 4, so at most 5)")
    g = torch.Generator().manual_seed(args.seed)
    t0 = time.time()
    for step in range(1, args.steps + 1):
        ids, spans = batch(args.batch, g)
        anchors, labels, mask = anchors_and_targets(ids, spans, args.anchors, S, g)
        feats = F.embedding(ids, emb)
        for v, m in models.items():
            m.train()
            logits = m.forward_train(feats, ids, anchors)
            loss = F.cross_entropy(logits[mask], labels[mask])
            opts[v].zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
            opts[v].step()
        if step % args.eval_every == 0 or step == args.steps:
            cells, accs = [], {}
            with torch.no_grad():
                for v, m in models.items():
                    m.eval()
                    tau, accs[v] = tau_hat(m.forward_train(F.embedding(val_ids, emb), val_ids, val_anchors),
                                           val_labels, val_mask)
                    cells.append(f"{tau:13.3f}")
            print(f"{step:6d} " + " ".join(cells) + f"   [{time.time() - t0:.0f} s]", flush=True)
    print("# per-slot held-out accuracy at the end:")
    for v in names:
        print(f"#   {v:>13}: " + " ".join(f"{a:.3f}" for a in accs[v]))


if __name__ == "__main__":
    main()
