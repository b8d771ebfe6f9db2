"""Speculative generation: one loop, exact verification, and the proposers that need no training.

A round: the proposer drafts a block from the anchor (the last committed token, which has no target feature yet);
the target verifies [anchor, d_1 .. d_K] in one forward; the longest accepted prefix plus one token of the
target's own is committed; the cache is rolled back to the committed length; the proposer is told the committed
tokens and their target features (``commit``). Plain autoregressive decoding is the same loop with K = 0.

Exactness (DESIGN §1): draft x_k ~ q_k is accepted with probability min(1, p_k(x_k) / q_k(x_k)); at the first
rejection the token is sampled from norm(max(0, p_k - q_k)); when all are accepted the bonus token comes from
p_{K+1}. Greedy is the point-mass case of the same rule. Acceptance coins and residual/bonus samples use two
independent random streams, neither shared with the proposer's.
"""

from __future__ import annotations

import copy
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Callable, Protocol

import torch

from hyflash import HyflashError


# ------------------------------------------------------------------------------------------------ sampling
@dataclass
class SamplingConfig:
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    seed: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0

    def validate(self) -> None:
        if self.temperature < 0:
            raise HyflashError("temperature must be >= 0")
        if self.top_k < 0:
            raise HyflashError("top_k must be >= 0")
        if not 0.0 < self.top_p <= 1.0:
            raise HyflashError("top_p must be in (0, 1]")


def target_probs(logits: torch.Tensor, sampling: SamplingConfig) -> torch.Tensor:
    """Processed next-token distribution(s) in fp32: temperature, then top-k, then top-p. [.., V] -> [.., V].

    Greedy gives the point mass on the argmax. The same function must produce the q a drafter samples from.
    """
    logits = logits.float()
    if sampling.greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    logits = logits / sampling.temperature
    if sampling.top_k and sampling.top_k < logits.shape[-1]:
        kth = torch.topk(logits, sampling.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if sampling.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        drop_sorted = cum - sorted_logits.softmax(-1) >= sampling.top_p  # keep the smallest prefix reaching top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits.softmax(-1)


def random_stream(seed: int | None, stream: int) -> torch.Generator:
    """An independent random stream per purpose (drafting, acceptance coins, residual/bonus samples)."""
    base = seed if seed is not None else int(torch.randint(2**31, (1,)))
    g = torch.Generator()
    g.manual_seed((base * 1_000_003 + stream) % 2**63)
    return g


# ----------------------------------------------------------------------------------------------- proposers
@dataclass
class Draft:
    tokens: list[int]  # K drafted tokens d_1..d_K
    probs: torch.Tensor | None = None  # [K, V] fp32 distributions the tokens were sampled from; None = point masses
    # None: a chain (d_i follows d_{i−1}). Else a tree of candidates (greedy decoding only): d_i follows
    # parents[i − 1], an index into [anchor, d_1, ..]; a parent precedes its children, and among siblings the one
    # that continues the drafter's first choice comes first.
    parents: list[int] | None = None

    def chain(self) -> "Draft":
        """The tree's first-choice path (first child at every level) as a chain; a chain is returned as is."""
        if self.parents is None:
            return self
        tokens, at = [], 0
        for i, p in enumerate(self.parents, start=1):
            if p == at:
                tokens.append(self.tokens[i - 1])
                at = i
        return Draft(tokens)


class Proposer(Protocol):
    """What the engine needs from a drafter.

    ``reset`` starts a sequence; ``commit`` receives tokens the target verified and kept, with their target
    features (rows of ``Target.forward(..).features``), in order; ``draft`` proposes up to ``block_size`` tokens
    after ``anchor`` (the last committed token, not yet passed to ``commit``) and must not change committed state.
    """

    block_size: int
    needs_features: bool

    def reset(self, prompt_ids: list[int]) -> None: ...

    def commit(self, token_ids: list[int], features: torch.Tensor | None) -> None: ...

    def draft(self, anchor: int, max_tokens: int, sampling: SamplingConfig) -> Draft: ...

    def state_bytes(self) -> int: ...


class NoDraft:
    """Plain autoregressive decoding: the denominator of every speedup."""

    block_size = 0
    needs_features = False

    def reset(self, prompt_ids):
        pass

    def commit(self, token_ids, features):
        pass

    def draft(self, anchor, max_tokens, sampling):
        return Draft([])

    def state_bytes(self):
        return 0


# ---------------------------------------------------------------------------------------------- the loop
@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    new_tokens: int = 0
    rounds: int = 0
    drafted: int = 0  # draft tokens sent to verification, all rounds together
    acceptance_length: float = 0.0  # tokens committed per verification round, the target's own token included
    committed_histogram: dict[int, int] = field(default_factory=dict)  # committed tokens per round -> rounds
    prefill_ms: float = 0.0
    draft_ms: float = 0.0
    verify_ms: float = 0.0
    total_ms: float = 0.0
    tokens_per_s: float = 0.0  # new tokens / decode time (after prefill)
    drafter_state_bytes: int = 0
    target_kv_bytes: int = 0  # key/value bytes the target's cache holds at the end
    stop_reason: str = ""

    def to_dict(self) -> dict:
        d = asdict(self)
        d["committed_histogram"] = {str(k): v for k, v in sorted(self.committed_histogram.items())}
        return d


@dataclass
class GenerationResult:
    token_ids: list[int]  # new tokens only (an EOS that ended generation is included)
    text: str
    stats: GenerationStats


def verify_block(logits: torch.Tensor, draft: Draft, sampling: SamplingConfig,
                 coin_gen: torch.Generator, sample_gen: torch.Generator,
                 top: torch.Tensor | None = None) -> tuple[int, int]:
    """Exact acceptance of a drafted block. ``logits`` [K+1, V]: row i is the target's prediction after
    [anchor, d_1..d_i]; ``top``: their argmaxes when the engine computed them. Returns (number of accepted drafts
    m, the target's token after them)."""
    if sampling.greedy:  # accept while the draft equals the target's argmax; one reduction, no [K+1, V] copies
        top = (logits.max(-1).indices if top is None else top).tolist()  # the first maximal index, as argmax
        m = 0
        while m < len(draft.tokens) and draft.tokens[m] == top[m]:
            m += 1
        return m, top[m]
    p = target_probs(logits, sampling)  # [K+1, V]
    for i, x in enumerate(draft.tokens):
        q_x = 1.0 if draft.probs is None else float(draft.probs[i, x])
        u = torch.rand((), generator=coin_gen, dtype=torch.float64).item()
        if not (q_x > 0 and u < min(1.0, float(p[i, x]) / q_x)):
            if draft.probs is None:
                residual = p[i].clone()
                residual[x] = 0.0
            else:
                residual = (p[i] - draft.probs[i]).clamp_min(0.0)
            return i, int(torch.multinomial(residual / residual.sum(), 1, generator=sample_gen))
    return len(draft.tokens), int(torch.multinomial(p[len(draft.tokens)], 1, generator=sample_gen))


def verify_tree(logits: torch.Tensor, draft: Draft, top: torch.Tensor | None = None) -> tuple[list[int], int]:
    """Greedy acceptance over a tree of candidates: from the anchor, follow the child that equals the target's
    argmax while there is one. ``logits`` [n+1, V] row i: the prediction after the path to node i (0: the anchor);
    ``top``: their argmaxes when the engine computed them. Returns (accepted nodes, 1-based, in order; the
    target's token after the last of them)."""
    top = (logits.max(-1).indices if top is None else top).tolist()
    children: dict[int, dict[int, int]] = {}
    for i, p in enumerate(draft.parents, start=1):
        children.setdefault(p, {}).setdefault(draft.tokens[i - 1], i)
    path, node = [], 0
    while (child := children.get(node, {}).get(top[node])) is not None:
        path.append(child)
        node = child
    return path, top[node]


@dataclass
class Prefill:
    """The target's pass over a prompt, computed once and shared by several generations (e.g. one per drafter in
    an evaluation): each generation decodes from its own copy of the cache."""

    prompt_ids: list[int]
    cache: object
    last_logits: torch.Tensor  # [V] fp32: the prediction after the prompt
    features: torch.Tensor | None  # [T, F] target features of the prompt (None if not computed)
    ms: float = 0.0


PREFILL_CHUNK = 2048  # prompt tokens per target forward in a prefill


def prompt_forward(target, prompt_ids: list[int], cache, features: bool, chunk: int = PREFILL_CHUNK,
                   on_chunk: Callable[[int], None] | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The target over a prompt into ``cache``, ``chunk`` tokens per forward → (logits after the prompt [V], features
    [T, F] or None). In chunks, a sliding-window layer attends over its window plus the chunk instead of the whole
    prompt (Gemma 3: 15 of 18 layers; a 16K-token prompt's attention cost falls about fivefold), the attention mask
    stays chunk × prompt, and only the last token's logits are computed. ``on_chunk`` is called with each chunk's
    token count once it is done (a progress bar)."""
    feats, logits = [], None
    for start in range(0, len(prompt_ids), chunk):
        block = prompt_ids[start:start + chunk]
        out = target.forward(torch.tensor(block), cache, features=features, last_only=True)
        logits = out.logits[-1]
        if features:
            feats.append(out.features)
        if on_chunk:
            on_chunk(len(block))
    target.rollback(cache, len(prompt_ids))
    if hasattr(cache, "trim"):  # our static cache: sliding-window layers keep only their window from here on
        cache.trim()
    return logits, (torch.cat(feats) if features else None)


def prefill(target, prompt_ids: list[int], features: bool = True, capacity: int | None = None) -> Prefill:
    """Run the target over ``prompt_ids`` once (see ``Prefill``); ``capacity``: tokens the cache must hold later
    (prompt + new tokens; matters only on the fast path's static cache)."""
    t0 = time.perf_counter()
    cache = target.new_cache(capacity)
    last_logits, feats = prompt_forward(target, prompt_ids, cache, features)
    return Prefill(list(prompt_ids), cache, last_logits, feats, 1e3 * (time.perf_counter() - t0))


def generate(target, prompt_ids: list[int], proposer: Proposer | None = None, max_new_tokens: int = 128,
             sampling: SamplingConfig | None = None, stop_strings: tuple[str, ...] | list[str] = (),
             on_tokens: Callable[[list[int]], None] | None = None,
             shared_prefill: Prefill | None = None,
             on_prefill: Callable[[int], None] | None = None) -> GenerationResult:
    """Generate up to ``max_new_tokens`` after ``prompt_ids`` with the target, drafting with ``proposer``.

    The output equals the target's own decoding (greedy: token for token; sampling: in distribution).
    ``on_tokens`` is called with each round's newly committed tokens (streaming). ``shared_prefill``: the target's
    pass over this prompt from ``prefill()``, reused (its cache is copied, never changed); its time is not counted
    again (``stats.prefill_ms`` is then the copy's). ``on_prefill`` is called with the prompt tokens of each
    prefill chunk once it is done (``prompt_forward``).
    """
    sampling = sampling or SamplingConfig()
    sampling.validate()
    proposer = proposer or NoDraft()
    if not prompt_ids:
        raise HyflashError("the prompt is empty")
    if max_new_tokens < 1:
        raise HyflashError("max_new_tokens must be >= 1")
    if len(prompt_ids) >= target.max_context:
        raise HyflashError(f"the prompt has {len(prompt_ids)} tokens; the target's context window is "
                           f"{target.max_context} (leave room for at least one new token)")
    coin_gen, sample_gen = random_stream(sampling.seed, 1), random_stream(sampling.seed, 2)
    stats = GenerationStats(prompt_tokens=len(prompt_ids))
    hist: Counter[int] = Counter()
    eos = target.eos_token_ids
    t_start = time.perf_counter()
    proposer.reset(list(prompt_ids))  # first: what it needs of the prefill (features) may depend on its state

    if shared_prefill is not None:
        if list(shared_prefill.prompt_ids) != list(prompt_ids):
            raise HyflashError("shared_prefill was computed for another prompt")
        if proposer.needs_features and shared_prefill.features is None:
            raise HyflashError("shared_prefill has no target features, and this proposer needs them")
        cache = copy.deepcopy(shared_prefill.cache)
        last_logits, features = shared_prefill.last_logits, shared_prefill.features
    else:
        cache = target.new_cache(len(prompt_ids) + max_new_tokens + 1)
        last_logits, features = prompt_forward(target, prompt_ids, cache, proposer.needs_features,
                                               on_chunk=on_prefill)
    tree_ok = target.supports_tree and hasattr(cache, "capacity")  # else a drafted tree is cut to its chain
    proposer.commit(list(prompt_ids), features if proposer.needs_features else None)
    anchor = int(torch.multinomial(target_probs(last_logits, sampling), 1, generator=sample_gen)) \
        if not sampling.greedy else int(last_logits.argmax())
    t_decode = time.perf_counter()
    stats.prefill_ms = 1e3 * (t_decode - t_start)

    new: list[int] = [anchor]
    if on_tokens:
        on_tokens([anchor])
    stop_reason = _stop_reason(target, new, anchor, eos, max_new_tokens, stop_strings)
    while not stop_reason:
        committed = len(prompt_ids) + len(new) - 1  # tokens with features; the anchor is not among them
        room = min(max_new_tokens - len(new), target.max_context - committed - 1)
        if room <= 0:
            stop_reason = "context"
            break
        t0 = time.perf_counter()
        draft = proposer.draft(anchor, room - 1, sampling) if room > 1 else Draft([])
        if draft.parents is not None and not (tree_ok and sampling.greedy):
            draft = draft.chain()
        draft.tokens = draft.tokens[:room - 1]
        draft.parents = None if draft.parents is None else draft.parents[:room - 1]
        t1 = time.perf_counter()
        out = target.forward(torch.tensor([anchor] + draft.tokens), cache, features=proposer.needs_features,
                             parents=draft.parents)
        if draft.parents is None:
            m, bonus = verify_block(out.logits, draft, sampling, coin_gen, sample_gen, top=out.top)
            target.rollback(cache, committed + m + 1)
            kept, rows = draft.tokens[:m], slice(0, m + 1)
        else:  # the accepted path's keys/values move up to follow the committed ones; the other branches go
            path, bonus = verify_tree(out.logits, draft, out.top)
            target.keep_path(cache, committed, [0] + path)
            m, kept, rows = len(path), [draft.tokens[i - 1] for i in path], [0] + path
        t2 = time.perf_counter()
        stats.draft_ms += 1e3 * (t1 - t0)
        stats.verify_ms += 1e3 * (t2 - t1)
        accepted = [anchor] + kept
        proposer.commit(accepted, None if out.features is None else out.features[rows])
        round_tokens = kept + [bonus]
        stats.rounds += 1
        stats.drafted += len(draft.tokens)
        # stop inside the block: EOS, stop string or token budget end the round where they occur
        emitted = []
        for tok in round_tokens:
            new.append(tok)
            emitted.append(tok)
            stop_reason = _stop_reason(target, new, tok, eos, max_new_tokens, stop_strings)
            if stop_reason:
                break
        hist[len(emitted)] += 1
        if on_tokens:
            on_tokens(emitted)
        anchor = bonus

    t_end = time.perf_counter()
    text = target.decode(new)
    if stop_reason == "stop_string":
        text = _cut_at_stop(text, stop_strings)
    stats.new_tokens = len(new)
    stats.stop_reason = stop_reason
    stats.committed_histogram = dict(hist)
    stats.acceptance_length = sum(k * v for k, v in hist.items()) / max(1, stats.rounds)
    stats.total_ms = 1e3 * (t_end - t_start)
    decode_s = t_end - t_decode
    stats.tokens_per_s = (len(new) - 1) / decode_s if decode_s > 0 and len(new) > 1 else 0.0
    stats.drafter_state_bytes = proposer.state_bytes()
    stats.target_kv_bytes = _cache_nbytes(cache)
    return GenerationResult(new, text, stats)


def _cache_nbytes(cache) -> int:
    if hasattr(cache, "capacity"):  # hyflash.fast.StaticCache
        return cache.nbytes()
    total = 0
    for layer in getattr(cache, "layers", []):
        for x in (getattr(layer, "keys", None), getattr(layer, "values", None)):
            if isinstance(x, torch.Tensor):
                total += x.numel() * x.element_size()
    return total


def _stop_reason(target, new, tok, eos, max_new_tokens, stop_strings) -> str:
    if tok in eos:
        return "eos"
    if stop_strings and any(s in target.decode(new[-64:]) for s in stop_strings):
        return "stop_string"
    if len(new) >= max_new_tokens:
        return "max_new_tokens"
    return ""


def _cut_at_stop(text: str, stop_strings) -> str:
    cuts = [text.find(s) for s in stop_strings if s in text]
    return text[:min(cuts)] if cuts else text
