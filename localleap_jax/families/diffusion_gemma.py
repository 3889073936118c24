"""DiffusionGemma (google/diffusiongemma-26B-A4B-it): a Gemma-4 MoE trunk as a block-diffusion encoder-decoder.

No mask token: a canvas of `canvas_length` tokens starts uniformly random and the positions a step does not
accept are re-randomised. The same weights run twice: the *encoder*, causally over the prompt and the finished
canvases (building K/V), and the *decoder*, bidirectionally over the current canvas, each layer attending to
[encoder K/V ; canvas K/V]; the decoder's input is the canvas embedding plus a self-conditioning signal, the
previous step's probabilities as an expected embedding. Text only: the vision tower is not converted and image
tokens are refused (`check_text_only`). The reference is transformers' `models/diffusion_gemma`
(configuration, modeling, generation), which the tests run.

The network (pure functions over a plain parameter dict; fp32 norms, RoPE and attention softmax, weights and
matmuls in the parameter dtype, logits in fp32):
- layers of two kinds from `layer_types`: "sliding" (head_dim, num_key_value_heads, q/k/v projections, default
  RoPE) and "full"/global (global_head_dim, num_global_key_value_heads, no v_proj: V is the raw K projection,
  proportional RoPE: only the first partial_rotary_factor of each head's frequency pairs rotate, at theta^(-2i/
  head_dim)); each kind its own theta. q and k get a per-head RMSNorm, v a scale-free one; attention scale 1.0.
  The tree holds one layer-stacked dict per kind ("sliding" [Ns, ...], "full" [Nf, ...]) and the layers run in
  `layer_types` order.
- a layer: h += post_attn_norm(attn(input_norm(h))); then a dense GELU-tanh MLP and the MoE (`moe.py`: softmax
  top-k renormalised, times per_expert_scale; the router reads RMSNorm(h) * scale / sqrt(D), the experts
  pre_ffw_norm_2(h)) side by side, h += post_ffw_norm(post_ffw_norm_1(mlp) + post_ffw_norm_2(moe)); then the
  whole residual h *= layer_scalar (the encoder has its own layer_scalar buffers, the decoder its own).
- RMSNorm weights are used as they are (x * w, not x * (1 + w)); embeddings times sqrt(D) (rounded to the
  parameter dtype, as transformers does); final norm, tied head, logits softcapped cap * tanh(z / cap).
- sliding layers: the encoder's query at position p sees keys in (p - W, p]; the decoder sees the last W - 1
  encoded positions (what transformers' sliding cache keeps) and the whole canvas. Google's JAX sampler
  (google-deepmind/gemma `gemma/diffusion`) lets the decoder see W context positions; transformers is followed.
  W is config.json's sliding_window (`use_bidirectional_attention="all"`, under which transformers halves it
  plus one and the encoder is no longer causal, is refused).

Positions start at each row's first real token (left padding is never attended), so a left-padded row
computes what it computes alone.

Layouts: the stored tree holds one layer-stacked dict per kind ("sliding" [Ns, ...], "full" [Nf, ...]); decoding
reads `decoding_params`' one dict per layer (`params[LAYERS]`, in layer order: `ll.load` splits once), so a pass
reads each layer's weights where they lie. The layers are a Python loop (unrolled: compile time grows with depth);
each layer's encoder K/V is an array of its own, written in place by `encode_into`, and `decode` attends over
[encoder K/V ; canvas K/V] with one softmax over both parts without concatenating them. `encode_into` attends over
the whole buffer under a mask.

Public functions (`config` is the loaded ModelConfig; all jit with it static):

    logits, kv = encode(params, ids, mask, config)        # causal encoder over [B, L]: softcapped logits
                                                          # [B, L, V] and one (k, v) [B, L, K, hd] per layer
    logits = decoder_logits(params, ids, mask, canvas, config, sc_logits=None)
                                                          # encode ids, then the decoder on canvas [B, C]:
                                                          # [B, C, V] softcapped; sc_logits [B, C, V]: the
                                                          # previous step's temperature-scaled logits
    cache = init_cache(config, batch, max_len)            # the encoder K/V as a static-shape buffer
    logits, cache = encode_into(params, cache, ids, mask, config)   # encode a chunk after what cache holds
    logits = decode(params, cache, canvas, config, soft)  # the decoder over one canvas (soft: [B, C, D] or None)
    soft = soft_embedding(params, z, config)              # softmax(z) @ E * sqrt(D): the self-conditioning input
    T = temperature(i, max_denoising_steps, t_min, t_max) # pass i from 0: t_min + (t_max - t_min) (N - i) / N
    accepted = accept(z, entropy_bound)                   # EntropyBoundSampler.accept_canvas's set
    stop_now, history = stop(argmax, history, z, confidence_threshold)   # StableAndConfidentStoppingCriteria

The encoder K/V cache (`EncoderCache`): per layer a [B, S, K, hd] buffer for K and for V, each
slot's position [B, S], whether it holds a real token [B, S], and per row the next free slot (`end`) and the
count of real tokens encoded (`length`, the position the canvas starts at). Its shape never changes, so it is a
`lax.while_loop` carry. `encode_into` writes a chunk of T slots at each row's `end` and attends over the whole
buffer under a mask from the slot positions (causal; sliding layers: the window), so encoding the prompt in
one call or in chunks gives the same K/V. A generation of J canvases of C tokens after a left-padded prompt
[B, Lp] calls them like this (transformers' `generate`, step for step):

    cache = init_cache(config, B, Lp + J * C)
    _, cache = encode_into(params, cache, prompt, prompt_mask, config)
    for j in range(J):                               # lax.while_loop over canvases
        canvas = argmax = noise[:, j, 0]             # uniform ids in [0, vocab)
        soft = None (zeros [B, C, D]); history = init_history(B, stability_threshold, C); done = False
        for i in range(N):                           # lax.while_loop over denoising steps, while any row works
            nfe += ~(done | ended)                   # transformers' count: passes while the row works
            z = decode(params, cache, canvas, config, soft) / temperature(i, N, t_min, t_max)
            x = categorical(z); a = argmax(z)        # transformers: torch.multinomial(softmax(z)); greedy: x = a
            new = where(accept(z, entropy_bound), x, noise[:, j, i + 1])      # accept, renoise the rest
            a, new, z = where(done, (argmax, canvas, z_prev), (a, new, z))   # rows done keep their state
            stop_now, history = stop(a, history, z, confidence_threshold)   # (the frozen argmax goes in)
            done |= stop_now; canvas, argmax, z_prev = new, a, z
            soft = soft_embedding(params, z, config)
        kept = argmax                                # the ARGMAX canvas is the output, not the sampled one
        ended |= any(kept in arch.eos_token_ids); pad what follows the first EOS (and the canvases of rows
        ended before); encode what is kept:
        _, cache = encode_into(params, cache, kept, ones, config)

tests/test_diffusion_gemma.py `eager_generate` is this loop, eagerly; it reproduces transformers' generate
(tokens and passes) with the draws supplied. On random weights at low temperature the self-conditioning feedback
multiplies fp32 noise by ~5 a step, so whole generations of two correct implementations part ways after a few
steps: compare them where the feedback is damped (that test scales the self-conditioning MLP by 0.1).

Randomness in transformers' generate (it has no deterministic mode; tests supply these draws): the initial
canvas (`EntropyBoundSampler.initialize_canvas`, torch.randint [B, C], once per canvas), then in every step
`torch.multinomial(softmax(z))` (the sample x) and, after it, the renoise draw (`renoise_canvas` ->
`initialize_canvas`, torch.randint [B, C], also after the last step and for rows already done). So a loop fed
`canvas_noise [B, J, N + 1, C]` (index 0 the initial canvas, index i + 1 the renoise after pass i) and a
sampler that is argmax (or fed Gumbel noise) reproduces it once torch.multinomial is made to agree (the test
patches `EntropyBoundSampler.initialize_canvas` / `renoise_canvas` and `torch.multinomial`; transformers has no
greedy mode: the temperature never reaches 0). Its generate needs `attn_implementation="sdpa"`: under "eager"
it builds the decoder's mask with the canvas' integer dtype and fails.

Where Google's JAX sampler (google-deepmind/gemma `gemma/diffusion/_sampler.py`, `_early_stopping.py`)
differs from transformers (followed here): its stability test compares the argmax with the canvas fed in, not
with the previous argmax; its entropy stop is `<=` (transformers `<`); it returns (and encodes) the last
sampled canvas, not the argmax; its decoder sees W context positions in sliding layers, not W - 1; it carries
the self-conditioning embedding in bf16 and freezes only the canvas of finished rows.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from pathlib import Path
from typing import Any, Mapping, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jaxtyping import Array, Bool, Float, Int

from localleap_jax.config import ModelConfig
from localleap_jax.errors import ConfigError, DecodeError
from localleap_jax.families import Family
from localleap_jax.families.fields import flag, positive, refuse, whole
from localleap_jax.families.target import Target
from localleap_jax.moe import MoE, Router, moe_layer
from localleap_jax.rules.canvas import entropy, entropy_bound_accept
from localleap_jax.tokenizer import added_token_id

MASK_TOKEN = "<mask>"  # Gemma's reserved mask token: DiffusionGemma never reads nor writes it
GEMMA_MASK_ID = 4  # its id in Gemma's vocabulary, when neither config.json nor the tokenizer names one
KINDS = {"sliding_attention": "sliding", "full_attention": "full"}  # transformers' layer type -> our stack
ACTIVATION = "gelu_pytorch_tanh"


# ---------------------------------------------------------------- settings


@dataclasses.dataclass(frozen=True)
class Rotary:
    """One layer kind's RoPE: "default" (every frequency pair of the head, theta^(-2i/rotary dims)) or
    "proportional" (the first `partial` share of the head's pairs at theta^(-2i/head_dim), the rest not rotated;
    all frequencies divided by `factor`)."""

    kind: str
    theta: float
    partial: float = 1.0
    factor: float = 1.0

    def inv_freq(self, head_dim: int) -> np.ndarray:
        """[head_dim / 2] fp32 inverse frequencies, as transformers computes them (zeros: pairs left as they are)."""
        if self.kind == "default":
            steps = np.arange(0, head_dim, 2, dtype=np.float32) / np.float32(head_dim)
            return (np.float32(1.0) / (np.float32(self.theta) ** steps)).astype(np.float32)
        angles = int(self.partial * head_dim // 2)
        steps = np.arange(0, 2 * angles, 2).astype(np.float32) / np.float32(head_dim)
        rotated = np.float32(1.0) / (np.float32(self.theta) ** steps)
        out = np.concatenate([rotated, np.zeros(head_dim // 2 - angles, np.float32)])
        return (out / np.float32(self.factor)).astype(np.float32)


@dataclasses.dataclass(frozen=True)
class DiffusionGemmaArch:
    """DiffusionGemma's own settings (`ModelConfig.arch`); the ModelConfig fields hold the sliding layers' sizes, the
    canvas length (`canvas_length`) and every id that ends a row (`eos_token_ids`)."""

    layer_types: tuple[str, ...]  # per layer: "sliding" or "full"
    sliding_window: int  # W (module docstring)
    global_head_dim: int
    global_kv_heads: int
    sliding_rotary: Rotary
    global_rotary: Rotary
    logit_softcap: float
    num_experts: int
    top_k_experts: int
    moe_intermediate_size: int
    image_token_ids: tuple[int, ...]  # image placeholder, begin and end of image: refused (text only)
    moe_dispatch: str | None = None  # moe.MoE.dispatch (None: its default)

    def __post_init__(self):
        if not self.layer_types or set(self.layer_types) - {"sliding", "full"}:
            raise ConfigError(f"layer_types {self.layer_types!r}: expected 'sliding' and 'full' layers")

    @property
    def slots(self) -> tuple[tuple[str, int], ...]:
        """Each layer's (kind, index in that kind's stack), in layer order."""
        seen = {"sliding": 0, "full": 0}
        out = []
        for kind in self.layer_types:
            out.append((kind, seen[kind]))
            seen[kind] += 1
        return tuple(out)

    def count(self, kind: str) -> int:
        return self.layer_types.count(kind)

    def moe(self) -> MoE:
        router = Router(self.num_experts, self.top_k_experts, score="softmax", normalise=True, expert_scale=True)
        chosen = {} if self.moe_dispatch is None else {"dispatch": self.moe_dispatch}
        return MoE(router, activation="gelu_tanh", **chosen)


def arch_of(config: ModelConfig) -> DiffusionGemmaArch:
    if not isinstance(config.arch, DiffusionGemmaArch):
        raise ConfigError(f"a {config.family} config has no DiffusionGemma settings (ModelConfig.arch)")
    return config.arch


def head_dims(config: ModelConfig) -> dict[str, tuple[int, int]]:
    """Per layer kind: (key/value heads, head size)."""
    a = arch_of(config)
    return {"sliding": (config.n_kv_heads, config.head_dim), "full": (a.global_kv_heads, a.global_head_dim)}


# ---------------------------------------------------------------- config.json


def _text_config(cfg: Mapping[str, Any]) -> Mapping[str, Any]:
    text = cfg.get("text_config")
    if not isinstance(text, Mapping):
        raise ConfigError("config.json has no text_config object (DiffusionGemma keeps its text model's settings "
                          "there)")
    return text


def _rotary(params: Any, kind: str) -> Rotary:
    if not isinstance(params, Mapping):
        raise ConfigError(f"config.json rope_parameters[{kind!r}] must be an object")
    rope_type = params.get("rope_type", "default")
    theta = positive(params, "rope_theta", None)
    partial = positive(params, "partial_rotary_factor", 1.0)
    factor = positive(params, "factor", 1.0)
    if rope_type == "default" and (partial != 1.0 or factor != 1.0):
        raise ConfigError(f"config.json rope_parameters[{kind!r}]: default RoPE with partial_rotary_factor or "
                          "factor is not implemented (transformers cannot run it either)")
    if rope_type not in ("default", "proportional"):
        raise ConfigError(f"config.json rope_parameters[{kind!r}] rope_type={rope_type!r}: only 'default' and "
                          "'proportional' are implemented")
    if partial > 1.0:
        raise ConfigError(f"config.json rope_parameters[{kind!r}] partial_rotary_factor={partial} must be <= 1")
    return Rotary(rope_type, theta, partial, factor)


def _layer_types(text: Mapping, n_layers: int) -> tuple[str, ...]:
    types = text.get("layer_types")
    if types is None:  # transformers' default: five sliding layers, then a full one
        types = ["sliding_attention" if (i + 1) % 6 else "full_attention" for i in range(n_layers)]
    if not isinstance(types, list) or len(types) != n_layers or any(t not in KINDS for t in types):
        raise ConfigError(f"config.json layer_types must list {n_layers} of 'sliding_attention' / "
                          f"'full_attention', got {types!r}")
    types = list(types)
    types[-1] = "full_attention"  # transformers forces the last layer global (with a warning)
    return tuple(KINDS[t] for t in types)


def _global_attention(text: Mapping, kinds: tuple[str, ...], n_kv: int) -> tuple[int, int]:
    """(global head size, global K/V heads), from either config.json form: the released one (global_head_dim,
    num_global_key_value_heads) or save_pretrained's per_layer_config (an override per full layer)."""
    per_layer = text.get("per_layer_config")
    if per_layer is None:
        head = whole(text, "global_head_dim", default=512)  # transformers' default
        heads = whole(text, "num_global_key_value_heads", default=n_kv)
        return head, heads
    if not isinstance(per_layer, Mapping):
        raise ConfigError("config.json per_layer_config must be an object of layer index -> overrides")
    overrides = {}
    for key, value in per_layer.items():
        if not str(key).isdigit() or not 0 <= int(key) < len(kinds) or not isinstance(value, Mapping):
            raise ConfigError(f"config.json per_layer_config has an entry {key!r}: expected a layer index")
        if kinds[int(key)] != "full":
            raise ConfigError(f"config.json per_layer_config overrides sliding layer {key}: only the global layers' "
                              "head size and K/V heads may differ (not implemented)")
        unknown = set(value) - {"head_dim", "num_key_value_heads"}
        if unknown:
            raise ConfigError(f"config.json per_layer_config[{key!r}] sets {sorted(unknown)}: only head_dim and "
                              "num_key_value_heads are implemented")
        overrides[int(key)] = (whole(value, "head_dim", default=text.get("head_dim", 256)),
                               whole(value, "num_key_value_heads", default=n_kv))
    full = [i for i, k in enumerate(kinds) if k == "full"]
    found = {overrides.get(i) for i in full}
    if len(found) != 1 or None in found:
        raise ConfigError("config.json per_layer_config must give every global layer the same head_dim and "
                          f"num_key_value_heads (got {overrides} for global layers {full})")
    return found.pop()


def _ids(value: Any, key: str) -> tuple[int, ...]:
    values = value if isinstance(value, list) else [value]
    if not values or any(isinstance(v, bool) or not isinstance(v, int) or v < 0 for v in values):
        raise ConfigError(f"config.json {key}={value!r} must be a token id or a list of them")
    return tuple(values)


def end_ids(cfg: Mapping[str, Any]) -> tuple[int, ...]:
    """Every id that ends a row, the EOS first: text_config.eos_token_id, then config.json's top-level eos_token_id and
    its generation_config's (transformers' generate stops at any of them: the release lists [1, 106, 50], <eos>, the
    end of a turn and 50, where text_config says 1 alone)."""
    text = _text_config(cfg)
    ids = list(_ids(text.get("eos_token_id", 1), "text_config.eos_token_id"))
    generation = cfg.get("generation_config")
    for key, value in (("eos_token_id", cfg.get("eos_token_id")),
                       ("generation_config.eos_token_id",
                        generation.get("eos_token_id") if isinstance(generation, Mapping) else None)):
        if value is not None:
            ids += [i for i in _ids(value, key) if i not in ids]
    return tuple(ids)


def read(cfg: Mapping[str, Any]) -> ModelConfig:
    text = _text_config(cfg)
    bad = []
    if text.get("use_bidirectional_attention") not in (None, "vision"):
        bad.append(f"use_bidirectional_attention={text.get('use_bidirectional_attention')!r} (a bidirectional "
                   "encoder; only the causal one, None or 'vision', is implemented)")
    if text.get("attention_bias"):
        bad.append("attention_bias=true")
    if text.get("hidden_activation", ACTIVATION) != ACTIVATION:
        bad.append(f"hidden_activation={text.get('hidden_activation')!r} (only {ACTIVATION})")
    if not flag(cfg, "tie_word_embeddings", True) or not flag(text, "tie_word_embeddings", True):
        bad.append("tie_word_embeddings=false (an untied head and encoder)")
    for key, default in (("hidden_size_per_layer_input", 0), ("num_kv_shared_layers", 0)):
        if text.get(key) not in (None, default):
            bad.append(f"{key}={text.get(key)!r} (Gemma 4's per-layer inputs and K/V sharing)")
    for key, default in (("enable_moe_block", True), ("attention_k_eq_v", True), ("use_double_wide_mlp", False)):
        if text.get(key) not in (None, default):
            bad.append(f"{key}={text.get(key)!r}")
    if any(text.get(k) is None for k in ("num_experts", "top_k_experts", "moe_intermediate_size")):
        bad.append("a layer without MoE block (num_experts, top_k_experts and moe_intermediate_size must be set)")
    refuse(bad)

    d_model = whole(text, "hidden_size", default=2304)
    n_heads = whole(text, "num_attention_heads", default=8)
    n_kv = whole(text, "num_key_value_heads", default=4)
    n_layers = whole(text, "num_hidden_layers", default=30)
    vocab = whole(text, "vocab_size", default=262_144)
    kinds = _layer_types(text, n_layers)
    global_head, global_kv = _global_attention(text, kinds, n_kv)
    for heads, what in ((n_kv, "num_key_value_heads"), (global_kv, "the global layers' K/V heads")):
        if n_heads % heads:
            raise ConfigError(f"num_attention_heads={n_heads} is not a multiple of {what} ({heads})")
    if global_head % 2:
        raise ConfigError(f"the global head size {global_head} must be even for rotate-half RoPE")
    rope = text.get("rope_parameters") or {
        "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
        "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0}}
    if not isinstance(rope, Mapping) or set(rope) - set(KINDS):
        raise ConfigError("config.json rope_parameters must map 'sliding_attention' / 'full_attention' to their RoPE")
    eos = end_ids(cfg)
    pad = whole(text, "pad_token_id", default=0, minimum=0)
    images = tuple(whole(cfg, key, default=d, minimum=0)
                   for key, d in (("image_token_id", 258_880), ("boi_token_id", 255_999), ("eoi_token_id", 258_882)))
    arch = DiffusionGemmaArch(
        layer_types=kinds, sliding_window=whole(text, "sliding_window", default=512), global_head_dim=global_head,
        global_kv_heads=global_kv,
        sliding_rotary=_rotary(rope.get("sliding_attention", {"rope_theta": 10_000.0}), "sliding_attention"),
        global_rotary=_rotary(rope.get("full_attention", {"rope_theta": 1_000_000.0}), "full_attention"),
        logit_softcap=positive(text, "final_logit_softcapping", 30.0), num_experts=whole(text, "num_experts"),
        top_k_experts=whole(text, "top_k_experts"), moe_intermediate_size=whole(text, "moe_intermediate_size"),
        image_token_ids=images)
    if arch.top_k_experts > arch.num_experts:
        raise ConfigError(f"top_k_experts={arch.top_k_experts} exceeds num_experts={arch.num_experts}")
    return ModelConfig(
        d_model=d_model, n_heads=n_heads, n_kv_heads=n_kv, n_layers=n_layers,
        mlp_hidden_size=whole(text, "intermediate_size", default=9216), vocab_size=vocab, embedding_size=vocab,
        rope_theta=arch.sliding_rotary.theta, rms_norm_eps=positive(text, "rms_norm_eps", 1e-6),
        max_sequence_length=whole(text, "max_position_embeddings", default=131_072),
        mask_token_id=whole(cfg, "mask_token_id", default=GEMMA_MASK_ID, minimum=0), eos_token_id=eos[0],
        pad_token_id=pad, family="diffusion_gemma", qk_norm=True,
        explicit_head_dim=whole(text, "head_dim", default=256), tie_word_embeddings=True, arch=arch,
        canvas_length=whole(cfg, "canvas_length", default=256), eos_token_ids=eos)


def write(c: ModelConfig) -> dict[str, Any]:
    """config.json in the released form (global_head_dim / num_global_key_value_heads, no per_layer_config)."""
    a = arch_of(c)
    types = {v: k for k, v in KINDS.items()}

    def rope(r: Rotary) -> dict:
        out = {"rope_type": r.kind, "rope_theta": r.theta}
        if r.kind == "proportional":
            out["partial_rotary_factor"] = r.partial
            if r.factor != 1.0:
                out["factor"] = r.factor
        return out

    image, boi, eoi = a.image_token_ids
    text = {
        "model_type": "diffusion_gemma_text", "vocab_size": c.vocab_size, "hidden_size": c.d_model,
        "intermediate_size": c.mlp_hidden_size, "num_hidden_layers": c.n_layers, "num_attention_heads": c.n_heads,
        "num_key_value_heads": c.n_kv_heads, "head_dim": c.head_dim, "global_head_dim": a.global_head_dim,
        "num_global_key_value_heads": a.global_kv_heads, "hidden_activation": ACTIVATION,
        "max_position_embeddings": c.max_sequence_length, "rms_norm_eps": c.rms_norm_eps,
        "pad_token_id": c.pad_token_id,
        "eos_token_id": list(c.end_ids) if len(c.end_ids) > 1 else c.end_ids[0],
        "tie_word_embeddings": True, "attention_bias": False, "sliding_window": a.sliding_window,
        "layer_types": [types[k] for k in a.layer_types], "final_logit_softcapping": a.logit_softcap,
        "rope_parameters": {"sliding_attention": rope(a.sliding_rotary), "full_attention": rope(a.global_rotary)},
        "use_bidirectional_attention": None, "num_experts": a.num_experts, "top_k_experts": a.top_k_experts,
        "moe_intermediate_size": a.moe_intermediate_size}
    return {"architectures": ["DiffusionGemmaForBlockDiffusion"], "model_type": "diffusion_gemma",
            "text_config": text, "canvas_length": c.canvas_length, "tie_word_embeddings": True,
            "eos_token_id": text["eos_token_id"],
            "image_token_id": image, "boi_token_id": boi, "eoi_token_id": eoi, "mask_token_id": c.mask_token_id}


def complete_config(src: Path, hf_config: dict) -> dict:
    """The ids that end a row from the source's generation_config.json too (what transformers' generate stops at),
    written into config.json's top-level eos_token_id; and the (unused) mask id: the tokenizer's <mask> when it has
    one. So the converted config.json states both."""
    out = dict(hf_config)
    generation = src / "generation_config.json"
    if generation.exists():
        try:
            stops = json.loads(generation.read_text()).get("eos_token_id")
        except (OSError, ValueError, AttributeError) as e:
            raise ConfigError(f"{generation} cannot be read as a JSON object ({type(e).__name__})") from None
        if stops is not None:
            top = list(_ids(out["eos_token_id"], "eos_token_id")) if out.get("eos_token_id") is not None else []
            out["eos_token_id"] = top + [i for i in _ids(stops, "generation_config.json eos_token_id") if i not in top]
    if out.get("mask_token_id") is None and (src / "tokenizer.json").exists():
        found = added_token_id(src / "tokenizer.json", MASK_TOKEN)
        if found is None:
            try:
                found = json.loads((src / "tokenizer.json").read_text())["model"]["vocab"].get(MASK_TOKEN)
            except (OSError, ValueError, KeyError, TypeError, AttributeError):
                found = None
        if isinstance(found, int):
            out["mask_token_id"] = found
    return out


# ---------------------------------------------------------------- parameters and tensor names

# Per layer: norms [D] (transformers' names: ours); the attention's and MLPs' kernels are [in, out].
NORMS = {"input_layernorm": "input_norm", "post_attention_layernorm": "post_attn_norm",
         "pre_feedforward_layernorm": "pre_ffw_norm", "post_feedforward_layernorm": "post_ffw_norm",
         "post_feedforward_layernorm_1": "post_ffw_norm_1", "post_feedforward_layernorm_2": "post_ffw_norm_2",
         "pre_feedforward_layernorm_2": "pre_ffw_norm_2"}


def _layer_shapes(config: ModelConfig, kind: str) -> dict:
    a = arch_of(config)
    D, F, E, Fe = config.d_model, config.mlp_hidden_size, a.num_experts, a.moe_intermediate_size
    K, hd = head_dims(config)[kind]
    Hq = config.n_heads * hd
    tree = {"q_proj": {"kernel": (D, Hq)}, "k_proj": {"kernel": (D, K * hd)},
            "o_proj": {"kernel": (Hq, D)}, "q_norm": (hd,), "k_norm": (hd,),
            **{ours: (D,) for ours in NORMS.values()},
            "mlp": {"gate_proj": {"kernel": (D, F)}, "up_proj": {"kernel": (D, F)}, "down_proj": {"kernel": (F, D)}},
            "router_scale": (D,),
            "moe": {"gate": {"kernel": (D, E)}, "expert_scale": (E,),
                    "experts": {"gate_proj": (E, D, Fe), "up_proj": (E, D, Fe), "down_proj": (E, Fe, D)}},
            "layer_scalar": (1,), "encoder_layer_scalar": (1,)}
    if kind == "sliding":
        tree["v_proj"] = {"kernel": (D, K * hd)}
    return tree


def _shapes(config: ModelConfig) -> dict:
    a = arch_of(config)
    D, F = config.d_model, config.mlp_hidden_size
    tree = {"wte": {"embedding": (config.embedding_size, D)}, "final_norm": (D,),
            "self_conditioning": {"pre_norm": (D,), "gate_proj": {"kernel": (D, F)}, "up_proj": {"kernel": (D, F)},
                                  "down_proj": {"kernel": (F, D)}}}
    for kind in ("sliding", "full"):
        n = a.count(kind)
        if n:
            tree[kind] = jax.tree.map(lambda s: (n, *s), _layer_shapes(config, kind),
                                      is_leaf=lambda s: isinstance(s, tuple))
    return tree


def init_params(config: ModelConfig, rng: jax.Array, dtype=jnp.float32) -> dict:
    """Random parameters: N(0, 0.02) matrices and embedding, unit norms, scales and layer scalars."""
    shapes = _shapes(config)
    leaves, treedef = jax.tree.flatten_with_path(shapes, is_leaf=lambda s: isinstance(s, tuple))
    keys = jax.random.split(rng, len(leaves))
    out = []
    for (path, shape), key in zip(leaves, keys):
        name = str(getattr(path[-1], "key", path[-1]))
        parent = str(getattr(path[-2], "key", path[-2])) if len(path) > 1 else ""
        matrix = name == "kernel" or parent in ("experts", "wte")
        out.append(jax.random.normal(key, shape, dtype) * 0.02 if matrix else jnp.ones(shape, dtype))
    return jax.tree.unflatten(treedef, out)


def tensor_map(config: ModelConfig) -> dict[str, Target | tuple[Target, ...]]:
    """The text model's tensors (`model.decoder.*`, and the encoder's own layer_scalar buffers; the encoder's other
    weights are tied to the decoder's and not stored), and where each goes."""
    a = arch_of(config)
    Fe = a.moe_intermediate_size
    m = {"model.decoder.embed_tokens.weight": Target(("wte", "embedding"), None, False),
         "model.decoder.norm.weight": Target(("final_norm",), None, False),
         "model.decoder.self_conditioning.pre_norm.weight": Target(("self_conditioning", "pre_norm"), None, False)}
    for name in ("gate_proj", "up_proj", "down_proj"):
        m[f"model.decoder.self_conditioning.{name}.weight"] = Target(("self_conditioning", name, "kernel"), None, True)
    for i, (kind, j) in enumerate(a.slots):
        pre = f"model.decoder.layers.{i}."
        attn = ("q_proj", "k_proj", "o_proj") + (("v_proj",) if kind == "sliding" else ())
        for name in attn:
            m[f"{pre}self_attn.{name}.weight"] = Target((kind, name, "kernel"), j, True)
        for name in ("q_norm", "k_norm"):
            m[f"{pre}self_attn.{name}.weight"] = Target((kind, name), j, False)
        for hf, ours in NORMS.items():
            m[f"{pre}{hf}.weight"] = Target((kind, ours), j, False)
        for name in ("gate_proj", "up_proj", "down_proj"):
            m[f"{pre}mlp.{name}.weight"] = Target((kind, "mlp", name, "kernel"), j, True)
        m[f"{pre}router.proj.weight"] = Target((kind, "moe", "gate", "kernel"), j, True)
        m[f"{pre}router.scale"] = Target((kind, "router_scale"), j, False)
        m[f"{pre}router.per_expert_scale"] = Target((kind, "moe", "expert_scale"), j, False)
        m[f"{pre}experts.gate_up_proj"] = (Target((kind, "moe", "experts", "gate_proj"), j, True, (0, Fe)),
                                           Target((kind, "moe", "experts", "up_proj"), j, True, (Fe, 2 * Fe)))
        m[f"{pre}experts.down_proj"] = Target((kind, "moe", "experts", "down_proj"), j, True)
        m[f"{pre}layer_scalar"] = Target((kind, "layer_scalar"), j, False)
        m[f"model.encoder.language_model.layers.{i}.layer_scalar"] = Target((kind, "encoder_layer_scalar"), j, False)
    return m


def tied_copies(config: ModelConfig) -> dict[str, str]:
    """The encoder's weights, tied to the decoder's (transformers' `_tied_weights_keys`: every weight, scale and expert
    tensor of the layers, the norm and the embedding; not the encoder's own layer_scalar buffers): an export without
    de-duplication writes them under model.encoder.language_model.*. {copy: source}."""
    decoder, encoder = "model.decoder.", "model.encoder.language_model."
    return {encoder + name[len(decoder):]: name for name in tensor_map(config)
            if name.startswith(decoder) and not name.startswith(decoder + "self_conditioning.")
            and not name.endswith(".layer_scalar")}


# ---------------------------------------------------------------- the network's pieces


def _rms(x: Float[Array, "... D"], weight: Float[Array, "D"] | None, eps: float) -> Float[Array, "... D"]:
    """Gemma's RMSNorm: x * (mean(x^2) + eps)^-1/2 (times the weight as it is) in fp32, back in x's dtype."""
    x32 = x.astype(jnp.float32)
    out = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    if weight is not None:
        out = out * weight.astype(jnp.float32)
    return out.astype(x.dtype)


def _rope(x: Float[Array, "B T N H"], positions: Int[Array, "B T"], inv_freq: np.ndarray) -> Float[Array, "B T N H"]:
    """Rotate-half RoPE over the whole head (zero frequencies leave their pairs as they are); angles in fp32,
    cos/sin in x's dtype as transformers applies them."""
    freqs = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)  # [B, T, H/2]
    angles = jnp.concatenate([freqs, freqs], axis=-1)[:, :, None, :]
    cos, sin = jnp.cos(angles).astype(x.dtype), jnp.sin(angles).astype(x.dtype)
    x1, x2 = jnp.split(x, 2, axis=-1)
    return x * cos + jnp.concatenate([-x2, x1], axis=-1) * sin


def _gelu_mlp(p: dict, x: Float[Array, "... D"]) -> Float[Array, "... D"]:
    gate = jax.nn.gelu(x @ p["gate_proj"]["kernel"], approximate=True)
    return (gate * (x @ p["up_proj"]["kernel"])) @ p["down_proj"]["kernel"]


def _embed_scale(params: dict, config: ModelConfig) -> Array:
    """sqrt(D), as transformers' fp32 buffer cast to the embedding's dtype (bf16: 55.4256 -> 55.5 for D=3072)."""
    return jnp.asarray(np.float32(config.d_model ** 0.5)).astype(params["wte"]["embedding"].dtype)


def _embed(params: dict, ids: Int[Array, "B T"], config: ModelConfig) -> Float[Array, "B T D"]:
    table = params["wte"]["embedding"]
    return jnp.take(table, ids, axis=0) * _embed_scale(params, config)


def _qkv(lp: dict, x: Float[Array, "B T D"], positions: Int[Array, "B T"], kind: str, config: ModelConfig):
    """Queries [B, T, H, hd] and this chunk's keys and values [B, T, K, hd], normed and rotated."""
    a = arch_of(config)
    K, hd = head_dims(config)[kind]
    B, T, _ = x.shape
    eps = config.rms_norm_eps
    inv_freq = (a.sliding_rotary if kind == "sliding" else a.global_rotary).inv_freq(hd)
    q = _rope(_rms((x @ lp["q_proj"]["kernel"]).reshape(B, T, config.n_heads, hd), lp["q_norm"], eps), positions,
              inv_freq)
    k_raw = (x @ lp["k_proj"]["kernel"]).reshape(B, T, K, hd)
    v_raw = (x @ lp["v_proj"]["kernel"]).reshape(B, T, K, hd) if kind == "sliding" else k_raw  # global: K = V
    k = _rope(_rms(k_raw, lp["k_norm"], eps), positions, inv_freq)
    return q, k, _rms(v_raw, None, eps)


def _attend(q: Float[Array, "B T H hd"], parts: tuple[tuple[Array, Array, Array], ...]) -> Float[Array, "B T Hhd"]:
    """Attention with scale 1.0 and one fp32 softmax over keys held in several arrays (`parts`: (k [B, S, K, hd],
    v [B, S, K, hd], allowed [B, #T, S]) each: the decoder reads the encoder's buffer and its canvas' own K/V without
    concatenating them); a query that may see no key gets a uniform average (only padding queries, whose outputs
    nothing reads)."""
    B, T, H, hd = q.shape
    K = parts[0][0].shape[2]
    q = q.reshape(B, T, K, H // K, hd)
    scores = [jnp.where(allowed[:, None, None], jnp.einsum("btkgd,bskd->bkgts", q, k, preferred_element_type=jnp.float32),
                        jnp.finfo(jnp.float32).min) for k, _, allowed in parts]
    probs = jax.nn.softmax(jnp.concatenate(scores, axis=-1), axis=-1).astype(parts[0][1].dtype)
    out, at = 0, 0
    for k, v, _ in parts:
        out = out + jnp.einsum("bkgts,bskd->btkgd", probs[..., at:at + k.shape[1]], v)
        at += k.shape[1]
    return out.reshape(B, T, H * hd)


def _feed_forward(lp: dict, h: Float[Array, "B T D"], config: ModelConfig, mesh=None) -> Float[Array, "B T D"]:
    """The dense MLP and the MoE side by side, each post-normed, summed and normed (the residual added by the
    caller)."""
    eps = config.rms_norm_eps
    dense = _rms(_gelu_mlp(lp["mlp"], _rms(h, lp["pre_ffw_norm"], eps)), lp["post_ffw_norm_1"], eps)
    router_in = _rms(h, None, eps) * lp["router_scale"] * jnp.asarray(config.d_model ** -0.5, h.dtype)
    routed = moe_layer(arch_of(config).moe(), lp["moe"], _rms(h, lp["pre_ffw_norm_2"], eps), router_input=router_in,
                       mesh=mesh)
    return _rms(dense + _rms(routed, lp["post_ffw_norm_2"], eps), lp["post_ffw_norm"], eps)


# The decoding layout's key. Not a masked LM's "layers": partition splits those over the "model" axis, while a canvas
# model's layers stay whole on every device, as its stacks did (split, XLA's CPU runtime deadlocks DiffusionGemma's
# program on a data x model mesh: two collective permutes in flight wait on each other).
LAYERS = "canvas_layers"


def decoding_params(params: dict, config: ModelConfig, *, free: bool = False) -> dict:
    """The decoding layout: `params[LAYERS]`, one dict of arrays per layer in layer order, in place of the kinds'
    stacks (each pass then reads a layer's weights where they lie; model.py's docstring). `free`: delete each stack
    once split."""
    if LAYERS in params:
        return params
    a = arch_of(config)
    split = {}
    for kind in ("sliding", "full"):
        if kind in params:
            def parts(leaf, n=a.count(kind)):
                out = tuple(leaf[j] for j in range(n))
                if free and isinstance(leaf, jax.Array):
                    leaf.delete()
                return out
            split[kind] = jax.tree.map(parts, params[kind])
    layers = tuple(jax.tree.map(lambda t, j=j: t[j], split[kind], is_leaf=lambda t: isinstance(t, tuple))
                   for kind, j in a.slots)
    return {**{k: v for k, v in params.items() if k not in ("sliding", "full")}, LAYERS: layers}


def stacked_params(params: dict, config: ModelConfig) -> dict:
    """The stored layout (one layer-stacked dict per kind) of a tree in either layout."""
    if LAYERS not in params:
        return params
    a = arch_of(config)
    out = {k: v for k, v in params.items() if k != LAYERS}
    for kind in ("sliding", "full"):
        mine = [lp for lp, (k, _) in zip(params[LAYERS], a.slots) if k == kind]
        if mine:
            out[kind] = jax.tree.map(lambda *leaves: jnp.stack(leaves), *mine)
    return out


def _head(params: dict, h: Float[Array, "B T D"], config: ModelConfig) -> Float[Array, "B T V"]:
    """Final norm, tied head, softcap, in fp32."""
    h = _rms(h, params["final_norm"], config.rms_norm_eps)
    logits = (h @ params["wte"]["embedding"].T).astype(jnp.float32)
    cap = arch_of(config).logit_softcap
    return jnp.tanh(logits / cap) * cap


# ---------------------------------------------------------------- the encoder and its cache


class EncoderCache(NamedTuple):
    """The encoder's K/V in a static-shape buffer of S slots per row (module docstring)."""

    k: tuple[Float[Array, "B S K hd"], ...]  # per layer, in layer order: keys after norm and RoPE
    v: tuple[Float[Array, "B S K hd"], ...]  # values after the scale-free norm
    positions: Int[Array, "B S"]  # each slot's position in its row
    valid: Bool[Array, "B S"]  # the slot holds a real token
    end: Int[Array, "B"]  # the next free slot
    length: Int[Array, "B"]  # real tokens encoded: the position the canvas starts at


def init_cache(config: ModelConfig, batch: int, max_len: int, dtype=jnp.float32) -> EncoderCache:
    """An empty cache of max_len slots per row (prompt width + the canvases to come); `dtype`: the parameters'."""
    k = tuple(jnp.zeros((batch, max_len, *head_dims(config)[kind]), dtype) for kind, _ in arch_of(config).slots)
    return EncoderCache(k, k, jnp.zeros((batch, max_len), jnp.int32), jnp.zeros((batch, max_len), bool),
                        jnp.zeros((batch,), jnp.int32), jnp.zeros((batch,), jnp.int32))


def _write_rows(buf: Array, new: Array, start: Int[Array, "B"], rows: Bool[Array, "B"] | None = None) -> Array:
    """buf [B, S, ...] with new [B, T, ...] written at each row's start slot (`rows`: only those rows; the others'
    slots there are written back as they were)."""
    if rows is None:
        return jax.vmap(lambda b, n, s: jax.lax.dynamic_update_slice_in_dim(b, n, s, axis=0))(buf, new, start)
    T = new.shape[1]

    def one(b, n, s, r):  # dynamic_slice clamps the start as dynamic_update_slice does: a row left out is unchanged
        return jax.lax.dynamic_update_slice_in_dim(b, jnp.where(r, n, jax.lax.dynamic_slice_in_dim(b, s, T)), s, 0)
    return jax.vmap(one)(buf, new, start, rows)


def _encode(params: dict, cache: EncoderCache, ids: Int[Array, "B T"], mask: Bool[Array, "B T"],
            config: ModelConfig, mesh=None, rows: Bool[Array, "B"] | None = None
            ) -> tuple[Float[Array, "B T D"], EncoderCache]:
    """`encode_into`'s network: the chunk's final hidden states (before the head) and the cache. `rows`: only
    these rows' chunks are written and counted (the others' cache is left as it was; their hidden states are
    computed and meaningless)."""
    a = arch_of(config)
    mask = mask.astype(bool)
    written = mask if rows is None else mask & rows[:, None]
    positions = cache.length[:, None] + jnp.maximum(jnp.cumsum(mask.astype(jnp.int32), axis=1) - 1, 0)
    slot_pos = _write_rows(cache.positions, positions, cache.end, rows)
    valid = _write_rows(cache.valid, written, cache.end, rows)
    causal = valid[:, None, :] & (slot_pos[:, None, :] <= positions[:, :, None])  # [B, T, S]
    windowed = causal & (slot_pos[:, None, :] > positions[:, :, None] - a.sliding_window)
    params = decoding_params(params, config)
    k_buf, v_buf = [], []
    h = _embed(params, ids, config)
    eps = config.rms_norm_eps
    for i, (lp, (kind, _)) in enumerate(zip(params[LAYERS], a.slots)):
        q, k, v = _qkv(lp, _rms(h, lp["input_norm"], eps), positions, kind, config)
        k_buf.append(_write_rows(cache.k[i], k, cache.end, rows))  # each layer's buffer, written in place
        v_buf.append(_write_rows(cache.v[i], v, cache.end, rows))
        attn = _attend(q, ((k_buf[i], v_buf[i], windowed if kind == "sliding" else causal),))
        h = h + _rms(attn @ lp["o_proj"]["kernel"], lp["post_attn_norm"], eps)
        h = (h + _feed_forward(lp, h, config, mesh)) * lp["encoder_layer_scalar"]
    T = ids.shape[1]
    moved = T if rows is None else T * rows.astype(jnp.int32)
    cache = EncoderCache(tuple(k_buf), tuple(v_buf), slot_pos, valid, cache.end + moved,
                         cache.length + jnp.sum(written, axis=1, dtype=jnp.int32))
    return h, cache


@functools.partial(jax.jit, static_argnames=("config", "mesh"))
def encode_into(params: dict, cache: EncoderCache, ids: Int[Array, "B T"], mask: Bool[Array, "B T"],
                config: ModelConfig, mesh=None) -> tuple[Float[Array, "B T V"], EncoderCache]:
    """The causal encoder over a chunk of T tokens that follows what `cache` holds (mask: True on real tokens;
    left padding in the first chunk). Returns the chunk's softcapped logits and the cache with its K/V written
    at each row's `end` (the buffer must have T free slots there: XLA would clamp a write past its end onto
    earlier slots)."""
    h, cache = _encode(params, cache, ids, mask, config, mesh)
    return _head(params, h, config), cache


def restart_rows(cache: EncoderCache, rows: Bool[Array, "B"]) -> EncoderCache:
    """The cache with `rows` emptied (nothing encoded: a row taking a new prompt)."""
    return cache._replace(valid=cache.valid & ~rows[:, None], end=jnp.where(rows, 0, cache.end),
                          length=jnp.where(rows, 0, cache.length))


def layer_kv(cache: EncoderCache, config: ModelConfig) -> tuple[tuple[Array, Array], ...]:
    """One (k, v) [B, S, K, hd] per layer, in layer order."""
    return tuple(zip(cache.k, cache.v))


def encode(params: dict, ids: Int[Array, "B L"], mask: Bool[Array, "B L"], config: ModelConfig
           ) -> tuple[Float[Array, "B L V"], tuple[tuple[Array, Array], ...]]:
    """The causal encoder over left-padded ids: softcapped logits [B, L, V] and one (k, v) [B, L, K, hd] per
    layer (keys normed and rotated, values normed; padding slots hold K/V that nothing attends)."""
    check_text_only(ids, config)
    cache = init_cache(config, ids.shape[0], ids.shape[1], params["wte"]["embedding"].dtype)
    logits, cache = encode_into(params, cache, jnp.asarray(ids), jnp.asarray(mask), config)
    return logits, layer_kv(cache, config)


# ---------------------------------------------------------------- the decoder


@functools.partial(jax.jit, static_argnames=("config",))
def soft_embedding(params: dict, z: Float[Array, "B C V"], config: ModelConfig) -> Float[Array, "B C D"]:
    """The self-conditioning input from the previous step's (temperature-scaled) logits z: softmax(z) @ E *
    sqrt(D), z first cast to the embedding's dtype and the softmax in fp32, as transformers does."""
    table = params["wte"]["embedding"]
    probs = jax.nn.softmax(z.astype(table.dtype).astype(jnp.float32), axis=-1).astype(table.dtype)
    return (probs @ table) * _embed_scale(params, config)


def _self_conditioned(params: dict, canvas: Int[Array, "B C"], soft: Float[Array, "B C D"] | None,
                      config: ModelConfig) -> Float[Array, "B C D"]:
    """The decoder's input: scale-free RMSNorm(embed(canvas) + MLP(pre_norm(soft))); no soft: zeros (the MLP of
    zeros is zero, so the first step's input is the normalised embedding)."""
    x = _embed(params, canvas, config)
    p = params["self_conditioning"]
    eps = config.rms_norm_eps
    signal = _gelu_mlp(p, _rms(jnp.zeros_like(x) if soft is None else soft.astype(x.dtype), p["pre_norm"], eps))
    return _rms(x + signal, None, eps)


@functools.partial(jax.jit, static_argnames=("config", "mesh"))
def decode(params: dict, cache: EncoderCache, canvas: Int[Array, "B C"], config: ModelConfig,
           soft: Float[Array, "B C D"] | None = None, mesh=None) -> Float[Array, "B C V"]:
    """The bidirectional decoder over a canvas that follows what `cache` holds: softcapped logits [B, C, V].
    `soft`: the self-conditioning input (`soft_embedding` of the previous step's logits; None or zeros on a
    row's first step)."""
    return _head(params, _decode(params, cache, canvas, config, soft, mesh), config)


def _decode(params: dict, cache: EncoderCache, canvas: Int[Array, "B C"], config: ModelConfig,
            soft: Float[Array, "B C D"] | None = None, mesh=None) -> Float[Array, "B C D"]:
    """`decode`'s network: the canvas' final hidden states, before the head."""
    a = arch_of(config)
    C = canvas.shape[1]
    positions = cache.length[:, None] + jnp.arange(C, dtype=jnp.int32)[None, :]
    seen = {"full": cache.valid,  # the sliding layers see the last W - 1 encoded positions
            "sliding": cache.valid & (cache.positions >= cache.length[:, None] - (a.sliding_window - 1))}
    everything = jnp.ones(canvas.shape, bool)[:, None, :]
    params = decoding_params(params, config)
    h = _self_conditioned(params, canvas, soft, config)
    eps = config.rms_norm_eps
    for i, (lp, (kind, _)) in enumerate(zip(params[LAYERS], a.slots)):
        q, k, v = _qkv(lp, _rms(h, lp["input_norm"], eps), positions, kind, config)
        # [encoder K/V ; canvas K/V] under one softmax, neither copied into the other
        attn = _attend(q, ((cache.k[i], cache.v[i], seen[kind][:, None, :]), (k, v, everything)))
        h = h + _rms(attn @ lp["o_proj"]["kernel"], lp["post_attn_norm"], eps)
        h = (h + _feed_forward(lp, h, config, mesh)) * lp["layer_scalar"]
    return h


def decoder_logits(params: dict, ids: Int[Array, "B L"], mask: Bool[Array, "B L"], canvas: Int[Array, "B C"],
                   config: ModelConfig, sc_logits: Float[Array, "B C V"] | None = None) -> Float[Array, "B C V"]:
    """Encode ids (left-padded; mask True on real tokens), then the decoder over canvas: softcapped logits
    [B, C, V]. sc_logits: the previous step's temperature-scaled logits (transformers' self_conditioning_logits);
    None on the first step. The prompt must be text (no image tokens); the canvas may hold any id of the vocabulary:
    it is noise (transformers' initial canvas draws uniformly over all of it, image ids included)."""
    check_text_only(ids, config)
    check_canvas_ids(canvas, config)
    ids, mask = jnp.asarray(ids), jnp.asarray(mask)
    cache = init_cache(config, ids.shape[0], ids.shape[1], params["wte"]["embedding"].dtype)
    _, cache = encode_into(params, cache, ids, mask, config)
    soft = None if sc_logits is None else soft_embedding(params, jnp.asarray(sc_logits), config)
    return decode(params, cache, jnp.asarray(canvas), config, soft)


def check_text_only(ids: Any, config: ModelConfig) -> None:
    """Refuse image tokens (the vision tower is not part of this model), for ids known on the host."""
    if isinstance(ids, jax.core.Tracer):
        return
    images = arch_of(config).image_token_ids
    if np.isin(np.asarray(ids), images).any():
        raise DecodeError(f"the ids hold image tokens ({', '.join(map(str, images))}): DiffusionGemma runs here "
                          "as a text model (its vision tower is not supported)")


def check_canvas_ids(canvas: Any, config: ModelConfig) -> None:
    """A canvas holds ids of the vocabulary (any of them), for ids known on the host."""
    if isinstance(canvas, jax.core.Tracer):
        return
    canvas = np.asarray(canvas)
    if canvas.size and (canvas.min() < 0 or canvas.max() >= config.vocab_size):
        raise DecodeError(f"the canvas holds ids outside [0, {config.vocab_size}) (the vocabulary)")


# ---------------------------------------------------------------- the sampler's deterministic pieces


def temperature(i: Int[Array, "*B"] | int, max_denoising_steps: int, t_min: float, t_max: float
                ) -> Float[Array, "*B"]:
    """The temperature of denoising pass i (from 0): transformers' LinearTemperatureScheduleLogitsProcessor at
    cur_step = N - i, t_min + (t_max - t_min) * (cur_step / N), in fp32 as torch rounds it (t_max at i = 0;
    t_min + (t_max - t_min) / N at the last pass: t_min itself is never reached). (The canvas rules' schedule,
    `rules.canvas.linear_temperature`, takes per-row fp32 settings: there t_max - t_min is their fp32 difference.)"""
    cur = jnp.asarray(max_denoising_steps - jnp.asarray(i), jnp.int32).astype(jnp.float32)
    fraction = cur / jnp.float32(max_denoising_steps)
    return jnp.float32(t_min) + jnp.float32(t_max - t_min) * fraction


def accept(z: Float[Array, "B C V"], entropy_bound: float | Float[Array, "B"]) -> Bool[Array, "B C"]:
    """EntropyBoundSampler.accept_canvas's set (`rules.canvas.entropy_bound_accept` on the entropies of z, which the
    entropy_bound rule runs): sort the positions by entropy ascending and accept the prefix whose entropies before
    each one sum to at most entropy_bound (the lowest-entropy position always). Ties in entropy at the boundary:
    here the earlier position wins (a stable sort); torch.sort promises no order."""
    return entropy_bound_accept(entropy(z), entropy_bound)


def init_history(batch: int, stability_threshold: int, canvas_length: int) -> Int[Array, "B S C"]:
    """The stopping criterion's argmax history (-1: no canvas yet), per row: [B, stability_threshold, C]."""
    return jnp.full((batch, stability_threshold, canvas_length), -1, jnp.int32)


def stop(argmax: Int[Array, "B C"], history: Int[Array, "B S C"], z: Float[Array, "B C V"],
         confidence_threshold: float | Float[Array, "B"]) -> tuple[Bool[Array, "B"], Int[Array, "B S C"]]:
    """StableAndConfidentStoppingCriteria: stop a row when its argmax canvas equals each of the last S
    (`history.shape[1]` = stability_threshold; 0: always stable) and the mean entropy of softmax(z) over the
    canvas is below confidence_threshold (strictly). Returns the decision and the history with this argmax
    appended (the oldest dropped)."""
    argmax = argmax.astype(history.dtype)
    stable = jnp.all(history == argmax[:, None, :], axis=(1, 2))
    if history.shape[1]:
        history = jnp.concatenate([history[:, 1:], argmax[:, None, :]], axis=1)
    threshold = jnp.asarray(confidence_threshold, jnp.float32)
    confident = jnp.mean(entropy(z), axis=-1) < threshold
    return stable & confident, history


# ---------------------------------------------------------------- the family record


@struct.dataclass
class DiffusionGemmaDenoiser:
    """What the decode loop runs of DiffusionGemma (`localleap_jax.denoiser.CanvasDenoiser`): the encoder appending to
    its static-shape K/V buffer, the decoder over a canvas after it, the head, the self-conditioning input."""

    params: dict
    config: ModelConfig = struct.field(pytree_node=False)

    @property
    def shift(self) -> int:
        return 0

    @property
    def vocab(self) -> int:  # what a uniform draw ranges over (transformers' text_config.vocab_size)
        return self.config.vocab_size

    def empty_cache(self, batch: int, length: int) -> EncoderCache:
        return init_cache(self.config, batch, length, self.params["wte"]["embedding"].dtype)

    def encode(self, cache: EncoderCache, ids: Int[Array, "B T"], mask: Bool[Array, "B T"],
               rows: Bool[Array, "B"] | None = None) -> EncoderCache:
        return _encode(self.params, cache, ids, mask, self.config, rows=rows)[1]

    def restart(self, cache: EncoderCache, rows: Bool[Array, "B"]) -> EncoderCache:
        return restart_rows(cache, rows)

    def decode(self, cache: EncoderCache, canvas: Int[Array, "B C"], soft: Float[Array, "B C D"]
               ) -> Float[Array, "B C D"]:
        return _decode(self.params, cache, canvas, self.config, soft)

    def head(self, hidden: Float[Array, "... D"]) -> Float[Array, "... V"]:
        return _head(self.params, hidden, self.config)

    def soft_embedding(self, z: Float[Array, "B C V"]) -> Float[Array, "B C D"]:
        return soft_embedding(self.params, z, self.config)

    def no_soft(self, batch: int, length: int) -> Float[Array, "B C D"]:
        """A canvas's first pass: no self-conditioning (zeros, which the decoder reads as none)."""
        return jnp.zeros((batch, length, self.config.d_model), self.params["wte"]["embedding"].dtype)

    def check_prompt(self, ids) -> None:
        check_text_only(ids, self.config)


def denoiser(params: Any, config: ModelConfig) -> DiffusionGemmaDenoiser:
    return DiffusionGemmaDenoiser(decoding_params(params, config), config)


FAMILY = Family(
    name="diffusion_gemma", title="DiffusionGemma", model_types=("diffusion_gemma",),
    architectures=("DiffusionGemma",), read=read, write=write, tensor_map=tensor_map, mask_token=MASK_TOKEN,
    init_params=init_params, denoiser=denoiser, decoding_params=decoding_params, stacked_params=stacked_params,
    complete_config=complete_config, tied_copies=tied_copies,
    ignored_tensors=("model.encoder.vision_tower.", "model.encoder.embed_vision."),
    likelihood=None, likelihood_refusal="likelihood of DiffusionGemma is not served: a uniform-noise canvas model "
    "has no masked-token estimator (and its authors publish none)",
    eval_strategies="entropy_bound,localleap_uniform")
