"""SDAR / TraDo (JetLM/SDAR-*-Chat, Gen-Verse/TraDo-*): Qwen3 continued-pretrained as a block-diffusion LM.

The network is a Qwen3 block (per-head RMSNorm on q and k before RoPE, head_dim from the config, an optionally tied
head, no biases) attending block-causally on each row's grid of `block_size` positions from its first real token
(`ModelConfig.block_size`); no logits shift. config.json (Qwen3 keys, defaults those of SDAR's configuration_sdar.py)
names neither the mask id (the tokenizer's `<|MASK|>`, which the slow files' added_tokens.json spells `<MASK>`) nor, in every release, the block size (the chat models'
default is 4): the converter writes both into the converted checkpoint's config.json. Likelihood: refused (the
authors publish no estimator). Evaluation: SDAR's own (OpenCompass, JetEngine) decodes with
low_confidence_dynamic at threshold 0.9.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

from localleap_jax.config import ModelConfig
from localleap_jax.errors import ConfigError
from localleap_jax.families import Family, qwen
from localleap_jax.families.fields import fill_token_id, flag, refuse, whole

MASK_TOKEN = "<|MASK|>"  # SDAR's (151669 in the release; config.json does not name it)
# The release's slow files (added_tokens.json, special_tokens_map.json) spell the same id <MASK>.
MASK_SPELLINGS = ("<MASK>",)
DEFAULT_BLOCK_SIZE = 4  # the block length SDAR's released chat models were trained with


def read(cfg: Mapping[str, Any]) -> ModelConfig:
    bad = qwen.refusals(cfg, tied_ok=True)
    if cfg.get("attention_bias"):
        bad.append("attention_bias=true (Qwen3 then biases q/k/v and o; not implemented)")
    refuse(bad)
    if cfg.get("mask_token_id") is None:
        raise ConfigError("config.json has no mask_token_id (SDAR's tokenizer names it <|MASK|>): convert the "
                          "checkpoint with `python -m convert SRC OUT`, which reads it from the tokenizer")
    fields = qwen.fields(cfg)
    block_size = whole(cfg, "block_size", default=DEFAULT_BLOCK_SIZE)
    return ModelConfig(**fields, family="sdar", qk_norm=True,
                       explicit_head_dim=whole(cfg, "head_dim", default=fields["d_model"] // fields["n_heads"]),
                       tie_word_embeddings=flag(cfg, "tie_word_embeddings", False), block_size=block_size)


def write(c: ModelConfig) -> dict[str, Any]:
    return {"architectures": ["SDARForCausalLM"], "model_type": "sdar", **qwen.keys(c), "head_dim": c.head_dim,
            "tie_word_embeddings": c.tie_word_embeddings, "attention_bias": False, "block_size": c.block_size}


def complete_config(src: Path, hf_config: dict) -> dict:
    """The block size (the chat models' default when absent) and the mask id (the tokenizer's <|MASK|>), so the
    converted checkpoint's config.json states both."""
    out = dict(hf_config)
    out.setdefault("block_size", DEFAULT_BLOCK_SIZE)
    fill_token_id(out, "mask_token_id", src, MASK_TOKEN, spellings=MASK_SPELLINGS, role="mask_token")
    return out


FAMILY = Family(
    name="sdar", title="SDAR", model_types=("sdar",), architectures=("SDAR",),
    read=read, write=write, tensor_map=qwen.tensor_map, mask_token=MASK_TOKEN, chat_format="chatml",
    complete_config=complete_config, build_tokenizer=qwen.build_slow_tokenizer,
    slow_tokenizer_files=qwen.SLOW_TOKENIZER_FILES,
    likelihood=None, likelihood_refusal="likelihood of block-diffusion models (SDAR) is not served: their authors "
    "publish no estimator, and a block-causal mask changes what a masked token sees",
    eval_strategies="low_confidence,dynamic:threshold=0.9,threshold,localleap")
