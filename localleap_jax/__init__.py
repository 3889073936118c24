"""localleap-jax: LocalLeap decoding for diffusion LLMs (LLaDA) in JAX/Flax.

    import localleap_jax as ll
    model = ll.load(path)
    ids, mask = model.tokenizer.encode_batch(prompts)
    out = ll.generate(model, ids, mask, ll.DecodeConfig(strategy="localleap"))
"""

from localleap_jax.checkpoint import CheckpointError, Model, load
from localleap_jax.config import ConfigError, ModelConfig
from localleap_jax.decode import DecodeConfig, DecodeError, Generation, generate
from localleap_jax.strategies import STRATEGIES, register

__all__ = ["CheckpointError", "ConfigError", "DecodeConfig", "DecodeError", "Generation", "Model", "ModelConfig",
           "STRATEGIES", "generate", "load", "register"]
