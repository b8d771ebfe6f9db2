"""Target features computed while training, instead of read from a cache on disk.

A disk cache (``hyflash.data.features``) costs 5.96 KB per token for SmolLM2 (13 GB for our 2M tokens): right for
a CPU, where the target's forward is most of a step's cost and is paid once. On a GPU the target's forward over a
2K-token sequence takes milliseconds, and the cache would have to be moved to the machine; there, the tokenised
sequences (a few MB) are all a training run needs. ``OnlineFeatureStore`` reads them and runs the target on each
sequence when the loop asks for it, returning exactly what ``FeatureStore`` returns for the same sequence (the same
``sequence_outputs`` computes both), so a recipe trains the same drafter from either.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from pathlib import Path

import torch

from hyflash import HyflashError
from hyflash.data.features import sequence_outputs


class OnlineFeatureStore:
    """store[i] -> the FeatureStore item of sequence i of ``sequences_path`` (a ``hyflash.data.sequences`` JSONL),
    computed with ``target``: features on the target's device, everything else on the CPU. The last ``keep``
    items are kept (validation revisits the same sequences)."""

    def __init__(self, sequences_path, target, topk: int = 32, keep: int = 8):
        path = Path(sequences_path)
        if not path.is_file():
            raise HyflashError(f"sequences file not found: {path}")
        with open(path, encoding="utf-8") as f:
            self.sequences = [json.loads(line) for line in f if line.strip()]
        if not self.sequences:
            raise HyflashError(f"{path} holds no sequences")
        too_long = [s["id"] for s in self.sequences if len(s["ids"]) > target.max_context]
        if too_long:
            raise HyflashError(f"{len(too_long)} sequences are longer than the target's context of "
                               f"{target.max_context} tokens (e.g. {too_long[0]})")
        self.path, self.target = path, target
        self.topk = min(topk, target.vocab_size)
        # no "feature_layers" entry: the features come from whatever layers target.feature_layers names when read
        self.config = {"topk": self.topk, "dtype": str(target.dtype).removeprefix("torch."), "online": True}
        self.total_tokens = sum(len(s["ids"]) for s in self.sequences)
        self._recent: OrderedDict[int, dict] = OrderedDict()
        self.keep = keep

    def __len__(self) -> int:
        return len(self.sequences)

    def lengths(self) -> list[int]:
        return [len(s["ids"]) for s in self.sequences]

    def kinds(self) -> list[str | None]:
        return [s.get("kind") for s in self.sequences]

    def __getitem__(self, i: int) -> dict:
        if i in self._recent:
            self._recent.move_to_end(i)
            return self._recent[i]
        s = self.sequences[i]
        feats, labels, vals, top = sequence_outputs(self.target, s["ids"], self.topk)
        # clones: outputs of inference mode cannot be saved for the drafter's backward pass
        item = {"id": s["id"], "kind": s.get("kind"), "features": feats.clone(),
                "input_ids": torch.tensor(s["ids"], dtype=torch.int64),
                "labels": labels.cpu().long(), "spans": [list(span) for span in s["spans"]],
                "topk_vals": vals.cpu(), "topk_ids": top.cpu().long()}
        self._recent[i] = item
        while len(self._recent) > self.keep:
            self._recent.popitem(last=False)
        return item
