"""localleap-jax: LocalLeap decoding for diffusion LLMs (LLaDA, Dream) in JAX/Flax.

    import localleap_jax as ll
    model = ll.load(path)
    ids, mask = model.tokenizer.encode_batch(prompts)
    out = ll.generate(model, ids, mask, ll.DecodeConfig(strategy=ll.rule("localleap", kappa=0.9)))
"""

from localleap_jax import checkpoint
from localleap_jax.api import generate, load
from localleap_jax.checkpoint import CheckpointError, Model
from localleap_jax.config import ConfigError, ModelConfig
from localleap_jax.decode import DecodeConfig, DecodeError, Generation
from localleap_jax.rules import RULES, all_of, any_of, register, rule, stateless
from localleap_jax.trace import Trace, load_trace, save_trace

__all__ = ["CheckpointError", "ConfigError", "DecodeConfig", "DecodeError", "Generation", "Model", "ModelConfig",
           "RULES", "Trace", "all_of", "any_of", "checkpoint", "generate", "load", "load_trace", "register", "rule",
           "save_trace", "stateless"]
