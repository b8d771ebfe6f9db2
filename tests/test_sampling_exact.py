"""Sampling is exact (DESIGN §1): whatever the drafter proposes, speculative generation samples from the target.

End to end: on a tiny fp64 Llama with a deliberately wrong drafter, the empirical joint distribution of the first
generated tokens over many seeds must match the target's distribution, computed exactly by enumerating every
continuation. Negative controls run the same statistic on deliberately broken acceptance rules and must reject
them, which proves the test has power. Unit tests check ``verify_block`` on hand-made logits, the greedy case,
EOS inside an accepted block and the token budget.
"""

from types import SimpleNamespace

import pytest
import torch
from scipy import stats

from conftest import tiny_llama
from hyflash import decoding
from hyflash.decoding import Draft, NoDraft, SamplingConfig, generate, target_probs, verify_block
from hyflash.proposers import RandomProposer

V = 8  # vocabulary of the tiny target; its EOS id is V - 1
PROMPT = [1, 3, 5]  # not token 0: it is the pad id, whose embedding row is zero
# With fixed seeds the whole test is deterministic. For a correct sampler the p-value is uniform on (0, 1), so a
# threshold of 1e-3 means the chosen seeds had a 0.1% chance of failing a correct implementation; a real bias of
# the size the negative controls show gives p-values far below 1e-6 at these sample sizes.
P_PASS = 1e-3
P_REJECT = 1e-6


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: no fork/join overhead per matmul


def decodable(target):
    """The conftest targets have no tokenizer, but ``generate`` decodes its output to text; give them a stub."""
    if target.tokenizer is None:
        target.tokenizer = SimpleNamespace(decode=lambda ids, skip_special_tokens=True: " ".join(map(str, ids)))
    return target


def peaked_tiny_llama(vocab, lm_head_gain=1.5):
    """A tiny Llama whose next-token distributions are peaked and depend on the context.

    The default init (std 0.02) gives almost uniform distributions, against which a sampler that ignores the
    target would pass, and greedy continuations that repeat one token; re-initialise with unit-scale weights.
    """
    t = decodable(tiny_llama(vocab=vocab))
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, w in t.model.named_parameters():
            if w.dim() == 2:
                std = 1.0 if "embed" in name else w.shape[1] ** -0.5
                w.copy_(torch.randn(w.shape, generator=g, dtype=w.dtype) * std * (lm_head_gain if "lm_head" in name else 1.0))
    return t


@pytest.fixture(scope="module")
def target():
    return peaked_tiny_llama(V)


@pytest.fixture(scope="module")
def greedy_target():
    """Vocabulary 32 so greedy continuations are varied (vocabulary 8 falls into one repeated token)."""
    t = peaked_tiny_llama(32, lm_head_gain=1.0)
    t.eos_token_ids = set()
    return t


class DistortedProposer:
    """Drafts K tokens, each sampled from a fixed wrong distribution q (depending on the anchor and the slot),
    processed by the same temperature/top-k/top-p as the target's p, with its own random stream."""

    needs_features = False

    def __init__(self, q_logits: torch.Tensor, seed: int):
        self.q_logits = q_logits  # [V anchors, K slots, V]
        self.block_size = q_logits.shape[1]
        self.gen = torch.Generator().manual_seed(10**6 + seed)

    def reset(self, prompt_ids):
        pass

    def commit(self, token_ids, features):
        pass

    def draft(self, anchor, max_tokens, sampling):
        k = min(self.block_size, max_tokens)
        q = target_probs(self.q_logits[anchor, :k], sampling)
        if sampling.greedy:
            return Draft(q.argmax(-1).tolist(), q)
        return Draft(torch.multinomial(q, 1, generator=self.gen)[:, 0].tolist(), q)

    def state_bytes(self):
        return 0


def distorted_q_logits(target, k=7, seed=0):
    """Random q logits with extra mass on the token the target least likes after the prompt."""
    g = torch.Generator().manual_seed(seed)
    vocab = target.vocab_size
    q = 2.0 * torch.randn(vocab, k, vocab, generator=g, dtype=torch.float64)
    p = target.forward(torch.tensor(PROMPT), target.new_cache(), features=False).logits[-1]
    q[:, :, int(p.argmin())] += 3.0
    return q


# ------------------------------------------------------------------------------------ exact distributions
def exact_distribution(target, sampling, n):
    """P(first n generated tokens), generation cut at EOS: {token tuple: probability}, by enumeration of
    p(t1) p(t2 | t1) .. with a fresh forward per prefix."""
    eos = target.eos_token_ids
    dist = {}

    def expand(prefix, prob):
        logits = target.forward(torch.tensor(PROMPT + prefix), target.new_cache(), features=False).logits[-1]
        p = target_probs(logits, sampling).double()
        for tok in torch.nonzero(p).flatten().tolist():
            seq, pr = prefix + [tok], prob * float(p[tok])
            if tok in eos or len(seq) == n:
                dist[tuple(seq)] = pr
            else:
                expand(seq, pr)

    expand([], 1.0)
    total = sum(dist.values())
    assert abs(total - 1.0) < 1e-5
    return {k: v / total for k, v in dist.items()}


def sample_outcomes(target, sampling_kw, n, runs, q_logits, max_new_tokens, seed0=0):
    """First n tokens of ``runs`` generations with seeds seed0.. (each run: its own sampler and drafter seed)."""
    outcomes = []
    for i in range(seed0, seed0 + runs):
        proposer = DistortedProposer(q_logits, seed=i)
        r = generate(target, PROMPT, proposer, max_new_tokens=max_new_tokens,
                     sampling=SamplingConfig(seed=i, **sampling_kw))
        outcomes.append(tuple(r.token_ids[:n]))
    return outcomes


def chi_square_pvalue(outcomes, dist):
    """Goodness of fit of observed outcomes to ``dist``; cells with expected count < 5 are pooled."""
    n = len(outcomes)
    impossible = [o for o in outcomes if o not in dist]
    if impossible:
        return 0.0  # an outcome the target can never produce
    counts = {}
    for o in outcomes:
        counts[o] = counts.get(o, 0) + 1
    cells = sorted(dist, key=dist.get, reverse=True)
    obs, exp, pool_o, pool_e = [], [], 0, 0.0
    for c in cells:
        if n * dist[c] >= 5:
            obs.append(counts.get(c, 0))
            exp.append(n * dist[c])
        else:
            pool_o += counts.get(c, 0)
            pool_e += n * dist[c]
    if pool_e >= 5 or not obs:
        obs.append(pool_o)
        exp.append(pool_e)
    else:  # too little mass to stand alone: merge into the smallest cell
        obs[-1] += pool_o
        exp[-1] += pool_e
    assert len(obs) >= 10, "too few cells for a meaningful test"
    return float(stats.chisquare(obs, exp).pvalue)


# max_new_tokens=4 although only 3 tokens are scored: the first token comes from the prefill, so with 4 the first
# verification round drafts 2 tokens and tokens 2 and 3 can both come from one block (accepted drafts, a residual
# sample at slot 1 or 2, or the bonus token); with 3 only one draft slot would ever be exercised.
N_TOKENS, MAX_NEW, RUNS = 3, 4, 4000

CONFIGS = {
    "temperature_1": dict(temperature=1.0),
    "temperature_0.8_top_k_5_top_p_0.9": dict(temperature=0.8, top_k=5, top_p=0.9),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_speculative_sampling_matches_target_joint_distribution(target, name):
    sampling_kw = CONFIGS[name]
    q_logits = distorted_q_logits(target)
    dist = exact_distribution(target, SamplingConfig(**sampling_kw), N_TOKENS)
    outcomes = sample_outcomes(target, sampling_kw, N_TOKENS, RUNS, q_logits, MAX_NEW)
    assert all(o in dist for o in outcomes), "generated a sequence the target gives probability 0"
    pvalue = chi_square_pvalue(outcomes, dist)
    print(f"{name}: chi-square p-value {pvalue:.3g} over {RUNS} runs")
    assert pvalue > P_PASS, f"{name}: p-value {pvalue:.2e}"


def _accept_everything(logits, draft, sampling, coin_gen, sample_gen, top=None):
    """Broken: every draft is kept, the bonus token comes from p."""
    p = target_probs(logits, sampling)
    k = len(draft.tokens)
    return k, int(torch.multinomial(p[k], 1, generator=sample_gen))


def _resample_from_p(logits, draft, sampling, coin_gen, sample_gen, top=None):
    """Broken in the classic subtle way: the acceptance test is right but a rejection resamples from p instead of
    norm(max(0, p - q)), which over-represents tokens the drafter also likes."""
    p = target_probs(logits, sampling)
    for i, x in enumerate(draft.tokens):
        u = torch.rand((), generator=coin_gen, dtype=torch.float64).item()
        q_x = float(draft.probs[i, x])
        if not (q_x > 0 and u < min(1.0, float(p[i, x]) / q_x)):
            return i, int(torch.multinomial(p[i], 1, generator=sample_gen))
    k = len(draft.tokens)
    return k, int(torch.multinomial(p[k], 1, generator=sample_gen))


@pytest.mark.parametrize("broken", [_accept_everything, _resample_from_p], ids=["accept_all", "resample_from_p"])
def test_negative_control_broken_acceptance_is_detected(target, monkeypatch, broken):
    """The same statistic on a broken acceptance rule must reject it: the exactness test has power."""
    sampling_kw = CONFIGS["temperature_1"]
    q_logits = distorted_q_logits(target)
    dist = exact_distribution(target, SamplingConfig(**sampling_kw), N_TOKENS)
    monkeypatch.setattr(decoding, "verify_block", broken)
    outcomes = sample_outcomes(target, sampling_kw, N_TOKENS, 1200, q_logits, MAX_NEW)
    pvalue = chi_square_pvalue(outcomes, dist)
    print(f"{broken.__name__}: chi-square p-value {pvalue:.3g}")
    assert pvalue < P_REJECT, f"broken acceptance not detected: p-value {pvalue:.2e}"


# ------------------------------------------------------------------------------------------------ greedy
def argmax_decode(target, prompt, n):
    """Reference greedy decoding: a fresh full forward per token (no cache reuse, no rollback)."""
    seq = list(prompt)
    for _ in range(n):
        logits = target.forward(torch.tensor(seq), target.new_cache(), features=False).logits[-1]
        seq.append(int(logits.argmax()))
        if seq[-1] in target.eos_token_ids:
            break
    return seq[len(prompt):]


class OracleProposer:
    """Drafts the target's own greedy continuation (block of 7), so every draft is accepted."""

    needs_features = False
    block_size = 7

    def __init__(self, continuation):
        self.continuation = continuation
        self.pos = 0  # tokens committed after the prompt

    def reset(self, prompt_ids):
        self.pos = -len(prompt_ids)

    def commit(self, token_ids, features):
        self.pos += len(token_ids)

    def draft(self, anchor, max_tokens, sampling):
        start = self.pos + 1  # the anchor is continuation[self.pos]
        return Draft(self.continuation[start:start + min(self.block_size, max_tokens)])

    def state_bytes(self):
        return 0


@pytest.fixture
def no_eos(target):
    saved = target.eos_token_ids
    target.eos_token_ids = set()
    yield target
    target.eos_token_ids = saved


def test_greedy_output_equals_argmax_decoding_with_random_and_wrong_drafts(greedy_target):
    target = greedy_target
    n = 30
    for prompt in ([1, 3, 5], [2, 6], [4, 4, 1, 6, 2]):
        reference = argmax_decode(target, prompt, n)
        assert len(set(reference)) > 5  # a varied continuation
        assert generate(target, prompt, NoDraft(), max_new_tokens=n).token_ids == reference
        for seed in range(3):
            r = generate(target, prompt, RandomProposer(target.vocab_size, block_size=7, seed=seed), max_new_tokens=n)
            assert r.token_ids == reference, f"random drafts, prompt {prompt}, seed {seed}"
        wrong = DistortedProposer(distorted_q_logits(target), seed=0)  # greedy drafts with one-hot probs
        assert generate(target, prompt, wrong, max_new_tokens=n).token_ids == reference
        oracle = generate(target, prompt, OracleProposer(reference), max_new_tokens=n)
        assert oracle.token_ids == reference
        # the whole block is accepted every round: 1 (prefill) + 8 + 8 + 8 + 5 tokens
        assert oracle.stats.rounds == 4 and oracle.stats.committed_histogram == {8: 3, 5: 1}


# ----------------------------------------------------------------------------------- verify_block units
def _streams(seed):
    return torch.Generator().manual_seed(2 * seed), torch.Generator().manual_seed(2 * seed + 1)


@pytest.mark.parametrize("sampling", [SamplingConfig(temperature=1.0), SamplingConfig(temperature=0.7, top_k=5, top_p=0.9)],
                         ids=["t1", "t0.7_k5_p0.9"])
def test_verify_accepts_every_draft_when_q_equals_p(sampling):
    K, Vb = 5, 12
    g = torch.Generator().manual_seed(0)
    for trial in range(200):
        logits = 3 * torch.randn(K + 1, Vb, generator=g)
        p = target_probs(logits, sampling)
        tokens = torch.multinomial(p[:K], 1, generator=g)[:, 0].tolist()
        m, tok = verify_block(logits, Draft(tokens, p[:K].clone()), sampling, *_streams(trial))
        assert m == K
        assert p[K, tok] > 0


@pytest.mark.parametrize("with_probs", [True, False], ids=["sampled_q", "point_mass"])
def test_verify_always_rejects_a_draft_the_target_gives_zero_probability(with_probs):
    sampling = SamplingConfig(temperature=1.0, top_k=4)
    K, Vb = 3, 10
    g = torch.Generator().manual_seed(1)
    for trial in range(300):
        logits = torch.randn(K + 1, Vb, generator=g)
        p = target_probs(logits, sampling)
        slot = trial % K
        tokens = [int(p[i].argmax()) for i in range(K)]  # earlier slots: the target's favourite (accepted often)
        tokens[slot] = int(p[slot].argmin())  # outside the top-4: p = 0
        assert p[slot, tokens[slot]] == 0
        q = torch.full((K, Vb), 1.0 / Vb)  # q gives the doomed token positive mass
        draft = Draft(tokens, q if with_probs else None)
        m, tok = verify_block(logits, draft, sampling, *_streams(trial))
        assert m <= slot
        if m == slot:
            assert tok != tokens[slot]
        assert p[m, tok] > 0  # the residual never samples outside p's support


@pytest.mark.parametrize("sampling", [SamplingConfig(temperature=1.0), SamplingConfig(temperature=0.7, top_k=5, top_p=0.9)],
                         ids=["t1", "t0.7_k5_p0.9"])
def test_verify_first_token_is_distributed_as_p_and_acceptance_rate_is_overlap(sampling):
    """The token emitted at slot 1 (the draft if accepted, else the residual sample) is distributed as p_1, and
    the draft is accepted with probability sum_x min(p_1(x), q_1(x))."""
    Vb, n = 10, 20000
    g = torch.Generator().manual_seed(3)
    logits = 2 * torch.randn(2, Vb, generator=g)
    q = target_probs(2 * torch.randn(1, Vb, generator=g), sampling)
    p = target_probs(logits, sampling)
    drafts = torch.multinomial(q[0], n, replacement=True, generator=g).tolist()
    coin, sample = _streams(7)
    first, accepted = [], 0
    for x in drafts:
        m, tok = verify_block(logits, Draft([x], q), sampling, coin, sample)
        first.append(x if m == 1 else tok)
        accepted += m
    support = torch.nonzero(p[0]).flatten().tolist()
    assert set(first) <= set(support)
    counts = torch.bincount(torch.tensor(first), minlength=Vb)[support].double()
    expected = n * p[0, support].double() / p[0, support].double().sum()
    assert stats.chisquare(counts.numpy(), expected.numpy()).pvalue > P_PASS
    overlap = float(torch.minimum(p[0], q[0]).sum())
    assert 0.05 < overlap < 0.95  # the test exercises both branches
    assert stats.binomtest(accepted, n, overlap).pvalue > P_PASS


def test_verify_greedy_accepts_exactly_the_argmax_prefix():
    K, Vb = 6, 9
    g = torch.Generator().manual_seed(4)
    greedy = SamplingConfig()
    for trial in range(100):
        logits = torch.randn(K + 1, Vb, generator=g)
        best = logits.argmax(-1).tolist()
        wrong_at = trial % (K + 1)  # K means: all drafts right
        tokens = best[:K]
        if wrong_at < K:
            tokens[wrong_at] = (best[wrong_at] + 1 + trial % (Vb - 1)) % Vb
        m, tok = verify_block(logits, Draft(tokens), greedy, *_streams(trial))
        assert (m, tok) == (wrong_at, best[wrong_at])


# ------------------------------------------------------------------------------------------ stopping
class FixedBlockProposer:
    """Always drafts the same 7 tokens (ignoring max_tokens) with a q that makes them certain to be accepted at
    temperature 1: q(x) = 1e-9 <= p(x), so min(1, p/q) = 1."""

    needs_features = False
    block_size = 7

    def __init__(self, tokens):
        self.tokens = list(tokens)
        self.max_tokens_seen = []

    def reset(self, prompt_ids):
        pass

    def commit(self, token_ids, features):
        pass

    def draft(self, anchor, max_tokens, sampling):
        self.max_tokens_seen.append(max_tokens)
        q = torch.full((len(self.tokens), V), (1 - 1e-9) / (V - 1))
        q[torch.arange(len(self.tokens)), torch.tensor(self.tokens)] = 1e-9
        return Draft(list(self.tokens), q)

    def state_bytes(self):
        return 0


def test_eos_inside_an_accepted_block_ends_generation(target):
    (eos,) = target.eos_token_ids
    block = [2, 4, eos, 1, 3, 6, 5]
    for seed in range(20):
        r = generate(target, PROMPT, FixedBlockProposer(block), max_new_tokens=50,
                     sampling=SamplingConfig(temperature=1.0, seed=seed))
        if r.token_ids[0] == eos:  # the prefill's own sample was EOS: no round at all
            assert r.token_ids == [eos] and r.stats.rounds == 0
            continue
        assert r.token_ids[1:] == [2, 4, eos], r.token_ids
        assert r.stats.stop_reason == "eos"
        assert r.stats.rounds == 1 and r.stats.committed_histogram == {3: 1}


def test_eos_as_the_greedy_token_inside_a_block_ends_generation(no_eos):
    target = no_eos
    reference = argmax_decode(target, PROMPT, 20)
    stop_tok = reference[5]
    target.eos_token_ids = {stop_tok}
    first = reference.index(stop_tok)
    r = generate(target, PROMPT, OracleProposer(reference), max_new_tokens=20)
    assert r.token_ids == reference[:first + 1]
    assert r.stats.stop_reason == "eos"


class OverdraftingRandomProposer(RandomProposer):
    """Random point-mass drafts, always 7 of them whatever ``max_tokens`` says (the loop must truncate)."""

    def draft(self, anchor, max_tokens, sampling):
        return super().draft(anchor, 7, sampling)


@pytest.mark.parametrize("greedy", [False, True], ids=["always_accepted", "greedy_random"])
def test_max_new_tokens_is_respected_exactly(no_eos, greedy):
    target = no_eos
    block = [2, 4, 6, 1, 3, 5, 7]
    for n in range(1, 11):
        if greedy:
            proposer, sampling = OverdraftingRandomProposer(V, block_size=7, seed=n), SamplingConfig()
        else:
            proposer, sampling = FixedBlockProposer(block), SamplingConfig(temperature=1.0, seed=n)
        r = generate(target, PROMPT, proposer, max_new_tokens=n, sampling=sampling)
        assert len(r.token_ids) == n, (n, r.token_ids)
        assert r.stats.new_tokens == n and r.stats.stop_reason == "max_new_tokens"
        if not greedy:
            # every round commits its whole (truncated) block plus a bonus token: ceil((n - 1) / 8) rounds
            assert r.stats.rounds == -(-(n - 1) // 8)
            kept = min(7, max(n - 2, 0))
            assert r.token_ids[1:1 + kept] == block[:kept]
            assert all(m <= n - 2 for m in proposer.max_tokens_seen)  # never offered more than the room left


# ------------------------------------------------------------------- point-mass guesses while the target samples
class ArgmaxProposer(DistortedProposer):
    """Sends the argmax of the same wrong q as a point mass (``Draft`` without probabilities), as a drafter does with
    a draft temperature of 0 and prompt lookup always does, while the target samples."""

    def draft(self, anchor, max_tokens, sampling):
        k = min(self.block_size, max_tokens)
        return Draft(self.q_logits[anchor, :k].argmax(-1).tolist())


def test_point_mass_guesses_keep_the_target_joint_distribution(target):
    sampling_kw = CONFIGS["temperature_1"]
    q_logits = distorted_q_logits(target)
    dist = exact_distribution(target, SamplingConfig(**sampling_kw), N_TOKENS)
    outcomes = []
    for i in range(RUNS):
        r = generate(target, PROMPT, ArgmaxProposer(q_logits, seed=i), max_new_tokens=MAX_NEW,
                     sampling=SamplingConfig(seed=i, **sampling_kw))
        outcomes.append(tuple(r.token_ids[:N_TOKENS]))
    assert all(o in dist for o in outcomes), "generated a sequence the target gives probability 0"
    pvalue = chi_square_pvalue(outcomes, dist)
    print(f"point-mass guesses: chi-square p-value {pvalue:.3g} over {RUNS} runs")
    assert pvalue > P_PASS, f"p-value {pvalue:.2e}"
