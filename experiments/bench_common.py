"""What the benchmarks share: model shapes, the same weights in JAX and PyTorch, and a timer."""

from __future__ import annotations

import os
import statistics
import sys
import time
from pathlib import Path

# JAX must not grab 75% of the GPU: the PyTorch model shares it in the same process.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from localleap_jax.checkpoint import Model  # noqa: E402
from localleap_jax.config import ModelConfig  # noqa: E402
from localleap_jax.model import init_params  # noqa: E402
from localleap_jax.families import write_config

SHAPES = {
    # LLaDA-8B-Instruct's architecture (../shared/reference/llada-8b-instruct.md)
    "llada-8b": ModelConfig(d_model=4096, n_heads=32, n_kv_heads=32, n_layers=32, mlp_hidden_size=12288,
                            vocab_size=126464, embedding_size=126464, rope_theta=500000.0,
                            max_sequence_length=4096, mask_token_id=126336, eos_token_id=126081,
                            pad_token_id=126081),
    # Dream-v0-Instruct-7B's architecture (a Qwen2.5-7B block: GQA 28/4, q/k/v biases, untied head)
    "dream-7b": ModelConfig(d_model=3584, n_heads=28, n_kv_heads=4, n_layers=28, mlp_hidden_size=18944,
                            vocab_size=152064, embedding_size=152064, rope_theta=1000000.0, rms_norm_eps=1e-6,
                            max_sequence_length=131072, mask_token_id=151666, eos_token_id=151643,
                            pad_token_id=151643, family="dream", qkv_bias=True, logits_shift=1),
    # a CPU-sized model of the LLaDA family
    "small": ModelConfig(d_model=256, n_heads=8, n_kv_heads=8, n_layers=4, mlp_hidden_size=768, vocab_size=32000,
                         embedding_size=32000, rope_theta=500000.0, max_sequence_length=4096, mask_token_id=31999,
                         eos_token_id=31998, pad_token_id=31998),
}


def on_gpu() -> bool:
    return jax.default_backend() == "gpu"


def random_model(shape: str, dtype, seed: int = 0) -> Model:
    config = SHAPES[shape]
    params = jax.jit(lambda k: init_params(config, k, dtype))(jax.random.key(seed))
    return Model(config, params, tokenizer=None)


def torch_twin(model: Model, dtype=None):
    """transformers' Llama (LLaDA) or Qwen2 (Dream) holding exactly `model`'s weights, via the family's HF
    tensor names, on the same device kind."""
    import torch

    from oracles import bidirectional as reference_torch
    from localleap_jax.families import hf_tensors

    device = "cuda" if on_gpu() and torch.cuda.is_available() else "cpu"
    tdtype = dtype or {"bfloat16": torch.bfloat16, "float16": torch.float16}.get(str(model.dtype), torch.float32)
    tensors = {}
    for name, arr in hf_tensors(model.params, model.config).items():
        if device == "cuda":  # device to device, no host copy
            t = torch.from_dlpack(jnp.asarray(arr))
        else:
            t = torch.from_numpy(np.array(arr, np.float32))  # a writable copy
        tensors[name] = t.to(device=device, dtype=tdtype).contiguous()
    build = reference_torch.qwen2_from_dream if model.config.family == "dream" else reference_torch.llama_from_llada
    return build(write_config(model.config), tensors, dtype=tdtype, device=device), device


def median_seconds(fn, reps: int = 5, warmup: int = 1) -> float:
    """Median wall time of fn() (which must block until its result is ready)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def torch_sync():
    import torch
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def forward_flops(config: ModelConfig, batch: int, length: int, head_positions: int | None = None) -> float:
    """Matmul FLOPs of one forward pass (2 per multiply-add), attention included."""
    d, f, kv = config.d_model, config.mlp_hidden_size, config.n_kv_heads * config.head_dim
    per_token_layer = 2 * (2 * d * d + 2 * d * kv + 3 * d * f)
    attention = 2 * 2 * length * length * d  # QK^T and PV, per layer per sequence
    head = 2 * d * config.embedding_size * (head_positions if head_positions is not None else length)
    return batch * (config.n_layers * (per_token_layer * length + attention) + head)
