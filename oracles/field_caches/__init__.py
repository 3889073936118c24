"""Eager transcriptions of the field's approximate caches for bidirectional diffusion LLMs (doc: to be written)."""

from oracles.field_caches.common import (BatchResult, CacheResult, CommitRule, DInferThreshold, LowConfidence,
                                         PassLog, Threshold, no_cache, per_row)
from oracles.field_caches.d2cache_loop import d2cache
from oracles.field_caches.dkv_loop import dkv
from oracles.field_caches.dllm_cache_loop import dllm_cache
from oracles.field_caches.network import EagerLLaDA
from oracles.field_caches.vicinity_loop import vicinity

LOOPS = {"none": no_cache, "dllm_cache": dllm_cache, "dkv": dkv, "d2cache": d2cache, "vicinity": vicinity}
