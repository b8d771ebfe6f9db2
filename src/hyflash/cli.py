"""Command line: ``hyflash generate | train | eval | report | training-report | budget``."""

from __future__ import annotations

import json
import sys

import click

from hyflash import HyflashError, cpuload


class _TextStreamer:
    """Prints the decoded text as tokens arrive (decoding the whole output each time keeps UTF-8 intact)."""

    def __init__(self, target):
        self.target, self.ids, self.printed = target, [], 0

    def __call__(self, new_ids):
        self.ids.extend(new_ids)
        text = self.target.decode(self.ids)
        if text.endswith("\ufffd"):  # an incomplete multi-byte character: wait for the rest
            return
        sys.stdout.write(text[self.printed:])
        sys.stdout.flush()
        self.printed = len(text)


@click.group()
@click.version_option(package_name="hyflash")
def cli():
    """hyflash: lossless speculative decoding with the HyFlash block drafter."""


@cli.command()
@click.argument("prompt", required=False)
@click.option("--prompt-file", "-f", type=click.File("r", encoding="utf-8"), default=None,
              help="Read the prompt from this file ('-': standard input) instead of PROMPT: long documents.")
@click.option("--target", default=None, help="Embedded name (smollm2-135m), model directory, .gguf file or hub id.")
@click.option("--drafter", default=None,
              help="none | ngram | auto (the shipped drafter) | path to a drafter checkpoint | ngram+auto, ngram+PATH "
                   "(prompt lookup when the text repeats, else the drafter). A drafter may end in @C (adaptive block "
                   "length, e.g. auto@0.05) or #N (greedy: verify a tree of N candidates, e.g. auto#12; default 4, "
                   "2 on the AVX2 and NEON builds of our kernels, where a verify's cost grows with its rows), and before them "
                   "~T, the temperature the drafter samples its guesses at when --temperature > 0 (e.g. auto~0: its "
                   "argmax; default: the target's). "
                   "paced:SPEC drafts with SPEC or takes plain steps, whichever measures faster. "
                   "Default: ngram+auto where a drafter ships for the target (the fastest we measured), else ngram.")
@click.option("--max-new-tokens", default=128, show_default=True, type=int)
@click.option("--temperature", default=0.0, show_default=True, type=float, help="0 = greedy.")
@click.option("--top-k", default=0, show_default=True, type=int)
@click.option("--top-p", default=1.0, show_default=True, type=float)
@click.option("--seed", default=None, type=int)
@click.option("--chat/--no-chat", default=None, help="Wrap the prompt in the chat template (default: if the target has one).")
@click.option("--dtype", default="bf16", show_default=True, type=click.Choice(["bf16", "fp32"]))
@click.option("--stop", "stop_strings", multiple=True, help="Stop string (repeatable).")
@click.option("--threads", default=None, type=int,
              help="torch CPU threads (default: torch's, fewer where other processes kept cores busy while the "
                   "model loaded: threads that share a core with them wait at every step).")
@click.option("--fast/--no-fast", default=None,
              help="Our lean target forward with a static KV cache (default: where it covers the architecture).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object {text, token_ids, stats} and nothing else.")
def generate(prompt, prompt_file, target, drafter, max_new_tokens, temperature, top_k, top_p, seed, chat, dtype,
             stop_strings, threads, fast, as_json):
    """Generate text for PROMPT (or the text of --prompt-file), streaming it, then print the decoding statistics."""
    import torch

    from hyflash.decoding import PREFILL_CHUNK, SamplingConfig, generate as run
    from hyflash.target import Target

    if (prompt is None) == (prompt_file is None):
        raise HyflashError("give the prompt either as PROMPT or with --prompt-file, not both" if prompt is not None
                           else "no prompt: give PROMPT or --prompt-file FILE")
    if prompt_file is not None:
        prompt = prompt_file.read()
    if not prompt.strip():
        raise HyflashError("the prompt is empty")
    from hyflash.proposers import load_proposer, shipped_drafter_path, tree_nodes

    before = cpuload.snapshot()
    tgt = Target.load(target, dtype=dtype, threads=threads, fast=fast)
    if threads is None:
        _leave_busy_cores(before)
    shipped = shipped_drafter_path(tgt) is not None
    if drafter is None:
        drafter = "ngram+auto" if shipped else "auto"
    if drafter == "auto" and not shipped:
        click.echo(f"hyflash: no drafter shipped for {tgt.name} yet; drafting with prompt lookup (ngram)", err=True)
    proposer = load_proposer(drafter, tgt, seed=seed)
    ids = tgt.encode(prompt, chat=chat)
    sampling = SamplingConfig(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
    if drafter != "none" and sampling.greedy and not tgt.bitwise_verify:
        click.echo("hyflash: note: without our C++ kernels (they need Linux on an x86-64 CPU with AVX2 and FMA or "
                   "on 64-bit Arm, and a C++ compiler), bf16 verification rounds differently from single steps, so "
                   "greedy output can differ from --drafter none at near-ties; --dtype fp32 keeps it identical", err=True)
    streamer = None if as_json else _TextStreamer(tgt)
    bar = on_prefill = None
    if not as_json and len(ids) > PREFILL_CHUNK:  # a long prompt's prefill takes a while on a CPU: show it
        from tqdm import tqdm

        bar = tqdm(total=len(ids), desc="prefill", unit="tok", dynamic_ncols=True, leave=False, file=sys.stderr)

        def on_prefill(n: int) -> None:
            bar.update(n)
            if bar.n >= bar.total:  # gone before the text streams
                bar.close()
    try:
        result = run(tgt, ids, proposer, max_new_tokens=max_new_tokens, sampling=sampling,
                     stop_strings=tuple(stop_strings), on_tokens=streamer, on_prefill=on_prefill)
    finally:
        if bar is not None:
            bar.close()
    stats = result.stats.to_dict()
    stats["drafter"] = drafter
    stats["tree"] = tree_nodes(proposer)
    stats["target"] = tgt.name
    stats["fast_path"] = tgt.fast
    stats["threads"] = torch.get_num_threads()
    if as_json:
        click.echo(json.dumps({"text": result.text, "token_ids": result.token_ids, "stats": stats}))
        return
    click.echo("")
    click.echo(
        f"\n[{stats['new_tokens']} tokens in {stats['rounds']} rounds | acceptance length "
        f"{stats['acceptance_length']:.2f} | {stats['tokens_per_s']:.1f} tok/s | draft {stats['draft_ms']:.0f} ms, "
        f"verify {stats['verify_ms']:.0f} ms | drafter state {stats['drafter_state_bytes']:,} B | target KV "
        f"{stats['target_kv_bytes']:,} B | stop: {stats['stop_reason']}]", err=True)


def _leave_busy_cores(before: cpuload.Snapshot | None) -> None:
    """Fewer torch threads where other processes kept cores busy since ``before`` (the model's load), saying so: see
    hyflash.cpuload for why that is faster."""
    old, new, busy = cpuload.leave_busy_cores(before)
    if new < old:
        click.echo(f"hyflash: other processes kept {busy:.1f} of {cpuload.available_cores()} cores busy while the "
                   f"model loaded: decoding with {new} thread{'s' * (new > 1)} instead of {old} (--threads chooses)",
                   err=True)


@cli.command()
@click.option("--target", default="smollm2-135m", show_default=True,
              help="Preset (phi-4-reasoning), config.json, model directory or target spec.")
@click.option("--drafter", default="auto", show_default=True,
              help="auto (the shipped drafter, else the paper's layout) | paper | none | checkpoint directory.")
@click.option("--context", default=0, type=int, help="Context length in tokens (default: the target's maximum).")
@click.option("--weight-bits", default=16.0, show_default=True, type=float, help="Target weight bits.")
@click.option("--embed-bits", default=None, type=float, help="Embedding/LM head bits (default: --weight-bits).")
@click.option("--kv-bits", default=16.0, show_default=True, type=float, help="Target KV cache bits.")
@click.option("--drafter-bits", default=16.0, show_default=True, type=float, help="Drafter weight bits.")
@click.option("--budget-gib", default=None, type=float, help="Device budget to subtract from.")
@click.option("--measure", default=0, type=int,
              help="Also run the target and drafter here over min(context, N) tokens and print measured bytes.")
def budget(target, drafter, context, weight_bits, embed_bits, kv_bits, drafter_bits, budget_gib, measure):
    """Memory budget: target weights and KV cache, drafter weights and context state, what is left."""
    from hyflash.budget import budget_command_impl

    click.echo(budget_command_impl(target, drafter, context, weight_bits, embed_bits, kv_bits, drafter_bits,
                                   budget_gib, measure))


@cli.command("eval")
@click.option("--target", default="smollm2-135m", show_default=True)
@click.option("--drafters", default="none,ngram,auto", show_default=True,
              help="Comma-separated: none, ngram, auto, PATH or LABEL=PATH ('none' is always run: the baseline); a "
                   "drafter spec takes the suffixes --drafter of 'hyflash generate' lists (e.g. LABEL=PATH~0).")
@click.option("--suites", default="mtbench", show_default=True,
              help="Comma-separated; short: mtbench, mtbench2, humaneval, gsm8k, math, writing; long: hotpotqa, "
                   "reports, longcode, probe_nearby, probe_distant.")
@click.option("--buckets", default="", help="Prompt-length buckets for long suites, e.g. 512-1K,1K-2K,2K-4K,4K-8K.")
@click.option("--limit", default=10, show_default=True, type=int, help="Items per suite (per bucket for long ones).")
@click.option("--skip", default=0, show_default=True, type=click.IntRange(min=0),
              help="Leave out the first N items per suite (per bucket for long ones): the next --limit items after an "
                   "earlier run's, into another --out, to add items without repeating them.")
@click.option("--max-new-tokens", default=128, show_default=True, type=int)
@click.option("--temperatures", default="0", show_default=True, help="Comma-separated, e.g. 0,1.")
@click.option("--seed", default=0, show_default=True, type=int)
@click.option("--dtype", default="bf16", show_default=True, type=click.Choice(["bf16", "fp32"]))
@click.option("--threads", default=None, type=int)
@click.option("--fast/--no-fast", default=None,
              help="Our lean target forward with a static KV cache (default: where it covers the architecture).")
@click.option("--out", required=True, help="Run folder (a rerun with the same settings continues it).")
def eval_command(target, drafters, suites, buckets, limit, skip, max_new_tokens, temperatures, seed, dtype, threads,
                 fast, out):
    """Evaluate drafters side by side against plain decoding; raw JSON + summary.md in --out."""
    import torch

    from hyflash.evaluation.runner import run_eval

    if threads:
        torch.set_num_threads(threads)
    split = [s.strip() for s in suites.split(",") if s.strip()]
    bks = [b.strip() for b in buckets.split(",") if b.strip()]
    try:
        temps = [float(t) for t in temperatures.split(",")]
    except ValueError:
        raise HyflashError(f"bad --temperatures {temperatures!r}") from None
    path = run_eval(target, drafters, split, bks, out, limit, max_new_tokens, temps, seed, dtype,
                    command="hyflash eval " + " ".join(sys.argv[2:]), fast=fast, skip=skip)
    click.echo(path.read_text())


@cli.command("report")
@click.argument("runs", nargs=-1, required=True)
@click.option("--out", required=True, help="Report folder (REPORT.md and plots).")
@click.option("--training-length", type=click.IntRange(min=1), default=None,
              help="The drafters' training length in tokens: buckets whose shortest prompt reaches it are checked "
                   "against the beyond-the-training-length bars (default: the two longest buckets).")
def report_command(runs, out, training_length):
    """Tables and plots from one or more `hyflash eval` run folders; each of the paper's bars with how often it holds
    over resampled prompts (a paired bootstrap)."""
    from hyflash.evaluation.report import build_report

    click.echo(str(build_report(list(runs), out, training_length=training_length)))


@cli.command("training-report")
@click.argument("runs", nargs=-1, required=True)
@click.option("--at-step", "step", type=int, required=True,
              help="Compare held-out τ̂ at this step (the runs share a schedule; some may have stopped early).")
@click.option("--out", required=True, help="Report folder (REPORT.md and plots).")
def training_report_command(runs, step, out):
    """Ablations from `hyflash train` run folders: held-out τ̂ at equal steps, parameters, what each changes."""
    from hyflash.evaluation.training import build_training_report

    click.echo(str(build_training_report(list(runs), out, step, "hyflash training-report " + " ".join(sys.argv[2:]))))


@cli.command("quantize")
@click.argument("drafter")
@click.option("--out", required=True, help="Folder for the 4-bit checkpoint.")
@click.option("--target", default="smollm2-135m", show_default=True)
@click.option("--data", required=True, help="Training feature store to calibrate on (hyflash.data.features).")
@click.option("--sequences", default=32, show_default=True, type=int, help="Calibration sequences.")
@click.option("--group-size", default=64, show_default=True, type=int)
@click.option("--seed", default=0, show_default=True, type=int)
def quantize_command(drafter, out, target, data, sequences, group_size, seed):
    """GPTQ 4-bit weights for a drafter checkpoint, calibrated on training features."""
    from hyflash.quant import quantize_command_impl

    info = quantize_command_impl(drafter, out, target, data, sequences, group_size, seed)
    click.echo(f"{len(info['quantized'])} linear layers at 4 bits (group {group_size}): weights "
               f"{info['weight_bytes'] / 2**20:.2f} MiB, bf16 {info['bf16_weight_bytes'] / 2**20:.2f} MiB -> {out}")


def _register_train() -> None:
    from hyflash.train import train_command

    cli.add_command(train_command)


_register_train()


def main():
    try:
        cli(standalone_mode=False)
    except HyflashError as e:
        click.echo(f"error: {e}", err=True)
        sys.exit(2)
    except click.exceptions.Abort:
        sys.exit(130)
    except click.ClickException as e:
        e.show()
        sys.exit(e.exit_code)


if __name__ == "__main__":
    main()
