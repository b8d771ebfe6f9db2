"""Every way to run the default target here, side by side in one process on the same prompts and threads:

    transformers generate()         the library users start from
    ours, plain                     our loop, transformers forward (the denominator of the drafter benchmarks)
    ours fast, plain                our lean Llama forward with a static KV cache (hyflash.fast)
    ours fast, prompt lookup        + n-gram drafts
    ours fast, <drafter>            + the shipped (or given) HyFlash drafter, and ngram+drafter
    llama.cpp, plain                the same GGUF through llama-cpp-python (optional extra: install.sh llamacpp)

Prints tokens/s (decode only, median over repeats), ratios to llama.cpp and to our fast plain decoding, and the
bandwidth plain decoding achieves (weight bytes read per token x tokens/s) against this machine's measured memory
bandwidth (a streaming read of a buffer far larger than the caches). Greedy.

    python benchmarks/bench_systems.py [--prompts 5] [--max-new-tokens 128] [--repeats 3] [--drafter auto]
"""

import argparse
import time

import torch

from common import machine_line, median
from hyflash.data.sources import SOURCES
from hyflash.decoding import generate
from hyflash.proposers import load_proposer
from hyflash.target import EMBEDDED_TARGETS, Target, _find_embedded_gguf


def memory_bandwidth(gib: float = 1.0, repeats: int = 5) -> float:
    """Bytes/s of a streaming read (sum) over a `gib` GiB fp32 buffer: best of `repeats`."""
    x = torch.ones(int(gib * (1 << 30)) // 4)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t0)
    return x.numel() * 4 / best


def weight_bytes_per_token(target) -> int:
    """Bytes of weights one decode step reads: every parameter once (the embedding row is negligible; with tied
    embeddings the LM head reads the whole matrix)."""
    return sum(p.numel() * p.element_size() for p in target.model.parameters())


def hf_generate_tps(target, ids, n) -> float:
    x = torch.tensor([ids])
    with torch.inference_mode():
        t0 = time.perf_counter()
        target.model.generate(x, max_new_tokens=1, min_new_tokens=1, do_sample=False)
        t1 = time.perf_counter()
        out = target.model.generate(x, max_new_tokens=n, min_new_tokens=n, do_sample=False)
        t2 = time.perf_counter()
    made = out.shape[1] - x.shape[1]
    return (made - 1) / ((t2 - t1) - (t1 - t0))  # subtract the prefill (+ first token) time


LLAMA_CPP_SCRIPT = """
import json, sys, time
import llama_cpp.llama_cpp as ll
path, threads, n, extra = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "1"
if not extra:  # llama.cpp without its extra buffer types (the AMX / repacked weight layouts)
    default_params = ll.llama_model_default_params
    def params():
        p = default_params()
        p.use_extra_bufts = False
        return p
    ll.llama_model_default_params = params
from llama_cpp import Llama
llm = Llama(model_path=path, n_threads=threads, n_ctx=4096, verbose=False)
for line in sys.stdin:  # one prompt (token ids) a line -> its decode tokens/s, a line
    ids = json.loads(line)
    t_first, count = None, 0
    for _ in llm.generate(ids, temp=0.0, top_k=1, reset=True):
        count += 1
        if count == 1:
            t_first = time.perf_counter()
        if count >= n:
            break
    llm.reset()
    print(json.dumps((count - 1) / (time.perf_counter() - t_first)), flush=True)
"""


class LlamaCpp:
    """llama.cpp greedy decoding in a process of its own (llama.cpp's OpenMP runtime and torch's crash when both are
    loaded into one process here), fed one prompt at a time so that it takes its turn among our systems. Its AMX
    matmul (an extra buffer type that repacks the weights) dies with SIGSEGV in this project's VM
    (ggml_backend_amx_mul_mat, at the first token); after such a crash it starts again without extra buffer types,
    on its AVX-512 kernels, and ``note`` says so."""

    def __init__(self, gguf, n, threads, warm_up):
        import subprocess
        import sys

        self.note = "llama.cpp with its default buffer types"
        for extra in ("1", "0"):
            self.proc = subprocess.Popen([sys.executable, "-c", LLAMA_CPP_SCRIPT, str(gguf), str(threads), str(n), extra],
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            try:
                self(warm_up)
                return
            except RuntimeError:
                if self.proc.returncode != -11 or extra == "0":
                    raise
                self.note = "llama.cpp without extra buffer types (its AMX path crashed: SIGSEGV), AVX-512 kernels"

    def __call__(self, ids) -> float:
        import json

        self.proc.stdin.write(json.dumps(ids) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            self.proc.wait()
            raise RuntimeError(f"llama.cpp failed (exit {self.proc.returncode}): "
                               f"{self.proc.stderr.read()[-300:].strip() or 'no message'}")
        return float(line)

    def close(self):
        self.proc.stdin.close()
        self.proc.wait()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=5, help="MT-Bench first turns")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--drafter", default="auto")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    hf = Target.load("smollm2-135m", dtype="bf16")
    fast = Target.load("smollm2-135m", dtype="bf16", fast=True)
    prompts = [fast.encode(q["turns"][0]) for q in list(SOURCES["mtbench"].read())[: args.prompts]]
    n = args.max_new_tokens
    systems = {
        "transformers generate()": lambda ids: hf_generate_tps(hf, ids, n),
        "ours, plain": lambda ids: generate(hf, ids, None, max_new_tokens=n).stats.tokens_per_s,
        "ours fast, plain": lambda ids: generate(fast, ids, None, max_new_tokens=n).stats.tokens_per_s,
        "ours fast, prompt lookup": lambda ids: generate(fast, ids, load_proposer("ngram", fast),
                                                         max_new_tokens=n).stats.tokens_per_s,
    }
    drafter = load_proposer(args.drafter, fast)
    if drafter.needs_features:
        systems[f"ours fast, drafter {args.drafter}"] = lambda ids: generate(
            fast, ids, drafter, max_new_tokens=n).stats.tokens_per_s
        combo = load_proposer("ngram+" + args.drafter, fast)
        systems[f"ours fast, ngram+{args.drafter}"] = lambda ids: generate(
            fast, ids, combo, max_new_tokens=n).stats.tokens_per_s
    import importlib.util

    llm = importlib.util.find_spec("llama_cpp") is not None  # run in its own process (see LlamaCpp)
    llama = None
    if llm:
        try:
            llama = LlamaCpp(_find_embedded_gguf(EMBEDDED_TARGETS["smollm2-135m"]), n, args.threads, prompts[0][:16])
            systems["llama.cpp, plain"] = llama
        except RuntimeError as e:
            print(f"# {e}")
            llm = False
    for fn in systems.values():  # warm-up
        fn(prompts[0][:16])
    results = {name: [] for name in systems}
    for i, ids in enumerate(prompts):  # every system on a prompt back to back, the order alternating per prompt
        names = list(systems) if i % 2 == 0 else list(systems)[::-1]
        for name in names:
            results[name].append(median([systems[name](ids) for _ in range(args.repeats)]))
    if llama is not None:
        llama.close()
        print(f"# {llama.note}")
    bw = memory_bandwidth()
    print(machine_line())
    print(f"# SmolLM2-135M-Instruct bf16 (llama.cpp: the package's GGUF) | {len(prompts)} MT-Bench prompts | "
          f"{n} new tokens | greedy | median of {args.repeats} per prompt, then mean over prompts")
    base = sum(results["ours fast, plain"]) / len(prompts)
    ref = sum(results["llama.cpp, plain"]) / len(prompts) if llm else None
    print(f"{'system':<34}{'tok/s':>8}{'vs ours fast plain':>20}{'vs llama.cpp':>14}")
    for name, xs in results.items():
        tps = sum(xs) / len(xs)
        print(f"{name:<34}{tps:>8.1f}{tps / base:>19.2f}x" + (f"{tps / ref:>13.2f}x" if ref else f"{'–':>14}"))
    if not llm:
        print("# llama.cpp not measured: `bash scripts/install.sh llamacpp` (compiles llama.cpp once) to include it")
    per_token = weight_bytes_per_token(fast)
    for name in ("ours, plain", "ours fast, plain"):
        tps = sum(results[name]) / len(prompts)
        print(f"# {name}: {per_token / 2**20:.0f} MiB of weights per token x {tps:.1f} tok/s = "
              f"{per_token * tps / 1e9:.2f} GB/s = {100 * per_token * tps / bw:.0f}% of the measured "
              f"{bw / 1e9:.1f} GB/s streaming-read bandwidth")


if __name__ == "__main__":
    main()
