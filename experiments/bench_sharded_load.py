"""Host memory of loading a checkpoint whole vs straight into shards, side by side.

    python experiments/bench_sharded_load.py                         # ~2 GB synthetic LLaDA-shaped checkpoint
    python experiments/bench_sharded_load.py --layers 2 --vocab 8000  # a quick one
    python experiments/bench_sharded_load.py --checkpoint DIR        # an existing checkpoint

Writes a checkpoint of random LLaDA-shaped fp32 weights (d_model 2048, --layers blocks) with
`checkpoint.save`, then loads it in fresh processes, one way each:

  whole             ll.load(path): the whole model on one device
  whole-then-shard  ll.load(path), then shard_params onto model=4 (what a mesh cost before loading
                    went straight into shards)
  sharded           ll.load(path, mesh=make_mesh(1, 4)) on 4 CPU devices of one process
  sharded-2proc     the same mesh over 2 processes x 2 CPU devices (jax.distributed, gloo): each
                    process restores only its own devices' shards

and prints, per process: RSS before loading (JAX started and the libraries warm: the small
embedded model loaded the same way first), peak RSS (VmHWM), the peak's excess
over the start, and the parameter bytes each device holds (from the arrays' addressable shards).
On CPU a device's memory is host memory, so a process's RSS includes its devices' shards: "model=4,
1 process" still holds the whole model in one process (in four quarters); the two-process rows are
the ones where no process ever holds all of it.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from localleap_jax.families import read_config_file

from localleap_jax import cli

REPO = Path(__file__).resolve().parents[1]

# mode -> (what it does, CPU devices per process, processes)
MODES = {"whole": ("one device", 1, 1), "whole-then-shard": ("one device, then shard", 4, 1),
         "sharded": ("model=4, 1 process", 4, 1), "sharded-2proc": ("model=4, 2 processes", 2, 2)}


def rss_mb() -> float:
    """Resident memory now (VmRSS)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def peak_rss_mb() -> float:
    """This process image's peak RSS (VmHWM). Not getrusage's ru_maxrss: Linux carries that across exec, so
    a child forked from this script's parent (which wrote the checkpoint) would report the parent's peak."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024  # kB
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # not Linux: the best there is


# ---------------------------------------------------------------- writing the checkpoint


def synthetic_config(layers: int, vocab: int, d_model: int):
    from localleap_jax.checkpoint import EMBEDDED
    from localleap_jax.config import ModelConfig

    tiny = read_config_file(EMBEDDED / "config.json")  # its tokenizer and special ids
    return ModelConfig(d_model=d_model, n_heads=16, n_kv_heads=16, n_layers=layers, mlp_hidden_size=5632,
                       vocab_size=tiny.vocab_size, embedding_size=vocab, rope_theta=500000.0,
                       max_sequence_length=4096, mask_token_id=tiny.mask_token_id, eos_token_id=tiny.eos_token_id,
                       pad_token_id=tiny.pad_token_id)


def write_checkpoint(path: Path, layers: int, vocab: int, d_model: int, chunk_bytes: int | None) -> float:
    """Random fp32 weights of that shape, saved with checkpoint.save; returns their bytes."""
    import jax

    from localleap_jax import checkpoint
    from localleap_jax.model import init_params

    config = synthetic_config(layers, vocab, d_model)
    params = jax.jit(lambda k: init_params(config, k, "float32"))(jax.random.key(0))
    checkpoint.save(path, config, params, checkpoint.EMBEDDED, manifest={"source": "bench_sharded_load (random)"},
                    chunk_bytes=chunk_bytes)
    return sum(a.nbytes for a in jax.tree.leaves(params))


# ---------------------------------------------------------------- one measurement (a child process)


def measure(mode: str, path: str, verify: bool, process_id: int | None, port: int | None) -> dict:
    if process_id is not None:
        from localleap_jax import processes
        processes.initialize(processes.Processes(f"localhost:{port}", 2, process_id))
    import jax

    import localleap_jax as ll
    from localleap_jax.dist.mesh import addressable_bytes, shard_params
    from localleap_jax.partition import make_mesh

    # Start the backend and load the small embedded model once (Orbax, TensorStore and the tokenizer
    # libraries imported and warm): what they take is not this checkpoint's loading.
    ll.load(ll.checkpoint.EMBEDDED, dtype="float32", verify=verify,
            mesh=None if mode.startswith("whole") else make_mesh(1, 4))
    start = rss_mb()
    t0 = time.perf_counter()
    if mode in ("whole", "whole-then-shard"):
        model = ll.load(path, dtype="float32", verify=verify)
        params = model.params
        if mode == "whole-then-shard":
            params = jax.block_until_ready(shard_params(params, make_mesh(1, 4)))
            del model  # the whole copy goes once the shards exist
    else:
        params = ll.load(path, dtype="float32", verify=verify, mesh=make_mesh(1, 4)).params
    seconds = time.perf_counter() - t0
    per_device = {str(d): b for d, b in sorted(addressable_bytes(params).items(), key=lambda kv: kv[0].id)}
    return {"mode": mode, "process": jax.process_index(), "start_mb": start, "peak_mb": peak_rss_mb(),
            "end_mb": rss_mb(), "seconds": seconds, "per_device": per_device}


def run_mode(mode: str, path: Path, verify: bool) -> list[dict]:
    """Measure one mode in fresh processes (each starts from an empty heap)."""
    _, devices, processes = MODES[mode]
    env = {**os.environ, "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}", "JAX_PLATFORMS": "cpu",
           "PYTHONPATH": str(REPO)}
    base = [sys.executable, __file__, "--child", mode, "--checkpoint", str(path)] + ([] if verify else ["--no-verify"])
    if processes == 1:
        return [json.loads(subprocess.run(base, env=env, check=True, capture_output=True, text=True)
                           .stdout.strip().splitlines()[-1])]
    with socket.socket() as s:
        s.bind(("localhost", 0))
        port = s.getsockname()[1]
    procs = [subprocess.Popen([*base, "--process-id", str(i), "--port", str(port)], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for i in (0, 1)]
    try:
        outs = [p.communicate(timeout=900) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for p, (_, err) in zip(procs, outs):
        if p.returncode:
            raise RuntimeError(f"{mode}: a process failed: {err[-2000:]}")
    return [json.loads(out.strip().splitlines()[-1]) for out, _ in outs]


def print_table(rows: list[dict], model_mb: float) -> None:
    print(f"\nparameters: {model_mb:.0f} MB in all; a quarter: {model_mb / 4:.0f} MB")
    print(f"{'load':<24}{'process':>8}{'RSS start':>11}{'peak RSS':>10}{'peak - start':>14}{'end RSS':>9}"
          f"{'seconds':>9}   per-device parameter MB")
    for r in rows:
        devices = " ".join(f"{b / 2**20:.0f}" for b in r["per_device"].values())
        print(f"{MODES[r['mode']][0]:<24}{r['process']:>8}{r['start_mb']:>11.0f}{r['peak_mb']:>10.0f}"
              f"{r['peak_mb'] - r['start_mb']:>14.0f}{r['end_mb']:>9.0f}{r['seconds']:>9.1f}   {devices}")


def main(argv=None) -> int:
    ap = cli.OneLineParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", help="measure this checkpoint instead of writing a synthetic one")
    ap.add_argument("--keep", help="write the synthetic checkpoint here and keep it (reuse it with --checkpoint)")
    ap.add_argument("--layers", type=int, default=7)
    ap.add_argument("--vocab", type=int, default=32000, help="embedding rows (the LM head has as many columns)")
    ap.add_argument("--d-model", type=int, default=2048)
    ap.add_argument("--modes", default=",".join(MODES), help="comma-separated, of %(default)s")
    ap.add_argument("--no-verify", action="store_true", help="skip the content hashes (load(verify=False))")
    ap.add_argument("--whole-chunks", action="store_true",
                    help="write each array as one stored chunk (Orbax's default, and every checkpoint written before "
                         "checkpoint.CHUNK_BYTES): a host then reads each leaf whole, even for one shard")
    ap.add_argument("--json", help="also write the rows here")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--process-id", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(measure(args.child, args.checkpoint, not args.no_verify, args.process_id, args.port)))
        return 0
    tmp = None
    try:
        if args.checkpoint:
            path = Path(args.checkpoint)
        else:
            if args.keep:
                path = Path(args.keep)
            else:
                tmp = Path(tempfile.mkdtemp(prefix="bench_sharded_load-"))
                path = tmp / "checkpoint"
            t0 = time.perf_counter()
            from localleap_jax.checkpoint import CHUNK_BYTES
            chunk_bytes = None if args.whole_chunks else CHUNK_BYTES
            nbytes = write_checkpoint(path, args.layers, args.vocab, args.d_model, chunk_bytes)
            layout = "one chunk per array" if chunk_bytes is None else f"chunks of <= {chunk_bytes / 2**20:.0f} MiB"
            print(f"wrote {nbytes / 2**20:.0f} MB of random fp32 LLaDA-shaped weights (d_model {args.d_model}, "
                  f"{args.layers} layers, {args.vocab} vocabulary rows; {layout}) to {path} in "
                  f"{time.perf_counter() - t0:.0f}s")
        model_mb = sum(f.stat().st_size for f in (path / "params").rglob("*") if f.is_file()) / 2**20
        rows = []
        for mode in filter(None, (m.strip() for m in args.modes.split(","))):
            if mode not in MODES:
                ap.error(f"--modes: unknown mode {mode!r}; choose from {', '.join(MODES)}")
            rows += run_mode(mode, path, not args.no_verify)
        print_table(rows, model_mb)
        if args.json:
            Path(args.json).write_text(json.dumps({"model_mb": model_mb, "rows": rows}, indent=2))
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    cli.guard_startup()  # this process is the command's: Ctrl-C answered within seconds (localleap_jax.cli)
    sys.exit(cli.run_command(main))
