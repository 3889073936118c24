"""LLaDA2.1's JointThreshold (localleap_jax/rules/editing.py) in the one compiled loop, against SGLang's loop
transcribed eagerly (oracles/joint_threshold.py): the same tokens, NFE and edits on tiny SDAR checkpoints (blocks of
4 and 8, the exact block cache) and a tiny LLaDA checkpoint (blocks of 8 over 32 generated positions, no cache),
whose heads are scaled so that predictions at decoded positions keep changing (edits happen: each case prints how
often, and asserts they did). Then per-row settings in a left-padded batch, the bound at a large
max_post_edit_steps, traces, continuous batching, the refusals, and a user's rule that edits.

The loop never predicts the mask token nor the embedding rows past the tokenizer (they keep their softmax share);
SGLang's argmax may, so the oracle is given the same exclusion (`never_predict`)."""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import pytest
from flax import struct

import localleap_jax as ll
from localleap_jax import dynamics
from localleap_jax.denoiser import FunctionDenoiser
from localleap_jax.rules import Decision, RuleBase
from localleap_jax.tokenizer import left_pad
from oracles import joint_threshold as JT

from helpers import TOKENIZER_CORPUS, random_sdar_tensors, tiny_sdar_config, write_hf_checkpoint
from stubs import MASK, V, StubModel, config, seeded

ROWS = 320  # SDAR embedding rows; the tokenizer knows 300 ids
MODES = {"S": JT.S_MODE, "Q": JT.Q_MODE}


# ---------------------------------------------------------------- the models and their eager references


class Checkpoint:
    """A JAX model, the same weights as a numpy `logits_fn` for the oracle, and the oracle's layout."""

    def __init__(self, model, logits_fn, layout):
        self.model, self.logits_fn, self.layout = model, logits_fn, layout
        special, rows = model.special, model.config.embedding_size
        self.never = [special.mask, *range(special.vocab_limit or rows, rows)]

    def reference(self, prompt, *, gen_length, block_length, **settings) -> JT.EditResult:
        return JT.joint_threshold_generate(self.logits_fn, np.asarray(prompt), mask_id=self.model.special.mask,
                                           gen_length=gen_length, block_length=block_length, layout=self.layout,
                                           never_predict=self.never, **settings)

    def ours(self, prompts, rule, *, gen_length, block_length, cache="auto", **kw):
        ids, mask = left_pad([list(map(int, p)) for p in prompts], self.model.config.pad_token_id)
        cfg = ll.DecodeConfig(strategy=rule, gen_length=gen_length, block_length=block_length, cache=cache)
        return ll.generate(self.model, ids, mask, cfg, **kw)


def _sdar(tmp_path_factory, block_size: int) -> Checkpoint:
    from localleap_jax.convert_hf import convert
    from localleap_jax.families import make_tokenizer
    from oracles import sdar as reference_sdar

    tok = make_tokenizer("sdar", TOKENIZER_CORPUS, vocab_size=300)
    cfg = tiny_sdar_config(ROWS, tok.eos_token_id, block_size=block_size)
    tensors = random_sdar_tensors(cfg, seed=4 + block_size, head_scale=12.0)
    src = write_hf_checkpoint(tmp_path_factory.mktemp("hf") / f"jt-sdar{block_size}", cfg, tensors, tok)
    out = tmp_path_factory.mktemp("conv") / f"jt-sdar{block_size}"
    convert(str(src), str(out), progress=False)
    torch_model = reference_sdar.sdar_torch_model(json.loads((out / "config.json").read_text()),
                                                  {k: v.numpy() for k, v in tensors.items()})
    return Checkpoint(ll.load(out, dtype="float32"), reference_sdar.sdar_logits_fn(torch_model, block_size),
                      "block_diffusion")


@pytest.fixture(scope="module")
def sdar4(tmp_path_factory):
    return _sdar(tmp_path_factory, 4)


@pytest.fixture(scope="module")
def sdar8(tmp_path_factory):
    return _sdar(tmp_path_factory, 8)


@pytest.fixture(scope="module")
def llada(sharp_checkpoint):
    """The 2-layer LLaDA checkpoint with its head scaled x20, and transformers' Llama holding the same weights."""
    import torch

    from oracles.bidirectional import bidirectional_logits, llama_from_llada

    path, cfg, tensors = sharp_checkpoint
    torch_model = llama_from_llada(cfg, tensors)

    def logits_fn(ids):
        with torch.no_grad():
            return bidirectional_logits(torch_model, torch.from_numpy(np.asarray(ids))).numpy()

    return Checkpoint(ll.load(path, dtype="float32"), logits_fn, "bidirectional")


@pytest.fixture(scope="module")
def seeded_stub():
    """The stub whose predictions follow the row's own canvas (tests/stubs.py): held tokens are often predicted
    as themselves."""
    model = seeded(16)
    return Checkpoint(model, lambda ids: np.asarray(model.denoiser.logits_fn(jnp.asarray(ids))), "bidirectional")


def _prompts(lengths, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 290, n) for n in lengths]


# ---------------------------------------------------------------- equal to SGLang's loop, row by row

# (checkpoint, gen_length, block_length, prompt lengths): SDAR's block is its config's block_size; a prompt length
# off the block grid puts the prompt's tail in the first decoded block (never edited), one on it does not.
CASES = {"sdar4": (12, 4, [13, 12]), "sdar8": (16, 8, [13, 16]), "llada": (32, 8, [8, 3])}
SEEDS = {"sdar4": 0, "sdar8": 0, "llada": 0}


@pytest.mark.parametrize("mode", ["S", "Q"])
@pytest.mark.parametrize("which", list(CASES))
def test_tokens_nfe_and_edits_equal_sglangs_loop(which, mode, request):
    ckpt = request.getfixturevalue(which)
    G, T, lengths = CASES[which]
    settings = MODES[mode]
    rule = ll.rule("joint_threshold", **settings)
    edits = passes = 0
    endings = set()
    for prompt in _prompts(lengths, seed=SEEDS[which]):
        P = len(prompt)
        theirs = ckpt.reference(prompt, gen_length=G, block_length=T, **settings)
        out = ckpt.ours([prompt], rule, gen_length=G, block_length=T)
        assert out.tokens[0, out.prompt_length:].tolist() == theirs.tokens[P:P + G].tolist(), P
        assert (int(out.nfe[0]), int(out.edits[0])) == (theirs.nfe, theirs.edits), P
        assert not out.hit_bound[0] and theirs.capped == 0
        edits, passes = edits + theirs.edits, passes + theirs.nfe
        endings |= {e["ended"] for e in theirs.log if e["ended"]}
    print(f"{which} {mode}: {edits} edits in {passes} passes ({edits / passes:.2f} per pass); blocks ended by "
          f"{sorted(endings)}")
    assert edits > 0  # the case happened: tokens were replaced
    if which == "sdar4" and mode == "S":  # both ways a block ends happened here
        assert endings == {"budget", "no_change"}, endings


def test_the_prompts_tail_in_a_block_diffusion_rows_first_block_is_never_edited(sdar4):
    """Where the model disagrees with a prompt token that shares the first decoded block, SGLang does not edit it
    (nor does the loop). The case happens: the prediction at a tail position differs from its token."""
    G, T = 12, 4
    prompt = _prompts([13], seed=SEEDS["sdar4"])[0]
    out = sdar4.ours([prompt], ll.rule("joint_threshold"), gen_length=G, block_length=T, trace=True)
    P, Lp = len(prompt), out.prompt_length
    assert out.tokens[0, :Lp][-1] == prompt[-1]  # the tail (position 12, alone in block 3) held its token
    logits = sdar4.logits_fn(out.tokens[:, Lp - P:])[0]
    assert int(np.argmax(logits[P - 1])) != prompt[-1]  # and the model disagrees with it at the end


@struct.dataclass
class _EditsEverything(RuleBase):
    """A user's rule that asks to edit every position holding a token, the prompt's tail included."""

    name = "edits_everything"
    edit_names = ("any",)

    def update(self, s, state):
        return Decision(s.candidates & (s.conf >= 0.8), edit=s.valid & (s.tokens != s.mask_id)), state


def test_the_loop_never_edits_the_prompt_whatever_a_rule_asks(sdar4):
    prompt = _prompts([13], seed=SEEDS["sdar4"])[0]
    out = sdar4.ours([prompt], _EditsEverything(), gen_length=12, block_length=4)
    assert out.tokens[0, out.prompt_length - len(prompt):out.prompt_length].tolist() == prompt.tolist()
    assert out.edits[0] > 0  # it did edit, elsewhere


# ---------------------------------------------------------------- a batch, per-row settings


@pytest.mark.parametrize("which", ["sdar4", "llada"])
def test_a_left_padded_batch_with_per_row_settings_equals_each_row_alone(which, request):
    ckpt = request.getfixturevalue(which)
    G, T, _ = CASES[which]
    prompts = _prompts([13, 5, 10], seed=3)
    rows = {"threshold": np.array([0.5, 0.7, 0.3]), "edit_threshold": np.array([0.0, 0.5, 0.2]),
            "max_post_edit_steps": np.array([16, 3, 0])}
    out = ckpt.ours(prompts, ll.rule("joint_threshold", **rows), gen_length=G, block_length=T)
    for b, prompt in enumerate(prompts):
        settings = {k: v[b].item() for k, v in rows.items()}
        theirs = ckpt.reference(prompt, gen_length=G, block_length=T, **settings)
        P = len(prompt)
        assert out.tokens[b, out.prompt_length:].tolist() == theirs.tokens[P:P + G].tolist(), b
        assert (int(out.nfe[b]), int(out.edits[b])) == (theirs.nfe, theirs.edits), b
    assert len(set(out.nfe.tolist())) == 3 and out.edits.sum() > 0  # rows really ran apart, and edited


# ---------------------------------------------------------------- the bound


def _flipping(gen_length: int, block_length: int, conf: float = 0.9) -> StubModel:
    """A stub over V = 8 ids whose generated positions predict word 1 + j % 6 at `conf`, except each block's first
    position, which predicts the word after the one it holds (never agreeing with itself): every block's mask
    passes commit it, then every post-edit pass edits its first position, until the budget ends the block.
    conf 1.0: every other logit is -inf, so the probability is exactly 1.0."""
    G, T = gen_length, block_length
    rest = -jnp.inf if conf >= 1.0 else jnp.log((1.0 - conf) / (V - 1))

    def logits_fn(x):
        B, L = x.shape
        gen = x[:, L - G:]
        j = jnp.arange(G)
        word = 1 + j % 6
        flip = jnp.where(gen == MASK, 1, 1 + gen % 6)  # (the next word, cyclically; word 1 while a mask)
        target = jnp.where(j % T == 0, flip, word)
        lp = jnp.where(jnp.arange(V) == target[..., None], jnp.log(conf), rest)
        return jnp.concatenate([jnp.zeros((B, L - G, V)), lp], axis=1)

    return StubModel(config(), FunctionDenoiser(logits_fn, V, 0))


def _stub_reference(model: StubModel, prompt, **kw) -> JT.EditResult:
    def logits_fn(canvas):
        return np.asarray(model.denoiser.logits_fn(jnp.asarray(canvas)))

    return JT.joint_threshold_generate(logits_fn, prompt, mask_id=MASK, layout="bidirectional", never_predict=[MASK],
                                       **kw)


@pytest.mark.parametrize("edit_threshold, nfe, edits", [(1.0, 2 * 9, 0), (0.999, 2 * 11, 2 * 9)])
def test_both_thresholds_are_strict(edit_threshold, nfe, edits):
    """Every prediction at probability exactly 1.0. Threshold 1.0: no mask passes ("> 1.0"), so each mask pass
    commits the single most confident mask, the lowest position first: 8 mask passes per block of 8. The block's
    first position (committed first) then disagrees with its token at exactly 1.0. edit_threshold 1.0: never
    edited; the pass after the last commit changes nothing and ends the block: 9 passes. 0.999: edited in each of
    the 7 later mask passes and in the 2 post-edit passes (max_post_edit_steps 2), the third ends the block: 11
    passes, 9 edits. Two blocks."""
    G, T = 16, 8
    model = _flipping(G, T, conf=1.0)
    prompt = [2, 3, 4]
    ids, mask = left_pad([prompt], 0)
    settings = dict(threshold=1.0, edit_threshold=edit_threshold, max_post_edit_steps=2)
    out = ll.generate(model, ids, mask, ll.DecodeConfig(strategy=ll.rule("joint_threshold", **settings),
                                                        gen_length=G, block_length=T))
    theirs = _stub_reference(model, prompt, gen_length=G, block_length=T, **settings)
    assert out.tokens[0, out.prompt_length:].tolist() == theirs.tokens[len(prompt):].tolist()
    assert (int(out.nfe[0]), int(out.edits[0])) == (theirs.nfe, theirs.edits) == (nfe, edits)


def test_a_large_post_edit_budget_ends_every_block_within_the_bound():
    G, T, budget = 16, 8, 400
    model = _flipping(G, T)
    prompt = [2, 3, 4]
    ids, mask = left_pad([prompt], 0)
    cfg = ll.DecodeConfig(strategy=ll.rule("joint_threshold", max_post_edit_steps=budget), gen_length=G,
                          block_length=T)
    assert cfg.pass_bound() == (G // T) * (T + budget + 1)
    out = ll.generate(model, ids, mask, cfg)
    theirs = _stub_reference(model, prompt, gen_length=G, block_length=T, max_post_edit_steps=budget)
    assert theirs.passes_per_block == [1 + budget + 1] * (G // T)  # the budget ended each block
    assert out.tokens[0, out.prompt_length:].tolist() == theirs.tokens[len(prompt):].tolist()
    assert (int(out.nfe[0]), int(out.edits[0])) == (theirs.nfe, theirs.edits) == (2 * (budget + 2), 2 * budget)
    assert out.nfe[0] <= cfg.pass_bound() and not out.hit_bound[0]


def test_the_bound_on_a_block_grid_covers_the_rows_extra_block(sdar4):
    """On SDAR's grid a row whose prompt leaves a tail decodes one block more than gen_length / block_length."""
    cfg = ll.DecodeConfig(strategy=ll.rule("joint_threshold", max_post_edit_steps=[2, 5]), gen_length=12,
                          block_length=4)
    assert cfg.pass_bound(sdar4.model.config) == 4 * (4 + 5 + 1)
    assert cfg.pass_bound() == 3 * (4 + 5 + 1)


# ---------------------------------------------------------------- traces, slots


def test_traces_record_edits_as_a_clause_of_their_own(llada):
    prompts = _prompts([8, 3], seed=1)
    out = llada.ours(prompts, ll.rule("joint_threshold"), gen_length=16, block_length=8, trace=True)
    trace = out.trace
    assert trace.edit_names == ("changed",) and trace.remask_names == ()
    assert trace.edited.sum(axis=(1, 2)).tolist() == out.edits.tolist() and out.edits.sum() > 0
    assert not (trace.edited & trace.committed).any() and (trace.clause >= 0).all()
    assert trace.edit.shape[1] == ll.DecodeConfig(strategy="joint_threshold", gen_length=16,
                                                  block_length=8).pass_bound()
    summary = dynamics.edits(trace)
    assert summary["edits"] == int(out.edits.sum()) and summary["by_clause"] == {"changed": summary["edits"]}
    assert sum(summary["by_tenth_of_the_region"]) == summary["edits"]
    assert dynamics.summary(trace)["edits"] == summary and dynamics.revocations(trace)["remasks"] == 0
    untraced = llada.ours(prompts, ll.rule("joint_threshold"), gen_length=16, block_length=8)
    assert np.array_equal(untraced.tokens, out.tokens) and np.array_equal(untraced.edits, out.edits)
    threshold = llada.ours(prompts, ll.rule("threshold"), gen_length=16, block_length=8, trace=True)
    # a rule that never edits: out.edits is zeros [B] (an int array for every rule), the trace holds no edit buffer
    assert threshold.edits.tolist() == [0] * len(prompts) and threshold.edits.dtype == np.int32
    assert threshold.trace.edit is None and not threshold.trace.edited.any()


def test_a_saved_trace_keeps_its_edits(llada, tmp_path):
    from localleap_jax.trace import load_trace, save_trace

    out = llada.ours(_prompts([8], seed=1), ll.rule("joint_threshold"), gen_length=16, block_length=8, trace=True)
    back, _, _ = load_trace(save_trace(tmp_path / "t.npz", out.trace))
    assert back.edit_names == ("changed",) and back.edited.sum() == int(out.edits[0]) > 0


@pytest.mark.parametrize("which", ["sdar4", "llada"])
def test_slots_give_each_prompt_its_fixed_batch_result(which, request):
    ckpt = request.getfixturevalue(which)
    G, T, _ = CASES[which]
    prompts = _prompts([13, 5, 10], seed=3)
    rule = ll.rule("joint_threshold", max_post_edit_steps=[16, 3, 0])
    fixed = ckpt.ours(prompts, rule, gen_length=G, block_length=T)
    slotted = ckpt.ours(prompts, rule, gen_length=G, block_length=T, slots=2)
    assert np.array_equal(slotted.tokens, fixed.tokens)
    assert np.array_equal(slotted.nfe, fixed.nfe) and np.array_equal(slotted.edits, fixed.edits)


# ---------------------------------------------------------------- what is refused, in one line


@pytest.mark.parametrize("cache", ["dual"])  # (prefix refreshes on the same schedule: the dual case covers it)
def test_under_fast_dllms_caches_each_row_ends_its_blocks_as_alone(llada, cache):
    """The caches decide per row (each row refreshes at its own block start), so a rule that ends its own blocks
    (passes after the last mask, editing) runs under them: a left-padded batch with per-row settings decodes each
    row as that row alone under the same cache."""
    G, T, _ = CASES["llada"]
    prompts = _prompts([13, 5, 10], seed=3)
    rows = {"threshold": np.array([0.5, 0.7, 0.3]), "edit_threshold": np.array([0.0, 0.5, 0.2]),
            "max_post_edit_steps": np.array([16, 3, 0])}
    out = llada.ours(prompts, ll.rule("joint_threshold", **rows), gen_length=G, block_length=T, cache=cache)
    for b, prompt in enumerate(prompts):
        alone = llada.ours([prompt], ll.rule("joint_threshold", **{k: v[b].item() for k, v in rows.items()}),
                           gen_length=G, block_length=T, cache=cache)
        assert out.tokens[b, -G:].tolist() == alone.tokens[0, -G:].tolist(), b
        assert (int(out.nfe[b]), int(out.edits[b])) == (int(alone.nfe[0]), int(alone.edits[0])), b
    assert len(set(out.nfe.tolist())) == 3 and out.edits.sum() > 0  # rows really ran apart, and edited


def test_joint_threshold_cannot_be_combined():
    with pytest.raises(ll.DecodeError, match="^joint_threshold edits and ends its own blocks: it cannot be combined"):
        ll.DecodeConfig(strategy=ll.any_of(ll.rule("threshold"), ll.rule("joint_threshold"))).validate()


@pytest.mark.parametrize("setting, value", [("threshold", 1.5), ("edit_threshold", -0.1),
                                            ("max_post_edit_steps", 2.5), ("max_post_edit_steps", -1)])
def test_a_bad_setting_is_one_line(setting, value):
    with pytest.raises(ll.DecodeError, match=rf"^joint_threshold: {setting}="):
        ll.DecodeConfig(strategy=ll.rule("joint_threshold", **{setting: value})).validate()


class _Editor(RuleBase):
    """Commits as threshold 0.8 does; asks to edit every held token predicted at >= 0.5 (the loop replaces those
    whose prediction differs)."""

    def update(self, s, state):
        return Decision(s.candidates & (s.conf >= 0.8), edit=s.decoded & (s.conf >= 0.5)), state


@struct.dataclass
class _Undeclared(_Editor):
    name = "undeclared"


@struct.dataclass
class _Declared(_Editor):
    name = "declared_editor"
    edit_names = ("confident",)


@struct.dataclass
class _BareCommit(RuleBase):
    name = "bare_editor"
    edit_names = ("confident",)

    def update(self, s, state):
        return s.candidates, state


@struct.dataclass
class _FinishesUndeclared(_Declared):
    name = "finishes_undeclared"

    def update(self, s, state):
        return Decision(s.candidates, edit=s.decoded, finished=jnp.ones(s.step.shape, bool)), state


@struct.dataclass
class _FinishesAsCodes(_Declared):
    name = "finishes_as_codes"
    ends_blocks = True

    def update(self, s, state):
        return Decision(s.candidates, edit=s.decoded, finished=s.candidates), state


AT = r" at \S*test_joint_threshold.py:\d+ "


@pytest.mark.parametrize("rule, message", [
    (_Undeclared(), rf"rule 'undeclared'{AT}returned Decision\(commit, edit\) but declares no edit_names"),
    (_BareCommit(), rf"rule 'bare_editor'{AT}declares edit_names but returned .*Decision\(commit, edit=\.\.\.\)"),
    (_FinishesUndeclared(), rf"'finishes_undeclared'{AT}returned Decision\(commit, finished\) but declares no "
                            r"ends_blocks"),
    (_FinishesAsCodes(), rf"'finishes_as_codes'{AT}returned a finished of shape \(1, 8\); expected \(1,\) "
                         r"\(one per row\)"),
])
def test_a_users_editing_rule_with_a_mistake_ends_in_one_line(llada, rule, message):
    with pytest.raises(ll.DecodeError, match=message):
        llada.ours(_prompts([8]), rule, gen_length=16, block_length=8)


def _editor_reference(ckpt: Checkpoint, prompt, gen_length: int, block_length: int) -> tuple[list[int], int, int, int]:
    """_Editor's decoding written out eagerly on the numpy logits: per block, each pass commits the masks at
    confidence >= 0.8 (none: the most confident), and replaces every generated token of the block whose prediction
    differs at >= 0.5; the block ends on the pass that fills its last mask. (tokens, NFE, edits, held tokens
    predicted as themselves at >= 0.5: asked for by the rule, no edit)"""
    P, mask_id = len(prompt), ckpt.model.special.mask
    x = np.concatenate([np.asarray(prompt), np.full(gen_length, mask_id)])
    nfe = edits = same = 0
    for lo in range(P, P + gen_length, block_length):
        while (x[lo:lo + block_length] == mask_id).any():
            z = np.asarray(ckpt.logits_fn(x[None]), np.float64)[0, lo:lo + block_length]
            pred, conf, _ = JT._softmax_argmax(z, ckpt.never)
            block = x[lo:lo + block_length]
            masked = block == mask_id
            commit = masked & (conf >= 0.8)
            if not commit.any():
                commit[np.argmax(np.where(masked, conf, -np.inf))] = True
            edit = ~masked & (pred != block) & (conf >= 0.5)
            same += int((~masked & (pred == block) & (conf >= 0.5)).sum())
            x[lo:lo + block_length] = np.where(commit | edit, pred, block)
            nfe, edits = nfe + 1, edits + int(edit.sum())
    return x[P:].tolist(), nfe, edits, same


@pytest.mark.parametrize("which", ["llada", "seeded_stub"])
def test_a_users_rule_edits_with_the_loops_care(which, request):
    """A user's rule that edits (README shows one): the loop replaces only generated tokens whose prediction
    differs (the rule asks for every held token at >= 0.5), and, since the rule does not end its blocks, a block
    ends on the pass that fills its last mask. Equal to the same decoding written out eagerly."""
    ckpt = request.getfixturevalue(which)
    prompts = _prompts([8, 3], seed=2) if which == "llada" else [[2, 5, 3], [4, 4, 1, 6]]
    out = ckpt.ours(prompts, _Declared(), gen_length=16, block_length=8, trace=True)
    same = 0
    for b, prompt in enumerate(prompts):
        if which == "seeded_stub":  # the stub reads its prompt at canvas positions: give it the padded one
            prompt = out.tokens[b, :out.prompt_length]
        tokens, nfe, edits, agreed = _editor_reference(ckpt, prompt, 16, 8)
        assert out.tokens[b, out.prompt_length:].tolist() == tokens
        assert (int(out.nfe[b]), int(out.edits[b])) == (nfe, edits)
        same += agreed
    assert out.trace.edit_names == ("confident",) and out.edits.sum() > 0
    if which == "seeded_stub":  # the rule asked to edit tokens predicted as themselves: the loop left them
        assert same > 0
    assert out.edits.tolist() == out.trace.edited.sum(axis=(1, 2)).tolist()
