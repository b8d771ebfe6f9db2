"""The HyFlash drafter: training forward == streaming runtime, bounded state, lossless decoding, checkpoints."""

import json

import pytest
import torch

from conftest import tiny_llama
from hyflash import HyflashError
from hyflash.decoding import SamplingConfig, generate
from hyflash.drafter import memory as mem
from hyflash.drafter.config import DrafterConfig
from hyflash.drafter.model import HyFlashDrafter, from_pretrained, new_drafter, save_pretrained
from hyflash.drafter.state import DrafterState
from hyflash.proposers import HyFlashProposer, load_proposer

TINY = dict(num_layers=2, block_size=4, window=6, hidden_size=32, num_heads=4, num_kv_heads=2, head_dim=8,
            intermediate_size=48, memory_heads=2, memory_head_dim=8, memory_state_dim=8, vocab_size=50,
            target_hidden_size=16, target_layers=[0, 1, 2])

VARIANTS = [
    dict(variant="hyflash", memory="mamba2"),
    dict(variant="hyflash", memory="gdn"),
    dict(variant="full"),
    dict(variant="swa"),
    dict(variant="hyflash", memory="mamba2", memory_limit=5),
    dict(variant="hyflash", memory="gdn", memory_limit=5),
    dict(variant="hyflash", memory="mamba2", slot_attention=False),
    dict(variant="hyflash", memory="gdn", num_layers=1),
    dict(variant="hyflash", memory="mamba2", num_layers=3),
    dict(variant="hyflash", memory="mamba2", draft_vocab_size=20),
    dict(variant="hyflash", memory="mamba2", memory_long_heads=1, memory_min_half_life=100.0),
    dict(variant="hyflash", memory="gdn", memory_long_heads=1, memory_min_half_life=100.0),
    dict(variant="hyflash", memory="mamba2", context_lags=3, context_lag_rank=4),
    dict(variant="swa", context_lags=7, context_lag_rank=4),
    dict(variant="hyflash", memory="mamba2", context_lags=2, context_lag_rank=4, slot_embeddings=True),
    dict(variant="hyflash", memory="mamba2", context_lags=2, context_lag_rank=4, slot_query_scales=True),
    dict(variant="hyflash", memory="mamba2", copy_head_rank=4),
    dict(variant="swa", copy_head_rank=4, context_lags=2, context_lag_rank=4),
    dict(variant="full", copy_head_rank=4),
    dict(variant="hyflash", memory="gdn", copy_head_rank=4, copy_memory=True),
    dict(variant="hyflash", memory="mamba2", copy_head_rank=4, copy_memory=True, memory_limit=5),
    dict(variant="hyflash", memory="mamba2", copy_head_rank=4, copy_head_tokens=True),
    dict(variant="swa", copy_head_rank=4, copy_head_tokens=True),
    dict(variant="hyflash", memory="gdn", copy_head_rank=4, copy_head_tokens=True, copy_memory=True),
    dict(variant="hyflash", memory="mamba2", copy_head_rank=4, copy_head_tokens=True, copy_memory=True,
         copy_memory_dpfp=2),
    dict(variant="hyflash", memory="gdn", copy_head_rank=4, copy_memory=True, copy_memory_dpfp=3, memory_limit=5),
    dict(variant="hyflash", memory="mamba2", copy_head_rank=4, copy_head_tokens=True, copy_memory=True,
         copy_memory_dpfp=2, copy_memory_gate=True),
    dict(variant="hyflash", memory="gdn", copy_head_rank=4, copy_memory=True, copy_memory_gate=True, memory_limit=5),
    dict(variant="hyflash", memory="mamba2", copy_head_rank=4, copy_head_tokens=True, copy_memory=True,
         copy_memory_dpfp=2, copy_memory_delay=6),
    dict(variant="hyflash", memory="gdn", copy_head_rank=4, copy_memory=True, copy_memory_delay=3, memory_limit=5),
]


def tiny_drafter(seed=0, **kw):
    torch.manual_seed(seed)
    cfg = DrafterConfig(**{**TINY, **kw})
    emb, head = torch.randn(cfg.vocab_size, cfg.hidden_size), torch.randn(cfg.vocab_size, cfg.hidden_size)
    d = HyFlashDrafter(cfg, emb, head).double()
    if cfg.context_lags:  # zero-initialised; make it matter
        torch.nn.init.normal_(d.lag_up.weight, std=0.3)
    if cfg.copy_head_rank:  # zero-initialised; make it matter
        torch.nn.init.normal_(d.copy_up.weight, std=0.3)
    if cfg.copy_memory:
        torch.nn.init.normal_(d.copy_memory_up.weight, std=0.3)
    if cfg.copy_memory_gate:  # zeros at the start (a constant ½); make each slot's gate depend on its match
        torch.nn.init.normal_(d.copy_gate_scale, std=1.0)
        torch.nn.init.normal_(d.copy_gate_bias, std=1.0)
    if cfg.slot_query_scales:  # ones at the start; make each slot's differ
        for layer in d.layers:
            torch.nn.init.uniform_(layer.attn.slot_q_scale, 0.5, 1.5)
    return d


@pytest.mark.parametrize("kw", VARIANTS, ids=lambda kw: "-".join(f"{v}" for v in kw.values()))
def test_training_forward_equals_streaming_runtime(kw):
    """Logits at many anchors from one training pass == commit() the same features in random folds, then draft."""
    d = tiny_drafter(**kw)
    T = 40
    g = torch.Generator().manual_seed(1)
    feats = torch.randn(1, T, 3 * 16, dtype=torch.float64, generator=g) * 3
    ids = torch.randint(50, (1, T), generator=g)
    anchors = torch.tensor([[1, 3, 6, 7, 8, 15, 22, 30, 39]])  # inside, at and far beyond the window of 6
    train_logits = d.forward_train(feats, ids, anchors)[0]  # [n, S, V]
    state, done = DrafterState(d), 0
    for j, a in enumerate(anchors[0].tolist()):
        while done < a:  # fold 1..8 features per commit, like verification rounds
            n = min(a - done, int(torch.randint(1, 9, (1,), generator=g)))
            state.commit(feats[0, done:done + n], ids[0, done:done + n].tolist())
            done += n
        runtime_logits = d.logits(state.draft_hidden(int(ids[0, a])))
        torch.testing.assert_close(runtime_logits, train_logits[j], rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("kw", VARIANTS, ids=lambda kw: "-".join(f"{v}" for v in kw.values()))
def test_padding_anchors_change_nothing(kw):
    """A batch pads its rows with anchor 1 (masked in the loss: train.make_batch): the padded rows run, and the real
    anchors' logits are those of the row without padding."""
    d = tiny_drafter(**kw)
    g = torch.Generator().manual_seed(2)
    feats = torch.randn(1, 20, 3 * 16, dtype=torch.float64, generator=g)
    ids = torch.randint(50, (1, 20), generator=g)
    real = d.forward_train(feats, ids, torch.tensor([[1, 4, 9]]))
    padded = d.forward_train(feats, ids, torch.tensor([[1, 4, 9, 1, 1]]))
    assert padded.shape[1] == 5 and torch.isfinite(padded).all()
    torch.testing.assert_close(padded[:, :3], real, rtol=1e-10, atol=1e-10)


def test_causal_head_training_matches_left_to_right_drafting():
    d = tiny_drafter(causal_head_rank=4)
    torch.nn.init.normal_(d.causal_up.weight)  # zero-initialised; make it matter
    T, a = 20, 12
    feats = torch.randn(1, T, 48, dtype=torch.float64)
    ids = torch.randint(50, (1, T))
    state = DrafterState(d)
    state.commit(feats[0, :a])
    h = state.draft_hidden(int(ids[0, a]))
    drafted, prev = [], int(ids[0, a])
    for i in range(4):  # what the proposer does: greedy, left to right
        hi = h[i] if i == 0 else h[i] + d.causal_bias_hidden(torch.tensor(prev))
        prev = int(d.logits(hi).argmax())
        drafted.append(prev)
    prev_ids = torch.tensor([[[int(ids[0, a])] + drafted[:-1]]])  # slot i sees the token drafted at slot i−1
    train = d.forward_train(feats, ids, torch.tensor([[a]]), prev_ids=prev_ids)[0, 0]
    assert train.argmax(-1).tolist() == drafted
    without = d.forward_train(feats, ids, torch.tensor([[a]]))[0, 0]
    assert not torch.allclose(train[1:], without[1:])  # the bias changes slots after the first


def test_lagged_context_features_start_as_none_and_see_only_the_past():
    """Zero-initialised, the lags change nothing; trained, feature t reads features t−1..t−L and nothing later."""
    d = tiny_drafter(context_lags=2, context_lag_rank=4)
    feats = torch.randn(1, 10, 48, dtype=torch.float64)
    c, state = d.committed(feats)
    assert state.shape == (1, 2, 32) and torch.equal(state, d.fuse_features(feats)[:, -2:])
    moved = feats.clone()
    moved[0, 5] += 1.0
    c2 = d.committed(moved)[0]
    changed = (c2 - c).abs().amax(-1)[0] > 1e-9
    assert changed.tolist() == [False] * 5 + [True] * 3 + [False] * 2  # positions 5 (itself), 6 and 7 (lags 1, 2)
    torch.nn.init.zeros_(d.lag_up.weight)
    torch.testing.assert_close(d.committed(feats)[0], d.fuse_features(feats), rtol=0, atol=0)
    with pytest.raises(HyflashError, match="context_lags"):
        DrafterConfig(**{**TINY, "context_lags": -1})


def test_copy_head_reads_what_followed_the_match_and_nothing_uncommitted():
    """Slot j reads the value j + 1 after the position its query matches, only from committed features inside the
    window; zero-initialised, the head changes nothing."""
    cfg = DrafterConfig(**{**TINY, "copy_head_rank": 4})
    d = HyFlashDrafter(cfg, torch.randn(50, 32), torch.randn(50, 32)).double()
    ids, feats = torch.randint(50, (1, 20)), torch.randn(1, 20, 48, dtype=torch.float64)
    assert torch.equal(d.copy_slot_inputs(d.committed(feats)[0], ids, torch.tensor([[12]])), torch.zeros(1, 1, 4, 32,
                       dtype=torch.float64))
    torch.nn.init.eye_(d.copy_up.weight)  # slot inputs' first 4 dims = the read values
    M, a, m = 20, 12, 7  # keys of positions 0..19; the block at 12 sees 6..11 (window 6); its query matches 7 only
    k = torch.zeros(1, M, 4, dtype=torch.float64)
    k[0, m, 0] = 100.0
    q = torch.tensor([[[100.0, 0, 0, 0]]], dtype=torch.float64)
    v = torch.arange(M * 4, dtype=torch.float64).view(1, M, 4)
    out = d.copy_read(q, k, v, torch.tensor([[a]]), 0)[0][0, 0, :, :4]  # [S, 4]
    for j in range(4):
        torch.testing.assert_close(out[j], v[0, m + 1 + j])
    v2 = v.clone()
    v2[0, a:] = -1.0  # features at and after the anchor are not committed: no slot may read them
    k2 = k.clone()
    k2[0, a:, 0] = 1e4
    at = torch.tensor([[a]])
    torch.testing.assert_close(d.copy_read(q, k2, v2, at, 0)[0], d.copy_read(q, k, v, at, 0)[0])
    far = d.copy_read(q, k, v, torch.tensor([[m + d.config.window + 1]]), 0)[0][0, 0, 0, :4]  # match out of the window
    assert not torch.allclose(far, v[0, m + 1])
    assert torch.equal(d.copy_read(q, k, v, torch.tensor([[1]]), 0)[0], torch.zeros(1, 1, 4, 32, dtype=torch.float64))
    with pytest.raises(HyflashError, match="copy_head_rank"):
        DrafterConfig(**{**TINY, "copy_head_rank": -1})


def test_copy_head_tokens_start_as_an_exact_bigram_lookup():
    """With copy_head_tokens, before any training the copy head puts its weight on where the anchor and the token
    before it occurred together, and reads the tokens that followed; the runtime needs the tokens' ids."""
    d = tiny_drafter(copy_head_rank=16, copy_head_tokens=True, window=64)
    torch.nn.init.zeros_(d.copy_q.weight)  # the features' part starts random; leave only the tokens' part
    torch.nn.init.zeros_(d.copy_k.weight)
    g = torch.Generator().manual_seed(3)
    ids = torch.randperm(50, generator=g)[:40][None]  # distinct tokens, then a copy of positions 10..12 at 30..32
    ids[0, 30:33] = ids[0, 10:13]
    ids[0, 20] = ids[0, 11]  # the anchor's token alone, without the token before it
    feats = torch.randn(1, 40, 48, dtype=torch.float64, generator=g)
    c = d.committed(feats)[0]
    e = d.copy_token_embeddings(ids, c.dtype)
    zero = c.new_zeros(1, 1, c.shape[-1])
    k, _ = d.copy_keys_values(c, zero, e, zero)
    a = 31  # anchor ids[31] = ids[11], the token before it ids[30] = ids[10]
    q = d.copy_query(ids[:, [a]], c[:, [a - 1]], e[:, [a - 1]])
    w = torch.softmax((q @ k[0, :a - 1].T)[0, 0] * 16 ** -0.5, dim=-1)  # slot 0's weights over t ≤ a − 2
    assert w.argmax() == 11 and w[11] > 0.99  # the bigram match, not the unigram one at 20
    state = DrafterState(d)
    state.commit(feats[0, :3], ids[0, :3].tolist())
    with pytest.raises(HyflashError, match="token ids"):
        state.commit(feats[0, 3:5])
    with pytest.raises(HyflashError, match="token ids"):
        state.commit(feats[0, 3:5], [1])
    assert state.n == 3 and state.copy_k.shape[1] == 3  # the refused commits changed nothing


def test_copy_memory_pairs_each_key_with_the_value_j_plus_1_later_however_far_back():
    """Head j of the copy memory stores (key of feature t, value of feature t + 1 + j); with orthonormal keys and full
    write strength a query equal to one key reads back exactly what followed it, from past the window too."""
    d = tiny_drafter(copy_head_rank=4, copy_memory=True)
    torch.nn.init.zeros_(d.copy_beta.weight)
    torch.nn.init.constant_(d.copy_beta.bias, 50.0)  # β = 1
    T, S, m = 12, 4, 2  # positions 0..11; keys: position 2 has e_0, three others e_1..e_3, the rest zero
    k = torch.zeros(1, T, 4, dtype=torch.float64)
    k[0, m, 0], k[0, 5, 1], k[0, 6, 2], k[0, 8, 3] = 3.0, 1.0, 1.0, 1.0
    v = torch.randn(1, T, 4, dtype=torch.float64)
    c = torch.randn(1, T, 32, dtype=torch.float64)
    keys, vals, g, beta, recent = d.copy_memory_inputs(c, k, v, torch.zeros(1, S, 4, dtype=torch.float64))
    for j in range(S):
        torch.testing.assert_close(keys[0, m + 1 + j, j], torch.nn.functional.normalize(k[0, m], dim=-1))
    torch.testing.assert_close(recent[0, -1], torch.zeros(4, dtype=torch.float64))  # feature 11's key is zero
    state = mem.step("gdn", mem.init_state(1, S, 4, 4, dtype=torch.float64), keys, vals, g, beta)
    out = mem.read(state, torch.eye(4, dtype=torch.float64)[None, None, :1].expand(1, S, 1, 4))[0, :, 0]  # [S, 4]
    torch.testing.assert_close(out, v[0, m + 1: m + 1 + S])  # position 2 is 10 back: past the window of 6
    with pytest.raises(HyflashError, match="copy_memory"):
        DrafterConfig(**{**TINY, "variant": "swa", "copy_head_rank": 4, "copy_memory": True})


def test_dpfp_copy_memory_keys_are_the_expanded_normalised_keys():
    """copy_memory_dpfp = ν: the copy memory writes and reads keys of 2·rank·ν dimensions, the DPFP map of the copy
    key (each ReLU([k, −k]) component times the one i places before it, i = 1..ν), L2-normalised; its state is that
    many rows by rank."""
    d = tiny_drafter(copy_head_rank=4, copy_memory=True, copy_memory_dpfp=2)
    k = torch.tensor([[1.0, -2.0, 0.5, 3.0]], dtype=torch.float64)
    y = torch.tensor([1.0, 0.0, 0.5, 3.0, 0.0, 2.0, 0.0, 0.0], dtype=torch.float64)  # ReLU([k, -k])
    expected = torch.cat([y * y[[7, 0, 1, 2, 3, 4, 5, 6]], y * y[[6, 7, 0, 1, 2, 3, 4, 5]]])
    torch.testing.assert_close(d.copy_memory_key(k)[0], expected / expected.norm())
    assert d.config.copy_memory_key_dim == 16
    assert DrafterState(d).copy_mem.shape == (1, d.config.block_size, 16, 4)
    with pytest.raises(HyflashError, match="copy_memory_dpfp"):
        DrafterConfig(**{**TINY, "variant": "hyflash", "copy_head_rank": 4, "copy_memory_dpfp": 2})


def test_delayed_copy_memory_folds_a_write_only_once_it_is_delay_features_old():
    """copy_memory_delay = D: after n committed features the copy memory is the undelayed one's after n − D (nothing
    before D), whatever the commit sizes; the writes waiting are the window's copy keys and values, so only their D
    write strengths are queued, counted in the state's bytes."""
    kw = dict(copy_head_rank=4, copy_head_tokens=True, copy_memory=True, copy_memory_dpfp=2)
    D, T = 6, 30
    d = tiny_drafter(**kw, copy_memory_delay=D)
    plain = tiny_drafter(**kw)
    plain.load_state_dict(d.state_dict())
    g = torch.Generator().manual_seed(3)
    feats = torch.randn(T, 48, dtype=torch.float64, generator=g)
    ids = torch.randint(50, (T,), generator=g)
    late, early = DrafterState(d), DrafterState(plain)
    n = 0
    for step in (1, 4, 2, 7, 1, 3, 8, 4):
        late.commit(feats[n:n + step], ids[n:n + step].tolist())
        n += step
        while early.n < n - D:  # the undelayed state, D features behind
            early.commit(feats[early.n:early.n + 1], ids[early.n:early.n + 1].tolist())
        if n <= D:
            assert not late.copy_mem.any()
        else:
            torch.testing.assert_close(late.copy_mem, early.copy_mem, rtol=1e-12, atol=1e-12)
        assert late.copy_queue.shape[1] == min(n, D)
    assert late.nbytes() - DrafterState(plain).nbytes() == D * 8  # the strengths, in fp64
    assert DrafterState(d).nbytes() == DrafterState(plain).nbytes() + D * 8  # counted at capacity when empty
    with pytest.raises(HyflashError, match="copy_memory_delay"):
        DrafterConfig(**{**TINY, "variant": "hyflash", "copy_head_rank": 4, "copy_memory_delay": 6})
    with pytest.raises(HyflashError, match="copy_memory_delay"):
        DrafterConfig(**{**TINY, "variant": "hyflash", "copy_head_rank": 4, "copy_memory": True,
                         "copy_memory_delay": -1})
    with pytest.raises(HyflashError, match=r"copy_memory_delay \(7\) must be <= window \(6\)"):
        DrafterConfig(**{**TINY, "variant": "hyflash", "copy_head_rank": 4, "copy_memory": True,
                         "copy_memory_delay": 7})


def test_copy_memory_gate_scales_the_read_by_the_window_s_best_match():
    """copy_memory_gate: copy_read's best score for slot j is the highest score among the positions the slot may read
    (a − W ≤ t ≤ a − 2 − j; 0 where there is none), and the memory's read of slot j is scaled by
    sigmoid(a_j·best_j + b_j): ½ everywhere at initialisation, shut where a strongly negative scale meets a match."""
    d = tiny_drafter(copy_head_rank=4, copy_memory=True, copy_memory_gate=True)
    S, W = d.config.block_size, d.config.window
    g = torch.Generator().manual_seed(3)
    k, v = (torch.randn(1, 20, 4, dtype=torch.float64, generator=g) for _ in range(2))
    q = torch.randn(1, 1, 4, dtype=torch.float64, generator=g)
    scores = (k[0] @ q[0, 0]) * 4 ** -0.5
    a = 12
    out, best = d.copy_read(q, k, v, torch.tensor([[a]]), 0, best=True)
    torch.testing.assert_close(out, d.copy_read(q, k, v, torch.tensor([[a]]), 0)[0])
    torch.testing.assert_close(best[0, 0], torch.stack([scores[a - W: a - 1 - j].max() for j in range(S)]))
    assert torch.equal(d.copy_read(q, k, v, torch.tensor([[1]]), 0, best=True)[1], torch.zeros(1, 1, S,
                       dtype=torch.float64))  # nothing committed before the anchor's predecessor: no match
    y = torch.randn(1, 1, S, 4, dtype=torch.float64, generator=g)
    fresh = HyFlashDrafter(d.config, torch.randn(50, 32), torch.randn(50, 32)).double()
    fresh.copy_memory_up.weight.data.copy_(d.copy_memory_up.weight)
    torch.testing.assert_close(fresh.copy_memory_read(y, best), d.copy_memory_up(y / 2))
    with torch.no_grad():
        d.copy_gate_scale.fill_(-1e3)
        d.copy_gate_bias.zero_()
    best = torch.tensor([[[2.0, -2.0] + [0.0] * (S - 2)]], dtype=torch.float64)
    gate = torch.tensor([0.0, 1.0] + [0.5] * (S - 2), dtype=torch.float64)
    torch.testing.assert_close(d.copy_memory_read(y, best), d.copy_memory_up(y * gate[:, None]))
    with pytest.raises(HyflashError, match="copy_memory_gate"):
        DrafterConfig(**{**TINY, "variant": "hyflash", "copy_head_rank": 4, "copy_memory_gate": True})


def test_reading_memory_never_changes_the_state():
    d = tiny_drafter()
    state = DrafterState(d)
    state.commit(torch.randn(9, 48, dtype=torch.float64))
    before = [m.clone() for m in state.memories] + [w.k.clone() for w in state.windows]
    first = state.draft_hidden(3)
    for anchor in (4, 5, 3):
        state.draft_hidden(anchor)
    after = [m for m in state.memories] + [w.k for w in state.windows]
    assert all(torch.equal(x, y) for x, y in zip(before, after))
    assert torch.equal(first, state.draft_hidden(3))


def smollm2_geometry_drafter(variant, **kw):
    cfg = DrafterConfig(variant=variant, **kw)  # SmolLM2-135M geometry, window 256
    emb = torch.randn(cfg.vocab_size, cfg.hidden_size) * 0.02
    return HyFlashDrafter(cfg, emb, emb).to(torch.bfloat16)


def state_bytes_at(drafter, context):
    state = DrafterState(drafter)
    feats = torch.randn(context, 5 * 576, dtype=torch.bfloat16)
    for start in range(0, context, 512):
        state.commit(feats[start:start + 512])
    state.draft_hidden(1)
    return state.nbytes()


@pytest.mark.parametrize("variant", ["hyflash", "swa", "full", "hyflash-lags"])
def test_drafter_state_bytes_bounded_except_full(variant):
    lags = variant.endswith("-lags")
    d = smollm2_geometry_drafter(variant.removesuffix("-lags"), context_lags=7 if lags else 0)
    b1k, b6k = state_bytes_at(d, 1024), state_bytes_at(d, 6144)
    if lags:  # the last 7 fused features on top of HyFlash's state
        assert b1k - state_bytes_at(smollm2_geometry_drafter("hyflash"), 1024) == 7 * 576 * 2
    if variant == "full":
        per_feature = (b6k - b1k) / 5120
        assert per_feature == 2 * 2 * 3 * 64 * 2  # layers · (k, v) · kv heads · head_dim · bf16 bytes
        assert b1k == 1024 * per_feature
    else:
        assert b1k == b6k > 0


@pytest.mark.parametrize("kw", VARIANTS[:4], ids=lambda kw: "-".join(f"{v}" for v in kw.values()))
def test_untrained_drafter_is_lossless_on_tiny_target(kw):
    target = tiny_llama(vocab=50, hidden=32)
    cfg = DrafterConfig(**{**TINY, **kw, "hidden_size": 32})
    torch.manual_seed(0)
    proposer = HyFlashProposer(new_drafter(cfg, target))
    prompt = torch.randint(1, 49, (30,)).tolist()
    plain = generate(target, prompt, None, max_new_tokens=40)
    spec = generate(target, prompt, proposer, max_new_tokens=40)
    assert spec.token_ids == plain.token_ids
    assert spec.stats.rounds > 0 and spec.stats.drafter_state_bytes > 0


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["hyflash", "full", "swa"])
def test_untrained_drafter_is_lossless_on_smollm2(smollm2_fp32, variant):
    target = smollm2_fp32
    torch.manual_seed(0)
    proposer = HyFlashProposer(new_drafter(DrafterConfig(variant=variant), target))
    for prompt in ("Name three colours.", "Write a limerick about a cat."):
        ids = target.encode(prompt)
        ref = target.model.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False)[0, len(ids):].tolist()
        assert generate(target, ids, proposer, max_new_tokens=16).token_ids == ref


def test_checkpoint_round_trip_and_target_check(tmp_path):
    target = tiny_llama(vocab=50, hidden=32)
    cfg = DrafterConfig(**{**TINY, "hidden_size": 32})
    drafter = new_drafter(cfg, target, dtype=torch.float32)
    save_pretrained(drafter, tmp_path / "d", dtype=None)
    loaded = from_pretrained(tmp_path / "d", target, dtype=torch.float32)
    for (name, a), (_, b) in zip(drafter.state_dict().items(), loaded.state_dict().items()):
        assert torch.equal(a, b), name
    saved = json.loads((tmp_path / "d" / "config.json").read_text())
    assert saved["target_fingerprint"] == target.fingerprint() and saved["target_name"] == "tiny-llama"

    other = tiny_llama(vocab=50, hidden=32, seed=1)  # same geometry, different weights
    with pytest.raises(HyflashError, match="trained for target"):
        from_pretrained(tmp_path / "d", other)
    with pytest.raises(HyflashError, match="no drafter checkpoint"):
        from_pretrained(tmp_path / "missing", target)
    with pytest.raises(HyflashError, match="unknown drafter"):
        load_proposer(str(tmp_path / "missing"), target)

    (tmp_path / "d" / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(HyflashError, match="corrupt"):
        from_pretrained(tmp_path / "d", target)

    save_pretrained(drafter, tmp_path / "e")
    bad = json.loads((tmp_path / "e" / "config.json").read_text())
    bad["num_layers"] = 3  # config no longer matches the weights
    (tmp_path / "e" / "config.json").write_text(json.dumps(bad))
    with pytest.raises(HyflashError, match="do not match"):
        from_pretrained(tmp_path / "e", target)
    bad["unknown_field"] = 1
    (tmp_path / "e" / "config.json").write_text(json.dumps(bad))
    with pytest.raises(HyflashError, match="unknown fields"):
        from_pretrained(tmp_path / "e", target)


def test_sampling_with_drafter_uses_its_own_distribution():
    """At temperature 1 the proposer returns the q it sampled from (needed by the acceptance rule)."""
    target = tiny_llama(vocab=50, hidden=32)
    proposer = HyFlashProposer(new_drafter(DrafterConfig(**{**TINY, "hidden_size": 32}), target), seed=0)
    proposer.reset([1, 2, 3])
    proposer.commit([1, 2, 3], target.forward(torch.tensor([1, 2, 3]), target.new_cache()).features)
    draft = proposer.draft(4, 7, SamplingConfig(temperature=1.0, top_k=10))
    assert draft.probs.shape == (4, 50)
    assert torch.allclose(draft.probs.sum(-1), torch.ones(4, dtype=draft.probs.dtype))
    assert all(draft.probs[i, t] > 0 for i, t in enumerate(draft.tokens))
    assert ((draft.probs > 0).sum(-1) <= 10).all()  # top-k applied to q as to p


def test_reduced_draft_vocabulary_round_trips_and_stays_lossless(tmp_path):
    target = tiny_llama(vocab=50, hidden=32)
    cfg = DrafterConfig(**{**TINY, "hidden_size": 32, "draft_vocab_size": 12})
    drafter = new_drafter(cfg, target, dtype=torch.float32)
    vocab = torch.randperm(50, generator=torch.Generator().manual_seed(0))[:12]
    drafter.set_draft_vocab(vocab)
    save_pretrained(drafter, tmp_path / "d", dtype=None)
    loaded = from_pretrained(tmp_path / "d", target, dtype=torch.float32)
    assert torch.equal(loaded.draft_vocab, vocab)
    proposer = HyFlashProposer(loaded, seed=0)
    prompt = torch.randint(1, 49, (20,)).tolist()
    proposer.reset(prompt)
    proposer.commit(prompt, target.forward(torch.tensor(prompt), target.new_cache()).features)
    greedy = proposer.draft(5, 7, SamplingConfig())
    assert set(greedy.tokens) <= set(vocab.tolist())  # drafts are target ids from the draft vocabulary
    sampled = proposer.draft(5, 7, SamplingConfig(temperature=1.0))
    assert sampled.probs.shape == (4, 50) and (sampled.probs[:, [i for i in range(50) if i not in vocab]] == 0).all()
    plain = generate(target, prompt, None, max_new_tokens=30)
    assert generate(target, prompt, proposer, max_new_tokens=30).token_ids == plain.token_ids


def test_lookup_then_drafter_is_lossless_and_uses_both():
    from hyflash.proposers import LookupThenDrafter

    target = tiny_llama(vocab=50, hidden=32)
    torch.manual_seed(0)
    drafter = new_drafter(DrafterConfig(**{**TINY, "hidden_size": 32}), target)
    phrase = torch.randint(1, 49, (12,)).tolist()
    prompt = phrase * 3 + torch.randint(1, 49, (10,)).tolist()  # repeats for lookup, fresh text for the drafter
    plain = generate(target, prompt, None, max_new_tokens=40)
    combo = LookupThenDrafter(HyFlashProposer(drafter), min_match=2)
    spec = generate(target, prompt, combo, max_new_tokens=40)
    assert spec.token_ids == plain.token_ids
    assert 0 < combo.lookup_rounds < combo.rounds == spec.stats.rounds
    alone = HyFlashProposer(drafter)
    generate(target, prompt, alone, max_new_tokens=40)
    # the drafter committed the same features whichever proposer drafted each round (in other chunks: float64 close)
    assert combo.drafter.state.n == alone.state.n
    assert all(torch.allclose(a, b, rtol=1e-9, atol=1e-12)
               for a, b in zip(combo.drafter.state.memories, alone.state.memories))


def test_confidence_cuts_the_block_where_the_drafters_own_estimate_falls():
    """Adaptive block length: the draft is the leading slots whose running product of the drafter's probabilities
    of its own tokens stays >= confidence; generation stays lossless (greedy) and shorter drafts mean more rounds."""
    target = tiny_llama(vocab=50, hidden=32)
    torch.manual_seed(0)
    drafter = new_drafter(DrafterConfig(**{**TINY, "hidden_size": 32}), target)
    with torch.no_grad():
        drafter.head_weight.mul_(8)  # sharpen the untrained drafter so its probabilities spread over (0, 1)
    prompt = torch.randint(1, 49, (20,)).tolist()
    full = HyFlashProposer(drafter)
    full.reset(prompt)
    full.commit(prompt, target.forward(torch.tensor(prompt), target.new_cache()).features)
    with torch.no_grad():
        probs = drafter.logits(full.state.draft_hidden(7)).double().softmax(-1)
    running = probs.max(-1).values.cumprod(0)
    assert running[0] > running[-1]
    for cut in (1, 2, 3):
        cut_at = HyFlashProposer(drafter, confidence=float(running[cut - 1]) - 1e-7)
        cut_at.state = full.state
        assert cut_at.draft(7, 7, SamplingConfig()).tokens == full.draft(7, 7, SamplingConfig()).tokens[:cut]
    never = HyFlashProposer(drafter, confidence=1.0)
    never.state = full.state
    assert never.draft(7, 7, SamplingConfig()).tokens == []
    sampled = HyFlashProposer(drafter, seed=0, confidence=float(running[1]))
    sampled.state = full.state
    sampled.gen = torch.Generator().manual_seed(0)
    d = sampled.draft(7, 7, SamplingConfig(temperature=1.0))
    assert d.probs.shape[0] == len(d.tokens) <= 4  # q is returned for exactly the slots sent
    plain = generate(target, prompt, None, max_new_tokens=40)
    spec = generate(target, prompt, HyFlashProposer(drafter, confidence=float(running[1])), max_new_tokens=40)
    every = generate(target, prompt, HyFlashProposer(drafter), max_new_tokens=40)
    assert spec.token_ids == plain.token_ids == every.token_ids
    assert spec.stats.drafted < every.stats.drafted
    with pytest.raises(HyflashError, match="confidence"):
        HyFlashProposer(drafter, confidence=1.5)
    with pytest.raises(HyflashError, match="bad confidence"):
        load_proposer("auto@high", target)


def test_tree_candidates_are_the_most_probable_paths_best_first():
    """HyFlashProposer._tree: nodes in order of their path probability (the product of the slots' probabilities),
    so parents precede children and a first choice precedes its siblings."""
    from types import SimpleNamespace

    from hyflash.decoding import Draft

    prop = HyFlashProposer.__new__(HyFlashProposer)
    prop.branching = 2
    prop.drafter = SimpleNamespace(token_ids=lambda index: index + 100)
    probs = torch.tensor([[0.6, 0.3, 0.1], [0.9, 0.05, 0.05], [0.55, 0.35, 0.1]])
    d = prop._tree(probs.log(), 5)
    # path scores: .6 (slot 0 first) > .54 (then slot 1 first) > .3 (slot 0 second) > .297 > .27
    assert d.tokens == [100, 100, 101, 100, 100] and d.parents == [0, 1, 0, 2, 3]
    assert d.chain().tokens == [100, 100, 100] and d.chain().parents is None
    assert Draft([5, 6]).chain().tokens == [5, 6]


def test_graft_merges_a_chain_into_a_tree_as_a_path_from_the_root():
    from hyflash.decoding import Draft
    from hyflash.proposers import graft

    tree = Draft([10, 20, 11, 30], parents=[0, 1, 0, 2])  # 10 -> 20 -> 30, and 11
    d = graft(tree, [10, 20, 40, 50])  # follows 10 -> 20, then branches off with 40 -> 50
    assert d.tokens == [10, 20, 11, 30, 40, 50] and d.parents == [0, 1, 0, 2, 2, 5]
    assert graft(tree, [10, 20, 30]).tokens == tree.tokens  # already there: nothing added
    assert graft(tree, []).parents == tree.parents
    d = graft(tree, [12, 13])
    assert d.tokens[-2:] == [12, 13] and d.parents[-2:] == [0, 5]
    assert all(p < i for i, p in enumerate(d.parents, start=1))  # parents precede children


def test_drafter_specs_choose_a_tree_or_a_chain(tmp_path):
    from hyflash.proposers import default_tree

    target = tiny_llama(vocab=50, hidden=32)
    save_pretrained(new_drafter(DrafterConfig(**{**TINY, "hidden_size": 32}), target), tmp_path / "d", dtype=None)
    path = str(tmp_path / "d")
    assert load_proposer(path, target).tree == default_tree()  # the default: a tree when greedy on the fast path
    assert load_proposer(path + "#5", target).tree == 5
    assert load_proposer(path + "#0", target).tree == 0  # a chain
    assert load_proposer(path + "@0.1", target).tree == 0  # adaptive block length is a chain's
    assert load_proposer("ngram+" + path + "#7", target).drafter.tree == 7
    # the weights the C++ drafting path reads: int8 by default, :bf16 / :int8 at the end of a spec
    assert load_proposer(path, target).drafter.native_weights == "int8"
    assert load_proposer(path + "#5:bf16", target).drafter.native_weights == "bf16"
    prop = load_proposer("ngram+" + path + ":bf16", target)
    assert prop.drafter.drafter.native_weights == "bf16" and prop.drafter.tree == default_tree()
    with pytest.raises(HyflashError, match="bad tree size"):
        load_proposer(path + "#many", target)


def test_the_default_tree_is_smaller_on_the_builds_whose_pair_products_are_two_fmas(monkeypatch):
    from hyflash import kernels, proposers

    for build, nodes in (("amx", 4), ("avx512-bf16", 4), ("avx2", 2), ("neon", 2), (None, 4)):
        monkeypatch.setattr(kernels, "isa", lambda build=build: build)
        assert proposers.default_tree() == nodes
    assert set(kernels.PAIRS_BY_FMA) == {"avx2", "neon"}


def test_a_tree_of_n_nodes_drafts_only_the_blocks_first_n_slots(tmp_path):
    """A tree of N candidate nodes reaches at most N slots deep, so HyFlashProposer asks the drafter for the block's
    first min(N, block) slots; a chain, or sampling, for all of them."""
    target = tiny_llama(vocab=50, hidden=32)
    drafter = new_drafter(DrafterConfig(**{**TINY, "hidden_size": 32}), target)
    block = drafter.config.block_size
    asked = []
    for tree, sampling, want in ((2, SamplingConfig(), 2), (block + 3, SamplingConfig(), block),
                                 (0, SamplingConfig(), block), (2, SamplingConfig(temperature=1.0), block)):
        prop = HyFlashProposer(drafter, tree=tree, seed=0)
        prop.reset([1, 2, 3])
        draft_logits = prop.state.draft_logits

        def spy(anchor, slots=None):
            logits = draft_logits(anchor, slots)
            asked.append(logits.shape[0])
            return logits

        prop.state.draft_logits = spy
        draft = prop.draft(4, 20, sampling)
        assert asked[-1] == want and 1 <= len(draft.tokens) <= max(tree, block)


def test_memory_horizon_measures_the_retention_the_gates_give():
    """benchmarks/memory_horizon.py: a write d steps back is scaled by exp(g_{t+1} + ... + g_{t+d}); constant gates
    give the closed forms, distances longer than every sequence give no figure, and the gates it reads are the
    memory's own."""
    import math
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))
    from memory_horizon import log_decays, retention_table

    g = torch.empty(600, 2)
    g[:, 0], g[:, 1] = -0.01, -math.log(2) / 100  # head 1: a half-life of 100 steps
    g[300, 0] = -5.0  # one hard forget in head 0: the median over positions barely moves, the mean does
    t = retention_table([g])
    assert abs(float(t["half-life"][1]) - 100) < 1e-3 and abs(float(t["half-life"][0]) - math.log(2) / 0.01) < 1e-3
    assert abs(float(t["r@256"][1]) - 2 ** -2.56) < 1e-5
    assert abs(float(t["r@64"][0]) - math.exp(-0.64)) < 1e-5  # most 64-step windows miss the forget
    assert math.isnan(float(t["r@1024"][0]))  # no position has 1,024 steps after it
    assert abs(float(t["r@8192*"][0]) - math.exp(8192 * float(g[:, 0].mean()))) < 1e-12
    cfg = DrafterConfig(variant="hyflash", memory="mamba2", num_layers=2, window=6, hidden_size=32, num_heads=4,
                        num_kv_heads=2, head_dim=8, intermediate_size=64, memory_heads=2, memory_head_dim=8,
                        memory_state_dim=4, target_layers=[0, 1], target_hidden_size=32, vocab_size=40)
    emb = torch.randn(40, 32)
    drafter = HyFlashDrafter(cfg, emb, emb).eval()
    feats = torch.randn(50, 2 * 32)
    got = log_decays(drafter, [feats])
    c = drafter.fuse_features(feats[None])
    for i, layer in enumerate(drafter.layers):
        assert torch.equal(got[i][0], layer.memory.write_inputs(c)[2][0].float())
        assert bool((got[i][0] <= 0).all())


def test_long_memory_heads_cannot_forget_faster_than_their_half_life():
    """memory_long_heads: the first heads' log-decays are -c * sigmoid(gate pre-activation), c = ln 2 /
    memory_min_half_life, so their half-life stays above it while the gate still sets it per feature (a gradient
    reaches the gate); the other heads are untouched."""
    import math

    for memory in ("mamba2", "gdn"):
        plain = tiny_drafter(memory=memory)
        floored = tiny_drafter(memory=memory, memory_long_heads=1, memory_min_half_life=50.0)
        with torch.no_grad():
            for m in (plain.layers[0].memory, floored.layers[0].memory):
                m.dt_bias.fill_(3.0)  # fast forgetting everywhere: the floor must act
        floored.load_state_dict(plain.state_dict())
        c = torch.randn(1, 30, plain.config.hidden_size, dtype=torch.float64)
        with torch.no_grad():
            g0 = plain.layers[0].memory.write_inputs(c)[2]
        g1 = floored.layers[0].memory.write_inputs(c)[2]
        cap = math.log(2) / 50.0
        assert bool((g0[..., 0] < -cap).all())  # without the floor head 0 forgets faster than the half-life allows
        assert bool((g1[..., 0] >= -cap).all()) and bool((g1[..., 0] < 0).all())
        assert float(g1[..., 0].detach().std()) > 0  # still chosen per feature
        torch.testing.assert_close(g1[..., 1:].detach(), g0[..., 1:], rtol=0, atol=0)
        g1[..., 0].sum().backward()
        assert float(floored.layers[0].memory.dt_bias.grad[0].abs()) > 0
    with pytest.raises(HyflashError, match="memory_long_heads"):
        DrafterConfig(**{**TINY, "memory_long_heads": TINY["memory_heads"] + 1})


def test_copy_token_drafter_round_trips_and_generates_losslessly(tmp_path):
    """A drafter whose copy head reads the committed tokens gets their ids from the decoding loop (prompt, then each
    round's accepted tokens): saved and loaded, it samples, and greedy it leaves the target's output unchanged; its
    state after a generation equals a fresh state fed the same tokens and features at once."""
    target = tiny_llama(vocab=50, hidden=32)
    torch.manual_seed(0)
    cfg = DrafterConfig(**{**TINY, "hidden_size": 32, "copy_head_rank": 8, "copy_head_tokens": True})
    drafter = new_drafter(cfg, target, dtype=torch.float32)
    torch.nn.init.normal_(drafter.copy_up.weight, std=0.5)  # zero-initialised; make the head matter
    save_pretrained(drafter, tmp_path / "d", dtype=None)
    loaded = from_pretrained(tmp_path / "d", target, dtype=torch.float32)
    assert loaded.config.copy_head_tokens and torch.equal(loaded.copy_kt.weight, drafter.copy_kt.weight)
    phrase = torch.randint(1, 49, (10,)).tolist()
    prompt = phrase * 3 + phrase[:4]
    sampled = generate(target, prompt, HyFlashProposer(loaded, seed=0), max_new_tokens=30,
                       sampling=SamplingConfig(temperature=1.0, seed=0))
    assert sampled.token_ids and sampled.stats.drafted > 0
    plain = generate(target, prompt, None, max_new_tokens=30)
    proposer = HyFlashProposer(loaded, seed=0)
    spec = generate(target, prompt, proposer, max_new_tokens=30)
    assert spec.token_ids == plain.token_ids and spec.stats.rounds > 1
    ids = prompt + spec.token_ids[:proposer.state.n - len(prompt)]
    fresh = DrafterState(loaded)
    fresh.commit(target.forward(torch.tensor(ids), target.new_cache()).features, ids)
    torch.testing.assert_close(proposer.state.copy_k, fresh.copy_k, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(proposer.state.copy_last_token, fresh.copy_last_token, rtol=0, atol=0)


def test_draft_temperature_sets_the_distribution_guesses_are_drawn_from(tmp_path):
    """~0: the drafter's argmax as a point mass while the target samples (the same guesses greedy decoding gets);
    ~T: q = softmax(logits / T); no suffix: the target's temperature. The spec forms parse, and bad ones say why."""
    from hyflash.decoding import target_probs
    from hyflash.proposers import split_draft_temperature

    target = tiny_llama(vocab=50, hidden=32)
    torch.manual_seed(0)
    save_pretrained(new_drafter(DrafterConfig(**{**TINY, "hidden_size": 32}), target), tmp_path / "d", dtype=None)
    path = str(tmp_path / "d")
    prompt = torch.randint(1, 49, (30,)).tolist()
    feats = target.forward(torch.tensor(prompt), target.new_cache(), features=True).features
    sampled = SamplingConfig(temperature=1.0, seed=0)

    def drafted(spec, sampling):
        prop = load_proposer(spec + "#0", target, seed=0)
        prop.reset(prompt)
        prop.commit(prompt, feats)
        return prop, prop.draft(prompt[-1], 4, sampling)

    _, greedy = drafted(path, SamplingConfig())
    prop, argmax = drafted(path + "~0", sampled)
    assert prop.draft_temperature == 0.0
    assert argmax.tokens == greedy.tokens and argmax.probs is None  # a point mass: accepted with the target's p
    _, own = drafted(path, sampled)
    assert own.probs is not None and torch.allclose(own.probs.sum(-1), torch.ones(len(own.tokens)))
    prop, cool = drafted(path + "~0.5", sampled)
    logits = prop.state.draft_logits(prompt[-1], None)[:4]
    want = prop.drafter.full_vocab(target_probs(logits, SamplingConfig(temperature=0.5)))
    assert torch.allclose(cool.probs, want, atol=1e-6)
    assert load_proposer("ngram+" + path + "~0@0.1", target).drafter.draft_temperature == 0.0
    assert split_draft_temperature("~/runs/d") == ("~/runs/d", None)  # a home path, not a suffix
    with pytest.raises(HyflashError, match="must be >= 0"):
        load_proposer(path + "~-1", target)
    with pytest.raises(HyflashError, match="has none"):
        load_proposer("ngram~0", target)
    out = generate(target, prompt, load_proposer(path + "~0", target, seed=0), max_new_tokens=12, sampling=sampled)
    assert len(out.token_ids) == 12 and out.stats.rounds > 0
