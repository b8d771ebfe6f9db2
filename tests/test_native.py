"""Our C++ paths (hyflash.kernels): the Llama forward (fast.LeanLlama) and the drafter's commit and draft
(drafter.state.DrafterState) against the torch code they replace, in bf16 on CPUs with AMX; and the property that makes
bf16 speculative decoding exact on them: a token's result does not depend on how many tokens are verified together.
Each test runs once per build this CPU can run (tests/conftest.py ``each_build``), and every build but AMX is
compared with reference bits computed by the AVX-512 BF16 build (tests/fixtures/kernel_bits.safetensors)."""

from pathlib import Path

import pytest
import torch

from conftest import tiny_gemma3, tiny_llama
from hyflash import HyflashError, kernels
from hyflash.decoding import generate
from hyflash.drafter.attention import rope_tables
from hyflash.drafter.config import DrafterConfig
from hyflash.drafter.model import new_drafter
from hyflash.drafter.state import DrafterState
from hyflash.proposers import HyFlashProposer, NgramProposer

pytestmark = [pytest.mark.skipif(kernels.amx() is None, reason="no C++ kernels on this machine"),
              pytest.mark.usefixtures("each_build")]  # every test once per build the CPU runs


def bf16_llama(seed=0):
    """hidden 128 over 4 heads: head_dim 32, the smallest geometry the C++ forward takes"""
    target = tiny_llama(vocab=64, hidden=128, layers=2, seed=seed, dtype=torch.bfloat16)
    target.use_fast_path()
    assert target.lean.native is not None
    return target


def _close(a, b, tol=0.05):
    a, b = a.float(), b.float()
    return (a - b).abs().max() <= tol * b.abs().max()


def test_native_forward_matches_the_torch_lean_forward():
    target = bf16_llama()
    lean = target.lean
    prompt = torch.randint(1, 63, (20,), generator=torch.Generator().manual_seed(0))
    steps = [torch.tensor([5]), torch.tensor([7, 8, 9, 10]), torch.tensor([11, 12, 13, 14, 15])]
    parents = [None, None, [0, 0, 1, 1]]
    runs = {}
    for native in (True, False):
        saved = lean.native
        lean.native = saved if native else None
        try:
            cache = target.new_cache(64)
            target.forward(prompt, cache)  # 20 tokens: the torch path either way
            outs = [target.forward(ids, cache, parents=p) for ids, p in zip(steps, parents)]
            runs[native] = (outs, cache.k[1][0, :, : cache.length].clone())
        finally:
            lean.native = saved
    for a, b in zip(runs[True][0], runs[False][0]):
        assert _close(a.logits, b.logits) and _close(a.features, b.features)
        assert (a.logits.argmax(-1) == b.logits.argmax(-1)).float().mean() >= 0.8
    assert _close(runs[True][1], runs[False][1])


def _block_gets_single_step_bits(target, cache, start: int, block: list[int]) -> None:
    """After ``start`` cached tokens: ``block`` in one forward gives the logits, features and cached keys of its
    tokens run one at a time, bit for bit."""
    together = target.forward(torch.tensor(block), cache)
    k_together = [k[0, :, start:start + len(block)].clone() for k in cache.k]
    target.rollback(cache, start)
    one_by_one = [target.forward(torch.tensor([t]), cache) for t in block]
    assert torch.equal(together.logits, torch.cat([o.logits for o in one_by_one]))
    assert torch.equal(together.features, torch.cat([o.features for o in one_by_one]))
    assert all(torch.equal(a, k[0, :, start:start + len(block)]) for a, k in zip(k_together, cache.k))


@pytest.mark.parametrize("start", [19, 126])  # 126: the new tokens straddle a chunk of the C++ attention (64 keys)
def test_native_forward_gives_each_token_the_bits_of_a_single_token_step(start):
    target = bf16_llama(seed=1)
    prompt = torch.randint(1, 63, (start,), generator=torch.Generator().manual_seed(1))
    cache = target.new_cache(160)
    target.forward(prompt, cache)
    _block_gets_single_step_bits(target, cache, start, [3, 14, 15, 9, 26, 5])
    # trees: each node's logits are its path's, run as a chain — also when slots are not in depth order (the
    # second tree's have depths 0, 1, 2, 1, 3) and when a node's slot and position fall in different chunks (the
    # third's node 2, at slot 128 and position 127)
    for parents, path in (([0, 0, 1, 1], [0, 1, 4]), ([0, 1, 0, 2], [0, 1, 2, 4]), ([0, 0, 2], [0, 2, 3])):
        nodes = [3, 14, 40, 15, 41][: len(parents) + 1]
        target.rollback(cache, start)
        tree = target.forward(torch.tensor(nodes), cache, parents=parents)
        target.rollback(cache, start)
        chain = target.forward(torch.tensor([nodes[i] for i in path]), cache)
        assert torch.equal(tree.logits[path], chain.logits)
        target.rollback(cache, start)
        steps = [target.forward(torch.tensor([nodes[i]]), cache).logits for i in path]
        assert torch.equal(tree.logits[path], torch.cat(steps))


@pytest.mark.parametrize("window", [0, 3, 75])  # 0: none (Llama); 3: shorter than a path; 75: at start 200 the
# rows' windows begin on both sides of a chunk edge (positions 126-131)
@pytest.mark.parametrize("start", [5, 126, 200])
@pytest.mark.parametrize("geometry", [(9, 3, 64), (4, 1, 256)])
def test_native_attention_gives_a_token_the_same_fp32_bits_alone_in_a_chain_and_in_a_tree(start, window, geometry):
    """The C++ attention before its bf16 rounding (where a different summation would show): SmolLM2's geometry
    (9 query heads over 3 kv heads of 64) and Gemma 3's (4 over 1 of 256), keys chunked by position, trees whose slots
    and positions fall in different chunks; also in a sliding window (Gemma 3's local layers: a token at position p
    sees p - window + 1 .. p), where a row alone skips chunks a block computes. A token alone fills at most 4 of a
    block's 16 query rows, a chain of 6 more than 16, which the AVX2 build computes in different loops (8 keys on
    half the rows, or 4 keys on all 16): each must give the other's bits."""
    amx = kernels.amx()
    g = torch.Generator().manual_seed(start)
    (H, Hkv, hd), cap = geometry, 240
    k = torch.randn(Hkv, cap, hd, generator=g).to(torch.bfloat16)
    v = torch.randn(Hkv, cap, hd, generator=g).to(torch.bfloat16)
    nodes_q = torch.randn(6, H * hd, generator=g).mul(2).to(torch.bfloat16)
    nodes_k = torch.randn(6, Hkv, hd, generator=g).to(torch.bfloat16)
    nodes_v = torch.randn(6, Hkv, hd, generator=g).to(torch.bfloat16)

    def attend(slots, parents):  # the nodes `slots` placed at start.. as a tree (parents) or a chain (None)
        kk, vv = k.clone(), v.clone()
        for i, s_ in enumerate(slots):
            kk[:, start + i], vv[:, start + i] = nodes_k[s_], nodes_v[s_]
        n = len(slots)
        sees = torch.ones(n, n, dtype=torch.bool).tril() if parents is None else \
            __import__("hyflash.fast", fromlist=["tree_mask"]).tree_mask(parents, start)[1]
        return amx.llama_attention(nodes_q[slots].contiguous(), kk, vv, start, sees.contiguous(), H, hd ** -0.5,
                                   window)

    for parents, path in (([0, 0, 1, 1], [0, 1, 4]), ([0, 1, 0, 2], [0, 1, 2, 4]), ([0, 0, 2], [0, 2, 3]),
                          ([0, 1, 2, 3, 4], [0, 1, 2, 3, 4, 5])):
        tree = attend(list(range(len(parents) + 1)), parents)
        chain = attend(path, None)
        assert torch.equal(tree[path], chain)
        for depth in range(len(path)):  # each path node alone after its committed ancestors
            alone = attend(path[: depth + 1], None)[depth]
            assert torch.equal(chain[depth], alone)
    # and the values are attention's
    out = attend([0, 1, 2], None)
    kk, vv = k.clone().float(), v.clone().float()
    for i in range(3):
        kk[:, start + i], vv[:, start + i] = nodes_k[i].float(), nodes_v[i].float()
    q = nodes_q[:3].float().view(3, H, hd).transpose(0, 1)
    pos, key = torch.arange(start, start + 3)[:, None], torch.arange(start + 3)[None, :]
    visible = (key <= pos) & ((key > pos - window) if window else True)
    ref = torch.nn.functional.scaled_dot_product_attention(
        q, kk[:, : start + 3].repeat_interleave(H // Hkv, 0), vv[:, : start + 3].repeat_interleave(H // Hkv, 0),
        attn_mask=visible, scale=hd ** -0.5)
    assert torch.allclose(out.view(3, H, hd).transpose(0, 1), ref, atol=1e-4, rtol=1e-3)


def test_native_forward_returns_each_rows_argmax_and_checks_the_tree():
    target = bf16_llama(seed=4)
    cache = target.new_cache(64)
    target.forward(torch.randint(1, 63, (10,), generator=torch.Generator().manual_seed(4)), cache)
    for ids, parents in ((torch.tensor([5]), None), (torch.tensor([7, 8, 9]), None),
                         (torch.tensor([3, 14, 40, 15]), [0, 0, 2])):
        out = target.forward(ids, cache, parents=parents)
        assert out.top is not None and torch.equal(out.top, out.logits.max(-1).indices)
        target.rollback(cache, 10)
    with pytest.raises(RuntimeError, match="parent"):
        target.lean.forward(torch.tensor([1, 2, 3]), cache, None, parents=[0, 2])


def _bf16_drafter(target, variant="hyflash", window=6, pack=True, **kw):
    torch.manual_seed(0)
    cfg = DrafterConfig(variant=variant, num_layers=2, block_size=4, window=window, hidden_size=128, num_heads=4,
                        num_kv_heads=2, head_dim=32, intermediate_size=256, memory_heads=2, memory_head_dim=16,
                        memory_state_dim=16, vocab_size=64, target_hidden_size=128, target_layers=[0, 1], **kw)
    drafter = new_drafter(cfg, target, dtype=torch.bfloat16).eval()
    with torch.no_grad():  # livelier than the zero-initialised defaults, so every branch matters
        for p in drafter.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    if pack:
        drafter.pack_for_inference()
    return drafter


@pytest.mark.parametrize("variant", ["hyflash", "swa", "hyflash-floor", "hyflash-slots"])
def test_native_drafter_commits_and_drafts_as_the_torch_state(variant):
    """floor: memory_long_heads; slots: slot_embeddings (each mask slot its own input)."""
    target = bf16_llama(seed=2)
    extra = {"hyflash-floor": dict(memory_long_heads=1, memory_min_half_life=4.0),
             "hyflash-slots": dict(slot_embeddings=True)}.get(variant, {})
    drafter = _bf16_drafter(target, variant.split("-")[0], **extra)
    ids = torch.randint(1, 63, (40,), generator=torch.Generator().manual_seed(2))
    feats = target.forward(ids, target.new_cache(64)).features
    states = {}
    for native in (True, False):
        state = DrafterState(drafter)
        assert state.native is not None
        if not native:
            state.native = None
        state.commit(feats[:10])  # > 16 rows would take the torch path; 10 and then blocks of 3: the C++ one
        logits = []
        for i in range(10, 40, 3):  # the window of 6 wraps several times
            state.commit(feats[i:i + 3])
            logits.append(state.draft_logits(int(ids[i])))
            logits.append(state.draft_logits(int(ids[i]), slots=2))  # the block's first 2 slots alone
        states[native] = (state, logits)
    (a, la), (b, lb) = states[True], states[False]
    assert a.n == b.n == 40
    for x, y in zip(la, lb):
        assert _close(x, y)
    block = drafter.config.block_size
    assert [x.shape[0] for x in la[:2]] == [block, 2]
    # the first 2 slots alone attend to fewer slots than in the whole block, so their guesses differ from its
    # first 2 rows
    assert not torch.equal(la[1], la[0][:2])
    with pytest.raises(HyflashError, match="slots must be 1"):
        a.draft_logits(1, slots=block + 1)
    for x, y in zip(a.memories, b.memories):
        assert _close(x, y, 1e-2)
    for wa, wb in zip(a.windows, b.windows):
        assert _close(wa.k, wb.k) and _close(wa.v, wb.v)


def test_bf16_speculative_greedy_output_equals_plain_decoding_on_the_native_path():
    target = bf16_llama(seed=3)
    drafter = _bf16_drafter(target, window=8)
    prompt = torch.randint(1, 63, (12,), generator=torch.Generator().manual_seed(3)).tolist()
    plain = generate(target, prompt, None, max_new_tokens=40).token_ids
    for proposer in (HyFlashProposer(drafter), HyFlashProposer(drafter, tree=6), NgramProposer(block_size=5)):
        assert generate(target, prompt, proposer, max_new_tokens=40).token_ids == plain


def bf16_gemma3(seed=0, window=6):
    """Every matmul in_features a multiple of 32 (our kernels' smallest), sliding layers (window 6) and full ones."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(seed)
    cfg = Gemma3TextConfig(vocab_size=64, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                           num_attention_heads=2, num_key_value_heads=1, head_dim=64, sliding_window=window,
                           layer_types=["sliding_attention", "full_attention"] * 2, max_position_embeddings=1024,
                           eos_token_id=63, bos_token_id=2, pad_token_id=0)
    model = Gemma3ForCausalLM(cfg).to(torch.bfloat16)
    with torch.no_grad():
        model.model.embed_tokens.weight.mul_(0.2)  # keep the scaled embeddings in a tame range
    from hyflash.target import Target

    target = Target(model, None, "tiny-gemma3-bf16", feature_layers=[0, 1])
    target.use_fast_path()
    assert target.lean.bitwise and target.bitwise_verify and target.supports_tree
    return target


def test_gemma_norm_is_the_torch_formula_row_by_row():
    """Gemma 3's RMSNorm in C++ (what LeanGemma3 calls where our kernels load): within a bf16 rounding of the torch
    formula it replaces, a row's bits the same alone and among others, and a strided view (q/k heads of a qkv row)
    normalised as its copy is."""
    amx = kernels.amx()
    g = torch.Generator().manual_seed(0)
    for d in (16, 256, 640):
        x = torch.randn(37, d, generator=g).mul(3).to(torch.bfloat16)
        w1 = 1.0 + torch.randn(d, generator=g).mul(0.1)
        got = amx.gemma_norm(x, w1, 1e-6)
        xf = x.float()
        want = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6) * w1
        assert got.dtype == torch.bfloat16 and got.shape == x.shape
        assert ((got.float() - want).abs() <= want.abs() * 2 ** -7 + 1e-6).all()  # one bf16 rounding (and a bit)
        for i in (0, 5, 36):
            assert torch.equal(amx.gemma_norm(x[i:i + 1], w1, 1e-6), got[i:i + 1])
    qkv = torch.randn(3, 6 * 64, generator=g).to(torch.bfloat16)  # 4 query heads, 1 key, 1 value head of 64
    w1 = 1.0 + torch.randn(64, generator=g).mul(0.1)
    heads = qkv[:, : 4 * 64].view(3, 4, 64)
    assert torch.equal(amx.gemma_norm(heads, w1, 1e-6), amx.gemma_norm(heads.contiguous(), w1, 1e-6))
    with pytest.raises(RuntimeError, match="multiple of 16"):
        amx.gemma_norm(torch.zeros(2, 24, dtype=torch.bfloat16), torch.ones(24), 1e-6)


def test_gemma_qk_gives_the_bits_of_the_norms_then_rope():
    """gemma_qk (a layer's query and key heads normalised and rotated in one call) equals gemma_norm of each head
    followed by the torch rotation LeanLlama._rotate, bit for bit, for a step, a verify and a prompt's rows."""
    from hyflash.fast import LeanLlama

    amx = kernels.amx()
    g = torch.Generator().manual_seed(0)
    for H, Hkv, hd, n in ((4, 1, 256, 1), (4, 1, 256, 7), (2, 1, 64, 300), (9, 3, 64, 5)):
        qkv = torch.randn(n, (H + 2 * Hkv) * hd, generator=g).mul(2).to(torch.bfloat16)
        qw, kw = 1 + torch.randn(hd, generator=g) * 0.1, 1 + torch.randn(hd, generator=g) * 0.1
        half = rope_tables(torch.arange(100, 100 + n), hd, 10000.0, torch.float32)  # [n, hd / 2] each
        cos, sin = (torch.cat([t, t], dim=-1).to(torch.bfloat16) for t in half)  # [n, hd]: LeanGemma3._rope's layout
        q, k = amx.gemma_qk(qkv, H, Hkv, qw, kw, cos.contiguous(), sin.contiguous(), 1e-6)
        want_q = amx.gemma_norm(qkv[:, : H * hd].view(n, H, hd), qw, 1e-6).transpose(0, 1)
        want_k = amx.gemma_norm(qkv[:, H * hd:(H + Hkv) * hd].view(n, Hkv, hd), kw, 1e-6).transpose(0, 1)
        want_q, want_k = (LeanLlama._rotate(x, cos[None], sin[None]) for x in (want_q, want_k))
        assert torch.equal(q.view(n, H, hd).transpose(0, 1), want_q)
        assert torch.equal(k.transpose(0, 1), want_k)


# 4: inside the 6-token window; 19: sliding layers drop keys; 300 and 600: long enough for SDPA over several queries
# at once to round differently from one query at a time (600 fails when the block attends all at once; at the
# shorter starts the two happen to round alike)
def test_gemma3_cpp_attention_computes_the_torch_lean_forward():
    """Gemma 3's bitwise forward (the C++ attention, windows included) against the same forward with SDPA, all
    queries at once under masks: bf16 values close, the same argmax almost everywhere."""
    target = bf16_gemma3(seed=2)
    lean = target.lean
    assert lean.cpp_attention is not None
    prompt = torch.randint(1, 63, (40,), generator=torch.Generator().manual_seed(0))
    steps = [torch.tensor([5]), torch.tensor([7, 8, 9, 10]), torch.tensor([11, 12, 13, 14, 15, 16, 17, 18])]
    runs = {}
    for bitwise in (True, False):
        lean.bitwise = bitwise
        try:
            cache = target.new_cache(64)
            target.forward(prompt, cache)  # 40 tokens: SDPA either way
            runs[bitwise] = [target.forward(ids, cache) for ids in steps]
        finally:
            lean.bitwise = True
    for a, b in zip(runs[True], runs[False]):
        assert _close(a.logits, b.logits) and _close(a.features, b.features)
        assert (a.logits.argmax(-1) == b.logits.argmax(-1)).float().mean() >= 0.8


@pytest.mark.parametrize("cpp", [True, False])  # False: each token attends alone through SDPA (other geometries)
@pytest.mark.parametrize("start", [4, 19, 300, 600])
def test_gemma3_forward_gives_each_token_the_bits_of_a_single_token_step(start, cpp):
    """Gemma 3 runs the torch lean forward, its matmuls on our kernels and its attention in C++ (sliding windows
    included): a block, and each node of a tree, get the bits (logits, features, cached keys) of single-token steps
    along its path."""
    target = bf16_gemma3(seed=1)
    if not cpp:
        target.lean.cpp_attention = None
    prompt = torch.randint(1, 63, (start,), generator=torch.Generator().manual_seed(1))
    cache = target.new_cache(start + 16)
    target.forward(prompt, cache)
    # 8 tokens: the last ones' windows start inside the block
    _block_gets_single_step_bits(target, cache, start, [3, 14, 15, 9, 26, 5, 35, 8])
    # trees, also with slots out of depth order (the second's depths are 0, 1, 2, 1, 3) and a path of 7 nodes whose
    # deepest sees fewer than all of them in a sliding layer (the third)
    for parents, path in (([0, 0, 1, 1], [0, 1, 4]), ([0, 1, 0, 2], [0, 1, 2, 4]),
                          ([0, 0, 1, 3, 4, 5, 6], [0, 1, 3, 4, 5, 6, 7])):
        nodes = [3, 14, 40, 15, 41, 9, 26, 5][: len(parents) + 1]
        target.rollback(cache, start)
        tree = target.forward(torch.tensor(nodes), cache, parents=parents)
        target.rollback(cache, start)
        steps = [target.forward(torch.tensor([nodes[i]]), cache).logits for i in path]
        assert torch.equal(tree.logits[path], torch.cat(steps))
        target.rollback(cache, start)
        target.forward(torch.tensor(nodes), cache, parents=parents)
        target.keep_path(cache, start, path)  # the kept path: the next step sees what single steps wrote
        after = target.forward(torch.tensor([7]), cache).logits
        target.rollback(cache, start)
        for i in path:
            target.forward(torch.tensor([nodes[i]]), cache)
        assert torch.equal(after, target.forward(torch.tensor([7]), cache).logits)


@pytest.mark.parametrize("cpp", [True, False])  # False: each token attends alone through SDPA
def test_gemma3_windowed_cache_gives_the_bits_of_the_whole_history(cpp):
    """Sliding layers keep only what their window can still see (``StaticCache``: buffers of window + a key chunk +
    slack, slid down by whole chunks, grown for a long forward): a chunked prefill, then steps, chains and trees with
    kept paths and rollbacks give the logits and features of a cache that keeps every position, bit for bit."""
    from hyflash.decoding import prompt_forward

    target = bf16_gemma3(seed=5)
    if not cpp:
        target.lean.cpp_attention = None
    cap = 700
    whole, windowed = target.lean.new_cache(cap, windowed=False), target.lean.new_cache(cap, slack=8)
    assert not any(whole.windowed) and windowed.windowed == [True, False, True, False]
    assert windowed.k[0].shape[2] == 128  # 5 + 64 + 8 rounded up to a chunk
    g = torch.Generator().manual_seed(5)
    prompt = torch.randint(1, 63, (300,), generator=g).tolist()
    first = [prompt_forward(target, prompt, c, True, chunk=200) for c in (whole, windowed)]  # 200 > 128: grown
    assert torch.equal(first[0][0], first[1][0]) and torch.equal(first[0][1], first[1][1])
    # the 200-token chunk grew the buffers to 256; for the last 100 they held (200 - 5) // 64 * 64 on in 128, and
    # after the prefill (300 - 5) // 64 * 64 on
    assert windowed.k[0].shape[2] == 128 and windowed.base == 256
    grown = target.lean.new_cache(cap, slack=8)
    target.forward(torch.tensor(prompt[:200]), grown)
    assert grown.k[0].shape[2] == 256 and grown.k[1].shape[2] == cap
    bases, slots, rounds = {windowed.base}, set(), 0
    while whole.length < cap - 16:
        n = int(torch.randint(1, 9, (1,), generator=g))
        ids, start = torch.randint(1, 63, (n,), generator=g), whole.length
        parents = [int(torch.randint(0, i, (1,), generator=g)) for i in range(1, n)] if n > 2 and rounds % 3 else None
        a, b = (target.forward(ids, c, parents=parents) for c in (whole, windowed))
        assert torch.equal(a.logits, b.logits) and torch.equal(a.features, b.features), (rounds, start, n)
        if parents:  # keep the path to a random node
            node, path = int(torch.randint(0, n, (1,), generator=g)), []
            while node:
                path.append(node)
                node = parents[node - 1]
            for c in (whole, windowed):
                target.keep_path(c, start, [0] + path[::-1])
        else:
            keep = int(torch.randint(1, n + 1, (1,), generator=g))
            for c in (whole, windowed):
                target.rollback(c, start + keep)
        bases.add(windowed.base)
        slots.add(windowed.k[0].shape[2])
        rounds += 1
    assert len(bases) >= 5 and all(b % 64 == 0 for b in bases)  # slid down several times, by whole chunks
    assert slots == {128} and windowed.k[1].shape[2] == cap
    assert not any(k.is_inference() for k in windowed.k)  # buffers resized in a forward stay ordinary tensors
    assert windowed.allocated_bytes() < 0.7 * whole.allocated_bytes()
    assert windowed.nbytes() < whole.nbytes() == 2 * 4 * 64 * 2 * whole.length
    with pytest.raises(ValueError, match="no longer hold"):  # its window's keys are gone
        target.rollback(windowed, windowed.base + 4)
    target.rollback(windowed, windowed.base + 5)  # the oldest key position base + 5 sees is base
    target.rollback(whole, windowed.length)
    a, b = (target.forward(torch.tensor([9]), c) for c in (whole, windowed))
    assert torch.equal(a.logits, b.logits)
    target.rollback(windowed, 0)  # empty again: from the start
    assert windowed.base == 0
    again = prompt_forward(target, prompt, windowed, True, chunk=200)
    assert torch.equal(again[0], first[0][0])


def test_gemma3_bf16_speculative_greedy_output_equals_plain_decoding():
    target = bf16_gemma3(seed=3)
    drafter = _bf16_drafter(target, window=8)
    prompt = torch.randint(1, 63, (12,), generator=torch.Generator().manual_seed(3)).tolist()
    plain = generate(target, prompt, None, max_new_tokens=40).token_ids
    for proposer in (HyFlashProposer(drafter), HyFlashProposer(drafter, tree=6), NgramProposer(block_size=5)):
        assert generate(target, prompt, proposer, max_new_tokens=40).token_ids == plain


@pytest.mark.slow
def test_smollm2_bf16_speculative_output_is_token_identical_to_plain():
    from hyflash.data.sources import SOURCES
    from hyflash.proposers import load_proposer
    from hyflash.target import Target

    target = Target.load("smollm2-135m", dtype="bf16", fast=True)
    assert target.lean.native is not None
    prompts = [target.encode(q["turns"][0]) for q in list(SOURCES["mtbench"].read())[:3]]
    drafters = [load_proposer(spec, target) for spec in ("auto", "auto#0", "ngram+auto")]
    for ids in prompts:
        plain = generate(target, ids, None, max_new_tokens=64).token_ids
        for proposer in drafters:
            assert generate(target, ids, proposer, max_new_tokens=64).token_ids == plain


@pytest.mark.slow
def test_gemma3_270m_bf16_prompt_lookup_output_is_token_identical_to_plain():
    """The long-context target in bf16: with its verify attending all at once these two prompts left plain decoding's
    text at tokens 2 and 25 (benchmarks/check_identity.py, AVX-512 BF16 build, 2026-12-01)."""
    from hyflash.target import Target

    target = Target.load("gemma3-270m", dtype="bf16", fast=True)
    assert target.bitwise_verify and target.supports_tree
    taus = []
    for prompt in ("Describe how a bicycle works.", "Write a Python function that reverses a string."):
        ids = target.encode(prompt)
        plain = generate(target, ids, None, max_new_tokens=64).token_ids
        spec = generate(target, ids, NgramProposer(), max_new_tokens=64)
        assert spec.token_ids == plain, prompt
        taus.append(spec.stats.acceptance_length)
    assert max(taus) > 1.5  # drafts were accepted: many-token verifies were exercised


def test_native_keep_path_moves_the_same_entries_as_the_torch_gather():
    from hyflash.fast import StaticCache

    caches = [StaticCache(3, 2, 32, 40, torch.bfloat16) for _ in range(2)]
    g = torch.Generator().manual_seed(4)
    for i, buf in enumerate(caches[0].k + caches[0].v):
        buf.copy_(torch.randn(buf.shape, generator=g))
        (caches[1].k + caches[1].v)[i].copy_(buf)
    caches[1].native = False
    assert caches[0].native
    for c in caches:
        c.length = 20
        c.keep_path(10, [0, 2, 3, 7, 9])
    assert caches[0].length == caches[1].length == 15
    assert all(torch.equal(a, b) for a, b in zip(caches[0].k + caches[0].v, caches[1].k + caches[1].v))


def test_top_probs_are_softmax_topk():
    g = torch.Generator().manual_seed(5)
    logits = (torch.randn(7, 8192, generator=g) * 3).to(torch.bfloat16)
    logits[2, 10] = logits[2, 20] = logits[2].max() + 1  # a tie: the lower index first
    probs, index = kernels.amx().top_probs(logits, 3)
    ref = logits.float().softmax(-1)
    assert torch.equal(index[2, :2], torch.tensor([10, 20]))
    assert torch.equal(ref.gather(-1, index), ref.gather(-1, ref.topk(3, dim=-1).indices))  # the same 3 values
    assert torch.allclose(probs, ref.gather(-1, index), rtol=1e-5, atol=1e-7)
    assert (probs[:, :-1] >= probs[:, 1:]).all()
    probs32, index32 = kernels.amx().top_probs(logits.float(), 3)
    assert torch.equal(index32, index) and torch.equal(probs32, probs)


def test_int8_drafter_weights_draft_like_bf16_and_generation_stays_exact():
    from hyflash.proposers import DEFAULT_WEIGHTS, load_proposer, split_spec

    target = bf16_llama(seed=6)
    drafter = _bf16_drafter(target, window=8)
    ids = torch.randint(1, 63, (30,), generator=torch.Generator().manual_seed(6))
    feats = target.forward(ids, target.new_cache(64)).features
    logits = {}
    for weights in ("bf16", "int8", "bf16"):  # one drafter, repacked when the kind changes
        prop = HyFlashProposer(drafter, weights=weights)
        prop.reset(ids.tolist())
        prop.commit(None, feats[:12])
        prop.commit(None, feats[12:15])
        kinds = {lin.amx.dtype for lin in (drafter._packed_head,)}
        assert kinds == {torch.int8 if weights == "int8" else torch.bfloat16}
        logits.setdefault(weights, []).append(prop.state.draft_logits(int(ids[14])))
    assert torch.equal(logits["bf16"][0], logits["bf16"][1])
    assert _close(logits["int8"][0], logits["bf16"][0]) and not torch.equal(logits["int8"][0], logits["bf16"][0])
    prompt = ids[:12].tolist()
    plain = generate(target, prompt, None, max_new_tokens=30).token_ids
    for tree in (0, 4):
        assert generate(target, prompt, HyFlashProposer(drafter, tree=tree, weights="int8"),
                        max_new_tokens=30).token_ids == plain
    assert DEFAULT_WEIGHTS == "int8" and split_spec("auto#4")[2] == 4
    with pytest.raises(Exception, match="weights"):
        HyFlashProposer(drafter, weights="int4")


def test_lookup_then_drafter_grafts_weak_matches_onto_the_tree_and_stays_exact():
    from hyflash.proposers import LookupThenDrafter

    target = bf16_llama(seed=7)
    drafter = _bf16_drafter(target, window=8)
    g = torch.Generator().manual_seed(7)
    phrase = torch.randint(1, 63, (6,), generator=g).tolist()
    prompt = phrase * 2 + torch.randint(1, 63, (10,), generator=g).tolist()
    plain = generate(target, prompt, None, max_new_tokens=40).token_ids
    for weights in ("int8", "bf16"):
        combo = LookupThenDrafter(HyFlashProposer(drafter, tree=4, weights=weights), min_match=3, graft=3)
        assert generate(target, prompt, combo, max_new_tokens=40).token_ids == plain
        assert combo.graft_rounds > 0


REFERENCE = Path(__file__).parent / "fixtures" / "kernel_bits.safetensors"


def reference_outputs(target, drafter) -> dict[str, torch.Tensor]:
    """What the reference-bits test compares: the forward's logits and features (a chain and a tree), the drafter's
    draft logits after two commits and their top probabilities, and bf16 and int8 matmuls of 13 rows."""
    cache = target.new_cache(160)
    prompt = torch.arange(70) * 7 % 61 + 1  # inputs from integer arithmetic: the same on every CPU
    for start in range(0, 70, 14):  # 14 tokens a forward: more would go through torch's matmuls, not ours
        target.forward(prompt[start:start + 14], cache)
    chain = target.forward(torch.tensor([3, 14, 15, 9]), cache)
    tree = target.forward(torch.tensor([5, 6, 7, 8, 9]), cache, parents=[0, 0, 1, 1])
    state = DrafterState(drafter)
    state.commit(chain.features)
    state.commit(tree.features[:3])
    draft = state.draft_logits(7)
    amx = kernels.amx()
    w, x = drafter.head_weight[:, :96].contiguous(), target.model.model.embed_tokens.weight[:13, :96].contiguous()
    probs, index = amx.top_probs(draft, 3)
    return {"chain_logits": chain.logits, "chain_features": chain.features, "tree_logits": tree.logits,
            "draft_logits": draft, "top_probs": probs, "top_index": index, "linear_bf16": amx.linear(x, amx.pack(w)),
            "linear_int8": amx.linear(x, amx.pack_q8(w))}


def reference_models(weights: dict[str, torch.Tensor] | None = None):
    """The tiny bf16 target and drafter of the reference-bits test, with ``weights`` (the fixture's) or freshly
    initialised → (target, drafter, their weights as the fixture stores them)."""
    def part(prefix):  # the fixture's entries under "prefix." with that prefix removed
        return {k[len(prefix) + 1:]: v for k, v in weights.items() if k.startswith(prefix + ".")}

    target = tiny_llama(vocab=64, hidden=128, layers=2, seed=4, dtype=torch.bfloat16)
    if weights is not None:
        target.model.load_state_dict(part("target"))
    target.use_fast_path()
    drafter = _bf16_drafter(target, pack=False)
    if weights is not None:
        drafter.load_state_dict(part("drafter"))
    stored = {f"{name}.{k}": v.detach().clone().contiguous() for name, module in (("target", target.model),
              ("drafter", drafter)) for k, v in module.state_dict().items()}
    # The RoPE tables are inputs too: torch's own cos and sin (vectorised per CPU) may differ in the last bit from
    # one kind of CPU to another, and the kernels' bits are what is compared.
    if weights is None:
        target.lean._rope_table(160)
        drafter._rope_table = rope_tables(torch.arange(160), drafter.config.head_dim, drafter.config.rope_theta,
                                          torch.bfloat16)
    else:
        target.lean._rope_cache = (weights["rope.target.cos"], weights["rope.target.sin"])
        drafter._rope_table = (weights["rope.drafter.cos"], weights["rope.drafter.sin"])
    for name, (cos, sin) in (("target", target.lean._rope_cache), ("drafter", drafter._rope_table)):
        stored |= {f"rope.{name}.cos": cos.contiguous(), f"rope.{name}.sin": sin.contiguous()}
    drafter.pack_for_inference()
    return target, drafter, stored


def test_every_build_gives_the_reference_bits(each_build):
    """The fixture (tests/fixtures/make_kernel_bits.py) holds a tiny target's and drafter's weights and what the
    AVX-512 BF16 build computes from them, whose exactness the other tests establish. The AVX2 build (pair products
    as two FMAs, the odd one first, as VDPBF16PS is specified; the same reduction trees) and the NEON build (the
    AVX2 build's operations on 128-bit registers) must give the same bits, so each of them is checked against it on
    whatever CPU runs the tests, Arm included. (The AMX build accumulates its tiles in its own order.)"""
    if each_build == "amx":
        pytest.skip("the AMX build is checked against itself, not against the reference")
    from safetensors.torch import load_file

    fixture = load_file(REFERENCE)
    target, drafter, _ = reference_models({k: v for k, v in fixture.items() if not k.startswith("out.")})
    got = reference_outputs(target, drafter)
    for name, value in got.items():
        assert torch.equal(value, fixture["out." + name]), name
