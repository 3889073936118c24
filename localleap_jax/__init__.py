"""localleap-jax: LocalLeap decoding for diffusion LLMs (LLaDA, Dream) in JAX/Flax.

    import localleap_jax as ll
    model = ll.load(path)
    ids, mask = model.tokenizer.encode_batch(prompts)
    out = ll.generate(model, ids, mask, ll.DecodeConfig(strategy=ll.rule("localleap", kappa=0.9)))
    logp = ll.loglikelihood(model, context_ids, continuation_ids, ll.LikelihoodConfig(mc_num=128))
"""

from localleap_jax import checkpoint
from localleap_jax.api import generate, load, loglikelihood
from localleap_jax.checkpoint import CheckpointError, Model
from localleap_jax.config import ConfigError, ModelConfig
from localleap_jax.decode import DecodeConfig, DecodeError, Generation
from localleap_jax.errors import LocalLeapError
from localleap_jax.likelihood import LikelihoodConfig, LikelihoodError, encode_pair
from localleap_jax.partition import make_mesh
from localleap_jax.rules import RULES, all_of, any_of, register, rule, stateless
from localleap_jax.trace import Trace, load_trace, save_trace

__all__ = ["CheckpointError", "ConfigError", "DecodeConfig", "DecodeError", "Generation", "LikelihoodConfig",
           "LikelihoodError", "LocalLeapError", "Model", "ModelConfig", "RULES", "Trace", "all_of", "any_of", "checkpoint",
           "encode_pair", "generate", "load", "load_trace", "loglikelihood", "make_mesh", "register", "rule", "save_trace",
           "stateless"]
