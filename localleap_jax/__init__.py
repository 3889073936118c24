"""localleap-jax: LocalLeap decoding for diffusion LLMs (LLaDA, Dream) in JAX/Flax.

    import localleap_jax as ll
    model = ll.load(path)
    ids, mask = model.tokenizer.encode_batch(prompts)
    out = ll.generate(model, ids, mask, ll.DecodeConfig(strategy=ll.rule("localleap", kappa=0.9)))
    logp = ll.loglikelihood(model, context_ids, continuation_ids, ll.LikelihoodConfig(mc_num=128))

Each name below is imported the first time it is used (PEP 562), so `import localleap_jax` itself is cheap: a
command line can import its toolkit (`localleap_jax.cli`) and guard its startup before JAX and the rest load.
"""

from __future__ import annotations

import importlib as _importlib
from typing import TYPE_CHECKING as _TYPE_CHECKING

# name -> the module that defines it
_HOMES = {
    "generate": "api", "load": "api", "loglikelihood": "api", "lower_generate": "api",
    "CheckpointError": "checkpoint", "Model": "checkpoint",
    "ConfigError": "config", "ModelConfig": "config",
    "DecodeConfig": "decode", "DecodeError": "decode", "Generation": "decode",
    "cache": "decode.cache", "register_cache": "decode.cache",
    "LocalLeapError": "errors",
    "LikelihoodConfig": "likelihood", "LikelihoodError": "likelihood", "encode_pair": "likelihood",
    "make_mesh": "partition",
    "RULES": "rules", "all_of": "rules", "any_of": "rules", "register": "rules", "rule": "rules",
    "stateless": "rules",
    "Trace": "trace", "load_trace": "trace", "save_trace": "trace",
}

# The public names, and the two submodules the documentation reaches into (ll.rules.RuleBase, ll.checkpoint.load).
__all__ = sorted([*_HOMES, "checkpoint", "rules"])


def __getattr__(name: str):
    if name in _HOMES:
        value = getattr(_importlib.import_module(f"{__name__}.{_HOMES[name]}"), name)
    else:  # a submodule (ll.checkpoint, ll.rules, ll.model, ...): imported on first use, as `import` would
        try:
            value = _importlib.import_module(f"{__name__}.{name}")
        except ModuleNotFoundError as e:
            if e.name != f"{__name__}.{name}":
                raise
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
    globals()[name] = value
    return value


def __dir__():
    # What a reader may use: the public names, not this module's machinery nor every submodule imported so far
    # (each is still reachable as ll.<submodule>).
    return list(__all__)


del annotations  # the __future__ import's binding: not a name of the package

if _TYPE_CHECKING:  # what the names are, for readers and type checkers
    from localleap_jax import checkpoint
    from localleap_jax.api import generate, load, loglikelihood, lower_generate
    from localleap_jax.checkpoint import CheckpointError, Model
    from localleap_jax.config import ConfigError, ModelConfig
    from localleap_jax.decode import DecodeConfig, DecodeError, Generation
    from localleap_jax.decode.cache import cache, register_cache
    from localleap_jax.errors import LocalLeapError
    from localleap_jax.likelihood import LikelihoodConfig, LikelihoodError, encode_pair
    from localleap_jax.partition import make_mesh
    from localleap_jax.rules import RULES, all_of, any_of, register, rule, stateless
    from localleap_jax.trace import Trace, load_trace, save_trace
