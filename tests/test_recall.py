"""Recall sequences copy earlier passages verbatim at near and far distances, skip held-out text, and train as a
mixture with the base store, which keeps its own held-out split."""

import json

import numpy as np
import pytest

from hyflash import HyflashError
from hyflash.data.recall import build_recall, copy_follow_rate, recall_sequence
from hyflash.train import MixedStore, split_indices, split_store, train
from test_train import FakeStore, target, tiny_config  # noqa: F401 (target: a fixture)


def test_every_copy_repeats_an_earlier_passage_near_or_far():
    base = list(range(10_000, 12_048))  # distinct tokens: a copy's source is found by value
    near = far = 0
    for seed in range(5):
        ids, spans = recall_sequence(base, np.random.default_rng(seed), max_len=2048, near_max=224, far_min=320)
        assert len(ids) <= 2048 and spans
        rest = [t for i, t in enumerate(ids) if not any(s <= i < e for s, e in spans)]
        assert rest == base[:len(rest)]  # outside the copies, the base text in order
        for s, e in spans:
            assert 32 <= e - s <= 96 or e == len(ids)
            # where the passage occurred before (a copy may itself contain an earlier copy: several places)
            dists = [s - k for k in range(s) if ids[k:k + e - s] == ids[s:e]]
            fits = [d for d in dists if d <= 224 or d >= 320 + (e - s)]
            assert fits, (s, e, dists)
            near, far = near + (min(fits) <= 224), far + (min(fits) > 224)
    assert near and far


@pytest.mark.parametrize("far_fraction", [0.0, 1.0])
def test_far_fraction_gives_stores_of_near_or_far_copies_only(far_fraction):
    """--far-fraction 0 / 1: every copy's source lies within near_max / at least far_min + its length back (a
    store per kind, so that training logs each kind's held-out acceptance apart)."""
    base = list(range(10_000, 12_048))
    for seed in range(5):
        ids, spans = recall_sequence(base, np.random.default_rng(seed), far_fraction=far_fraction)
        assert spans
        for s, e in spans:
            d = min(s - k for k in range(s) if ids[k:k + e - s] == ids[s:e])
            assert (d >= 320 + (e - s)) if far_fraction == 1.0 else (d <= 224), (far_fraction, s, e, d)
    with pytest.raises(HyflashError, match="far_fraction"):
        recall_sequence(base, np.random.default_rng(0), far_fraction=1.5)


def test_recall_data_skips_the_recipes_held_out_sequences(tmp_path):
    seqs = [{"id": f"s{i}", "kind": "document", "ids": list(range(i * 3000, i * 3000 + 1600)), "spans": [[1, 1600]]}
            for i in range(50)]
    path = tmp_path / "sequences.jsonl"
    path.write_text("".join(json.dumps(s) + "\n" for s in seqs))
    recipe = tmp_path / "r.json"
    recipe.write_text(json.dumps({"val_fraction": 0.1, "val_sequences": 5}))
    meta = build_recall(path, tmp_path / "recall.jsonl", count=100, recipe=str(recipe))
    _, val = split_indices(50, tiny_config(val_fraction=0.1, val_sequences=5))
    held = {f"s{int(i)}" for i in val}
    out = [json.loads(line) for line in open(tmp_path / "recall.jsonl")]
    assert meta["held_out_skipped"] == 5 and len(out) == 45
    assert all(r["kind"] == "recall" and r["id"].removeprefix("recall/") not in held for r in out)
    with pytest.raises(HyflashError, match="no sequence"):
        build_recall(path, tmp_path / "none.jsonl", min_len=5000)


def test_a_mixture_keeps_each_stores_held_out_split(target, tmp_path):
    a, b = FakeStore(target, n=10, seed=0), FakeStore(target, n=6, seed=1)
    mix = MixedStore([a, b])
    assert len(mix) == 16 and mix[12] is b[2] and mix[3] is a[3]
    cfg = tiny_config(val_fraction=0.2, val_sequences=2)
    train_idx, val_idx = split_store(mix, cfg)
    alone_train, alone_val = split_indices(10, cfg)
    assert np.array_equal(val_idx[val_idx < 10], alone_val)  # the base store validates where it did alone
    assert np.array_equal(train_idx[train_idx < 10], alone_train)
    assert sorted(np.concatenate([train_idx, val_idx]).tolist()) == list(range(16))
    a.config, b.config = {"feature_layers": [0, 1]}, {"feature_layers": [1, 2]}
    with pytest.raises(HyflashError, match="different target layers"):
        MixedStore([a, b])
    b.config = {"online": True}  # an online store computes whatever layers the drafter reads
    assert MixedStore([b, a]).config == {"feature_layers": [0, 1]}
    del a.config, b.config
    train(tiny_config(steps=3, eval_every=3, ckpt_every=3), tmp_path, target, mix)
    last = [json.loads(line) for line in open(tmp_path / "log.jsonl")][-1]
    assert len(last["val_tau_parts"]) == 2 and all(t >= 1.0 for t in last["val_tau_parts"])


def test_the_recall_stage_is_the_same_for_every_variant():
    """Equal budgets: the recall stage of HyFlash, sliding window and no slot attention differs only in the drafter
    (each its first stage's) and where it starts from."""
    from hyflash.train import load_recipe

    stages = {v: load_recipe(f"smollm2-{v}-recall").to_dict() for v in ("hyflash", "swa", "noslot")}
    firsts = {"hyflash": "smollm2-hyflash", "swa": "smollm2-swa", "noslot": "smollm2-hyflash-noslot"}
    for v, d in stages.items():
        assert d["drafter"] == load_recipe(firsts[v]).to_dict()["drafter"]
        assert d["init_from"] == f"runs/{v}/final" and d["kind_weights"]["recall"] > 0 and len(d["data"]) == 2
    rest = [{k: x for k, x in d.items() if k not in ("drafter", "init_from")} for d in stages.values()]
    assert all(r == rest[0] for r in rest)


def test_copy_follow_rate_counts_where_the_targets_token_continues_the_copy():
    ids = np.array([5, 6, 7, 8, 5, 6, 7, 8, 9])
    labels = np.array([0, 0, 0, 0, 6, 7, 0, 0, 0])  # continues the copy [4, 8) at 4 and 5, not at 6
    rate, n, by_off = copy_follow_rate([{"input_ids": ids, "labels": labels, "spans": [[4, 8]]}], by_offset=3)
    assert n == 3 and rate == pytest.approx(2 / 3) and by_off == [1.0, 1.0, 0.0]


def test_the_copy_recipes_differ_only_in_the_drafter():
    """Equal budgets: the four copy-only recipes share data, schedule and seed; each drafter differs from HyFlash's
    in its one ablation field (the sliding window also in its MLP width, which matches parameters)."""
    from hyflash.train import load_recipe

    r = {v: load_recipe(f"smollm2-copy-{v}").to_dict() for v in ("hyflash", "noslot", "swa", "gdn")}
    rest = {v: {k: x for k, x in d.items() if k not in ("drafter", "_comment")} for v, d in r.items()}
    assert all(x == rest["hyflash"] for x in rest.values())
    assert rest["hyflash"]["data"] == ["data/copy/feat/near", "data/copy/feat/far"]
    base = r["hyflash"]["drafter"]
    diff = {v: {k for k in base if d["drafter"][k] != base[k]} for v, d in r.items()}
    assert diff == {"hyflash": set(), "noslot": {"slot_attention"}, "swa": {"variant", "intermediate_size"},
                    "gdn": {"memory"}}
    for v in ("hyflash", "noslot", "swa"):  # the lagged-context runs: the same recipe with lags 7 of rank 64 added
        lags = load_recipe(f"smollm2-copy-{v}-lags").to_dict()
        assert {k: x for k, x in lags.items() if k not in ("drafter", "_comment")} == rest["hyflash"]
        assert lags["drafter"] == {**r[v]["drafter"], "context_lags": 7, "context_lag_rank": 64}
    for v in ("hyflash", "noslot", "swa"):  # the copy-head runs: rank 64; HyFlash and no-slot also with its memory
        for name, extra in (("copyhead", {}), ("copymem", {"copy_memory": True})):
            if v == "swa" and name == "copymem":
                continue  # the sliding window has no memory
            ch = load_recipe(f"smollm2-copy-{v}-{name}").to_dict()
            assert {k: x for k, x in ch.items() if k not in ("drafter", "_comment")} == rest["hyflash"]
            assert ch["drafter"] == {**r[v]["drafter"], "copy_head_rank": 64, **extra}
        tok = load_recipe(f"smollm2-copy-{v}-copytok").to_dict()  # the copy head reading the tokens too
        assert {k: x for k, x in tok.items() if k not in ("drafter", "_comment")} == rest["hyflash"]
        assert tok["drafter"] == {**r[v]["drafter"], "copy_head_rank": 64, "copy_head_tokens": True}
    far = load_recipe("smollm2-copy-hyflash-copymemtok").to_dict()  # ... with its memory, rank 128, for far copies
    assert {k: x for k, x in far.items() if k not in ("drafter", "_comment")} == rest["hyflash"]
    assert far["drafter"] == {**r["hyflash"]["drafter"], "copy_head_rank": 128, "copy_head_tokens": True,
                              "copy_memory": True}
    dpfp = load_recipe("smollm2-copy-hyflash-copymemtok-dpfp4").to_dict()  # its keys DPFP-expanded, and one change each
    assert {k: x for k, x in dpfp.items() if k not in ("drafter", "_comment")} == rest["hyflash"]
    assert dpfp["drafter"] == {**far["drafter"], "copy_memory_dpfp": 4}
    for name, extra in (("gate", {"copy_memory_gate": True}), ("mem256", {"memory_limit": 256}),
                        ("delay256", {"copy_memory_delay": 256})):
        one = load_recipe(f"smollm2-copy-hyflash-copymemtok-dpfp4-{name}").to_dict()
        assert {k: x for k, x in one.items() if k not in ("drafter", "_comment")} == rest["hyflash"]
        assert one["drafter"] == {**dpfp["drafter"], **extra}
    noslot = load_recipe("smollm2-copy-noslot-copymemtok-dpfp4").to_dict()  # its no-slot-attention ablation
    assert {k: x for k, x in noslot.items() if k not in ("drafter", "_comment")} == rest["hyflash"]
    assert noslot["drafter"] == {**dpfp["drafter"], "slot_attention": False}


def test_short_recall_sequences_from_chunked_documents(tmp_path):
    """The command line builds recall data for a short training length: base sequences cut into chunks, every
    sequence at most --max-len tokens, every far copy's source at least --far-min + its length back, and each
    chunk used at most once."""
    from hyflash.data.recall import main

    path = tmp_path / "base.jsonl"
    with open(path, "w") as f:
        for k in range(4):  # distinct tokens everywhere: a copy's source is found by value
            f.write(json.dumps({"id": f"doc{k}", "ids": list(range(10_000 * (k + 1), 10_000 * (k + 1) + 3000))})
                    + "\n")
    out = tmp_path / "far.jsonl"
    assert main(["--sequences", str(path), "--out", str(out), "--count", "20", "--min-len", "512", "--chunk", "512",
                 "--max-len", "512", "--far-min", "272", "--lead", "288", "384", "--gap", "32", "128",
                 "--far-fraction", "1"]) == 0
    rows = [json.loads(line) for line in open(out)]
    assert len(rows) == 20  # 4 documents of 3,000 tokens: 5 chunks each
    assert len({r["id"] for r in rows}) == 20 and all("@" in r["id"] for r in rows)
    with_copy = 0
    for r in rows:
        ids, spans = r["ids"], r["spans"]
        assert len(ids) <= 512
        for s, e in spans:
            d = min(s - k for k in range(s) if ids[k:k + e - s] == ids[s:e])
            assert d >= 272 + (e - s), (s, e, d)
        with_copy += bool(spans)
    assert with_copy >= 15  # the lead leaves room for a far copy in most sequences
    near = tmp_path / "near.jsonl"  # a lead shorter than a copy: base text comes first, then near copies
    assert main(["--sequences", str(path), "--out", str(near), "--count", "20", "--min-len", "512", "--chunk", "512",
                 "--max-len", "512", "--lead", "16", "64", "--gap", "32", "128", "--far-fraction", "0"]) == 0
    for r in map(json.loads, open(near)):
        assert len(r["ids"]) <= 512 and r["spans"]
        for s, e in r["spans"]:
            assert min(s - k for k in range(s) if r["ids"][k:k + e - s] == r["ids"][s:e]) <= 224
    meta = json.loads(out.with_suffix(".meta.json").read_text())
    assert meta["inputs"]["chunk"] == 512 and meta["inputs"]["max_len"] == 512 and meta["inputs"]["lead"] == [288, 384]
