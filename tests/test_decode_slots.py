"""Continuous batching (localleap_jax.decode.slots): N prompts through S < N slots in one compiled loop.

Every prompt's tokens, NFE (and remasks, trace) equal the prompt decoded alone, for rules of every kind (the
schedule's, thresholds, LocalLeap, rules with state, rules that revoke, whole-canvas ones) and every cache policy;
the slots really refill mid-run (fewer passes than the prompts' passes one after another), under a cache too, as
soon as their row finishes (every cache refreshes per row); bad `slots=` ends in one line."""

from __future__ import annotations

import numpy as np
import pytest

import localleap_jax as ll
from localleap_jax.checkpoint import EMBEDDED
from localleap_jax.compile_cache import compiled_programs
from localleap_jax.synthetic_math import take

N, S = 7, 3


@pytest.fixture(scope="module")
def model():
    return ll.load(EMBEDDED, dtype="float32")


@pytest.fixture(scope="module")
def prompts(model):
    """7 test questions of different lengths, left-padded together (one prompt bucket)."""
    questions = [f"Question: {p['question']}\nAnswer:" for p in take("test", N, seed=5)]
    ids, mask = model.tokenizer.encode_batch(questions)
    assert len(set(mask.sum(axis=1).tolist())) > 2  # lengths differ: left padding is exercised
    return ids, mask


def alone(model, ids, mask, cfg, **kw):
    """Each prompt decoded by itself: (generated tokens [N, G], nfe [N], remasks [N] or None, passes [N])."""
    outs = [ll.generate(model, ids[i:i + 1, ~(~mask[i:i + 1]).all(0)], None, cfg, **kw) for i in range(len(ids))]
    gen = np.stack([o.tokens[0, o.prompt_length:] for o in outs])
    remasks = None if outs[0].remasks is None else np.array([int(o.remasks[0]) for o in outs])
    return gen, np.array([int(o.nfe[0]) for o in outs]), remasks, np.array([o.forward_passes for o in outs]), outs


CASES = [  # (rule, cache, gen_length, block_length)
    ("low_confidence", "none", 32, 8),  # one token a pass: rows that stop early use fewer passes
    ("threshold", "prefix", 48, 16),
    ("localleap", "dual", 48, 16),
    ("threshold", "vicinity:prefix_look=4,after_look=4,warmup=2,refresh_every=3", 48, 16),  # per-row phases
    ("wino", "none", 32, 16),  # takes commits back; a probe copy of the block in the same pass
    ("saber", "none", 32, 8),  # sees the whole generated region; its state spans blocks
    ("remdm", "none", 16, 16),  # the whole canvas as one block, runs to its pass bound
]


@pytest.mark.parametrize("rule, cache, gen_length, block_length", CASES,
                         ids=[f"{c[0]}-{c[1].split(':')[0]}" for c in CASES])
def test_every_prompt_equals_itself_decoded_alone(model, prompts, rule, cache, gen_length, block_length):
    ids, mask = prompts
    cfg = ll.DecodeConfig(strategy=rule, gen_length=gen_length, block_length=block_length, cache=cache,
                          early_stop=rule not in ("remdm",))
    out = ll.generate(model, ids, mask, cfg, slots=S)
    gen, nfe, remasks, passes, _ = alone(model, ids, mask, cfg)
    assert out.tokens.shape == (N, ids.shape[1] + gen_length) and out.slots == S
    np.testing.assert_array_equal(out.tokens[:, :ids.shape[1]], ids)  # prompts in prompt order
    np.testing.assert_array_equal(out.tokens[:, out.prompt_length:], gen)
    np.testing.assert_array_equal(out.nfe, nfe)
    if remasks is not None:
        np.testing.assert_array_equal(out.remasks, remasks)
    # The case happened: slots refilled while other rows still worked (fewer passes than one prompt after
    # another); with one token a pass and early stop, rows finished at different passes.
    assert out.forward_passes < passes.sum()
    if rule == "low_confidence":
        assert len(set(nfe.tolist())) > 1
    assert any(p.kind == "decode/one-device/slots" for p in compiled_programs())


def test_the_block_cache_of_a_block_diffusion_model_is_prefilled_for_each_new_prompt():
    """SDAR's exact cache: a slot taking a prompt prefills its whole blocks; rows advance on their own."""
    model = ll.load(ll.checkpoint.EMBEDDED.parent / "tiny-math-sdar", dtype="float32")
    questions = [f"Question: {p['question']}\nAnswer:" for p in take("test", 5, seed=6)]
    ids, mask = model.tokenizer.encode_batch(questions)
    T = model.config.block_size
    cfg = ll.DecodeConfig(strategy="localleap", gen_length=32, block_length=T, early_stop=True)
    assert cfg.cache_mode(model.config) == "block"
    out = ll.generate(model, ids, mask, cfg, slots=2)
    gen, nfe, _, passes, _ = alone(model, ids, mask, cfg)
    np.testing.assert_array_equal(out.tokens[:, out.prompt_length:], gen)
    np.testing.assert_array_equal(out.nfe, nfe)
    assert out.forward_passes < passes.sum()


def test_the_trace_of_each_prompt_is_its_trace_alone(model, prompts):
    ids, mask = prompts
    cfg = ll.DecodeConfig(strategy="localleap", gen_length=32, block_length=16, early_stop=True)
    out = ll.generate(model, ids, mask, cfg, slots=S, trace=True)
    *_, outs = alone(model, ids, mask, cfg, trace=True)
    for i, o in enumerate(outs):
        for field in ("pred", "clause", "commit_pass", "passes", "token"):
            np.testing.assert_array_equal(getattr(out.trace, field)[i], getattr(o.trace, field)[0], err_msg=field)
        # (fp32 sums over a batch of 3 rows vs 1: measured at most 9.2e-7 apart)
        np.testing.assert_allclose(out.trace.conf[i], o.trace.conf[0], rtol=0, atol=2e-6)


def block_steps(trace, block_length: int) -> list[int]:
    """A row's passes in each block it decoded, from its trace alone: block k ends at the last commit inside it."""
    last = [int(c.max()) for c in trace.commit_pass[0].reshape(-1, block_length)]
    ends = [e for e in last if e >= 0]  # blocks after an early stop commit nothing
    return [e - b for e, b in zip(ends, [-1] + ends[:-1])]


def schedule(steps: list[list[int]], slots: int) -> tuple[int, int]:
    """(passes, passes where some row starts a block) of S slots taking the prompts in order, from each prompt's
    passes per block: a slot takes its next prompt on the pass after its row's last."""
    free_at, starts = [0] * slots, set()
    for p in range(len(steps)):
        k = min(range(slots), key=lambda s: (free_at[s], s))
        for n in steps[p]:
            starts.add(free_at[k])
            free_at[k] += n
    return max(free_at), len(starts)


@pytest.mark.parametrize("cache", ["none", "prefix", "dual"])
def test_slots_refill_as_soon_as_their_row_finishes(model, prompts, cache):
    """The run's passes equal a schedule built from each prompt's passes per block alone: a slot takes its next
    prompt on the pass after its row's last, with a cache too; with Fast-dLLM's caches the passes that ran the whole
    canvas are those where some row started a block (each row refreshes at its own block start, in a lane)."""
    ids, mask = prompts
    T = 16
    # (a high threshold: rows need different numbers of passes in the same block, so some finish mid-block)
    cfg = ll.DecodeConfig(strategy="threshold:kappa=0.999", gen_length=48, block_length=T, cache=cache,
                          early_stop=True)
    out = ll.generate(model, ids, mask, cfg, slots=S)
    *_, outs = alone(model, ids, mask, cfg, trace=True)
    steps = [block_steps(o.trace, T) for o in outs]
    assert [sum(s) for s in steps] == out.nfe.tolist()
    assert len({len(s) for s in steps}) > 1  # early stop: prompts decode different numbers of blocks
    assert len({s[-1] for s in steps}) > 1  # rows' last blocks take different numbers of passes
    passes, starts = schedule(steps, S)
    assert out.forward_passes == passes
    assert out.full_passes == (passes if cache == "none" else starts)


def test_per_prompt_settings_follow_their_prompt_into_its_slot(model, prompts):
    """A setting given per prompt ([N]) is the prompt's wherever it runs: each equals its prompt alone with it."""
    ids, mask = prompts
    kappa = np.array([0.5, 0.999, 0.7, 0.999, 0.9, 0.6, 0.99])
    make = lambda k: ll.DecodeConfig(strategy=ll.rule("threshold", kappa=k), gen_length=48, block_length=16,  # noqa: E731
                                     early_stop=True)
    out = ll.generate(model, ids, mask, make(kappa), slots=S)
    for i, k in enumerate(kappa):
        one = ll.generate(model, ids[i:i + 1], mask[i:i + 1], make(float(k)))
        np.testing.assert_array_equal(out.tokens[i, out.prompt_length:], one.tokens[0, one.prompt_length:])
        assert out.nfe[i] == one.nfe[0]
    assert out.nfe.max() > out.nfe.min()  # the settings made a difference


def test_rows_that_stop_at_the_bound_free_their_slots_under_a_cache(model):
    """Saber with the prefix cache and max_passes, one slot: the row stops at the bound with masks left, and the
    queued prompts must still be taken (when rows advanced together, they were not: NFE [10, 0, 0], never
    decoded)."""
    questions = [f"Question: {p['question']}\nAnswer:" for p in take("test", 3, seed=7)]
    ids, mask = model.tokenizer.encode_batch(questions)
    cfg = ll.DecodeConfig(strategy="saber", gen_length=32, block_length=8, cache="prefix", max_passes=10)
    out = ll.generate(model, ids, mask, cfg, slots=1)
    gen, nfe, remasks, _, outs = alone(model, ids, mask, cfg)
    np.testing.assert_array_equal(out.tokens[:, out.prompt_length:], gen)
    np.testing.assert_array_equal(out.nfe, nfe)
    np.testing.assert_array_equal(out.remasks, remasks)
    np.testing.assert_array_equal(out.hit_bound, [bool(o.hit_bound[0]) for o in outs])
    assert out.hit_bound[0] and not out.hit_bound.all()  # the case: the first row stopped at the bound


def test_slots_at_least_the_batch_run_the_fixed_program(model, prompts):
    ids, mask = prompts
    cfg = ll.DecodeConfig(strategy="threshold", gen_length=32, block_length=16)
    a, b = ll.generate(model, ids, mask, cfg, slots=N), ll.generate(model, ids, mask, cfg)
    np.testing.assert_array_equal(a.tokens, b.tokens)
    assert a.forward_passes == b.forward_passes and a.slots == N and b.slots == N
    assert 0 < b.occupancy <= 1


@pytest.mark.parametrize("slots", [0, -2, 2.5, "4", True])
def test_bad_slots_end_in_one_line(model, prompts, slots):
    ids, mask = prompts
    with pytest.raises(ll.DecodeError, match=r"^slots=.* must be a positive whole number") as info:
        ll.generate(model, ids, mask, ll.DecodeConfig(gen_length=32, block_length=16), slots=slots)
    assert "\n" not in str(info.value)
