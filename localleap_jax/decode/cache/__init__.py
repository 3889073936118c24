"""Cache policies: what each forward pass of the loop computes, and what it keeps for the next (one policy, one
module; the protocol in `protocol`, the shared pieces of a pass in `passes`).

    state = policy.init(denoiser, canvas)
    hidden = policy.forward(denoiser, canvas, x, block, state, view)       # hidden.block, .region, .cache, .full
    state = policy.update(denoiser, hidden.cache, outcome)                 # after the rule's step
    policy = ll.cache("dkv", reload_every=8)                               # or "dkv:reload_every=8"

  none        every pass runs the whole canvas (plain; with a probe copy of the block for WINO, none+probe; with
              a soft input for dInfer's iteration smoothing, none+soft)
  prefix      Fast-dLLM's prefix cache: a row's first pass in a block runs the canvas and stores every layer's K/V;
              its later passes run the canvas from the block on (fast_dllm)
  dual        Fast-dLLM's dual cache: as prefix, but later passes run only the block (fast_dllm)
  block       block diffusion's exact cache (SDAR) (block)
  subblock    Fast-dLLM v2's approximate sub-block cache (block)
  encoder     a uniform-noise canvas model's encoder K/V and self-conditioning input (DiffusionGemma) (encoder)
  dllm_cache  dLLM-Cache: per-layer K/V and sublayer outputs, refreshed on a schedule, the least stable response
              positions recomputed in between (dllm_cache)
  dkv         dKV-Cache-Decode: delayed caching of decoded tokens' K/V, reloaded every reload_every passes (dkv)
  d2cache     d2Cache: each pass runs only positions picked by confidence, density and attention rollout (d2cache)
  vicinity    dInfer's vicinity refresh: the dual cache with a halo, warmup and periodic refresh (vicinity)

Every policy decides per row: a row refreshes when its own schedule says, the others take their cached pass in the
same program (whole-canvas passes run in lanes for the rows that take one: passes.in_lanes), so rows advance
through blocks on their own and a row decodes as it does alone.
"""

from localleap_jax.decode.cache.block import BlockCache, SubBlockCache, block_window
from localleap_jax.decode.cache.d2cache import D2Cache
from localleap_jax.decode.cache.dkv import DkvCache
from localleap_jax.decode.cache.dllm_cache import DllmCache
from localleap_jax.decode.cache.encoder import CanvasCacheState, CanvasEncoderCache
from localleap_jax.decode.cache.fast_dllm import DualCache, PrefixCache
from localleap_jax.decode.cache.plain import NoCache, ProbedNoCache, SoftNoCache
from localleap_jax.decode.cache.protocol import (CachePolicy, Hidden, PassOutcome, PassView, PolicyBase, from_full,
                                                 setting, static_setting)
from localleap_jax.decode.cache.registry import (CACHES, cache, is_policy, policy_from_json, policy_to_json,
                                                 register_cache, resolve)
from localleap_jax.decode.cache.vicinity import VicinityCache

for _name, _cls in (("none", NoCache), ("prefix", PrefixCache), ("dual", DualCache), ("block", BlockCache),
                    ("subblock", SubBlockCache), ("encoder", CanvasEncoderCache), ("dllm_cache", DllmCache),
                    ("dkv", DkvCache), ("d2cache", D2Cache), ("vicinity", VicinityCache)):
    register_cache(_name)(_cls)


# name -> the policy with its default settings (the built-in ones)
CACHE_POLICIES: dict[str, CachePolicy] = {name: cls() for name, cls in CACHES.items()}
CACHE_MODES = tuple(CACHE_POLICIES)
BIDIRECTIONAL_CACHES = tuple(n for n, p in CACHE_POLICIES.items() if "bidirectional" in p.fits)
BLOCK_CAUSAL_CACHES = tuple(n for n, p in CACHE_POLICIES.items() if "block_causal" in p.fits)
CANVAS_CACHES = tuple(n for n, p in CACHE_POLICIES.items() if "canvas" in p.fits)

__all__ = ["BIDIRECTIONAL_CACHES", "BLOCK_CAUSAL_CACHES", "CACHES", "CACHE_MODES", "CACHE_POLICIES", "CANVAS_CACHES",
           "BlockCache", "CachePolicy", "CanvasCacheState", "CanvasEncoderCache", "D2Cache", "DkvCache", "DllmCache",
           "DualCache", "Hidden", "NoCache", "PassOutcome", "PassView", "PolicyBase", "PrefixCache", "ProbedNoCache", "SoftNoCache",
           "SubBlockCache", "VicinityCache", "block_window", "cache", "from_full", "is_policy", "policy_from_json",
           "policy_to_json", "register_cache", "resolve", "setting", "static_setting"]
