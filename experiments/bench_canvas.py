"""What a canvas model's encoder costs in the one loop: rows that start their canvases at the same passes vs at
different passes, side by side in one run.

    python experiments/bench_canvas.py                   # a CPU-sized random DiffusionGemma, 8 rows, 4 canvases
    python experiments/bench_canvas.py --rows 16 --canvas 64 --d-model 512

DiffusionGemma's loop (decode/cache.py `CanvasEncoderCache`) encodes a row's finished canvas on the row's first
pass in its next canvas, and a pass in which any row does so runs the encoder over the whole batch (a `lax.cond`:
passes where no row starts run the decoder alone). Rows start together when every row takes the same passes per
canvas; they drift apart when they stop at different passes (the rule's stop; here each row is given its own
`max_denoising_steps`, a per-row setting, so the drift does not depend on what a random model predicts). Printed per
case: passes, passes that ran the encoder, wall time (compilation excluded), time per pass; then one decoder pass
and one encoder pass over the batch timed alone, the share of the generation spent encoding, and what encoding
only the rows that start would save at most (the encoder's time x the share of rows that did not start).
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from localleap_jax import cli


def dg_config(d_model: int, vocab: int, canvas: int):
    from localleap_jax.families import read_config

    heads = max(d_model // 64, 2)
    text = dict(vocab_size=vocab, hidden_size=d_model, intermediate_size=2 * d_model, num_hidden_layers=4,
                num_attention_heads=heads, num_key_value_heads=max(heads // 2, 1), head_dim=64, global_head_dim=128,
                num_global_key_value_heads=1, sliding_window=64,
                layer_types=["sliding_attention", "sliding_attention", "sliding_attention", "full_attention"],
                num_experts=8, top_k_experts=2, moe_intermediate_size=d_model // 2, max_position_embeddings=4096,
                eos_token_id=1, pad_token_id=0, bos_token_id=2)
    return read_config({"model_type": "diffusion_gemma", "text_config": text, "canvas_length": canvas})


def best_of(fn, repeats: int) -> float:
    fn()  # compiled and run once
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def main(argv=None):
    ap = cli.OneLineParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--canvas", type=int, default=32, help="canvas_length")
    ap.add_argument("--canvases", type=int, default=4, help="canvases per row (gen_length = canvases x canvas)")
    ap.add_argument("--prompt", type=int, default=32, help="prompt tokens per row")
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--steps", type=int, default=8, help="max_denoising_steps of every row when they start together; "
                                                          "apart, row b takes steps - b % 4 ... (4 different counts)")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)
    if args.steps < 4:
        ap.error("--steps must be at least 4 (rows apart take steps - 3 ... steps passes a canvas)")

    import jax
    import jax.numpy as jnp

    import localleap_jax as ll
    from localleap_jax.families import init_params
    from localleap_jax.loaded import Model

    config = dg_config(args.d_model, args.vocab, args.canvas)
    model = Model(config, jax.jit(lambda k: init_params(config, k, jnp.float32))(jax.random.key(0)), None)
    B, C, J = args.rows, args.canvas, args.canvases
    ids = np.random.default_rng(0).integers(3, args.vocab, (B, args.prompt)).astype(np.int32)
    mask = np.ones(ids.shape, bool)
    print(f"random DiffusionGemma d_model {args.d_model}, 4 layers, 8 experts, vocab {args.vocab}; {B} rows, prompt "
          f"{args.prompt}, {J} canvases of {C}, {jax.default_backend()}")
    print(f"{'rows start':<12}{'passes':>8}{'encoder':>9}{'seconds':>9}{'ms/pass':>9}")
    apart_steps = args.steps - np.arange(B) % 4
    cases = {}
    for label, steps in (("together", np.full(B, args.steps)), ("apart", apart_steps)):
        # confidence 1e-9: no early stop; every canvas runs its row's max_denoising_steps
        rule = ll.rules.EntropyBound(max_denoising_steps=steps, confidence_threshold=1e-9)
        cfg = ll.DecodeConfig(strategy=rule, gen_length=J * C, block_length=C)
        out = ll.generate(model, ids, mask, cfg, jax.random.key(1))
        seconds = best_of(lambda: ll.generate(model, ids, mask, cfg, jax.random.key(1)), args.repeats)
        cases[label] = (out.forward_passes, out.full_passes, seconds)
        print(f"{label:<12}{out.forward_passes:>8}{out.full_passes:>9}{seconds:>9.3f}"
              f"{1e3 * seconds / out.forward_passes:>9.2f}")

    # One decoder pass and one encoder pass (a canvas of C for every row) over the batch, alone.
    den = model.denoiser
    cache = den.encode(den.empty_cache(B, args.prompt + J * C), jnp.asarray(ids), jnp.asarray(mask))
    canvas = jnp.asarray(np.random.default_rng(1).integers(0, args.vocab, (B, C)), jnp.int32)
    soft = den.no_soft(B, C)
    decode = jax.jit(lambda c, x: den.decode(c, x, soft))
    encode = jax.jit(lambda c, x: den.encode(c, x, jnp.ones(x.shape, bool), jnp.ones((B,), bool)))
    t_dec = best_of(lambda: jax.block_until_ready(decode(cache, canvas)), 5 * args.repeats)
    t_enc = best_of(lambda: jax.block_until_ready(encode(cache, canvas)), 5 * args.repeats)
    print(f"alone: one decoder pass {1e3 * t_dec:.2f} ms, one encoder pass {1e3 * t_enc:.2f} ms over {B} rows "
          f"(encoder/decoder {t_enc / t_dec:.2f})")
    for label, (passes, encoder, seconds) in cases.items():
        starts = B * (J - 1)  # canvases started after a row's first: each encodes one finished canvas
        share = encoder * t_enc / seconds
        saved = encoder * t_enc * (1 - starts / (encoder * B)) / seconds
        print(f"{label}: encoder on {encoder}/{passes} passes ({starts / encoder:.1f} of {B} rows starting per such "
              f"pass): ~{100 * share:.0f}% of the time encoding; encoding only the starting rows would save at most "
              f"~{100 * saved:.0f}%")
    t_apart, t_together = cases["apart"][2] / cases["apart"][0], cases["together"][2] / cases["together"][0]
    print(f"time per pass apart / together: {t_apart / t_together:.2f}")


if __name__ == "__main__":
    cli.guard_startup()  # this process is the command's: Ctrl-C answered within seconds (localleap_jax.cli)
    raise SystemExit(cli.run_command(main))
