"""`hyflash generate` beside other work: the threads it chooses (hyflash.cpuload) against torch's default.

Each repeat runs, back to back: with every core free (threads chosen); with BUSY cores held by busy loops, the
threads chosen, then --threads forced to torch's default. Prints tok/s medians and their ratios.

    python benchmarks/bench_busy_cores.py --busy 1 --repeats 5
"""

import argparse
import json
import subprocess
import sys

from common import machine_line, median

PROMPT = "Explain speculative decoding in two sentences."


def run_generate(*extra: str) -> dict:
    proc = subprocess.run([sys.executable, "-m", "hyflash.cli", "generate", PROMPT, "--json", *extra],
                          capture_output=True, text=True, timeout=600)
    if proc.returncode:
        raise SystemExit(proc.stderr)
    return json.loads(proc.stdout)["stats"]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--busy", type=int, default=1, help="cores held by busy loops")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--max-new-tokens", default="64")
    args = ap.parse_args()
    import torch

    default = torch.get_num_threads()
    print(machine_line())
    results = {"idle, chosen": [], f"{args.busy} busy, chosen": [], f"{args.busy} busy, --threads {default}": []}
    threads = {k: set() for k in results}
    common = ("--max-new-tokens", args.max_new_tokens)
    for _ in range(args.repeats):
        s = run_generate(*common)
        results["idle, chosen"].append(s["tokens_per_s"])
        threads["idle, chosen"].add(s["threads"])
        loops = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.busy)]
        try:
            for key, extra in ((f"{args.busy} busy, chosen", ()),
                               (f"{args.busy} busy, --threads {default}", ("--threads", str(default)))):
                s = run_generate(*common, *extra)
                results[key].append(s["tokens_per_s"])
                threads[key].add(s["threads"])
        finally:
            for p in loops:
                p.kill()
                p.wait()
    base = median(results[f"{args.busy} busy, --threads {default}"])
    print(f"| setting | threads | tok/s median (of {args.repeats}) | runs | vs --threads {default} beside the loops |")
    print("|---|---|---|---|---|")
    for key, xs in results.items():
        print(f"| {key} | {'/'.join(map(str, sorted(threads[key])))} | {median(xs):.1f} | "
              f"{', '.join(f'{x:.1f}' for x in xs)} | {median(xs) / base:.2f}× |")


if __name__ == "__main__":
    main()
