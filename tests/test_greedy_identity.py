"""Greedy speculative output is token-identical to the target's own greedy decoding (real SmolLM2, fp32)."""

import inspect
import json.decoder
import textwrap

import pytest
import torch

from hyflash.decoding import generate
from hyflash.proposers import NgramProposer, RandomProposer

MAX_NEW = 24

CHAT = [
    "What is the capital of France?",
    "Write a haiku about autumn leaves.",
    "Explain what a hash table is in two sentences.",
    "List three prime numbers greater than 50.",
    "Translate 'good morning, how are you?' into Spanish.",
    "Write a Python function that reverses a string.",
    "Why is the sky blue?",
    "Give me a recipe for pancakes.",
    "What is 17 times 23? Show your work.",
    "Summarise the plot of Romeo and Juliet.",
    "Repeat the word 'banana' five times, separated by commas.",
    "Write a short story opening about a lighthouse keeper.",
]
PLAIN = [
    "The quick brown fox",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a small village by the sea,",
    "1, 2, 3, 4, 5, 6,",
    "import numpy as np\n\n# compute the mean of an array\n",
    "The theory of relativity states that",
]


def long_prompts(target):
    """Two prompts over 1K tokens from real text on disk (the standard library's own source)."""
    source = inspect.getsource(json.decoder)
    plain = source[:6000]
    chat = "Here is some code:\n\n" + textwrap.dedent(inspect.getsource(inspect.getmembers))[:1500] + \
        "\n\n" + source[:4000] + "\n\nWhat does the function `py_scanstring` do?"
    return [("plain-long", target.encode(plain, chat=False)), ("chat-long", target.encode(chat, chat=True))]


def reference_greedy(target, ids, max_new):
    out = target.model.generate(torch.tensor([ids]), max_new_tokens=max_new, do_sample=False, min_new_tokens=0)
    return out[0, len(ids):].tolist()


@pytest.mark.slow
def test_greedy_is_token_identical(smollm2_fp32):
    target = smollm2_fp32
    cases = [(f"chat-{i}", target.encode(p, chat=True)) for i, p in enumerate(CHAT)]
    cases += [(f"plain-{i}", target.encode(p, chat=False)) for i, p in enumerate(PLAIN)]
    cases += long_prompts(target)
    assert len(cases) >= 20 and max(len(ids) for _, ids in cases) > 1024
    accepted_any = False
    for name, ids in cases:
        ref = reference_greedy(target, ids, MAX_NEW)
        for proposer in (NgramProposer(), RandomProposer(target.vocab_size, seed=len(ids))):
            result = generate(target, ids, proposer, max_new_tokens=MAX_NEW)
            assert result.token_ids == ref, f"{name} with {type(proposer).__name__}"
            accepted_any |= result.stats.acceptance_length > 1.0
    assert accepted_any, "prompt lookup never had a draft accepted: the speculative path was not exercised"


def test_greedy_tree_drafting_with_the_shipped_drafter_is_token_identical(smollm2_fp32):
    """The fast engine verifying trees of candidates from the shipped drafter (hyflash generate's drafter#N)
    gives the target's own greedy tokens, and the tree is exercised (more than one token committed per round)."""
    from hyflash.proposers import load_proposer
    from hyflash.target import Target

    fast = Target.load("smollm2-135m", dtype="fp32", fast=True)
    assert fast.supports_tree
    proposer = load_proposer("auto#12", fast)
    assert proposer.tree == 12
    taus = []
    for text in CHAT[:4] + PLAIN[:2]:
        ids = fast.encode(text, chat=text in CHAT)
        result = generate(fast, ids, proposer, max_new_tokens=MAX_NEW)
        assert result.token_ids == reference_greedy(smollm2_fp32, ids, MAX_NEW), text
        taus.append(result.stats.acceptance_length)
    assert max(taus) > 1.5
