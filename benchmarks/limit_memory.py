"""A copy of a saved HyFlash drafter whose memory folds only the last N committed features, for the
memory-limited ablation *at inference*: the same weights, the memory's reach cut (``DrafterConfig.memory_limit``).

    python benchmarks/limit_memory.py /work/runs/gemma-hyflash-s2/final /work/runs/gemma-hyflash-s2-mem512i --limit 512
"""

import argparse
import json
import shutil
from pathlib import Path


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("src", type=Path, help="a drafter directory (save_pretrained)")
    ap.add_argument("dst", type=Path, help="where the copy goes (must not exist)")
    ap.add_argument("--limit", type=int, default=512)
    args = ap.parse_args()
    config = json.loads((args.src / "config.json").read_text())
    if config.get("variant") != "hyflash" or config.get("memory") in (None, "none"):
        raise SystemExit(f"{args.src} is not a HyFlash drafter with a memory")
    if args.dst.exists():
        raise SystemExit(f"{args.dst} exists; choose another directory")
    shutil.copytree(args.src, args.dst)
    config["memory_limit"] = args.limit
    (args.dst / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    print(f"{args.dst}: {args.src}'s weights, memory limited to the last {args.limit} committed features")


if __name__ == "__main__":
    main()
