"""Ablations compared where training measures them: held-out τ̂ at equal steps, from the runs' own logs.

    hyflash training-report RUN_DIR [RUN_DIR ...] --at-step 500 --out reports/NAME

Each RUN_DIR is a ``hyflash train`` output (its ``train_config.json`` and ``log.jsonl``; checkpoints are not needed,
so the two files can be copied next to the report). For every run the table gives what its recipe changes, its
trainable parameters, and the held-out τ̂ (1 + mean accepted prefix of argmax drafts on the same held-out anchors,
``hyflash.train.evaluate``) at the chosen step of the same schedule, so runs stopped early compare at equal budget.
Runs trained on several data stores also get each store's held-out τ̂ apart (a table, and
val_tau_by_store_vs_step.png). Writes REPORT.md and, with matplotlib, val_tau_vs_step.png and
val_tau_vs_depth.png.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import torch

from hyflash import HyflashError
from hyflash.drafter.config import DrafterConfig

# drafter fields that make an ablation, in the order the table names them
ABLATION_FIELDS = ("variant", "num_layers", "memory", "memory_limit", "slot_attention", "window", "memory_long_heads",
                   "memory_min_half_life", "context_lags", "copy_head_rank", "copy_head_tokens", "copy_memory",
                   "copy_memory_dpfp", "copy_memory_gate")


def load_training_run(run_dir) -> tuple[dict, list[dict]]:
    run_dir = Path(run_dir)
    cfg_path, log_path = run_dir / "train_config.json", run_dir / "log.jsonl"
    if not cfg_path.exists() or not log_path.exists():
        raise HyflashError(f"{run_dir} is not a training run (needs train_config.json and log.jsonl)")
    cfg = json.loads(cfg_path.read_text())
    log = [json.loads(line) for line in log_path.read_text().splitlines() if line.strip()]
    return cfg, log


def trainable_parameters(cfg: dict) -> int:
    """The drafter's trainable parameters from its config alone (the shared embedding/LM head are not counted)."""
    from hyflash.drafter.model import HyFlashDrafter

    d = cfg["drafter"]
    # a saved training config holds the dataclass default for the target's width (the target sets it when training
    # starts); the drafter shares the target's embedding, so the two widths are equal
    dcfg = DrafterConfig.from_dict({**d, "target_hidden_size": d.get("hidden_size", 576)})
    emb = torch.zeros(1, dcfg.hidden_size)
    return HyFlashDrafter(dcfg, emb, emb).num_parameters()


def run_row(name: str, cfg: dict, log: list[dict], step: int) -> dict:
    evals = [r for r in log if "val_tau" in r]
    at = next((r for r in evals if r["step"] == step), None)
    last = evals[-1] if evals else None
    # a field a run's config leaves out has its default (configs written before the field existed leave it out)
    defaults = {f.name: f.default for f in dataclasses.fields(DrafterConfig) if f.name in ABLATION_FIELDS}
    return {"name": name, **{f: cfg["drafter"].get(f, defaults[f]) for f in ABLATION_FIELDS},
            "params": trainable_parameters(cfg), "schedule_steps": cfg["steps"], "steps_run": log[-1]["step"] if log else 0,
            "val_tau": None if at is None else at["val_tau"], "val_anchors": None if at is None else at["val_anchors"],
            "val_tau_se": None if at is None else at.get("val_tau_se"),  # logged by runs since 2026-11-30
            "half_life": None if at is None else at.get("val_half_life"),  # logged by runs since 2026-12-02
            "hours": None if at is None else at["elapsed"] / 3600,
            "last_step": None if last is None else last["step"], "last_val_tau": None if last is None else last["val_tau"],
            "curve": [(r["step"], r["val_tau"]) for r in evals],
            # a run on several stores logs each store's held-out τ̂ apart (train.py: val_tau_parts, in data order)
            "stores": store_names(cfg.get("data")), "parts": None if at is None else at.get("val_tau_parts"),
            "parts_curve": [(r["step"], r["val_tau_parts"]) for r in evals if r.get("val_tau_parts")],
            "recipe": {k: cfg[k] for k in ("data", "seq_len", "batch_seqs", "anchors_per_seq", "lr", "seed",
                                           "kl_weight", "draft_vocab") if k in cfg}}


def store_names(data) -> list[str]:
    """Short names of a recipe's data stores: each path's last part, or its last two where those clash."""
    paths = [data] if isinstance(data, str) else list(data or [])
    names = [Path(d).name for d in paths]
    if len(set(names)) < len(names):
        names = ["/".join(Path(d).parts[-2:]) for d in paths]
    return names


def _on_stores(row: dict, names: list[str], parts) -> bool:
    """Whether ``parts`` (one logged val_tau_parts) of ``row`` are τ̂ values on exactly the stores ``names``."""
    return bool(parts) and row["stores"] == names and len(parts) == len(names)


def _stores_table(rows: list[dict], step: int) -> list[str]:
    """Held-out τ̂ on each data store apart, for runs trained on several (empty when none logs it)."""
    split = [r for r in rows if r.get("parts")]
    if not split:
        return []
    names = split[0]["stores"]
    lines = [f"Held-out τ̂ on each data store apart at step {step} (each store holds out its own sequences):", "",
             "| run | " + " | ".join(f"`{n}`" for n in names) + " |", "|---|" + "---|" * len(names)]
    for r in rows:
        if _on_stores(r, names, r.get("parts")):
            cells = ["–" if t is None else f"{t:.3f}" for t in r["parts"]]
        else:
            cells = ["not logged" if not r.get("parts") else "other stores"] * len(names)
        lines.append(f"| {r['name']} | " + " | ".join(cells) + " |")
    return lines + [""]


def _differs(row: dict, base: dict | None) -> str:
    if base is None or row is base:
        return "—"
    changed = [f"{f} {row[f]}" for f in ABLATION_FIELDS if row[f] != base[f]]
    return ", ".join(changed) or "same drafter"


def training_markdown(rows: list[dict], step: int, command: str, fake: bool = False) -> str:
    base = next((r for r in rows if r["name"] == "hyflash"), rows[0])
    same = {json.dumps(r["recipe"], sort_keys=True) for r in rows}
    lines = []
    if fake:
        lines += ["> **FAKE NUMBERS: a test fixture of the report generator, not a measurement.**", ""]
    lines += [f"# Held-out τ̂ at equal training steps (step {step} of the same schedule)", "",
              f"Command: `{command}`", "",
              "τ̂ = 1 + the mean accepted prefix of the drafter's argmax block against the target's greedy tokens, on the "
              "same held-out sequences and anchors for every run (`hyflash.train.evaluate`; an acceptance-length proxy "
              "measured during training, not a decoding run).", ""]
    if len(same) > 1:
        lines += ["**The runs do not share data, length, batch, learning rate, seed or distillation: the comparison is "
                  "not at equal budget.**", ""]
    lines += [f"| run | differs from {base['name']} | trainable params | τ̂ at step {step} | τ̂−1 vs {base['name']} "
              "| hours to that step | last τ̂ (step) |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        ratio = "–"
        if r["val_tau"] is not None and base["val_tau"] is not None and base["val_tau"] > 1:
            ratio = f"{(r['val_tau'] - 1) / (base['val_tau'] - 1):.2f}×"
        tau = "not reached" if r["val_tau"] is None else f"{r['val_tau']:.3f}"
        if r["val_tau_se"] is not None:
            tau += f" ± {r['val_tau_se']:.3f}"
        hours = "–" if r["hours"] is None else f"{r['hours']:.2f}"
        last = "–" if r["last_step"] is None else f"{r['last_val_tau']:.3f} ({r['last_step']}/{r['schedule_steps']})"
        lines.append(f"| {r['name']} | {_differs(r, base)} | {r['params'] / 1e6:.2f}M | {tau} | {ratio} | {hours} | "
                     f"{last} |")
    lines += ["", f"Held-out anchors per evaluation: {sorted({r['val_anchors'] for r in rows if r['val_anchors']})}. "
              "Hours are each run's own training time (machines and load differ: not a speed comparison).", ""]
    lines += _stores_table(rows, step)
    reach = [r for r in rows if r.get("half_life")]
    if reach:  # runs that log it: how far each memory head reaches at that step
        lines += [f"Memory reach at step {step}: each layer's memory heads by median half-life on the held-out features "
                  "(features; a write keeps half after that many), longest first:", ""]
        for r in reach:
            layers = "; ".join(f"layer {i}: " + ", ".join(f"{h:,.0f}" if h >= 10 else f"{h:.1f}"
                                                          for h in sorted(layer, reverse=True))
                               for i, layer in enumerate(r["half_life"]))
            lines.append(f"- {r['name']}: {layers}")
        lines.append("")
    return "\n".join(lines)


def _plots(rows: list[dict], step: int, out: Path) -> list[Path]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("hyflash: matplotlib is not installed (pip install 'hyflash[plot]'); no plots", file=sys.stderr)
        return []
    made = []
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for r in rows:
        if r["curve"]:
            ax.plot(*zip(*r["curve"]), marker="o", ms=3, label=r["name"])
    ax.axvline(step, color="grey", lw=0.8, ls="--")
    ax.set_xlabel("training step")
    ax.set_ylabel("held-out τ̂")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "val_tau_vs_step.png", dpi=120)
    plt.close(fig)
    made.append(out / "val_tau_vs_step.png")
    split = [r for r in rows if r["parts_curve"]]
    if split:  # one panel per data store: held-out τ̂ on that store against steps
        names = split[0]["stores"]
        fig, axes = plt.subplots(1, len(names), figsize=(3.2 * len(names) + 0.5, 3.6), sharey=True, squeeze=False)
        for j, (name, ax) in enumerate(zip(names, axes[0])):
            for r in split:
                pts = [(st, parts[j]) for st, parts in r["parts_curve"]
                       if _on_stores(r, names, parts) and parts[j] is not None]
                if pts:
                    ax.plot(*zip(*pts), marker="o", ms=3, label=r["name"])
            ax.axvline(step, color="grey", lw=0.8, ls="--")
            ax.set_title(name, fontsize=9)
            ax.set_xlabel("training step")
            ax.grid(alpha=0.3)
        axes[0][0].set_ylabel("held-out τ̂ on the store")
        axes[0][-1].legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(out / "val_tau_by_store_vs_step.png", dpi=120)
        plt.close(fig)
        made.append(out / "val_tau_by_store_vs_step.png")
    depth = {}  # variant -> {layers: τ̂}, for runs that change nothing but the layer count
    for r in rows:
        plain = (r["memory_limit"] is None and r["slot_attention"] is not False and r["memory"] == "mamba2"
                 and not r["context_lags"] and not r["copy_head_rank"])
        if plain and r["val_tau"] is not None:
            depth.setdefault(r["variant"], {})[r["num_layers"]] = r["val_tau"]
    if any(len(v) > 1 for v in depth.values()):
        fig, ax = plt.subplots(figsize=(5, 4))
        for variant, pts in sorted(depth.items()):
            xs = sorted(pts)
            ax.plot(xs, [pts[x] for x in xs], marker="o", label=variant)
        ax.set_xticks(sorted({x for v in depth.values() for x in v}))
        ax.set_xlabel("drafter layers")
        ax.set_ylabel(f"held-out τ̂ at step {step}")
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        fig.savefig(out / "val_tau_vs_depth.png", dpi=120)
        plt.close(fig)
        made.append(out / "val_tau_vs_depth.png")
    return made


def build_training_report(run_dirs: list, out_dir, step: int, command: str, fake: bool = False) -> Path:
    """REPORT.md (+ plots) comparing the training runs in ``run_dirs`` (named by their folder) at ``step``."""
    if not run_dirs:
        raise HyflashError("no training runs given")
    rows = []
    for d in run_dirs:
        cfg, log = load_training_run(d)
        rows.append(run_row(Path(d).name, cfg, log, step))
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    text = training_markdown(rows, step, command, fake)
    plots = _plots(rows, step, out)
    if plots:
        text += "\n" + "\n".join(f"![{p.stem}]({p.name})" for p in plots) + "\n"
    (out / "REPORT.md").write_text(text)
    return out / "REPORT.md"
