"""The earlier home of the lm-eval adapter, kept so its names and `python -m localleap_jax.lm_eval_adapter` keep
working: the adapter is the package `localleap_jax.lm_eval` (model arguments, the answers' identity, prompt
fitting, the stats log, devices, the LM class, the command line)."""

import sys

from localleap_jax.lm_eval import (ADAPTER_ARGS, CACHE_OWNER, ENCODING_FILES, PYTHON_ONLY_ARGS, USER_ERRORS,
                                   CacheMismatchError, LocalLeapLM, ModelArgsError, Prompt,
                                   PromptTooLongError, answers_key, check_checkpoint, check_gen_length,
                                   check_writable, claim_cache, cut_at_until, decode_settings, default_dtype,
                                   fewshot_spans, follow, forget_missing_answers, join_and_mesh, key_digest, main, parse_model_args,
                                   preflight, processes_of, prompt_key, read_stats, rows_interact,
                                   tokenizer_fingerprint, weights_fingerprint)

__all__ = ["ADAPTER_ARGS", "CACHE_OWNER", "CacheMismatchError", "ENCODING_FILES", "LocalLeapLM", "ModelArgsError",
           "PYTHON_ONLY_ARGS", "Prompt", "PromptTooLongError", "USER_ERRORS", "answers_key", "check_checkpoint",
           "check_gen_length", "check_writable", "claim_cache", "cut_at_until", "decode_settings", "default_dtype",
           "fewshot_spans", "follow", "forget_missing_answers", "join_and_mesh", "key_digest", "main",
           "parse_model_args", "preflight", "processes_of", "prompt_key", "read_stats", "rows_interact",
           "tokenizer_fingerprint", "weights_fingerprint"]

if __name__ == "__main__":
    sys.exit(main())
