"""PacedProposer: drafting or plain steps, whichever commits more tokens per second, with the target's own output
either way. Time is a fake clock here, advanced by what a round did, so the choice is tested without timing noise."""

import pytest
import torch

from conftest import tiny_llama
from hyflash import HyflashError
from hyflash.decoding import Draft, generate
from hyflash.proposers import NgramProposer, PacedProposer, load_proposer


class Oracle:
    """Drafts the target's own greedy continuation (known in advance), ``k`` tokens a round, and advances the fake
    clock by ``extra`` when it drafts (a round's unit step is added where the clock is read, once a round)."""

    needs_features = True  # as a drafter: every commit must bring the target's features

    def __init__(self, plain_ids, prompt_len, k, clock, extra):
        self.plain, self.prompt_len, self.k = plain_ids, prompt_len, k
        self.clock, self.extra = clock, extra
        self.done = 0  # committed generated tokens

    def reset(self, prompt_ids):
        self.done = -len(prompt_ids)

    def commit(self, token_ids, features):
        assert features is not None and len(features) == len(token_ids)
        self.done += len(token_ids)

    def draft(self, anchor, max_tokens, sampling):
        self.clock[0] += self.extra
        at = self.done + 1  # the anchor is plain[self.done]
        return Draft(self.plain[at:at + min(self.k, max_tokens)])

    def state_bytes(self):
        return 0


@pytest.mark.parametrize("extra,drafting_wins", [(10.0, False), (0.5, True)])
def test_paced_takes_the_faster_arm_and_keeps_the_targets_output(extra, drafting_wins):
    target = tiny_llama(seed=7)  # a seed whose 80 greedy tokens hold no end-of-sequence token
    prompt = torch.randint(1, 31, (8,), generator=torch.Generator().manual_seed(7)).tolist()
    plain = generate(target, prompt, None, max_new_tokens=80).token_ids
    assert len(plain) == 80
    clock = [0.0]
    # drafting 3 right tokens a round: 4 tokens for 1 + extra time units, against 1 token for 1 unit plain

    def tick():  # read once a round, at its start: each round costs 1 unit, plus the drafting's extra
        clock[0] += 1.0
        return clock[0]

    paced = PacedProposer(Oracle(plain, len(prompt), 3, clock, extra), clock=tick)
    out = generate(target, prompt, paced, max_new_tokens=80)
    assert out.token_ids == plain
    assert (paced.rate[PacedProposer.DRAFT] > paced.rate[PacedProposer.PLAIN]) == drafting_wins
    expected = 4 / (1 + extra)  # tokens per unit of drafting rounds, measured exactly on the fake clock
    assert paced.rate[PacedProposer.DRAFT] == pytest.approx(expected) and paced.rate[PacedProposer.PLAIN] == 1.0
    # after the warm-up and 4 tries each: drafting, with a plain step every 8 rounds; or plain steps alone, drafting
    # retired for the rest of the prompt (plain is faster by more than 15%)
    since_warmup = paced.rounds - paced.warmup
    assert since_warmup > 2 * paced.recheck
    rechecks = since_warmup // paced.recheck - 2 * paced.explore // paced.recheck  # those after the exploration
    if drafting_wins:
        assert paced.arm_rounds[PacedProposer.PLAIN] == paced.explore + rechecks and not paced.retired
    else:
        assert paced.arm_rounds[PacedProposer.DRAFT] == paced.warmup + paced.explore and paced.retired
        assert not paced.needs_features  # the loop no longer computes features for a drafter it will not use
    # the next prompt keeps the rates (no new exploration; its first round drafts, to refresh that arm), and the
    # time between prompts counts for no arm
    clock[0] += 1000.0
    before = list(paced.arm_rounds)
    assert generate(target, prompt, paced, max_new_tokens=80).token_ids == plain
    assert paced.rate[PacedProposer.DRAFT] == pytest.approx(expected) and paced.rate[PacedProposer.PLAIN] == 1.0
    if drafting_wins:
        assert paced.arm_rounds[PacedProposer.PLAIN] - before[PacedProposer.PLAIN] <= 80 // (4 * paced.recheck) + 1
    else:
        assert paced.arm_rounds[PacedProposer.DRAFT] - before[PacedProposer.DRAFT] == 1 and paced.retired


def test_paced_output_is_exact_with_a_real_proposer_and_real_time():
    target = tiny_llama(seed=6)
    prompt = [3, 4, 5, 6, 3, 4, 5, 6, 3, 4]
    plain = generate(target, prompt, None, max_new_tokens=40).token_ids
    paced = PacedProposer(NgramProposer(block_size=4))
    assert generate(target, prompt, paced, max_new_tokens=40).token_ids == plain
    assert sum(paced.arm_rounds) == paced.rounds and min(paced.arm_rounds) > 0  # both arms were tried


def test_paced_spec():
    target = tiny_llama(seed=7)
    assert isinstance(load_proposer("paced:ngram", target), PacedProposer)
    with pytest.raises(HyflashError, match="paced: needs a drafter"):
        load_proposer("paced:none", target)
