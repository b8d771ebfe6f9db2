"""The lean forward with a static KV cache computes the same function as the transformers path."""

import pytest
import torch

from conftest import tiny_gemma3, tiny_llama
from hyflash import HyflashError
from hyflash.decoding import SamplingConfig, generate
from hyflash.proposers import NgramProposer, RandomProposer


def _llama(seed, dtype):
    return tiny_llama(vocab=50, hidden=32, seed=seed, dtype=dtype)


def _gemma3(seed, dtype):  # sliding window 6 < the sequences below: windowed and full layers both matter
    return tiny_gemma3(vocab=50, hidden=32, seed=seed, dtype=dtype)


ARCHS = {"llama": _llama, "gemma3": _gemma3}


def both(seed=0, dtype=torch.float64, arch="llama"):
    slow, fast = ARCHS[arch](seed, dtype), ARCHS[arch](seed, dtype)
    fast.use_fast_path()
    return slow, fast


@pytest.mark.parametrize("arch", ARCHS)
def test_logits_and_features_match_through_blocks_and_rollbacks(one_thread, arch):
    slow, fast = both(arch=arch)
    if arch == "gemma3":
        slow.model.model.embed_tokens.weight.data.mul_(0.2)  # keep the scaled embeddings in a tame range
        fast.model.model.embed_tokens.weight.data.mul_(0.2)
    ids = torch.randint(1, 49, (30,), generator=torch.Generator().manual_seed(0))
    cs, cf = slow.new_cache(), fast.new_cache(64)
    if arch == "gemma3":
        cs.activate_past_recording()  # transformers' sliding layers need it before a rollback
    for a, b, keep in [(0, 17, 17), (17, 24, 20), (20, 21, 21), (21, 30, 25)]:  # prefill, blocks, rollbacks
        os_, of = slow.forward(ids[a:b], cs), fast.forward(ids[a:b], cf)
        assert torch.allclose(os_.logits, of.logits, atol=1e-10, rtol=1e-10)
        assert torch.allclose(os_.features, of.features, atol=1e-10, rtol=1e-10)
        slow.rollback(cs, keep)
        fast.rollback(cf, keep)
        assert slow.cache_length(cs) == fast.cache_length(cf) == keep
    assert fast.forward(ids[:2], cf, features=False).features is None
    with pytest.raises(ValueError):
        fast.rollback(cf, 99)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_generation_is_identical_on_the_fast_path(one_thread, temperature, arch):
    slow, fast = both(seed=1, arch=arch)
    prompt = torch.randint(1, 49, (25,), generator=torch.Generator().manual_seed(2)).tolist()
    for make in (lambda: None, lambda: NgramProposer(), lambda: RandomProposer(50, seed=4)):
        kw = dict(max_new_tokens=30, sampling=SamplingConfig(temperature=temperature, seed=7))
        a, b = generate(slow, prompt, make(), **kw), generate(fast, prompt, make(), **kw)
        assert a.token_ids == b.token_ids
        layers, kv_heads, head_dim = (3, 2, 8) if arch == "llama" else (4, 1, 16)
        assert b.stats.target_kv_bytes == (len(prompt) + len(b.token_ids) - 1) * layers * 2 * kv_heads * head_dim * 8


def test_static_cache_capacity_and_unsupported_architectures(one_thread):
    _, fast = both()
    cache = fast.new_cache(5)
    with pytest.raises(ValueError):
        fast.forward(torch.arange(1, 7), cache)
    from transformers import Qwen2Config, Qwen2ForCausalLM
    from hyflash.target import Target

    qwen = Qwen2ForCausalLM(Qwen2Config(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2))
    with pytest.raises(HyflashError, match="Llama and Gemma 3"):
        Target(qwen, None, "tiny-qwen2", feature_layers=[0]).use_fast_path()


@pytest.mark.slow
def test_smollm2_fast_path_greedy_matches_transformers(smollm2_fp32):
    from hyflash.target import Target

    fast = Target.load("smollm2-135m", dtype="fp32", fast=True)
    for prompt in ("Write a short poem about the sea.", "List three prime numbers and explain why they are prime."):
        ids = smollm2_fp32.encode(prompt)
        a = generate(smollm2_fp32, ids, None, max_new_tokens=48)
        b = generate(fast, ids, NgramProposer(), max_new_tokens=48)
        assert a.token_ids == b.token_ids


@pytest.mark.slow
def test_gemma3_270m_fast_path_matches_transformers_beyond_the_sliding_window():
    """The long-context target: logits of a prompt longer than its 512-token sliding window, then greedy decoding
    with prompt lookup, equal to transformers' in fp32."""
    from hyflash.target import Target

    slow = Target.load("gemma3-270m", dtype="fp32")
    fast = Target.load("gemma3-270m", dtype="fp32", fast=True)
    text = " ".join(f"Item {i}: the {['red', 'blue', 'green'][i % 3]} box holds {i * 7 % 50} marbles." for i in range(60))
    ids = slow.encode(text + " Item 60: the", chat=False)
    assert len(ids) > 600
    a = slow.forward(torch.tensor(ids), slow.new_cache())
    b = fast.forward(torch.tensor(ids), fast.new_cache(len(ids) + 64))
    assert torch.allclose(a.logits[-64:], b.logits[-64:], atol=2e-3, rtol=1e-3)
    x = generate(slow, ids, None, max_new_tokens=24)
    y = generate(fast, ids, NgramProposer(), max_new_tokens=24)
    assert x.token_ids == y.token_ids
