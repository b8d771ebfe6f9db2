"""Cache rollback is exact: after a verify forward and a rollback, the target continues as if the rejected tokens
had never been seen. The reference is always a fresh ``Target.forward`` of the committed sequence on a new cache.

Covers a full-attention model (tiny Llama), a model with sliding-window layers (tiny Gemma 3, window 6) where
rollback must cross the window boundary again and again, and the real SmolLM2 target in fp32.
"""

import pytest
import torch

from conftest import tiny_gemma3, tiny_llama
from hyflash import HyflashError
from hyflash.target import Target

# The tiny targets run in fp64: their features (hidden states, model dtype) must agree to 1e-10 (measured: ~1e-17).
# Target.forward returns logits cast to fp32, so logits are compared to a few fp32 ulps of their scale instead.
FP64_TOL = 1e-10
FP32_ULPS = 4 * torch.finfo(torch.float32).eps


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: no fork/join overhead per matmul


def with_last_layer_features(t):
    """Re-wrap a conftest target so its (fp64) features include the last decoder layer's output."""
    return Target(t.model, t.tokenizer, t.name, feature_layers=[0, t.num_layers - 1])


@pytest.fixture(scope="module", params=["llama", "gemma3_sliding6"])
def tiny(request):
    return with_last_layer_features(tiny_llama() if request.param == "llama" else tiny_gemma3())


def fresh(target, seq):
    """Logits and features of ``seq`` in one forward on a new cache."""
    return target.forward(torch.tensor(seq), target.new_cache(), features=True)


def assert_close(out, ref, rows, tol, what):
    """``out``'s rows equal the last ``rows`` rows of the fresh reference ``ref``: features within ``tol``, the
    fp32 logits within ``tol`` plus a few fp32 ulps of their scale."""
    ref_logits = ref.logits[-rows:]
    dl = (out.logits - ref_logits).abs().max().item()
    df = (out.features.double() - ref.features[-rows:].double()).abs().max().item()
    logit_tol = tol + FP32_ULPS * ref_logits.abs().max().item()
    assert dl <= logit_tol and df <= tol, f"{what}: logits differ by {dl:.2e}, features by {df:.2e}"
    return df


def speculative_rounds(target, schedule, prompt_len, seed, tol, crop_after_next=True):
    """Mimic verification rounds: forward k tokens after the committed prefix, roll back to keep m of them,
    forward the next token; every forward must equal a fresh forward of the committed sequence.

    ``schedule``: list of (k, m). Returns the committed sequence and the largest feature difference seen."""
    g = torch.Generator().manual_seed(seed)
    vocab = target.vocab_size

    def rand(n):
        return torch.randint(1, vocab, (n,), generator=g).tolist()

    committed = rand(prompt_len)
    cache = target.new_cache()
    target.forward(torch.tensor(committed), cache, features=True)
    target.rollback(cache, len(committed))  # as generate() does after the prefill
    worst = 0.0
    for r, (k, m) in enumerate(schedule):
        block = rand(k)
        out = target.forward(torch.tensor(block), cache, features=True)
        assert target.cache_length(cache) == len(committed) + k
        worst = max(worst, assert_close(out, fresh(target, committed + block), k, tol, f"round {r}: block of {k}"))
        target.rollback(cache, len(committed) + m)
        committed += block[:m]
        assert target.cache_length(cache) == len(committed)
        nxt = rand(1)
        out = target.forward(torch.tensor(nxt), cache, features=True)
        committed += nxt
        worst = max(worst, assert_close(out, fresh(target, committed), 1, tol,
                                        f"round {r}: next token after keeping {m} of {k}"))
        if crop_after_next:  # generate() crops after every forward; a rollback to the current length is allowed
            target.rollback(cache, len(committed))
            assert target.cache_length(cache) == len(committed)
    return committed, worst


def random_schedule(seed, rounds):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(rounds):
        k = int(torch.randint(1, 9, (1,), generator=g))
        out.append((k, int(torch.randint(0, k + 1, (1,), generator=g))))
    return out


# Rollbacks of more than the window (6) and blocks longer than the window, early (the prefix is shorter than the
# window, then crosses it) and late; then random rounds (k in 1..8, m in 0..k).
EDGE_SCHEDULE = [(8, 0), (8, 8), (7, 1), (1, 0), (8, 2), (6, 0), (5, 5), (8, 7), (2, 1), (8, 0), (7, 0), (1, 1)]


@pytest.mark.parametrize("prompt_len", [3, 9])
def test_logits_after_rollback_equal_a_fresh_forward_of_the_committed_sequence(tiny, prompt_len):
    schedule = EDGE_SCHEDULE + random_schedule(prompt_len, 16)
    committed, worst = speculative_rounds(tiny, schedule, prompt_len, seed=prompt_len, tol=FP64_TOL)
    assert len(committed) >= 30  # far beyond the sliding window of 6


def test_rollback_without_a_crop_after_the_next_token_is_exact(tiny):
    """The next token's forward is not followed by a crop (sliding layers then hold more than the window)."""
    speculative_rounds(tiny, random_schedule(11, 20), 5, seed=11, tol=FP64_TOL, crop_after_next=False)


def test_a_stale_token_left_in_the_cache_is_detected(tiny):
    """Negative control: keeping one rejected token too many changes the next logits far beyond the tolerance."""
    g = torch.Generator().manual_seed(3)
    committed = torch.randint(1, tiny.vocab_size, (20,), generator=g).tolist()
    block = torch.randint(1, tiny.vocab_size, (4,), generator=g).tolist()
    cache = tiny.new_cache()
    tiny.forward(torch.tensor(committed), cache, features=False)
    tiny.rollback(cache, len(committed))
    tiny.forward(torch.tensor(block), cache, features=False)
    tiny.rollback(cache, len(committed) + 2)  # keeps block[1], which a correct rollback to +1 would drop
    nxt = [block[3]]
    out = tiny.forward(torch.tensor(nxt), cache, features=True)
    ref = fresh(tiny, committed + block[:1] + nxt)
    with pytest.raises(AssertionError):
        assert_close(out, ref, 1, FP64_TOL, "stale token")
    assert (out.features[-1] - ref.features[-1]).abs().max().item() > 1e6 * FP64_TOL


def test_rollback_to_a_longer_or_negative_length_raises(tiny):
    cache = tiny.new_cache()
    tiny.forward(torch.arange(1, 13), cache, features=False)
    for bad in (13, 100, -1):
        with pytest.raises(ValueError):
            tiny.rollback(cache, bad)
    assert tiny.cache_length(cache) == 12  # a refused rollback changes nothing
    out = tiny.forward(torch.tensor([5]), cache, features=True)
    assert_close(out, fresh(tiny, list(range(1, 13)) + [5]), 1, FP64_TOL, "after refused rollbacks")


def test_full_attention_cache_rolls_back_to_any_earlier_length_in_steps():
    """Without sliding-window layers, rollbacks can go anywhere and can follow each other without a forward."""
    target = with_last_layer_features(tiny_llama())
    seq = torch.randint(1, 32, (40,), generator=torch.Generator().manual_seed(5)).tolist()
    cache = target.new_cache()
    target.forward(torch.tensor(seq), cache, features=False)
    for length in (35, 30, 12, 0):
        target.rollback(cache, length)
        assert target.cache_length(cache) == length
    out = target.forward(torch.tensor(seq[:20]), cache, features=True)
    assert_close(out, fresh(target, seq[:20]), 20, FP64_TOL, "after stepwise rollback to 0")


def test_sliding_window_rollback_in_two_steps_is_exact_or_refused():
    """Rolling back 20 -> 18 -> 16 must either give exact logits or be refused by rollback with a clear error."""
    target = with_last_layer_features(tiny_gemma3())
    seq = torch.randint(1, 48, (20,), generator=torch.Generator().manual_seed(6)).tolist()
    cache = target.new_cache()
    target.forward(torch.tensor(seq), cache, features=False)
    try:
        target.rollback(cache, 18)
        target.rollback(cache, 16)
    except (ValueError, HyflashError):
        return  # an honest refusal at rollback time is acceptable
    out = target.forward(torch.tensor([7]), cache, features=True)
    assert_close(out, fresh(target, seq[:16] + [7]), 1, FP64_TOL, "after two rollbacks")


# ------------------------------------------------------------------------------------- the real target
# fp32, SmolLM2-135M: a cached forward of a short block and one full forward of ~300 tokens run different matrix
# shapes, so logits differ in the last bits. Measured max |diff| over these rounds: 5e-5 (logits are O(10)); the
# tolerance leaves 20x headroom for other CPUs/BLAS builds, and one stale token in the cache gives diffs of O(1)
# (the negative control below checks that the comparison can fail).
SMOL_TOL = 1e-3


def test_smollm2_rollback_matches_fresh_forward(smollm2_fp32):
    target = smollm2_fp32
    torch.set_num_threads(1)  # the fixture asks for 2; on 2 shared cores that can be 50x slower for 1-token steps
    text = ("The committee met on Tuesday to review the budget for the new library. After a long discussion "
            "about shelving, lighting and the reading room, they agreed to ask the architect for two options. ")
    ids = target.tokenizer.encode(text * 12)  # ~450 tokens
    prompt = ids[:300]
    assert len(prompt) == 300
    g = torch.Generator().manual_seed(0)
    cache = target.new_cache()
    target.forward(torch.tensor(prompt), cache, features=False)
    target.rollback(cache, len(prompt))
    committed = list(prompt)
    worst = 0.0
    for k, m in [(8, 3), (8, 0), (5, 5), (8, 1)]:
        block = torch.randint(target.vocab_size, (k,), generator=g).tolist()
        block[:m] = ids[len(committed):len(committed) + m]  # kept tokens continue the real text
        target.forward(torch.tensor(block), cache, features=False)
        target.rollback(cache, len(committed) + m)
        committed += block[:m]
        assert target.cache_length(cache) == len(committed)
        nxt = [ids[len(committed)]]
        out = target.forward(torch.tensor(nxt), cache, features=False)
        committed += nxt
        target.rollback(cache, len(committed))
        ref = target.forward(torch.tensor(committed), target.new_cache(), features=False).logits[-1]
        diff = (out.logits[-1] - ref).abs().max().item()
        worst = max(worst, diff)
        assert diff <= SMOL_TOL, f"after keeping {m} of {k}: logits differ by {diff:.2e}"
        assert int(out.logits[-1].argmax()) == int(ref.argmax())
    print(f"smollm2 fp32: max |logit diff| after rollback {worst:.2e}")

    # negative control: a rollback that keeps one rejected token too many must be caught by the same comparison
    block = [ids[len(committed)], 1234, 4321]
    target.forward(torch.tensor(block), cache, features=False)
    target.rollback(cache, len(committed) + 2)  # should have been + 1
    out = target.forward(torch.tensor([ids[len(committed) + 1]]), cache, features=False)
    ref = target.forward(torch.tensor(committed + ids[len(committed):len(committed) + 2]), target.new_cache(),
                         features=False).logits[-1]
    stale = (out.logits[-1] - ref).abs().max().item()
    print(f"smollm2 fp32: max |logit diff| with one stale token {stale:.2e}")
    assert stale > 100 * SMOL_TOL
