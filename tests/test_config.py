"""config.json validation, both families: every wrong type, range, out-of-vocabulary id and unimplemented
field is refused by name (never coerced: `int(64.7)` would silently build another model)."""

import pytest

from localleap_jax.config import ConfigError
from localleap_jax.families import read_config, write_config
from helpers import tiny_dream_config, tiny_hf_config

LLADA = tiny_hf_config(300, 2, 0)
DREAM = tiny_dream_config(320, 299, 296)


def _drop(cfg, key):
    return {k: v for k, v in cfg.items() if k != key}


@pytest.mark.parametrize("cfg, named", [
    ({**LLADA, "d_model": 64.7}, "d_model=64.7 must be an integer"),
    ({**LLADA, "d_model": 64.0}, "d_model=64.0 must be an integer"),
    ({**LLADA, "d_model": True}, "d_model=True must be an integer"),
    ({**LLADA, "d_model": "64"}, "d_model='64' must be an integer"),
    ({**LLADA, "n_layers": [3]}, "n_layers=[3] must be an integer"),
    ({**LLADA, "n_layers": 0}, "n_layers=0 must be >= 1"),
    ({**LLADA, "n_kv_heads": 3}, "n_heads=4 is not a multiple of n_kv_heads=3"),
    (_drop(LLADA, "vocab_size"), "missing vocab_size"),
    (_drop(LLADA, "mask_token_id"), "missing mask_token_id"),
    ({**LLADA, "embedding_size": 200}, "embedding_size=200 < vocab_size=300"),
    ({**LLADA, "eos_token_id": 300}, "eos_token_id=300 is outside the vocabulary"),
    ({**LLADA, "pad_token_id": 1000}, "pad_token_id=1000 is outside the vocabulary"),
    ({**LLADA, "mask_token_id": 300}, "mask_token_id=300 is outside the vocabulary"),
    ({**LLADA, "mask_token_id": 0}, "eos_token_id=0 equals mask_token_id: a generated end of text would read as a "
                                    "position still to generate"),
    ({**LLADA, "pad_token_id": 2}, "pad_token_id=2 equals mask_token_id: padding would read as positions to generate"),
    ({**LLADA, "pad_token_id": 5, "eos_token_id": 2}, "eos_token_id=2 equals mask_token_id"),  # pad apart: no guard
    ({**LLADA, "eos_token_id": None}, "missing eos_token_id"),
    ({**LLADA, "rms_norm_eps": 0}, "rms_norm_eps=0 must be a positive number"),
    ({**LLADA, "rope_theta": "1e4"}, "rope_theta='1e4' must be a positive number"),
    ({**LLADA, "rope_theta": float("nan")}, "rope_theta=nan must be a positive number"),
    ({**_drop(LLADA, "mlp_hidden_size"), "mlp_ratio": 1.3}, "mlp_ratio=1.3 times d_model=64 is not a whole number"),
    ({**LLADA, "rope_scaling": {"type": "linear", "factor": 2}}, "rope_scaling"),
    ({**LLADA, "rope_full_precision": False}, "rope_full_precision=False"),
    ({**LLADA, "layer_norm_with_affine": False}, "layer_norm_with_affine=False"),
    ({**LLADA, "bias_for_layer_norm": True}, "bias_for_layer_norm"),
    (_drop(LLADA, "rope"), "rope missing"),
    (_drop(LLADA, "layer_norm_type"), "layer_norm_type missing"),
    ({**DREAM, "hidden_size": 112.5}, "hidden_size=112.5 must be an integer"),
    ({**DREAM, "intermediate_size": "160"}, "intermediate_size='160' must be an integer"),
    ({**DREAM, "num_key_value_heads": 3}, "n_heads=14 is not a multiple of n_kv_heads=3"),
    ({**DREAM, "max_position_embeddings": 0}, "max_position_embeddings=0 must be >= 1"),
    ({**DREAM, "rms_norm_eps": -1e-6}, "rms_norm_eps=-1e-06 must be a positive number"),
    ({**DREAM, "mask_token_id": 320}, "mask_token_id=320 is outside the vocabulary"),
    ({**DREAM, "pad_token_id": 299}, "pad_token_id=299 equals mask_token_id"),
    ({**DREAM, "eos_token_id": [296, 297]}, "eos_token_id=[296, 297] must be an integer"),
    (_drop(DREAM, "mask_token_id"), "missing mask_token_id"),
    ({**DREAM, "attention_bias": "yes"}, "attention_bias='yes' must be true or false"),
    ({**DREAM, "head_dim": 16}, "head_dim=16"),
    ({**DREAM, "layer_types": ["full_attention", "sliding_attention", "full_attention"]}, "layer_types"),
    ({**DREAM, "rope_parameters": {"rope_type": "yarn", "factor": 4.0}}, "rope_parameters"),
    ({**DREAM, "use_sliding_window": True, "sliding_window": 64}, "use_sliding_window"),
    ({**DREAM, "rope_scaling": {"type": "dynamic", "factor": 2.0}}, "rope_scaling"),
    ({**DREAM, "tie_word_embeddings": True}, "tie_word_embeddings"),
    ({"model_type": "mistral", "hidden_size": 64}, "model_type='mistral'"),
    ({"hidden_size": 64}, "names no model family"),
    ([1, 2], "must hold a JSON object, not a list"),
])
def test_bad_config_is_refused_by_name(cfg, named):
    with pytest.raises(ConfigError, match=named.replace("[", r"\[").replace("]", r"\]").replace("(", r"\(")
                       .replace(")", r"\)").replace("+", r"\+")):
        read_config(cfg)


def test_dream_sliding_window_size_alone_is_not_in_use():
    """Qwen2/Dream only slide when use_sliding_window is true; a size next to `false` changes nothing."""
    assert read_config({**DREAM, "sliding_window": 4096, "use_sliding_window": False}).family == "dream"


@pytest.mark.parametrize("cfg", [LLADA, DREAM])
def test_both_families_round_trip(cfg):
    c = read_config(cfg)
    assert read_config(write_config(c)) == c
    assert c.logits_shift == (1 if c.family == "dream" else 0) and c.qkv_bias == (c.family == "dream")
