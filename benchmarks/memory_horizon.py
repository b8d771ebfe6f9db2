"""How far back a trained drafter's recurrent memory can reach: the decay its gates give on real target features.

Each memory head folds a committed feature into its state S and multiplies S by a_t = exp(g_t) at every later
token (``hyflash.drafter.memory``; Mamba-2: g_t = A·softplus(gate_t + dt_bias), Gated DeltaNet likewise before its
delta rule), so what a feature wrote d tokens ago is still there scaled by exp(g_{t+1} + … + g_{t+d}), its
*retention*. Writes and reads do not change that factor: if a head's retention after 512 tokens is tiny, that head
cannot carry anything from further back, however it was trained to read it. This script runs the drafter's memory
gates over committed features of real text and prints, per layer and head, the median per-token half-life and the
median retention at several distances (over every position where the distance fits in the sequence), plus the
same for the gates' biases alone (what the head does when the feature-dependent part is zero) and for a freshly
initialised drafter of the same config. Beyond the sequences' length the retention is extrapolated as
exp(d · mean g) and marked so.

    python benchmarks/memory_horizon.py --drafter PATH --target gemma3-270m --data FEATURE_STORE [--sequences 8]
    python benchmarks/memory_horizon.py --drafter src/hyflash/checkpoints/SmolLM2-135M-Instruct/hyflash \\
        --target smollm2-135m --text FILE [--length 2048] [--sequences 4]
    [--plot OUT.png]: retention against distance for every head
"""

import argparse
import math

import torch

from common import machine_line
from hyflash.drafter.config import DrafterConfig
from hyflash.drafter.model import HyFlashDrafter, from_pretrained, half_lives, new_drafter
from hyflash.target import Target

DISTANCES = [64, 256, 512, 1024, 2048]
EXTRAPOLATED = [8192, 32768]


def feature_sequences(args, target) -> list[torch.Tensor]:
    """[T, F] target features of each sequence: from a feature store, or computed here from a text file."""
    if args.data:
        from hyflash.data.features import FeatureStore

        store = FeatureStore(args.data)
        return [store[i]["features"].float() for i in range(min(args.sequences, len(store)))]
    ids = target.tokenizer.encode(open(args.text, encoding="utf-8").read())
    out = []
    for start in range(0, len(ids) - args.length + 1, args.length):
        if len(out) == args.sequences:
            break
        out.append(target.sequence_forward(torch.tensor(ids[start:start + args.length])).features.float())
    if not out:
        raise SystemExit(f"{args.text} has fewer than {args.length} tokens")
    return out


def log_decays(drafter: HyFlashDrafter, feats: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """Per layer, per sequence: the memory's log-decays g [T, H] on these features (``memory_log_decays``)."""
    out = [[] for _ in drafter.layers]
    for f in feats:
        for i, g in enumerate(drafter.memory_log_decays(f[None].to(next(drafter.parameters()).dtype))):
            if g is not None:
                out[i].append(g[0])
    return out


def retention_table(gs: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per head: half-life (ln 2 / median −g), median retention at each distance that fits, mean g."""
    H = gs[0].shape[1]
    g_all = torch.cat(gs)  # [ΣT, H]
    table = {"half-life": half_lives(g_all), "mean g": g_all.mean(dim=0)}
    for d in DISTANCES:
        parts = []
        for g in gs:
            if g.shape[0] > d:
                G = torch.cat([torch.zeros(1, H), g.cumsum(0)])  # G[j] = g_1 + … + g_j
                parts.append((G[d:] - G[:-d]).exp())  # retention over the d steps after each position
        table[f"r@{d}"] = torch.cat(parts).median(dim=0).values if parts else torch.full((H,), float("nan"))
    for d in EXTRAPOLATED:
        table[f"r@{d}*"] = (d * table["mean g"]).exp()
    return table


def bias_only(layer) -> torch.Tensor:
    """The log-decay a head's gate gives when the feature-dependent part is zero: −exp(A_log)·softplus(dt_bias), or
    −c·sigmoid(dt_bias) for the heads under a reach floor (``memory_long_heads``)."""
    m = layer.memory
    pre = m.dt_bias.detach().float()
    return m._floor(-torch.exp(m.A_log.detach().float()) * torch.nn.functional.softplus(pre), pre)


def fmt(x: float) -> str:
    if math.isnan(x):
        return "     -"
    if x >= 1e4:
        return f"{x:6.0f}"
    return f"{x:6.3g}" if x >= 1e-3 else f"{x:6.0e}"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--drafter", required=True)
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--data", help="a feature store of this target (hyflash.data.features)")
    ap.add_argument("--text", help="else a text file, cut into --length-token sequences")
    ap.add_argument("--length", type=int, default=2048)
    ap.add_argument("--sequences", type=int, default=8)
    ap.add_argument("--plot", help="write retention against distance per head to this PNG")
    args = ap.parse_args()
    if not (args.data or args.text):
        raise SystemExit("give --data STORE or --text FILE")
    torch.manual_seed(0)
    target = Target.load(args.target, dtype="fp32")
    drafter = from_pretrained(args.drafter, target, dtype=torch.float32).eval()
    cfg = drafter.config
    target.feature_layers = list(cfg.target_layers)
    fresh = new_drafter(DrafterConfig.from_dict(cfg.to_dict()), target, torch.float32).eval()
    feats = feature_sequences(args, target)
    print(machine_line())
    print(f"# drafter {args.drafter}: {cfg.variant}, {cfg.memory} memory, {len(drafter.layers)} layers x "
          f"{cfg.memory_heads} heads; target {target.name}; {len(feats)} sequences of "
          f"{min(f.shape[0] for f in feats)}-{max(f.shape[0] for f in feats)} tokens")
    print("# half-life in tokens (median over positions); r@d: median retention after d tokens; r@d*: extrapolated "
          "exp(d * mean g); 'bias' columns: the gate's bias alone; 'init': a freshly initialised drafter, same config")
    trained, init = log_decays(drafter, feats), log_decays(fresh, feats)
    curves = {}
    for i, layer in enumerate(drafter.layers):
        if layer.memory is None:
            continue
        t, t0 = retention_table(trained[i]), retention_table(init[i])
        b = bias_only(layer)
        keys = ["half-life"] + [f"r@{d}" for d in DISTANCES] + [f"r@{d}*" for d in EXTRAPOLATED]
        print(f"\nlayer {i}   " + " ".join(f"{k:>6}" for k in keys) + "   bias half-life   init half-life  init r@512")
        for h in range(layer.memory.H):
            bias_hl = math.log(2) / float(-b[h])
            print(f"  head {h:2d} " + " ".join(fmt(float(t[k][h])) for k in keys)
                  + f"   {fmt(bias_hl):>14}   {fmt(float(t0['half-life'][h])):>14}  {fmt(float(t0['r@512'][h])):>10}")
        for cut in (512, 2048):
            kept = int((t[f"r@{cut}"] >= 0.01).sum())
            print(f"  heads keeping >= 1% of a write after {cut} tokens: {kept} of {layer.memory.H} "
                  f"(freshly initialised: {int((t0[f'r@{cut}'] >= 0.01).sum())})")
        curves[i] = t
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, axes = plt.subplots(1, len(curves), figsize=(5 * len(curves), 4), squeeze=False)
        for ax, (i, t) in zip(axes[0], curves.items()):
            for h in range(len(t["half-life"])):
                ax.plot(DISTANCES, [max(float(t[f"r@{d}"][h]), 1e-12) for d in DISTANCES], marker="o", lw=1,
                        label=f"head {h}")
            ax.set_xscale("log")
            ax.set_yscale("log")
            ax.set_ylim(1e-12, 1.5)
            ax.axhline(0.01, color="grey", ls=":", lw=1)
            ax.set_title(f"layer {i}: each head's retention")
            ax.set_xlabel("tokens since the write")
            ax.set_ylabel("median retention")
            ax.legend(fontsize=7, ncol=2, loc="lower left")
        fig.tight_layout()
        fig.savefig(args.plot, dpi=110)
        print(f"\nplot: {args.plot}")


if __name__ == "__main__":
    main()
