"""Decoding rules: which still-masked positions of each row's current block commit this step.

    import localleap_jax as ll
    r = ll.rule("localleap", kappa=0.9, tau=0.75, radius=4)     # or ll.rule("localleap:kappa=0.9")
    cfg = ll.DecodeConfig(strategy=r, gen_length=256, block_length=32)

A rule is a frozen dataclass holding its settings, with `init(batch, block, vocab) -> state` and
`update(signals, state) -> (commit, state)` (see `base`). Settings are traced arrays of one value
per row inside the compiled loop. Rules by module:

  confidence   low_confidence (LLaDA), threshold and factor (Fast-dLLM), localleap
  uncertainty  margin, entropy (schedule by another ranking), eb (EB-Sampler)
  stateful     stable (this project's worked example); klass (KLASS)
  combinators  any_of, all_of
  revoking     wino, saber, remdm: rules that take commits back (Decision(commit, remask))
  editing      joint_threshold (LLaDA2.1): rules that replace held tokens and end their own blocks
               (Decision(commit, edit=..., finished=...))
  indel        joint_threshold_indel (LLaDA2.2): a rule that rewrites its block, inserting and dropping positions
               (Decision(commit, ..., block=..., insert=..., delete=...))
  dinfer       credit (writes its fused argmax: Decision(commit, block=...)), hierarchy, smooth (feeds the next pass
               an input embedding: Decision(commit, soft_weight=...)): dInfer's decoders
  canvas       entropy_bound (DiffusionGemma's sampler), localleap_uniform: canvas rules, for a uniform-noise
               canvas model without masks (CanvasDecision(accept, tokens, finished))
  sources      rules from a user's file or module (load_rules, --rules), entry points, each rule's code_identity
  traits       what the loop reads of a rule, once: RuleTraits (region, probes, remask_names, resets_state,
               edit_names, ends_blocks, canvas, rewrites, soft_input)
  failures     a rule's calls inside the compiled loop, and a failure there in one line (file, line, what to do)
  strategy     one way to say a rule: resolve / as_rule (a rule or a spec), with_shared_settings (the shared flags)
"""

from localleap_jax.rules.base import (Decision, DecodeError, Rule, RuleBase, Signals, first_clause, most_confident, per_row,
                                      rank_by, setting, top_k)
from localleap_jax.rules.registry import (RULES, FunctionRule, parse_spec, register, register_rule, rule,
                                          rule_from_json, rule_to_json, split_specs, stateless)
from localleap_jax.rules.confidence import Dynamic, Factor, LocalLeap, LowConfidence, Threshold, near_any  # noqa: E402
from localleap_jax.rules.uncertainty import EntropyBounded, Entropy, Margin  # noqa: E402
from localleap_jax.rules.stateful import Klass, Stable  # noqa: E402
from localleap_jax.rules.combinators import AllOf, AnyOf, all_of, any_of  # noqa: E402
from localleap_jax.rules.revoking import ReMDM, Saber, Wino  # noqa: E402
from localleap_jax.rules.editing import JointThreshold  # noqa: E402
from localleap_jax.rules.indel import JointThresholdInDel  # noqa: E402
from localleap_jax.rules.dinfer import Credit, Hierarchy, Smooth  # noqa: E402
from localleap_jax.rules.canvas import (CanvasDecision, CanvasRuleBase, CanvasSignals, EntropyBound,  # noqa: E402
                                        LocalLeapUniform)
from localleap_jax.rules.sources import RulesError, code_identity, load_rules  # noqa: E402
from localleap_jax.rules.traits import RuleTraits, traits_of  # noqa: E402
from localleap_jax.rules.failures import check_calls, run_init, run_temperature, run_update  # noqa: E402
from localleap_jax.rules.strategy import SHARED_SETTINGS, as_rule, resolve, with_shared_settings  # noqa: E402

__all__ = ["AllOf", "AnyOf", "CanvasDecision", "CanvasRuleBase", "CanvasSignals", "Credit", "Decision", "DecodeError", "Dynamic", "Entropy", "EntropyBounded", "Factor", "FunctionRule",
           "EntropyBound", "Hierarchy", "JointThreshold", "JointThresholdInDel", "Smooth", "Klass", "LocalLeap", "LocalLeapUniform", "LowConfidence", "Margin", "RULES", "ReMDM", "Rule", "RuleBase", "RuleTraits", "RulesError",
           "SHARED_SETTINGS", "Saber", "Signals", "Stable", "Threshold", "Wino", "all_of", "any_of", "as_rule", "check_calls",
           "code_identity", "first_clause", "load_rules", "most_confident", "near_any", "parse_spec", "per_row", "rank_by",
           "register", "register_rule", "resolve", "rule", "rule_from_json", "rule_to_json", "run_init", "run_temperature", "run_update",
           "setting", "split_specs", "stateless", "top_k", "traits_of", "with_shared_settings"]
