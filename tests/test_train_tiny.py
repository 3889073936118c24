"""train_tiny: LLaDA's SFT objective, SDAR's block-diffusion one, DiffusionGemma's uniform-noise one (its draws,
its loss against the family's decoder run on its own, self-conditioning's stop-gradient), resumable Orbax state, and
exports `ll.load` reads (the embedded DiffusionGemma twin among them)."""

import dataclasses
import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from tokenizers import Tokenizer

import localleap_jax as ll
from localleap_jax import families, synthetic_math
from localleap_jax.checkpoint import EMBEDDED, copy_tokenizer_files
from localleap_jax.commands import train_tiny
from localleap_jax.families import diffusion_gemma as dg
from localleap_jax.model import forward

TINY = ["--steps", "6", "--batch-size", "8", "--d-model", "32", "--n-layers", "1", "--n-heads", "2",
        "--mlp-hidden-size", "64", "--warmup", "2", "--save-every", "3"]


def test_splits_are_deterministic_and_disjoint():
    a, b = synthetic_math.take("test", 300, seed=0), synthetic_math.take("test", 300, seed=0)
    assert a == b
    train = {p["question"] for p in synthetic_math.take("train", 3000, seed=0)}
    assert not train & {p["question"] for p in a}
    assert {p["kind"] for p in a} == {"copy", "add", "sub"}
    for p in a:
        n = int(p["answer"].split("#### ")[1])
        if p["kind"] == "add":
            x, y = map(int, p["answer"].split("<<")[1].split("=")[0].split("+"))
            assert n == x + y
        if p["kind"] == "sub":
            x, y = map(int, p["answer"].split("<<")[1].split("=")[0].split("-"))
            assert n == x - y >= 0


def test_chain_problems_work_every_step_out_and_keep_the_splits_apart():
    """The chain task: 2-4 assignments on values in 1..9 (`a = 3. b = a + 2. c = b *2. ...`), each worked as
    `name = x op y = z.` with z right, x the value of the name the step builds on, and op, y the question's."""
    import re

    a = synthetic_math.take("test", 300, seed=0, task="chain")
    assert a == synthetic_math.take("test", 300, seed=0, task="chain")
    train = {p["question"] for p in synthetic_math.take("train", 3000, seed=0, task="chain")}
    assert not train & {p["question"] for p in a}
    assert {p["kind"] for p in a} == {"chain2", "chain3", "chain4"}
    ops = {"+": lambda x, y: x + y, "-": lambda x, y: x - y, "*": lambda x, y: x * y}
    seen_ops = set()
    for p in a:
        work, final = p["answer"].split("\n#### ")
        steps = re.findall(r"(\w) = (\d+) ?([-+*]) ?(\d+) = (\d+)\.", work)
        assert len(steps) == int(p["kind"][-1])
        written = {"+": " + {}", "-": " - {}", "*": " *{}"}  # doubling: ` *2`, as many tokens as ` + 2`
        assert " ".join(f"{n} = {x}{written[o].format(y)} = {z}." for n, x, o, y, z in steps) == work
        told = re.fullmatch(r"(\w) = (\d+)\. (.*) What is (\w)\?", p["question"])
        value = {told.group(1): int(told.group(2))}
        said = re.findall(r"(\w) = (\w) ?([-+*]) ?(\d+)\.", told.group(3))
        assert [(n, o, y) for n, _, o, y in said] == [(n, o, y) for n, _, o, y, _ in steps]
        for (n, x, o, y, z), (_, built_on, _, _) in zip(steps, said):
            assert int(x) == value[built_on] and ops[o](int(x), int(y)) == int(z) and 1 <= int(z) <= 9
            assert o != "*" or y == "2"
            value[n], _ = int(z), seen_ops.add(o)
        assert told.group(4) == steps[-1][0] and int(final) == value[steps[-1][0]]
    assert seen_ops == set(ops)
    # chain3 and chain6 (tiny-chain's stages): the same chains with exactly three / six steps, so every answer
    # is one shape with its values and operators (which the question gives) filled in, and one length in
    # tokens: where the answer line falls does not depend on which operators the chain holds (with ` * 2`,
    # a token longer than ` + 2`, it did, and that is where the parallel rules lost).
    tokenizer = Tokenizer.from_file(str(EMBEDDED / "tokenizer.json"))
    for task, n in (("chain3", 3), ("chain6", 6)):
        fixed = synthetic_math.take("test", 300, seed=0, task=task)
        assert {p["kind"] for p in fixed} == {f"chain{n}"}
        assert len({re.sub(r"\d", "9", re.sub(r" \*2| [-+] \d", " + 9", p["answer"])) for p in fixed}) == 1
        assert {"*" in p["answer"] for p in fixed} == {True, False}
        assert len({len(tokenizer.encode(p["answer"]).ids) for p in fixed}) == 1
        assert {p["question"][-10:] for p in fixed} == {f"What is {'abcdefg'[n]}?"}
        train_fixed = {p["question"] for p in synthetic_math.take("train", 3000, task=task)}
        assert not {p["question"] for p in fixed} & train_fixed
    # The math task's stream is unchanged by the chain task's arrival (tiny-math and its tests rely on it).
    assert synthetic_math.take("test", 5, seed=0) == synthetic_math.take("test", 5, seed=0, task="math")
    with pytest.raises(ValueError, match="task must be one of"):
        synthetic_math.take("test", 5, task="chains")


def test_a_batch_with_a_prompt_longer_than_prompt_length_widens_instead_of_ending_the_run():
    """A run died an hour in on one 106-token prompt of the chain task's first form (--prompt-length 104): now
    its batch is padded to the next multiple of 8, every prompt intact at the right edge, the canvas after it."""
    from localleap_jax.checkpoint import EMBEDDED

    cfg = train_tiny.TrainConfig(task="chain", prompt_length=8, batch_size=4, gen_length=64)
    tok = train_tiny.build_tokenizer(cfg, EMBEDDED)
    tokens, mask, answer = train_tiny.make_batch(0, cfg, tok)
    width = tokens.shape[1] - cfg.gen_length
    longest = int(mask[:, :width].sum(1).max())
    assert longest > cfg.prompt_length and width % 8 == 0 and longest <= width < longest + 8
    stream = synthetic_math.problems("train", seed=f"{cfg.seed}-0", task="chain")
    for row in range(4):
        prompt = tok.encode(train_tiny.PROMPT.format(question=next(stream)["question"]))
        assert tokens[row, width - len(prompt):width].tolist() == prompt and mask[row, :width].sum() == len(prompt)
    assert answer[:, width:].all() and not answer[:, :width].any()


def test_sft_loss_is_cross_entropy_on_masked_answer_tokens_weighted_by_one_over_t():
    """Against a direct transcription of LLaDA's SFT loss with the same noise draw."""
    cfg = ll.ModelConfig(d_model=32, n_heads=2, n_kv_heads=2, n_layers=1, mlp_hidden_size=64, vocab_size=50,
                         embedding_size=50, mask_token_id=49, eos_token_id=48, pad_token_id=48)
    params = ll.model.init_params(cfg, jax.random.key(0))
    rng = np.random.RandomState(0)
    tokens = jnp.asarray(rng.randint(0, 48, (4, 12)), jnp.int32)
    mask = jnp.ones((4, 12), bool)
    answer = jnp.asarray(np.arange(12)[None, :] >= 5).repeat(4, 0)
    key = jax.random.key(3)
    got = float(train_tiny.sft_loss(params, tokens, mask, answer, key, config=cfg))
    k_t, k_m = jax.random.split(key)
    t = (np.arange(4) + np.asarray(jax.random.uniform(k_t, (4,)))) / 4
    p = (1 - 1e-3) * t + 1e-3
    masked = np.asarray(answer) & (np.asarray(jax.random.uniform(k_m, (4, 12))) < p[:, None])
    logits = np.asarray(forward(params, jnp.where(masked, 49, tokens), mask, cfg), np.float64)
    logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    ce = -np.take_along_axis(logp, np.asarray(tokens)[..., None], -1)[..., 0]
    want = np.mean([(ce[b][masked[b]]).sum() / p[b] / 7 for b in range(4)])
    assert got == pytest.approx(want, rel=1e-5)


def test_decode_like_rows_see_clean_blocks_before_one_masked_block_and_masks_after_it():
    """sft_loss(decode_like=...) against a row-by-row transcription with the same draws: a decode-like row keeps
    the answer blocks before its block j clean, masks block j at its ratio t and every later block whole, and
    scores block j alone (1/t, over the block's length); the other rows are LLaDA's loss as before. The case
    happens: both kinds of row are drawn, and decode-like rows draw every block, the short last one too."""
    cfg = ll.ModelConfig(d_model=32, n_heads=2, n_kv_heads=2, n_layers=1, mlp_hidden_size=64, vocab_size=50,
                         embedding_size=50, mask_token_id=49, eos_token_id=48, pad_token_id=48)
    params = ll.model.init_params(cfg, jax.random.key(0))
    B, P, G, bl = 8, 5, 14, 4  # blocks of the canvas: columns 0-3, 4-7, 8-11, 12-13 (a short last one)
    tokens = jnp.asarray(np.random.RandomState(0).randint(0, 48, (B, P + G)), jnp.int32)
    mask = jnp.ones((B, P + G), bool)
    answer = jnp.asarray(np.arange(P + G)[None, :] >= P).repeat(B, 0)
    key = jax.random.key(6)
    got = float(train_tiny.sft_loss(params, tokens, mask, answer, key, config=cfg, decode_like=0.5,
                                    block_length=bl))
    k_t, k_m = jax.random.split(key)
    t = (np.arange(B) + np.asarray(jax.random.uniform(k_t, (B,)))) / B
    p = (1 - 1e-3) * t + 1e-3
    iid = np.asarray(jax.random.uniform(k_m, (B, P + G))) < p[:, None]
    k_row, k_block, k_m2 = jax.random.split(jax.random.fold_in(key, 1), 3)
    decode_row = np.asarray(jax.random.uniform(k_row, (B,))) < 0.5
    block = (np.asarray(jax.random.uniform(k_block, (B,))) * 4).astype(int)  # 4 blocks
    u = np.asarray(jax.random.uniform(k_m2, (B, P + G)))
    masked, scored, length = np.zeros((B, P + G), bool), np.zeros((B, P + G), bool), np.full(B, G)
    for b in range(B):
        for col in range(P, P + G):
            j = (col - P) // bl
            if not decode_row[b]:
                masked[b, col] = scored[b, col] = iid[b, col]
            elif j == block[b]:
                masked[b, col] = scored[b, col] = u[b, col] < p[b]
            else:
                masked[b, col] = j > block[b]
        if decode_row[b]:
            length[b] = min(bl, G - bl * block[b])
    assert decode_row.any() and not decode_row.all()
    assert set(block[decode_row]) == {0, 1, 2, 3}  # first, middle and the short last block all drawn
    logits = np.asarray(forward(params, jnp.where(masked, 49, tokens), mask, cfg), np.float64)
    logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    ce = -np.take_along_axis(logp, np.asarray(tokens)[..., None], -1)[..., 0]
    want = np.mean([ce[b][scored[b]].sum() / p[b] / length[b] for b in range(B)])
    assert got == pytest.approx(want, rel=1e-5)


@pytest.fixture
def compilations_shared_between_runs(tmp_path):
    """JAX's persistent compilation cache, in tmp_path and for one test: each train_tiny.main jits its train step
    (and the parameters' init) afresh, a new closure per run, so every run would compile the same programs
    again; with the cache the later runs read the first run's executables. JAX's settings are put back after."""
    import jax
    from jax.experimental.compilation_cache import compilation_cache

    from localleap_jax.compile_cache import enable_compilation_cache

    flags = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs",
             "jax_persistent_cache_min_entry_size_bytes")
    before = {k: getattr(jax.config, k) for k in flags}
    enable_compilation_cache(tmp_path / "xla")
    compilation_cache.reset_cache()  # read the settings again at the next compile
    yield tmp_path / "xla"
    for k, v in before.items():
        jax.config.update(k, v)
    compilation_cache.reset_cache()


def test_training_resumes_and_exports_a_loadable_checkpoint(tmp_path, capsys, monkeypatch,
                                                           compilations_shared_between_runs):
    out = tmp_path / "run"
    real_batch = train_tiny.make_batch

    def interrupted(step, *a):
        if step == 4:
            raise KeyboardInterrupt  # Ctrl-C during step 4 (index 4: four steps are done)
        return real_batch(step, *a)
    monkeypatch.setattr(train_tiny, "make_batch", interrupted)
    assert train_tiny.main(["--out", str(out), *TINY]) == 130
    (line,) = capsys.readouterr().err.strip().splitlines()[-1:]
    assert line.startswith("interrupted (Ctrl-C) after step 4; state saved"), line
    assert (out / "train_state" / "4").exists() and not (out / "checkpoint").exists()
    monkeypatch.setattr(train_tiny, "make_batch", real_batch)
    train_tiny.main(["--out", str(out), *TINY])  # resumes at 4, runs to 6, exports
    manifest = json.loads((out / "checkpoint" / "manifest.json").read_text())
    assert manifest["training"]["resumed_from_step"] == 4 and manifest["training"]["exported_at_step"] == 6
    model = ll.load(out / "checkpoint", dtype="float32")
    assert model.config.d_model == 32 and model.tokenizer.eot_id is not None
    ids, mask = model.tokenizer.encode_batch(["Question: Mia has 3 pens. How many pens does Mia have?\nAnswer:"])
    out_gen = ll.generate(model, ids, mask, ll.DecodeConfig(gen_length=64, block_length=16))
    assert out_gen.tokens.shape == (1, ids.shape[1] + 64)
    capsys.readouterr()
    assert train_tiny.main(["--out", str(out), *TINY, "--lr", "0.1"]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("error: ") and "holds a run with a different configuration" in line, line
    # Resuming restored everything (parameters, optimizer moments, the schedule's step): the same six steps run
    # without a stop end in the same weights, bit for bit (a resume from fresh parameters or a fresh optimizer
    # state would not).
    # (the same tokenizer as the first run's: build_tokenizer keeps the one it finds, and training it again on
    # the same corpus would give the same one)
    shutil.copytree(out / "tokenizer", tmp_path / "straight" / "tokenizer")
    train_tiny.main(["--out", str(tmp_path / "straight"), *TINY])
    straight = ll.load(tmp_path / "straight" / "checkpoint", dtype="float32")
    assert json.loads((tmp_path / "straight" / "checkpoint" / "manifest.json").read_text())["training"][
        "resumed_from_step"] == 0
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(model.params), jax.tree.leaves(straight.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=jax.tree_util.keystr(path))


# ---------------------------------------------------------------- block diffusion (--family sdar)

SDAR = ll.ModelConfig(d_model=32, n_heads=2, n_kv_heads=2, n_layers=2, mlp_hidden_size=64, vocab_size=50,
                      embedding_size=50, mask_token_id=49, eos_token_id=48, pad_token_id=48, family="sdar",
                      qk_norm=True, block_size=4)
# A left-padded batch: 7 prompt columns (real prompt lengths 5, 2, 7: none a multiple of the block of 4, so the
# first answer block holds prompt tokens too), then a 6-token answer canvas.
P, G, T = 7, 6, 4
PROMPT_LENGTHS = (5, 2, 7)


def bd_batch(seed=0):
    rng = np.random.RandomState(seed)
    tokens = rng.randint(0, 48, (len(PROMPT_LENGTHS), P + G))
    mask = np.ones(tokens.shape, bool)
    for b, n in enumerate(PROMPT_LENGTHS):
        mask[b, :P - n] = False
        tokens[b, :P - n] = 48
    answer = np.zeros(tokens.shape, bool)
    answer[:, P:] = True
    return tokens, mask, answer


def brute_force_block_diffusion_mask(real, n_noisy, block):
    """The rule written out with loops: columns [0, L) are the clean copy, [L, L + n_noisy) the noisy copy of
    the last n_noisy clean columns; a position is its column minus the row's first real column."""
    B, L = real.shape
    out = np.zeros((B, L + n_noisy, L + n_noisy), bool)
    for b in range(B):
        first = int(np.argmax(real[b]))
        for q in range(L + n_noisy):
            q_noisy, q_col = q >= L, (q - n_noisy if q >= L else q)
            if not real[b, q_col]:
                out[b, q, q] = True  # padding: itself only
                continue
            q_block = (q_col - first) // block
            for k in range(L + n_noisy):
                k_noisy, k_col = k >= L, (k - n_noisy if k >= L else k)
                if not real[b, k_col]:
                    continue
                k_block = (k_col - first) // block
                if not q_noisy:
                    out[b, q, k] = not k_noisy and k_block <= q_block
                elif k_noisy:
                    out[b, q, k] = k_block == q_block
                else:
                    out[b, q, k] = k_block < q_block
    return out


def test_block_diffusion_mask_equals_a_brute_force_construction():
    tokens, mask, _ = bd_batch()
    n = train_tiny.noisy_width(G, T, P + G)
    assert n == G + T - 1
    got = np.asarray(train_tiny.block_diffusion_attention(ll.model.positions_from_mask(jnp.asarray(mask)),
                                                          jnp.asarray(mask), n, T))
    np.testing.assert_array_equal(got, brute_force_block_diffusion_mask(mask, n, T))
    # The noisy copy reaches back far enough: every prompt token sharing a block with an answer token is in it.
    for b, n_prompt in enumerate(PROMPT_LENGTHS):
        in_first_answer_block = n_prompt % T
        assert P - in_first_answer_block >= P + G - n


def test_block_diffusion_logits_are_what_block_causal_forward_gives_at_inference():
    """Denoising block i in training (noisy copy, all blocks at once) scores it exactly as `forward` does on the
    canvas a decoder holds then: blocks < i clean, block i noisy (prompt tokens kept), later blocks masked."""
    params = ll.model.init_params(SDAR, jax.random.key(1))
    tokens, mask, answer = bd_batch()
    n = train_tiny.noisy_width(G, T, P + G)
    masked = answer & (np.random.RandomState(2).rand(*tokens.shape) < 0.5)
    noisy = np.where(masked, SDAR.mask_token_id, tokens)
    logits = np.asarray(train_tiny.block_diffusion_logits(params, jnp.asarray(tokens), jnp.asarray(mask),
                                                          jnp.asarray(noisy[:, -n:]), config=SDAR, gen_length=G))
    block = np.where(mask, np.cumsum(mask, 1) - 1, -1) // T
    checked = 0
    for i in range(block.max() + 1):
        canvas = np.where(block < i, tokens, np.where(block == i, noisy, SDAR.mask_token_id))
        canvas = np.where(mask, canvas, tokens)
        ref = np.asarray(forward(params, jnp.asarray(canvas), jnp.asarray(mask), SDAR))
        here = (block == i) & answer
        np.testing.assert_allclose(logits[here[:, P:]], ref[here], rtol=1e-5, atol=1e-5)
        checked += here.sum()
    assert checked == answer.sum()


def one_block_loss(params, tokens, mask, block_cols):
    """bd_sft_loss with only the answer columns `block_cols` (one grid block of every row) masked and scored."""
    answer = np.zeros(tokens.shape, bool)
    answer[:, block_cols] = True
    return float(train_tiny.bd_sft_loss(params, jnp.asarray(tokens), jnp.asarray(mask), jnp.asarray(answer),
                                        jax.random.key(5), config=SDAR, gen_length=G))


def test_a_noisy_block_sees_its_clean_prefix_and_nothing_after_it():
    params = ll.model.init_params(SDAR, jax.random.key(1))
    tokens, mask, _ = bd_batch()
    tokens, mask = tokens[:1], mask[:1]  # prompt of 5 tokens: grid blocks [2..5]=cols 2-5, [6..9]=cols 6-9, ...
    block = (cols := np.arange(P + G)) - 2  # grid position per column (2 padding columns)
    cols_of = lambda i: cols[(block >= 0) & (block // T == i)]  # noqa: E731
    # Block 1 (columns 6..9): prompt column 6, answer columns 7..9.
    scored = [c for c in cols_of(1) if c >= P]
    base = one_block_loss(params, tokens, mask, scored)

    def changed(cols_to_change):
        t = tokens.copy()
        t[0, cols_to_change] = (t[0, cols_to_change] + 1) % 48
        return t
    later = list(cols_of(2)) + list(cols_of(3))
    assert one_block_loss(params, changed(later), mask, scored) == pytest.approx(base, rel=1e-6, abs=1e-7)
    for prefix in (cols_of(0)[-1:], cols_of(0)[:1], [6]):  # the clean blocks before, and the block's own prompt
        assert abs(one_block_loss(params, changed(prefix), mask, scored) - base) > 1e-5, prefix
    # The block's own clean answer tokens reach it only as targets, never as context (no leak in any layer):
    # the logits at the block's noisy positions do not move when they change.
    n = train_tiny.noisy_width(G, T, P + G)

    def logits_of(clean, noisy):
        return np.asarray(train_tiny.block_diffusion_logits(params, jnp.asarray(clean), jnp.asarray(mask),
                                                            jnp.asarray(noisy[:, -n:]), config=SDAR, gen_length=G))
    noisy = tokens.copy()
    noisy[0, scored] = SDAR.mask_token_id
    at = np.asarray(scored) - P
    np.testing.assert_allclose(logits_of(changed(scored), noisy)[0, at], logits_of(tokens, noisy)[0, at],
                               rtol=1e-6, atol=1e-6)


def test_warm_start_copies_every_matching_leaf_and_keeps_the_new_ones():
    llada = dataclasses.replace(SDAR, family="llada", qk_norm=False, block_size=0)
    source = ll.model.init_params(llada, jax.random.key(7))
    params, copied, kept = train_tiny.warm_start(ll.model.init_params(SDAR, jax.random.key(8)), source)
    assert sorted(kept) == ["['blocks']['k_norm']['scale']", "['blocks']['q_norm']['scale']"]
    assert len(copied) == len(jax.tree.leaves(source))
    flat = {jax.tree_util.keystr(k): v for k, v in jax.tree_util.tree_leaves_with_path(params)}
    for path, leaf in jax.tree_util.tree_leaves_with_path(source):
        np.testing.assert_array_equal(np.asarray(flat[jax.tree_util.keystr(path)]), np.asarray(leaf))
    np.testing.assert_array_equal(np.asarray(flat["['blocks']['q_norm']['scale']"]), 1.0)


def test_sdar_run_warm_starts_and_exports_a_block_diffusion_checkpoint(tmp_path, compilations_shared_between_runs):
    # A tiny LLaDA checkpoint (untrained) to warm-start from, with the tokenizer a TINY run builds.
    base = tmp_path / "llada"
    train_tiny.main(["--out", str(base), *TINY, "--steps", "2", "--warmup", "1"])
    run = tmp_path / "sdar"
    train_tiny.main(["--out", str(run), *TINY, "--steps", "2", "--warmup", "1", "--family", "sdar",
                     "--init-from", str(base / "checkpoint")])
    saved = json.loads((run / "train_config.json").read_text())
    assert saved["family"] == "sdar" and saved["block_size"] == 4 and saved["init_from"]
    llada_saved = json.loads((base / "train_config.json").read_text())
    # llada on the math task: as before (the task is recorded only when it is not the math one, decode_like and
    # its blocks only when rows are drawn decode-like)
    assert set(llada_saved) == {f.name for f in dataclasses.fields(train_tiny.TrainConfig)} - {
        "task", "decode_like", "block_length"}
    model = ll.load(run / "checkpoint", dtype="float32")
    assert model.config.family == "sdar" and model.config.block_size == 4 and model.config.qk_norm
    hf = json.loads((run / "checkpoint" / "config.json").read_text())
    assert hf["model_type"] == "sdar" and hf["block_size"] == 4
    manifest = json.loads((run / "checkpoint" / "manifest.json").read_text())
    assert manifest["eval_defaults"] == {"gen_length": 64, "block_length": 4, "num_fewshot": 0}
    assert manifest["training"]["warm_start"]["kept_init"] == ["['blocks']['k_norm']['scale']",
                                                                "['blocks']['q_norm']['scale']"]
    assert "adapting a pretrained model" in (run / "checkpoint" / "README.md").read_text()
    with pytest.raises(SystemExit):
        train_tiny.main(["--out", str(tmp_path / "x"), *TINY, "--block-size", "8"])  # llada has no blocks


@pytest.mark.parametrize("flags, message", [
    (["--steps", "0"], "--steps must be >= 1, got 0"),
    (["--save-every", "0"], "--save-every must be >= 1, got 0"),
    (["--warmup", "6"], "need 0 <= --warmup < --steps"),
    (["--lr", "0"], "--lr > 0 and --weight-decay >= 0; got warmup 2, steps 6, lr 0.0"),
    (["--n-heads", "3"], "--n-heads 3 must divide --d-model 32"),
    (["--decode-like", "1.5"], "--decode-like is a share of rows"),
    (["--block-length", "5"], "--block-length must divide --gen-length 64"),
    (["--family", "diffusion_gemma", "--decode-like", "0.5"], "--decode-like is for --family llada"),
    (["--family", "diffusion_gemma", "--block-size", "4"], "--block-size is for --family sdar"),
])
def test_bad_training_flags_end_in_one_line_before_anything_is_built(tmp_path, capsys, flags, message):
    with pytest.raises(SystemExit) as exit_:
        train_tiny.main(["--out", str(tmp_path / "run"), *TINY, *flags])
    assert exit_.value.code == 2 and message in capsys.readouterr().err
    assert not (tmp_path / "run").exists()  # refused before the work directory is made


def test_a_vocabulary_the_tokenizer_cannot_have_and_a_short_run_s_warmup(tmp_path, capsys):
    """Issue #47: --vocab-size 1 was ignored (the run trained with 262 tokens); --steps 1 failed on the default warm-up
    of 200, a line that hid the other mistakes. Now every mistake is in the one line, and a short run's default
    warm-up fits it."""
    run = tmp_path / "run"
    with pytest.raises(SystemExit) as exit_:
        train_tiny.main(["--out", str(run), "--steps", "1", "--vocab-size", "1", "--n-heads", "3"])
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert exit_.value.code == 2 and line == (
        "error: --vocab-size 1: the byte-level tokenizer needs at least 262 (256 bytes and 6 special tokens); "
        "--n-heads 3 must divide --d-model 128"), line  # no word of the warm-up: 0 for a run of one step
    with pytest.raises(SystemExit):
        train_tiny.main(["--out", str(run), *TINY, "--init-from", str(EMBEDDED), "--vocab-size", "300"])
    assert "--vocab-size: --init-from brings its own tokenizer" in capsys.readouterr().err
    assert not run.exists()


def test_a_damaged_warm_start_is_refused_before_anything_is_written(tmp_path, capsys):
    """Issue #47: `--init-from <corrupt>` left OUT/tokenizer/ and OUT/train_config.json behind."""
    import shutil

    source = tmp_path / "source"
    shutil.copytree(EMBEDDED, source)
    (shard,) = [p for p in (source / "params").rglob("*") if p.is_file() and p.stat().st_size > 1_000_000][:1]
    shard.write_bytes(shard.read_bytes()[:100])
    run = tmp_path / "run"
    assert train_tiny.main(["--out", str(run), *TINY, "--init-from", str(source)]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(f"error: --init-from {source}: ") and "is truncated" in line, line
    assert not run.exists()


# ---------------------------------------------------------------- DiffusionGemma (--family diffusion_gemma)

# One layer (a full-attention one) keeps the compiles short; the run below trains both kinds of layer.
DG_RUN = train_tiny.TrainConfig(d_model=32, n_layers=1, n_heads=2, mlp_hidden_size=64, gen_length=8)


def dg_config(dispatch="all"):
    """The tiny DiffusionGemma of --family diffusion_gemma at DG_RUN's sizes; its MoE run densely (dispatch "all":
    the same function as the sparse paths, which test_moe checks, and a quicker compile)."""
    config = train_tiny.dg_model_config(DG_RUN, train_tiny.build_tokenizer(DG_RUN, EMBEDDED))
    return dataclasses.replace(config, arch=dataclasses.replace(config.arch, moe_dispatch=dispatch))


def spread_params(config, seed=0):
    """Random parameters far enough from the init (matrices N(0, 0.3), vectors around 1) that the logits depend
    on every input: at the init's N(0, 0.02) they are nearly uniform whatever the canvas or the self-conditioning."""
    params = families.init_params(config, jax.random.key(seed))
    leaves, treedef = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(seed + 1), len(leaves))
    return jax.tree.unflatten(treedef, [x + (0.3 if x.ndim > 1 and x.shape[-1] > 1 else 0.2)
                                        * jax.random.normal(k, x.shape) for x, k in zip(leaves, keys)])


def test_uniform_noise_replaces_canvas_tokens_at_ratio_t_with_uniform_draws():
    """Measured on 8 rows of 3000 canvas columns, all one token: row b's changed share is p_b (1 - 1/V) (a draw may
    be the token itself), p_b in its 1/8 slice of [0, 1] (stratified t, LLaDA's floor); the replacements cover the
    vocabulary evenly (no id drawn much more or less than 1/V); the prompt columns never change."""
    B, P, G, V, token = 8, 5, 3000, 50, 7
    tokens = jnp.full((B, P + G), token, jnp.int32)
    answer = jnp.asarray(np.arange(P + G) >= P)[None].repeat(B, 0)
    noisy, p = train_tiny.uniform_noise(jax.random.key(0), tokens, answer, V)
    noisy, p = np.asarray(noisy), np.asarray(p)
    assert (noisy[:, :P] == token).all()
    t = (p - 1e-3) / (1 - 1e-3)
    assert all(b / B <= t[b] <= (b + 1) / B for b in range(B))
    changed = (noisy[:, P:] != token).mean(axis=1)
    np.testing.assert_allclose(changed, p * (1 - 1 / V), atol=0.03)
    drawn = noisy[:, P:][noisy[:, P:] != token]
    counts = np.bincount(drawn, minlength=V)
    assert counts.size == V and (drawn < V).all()
    expected = drawn.size / (V - 1)  # the token's own draws do not show as changes
    others = np.delete(counts, token)
    assert np.abs(others - expected).max() < 5 * np.sqrt(expected), (others.min(), others.max(), expected)


def dg_batch(config, seed=0):
    """Left-padded prompts (real lengths 6, 3, 9, 9) and a canvas of the config's length."""
    rng = np.random.RandomState(seed)
    P, C = 9, config.canvas_length
    tokens = rng.randint(4, config.vocab_size, (4, P + C)).astype(np.int32)
    mask = np.ones(tokens.shape, bool)
    for b, n in enumerate((6, 3, 9, 9)):
        mask[b, :P - n] = False
        tokens[b, :P - n] = config.pad_token_id
    answer = np.zeros(tokens.shape, bool)
    answer[:, P:] = True
    return jnp.asarray(tokens), jnp.asarray(mask), jnp.asarray(answer), P


def test_canvas_loss_is_the_decoders_cross_entropy_on_the_uniformly_corrupted_canvas():
    """Against the family's `decoder_logits` run on its own: the canvas corrupted with the loss's draws (one t per
    row, stratified; a uniform token where replaced), the encoder over the prompt; in the rows drawn for
    self-conditioning a second pass fed the first pass's logits (`sc_logits`: their softmax as an expected
    embedding), in the others the first pass alone; cross-entropy of the clean canvas at every canvas position,
    corrupted or not, unweighted, averaged. Both kinds of row are drawn."""
    config = dg_config()
    params = spread_params(config)
    tokens, mask, answer, P = dg_batch(config)
    key = jax.random.key(3)
    got = float(train_tiny.canvas_loss(params, tokens, mask, answer, key, config=config))
    k_noise, k_sc = jax.random.split(key)
    k_mask, k_draw = jax.random.split(k_noise)
    k_t, k_m = jax.random.split(k_mask)
    t = (np.arange(4) + np.asarray(jax.random.uniform(k_t, (4,)))) / 4
    p = (1 - 1e-3) * t + 1e-3
    replaced = np.asarray(answer) & (np.asarray(jax.random.uniform(k_m, answer.shape)) < p[:, None])
    draws = np.asarray(jax.random.randint(k_draw, tokens.shape, 0, config.vocab_size))
    noisy = np.where(replaced, draws, np.asarray(tokens))[:, P:]
    assert (noisy != np.asarray(tokens)[:, P:]).any() and (noisy == np.asarray(tokens)[:, P:]).any()
    self_conditioned = np.asarray(jax.random.uniform(k_sc, (4,))) < 0.5
    assert self_conditioned.any() and not self_conditioned.all()
    first = dg.decoder_logits(params, tokens[:, :P], mask[:, :P], noisy, config)
    second = dg.decoder_logits(params, tokens[:, :P], mask[:, :P], noisy, config, sc_logits=first)
    logits = np.where(self_conditioned[:, None, None], np.asarray(second), np.asarray(first)).astype(np.float64)
    logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    ce = -np.take_along_axis(logp, np.asarray(tokens)[:, P:, None], -1)[..., 0]
    assert got == pytest.approx(ce.mean(), rel=1e-5)
    assert abs(np.asarray(second) - np.asarray(first)).max() > 0.1  # the self-conditioning input matters here


def test_self_conditioning_trains_the_second_pass_on_the_first_pass_held_fixed():
    """The gradient of the loss with every row self-conditioned is the gradient of the second pass alone with the
    first pass's logits as a constant input (stop_gradient): no gradient flows back through the first pass."""
    config = dg_config()
    params = spread_params(config, seed=2)
    tokens, mask, answer, P = dg_batch(config, seed=1)
    answer = jnp.zeros_like(answer)  # no corruption: the canvas is the clean one, so the passes below need no draws
    key = jax.random.key(0)
    grads = jax.grad(train_tiny.canvas_loss)(params, tokens, mask, answer, key, config=config, self_condition=1.0)
    first = dg.decoder_logits(params, tokens[:, :P], mask[:, :P], tokens[:, P:], config)

    def second_pass_alone(params):
        logits = dg.decoder_logits(params, tokens[:, :P], mask[:, :P], tokens[:, P:], config, sc_logits=first)
        return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, P:]).mean()
    want = jax.grad(second_pass_alone)(params)
    for (path, g), w in zip(jax.tree_util.tree_leaves_with_path(grads), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-4, atol=1e-6,
                                   err_msg=jax.tree_util.keystr(path))


DG_FLAGS = ["--family", "diffusion_gemma", "--steps", "20", "--batch-size", "8", "--d-model", "32", "--n-layers",
            "2", "--n-heads", "2", "--mlp-hidden-size", "64", "--warmup", "2", "--save-every", "10", "--lr", "1e-2",
            "--gen-length", "32"]  # 2 layers: one sliding, one full; prompts (<= 66 tokens) all padded to 72


def test_diffusion_gemma_run_lowers_the_loss_and_exports_a_checkpoint_that_round_trips(tmp_path):
    """`--family diffusion_gemma`, 20 steps: the exported parameters have a loss well under their init's on fresh
    problems; the export is a DiffusionGemma checkpoint `ll.load` reads back as the config trained (config.json
    written and read again gives it too), one canvas of --gen-length, decoded by default in blocks of it."""
    out = tmp_path / "dg"
    (out / "tokenizer").mkdir(parents=True)
    copy_tokenizer_files(EMBEDDED, out / "tokenizer")  # tiny-math's (training its own would take longer)
    assert train_tiny.main(["--out", str(out), *DG_FLAGS]) == 0
    model = ll.load(out / "checkpoint", dtype="float32")
    run = dataclasses.replace(DG_RUN, n_layers=2, gen_length=32, batch_size=8)
    trained = train_tiny.dg_model_config(run, model.tokenizer)
    assert model.config == trained == families.read_config(families.write_config(model.config))
    assert model.config.family == "diffusion_gemma" and model.config.canvas_length == 32
    assert set(model.config.arch.layer_types) == {"sliding", "full"} and model.config.end_ids == (0, 3)
    manifest = json.loads((out / "checkpoint" / "manifest.json").read_text())
    assert manifest["eval_defaults"] == {"gen_length": 32, "block_length": 32, "num_fewshot": 0}
    assert manifest["training"]["objective"].startswith("canvas_loss")
    assert json.loads((out / "train_config.json").read_text())["family"] == "diffusion_gemma"
    batch = [jnp.asarray(x) for x in train_tiny.make_batch(10_000, run, model.tokenizer)]
    loss = jax.jit(lambda params: train_tiny.canvas_loss(params, *batch, jax.random.key(5), config=trained))
    before = float(loss(families.init_params(trained, jax.random.key(0))))
    after = float(loss(model.params))
    assert after < 0.6 * before, (before, after)


def test_the_embedded_diffusion_gemma_twin_answers_as_its_readme_says():
    """`ll.load("embedded-dg")` (localleap_jax/assets/tiny-math-dg): the problem its README decodes, alone, with
    DiffusionGemma's own sampler at its defaults (sampled, rng key 0), one canvas of 48: the worked answer, the
    canvas finished by the stop criterion well before the pass bound."""
    model = ll.load("embedded-dg", dtype="float32")
    assert model.config.family == "diffusion_gemma" and model.config.canvas_length == 48
    question = "Max has 8 bags. He gives 4 bags to Mia. How many bags does Max have left?"
    ids, mask = model.tokenizer.encode_batch([train_tiny.PROMPT.format(question=question)])
    cfg = ll.DecodeConfig(strategy=ll.rules.EntropyBound(), gen_length=48, block_length=48)
    out = ll.generate(model, ids, mask, cfg, rng=jax.random.key(0))
    assert model.tokenizer.decode_generated(out) == ["Max has 8 - 4 = <<8-4=4>>4 bags left.\n#### 4"]
    assert out.nfe.tolist() == [3]
    readme = (EMBEDDED.parent / "tiny-math-dg" / "README.md").read_text()
    assert question in readme and "<<8-4=4>>4 bags left." in readme
