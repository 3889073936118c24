"""Ahead of time: the whole generation program lowered from a `ModelConfig` alone (no weights, no devices held).

    lowered = lower_generate(config, cfg, batch=8, prompt_length=896, dtype="bfloat16")   # this host's backend
    lowered = lower_generate(config, cfg, batch=8, prompt_length=896, topology="v5e:2x4", mesh=dict(data=2, model=4))
    compiled = lowered.compile(); compiled.memory_analysis(); compiled.as_text()

It assembles the program `ll.generate` runs (`decode.run.assemble`: the same bucketing, rule rows, loop settings and
loop function) for a batch of `batch` prompts of `prompt_length` tokens, and lowers it with every array replaced by
its shape: the parameters are `checkpoint.reading.abstract_params` in the layout decoding reads them in, the inputs
`jax.ShapeDtypeStruct`s placed as the placement would place them (one device, or the mesh's shardings: the same
`DataModelMesh` as a run on a mesh). A TPU topology (`"v5e:2x4"`, `"v6e:2x2"`, `"v5p:2x2x1"`) is described by libtpu
(`jax.experimental.topologies`), so the program compiles for those chips on a host that has none; libtpu is the
`[tpu-aot]` extra (`pip install "jax[tpu]"` at the installed jax version). Set JAX_PLATFORMS=cpu on such a host:
the topology needs no TPU backend, and without it JAX would look for TPU chips at start-up.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Mapping

import jax
import numpy as np

from localleap_jax.attention import lowering_platform
from localleap_jax.config import ModelConfig
from localleap_jax.decode import DecodeConfig, OneDevice
from localleap_jax.decode.run import Program, assemble
from localleap_jax.denoiser import SpecialIds
from localleap_jax.dist.mesh import DataModelMesh
from localleap_jax.errors import DecodeError, first_line
from localleap_jax.families import decoding_params as family_decoding_params, denoiser_of
from localleap_jax.partition import DATA, EXPERT, MODEL, make_mesh, parse_mesh

TOPOLOGY_HINT = ('a TPU topology is described by libtpu: pip install "localleap_jax[tpu-aot]" (jax[tpu] at the '
                 "installed jax version), and run with JAX_PLATFORMS=cpu")


def topology_devices(topology: str | None) -> list:
    """The devices a program is compiled for: this host's (None), or a TPU topology's as libtpu describes them
    ("v5e:2x4": 8 v5e chips; "v5p:2x2x1": 4 v5p chips), which need no TPU here."""
    if topology is None:
        return list(jax.devices())
    if not isinstance(topology, str) or ":" not in topology:
        raise DecodeError(f"topology {topology!r}: expected a TPU generation and chip grid, like 'v5e:2x4', "
                          "'v6e:2x2' or 'v5p:2x2x1'")
    from jax.experimental import topologies

    # libtpu reads these at start-up (a TPU VM sets them); elsewhere it warns at length without them. Any valid
    # accelerator type quiets it: the topology named below is what gets described.
    os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
    os.environ.setdefault("TPU_ACCELERATOR_TYPE", "v6e-1")
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # several processes may describe topologies at once
    try:
        return list(topologies.get_topology_desc(platform="tpu", topology_name=topology).devices)
    except Exception as e:  # no libtpu, or a name it does not know
        if "libtpu" in str(e).lower() or "unknown backend" in str(e).lower() or "platform" in str(e).lower():
            raise DecodeError(f"topology {topology!r} cannot be described here ({first_line(e)}): "
                              f"{TOPOLOGY_HINT}") from None
        raise DecodeError(f"topology {topology!r}: {first_line(e)}") from None


def mesh_sizes(mesh: Mapping[str, int] | str | None) -> dict[str, int] | None:
    """{'data': D, 'expert': E, 'model': M} from a dict or "data=2,model=4" (None: no mesh)."""
    if mesh is None:
        return None
    sizes = parse_mesh(mesh) if isinstance(mesh, str) else dict(mesh)
    unknown = set(sizes) - {DATA, EXPERT, MODEL}
    if unknown or any(not isinstance(v, int) or v < 1 for v in sizes.values()):
        raise DecodeError(f"mesh {mesh!r}: expected data=, expert=, model= with positive whole numbers")
    return sizes


def build_mesh(sizes: dict[str, int], devices: list):
    """The mesh `ll.make_mesh` makes over `devices` (data defaults to what the other axes leave)."""
    model, expert = sizes.get(MODEL, 1), sizes.get(EXPERT, 1)
    data = sizes.get(DATA)
    if data is None:
        if len(devices) % (model * expert):
            raise DecodeError(f"mesh {sizes}: expert x model = {model * expert} does not divide the "
                              f"{len(devices)} devices")
        data = len(devices) // (model * expert)
    return make_mesh(data, model, devices, expert=expert)


def decoding_params(params, config: ModelConfig):
    """The parameter tree in the layout decoding reads (the family's `decoding_params`: per-layer arrays), from the
    stacked tree checkpoints hold. Shapes in, shapes out."""
    return jax.eval_shape(lambda p: family_decoding_params(p, config), params)


@dataclasses.dataclass(frozen=True)
class ShapeModel:
    """What `decode.run.assemble` reads of a model, with shapes for parameters: its config, denoiser and ids."""

    config: ModelConfig
    params: Any
    special: SpecialIds

    @property
    def denoiser(self):
        return denoiser_of(self.params, self.config)


def _on_one_device(tree, device):
    sharding = None if device is None else jax.sharding.SingleDeviceSharding(device)
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(np.shape(a), a.dtype, sharding=sharding), tree)


@dataclasses.dataclass(frozen=True)
class Planned:
    """A lowered generation program and what it was lowered for."""

    lowered: Any  # jax.stages.Lowered
    program: Program
    devices: tuple  # the devices the program runs on (one, or the mesh's)
    mesh: Any  # the jax Mesh, or None
    params: Any  # the parameters' shapes (with shardings on a mesh)


def plan_generate(config: ModelConfig, cfg: DecodeConfig, *, batch: int, prompt_length: int,
                  dtype: str = "bfloat16", topology: str | None = None, mesh=None, trace: bool = False,
                  slots: int | None = None, special: SpecialIds | None = None) -> Planned:
    """`lower_generate`, and what it lowered (the program's pieces, its devices and mesh)."""
    from localleap_jax.checkpoint.reading import abstract_params, parameter_dtype

    if not isinstance(config, ModelConfig):
        raise DecodeError(f"lower_generate takes a ModelConfig, got {type(config).__name__}")
    for name, value in (("batch", batch), ("prompt_length", prompt_length)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
            raise DecodeError(f"{name}={value!r} must be a positive whole number")
    try:
        params = decoding_params(abstract_params(config, parameter_dtype(dtype)), config)
    except DecodeError:
        raise
    except Exception as e:  # an unsupported dtype name (CheckpointError) and the like: one line
        raise DecodeError(first_line(e)) from None
    devices = topology_devices(topology)
    sizes = mesh_sizes(mesh)
    jax_mesh = None if sizes is None else build_mesh(sizes, devices)
    placement = OneDevice() if jax_mesh is None else DataModelMesh(jax_mesh)
    shape_model = ShapeModel(config, params, special or SpecialIds.of(config))
    ids = np.zeros((batch, prompt_length), np.int32)  # values never reach the program: only shapes and dtypes
    rng = jax.random.key(0) if cfg.draws else None
    program = assemble(shape_model, ids, np.ones(ids.shape, bool), cfg, rng, placement=placement, trace=trace,
                       slots=slots)
    if jax_mesh is None:
        device = devices[0] if topology is not None else None
        denoiser, inputs = _on_one_device(program.denoiser, device), _on_one_device(program.inputs, device)
        used = (devices[0],)
    else:
        denoiser, inputs = placement.shapes(program.denoiser, *program.inputs)
        used = tuple(jax_mesh.devices.flat)
    with lowering_platform(used[0].platform):  # the model's attention picks the kernel of the target chip
        lowered = placement.lower(program.loop_fn, denoiser, inputs)
    params_out = denoiser.params if hasattr(denoiser, "params") else params
    return Planned(lowered, program, used, jax_mesh, params_out)


def lower_generate(config: ModelConfig, cfg: DecodeConfig, *, batch: int, prompt_length: int,
                   dtype: str = "bfloat16", topology: str | None = None, mesh=None, trace: bool = False,
                   slots: int | None = None, special: SpecialIds | None = None):
    """The `jax.stages.Lowered` of the generation program `ll.generate` runs for `batch` prompts of `prompt_length`
    tokens (bucketed as a run buckets them) under `cfg`, from `config` alone: parameters of `dtype` as shapes, on
    this host's first device, or on a TPU `topology` ("v5e:2x4"); `mesh` (dict(data=, expert=, model=) or
    "data=2,model=4"): split as a run on `ll.make_mesh(...)` splits it, over the topology's devices or this host's.
    `special`: the loop's special ids (default: the config's, no tokenizer: no EOT, every id decodable)."""
    return plan_generate(config, cfg, batch=batch, prompt_length=prompt_length, dtype=dtype, topology=topology,
                         mesh=mesh, trace=trace, slots=slots, special=special).lowered


# ---------------------------------------------------------------- what a planned program costs

GiB = 1 << 30
# Per chip (one JAX device): HBM capacity and bandwidth, from Google's Cloud TPU system-architecture pages
# (cloud.google.com/tpu/docs/v4, /v5e, /v5p, /v6e: "HBM capacity per chip", "HBM bandwidth per chip"; capacities
# read as GiB). Keyed by the device_kind JAX reports.
CHIPS: dict[str, tuple[str, int, float]] = {
    "TPU v4": ("v4", 32 * GiB, 1.2e12),
    "TPU v5 lite": ("v5e", 16 * GiB, 8.19e11),
    "TPU v5e": ("v5e", 16 * GiB, 8.19e11),
    "TPU v5": ("v5p", 95 * GiB, 2.765e12),
    "TPU v5p": ("v5p", 95 * GiB, 2.765e12),
    "TPU v6 lite": ("v6e", 32 * GiB, 1.638e12),
    "TPU v6e": ("v6e", 32 * GiB, 1.638e12),
}


def device_memory(device) -> tuple[str, int | None, float | None]:
    """(what the device is, its memory in bytes or None, its memory bandwidth in bytes/s or None): a TPU chip from
    `CHIPS`, a GPU from its allocator's limit, a CPU from this host's RAM."""
    kind = getattr(device, "device_kind", "") or ""
    if kind in CHIPS:
        name, memory, bandwidth = CHIPS[kind]
        return f"TPU {name}", memory, bandwidth
    if getattr(device, "platform", "") == "cpu":
        try:
            pages = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError, AttributeError):
            pages = None
        return "CPU (host memory)", pages, None
    try:
        stats = device.memory_stats() or {}
    except Exception:  # a described device (topology) has no allocator
        stats = {}
    return kind or str(getattr(device, "platform", "device")), stats.get("bytes_limit"), None


def _shard_bytes(leaf) -> int:
    shape = tuple(np.shape(leaf))
    sharding = getattr(leaf, "sharding", None)
    if sharding is not None and hasattr(sharding, "shard_shape"):
        shape = sharding.shard_shape(shape)
    return int(np.prod(shape, dtype=np.int64)) * np.dtype(leaf.dtype).itemsize


def is_embedding(path: tuple[str, ...]) -> bool:
    """The embedding table's leaf (a pass only gathers rows of it, unless the head is tied to it)."""
    return bool(path) and path[0] == "wte"


def weight_bytes(planned: Planned, *, read_by_a_pass: bool = False) -> int:
    """Parameter bytes per device; `read_by_a_pass`: those a pass reads whole (all but the embedding table, which a
    pass only gathers from, unless the head is tied to it)."""
    from localleap_jax.partition import path_names

    tied = planned.program.denoiser.config.tie_word_embeddings
    total = 0
    for path, leaf in jax.tree_util.tree_flatten_with_path(planned.params)[0]:
        if read_by_a_pass and not tied and is_embedding(path_names(path)):
            continue
        total += _shard_bytes(leaf)
    return total


def kv_bytes(planned: Planned) -> int:
    """Bytes per device of the K/V a pass attends over: the model's cache for the canvas (prompt bucket + generated
    region, to the block grid's end), for the rows of one data shard, split over "model" when the heads divide."""
    from localleap_jax.decode.canvas import Canvas

    program, loop = planned.program, planned.program.loop
    denoiser = program.denoiser
    ids = program.inputs[0]
    sizes = dict(planned.mesh.shape) if planned.mesh is not None else {}
    rows = ids.shape[0] // sizes.get(DATA, 1)

    def cache():
        canvas = Canvas.build(jax.numpy.zeros((rows, ids.shape[1]), jax.numpy.int32),
                              jax.numpy.ones((rows, ids.shape[1]), bool), gen_length=loop.gen_length,
                              block_length=loop.block_length, mask_id=0, shift=denoiser.shift, grid=loop.block_grid)
        return denoiser.empty_cache(rows, canvas.length)

    total = sum(int(np.prod(a.shape, dtype=np.int64)) * np.dtype(a.dtype).itemsize
                for a in jax.tree.leaves(jax.eval_shape(cache)))
    model = sizes.get(MODEL, 1)
    return total // model if model > 1 and denoiser.config.n_kv_heads % model == 0 else total


@dataclasses.dataclass(frozen=True)
class PassCost:
    """Bytes one pass of the generation loop moves per device (hlo_bytes.loop_passes), against its floor: every
    weight a pass reads read once, and the K/V it attends over read once."""

    cached: int  # a pass that reads the cache (every conditional at its cheapest branch)
    full: int  # a pass that refreshes / stores / encodes (the cache policy's dearest branch)
    before: int  # the program before the loop (prefill)
    weights: int  # floor part: the weights a pass reads (all but the embedding table, unless tied)
    kv: int  # floor part: the K/V of the canvas
    cache_choices: int  # the cache policy's conditionals in the loop body (0: every pass is a full one)

    @property
    def floor(self) -> int:
        return self.weights + self.kv

    @property
    def cached_ratio(self) -> float:
        return self.cached / self.floor

    @property
    def full_ratio(self) -> float:
        return self.full / self.floor

    def to_json(self) -> dict:
        return {**dataclasses.asdict(self), "floor": self.floor, "cached_ratio": round(self.cached_ratio, 4),
                "full_ratio": round(self.full_ratio, 4)}


def pass_cost(planned: Planned, compiled) -> PassCost:
    """The bytes per cached and per full pass of a compiled planned program, and their floor (per device)."""
    from localleap_jax import hlo_bytes

    passes = hlo_bytes.loop_passes(compiled.as_text())
    return PassCost(passes.cached, passes.full, passes.before, weight_bytes(planned, read_by_a_pass=True),
                    kv_bytes(planned), passes.cache_choices)


__all__ = ["CHIPS", "PassCost", "Planned", "ShapeModel", "TOPOLOGY_HINT", "build_mesh", "decoding_params", "lower_generate", "mesh_sizes",
           "device_memory", "is_embedding", "kv_bytes", "pass_cost", "plan_generate", "topology_devices", "weight_bytes"]
