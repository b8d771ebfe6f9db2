"""Recurrent memory of the drafter: fold committed target features into a fixed-size state, read it with queries.

Per (batch, head) the state is a matrix S ∈ R^{dk×dv}. Feature t brings a key k_t ∈ R^{dk}, a value v_t ∈ R^{dv},
a log-decay g_t ≤ 0 (a_t = exp(g_t) ∈ (0, 1]) and, for gdn, a write strength β_t ∈ (0, 1):

    mamba2 (SSD, scalar decay per head):  S_t = a_t · S_{t-1} + k_t v_tᵀ
                                          (Mamba-2 mapping: k = B, v = x·Δ, g = A·Δ)
    gdn    (gated delta rule):            S_t = a_t · (I − β_t k_t k_tᵀ) S_{t-1} + β_t k_t v_tᵀ
                                          (k L2-normalised by the caller)

    read:                                 o = Sᵀ q        (q ∈ R^{dk} → o ∈ R^{dv}; S is not changed)

Three forms of the same recurrence, side by side:
    step     the exact recurrence, feature by feature (inference: commit 1..8 features per round)
    chunked  the chunk-parallel form (training, prefill)
    read_at  the state at arbitrary prefix lengths p, read by many queries at once (training)

Chunked algebra. Inside a chunk with start state S_0 and local cumulative log-decay G_i = g_1 + … + g_i
(γ_i = exp(G_i)), both kinds have the form

    S_i = γ_i S_0 + Σ_{j≤i} (γ_i/γ_j) k_j u_jᵀ                                                     (*)

with u_j = v_j for mamba2 (SSD state passing, after Dao & Gu 2024). For gdn write the update as
S_i = a_i S_{i-1} + k_i u_iᵀ, u_i = β_i (v_i − a_i S_{i-1}ᵀ k_i); substituting (*) for S_{i-1} gives

    u_i + Σ_{j<i} β_i (γ_i/γ_j) (k_iᵀ k_j) u_j = β_i v_i − β_i γ_i S_0ᵀ k_i,

i.e. (I + A) U = diag(β) V − diag(βγ) K S_0 with A strictly lower triangular, so U = U₀ − W S_0 where
U₀ = (I+A)⁻¹ diag(β) V and W = (I+A)⁻¹ diag(βγ) K do not depend on S_0 (the WY/UT form, after Yang et al.
2024, "Parallelizing Linear Transformers with the Delta Rule" and "Gated Delta Networks"). Only the cheap hand-over
S_0 → S_L is sequential over chunks. Because (*) holds at every i, the state at any position inside a chunk is
γ-decayed S_0 plus a decay-masked sum over the chunk's (transformed) values, which is what `read_at` uses.

Numerics: every decay factor is exp(G_i − G_j) with j ≤ i inside one chunk (≤ 0), and the exponent is masked
before the exp, so no exp of a large positive number appears in values or gradients.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

MEMORY_KINDS = ("mamba2", "gdn")

# `step` folds up to this many features with the exact loop; longer folds (prefill) use the chunked form.
STEP_LOOP_MAX = 16


def _check(kind: str, beta: Tensor | None) -> None:
    if kind not in MEMORY_KINDS:
        raise ValueError(f"unknown memory kind {kind!r}; expected one of {MEMORY_KINDS}")
    if kind == "gdn" and beta is None:
        raise ValueError("memory kind 'gdn' needs beta [B, T, H]")
    if kind == "mamba2" and beta is not None:
        raise ValueError("memory kind 'mamba2' takes no beta (pass None)")


def init_state(batch: int, heads: int, dk: int, dv: int, dtype: torch.dtype = torch.float32,
               device: torch.device | str | None = None) -> Tensor:
    """The empty memory: S = 0, shape [B, H, dk, dv]."""
    return torch.zeros(batch, heads, dk, dv, dtype=dtype, device=device)


def read(S: Tensor, q: Tensor) -> Tensor:
    """o = Sᵀ q.  S [B, H, dk, dv], q [B, H, Q, dk] -> [B, H, Q, dv]. Pure: S is neither changed nor aliased."""
    return torch.matmul(q, S)


def step(kind: str, S: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor | None = None) -> Tensor:
    """Fold n new features into S in order (exact recurrence) and return the NEW state; S is not mutated.

        mamba2:  S ← exp(g_t) S + k_t v_tᵀ
        gdn:     S ← exp(g_t) (S − β_t k_t (k_tᵀ S)) + β_t k_t v_tᵀ

    k [B, n, H, dk], v [B, n, H, dv], g [B, n, H], beta [B, n, H] (gdn) or None (mamba2); S [B, H, dk, dv].
    For n > STEP_LOOP_MAX (prefill) the chunked form is used, which is the same recurrence up to rounding.
    """
    _check(kind, beta)
    n = k.shape[1]
    if n > STEP_LOOP_MAX:
        return chunked(kind, k, v, g, beta, S0=S)[1]
    S = S.clone() if n == 0 else S
    a = g.exp()
    for t in range(n):
        kt, vt, at = k[:, t, :, :, None], v[:, t, :, None, :], a[:, t, :, None, None]  # [B,H,dk,1] [B,H,1,dv]
        if kind == "mamba2":
            S = at * S + kt * vt
        else:
            bt = beta[:, t, :, None, None]
            kS = (kt * S).sum(-2, keepdim=True)  # k_tᵀ S  [B, H, 1, dv]
            S = at * (S - bt * kt * kS) + bt * kt * vt
    return S


def _to_chunks(x: Tensor, L: int) -> Tensor:
    """[B, T, H, ...] -> [B, H, n_chunks, L, ...], zero-padded at the end (zero features are identity folds)."""
    x = x.movedim(1, 2)
    T = x.shape[2]
    n_chunks = -(-T // L)
    pad = n_chunks * L - T
    if pad:
        x = torch.cat([x, x.new_zeros(*x.shape[:2], pad, *x.shape[3:])], dim=2)
    return x.reshape(*x.shape[:2], n_chunks, L, *x.shape[3:])


def _scan(kind: str, k: Tensor, v: Tensor, g: Tensor, beta: Tensor | None, S0: Tensor | None, chunk: int,
          keep_states: bool = True):
    """Chunked form. Returns (states [B,H,n_chunks,dk,dv] before each chunk, or None without ``keep_states``,
    final [B,H,dk,dv], K [B,H,n_chunks,L,dk], U [B,H,n_chunks,L,dv] (v for mamba2, the transformed u for gdn),
    G [B,H,n_chunks,L]).

    The chunk loop takes its per-chunk operands from ``unbind``, whose backward stacks the gradients once; indexing
    a chunk out of the whole tensor instead makes autograd build (and zero-fill) a whole-tensor gradient per chunk,
    which dominated the backward pass for large keys."""
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")
    B, T, H, dk = k.shape
    dv = v.shape[-1]
    L = chunk
    K, V = _to_chunks(k, L), _to_chunks(v, L)
    G = _to_chunks(g, L).cumsum(-1)                                   # local cumulative log-decay G_i
    n_chunks = K.shape[2]
    Kd = K * (G[..., -1:] - G).exp()[..., None]                       # (γ_L/γ_j) k_j: decayed to the chunk end
    decay_total = G[..., -1].exp()[..., None, None]                   # γ_L per chunk  [B,H,n_chunks,1,1]
    if kind == "gdn":
        Bc = _to_chunks(beta, L)
        strict = torch.ones(L, L, dtype=torch.bool, device=k.device).tril(-1)
        seg = (G[..., :, None] - G[..., None, :]).masked_fill(~strict, float("-inf")).exp()  # γ_i/γ_j, j < i
        A = Bc[..., :, None] * seg * (K @ K.transpose(-1, -2))      # A_ij = β_i (γ_i/γ_j) k_iᵀ k_j
        IA = A + torch.eye(L, dtype=A.dtype, device=A.device)
        U0 = torch.linalg.solve_triangular(IA, Bc[..., None] * V, upper=False, unitriangular=True)
        w0 = 0 if S0 is not None else 1                               # from a zero state chunk 0 needs no W
        W = torch.linalg.solve_triangular(IA[:, :, w0:], ((Bc * G.exp())[..., None] * K)[:, :, w0:],
                                          upper=False, unitriangular=True)
    else:
        increment = Kd.transpose(-1, -2) @ V                          # Σ_j (γ_L/γ_j) k_j v_jᵀ

    S = torch.zeros(B, H, dk, dv, dtype=k.dtype, device=k.device) if S0 is None else S0
    states, us = [], []
    decays = decay_total.unbind(2)
    if kind == "gdn":
        U0s, Ws, KdTs = U0.unbind(2), W.unbind(2), Kd.transpose(-1, -2).unbind(2)
    else:
        increments = increment.unbind(2)
    for c in range(n_chunks):                                         # inter-chunk state passing
        if keep_states:
            states.append(S)
        if kind == "gdn":
            u = U0s[c] - Ws[c - w0] @ S if c >= w0 else U0s[c]        # U = U₀ − W S_0
            us.append(u)
            S = decays[c] * S + KdTs[c] @ u
        else:
            S = decays[c] * S + increments[c]
    if not keep_states:
        states = None
    elif n_chunks:
        states = torch.stack(states, 2)
    else:
        states = S.new_zeros(B, H, 0, dk, dv)
    U = (torch.stack(us, 2) if n_chunks else V) if kind == "gdn" else V
    return states, S, K, U, G


def chunked(kind: str, k: Tensor, v: Tensor, g: Tensor, beta: Tensor | None = None, S0: Tensor | None = None,
            chunk: int = 64) -> tuple[Tensor, Tensor]:
    """Chunked (training / prefill) form over a whole sequence, starting from S0 (zeros if None).

        S_end = γ_L S_0 + Σ_j (γ_L/γ_j) k_j u_jᵀ  per chunk, u = v (mamba2) or u = U₀ − W S_0 (gdn, UT form)

    k [B,T,H,dk], v [B,T,H,dv], g [B,T,H], beta [B,T,H] or None. T need not be a multiple of chunk.
    Returns (chunk_states [B, n_chunks, H, dk, dv] = state BEFORE each chunk, final_state [B, H, dk, dv]).
    """
    _check(kind, beta)
    states, final, *_ = _scan(kind, k, v, g, beta, S0, chunk)
    return states.transpose(1, 2), final


QUADRATIC_MAX = 1 << 26  # ungrouped training reads use the quadratic form up to B·H·Q·T elements


def read_at(kind: str, k: Tensor, v: Tensor, g: Tensor, q: Tensor, q_pos: Tensor, beta: Tensor | None = None,
            chunk: int = 64, limit: int | None = None, form: str = "auto", group: int = 1) -> Tensor:
    """Training-time read: o_i = read(S_{p_i}, q_i), S_p = state after folding features 0..p-1 from zero (S_0 = 0).

    With p = c·L + r (chunk c, offset r) and (*) from the module docstring:
        S_pᵀ q = γ_r S_cᵀ q + Σ_{j<r} (γ_r/γ_j) (k_jᵀ q) u_j       (u = v for mamba2, transformed u for gdn)

    k [B,T,H,dk], v [B,T,H,dv], g [B,T,H], beta [B,T,H] or None, q [B,H,Q,dk],
    q_pos LongTensor [Q] (shared over the batch) or [B,Q] with values in [0, T]. Returns [B,H,Q,dv].
    limit=N: the memory of query i holds only features max(0, p-N)..p-1, folded from a zero state.
    form: "chunked" (above), "quadratic" (o_i = Σ_{j<p} exp(Σ_{j<t<p} g_t)(k_jᵀq_i) u_j, the SSD dual form, O(Q·T); for
    gdn with the transformed values u of the chunked scan, since (*) chained over chunks makes every state such a sum;
    faster on CPU than the chunked form for ungrouped queries, which would each gather a dk × dv state), or "auto"
    (quadratic for ungrouped queries up to QUADRATIC_MAX elements, chunked otherwise).
    group=G: consecutive runs of G queries share one position (a drafting block's slots all read the state at their
    anchor); the quadratic form then builds its decay weights once per run instead of once per query.
    """
    _check(kind, beta)
    B, T, H, dk = k.shape
    Q = q.shape[2]
    pos = (q_pos.expand(B, Q) if q_pos.dim() == 1 else q_pos).to(device=k.device, dtype=torch.long)
    if pos.shape != (B, Q):
        raise ValueError(f"q_pos must be [Q] or [B, Q] with Q={Q}, B={B}; got {tuple(q_pos.shape)}")
    if pos.numel() and (int(pos.min()) < 0 or int(pos.max()) > T):
        raise ValueError(f"q_pos values must lie in [0, {T}]")
    if group < 1 or Q % group:
        raise ValueError(f"group must divide the number of queries {Q}; got {group}")
    if group > 1:
        runs = pos.view(B, Q // group, group)
        if not bool((runs == runs[..., :1]).all()):
            raise ValueError(f"group={group}: each run of {group} consecutive queries must share one position")
    if limit is not None:
        if limit < 0:
            raise ValueError(f"limit must be >= 0, got {limit}")
        if pos.numel() and limit < int(pos.max()):                    # otherwise the windows hold every prefix
            return _read_at_limited(kind, k, v, g, q, pos, beta, chunk, limit, group)
    if T == 0:
        return q.new_zeros(B, H, Q, v.shape[-1])
    if form not in ("auto", "chunked", "quadratic"):
        raise ValueError(f"form must be auto, chunked or quadratic; got {form!r}")
    if form == "quadratic" or (form == "auto" and group == 1 and B * H * Q * T <= QUADRATIC_MAX):
        if kind == "gdn":  # the values each feature's write adds, u_j, from the scan: then the sum is mamba2's
            U = _scan(kind, k, v, g, beta, None, chunk, keep_states=False)[3]  # [B, H, n_chunks, L, dv]
            v = U.flatten(2, 3)[:, :, :T].movedim(1, 2)                   # [B, T, H, dv]
        return _read_at_limited("mamba2", k, v, g, q, pos, None, chunk, T, group)  # a window of T holds every prefix

    states, final, K, U, G = _scan(kind, k, v, g, beta, None, chunk)
    L, n_chunks, n = chunk, K.shape[2], Q // group
    S_all = torch.cat([states, final[:, :, None]], 2)                 # S_all[:, :, c] = state at p = c·L
    pa = pos[:, ::group]                                              # one position per run of `group` queries
    c = torch.div(pa, L, rounding_mode="floor")
    r = pa - c * L
    bidx = torch.arange(B, device=k.device)[:, None]
    # G_r: local log-decay from the chunk start to p (0 when r = 0)
    Gr = G.reshape(B, H, n_chunks * L).gather(-1, (pa - 1).clamp(min=0)[:, None].expand(B, H, n))
    Gr = Gr.masked_fill((r == 0)[:, None], 0.0)                       # [B, H, n]
    q5 = q.view(B, H, n, group, dk)
    # chunk-start state decayed to p:  γ_r S_cᵀ q
    Sc = S_all[bidx, :, c].transpose(1, 2)                            # [B, H, n, dk, dv]
    o = Gr.exp()[..., None, None] * (q5 @ Sc)                         # [B, H, n, group, dv]
    # intra-chunk part: decay-masked attention over features c·L .. p-1
    cc = c.clamp(max=n_chunks - 1)                                    # p = T = n_chunks·L has r = 0: nothing here
    Kc, Uc, Gc = (x[bidx, :, cc].transpose(1, 2) for x in (K, U, G))  # [B,H,n,L,dk] [B,H,n,L,dv] [B,H,n,L]
    before = torch.arange(L, device=k.device) < r[:, None, :, None]   # j < r   [B, 1, n, L]
    w = (Gr[..., None] - Gc).masked_fill(~before, float("-inf")).exp()
    scores = (q5 @ Kc.transpose(-1, -2)) * w[..., None, :]            # (γ_r/γ_j) k_jᵀ q   [B, H, n, group, L]
    return (o + scores @ Uc).view(B, H, Q, -1)


def read_at_delayed(stream: Tensor, v: Tensor, beta: Tensor, q: Tensor, q_pos: Tensor, heads: int,
                    chunk: int = 64, limit: int | None = None) -> Tensor:
    """``read_at("gdn", …)`` without decay for heads that write one key stream at different delays, as the copy
    memory does: head h writes, at position p, the key ``stream[p + heads − 1 − h]`` with the value v_p and strength
    β_p (shared by all heads), and every head is read by the same query. Equal to ``read_at`` on the per-head keys
    (tested), but the per-head work is only what the recurrence needs:

    - the read's scores q_i·k are one product with the stream, shifted per head, instead of one per head;
    - with T_c = (I + A)⁻¹ of each chunk, U = T_c diag(β) V − T_c diag(β) (K S_0): K S_0 replaces the W S_0 of
      ``_scan``, so no dk-wide triangular solve and no W tensor (the gdn UT form with γ = 1).

    stream [B, T + heads − 1, dk] (L2-normalised keys), v [B, T, dv], beta [B, T], q [B, Q, dk], q_pos LongTensor
    [B, Q] with values in [0, T]. Returns [B, heads, Q, dv]: head h's state after writes 0..p−1 read by q_i.
    limit=N: after writes max(0, p − N)..p − 1 only, folded from zero (``_read_at_delayed_limited``)."""
    B, T, dv = v.shape
    H, L, dk = heads, chunk, stream.shape[-1]
    if stream.shape[:2] != (B, T + H - 1) or beta.shape != (B, T) or q.shape[0] != B or q_pos.shape != q.shape[:2]:
        raise ValueError(f"read_at_delayed: stream {tuple(stream.shape)}, v {tuple(v.shape)}, beta {tuple(beta.shape)}, "
                         f"q {tuple(q.shape)}, q_pos {tuple(q_pos.shape)} do not fit {H} heads")
    if T == 0 or limit == 0:
        return q.new_zeros(B, H, q.shape[1], dv)
    if limit is not None and limit < T:
        return _read_at_delayed_limited(stream, v, beta, q, q_pos.to(device=v.device, dtype=torch.long), H, limit)
    n_chunks = -(-T // L)
    pad = n_chunks * L - T                                            # zero writes at the end change nothing
    offsets = [H - 1 - h for h in range(H)]
    keys = torch.stack([stream[:, o: o + T] for o in offsets], 1)     # [B, H, T, dk]
    Kc = F.pad(keys, (0, 0, 0, pad)).view(B, H, n_chunks, L, dk)
    Vb = F.pad((beta[..., None] * v), (0, 0, 0, pad)).view(B, 1, n_chunks, L, dv)  # diag(β) V
    Bc = F.pad(beta, (0, pad)).view(B, 1, n_chunks, L)
    strict = torch.ones(L, L, dtype=torch.bool, device=v.device).tril(-1)
    A = (Bc[..., :, None] * (Kc @ Kc.transpose(-1, -2))).masked_fill(~strict, 0.0)  # β_i k_iᵀ k_j, j < i
    eye = torch.eye(L, dtype=A.dtype, device=A.device)
    Tc = torch.linalg.solve_triangular(A + eye, eye.expand_as(A), upper=False, unitriangular=True)  # (I + A)⁻¹
    U0 = Tc @ Vb                                                      # [B, H, n_chunks, L, dv]
    TB = Tc * Bc[..., None, :]                                        # T_c diag(β)
    S = 0  # the empty state: the first chunk's u is U₀ itself
    us = []
    for u0, tb, k in zip(U0.unbind(2), TB.unbind(2), Kc.unbind(2)):
        u = u0 - tb @ (k @ S) if us else u0
        us.append(u)
        S = S + k.transpose(-1, -2) @ u
    U = torch.stack(us, 2).flatten(2, 3)[:, :, :T]                    # [B, H, T, dv]: what each write adds
    scores = q @ stream.transpose(-1, -2)                             # [B, Q, T + H − 1]: q_i · stream[m]
    idx = torch.arange(T, device=v.device)
    per_head = torch.stack([scores[..., o: o + T] for o in offsets], 1)  # [B, H, Q, T]: q_i · k_p of head h
    before = idx < q_pos.to(device=v.device, dtype=torch.long)[..., None]  # p < position of query i  [B, Q, T]
    return per_head.masked_fill(~before[:, None], 0.0) @ U


def _read_at_delayed_limited(stream: Tensor, v: Tensor, beta: Tensor, q: Tensor, pos: Tensor, H: int,
                             N: int) -> Tensor:
    """``read_at_delayed`` with each query's memory holding only the writes of positions p − N..p − 1, folded from
    zero: for one window with keys K (rows k_t), strengths β and values V, the delta rule's state is Kᵀ U with
    (I + A) U = diag(β) V, A_ts = β_t k_tᵀ k_s for s < t (the UT form with γ = 1 and S_0 = 0, see the module
    docstring), so the read is o = Σ_t (q·k_t) u_t. One N × N triangular solve per query and head, with the keys'
    Gram matrix taken once per query window of the shared stream (head h's block is shifted by its delay), instead of
    folding each window chunk by chunk at the keys' width as ``_read_at_limited`` does. Positions before 0 write
    nothing (β = 0)."""
    B, T, dv = v.shape
    Q = q.shape[1]
    E = N + H - 1                                                     # stream rows a window's heads touch
    idx = pos[..., None] - N + torch.arange(N, device=v.device)       # write positions of each window [B, Q, N]
    valid = idx >= 0
    sidx = pos[..., None] - N + torch.arange(E, device=v.device)      # their stream rows (head h: + H − 1 − h)
    bidx = torch.arange(B, device=v.device)[:, None, None]
    ks = stream[bidx, sidx.clamp(min=0)]                              # [B, Q, E, dk] (rows before 0 unused)
    gram = ks @ ks.transpose(-1, -2)                                  # [B, Q, E, E]
    qk = (ks @ q[..., None]).squeeze(-1)                              # [B, Q, E]: q_i · stream rows
    bw = (beta[bidx, idx.clamp(min=0)] * valid).to(v.dtype)           # [B, Q, N]
    vw = v[bidx, idx.clamp(min=0)] * bw[..., None]                    # diag(β) V   [B, Q, N, dv]
    strict = torch.ones(N, N, dtype=torch.bool, device=v.device).tril(-1)
    eye = torch.eye(N, dtype=v.dtype, device=v.device)
    outs = []
    for h in range(H):
        o = H - 1 - h
        A = (bw[..., :, None] * gram[..., o:o + N, o:o + N]).masked_fill(~strict, 0.0)
        U = torch.linalg.solve_triangular(A + eye, vw, upper=False, unitriangular=True)  # [B, Q, N, dv]
        outs.append((qk[..., None, o:o + N] @ U).squeeze(-2))        # Σ_t (q·k_t) u_t   [B, Q, dv]
    return torch.stack(outs, 1)


def _read_at_limited(kind: str, k: Tensor, v: Tensor, g: Tensor, q: Tensor, pos: Tensor, beta: Tensor | None,
                     chunk: int, N: int, group: int = 1) -> Tensor:
    """read_at with the memory restricted to the last N features before each query position."""
    B, T, H, dk = k.shape
    Q, dv = q.shape[2], v.shape[-1]
    if N == 0:
        return q.new_zeros(B, H, Q, dv)
    if kind == "mamba2":
        # quadratic SSD form, o_i = Σ_{p-N ≤ j < p} exp(Σ_{j<t<p} g_t) (k_jᵀ q_i) v_j, with the decay weights built
        # once per run of `group` queries at one position. Prefix sums and their differences in float64 so that
        # they do not cancel; the weights themselves in the working precision (float32 unless checking in float64).
        n = Q // group
        pa = pos[:, ::group]                                             # [B, n]
        Gx = F.pad(g.double().cumsum(1), (0, 0, 1, 0)).movedim(1, 2)   # Gx[..., p] = Σ_{t<p} g_t   [B, H, T+1]
        Gp = Gx.gather(-1, pa[:, None].expand(B, H, n))               # [B, H, n]
        j = torch.arange(T, device=k.device)
        inside = (j < pa[..., None]) & (j >= pa[..., None] - N)       # [B, n, T]
        wd = torch.float64 if q.dtype == torch.float64 else torch.float32
        w = (Gp[..., None] - Gx[..., None, 1:]).to(wd).masked_fill(~inside[:, None], float("-inf")).exp().to(q.dtype)
        scores = torch.einsum("bhqd,bthd->bhqt", q, k).view(B, H, n, group, T) * w[:, :, :, None]
        return torch.einsum("bhqt,bthe->bhqe", scores.view(B, H, Q, T), v)
    # gdn: fold each window p-N .. p-1 from a zero state (left-padded with identity folds: k = v = g = β = 0)
    idx = pos[..., None] - N + torch.arange(N, device=k.device)       # [B, Q, N]
    valid = (idx >= 0)[..., None]
    bidx = torch.arange(B, device=k.device)[:, None, None]

    def windows(x: Tensor) -> Tensor:                                 # [B, T, H, ...] -> [B·Q, N, H, ...]
        xw = x[bidx, idx.clamp(min=0)]
        xw = xw * valid.reshape(*valid.shape, *([1] * (xw.dim() - valid.dim())))
        return xw.reshape(B * Q, N, *x.shape[2:])

    _, S = _scan(kind, windows(k), windows(v), windows(g), windows(beta), None, min(chunk, N))[:2]
    S = S.reshape(B, Q, H, dk, dv).transpose(1, 2)                    # [B, H, Q, dk, dv]
    return (q[..., None, :] @ S).squeeze(-2)
