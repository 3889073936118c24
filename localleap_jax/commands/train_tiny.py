"""Train the small LLaDA-architecture model on synthetic GSM8K-format problems.

LLaDA's SFT objective: the prompt is kept; the answer canvas (answer, EOT, then EOS up to
`--gen-length`) is masked with ratio t ~ U(0, 1) per sample, and the loss is the
cross-entropy on masked positions weighted by 1/t, averaged over the canvas length. The t of
a batch are stratified (one per 1/B slice of [0, 1]) to cut the variance; each t is still
marginally uniform. `--decode-like F` masks a share F of the rows as block-by-block decoding sees
them instead (the answer blocks of `--block-length` before a drawn block clean, that block at ratio
t, every later block all masks; only that block scored): the case every commit of a decoding pass is
decided in, which independent masking rarely shows (see `sft_loss`).

Same `model.py` as inference; optax AdamW with warm-up and cosine decay; Orbax checkpoints
every `--save-every` steps that a rerun resumes from; the output is a checkpoint directory
in the format `convert` writes, so `localleap_jax.load` reads both.

    python experiments/train_tiny.py --out runs/tiny --steps 5000

`--family sdar` trains the block-diffusion (SDAR / BD3-LM) variant instead: the same network with per-head
q/k RMSNorm and block-causal attention (`--block-size`, default 4), under the block-diffusion SFT objective
of `bd_sft_loss` (see `block_diffusion_attention` for its attention mask). SDAR is made by adapting a
pretrained model to block diffusion, so `--init-from DIR` warm-starts from a checkpoint directory (every
parameter leaf whose shape matches is copied, its tokenizer is used; new leaves such as q_norm/k_norm keep
their init):

    python experiments/train_tiny.py --family sdar --init-from localleap_jax/assets/tiny-math \
        --out runs/tiny-sdar --steps 1000 --lr 5e-4 --warmup 50

`--family diffusion_gemma` trains a tiny DiffusionGemma (`dg_model_config`: sliding and full attention layers, MoE
beside the dense MLP in every layer, a tied head) under DiffusionGemma's uniform-noise objective (`canvas_loss`):
the prompt through the causal encoder, the answer canvas (one canvas of --gen-length tokens) with each position
replaced by a uniformly drawn token with probability t, the decoder, self-conditioned on its own first pass in
half of the rows, predicting the clean canvas. The export decodes with a canvas rule (`entropy_bound`,
`localleap_uniform`; block_length = gen_length). `--init-from` copies what matches in shape (the embedding).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from tqdm import tqdm

from localleap_jax import checkpoint, cli, families, synthetic_math
from localleap_jax.config import ModelConfig
from localleap_jax.errors import CheckpointError, ConfigError, UserError
from localleap_jax.families import diffusion_gemma as dg
from localleap_jax.model import forward, head, positions_from_mask, trunk_masked
from localleap_jax.tokenizer import (BOS_TOKEN, EOS_TOKEN, EOT_TOKEN, HEADER_TOKENS, MASK_TOKEN, Tokenizer, left_pad,
                                     make_tokenizer)

PROMPT = "Question: {question}\nAnswer:"  # lm-eval's gsm8k doc_to_text, 0-shot
CHAIN_STRATEGIES = "low_confidence,threshold:kappa=0.5,threshold,localleap"
# --family diffusion_gemma's fixed choices (dg_model_config): the sliding layers' window (prompts run 45-66 tokens,
# so the sliding layers see part of the question and the full ones all of it), the experts per layer and per token.
DG_SLIDING_WINDOW = 32
DG_EXPERTS = 4
DG_TOP_K = 2


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    steps: int = 5000
    batch_size: int = 64
    lr: float = 2e-3
    warmup: int = 200
    weight_decay: float = 0.01
    seed: int = 0
    gen_length: int = 64
    prompt_length: int = 72
    vocab_size: int = 384
    d_model: int = 128
    n_layers: int = 4
    n_heads: int = 4
    mlp_hidden_size: int = 512
    task: str = "math"
    decode_like: float = 0.0
    block_length: int = 16


# The flags whose default depends on the others (None until given): --vocab-size (--init-from brings its own), --warmup
# (200 steps, or a tenth of a run of 200 steps or fewer).
GIVEN_OR_DERIVED = ("vocab_size", "warmup")
DEFAULT_HELP = {"warmup": "200, or a tenth of --steps when that is 200 or fewer",
                "vocab_size": "384; --init-from: its tokenizer's"}
# The smallest vocabulary the byte-level BPE tokenizer has (make_tokenizer): its 256 bytes and its special tokens.
MIN_VOCAB = 256 + len([EOS_TOKEN, BOS_TOKEN, MASK_TOKEN, EOT_TOKEN, *HEADER_TOKENS])

# What each TrainConfig field is, as `--help` prints it (with its default).
FIELD_HELP = {
    "steps": "optimizer steps",
    "batch_size": "rows per step",
    "lr": "peak learning rate (AdamW; linear warm-up, then cosine decay to 5%% of it)",
    "warmup": "warm-up steps",
    "weight_decay": "AdamW weight decay",
    "seed": "seed of the data stream, the tokenizer corpus and the initialisation",
    "gen_length": "answer canvas: answer + EOT + EOS padding, in tokens",
    "prompt_length": "prompts are left-padded to this many tokens (a longer batch: to a multiple of 8)",
    "vocab_size": "tokenizer vocabulary (built from the task's corpus; --init-from brings its own)",
    "d_model": "model width",
    "n_layers": "transformer blocks",
    "n_heads": "attention heads",
    "mlp_hidden_size": "SwiGLU hidden width",
    "task": "synthetic_math.TASKS: math (tiny-math's), chain, chain3, chain6 (tiny-chain's stages)",
    "decode_like": "share of rows masked as block-by-block decoding sees them (sft_loss; llada only)",
    "block_length": "decode_like's blocks, and the export's default decoding block (llada)",
}


def build_tokenizer(cfg: TrainConfig, out_dir: Path) -> Tokenizer:
    if not (out_dir / "tokenizer.json").exists():
        corpus = [PROMPT.format(question=p["question"]) + " " + p["answer"]
                  for p in synthetic_math.take("train", 20000, seed=cfg.seed, unique=False, task=cfg.task)]
        make_tokenizer(corpus, cfg.vocab_size).save_pretrained(str(out_dir))
    from transformers import PreTrainedTokenizerFast
    hf = PreTrainedTokenizerFast.from_pretrained(str(out_dir))
    return Tokenizer(hf, mask_id=hf.mask_token_id, eos_id=hf.eos_token_id)


def model_config(cfg: TrainConfig, tok: Tokenizer) -> ModelConfig:
    return ModelConfig(d_model=cfg.d_model, n_heads=cfg.n_heads, n_kv_heads=cfg.n_heads, n_layers=cfg.n_layers,
                       mlp_hidden_size=cfg.mlp_hidden_size, vocab_size=len(tok.hf), embedding_size=len(tok.hf),
                       rope_theta=10000.0, max_sequence_length=512, mask_token_id=tok.mask_id,
                       eos_token_id=tok.eos_id, pad_token_id=tok.pad_id)


def sdar_model_config(cfg: TrainConfig, tok: Tokenizer, block_size: int) -> ModelConfig:
    """The same network as `model_config`'s in SDAR's (Qwen3) layout: q/k RMSNorm per head, an untied head,
    and block-causal attention on blocks of `block_size`."""
    return dataclasses.replace(model_config(cfg, tok), family="sdar", qk_norm=True, block_size=block_size,
                               explicit_head_dim=cfg.d_model // cfg.n_heads, tie_word_embeddings=False)


def dg_model_config(cfg: TrainConfig, tok: Tokenizer, block_size: int = 0) -> ModelConfig:
    """A tiny DiffusionGemma of the run's sizes, read from the config.json it exports (so the export round-trips
    through `ll.load`): layers alternating sliding (window DG_SLIDING_WINDOW) and full attention, the last one full
    (as transformers forces it); sliding layers of head size d_model / n_heads, global ones of twice that with one K/V
    head, proportional RoPE on a quarter of their pairs (the released model's layout, scaled down); every
    layer a dense GELU MLP of --mlp-hidden-size beside DG_EXPERTS experts of a quarter of it, top-DG_TOP_K. Tied
    embeddings, logit softcap 30, the tokenizer's EOS and EOT both ending a row, one canvas of --gen-length tokens.
    (`block_size` is unused: a canvas is as long as the answer.)"""
    head_dim = cfg.d_model // cfg.n_heads
    text = {"model_type": "diffusion_gemma_text", "vocab_size": len(tok.hf), "hidden_size": cfg.d_model,
            "intermediate_size": cfg.mlp_hidden_size, "num_hidden_layers": cfg.n_layers,
            "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.n_heads, "head_dim": head_dim,
            "global_head_dim": 2 * head_dim, "num_global_key_value_heads": 1,
            "sliding_window": DG_SLIDING_WINDOW,
            "layer_types": ["full_attention" if i % 2 or i == cfg.n_layers - 1 else "sliding_attention"
                            for i in range(cfg.n_layers)],
            "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                                "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                                   "rope_theta": 1_000_000.0}},
            "num_experts": DG_EXPERTS, "top_k_experts": DG_TOP_K,
            "moe_intermediate_size": max(cfg.mlp_hidden_size // 4, 1), "max_position_embeddings": 512,
            "rms_norm_eps": 1e-6, "final_logit_softcapping": 30.0, "pad_token_id": tok.pad_id,
            "eos_token_id": [tok.eos_id] + ([tok.eot_id] if tok.eot_id is not None else [])}
    return families.read_config({"architectures": ["DiffusionGemmaForBlockDiffusion"], "model_type": "diffusion_gemma",
                                 "text_config": text, "canvas_length": cfg.gen_length, "mask_token_id": tok.mask_id})


def warm_start(params, source):
    """`params` with every leaf that `source` has at the same path and shape replaced by source's (as float32
    copies); returns (params, copied paths, kept paths: leaves left at their init)."""
    flat_source = {jax.tree_util.keystr(k): v for k, v in jax.tree_util.tree_leaves_with_path(source)}
    copied, kept = [], []

    def take(path, leaf):
        name = jax.tree_util.keystr(path)
        other = flat_source.get(name)
        if other is not None and other.shape == leaf.shape:
            copied.append(name)
            return jnp.asarray(other, leaf.dtype)
        kept.append(name)
        return leaf
    return jax.tree_util.tree_map_with_path(take, params), copied, kept


def make_batch(step: int, cfg: TrainConfig, tok: Tokenizer):
    """Tokens [B, P+G], real-token mask [B, P+G], answer-canvas mask [B, P+G]; deterministic in (seed, step)."""
    stream = synthetic_math.problems("train", seed=f"{cfg.seed}-{step}", task=cfg.task)
    probs = [next(stream) for _ in range(cfg.batch_size)]
    prompts = [tok.encode(PROMPT.format(question=p["question"])) for p in probs]
    prompt_ids, prompt_mask = left_pad(prompts, tok.pad_id)
    # A rare longer prompt widens its batch (left padding changes no logit: positions start at the first real
    # token) rather than ending a run an hour in; multiples of 8 keep the compiled shapes few.
    width = max(cfg.prompt_length, -(-prompt_ids.shape[1] // 8) * 8)
    pad = width - prompt_ids.shape[1]
    prompt_ids = np.pad(prompt_ids, ((0, 0), (pad, 0)), constant_values=tok.pad_id)
    prompt_mask = np.pad(prompt_mask, ((0, 0), (pad, 0)))
    canvas = np.full((cfg.batch_size, cfg.gen_length), tok.eos_id, np.int32)
    for i, p in enumerate(probs):
        ans = tok.hf(p["answer"], add_special_tokens=False)["input_ids"] + [tok.eot_id]
        if len(ans) > cfg.gen_length:
            raise ValueError(f"an answer has {len(ans)} tokens > --gen-length {cfg.gen_length}")
        canvas[i, :len(ans)] = ans
    tokens = np.concatenate([prompt_ids, canvas], axis=1)
    mask = np.concatenate([prompt_mask, np.ones_like(canvas, bool)], axis=1)
    answer = np.concatenate([np.zeros_like(prompt_mask), np.ones_like(canvas, bool)], axis=1)
    return tokens, mask, answer


def sft_loss(params, tokens, mask, answer, rng, *, config: ModelConfig, decode_like: float = 0.0,
             block_length: int = 16):
    """LLaDA's SFT loss (see the module docstring). With `decode_like` > 0, that share of rows (drawn per row)
    is masked as block-by-block decoding sees the canvas instead: a block j of `block_length` answer columns
    is drawn uniformly, the blocks before it are clean, block j is masked at the row's ratio t, every block
    after it is all masks, and only block j is scored (its masked cross-entropy weighted 1/t, over the
    block's length). Under independent masking a masked value usually has a copy of itself in view (the
    next step's operand), so the model rarely learns how sure to be when the steps after it are still
    masks, which is the case every parallel commit of a block's first pass is decided in."""
    B, L = tokens.shape
    p_mask, masked = noise(rng, answer, B)
    scored, per_row_len = masked, answer.sum(axis=1)
    if decode_like:
        k_row, k_block, k_m = jax.random.split(jax.random.fold_in(rng, 1), 3)
        column = jnp.cumsum(answer, axis=1) - 1  # answer column of each position (-1 before the canvas)
        n_blocks = -(-per_row_len // block_length)
        block = jnp.floor(jax.random.uniform(k_block, (B,)) * n_blocks).astype(jnp.int32)[:, None]
        col_block = jnp.where(answer, column // block_length, -1)
        in_block = col_block == block
        block_masked = (in_block & (jax.random.uniform(k_m, (B, L)) < p_mask[:, None])) | (col_block > block)
        decode_row = (jax.random.uniform(k_row, (B,)) < decode_like)[:, None]
        masked = jnp.where(decode_row, block_masked, masked)
        scored = jnp.where(decode_row, block_masked & in_block, masked)
        per_row_len = jnp.where(decode_row[:, 0], in_block.sum(axis=1), per_row_len)
    noisy = jnp.where(masked, config.mask_token_id, tokens)
    logits = forward(params, noisy, mask, config)
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, tokens)
    per_row = jnp.sum(jnp.where(scored, ce, 0.0), axis=1) / p_mask / per_row_len
    return per_row.mean()


def noise(rng, answer, batch: int):
    """The masking draw both objectives share: stratified t per row (marginally U(0, 1)), LLaDA's floored
    mask probability p, and which answer-canvas positions are masked (independently, with probability p)."""
    k_t, k_m = jax.random.split(rng)
    t = (jnp.arange(batch) + jax.random.uniform(k_t, (batch,))) / batch
    p_mask = (1 - 1e-3) * t + 1e-3
    masked = answer & (jax.random.uniform(k_m, answer.shape) < p_mask[:, None])
    return p_mask, masked


def block_diffusion_attention(positions, real, n_noisy: int, block_size: int):
    """Attention mask [B, L + n_noisy, L + n_noisy] for block-diffusion training on [clean | noisy], where the
    noisy copy stands for the clean sequence's last `n_noisy` columns (same RoPE positions, same real marks).

    `positions` [B, L]: each clean token's position on the row's grid (0 at the first real token, as
    `positions_from_mask`); `real` [B, L]: not padding. Block of a position: position // block_size.
    mask[b, q, k] (query q sees key k):
      clean q -> clean k  iff k is real and block(k) <= block(q). This is exactly what `forward` computes for
                          a finished block at inference (block-causal), so the clean copy yields the K/V a
                          decoded block presents to the blocks after it.
      clean q -> noisy k  never: the clean copy must not depend on any noise draw (at inference the
                          context blocks are clean).
      noisy q -> clean k  iff k is real and block(k) < block(q): the finished, clean context before the block
                          being denoised -- its own block's clean keys would leak the answer.
      noisy q -> noisy k  iff k is real and block(k) == block(q): bidirectional inside the block being
                          denoised, seeing only its noisy tokens (the block's prompt tokens are in the noisy
                          copy too, never masked: at inference the prompt's last partial block is decoded
                          together with the first answer tokens, its prompt positions unmasked). The clean
                          copy of those prompt positions is not used instead: in layers >= 1 its hidden state
                          has attended to the clean answer tokens of the same block.
      padding q           sees itself only (keeps its softmax finite; no real query reads a padding key).
    """
    L = positions.shape[1]
    pos = jnp.concatenate([positions, positions[:, L - n_noisy:]], axis=1)
    is_real = jnp.concatenate([real, real[:, L - n_noisy:]], axis=1).astype(bool)
    noisy = jnp.arange(L + n_noisy) >= L
    block = pos // block_size
    bq, bk = block[:, :, None], block[:, None, :]
    nq, nk = noisy[None, :, None], noisy[None, None, :]
    sees = jnp.where(nq, jnp.where(nk, bk == bq, bk < bq), ~nk & (bk <= bq)) & is_real[:, None, :]
    return jnp.where(is_real[:, :, None], sees, jnp.eye(L + n_noisy, dtype=bool)[None])


def noisy_width(gen_length: int, block_size: int, length: int) -> int:
    """Columns the noisy copy covers: the answer canvas and the block_size - 1 prompt columns before it
    (enough for the prompt's share of the first answer block, wherever the grid puts it)."""
    return min(gen_length + block_size - 1, length)


def block_diffusion_logits(params, clean, mask, noisy_tokens, *, config: ModelConfig, gen_length: int):
    """Logits [B, gen_length, V] of the noisy copy's answer-canvas positions. `clean` [B, L]: the clean
    sequence (its last gen_length columns the answer canvas); `noisy_tokens` [B, n]: the noisy copy of its
    last n = noisy_width(...) columns."""
    L, n = clean.shape[1], noisy_tokens.shape[1]
    positions = positions_from_mask(mask)
    seq = jnp.concatenate([clean, noisy_tokens], axis=1)
    seq_positions = jnp.concatenate([positions, positions[:, L - n:]], axis=1)
    attn = block_diffusion_attention(positions, mask, n, config.block_size)
    h = trunk_masked(params, seq, seq_positions, attn, config)
    return head(params, h[:, L + n - gen_length:], config)


def bd_sft_loss(params, tokens, mask, answer, rng, *, config: ModelConfig, gen_length: int):
    """Block-diffusion SFT loss (SDAR / BD3-LM): the sequence is [clean prompt + answer canvas | noisy copy],
    the noisy copy's answer positions masked with the same draw as `sft_loss` (ratio t per row, stratified;
    p = (1 - 1e-3) t + 1e-3); cross-entropy on the masked noisy positions weighted 1/p, summed per row over
    the canvas length and averaged over rows, as `sft_loss`. Every block is denoised at once, each under its
    own clean context (`block_diffusion_attention`). The answer canvas must be the last gen_length columns."""
    B, L = tokens.shape
    p_mask, masked = noise(rng, answer, B)
    n = noisy_width(gen_length, config.block_size, L)
    noisy = jnp.where(masked, config.mask_token_id, tokens)[:, L - n:]
    logits = block_diffusion_logits(params, tokens, mask, noisy, config=config, gen_length=gen_length)
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, L - gen_length:])
    per_row = jnp.sum(jnp.where(masked[:, L - gen_length:], ce, 0.0), axis=1) / p_mask / answer.sum(axis=1)
    return per_row.mean()


def uniform_noise(rng, tokens, answer, vocab: int):
    """DiffusionGemma's corruption (Google's `CategoricalProcess.uniform_process` under its linear schedule, in
    google-deepmind/gemma `gemma/diffusion/hackable_diffusion_adapter`): every answer-canvas position is replaced,
    with probability t, by a token drawn uniformly from the whole vocabulary [0, vocab) (the draw may be the token
    itself, as at inference, where the canvas starts and is re-noised with the same draws); t per row, stratified
    and floored as in `noise`. Returns the noisy tokens and each row's p [B]."""
    k_mask, k_draw = jax.random.split(rng)
    p, replaced = noise(k_mask, answer, tokens.shape[0])
    draws = jax.random.randint(k_draw, tokens.shape, 0, vocab, dtype=tokens.dtype)
    return jnp.where(replaced, draws, tokens), p


def self_conditioned_logits(params, prompt, prompt_mask, canvas, self_condition, *, config: ModelConfig):
    """The decoder's logits [B, C, V] over `canvas` after the prompt, trained as DiffusionGemma's self-conditioning
    is (Google's SFT model): a first pass without self-conditioning; its logits, under stop_gradient, become the
    second pass's self-conditioning input (`dg.soft_embedding`: softmax @ E * sqrt(D)) in the rows where
    `self_condition` [B] holds, the others' second pass seeing none (zeros, as a canvas's first pass at inference);
    the second pass's logits are returned. The encoder runs once, causally over the left-padded prompt."""
    cache = dg.init_cache(config, prompt.shape[0], prompt.shape[1], params["wte"]["embedding"].dtype)
    _, cache = dg.encode_into(params, cache, prompt, prompt_mask, config)
    first = dg.decode(params, cache, canvas, config)
    soft = dg.soft_embedding(params, jax.lax.stop_gradient(first), config)
    soft = jnp.where(self_condition[:, None, None], soft, jnp.zeros_like(soft))
    return dg.decode(params, cache, canvas, config, soft)


def canvas_loss(params, tokens, mask, answer, rng, *, config: ModelConfig, self_condition: float = 0.5):
    """DiffusionGemma's uniform-noise objective on one canvas (the answer canvas: the last canvas_length columns):
    the prompt, kept, goes through the causal encoder; the canvas, corrupted by `uniform_noise`, through the
    decoder (`self_conditioned_logits`, each row self-conditioned with probability `self_condition`); the loss is
    the cross-entropy of the clean canvas at every canvas position -- corrupted or not, since the decoder cannot
    tell which are -- averaged over the canvas and over rows, with no weight in t (Google's `NoWeightDiscreteLoss`
    over its target mask, the canvas). (Google's recipe also trains the encoder autoregressively on prompt and
    canvas, an auxiliary loss left out here: with one canvas the decoder never reads the encoded canvas.)"""
    B, L = tokens.shape
    C = config.canvas_length
    k_noise, k_sc = jax.random.split(rng)
    noisy, _ = uniform_noise(k_noise, tokens, answer, config.vocab_size)
    use_sc = jax.random.uniform(k_sc, (B,)) < self_condition
    logits = self_conditioned_logits(params, tokens[:, :L - C], mask[:, :L - C], noisy[:, L - C:], use_sc,
                                     config=config)
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, L - C:])
    return jnp.mean(ce)


def sdar_readme(cfg: TrainConfig, config: ModelConfig, log: dict, init_from: str | None) -> str:
    warm = (f"Warm-started from `{init_from}` (a bidirectional checkpoint of the same network, whose tokenizer "
            "this one is): every parameter of matching shape was copied; the new per-head q/k RMSNorm scales "
            "start at 1. "
            "This is how SDAR itself is made -- by adapting a pretrained model to block diffusion -- so the "
            "warm start is part of the recipe, not a shortcut.\n\n" if init_from else
            "Trained from random initialisation.\n\n")
    return (f"# Small SDAR-architecture (block diffusion) model trained by experiments/train_tiny.py\n\n"
            f"The block-diffusion counterpart of `tiny-math`: the same network ({cfg.n_layers} layers, d_model "
            f"{cfg.d_model}, {cfg.n_heads} heads, SwiGLU {cfg.mlp_hidden_size}, vocabulary {config.vocab_size}) in "
            f"SDAR's Qwen3 layout, with per-head q/k RMSNorm and block-causal attention on blocks of "
            f"{config.block_size} ({config.num_params / 1e6:.2f}M parameters, fp32).\n\n"
            f"Data: the synthetic-math train split, as tiny-math. Objective: the block-diffusion SFT loss of "
            f"SDAR / BD3-LM (`bd_sft_loss`): [clean prompt + answer canvas | noisy copy of the answer canvas and "
            f"of the prompt tokens that share its first block], "
            f"the noisy copy masked at ratio t (per sample, stratified), each noisy block seeing the clean "
            f"blocks before it and its own noisy tokens; cross-entropy on masked tokens weighted 1/t.\n\n"
            f"{warm}"
            f"Decode block by block (eval default block_length {config.block_size}, gen_length {cfg.gen_length}).\n\n"
            f"```\n{json.dumps(log, indent=2)}\n```\n")


def dg_readme(cfg: TrainConfig, config: ModelConfig, log: dict, init_from: str | None) -> str:
    a = dg.arch_of(config)
    kept = ", ".join(log.get("warm_start", {}).get("kept_init", [])) or "none"
    warm = (f"Warm-started from `{init_from}`: the {log['warm_start']['copied_leaves']} parameters of matching shape "
            f"were copied (left at their init: {kept}).\n\n" if init_from else
            "Trained from random initialisation.\n\n")
    return (f"# Small DiffusionGemma-architecture (uniform-noise canvas) model trained by "
            f"experiments/train_tiny.py\n\n"
            f"The DiffusionGemma twin of `tiny-math`: a causal encoder over the prompt and a bidirectional decoder over "
            f"one canvas of {config.canvas_length} tokens, the same weights ({config.n_layers} layers "
            f"{'/'.join(a.layer_types)}, sliding window {a.sliding_window}, d_model {config.d_model}, {config.n_heads} "
            f"heads, a GELU MLP of {config.mlp_hidden_size} beside {a.num_experts} experts of "
            f"{a.moe_intermediate_size}, top-{a.top_k_experts}, vocabulary {config.vocab_size}, fp32).\n\n"
            f"Data: the synthetic-math train split, as tiny-math. Objective: DiffusionGemma's uniform-noise loss "
            f"(`canvas_loss`): each answer-canvas position replaced by a uniform token with probability t (per "
            f"sample, stratified), the decoder (self-conditioned on its own stop-gradient first pass in half of the "
            f"rows) predicting the clean canvas, cross-entropy over every canvas position, unweighted.\n\n"
            f"{warm}"
            f"Decode one canvas with a canvas rule (block_length = gen_length = {config.canvas_length}).\n\n"
            f"```\n{json.dumps(log, indent=2)}\n```\n")


@dataclasses.dataclass(frozen=True)
class Objective:
    """What one `--family` trains (OBJECTIVES): its network's config from the run's settings, the tokenizer and
    --block-size; the loss on a batch (`loss(cfg, config)`: f(params, tokens, mask, answer, rng)); the block the
    export decodes in by default; what its log and README say. `blocks`: takes --block-size (SDAR's grid);
    `masks`: takes --decode-like and --block-length (LLaDA's masking)."""

    config: Callable[[TrainConfig, Tokenizer, int], ModelConfig]
    loss: Callable[[TrainConfig, ModelConfig], Callable]
    decode_block: Callable[[TrainConfig, ModelConfig], int]
    name: str = ""  # the objective's name in the log ("": LLaDA's, whose log records none)
    readme: Callable[[TrainConfig, ModelConfig, dict, str | None], str] | None = None
    blocks: bool = False
    masks: bool = False


OBJECTIVES = {
    "llada": Objective(lambda cfg, tok, _: model_config(cfg, tok),
                       lambda cfg, config: functools.partial(sft_loss, config=config, decode_like=cfg.decode_like,
                                                             block_length=cfg.block_length),
                       lambda cfg, config: cfg.block_length, masks=True),
    "sdar": Objective(sdar_model_config,
                      lambda cfg, config: functools.partial(bd_sft_loss, config=config, gen_length=cfg.gen_length),
                      lambda cfg, config: config.block_size, "bd_sft_loss (block diffusion SFT)", sdar_readme,
                      blocks=True),
    "diffusion_gemma": Objective(dg_model_config, lambda cfg, config: functools.partial(canvas_loss, config=config),
                                 lambda cfg, config: config.canvas_length,
                                 "canvas_loss (DiffusionGemma's uniform noise, self-conditioned)", dg_readme),
}


def main(argv=None) -> int:
    ap = cli.OneLineParser(prog="python experiments/train_tiny.py", description=__doc__,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="work directory (Orbax training state lives in OUT/train_state)")
    ap.add_argument("--export", help="final checkpoint directory (default OUT/checkpoint)")
    ap.add_argument("--save-every", type=int, default=250,
                    help="save the training state every this many steps; a rerun resumes from it (default 250)")
    ap.add_argument("--export-only", action="store_true",
                    help="export the latest saved training state as a checkpoint directory, without training")
    ap.add_argument("--family", choices=tuple(OBJECTIVES), default="llada",
                    help="llada: bidirectional, LLaDA's SFT loss (default); sdar: block diffusion (bd_sft_loss); "
                         "diffusion_gemma: encoder-decoder over one uniform-noise canvas of --gen-length (canvas_loss)")
    ap.add_argument("--block-size", type=int, default=None, help="SDAR's block length (default 4; sdar only)")
    ap.add_argument("--init-from", help="warm start: a checkpoint directory whose parameters of matching shape "
                                        "(and whose tokenizer) this run starts from")
    for f in dataclasses.fields(TrainConfig):
        default = DEFAULT_HELP.get(f.name, f.default)
        ap.add_argument("--" + f.name.replace("_", "-"), type=type(f.default),
                        default=None if f.name in GIVEN_OR_DERIVED else f.default,
                        help=f"{FIELD_HELP[f.name]} (default {default})")
    args = ap.parse_args(argv)
    problems = []  # every mistake of the flags, in one line (one does not hide the next)
    if args.vocab_size is not None and args.init_from:
        problems.append("--vocab-size: --init-from brings its own tokenizer (and so its vocabulary); leave it out")
    if args.vocab_size is not None and args.vocab_size < MIN_VOCAB:
        problems.append(f"--vocab-size {args.vocab_size}: the byte-level tokenizer needs at least {MIN_VOCAB} (256 "
                        f"bytes and {MIN_VOCAB - 256} special tokens)")
    if args.vocab_size is None:
        args.vocab_size = TrainConfig.vocab_size
    if args.warmup is None:  # the default warm-up fits the run: 200 steps, or a tenth of a shorter one
        args.warmup = TrainConfig.warmup if args.steps > TrainConfig.warmup else args.steps // 10
    # --family names the architecture trained and its objective: LLaDA's (bidirectional), SDAR's (block
    # diffusion) or DiffusionGemma's (uniform noise on one canvas)
    objective = OBJECTIVES[args.family]
    if not objective.blocks and args.block_size is not None:
        problems.append(f"--block-size is for --family sdar ({args.family} has no block grid)")
    block_size = args.block_size if args.block_size is not None else 4
    if objective.blocks and block_size < 1:
        problems.append(f"--block-size must be >= 1, got {block_size}")
    cfg = TrainConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(TrainConfig)})
    small = [f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}"
             for name in ("steps", "batch_size", "gen_length", "prompt_length", "d_model", "n_layers", "n_heads",
                          "mlp_hidden_size", "save_every") if getattr(args, name) < 1]
    problems += small
    if not small and (not 0 <= cfg.warmup < cfg.steps or not cfg.lr > 0 or cfg.weight_decay < 0):
        problems.append(f"need 0 <= --warmup < --steps, --lr > 0 and --weight-decay >= 0; got warmup {cfg.warmup}, "
                        f"steps {cfg.steps}, lr {cfg.lr}, weight decay {cfg.weight_decay}")
    if cfg.n_heads >= 1 and cfg.d_model % cfg.n_heads:
        problems.append(f"--n-heads {cfg.n_heads} must divide --d-model {cfg.d_model}")
    if cfg.task not in synthetic_math.TASKS:
        problems.append(f"--task must be one of {', '.join(sorted(synthetic_math.TASKS))}, got {cfg.task!r}")
    if not 0.0 <= cfg.decode_like <= 1.0:
        problems.append(f"--decode-like is a share of rows, in [0, 1]; got {cfg.decode_like}")
    if objective.masks and (cfg.block_length < 1 or cfg.gen_length % cfg.block_length):  # sdar: --block-size
        problems.append(f"--block-length must divide --gen-length {cfg.gen_length} (the export decodes in blocks of "
                        f"it), got {cfg.block_length}")
    if cfg.decode_like and not objective.masks:
        problems.append(f"--decode-like is for --family llada ({args.family}'s objective has no masks to draw)")
    if problems:
        ap.error("; ".join(problems))
    saved: dict = {"step": None}  # the last training state saved (what an interrupted run keeps)
    state_dir = Path(args.out).expanduser().resolve() / "train_state"

    def interrupted(why: str) -> str:  # the line of a run the watchdog ended (inside a compile or a step)
        if saved["step"] is None:
            return f"interrupted ({why}) before a training state was saved; nothing was kept"
        return (f"interrupted ({why}); the training state of step {saved['step']} is kept in {state_dir}; rerun the "
                "same command to resume")

    return cli.run_command(lambda: train(args, cfg, block_size, argv, saved), interrupted)


def train(args, cfg: TrainConfig, block_size: int, argv, saved: dict | None = None) -> int:
    """The run the flags ask for: train (or resume), then export a checkpoint directory. `saved["step"]` follows the
    last training state saved."""
    saved = {} if saved is None else saved
    objective = OBJECTIVES[args.family]  # the architecture and objective --family names (see main)
    cli.check_writable_dir(args.out, "--out")  # both before any work, not after the training
    if args.export:
        cli.check_writable_dir(Path(args.export).expanduser().resolve().parent, "--export", args.export)
    init_from = str(Path(args.init_from).resolve()) if args.init_from else None
    source = None
    if init_from:  # read (and checked) before anything is written: a damaged source leaves nothing behind
        try:
            source = checkpoint.load(init_from, dtype="float32")
        except (CheckpointError, ConfigError) as e:
            raise UserError(f"--init-from {args.init_from}: {e}") from None
    # The run's identity: TrainConfig, plus the new flags only when they are not the default (a LLaDA run from
    # scratch records, and resumes from, exactly what it always has).
    run_cfg = dataclasses.asdict(cfg)
    if cfg.task == "math":
        del run_cfg["task"]
    if not cfg.decode_like:
        del run_cfg["decode_like"], run_cfg["block_length"]
    if objective.name:  # not LLaDA's (whose runs record exactly what they always have)
        run_cfg |= {"family": args.family} | ({"block_size": block_size} if objective.blocks else {})
    if init_from:
        run_cfg |= {"init_from": init_from}
    out = Path(args.out).resolve()
    saved_cfg = out / "train_config.json"
    if saved_cfg.exists() and json.loads(saved_cfg.read_text()) != run_cfg:
        raise UserError(f"{out} holds a run with a different configuration ({saved_cfg}); use a new --out")
    if source is not None:  # the warm start's ids: its tokenizer, checked against its model before anything is written
        tok = build_tokenizer(cfg, Path(init_from))
        config = objective.config(cfg, tok, block_size)
        for name in ("vocab_size", "mask_token_id", "eos_token_id", "pad_token_id"):
            if getattr(source.config, name) != getattr(config, name):
                raise UserError(f"--init-from {init_from} has {name}={getattr(source.config, name)}, this run "
                                f"{getattr(config, name)}")
        params, copied, kept = warm_start(families.init_params(config, jax.random.key(cfg.seed)),
                                           families.stacked_params(source.params, source.config))
        if not copied:
            raise UserError(f"--init-from {init_from}: no parameter has a matching shape")
    out.mkdir(parents=True, exist_ok=True)
    saved_cfg.write_text(json.dumps(run_cfg, indent=2))
    if init_from and not (out / "tokenizer" / "tokenizer.json").exists():
        (out / "tokenizer").mkdir(parents=True, exist_ok=True)
        checkpoint.copy_tokenizer_files(init_from, out / "tokenizer")
    tok = build_tokenizer(cfg, out / "tokenizer")
    if source is None and len(tok.hf) != cfg.vocab_size:  # the corpus ran out of merges before the size asked for
        print(f"note: the training corpus gives a tokenizer of {len(tok.hf)} tokens, not --vocab-size "
              f"{cfg.vocab_size}: the model's vocabulary is {len(tok.hf)}", file=sys.stderr)
    config = objective.config(cfg, tok, block_size)
    loss_fn = objective.loss(cfg, config)
    schedule = optax.warmup_cosine_decay_schedule(0.0, cfg.lr, cfg.warmup, cfg.steps, end_value=cfg.lr * 0.05)
    optimizer = optax.chain(optax.clip_by_global_norm(1.0),
                            optax.adamw(schedule, b1=0.9, b2=0.99, weight_decay=cfg.weight_decay))
    warm = None
    if source is None:
        params = families.init_params(config, jax.random.key(cfg.seed))
    else:
        warm = {"init_from": args.init_from, "copied_leaves": len(copied), "kept_init": kept}
        print(f"warm start from {init_from}: {len(copied)} leaves copied; kept at init: {', '.join(kept) or 'none'}")
    state = {"params": params, "opt": optimizer.init(params)}

    manager = ocp.CheckpointManager(out / "train_state", options=ocp.CheckpointManagerOptions(max_to_keep=2))
    start = 0
    if manager.latest_step() is not None:
        start = saved["step"] = manager.latest_step()
        state = manager.restore(start, args=ocp.args.StandardRestore(state))
        print(f"resumed from step {start}")

    @jax.jit
    def train_step(state, tokens, mask, answer, rng):
        loss, grads = jax.value_and_grad(loss_fn)(state["params"], tokens, mask, answer, rng)
        updates, opt = optimizer.update(grads, state["opt"], state["params"])
        return {"params": optax.apply_updates(state["params"], updates), "opt": opt}, loss

    print(f"model: {sum(leaf.size for leaf in jax.tree.leaves(params)) / 1e6:.2f}M parameters, {config}")
    t0, ema = time.time(), None
    steps = range(start, start if args.export_only else cfg.steps)
    bar = tqdm(steps, initial=start, total=cfg.steps, desc="train", dynamic_ncols=True, disable=args.export_only)
    completed = start
    try:
        with cli.stopping_between_steps():  # a Ctrl-C lands between two steps, never inside a save
            for step in bar:
                cli.stop_if_asked()
                batch = make_batch(step, cfg, tok)
                state, loss = train_step(state, *batch, jax.random.fold_in(jax.random.key(cfg.seed + 1), step))
                completed = step + 1
                if step % 10 == 0:
                    loss = float(loss)
                    ema = loss if ema is None else 0.9 * ema + 0.1 * loss
                    bar.set_postfix(loss=f"{ema:.3f}", lr=f"{float(schedule(step)):.1e}")
                if completed % args.save_every == 0 or completed == cfg.steps:
                    manager.save(completed, args=ocp.args.StandardSave(state))
                    manager.wait_until_finished()
                    saved["step"] = completed
    except KeyboardInterrupt as e:
        # Keep every finished step: save the state now, then let the same command resume from it.
        if completed != manager.latest_step():
            manager.save(completed, args=ocp.args.StandardSave(state), force=True)
        manager.wait_until_finished()
        saved["step"] = completed
        bar.close()
        print(f"interrupted ({str(e) or 'Ctrl-C'}) after step {completed}; state saved in {out / 'train_state'}; "
              "rerun the same command to resume", file=sys.stderr)
        return cli.EXIT_INTERRUPTED
    manager.wait_until_finished()
    seconds = time.time() - t0

    export = Path(args.export or out / "checkpoint").resolve()
    if export.exists():
        print(f"{export} exists; not overwriting it")
        return 0
    log = {"train_config": dataclasses.asdict(cfg), "train_seconds_this_run": round(seconds, 1),
           "resumed_from_step": start, "exported_at_step": start + len(steps), "hardware": f"{platform.processor() or platform.machine()}, "
           f"{os.cpu_count()} CPU cores, jax {jax.__version__} on {jax.default_backend()}",
           "final_loss_ema": ema}
    if objective.name:
        log |= {"family": args.family} | ({"block_size": block_size} if objective.blocks else {}) | {
            "objective": objective.name}
    if warm:
        log |= {"warm_start": warm}
    if objective.name or init_from:
        log |= {"command": " ".join(["python", "experiments/train_tiny.py", *(argv if argv is not None
                                                                              else sys.argv[1:])])}
    if objective.readme:
        readme = objective.readme(cfg, config, log, args.init_from)
    else:
        readme = (f"# Small LLaDA-architecture model trained by experiments/train_tiny.py\n\n"
                  f"```\n{json.dumps(log, indent=2)}\n```\n")
    checkpoint.save(export, config, state["params"], out / "tokenizer",
                    manifest={"source": "experiments/train_tiny.py", "training": log,
                              # what experiments/eval_gsm8k.py runs on this model when given no flags
                              "eval_data": "synthetic_math", "eval_data_spec": {"n": 500, "seed": cfg.seed}
                              | ({"task": cfg.task} if cfg.task != "math" else {}),
                              "eval_defaults": {"gen_length": cfg.gen_length,
                                                "block_length": objective.decode_block(cfg, config),
                                                "num_fewshot": 0}
                              # the chain tasks are where committing early should cost accuracy: their default
                              # run puts the low threshold beside the paper's settings
                              | ({"strategies": CHAIN_STRATEGIES} if cfg.task != "math" else {})},
                    readme=readme)
    print(f"wrote {export}")
    return 0
