"""One GPU, nothing downloaded: the JAX side next to PyTorch and Fast-dLLM's loops at LLaDA-8B's shape, in one run.

    python experiments/gpu_report.py                      # one GPU: random bf16 weights, under 8 min on an H200
    python experiments/gpu_report.py --shape small        # CPU: every section at a small shape (a couple of minutes)
    python experiments/gpu_report.py --json out/report.json --budget-s 420

Weights: `bench_common.random_model(shape)` (bf16 on GPU, fp32 on CPU); the PyTorch side is transformers'
LlamaForCausalLM holding the same tensors (`bench_common.torch_twin`: device to device through dlpack, no host
copy). Every number is measured in this run, so each ratio compares the two sides on the same machine.

Sections, printed with their elapsed time and written to --json (default runs/gpu_report/<shape>.json, under the
current directory):
  forward     one bidirectional forward to logits [B, L, V] at L=--length (1152): ms and TFLOP/s, JAX's
              `model.forward` vs transformers' Llama with a boolean 4D mask; ratio torch ms / JAX ms
  caches      ms per step and tokens/s for every cache mode (none / prefix / dual): JAX `ll.generate(cache=m)` vs
              Fast-dLLM's loop of that mode (oracles.fast_dllm), low_confidence pinned at
              --tokens-per-step (random weights give flat confidences, so thresholds would commit one token a
              step); ratio JAX tokens/s / Fast-dLLM tokens/s, and whether the tokens agree (bf16 on two stacks
              with flat confidences: expect them to drift apart; agreement is checked in the fp32 tests)
  localleap   LocalLeap (default settings) + dual cache: JAX vs the PyTorch LocalLeap loop (Fast-dLLM's dual loop
              with reference_rules' eager LocalLeap rule); ratio of tokens/s
  memory      peak device memory: JAX (`memory_stats()["peak_bytes_in_use"]`) and torch (`max_memory_allocated`),
              both holding their copy of the weights (the twin's transposed copies are JAX arrays too: this is
              the benchmark's peak, not the decoder's)
  decoder memory  the decoder's own peak, measured first, in a subprocess that never imports torch nor builds the
              twin (`--decoder-memory-only`): the weights, then `ll.generate` in every cache mode at each batch;
              its device's peak bytes in use (host peak RSS where the device reports none: CPU), against the
              parameters + the K/V cache of the largest batch (the issue's goal at B=1: peak <= 1.1x that), and
              each compiled program's own footprint (XLA's memory_analysis: arguments + temporaries)
and the attention path JAX chose (`localleap_jax.model.attention_implementation`).

Time boxes: --budget-s (default 400 s) is the whole report's; each section gets a share (less when the report runs
behind); before each measurement its cost is predicted from what this run measured so far (forward time or steps at
that batch, compile times) and the measurement is skipped, with a note, if it would not fit what is left of its
section. JAX runs once per setting (`ll.generate` times its compile apart from the run); the Fast-dLLM loop runs
once, torch warmed up by the forward section. Tokens/s counts every generated position (B x gen_length).

Threads (--threads, default 1; CPU only): the same count on both sides, set before torch and jax are imported.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from bench_threads import N_THREADS  # noqa: F401 (before jax and torch: it sets their threads)
from bench_common import forward_flops, median_seconds, on_gpu, random_model, torch_sync, torch_twin
from localleap_jax import cli

import jax
import jax.numpy as jnp
import numpy as np

# Per shape: forward length, prompt + generation (prompt = length - gen_length), block, batches.
SHAPE_DEFAULTS = {
    "llada-8b": dict(length=1152, gen_length=256, block_length=32, batch="1,8"),
    "small": dict(length=256, gen_length=64, block_length=16, batch="1,8"),
}
SHARES = {"forward": 0.15, "caches": 0.5, "localleap": 0.25}  # of --budget-s, in this order; the rest: setup
MODE_COST = {"none": 1.0, "prefix": 0.6, "dual": 0.3}  # a pass's cost relative to a full forward, upper-ish


class Section:
    """A time-boxed part of the report: `fits(predicted_s)` says whether a measurement still fits its share.

    Its allowance: its share of the budget, or, when the report runs behind (a slow setup or section), that
    share's part of the time left, so the later sections keep theirs."""

    def __init__(self, name: str, report: dict, budget_s: float, t_start: float):
        names = list(SHARES)
        later = sum(SHARES[n] for n in names[names.index(name):])
        left = budget_s - (time.perf_counter() - t_start)
        self.name, self.allowance = name, max(0.0, min(SHARES[name] * budget_s, left * SHARES[name] / later))
        self.out = report.setdefault("sections", {}).setdefault(name, {"rows": [], "skipped": []})

    def __enter__(self):
        self.t0 = time.perf_counter()
        print(f"\n== {self.name} (time box {self.allowance:.0f} s)")
        return self

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def fits(self, what: str, predicted_s: float) -> bool:
        left = self.allowance - self.elapsed()
        if predicted_s <= left:
            return True
        note = f"{what}: skipped (predicted {predicted_s:.0f} s, {left:.0f} s left in this section)"
        print("   " + note)
        self.out["skipped"].append(note)
        return False

    def __exit__(self, *exc):
        self.out["seconds"] = self.elapsed()
        print(f"   [{self.name}: {self.out['seconds']:.1f} s]")


def device_memory() -> dict:
    """Peak bytes in use so far on the first device, per side (None where the backend does not say)."""
    stats = jax.devices()[0].memory_stats() or {}
    out = {"jax_peak_bytes": stats.get("peak_bytes_in_use")}
    import torch
    out["torch_peak_bytes"] = torch.cuda.max_memory_allocated() if torch.cuda.is_available() else None
    return out


def random_prompts(config, B: int, P: int, seed: int) -> np.ndarray:
    """[B, P] int32 ids away from the special ids at the top of the vocabulary."""
    return np.random.RandomState(seed).randint(0, config.vocab_size - 1000, (B, P)).astype(np.int32)


# ------------------------------------------------------------------------------------------------ sections


def forward_section(sec: Section, model, twin, batches, L: int, reps: int) -> dict:
    """-> {B: seconds of the slower side's forward} (what the later sections predict their cost from)."""
    import torch

    from localleap_jax.model import forward
    from oracles.bidirectional import bidirectional_logits

    fwd = jax.jit(forward, static_argnames="config")
    tmodel, device = twin
    per_batch = {}
    print(f"{'B':>3} {'JAX ms':>9} {'JAX TFLOP/s':>12} {'torch ms':>9} {'torch TFLOP/s':>14} {'torch/JAX':>10}"
          f"{'compile s':>10}")
    for B in batches:
        if per_batch:  # scale the last measurement: reps + warmups on both sides, and a compile
            b0, s0 = max(per_batch.items())
            if not sec.fits(f"forward B={B}", s0 * B / b0 * (reps + 2) * 2 + sec.out["rows"][-1]["compile_s"]):
                continue
        ids = random_prompts(model.config, B, L, seed=B)
        ids_d, mask_d = jax.device_put(ids), jax.device_put(np.ones_like(ids, bool))
        t0 = time.perf_counter()
        fwd(model.params, ids_d, mask_d, config=model.config).block_until_ready()
        compile_s = time.perf_counter() - t0
        jax_s = median_seconds(lambda: fwd(model.params, ids_d, mask_d, config=model.config).block_until_ready(),
                               reps=reps, warmup=1)
        t_ids = torch.tensor(ids, device=device)
        t_mask = torch.ones_like(t_ids, dtype=torch.bool)
        torch_s = median_seconds(lambda: (bidirectional_logits(tmodel, t_ids, t_mask), torch_sync()), reps=reps,
                                 warmup=1)
        flops = forward_flops(model.config, B, L)
        row = {"batch": B, "length": L, "jax_ms": jax_s * 1e3, "jax_tflops": flops / jax_s / 1e12,
               "torch_ms": torch_s * 1e3, "torch_tflops": flops / torch_s / 1e12, "torch_over_jax": torch_s / jax_s,
               "compile_s": compile_s}
        sec.out["rows"].append(row)
        per_batch[B] = max(jax_s, torch_s)
        print(f"{B:>3} {row['jax_ms']:>9.2f} {row['jax_tflops']:>12.2f} {row['torch_ms']:>9.2f} "
              f"{row['torch_tflops']:>14.2f} {row['torch_over_jax']:>9.2f}x{compile_s:>10.1f}")
    return per_batch


def forward_seconds(per_batch: dict, B: int) -> float:
    """A full forward at batch B, from the forward section (scaled from the nearest batch measured)."""
    if B in per_batch:
        return per_batch[B]
    b0 = min(per_batch, key=lambda b: abs(b - B))
    return per_batch[b0] * B / b0


def decode_pair(model, twin, ids, *, strategy: str, cache: str, G: int, T: int, steps: int | None) -> dict:
    """JAX `generate` (one call: its compile reported apart) next to Fast-dLLM's loop of the same mode."""
    import torch

    import localleap_jax as ll
    from oracles import fast_dllm as reference_fast_dllm, rules as reference_rules

    B, P = ids.shape
    rule = ll.rule(strategy, steps=steps) if strategy == "low_confidence" else ll.rule(strategy)
    cfg = ll.DecodeConfig(strategy=rule, gen_length=G, block_length=T, cache=cache)
    out = ll.generate(model, jax.device_put(ids), None, cfg)
    rule = {"steps": steps} if strategy == "low_confidence" else {"rule": reference_rules.make(strategy)}
    tmodel, device = twin
    t_ids = torch.tensor(ids, dtype=torch.long, device=device)
    torch_sync()
    t0 = time.perf_counter()
    fast = reference_fast_dllm.LOOPS[cache](tmodel, t_ids, gen_length=G, block_length=T,
                                            mask_id=model.config.mask_token_id, **rule)
    torch_sync()
    fast_s = time.perf_counter() - t0
    x = fast.x.cpu().numpy()
    same_rows = int((out.tokens[:, P:] == x[:, P:]).all(axis=1).sum())
    jax_tps, fast_tps = B * G / out.seconds, B * G / fast_s
    return {"batch": B, "strategy": strategy, "cache": cache, "jax_passes": out.forward_passes,
            "fast_dllm_passes": fast.nfe, "jax_ms_per_step": out.seconds / out.forward_passes * 1e3,
            "fast_dllm_ms_per_step": fast_s / fast.nfe * 1e3, "jax_tokens_per_s": jax_tps,
            "fast_dllm_tokens_per_s": fast_tps, "jax_over_fast_dllm": jax_tps / fast_tps,
            "rows_agree": same_rows, "jax_compile_s": out.compile_seconds, "jax_s": out.seconds,
            "fast_dllm_s": fast_s}


def print_decode_header():
    print(f"{'B':>3} {'strategy':<15}{'cache':<7}{'passes jax/fd':>14}{'jax ms/step':>12}{'fd ms/step':>11}"
          f"{'jax tok/s':>10}{'fd tok/s':>9}{'jax/fd':>8}{'rows same':>10}{'compile s':>10}")


def print_decode_row(r: dict):
    print(f"{r['batch']:>3} {r['strategy']:<15}{r['cache']:<7}{str(r['jax_passes']) + '/' + str(r['fast_dllm_passes']):>14}"
          f"{r['jax_ms_per_step']:>12.2f}{r['fast_dllm_ms_per_step']:>11.2f}{r['jax_tokens_per_s']:>10.1f}"
          f"{r['fast_dllm_tokens_per_s']:>9.1f}{r['jax_over_fast_dllm']:>7.2f}x{r['rows_agree']:>7}/{r['batch']}"
          f"{r['jax_compile_s']:>10.1f}")


def predicted_decode_s(report: dict, per_batch: dict, B: int, cache: str, passes: int, G: int, T: int) -> float:
    """Both sides' run plus JAX's compile (the slowest decode compile so far; a guess before the first): from the
    steps measured at this mode and batch if any, else a full forward per block and MODE_COST of one for the rest."""
    rows = [r for name in ("caches", "localleap") for r in report["sections"].get(name, {}).get("rows", [])]
    compile_s = max([r["jax_compile_s"] for r in rows] or [30.0 if on_gpu() else 5.0])
    same = [r for r in rows if (r["batch"], r["cache"]) == (B, cache)]
    if same:  # this mode and batch ran already: its steps' cost, measured (a margin for another rule's loop)
        return 1.3 * passes * (same[-1]["jax_ms_per_step"] + same[-1]["fast_dllm_ms_per_step"]) / 1e3 + compile_s
    f = forward_seconds(per_batch, B)
    blocks = G // T
    run = blocks * f + max(passes - blocks, 0) * f * MODE_COST[cache]
    return 2.3 * run + compile_s  # both sides, torch's with a float64 softmax on top


def decode_section(sec: Section, report, model, twin, per_batch, batches, modes, *, strategy, G, T, P, steps,
                   passes):
    print_decode_header()
    for B in batches:
        for cache in modes:
            what = f"{strategy} {cache} B={B}"
            if not sec.fits(what, predicted_decode_s(report, per_batch, B, cache, passes, G, T)):
                continue
            row = decode_pair(model, twin, random_prompts(model.config, B, P, seed=100 + B), strategy=strategy,
                              cache=cache, G=G, T=T, steps=steps)
            sec.out["rows"].append(row)
            print_decode_row(row)


# ------------------------------------------------------------------------------------------------ decoder memory


def tree_bytes(tree) -> int:
    return sum(int(np.prod(a.shape)) * a.dtype.itemsize for a in jax.tree.leaves(tree))


def decoder_memory(args, dtype) -> dict:
    """In this process, which has not imported torch (checked): the decoder alone, every cache mode at each batch."""
    import resource

    import localleap_jax as ll
    from localleap_jax.compile_cache import compiled_programs

    model = random_model(args.shape, dtype)
    jax.block_until_ready(model.params)
    c = model.config
    L, G, T = args.length, args.gen_length, args.block_length
    P = L - G
    params = tree_bytes(model.params)
    rows = []
    for B in [int(b) for b in args.batch.split(",")]:
        kv = 2 * c.n_layers * B * L * c.n_kv_heads * c.head_dim * dtype.itemsize
        for cache in ("none", "prefix", "dual"):
            rule = ll.rule("low_confidence", steps=G // args.tokens_per_step)
            out = ll.generate(model, random_prompts(c, B, P, seed=B), None,
                              ll.DecodeConfig(strategy=rule, gen_length=G, block_length=T, cache=cache))
            program = compiled_programs()[-1].executable.memory_analysis()
            footprint = program.argument_size_in_bytes + program.temp_size_in_bytes + program.output_size_in_bytes
            rows.append({"batch": B, "cache": cache, "passes": out.forward_passes, "kv_bytes": kv,
                         "program_bytes": int(footprint), "program_temp_bytes": int(program.temp_size_in_bytes)})
            print(f"   B={B} {cache:6s} program: arguments + temporaries {footprint / 2**30:.3f} GiB (temporaries "
                  f"{program.temp_size_in_bytes / 2**30:.3f}; K/V {kv / 2**30:.3f})")
    stats = jax.devices()[0].memory_stats() or {}
    peak = stats.get("peak_bytes_in_use")
    source = "device peak_bytes_in_use"
    if peak is None:  # CPU: the process's peak resident memory (runtime and Python included)
        peak, source = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "host peak RSS"
    largest = max(r["kv_bytes"] for r in rows)
    return {"torch_imported": "torch" in sys.modules, "device": jax.devices()[0].device_kind, "peak_bytes": int(peak),
            "peak_source": source, "param_bytes": params, "kv_bytes_largest_batch": largest,
            "peak_over_params_and_kv": peak / (params + largest), "rows": rows}


def run_decoder_memory(args) -> dict:
    """`decoder_memory` in a fresh process (this one will build the twin): its report, or why it has none."""
    import subprocess
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "decoder.json"
        flags = ["--shape", args.shape, "--length", str(args.length), "--gen-length", str(args.gen_length),
                 "--block-length", str(args.block_length), "--batch", args.batch, "--tokens-per-step",
                 str(args.tokens_per_step), "--threads", str(args.threads), "--json", str(out),
                 "--decoder-memory-only"] + (["--dtype", args.dtype] if args.dtype else [])
        run = subprocess.run([sys.executable, str(Path(__file__).resolve()), *flags], capture_output=True, text=True)
        print(run.stdout.rstrip())
        if run.returncode != 0 or not out.exists():
            return {"error": (run.stderr.strip().splitlines() or ["no output"])[-1]}
        return json.loads(out.read_text())


# ------------------------------------------------------------------------------------------------ main


def main(argv=None) -> dict:
    ap = cli.OneLineParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="llada-8b", choices=sorted(SHAPE_DEFAULTS))
    ap.add_argument("--length", type=int, help="forward length L and the decode canvas (prompt + generation)")
    ap.add_argument("--gen-length", type=int)
    ap.add_argument("--block-length", type=int)
    ap.add_argument("--batch", help="comma-separated batch sizes")
    ap.add_argument("--tokens-per-step", type=int, default=4, help="low_confidence's pinned schedule")
    ap.add_argument("--dtype", default=None, help="bfloat16 on GPU, float32 on CPU")
    ap.add_argument("--reps", type=int, default=3, help="forward: median of this many")
    ap.add_argument("--budget-s", type=float, default=400.0, help="time for the whole report (sections share it)")
    ap.add_argument("--threads", type=int, default=1, help="CPU threads on both sides (read by bench_threads)")
    ap.add_argument("--json", help="where the report goes besides the printout (default "
                                   "runs/gpu_report/<shape>.json, under the current directory)")
    ap.add_argument("--decoder-memory-only", action="store_true",
                    help="only the decoder's memory, in this process (no torch): what the report runs first")
    args = ap.parse_args(argv)
    args.json = Path(args.json or Path("runs") / "gpu_report" / f"{args.shape}.json").expanduser().resolve()
    # checked before minutes of measuring, nothing left behind
    cli.check_writable_dir(args.json.parent, "--json", args.json)
    if args.json.is_dir():
        ap.error(f"argument --json: {args.json} is a directory; name the report's file")
    for k, v in SHAPE_DEFAULTS[args.shape].items():
        if getattr(args, k) is None:
            setattr(args, k, v)

    if args.decoder_memory_only:
        report = decoder_memory(args, jnp.dtype(args.dtype or ("bfloat16" if on_gpu() else "float32")))
        Path(args.json).write_text(json.dumps(report, indent=2))
        return report
    print("== decoder memory (a process without torch or the twin)")
    t0 = time.perf_counter()
    decoder = run_decoder_memory(args)
    decoder["seconds"] = time.perf_counter() - t0
    if "peak_bytes" in decoder:
        print(f"   decoder peak ({decoder['peak_source']}): {decoder['peak_bytes'] / 2**30:.2f} GiB = "
              f"{decoder['peak_over_params_and_kv']:.2f}x parameters {decoder['param_bytes'] / 2**30:.2f} GiB + K/V "
              f"{decoder['kv_bytes_largest_batch'] / 2**30:.2f} GiB  [{decoder['seconds']:.1f} s]")
    else:
        print(f"   not measured: {decoder['error']}")

    import torch

    from localleap_jax.model import attention_implementation

    torch.set_num_threads(N_THREADS)
    t_start = time.perf_counter()
    dtype = jnp.dtype(args.dtype or ("bfloat16" if on_gpu() else "float32"))
    batches = [int(b) for b in args.batch.split(",")]
    L, G, T = args.length, args.gen_length, args.block_length
    P = L - G
    steps = G // args.tokens_per_step

    model = random_model(args.shape, dtype)
    jax.block_until_ready(model.params)
    twin = torch_twin(model)
    setup_s = time.perf_counter() - t_start
    c = model.config
    attn = attention_implementation(dtype.name, c.head_dim, c.n_heads, c.n_kv_heads, args.length)
    report = {"device": jax.devices()[0].device_kind, "torch_device": twin[1], "shape": args.shape,
              "dtype": dtype.name, "params": model.config.num_params, "attention_implementation": attn,
              "config": {"length": L, "prompt_length": P, "gen_length": G, "block_length": T, "batches": batches,
                         "tokens_per_step": args.tokens_per_step, "budget_s": args.budget_s, "threads": N_THREADS},
              "sections": {"setup": {"seconds": setup_s}}, "decoder_memory": decoder}
    print(f"{report['device']} (torch on {twin[1]}): {args.shape}, {model.config.num_params / 1e9:.2f}B params, "
          f"{dtype.name}; JAX attention: {attn}; setup {setup_s:.1f} s")

    with Section("forward", report, args.budget_s, t_start) as sec:
        per_batch = forward_section(sec, model, twin, batches, L, args.reps)
    report["memory_after_forward"] = device_memory()
    if not per_batch:
        raise SystemExit("the forward section measured nothing: no time left for the rest")

    with Section("caches", report, args.budget_s, t_start) as sec:
        print(f"   low_confidence pinned at {args.tokens_per_step} tokens/step; prompt {P} + gen {G}, block {T}")
        decode_section(sec, report, model, twin, per_batch, batches, ("none", "prefix", "dual"), strategy="low_confidence",
                       G=G, T=T, P=P, steps=steps, passes=steps)
    with Section("localleap", report, args.budget_s, t_start) as sec:
        print("   LocalLeap (kappa 0.9, tau 0.75, radius 4) + dual: JAX vs the PyTorch LocalLeap loop")
        # Random weights: rarely a confident token, so about one commit per step (G passes) on both sides.
        decode_section(sec, report, model, twin, per_batch, batches, ("dual",), strategy="localleap", G=G, T=T, P=P,
                       steps=None, passes=G)

    report["memory"] = device_memory()
    report["total_seconds"] = time.perf_counter() - t_start
    mem = report["memory"]
    gib = lambda b: "n/a" if b is None else f"{b / 2**30:.2f} GiB"  # noqa: E731
    print(f"\npeak device memory with the twin (the benchmark's): JAX {gib(mem['jax_peak_bytes'])}, torch "
          f"{gib(mem['torch_peak_bytes'])}; the decoder's alone: {gib(decoder.get('peak_bytes'))}")
    print(f"total {report['total_seconds']:.1f} s")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    tmp = args.json.with_name(f".{args.json.name}.tmp")
    tmp.write_text(json.dumps(report, indent=2))
    tmp.replace(args.json)
    print(f"written {args.json}")
    return report


if __name__ == "__main__":
    cli.guard_startup()  # this process is the command's: a Ctrl-C is answered within seconds, even mid-measurement
    sys.exit(cli.run_command(lambda: main() and 0))  # main returns the report it wrote
