"""Evaluation suites: the prompts `hyflash eval` decodes, built from the pinned evaluation sources (DATA.md).

Short suites (chat prompts): ``mtbench`` (first turns), ``mtbench2`` (second turns, after the target's own greedy
first answer), ``humaneval``, ``gsm8k`` (the first N), ``math`` (MATH500 subset + AIME 2025), ``writing``
(WritingBench, English requests).

Long-context suites, in buckets of prompt length (target tokens, chat template included):

- ``hotpotqa``: LongBench-style HotpotQA — the question's gold and distractor paragraphs, padded with other
  questions' paragraphs (seeded choice and order) until the prompt falls inside the bucket; for a base model two
  other questions, answered, come before its own (``hotpotqa_item``).
- ``reports``: one AA-LCR report bundle cut to the bucket, then its question (GovReport/QASPER stand-in).
- ``longcode``: Python source of an installed library that is not in our training data (the ``transformers``
  package), cut to the bucket; plain continuation, no chat template.
- ``probe_nearby``: filler text, then a passage, then "repeat the last passage": the evidence for the continuation
  lies inside the drafter's attention window.
- ``probe_distant``: a passage, then filler, then "repeat the first passage": the evidence lies only further back
  than the window (the memory must carry it).

Every item records where it came from; evaluation data never enters training (see the data split).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path

from hyflash import HyflashError

SHORT_SUITES = ("mtbench", "mtbench2", "humaneval", "gsm8k", "math", "writing")
LONG_SUITES = ("hotpotqa", "reports", "longcode", "probe_nearby", "probe_distant")
SUITE_SOURCES = {"mtbench": ["mtbench"], "mtbench2": ["mtbench"], "humaneval": ["humaneval"], "gsm8k": ["gsm8k"],
                 "math": ["math500", "aime2025"], "writing": ["writingbench"], "hotpotqa": ["hotpotqa"],
                 "reports": ["aa_lcr"], "longcode": [], "probe_nearby": ["aa_lcr"], "probe_distant": ["aa_lcr"]}


@dataclass
class EvalItem:
    id: str  # unique in a run: suite/bucket/source id
    suite: str
    bucket: str  # "" for short suites
    prompt_ids: list[int]
    meta: dict = field(default_factory=dict)
    first_turn: dict | None = None  # mtbench2: the first turn to answer (greedy, plain) before this prompt exists


def parse_bucket(name: str) -> tuple[int, int]:
    """'1K-2K' → (1024, 2048); '512-1K' → (512, 1024). Bounds are [lo, hi) in tokens."""
    def tokens(s: str) -> int:
        s = s.strip().upper()
        return int(float(s[:-1]) * 1024) if s.endswith("K") else int(s)
    try:
        lo, hi = (tokens(x) for x in name.split("-"))
    except ValueError:
        raise HyflashError(f"bad bucket {name!r}: expected LO-HI such as 512-1K or 2K-4K") from None
    if not 0 < lo < hi:
        raise HyflashError(f"bad bucket {name!r}: need 0 < LO < HI")
    return lo, hi


def load_records(source: str, limit: int | None = None, cache=None) -> list[dict]:
    from hyflash.data.sources import SOURCES

    out = []
    for rec in SOURCES[source].read(cache):
        out.append(rec)
        if limit is not None and len(out) >= limit:
            break
    return out


# ------------------------------------------------------------------------------------------- short suites
def _chat(target, text: str) -> list[int]:
    """A user turn in the chat template; a base model (no template) gets the plain text, then a blank line,
    and continues from there."""
    if getattr(target, "has_chat_template", True):
        return target.encode(text, chat=True)
    return target.encode(text.rstrip() + "\n\n", chat=False)


def short_items(suite: str, target, records: dict[str, list[dict]], limit: int) -> list[EvalItem]:
    """Items of a short suite from its sources' records (``records[source]``), the first ``limit`` of them."""
    if suite in ("mtbench", "mtbench2"):
        out = []
        for r in records["mtbench"][:limit]:
            if suite == "mtbench":
                out.append(EvalItem(f"mtbench/{r['id']}", suite, "", _chat(target, r["turns"][0]),
                                    {"source": r["id"], "category": r.get("category")}))
            elif len(r["turns"]) > 1:
                out.append(EvalItem(f"mtbench2/{r['id']}", suite, "", [], {"source": r["id"]},
                                    first_turn={"user": r["turns"][0], "second": r["turns"][1]}))
        return out
    if suite == "humaneval":
        return [EvalItem(f"humaneval/{r['id']}", suite, "", _chat(
            target, "Complete this Python function.\n\n```python\n" + r["turns"][0] + "```"), {"source": r["id"]})
            for r in records["humaneval"][:limit]]
    if suite == "gsm8k":
        return [EvalItem(f"gsm8k/{r['id']}", suite, "", _chat(target, r["turns"][0]), {"source": r["id"]})
                for r in records["gsm8k"][:limit]]
    if suite == "math":
        mixed = [r for pair in zip(records["math500"], records["aime2025"]) for r in pair]  # alternate sources
        seen = {r["id"] for r in mixed}
        mixed += [r for r in records["math500"] + records["aime2025"] if r["id"] not in seen]
        return [EvalItem(f"math/{r['id']}", suite, "", _chat(target, r["turns"][0]), {"source": r["id"]})
                for r in mixed[:limit]]
    if suite == "writing":
        english = [r for r in records["writingbench"] if r["turns"][0].isascii()]
        return [EvalItem(f"writing/{r['id']}", suite, "", _chat(target, r["turns"][0]), {"source": r["id"]})
                for r in english[:limit]]
    raise HyflashError(f"unknown short suite {suite!r} (known: {', '.join(SHORT_SUITES)})")


def second_turn_ids(target, first_turn: dict, first_answer: str) -> list[int]:
    """mtbench2's prompt: the first question, the target's own first answer, then the second question."""
    return target.encode([{"role": "user", "content": first_turn["user"]},
                          {"role": "assistant", "content": first_answer},
                          {"role": "user", "content": first_turn["second"]}], chat=True)


# -------------------------------------------------------------------------------------------- long suites
HOTPOTQA_BASE_DEMOS = 2  # answered questions before a base model's own


def _fits(n: int, lo: int, hi: int) -> bool:
    return lo <= n < hi


def hotpotqa_item(target, rec: dict, others: list[dict], bucket: str, seed: int) -> EvalItem | None:
    """The question's own paragraphs plus other questions' paragraphs until the prompt is inside the bucket.

    A base model (no chat template) given the zero-shot prompt tends to repeat the question block instead of
    answering (Gemma 3 270M did, the same continuation in every bucket), so its prompt ends with two other questions
    answered (``HOTPOTQA_BASE_DEMOS``, their gold answers) and then "Answer:" with no blank line after it."""
    from hyflash.data.sources import hotpotqa_prompt

    lo, hi = parse_bucket(bucket)
    rng = random.Random(f"{seed}/{rec['id']}/{bucket}")
    base = not getattr(target, "has_chat_template", True)
    demos = []
    if base:
        answered = [o for o in others if o["id"] != rec["id"] and o.get("answer")]
        demos = [(o["question"], o["answer"]) for o in rng.sample(answered, min(HOTPOTQA_BASE_DEMOS, len(answered)))]

    def encode(paragraphs):
        text = hotpotqa_prompt(paragraphs, rec["question"], demos)
        return target.encode(text, chat=False) if base else _chat(target, text)

    own = [list(p) for p in rec["paragraphs"]]
    pool = [list(p) for o in others if o["id"] != rec["id"] for p in o["paragraphs"]]
    rng.shuffle(pool)
    paragraphs = list(own)
    ids = encode(paragraphs)
    if len(ids) >= hi:
        return None
    for p in pool:
        if len(ids) >= lo:
            break
        trial = paragraphs + [p]
        trial_ids = encode(trial)
        if len(trial_ids) >= hi:
            continue  # this paragraph overshoots the bucket: try a shorter one
        paragraphs, ids = trial, trial_ids
    if not _fits(len(ids), lo, hi):
        return None
    order = list(range(len(paragraphs)))  # gold paragraphs end up anywhere in the prompt
    rng.shuffle(order)
    paragraphs = [paragraphs[i] for i in order]
    ids = encode(paragraphs)
    return EvalItem(f"hotpotqa/{bucket}/{rec['id']}", "hotpotqa", bucket, ids,
                    {"source": rec["id"], "paragraphs": len(paragraphs), "gold": len(own), "demos": len(demos)})


def _cut_to(target, text: str, n_tokens: int) -> str:
    ids = target.tokenizer.encode(text, add_special_tokens=False)[:max(0, n_tokens)]
    return target.tokenizer.decode(ids)


def _fill_between(target, make, lo: int, hi: int) -> list[int] | None:
    """make(n) → prompt ids built with about n filler tokens; find an n whose prompt lands in [lo, hi)."""
    target_len = (lo + hi) // 2
    n = target_len
    for _ in range(8):
        ids = make(n)
        if _fits(len(ids), lo, hi):
            return ids
        n = max(0, n + (target_len - len(ids)))
    return None


def reports_item(target, rec: dict, bucket: str) -> EvalItem | None:
    lo, hi = parse_bucket(bucket)
    question = (rec.get("question") or "").strip() or "Summarise the documents above."
    text = rec["turns"][0]
    context = text[: -len(question)].strip() if text.endswith(question) else text
    ids = _fill_between(target, lambda n: _chat(target, _cut_to(target, context, n) + "\n\n" + question), lo, hi)
    return None if ids is None else EvalItem(f"reports/{bucket}/{rec['id']}", "reports", bucket, ids,
                                             {"source": rec["id"]})


def library_code(package: str = "transformers", min_chars: int = 4000) -> list[tuple[str, str]]:
    """(relative path, source) of an installed library's .py files, sorted by path."""
    import importlib

    root = Path(importlib.import_module(package).__file__).parent
    out = []
    for p in sorted(root.rglob("*.py")):
        text = p.read_text(encoding="utf-8", errors="replace")
        if len(text) >= min_chars:
            out.append((str(p.relative_to(root.parent)), text))
    return out


def longcode_item(target, files: list[tuple[str, str]], index: int, bucket: str) -> EvalItem | None:
    lo, hi = parse_bucket(bucket)
    text = "\n\n".join(f"# file: {path}\n{src}" for path, src in files[index:index + 64])

    def make(n):
        return target.tokenizer.encode(_cut_to(target, text, n), add_special_tokens=True)
    ids = _fill_between(target, make, lo, hi)
    return None if ids is None else EvalItem(f"longcode/{bucket}/{files[index][0]}", "longcode", bucket, ids,
                                             {"source": files[index][0]})


def passage_of(text: str, words: int = 90) -> str:
    """About `words` words from the middle of `text` (a paragraph-sized quote; document bundles share their
    opening boilerplate, so the start would give every probe the same passage)."""
    w = text.split()
    skip = max(0, (len(w) - words) // 2)
    return " ".join(w[skip:skip + words])


PRIME_WORDS = 8  # the answer is started with the passage's first words, so the target copies it verbatim


def probe_item(target, kind: str, passage_rec: dict, filler_text: str, bucket: str) -> EvalItem | None:
    """A copying probe. nearby: filler, then the passage, then a request to repeat the LAST passage (the evidence
    is inside the window); distant: the passage, then filler, then a request to repeat the FIRST passage (the
    evidence is only further back than the window). The answer is started with the passage's first words: a
    135M target will not recall a passage from thousands of tokens back when merely asked, but once started it
    copies it verbatim, so the continuation depends on distant content, and a drafter is accepted only as far as
    it carries that content too."""
    lo, hi = parse_bucket(bucket)
    passage = passage_of(passage_rec["turns"][0])
    prime = target.tokenizer.encode(" ".join(passage.split()[:PRIME_WORDS]), add_special_tokens=False)
    if kind == "probe_nearby":
        def make(n):
            return _chat(target, "Read the text below.\n\n" + _cut_to(target, filler_text, n)
                         + "\n\nLast passage:\n" + passage + "\n\nRepeat the last passage word for word.") + prime
    elif kind == "probe_distant":
        def make(n):
            return _chat(target, "First passage:\n" + passage + "\n\nMore text follows.\n\n"
                         + _cut_to(target, filler_text, n) + "\n\nRepeat the first passage word for word.") + prime
    else:
        raise HyflashError(f"unknown probe {kind!r}")
    ids = _fill_between(target, make, lo, hi)
    return None if ids is None else EvalItem(f"{kind}/{bucket}/{passage_rec['id']}", kind, bucket, ids,
                                             {"source": passage_rec["id"], "passage": passage})


def _filler_for(recs: list[dict], i: int, passage: str) -> str | None:
    """Another bundle's text that does not contain the passage's opening (bundles share boilerplate)."""
    opening = " ".join(passage.split()[:PRIME_WORDS])
    for j in range(1, len(recs)):
        text = recs[(i + j) % len(recs)]["turns"][0]
        if opening not in " ".join(text.split()):
            return text
    return None


def long_items(suite: str, target, records: dict[str, list[dict]], buckets: list[str], limit: int,
               seed: int = 0, code_files: list[tuple[str, str]] | None = None, skip: int = 0) -> list[EvalItem]:
    """Up to ``limit`` items per bucket, after the first ``skip`` of that bucket (the items a run with ``--limit
    skip`` had: each item is built from its own source, whatever the limit); sources too short for a bucket are
    skipped."""
    out = []
    limit += skip
    for bucket in buckets:
        got = []
        if suite == "hotpotqa":
            recs = records["hotpotqa"]
            for r in recs:
                if len(got) >= limit:
                    break
                if (item := hotpotqa_item(target, r, recs, bucket, seed)) is not None:
                    got.append(item)
        elif suite == "reports":
            for r in records["aa_lcr"]:
                if len(got) >= limit:
                    break
                if (item := reports_item(target, r, bucket)) is not None:
                    got.append(item)
        elif suite == "longcode":
            files = code_files if code_files is not None else library_code()
            for i in range(0, len(files), 7):  # spread over the library
                if len(got) >= limit:
                    break
                if (item := longcode_item(target, files, i, bucket)) is not None:
                    got.append(item)
        elif suite in ("probe_nearby", "probe_distant"):
            recs = records["aa_lcr"]
            for i, r in enumerate(recs):
                if len(got) >= limit:
                    break
                filler = _filler_for(recs, i, passage_of(r["turns"][0]))  # unrelated to the passage
                if filler is not None and (item := probe_item(target, suite, r, filler, bucket)) is not None:
                    got.append(item)
        else:
            raise HyflashError(f"unknown long suite {suite!r} (known: {', '.join(LONG_SUITES)})")
        out += got[skip:]
    return out
