"""Tests for hyflash.drafter.memory: chunked / step / read_at against a plain per-feature loop of the recurrence."""

import pytest
import torch
import torch.nn.functional as F

from hyflash.drafter import memory

KINDS = memory.MEMORY_KINDS
TOL = {torch.float64: 1e-10, torch.float32: 1e-4}


def make_inputs(kind, B=2, T=50, H=3, dk=5, dv=4, dtype=torch.float64, seed=0, decay_scale=1.0):
    """Realistic inputs: decays in (0, 1); for gdn unit-norm keys and beta in (0, 1)."""
    gen = torch.Generator().manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    k = rnd(B, T, H, dk)
    k = F.normalize(k, dim=-1) if kind == "gdn" else k / dk**0.5
    v = rnd(B, T, H, dv)
    g = -F.softplus(rnd(B, T, H)) * decay_scale
    beta = torch.sigmoid(rnd(B, T, H)) if kind == "gdn" else None
    cast = (lambda x: None if x is None else x.to(dtype))
    return cast(k), cast(v), cast(g), cast(beta)


def reference_states(kind, k, v, g, beta, S0=None):
    """All states S_0..S_T of the recurrence, one feature at a time, in float64: [B, T+1, H, dk, dv].

    mamba2: S_t = a_t S_{t-1} + k_t v_tᵀ;   gdn: S_t = a_t (I − β_t k_t k_tᵀ) S_{t-1} + β_t k_t v_tᵀ.
    """
    k, v, g = k.double(), v.double(), g.double()
    B, T, H, dk = k.shape
    dv = v.shape[-1]
    S = torch.zeros(B, H, dk, dv, dtype=torch.float64) if S0 is None else S0.double()
    eye = torch.eye(dk, dtype=torch.float64)
    out = [S]
    for t in range(T):
        a = g[:, t].exp()[..., None, None]
        kt, vt = k[:, t], v[:, t]
        kv = torch.einsum("bhi,bhj->bhij", kt, vt)
        if kind == "mamba2":
            S = a * S + kv
        else:
            b = beta[:, t].double()[..., None, None]
            P = eye - b * torch.einsum("bhi,bhj->bhij", kt, kt)
            S = a * (P @ S) + b * kv
        out.append(S)
    return torch.stack(out, 1)


def rel_err(x, ref):
    return ((x.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-300)).item()


def read_ref(states, q, pos):
    """o_i = S_{p_i}ᵀ q_i from reference states [B, T+1, H, dk, dv]; pos [B, Q]."""
    B = states.shape[0]
    S = states[torch.arange(B)[:, None], pos]  # [B, Q, H, dk, dv]
    return torch.einsum("bhqd,bqhde->bhqe", q.double(), S)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("T,chunk", [(50, 16), (64, 16), (5, 8), (33, 1)])
def test_chunked_matches_recurrence(kind, dtype, T, chunk):
    k, v, g, beta = make_inputs(kind, T=T, dtype=dtype)
    ref = reference_states(kind, k, v, g, beta)
    chunk_states, final = memory.chunked(kind, k, v, g, beta, chunk=chunk)
    n_chunks = -(-T // chunk)
    assert chunk_states.shape == (2, n_chunks, 3, 5, 4) and final.shape == (2, 3, 5, 4)
    assert chunk_states.dtype == dtype and final.dtype == dtype
    assert rel_err(final, ref[:, T]) < TOL[dtype]
    assert rel_err(chunk_states, ref[:, 0:T:chunk]) < TOL[dtype]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_chunked_continues_from_initial_state(kind, dtype):
    k, v, g, beta = make_inputs(kind, T=70, dtype=dtype, seed=1)
    ref = reference_states(kind, k, v, g, beta)
    _, S30 = memory.chunked(kind, k[:, :30], v[:, :30], g[:, :30], None if beta is None else beta[:, :30], chunk=8)
    rest = (k[:, 30:], v[:, 30:], g[:, 30:], None if beta is None else beta[:, 30:])
    chunk_states, final = memory.chunked(kind, *rest, S0=S30, chunk=16)
    assert rel_err(final, ref[:, 70]) < TOL[dtype]
    assert rel_err(chunk_states, ref[:, 30:70:16]) < TOL[dtype]


@pytest.mark.parametrize("kind", KINDS)
def test_chunked_is_safe_under_strong_decay(kind):
    # log-decays around -30 per feature: a naive exp(-cumsum) within a chunk of 64 would overflow float32
    k, v, g, beta = make_inputs(kind, T=100, dtype=torch.float32, seed=2, decay_scale=40.0)
    k.requires_grad_()
    g.requires_grad_()
    ref = reference_states(kind, k.detach(), v, g.detach(), beta)
    chunk_states, final = memory.chunked(kind, k, v, g, beta, chunk=64)
    assert torch.isfinite(chunk_states).all() and torch.isfinite(final).all()
    assert rel_err(final, ref[:, 100]) < 1e-4
    final.sum().backward()
    assert torch.isfinite(k.grad).all() and torch.isfinite(g.grad).all()


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_step_random_folds_match_recurrence(kind, dtype, monkeypatch):
    T = 120
    k, v, g, beta = make_inputs(kind, T=T, dtype=dtype, seed=3)
    ref = reference_states(kind, k, v, g, beta)
    calls = []
    real_chunked = memory.chunked
    monkeypatch.setattr(memory, "chunked", lambda *a, **kw: calls.append(a[1].shape[1]) or real_chunked(*a, **kw))

    gen = torch.Generator().manual_seed(4)
    sizes = [int(torch.randint(1, 9, (1,), generator=gen)) for _ in range(12)]
    sizes.append(40)  # a prefill-sized fold: must go through the chunked path
    sizes.append(T - sum(sizes))
    assert sizes[-1] >= 1
    S = memory.init_state(2, 3, 5, 4, dtype=dtype)
    t = 0
    for n in sizes:
        sl = slice(t, t + n)
        before = S.clone()
        S_new = memory.step(kind, S, k[:, sl], v[:, sl], g[:, sl], None if beta is None else beta[:, sl])
        assert torch.equal(S, before), "step must not mutate its input state"
        t += n
        S = S_new
        assert S.dtype == dtype
        assert rel_err(S, ref[:, t]) < TOL[dtype], f"after folding {t} features"
    assert t == T
    assert 40 in calls and all(n > memory.STEP_LOOP_MAX for n in calls)


def test_init_state_is_zero_with_requested_shape_and_dtype():
    S = memory.init_state(2, 3, 4, 5, dtype=torch.float64)
    assert S.shape == (2, 3, 4, 5) and S.dtype == torch.float64 and not S.any()


@pytest.mark.parametrize("kind", KINDS)
def test_read_leaves_state_unchanged_and_unaliased(kind):
    k, v, g, beta = make_inputs(kind, T=20)
    S = memory.step(kind, memory.init_state(2, 3, 5, 4, dtype=torch.float64), k, v, g, beta)
    keep = S.clone()
    q = torch.randn(2, 3, 6, 5, dtype=torch.float64)
    o = memory.read(S, q)
    assert torch.equal(S, keep)
    assert o.shape == (2, 3, 6, 4)
    assert torch.allclose(o, torch.einsum("bhde,bhqd->bhqe", S, q))
    o.add_(1.0)  # writing to the output must not reach the state
    assert torch.equal(S, keep)
    o2 = memory.read(S, q[:, :, :1])  # single query
    o2.mul_(0.0)
    assert torch.equal(S, keep)


def positions(T, chunk, Q_extra, seed):
    """Query positions: 0, T, every chunk boundary and its neighbours, plus random ones."""
    fixed = {0, T}
    for b in range(0, T + 1, chunk):
        fixed |= {max(0, b - 1), b, min(T, b + 1)}
    gen = torch.Generator().manual_seed(seed)
    rand = torch.randint(0, T + 1, (Q_extra,), generator=gen).tolist()
    return torch.tensor(sorted(fixed) + rand)


KIND_FORMS = [("mamba2", "chunked"), ("mamba2", "quadratic"), ("gdn", "chunked"), ("gdn", "quadratic")]


@pytest.mark.parametrize("kind,form", KIND_FORMS)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("T,chunk", [(45, 8), (48, 16)])
def test_read_at_matches_reading_recurrent_states(kind, form, dtype, T, chunk):
    k, v, g, beta = make_inputs(kind, T=T, dtype=dtype, seed=5)
    ref = reference_states(kind, k, v, g, beta)
    pos = positions(T, chunk, 10, seed=6)
    q = torch.randn(2, 3, len(pos), 5, dtype=torch.float64).to(dtype)
    o = memory.read_at(kind, k, v, g, q, pos, beta, chunk=chunk, form=form)
    assert o.shape == (2, 3, len(pos), 4) and o.dtype == dtype
    expected = read_ref(ref, q, pos.expand(2, -1))
    assert rel_err(o, expected) < TOL[dtype]
    assert not o[:, :, pos == 0].any(), "p = 0 reads the zero state"
    # per-batch positions [B, Q]
    pos_b = torch.stack([pos, pos.flip(0)])
    o_b = memory.read_at(kind, k, v, g, q, pos_b, beta, chunk=chunk, form=form)
    assert rel_err(o_b, read_ref(ref, q, pos_b)) < TOL[dtype]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("limit", [0, 1, 5, 16, 30, 1000])
def test_read_at_limit_matches_window_folded_from_zero(kind, dtype, limit):
    T, chunk = 37, 8
    # slow decay so that features older than the limit still matter
    k, v, g, beta = make_inputs(kind, T=T, dtype=dtype, seed=7, decay_scale=0.05)
    pos = positions(T, chunk, 6, seed=8)
    pos_b = torch.stack([pos, pos.flip(0)])
    q = torch.randn(2, 3, len(pos), 5, dtype=torch.float64).to(dtype)
    o = memory.read_at(kind, k, v, g, q, pos_b, beta, chunk=chunk, limit=limit)
    expected = torch.zeros(2, 3, len(pos), 4, dtype=torch.float64)
    for b in range(2):
        for i, p in enumerate(pos_b[b].tolist()):
            s = max(0, p - limit)
            sl = slice(s, p)
            S = reference_states(kind, k[b:b + 1, sl], v[b:b + 1, sl], g[b:b + 1, sl],
                                 None if beta is None else beta[b:b + 1, sl])[0, -1]
            expected[b, :, i] = torch.einsum("hd,hde->he", q[b, :, i].double(), S)
    assert o.shape == expected.shape and o.dtype == dtype
    if limit == 0:
        assert not o.any()
    else:
        assert rel_err(o, expected) < TOL[dtype]
    if 0 < limit < T:  # the limit must actually change the answer
        full = memory.read_at(kind, k, v, g, q, pos_b, beta, chunk=chunk)
        assert rel_err(full, expected) > 1e-3


@pytest.mark.parametrize("kind,form", KIND_FORMS)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("limit", [None, 5])
def test_grouped_read_at_matches_ungrouped(kind, form, dtype, limit):
    """Runs of `group` queries at one position (a block's slots) give the same reads with group set."""
    T, chunk, group = 45, 8, 4
    k, v, g, beta = make_inputs(kind, T=T, dtype=dtype, seed=13)
    anchors = torch.stack([positions(T, chunk, 3, seed=14), positions(T, chunk, 3, seed=15).flip(0)])
    pos = anchors.repeat_interleave(group, dim=1)                      # [2, n·group]
    q = torch.randn(2, 3, pos.shape[1], 5, dtype=torch.float64).to(dtype)
    ref = reference_states(kind, k, v, g, beta)
    grouped = memory.read_at(kind, k, v, g, q, pos, beta, chunk=chunk, limit=limit, form=form, group=group)
    plain = memory.read_at(kind, k, v, g, q, pos, beta, chunk=chunk, limit=limit, form=form)
    assert grouped.shape == plain.shape and rel_err(grouped, plain) < TOL[dtype]
    if limit is None:
        assert rel_err(grouped, read_ref(ref, q, pos)) < TOL[dtype]
    with pytest.raises(ValueError):  # a run whose queries sit at different positions
        memory.read_at(kind, k, v, g, q, pos.roll(1, dims=1), beta, chunk=chunk, form=form, group=group)
    with pytest.raises(ValueError):  # group must divide the queries
        memory.read_at(kind, k, v, g, q, pos, beta, chunk=chunk, form=form, group=5)


@pytest.mark.parametrize("kind,form", KIND_FORMS)
def test_read_at_is_safe_under_strong_decay(kind, form):
    T = 150
    k, v, g, beta = make_inputs(kind, T=T, dtype=torch.float32, seed=9, decay_scale=40.0)
    ref = reference_states(kind, k, v, g, beta)
    pos = positions(T, 64, 10, seed=10)
    q = torch.randn(2, 3, len(pos), 5, requires_grad=True)
    g = g.clone().requires_grad_()
    for limit in (None, 20):
        o = memory.read_at(kind, k, v, g, q, pos, beta, chunk=64, limit=limit, form=form)
        assert torch.isfinite(o).all()
        if limit is None:
            assert rel_err(o, read_ref(ref, q.detach(), pos.expand(2, -1))) < 1e-4
        grads = torch.autograd.grad(o.square().sum(), (q, g))
        assert all(torch.isfinite(x).all() for x in grads)


def test_bad_arguments_raise():
    k, v, g, beta = make_inputs("gdn", T=6)
    q = torch.randn(2, 3, 2, 5, dtype=torch.float64)
    with pytest.raises(ValueError):
        memory.chunked("rwkv", k, v, g, beta)
    with pytest.raises(ValueError):
        memory.chunked("gdn", k, v, g, None)
    with pytest.raises(ValueError):
        memory.read_at("gdn", k, v, g, q, torch.tensor([0, 7]), beta)  # 7 > T
    with pytest.raises(ValueError):
        memory.read_at("gdn", k, v, g, q, torch.tensor([0, 1]), beta, limit=-1)
    with pytest.raises(ValueError):
        memory.read_at("gdn", k, v, g, q, torch.tensor([0, 1]), beta, form="square")


@pytest.mark.parametrize("kind,form", KIND_FORMS)
@pytest.mark.parametrize("limit", [None, 3])
def test_read_at_gradcheck(kind, form, limit):
    k, v, g, beta = make_inputs(kind, B=1, T=7, H=2, dk=3, dv=2, seed=11)
    q = torch.randn(1, 2, 5, 3, dtype=torch.float64)
    pos = torch.tensor([0, 3, 4, 6, 7])
    leaves = [x.clone().requires_grad_() for x in (k, v, g, q)]
    if kind == "gdn":
        leaves.append(beta.clone().requires_grad_())

    def f(k, v, g, q, beta=None):
        return memory.read_at(kind, k, v, g, q, pos, beta, chunk=4, limit=limit, form=form)

    assert torch.autograd.gradcheck(f, leaves)


@pytest.mark.parametrize("kind", KINDS)
def test_chunked_gradcheck(kind):
    k, v, g, beta = make_inputs(kind, B=1, T=7, H=2, dk=3, dv=2, seed=12)
    S0 = torch.randn(1, 2, 3, 2, dtype=torch.float64) * 0.3
    leaves = [x.clone().requires_grad_() for x in (k, v, g, S0)]
    if kind == "gdn":
        leaves.append(beta.clone().requires_grad_())

    def f(k, v, g, S0, beta=None):
        return memory.chunked(kind, k, v, g, beta, S0=S0, chunk=4)

    assert torch.autograd.gradcheck(f, leaves)


def delayed_inputs(B, T, H, dk, dv, Q, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    stream = F.normalize(torch.randn(B, T + H - 1, dk, generator=gen, dtype=torch.float64), dim=-1)
    v = torch.randn(B, T, dv, generator=gen, dtype=torch.float64)
    beta = torch.sigmoid(torch.randn(B, T, generator=gen, dtype=torch.float64))
    q = torch.randn(B, Q, dk, generator=gen, dtype=torch.float64)
    pos = torch.randint(0, T + 1, (B, Q), generator=gen)
    return [x.to(dtype) for x in (stream, v, beta, q)] + [pos]


def delayed_per_head(stream, v, beta, q, H):
    """The per-head inputs of read_at that read_at_delayed stands for: head h's key at p is stream[p + H − 1 − h]."""
    B, T = v.shape[:2]
    keys = torch.stack([stream[:, H - 1 - h: H - 1 - h + T] for h in range(H)], 2)  # [B, T, H, dk]
    return (keys, v[:, :, None].expand(-1, -1, H, -1), torch.zeros(B, T, H, dtype=v.dtype), q[:, None].expand(-1, H, -1, -1),
            beta[..., None].expand(-1, -1, H))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("T,H,chunk", [(45, 3, 8), (48, 7, 16), (5, 7, 64), (1, 2, 4)])
def test_read_at_delayed_matches_the_recurrence_of_each_head(dtype, T, H, chunk):
    stream, v, beta, q, pos = delayed_inputs(2, T, H, 6, 4, 9, dtype, seed=21)
    pos[0, :2] = torch.tensor([0, T])  # the empty state and the whole sequence
    k, vh, g, qh, bh = delayed_per_head(stream, v, beta, q, H)
    expected = read_ref(reference_states("gdn", k, vh, g, bh), qh, pos)
    o = memory.read_at_delayed(stream, v, beta, q, pos, H, chunk=chunk)
    assert o.shape == (2, H, 9, 4) and o.dtype == dtype
    assert rel_err(o, expected) < TOL[dtype]
    assert not o[0, :, 0].any(), "p = 0 reads the empty state"
    # the heads differ: each reads its own delay
    assert rel_err(o[:, 0], o[:, 1]) > 1e-2


@pytest.mark.parametrize("limit", [None, 4])
def test_read_at_delayed_gradients_match_read_at(limit):
    """Whole memory (chunked form) and limited to the last 4 writes (one triangular solve per window)."""
    stream, v, beta, q, pos = delayed_inputs(1, 13, 3, 3, 2, 5, torch.float64, seed=22)
    leaves = [x.clone().requires_grad_() for x in (stream, v, beta, q)]

    def read(s, v, b, q):
        return memory.read_at_delayed(s, v, b, q, pos, 3, chunk=4, limit=limit)

    assert torch.autograd.gradcheck(read, leaves)
    out = read(*leaves)
    w = torch.randn_like(out)
    grads = torch.autograd.grad((out * w).sum(), leaves)
    ref_leaves = [x.detach().clone().requires_grad_() for x in (stream, v, beta, q)]
    k, vh, g, qh, bh = delayed_per_head(*ref_leaves, 3)
    ref = memory.read_at("gdn", k, vh, g, qh, pos, bh, chunk=4, form="chunked", limit=limit)
    for a, b in zip(grads, torch.autograd.grad((ref * w).sum(), ref_leaves)):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("T,H,N", [(45, 3, 8), (48, 7, 20), (30, 2, 1), (12, 7, 11)])
def test_read_at_delayed_limited_matches_folding_each_window(dtype, T, H, N):
    """limit=N: each query reads the delta-rule state of only the last N writes before it, folded from zero, as
    read_at's limited form does for the per-head keys (including windows that start before position 0)."""
    stream, v, beta, q, pos = delayed_inputs(2, T, H, 6, 4, 9, dtype, seed=24)
    pos[0, :3] = torch.tensor([0, T, min(N, T) // 2])  # empty, the end, a window cut by position 0
    k, vh, g, qh, bh = delayed_per_head(stream, v, beta, q, H)
    expected = memory.read_at("gdn", k, vh, g, qh, pos, bh, chunk=4, limit=N)
    o = memory.read_at_delayed(stream, v, beta, q, pos, H, limit=N)
    assert o.shape == (2, H, 9, 4) and o.dtype == dtype
    assert rel_err(o, expected) < TOL[dtype]
    assert rel_err(o, memory.read_at_delayed(stream, v, beta, q, pos, H)) > 1e-2  # the limit changes the reads
    assert not memory.read_at_delayed(stream, v, beta, q, pos, H, limit=0).any()


def test_read_at_delayed_rejects_mismatched_shapes():
    stream, v, beta, q, pos = delayed_inputs(1, 10, 3, 4, 2, 5, torch.float64, seed=23)
    with pytest.raises(ValueError, match="do not fit 4 heads"):
        memory.read_at_delayed(stream, v, beta, q, pos, 4)
