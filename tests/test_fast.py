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
def test_a_prefill_keeps_only_the_last_rows_logits(one_thread, arch):
    """A long prompt's logits are [n, V]: with Gemma's 262K vocabulary 17 GB at 16K tokens. A prefill needs only the
    last row; both paths give it equal to the last row of the full logits, with the same features and cache."""
    for t in both(arch=arch):
        ids = torch.randint(1, 49, (20,), generator=torch.Generator().manual_seed(3))
        full_cache, last_cache = t.new_cache(32), t.new_cache(32)
        full = t.forward(ids, full_cache)
        last = t.forward(ids, last_cache, last_only=True)
        assert last.logits.shape == (1, full.logits.shape[1])
        assert torch.allclose(last.logits[0], full.logits[-1], atol=1e-10, rtol=1e-10)
        assert torch.equal(last.features, full.features)
        assert t.cache_length(last_cache) == t.cache_length(full_cache) == 20
        nxt = torch.tensor([7])
        assert torch.allclose(t.forward(nxt, last_cache).logits, t.forward(nxt, full_cache).logits,
                              atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize("arch", ARCHS)
def test_a_prompt_run_in_chunks_equals_one_pass(one_thread, arch):
    """prompt_forward's chunks (here 7 tokens, past Gemma's 6-token sliding window) give the one-pass logits,
    features and cache, on the transformers path and ours."""
    from hyflash.decoding import prompt_forward

    for t in both(arch=arch):
        ids = torch.randint(1, 49, (23,), generator=torch.Generator().manual_seed(4)).tolist()
        one, chunked = t.new_cache(40), t.new_cache(40)
        logits1, feats1 = prompt_forward(t, ids, one, features=True, chunk=len(ids))
        logits7, feats7 = prompt_forward(t, ids, chunked, features=True, chunk=7)
        assert torch.allclose(logits1, logits7, atol=1e-10, rtol=1e-10) and logits7.shape == (50,)
        assert torch.allclose(feats1, feats7, atol=1e-10, rtol=1e-10) and feats7.shape[0] == 23
        nxt = torch.tensor([5, 9])
        assert torch.allclose(t.forward(nxt, one).logits, t.forward(nxt, chunked).logits, atol=1e-10, rtol=1e-10)


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


# ------------------------------------------------------------------------------------------ tree verification
@pytest.mark.parametrize("arch", ARCHS)  # Gemma 3: the 12-token prompt and the tree pass its 6-token window
def test_tree_forward_sees_each_path_as_a_chain_and_keeps_the_chosen_one(one_thread, arch):
    """Every node of a candidate tree gets the logits and features its own path would get as a chain, and after
    keep_path the cache continues exactly like the chain of the kept path."""
    _, fast = both(seed=3, arch=arch)
    assert fast.supports_tree
    prompt = torch.randint(1, 49, (12,), generator=torch.Generator().manual_seed(5))
    #            node: 1  2  3  4  5  6  7   (0 is the anchor)
    parents = [0, 1, 0, 2, 3, 1, 4]
    tree = torch.tensor([7, 11, 13, 17, 19, 23, 29, 31])  # anchor, then node tokens
    cache = fast.new_cache(64)
    fast.forward(prompt, cache)
    out = fast.forward(tree, cache, parents=parents)

    def path_to(node):
        path = [node]
        while path[-1]:
            path.append(parents[path[-1] - 1])
        return path[::-1]

    for node in range(len(tree)):
        nodes = path_to(node)
        ref = fast.new_cache(64)
        fast.forward(prompt, ref)
        chain = fast.forward(tree[nodes], ref)
        assert torch.allclose(out.logits[node], chain.logits[-1], atol=1e-10, rtol=1e-10)
        assert torch.allclose(out.features[node], chain.features[-1], atol=1e-10, rtol=1e-10)
    kept = path_to(7)  # 0 → 1 → 2 → 4 → 7: not the nodes' storage order
    fast.keep_path(cache, len(prompt), kept)
    ref = fast.new_cache(64)
    fast.forward(torch.cat([prompt, tree[kept]]), ref)
    assert fast.cache_length(cache) == fast.cache_length(ref) == len(prompt) + len(kept)
    nxt = torch.tensor([37, 41])
    assert torch.allclose(fast.forward(nxt, cache).logits, fast.forward(nxt, ref).logits, atol=1e-10, rtol=1e-10)
    with pytest.raises(ValueError):
        fast.forward(tree[:3], fast.new_cache(8), parents=[1, 0])  # a parent after its child
    slow = ARCHS[arch](3, torch.float64)
    with pytest.raises(HyflashError, match="fast=True"):
        slow.forward(tree[:3], slow.new_cache(), parents=[0, 0])  # transformers' path verifies chains only


class OracleTree:
    """Drafts a tree whose second branch holds the true continuation (known from a plain run) and whose first holds
    wrong tokens, with random leaves: the engine must find the right path wherever it sits."""

    needs_features = False
    block_size = 4

    def __init__(self, truth: list[int], prompt_len: int):
        self.truth, self.prompt_len, self.seen = truth, prompt_len, 0
        self.gen = torch.Generator().manual_seed(9)

    def reset(self, prompt_ids):
        self.seen = 0

    def commit(self, token_ids, features):
        self.seen += len(token_ids)

    def draft(self, anchor, max_tokens, sampling):
        from hyflash.decoding import Draft

        done = self.seen - self.prompt_len + 1  # new tokens committed so far, the anchor included
        right = self.truth[done:done + 3]
        if max_tokens < 8 or len(right) < 3:
            return Draft([])
        wrong = [(t + 1) % 49 + 1 for t in right]
        noise = torch.randint(1, 49, (2,), generator=self.gen).tolist()
        # nodes 1-2: a wrong chain; 3-5: the right chain (cut after two when seen is odd); 6-7: noise leaves
        tokens = wrong[:2] + right + noise
        parents = [0, 1, 0, 3, 4, 3, 2]
        if self.seen % 2:
            tokens[4] = wrong[2]
        return Draft(tokens, parents=parents)

    def state_bytes(self):
        return 0


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_tree_generation_is_identical_and_takes_the_right_branch(one_thread, arch):
    seed = {"llama": 1, "gemma3": 2}[arch]  # tiny Gemma 3 with seed 1 ends (EOS) at once; with 2 it writes 23 tokens
    _, fast = both(seed=seed, arch=arch)
    prompt = torch.randint(1, 49, (20,), generator=torch.Generator().manual_seed(2)).tolist()
    plain = generate(fast, prompt, None, max_new_tokens=40)
    tree = generate(fast, prompt, OracleTree(plain.token_ids, len(prompt)), max_new_tokens=40)
    assert tree.token_ids == plain.token_ids
    assert tree.stats.acceptance_length > 2.5  # two or three drafted tokens accepted in most rounds
    # where the target cannot verify a tree (transformers' path, or sampling), the tree's first chain is sent
    slow = ARCHS[arch](seed, torch.float64)
    chain = generate(slow, prompt, OracleTree(plain.token_ids, len(prompt)), max_new_tokens=40)
    assert chain.token_ids == plain.token_ids and chain.stats.acceptance_length < 1.5  # the wrong chain


def test_bitwise_verify_is_claimed_only_where_it_holds():
    """fp32 (differences ~1e-7) and our C++ bf16 forward verify with single-step bits; torch's bf16 path does not
    promise it, and `hyflash generate` then says so."""
    from hyflash import kernels

    t32 = tiny_llama(vocab=50, hidden=32, dtype=torch.float32)
    assert t32.bitwise_verify
    t16 = tiny_llama(vocab=50, hidden=32, dtype=torch.bfloat16)
    assert not t16.bitwise_verify  # the transformers path: no C++ forward
    t16.use_fast_path()
    assert t16.bitwise_verify == (t16.lean.native is not None)
    if kernels.amx() is None:
        assert not t16.bitwise_verify
    # Gemma 3: torch's lean forward, bitwise when every matmul is on our kernels (hidden 32: in_features they take)
    g16 = tiny_gemma3(vocab=50, hidden=32, dtype=torch.bfloat16)
    assert not g16.bitwise_verify
    g16.use_fast_path()
    assert g16.bitwise_verify == (kernels.amx() is not None)
    g64 = tiny_gemma3(vocab=50, hidden=32)
    g64.use_fast_path()
    assert g64.bitwise_verify and not g64.lean.bitwise  # fp64: exact enough without the kernels' property


def test_gemma3_without_our_kernels_does_not_claim_bitwise_verify(monkeypatch):
    from hyflash import kernels

    monkeypatch.setenv("HYFLASH_KERNELS", "0")
    kernels.amx.cache_clear()
    try:
        g16 = tiny_gemma3(vocab=50, hidden=32, dtype=torch.bfloat16)
        g16.use_fast_path()
        assert not g16.lean.bitwise and not g16.bitwise_verify
    finally:
        monkeypatch.undo()
        kernels.amx.cache_clear()
