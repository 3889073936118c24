"""lm-eval-harness model `localleap`: lm-eval owns tasks, prompts, filters and metrics; this generates and scores.

    python -m localleap_jax.lm_eval --model localleap \\
        --model_args checkpoint=DIR,strategy=localleap,gen_length=256,block_length=32 --tasks gsm8k

(`python -m localleap_jax.lm_eval` is the `lm_eval`
command with this model registered; it takes exactly lm_eval's arguments, and ends a mistake
with one `error: ...` line.)

What each part does (LocalLeapLM's `generate_until`, prompt fitting and `truncate_fewshot`, the
stats log, the answers' identity that claims a response cache) is said in its module:

  args      model arguments: ADAPTER_ARGS, their parsers, parse_model_args, ModelArgsError
  identity  what the answers depend on (answers_key, fingerprints) and the response cache's claim
  prompts   prompt fitting (few-shot spans, truncation, PromptTooLongError) and cutting at `until`
  stats     the per-request stats log
  devices   joining the processes, the mesh to generate on, a follower's evaluation
  model     LocalLeapLM, registered with lm-eval as "localleap" (generate_until, loglikelihood, rolling)
  choice_task  an offline multiple-choice task for the embedded model (python -m localleap_jax.lm_eval.choice_task)
  cli       the command line (main), its preflight checks and USER_ERRORS
"""

from localleap_jax.lm_eval.args import (ADAPTER_ARGS, PYTHON_ONLY_ARGS, ModelArgsError, check_gen_length,
                                        default_dtype, parse_model_args, refuse_python_only)
from localleap_jax.lm_eval.cli import USER_ERRORS, check_checkpoint, main, preflight
from localleap_jax.lm_eval.devices import follow, join_and_mesh, processes_of
from localleap_jax.lm_eval.identity import (CACHE_OWNER, ENCODING_FILES, CacheMismatchError, answers_key,
                                            check_response_cache, claim_cache, decode_settings,
                                            forget_missing_answers, key_digest, response_cache_file, rows_interact,
                                            tokenizer_fingerprint, weights_fingerprint)
from localleap_jax.lm_eval.model import LocalLeapLM
from localleap_jax.lm_eval.prompts import Prompt, PromptTooLongError, cut_at_until, fewshot_spans, fit, fit_all
from localleap_jax.lm_eval.stats import append_stats, check_writable, open_stats, pair_key, prompt_key, read_stats

__all__ = ["ADAPTER_ARGS", "CACHE_OWNER", "CacheMismatchError", "ENCODING_FILES", "LocalLeapLM", "ModelArgsError",
           "PYTHON_ONLY_ARGS", "Prompt", "PromptTooLongError", "USER_ERRORS", "answers_key", "append_stats",
           "check_checkpoint", "check_gen_length", "check_response_cache", "check_writable", "claim_cache", "cut_at_until", "decode_settings",
           "default_dtype", "fewshot_spans", "fit", "fit_all", "follow", "forget_missing_answers", "join_and_mesh",
           "key_digest", "main", "open_stats", "pair_key", "parse_model_args", "preflight", "processes_of",
           "prompt_key", "read_stats", "refuse_python_only", "response_cache_file", "rows_interact", "tokenizer_fingerprint",
           "weights_fingerprint"]
