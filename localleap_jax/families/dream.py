"""Dream (Dream-org/Dream-v0-Base-7B, -Instruct-7B): a Qwen2.5 block with bidirectional attention whose logits lag
one position: the token at i is scored from the hidden state at i - 1 (`ModelConfig.logits_shift` = 1).

config.json: Qwen2 keys (defaults those of Dream's configuration_dream.py, used only when a key is absent); Dream's
modeling code always builds q/k/v with biases (a config may say otherwise explicitly); untied head; vocab_size counts
every embedding row (152064), the tokenizer knows fewer ids. Tensors: Qwen2's names (qwen.py).
The release ships only a "slow" Qwen2 tokenizer (vocab.json + merges.txt) and remote code: the converter builds
the same tokenizer with transformers' own Qwen2 class (no remote code runs). Likelihood: Dream's estimator and
pairs (EOS appended to the whole string, never masked).
"""

from __future__ import annotations

from typing import Any, Mapping

from localleap_jax.config import ModelConfig
from localleap_jax.errors import ConfigError
from localleap_jax.families import Family, qwen
from localleap_jax.families.fields import flag, refuse

MASK_TOKEN = "<|mask|>"  # Dream's (151666 in the release; config.json names its id)


def read(cfg: Mapping[str, Any]) -> ModelConfig:
    refuse(qwen.refusals(cfg, tied_ok=False))
    fields = qwen.fields(cfg)
    d_model, n_heads = fields["d_model"], fields["n_heads"]
    head_dim = cfg.get("head_dim")
    if head_dim is not None and head_dim != d_model // n_heads:
        refuse([f"head_dim={head_dim!r} (only hidden_size / num_attention_heads = {d_model // n_heads})"])
    if fields["vocab_size"] != fields["embedding_size"]:  # one vocab_size in Dream's config: the embedding's rows
        raise ConfigError(f"a Dream config has vocab_size == embedding_size, got {fields['vocab_size']} and "
                          f"{fields['embedding_size']}")
    return ModelConfig(**fields, family="dream", qkv_bias=flag(cfg, "attention_bias", True), logits_shift=1)


def write(c: ModelConfig) -> dict[str, Any]:
    return {"architectures": ["DreamModel"], "model_type": "Dream", **qwen.keys(c), "sliding_window": None,
            "tie_word_embeddings": False, "attention_bias": c.qkv_bias}


FAMILY = Family(
    name="dream", title="Dream", model_types=("dream",), architectures=("Dream",),
    read=read, write=write, tensor_map=qwen.tensor_map, mask_token=MASK_TOKEN, chat_format="chatml",
    build_tokenizer=qwen.build_slow_tokenizer, slow_tokenizer_files="Dream's vocab.json + merges.txt",
    likelihood="dream", pairs_end_with_eos=True)
