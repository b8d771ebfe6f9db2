"""`hyflash eval`: decode every suite item with every drafter, side by side, and keep the raw numbers.

Output folder:
    run.json       machine, date, commit, target (+ fingerprint), drafters (+ weight sha256), data versions, args
    items.jsonl    the items (id, suite, bucket, prompt length): what was evaluated
    raw.jsonl      one line per (item, drafter, temperature): τ, committed-length histogram, tokens/s, draft and
                   verify ms, drafter context bytes, target KV bytes, the output's token ids
    summary.md     per (suite, bucket, drafter, temperature): τ, speedup over plain decoding, ms, bytes
A rerun with the same settings continues where it stopped (done lines are kept). The target's pass over a prompt
(the expensive part at long context) is computed once per item and shared by every drafter.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import torch

from hyflash import HyflashError, kernels
from hyflash.evaluation import suites as S

FORMAT = 1


# Settings that change a run's last bits (and so, at greedy ties, its tokens): the kernel build and the ISA that
# torch, MKL and oneDNN may use. Two CPUs give the same greedy tokens only with the same ones (reports/README.md).
NUMERIC_ENV = ("HYFLASH_KERNELS", "HYFLASH_FAST_BF16", "ATEN_CPU_CAPABILITY", "MKL_ENABLE_INSTRUCTIONS",
               "ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA")
CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16")


def machine() -> dict:
    """The CPU, its ISA flags that matter here, torch's build and threads, and the numeric settings set in the
    environment (``env``: only those set). ``cpu_id`` is the x86 family and model: virtual machines often name
    every CPU of a vendor alike ("AMD EPYC"), and two generations behind one name differ in speed and kernels."""
    cpu = platform.processor() or platform.machine()
    cpu_id = ""
    flags: list[str] = []
    try:
        with open("/proc/cpuinfo") as f:
            lines = f.read().splitlines()
        cpu = next(line.split(":", 1)[1].strip() for line in lines if line.startswith("model name"))
        have = set(next(line.split(":", 1)[1].split() for line in lines if line.startswith("flags")))
        flags = [f for f in CPU_FLAGS if f in have]
        field = {k.strip(): v.strip() for k, _, v in (line.partition(":") for line in lines[:30])}
        if "cpu family" in field and "model" in field:
            cpu_id = f"family {field['cpu family']} model {field['model']}"
    except (OSError, StopIteration):
        pass
    try:
        build = kernels.isa()
    except HyflashError:  # a bad HYFLASH_KERNELS: the run that uses the kernels says so
        build = None
    return {"cpu": cpu, "cpu_id": cpu_id, "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "torch": torch.__version__, "python": platform.python_version(), "kernels": build or "off",
            "cpu_flags": flags, "env": {k: os.environ[k] for k in NUMERIC_ENV if k in os.environ}}


def git_commit() -> str:
    """The checkout's short commit, with "+changes" when tracked files differ from it (a run of uncommitted code)."""
    here = Path(__file__).parent
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                cwd=here).stdout.strip()
        if not commit:
            return "?"
        changed = subprocess.run(["git", "diff", "--quiet", "HEAD", "--"], capture_output=True, cwd=here).returncode
        return commit + ("+changes" if changed == 1 else "")
    except OSError:
        return "?"


def parse_drafters(spec: str) -> dict[str, str]:
    """'none,ngram,hyflash=PATH,full=PATH2' → {label: spec}; a bare PATH is labelled by its folder name."""
    out = {}
    for part in [p.strip() for p in spec.split(",") if p.strip()]:
        label, _, value = part.partition("=") if "=" in part else (None, None, part)
        if label is None:
            label = value if value in ("none", "ngram", "auto", "ngram+auto") else Path(value).name or value
        if label in out:
            raise HyflashError(f"drafter label {label!r} given twice; name them label=PATH")
        out[label] = value
    out = {"none": "none", **{k: v for k, v in out.items() if k != "none"}}  # plain decoding is the baseline
    return out


def drafter_info(spec: str, target) -> dict:
    from hyflash.drafter.config import DrafterConfig
    from hyflash.proposers import (DEFAULT_WEIGHTS, resolve_tree, shipped_drafter_path, split_draft_temperature,
                                   split_spec, split_weights)

    if spec.startswith("paced:"):  # the inner drafter's checkpoint, marked as paced against plain steps
        return {**drafter_info(spec[len("paced:"):], target), "spec": spec, "paced": True}
    base, weights = split_weights(spec)  # "auto:bf16": the C++ drafting path on bf16 weights
    base, confidence, tree = split_spec(base)  # "auto@0.1": adaptive block length; "auto#12": a tree of 12
    base, draft_temperature = split_draft_temperature(base)  # "auto~0": guesses are the drafter's argmax
    path = shipped_drafter_path(target) if base.endswith("auto") else None
    if path is None and base not in ("none", "ngram", "auto", "ngram+auto", "random"):
        path = Path(base.removeprefix("ngram+"))
    if path is None:
        return {"spec": spec}
    cfg = DrafterConfig.load(path / "config.json")
    digest = hashlib.sha256((path / "model.safetensors").read_bytes()).hexdigest()
    return {"spec": spec, "path": str(path), "weights_sha256": digest, "variant": cfg.variant,
            "num_layers": cfg.num_layers, "window": cfg.window, "memory": cfg.memory,
            "memory_limit": cfg.memory_limit, "slot_attention": cfg.slot_attention, "context_lags": cfg.context_lags,
            "copy_head_rank": cfg.copy_head_rank,
            "draft_vocab_size": cfg.draft_vocab_size, "confidence": confidence or 0.0,
            "tree": resolve_tree(tree, confidence), "weights": weights or DEFAULT_WEIGHTS,
            "draft_temperature": draft_temperature}


def build_items(target, suites: list[str], buckets: list[str], limit: int, seed: int = 0,
                skip: int = 0) -> list[S.EvalItem]:
    items = []
    for suite in suites:
        sources = S.SUITE_SOURCES.get(suite)
        if sources is None:
            raise HyflashError(f"unknown suite {suite!r} (known: {', '.join(S.SHORT_SUITES + S.LONG_SUITES)})")
        records = {src: S.load_records(src) for src in sources}
        if suite in S.SHORT_SUITES:
            items += S.short_items(suite, target, records, limit + skip)[skip:]
        else:
            if not buckets:
                raise HyflashError(f"suite {suite} needs --buckets (e.g. 1K-2K,2K-4K)")
            items += S.long_items(suite, target, records, buckets, limit, seed, skip=skip)
    return items


def read_jsonl(path: Path) -> list[dict]:
    if not path.exists():
        return []
    out = []
    with open(path) as f:
        for line in f:
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                break  # a line cut by a kill: everything after it is redone
    return out


def _append(path: Path, rec: dict) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(rec) + "\n")
        f.flush()
        os.fsync(f.fileno())


def run_eval(target_spec: str, drafters: str, suites: list[str], buckets: list[str], out_dir, limit: int = 10,
             max_new_tokens: int = 128, temperatures=(0.0,), seed: int = 0, dtype: str = "bf16",
             items: list[S.EvalItem] | None = None, target=None, command: str = "", fast: bool | None = None,
             skip: int = 0) -> Path:
    """Run (or continue) an evaluation into ``out_dir``; returns the summary path. ``items``/``target``: given
    directly by tests (tiny fixtures) instead of being built from the pinned sources."""
    from tqdm import tqdm

    from hyflash.data.sources import SOURCES
    from hyflash.decoding import SamplingConfig, generate, prefill
    from hyflash.evaluation.report import write_summary
    from hyflash.proposers import load_proposer
    from hyflash.target import Target

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    target = target or Target.load(target_spec, dtype=dtype, fast=fast)
    labels = parse_drafters(drafters)
    settings = {"target": target.name, "target_fingerprint": target.fingerprint(), "drafters": labels,
                "suites": list(suites), "buckets": list(buckets), "limit": limit, "max_new_tokens": max_new_tokens,
                "temperatures": [float(t) for t in temperatures], "seed": seed, "dtype": dtype,
                "fast_path": bool(getattr(target, "fast", False))}
    if skip:  # only when used, so that runs from before the option resume
        settings["skip"] = skip
    header_path = out / "run.json"
    if header_path.exists():
        old = json.loads(header_path.read_text())
        if old.get("settings") != settings:
            raise HyflashError(f"{out} holds a run with other settings; continue it with the same ones or choose "
                               f"another --out (it has {old.get('settings')})")
    else:
        used = sorted({src for s in suites for src in S.SUITE_SOURCES.get(s, [])})
        header = {"format": FORMAT, "settings": settings, "machine": machine(), "commit": git_commit(),
                  "started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                  "command": command or " ".join(sys.argv),
                  "drafter_info": {k: drafter_info(v, target) for k, v in labels.items()},
                  "data": {src: f"{SOURCES[src].package}=={SOURCES[src].version}" for src in used},
                  "note": "evaluation data only: none of these sources is in the training split"}
        if "longcode" in suites:
            import transformers
            header["data"]["longcode"] = f"transformers=={transformers.__version__} (installed sources)"
        header_path.write_text(json.dumps(header, indent=1) + "\n")

    if items is None:
        items = build_items(target, suites, buckets, limit, seed, skip)
    (out / "items.jsonl").write_text("".join(json.dumps({"id": it.id, "suite": it.suite, "bucket": it.bucket,
                                                         "prompt_tokens": len(it.prompt_ids), "meta": it.meta})
                                             + "\n" for it in items))
    proposers = {label: load_proposer(spec, target, seed=seed) for label, spec in labels.items()}
    needs_features = any(p.needs_features for p in proposers.values())
    raw_path, first_path = out / "raw.jsonl", out / "first_turns.jsonl"
    done = {(r["item"], r["drafter"], r["temperature"]) for r in read_jsonl(raw_path)}
    _rewrite_complete(raw_path)
    first_answers = {r["item"]: r["text"] for r in read_jsonl(first_path)}
    temps = [float(t) for t in temperatures]

    for i, item in enumerate(tqdm(items, desc="eval", unit="item", dynamic_ncols=True)):
        todo = [(label, t) for t in temps for label in labels if (item.id, label, t) not in done]
        if not todo:
            continue
        if item.first_turn is not None:  # mtbench2: the target's own greedy first answer, computed once
            if item.id not in first_answers:
                first_ids = target.encode(item.first_turn["user"], chat=True)
                ans = generate(target, first_ids, None, max_new_tokens=max_new_tokens)
                first_answers[item.id] = ans.text
                _append(first_path, {"item": item.id, "text": ans.text})
            item.prompt_ids = S.second_turn_ids(target, item.first_turn, first_answers[item.id])
        if len(item.prompt_ids) + 1 >= target.max_context:
            continue
        shared = prefill(target, item.prompt_ids, features=needs_features,
                         capacity=len(item.prompt_ids) + max_new_tokens + 1)
        if i % 2:
            todo = todo[::-1]  # alternate the order so that no system always runs first
        for label, t in todo:
            sampling = SamplingConfig(temperature=t, seed=seed + i)
            res = generate(target, item.prompt_ids, proposers[label], max_new_tokens=max_new_tokens,
                           sampling=sampling, shared_prefill=shared)
            s = res.stats
            _append(raw_path, {
                "item": item.id, "suite": item.suite, "bucket": item.bucket, "prompt_tokens": len(item.prompt_ids),
                "drafter": label, "temperature": t, "tau": s.acceptance_length, "rounds": s.rounds,
                "new_tokens": s.new_tokens, "histogram": s.committed_histogram,
                "decode_s": (s.total_ms - s.prefill_ms) / 1e3, "tokens_per_s": s.tokens_per_s,
                "draft_ms": s.draft_ms, "verify_ms": s.verify_ms, "prefill_ms": shared.ms,
                "drafter_state_bytes": s.drafter_state_bytes, "target_kv_bytes": s.target_kv_bytes,
                "stop_reason": s.stop_reason, "token_ids": res.token_ids})
    return write_summary(out)


def _rewrite_complete(path: Path) -> None:
    """Drop a trailing line cut by a kill, so that appends start on a clean line."""
    if not path.exists():
        return
    rows = read_jsonl(path)
    text = "".join(json.dumps(r) + "\n" for r in rows)
    if path.read_text() != text:
        tmp = path.with_suffix(".tmp")
        tmp.write_text(text)
        os.replace(tmp, path)
