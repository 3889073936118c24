"""Rules that take commits back (localleap_jax.rules.revoking: wino, saber, remdm) through the compiled loop,
against the authors' functions transcribed eagerly (oracles.revoke) on transformers' Llama with
the same weights: the same tokens, NFE and remasks; left padding, per-row settings, the pass bound, traces, and
the contract's refusals."""

from __future__ import annotations

import types

import numpy as np
import pytest
from flax import struct

import localleap_jax as ll
from localleap_jax import dynamics
from oracles import revoke as ref
from localleap_jax.compile_cache import compiled_programs
from localleap_jax.decode import step as decode_step
from localleap_jax.rules import Decision, RuleBase
from localleap_jax.tokenizer import left_pad

PROMPTS = [[276, 70, 271, 88, 226, 24, 298, 282], [100, 101, 102], [5, 17, 42, 9, 120, 3]]


@pytest.fixture(scope="module")
def sharp(sharp_checkpoint):
    """(the 2-layer sharp JAX model, the same weights as transformers' Llama: plain and masked logits fns)."""
    path, cfg, tensors = sharp_checkpoint
    return (ll.load(path, dtype="float32"), *ref.llada_fns(cfg, tensors))


def authors(name, sharp, prompt, settings, gen_length, block_length):
    model, logits_fn, masked_fn = sharp
    common = dict(mask_id=model.config.mask_token_id, gen_length=gen_length, predict_mask=False,
                  vocab_limit=model.special.vocab_limit)  # (the loop never predicts the mask or undecodable ids)
    if name == "wino":
        return ref.wino_generate(masked_fn, prompt, block_length=block_length, **common, **settings)
    if name == "saber":
        return ref.saber_generate(logits_fn, prompt, block_length=block_length, **common, **settings)
    return ref.remdm_generate(logits_fn, prompt, **common, **settings)


CASES = [("wino", {}, 16, 8), ("wino", {"threshold": 0.5, "threshold_back": 0.95}, 16, 4),
         ("saber", {}, 16, 8), ("saber", {"n": 1}, 16, 4),
         ("remdm", {}, 16, 16), ("remdm", {"init_unmask_ratio": 0.75, "unmask_k": 2, "loop_steps": 3}, 16, 16)]


@pytest.mark.parametrize("name, settings, gen_length, block_length", CASES,
                         ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_each_rule_equals_the_authors_function(sharp, name, settings, gen_length, block_length):
    model = sharp[0]
    cfg = ll.DecodeConfig(strategy=ll.rule(name, **settings), gen_length=gen_length, block_length=block_length)
    remasked = 0
    for prompt in PROMPTS[:2]:
        theirs = authors(name, sharp, prompt, settings, gen_length, block_length)
        ids, mask = left_pad([prompt], model.config.pad_token_id)
        out = ll.generate(model, ids, mask, cfg)
        assert out.tokens[0, out.prompt_length:].tolist() == theirs.tokens[len(prompt):], prompt
        assert int(out.nfe[0]) == theirs.nfe and int(out.remasks[0]) == theirs.remasks, prompt
        assert not out.hit_bound[0]
        remasked += theirs.remasks
    assert remasked > 0  # the case happened: tokens were taken back


def test_a_left_padded_batch_with_per_row_settings_equals_each_row_alone(sharp):
    model = sharp[0]
    thresholds = np.array([0.6, 0.5, 0.7], np.float32)
    ids, mask = left_pad(PROMPTS, model.config.pad_token_id)
    batch = ll.generate(model, ids, mask, ll.DecodeConfig(strategy=ll.rule("wino", threshold=thresholds),
                                                          gen_length=16, block_length=8))
    for b, prompt in enumerate(PROMPTS):
        one, m1 = left_pad([prompt], model.config.pad_token_id)
        alone = ll.generate(model, one, m1, ll.DecodeConfig(strategy=ll.rule("wino", threshold=float(thresholds[b])),
                                                            gen_length=16, block_length=8))
        assert batch.tokens[b, batch.prompt_length:].tolist() == alone.tokens[0, alone.prompt_length:].tolist()
        assert batch.nfe[b] == alone.nfe[0] and batch.remasks[b] == alone.remasks[0]
    assert len(set(batch.nfe.tolist())) > 1  # rows really ran apart


def test_the_bound_is_hit_and_reported_never_hung(sharp):
    model = sharp[0]
    ids, mask = left_pad(PROMPTS[:2], model.config.pad_token_id)
    out = ll.generate(model, ids, mask, ll.DecodeConfig(strategy=ll.rule("saber"), gen_length=16, block_length=8,
                                                        max_passes=3))
    assert out.hit_bound.all() and out.forward_passes == 3 and (out.tokens == model.config.mask_token_id).any(axis=1).all()

    @struct.dataclass
    class Stuck(RuleBase):  # commits and takes everything back: no pass makes progress
        name = "stuck"
        remask_names = ("undo",)

        def update(self, s, state):
            return Decision(s.candidates, s.decoded | s.candidates), state

    out = ll.generate(model, ids, mask, ll.DecodeConfig(strategy=Stuck(), gen_length=16, block_length=8,
                                                        max_passes=20))
    assert out.hit_bound.all() and out.forward_passes == 20 and (out.nfe == 20).all()
    with pytest.raises(ll.DecodeError, match=r"max_passes=1 < the 2 passes saber needs"):
        ll.DecodeConfig(strategy="saber", gen_length=16, block_length=8, max_passes=1).validate()
    with pytest.raises(ll.DecodeError, match=r"max_passes=20 < the 24 passes remdm needs"):
        ll.DecodeConfig(strategy="remdm", gen_length=16, block_length=16, max_passes=20).validate()


def test_the_loop_holds_each_rules_traits_as_declared():
    """The traits the loop's compile-time settings hold are those each rule's docstring declares (read once, by
    rules.traits_of), and the cache follows them: the probed pass for a rule that probes."""
    from localleap_jax.decode.cache import ProbedNoCache, SoftNoCache
    from localleap_jax.rules import RuleTraits

    declared = {"threshold": RuleTraits(), "saber": RuleTraits("generated", False, ("dropped",), False),
                "remdm": RuleTraits("generated", False, ("least_likely",), True),
                "wino": RuleTraits("block", True, ("narrow_out",), True),
                "credit": RuleTraits(rewrites=True), "hierarchy": RuleTraits(),
                "smooth": RuleTraits(resets_state=False, soft_input=True),
                "joint_threshold_indel": RuleTraits(edit_names=("changed",), ends_blocks=True, rewrites=True)}
    for name, traits in declared.items():
        loop = ll.DecodeConfig(strategy=name, gen_length=16, block_length=16).loop_settings()
        assert loop.traits == traits, name
        assert isinstance(loop.cache, ProbedNoCache) == traits.probes, name
        assert isinstance(loop.cache, SoftNoCache) == traits.soft_input, name


_real_apply = decode_step.apply_decision


def test_a_rule_that_only_commits_never_traces_the_remask_path(sharp, monkeypatch):
    import jax

    from localleap_jax.decode import decode_loop

    model = sharp[0]
    ids, mask = left_pad(PROMPTS[:1], model.config.pad_token_id)

    def jaxpr(rule):
        cfg = ll.DecodeConfig(strategy=rule, gen_length=16, block_length=8)
        loop = cfg.loop_settings(False, model.config)
        return str(jax.make_jaxpr(lambda d, i, m, r: decode_loop(d, i, m, None, r, loop=loop, special=model.special))(
            model.denoiser, ids, mask, cfg.rule.with_rows(1)))

    before = jaxpr(ll.rule("threshold"))

    def unreachable(*a, **k):
        raise AssertionError("the remask path was traced")

    def no_soft_input(*a, **k):
        raise AssertionError("the soft input was traced")

    from localleap_jax.denoiser import ModelDenoiser

    monkeypatch.setattr(decode_step, "apply_decision", unreachable)
    monkeypatch.setattr(ModelDenoiser, "soft_embedding", no_soft_input)
    monkeypatch.setattr(ModelDenoiser, "no_soft", no_soft_input)
    assert jaxpr(ll.rule("threshold")) == before  # the same program, with the remask path gone
    # every trait that makes a rule return a Decision traces that path: remasks, edits and block ends, a rewritten
    # block (credit, insert/delete), a soft input (smooth: which also traces the soft input, and only it)
    for name in ("wino", "joint_threshold", "credit", "hierarchy", "smooth"):
        if name == "hierarchy":  # a rule that only commits, with a new clause: the same path as threshold
            jaxpr(ll.rule(name))
            continue
        with pytest.raises(AssertionError, match="remask path was traced|soft input was traced"):
            jaxpr(ll.rule(name))
    monkeypatch.setattr(decode_step, "apply_decision", _real_apply)
    with pytest.raises(AssertionError, match="soft input was traced"):
        jaxpr(ll.rule("smooth"))


def test_traces_record_remasks_and_the_dynamics_count_them(sharp):
    model = sharp[0]
    ids, mask = left_pad(PROMPTS, model.config.pad_token_id)
    out = ll.generate(model, ids, mask, ll.DecodeConfig(strategy="saber", gen_length=16, block_length=8), trace=True)
    trace = out.trace
    assert trace.remask_names == ("dropped",)
    assert trace.remasked.sum(axis=(1, 2)).tolist() == out.remasks.tolist() and out.remasks.sum() > 0
    assert (trace.clause >= -1).all()  # only the one remask clause
    summary = dynamics.revocations(trace)
    assert summary["remasks"] == int(out.remasks.sum()) and summary["by_clause"] == {"dropped": summary["remasks"]}
    assert sum(summary["by_tenth_of_the_region"]) == summary["remasks"]
    untraced = ll.generate(model, ids, mask, ll.DecodeConfig(strategy="saber", gen_length=16, block_length=8))
    assert np.array_equal(untraced.tokens, out.tokens) and np.array_equal(untraced.nfe, out.nfe)


def test_a_sweep_of_winos_thresholds_compiles_once(sharp):
    model = sharp[0]
    ids, mask = left_pad(PROMPTS, model.config.pad_token_id)
    before = len(compiled_programs())
    outs = [ll.generate(model, ids, mask, ll.DecodeConfig(strategy=ll.rule("wino", threshold=t, threshold_back=tb),
                                                          gen_length=16, block_length=8))
            for t, tb in ((0.5, 0.9), (0.7, 0.95), (0.6, 0.8))]
    assert len(compiled_programs()) - before <= 1  # (none when an earlier test compiled this shape)
    assert len({o.tokens.tobytes() + o.nfe.tobytes() for o in outs}) > 1  # the settings changed the decoding


@pytest.mark.parametrize("cfg, message", [
    (dict(strategy="saber", cache="dual"), r"saber sees the whole generated region: use cache 'none', 'prefix'"),
    (dict(strategy="wino", cache="prefix"), r"wino scores the block with each position hidden .* use cache 'none'"),
    (dict(strategy="remdm", block_length=8), r"remdm works on the whole canvas: block_length must equal gen_length"),
    (dict(strategy="remdm:init_unmask_ratio=0.8", block_length=16), r"remdm: gen_length x init_unmask_ratio"),
    # (refused when the combination is made: made inside the test)
    (dict(strategy=lambda: ll.any_of(ll.rule("wino"), ll.rule("threshold"))), r"wino takes commits back .* any_of/all_of"),
    (dict(strategy="saber:n=3"), r"saber: n=3 must lie in \[1, 2\]"),
])
def test_what_a_revoking_rule_cannot_run_with_is_refused_in_one_line(cfg, message):
    with pytest.raises(ll.DecodeError, match=message):
        made = {k: v() if k == "strategy" and callable(v) else v for k, v in cfg.items()}
        ll.DecodeConfig(**{"gen_length": 16, "block_length": 8, **made}).validate()


AT = r" at \S*test_revoking.py:\d+ "  # where a rule's decisions are defined: every message about what it returned


def test_wino_on_a_shifted_family_and_an_undeclared_decision_are_refused(dream_converted, sharp):
    dream = ll.load(dream_converted, dtype="float32")
    with pytest.raises(ll.DecodeError, match="logits shift"):
        ll.DecodeConfig(strategy="wino", gen_length=16, block_length=8).validate(dream.config)
    model = sharp[0]
    ids, mask = left_pad(PROMPTS[:1], model.config.pad_token_id)
    silent = ll.stateless(lambda s: Decision(s.candidates, s.decoded), name="silent")
    with pytest.raises(ll.DecodeError, match=rf"'silent'{AT}returned Decision.* declares no remask_names"):
        ll.generate(model, ids, mask, ll.DecodeConfig(strategy=silent, gen_length=16, block_length=8))


class _Base(RuleBase):
    """Stubs of a user's rule with one mistake each (subclasses below are flax dataclasses)."""

    remask_names = ("undo",)

    def update(self, s, state):
        return Decision(s.candidates, s.decoded), state


@struct.dataclass
class _BadRegion(_Base):
    name = "bad_region"
    region = "Generated"


@struct.dataclass
class _ProbesOverRegion(_Base):
    name = "probes_over_region"
    region = "generated"
    probes = True


@struct.dataclass
class _NamesAsString(_Base):
    name = "names_as_string"
    remask_names = "undo"


@struct.dataclass
class _BareCommit(_Base):
    name = "bare_commit"

    def update(self, s, state):
        return s.candidates, state


@struct.dataclass
class _Tuple(_Base):
    name = "tuple"
    remask_names = ()

    def update(self, s, state):
        return (s.candidates, s.decoded), state


@struct.dataclass
class _FloatRemask(_Base):
    name = "float_remask"

    def update(self, s, state):
        return Decision(s.candidates, s.conf), state


@struct.dataclass
class _NarrowRemask(_Base):
    name = "narrow_remask"

    def update(self, s, state):
        return Decision(s.candidates, s.decoded[:, :3]), state


@struct.dataclass
class _ProbesAsText(_Base):
    name = "probes_as_text"
    probes = "yes"


class _Duck:
    """A user's class that is no RuleBase: what the loop once probed for defaults (region, probes, ...) it lacks."""

    name = "duck"
    clause_names = ("commit",)

    def init(self, batch, block, vocab):
        return ()

    def update(self, s, state):
        return s.candidates, state


@struct.dataclass
class _Keeps(RuleBase):
    """Commits what threshold would, with a state that spans blocks (so it cannot be combined)."""

    name = "keeps"
    resets_state = False

    def update(self, s, state):
        return s.candidates & (s.conf >= 0.9), state


@pytest.mark.parametrize("rule, message", [
    (_BadRegion(), r"bad_region: region='Generated'; a rule's region is 'block' or 'generated'"),
    (_ProbesOverRegion(), r"probes_over_region: probes score the current block"),
    (_NamesAsString(), r"names_as_string: remask_names='undo' must be a tuple of names"),
    (_ProbesAsText(), r"probes_as_text: probes='yes' must be True or False"),
    (_Duck(), r"^rule 'duck' lacks region, probes, remask_names, resets_state, edit_names, ends_blocks, canvas, rewrites, "
              r"soft_input, validate, "
              r"with_rows, pass_bound, min_passes, spec of the Rule protocol: subclass ll.rules.RuleBase"),
    # (refused when the combination is made: made inside the test)
    (lambda: ll.any_of(ll.rule("threshold"), _Keeps()), r"^keeps keeps its state across blocks: it cannot be combined "
                                                        r"with any_of/all_of"),
    (_BareCommit(), rf"rule 'bare_commit'{AT}declares remask_names but returned .*Decision\(commit, remask\)"),
    (_Tuple(), rf"rule 'tuple'{AT}returned tuple as its commit; .* returns ll.rules.Decision"),
    (_FloatRemask(), rf"rule 'float_remask'{AT}returned a remask of dtype float32; expected bool or int8"),
    (_NarrowRemask(), rf"rule 'narrow_remask'{AT}returned a remask of shape \(1, 3\); expected \(1, 8\)"),
])
def test_a_users_revoking_rule_with_a_mistake_ends_in_one_line(sharp, rule, message):
    model = sharp[0]
    ids, mask = left_pad(PROMPTS[:1], model.config.pad_token_id)
    with pytest.raises(ll.DecodeError, match=message) as e:
        rule = rule() if isinstance(rule, types.FunctionType) else rule
        ll.generate(model, ids, mask, ll.DecodeConfig(strategy=rule, gen_length=8, block_length=8))
    assert "\n" not in str(e.value)
