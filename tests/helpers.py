"""Builders the tests share: tiny random LLaDA- and Dream-layout Hugging Face checkpoints, a user's rule module, and
where things are.

Plain functions (no fixtures): a test imports what it builds with (`from helpers import tiny_hf_config`);
`conftest.py` holds the session fixtures made from them.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"

TOKENIZER_CORPUS = [
    "Question: Mia has 3 apples. She buys 4 more. How many apples does Mia have?\nAnswer: 3 + 4 = <<3+4=7>>7\n#### 7",
    "Question: Tom has 9 pens and gives 2 away. How many pens are left?\nAnswer: 9 - 2 = <<9-2=7>>7\n#### 7",
    "The quick brown fox jumps over the lazy dog. 0 1 2 3 4 5 6 7 8 9",
] * 20


def decode_config(strategy: str = "localleap", *, kappa=None, tau=None, radius=None, steps=None, **fields):
    """A DecodeConfig from a strategy name and the settings the eager oracles take beside it, mapped onto the rule
    the way the command lines' shared flags are (each to a rule that has it: ll.rules.with_shared_settings)."""
    import localleap_jax as ll

    rule = ll.rules.with_shared_settings(strategy, kappa=kappa, tau=tau, radius=radius, steps=steps)
    return ll.DecodeConfig(strategy=rule, **fields)


def tiny_hf_config(vocab: int, mask_id: int, eos_id: int, **overrides) -> dict:
    cfg = {
        "architectures": ["LLaDAModelLM"], "model_type": "llada", "auto_map": {"AutoModel": "modeling_llada.LLaDAModelLM"},
        "d_model": 64, "n_heads": 4, "n_kv_heads": 4, "n_layers": 3, "mlp_hidden_size": 96,
        "vocab_size": vocab, "embedding_size": -(-vocab // 16) * 16, "max_sequence_length": 512,
        "rope": True, "rope_theta": 10000.0, "rope_full_precision": True, "layer_norm_type": "rms",
        "rms_norm_eps": 1e-5, "activation_type": "silu", "block_type": "llama", "alibi": False,
        "include_bias": False, "include_qkv_bias": False, "weight_tying": False, "attention_layer_norm": False,
        "scale_logits": False, "input_emb_norm": False, "mask_token_id": mask_id, "eos_token_id": eos_id,
        "pad_token_id": eos_id,
    }
    cfg.update(overrides)
    return cfg


def tiny_family_configs(vocab: int = 300, wide: bool = False) -> dict:
    """Every family's network at a tiny size, as ModelConfigs (no weights, no tokenizer): LLaDA, Dream, SDAR, Fast-dLLM
    v2, LLaDA2 and LLaDA-MoE (MoE), DiffusionGemma (the sizes its own tests use). Mask id vocab - 50, EOS vocab - 49.
    `wide`: the same layers, heads and experts with wider matrices (hidden 256 (Dream 224), MLP 512, experts 128), so
    that a pass's bytes are mostly weights, as in the released models (at hidden 32-112 a block's activations weigh as
    much as the weights)."""
    from localleap_jax.families import read_config

    mask, eos = vocab - 50, vocab - 49
    d, f, e = (256, 512, 128) if wide else (None, None, None)
    wider = (lambda **sizes: sizes) if wide else (lambda **sizes: {})  # noqa: E731
    moe = {"vocab_size": vocab, "hidden_size": d or 32, "num_hidden_layers": 3, "num_attention_heads": 4,
           "num_key_value_heads": 2, "num_experts": 8, "num_experts_per_tok": 3, "tie_word_embeddings": False,
           "rope_scaling": None, "mask_token_id": mask, "eos_token_id": eos, "pad_token_id": eos}
    text = dict(vocab_size=vocab, hidden_size=d or 32, intermediate_size=f or 48, num_hidden_layers=5,
                num_attention_heads=4,
                num_key_value_heads=2, head_dim=8, global_head_dim=16, num_global_key_value_heads=1, sliding_window=5,
                layer_types=["sliding_attention", "full_attention", "sliding_attention", "sliding_attention",
                             "full_attention"],
                num_experts=6, top_k_experts=2, moe_intermediate_size=e or 16, max_position_embeddings=512,
                eos_token_id=0, pad_token_id=0, bos_token_id=1)
    vision = dict(model_type="gemma4_vision", hidden_size=16, intermediate_size=16, num_hidden_layers=1,
                  num_attention_heads=2, num_key_value_heads=2, head_dim=8, position_embedding_size=16)
    hf = {
        "llada": tiny_hf_config(vocab, mask, eos, **wider(d_model=d, mlp_hidden_size=f)),
        "dream": tiny_dream_config(vocab, mask, eos, **wider(hidden_size=224, intermediate_size=f)),
        "sdar": tiny_sdar_config(vocab, eos, mask_token_id=mask, block_size=4, **wider(hidden_size=d, intermediate_size=f)),
        "fast_dllm_v2": tiny_dream_config(vocab, mask, eos, model_type="Fast_dLLM_Qwen",
                                          architectures=["Fast_dLLM_QwenForCausalLM"], bd_size=8,
                                          **wider(hidden_size=224, intermediate_size=f)),
        "llada2": {**moe, "model_type": "llada2_moe", "architectures": ["LLaDA2MoeModelLM"], "head_dim": 16,
                   "partial_rotary_factor": 0.5, "rotary_dim": 8, "rope_theta": 600000.0, "rms_norm_eps": 1e-6,
                   "intermediate_size": f or 48, "moe_intermediate_size": e or 8, "n_group": 4, "topk_group": 2,
                   "routed_scaling_factor": 2.5, "num_shared_experts": 1, "first_k_dense_replace": 1,
                   "use_bias": False, "use_qkv_bias": False, "norm_head": False, "score_function": "sigmoid",
                   "norm_topk_prob": True},
        "llada_moe": {**moe, "model_type": "llada", "architectures": ["LLaDAMoEModelLM"], "rms_norm_eps": 1e-5,
                      "rope_theta": 50000.0, "partial_rotary_factor": 1.0, "dense_intermediate_size": f or 48,
                      "expert_intermediate_size": e or 8, "shared_expert_intermediate_size": None,
                      "moe_layer_freq": [0, 1, 1], "qk_layernorm": True, "moe_router_enable_expert_bias": False,
                      "norm_topk_prob": False, "routed_scaling_factor": 1, "attention_bias": False, "clip_qkv": None},
        "diffusion_gemma": {"architectures": ["DiffusionGemmaForBlockDiffusion"], "model_type": "diffusion_gemma",
                            "canvas_length": 8, "image_token_id": 290, "tie_word_embeddings": True,
                            "text_config": {"model_type": "diffusion_gemma_text", **text}, "vision_config": vision},
    }
    return {name: read_config(cfg) for name, cfg in hf.items()}


def random_llada_tensors(cfg: dict, seed: int = 0, head_scale: float = 1.0) -> dict:
    """LLaDA-named torch tensors (fp32). `head_scale` sharpens the output so confidences spread over (0, 1)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    d, f, v = cfg["d_model"], cfg["mlp_hidden_size"], cfg["embedding_size"]
    kv = cfg["n_kv_heads"] * (d // cfg["n_heads"])
    rnd = lambda *s, std=0.05: torch.randn(*s, generator=g) * std  # noqa: E731
    t = {
        "model.transformer.wte.weight": rnd(v, d, std=1.0),
        "model.transformer.ln_f.weight": 1 + rnd(d, std=0.1),
        "model.transformer.ff_out.weight": rnd(v, d, std=0.05 * head_scale),
    }
    for i in range(cfg["n_layers"]):
        b = f"model.transformer.blocks.{i}."
        t |= {b + "attn_norm.weight": 1 + rnd(d, std=0.1), b + "ff_norm.weight": 1 + rnd(d, std=0.1),
              b + "q_proj.weight": rnd(d, d, std=0.2), b + "k_proj.weight": rnd(kv, d, std=0.2),
              b + "v_proj.weight": rnd(kv, d, std=0.2), b + "attn_out.weight": rnd(d, d, std=0.1),
              b + "ff_proj.weight": rnd(f, d, std=0.1), b + "up_proj.weight": rnd(f, d, std=0.1),
              b + "ff_out.weight": rnd(d, f, std=0.1)}
    return t


def write_hf_checkpoint(path: Path, cfg: dict, tensors: dict, tokenizer, *, n_shards: int = 2, dtype=None,
                        index: bool = True) -> Path:
    """Sharded safetensors + index + config.json + tokenizer files, as the hub lays LLaDA out."""
    import torch
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    names = list(tensors)
    weight_map = {}
    for s in range(n_shards):
        part = names[s::n_shards]
        fname = f"model-{s + 1:05d}-of-{n_shards:05d}.safetensors"
        save_file({k: tensors[k].to(dtype or torch.float32).contiguous() for k in part}, str(path / fname))
        weight_map |= {k: fname for k in part}
    if index:
        (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (path / "config.json").write_text(json.dumps(cfg))
    if tokenizer is not None:
        tokenizer.save_pretrained(str(path))
    return path


# ---------------------------------------------------------------- Dream (Qwen2 layout)


def tiny_dream_config(rows: int, mask_id: int, eos_id: int, **overrides) -> dict:
    """A Dream config.json of Dream-v0-Instruct-7B's form at a tiny size: 14 query heads over 2 KV
    heads (7:1, like 28:4), head_dim 8, and more embedding rows than tokenizer ids (like 152064 vs 151667)."""
    cfg = {
        "architectures": ["DreamModel"], "attention_dropout": 0.0,
        "auto_map": {"AutoConfig": "configuration_dream.DreamConfig", "AutoModel": "modeling_dream.DreamModel"},
        "bos_token_id": eos_id, "eos_token_id": eos_id, "pad_token_id": eos_id, "mask_token_id": mask_id,
        "hidden_act": "silu", "hidden_size": 112, "intermediate_size": 160, "initializer_range": 0.02,
        "max_position_embeddings": 512, "max_window_layers": 3, "model_type": "Dream", "num_attention_heads": 14,
        "num_hidden_layers": 3, "num_key_value_heads": 2, "rms_norm_eps": 1e-06, "rope_scaling": None,
        "rope_theta": 1000000.0, "sliding_window": None, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
        "use_cache": False, "use_mrope": False, "use_sliding_window": False, "vocab_size": rows,
    }
    cfg.update(overrides)
    return cfg


def random_dream_tensors(cfg: dict, seed: int = 0, head_scale: float = 1.0) -> dict:
    """Dream-named torch tensors (fp32), q/k/v biases far from zero so a dropped bias shows in the logits."""
    import torch

    g = torch.Generator().manual_seed(seed)
    d, f, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    kv = cfg["num_key_value_heads"] * (d // cfg["num_attention_heads"])
    rnd = lambda *s, std=0.05: torch.randn(*s, generator=g) * std  # noqa: E731
    t = {
        "model.embed_tokens.weight": rnd(v, d, std=1.0),
        "model.norm.weight": 1 + rnd(d, std=0.1),
        "lm_head.weight": rnd(v, d, std=0.05 * head_scale),
    }
    for i in range(cfg["num_hidden_layers"]):
        b = f"model.layers.{i}."
        t |= {b + "input_layernorm.weight": 1 + rnd(d, std=0.1), b + "post_attention_layernorm.weight": 1 + rnd(d, std=0.1),
              b + "self_attn.q_proj.weight": rnd(d, d, std=0.2), b + "self_attn.q_proj.bias": rnd(d, std=0.5),
              b + "self_attn.k_proj.weight": rnd(kv, d, std=0.2), b + "self_attn.k_proj.bias": rnd(kv, std=0.5),
              b + "self_attn.v_proj.weight": rnd(kv, d, std=0.2), b + "self_attn.v_proj.bias": rnd(kv, std=0.5),
              b + "self_attn.o_proj.weight": rnd(d, d, std=0.1), b + "mlp.gate_proj.weight": rnd(f, d, std=0.1),
              b + "mlp.up_proj.weight": rnd(f, d, std=0.1), b + "mlp.down_proj.weight": rnd(d, f, std=0.1)}
    return t


def save_like_dream(tokenizer, path: Path) -> None:
    """Lay a tokenizer out as Dream-v0 does: only the "slow" Qwen2 files (vocab.json, merges.txt,
    tokenizer_config.json with the added tokens and chat template) and a remote-code tokenizer class,
    no tokenizer.json. The remote code here raises, so a test fails if anything ever runs it."""
    path.mkdir(parents=True, exist_ok=True)
    tokenizer.backend_tokenizer.model.save(str(path))  # vocab.json + merges.txt: the BPE ids only
    added = {str(i): {"content": t.content, "lstrip": False, "normalized": False, "rstrip": False,
                      "single_word": False, "special": True} for i, t in sorted(tokenizer.added_tokens_decoder.items())}
    (path / "tokenizer_config.json").write_text(json.dumps({
        "add_bos_token": False, "add_prefix_space": False, "added_tokens_decoder": added,
        "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
        "auto_map": {"AutoTokenizer": ["tokenization_dream.DreamTokenizer", None]},
        "bos_token": None, "chat_template": tokenizer.chat_template, "clean_up_tokenization_spaces": False,
        "eos_token": "<|endoftext|>", "errors": "replace", "model_max_length": 131072, "pad_token": "<|endoftext|>",
        "split_special_tokens": False, "tokenizer_class": "DreamTokenizer", "unk_token": None}, indent=2))
    (path / "tokenization_dream.py").write_text('raise RuntimeError("remote code must never run")\n')


def write_dream_checkpoint(path: Path, cfg: dict, tensors: dict, tokenizer, **kw) -> Path:
    """Sharded safetensors + index + config.json + Dream's slow tokenizer files, as the hub lays Dream out."""
    write_hf_checkpoint(path, cfg, tensors, tokenizer=None, **kw)
    save_like_dream(tokenizer, path)
    return path


# ---------------------------------------------------------------- SDAR (Qwen3 layout, block diffusion)


def tiny_sdar_config(rows: int, eos_id: int, **overrides) -> dict:
    """An SDAR config.json of JetLM/SDAR-4B-Chat's form at a tiny size: GQA (4 query heads over 2 KV heads),
    head_dim 24 != hidden / heads, and like the released config no mask_token_id, pad id or block_size (the
    converter reads the mask id from the tokenizer and states the block size)."""
    cfg = {
        "architectures": ["SDARForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
        "auto_map": {"AutoConfig": "configuration_sdar.SDARConfig", "AutoModelForCausalLM": "modeling_sdar.SDARForCausalLM"},
        "bos_token_id": eos_id, "eos_token_id": eos_id, "head_dim": 24, "hidden_act": "silu", "hidden_size": 64,
        "initializer_range": 0.02, "intermediate_size": 96, "max_position_embeddings": 512, "max_window_layers": 3,
        "model_type": "sdar", "num_attention_heads": 4, "num_hidden_layers": 3, "num_key_value_heads": 2,
        "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000.0, "sliding_window": None,
        "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_cache": True, "use_sliding_window": False,
        "vocab_size": rows,
    }
    cfg.update(overrides)
    return cfg


def random_sdar_tensors(cfg: dict, seed: int = 0, head_scale: float = 1.0) -> dict:
    """SDAR-named torch tensors (fp32); q/k norm scales far from one so a dropped norm shows in the logits.
    A tied config gets no lm_head.weight (as a tied checkpoint has none)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    d, f, v, hd = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"], cfg["head_dim"]
    q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    rnd = lambda *s, std=0.05: torch.randn(*s, generator=g) * std  # noqa: E731
    t = {"model.embed_tokens.weight": rnd(v, d, std=1.0), "model.norm.weight": 1 + rnd(d, std=0.1)}
    if not cfg.get("tie_word_embeddings"):
        t["lm_head.weight"] = rnd(v, d, std=0.05 * head_scale)
    for i in range(cfg["num_hidden_layers"]):
        b = f"model.layers.{i}."
        t |= {b + "input_layernorm.weight": 1 + rnd(d, std=0.1), b + "post_attention_layernorm.weight": 1 + rnd(d, std=0.1),
              b + "self_attn.q_proj.weight": rnd(q, d, std=0.2), b + "self_attn.k_proj.weight": rnd(kv, d, std=0.2),
              b + "self_attn.v_proj.weight": rnd(kv, d, std=0.2), b + "self_attn.o_proj.weight": rnd(d, q, std=0.1),
              b + "self_attn.q_norm.weight": 1 + rnd(hd, std=0.5), b + "self_attn.k_norm.weight": 1 + rnd(hd, std=0.5),
              b + "mlp.gate_proj.weight": rnd(f, d, std=0.1), b + "mlp.up_proj.weight": rnd(f, d, std=0.1),
              b + "mlp.down_proj.weight": rnd(d, f, std=0.1)}
    return t


# ---------------------------------------------------------------- a user's rule module (README's "Decoding rules")

# What a researcher writes, as README shows: a stateful rule class and a function, each registered by name.
USER_RULES = '''
import flax
import jax.numpy as jnp
import localleap_jax as ll


@ll.register("steady")                            # a stateful rule: a dataclass with init/update
@flax.struct.dataclass
class Steady(ll.rules.RuleBase):
    k: int = ll.rules.setting(2, int, low=1)      # a traced, validated, per-row setting
    def init(self, batch, block, vocab):
        return jnp.zeros((batch, block), jnp.int32), jnp.full((batch, block), -1, jnp.int32)
    def update(self, s, state):
        run, last = state
        run = jnp.where(s.pred == last, run + 1, 1)
        return s.candidates & (run >= ll.rules.per_row(self.k)), (run, s.pred)


@ll.register("confident")
def confident(s):
    return s.candidates & (s.conf >= 0.8)
'''
# The edit a test makes between two runs: Steady waits one pass longer (so its NFE and answers change).
USER_RULES_EDIT = ("run >= ll.rules.per_row(self.k))", "run >= ll.rules.per_row(self.k) + 1)")


def write_user_rules(path: Path, edited: bool = False) -> Path:
    text = USER_RULES.replace(*USER_RULES_EDIT) if edited else USER_RULES
    assert text != USER_RULES or not edited
    path.write_text(text)
    return path


@contextlib.contextmanager
def rules_put_back():
    """The rule registry and the loaded rule sources as they were, after the block (a test's rules are its own)."""
    from localleap_jax.rules import registry, sources

    saved = (dict(registry.RULES), dict(registry.ORIGINS), dict(sources._LOADED), dict(sources._BY_MODULE),
             set(sources._TRIED_ENTRY_POINTS))
    try:
        yield
    finally:
        for target, value in zip((registry.RULES, registry.ORIGINS, sources._LOADED, sources._BY_MODULE,
                                  sources._TRIED_ENTRY_POINTS), saved):
            target.clear()
            target.update(value)


@contextlib.contextmanager
def command_line_state_put_back():
    """What the lm-eval adapter's command line changes in this process (sys.argv, lm-eval's logging) put back."""
    import logging
    import sys

    import lm_eval.utils

    argv, logger = sys.argv[:], logging.getLogger("lm_eval")
    state = logger.handlers[:], logger.level, logger.propagate, lm_eval.utils._LOGGING_CONFIGURED
    try:
        yield
    finally:
        sys.argv = argv
        logger.handlers[:], logger.propagate, lm_eval.utils._LOGGING_CONFIGURED = state[0], state[2], state[3]
        logger.setLevel(state[1])


USER_CACHE = '''
import localleap_jax as ll
from flax import struct
from localleap_jax.decode.cache import DualCache, setting


@ll.register_cache("dual_every")
@struct.dataclass
class DualEvery(DualCache):
    """Fast-dLLM's dual cache, refreshed every `every` passes of a block instead of once."""

    every: int = setting(4, int, low=1)

    def refreshing(self, view):
        return view.step % self.every == 0
'''


def write_user_cache(path: Path) -> Path:
    """A user's cache policy file (`--rules` loads it as it loads rules): 'dual_every:every=N'."""
    path.write_text(USER_CACHE)
    return path
