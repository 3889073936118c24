"""Fast-dLLM v2 (NVlabs; Efficient-Large-Model/Fast_dLLM_v2_7B, _1.5B): Qwen2.5 turned into a block-diffusion LM.

The network is Qwen2.5's unchanged (q/k/v biases, GQA, RMSNorm, rope_theta; the 1.5B ties its head) attending
block-causally on each row's grid of `bd_size` (32) positions from its first real token, with Dream's logit shift
(the token at i is scored from the hidden state at i - 1). config.json: model_type "Fast_dLLM_Qwen", Qwen2 keys,
`bd_size` -> block_size; no mask id: the mask is the tokenizer's additional special token `|<MASK>|` (151665 in
the releases), which the converter writes into the converted config.json. Stop `<|im_end|>` (151645). The hub keeps
tokenizer.json in git LFS, so a copy may hold only the slow files (vocab.json + merges.txt): the converter builds the
fast tokenizer from them, as for Dream. Pad: config.json's pad_token_id (151645, what the release's config.json
says, read here) differs from the tokenizer's and generation_config.json's (<|endoftext|>, 151643), which the
authors' batch_sample fills after a row's stop; a padding position is never attended and the text is cut at the
stop, so the two differ only in the raw tokens after it.

Decoding (the authors' `batch_sample`) runs each block in sub-blocks of `sub_block_length` (8 in their evaluation),
commits the threshold rule (0.9) among the current sub-block's masks, and stores a full block's K/V in one more
forward whose last position's argmax is the next block's first token (see localleap_jax/decode/cache.py
`BlockCache` and DecodeConfig.sub_block_length). Likelihood: refused (their lm-eval code scores only a target's
first token, with the rest of the target visible in its block: not an ELBO).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

from localleap_jax.config import ModelConfig
from localleap_jax.errors import ConfigError
from localleap_jax.families import Family, qwen
from localleap_jax.families.fields import fill_token_id, flag, refuse, whole

MASK_TOKEN = "|<MASK>|"
DEFAULT_BLOCK_SIZE = 32  # bd_size of the released models
SUB_BLOCK_LENGTH = 8  # small_block_size in the authors' evaluation


def read(cfg: Mapping[str, Any]) -> ModelConfig:
    refuse(qwen.refusals(cfg, tied_ok=True))
    if cfg.get("mask_token_id") is None:
        raise ConfigError(f"config.json has no mask_token_id (Fast-dLLM v2's tokenizer names it {MASK_TOKEN}): convert "
                          "the checkpoint with `python -m convert SRC OUT`, which reads it from the tokenizer")
    fields = qwen.fields(cfg)
    d_model, n_heads = fields["d_model"], fields["n_heads"]
    head_dim = cfg.get("head_dim")
    if head_dim is not None and head_dim != d_model // n_heads:
        refuse([f"head_dim={head_dim!r} (only hidden_size / num_attention_heads = {d_model // n_heads})"])
    return ModelConfig(**fields, family="fast_dllm_v2", qkv_bias=flag(cfg, "attention_bias", True), logits_shift=1,
                       tie_word_embeddings=flag(cfg, "tie_word_embeddings", False),
                       block_size=whole(cfg, "bd_size", default=DEFAULT_BLOCK_SIZE))


def write(c: ModelConfig) -> dict[str, Any]:
    return {"architectures": ["Fast_dLLM_QwenForCausalLM"], "model_type": "Fast_dLLM_Qwen", **qwen.keys(c),
            "tie_word_embeddings": c.tie_word_embeddings, "attention_bias": c.qkv_bias, "bd_size": c.block_size}


def complete_config(src: Path, hf_config: dict) -> dict:
    """The mask id (the tokenizer's |<MASK>|), so the converted checkpoint's config.json states it."""
    out = dict(hf_config)
    out.setdefault("bd_size", DEFAULT_BLOCK_SIZE)
    fill_token_id(out, "mask_token_id", src, MASK_TOKEN, role="mask_token")
    return out


FAMILY = Family(
    name="fast_dllm_v2", title="Fast-dLLM v2", model_types=("fast_dllm_qwen",), architectures=("Fast_dLLM",),
    read=read, write=write, tensor_map=qwen.tensor_map, mask_token=MASK_TOKEN, chat_format="chatml",
    complete_config=complete_config, build_tokenizer=qwen.build_slow_tokenizer,
    slow_tokenizer_files=qwen.SLOW_TOKENIZER_FILES, sub_block_length=SUB_BLOCK_LENGTH,
    likelihood=None, likelihood_refusal="likelihood of Fast-dLLM v2 is not served: the authors' lm-eval code scores "
    "only a target's first token with the rest of the target visible in its block (not an ELBO), and no faithful "
    "block-diffusion estimator exists yet",
    eval_strategies="threshold:kappa=0.9,low_confidence,localleap")
