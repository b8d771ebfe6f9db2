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
    clock: ``step`` per round (the target's verify, in commit) plus ``extra`` when it drafted."""

    needs_features = False

    def __init__(self, plain_ids, prompt_len, k, clock, step, extra):
        self.plain, self.prompt_len, self.k = plain_ids, prompt_len, k
        self.clock, self.step, self.extra = clock, step, extra
        self.done = 0  # committed generated tokens

    def reset(self, prompt_ids):
        self.done = -len(prompt_ids)

    def commit(self, token_ids, features):
        self.done += len(token_ids)
        if self.done > 0:  # a verification round (the prompt's commit costs nothing here)
            self.clock[0] += self.step

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
    paced = PacedProposer(Oracle(plain, len(prompt), 3, clock, 1.0, extra), clock=lambda: clock[0])
    out = generate(target, prompt, paced, max_new_tokens=80)
    assert out.token_ids == plain
    assert (paced.rate[PacedProposer.DRAFT] > paced.rate[PacedProposer.PLAIN]) == drafting_wins
    expected = 4 / (1 + extra)  # tokens per unit of drafting rounds, measured exactly on the fake clock
    assert paced.rate[PacedProposer.DRAFT] == pytest.approx(expected) and paced.rate[PacedProposer.PLAIN] == 1.0
    # after the warm-up and 4 tries each, the better arm, with the other retried every 8 rounds
    since_warmup = paced.rounds - paced.warmup
    worse = paced.arm_rounds[PacedProposer.PLAIN if drafting_wins else PacedProposer.DRAFT]
    assert since_warmup > 2 * paced.recheck
    rechecks = since_warmup // paced.recheck - 2 * paced.explore // paced.recheck  # those after the exploration
    assert worse - paced.explore - (0 if drafting_wins else paced.warmup) == rechecks
    # the next prompt keeps the rates (no new exploration), and the time between prompts counts for no arm
    clock[0] += 1000.0
    before = list(paced.arm_rounds)
    assert generate(target, prompt, paced, max_new_tokens=80).token_ids == plain
    assert paced.rate[PacedProposer.DRAFT] == pytest.approx(expected) and paced.rate[PacedProposer.PLAIN] == 1.0
    better = PacedProposer.DRAFT if drafting_wins else PacedProposer.PLAIN
    assert paced.arm_rounds[better] - before[better] >= (paced.rounds - sum(before)) * (1 - 1 / paced.recheck) - 1


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
