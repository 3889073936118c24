"""Decoding: the whole generation of a batch as one jitted `lax.while_loop`, made of small pieces.

  config    DecodeConfig (what is asked, validated before compiling) and its compile-time LoopSettings
  canvas    the canvas layout [prompt | blocks] and row-wise helpers
  step      one denoising step: head -> prediction/confidence -> rule -> commits (the rule contract kept); a
            canvas rule's pass (`canvas_step`: accepted positions, the rest re-noised)
  cache/    cache policies, one module each (none, prefix, dual, block, subblock; encoder: a uniform-noise canvas
            model's; the field's dllm_cache, dkv, d2cache, vicinity): what each pass computes and keeps, per row
  draws     a canvas rule's random draws (the canvases' noise, the sample's key), or those supplied
  stop      stop policies (never, EOS early stop; a canvas model's rows ending on EOS)
  recorder  recorders (none, trace buffers)
  loop      decode_loop: the one while_loop, the step between the pieces' calls
  run       inputs checked and bucketed, one compile per program, Generation; the single-device runner
"""

from localleap_jax.decode.cache import CACHE_MODES, CACHE_POLICIES, CachePolicy, DualCache, NoCache, PrefixCache
from localleap_jax.decode.canvas import Canvas
from localleap_jax.decode.config import DecodeConfig, check_room, model_canvas
from localleap_jax.decode.loop import LoopOutput, LoopSettings, LoopState, PerRow, decode_loop
from localleap_jax.decode.recorder import NoRecorder, Recorder, TraceBuffers, TraceRecorder
from localleap_jax.decode.run import Generation, OneDevice, Placement, generate, pad_rows, prepare_inputs, run
from localleap_jax.decode.step import Scoring, StepResult, denoise_step, predict
from localleap_jax.decode.stop import NeverStop, StopAny, StopAtEos, StopPolicy
from localleap_jax.rules import DecodeError

__all__ = ["CACHE_MODES", "CACHE_POLICIES", "CachePolicy", "Canvas", "DecodeConfig", "DecodeError", "DualCache",
           "Generation", "LoopOutput", "LoopSettings", "LoopState", "NeverStop", "NoCache",
           "NoRecorder", "OneDevice", "PerRow", "Placement", "PrefixCache", "Recorder", "Scoring", "StepResult", "StopAny",
           "StopAtEos", "StopPolicy", "TraceBuffers", "TraceRecorder", "check_room", "decode_loop", "denoise_step",
           "generate", "model_canvas", "pad_rows", "predict", "prepare_inputs", "run"]
