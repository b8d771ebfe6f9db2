"""The command line: JSON output for scripts, and clear errors (no traceback) on bad input."""

import json
import os
import subprocess
import sys

import pytest
import torch

from conftest import tiny_llama
from hyflash import kernels
from hyflash.drafter.config import DrafterConfig
from hyflash.drafter.model import new_drafter, save_pretrained


def hyflash(*args, timeout=300, **env_vars):
    env = {**os.environ, "PYTHONWARNINGS": "ignore", **env_vars}
    return subprocess.run([sys.executable, "-m", "hyflash.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


def assert_clean_error(proc, message):
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    assert message in proc.stderr


@pytest.mark.slow
def test_generate_json_prints_one_object(smollm2_fp32):
    proc = hyflash("generate", "Name two fruits.", "--json", "--max-new-tokens", "12", "--drafter", "ngram")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)  # stdout holds the JSON object and nothing else
    assert set(out) == {"text", "token_ids", "stats"}
    assert len(out["token_ids"]) <= 12 and out["text"]
    for key in ("rounds", "acceptance_length", "tokens_per_s", "draft_ms", "verify_ms", "drafter_state_bytes",
                "committed_histogram"):
        assert key in out["stats"]
    assert out["stats"]["acceptance_length"] >= 1.0


@pytest.mark.slow
def test_bad_input_gets_a_clear_error(smollm2_fp32, tmp_path):
    assert_clean_error(hyflash("generate", "   "), "the prompt is empty")
    assert_clean_error(hyflash("generate"), "no prompt: give PROMPT or --prompt-file")
    (tmp_path / "p.txt").write_text("hi")
    assert_clean_error(hyflash("generate", "hi", "-f", str(tmp_path / "p.txt")), "not both")
    assert_clean_error(hyflash("generate", "word " * 9000, "--no-chat"), "context window is 8192")
    assert_clean_error(hyflash("generate", "hi", "--drafter", str(tmp_path / "nope")), "unknown drafter")
    # a drafter checkpoint made for another target
    tiny = tiny_llama(vocab=50, hidden=32)
    cfg = DrafterConfig(hidden_size=32, num_heads=4, num_kv_heads=2, head_dim=8, intermediate_size=48,
                        memory_heads=2, memory_head_dim=8, memory_state_dim=8)
    save_pretrained(new_drafter(cfg, tiny, dtype=torch.float32), tmp_path / "other")
    assert_clean_error(hyflash("generate", "hi", "--drafter", str(tmp_path / "other")), "trained for target")
    assert_clean_error(hyflash("generate", "hi", "--target", str(tmp_path / "missing")), "target not found")


@pytest.mark.slow
@pytest.mark.slow
def test_a_long_prompt_comes_from_a_file_or_stdin_with_a_prefill_progress_bar(smollm2_fp32, tmp_path):
    text = "The quick brown fox jumps over the lazy dog. " * 230  # about 2,300 tokens: more than a prefill chunk
    (tmp_path / "doc.txt").write_text(text)
    common = ["--no-chat", "--max-new-tokens", "4", "--drafter", "none", "--dtype", "fp32"]
    as_arg = hyflash("generate", text, *common, "--json")
    from_file = hyflash("generate", "--prompt-file", str(tmp_path / "doc.txt"), *common, "--json")
    from_stdin = subprocess.run([sys.executable, "-m", "hyflash.cli", "generate", "-f", "-", *common, "--json"],
                                input=text, capture_output=True, text=True, timeout=300)
    runs = [json.loads(proc.stdout) for proc in (as_arg, from_file, from_stdin)]
    assert runs[0]["stats"]["prompt_tokens"] > 2048
    assert runs[0]["token_ids"] == runs[1]["token_ids"] == runs[2]["token_ids"]
    shown = hyflash("generate", "-f", str(tmp_path / "doc.txt"), *common)
    assert shown.returncode == 0 and "prefill" in shown.stderr and "tok" in shown.stderr


def test_shipped_drafter_is_the_default_and_lossless(smollm2_fp32):
    from hyflash.decoding import generate
    from hyflash.proposers import HyFlashProposer, LookupThenDrafter, load_proposer, shipped_drafter_path

    path = shipped_drafter_path(smollm2_fp32)
    assert path is not None and (path / "model.safetensors").stat().st_size < 40 * 2**20  # small, in the repo
    proposer = load_proposer("auto", smollm2_fp32)
    assert isinstance(proposer, HyFlashProposer) and proposer.tree > 1  # a tree where the target verifies one
    assert isinstance(load_proposer("ngram+auto", smollm2_fp32), LookupThenDrafter)
    ids = smollm2_fp32.encode("Give three tips for staying focused while studying.")
    plain = generate(smollm2_fp32, ids, None, max_new_tokens=40)
    spec = generate(smollm2_fp32, ids, proposer, max_new_tokens=40)
    assert spec.token_ids == plain.token_ids and spec.stats.acceptance_length > 1.0
    proc = hyflash("generate", "Name two fruits.", "--json", "--max-new-tokens", "12")  # the default drafter
    assert proc.returncode == 0 and "no drafter shipped" not in proc.stderr
    stats = json.loads(proc.stdout)["stats"]
    assert stats["drafter"] == "ngram+auto" and stats["drafter_state_bytes"] > 0


def test_generate_notes_when_bf16_greedy_output_may_leave_plain_decodings():
    from hyflash import kernels

    proc = hyflash("generate", "Hi", "--max-new-tokens", "3", "--drafter", "ngram")
    assert proc.returncode == 0, proc.stderr
    assert ("near-ties" in proc.stderr) == (kernels.amx() is None)
    quiet = hyflash("generate", "Hi", "--max-new-tokens", "3", "--drafter", "ngram", "--dtype", "fp32")
    assert quiet.returncode == 0 and "near-ties" not in quiet.stderr


SLOW_VERIFY = [b for b in kernels.builds() if b in kernels.PAIRS_BY_FMA]  # avx2 on x86, neon on Arm


@pytest.mark.skipif(not SLOW_VERIFY or kernels.amx() is None, reason="needs a CPU with AVX2 and FMA, or 64-bit Arm")
def test_generate_drafts_a_smaller_tree_by_default_on_the_builds_without_bf16_dot_products():
    slow, best = SLOW_VERIFY[0], kernels.builds()[0]
    for build in (slow, best):
        proc = hyflash("generate", "Name two fruits.", "--json", "--max-new-tokens", "12", HYFLASH_KERNELS=build)
        assert proc.returncode == 0, proc.stderr
        assert "near-ties" not in proc.stderr  # the output is exact on every build
        stats = json.loads(proc.stdout)["stats"]
        assert stats["drafter"] == "ngram+auto"
        assert stats["tree"] == (2 if build in kernels.PAIRS_BY_FMA else 4)


def test_a_bad_hyflash_kernels_value_is_a_clean_error():
    proc = hyflash("generate", "Hi", "--max-new-tokens", "3", HYFLASH_KERNELS="avx3")
    assert_clean_error(proc, "HYFLASH_KERNELS='avx3': use 0 (off), 1 (the CPU's best) or one of")


def test_install_script_refuses_the_system_python(tmp_path):
    """scripts/install.sh outside a virtual environment stops before pip with a clear error (it would mix the pinned
    torch into the system's packages)."""
    from pathlib import Path

    base = Path(sys.base_prefix) / "bin" / "python3"
    (tmp_path / "python").symlink_to(base)  # `python` on PATH is the interpreter outside any venv
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "HYFLASH_SYSTEM_INSTALL")}
    env["PATH"] = f"{tmp_path}:{env['PATH']}"
    script = Path(__file__).resolve().parents[1] / "scripts" / "install.sh"
    run = subprocess.run(["bash", str(script), "dev"], capture_output=True, text=True, env=env, timeout=60)
    assert run.returncode == 2 and "no virtual environment is active" in run.stderr
    assert "python3 -m venv .venv" in run.stderr and run.stdout == ""
