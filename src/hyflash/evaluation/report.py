"""Tables and plots from `hyflash eval` runs: every figure traces to a run folder's raw.jsonl and its command.

    hyflash report RUN_DIR [RUN_DIR ...] --out reports/NAME

writes REPORT.md (the long-context table in the paper's shape, the short-suite table, the ablation and depth
tables, with the source of every table) and, with matplotlib, tau_vs_length.png, drafter_bytes_vs_length.png and
tau_vs_depth.png.
"""

from __future__ import annotations

import json
import random
from collections import defaultdict
from functools import partial
from pathlib import Path

from hyflash import HyflashError


def _median(xs):
    xs = sorted(xs)
    n = len(xs)
    if not n:
        return float("nan")
    return xs[n // 2] if n % 2 else 0.5 * (xs[n // 2 - 1] + xs[n // 2])


def load_run(run_dir) -> tuple[dict, list[dict]]:
    run_dir = Path(run_dir)
    header_path, raw_path = run_dir / "run.json", run_dir / "raw.jsonl"
    if not header_path.exists() or not raw_path.exists():
        raise HyflashError(f"{run_dir} is not an evaluation run (needs run.json and raw.jsonl)")
    from hyflash.evaluation.runner import read_jsonl

    header = json.loads(header_path.read_text())
    rows = read_jsonl(raw_path)
    for r in rows:
        r["_run"] = str(run_dir)
    return header, rows


def aggregate(rows: list[dict]) -> dict[tuple, dict]:
    """(suite, bucket, drafter, temperature) → n, τ (pooled over rounds), speedup (median over items of tokens/s
    against plain decoding of the same item and temperature), tok/s, ms per round, bytes, histogram."""
    base = {(r["_run"], r["item"], r["temperature"]): r for r in rows if r["drafter"] == "none"}
    groups = defaultdict(list)
    for r in rows:
        groups[(r["suite"], r["bucket"], r["drafter"], r["temperature"])].append(r)
    out = {}
    for key, rs in groups.items():
        rounds = sum(r["rounds"] for r in rs)
        hist = defaultdict(int)
        for r in rs:
            for k, v in r["histogram"].items():
                hist[int(k)] += v
        speed = [r["tokens_per_s"] / b["tokens_per_s"] for r in rs
                 if (b := base.get((r["_run"], r["item"], r["temperature"]))) and b["tokens_per_s"] > 0]
        decode = sum(r["decode_s"] for r in rs)
        out[key] = {"n": len(rs), "tau": sum(r["tau"] * r["rounds"] for r in rs) / max(1, rounds),
                    "speedup": _median(speed), "tokens_per_s": sum(r["new_tokens"] - 1 for r in rs) / decode
                    if decode > 0 else 0.0,
                    "draft_ms": sum(r["draft_ms"] for r in rs) / max(1, rounds),
                    "verify_ms": sum(r["verify_ms"] for r in rs) / max(1, rounds),
                    "drafter_bytes": (min(r["drafter_state_bytes"] for r in rs),
                                      max(r["drafter_state_bytes"] for r in rs)),
                    "target_kv_bytes": _median([r["target_kv_bytes"] for r in rs]),
                    "prompt_tokens": _median([r["prompt_tokens"] for r in rs]),
                    "histogram": dict(sorted(hist.items()))}
    return out


def _bytes(lo_hi) -> str:
    lo, hi = lo_hi
    return f"{lo:,}" if lo == hi else f"{lo:,}–{hi:,}"


def machine_env(m: dict) -> str:
    """The summary's sentence on kernels, CPU flags and numeric settings, for runs that recorded them ("" else)."""
    if "env" not in m:
        return ""
    env = " ".join(f"{k}={v}" for k, v in m["env"].items()) or "none of the numeric settings"
    return f" Kernels {m['kernels']}, CPU flags {' '.join(m['cpu_flags']) or 'none of note'}; environment: {env}."


def cpu_name(m: dict) -> str:
    """A run's ``machine()`` record: its CPU name with its family and model where known (run.json files before 2026-12-05 lack them)."""
    return f"{m['cpu']} ({m['cpu_id']})" if m.get("cpu_id") else m["cpu"]


def summary_markdown(header: dict, agg: dict) -> str:
    s = header["settings"]
    lines = [f"# Evaluation: {s['target']}", "",
             f"Started {header['started']} on {cpu_name(header['machine'])} ({header['machine']['cores']} cores, "
             f"torch threads {header['machine']['torch_threads']}), commit {header['commit']}."
             + machine_env(header['machine']),
             f"Command: `{header['command']}`", f"Data: {', '.join(f'{k} {v}' for k, v in header['data'].items())} "
             f"({header['note']}).", "",
             "| suite | bucket | drafter | T | n | τ | speedup (median) | tok/s | draft ms/round | verify ms/round | "
             "drafter context B | target KV B (median) |", "|---" * 12 + "|"]
    for (suite, bucket, drafter, t), a in sorted(agg.items(), key=lambda kv: (kv[0][0], _bucket_key(kv[0][1]),
                                                                              kv[0][3], kv[0][2])):
        lines.append(f"| {suite} | {bucket or '–'} | {drafter} | {t:g} | {a['n']} | {a['tau']:.2f} | "
                     f"{a['speedup']:.2f}x | {a['tokens_per_s']:.1f} | {a['draft_ms']:.1f} | {a['verify_ms']:.1f} | "
                     f"{_bytes(a['drafter_bytes'])} | {a['target_kv_bytes']:,.0f} |")
    return "\n".join(lines) + "\n"


def write_summary(run_dir) -> Path:
    header, rows = load_run(run_dir)
    path = Path(run_dir) / "summary.md"
    path.write_text(summary_markdown(header, aggregate(rows)))
    return path


def _bucket_key(b: str) -> int:
    if not b:
        return -1
    from hyflash.evaluation.suites import parse_bucket

    return parse_bucket(b)[0]


# ------------------------------------------------------------------------------------------------ reports
def _pick_temperature(agg: dict) -> float:
    temps = sorted({k[3] for k in agg})
    return 1.0 if 1.0 in temps else temps[0]


def build_report(run_dirs: list, out_dir, fake: bool = False, training_length: int | None = None) -> Path:
    """REPORT.md (+ plots) from one or more runs. ``fake``: mark every table as built from fake numbers (tests).
    ``training_length``: the drafters' training length in tokens, for the bars (``paper_claims``)."""
    runs = [load_run(d) for d in run_dirs]
    if not runs:
        raise HyflashError("no runs given")
    rows = [r for _, rs in runs for r in rs]
    agg = aggregate(rows)
    infos = {}
    for header, _ in runs:
        infos.update(header.get("drafter_info", {}))
    drafters = list(dict.fromkeys(r["drafter"] for r in rows))
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    src = "; ".join(f"`{d}/raw.jsonl` (`{h['command']}`)" for d, (h, _) in zip(run_dirs, runs))
    md = ["# Evaluation report", ""]
    if fake:
        md += ["**FAKE NUMBERS: a test fixture, not a measurement.**", ""]
    opt = f" --training-length {training_length}" if training_length else ""
    md += [f"Built by `hyflash report {' '.join(str(d) for d in run_dirs)}{opt} --out {out_dir}` from {src}.", ""]

    # long-context table, paper shape: bucket rows, drafter columns, τ
    by_cell = _by_cell(rows)
    for suite in sorted({k[0] for k in agg if k[1]}):
        buckets = sorted({k[1] for k in agg if k[0] == suite}, key=_bucket_key)
        for t in sorted({k[3] for k in agg if k[0] == suite}, reverse=True):  # the paper's temperature 1 first
            cols = [d for d in drafters if any((suite, b, d, t) in agg for b in buckets)]
            md += [f"## {suite}: τ by prompt length (temperature {t:g})", "",
                   "| prompt length | " + " | ".join(cols) + " |", "|---" * (len(cols) + 1) + "|"]
            for b in buckets:
                cells = [f"{agg[(suite, b, d, t)]['tau']:.2f}" if (suite, b, d, t) in agg else "–" for d in cols]
                # distinct prompts, so the plain baseline that every run repeats is not counted once per run
                n = len({r["item"] for r in by_cell.get((suite, b, t), ())})
                md.append(f"| {b} (n={n}) | " + " | ".join(cells) + " |")
            md.append("")
    md += paper_claims(agg, infos, training_length, rows)
    # short suites: τ and speedup per drafter
    short = sorted({k[0] for k in agg if not k[1]})
    if short:
        for t in sorted({k[3] for k in agg if not k[1]}):
            cols = [d for d in drafters if d != "none" and any((s, "", d, t) in agg for s in short)]
            md += [f"## Short suites (temperature {t:g}): τ / median speedup over plain decoding", "",
                   "| suite | " + " | ".join(cols) + " |", "|---" * (len(cols) + 1) + "|"]
            for s in short:
                cells = [f"{agg[(s, '', d, t)]['tau']:.2f} / {agg[(s, '', d, t)]['speedup']:.2f}x"
                         if (s, "", d, t) in agg else "–" for d in cols]
                md.append(f"| {s} | " + " | ".join(cells) + " |")
            md.append("")
    # ablations / depth: drafter configuration next to its pooled τ per suite
    described = [d for d in drafters if "variant" in infos.get(d, {})]
    draft_t = any(infos[d].get("draft_temperature") is not None for d in described)  # a column only then
    for t in sorted({k[3] for k in agg if k[2] in described}, reverse=True):  # one table per temperature, 1 first
        suites_all = sorted({k[0] for k in agg if k[3] == t})
        md += [f"## Drafter configurations (ablations, depth): τ pooled over buckets (temperature {t:g})", "",
               "| drafter | variant | layers | memory | memory limit | slot attention | "
               + ("draft temperature | " if draft_t else "") + " | ".join(suites_all)
               + " |", "|---" * (6 + draft_t + len(suites_all)) + "|"]
        for d in described:
            i = infos[d]
            cells = []
            for s in suites_all:
                rounds = [a for k, a in agg.items() if k[0] == s and k[2] == d and k[3] == t]
                cells.append(f"{sum(a['tau'] * a['n'] for a in rounds) / sum(a['n'] for a in rounds):.2f}"
                             if rounds else "–")
            md.append(f"| {d} | {i['variant']} | {i['num_layers']} | {i['memory'] if i['variant'] == 'hyflash' else '–'}"
                      f" | {i['memory_limit'] or '–'} | {'yes' if i['slot_attention'] else 'no'} | "
                      + (f"{_draft_t(i.get('draft_temperature'))} | " if draft_t else "")
                      + " | ".join(cells) + " |")
        md.append("")
    plots = _plots(agg, drafters, infos, out)
    md += [f"![{p.stem}]({p.name})" for p in plots]
    path = out / "REPORT.md"
    path.write_text("\n".join(md) + "\n")
    return path


def _draft_t(t: float | None) -> str:
    """A drafter's draft temperature as the configuration table gives it."""
    return "as sampled" if t is None else "0 (argmax)" if t == 0 else f"{t:g}"


# ------------------------------------------------------------------------------------ the paper's claims
PROBES = ("probe_nearby", "probe_distant")


def _roles(infos: dict) -> dict[str, str]:
    """Which evaluated drafter plays which part in the paper's comparisons (the first of each kind). A drafter run
    with a draft temperature of its own (``~T``) plays none: the comparisons are between drafters, each drawing its
    guesses at the generation's own temperature. Whether the draft slots attend to each other is set by the first
    HyFlash drafter with its whole memory: when it has no slot attention (a family trained without it), full
    attention and the sliding window are taken from drafters without it too."""
    described = {label: i for label, i in infos.items()
                 if "variant" in i and i.get("draft_temperature") is None}
    slots = next((i.get("slot_attention", True) for i in described.values()
                  if i["variant"] == "hyflash" and i.get("memory_limit") is None), True)
    roles = {}
    for label, i in described.items():
        if i.get("memory_limit") is not None:
            role = "memory-limited"
        elif i.get("slot_attention", True) == slots:
            role = i["variant"]
        else:
            role = "no slot attention" if slots else "with slot attention"
        roles.setdefault(role, label)
    return roles


def _extra(a: dict | None) -> float | None:
    return None if a is None else a["tau"] - 1.0


def _ratio(x: float | None, y: float | None) -> str:
    if x is None or y is None:
        return "–"
    return f"{x / y:.2f}" if y > 0 else ("∞" if x > 0 else "–")


def _meets(ok: bool | None) -> str:
    return "–" if ok is None else "**met**" if ok else "**not met**"


def _bar_holds(beyond: bool, eh: float | None, ef: float | None, es: float | None) -> bool | None:
    """The issue's bar on τ − 1 (``None`` where a drafter it needs was not evaluated): beyond the training length
    HyFlash ≥ 1.5× full attention and ≥ 1.1× sliding window, within it HyFlash ≥ full attention."""
    if beyond:
        if ef is None or es is None:
            return None
        return (eh >= 1.5 * ef if ef > 0 else eh > 0) and (eh >= 1.1 * es if es > 0 else eh > 0)
    return None if ef is None else eh >= ef


BOOTSTRAP_DRAWS = 2000


def _by_cell(rows: list[dict]) -> dict[tuple, list[dict]]:
    """The raw rows grouped by (suite, bucket, temperature), so each table cell reads only its own rows."""
    cells = defaultdict(list)
    for r in rows:
        cells[(r["suite"], r["bucket"], r["temperature"])].append(r)
    return cells


def _paired_items(cell_rows: list[dict], drafters: list[str]) -> list[list]:
    """Per prompt that every one of ``drafters`` decoded in one cell (``_by_cell``'s rows of a suite, bucket and
    temperature): each drafter's (committed tokens, rounds), in the order of ``drafters``. Rows of one drafter on one
    item in several runs pool, as ``aggregate`` pools them."""
    by_item = defaultdict(lambda: defaultdict(lambda: [0.0, 0]))
    for r in cell_rows:
        if r["drafter"] in drafters:
            acc = by_item[r["item"]][r["drafter"]]
            acc[0] += r["tau"] * r["rounds"]
            acc[1] += r["rounds"]
    return [[tuple(v[d]) for d in drafters] for _, v in sorted(by_item.items()) if len(v) == len(drafters)]


def bootstrap_support(items: list[list], holds, draws: int = BOOTSTRAP_DRAWS, seed: int = 0) -> float | None:
    """The share of ``draws`` resamples of the prompts (with replacement, the same prompts for every drafter) in
    which ``holds(τ − 1 of each drafter, pooled over the resample's rounds)`` is true: near 1, a reading that other
    prompts of the same kind would likely repeat; near ½, a coin toss. ``items``: ``_paired_items``'s lists."""
    if not items:
        return None
    rng, n, hits = random.Random(seed), len(items), 0
    for _ in range(draws):
        pick = [items[rng.randrange(n)] for _ in range(n)]
        extra = [sum(p[j][0] for p in pick) / max(1, sum(p[j][1] for p in pick)) - 1.0 for j in range(len(items[0]))]
        hits += bool(holds(*extra))
    return hits / draws


def _support_cell(items: list[list], holds) -> str:
    """``bootstrap_support`` as a table cell, with the number of prompts it resampled (few prompts: a weak guide)."""
    x = bootstrap_support(items, holds)
    return "–" if x is None else f"{100 * x:.0f}% ({len(items)})"


def _ahead_cell(items: list[list]) -> str:
    """How often the first of two drafters is ahead over bootstrap resamples; "level" where the two committed the
    same tokens in the same rounds on every prompt (the same guesses accepted, e.g. a memory cut that never bites)."""
    if items and all(a == b for a, b in items):
        return f"level ({len(items)})"
    return _support_cell(items, lambda e1, e2: e1 > e2)


def paper_claims(agg: dict, infos: dict, training_length: int | None = None,
                 rows: list[dict] | None = None) -> list[str]:
    """The issue's bars, checked on these runs: τ − 1 beyond the training length vs full attention (≥ 1.5×) and
    sliding window (≥ 1.1×), τ ≥ full attention within it. Beyond it are the two longest buckets (the issue's
    definition, for drafters trained at the length its bucket plan assumes) or, given ``training_length``, every
    bucket whose shortest prompt is at least that long; the distant-evidence probe (HyFlash
    above the memory-limited ablation and sliding window), the nearby probe (slot attention matters), and the
    drafter's context bytes (flat for HyFlash, growing for full attention). Given the raw ``rows``, each verdict also
    says how often it holds over paired bootstrap resamples of the cell's prompts (``bootstrap_support``)."""
    roles = _roles(infos)
    h = roles.get("hyflash")
    if h is None:
        return []
    by_cell = _by_cell(rows or [])
    header = ["## The paper's claims at our scale", "",
              f"Roles: {', '.join(f'{r} = `{d}`' for r, d in roles.items())}. τ − 1 = extra tokens per round.", ""]
    md = []  # the section's tables; none without long-context items (e.g. a short-suite run): no section then
    for t in sorted({k[3] for k in agg if k[1] and k[2] == h}, reverse=True):
        get = lambda s, b, d: agg.get((s, b, d, t)) if d else None  # noqa: E731
        suites = sorted({k[0] for k in agg if k[1] and k[0] not in PROBES and k[2] == h and k[3] == t})
        table = []
        for s in suites:
            buckets = sorted({k[1] for k in agg if k[0] == s and k[2] == h and k[3] == t}, key=_bucket_key)
            if training_length:
                beyond = {b for b in buckets if _bucket_key(b) >= training_length}
            else:
                beyond = set(buckets[-2:]) if len(buckets) > 2 else set()
            for b in buckets:
                eh, ef, es = (_extra(get(s, b, roles.get(r))) for r in ("hyflash", "full", "swa"))
                ok = _bar_holds(b in beyond, eh, ef, es)
                bar = "beyond: ≥1.5× full, ≥1.1× swa" if b in beyond else "within: τ ≥ full"
                cell = lambda e: "–" if e is None else f"{e:.2f}"  # noqa: E731
                line = (f"| {s} | {b} | {cell(eh)} | {cell(ef)} | {cell(es)} | {_ratio(eh, ef)} | "
                        f"{_ratio(eh, es)} | {bar} | {_meets(ok)} |")
                if rows is not None:
                    # within the length the bar reads HyFlash and full attention only: a missing swa drops nothing
                    if b in beyond:
                        ds, holds = ("hyflash", "full", "swa"), partial(_bar_holds, True)
                    else:
                        ds, holds = ("hyflash", "full"), lambda xh, xf: _bar_holds(False, xh, xf, None)
                    cell_rows = by_cell.get((s, b, t), [])
                    items = _paired_items(cell_rows, [roles[r] for r in ds]) if ok is not None else []
                    line += f" {_support_cell(items, holds)} |"
                table.append(line)
        if table:
            boot = rows is not None
            md += [f"### Long-context suites, temperature {t:g}", ""]
            if boot:
                md += [f"Last column: the share of {BOOTSTRAP_DRAWS:,} paired bootstrap resamples of the cell's "
                       "prompts in which the bar holds (each resample draws the cell's prompts with replacement, the same "
                       "ones for every drafter; in brackets, how many prompts): near 100% or 0%, a verdict other "
                       "prompts of the kind would likely repeat; near 50%, one these prompts decided. With fewer "
                       "than about 8 prompts a resample repeats the same few and the share overstates certainty.", ""]
            md += ["| suite | bucket | HyFlash τ−1 | full τ−1 | swa τ−1 | HyFlash/full | HyFlash/swa | bar | |"
                   + (" holds in |" if boot else ""), "|---" * (9 + boot) + "|"] + table + [""]
        probe_rows = []
        # the nearby probe sets HyFlash against its slot-attention ablation: the drafter without it, or, in a family
        # trained without slot attention, the one with it
        slot_role = "with slot attention" if "with slot attention" in roles else "no slot attention"
        for s, others in (("probe_distant", ("memory-limited", "swa", "full")),
                          ("probe_nearby", (slot_role, "swa", "full"))):
            for b in sorted({k[1] for k in agg if k[0] == s and k[2] == h and k[3] == t}, key=_bucket_key):
                eh = _extra(get(s, b, h))
                cells = [f"{_extra(get(s, b, roles.get(r))):.2f}" if get(s, b, roles.get(r)) else "–"
                         for r in others]
                ratios = [_ratio(eh, _extra(get(s, b, roles.get(r)))) for r in others[:2]]
                line = (f"| {s} | {b} | {eh:.2f} | " + " | ".join(f"{r}: {c}" for r, c in zip(others, cells))
                        + " | " + " / ".join(ratios) + " |")
                if rows is not None:
                    cell_rows = by_cell.get((s, b, t), [])
                    ahead = [_ahead_cell(_paired_items(cell_rows, [h, roles[r]])) if get(s, b, roles.get(r))
                             else "–" for r in others[:2]]
                    line += " " + " / ".join(ahead) + " |"
                probe_rows.append(line)
        if probe_rows:
            boot = rows is not None
            md += [f"### Probes, temperature {t:g} (τ − 1; ratios: HyFlash ÷ each of the first two"
                   + ("; HyFlash ahead in: the share of paired bootstrap resamples of the prompts where its τ is above"
                      " each of the first two, as for the suites above" if boot else "") + ")", "",
                   "| probe | bucket | HyFlash | vs | vs | vs | ratios |" + (" HyFlash ahead in |" if boot else ""),
                   "|---" * (7 + boot) + "|"] + probe_rows + [""]
    sizes = {}
    for d in (h, roles.get("full"), roles.get("swa")):
        ks = [k for k in agg if k[1] and k[2] == d]
        if d and ks:
            lo = min(agg[k]["drafter_bytes"][0] for k in ks)
            hi = max(agg[k]["drafter_bytes"][1] for k in ks)
            sizes[d] = f"{lo:,}–{hi:,} B" if lo != hi else f"{lo:,} B in every bucket"
    if sizes:
        flat = sizes[h].endswith("every bucket")
        md += ["### Drafter context memory over all long-context items", "",
               *[f"- `{d}`: {v}" for d, v in sizes.items()],
               f"- HyFlash identical across buckets: {_meets(flat)}", ""]
    return header + md if md else []


def _plots(agg: dict, drafters: list[str], infos: dict, out: Path) -> list[Path]:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    made = []
    long_keys = [k for k in agg if k[1]]
    if long_keys:
        t = _pick_temperature({k: agg[k] for k in long_keys})
        suites = sorted({k[0] for k in long_keys})
        for name, field, ylabel, panels in (("tau_vs_length", "tau", "acceptance length τ", suites),
                                            ("drafter_bytes_vs_length", "drafter_bytes", "drafter context bytes",
                                             [None])):
            # τ: a panel per suite (suites differ in how much the text repeats); bytes depend on length only
            fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels) + 1, 4), squeeze=False,
                                     sharey=True)
            for ax, suite in zip(axes[0], panels):
                for d in drafters:
                    pts = defaultdict(list)
                    for k in long_keys:
                        if k[2] == d and k[3] == t and suite in (None, k[0]):
                            v = agg[k][field]
                            pts[agg[k]["prompt_tokens"]].append(v[1] if isinstance(v, tuple) else v)
                    if pts:
                        xs = sorted(pts)
                        ax.plot(xs, [sum(pts[x]) / len(pts[x]) for x in xs], marker="o", label=d)
                ax.set_xscale("log", base=2)
                ax.set_xlabel("prompt tokens (bucket median)")
                if suite is not None:
                    ax.set_title(suite, fontsize=10)
                ax.grid(alpha=0.3)
            axes[0][0].set_ylabel(ylabel)
            axes[0][-1].legend(fontsize=8)
            fig.tight_layout()
            fig.savefig(out / f"{name}.png", dpi=120)
            plt.close(fig)
            made.append(out / f"{name}.png")
    by_variant = defaultdict(dict)
    for d, i in infos.items():
        if "variant" in i and i.get("memory_limit") is None and i.get("slot_attention", True):
            ks = [k for k in agg if k[2] == d]
            if ks:
                by_variant[i["variant"]][i["num_layers"]] = sum(agg[k]["tau"] * agg[k]["n"] for k in ks) / sum(
                    agg[k]["n"] for k in ks)
    if any(len(v) > 1 for v in by_variant.values()):
        fig, ax = plt.subplots(figsize=(5, 4))
        for variant, pts in by_variant.items():
            xs = sorted(pts)
            ax.plot(xs, [pts[x] for x in xs], marker="o", label=variant)
        ax.set_xlabel("drafter layers")
        ax.set_ylabel("acceptance length τ (pooled)")
        ax.legend()
        ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(out / "tau_vs_depth.png", dpi=120)
        plt.close(fig)
        made.append(out / "tau_vs_depth.png")
    return made
