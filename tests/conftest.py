"""Shared fixtures: the real default target (SmolLM2-135M-Instruct) and tiny randomly initialised models."""

import pytest
import torch

from hyflash import kernels
from hyflash.target import Target


@pytest.fixture(scope="module")
def one_thread():
    """Run a module's tests on one thread (tiny models are fastest so), restoring the setting afterwards."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(params=kernels.builds() if kernels.amx() is not None else [None])
def each_build(request, monkeypatch):
    """Run a test once per build of our C++ kernels this CPU can run (an AVX-512 BF16 CPU also runs the AVX2 build),
    with ``HYFLASH_KERNELS`` naming it; the module cache is cleared around it so that the test loads that build."""
    if request.param is not None:
        monkeypatch.setenv("HYFLASH_KERNELS", request.param)
    kernels.amx.cache_clear()
    yield request.param
    monkeypatch.undo()
    kernels.amx.cache_clear()


@pytest.fixture(scope="session")
def smollm2_fp32():
    """The real default target in fp32 (exactness tests run in fp32, DESIGN §1)."""
    torch.set_num_threads(2)
    return Target.load("smollm2-135m", dtype="fp32")


def tiny_llama(vocab=32, hidden=32, layers=3, seed=0, dtype=torch.float64):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      eos_token_id=vocab - 1, bos_token_id=0, pad_token_id=0, tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg).to(dtype)
    return Target(model, None, "tiny-llama", feature_layers=[0, 1])


def tiny_gemma3(vocab=48, hidden=32, layers=4, sliding_window=6, seed=0, dtype=torch.float64):
    """A Gemma 3 text model whose sliding-window layers (window 6) alternate with full-attention layers."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(seed)
    cfg = Gemma3TextConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                           num_hidden_layers=layers, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                           sliding_window=sliding_window, layer_types=["sliding_attention", "full_attention"] * (layers // 2),
                           max_position_embeddings=256, eos_token_id=vocab - 1, bos_token_id=2, pad_token_id=0)
    model = Gemma3ForCausalLM(cfg).to(dtype)
    return Target(model, None, "tiny-gemma3", feature_layers=[0, 1])
