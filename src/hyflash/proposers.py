"""Proposers for the speculative loop (decoding.generate): prompt lookup, random drafts, and the trained drafter.

Each one is told the committed tokens (and their target features) after every verification, and drafts a block
from the anchor without changing what it has committed.
"""

from __future__ import annotations

import dataclasses
import heapq
import time
from pathlib import Path

import torch

from hyflash import HyflashError, kernels
from hyflash.decoding import Draft, NoDraft, SamplingConfig, random_stream, target_probs
from hyflash.drafter import model as drafter_model
from hyflash.drafter.state import DrafterState

SHIPPED = Path(__file__).resolve().parent / "checkpoints"
# Candidate nodes a drafter sends when decoding greedily on a target that verifies trees, unless its spec says #N.
# On MT-Bench with the shipped drafter (80 first turns, our native engine, 2026-11-30, benchmarks/RESULTS.md): trees of
# 12, 6 and 4 nodes gave τ 1.75, 1.70, 1.66 and 1.05x, 1.14x, 1.18x plain decoding; once verifying costs little more
# than a plain step, the smaller tree's cheaper round wins (2 and 3 nodes tied with 4 on 8 prompts, at lower τ).
# With the chunked attention and int8 drafter weights (later the same day), 5 nodes: τ 1.67, 1.30x; 4: 1.65, 1.33x.
DEFAULT_TREE = 4
# On the builds of our kernels whose bf16 pair products are two FMAs (kernels.PAIRS_BY_FMA: AVX2, and NEON by analogy)
# a verify of k tokens is compute-bound, so a round costs more the larger its tree. On the AVX2 build (MT-Bench first
# turns 1-20, 2-core AMD EPYC, 2026-12-01, benchmarks/results/mtbench_avx2_2026-12-01_*.txt) `ngram+auto` with a tree
# of 2 was 1.00-1.26x plain decoding over eight runs; with 4 nodes 0.82-1.07x in the four that measured it, with 3
# nodes 0.96x in the one.
DEFAULT_TREE_PAIRS_BY_FMA = 2


def default_tree() -> int:
    """The nodes of a drafter's tree unless its spec says ``#N``: ``DEFAULT_TREE``, or ``DEFAULT_TREE_PAIRS_BY_FMA``
    on the builds of our kernels without bf16 dot products."""
    return DEFAULT_TREE_PAIRS_BY_FMA if kernels.isa() in kernels.PAIRS_BY_FMA else DEFAULT_TREE


def resolve_tree(tree: int | None, confidence: float | None) -> int:
    """The tree a drafter spec means: its ``#N``, else a chain with an adaptive block length, else ``default_tree()``."""
    if tree is not None:
        return tree
    return 0 if confidence else default_tree()


def continuation(seq: list[int], k: int, max_ngram: int, min_ngram: int) -> list[int]:
    """Up to ``k`` tokens that followed the most recent earlier occurrence of the last n tokens of ``seq`` (n from
    ``max_ngram`` down to ``min_ngram``, the longest match first); [] when none recurs."""
    for n in range(min(max_ngram, len(seq) - 1), min_ngram - 1, -1):
        tail = seq[-n:]
        for start in range(len(seq) - n - 1, -1, -1):  # most recent match first
            if seq[start:start + n] == tail:
                cont = seq[start + n:start + n + k]
                if cont:
                    return cont
    return []


class NgramProposer:
    """Prompt lookup: find the most recent earlier occurrence of the last n tokens (n from ``max_ngram`` down to
    ``min_ngram``) in the sequence so far and propose the tokens that followed it."""

    needs_features = False

    def __init__(self, block_size: int = 7, max_ngram: int = 3, min_ngram: int = 1):
        self.block_size, self.max_ngram, self.min_ngram = block_size, max_ngram, min_ngram
        self.tokens: list[int] = []

    def reset(self, prompt_ids):
        self.tokens = []

    def commit(self, token_ids, features):
        self.tokens.extend(token_ids)

    def draft(self, anchor, max_tokens, sampling):
        return Draft(continuation(self.tokens + [anchor], min(self.block_size, max_tokens), self.max_ngram,
                                  self.min_ngram))

    def state_bytes(self):
        return 8 * len(self.tokens)


class RandomProposer:
    """Drafts uniformly random tokens (point masses): a stress test for exactness, never a speedup."""

    needs_features = False

    def __init__(self, vocab_size: int, block_size: int = 7, seed: int = 0):
        self.vocab_size, self.block_size = vocab_size, block_size
        self.gen = random_stream(seed, 7)

    def reset(self, prompt_ids):
        pass

    def commit(self, token_ids, features):
        pass

    def draft(self, anchor, max_tokens, sampling):
        k = min(self.block_size, max_tokens)
        return Draft(torch.randint(self.vocab_size, (k,), generator=self.gen).tolist())

    def state_bytes(self):
        return 0



def shipped_drafter_path(target, variant: str = "hyflash") -> Path | None:
    """The drafter shipped with the package for ``target``, if there is one."""
    path = SHIPPED / target.name / variant
    return path if (path / drafter_model.CONFIG_NAME).exists() else None


class HyFlashProposer:
    """Drafts a block per round from the drafter's committed state; ``draft`` never changes that state."""

    needs_features = True

    def __init__(self, drafter: drafter_model.HyFlashDrafter, seed: int | None = None, confidence: float = 0.0,
                 tree: int = 0, branching: int = 3, weights: str = "bf16", draft_temperature: float | None = None):
        if not 0.0 <= confidence <= 1.0:
            raise HyflashError(f"confidence must be in [0, 1], got {confidence}")
        if draft_temperature is not None and not draft_temperature >= 0.0:
            raise HyflashError(f"draft temperature must be >= 0, got {draft_temperature}")
        if tree < 0 or branching < 1:
            raise HyflashError(f"tree must be >= 0 nodes and branching >= 1, got {tree} and {branching}")
        if weights not in WEIGHTS:
            raise HyflashError(f"drafter weights must be one of {', '.join(WEIGHTS)}, got {weights!r}")
        self.drafter = drafter.eval()
        # The weights our C++ draft and commit read (a bf16 drafter on a CPU with AMX; elsewhere the drafter's own):
        # bf16, or int8 codes with a scale per output column (half the bytes; the target's output is unchanged,
        # only the drafter's guesses move slightly). Packed when the first state is made; a drafter shared with a
        # proposer that asked for the other kind is packed afresh.
        if getattr(drafter, "native_weights", weights) != weights:
            drafter._runtime_weights = drafter._native_weights = None
        self.drafter.native_weights = weights
        self.drafter.pack_for_inference()  # bf16 on CPU: weights packed once (hyflash.packed)
        self.block_size = drafter.config.block_size
        self.seed = seed
        # Adaptive block length: keep drafted slots while the product of the drafter's probabilities of its own
        # tokens stays >= confidence (its estimate that the target accepts that far). The target's verify cost grows
        # with the block; slots it will almost surely reject are not worth sending. 0 keeps every slot. Any cut is
        # exact: verification of a shorter draft follows the same acceptance rule.
        self.confidence = confidence
        # Tree drafting (greedy decoding): instead of one chain, send the ``tree`` most likely candidates, each
        # slot's ``branching`` best tokens, expanded best first by the product of the drafter's probabilities along
        # the path — as Medusa builds its candidate trees from independent per-position heads, which the block's
        # slots are. The target verifies them all in one forward (hyflash.fast.tree_mask) and keeps the longest
        # path it agrees with. 0: a chain.
        self.tree, self.branching = tree, branching
        # The temperature of the distribution q the drafter samples its guesses from when the target samples (greedy
        # decoding ignores it). None: the target's own settings. 0: the drafter's argmax, sent as a point mass, so a
        # guess is accepted with the target's probability of it (as prompt lookup's are). Any q is exact: the
        # acceptance rule uses the q the guess came from (DESIGN §1); only how often guesses are accepted changes.
        # A distilled drafter's q is flatter than the target's where it copies, so its argmax may be accepted more
        # often than its samples (benchmarks/paired_items.py on the probes at temperature 1.0 measures it).
        self.draft_temperature = draft_temperature
        self.state: DrafterState | None = None

    @classmethod
    def from_pretrained(cls, path, target, **kw) -> "HyFlashProposer":
        return cls(drafter_model.from_pretrained(path, target), **kw)

    def reset(self, prompt_ids):
        self.state = DrafterState(self.drafter)
        self.gen = random_stream(self.seed, 3)

    def commit(self, token_ids, features):
        self.state.commit(features, token_ids)

    @torch.no_grad()
    def draft(self, anchor: int, max_tokens: int, sampling: SamplingConfig) -> Draft:
        k = min(self.block_size, max_tokens)
        if k <= 0:
            return Draft([])
        d = self.drafter
        if d.config.causal_head_rank == 0:
            tree = sampling.greedy and self.tree > 1
            # a tree of N nodes reaches at most N slots deep, so the drafter computes only those: fewer rows through
            # its layers and head (benchmarks/bench_draft.py: on the AVX2 build 2 of the 7 slots take half the
            # time), for slightly different guesses, since the slots attend among themselves (ab_draft_slots.py)
            logits = self.state.draft_logits(anchor, min(k, self.tree) if tree else None)[:k]
            if tree:
                return self._tree(logits, min(self.tree, max_tokens))
            if sampling.greedy or self.draft_temperature == 0.0:  # a point mass on the argmax
                index = logits.max(-1).indices  # the first maximal index, as argmax (and faster in bf16)
                keep = self._keep(logits, index)
                return Draft(d.token_ids(index[:keep]).tolist())
            q = target_probs(logits, self._draft_sampling(sampling))
            index = torch.multinomial(q, 1, generator=self.gen)[:, 0]
            keep = self._keep(q, index, probs=True)
            return Draft(d.token_ids(index[:keep]).tolist(), d.full_vocab(q[:keep]))
        h = self.state.draft_hidden(anchor)[:k]  # [k, d]
        tokens, probs, prev = [], [], anchor
        for i in range(k):  # left to right: slot i's logits are biased by the token drafted at slot i−1
            hi = h[i] if i == 0 else h[i] + d.causal_bias_hidden(torch.tensor(prev, device=h.device))
            point_mass = sampling.greedy or self.draft_temperature == 0.0
            q = target_probs(d.logits(hi), sampling if point_mass else self._draft_sampling(sampling))
            index = q.argmax() if point_mass else torch.multinomial(q, 1, generator=self.gen)[0]
            prev = int(d.token_ids(index))
            tokens.append(prev)
            probs.append(q)
        return Draft(tokens, None if point_mass else d.full_vocab(torch.stack(probs)))

    def _draft_sampling(self, sampling: SamplingConfig) -> SamplingConfig:
        """The settings q is drawn with: the target's, at the draft temperature where one is set."""
        if self.draft_temperature is None:
            return sampling
        return dataclasses.replace(sampling, temperature=self.draft_temperature)

    def _tree(self, logits: torch.Tensor, budget: int) -> Draft:
        """The ``budget`` most probable candidate nodes (slot d's token r has probability p[d, r]; a node's score
        is the product along its path), best first, so a parent precedes its children and a first choice its
        siblings."""
        k = min(self.branching, logits.shape[-1])
        module = kernels.amx() if logits.device.type == "cpu" and k <= 16 \
            and logits.dtype in (torch.bfloat16, torch.float32) else None
        if module is not None:  # one C++ call instead of a softmax and a top-k over [S, V] in fp32
            values, index = module.top_probs(logits, k)
        else:
            values, index = logits.float().softmax(-1).topk(k, dim=-1)
        p, ids = values.tolist(), self.drafter.token_ids(index).tolist()
        slots = len(p)
        tokens, parents = [], []
        heap = [(-p[0][r], 0, r, 0) for r in range(len(p[0]))]  # (−score, slot, rank, parent node)
        heapq.heapify(heap)
        while heap and len(tokens) < budget:
            neg, slot, r, parent = heapq.heappop(heap)
            tokens.append(ids[slot][r])
            parents.append(parent)
            if slot + 1 < slots:
                node = len(tokens)
                for r2 in range(len(p[slot + 1])):
                    heapq.heappush(heap, (neg * p[slot + 1][r2], slot + 1, r2, node))
        return Draft(tokens, parents=parents)

    def _keep(self, scores: torch.Tensor, index: torch.Tensor, probs: bool = False) -> int:
        """How many leading slots to send: all, or those whose running product of probabilities stays >= confidence.
        ``scores``: the slots' distributions (``probs``) or their logits."""
        if self.confidence <= 0.0:
            return len(index)
        if not probs:
            scores = scores.to(torch.promote_types(scores.dtype, torch.float32)).softmax(-1)
        running = scores.gather(-1, index[:, None])[:, 0].cumprod(0)
        return int((running >= self.confidence).sum())  # a running product only falls: the kept slots lead

    def state_bytes(self) -> int:
        return 0 if self.state is None else self.state.nbytes()


def graft(tree: Draft, chain: list[int]) -> Draft:
    """``tree`` with ``chain`` (tokens following the anchor) merged in as a path from the root: existing nodes are
    reused while the chain follows them, the rest is appended (parents before children, as verification needs)."""
    tokens, parents = list(tree.tokens), list(tree.parents)
    child = {(p, t): i for i, (t, p) in enumerate(zip(tokens, parents), start=1)}
    node = 0
    for t in chain:
        nxt = child.get((node, t))
        if nxt is None:
            tokens.append(t)
            parents.append(node)
            nxt = child[(node, t)] = len(tokens)
        node = nxt
    return Draft(tokens, parents=parents)


class LookupThenDrafter:
    """Prompt lookup when the last ``min_match`` or more tokens recur earlier in the sequence (a strong signal that
    the text is being copied), the trained drafter otherwise. The drafter commits every verified feature either way,
    so its state is the same as when it drafts every round."""

    needs_features = True

    def __init__(self, drafter: HyFlashProposer, min_match: int = 3, max_ngram: int = 4, graft: int = 3):
        self.drafter = drafter
        self.block_size = drafter.block_size
        self.lookup = NgramProposer(self.block_size, max_ngram=max(max_ngram, min_match), min_ngram=min_match)
        # When the drafter sends a tree, the continuation of a weaker match (the last 1 or 2 tokens) joins it as one
        # more branch of up to ``graft`` nodes: verifying a few more tree nodes costs little, and a longer accepted
        # path is kept whichever branch it follows. On 12 MT-Bench prompts (2026-11-30, our engine) grafts of 2, 3
        # and 4 nodes raised τ from 1.81 to 1.89, 1.91, 1.92 and the speedup from 1.43x to 1.51x, 1.54x, 1.52x.
        # 0: no graft.
        self.graft, self.weak_ngram = (graft, min(2, min_match - 1)) if min_match > 1 else (0, 0)
        self.lookup_rounds = self.rounds = self.graft_rounds = 0

    def reset(self, prompt_ids):
        self.lookup.reset(prompt_ids)
        self.drafter.reset(prompt_ids)
        self.lookup_rounds = self.rounds = self.graft_rounds = 0

    def commit(self, token_ids, features):
        self.lookup.commit(token_ids, features)
        self.drafter.commit(token_ids, features)

    def draft(self, anchor: int, max_tokens: int, sampling: SamplingConfig) -> Draft:
        self.rounds += 1
        found = self.lookup.draft(anchor, max_tokens, sampling)
        if found.tokens:
            self.lookup_rounds += 1
            return found
        draft = self.drafter.draft(anchor, max_tokens, sampling)
        if self.graft > 0 and draft.parents is not None:
            weak = continuation(self.lookup.tokens + [anchor], min(self.graft, max_tokens), self.weak_ngram, 1)
            grown = graft(draft, weak)
            self.graft_rounds += len(grown.tokens) > len(draft.tokens)
            draft = grown
        return draft

    def state_bytes(self) -> int:
        return self.lookup.state_bytes() + self.drafter.state_bytes()


class PacedProposer:
    """Drafts with ``inner`` or takes a plain step, whichever has been committing more tokens per second.

    Where verifying a block costs much more than a single step (a large tree on our kernels' AVX2 build on few
    cores: no bf16 dot-product instruction, so a verify of many tokens is compute-bound), speculation can be slower
    than plain decoding; where a verify costs about one step (AMX, AVX-512 BF16) it is faster. Which holds depends on the machine and the text,
    so this measures both as it goes. A round's time runs from one ``draft`` call to the next (drafting, the
    target's verify, the commit); its tokens are what ``commit`` receives. Each arm's rate is its tokens over its
    time, both sums decayed by ``memory`` per round of that arm (a ratio of sums: a drafting round's tokens vary
    from 1 to the block, and a mean of per-round rates would follow that noise). After ``warmup`` rounds each arm
    is tried ``explore`` times in turn; then each round takes the faster arm — plain only when it is faster by more
    than ``margin``, drafting being what was asked for — and every ``recheck`` rounds the other arm once, so a change
    (a longer context, a stretch of copied text) is noticed. The rates carry over from one prompt to the next (the
    machine's costs do not change with the prompt); ``reset`` only closes the round in flight.

    Keeping the drafter ready costs a plain round something (the target's features, the drafter's commit). So when,
    after the exploration and at least one drafting round of the current prompt, plain steps are faster by more
    than ``retire``, drafting is retired for the rest of the prompt: ``needs_features`` turns False (the loop stops
    computing features) and the inner proposer is no longer told the committed tokens, which is why it cannot draft
    again before the next ``reset``.

    A plain step is an empty draft: the loop verifies the anchor alone. The inner proposer commits every round
    either way, so its state is the one it would have had drafting throughout, and the output is the target's own
    whatever the arms (greedy: token for token)."""

    PLAIN, DRAFT = 0, 1

    def __init__(self, inner, warmup: int = 2, explore: int = 4, recheck: int = 8, memory: float = 0.9,
                 margin: float = 0.05, retire: float = 0.15, clock=None):
        self.inner, self.needs_features = inner, inner.needs_features
        self.warmup, self.explore, self.recheck, self.memory, self.margin = warmup, explore, recheck, memory, margin
        self.retire, self.retired, self._drafted = retire, False, False
        self.clock = clock or time.perf_counter
        self.tokens, self.seconds = [0.0, 0.0], [0.0, 0.0]  # decayed sums per arm
        self.rounds = 0
        self.arm_rounds = [0, 0]
        self._arm = self._start = self._tokens = None

    @property
    def rate(self) -> list[float | None]:
        """Tokens per second of each arm (PLAIN, DRAFT) so far; None before its first measured round."""
        return [t / s if s > 0 else None for t, s in zip(self.tokens, self.seconds)]

    def reset(self, prompt_ids):
        self.inner.reset(prompt_ids)
        self._arm = self._start = self._tokens = None  # the prefill between two prompts is no round's time
        self.retired, self._drafted, self.needs_features = False, False, self.inner.needs_features

    def _record(self, now: float):
        if self._arm is not None and self._tokens is not None and self.rounds > self.warmup:
            a = self._arm  # (the first rounds warm caches and the kernels' first calls)
            self.tokens[a] = self.memory * self.tokens[a] + self._tokens
            self.seconds[a] = self.memory * self.seconds[a] + max(now - self._start, 1e-9)
        self._arm = self._tokens = None

    def choose(self) -> int:
        """The arm of the next round."""
        if self.retired:
            return self.PLAIN
        n = self.rounds - self.warmup  # rounds since the warm-up
        if n <= 0:
            return self.DRAFT
        if n <= 2 * self.explore:
            return self.PLAIN if n % 2 else self.DRAFT
        if not self._drafted:  # a new prompt: its first round drafts, so each prompt has a say
            return self.DRAFT
        plain, drafting = self.rate
        if plain is not None and drafting is not None and plain > drafting * (1 + self.retire):
            self.retired, self.needs_features = True, False
            return self.PLAIN
        faster_plain = drafting is None or (plain is not None and plain > drafting * (1 + self.margin))
        best = self.PLAIN if faster_plain else self.DRAFT
        return 1 - best if n % self.recheck == 0 else best

    def draft(self, anchor: int, max_tokens: int, sampling: SamplingConfig) -> Draft:
        now = self.clock()
        self._record(now)
        self.rounds += 1
        arm = self.choose()
        self._arm, self._start = arm, now
        self.arm_rounds[arm] += 1
        self._drafted |= arm == self.DRAFT
        return self.inner.draft(anchor, max_tokens, sampling) if arm == self.DRAFT else Draft([])

    def commit(self, token_ids, features):
        if not self.retired:
            self.inner.commit(token_ids, features)
        if self._arm is not None:
            self._tokens = len(token_ids)  # the anchor and the accepted drafted tokens

    def state_bytes(self) -> int:
        return self.inner.state_bytes()


# The weights the C++ drafting path reads. int8 (a scale per output column) halves the bytes of a round: on MT-Bench
# (80 first turns, 2026-11-30, benchmarks/RESULTS.md) the drafter's tree of 4 went from 1.27x to 1.33x plain decoding
# and ngram+auto from 1.55x to 1.61x, keeping 99.8% of the bf16 weights' τ (1.647 vs 1.650).
WEIGHTS = ("bf16", "int8")
DEFAULT_WEIGHTS = "int8"


def split_weights(spec: str) -> tuple[str, str | None]:
    """``SPEC:bf16`` / ``SPEC:int8`` → (SPEC, the weights), anything else → (spec, None)."""
    base, _, suffix = spec.rpartition(":")
    return (base, suffix) if base and suffix in WEIGHTS else (spec, None)


def split_draft_temperature(spec: str) -> tuple[str, float | None]:
    """``SPEC~T`` → (SPEC, draft temperature T); anything else → (spec, None). A ``~`` followed by a path (``~/runs``)
    is not a suffix."""
    base, sep, value = spec.rpartition("~")
    if not sep or not base or "/" in value:
        return spec, None
    try:
        t = float(value)
    except ValueError:  # a directory named with a ~: the caller reports it if it does not exist
        return spec, None
    if not t >= 0.0:
        raise HyflashError(f"draft temperature must be >= 0, got {value!r} after ~ in the drafter spec")
    return base, t


def split_spec(spec: str) -> tuple[str, float | None, int | None]:
    """``BASE[@C][#N]`` → (BASE, confidence C or None, tree size N or None)."""
    confidence = tree = None
    if "#" in spec:
        spec, _, value = spec.rpartition("#")
        if not value.isdigit():
            raise HyflashError(f"bad tree size {value!r} after # in the drafter spec (want e.g. auto#12)")
        tree = int(value)
    if "@" in spec:
        spec, _, value = spec.rpartition("@")
        try:
            confidence = float(value)
        except ValueError:
            raise HyflashError(f"bad confidence {value!r} after @ in the drafter spec (want e.g. auto@0.1)") from None
    return spec, confidence, tree


def tree_nodes(proposer) -> int | None:
    """The nodes of the tree the drafter behind ``proposer`` sends when greedy (0: a chain); None without a drafter."""
    while isinstance(proposer, (PacedProposer, LookupThenDrafter)):
        proposer = proposer.inner if isinstance(proposer, PacedProposer) else proposer.drafter
    return proposer.tree if isinstance(proposer, HyFlashProposer) else None


def load_proposer(spec: str, target, block_size: int | None = None, seed: int | None = None,
                  confidence: float | None = None, tree: int | None = None, weights: str | None = None,
                  draft_temperature: float | None = None):
    """``none`` | ``ngram`` | ``random`` | ``auto`` (the drafter shipped for this target, else ngram) | a drafter
    checkpoint directory | ``ngram+auto`` or ``ngram+PATH`` (prompt lookup when it matches, else that drafter).
    A drafter spec may end in ``@C`` (e.g. ``auto@0.1``): adaptive block length with that confidence
    (``HyFlashProposer``); ``confidence`` does the same for a spec without one. It may end in ``#N`` (e.g.
    ``auto#12``): greedy decoding verifies a tree of N candidate tokens instead of a chain (``#0``: a chain);
    ``tree`` likewise. Without either, a drafter sends a tree of ``default_tree()`` nodes (an adaptive block length
    alone means a chain). A trailing ``:bf16`` or ``:int8`` (e.g. ``auto#4:int8``; ``weights`` likewise) chooses the
    weights the C++ drafting path reads (``HyFlashProposer``; default ``DEFAULT_WEIGHTS``). ``~T`` before any ``@C``
    or ``#N`` (e.g. ``auto~0``; ``draft_temperature`` likewise) sets the temperature the drafter samples its guesses
    at when the target samples, 0 for its argmax (``HyFlashProposer``). ``paced:SPEC`` (e.g.
    ``paced:ngram+auto``) drafts with SPEC or takes plain steps, whichever measures faster (``PacedProposer``)."""
    if spec.startswith("paced:"):
        inner = spec[len("paced:"):]
        if inner in ("", "none"):
            raise HyflashError("paced: needs a drafter after it, e.g. paced:ngram+auto")
        return PacedProposer(load_proposer(inner, target, block_size, seed, confidence, tree, weights,
                                           draft_temperature))
    spec, spec_weights = split_weights(spec)
    weights = spec_weights or weights or DEFAULT_WEIGHTS
    spec, spec_confidence, spec_tree = split_spec(spec)
    confidence = confidence if spec_confidence is None else spec_confidence
    tree = tree if spec_tree is None else spec_tree
    spec, spec_draft_t = split_draft_temperature(spec)
    draft_temperature = draft_temperature if spec_draft_t is None else spec_draft_t
    if spec_draft_t is not None and spec in ("none", "ngram", "random"):
        raise HyflashError(f"~{spec_draft_t:g} sets a trained drafter's draft temperature; {spec} has none")
    if spec.startswith("ngram+"):
        inner = spec[len("ngram+"):]
        if inner == "auto" and shipped_drafter_path(target) is None:
            raise HyflashError(f"no drafter shipped for {target.name}: use ngram, or ngram+PATH")
        drafter = load_proposer(inner, target, block_size, seed, confidence, tree, weights, draft_temperature)
        if not isinstance(drafter, HyFlashProposer):
            raise HyflashError(f"ngram+ needs a drafter checkpoint after the +, not {inner!r}")
        return LookupThenDrafter(drafter)
    if spec == "none":
        return NoDraft()
    if spec == "ngram":
        return NgramProposer(block_size=block_size or 7)
    if spec == "random":
        return RandomProposer(target.vocab_size, block_size=block_size or 7, seed=seed or 0)
    if spec == "auto":
        path = shipped_drafter_path(target)
        if path is None:
            return NgramProposer(block_size=block_size or 7)
        spec = str(path)
    if not Path(spec).exists():
        raise HyflashError(f"unknown drafter {spec!r}: not none/ngram/auto and no such checkpoint directory")
    tree = resolve_tree(tree, confidence)
    return HyFlashProposer.from_pretrained(spec, target, seed=seed, confidence=confidence or 0.0, tree=tree,
                                           weights=weights, draft_temperature=draft_temperature)
