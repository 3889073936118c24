"""An eager PyTorch oracle for LLaDA2.x (LLaDA2.0 / LLaDA2.1, mini and flash; the Ling-2.0 `llada2_moe`
architecture), for tests only: the network from the checkpoint's own (HF) tensor names, and the authors'
`LLaDA2MoeModelLM.generate` as a plain Python loop over a `logits_fn`.

What was read (public code, transcribed here, not copied):
  * inclusionAI/dFactory@92b68908 `models/llada2_moe/modeling_llada2_moe.py`: LLaDA2MoeRMSNorm,
    LLaDA2MoeRotaryEmbedding (+ transformers' default rope init: rotary dim = int(head_dim * partial_rotary_factor),
    inv_freq = theta^(-2i / rotary dim)), apply_rotary_pos_emb (NeoX rotate-half on the first rotary dims, the
    rest passed through), LLaDA2MoeMLP, LLaDA2MoeGate (group_limited_topk, forward), LLaDA2MoeSparseMoeBlock (the
    non-veomni path: `mlp.experts.{e}.*` ModuleList, moe_infer, shared experts), LLaDA2MoeAttention (eager),
    LLaDA2MoeDecoderLayer, LLaDA2MoeModel, LLaDA2MoeModelLM.forward and .generate (with _get_num_transfer_tokens
    and _sample_with_temperature_topk_topp); `configuration_llada2_moe.py` and
    `configs/model_configs/llada2_mini/config.json`.
  * inclusionAI/dInfer@fce4e328 `python/dinfer/model/modeling_llada2_moe.py`: the same gate (compared by eye).
  * ../shared/reference/llada2-moe.md (the facts and the hub's LLaDA2.1-mini config).

The network, per layer (pre-norm, residual around each half):
    qkv = h W_qkv^T viewed [.., Hq + 2 Hkv, D]; Q, K, V = its first Hq, next Hkv, last Hkv heads (head-major rows)
    Q, K = RMSNorm_D(Q) * query_layernorm, RMSNorm_D(K) * key_layernorm          (per head, BEFORE RoPE)
    Q, K rotated (NeoX rotate-half) on their first int(D * partial_rotary_factor) dims at each token's position
    attention softmax(Q K^T / sqrt(D) + M) V, GQA (query head h reads KV head h // (Hq / Hkv)), then `dense`
    MLP: SwiGLU `mlp.{gate,up,down}_proj` on the first `first_k_dense_replace` layers; MoE after:
        s = sigmoid(h W_g^T) (fp32);  selection on s + expert_bias: each of n_group groups scored by the sum of its
        top-2 biased scores, the topk_group best groups kept, the top num_experts_per_tok experts among them;
        w = s[idx] / (sum s[idx] + 1e-20) * routed_scaling_factor   (UNbiased s; renormalised only when top_k > 1)
        y = sum_k w_k SwiGLU_{idx_k}(h) + SwiGLU_shared(h)   (`mlp.shared_experts`, width moe_intermediate_size x
        num_shared_experts; none when num_shared_experts is 0 or null)
    final RMSNorm `model.norm`, untied `lm_head`; logits in the oracle's dtype (fp32 or float64).
The attention mask is explicit: `block_causal_mask` builds LLaDA2's block-causal pattern on each row's own grid
(the grid starts at the row's first real token, RoPE positions count from 0 there, left padding is never
attended), so a left-padded row gives the logits of the same row alone. The authors' model takes the mask as
given (their generate builds a 0/-inf bf16 block mask of the unpadded canvas) and has no padding support.

Traps of the authors' code (each followed or replaced as said):
  * `generate(temperature=0.0)` is NOT greedy: `_sample_with_temperature_topk_topp` skips the division at
    temperature 0, then draws with `torch.multinomial` from the temperature-1 softmax. Here greedy means the
    argmax, with its temperature-1 softmax probability as the confidence (what the reports' "temperature 0" means).
  * The gate renormalises whatever `norm_topk_prob` says (only `top_k > 1` decides) and ignores `score_function`,
    `router_dtype`, `moe_router_enable_expert_bias` (the bias buffer always exists), `rotary_dim` and
    `use_qk_norm`: followed (this oracle never reads those keys; `partial_rotary_factor` alone sets the rotary
    dims, default 0.5 as LLaDA2MoeConfig's).
  * LLaDA2MoeConfig defaults `use_bias=True` (a bias on `dense`) when config.json omits it; the released configs
    say false. This oracle loads no biases, so it refuses `use_bias` / `use_qkv_bias` true or missing.
  * Their in-block eos early stop (`eos_early_stop=True`) searches the whole canvas for the first eos, the prompt
    included, and returns the prompt with the answer (their normal return is the answer alone): here the search
    starts at the first generated position and `output` is always the answer alone.
  * The after-block eos stop is unconditional in their code (`eos_id` is never None there): followed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Mapping, Sequence

import numpy as np
import torch

# Ling tokenizer ids (../shared/reference/llada2-moe.md): config.json holds none of them.
LLADA2_MASK_ID = 156895  # <|mask|>
LLADA2_EOS_ID = 156892  # <|endoftext|> (eos and pad)
LLADA2_DEFAULT_BLOCK = 32  # generate's block_length default (the reports' setting)

LogitsFn = Callable[[np.ndarray], np.ndarray]  # ids [1, n] -> block-causal logits [1, n, V] (positions 0..n-1)


# ------------------------------------------------------------------------------------------------
# The config


@dataclass(frozen=True)
class LLaDA2Config:
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rotary_dim: int  # int(head_dim * partial_rotary_factor): the rotated leading dims of each head
    rope_theta: float
    rms_norm_eps: float
    intermediate_size: int  # dense layers
    moe_intermediate_size: int
    num_experts: int
    top_k: int
    n_group: int
    topk_group: int
    routed_scaling_factor: float
    num_shared_experts: int  # 0: none
    first_k_dense_replace: int


def llada2_config(hf_config: Mapping) -> LLaDA2Config:
    """The fields the network reads, from a config.json dict; refuses what this oracle would silently get wrong."""
    cfg = dict(hf_config)
    if cfg.get("model_type", "llada2_moe") not in ("llada2_moe", "llada2_moe_veomni"):
        raise ValueError(f"model_type={cfg.get('model_type')!r}: not a LLaDA2 (llada2_moe) config")
    for key in ("use_bias", "use_qkv_bias"):
        # LLaDA2MoeConfig's default for use_bias is True: a config without the key has a bias on `dense`.
        if cfg.get(key, key == "use_bias"):
            raise ValueError(f"{key} is true or missing: the released LLaDA2 checkpoints have no biases and "
                             "this oracle loads none")
    if cfg.get("norm_head", False):
        raise ValueError("norm_head=true is not transcribed")
    if cfg.get("rope_scaling") is not None:
        raise ValueError(f"rope_scaling={cfg['rope_scaling']!r}: only plain RoPE is transcribed")
    if cfg.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act={cfg['hidden_act']!r}: LLaDA2's MLPs are SwiGLU (silu)")
    if cfg.get("tie_word_embeddings", False):
        raise ValueError("tie_word_embeddings=true: LLaDA2's head is untied and this oracle reads lm_head.weight")
    heads = cfg["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads") or 0
    if kv_heads <= 0 or heads % kv_heads:
        raise ValueError(f"num_key_value_heads={kv_heads!r} must divide num_attention_heads={heads}")
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    rotary_dim = int(head_dim * cfg.get("partial_rotary_factor", 0.5))  # LLaDA2MoeConfig's default factor: 0.5
    if rotary_dim % 2 or rotary_dim <= 0:
        raise ValueError(f"rotary dim {rotary_dim} (head_dim x partial_rotary_factor) must be positive and even")
    experts, groups = cfg["num_experts"], cfg.get("n_group", 8)
    if experts % groups or experts // groups < 2:
        raise ValueError(f"num_experts={experts} must split into n_group={groups} groups of at least 2 "
                         "(the group score sums each group's top 2)")
    return LLaDA2Config(
        vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden_size"], num_layers=cfg["num_hidden_layers"],
        num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim, rotary_dim=rotary_dim,
        rope_theta=float(cfg.get("rope_theta", 10000.0)), rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-5)),
        intermediate_size=cfg["intermediate_size"], moe_intermediate_size=cfg["moe_intermediate_size"],
        num_experts=experts, top_k=cfg["num_experts_per_tok"], n_group=groups, topk_group=cfg.get("topk_group", 4),
        routed_scaling_factor=float(cfg.get("routed_scaling_factor", 2.5)),
        num_shared_experts=int(cfg.get("num_shared_experts") or 0),
        first_k_dense_replace=int(cfg.get("first_k_dense_replace", 0)))


# ------------------------------------------------------------------------------------------------
# The pieces (shared with oracles/llada_moe.py: the same maths)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * x / sqrt(mean(x^2) + eps) over the last axis (T5 / Llama RMSNorm)."""
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def rope(x: torch.Tensor, positions: torch.Tensor, rotary_dim: int, theta: float) -> torch.Tensor:
    """NeoX (rotate-half) RoPE on the first `rotary_dim` dims of x [B, H, L, D]; positions [B, L]."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim))
    angles = positions.to(torch.float64)[:, None, :, None] * inv_freq  # [B, 1, L, rotary_dim / 2]
    cos, sin = torch.cos(angles).to(x.dtype), torch.sin(angles).to(x.dtype)
    rot, rest = x[..., :rotary_dim], x[..., rotary_dim:]
    half = rotary_dim // 2
    x1, x2 = rot[..., :half], rot[..., half:]
    rotated = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    return torch.cat([rotated, rest], dim=-1)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """softmax(q k^T / sqrt(D), keys not allowed excluded) v with GQA. q [B, Hq, L, D], k/v [B, Hkv, S, D],
    allowed [B, L, S] bool -> [B, L, Hq * D]."""
    B, Hq, L, D = q.shape
    group = Hq // k.shape[1]
    k = k.repeat_interleave(group, dim=1)  # query head h reads KV head h // group
    v = v.repeat_interleave(group, dim=1)
    scores = q @ k.transpose(-1, -2) / float(np.sqrt(D))
    scores = scores.masked_fill(~allowed[:, None], float("-inf"))
    out = torch.softmax(scores, dim=-1) @ v
    return out.transpose(1, 2).reshape(B, L, Hq * D)


def swiglu(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """down(silu(gate x) * up x), weights stored [out, in] as nn.Linear."""
    return (torch.nn.functional.silu(x @ gate.T) * (x @ up.T)) @ down.T


def route_sigmoid_grouped(h: torch.Tensor, gate: torch.Tensor, expert_bias: torch.Tensor, *, top_k: int,
                          n_group: int, topk_group: int, routed_scaling_factor: float
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """LLaDA2MoeGate: (expert ids [T, k], weights [T, k]) for tokens h [T, H], in h's dtype (fp32 or wider).

    Selection reads the biased scores, the weights the unbiased ones (renormalised when top_k > 1). Ties fall as
    torch.topk puts them, as in the authors' gate."""
    scores = torch.sigmoid(h @ gate.T)  # [T, E]
    biased = scores + expert_bias
    T, E = biased.shape
    group_scores = biased.view(T, n_group, E // n_group).topk(2, dim=-1).values.sum(-1)  # [T, n_group]
    kept_groups = group_scores.topk(topk_group, dim=-1).indices
    group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, kept_groups, True)
    expert_mask = group_mask[:, :, None].expand(T, n_group, E // n_group).reshape(T, E)
    idx = biased.masked_fill(~expert_mask, float("-inf")).topk(top_k, dim=-1).indices
    w = scores.gather(1, idx)
    if top_k > 1:
        w = w / (w.sum(-1, keepdim=True) + 1e-20)
    return idx, w * routed_scaling_factor


def moe(x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor, experts: Sequence[tuple[torch.Tensor, ...]]
        ) -> torch.Tensor:
    """sum_k w[t, k] * expert_{idx[t, k]}(x[t]) for x [T, H] (each expert run on its tokens only)."""
    out = torch.zeros_like(x)
    for e, (gate, up, down) in enumerate(experts):
        token, slot = torch.nonzero(idx == e, as_tuple=True)
        if token.numel():
            out.index_add_(0, token, swiglu(x[token], gate, up, down) * w[token, slot, None].to(x.dtype))
    return out


# ------------------------------------------------------------------------------------------------
# The network


class LLaDA2Network:
    """LLaDA2.x from its HF tensors: `net(ids [B, L], allowed [B, L, L], positions [B, L]) -> logits [B, L, V]`.

    `allowed[b, q, k]`: query q may attend key k. Build it with `block_causal_mask`. Experts with a top-k are run
    per expert (eager, tiny configs); the router runs in max(dtype, float32), as the authors' in fp32."""

    def __init__(self, hf_config: Mapping, tensors: Mapping[str, np.ndarray], dtype: torch.dtype = torch.float32):
        self.config = c = llada2_config(hf_config)
        self.dtype = dtype
        t = {k: torch.as_tensor(np.asarray(v), dtype=dtype) for k, v in tensors.items()}
        used: set[str] = set()

        def take(name: str) -> torch.Tensor:
            if name not in t:
                raise KeyError(f"checkpoint has no {name}")
            used.add(name)
            return t[name]

        self.embed = take("model.word_embeddings.weight")
        self.norm = take("model.norm.weight")
        self.head = take("lm_head.weight")
        self.layers = []
        for i in range(c.num_layers):
            p = f"model.layers.{i}."
            layer = {"input_norm": take(p + "input_layernorm.weight"),
                     "post_norm": take(p + "post_attention_layernorm.weight"),
                     "qkv": take(p + "attention.query_key_value.weight"),
                     "q_norm": take(p + "attention.query_layernorm.weight"),
                     "k_norm": take(p + "attention.key_layernorm.weight"),
                     "dense": take(p + "attention.dense.weight")}
            if layer["qkv"].shape != ((c.num_heads + 2 * c.num_kv_heads) * c.head_dim, c.hidden_size):
                raise ValueError(f"layer {i}: query_key_value is {tuple(layer['qkv'].shape)}")
            if i < c.first_k_dense_replace:
                layer["mlp"] = tuple(take(p + f"mlp.{n}_proj.weight") for n in ("gate", "up", "down"))
            else:
                layer["gate"] = take(p + "mlp.gate.weight")
                layer["expert_bias"] = take(p + "mlp.gate.expert_bias")
                layer["experts"] = [tuple(take(p + f"mlp.experts.{e}.{n}_proj.weight") for n in ("gate", "up", "down"))
                                    for e in range(c.num_experts)]
                if c.num_shared_experts:
                    layer["shared"] = tuple(take(p + f"mlp.shared_experts.{n}_proj.weight")
                                            for n in ("gate", "up", "down"))
            self.layers.append(layer)
        unused = sorted(set(t) - used)
        if unused:
            raise ValueError(f"tensors this oracle does not read (a layout it does not know): {unused[:8]}")

    def route(self, layer: int, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The gate of MoE layer `layer` for tokens h [T, H] -> (idx [T, k], weights [T, k])."""
        c, p = self.config, self.layers[layer]
        rdt = torch.promote_types(self.dtype, torch.float32)
        return route_sigmoid_grouped(h.to(rdt), p["gate"].to(rdt), p["expert_bias"].to(rdt), top_k=c.top_k,
                                     n_group=c.n_group, topk_group=c.topk_group,
                                     routed_scaling_factor=c.routed_scaling_factor)

    def mlp(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        p = self.layers[layer]
        if "mlp" in p:
            return swiglu(x, *p["mlp"])
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        idx, w = self.route(layer, flat)
        y = moe(flat, idx, w, p["experts"])
        if "shared" in p:
            y = y + swiglu(flat, *p["shared"])
        return y.reshape(shape)

    def attend(self, layer: int, x: torch.Tensor, allowed: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        c, p = self.config, self.layers[layer]
        B, L, _ = x.shape
        qkv = (x @ p["qkv"].T).view(B, L, c.num_heads + 2 * c.num_kv_heads, c.head_dim).transpose(1, 2)
        q, k, v = qkv.split([c.num_heads, c.num_kv_heads, c.num_kv_heads], dim=1)
        q = rope(rms_norm(q, p["q_norm"], c.rms_norm_eps), positions, c.rotary_dim, c.rope_theta)
        k = rope(rms_norm(k, p["k_norm"], c.rms_norm_eps), positions, c.rotary_dim, c.rope_theta)
        return attention(q, k, v, allowed) @ p["dense"].T

    @torch.no_grad()
    def __call__(self, ids, allowed, positions) -> np.ndarray:
        c = self.config
        ids = torch.as_tensor(np.asarray(ids), dtype=torch.long)
        allowed = torch.as_tensor(np.asarray(allowed), dtype=torch.bool)
        positions = torch.as_tensor(np.asarray(positions), dtype=torch.long)
        if ids.ndim != 2 or allowed.shape != (*ids.shape, ids.shape[1]) or positions.shape != ids.shape:
            raise ValueError(f"ids {tuple(ids.shape)}, allowed {tuple(allowed.shape)}, positions "
                             f"{tuple(positions.shape)}: expected [B, L], [B, L, L], [B, L]")
        h = self.embed[ids]
        for i in range(c.num_layers):
            h = h + self.attend(i, rms_norm(h, self.layers[i]["input_norm"], c.rms_norm_eps), allowed, positions)
            h = h + self.mlp(i, rms_norm(h, self.layers[i]["post_norm"], c.rms_norm_eps))
        return (rms_norm(h, self.norm, c.rms_norm_eps) @ self.head.T).numpy()


def block_causal_mask(mask: np.ndarray, block_size: int) -> tuple[np.ndarray, np.ndarray]:
    """(allowed [B, L, L] bool, positions [B, L]) of LLaDA2's attention for a left-padded batch `mask` [B, L].

    Each row's grid starts at its first real token (p = index - first real index): a query at p sees a real key
    at q iff q // block_size <= p // block_size (bidirectional inside a block). Padding is never attended;
    a padding query sees only itself (its output is meaningless; this keeps its softmax finite)."""
    mask = np.asarray(mask, bool)
    if mask.ndim != 2 or not mask.any(axis=1).all():
        raise ValueError("mask must be [B, L] with at least one real token per row")
    B, L = mask.shape
    pos = np.arange(L)[None, :] - mask.argmax(axis=1)[:, None]
    blk = np.floor_divide(pos, block_size)
    allowed = (blk[:, None, :] <= blk[:, :, None]) & mask[:, None, :]
    allowed[:, np.arange(L), np.arange(L)] |= ~mask
    return allowed, np.maximum(pos, 0)


def block_causal_logits(net: LLaDA2Network, ids: np.ndarray, mask: np.ndarray, block_size: int) -> np.ndarray:
    """Logits [B, L, V] of a left-padded batch under LLaDA2's block-causal attention (no shift)."""
    allowed, positions = block_causal_mask(mask, block_size)
    return net(ids, allowed, positions)


def llada2_logits_fn(net: LLaDA2Network, block_size: int) -> LogitsFn:
    """The `logits_fn` for `generate`: an unpadded prefix [1, n], positions from 0, block-causal on `block_size`."""
    return lambda ids: block_causal_logits(net, ids, np.ones(np.shape(ids), bool), block_size)


# ------------------------------------------------------------------------------------------------
# The authors' generate, greedy


def get_num_transfer_tokens(block_length: int, steps: int) -> np.ndarray:
    """LLaDA2's per-step quota in a block: block_length // steps each, the remainder on the first steps."""
    base, remainder = divmod(block_length, steps)
    quota = np.full(steps, base, np.int64)
    quota[:remainder] += 1
    return quota


def greedy(logits: np.ndarray, never_predict: Sequence[int] = ()) -> tuple[np.ndarray, np.ndarray]:
    """(argmax id [T], its temperature-1 softmax probability [T]) in float64; lowest id on ties. Ids in
    `never_predict` are left out of the argmax but keep their softmax share."""
    z = np.asarray(logits, np.float64)
    choosable = z.copy()
    if len(never_predict):
        choosable[..., list(never_predict)] = -np.inf
    pred = choosable.argmax(axis=-1)
    e = np.exp(z - z.max(axis=-1, keepdims=True))
    conf = np.take_along_axis(e, pred[..., None], axis=-1)[..., 0] / e.sum(axis=-1)
    return pred.astype(np.int64), conf


def _topk(values: np.ndarray, k: int) -> np.ndarray:
    """torch.topk(values, k) as a boolean mask (ties fall as torch puts them, as in the authors' code)."""
    out = np.zeros(values.shape[0], bool)
    if k > 0:
        out[torch.topk(torch.from_numpy(np.asarray(values, np.float64)), int(k)).indices.numpy()] = True
    return out


@dataclass
class LLaDA2Result:
    tokens: np.ndarray  # the canvas [num_blocks * block_length] when the loop ended (masks where never decoded)
    output: np.ndarray  # the authors' return: the generated tokens x[P:P+G], cut after the first eos (kept)
    forwards: int  # forward passes (the authors' count: their loop recomputes [0, block end) every step)
    blocks: int  # blocks entered
    stopped: str | None = None  # "eos" (after a block), "eos_early_stop" (inside one), None
    passes_per_block: list[int] = field(default_factory=list)


def generate(logits_fn: LogitsFn, prompt: Sequence[int] | np.ndarray, *, gen_length: int,
             block_length: int = LLADA2_DEFAULT_BLOCK, steps: int = 32, threshold: float = 0.95,
             minimal_topk: int = 1, eos_id: int = LLADA2_EOS_ID, mask_id: int = LLADA2_MASK_ID,
             eos_early_stop: bool = False, never_predict: Sequence[int] = ()) -> LLaDA2Result:
    """`LLaDA2MoeModelLM.generate` for one prompt, greedy (argmax, softmax confidence; see the module docstring).

    steps = min(steps, gen_length // minimal_topk) per block; the canvas is ceil((P + G) / B) whole blocks on the
    absolute grid (positions 0..), decoding starts at block P // B (the prompt's tail shares the first decoded
    block and is never changed: only masks commit). Each step of a block, while it has masks: one forward of
    x[:block end] (`logits_fn`), x0 = argmax and p = its probability at the block's positions; with
    n = get_num_transfer_tokens(B, steps)[step] (over the block length, even for a partial first block): the
    masked positions with p > threshold (strict) commit if there are at least n of them, else the
    min(n, #masks) most confident masks (torch.topk). At most `steps` steps per block: a block still holding
    masks after them (only if the mask id is predicted) is left so, as theirs. After each block the loop stops if
    eos occurs in x[P:block end]. `eos_early_stop=True` adds their in-block stop: after a step that committed an
    eos, stop if every position from P to the first generated eos is decoded.

    Returns the canvas, the authors' output and their forward count (= the steps run; no prefill, no store pass).
    """
    prompt = np.asarray(prompt, np.int64)
    if prompt.ndim != 1 or prompt.size == 0:
        raise ValueError(f"prompt must be non-empty 1-D token ids, got shape {prompt.shape}")
    if mask_id in prompt:
        raise ValueError("the prompt holds the mask id: generate treats every mask in a block as open")
    steps = min(steps, gen_length // minimal_topk)
    if steps < 1 or block_length < 1 or gen_length < 1:
        raise ValueError(f"steps={steps} (after min with gen_length // minimal_topk), block_length={block_length}, "
                         f"gen_length={gen_length}: all must be >= 1")
    P, B = prompt.shape[0], block_length
    num_blocks = -(-(P + gen_length) // B)
    x = np.full(num_blocks * B, mask_id, np.int64)
    x[:P] = prompt
    quota = get_num_transfer_tokens(B, steps)
    result = LLaDA2Result(tokens=x, output=np.zeros(0, np.int64), forwards=0, blocks=0)

    def answer() -> np.ndarray:
        gen = x[P:P + gen_length]
        eos = np.flatnonzero(gen == eos_id)
        return gen[: eos[0] + 1].copy() if eos.size else gen.copy()

    for nb in range(P // B, num_blocks):
        lo, hi = nb * B, (nb + 1) * B
        result.blocks += 1
        result.passes_per_block.append(0)
        for step in range(steps):
            active = x[lo:hi] == mask_id
            if not active.any():
                break
            logits = np.asarray(logits_fn(x[None, :hi].copy()))
            if logits.shape[:2] != (1, hi):
                raise ValueError(f"logits_fn returned shape {logits.shape}, expected (1, {hi}, V)")
            result.forwards += 1
            result.passes_per_block[-1] += 1
            x0, p = greedy(logits[0, lo:hi], never_predict)
            confidence = np.where(active, p, -np.inf)
            high = confidence > threshold
            take = high if high.sum() >= quota[step] else _topk(confidence, min(int(quota[step]), int(active.sum())))
            x[lo:hi][take] = x0[take]
            if eos_early_stop and (x0[take] == eos_id).any():
                eos = np.flatnonzero(x[P:] == eos_id)
                if eos.size and not (x[P:P + eos[0]] == mask_id).any():
                    result.output, result.stopped = x[P:P + eos[0] + 1].copy(), "eos_early_stop"
                    return result
        if (x[P:hi] == eos_id).any():
            result.stopped = "eos"
            break
    result.output = answer()
    return result
