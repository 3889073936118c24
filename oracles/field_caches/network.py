"""LLaDA's network, eager and per layer, with the pieces the field's caches take apart.

Built from LLaDA's own (HF) tensor names, never from localleap_jax's parameter tree. One row at a time: every tensor
here is unbatched ([positions, features]); the caches run each row of a batch alone.

    net = EagerLLaDA(hf_config, tensors)                      # fp32 unless dtype= says otherwise
    net.logits(ids)                                           # [L, V]: the plain bidirectional forward
    out = net.run(ids, queries, kv)                           # a subset of positions through every layer
    layer = net.layers[i]; hn = layer.attn_norm(h); layer.q(hn), layer.k(hn), layer.v(hn)
    o, probs = net.attend(i, q, q_pos, k, k_pos, v)           # attn_out(softmax(QK^T/sqrt(D)) V), head probs
    layer.ffn(h)                                              # ff_out(silu(ff_proj n) * up_proj n), n = ff_norm(h)

The block, as the authors' modeling files compute it (each position's residual stream h):
    h <- h + attn_out(attention(q_proj n, k_proj n, v_proj n)),  n = RMSNorm_attn(h)
    h <- h + ff_out(silu(ff_proj m) * up_proj m),                 m = RMSNorm_ff(h)
RMSNorm in fp32 (weight * x / sqrt(mean x^2 + eps)); RoPE rotate-half on queries and keys in fp32 at each
position's index, inv_freq = 1 / theta^(2i / head_dim) with theta from the config; keys and values are kept
BEFORE RoPE (as dLLM-Cache, dKV-Cache and d2Cache keep them) and rotated when attended; softmax in fp32; no
biases; untied head after ln_f.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping, NamedTuple, Sequence

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * x / sqrt(mean(x^2) + eps) over the last axis, computed in fp32 (LLaDA's RMSLayerNorm)."""
    x32 = x.to(torch.float32)
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def rotate(t: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotate-half RoPE of t [n, H, D] at `positions` [n], in fp32 (LLaDA's rope_full_precision)."""
    D = t.shape[-1]
    inv_freq = 1.0 / (theta ** (torch.arange(0, D, 2, dtype=torch.float32) / D))
    angles = positions.to(torch.float32)[:, None] * inv_freq[None, :]  # [n, D/2]
    angles = torch.cat([angles, angles], dim=-1)[:, None, :]  # [n, 1, D]: the same angle for both halves
    t32 = t.to(torch.float32)
    first, second = t32[..., : D // 2], t32[..., D // 2:]
    half_turned = torch.cat([-second, first], dim=-1)
    return (t32 * angles.cos() + half_turned * angles.sin()).to(t.dtype)


@dataclass(frozen=True)
class Layer:
    """One block's weights (stored [out, in], as nn.Linear) and its sublayers."""

    attn_norm_w: torch.Tensor
    q_w: torch.Tensor
    k_w: torch.Tensor
    v_w: torch.Tensor
    attn_out_w: torch.Tensor
    ff_norm_w: torch.Tensor
    ff_proj_w: torch.Tensor
    up_proj_w: torch.Tensor
    ff_out_w: torch.Tensor
    eps: float

    def attn_norm(self, h: torch.Tensor) -> torch.Tensor:
        return rms_norm(h, self.attn_norm_w, self.eps)

    def q(self, hn: torch.Tensor) -> torch.Tensor:
        return hn @ self.q_w.T

    def k(self, hn: torch.Tensor) -> torch.Tensor:
        return hn @ self.k_w.T

    def v(self, hn: torch.Tensor) -> torch.Tensor:
        return hn @ self.v_w.T

    def ffn(self, h: torch.Tensor) -> torch.Tensor:
        """The FFN sublayer's output (after ff_out) for residual streams h [n, d]: what is added to h."""
        m = rms_norm(h, self.ff_norm_w, self.eps)
        return (F.silu(m @ self.ff_proj_w.T) * (m @ self.up_proj_w.T)) @ self.ff_out_w.T


class Pass(NamedTuple):
    """What `EagerLLaDA.run` gives back for its queries (n of them, in the order asked)."""

    logits: torch.Tensor  # [n, V]
    keys: list[torch.Tensor]  # per layer [n, Hkv * D]: the queries' fresh keys (before RoPE)
    values: list[torch.Tensor]  # per layer [n, Hkv * D]
    probs: list[torch.Tensor] | None  # per layer [H, n, L]: attention probabilities over every key position


class EagerLLaDA:
    """LLaDA from its HF tensors (`model.transformer.wte.weight`, `...blocks.{i}.q_proj.weight`, ...)."""

    def __init__(self, hf_config: Mapping, tensors: Mapping[str, torch.Tensor], dtype: torch.dtype = torch.float32):
        cfg = dict(hf_config)
        if cfg.get("include_bias") or cfg.get("include_qkv_bias") or cfg.get("weight_tying"):
            raise ValueError("this oracle loads no biases and an untied head (LLaDA-8B's layout)")
        self.dtype = dtype
        self.d_model, self.n_heads = cfg["d_model"], cfg["n_heads"]
        self.n_kv_heads = cfg.get("n_kv_heads") or self.n_heads
        self.head_dim = self.d_model // self.n_heads
        self.theta = float(cfg.get("rope_theta", 10000.0))
        self.eps = float(cfg.get("rms_norm_eps", 1e-5))
        t = {k: v.to(dtype) for k, v in tensors.items()}
        self.wte = t["model.transformer.wte.weight"]
        self.ln_f_w = t["model.transformer.ln_f.weight"]
        self.head_w = t["model.transformer.ff_out.weight"]
        self.layers: list[Layer] = []
        for i in range(cfg["n_layers"]):
            b = f"model.transformer.blocks.{i}."
            self.layers.append(Layer(*(t[b + n + ".weight"] for n in (
                "attn_norm", "q_proj", "k_proj", "v_proj", "attn_out", "ff_norm", "ff_proj", "up_proj", "ff_out")),
                eps=self.eps))

    @property
    def vocab(self) -> int:
        return self.head_w.shape[0]

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.wte[ids]

    def head(self, h: torch.Tensor) -> torch.Tensor:
        """Logits [n, V] of final residual streams h [n, d] (ln_f, then the untied output head)."""
        return rms_norm(h, self.ln_f_w, self.eps) @ self.head_w.T

    def attend(self, i: int, q: torch.Tensor, q_pos: torch.Tensor, k: torch.Tensor, k_pos: torch.Tensor,
               v: torch.Tensor, key_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer i's attention sublayer for queries q [nq, H*D] at q_pos [nq] over keys k / values v [nk, Hkv*D]
        (before RoPE) at k_pos [nk]; key_mask [nk] bool drops keys (padding). -> (attn_out output [nq, d],
        probabilities [H, nq, nk])."""
        H, Hkv, D = self.n_heads, self.n_kv_heads, self.head_dim
        qh = rotate(q.view(-1, H, D), q_pos, self.theta).transpose(0, 1)  # [H, nq, D]
        kh = rotate(k.view(-1, Hkv, D), k_pos, self.theta).transpose(0, 1)  # [Hkv, nk, D]
        vh = v.view(-1, Hkv, D).transpose(0, 1)
        if Hkv != H:  # query head h reads KV head h // (H / Hkv)
            kh, vh = kh.repeat_interleave(H // Hkv, dim=0), vh.repeat_interleave(H // Hkv, dim=0)
        scores = (qh @ kh.transpose(1, 2)) / math.sqrt(D)
        if key_mask is not None:
            scores = scores.masked_fill(~key_mask[None, None, :], float("-inf"))
        probs = torch.softmax(scores.to(torch.float32), dim=-1).to(q.dtype)
        out = (probs @ vh).transpose(0, 1).reshape(-1, H * D)
        return out @ self.layers[i].attn_out_w.T, probs

    def run(self, ids: torch.Tensor, queries: torch.Tensor | Sequence[int] | None = None,
            kv: Sequence[tuple[torch.Tensor, torch.Tensor]] | None = None, *, key_mask: torch.Tensor | None = None,
            with_probs: bool = False) -> Pass:
        """Run the positions `queries` (default: all) of the canvas ids [L] through every layer.

        Each layer's keys/values are `kv[layer]` ([L, Hkv*D] each, before RoPE, every position) with the queries'
        rows replaced by their fresh ones (in a copy: nothing is written back); without `kv` the queries must be
        every position (a full pass). Positions are canvas indices 0..L-1 (a row alone, never padded)."""
        L = ids.shape[0]
        q_idx = torch.arange(L) if queries is None else torch.as_tensor(queries, dtype=torch.long)
        if kv is None and not torch.equal(q_idx, torch.arange(L)):
            raise ValueError("a pass without kept keys/values runs every position")
        all_pos = torch.arange(L)
        h = self.embed(ids[q_idx])
        keys, values, probs = [], [], []
        for i, layer in enumerate(self.layers):
            hn = layer.attn_norm(h)
            q, k, v = layer.q(hn), layer.k(hn), layer.v(hn)
            if kv is None:
                k_all, v_all = k, v
            else:
                k_all, v_all = kv[i][0].clone(), kv[i][1].clone()
                k_all[q_idx], v_all[q_idx] = k, v
            o, p = self.attend(i, q, q_idx, k_all, all_pos, v_all, key_mask)
            h = h + o
            h = h + layer.ffn(h)
            keys.append(k)
            values.append(v)
            probs.append(p)
        return Pass(self.head(h), keys, values, probs if with_probs else None)

    def logits(self, ids: torch.Tensor, key_mask: torch.Tensor | None = None) -> torch.Tensor:
        """The bidirectional forward of the canvas ids [L] -> logits [L, V]. With key_mask [L] (bool), masked keys
        are never attended and positions count the kept tokens only (as a left-padded row alone)."""
        if key_mask is None:
            return self.run(ids).logits
        positions = (key_mask.long().cumsum(0) - 1).clamp(min=0)
        h = self.embed(ids)
        for i, layer in enumerate(self.layers):
            hn = layer.attn_norm(h)
            o, _ = self.attend(i, layer.q(hn), positions, layer.k(hn), positions, layer.v(hn), key_mask)
            h = h + o
            h = h + layer.ffn(h)
        return self.head(h)
