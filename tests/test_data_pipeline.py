"""Data stages 2-4 (regenerate, sequences, features) on a tiny random Llama with a tiny word-level tokenizer."""

import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import tiny_llama
from hyflash import HyflashError
from hyflash.data import features as F
from hyflash.data.features import FeatureStore, extract_features
from hyflash.data.regenerate import regenerate
from hyflash.data.sequences import build_sequences

VOCAB = 64
WORDS = ["<pad>", "<|im_start|>", "user", "assistant"] + [f"w{i}" for i in range(VOCAB - 5)] + ["<|im_end|>"]
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|> {{ m['role'] }} {{ m['content'] }} <|im_end|> {% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|> assistant {% endif %}")


def tiny_tokenizer():
    """One token per whitespace-separated word of WORDS; <|im_end|> (the last id) is the model's EOS."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<|im_end|>",
                                   chat_template=CHAT_TEMPLATE)


def text(rng, n):
    return " ".join(f"w{rng.randrange(VOCAB - 5)}" for _ in range(n))


@torch.inference_mode()
def greedy_alone(target, prompt_ids, max_new_tokens):
    """Plain one-sequence greedy decoding with the target's own cache, stopping after an EOS."""
    cache = target.new_cache()
    logits = target.forward(torch.tensor(prompt_ids), cache, features=False).logits
    out = []
    for _ in range(max_new_tokens):
        token = int(logits[-1].argmax())
        out.append(token)
        if token in target.eos_token_ids:
            break
        logits = target.forward(torch.tensor([token]), cache, features=False).logits
    return out


MAX_NEW = 10
MAX_PROMPT = 40


@pytest.fixture(scope="module")
def target():
    torch.set_num_threads(2)
    t = tiny_llama(vocab=VOCAB, hidden=32, layers=3, seed=1, dtype=torch.float64)
    t.tokenizer = tiny_tokenizer()
    prompts = [t.encode(text(random.Random(i), 3 + i)) for i in range(6)]
    # Make some answers end early: take as EOS a token that greedy decoding emits for some prompts, not all.
    answers = [greedy_alone(t, p, MAX_NEW) for p in prompts]
    counts = {}
    for a in answers:
        for tok in set(a[1:-2]):
            counts[tok] = counts.get(tok, 0) + 1
    t.eos_token_ids = {max((c, tok) for tok, c in counts.items() if c < len(answers))[1]}
    return t


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory):
    rng = random.Random(0)
    path = tmp_path_factory.mktemp("split") / "train_prompts.jsonl"
    lengths = [rng.randrange(1, 25) for _ in range(11)]
    lengths[4] = 50  # over MAX_PROMPT tokens with the template: skipped
    with open(path, "w") as f:
        for i, n in enumerate(lengths):
            f.write(json.dumps({"id": f"t/{i}", "source": "t", "messages": [{"role": "user", "content": text(rng, n)}]})
                    + "\n")
    return path


@pytest.fixture(scope="module")
def documents_file(tmp_path_factory):
    rng = random.Random(1)
    path = tmp_path_factory.mktemp("split") / "train_documents.jsonl"
    with open(path, "w") as f:
        for i, n in enumerate([150, 40, 7, 230]):
            f.write(json.dumps({"id": f"d/{i}", "source": "d", "text": text(rng, n)}) + "\n")
    return path


@pytest.fixture(scope="module")
def responses(target, prompts_file, tmp_path_factory):
    out = tmp_path_factory.mktemp("responses")
    regenerate(prompts_file, out, target, max_new_tokens=MAX_NEW, batch_size=3, shard_size=4,
               max_prompt_tokens=MAX_PROMPT)
    return out


def read(path):
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


# --------------------------------------------------------------------------- regenerate


def test_batched_left_padded_answers_equal_unbatched_greedy(target, prompts_file, responses):
    prompts = {r["id"]: r for r in read(prompts_file)}
    got = [r for shard in sorted(responses.glob("responses-*.jsonl")) for r in read(shard)]
    assert [r["id"] for r in got] == [f"t/{i}" for i in range(11) if i != 4]  # file order, long prompt skipped
    manifest = json.loads((responses / "regenerate.json").read_text())
    assert manifest["shards"]["responses-00001.jsonl"]["skipped"] == ["t/4"]
    lengths = {len(r["prompt_ids"]) for r in got}
    assert len(lengths) > 3  # the batches really were padded
    ended = 0
    for r in got:
        assert r["prompt_ids"] == target.encode(prompts[r["id"]]["messages"])
        assert r["response_ids"] == greedy_alone(target, r["prompt_ids"], MAX_NEW)
        ended += r["response_ids"][-1] in target.eos_token_ids
        assert all(t not in target.eos_token_ids for t in r["response_ids"][:-1])
    assert 0 < ended < len(got)  # some answers stop at EOS (and are cut there), some run to the limit


def test_regenerate_resumes_by_redoing_only_missing_shards(target, prompts_file, responses, tmp_path):
    before = {p.name: p.read_bytes() for p in responses.glob("responses-*.jsonl")}
    assert len(before) == 3
    copy = tmp_path / "responses"
    copy.mkdir()
    for name, data in before.items():
        (copy / name).write_bytes(data)
    (copy / "regenerate.json").write_bytes((responses / "regenerate.json").read_bytes())
    (copy / "responses-00002.jsonl").unlink()
    manifest = regenerate(prompts_file, copy, target, max_new_tokens=MAX_NEW, batch_size=3, shard_size=4,
                          max_prompt_tokens=MAX_PROMPT)
    assert manifest["this_run"]["response_tokens"] == manifest["shards"]["responses-00002.jsonl"]["response_tokens"]
    assert {p.name: p.read_bytes() for p in copy.glob("responses-*.jsonl")} == before
    with pytest.raises(HyflashError, match="other settings"):
        regenerate(prompts_file, copy, target, max_new_tokens=MAX_NEW + 1, shard_size=4, max_prompt_tokens=MAX_PROMPT)


# --------------------------------------------------------------------------- sequences

MAX_LEN = 64


@pytest.fixture(scope="module")
def sequences(target, responses, documents_file, tmp_path_factory):
    out = tmp_path_factory.mktemp("seq") / "sequences.jsonl"
    build_sequences(responses, documents_file, out, target, max_len=MAX_LEN, min_len=8)
    return out


def test_spans_cover_exactly_the_response_tokens(target, responses, sequences):
    answers = {r["id"]: r for shard in sorted(responses.glob("responses-*.jsonl")) for r in read(shard)}
    seqs = read(sequences)
    kinds = [s["kind"] for s in seqs]
    assert kinds.count("chat") == len(answers) and kinds.count("packed") >= 1
    for s in seqs:
        assert len(s["ids"]) <= MAX_LEN
        if s["kind"] == "chat":
            a = answers[s["id"]]
            assert s["ids"] == a["prompt_ids"] + a["response_ids"]
            assert s["spans"] == [[len(a["prompt_ids"]), len(s["ids"])]]
        elif s["kind"] == "packed":
            parts = [answers[p] for p in s["parts"]]
            assert len(parts) >= 2
            assert s["ids"] == [t for a in parts for t in a["prompt_ids"] + a["response_ids"]]
            assert [s["ids"][b:e] for b, e in s["spans"]] == [a["response_ids"] for a in parts]
    assert build_sequences(responses, None, sequences.with_name("again.jsonl"), target, max_len=MAX_LEN)
    assert sorted(s["id"] for s in read(sequences) if s["kind"] != "document") == sorted(
        s["id"] for s in read(sequences.with_name("again.jsonl")))


def test_without_singles_every_answer_is_trained_on_once(target, responses, tmp_path):
    answers = {r["id"] for shard in sorted(responses.glob("responses-*.jsonl")) for r in read(shard)}
    out = tmp_path / "packed_only.jsonl"
    meta = build_sequences(responses, None, out, target, max_len=MAX_LEN, min_len=8, singles=False)
    seqs = read(out)
    seen = [p for s in seqs if s["kind"] == "packed" for p in s["parts"]]
    seen += [s["id"] for s in seqs if s["kind"] == "chat"]  # only a leftover no pack could take
    assert sorted(seen) == sorted(answers) and meta["counts"]["packed"]["sequences"] >= 1
    assert meta["counts"]["chat"]["sequences"] <= 1
    with pytest.raises(HyflashError):
        build_sequences(responses, None, tmp_path / "none.jsonl", target, max_len=MAX_LEN, pack=False, singles=False)


def test_documents_are_cut_into_chunks_supervised_after_the_first_token(target, responses, documents_file,
                                                                       sequences, tmp_path):
    docs = {d["id"]: target.tokenizer.encode(d["text"], add_special_tokens=False) for d in read(documents_file)}
    chunks = {}
    for s in read(sequences):
        if s["kind"] == "document":
            doc, k = s["id"].split("#")
            chunks.setdefault(doc, {})[int(k)] = s
            assert s["spans"] == [[1, len(s["ids"])]]
    assert set(chunks) == {"d/0", "d/1", "d/3"}  # d/2 (7 tokens) is under min_len
    for doc, parts in chunks.items():
        joined = [t for k in sorted(parts) for t in parts[k]["ids"]]
        assert joined == docs[doc][:len(joined)] and len(docs[doc]) - len(joined) < 8
    capped = build_sequences(responses, documents_file, tmp_path / "capped.jsonl", target, max_len=MAX_LEN,
                             doc_tokens=100, min_len=8)
    assert capped["counts"]["document"]["tokens"] == 100


# --------------------------------------------------------------------------- features


@pytest.fixture(scope="module")
def features(target, sequences, tmp_path_factory):
    out = tmp_path_factory.mktemp("features")
    extract_features(sequences, out, target, shard_tokens=150, topk=5)
    return out


def test_features_and_labels_equal_a_direct_target_forward(target, sequences, features):
    store = FeatureStore(features)
    seqs = read(sequences)
    assert len(store) == len(seqs) and len(list(features.glob("index-*.json"))) > 2
    assert store.total_tokens == sum(len(s["ids"]) for s in seqs)
    for i, s in enumerate(seqs):
        item = store[i]
        out = target.forward(torch.tensor(s["ids"]), target.new_cache(), features=True)
        assert item["id"] == s["id"] and item["spans"] == s["spans"]
        assert item["input_ids"].tolist() == s["ids"]
        assert item["features"].dtype == target.dtype
        assert torch.equal(item["features"], out.features)
        assert torch.equal(item["labels"], out.logits.argmax(-1))
        assert torch.equal(item["topk_ids"][:, 0], item["labels"])
        assert torch.equal(item["topk_vals"], out.logits.topk(5, -1).values.half())


def test_features_resume_and_bf16_store_round_trip(target, sequences, features, tmp_path, monkeypatch, capsys):
    before = {p.name: p.read_bytes() for p in features.iterdir()}
    (features / "index-00001.json").unlink()
    manifest = extract_features(sequences, features, target, shard_tokens=150, topk=5)
    assert manifest["this_run"]["tokens"] == json.loads((features / "index-00001.json").read_text())["n_tokens"]
    assert {p.name: p.read_bytes() for p in features.iterdir() if p.name != "features.json"} == {
        k: v for k, v in before.items() if k != "features.json"}

    bf16 = tiny_llama(vocab=VOCAB, hidden=32, layers=3, seed=1, dtype=torch.bfloat16)
    import hyflash.kernels

    monkeypatch.setattr(hyflash.kernels, "cpu_has_fast_bf16", lambda: True)  # torch's bf16 matmuls, as they are
    extract_features(sequences, tmp_path / "bf16", bf16, shard_tokens=150, topk=5, limit=3)
    store = FeatureStore(tmp_path / "bf16")
    assert len(store) == 3
    stored = np.load(tmp_path / "bf16" / "feats-00000.npy", mmap_mode="r")
    assert stored.dtype == np.uint16 and isinstance(stored, np.memmap)
    for i, s in enumerate(read(sequences)[:3]):
        out = bf16.forward(torch.tensor(s["ids"]), bf16.new_cache(), features=True)
        assert store[i]["features"].dtype == torch.bfloat16 and torch.equal(store[i]["features"], out.features)
        assert torch.equal(store[i]["labels"], out.logits.argmax(-1))

    # a CPU without bf16 dot products: the model's matmuls go through PackedLinear (fp32 sums of the bf16 values)
    from hyflash.packed import PackedLinear, pack_linears, unpack_linears

    monkeypatch.setattr(hyflash.kernels, "cpu_has_fast_bf16", lambda: False)
    if PackedLinear(torch.zeros(16, 32, dtype=torch.bfloat16)).is_packed:  # our kernels or oneDNN can take it
        extract_features(sequences, tmp_path / "slow", bf16, shard_tokens=150, topk=5, limit=3)
        assert "fp32 sums of the bf16 values" in capsys.readouterr().err
        assert "forward" not in bf16.model.model.layers[0].mlp.down_proj.__dict__  # the model is left as it was
        slow = FeatureStore(tmp_path / "slow")
        assert pack_linears(bf16.model) > 0  # the same matmuls, by hand
        for i, s in enumerate(read(sequences)[:3]):
            out = bf16.forward(torch.tensor(s["ids"]), bf16.new_cache(), features=True)
            assert torch.equal(slow[i]["features"], out.features)
            assert torch.equal(slow[i]["labels"], out.logits.argmax(-1))
            scale = store[i]["features"].float().abs().max()  # and torch's bf16 matmul's values up to rounding
            assert (slow[i]["features"].float() - store[i]["features"].float()).abs().max() < 0.05 * scale
        unpack_linears(bf16.model)

    monkeypatch.setattr(F.shutil, "disk_usage", lambda p: type("U", (), {"free": 1000})())
    with pytest.raises(HyflashError, match="not enough disk"):
        extract_features(sequences, tmp_path / "full", target, shard_tokens=150, topk=5)


# --------------------------------------------------------------------------- online features (GPU training)


def test_online_store_returns_what_the_disk_store_holds(target, sequences, features):
    from hyflash.data.online import OnlineFeatureStore

    disk, online = FeatureStore(features), OnlineFeatureStore(sequences, target, topk=5, keep=2)
    assert len(online) == len(disk) and online.total_tokens == disk.total_tokens
    assert online.kinds() == disk.kinds() and online.lengths() == disk.lengths()
    for i in list(range(len(disk))) + [0]:  # 0 again: after it left the kept items
        a, b = disk[i], online[i]
        assert a.keys() == b.keys() and (a["id"], a["kind"], a["spans"]) == (b["id"], b["kind"], b["spans"])
        for k in ("features", "input_ids", "labels", "topk_vals", "topk_ids"):
            assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k
    with pytest.raises(HyflashError, match="not found"):
        OnlineFeatureStore(features / "nope.jsonl", target)


def test_training_on_online_features_equals_training_on_the_cache(target, sequences, features, tmp_path):
    """A recipe whose data is the sequences file trains the same drafter as one whose data is their feature cache
    (same batches, same steps: bit-identical weights), and a wrong device is a clear error."""
    from hyflash.train import TrainConfig, open_store, train

    drafter = dict(num_layers=1, block_size=3, window=4, hidden_size=32, num_heads=4, num_kv_heads=2, head_dim=8,
                   intermediate_size=32, memory_heads=2, memory_head_dim=8, memory_state_dim=8,
                   target_layers=list(target.feature_layers))
    cfg = dict(drafter=drafter, seq_len=32, anchors_per_seq=4, batch_seqs=2, steps=3, val_fraction=0.3,
               val_sequences=2, ckpt_every=3, eval_every=3, bf16=False, kl_weight=0.5)
    with pytest.raises(HyflashError, match="need the target"):
        open_store(str(sequences))
    cached = train(TrainConfig(**cfg, data=str(features)), tmp_path / "cached", target=target)
    online = train(TrainConfig(**cfg, data=str(sequences), online_topk=5), tmp_path / "online", target=target)
    for (name, a), (_, b) in zip(cached.state_dict().items(), online.state_dict().items()):
        assert torch.equal(a, b), name
    assert (tmp_path / "online" / "final" / "model.safetensors").exists()
    if not torch.cuda.is_available():
        with pytest.raises(HyflashError, match="no CUDA device"):
            train(TrainConfig(**cfg, data=str(sequences), device="cuda"), tmp_path / "gpu", target=target)


def test_drafters_trained_together_share_each_online_forward(target, sequences, tmp_path, monkeypatch):
    """Two drafters in one process read every batch from one target forward: the target runs exactly as often as
    for one drafter alone (training and validation), and each drafter is the one it would be alone. From the
    command line, several --recipe train into --out/<recipe>/, and --export exports each run of a stopped group."""
    from click.testing import CliRunner

    import hyflash.data.online as online
    from hyflash.data.online import OnlineFeatureStore
    from hyflash.target import Target
    from hyflash.train import TrainConfig, train_command, train_many

    calls = []
    real = online.sequence_outputs
    monkeypatch.setattr(online, "sequence_outputs", lambda *a, **k: calls.append(1) or real(*a, **k))
    drafter = dict(num_layers=1, block_size=3, window=4, hidden_size=32, num_heads=4, num_kv_heads=2, head_dim=8,
                   intermediate_size=32, memory_heads=2, memory_head_dim=8, memory_state_dim=8,
                   target_layers=list(target.feature_layers))
    cfg = dict(drafter=drafter, data=str(sequences), online_topk=5, seq_len=32, anchors_per_seq=4, batch_seqs=2,
               steps=4, val_fraction=0.3, val_sequences=2, ckpt_every=2, eval_every=2, bf16=False)
    a = TrainConfig(**cfg, kl_weight=0.5)
    b = TrainConfig(**{**cfg, "drafter": {**drafter, "variant": "swa"}}, lr=1e-3)

    def store():  # keeps one item, so every read of a sequence in a batch is a forward
        return OnlineFeatureStore(sequences, target, topk=5, keep=1)

    alone = [train_many([c], [tmp_path / f"alone{k}"], target, store()) for k, c in enumerate((a, b))]
    per_run = len(calls) // 2
    calls.clear()
    together = train_many([a, b], [tmp_path / "a", tmp_path / "b"], target, store())
    assert per_run > 0 and len(calls) == per_run  # not 2 × per_run
    for (one,), got in zip(alone, together):
        assert all(torch.equal(v, got.state_dict()[k]) for k, v in one.state_dict().items())

    recipes = []
    for name, c in (("first", a), ("second", b)):
        recipes.append(tmp_path / f"{name}.json")
        recipes[-1].write_text(json.dumps({**c.to_dict(), "steps": 4}))
    monkeypatch.setattr(Target, "load", classmethod(lambda cls, *args, **kw: target))
    run = CliRunner().invoke
    args = ["--recipe", str(recipes[0]), "--recipe", str(recipes[1]), "--out", str(tmp_path / "group")]
    result = run(train_command, args + ["--stop-at", "2"], standalone_mode=False)
    assert result.exception is None, result.output
    assert not (tmp_path / "group" / "first" / "final").exists()
    result = run(train_command, ["--export", "--out", str(tmp_path / "group")], standalone_mode=False)
    assert result.exception is None and result.output.count("exported") == 2
    assert (tmp_path / "group" / "second" / "final" / "model.safetensors").exists()
    result = run(train_command, args + ["--init-from", str(tmp_path / "a" / "final")], standalone_mode=False)
    assert "one per recipe" in str(result.exception)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (run on a GPU machine)")
def test_training_on_a_gpu_with_online_features_learns(target, sequences, tmp_path):
    import copy

    from hyflash.train import TrainConfig, train

    gpu_target = copy.deepcopy(target)
    gpu_target.model = gpu_target.model.float().cuda()
    drafter = dict(num_layers=1, block_size=3, window=4, hidden_size=32, num_heads=4, num_kv_heads=2, head_dim=8,
                   intermediate_size=32, memory_heads=2, memory_head_dim=8, memory_state_dim=8,
                   target_layers=list(target.feature_layers))
    cfg = TrainConfig(drafter=drafter, data=str(sequences), seq_len=32, anchors_per_seq=4, batch_seqs=2, steps=40,
                      lr=3e-3, val_fraction=0.3, val_sequences=2, ckpt_every=20, eval_every=20, device="cuda")
    train(cfg, tmp_path / "gpu", target=gpu_target)
    log = [json.loads(line) for line in (tmp_path / "gpu" / "log.jsonl").read_text().splitlines()]
    assert len(log) == 40 and np.mean([r["loss"] for r in log[-10:]]) < np.mean([r["loss"] for r in log[:10]])
    assert (tmp_path / "gpu" / "final" / "model.safetensors").exists()


def test_documents_only_for_a_base_model_without_regenerated_answers(target, documents_file, tmp_path):
    out = tmp_path / "docs_only.jsonl"
    meta = build_sequences(None, documents_file, out, target, max_len=MAX_LEN, min_len=8)
    seqs = read(out)
    assert seqs and all(s["kind"] == "document" for s in seqs)
    assert meta["counts"]["chat"]["sequences"] == 0 and meta["responses_dir"] is None
    with pytest.raises(HyflashError, match="nothing to build"):
        build_sequences(None, None, tmp_path / "nothing.jsonl", target, max_len=MAX_LEN)
