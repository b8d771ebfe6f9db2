"""The training loop: it learns, resumes bit-for-bit, exports a lossless drafter, samples anchors inside the spans,
weights slots as specified; the recipes match their parameter budgets."""

import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from conftest import tiny_llama
from hyflash.decoding import generate
from hyflash.drafter.config import DrafterConfig
from hyflash.drafter.model import HyFlashDrafter, from_pretrained
from hyflash.proposers import HyFlashProposer
from hyflash import HyflashError
from hyflash.train import (TrainConfig, block_loss, block_targets, checkpoints, distill_term, init_from_target,
                           load_recipe, make_batch, position_weights, sequence_ids, top_half_layers, train)

VOCAB = 32
DRAFTER = dict(num_layers=2, block_size=4, window=6, hidden_size=32, num_heads=4, num_kv_heads=2, head_dim=8,
               intermediate_size=64, memory_heads=2, memory_head_dim=8, memory_state_dim=8, target_layers=[0, 1])


class FakeStore:
    """An in-memory feature store made with the tiny target's real forward: the prompt is random, the answer is the
    target's own greedy continuation (as regenerated data is), spans cover the answer."""

    def __init__(self, target, n=10, prompt_len=8, answer_len=40, k=8, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.items = []
        for _ in range(n):
            prompt = torch.randint(1, VOCAB - 1, (prompt_len,), generator=g).tolist()
            answer = generate(target, prompt, None, max_new_tokens=answer_len).token_ids
            ids = torch.tensor(prompt + answer)
            out = target.forward(ids, target.new_cache())
            logp = out.logits.log_softmax(-1)
            vals, top = logp.topk(k, dim=-1)
            self.items.append(dict(features=out.features.to(torch.bfloat16), input_ids=ids,
                                   labels=out.logits.argmax(-1), spans=[[prompt_len, len(ids)]],
                                   topk_vals=vals.half(), topk_ids=top.int()))

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return self.items[i]


def tiny_target():
    t = tiny_llama(vocab=VOCAB, hidden=32)
    with torch.no_grad():  # a random model's logits are near-uniform; sharpen them (greedy tokens are unchanged)
        t.model.lm_head.weight.mul_(30)
    return t


@pytest.fixture(scope="module")
def target():
    torch.set_num_threads(1)
    return tiny_target()


@pytest.fixture(scope="module")
def store(target):
    return FakeStore(target)


def tiny_config(**kw) -> TrainConfig:
    base = dict(drafter=dict(DRAFTER), seq_len=64, anchors_per_seq=8, batch_seqs=2, steps=6, lr=3e-3, min_lr=3e-4,
                warmup=0.1, val_fraction=0.2, val_sequences=2, ckpt_every=3, eval_every=3, seed=0, bf16=True)
    return TrainConfig(**{**base, **kw})


def params(drafter):
    return {k: v.detach().clone() for k, v in drafter.named_parameters()}


# ------------------------------------------------------------------------------------------------ learning
def test_loss_decreases_on_memorisable_fixture(target, store, tmp_path):
    train(tiny_config(steps=30, eval_every=30, ckpt_every=30), tmp_path, target, store)
    log = [json.loads(line) for line in (tmp_path / "log.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in log]
    assert len(losses) == 30
    assert np.mean(losses[-5:]) < 0.6 * np.mean(losses[:5])
    assert np.mean([r["acc"][0] for r in log[-5:]]) > np.mean([r["acc"][0] for r in log[:5]]) + 0.2
    assert len(log[-1]["acc"]) == 4 and 1.0 <= log[-1]["val_tau"] <= 5.0
    assert {"step", "loss", "acc", "lr", "anchors_per_s", "elapsed", "data_s", "step_s"} <= set(log[0])
    # where a step's time goes: the batch (the store; on a GPU an online target's forward) is part of the step
    assert all(0 <= r["data_s"] <= r["step_s"] for r in log)


def test_validation_logs_how_far_each_memory_head_reaches(target, store, tmp_path):
    """Each validation logs every memory head's median half-life on the held-out features (val_half_life, per
    layer): the figure that shows a memory collapsing to short range while training; a floored head stays above its
    floor."""
    cfg = tiny_config(steps=3, eval_every=3, ckpt_every=3,
                      drafter={**DRAFTER, "memory_long_heads": 1, "memory_min_half_life": 100.0})
    train(cfg, tmp_path, target, store)
    rec = [json.loads(line) for line in (tmp_path / "log.jsonl").read_text().splitlines()][-1]
    hl = rec["val_half_life"]
    assert len(hl) == 2 and all(len(layer) == 2 for layer in hl)
    assert all(layer[0] >= 100 for layer in hl) and all(0 < h for layer in hl for h in layer)
    train(tiny_config(steps=3, eval_every=3, ckpt_every=3, drafter={**DRAFTER, "variant": "swa"}), tmp_path / "swa",
          target, store)
    rec = [json.loads(line) for line in (tmp_path / "swa" / "log.jsonl").read_text().splitlines()][-1]
    assert "val_tau" in rec and "val_half_life" not in rec  # no memory, no figure


# --------------------------------------------------------------------------------------------- resume
@pytest.mark.parametrize("draft_vocab", [0, 12], ids=["full-vocab", "draft-vocab"])
def test_killed_and_resumed_run_reaches_the_same_weights(target, store, tmp_path, draft_vocab):
    cfg = tiny_config(steps=6, ckpt_every=1, kl_weight=0.5, draft_vocab=draft_vocab)
    straight = params(train(cfg, tmp_path / "straight", target, store))
    train(cfg, tmp_path / "killed", target, store, stop_at=3)  # "killed" after step 3
    assert [p.name for p in checkpoints(tmp_path / "killed")] == ["step_0000002.pt", "step_0000003.pt"]
    assert not (tmp_path / "killed" / "final").exists()
    resumed = params(train(cfg, tmp_path / "killed", target, store))
    assert straight.keys() == resumed.keys()
    assert all(torch.equal(straight[k], resumed[k]) for k in straight)
    log = [json.loads(line)["step"] for line in (tmp_path / "killed" / "log.jsonl").read_text().splitlines()]
    assert log == [1, 2, 3, 4, 5, 6]
    ckpt = torch.load(checkpoints(tmp_path / "killed")[-1], weights_only=False)
    assert {"model", "optimizer", "scheduler", "step", "rng", "data_position"} <= set(ckpt)
    assert ckpt["data_position"] == 6 * cfg.batch_seqs


def test_a_run_stopped_early_exports_its_latest_checkpoint(target, store, tmp_path):
    from hyflash.train import export_latest

    cfg = tiny_config(steps=6, ckpt_every=2, draft_vocab=16)
    stopped = params(train(cfg, tmp_path, target, store, stop_at=4))  # the checkpoint of step 4 is the latest
    with pytest.raises(HyflashError, match="no checkpoints"):
        export_latest(tmp_path / "elsewhere", target)
    exported = from_pretrained(export_latest(tmp_path, target), target)
    for k, v in stopped.items():
        assert torch.equal(exported.state_dict()[k], v.to(torch.bfloat16).to(exported.state_dict()[k].dtype)), k
    assert torch.equal(exported.draft_vocab, train(cfg, tmp_path / "again", target, store, stop_at=1).draft_vocab)


def test_recipe_fields_are_overridden_from_the_command_line():
    from hyflash.train import apply_overrides

    cfg = apply_overrides(tiny_config(), ["batch_seqs=32", "lr=3e-4", "target=some/dir", "kind_weights={\"packed\": 5}",
                                          "device=auto"])
    assert (cfg.batch_seqs, cfg.lr, cfg.target, cfg.kind_weights, cfg.device) == (32, 3e-4, "some/dir",
                                                                                    {"packed": 5}, "auto")
    with pytest.raises(HyflashError, match="unknown fields"):
        apply_overrides(cfg, ["batch_size=3"])
    with pytest.raises(HyflashError, match="FIELD=VALUE"):
        apply_overrides(cfg, ["batch_seqs"])
    for bad in ("eval_every=0", "ckpt_every=0", "keep_checkpoints=-1"):  # checked up front, not a crash at step 1
        with pytest.raises(HyflashError, match=bad.split("=")[0] + ".* must be >="):
            apply_overrides(cfg, [bad])
    assert apply_overrides(cfg, ["keep_checkpoints=0"]).keep_checkpoints == 0  # keeps them all


@pytest.mark.parametrize("fast", [True, False], ids=["bf16-cpu", "avx2-cpu"])
def test_bf16_auto_trains_in_fp32_on_a_cpu_without_bf16_dot_products(target, store, tmp_path, monkeypatch, capsys,
                                                                     fast):
    """bf16 autocast is many times slower than fp32 where the CPU has no bf16 dot products: "auto" (the recipes')
    trains in fp32 there and says so, and each run's train_config.json records the precision it ran in."""
    import hyflash.kernels
    from hyflash.train import autocast_bf16

    monkeypatch.setattr(hyflash.kernels, "cpu_has_fast_bf16", lambda: fast)
    cpu = torch.device("cpu")
    assert autocast_bf16("auto", cpu)[0] is fast
    assert autocast_bf16("auto", torch.device("cuda"))[0] is True  # a GPU: bf16 whatever the CPU
    assert autocast_bf16(False, cpu) == (False, None)
    forced, warning = autocast_bf16(True, cpu)
    assert forced is True and (warning is None) is fast  # true forces bf16, with a warning where it is slow
    train(tiny_config(steps=2, ckpt_every=2, eval_every=2, bf16="auto"), tmp_path, target, store)
    assert json.loads((tmp_path / "train_config.json").read_text())["bf16"] is fast
    assert ("training in fp32" in capsys.readouterr().err) is not fast
    assert load_recipe("gemma3-hyflash").bf16 == "auto"
    with pytest.raises(HyflashError, match="bf16 must be"):
        tiny_config(bf16="yes")


def test_cpu_has_fast_bf16_reads_the_cpus_flags(monkeypatch):
    import hyflash.kernels as k

    for flags, fast in [({"avx2", "fma"}, False), ({"avx512f", "avx512_bf16"}, True), ({"amx_bf16"}, True)]:
        monkeypatch.setattr(k, "cpu_is_aarch64_linux", lambda: False)
        monkeypatch.setattr(k, "cpu_flags", lambda flags=flags: frozenset(flags))
        assert k.cpu_has_fast_bf16() is fast
    monkeypatch.setattr(k, "cpu_is_aarch64_linux", lambda: True)  # Arm: the BF16 extension in its "Features"
    for features, fast in [({"fp", "asimd"}, False), ({"fp", "asimd", "bf16"}, True)]:
        monkeypatch.setattr(k, "arm_features", lambda features=features: frozenset(features))
        assert k.cpu_has_fast_bf16() is fast
    monkeypatch.setenv("HYFLASH_FAST_BF16", "0")  # the override, whatever the CPU has
    assert k.cpu_has_fast_bf16() is False
    monkeypatch.setenv("HYFLASH_FAST_BF16", "1")
    monkeypatch.setattr(k, "arm_features", lambda: frozenset())
    assert k.cpu_has_fast_bf16() is True
    monkeypatch.setenv("HYFLASH_FAST_BF16", "yes")
    with pytest.raises(HyflashError, match="HYFLASH_FAST_BF16='yes'"):
        k.cpu_has_fast_bf16()


def test_no_resume_refuses_a_directory_with_checkpoints(target, store, tmp_path):
    cfg = tiny_config(steps=2, ckpt_every=1)
    train(cfg, tmp_path, target, store)
    with pytest.raises(ValueError, match="already holds checkpoints"):
        train(cfg, tmp_path, target, store, resume=False)


# ------------------------------------------------------------------------------- drafters trained together
def _log(run_dir):
    return [json.loads(line) for line in (run_dir / "log.jsonl").read_text().splitlines()]


def together_configs():
    """Two recipes that share the batches but not the drafter, loss or optimiser (one with a draft vocabulary)."""
    return [tiny_config(steps=6, ckpt_every=2, kl_weight=0.5, draft_vocab=12, init_from_target=True),
            tiny_config(steps=6, ckpt_every=2, lr=1e-3, drafter={**DRAFTER, "variant": "full", "num_layers": 1})]


def test_drafters_trained_together_match_drafters_trained_alone(target, store, tmp_path):
    """One batch (one target forward, online) for several drafters: each ends with the weights and the log it gets
    when trained alone, and its own final/ export."""
    from hyflash.train import train_many

    cfgs = together_configs()
    together = train_many(cfgs, [tmp_path / "a", tmp_path / "b"], target, store)
    for cfg, got, name in zip(cfgs, together, "ab"):
        alone = params(train(cfg, tmp_path / f"alone-{name}", target, store))
        assert all(torch.equal(alone[k], v) for k, v in params(got).items())
        log, log_alone = _log(tmp_path / name), _log(tmp_path / f"alone-{name}")
        assert [r["loss"] for r in log] == [r["loss"] for r in log_alone]
        assert [r.get("val_tau") for r in log] == [r.get("val_tau") for r in log_alone]
        assert all(r["drafters_sharing_batch"] == 2 and 0 <= r["data_s"] <= r["step_s"] for r in log)
        assert (tmp_path / name / "final" / "model.safetensors").exists()
    assert together[0].draft_vocab is not None and together[1].draft_vocab is None


def test_drafters_trained_together_resume_from_their_last_common_checkpoint(target, store, tmp_path):
    """Killed after step 4; one run's step-4 checkpoint is then lost (as if killed between the two saves): the group
    resumes both from step 2 and reaches the uninterrupted weights. Runs with no common step are refused."""
    from hyflash.train import train_many

    cfgs = together_configs()
    straight = [params(d) for d in train_many(cfgs, [tmp_path / "s1", tmp_path / "s2"], target, store)]
    dirs = [tmp_path / "k1", tmp_path / "k2"]
    train_many(cfgs, dirs, target, store, stop_at=4)
    checkpoints(dirs[1])[-1].unlink()
    assert [p.name for p in checkpoints(dirs[0])] == ["step_0000002.pt", "step_0000004.pt"]
    resumed = [params(d) for d in train_many(cfgs, dirs, target, store)]
    for want, got in zip(straight, resumed):
        assert all(torch.equal(want[k], got[k]) for k in want)
    assert [r["step"] for r in _log(dirs[1])] == [1, 2, 3, 4, 5, 6]
    for c in checkpoints(dirs[1]):
        c.unlink()
    with pytest.raises(HyflashError, match="no checkpoint of a common step"):
        train_many(cfgs, dirs, target, store)


def test_recipes_that_would_read_different_batches_are_not_trained_together(target, store, tmp_path):
    from hyflash.train import train_many

    cfgs = together_configs()
    for change in [dict(seed=1), dict(anchors_per_seq=4), dict(drafter={**DRAFTER, "target_layers": [1]})]:
        other = TrainConfig.from_dict({**cfgs[1].to_dict(), **change})
        field = "target_layers" if "drafter" in change else next(iter(change))
        with pytest.raises(HyflashError, match=f"differ in .*{field}"):
            train_many([cfgs[0], other], [tmp_path / "a", tmp_path / "b"], target, store)
    with pytest.raises(HyflashError, match="same directory"):
        train_many(cfgs, [tmp_path / "a", tmp_path / "a"], target, store)
    assert not (tmp_path / "a").exists()  # refused before anything was written


# ------------------------------------------------------------------------------------------- the export
def test_final_checkpoint_drives_lossless_decoding(target, store, tmp_path):
    train(tiny_config(steps=4, init_from_target=True), tmp_path, target, store)
    assert (tmp_path / "train_config.json").exists() and (tmp_path / "loss.png").exists()
    drafter = from_pretrained(tmp_path / "final", target)
    prompt = torch.randint(1, VOCAB - 1, (12,), generator=torch.Generator().manual_seed(5)).tolist()
    plain = generate(target, prompt, None, max_new_tokens=30)
    spec = generate(target, prompt, HyFlashProposer(drafter), max_new_tokens=30)
    assert spec.token_ids == plain.token_ids
    assert spec.stats.rounds < len(plain.token_ids)  # it drafted (and some drafts were accepted)


def test_held_out_split_does_not_depend_on_the_training_seed():
    """A second stage with another data-order seed must validate on the first stage's held-out sequences (never
    trained on), so the split has its own seed."""
    from hyflash.train import split_indices

    a, b = split_indices(100, tiny_config(seed=0, val_sequences=5)), split_indices(100, tiny_config(seed=1, val_sequences=5))
    assert np.array_equal(a[1], b[1]) and np.array_equal(a[0], b[0])
    c = split_indices(100, tiny_config(seed=0, val_sequences=5, split_seed=3))
    assert not np.array_equal(a[1], c[1])


def test_validation_crops_and_anchors_do_not_depend_on_the_training_seed(store):
    """The same held-out sequences are not enough: a later stage with a new data-order seed must score the same crops
    and anchors too, or its τ̂ is not comparable with the earlier stage's (long documents crop anywhere)."""
    from hyflash.train import split_store, validation_batches

    def batches(**kw):
        cfg = tiny_config(val_sequences=4, seq_len=24, **kw)
        return list(validation_batches(store, split_store(store, cfg)[1], cfg))

    a, b, c = batches(seed=0), batches(seed=1), batches(seed=0, split_seed=3)
    assert len(a) == len(b) > 0
    for x, y in zip(a, b):
        assert torch.equal(x["anchors"], y["anchors"]) and torch.equal(x["input_ids"], y["input_ids"])
    assert any(not torch.equal(x["input_ids"], y["input_ids"]) or not torch.equal(x["anchors"], y["anchors"])
               for x, y in zip(a, c))


def test_second_stage_starts_from_the_first_stages_drafter(target, store, tmp_path):
    """init_from: stage 2 begins with stage 1's exported weights and draft vocabulary (its step-0 validation τ̂
    equals the exported drafter's); a drafter of another shape is refused with a clear error."""
    train(tiny_config(steps=8, draft_vocab=12), tmp_path / "one", target, store)
    first = from_pretrained(tmp_path / "one" / "final", target, dtype=torch.float32)
    stage2 = tiny_config(steps=1, lr=1e-30, min_lr=1e-30, draft_vocab=12, init_from=str(tmp_path / "one" / "final"))
    second = train(stage2, tmp_path / "two", target, store)
    assert torch.equal(second.draft_vocab, first.draft_vocab)
    got, want = second.state_dict(), first.state_dict()
    assert all(torch.equal(got[k], want[k]) for k in want)  # lr 1e-30: one step moves nothing
    other = tiny_config(steps=1, draft_vocab=12, init_from=str(tmp_path / "one" / "final"),
                        drafter={**DRAFTER, "intermediate_size": 48})
    with pytest.raises(HyflashError, match="intermediate_size"):
        train(other, tmp_path / "three", target, store)


def test_draft_vocabulary_read_from_a_file_or_a_drafter(target, store, tmp_path):
    """draft_vocab_from: the vocabulary comes from a JSON list of ids or a saved drafter instead of counting labels
    (a GPU run with an online store would otherwise run the target over every training sequence first); a list of
    the wrong size, repeated ids, ids past the target's vocabulary and a missing file are refused."""
    train(tiny_config(steps=2, draft_vocab=12), tmp_path / "one", target, store)
    counted = from_pretrained(tmp_path / "one" / "final", target).draft_vocab
    chosen = [31, 0, 5, 7, 9, 11, 13, 2, 17, 19, 23, 29]  # not the most frequent labels, in no particular order
    (tmp_path / "ids.json").write_text(json.dumps(chosen))
    got = train(tiny_config(steps=1, draft_vocab=12, draft_vocab_from=str(tmp_path / "ids.json")), tmp_path / "two",
                target, store)
    assert got.draft_vocab.tolist() == sorted(chosen)
    again = train(tiny_config(steps=1, draft_vocab=12, draft_vocab_from=str(tmp_path / "one" / "final")),
                  tmp_path / "three", target, store)
    assert torch.equal(again.draft_vocab.cpu(), counted.cpu())
    for bad, match in [(chosen[:11], "holds 11 ids"), (chosen[:11] + [0], "distinct"), (chosen[:11] + [VOCAB], "distinct"),
                       ("not json", "not a JSON list")]:
        (tmp_path / "bad.json").write_text(bad if isinstance(bad, str) else json.dumps(bad))
        with pytest.raises(HyflashError, match=match):
            train(tiny_config(steps=1, draft_vocab=12, draft_vocab_from=str(tmp_path / "bad.json")),
                  tmp_path / f"bad-{match[:4]}", target, store)
    with pytest.raises(HyflashError, match="not found"):
        train(tiny_config(steps=1, draft_vocab=12, draft_vocab_from=str(tmp_path / "missing.json")), tmp_path / "x",
              target, store)


# ---------------------------------------------------------------------------------------------- the pieces
def test_anchors_and_supervised_slots_stay_inside_spans():
    """Anchors lie in a span; slot j (learning labels[a + j], the token at a + j + 1) is supervised exactly when
    tokens a .. a + j + 1 all lie in the anchor's span and inside the (cropped) sequence."""
    T, S, L = 50, 4, 24
    spans = [[3, 10], [20, 22], [30, 46]]
    inside = torch.zeros(T + 1, dtype=torch.bool)
    for s, e in spans:
        inside[s:e] = True
    item = dict(features=torch.zeros(T, 4, dtype=torch.bfloat16), input_ids=torch.arange(T), labels=torch.arange(T) + 1,
                spans=spans, topk_vals=torch.zeros(T, 2), topk_ids=torch.zeros(T, 2, dtype=torch.int32))
    cfg = tiny_config(seq_len=L, anchors_per_seq=5)
    seen = set()
    for seed in range(40):  # random crops of 24 out of 50 tokens and random anchors
        b = make_batch([item], [0], cfg, np.random.default_rng(seed), with_topk=True)
        start = int(b["input_ids"][0, 0])  # input_ids are positions, so the crop's first id is its offset
        real = b["mask"][0, :, 0]
        anchors = b["anchors"][0][real] + start
        assert len(anchors) > 0 and (anchors >= start + 1).all() and inside[anchors].all()
        seen.update(anchors.tolist())
        for a, m, t in zip(anchors.tolist(), b["mask"][0][real], b["targets"][0][real]):
            expect = [all(inside[a:a + j + 2]) and a + j + 1 < start + L for j in range(S)]
            assert m.tolist() == expect
            assert torch.equal(t[m], torch.arange(a, a + S)[m] + 1)  # slot j learns labels[a + j]
    assert seen <= set(range(3, 9)) | {20} | set(range(30, 45)) and len(seen) > 10


def test_batch_padding_is_masked_at_a_valid_anchor():
    """Rows with fewer anchors or tokens than the batch's longest are padded: padding anchors are 1 (a position every
    drafter can read the feature before), and none of their slots is supervised."""
    def item(T, spans):
        return dict(features=torch.zeros(T, 4, dtype=torch.bfloat16), input_ids=torch.arange(T),
                    labels=torch.arange(T) + 1, spans=spans)
    cfg = tiny_config(seq_len=64, anchors_per_seq=6)
    b = make_batch([item(40, [[0, 40]]), item(8, [[2, 5]])], [0, 1], cfg, np.random.default_rng(0), with_topk=False)
    assert b["input_ids"].shape == (2, 40) and b["anchors"].shape[1] == 6
    real = b["mask"].any(-1)
    assert real[0].all() and 0 < real[1].sum() < 6
    assert (b["anchors"][~real] == 1).all() and not b["mask"][~real].any()
    assert (b["anchors"] >= 1).all()


def test_follow_target_path_masks_blocks_the_target_would_not_accept():
    T = 20
    ids = torch.arange(T)
    labels = ids + 1  # the text is the target's greedy path ...
    labels[9] = 0  # ... except that after token 9 the target would have said 0, not 10
    sup = torch.ones(T, dtype=torch.bool)
    anchors = torch.tensor([5, 8, 10])
    _, off, _ = block_targets(labels, ids, sup, anchors, 4, follow_target_path=False)
    _, on, _ = block_targets(labels, ids, sup, anchors, 4, follow_target_path=True)
    assert off.all()
    assert on.tolist() == [[True] * 4, [True, True, False, False], [True] * 4]  # token 10 left the path


def test_position_decay_weights_are_as_specified():
    gamma, S = 4.0, 7
    w = position_weights(S, gamma)
    assert torch.allclose(w, torch.tensor([np.exp(-(k - 1) / gamma) for k in range(1, S + 1)], dtype=torch.float32))
    # the loss is Σ w_k·CE_k / Σ w_k: a wrong slot k costs in proportion to w_k
    V = 5
    targets = torch.zeros(1, 1, S, dtype=torch.long)
    logits = torch.zeros(1, 1, S, V)
    loss, _, _ = block_loss(logits, targets, torch.ones(1, 1, S, dtype=torch.bool), w)
    assert torch.allclose(loss, torch.tensor(np.log(V), dtype=torch.float32))
    logits[0, 0, 2, 0] = 10.0  # slot 3 nearly certain and right
    ce = torch.full((S,), np.log(V), dtype=torch.float32)
    ce[2] = -F.log_softmax(logits[0, 0, 2], -1)[0]
    loss, correct, count = block_loss(logits, targets, torch.ones(1, 1, S, dtype=torch.bool), w)
    assert torch.allclose(loss, (w * ce).sum() / w.sum())
    assert correct.tolist() == [1] * S and count.tolist() == [1] * S  # argmax ties resolve to token 0 here


def test_distillation_terms_on_a_full_support():
    torch.manual_seed(0)
    logits, t_logits = torch.randn(3, 6), torch.randn(3, 6)
    ids = torch.arange(6).expand(3, 6)
    lse = logits.logsumexp(-1)
    p_d, p_t = logits.softmax(-1), t_logits.softmax(-1)
    assert torch.allclose(distill_term(logits, lse, t_logits, ids, "l1"), (p_d - p_t).abs().sum(-1), atol=1e-6)
    kl = (p_t * (p_t.log() - p_d.log())).sum(-1)
    assert torch.allclose(distill_term(logits, lse, t_logits, ids, "kl"), kl, atol=1e-6)
    # on a top-2 support, mass the drafter puts outside it counts fully in the L1
    top = t_logits.topk(2, -1)
    l1 = distill_term(logits, lse, top.values, top.indices, "l1")
    pt2 = top.values.softmax(-1)
    expect = (p_d.gather(-1, top.indices) - pt2).abs().sum(-1) + 1 - p_d.gather(-1, top.indices).sum(-1)
    assert torch.allclose(l1, expect, atol=1e-6)


def test_init_from_target_copies_top_half_layers(target):
    assert top_half_layers(30, 2) == [22, 29] and top_half_layers(30, 1) == [29]
    from hyflash.drafter.model import new_drafter

    d = new_drafter(DrafterConfig(**{**DRAFTER, "intermediate_size": 80}), target, dtype=torch.float64)
    copied = init_from_target(d, target)
    src = target.model.model.layers[top_half_layers(3, 2)[1]]  # drafter layer 1 <- target layer 2
    assert torch.equal(d.layers[1].attn.q_proj.weight, src.self_attn.q_proj.weight)
    assert torch.equal(d.layers[1].norm.weight, src.input_layernorm.weight)
    x = torch.randn(3, 32, dtype=torch.float64)
    assert torch.allclose(d.layers[1].mlp(x), src.mlp(x))  # widened 64 -> 80, same function
    assert any("widened" in c for c in copied)


def test_reduced_draft_vocab_trains_and_decodes_losslessly(target, store, tmp_path):
    """With a draft vocabulary of the 12 most frequent labels, training learns, the checkpoint keeps the vocabulary,
    and decoding stays token-identical."""
    train(tiny_config(steps=20, draft_vocab=12, kl_weight=0.5, eval_every=20, ckpt_every=20), tmp_path, target, store)
    log = [json.loads(line) for line in (tmp_path / "log.jsonl").read_text().splitlines()]
    assert np.mean([r["loss"] for r in log[-3:]]) < np.mean([r["loss"] for r in log[:3]])
    counts = torch.zeros(VOCAB, dtype=torch.long)
    for item in store.items:
        counts += torch.bincount(item["labels"], minlength=VOCAB)
    drafter = from_pretrained(tmp_path / "final", target)
    assert drafter.config.draft_vocab_size == 12
    # the kept ids are the training split's most frequent labels: they cover most of the label mass
    kept = set(drafter.draft_vocab.tolist())
    assert len(kept) == 12 and counts[list(kept)].sum() > 0.6 * counts.sum()
    prompt = torch.randint(1, VOCAB - 1, (12,), generator=torch.Generator().manual_seed(5)).tolist()
    plain = generate(target, prompt, None, max_new_tokens=30)
    assert generate(target, prompt, HyFlashProposer(drafter), max_new_tokens=30).token_ids == plain.token_ids


@pytest.mark.parametrize("family,seq_len", [("smollm2", 2048), ("gemma3", 4096)])
def test_recipes_have_matched_parameter_budgets(family, seq_len):
    recipes = {name: load_recipe(f"{family}-{name}") for name in ("hyflash", "full", "swa")}
    counts = {}
    for name, cfg in recipes.items():
        assert cfg.drafter.variant == name and cfg.drafter.num_layers == 2 and cfg.seq_len == seq_len
        emb = torch.zeros(1, cfg.drafter.hidden_size)
        counts[name] = HyFlashDrafter(cfg.drafter, emb, emb).num_parameters()
    assert max(counts.values()) / min(counts.values()) < 1.03, counts
    same = {(c.data, c.steps, c.batch_seqs, c.anchors_per_seq, c.lr) for c in recipes.values()}
    assert len(same) == 1


def test_gemma3_second_stages_continue_their_own_first_stage_on_one_schedule():
    stages = {name: (load_recipe(f"gemma3-{name}"), load_recipe(f"gemma3-{name}-stage2"))
              for name in ("hyflash", "full", "swa")}
    for name, (first, second) in stages.items():
        assert second.init_from == f"runs/gemma3-{name}/final" and not second.init_from_target
        assert second.drafter.to_dict() == first.drafter.to_dict()  # init_from refuses another architecture
        # the same held-out sequences and draft vocabulary as the stage it continues
        assert (second.data, second.split_seed, second.val_fraction, second.val_sequences, second.draft_vocab) == \
               (first.data, first.split_seed, first.val_fraction, first.val_sequences, first.draft_vocab)
        assert second.lr < first.lr and second.seed != first.seed
    schedules = {(s.steps, s.lr, s.min_lr, s.warmup, s.seed, s.batch_seqs, s.anchors_per_seq) for _, s in stages.values()}
    assert len(schedules) == 1


def test_gemma3_mem512_ablation_differs_from_hyflash_in_the_memory_limit_only():
    plain, limited = load_recipe("gemma3-hyflash"), load_recipe("gemma3-hyflash-mem512")
    assert plain.drafter.memory_limit is None and limited.drafter.memory_limit == 512
    assert {**limited.drafter.to_dict(), "memory_limit": None} == plain.drafter.to_dict()
    assert {**vars(limited), "drafter": None, "_comment": None} == {**vars(plain), "drafter": None, "_comment": None}


@pytest.mark.parametrize("name, change", [("gdn", {"memory": "gdn"}), ("depth1", {"num_layers": 1}), ("depth3", {"num_layers": 3}),
                                          ("floor", {"memory_long_heads": 4, "memory_min_half_life": 8192.0})])
def test_gemma3_memory_and_depth_ablations_differ_from_hyflash_in_one_drafter_field(name, change):
    from hyflash.train import check_shareable

    plain, other = load_recipe("gemma3-hyflash"), load_recipe(f"gemma3-hyflash-{name}")
    assert other.drafter.to_dict() == {**plain.drafter.to_dict(), **change}
    assert {**vars(other), "drafter": None} == {**vars(plain), "drafter": None}
    check_shareable([plain, other], ["hyflash", name])  # one process may train them together


def test_gemma3_noslot_ablation_differs_from_hyflash_in_slot_attention_only():
    plain, noslot = load_recipe("gemma3-hyflash"), load_recipe("gemma3-hyflash-noslot")
    assert plain.drafter.slot_attention and not noslot.drafter.slot_attention
    assert {**noslot.drafter.to_dict(), "slot_attention": True} == plain.drafter.to_dict()
    assert {**vars(noslot), "drafter": None, "_comment": None} == {**vars(plain), "drafter": None, "_comment": None}


class _KindStore:
    def __init__(self, kinds):
        self._kinds = kinds

    def kinds(self):
        return list(self._kinds)


def test_kind_weights_repeat_sequences_of_a_kind_in_the_data_order():
    from hyflash.train import weighted_indices

    store = _KindStore(["packed", "document", "packed", "chat", "document"])
    idx = np.array([0, 1, 2, 3])                    # sequence 4 held out
    out = weighted_indices(store, idx, {"packed": 3, "chat": 0})
    assert sorted(out.tolist()) == [0, 0, 0, 1, 2, 2, 2]
    assert weighted_indices(store, idx, {}) is idx
    order = sequence_ids(out, seed=0, position=0, count=len(out))  # one epoch visits each copy once
    assert sorted(order) == sorted(out.tolist())
    with pytest.raises(HyflashError):
        weighted_indices(object(), idx, {"packed": 2})  # a store without kinds
    with pytest.raises(HyflashError):
        weighted_indices(store, idx, {"packed": 0, "document": 0, "chat": 0})
    with pytest.raises(HyflashError):
        TrainConfig(kind_weights={"packed": 1.5})


def test_a_batch_without_supervised_anchors_has_zero_loss_not_nan(target):
    """A crop can hold no token to learn (e.g. only a prompt). Its padded anchor must weigh nothing: the loss is 0
    (not NaN, which the log would show) and gradients stay finite, also with a reduced vocabulary and distillation."""
    from hyflash.drafter.model import new_drafter
    from hyflash.train import draft_index, to_draft_vocab

    store = FakeStore(target, n=2)
    for item in store.items:
        item["spans"] = []
    cfg = tiny_config(kl_weight=0.9, draft_vocab=8)
    drafter = new_drafter(DrafterConfig.from_dict({**cfg.drafter.to_dict(), "draft_vocab_size": 8}), target,
                          dtype=torch.float32)
    drafter.set_draft_vocab(torch.arange(8) + 10)  # token 0 (the padding's top-k id) lies outside it
    b = to_draft_vocab(make_batch(store, [0, 1], cfg, np.random.default_rng(0), with_topk=True), draft_index(drafter))
    assert not b["mask"].any()
    logits = drafter.forward_train(b["features"].float(), b["input_ids"], b["anchors"], prev_ids=b["prev_ids"])
    loss, _, count = block_loss(logits, b["targets"], b["mask"], position_weights(4, 4.0), 0.9, b["topk_vals"],
                                b["topk_ids"], "l1", b["loss_mask"])
    loss.backward()
    assert loss.item() == 0.0 and count.sum() == 0
    assert all(torch.isfinite(p.grad).all() for p in drafter.parameters() if p.grad is not None)


def test_draft_vocab_ceiling_counts_what_a_reduced_vocabulary_cannot_draft(store):
    from hyflash.train import draft_vocab_ceiling, draft_vocabulary, split_store

    cfg = tiny_config()
    train_idx, val_idx = split_store(store, cfg)
    full, small, one = draft_vocab_ceiling(store, train_idx, val_idx, cfg, [0, 3, 1], VOCAB)
    # by hand, on the same held-out blocks that evaluate() scores
    targets, masks = [], []
    for k in range(0, len(val_idx), cfg.batch_seqs):
        b = make_batch(store, [int(i) for i in val_idx[k:k + cfg.batch_seqs]], cfg,
                       np.random.default_rng([cfg.seed, 99, k]), with_topk=False)
        real = b["mask"][..., 0]
        targets.append(b["targets"][real])
        masks.append(b["mask"][real])
    t, m = torch.cat(targets), torch.cat(masks)
    kept = draft_vocabulary(store, train_idx, 3, VOCAB)
    inside = torch.isin(t, kept) & m
    assert full["draft_vocab"] == VOCAB and full["coverage"] == 1.0
    assert full["ceiling_tau"] == pytest.approx(1 + torch.cumprod(m.long(), -1).sum(-1).double().mean().item())
    assert small["coverage"] == pytest.approx((inside.sum() / m.sum()).item())
    assert small["ceiling_tau"] == pytest.approx(1 + torch.cumprod(inside.long(), -1).sum(-1).double().mean().item())
    assert full["ceiling_tau"] > small["ceiling_tau"] > one["ceiling_tau"] >= 1.0 and small["coverage"] < 1
    assert one["coverage"] < small["coverage"] and full["anchors"] == small["anchors"] == len(t) > 0


def test_validation_bounds_what_the_reduced_vocabulary_costs(target, store, tmp_path):
    from hyflash.train import evaluate, split_store

    cfg = tiny_config(steps=4, draft_vocab=3, eval_every=4, ckpt_every=4)
    train(cfg, tmp_path / "three", target, store)
    log = [json.loads(line) for line in (tmp_path / "three" / "log.jsonl").read_text().splitlines()]
    bounded = [rec for rec in log if "val_tau_vocab_free" in rec]
    # 3 of 32 ids leave held-out labels no draft can hit (a third are inside): counting them as hits raises τ̂
    assert bounded and all(rec["val_tau_vocab_free"] > rec["val_tau"] for rec in bounded)
    # a draft vocabulary of every id leaves nothing out: the bound is τ̂ itself
    cfg_all = tiny_config(steps=4, draft_vocab=VOCAB, eval_every=4, ckpt_every=4)
    train(cfg_all, tmp_path / "all", target, store)
    drafter = from_pretrained(tmp_path / "all" / "final", target, dtype=torch.float32)
    r = evaluate(drafter, store, split_store(store, cfg_all)[1], cfg_all)
    assert r["val_tau_vocab_free"] == r["val_tau"]


def test_init_from_a_gemma_target_copies_the_scales_its_norms_apply():
    """Gemma's RMSNorm computes x·(1 + w); ours x·w. The MLP's own pre-norm is Gemma's pre-feedforward norm."""
    from conftest import tiny_gemma3
    from hyflash.drafter.model import new_drafter

    t = tiny_gemma3(vocab=VOCAB, hidden=32, layers=4)
    with torch.no_grad():
        for p in t.model.parameters():
            if p.dim() == 1:
                p.uniform_(-0.5, 0.5)  # norms start at zero in a fresh Gemma: make them tell apart
    cfg = DrafterConfig(**{**DRAFTER, "num_heads": t.model.config.num_attention_heads,
                           "num_kv_heads": t.model.config.num_key_value_heads, "head_dim": t.model.config.head_dim,
                           "intermediate_size": t.model.config.intermediate_size})
    d = new_drafter(cfg, t, dtype=torch.float64)
    copied = init_from_target(d, t)
    j = top_half_layers(4, 2)[1]
    src = t.model.model.layers[j]
    assert torch.equal(d.layers[1].norm.weight, 1 + src.input_layernorm.weight)
    assert torch.equal(d.layers[1].mlp_norm.weight, 1 + src.pre_feedforward_layernorm.weight)
    assert torch.equal(d.layers[1].attn.q_norm.weight, 1 + src.self_attn.q_norm.weight)
    assert torch.equal(d.norm.weight, 1 + t.model.model.norm.weight)
    x = torch.randn(3, 32, dtype=torch.float64)
    assert torch.allclose(d.layers[1].norm(x), src.input_layernorm(x))  # the same function, not just the numbers
    assert f"layers.1.attn.q_proj <- {j}" in copied


def test_gemma3_gpu_recipes_differ_in_the_drafter_only_and_keep_the_cpu_held_out_split():
    """The four GPU recipes (scripts/gpu_gemma3.sh trains them side by side) share data, schedule and seeds; each
    drafter is its CPU recipe's; the CPU feature cache's sequences come first with the same split settings, so
    their held-out sequences are the CPU runs' (split_store splits each part on its own)."""
    names = {"hyflash": "gemma3-hyflash", "full": "gemma3-full", "swa": "gemma3-swa", "noslot": "gemma3-hyflash-noslot"}
    gpu = {v: load_recipe(f"gemma3-{v}-gpu") for v in names}
    for v, cpu_name in names.items():
        cpu = load_recipe(cpu_name)
        assert gpu[v].drafter.to_dict() == cpu.drafter.to_dict()
        assert (gpu[v].split_seed, gpu[v].val_fraction, gpu[v].val_sequences, gpu[v].draft_vocab, gpu[v].seq_len) == \
               (cpu.split_seed, cpu.val_fraction, cpu.val_sequences, cpu.draft_vocab, cpu.seq_len)
        assert gpu[v].data[0].endswith("part0.jsonl") and gpu[v].init_from_target and not gpu[v].init_from
    assert len({json.dumps({**vars(c), "drafter": None, "_comment": None}, sort_keys=True) for c in gpu.values()}) == 1


def test_gemma3_gpu_ablation_recipes_change_one_drafter_field_and_train_side_by_side_with_the_others():
    """mem512, depth1, depth3, gdn and floor are gemma3-hyflash-gpu with one drafter setting changed; all nine GPU recipes
    agree on what decides a batch, so one process trains them together (check_shareable)."""
    from hyflash.train import check_shareable

    hyflash = load_recipe("gemma3-hyflash-gpu")
    changes = {"mem512": {"memory_limit": 512}, "depth1": {"num_layers": 1}, "depth3": {"num_layers": 3},
               "gdn": {"memory": "gdn"}, "floor": {"memory_long_heads": 4, "memory_min_half_life": 8192.0}}
    for v, change in changes.items():
        cfg = load_recipe(f"gemma3-{v}-gpu")
        assert cfg.drafter.to_dict() == {**hyflash.drafter.to_dict(), **change}
        assert {**vars(cfg), "drafter": None} == {**vars(hyflash), "drafter": None}
    names = ["hyflash", "full", "swa", "noslot", *changes]
    check_shareable([load_recipe(f"gemma3-{v}-gpu") for v in names], names)  # raises if they could not share


def test_per_slot_vectors_do_not_decay_like_the_vectors_they_stand_in_for():
    """slot_embedding (rows of mask embeddings) and slot_q_scale (rows of query-norm weights) join the vectors'
    no-decay group; weight matrices (lags included) decay."""
    from hyflash.train import make_optimizer

    cfg = DrafterConfig(num_layers=1, block_size=3, hidden_size=32, num_heads=2, num_kv_heads=1, head_dim=16,
                        intermediate_size=48, memory_heads=2, memory_head_dim=8, memory_state_dim=8, vocab_size=40,
                        target_hidden_size=16, target_layers=[0], context_lags=2, context_lag_rank=4,
                        slot_embeddings=True, slot_query_scales=True)
    emb = torch.zeros(40, 32)
    d = HyFlashDrafter(cfg, emb, emb)
    decay, no_decay = make_optimizer(d, TrainConfig(weight_decay=0.1)).param_groups
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    ids = lambda group: {id(p) for p in group["params"]}  # noqa: E731
    for p in (d.slot_embedding, d.layers[0].attn.slot_q_scale, d.mask_embedding):
        assert id(p) in ids(no_decay)
    for p in (d.lag_up.weight, d.lag_down.weight, d.layers[0].attn.q_proj.weight):
        assert id(p) in ids(decay)
    assert len(ids(decay) | ids(no_decay)) == len(list(d.parameters()))


def test_per_anchor_prefixes_give_the_validation_tau_and_pair_up_across_drafters(target, store):
    """evaluate_many(per_anchor=True): each anchor's accepted prefix, in one order for every drafter, so that a
    difference between two drafters can be paired anchor by anchor (benchmarks/val_tau_se.py --paired)."""
    from hyflash.drafter.model import new_drafter
    from hyflash.train import evaluate, evaluate_many, split_store

    cfg = tiny_config()
    val = split_store(store, cfg)[1]
    torch.manual_seed(0)
    a, b = (new_drafter(cfg.drafter, target, dtype=torch.float32) for _ in range(2))
    # drafter a always drafts the store's most frequent label, so that some of its drafts are accepted
    common = int(torch.cat([item["labels"] for item in store.items]).mode().values)
    forward = a.forward_train
    a.forward_train = lambda *args, **kw: forward(*args, **kw) + 1e4 * F.one_hot(torch.tensor(common), VOCAB)
    ra, rb = evaluate_many([a, b], store, val, cfg, per_anchor=True)
    assert ra["val_prefixes"].max() > 0 and not torch.equal(ra["val_prefixes"], rb["val_prefixes"])
    for r in (ra, rb):
        p = r["val_prefixes"]
        assert len(p) == r["val_anchors"] > 0
        assert 1 + float(p.mean()) == pytest.approx(r["val_tau"], abs=1e-4)
    assert "val_prefixes" not in evaluate(a, store, val, cfg)  # the training log stays small
    assert torch.equal(evaluate_many([a], store, val, cfg, per_anchor=True)[0]["val_prefixes"], ra["val_prefixes"])
