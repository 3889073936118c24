"""`ModelConfig`: the network's architecture, the same fields for every model family.

One network (a Llama-style block, model.py) with switches: q/k/v biases (Dream), per-head q/k norms and an
explicit head size (Qwen3: SDAR), a tied head, block-causal attention (block diffusion), a logits shift (Dream
scores token i from position i - 1). Each family's file in `localleap_jax/families/` reads its own config.json
into these fields (and refuses what the network does not implement); `family` names the record that says the rest
(`localleap_jax.families.family_of`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from localleap_jax.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    d_model: int
    n_heads: int
    n_kv_heads: int
    n_layers: int
    mlp_hidden_size: int
    vocab_size: int
    embedding_size: int  # rows of the embedding and of the LM head (vocab padded up)
    rope_theta: float = 500000.0
    rms_norm_eps: float = 1e-5
    max_sequence_length: int = 4096
    mask_token_id: int = 126336
    eos_token_id: int = 126081
    pad_token_id: int = 126081
    family: str = "llada"  # the family record's name (localleap_jax.families): how config.json and tensors are named
    qkv_bias: bool = False  # q/k/v projections carry a bias (Dream, Qwen2-style)
    qk_norm: bool = False  # per-head RMSNorm on q and k before RoPE (Qwen3, SDAR)
    explicit_head_dim: int | None = None  # head size when it is not d_model / n_heads (Qwen3's head_dim)
    tie_word_embeddings: bool = False  # the LM head is the embedding matrix (no separate ff_out)
    # 0: bidirectional attention. > 0: block-causal on each row's grid of this many positions (SDAR): a query
    # in block i sees keys in blocks <= i, so a finished block's K/V never change.
    block_size: int = 0
    # True: the attention grid follows the decoding block (DecodeConfig.block_length; LLaDA2), block_size being
    # the default; False: block_length must be block_size, the block the model was trained with (SDAR).
    flexible_block: bool = False
    # How far the logits lag the tokens they score: 1 when the token at i is scored from the hidden state at i - 1
    # (Dream, trained from an autoregressive model), 0 when from its own (LLaDA, SDAR).
    logits_shift: int = 0
    rotary_dim: int | None = None  # RoPE on the first rotary_dim dims of each head (None: all; LLaDA2: half)
    # A family's own settings (a hashable frozen dataclass) for what these fields cannot say: its MoE layers, or a
    # network model.py does not implement (families/<name>.py says what it holds). None: none.
    arch: Any = None
    # > 0: a uniform-noise canvas model (DiffusionGemma): no mask token; a generation decodes canvases of this many
    # tokens, each started from uniform noise, with a canvas rule (rules/canvas.py). 0: a masked-diffusion model.
    canvas_length: int = 0
    # Every id that ends a row, when config.json lists several (DiffusionGemma); () : eos_token_id alone.
    eos_token_ids: tuple[int, ...] = ()
    # LLaDA2.2's edit tokens (config.json's delete_token_id / split_token_id): the insert/delete decoder writes them to
    # drop a position or to insert a mask before one. None: the model has none.
    delete_token_id: int | None = None
    split_token_id: int | None = None

    def __post_init__(self):
        if not isinstance(self.family, str) or not self.family:
            raise ConfigError(f"family must name a model family, got {self.family!r}")
        for name in ("d_model", "n_heads", "n_kv_heads", "n_layers", "mlp_hidden_size",
                     "vocab_size", "embedding_size", "max_sequence_length"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)}")
        if self.explicit_head_dim is not None and self.explicit_head_dim <= 0:
            raise ConfigError(f"head_dim must be positive, got {self.explicit_head_dim}")
        if self.block_size < 0:
            raise ConfigError(f"block_size must be >= 0 (0: bidirectional), got {self.block_size}")
        if self.canvas_length < 0:
            raise ConfigError(f"canvas_length must be >= 0 (0: a masked-diffusion model), got {self.canvas_length}")
        if self.logits_shift not in (0, 1):
            raise ConfigError(f"logits_shift must be 0 or 1, got {self.logits_shift}")
        if self.explicit_head_dim is None and self.d_model % self.n_heads:
            raise ConfigError(f"d_model={self.d_model} is not divisible by n_heads={self.n_heads}")
        if self.n_heads % self.n_kv_heads:
            raise ConfigError(f"n_heads={self.n_heads} is not a multiple of n_kv_heads={self.n_kv_heads}")
        if self.head_dim % 2:
            raise ConfigError(f"head_dim={self.head_dim} must be even for rotate-half RoPE")
        if self.rotary_dim is not None and not (0 < self.rotary_dim <= self.head_dim and self.rotary_dim % 2 == 0):
            raise ConfigError(f"rotary_dim={self.rotary_dim} must be even and in (0, head_dim={self.head_dim}]")
        if self.embedding_size < self.vocab_size:
            raise ConfigError(f"embedding_size={self.embedding_size} < vocab_size={self.vocab_size}")
        for name in ("mask_token_id", "eos_token_id", "pad_token_id"):
            if not 0 <= getattr(self, name) < self.vocab_size:
                raise ConfigError(f"{name}={getattr(self, name)} is outside the vocabulary (vocab_size={self.vocab_size})")
        for name in ("delete_token_id", "split_token_id"):
            t = getattr(self, name)
            if t is not None and not 0 <= t < self.vocab_size:
                raise ConfigError(f"{name}={t} is outside the vocabulary (vocab_size={self.vocab_size})")
            if t is not None and t == self.mask_token_id:
                raise ConfigError(f"{name}={t} equals mask_token_id: an edit token must be a token of its own")
        if self.delete_token_id is not None and self.delete_token_id == self.split_token_id:
            raise ConfigError(f"delete_token_id and split_token_id are both {self.delete_token_id}: they must differ")
        for t in self.eos_token_ids:
            if not 0 <= t < self.vocab_size:
                raise ConfigError(f"eos_token_ids holds {t}, outside the vocabulary (vocab_size={self.vocab_size})")
        for name, why in (("eos_token_id", "a generated end of text would read as a position still to generate"),
                          ("pad_token_id", "padding would read as positions to generate")):
            if getattr(self, name) == self.mask_token_id:  # eos == pad is fine (LLaDA pads with EOS)
                raise ConfigError(f"{name}={getattr(self, name)} equals mask_token_id: {why}; the mask id must be a "
                                  "token of its own")

    @property
    def head_dim(self) -> int:
        return self.explicit_head_dim or self.d_model // self.n_heads

    @property
    def end_ids(self) -> tuple[int, ...]:
        """The ids that end a row: eos_token_ids, or eos_token_id alone."""
        return self.eos_token_ids or (self.eos_token_id,)

    @property
    def block_causal(self) -> bool:
        """A block diffusion LM: attention is causal across blocks of `block_size` and bidirectional inside one."""
        return self.block_size > 0

    @property
    def num_params(self) -> int:
        d, f, v = self.d_model, self.mlp_hidden_size, self.embedding_size
        q, kv = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        per_layer = (2 * d + 2 * d * q + 2 * d * kv + 3 * d * f + (q + 2 * kv if self.qkv_bias else 0)
                     + (2 * self.head_dim if self.qk_norm else 0))
        return (1 if self.tie_word_embeddings else 2) * v * d + d + self.n_layers * per_layer
