"""config.json validation, both families: every wrong type, range, out-of-vocabulary id and unimplemented
field is refused by name (never coerced: `int(64.7)` would silently build another model)."""

import pytest

from localleap_jax.config import ConfigError
from localleap_jax.families import read_config, write_config
from helpers import tiny_dream_config, tiny_hf_config

LLADA = tiny_hf_config(300, 2, 0)
DREAM = tiny_dream_config(320, 299, 296)


def _drop(cfg, key):
    return {k: v for k, v in cfg.items() if k != key}


@pytest.mark.parametrize("cfg, named", [
    ({**LLADA, "d_model": 64.7}, "d_model=64.7 must be an integer"),
    ({**LLADA, "d_model": 64.0}, "d_model=64.0 must be an integer"),
    ({**LLADA, "d_model": True}, "d_model=True must be an integer"),
    ({**LLADA, "d_model": "64"}, "d_model='64' must be an integer"),
    ({**LLADA, "n_layers": [3]}, "n_layers=[3] must be an integer"),
    ({**LLADA, "n_layers": 0}, "n_layers=0 must be >= 1"),
    ({**LLADA, "n_kv_heads": 3}, "n_heads=4 is not a multiple of n_kv_heads=3"),
    (_drop(LLADA, "vocab_size"), "missing vocab_size"),
    (_drop(LLADA, "mask_token_id"), "missing mask_token_id"),
    ({**LLADA, "embedding_size": 200}, "embedding_size=200 < vocab_size=300"),
    ({**LLADA, "eos_token_id": 300}, "eos_token_id=300 is outside the vocabulary"),
    ({**LLADA, "pad_token_id": 1000}, "pad_token_id=1000 is outside the vocabulary"),
    ({**LLADA, "mask_token_id": 300}, "mask_token_id=300 is outside the vocabulary"),
    ({**LLADA, "mask_token_id": 0}, "eos_token_id=0 equals mask_token_id: a generated end of text would read as a "
                                    "position still to generate"),
    ({**LLADA, "pad_token_id": 2}, "pad_token_id=2 equals mask_token_id: padding would read as positions to generate"),
    ({**LLADA, "pad_token_id": 5, "eos_token_id": 2}, "eos_token_id=2 equals mask_token_id"),  # pad apart: no guard
    ({**LLADA, "eos_token_id": None}, "missing eos_token_id"),
    ({**LLADA, "rms_norm_eps": 0}, "rms_norm_eps=0 must be a positive number"),
    ({**LLADA, "rope_theta": "1e4"}, "rope_theta='1e4' must be a positive number"),
    ({**LLADA, "rope_theta": float("nan")}, "rope_theta=nan must be a positive number"),
    ({**_drop(LLADA, "mlp_hidden_size"), "mlp_ratio": 1.3}, "mlp_ratio=1.3 times d_model=64 is not a whole number"),
    ({**LLADA, "rope_scaling": {"type": "linear", "factor": 2}}, "rope_scaling"),
    ({**LLADA, "rope_full_precision": False}, "rope_full_precision=False"),
    ({**LLADA, "layer_norm_with_affine": False}, "layer_norm_with_affine=False"),
    ({**LLADA, "bias_for_layer_norm": True}, "bias_for_layer_norm"),
    (_drop(LLADA, "rope"), "rope missing"),
    (_drop(LLADA, "layer_norm_type"), "layer_norm_type missing"),
    ({**DREAM, "hidden_size": 112.5}, "hidden_size=112.5 must be an integer"),
    ({**DREAM, "intermediate_size": "160"}, "intermediate_size='160' must be an integer"),
    ({**DREAM, "num_key_value_heads": 3}, "n_heads=14 is not a multiple of n_kv_heads=3"),
    ({**DREAM, "max_position_embeddings": 0}, "max_position_embeddings=0 must be >= 1"),
    ({**DREAM, "rms_norm_eps": -1e-6}, "rms_norm_eps=-1e-06 must be a positive number"),
    ({**DREAM, "mask_token_id": 320}, "mask_token_id=320 is outside the vocabulary"),
    ({**DREAM, "pad_token_id": 299}, "pad_token_id=299 equals mask_token_id"),
    ({**DREAM, "eos_token_id": [296, 297]}, "eos_token_id=[296, 297] must be an integer"),
    (_drop(DREAM, "mask_token_id"), "missing mask_token_id"),
    ({**DREAM, "attention_bias": "yes"}, "attention_bias='yes' must be true or false"),
    ({**DREAM, "head_dim": 16}, "head_dim=16"),
    ({**DREAM, "layer_types": ["full_attention", "sliding_attention", "full_attention"]}, "layer_types"),
    ({**DREAM, "rope_parameters": {"rope_type": "yarn", "factor": 4.0}}, "rope_parameters"),
    ({**DREAM, "use_sliding_window": True, "sliding_window": 64}, "use_sliding_window"),
    ({**DREAM, "rope_scaling": {"type": "dynamic", "factor": 2.0}}, "rope_scaling"),
    ({**DREAM, "tie_word_embeddings": True}, "tie_word_embeddings"),
    ({"model_type": "mistral", "hidden_size": 64}, "model_type='mistral'"),
    ({"hidden_size": 64}, "names no model family"),
    ([1, 2], "must hold a JSON object, not a list"),
])
def test_bad_config_is_refused_by_name(cfg, named):
    with pytest.raises(ConfigError, match=named.replace("[", r"\[").replace("]", r"\]").replace("(", r"\(")
                       .replace(")", r"\)").replace("+", r"\+")):
        read_config(cfg)


def test_dream_sliding_window_size_alone_is_not_in_use():
    """Qwen2/Dream only slide when use_sliding_window is true; a size next to `false` changes nothing."""
    assert read_config({**DREAM, "sliding_window": 4096, "use_sliding_window": False}).family == "dream"


@pytest.mark.parametrize("cfg", [LLADA, DREAM])
def test_both_families_round_trip(cfg):
    c = read_config(cfg)
    assert read_config(write_config(c)) == c
    assert c.logits_shift == (1 if c.family == "dream" else 0) and c.qkv_bias == (c.family == "dream")


# ---------------------------------------------------------------- settings checked when made (issue #47)
# DecodeConfig, a rule (by ll.rule or its class) and LikelihoodConfig refuse a bad setting in one LocalLeapError line
# when they are made, not later inside generate or loglikelihood (they were accepted when made before).

import dataclasses  # noqa: E402
import math  # noqa: E402

import localleap_jax as ll  # noqa: E402


@pytest.mark.parametrize("fields, message", [
    (dict(gen_length="64"), r"^gen_length='64' must be a whole number$"),
    (dict(gen_length=-64), r"^gen_length=-64 must be positive$"),
    (dict(block_length=0), r"^block_length=0 must be positive$"),
    (dict(gen_length=True), r"^gen_length=True must be a whole number$"),
    (dict(prompt_bucket=8.0), r"^prompt_bucket=8.0 must be a whole number$"),
    (dict(temperature=math.nan), r"^temperature=nan must be a finite number"),
    (dict(temperature=-0.5), r"^temperature=-0.5 must be >= 0"),
    (dict(temperature="hot"), r"^temperature='hot' must be a finite number"),
    (dict(cache="dual2"), r"^unknown cache 'dual2' \(did you mean 'dual'\?\); choose from auto, none, prefix, dual"),
    (dict(cache=["dual"]), r"^cache=\['dual'\] is not a cache policy .*: give a name \(auto, none, prefix, dual"),
    (dict(early_stop=1), r"^early_stop=1 must be True or False$"),
    (dict(logits_eos_inf="yes"), r"^logits_eos_inf='yes' must be True or False$"),
    (dict(confidence_eos_eot_inf=None), r"^confidence_eos_eot_inf=None must be True or False$"),
    (dict(max_passes=0), r"^max_passes=0 must be a positive whole number"),
    (dict(sub_block_length=2.5), r"^sub_block_length=2.5 must be a positive whole number"),
    (dict(gen_len=64), r"^DecodeConfig has no field 'gen_len' \(did you mean 'gen_length'\?\); its fields: strategy"),
])
def test_decode_config_fields_are_checked_when_made(fields, message):
    with pytest.raises(ll.DecodeError, match=message) as e:
        ll.DecodeConfig(**fields)
    assert "\n" not in str(e.value)
    if "gen_len" not in fields:  # a config made from another (dataclasses.replace) too
        with pytest.raises(ll.DecodeError, match=message):
            dataclasses.replace(ll.DecodeConfig(), **fields)


@pytest.mark.parametrize("settings, message", [
    (dict(kappa="high"), r"^localleap: kappa='high' must be a number \(or an array of one per row\)$"),
    (dict(kappa=2.0), r"^localleap: kappa=2.0 must lie in \(0, 1\]$"),
    (dict(kappa=math.nan), r"^localleap: kappa=nan must be finite$"),
    (dict(radius=-1), r"^localleap: radius=-1 must lie in \[0, inf\)$"),
    (dict(radius=2.5), r"^localleap: radius=2.5 must be a whole number$"),
    (dict(kappa=[0.9, 1.5]), r"^localleap: kappa holds 1.5, which must lie in \(0, 1\]$"),
    (dict(kappa=None), r"^localleap: kappa=None must be a number"),
    (dict(kappa=0.5), r"^localleap: tau=0.75 > kappa=0.5"),  # settings that contradict each other
])
def test_rule_settings_are_checked_when_made(settings, message):
    from localleap_jax.rules import LocalLeap

    with pytest.raises(ll.DecodeError, match=message):
        ll.rule("localleap", **settings)
    if "tau" not in message and settings != dict(kappa=None):  # the class itself: each setting on its own
        with pytest.raises(ll.DecodeError, match=message):
            LocalLeap(**settings)


def test_every_registered_rules_every_setting_is_checked_when_made():
    """Each setting of each built-in rule refuses text and NaN when the rule is made, by name and by its class; a
    rule rebuilt by JAX from placeholders (its tree unflattened) is not refused."""
    import jax

    checked = 0
    for name in sorted(ll.rules.RULES):
        cls = ll.rules.RULES[name]
        made = ll.rule(name)
        for f in dataclasses.fields(made):
            if "setting" not in f.metadata:
                continue
            for bad in ("x", math.nan):
                with pytest.raises(ll.DecodeError, match=rf"^{name}: {f.name}"):
                    ll.rule(name, **{f.name: bad})
                with pytest.raises(ll.DecodeError, match=rf"^{name}: {f.name}"):
                    cls(**{f.name: bad})
            checked += 1
        leaves, tree = jax.tree.flatten(made)
        jax.tree.unflatten(tree, [object()] * len(leaves))  # what jax.vmap / pmap do with in_axes
    assert checked >= 25


@pytest.mark.parametrize("make, message", [
    (lambda: ll.rule(123), r"^rule takes a rule name, a spec string \('eb:gamma=0.01'\) or a rule object; got int 123$"),
    (lambda: ll.rule(ll.rule("threshold"), kapa=0.5), r"^threshold has no setting kapa; its settings: kappa$"),
    (lambda: ll.rule(ll.rule("threshold"), kappa=2.0), r"^threshold: kappa=2.0 must lie in \(0, 1\]$"),
    (lambda: ll.stateless(123), r"^stateless takes a function of the step's signals"),
    (lambda: ll.any_of(), r"^any_of takes one or more rules"),
    (lambda: ll.all_of("threshold", ll.rule("stable")), r"^all_of takes rule objects: ll.rule\('threshold'\)"),
    (lambda: ll.any_of(ll.rule("threshold"), 1), r"^int 1 lacks name, .* of the Rule protocol"),
    (lambda: ll.any_of(ll.rule("threshold"), ll.rule("wino")), r"^wino takes commits back.*cannot be combined"),
    (lambda: ll.register(123), r"^rule name 123: a name is a non-empty string without"),
])
def test_every_way_to_make_a_rule_names_what_it_cannot_take(make, message):
    """Siblings of the settings checked when made: each was a TypeError, or accepted and refused later."""
    with pytest.raises(ll.DecodeError, match=message):
        make()


def test_likelihood_config_is_checked_when_made():
    with pytest.raises(ll.LikelihoodError, match=r"^LikelihoodConfig: mc_num=100 must be a multiple of batch_size=32"):
        ll.LikelihoodConfig(mc_num=100, batch_size=32)
    with pytest.raises(ll.LikelihoodError, match=r"estimator='ar' is not one of llada, dream"):
        ll.LikelihoodConfig(estimator="ar")
