"""Model families: everything that tells one family from another, one file each.

    family = family_of(model.config)        # the record: how to read/write its config.json, its tensors, ...
    config = read_config(hf_config_dict)    # config.json -> ModelConfig, the family from model_type/architectures
    hf = write_config(config)               # ModelConfig -> config.json in the family's own layout

  llada  LLaDA (OLMo-style keys), bidirectional                                        llada.py
  dream  Dream (Qwen2.5 keys): q/k/v biases, logits lag one position                    dream.py
  sdar   SDAR / TraDo (Qwen3 keys): per-head q/k norms, tied head, block-causal           sdar.py
  fast_dllm_v2  Fast-dLLM v2 (Qwen2.5 keys): block-causal, logits shifted, sub-blocks   fast_dllm_v2.py
  llada2        LLaDA2.x (Ling-2.0 MoE): block-causal (a decoding block), partial rotary  llada2.py
  llada_moe     LLaDA-MoE (OLMoE-like MoE), bidirectional                                 llada_moe.py
  diffusion_gemma  DiffusionGemma: Gemma-4 MoE encoder-decoder, uniform-noise canvases     diffusion_gemma.py
                   (its own network, `init_params`/`denoiser` hooks)
  (fields.py: typed config.json readers; qwen.py: the Qwen2/Qwen3 keys and tensor names Dream and SDAR share;
   target.py: where a tensor goes.)

A family's reader turns its config.json into the family-neutral `ModelConfig` (the network's sizes and
switches: biases, q/k norms, a tied head, block-causal attention, the logits shift); the rest of the library
reads those switches, or asks the family record (`family_of`) for what is not the network's: conversion hooks,
the likelihood estimator, evaluation defaults. Nothing outside this package compares family names.

Adding a family: a file here ending in `FAMILY = Family(...)`, one line in `FAMILIES` below, and its tests.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Callable, Mapping

from localleap_jax.config import ModelConfig
from localleap_jax.errors import ConfigError
from localleap_jax.families.target import Target, by_hf_name, parts


@dataclasses.dataclass(frozen=True)
class Family:
    """What a model family is, beside the network its ModelConfig describes."""

    name: str  # ModelConfig.family, manifest.json's "family", `python -m convert --family NAME`
    title: str  # how messages name it ("LLaDA")
    model_types: tuple[str, ...]  # config.json model_type values (compared lowercased) that name it
    architectures: tuple[str, ...]  # substrings of config.json architectures that name it (the longest match wins)
    read: Callable[[Mapping[str, Any]], ModelConfig]  # config.json -> ModelConfig; refuses what the network lacks
    write: Callable[[ModelConfig], dict[str, Any]]  # ModelConfig -> config.json, for checkpoints written here
    tensor_map: Callable[[ModelConfig], dict[str, Target]]  # every HF tensor of a checkpoint, and where it goes
    mask_token: str  # the tokenizer's mask token
    # The network, for a family model.py does not implement (its own in its file; `ModelConfig.arch` holds its
    # settings): random parameters `init_params(config, rng, dtype)` (their tree is the checkpoint's), and what the
    # decode loop runs, `denoiser(params, config)`. None: model.py's network and `denoiser.ModelDenoiser`.
    init_params: Callable[..., Any] | None = None
    denoiser: Callable[[Any, ModelConfig], Any] | None = None
    # The two layouts of its parameters (model.py's docstring): `decoding_params(params, config, free=)` splits the
    # stored tree into one array per layer, `stacked_params(params, config)` stacks it back. None: model.py's.
    decoding_params: Callable[..., Any] | None = None
    stacked_params: Callable[[Any, ModelConfig], Any] | None = None
    chat_format: str = "llada"  # the small tokenizers this project trains: LLaDA's specials, or "chatml"
    key_hint: str | None = None  # a config.json key that names the family when architectures do not
    # Conversion: what config.json lacks, completed from the source's other files (`complete_config(src, hf)`);
    # a tokenizer.json built into `workdir` from the source's slow tokenizer files (`build_tokenizer(src, workdir)`
    # -> whether it built one).
    complete_config: Callable[[Path, dict], dict] | None = None
    build_tokenizer: Callable[[Path, Path], bool] | None = None
    slow_tokenizer_files: str = ""  # what `build_tokenizer` reads, for the "no tokenizer" message
    # Name prefixes of HF tensors the network does not use, which the converter skips (DiffusionGemma's vision
    # tower: this package runs its text model only).
    ignored_tensors: tuple[str, ...] = ()
    # HF tensors tied to another one that an export without de-duplication also writes (`tied_copies(config)` ->
    # {copy name: its source's name}; DiffusionGemma's encoder, tied to its decoder). A tied head's lm_head.weight is
    # every family's already (`families.tied_copies`). The converter accepts a copy equal to its source.
    tied_copies: Callable[[ModelConfig], dict[str, str]] | None = None
    # Likelihood: the family's own Monte-Carlo estimator ("llada" | "dream"), or None with the reason it is refused;
    # how text becomes (context, continuation) ids: LLaDA's split, or Dream's with EOS appended to the whole (context
    # its estimator never masks).
    likelihood: str | None = "llada"
    likelihood_refusal: str = ""
    pairs_end_with_eos: bool = False
    # Decoding: sub-blocks of a block-diffusion model's blocks the rule commits in, in order (0: none; Fast-dLLM
    # v2's 8), the default of DecodeConfig.sub_block_length.
    sub_block_length: int = 0
    # Evaluation: the strategies a run that names none compares (the baseline first).
    eval_strategies: str = "low_confidence,threshold,localleap"


from localleap_jax.families import diffusion_gemma, dream, fast_dllm_v2, llada, llada2, llada_moe, sdar  # noqa: E402

FAMILIES: dict[str, Family] = {f.name: f for f in (llada.FAMILY, dream.FAMILY, sdar.FAMILY, fast_dllm_v2.FAMILY,
                                                    llada2.FAMILY, llada_moe.FAMILY, diffusion_gemma.FAMILY)}


def family_of(config_or_name: ModelConfig | str) -> Family:
    """The record of a ModelConfig's family (or of a family name)."""
    name = config_or_name if isinstance(config_or_name, str) else config_or_name.family
    try:
        return FAMILIES[name]
    except KeyError:
        raise ConfigError(f"unknown model family {name!r}; known: {', '.join(FAMILIES)}") from None


def detect(cfg: Mapping[str, Any]) -> Family:
    """The family a config.json names: by model_type and architectures (which must agree), else by its key style."""
    model_type = cfg.get("model_type")
    by_type = [] if model_type is None else [f for f in FAMILIES.values() if str(model_type).lower() in f.model_types]
    if model_type is not None and not by_type:
        known = ", ".join(f"{f.title} ({f.model_types[0]!r})" for f in FAMILIES.values())
        raise ConfigError(f"config.json has model_type={model_type!r}; the families this package runs are {known}")
    archs = cfg.get("architectures") or []
    arch_text = " ".join(map(str, archs)) if isinstance(archs, list) else str(archs)
    hits = [(len(a), f) for f in FAMILIES.values() for a in f.architectures if a in arch_text]
    by_arch = max(hits, key=lambda h: h[0])[1] if hits else None
    if by_type and by_arch is not None and by_arch not in by_type:
        raise ConfigError(f"config.json contradicts itself: model_type={model_type!r} but architectures={archs!r}")
    hinted = [f for f in (by_type or FAMILIES.values()) if f.key_hint and f.key_hint in cfg]
    if by_arch is not None or by_type:  # families sharing a model_type (LLaDA, LLaDA-MoE) are told apart by keys
        return by_arch or (hinted or by_type)[0]
    if hinted:
        return hinted[0]
    known = ", ".join(f"{f.model_types[0]!r} ({f.title})" for f in FAMILIES.values())
    raise ConfigError(f"config.json names no model family: expected model_type {known}")


def read_config(cfg: Mapping[str, Any]) -> ModelConfig:
    """A config.json (as a dict) as the ModelConfig of its family."""
    if not isinstance(cfg, Mapping):
        raise ConfigError(f"config.json must hold a JSON object, not a {type(cfg).__name__}")
    return detect(cfg).read(cfg)


def read_config_file(path: str | Path) -> ModelConfig:
    path = Path(path)
    try:
        cfg = json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"no config.json at {path}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path} is not valid JSON: {e}") from None
    return read_config(cfg)


def write_config(config: ModelConfig) -> dict[str, Any]:
    """A config.json in the family's own layout, for checkpoints this project writes itself."""
    return family_of(config).write(config)


def tensor_map(config: ModelConfig) -> dict[str, Target]:
    """Every HF tensor name of the config's family's checkpoints, with its destination in the tree."""
    return family_of(config).tensor_map(config)


def tied_copies(config: ModelConfig) -> dict[str, str]:
    """The HF tensors a checkpoint may also hold as copies of a tensor it is tied to, each with its source's name: a
    tied head's lm_head.weight (the embedding), and the family's own (`Family.tied_copies`). None of them is read:
    the network reads the source."""
    targets = tensor_map(config)
    out = {}
    if config.tie_word_embeddings:
        embedding = [n for n, e in targets.items() if parts(e)[0].path == ("wte", "embedding")]
        if len(embedding) == 1:
            out["lm_head.weight"] = embedding[0]
    own = family_of(config).tied_copies
    if own is not None:
        out |= own(config)
    return {copy: source for copy, source in out.items() if copy not in targets and source in targets}


def hf_tensors(params: Any, config: ModelConfig) -> dict[str, Any]:
    """The family's HF-named tensors ([out, in] like PyTorch) from a Flax tree in either layout (for the PyTorch
    references)."""
    return by_hf_name(stacked_params(params, config), tensor_map(config))


def init_params(config: ModelConfig, rng, dtype=None):
    """Random parameters of the config's network (N(0, 0.02) matrices, zero biases, unit norms): the family's own
    network, or model.py's."""
    import jax.numpy as jnp

    from localleap_jax import model

    init = family_of(config).init_params or model.init_params
    return init(config, rng, jnp.float32 if dtype is None else dtype)


def denoiser_of(params: Any, config: ModelConfig):
    """What the decode loop runs for these parameters: the family's own denoiser, or model.py's."""
    from localleap_jax.denoiser import ModelDenoiser

    make = family_of(config).denoiser
    return make(params, config) if make is not None else ModelDenoiser.of(params, config)


def decoding_params(params: Any, config: ModelConfig, *, free: bool = False):
    """The parameters as decoding reads them: one array per layer and matrix (a tree already so: as it is).
    `free`: delete each stored leaf once split (the model's bytes held once while loading)."""
    from localleap_jax import model

    split = family_of(config).decoding_params or model.decoding_params
    return split(params, config, free=free)


def stacked_params(params: Any, config: ModelConfig):
    """The parameters as checkpoints store them and training updates them (each run of layers stacked)."""
    from localleap_jax import model

    stack = family_of(config).stacked_params or model.stacked_params
    return stack(params, config)


def make_tokenizer(family: str, texts, vocab_size: int = 512):
    """A small byte-level BPE tokenizer with the family's special tokens and chat format (tests, train_tiny)."""
    from localleap_jax.tokenizer import make_tokenizer as train

    record = family_of(family)
    return train(texts, vocab_size, chat=record.chat_format, mask_token=record.mask_token)


__all__ = ["FAMILIES", "Family", "Target", "decoding_params", "denoiser_of", "detect", "family_of", "hf_tensors",
           "init_params", "make_tokenizer", "read_config", "read_config_file", "stacked_params", "tensor_map",
           "tied_copies", "write_config"]
