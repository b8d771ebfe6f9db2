"""Print what a (lent, offline) training machine has: torch and its GPU, and the packages hyflash needs.
Used by scripts/gpu_train.sh and scripts/gpu_gemma3.sh before they train."""

import importlib
from importlib.metadata import PackageNotFoundError, version

import torch

print("torch", torch.__version__, "| cuda", torch.cuda.is_available(),
      torch.cuda.get_device_name(0) if torch.cuda.is_available() else "")
for module, dist in [("transformers", "transformers"), ("gguf", "gguf"), ("tokenizers", "tokenizers"),
                     ("safetensors", "safetensors"), ("numpy", "numpy"), ("accelerate", "accelerate"),
                     ("yaml", "PyYAML"), ("tqdm", "tqdm"), ("click", "click")]:
    try:
        importlib.import_module(module)
    except ImportError as e:
        print(module, "MISSING", e)
        continue
    try:
        print(module, version(dist))
    except PackageNotFoundError:
        print(module, "(version unknown)")
