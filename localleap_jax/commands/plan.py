"""Plan a generation before renting the chips: memory per device and bytes per pass, from a config.json alone.

    python -m localleap_jax.plan --config config.json --batch 8 --prompt-length 896 --gen-length 256 --cache dual
    python -m localleap_jax.plan --checkpoint DIR --topology v5e:2x4 --mesh data=2,model=4
    python -m localleap_jax.plan inclusionAI/LLaDA2.0-flash --topology v5p:2x2x2 --mesh expert=8 --json plan.json

The whole generation program `ll.generate` would run is lowered from the model's config.json (`ll.lower_generate`:
no weights are read, no device memory is taken) and compiled for this host, or for a TPU topology that libtpu
describes on any host (the `[tpu-aot]` extra). Printed per device: the parameters, the K/V cache and XLA's other
temporaries against the chip's memory (fits, or by how much it does not); the bytes a cached pass and a full pass
move (counted from the compiled program, `localleap_jax.hlo_bytes`) against their floor (every weight a pass reads,
and the cache, read once) and the time those bytes take at the chip's memory bandwidth; XLA's own cost analysis
where the backend gives one. A hub id reads only config.json. `--json PATH` writes the same as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

from localleap_jax import cli
from localleap_jax.errors import ConfigError, DecodeError

GB = 1e9
GiB = 1 << 30


def parse_args(argv=None):
    p = cli.OneLineParser(prog="python -m localleap_jax.plan", description=__doc__.split("\n")[0],
                          formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("hub_id", nargs="?", help="a hub id (only its config.json is downloaded)")
    p.add_argument("--config", help="a config.json")
    p.add_argument("--checkpoint", help="a checkpoint directory (its config.json)")
    p.add_argument("--topology", help="a TPU topology, e.g. v5e:2x4, v6e:2x2, v5p:2x2x1 (default: this host)")
    p.add_argument("--mesh", help="data=D,expert=E,model=M (default: one device)")
    p.add_argument("--batch", type=cli.positive, default=1)
    p.add_argument("--prompt-length", type=cli.positive, default=896)
    p.add_argument("--gen-length", type=cli.positive, default=256)
    p.add_argument("--block-length", type=cli.positive, default=None,
                   help="default: the model's block (block diffusion, canvases) or 32")
    p.add_argument("--cache", default="auto", help="none | prefix | dual | block | subblock | encoder | auto")
    p.add_argument("--strategy", default=None, help="a rule spec (default: the family's last evaluation strategy)")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    p.add_argument("--json", help="write the plan as JSON here")
    p.add_argument("--hlo", help="write the compiled program's optimized HLO text here")
    p.add_argument("--top", type=cli.count, default=5, help="print this many of a cached pass's dearest ops")
    args = p.parse_args(argv)
    given = [x for x in (args.hub_id, args.config, args.checkpoint) if x]
    if len(given) != 1:
        p.error("name the model once: --config config.json, --checkpoint DIR or a hub id")
    return args


def read_model_config(args):
    """The ModelConfig from --config, --checkpoint or a hub id (its config.json alone), and a note when an id the
    program's shapes do not depend on was missing and a placeholder planned with."""
    if args.config:
        path = Path(args.config).expanduser()
    elif args.checkpoint:
        path = Path(args.checkpoint).expanduser() / "config.json"
        if not path.parent.is_dir():
            raise ConfigError(f"--checkpoint {path.parent}: not a directory")
    else:
        path = hub_config(args.hub_id)
    return config_for_planning(path)


IDS = ("mask_token_id", "eos_token_id", "pad_token_id")  # ids a released config.json may leave to its tokenizer


def config_for_planning(path: Path):
    """(ModelConfig, note or None). A released config.json may leave ids to the tokenizer (LLaDA2: the mask and EOS
    ids): the converter reads them there; a plan needs only shapes, so it takes placeholders (the last vocabulary
    ids) and says so."""
    from localleap_jax.families import read_config, read_config_file

    try:
        return read_config_file(path), None
    except ConfigError as e:
        missing = next((key for key in IDS if f"no {key}" in str(e)), None)
        if missing is None:
            raise
    hf = json.loads(path.read_text())
    vocab = int(hf.get("vocab_size") or hf.get("text_config", {}).get("vocab_size", 2))
    placed = {}
    for _ in IDS:  # each read names the next missing id
        try:
            config = read_config({**hf, **placed})
            break
        except ConfigError as e:
            missing = next((key for key in IDS if f"no {key}" in str(e) and key not in placed), None)
            if missing is None:
                raise
            placed[missing] = vocab - 1 - len(placed)
    else:
        config = read_config({**hf, **placed})
    given = ", ".join(f"{key} {value}" for key, value in placed.items())
    return config, (f"config.json leaves ids to its tokenizer: planned with placeholders ({given}); ids do not "
                    "change the program's shapes")


def hub_config(repo_id: str) -> Path:
    """config.json of a hub repository, downloaded alone (or from the local hub cache)."""
    from huggingface_hub import hf_hub_download

    try:
        return Path(hf_hub_download(repo_id, "config.json"))
    except Exception as e:  # offline, no such repository, gated: one line
        name = type(e).__name__
        if "Offline" in name or "LocalEntryNotFound" in name or "Connection" in name:
            raise ConfigError(f"{repo_id}: config.json is not in the local hub cache and the hub cannot be reached "
                              f"(offline); pass --config PATH instead") from None
        raise ConfigError(f"{repo_id}: config.json could not be downloaded ({cli.one_line(e)})") from None


def decode_config(args, config):
    import localleap_jax as ll
    from localleap_jax.decode.config import model_canvas
    from localleap_jax.families import family_of

    strategy = args.strategy or family_of(config).eval_strategies.split(",")[-1]
    fields = {"gen_length": args.gen_length, "block_length": args.block_length or 32, **model_canvas(config,
                                                                                                       args.gen_length)}
    if args.block_length:
        fields["block_length"] = args.block_length
    return ll.DecodeConfig(strategy=strategy, cache=args.cache, **fields)


def plan(args) -> dict:
    """Lower, compile and measure; returns the plan as a dict (what --json writes)."""
    from localleap_jax.dist import aot
    from localleap_jax.hlo_bytes import backend_estimate

    config, note = read_model_config(args)
    cfg = decode_config(args, config)
    cfg.validate(config)
    t0 = time.perf_counter()
    planned = aot.plan_generate(config, cfg, batch=args.batch, prompt_length=args.prompt_length, dtype=args.dtype,
                                topology=args.topology, mesh=args.mesh)
    t1 = time.perf_counter()
    try:
        compiled = planned.lowered.compile()
    except Exception as e:  # XLA refuses a program that cannot fit the chip: that is the answer, not an error
        if "RESOURCE_EXHAUSTED" not in str(e):
            raise
        return not_fitting(args, config, cfg, planned, note, str(e), round(t1 - t0, 2),
                           round(time.perf_counter() - t1, 2))
    t2 = time.perf_counter()
    passes = aot.pass_cost(planned, compiled)
    text = compiled.as_text()
    if args.hlo:
        Path(args.hlo).expanduser().write_text(text)
    memory = compiled.memory_analysis()
    device = planned.devices[0]
    kind, capacity, bandwidth = aot.device_memory(device)
    params = aot.weight_bytes(planned)
    kv = aot.kv_bytes(planned)
    temp = int(getattr(memory, "temp_size_in_bytes", 0) or 0)
    arguments = int(getattr(memory, "argument_size_in_bytes", 0) or 0)
    output = int(getattr(memory, "output_size_in_bytes", 0) or 0)
    alias = int(getattr(memory, "alias_size_in_bytes", 0) or 0)
    code = int(getattr(memory, "generated_code_size_in_bytes", 0) or 0)
    total = arguments + temp + output - alias + code
    mesh = dict(planned.mesh.shape) if planned.mesh is not None else None
    out = {
        "model": {"family": config.family, "layers": config.n_layers, "d_model": config.d_model,
                  "parameters": sum(int(_size(leaf)) for leaf in _leaves(planned.params)) if mesh is None else None},
        "run": {"batch": args.batch, "prompt_length": args.prompt_length, "prompt_bucket": planned.program.prompt_length,
                "gen_length": cfg.gen_length, "block_length": cfg.block_length, "cache": planned.program.loop.cache.name,
                "strategy": cfg.rule.spec(), "dtype": args.dtype},
        "devices": {"kind": kind, "count": len(planned.devices), "topology": args.topology, "mesh": mesh,
                    "memory_bytes": capacity, "bandwidth_bytes_per_s": bandwidth},
        "per_device": {"parameters": params, "kv_cache": kv, "other_temporaries": max(temp - kv, 0),
                       "inputs_and_outputs": max(arguments - params, 0) + output - alias, "code": code,
                       "total": total, "fits": None if capacity is None else total <= capacity,
                       "headroom": None if capacity is None else capacity - total},
        "per_pass": passes.to_json(),
        "dearest_ops": dearest_ops(text, args.top),
        "seconds_at_bandwidth": None if bandwidth is None else {
            "cached": passes.cached / bandwidth, "full": passes.full / bandwidth, "floor": passes.floor / bandwidth},
        "xla_estimate": backend_estimate(compiled),
        "seconds": {"lower": round(t1 - t0, 2), "compile": round(t2 - t1, 2)},
        "note": note,
    }
    return out


def not_fitting(args, config, cfg, planned, note: str | None, message: str, lower_s: float, compile_s: float) -> dict:
    """The plan of a program XLA refused to compile for lack of device memory: what it asked for against what the
    chip has (from XLA's message), the parameters and K/V per device; no bytes per pass (there is no program)."""
    import re

    from localleap_jax.dist import aot

    kind, capacity, bandwidth = aot.device_memory(planned.devices[0])
    asked = re.search(r"required for ([\w ]+?) \(([\d.]+)([KMGT])\) exceeds available \w+ \(([\d.]+)([KMGT])\)", message)
    unit = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
    need = have = None
    if asked:
        need, have = float(asked.group(2)) * unit[asked.group(3)], float(asked.group(4)) * unit[asked.group(5)]
    mesh = dict(planned.mesh.shape) if planned.mesh is not None else None
    return {
        "model": {"family": config.family, "layers": config.n_layers, "d_model": config.d_model, "parameters": None},
        "run": {"batch": args.batch, "prompt_length": args.prompt_length, "prompt_bucket": planned.program.prompt_length,
                "gen_length": cfg.gen_length, "block_length": cfg.block_length, "cache": planned.program.loop.cache.name,
                "strategy": cfg.rule.spec(), "dtype": args.dtype},
        "devices": {"kind": kind, "count": len(planned.devices), "topology": args.topology, "mesh": mesh,
                    "memory_bytes": capacity, "bandwidth_bytes_per_s": bandwidth},
        "per_device": {"parameters": aot.weight_bytes(planned), "kv_cache": aot.kv_bytes(planned), "fits": False,
                       "xla_refused": cli.one_line(Exception(message))[:300],
                       "asked": {"what": asked.group(1) if asked else None, "bytes": need, "available": have}},
        "per_pass": None, "dearest_ops": [], "seconds_at_bandwidth": None, "xla_estimate": {},
        "seconds": {"lower": lower_s, "compile": compile_s}, "note": note,
    }


def dearest_ops(text: str, n: int) -> list[dict]:
    """The n ops of a cached pass that move the most bytes (times the runs of their loops), with where they came
    from (XLA's op_name: the JAX call path)."""
    import re

    from localleap_jax import hlo_bytes

    module = hlo_bytes.parse(text)
    loop = hlo_bytes.generation_loop(module)
    names = {i.name: i for c in module.computations.values() for i in c.instructions}
    out = []
    for op, runs in loop.body.top(n, hlo_bytes.cached_from(hlo_bytes.PASS_SOURCES), hlo_bytes.once_each(loop.body)):
        meta = names[op.name].attrs.get("metadata", "") if op.name in names else ""
        where = re.search(r'op_name="([^"]*)"', meta)
        out.append({"op": op.name, "kind": op.opcode, "read": op.read, "written": op.written, "runs": runs,
                    "bytes": (op.read + op.written) * runs, "source": where.group(1) if where else ""})
    return out


def _leaves(tree):
    import jax

    return jax.tree.leaves(tree)


def _size(leaf) -> int:
    import numpy as np

    return int(np.prod(leaf.shape, dtype=np.int64))


def report(p: dict) -> str:
    d, run, dev, per = p["model"], p["run"], p["devices"], p["per_device"]
    mesh = " x ".join(f"{k}={v}" for k, v in dev["mesh"].items()) if dev["mesh"] else "one device"
    where = f"{dev['kind']}" + (f" ({dev['topology']}, {dev['count']} chips)" if dev["topology"] else "")
    lines = [f"note: {p['note']}"] if p.get("note") else []
    lines += [f"{d['family']}: {d['layers']} layers, d_model {d['d_model']}"
             + (f", {d['parameters'] / 1e9:.2f} B parameters" if d["parameters"] else ""),
             f"run: batch {run['batch']}, prompt {run['prompt_length']} (bucket {run['prompt_bucket']}), gen "
             f"{run['gen_length']}, block {run['block_length']}, cache {run['cache']}, {run['strategy']}, {run['dtype']}",
             f"on: {where}, {mesh}"]
    cap = dev["memory_bytes"]
    lines.append(f"memory per device{'' if cap is None else f' (of {cap / GiB:.2f} GiB)'}:")
    if p["per_pass"] is None:  # XLA refused the program: it does not fit
        asked = per["asked"]
        lines.append(f"  parameters {per['parameters'] / GiB:10.3f} GiB, K/V cache {per['kv_cache'] / GiB:.3f} GiB")
        if asked["bytes"]:
            lines.append(f"  does NOT fit: XLA needs {asked['bytes'] / GiB:.2f} GiB for {asked['what']}, the chip "
                         f"has {asked['available'] / GiB:.2f} GiB ({(asked['bytes'] - asked['available']) / GiB:.2f} "
                         "GiB short)")
        else:
            lines.append(f"  does NOT fit: {per['xla_refused']}")
        lines.append(f"lowered in {p['seconds']['lower']} s, refused after {p['seconds']['compile']} s")
        return "\n".join(lines)
    for name in ("parameters", "kv_cache", "other_temporaries", "inputs_and_outputs", "code", "total"):
        lines.append(f"  {name.replace('_', ' '):20s} {per[name] / GiB:10.3f} GiB")
    if per["fits"] is not None:
        lines.append(f"  fits, {per['headroom'] / GiB:.2f} GiB to spare" if per["fits"] else
                     f"  does NOT fit: {-per['headroom'] / GiB:.2f} GiB short")
    ps = p["per_pass"]
    lines.append("bytes per pass per device (counted from the compiled program):")
    floor = f"floor {ps['floor'] / GB:.3f} GB = weights {ps['weights'] / GB:.3f} + K/V {ps['kv'] / GB:.3f}"
    if ps["cache_choices"]:
        lines.append(f"  cached pass {ps['cached'] / GB:10.3f} GB  {ps['cached_ratio']:5.2f}x  {floor}")
        lines.append(f"  full pass   {ps['full'] / GB:10.3f} GB  {ps['full_ratio']:5.2f}x")
    else:
        lines.append(f"  every pass is full: {ps['full'] / GB:.3f} GB  {ps['full_ratio']:.2f}x  {floor}")
    lines.append(f"  before the loop (prefill) {ps['before'] / GB:.3f} GB")
    if p["dearest_ops"]:
        lines.append("  where a cached pass's bytes go (dearest ops, bytes x runs):")
        for op in p["dearest_ops"]:
            lines.append(f"    {op['bytes'] / GB:9.3f} GB  {op['runs']:>3} x {op['kind']:<10} {op['source'][-90:]}")
    s = p["seconds_at_bandwidth"]
    if s:
        lines.append(f"at {dev['bandwidth_bytes_per_s'] / 1e9:.0f} GB/s: cached pass {s['cached'] * 1e3:.2f} ms, full "
                     f"pass {s['full'] * 1e3:.2f} ms (floor {s['floor'] * 1e3:.2f} ms)")
    est = p["xla_estimate"]
    if est:
        parts = [f"{k} {v:.4g}" for k, v in est.items() if k in ("optimal_seconds", "bytes accessed", "flops")]
        lines.append("XLA's cost analysis (each loop body counted once): " + ", ".join(parts))
    lines.append(f"lowered in {p['seconds']['lower']} s, compiled in {p['seconds']['compile']} s")
    return "\n".join(lines)


def work(args) -> int:
    if args.json:
        target = Path(args.json).expanduser()
        cli.check_writable_dir(target.parent, "--json", target)
    result = plan(args)
    print(report(result))
    if args.json:
        Path(args.json).expanduser().write_text(json.dumps(result, indent=1) + "\n")
    return 0


def prepare_environment(args) -> None:
    """Before JAX starts: a topology needs no TPU backend here (JAX would look for chips); a mesh on this host's CPU
    takes as many virtual CPU devices as it names."""
    if args.topology:
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
    elif args.mesh and os.environ.get("JAX_PLATFORMS", "cpu") == "cpu":
        from localleap_jax.partition import parse_mesh

        try:
            sizes = parse_mesh(args.mesh)
        except DecodeError:
            return  # reported in one line when the plan reads it
        n = 1
        for v in sizes.values():
            n *= v
        flags = os.environ.get("XLA_FLAGS", "")
        if "xla_force_host_platform_device_count" not in flags:
            os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={n}".strip()


def main(argv=None) -> int:
    args = parse_args(argv)
    prepare_environment(args)
    return cli.run_command(lambda: work(args))
