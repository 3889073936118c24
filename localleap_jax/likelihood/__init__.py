"""Log-likelihood of continuations under a masked diffusion LM: the authors' Monte-Carlo ELBO estimators
(LLaDA's for LLaDA, Dream's for Dream) as one compiled program per group shape.

    lcfg = LikelihoodConfig(mc_num=128, batch_size=32, cfg_scale=0.0, seed=0)
    logp = loglikelihood(model, contexts, continuations, lcfg)     # token-id lists -> np.ndarray [N]
    context_ids, continuation_ids = encode_pair(model.tokenizer, "Question: ...", " answer", model.config.family)
"""

from localleap_jax.likelihood.config import ESTIMATOR_NAMES, LikelihoodConfig, LikelihoodError
from localleap_jax.likelihood.estimators import MaskCount, MaskRate, estimator_for, stratified_counts
from localleap_jax.likelihood.pairs import encode_pair
from localleap_jax.likelihood.run import OnOneDevice, Placement, check_requests, run_groups


def loglikelihood(model, contexts, continuations, lcfg: LikelihoodConfig = LikelihoodConfig(), *,
                  placement: Placement | None = None, on_group=None):
    """One estimate of log p(continuation | context) per request (np.ndarray [N] float64), on one device or on
    `placement`. Contexts and continuations: lists of token-id lists (see `encode_pair`)."""
    return run_groups(model, contexts, continuations, lcfg, placement=placement, on_group=on_group)


def greedy_match(model, contexts, continuations, lcfg: LikelihoodConfig = LikelihoodConfig(), *,
                 placement: Placement | None = None, on_group=None):
    """LLaDA's `is_greedy` per request (np.ndarray [N] bool): does committing the most confident masked token
    per pass, from an all-mask continuation, reproduce the continuation? (lcfg.cfg_scale guides it.)"""
    return run_groups(model, contexts, continuations, lcfg, placement=placement, greedy=True, on_group=on_group)


__all__ = ["ESTIMATOR_NAMES", "LikelihoodConfig", "LikelihoodError", "MaskCount", "MaskRate", "OnOneDevice",
           "Placement", "check_requests", "encode_pair", "estimator_for", "greedy_match", "loglikelihood",
           "stratified_counts"]
