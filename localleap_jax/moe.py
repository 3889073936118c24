"""A mixture-of-experts feed-forward layer: the router as data, sparse expert dispatch, expert parallelism.

One layer, pure functions over a plain parameter dict (no layer axis: a model stacks layers itself):

    {"gate": {"kernel": [D, E]},                   # router projection: logits = h @ kernel
     "expert_bias": [E],                           # only when Router.bias is set (LLaDA2's `gate.expert_bias`)
     "expert_scale": [E],                          # only when Router.expert_scale (Gemma's `per_expert_scale`)
     "experts": {"gate_proj": [E, D, F],           # the routed experts: expert e maps x to
                 "up_proj": [E, D, F],             #   act(x @ gate_proj[e]) * (x @ up_proj[e]) @ down_proj[e]
                 "down_proj": [E, F, D]},
     "shared": {"gate_proj": {"kernel": [D, S]},   # optional: the shared experts as one dense MLP of width
                "up_proj": {"kernel": [D, S]},     #   S = num_shared * F, added unweighted
                "down_proj": {"kernel": [S, D]}}}

A Hugging Face `nn.Linear` weight [out, in] is the transposed kernel: `mlp.experts.{e}.gate_proj.weight` [F, D]
is `experts.gate_proj[e].T`, `mlp.gate.weight` [E, D] is `gate.kernel.T`. The key "experts" is what
`partition` splits over the mesh's "expert" axis (the leading E of each leaf; a layer-stacked [N, E, ...] leaf
has it second): keep that name when nesting this dict in a model.

    moe = MoE(Router(num_experts=256, top_k=8, score="sigmoid", bias="select", n_group=8, topk_group=4,
                     normalise=True, scale=2.5))                  # LLaDA2.x (= DeepSeek-V3's router)
    y = moe_layer(moe, params, x)                                 # x [..., D] -> y [..., D]
    y = moe_layer(moe, params, x, mesh=mesh)                      # experts split over mesh axis "expert"

Router variants (`Router`): the score is sigmoid or softmax of fp32 logits; an expert bias is added for the
choice only ("select": LLaDA2, DeepSeek-V3, GLM-4.5) or to the probabilities that become the weights
("weights": LLaDA-MoE); group-limited choice keeps the `topk_group` best of `n_group` groups, each scored by
the sum of its `group_top` best biased scores (DeepSeek-V3: 2; V2's max: 1); the k weights may be renormalised
(sum + 1e-20, DeepSeek's), multiplied by a learned per-expert scale (DiffusionGemma) and by
`routed_scaling_factor`. Qwen3-MoE and OLMoE are softmax top-k with `norm_topk_prob` as `normalise`;
Mixtral's softmax over the top-k logits is softmax top-k renormalised; DiffusionGemma is softmax top-k
renormalised times `per_expert_scale`, its router reading an RMS-normalised, scaled input (pass it as
`router_input`) and its experts GELU-tanh (`MoE(activation="gelu_tanh")`). The router always works in fp32
at full matmul precision: choices are discrete, and bf16 or TF32 logits flip some of them.

Sparse dispatch (`MoE.dispatch`): the T*k (token, expert) pairs are grouped by expert (a stable argsort, group
sizes from a bincount); each expert's tokens are gathered and run through it, and each pair's output is
gathered back in (token, slot) order, weighted and summed over the k slots in fp32 (gathers and a fixed-order
sum: deterministic, no scatter-add). Shapes are static (no data-dependent shape), so the layer jits and runs
inside `lax.while_loop`. The grouped matmuls:
- "capacity" (default): each expert's first C rows (C = `default_capacity`: the mean rows per expert plus four
  Poisson deviations) in one batched matmul over the experts, [E, C, D] x [E, D, F]: every expert's weights
  read once, in place, no copy. Rows past an expert's C take the "tiles" path under a `lax.cond` that runs
  only when some expert overflows: exact whatever the routing, never a dropped token, but a skewed batch
  (tokens that route alike, as a canvas of mask tokens may) pays both. Under `vmap` the cond runs both
  branches; the layer flattens its leading dimensions instead, so call it unbatched.
- "ragged": `jax.lax.ragged_dot`, one grouped GEMM per projection, computing only each group's rows where the
  backend has a grouped GEMM (TPU). JAX's generic lowering (CPU) and XLA's GPU rewrite (seen on an H200, jax
  0.11.2, also with --xla_gpu_experimental_use_ragged_dot_fusion) mask the rows per group instead: E times
  the work. experiments/bench_moe.py measures it.
- "tiles": each expert's rows padded to whole tiles of `tile` rows (at most T*k + min(E, T*k) * (tile - 1)
  rows: a static bound), one batched matmul over the tiles with each tile's expert weights gathered (copied).
- "gmm": TPU's grouped matmul kernel (Pallas megablox `gmm`, the one MaxText's MoE runs): rows sorted by expert
  as for "ragged", each expert's weight tiles loaded only for the row tiles of its group, so an expert no token
  chose is never read. A TPU kernel: on another backend it runs in Pallas's interpreter (tests), slowly.
- "all": every expert on every token, weighted by the (mostly zero) routing weights: the reference the
  sparse paths are tested against, and the benchmark's baseline. E/k times the routed work.

Expert parallelism (`moe_layer(..., mesh=mesh)` with a mesh axis "expert" of size n > 1): each device holds
E/n routed experts (the leaves of "experts" split on their expert dimension); everything else is as the
caller placed it. A `jax.shard_map` over "expert" alone (the other axes stay automatic, so it nests inside the
data-parallel shard_map of `dist`): every device routes the tokens it holds, keeps the pairs whose expert it
holds (the others sort last and get weight 0), runs its experts on them, and one `psum` over "expert" adds the
partial outputs. Tokens are not all-to-all'ed because on this project's meshes they are already on every
device of the expert axis (the batch is split only over "data"): dispatch is a local selection and the combine
is the one all-reduce a row-parallel MLP pays too. An all-to-all would pay only if the expert axis also split
the tokens. Shapes stay static: each device sizes its work as on one device (every pair might be its own),
and the overflow path covers a device whose experts draw more than their capacity.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Literal, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Float, Int

from localleap_jax.errors import ConfigError

EXPERT_AXIS = "expert"  # the mesh axis routed experts are split over (localleap_jax.partition.EXPERT)

ACTIVATIONS = {
    "silu": jax.nn.silu,  # SwiGLU experts (LLaDA2, LLaDA-MoE, DeepSeek, Qwen3-MoE, OLMoE)
    "gelu_tanh": functools.partial(jax.nn.gelu, approximate=True),  # Gemma's gelu_pytorch_tanh
    "gelu": functools.partial(jax.nn.gelu, approximate=False),
}


@dataclasses.dataclass(frozen=True)
class Router:
    """How a token picks its experts and weighs them; every family's router is one of these.

    num_experts: E routed experts.            top_k: experts per token.
    score: "sigmoid" | "softmax" of the fp32 logits.
    bias: None | "select" (expert_bias added to the scores for the choice only; the weights come from the
        unbiased scores: LLaDA2, DeepSeek-V3) | "weights" (added to the probabilities, which then are both the
        choice and the weights: LLaDA-MoE).
    n_group, topk_group, group_top: group-limited choice (n_group > 1): experts in n_group equal groups, each
        scored by the sum of its group_top best (biased) scores; only the topk_group best groups are eligible.
    normalise: divide the k weights by their sum + 1e-20 (DeepSeek's norm_topk_prob; LLaDA2's gate does it
        whenever top_k > 1, whatever its config says: normalise=top_k > 1 there).
    scale: multiply the weights (routed_scaling_factor).
    expert_scale: multiply each weight by a learned per-expert scale, params["expert_scale"][e] (Gemma).
    """

    num_experts: int
    top_k: int
    score: Literal["sigmoid", "softmax"] = "softmax"
    bias: Literal["select", "weights"] | None = None
    n_group: int = 1
    topk_group: int = 1
    group_top: int = 2
    normalise: bool = False
    scale: float = 1.0
    expert_scale: bool = False

    def __post_init__(self):
        E, k = self.num_experts, self.top_k
        if self.score not in ("sigmoid", "softmax"):
            raise ConfigError(f"router score {self.score!r}: expected 'sigmoid' or 'softmax'")
        if self.bias not in (None, "select", "weights"):
            raise ConfigError(f"router bias {self.bias!r}: expected None, 'select' or 'weights'")
        if not 1 <= k <= E:
            raise ConfigError(f"router top_k={k} with {E} experts: expected 1 <= top_k <= num_experts")
        if self.n_group < 1 or E % self.n_group:
            raise ConfigError(f"router n_group={self.n_group} does not divide {E} experts")
        if self.n_group > 1:
            size = E // self.n_group
            if not 1 <= self.topk_group <= self.n_group:
                raise ConfigError(f"router topk_group={self.topk_group}: expected 1..n_group={self.n_group}")
            if not 1 <= self.group_top <= size:
                raise ConfigError(f"router group_top={self.group_top}: expected 1..{size} (the group size)")
            if self.topk_group * size < k:
                raise ConfigError(f"router top_k={k} exceeds the {self.topk_group} x {size} experts of the "
                                  "groups kept")


DISPATCHES = ("capacity", "ragged", "tiles", "gmm", "all")


@dataclasses.dataclass(frozen=True)
class MoE:
    """A MoE layer's settings: its router, the experts' activation, and how the routed experts run
    (`dispatch`, one of DISPATCHES; see the module docstring). `capacity`: rows per expert of "capacity"'s
    batched matmul (None: `default_capacity` of the shapes); `tile`: rows per tile for "tiles" and for
    "capacity"'s overflow (None: `default_tile` of the shapes)."""

    router: Router
    activation: Literal["silu", "gelu_tanh", "gelu"] = "silu"
    dispatch: Literal["capacity", "ragged", "tiles", "gmm", "all"] = "capacity"
    capacity: int | None = None
    tile: int | None = None

    def __post_init__(self):
        if self.activation not in ACTIVATIONS:
            raise ConfigError(f"MoE activation {self.activation!r}: expected one of {sorted(ACTIVATIONS)}")
        if self.dispatch not in DISPATCHES:
            raise ConfigError(f"MoE dispatch {self.dispatch!r}: expected one of {', '.join(DISPATCHES)}")
        for name in ("capacity", "tile"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ConfigError(f"MoE {name}={getattr(self, name)}: expected a positive number of rows")


# ---------------------------------------------------------------- router


def route(router: Router, h: Float[Array, "T D"], gate_kernel: Float[Array, "D E"],
          expert_bias: Float[Array, "E"] | None = None, expert_scale: Float[Array, "E"] | None = None
          ) -> tuple[Int[Array, "T k"], Float[Array, "T k"]]:
    """Each token's k experts and their weights, in fp32 whatever the dtypes of h and the parameters. The k
    experts of a token are distinct and in no promised order (compare them as sets)."""
    E = router.num_experts
    if gate_kernel.shape[-1] != E:
        raise ConfigError(f"router gate kernel {tuple(gate_kernel.shape)} does not end in num_experts={E}")
    if (expert_bias is None) != (router.bias is None):
        given = "absent" if expert_bias is None else "given"
        raise ConfigError(f"router bias={router.bias!r} but expert_bias is {given}")
    if (expert_scale is None) == router.expert_scale:
        raise ConfigError(f"router expert_scale={router.expert_scale} but the expert_scale parameter is "
                          f"{'absent' if expert_scale is None else 'given'}")
    logits = jnp.matmul(h.astype(jnp.float32), gate_kernel.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST)
    probs = jax.nn.sigmoid(logits) if router.score == "sigmoid" else jax.nn.softmax(logits, axis=-1)
    biased = probs if expert_bias is None else probs + expert_bias.astype(jnp.float32)
    choice = _best_groups_only(router, biased) if router.n_group > 1 else biased
    _, idx = jax.lax.top_k(choice, router.top_k)
    weights = jnp.take_along_axis(biased if router.bias == "weights" else probs, idx, axis=-1)
    if router.normalise:
        weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + 1e-20)
    if router.expert_scale:
        weights = weights * expert_scale.astype(jnp.float32)[idx]
    return idx.astype(jnp.int32), weights * jnp.float32(router.scale)


def _best_groups_only(router: Router, scores: Float[Array, "T E"]) -> Float[Array, "T E"]:
    """The scores with every expert outside its token's topk_group best groups set to -inf."""
    T, E = scores.shape
    grouped = scores.reshape(T, router.n_group, E // router.n_group)
    group_score = jnp.sum(jax.lax.top_k(grouped, router.group_top)[0], axis=-1)  # [T, G]
    _, best = jax.lax.top_k(group_score, router.topk_group)
    keep = jnp.any(best[:, :, None] == jnp.arange(router.n_group), axis=1)  # [T, G]; a compare, not a scatter
    return jnp.where(keep[:, :, None], grouped, -jnp.inf).reshape(T, E)


# ---------------------------------------------------------------- experts


def dense_mlp(activation: str, params: dict, x: Float[Array, "T D"]) -> Float[Array, "T D"]:
    """down(act(x gate) * (x up)) with {"kernel"} leaves (the shared experts), in the dtype of x."""
    act = ACTIVATIONS[activation]
    kernel = lambda name: params[name]["kernel"].astype(x.dtype)  # noqa: E731
    return (act(x @ kernel("gate_proj")) * (x @ kernel("up_proj"))) @ kernel("down_proj")


def routed_all(activation: str, experts: dict, x: Float[Array, "T D"], idx: Int[Array, "T k"],
               weights: Float[Array, "T k"]) -> Float[Array, "T D"]:
    """Every expert on every token, each output weighted by the token's routing weight for it (0 unless
    chosen); fp32 combine."""
    act = ACTIVATIONS[activation]
    T, E = x.shape[0], experts["gate_proj"].shape[0]
    combine = jnp.zeros((T, E), jnp.float32).at[jnp.arange(T)[:, None], idx].add(weights)
    w = {name: experts[name].astype(x.dtype) for name in ("gate_proj", "up_proj", "down_proj")}
    hidden = act(jnp.einsum("td,edf->tef", x, w["gate_proj"])) * jnp.einsum("td,edf->tef", x, w["up_proj"])
    out = jnp.einsum("tef,efd->ted", hidden, w["down_proj"])
    return jnp.einsum("ted,te->td", out.astype(jnp.float32), combine)


class _Pairs(NamedTuple):
    """The T*k (token, slot) pairs, pair p = token p // k's slot p % k, grouped by the expert held here."""

    key: Int[Array, "R"]  # the pair's expert among those held here; E_here for a pair of an expert held elsewhere
    order: Int[Array, "R"]  # pair ids sorted by key (stable): each expert's pairs contiguous, experts in order
    inverse: Int[Array, "R"]  # the position of each pair in `order`
    sizes: Int[Array, "E"]  # pairs per expert held here
    rank: Int[Array, "R"]  # in `order`'s sequence: the row's rank among its expert's pairs


def _pairs(idx: Int[Array, "T k"], held: int, first) -> _Pairs:
    local = idx.reshape(-1) - first
    key = jnp.where((local >= 0) & (local < held), local, held)  # experts held elsewhere sort last
    order = jnp.argsort(key, stable=True)
    R = order.shape[0]
    inverse = jnp.zeros_like(order).at[order].set(jnp.arange(R, dtype=order.dtype))
    sizes = jnp.bincount(key, length=held + 1)[:held]
    rank = jnp.arange(R) - (jnp.cumsum(sizes) - sizes)[jnp.minimum(key[order], held - 1)]
    return _Pairs(key, order, inverse, sizes, rank)


def routed_sparse(moe: MoE, experts: dict, x: Float[Array, "T D"], idx: Int[Array, "T k"],
                  weights: Float[Array, "T k"], first: Int[Array, ""] | int = 0) -> Float[Array, "T D"]:
    """The routed experts held here (experts[...] [E_here, ...], global ids first .. first + E_here - 1) on
    the pairs routed to them, grouped by expert; pairs routed elsewhere contribute nothing. fp32 out."""
    T, k = idx.shape
    held = experts["gate_proj"].shape[0]
    pairs = _pairs(idx, held, first)
    tile = moe.tile or default_tile(T * k, held)
    if moe.dispatch == "capacity":
        capacity = min(moe.capacity or default_capacity(T * k, moe.router.num_experts, T), T)
        per_pair = _capacity(moe.activation, experts, x, pairs, capacity, tile)
    else:
        rows = x[pairs.order // k]  # [T*k, D]: the token of each pair, in expert order
        if moe.dispatch == "ragged":
            out = _grouped_ragged(moe.activation, experts, rows, pairs.sizes)
        elif moe.dispatch == "gmm":
            out = _grouped_gmm(moe.activation, experts, rows, pairs.sizes)
        else:
            out = _grouped_tiles(moe.activation, experts, rows, pairs.key[pairs.order], pairs.rank, pairs.sizes, tile)
        per_pair = out[pairs.inverse]  # back in (token, slot) order
    pair_weights = jnp.where(pairs.key < held, weights.reshape(-1), 0.0)  # pairs held elsewhere: 0, kept 0
    return jnp.sum((per_pair.astype(jnp.float32) * pair_weights[:, None]).reshape(T, k, -1), axis=1)


def _grouped_ragged(activation: str, experts: dict, rows: Float[Array, "R D"], sizes: Int[Array, "E"]
                    ) -> Float[Array, "R D"]:
    """Rows grouped by expert (sizes[e] rows of expert e, then rows of no group, which come out 0)."""
    act = ACTIVATIONS[activation]
    grouped = lambda a, name: jax.lax.ragged_dot(a, experts[name].astype(rows.dtype), sizes)  # noqa: E731
    return grouped(act(grouped(rows, "gate_proj")) * grouped(rows, "up_proj"), "down_proj")


GMM_TILE = 128  # megablox's row / contraction / output tile (its default)


def _grouped_gmm(activation: str, experts: dict, rows: Float[Array, "R D"], sizes: Int[Array, "E"]
                 ) -> Float[Array, "R D"]:
    """_grouped_ragged with Pallas megablox `gmm` (TPU; elsewhere its interpreter): rows padded to whole row tiles;
    rows of no group here come out 0."""
    from jax.experimental.pallas.ops.tpu.megablox import gmm

    from localleap_jax.attention import platform

    act = ACTIVATIONS[activation]
    R = rows.shape[0]
    m = -(-R // GMM_TILE) * GMM_TILE if R > GMM_TILE else -(-R // 8) * 8
    padded = jnp.pad(rows, ((0, m - R), (0, 0)))
    interpret = platform() != "tpu"

    def grouped(a, name):
        w = experts[name].astype(rows.dtype)
        tiling = (min(GMM_TILE, m), min(GMM_TILE, w.shape[1]), min(GMM_TILE, w.shape[2]))
        return gmm(a, w, sizes.astype(jnp.int32), preferred_element_type=rows.dtype, tiling=tiling,
                   interpret=interpret)

    out = grouped(act(grouped(padded, "gate_proj")) * grouped(padded, "up_proj"), "down_proj")
    grouped_rows = jnp.arange(m) < jnp.sum(sizes)  # past the groups: left unwritten by the kernel
    return jnp.where(grouped_rows[:, None], out, jnp.zeros((), out.dtype))[:R]


def default_tile(rows: int, experts: int) -> int:
    """Tile rows for "tiles". At most as many rows as experts, the bound holds `rows` tiles whatever their size
    (each row might be its expert's only one), so tiles of one row compute least. Above that, each tile costs a
    gathered copy of its expert's weights: tiles of twice the mean rows per expert, as a power of two within
    8..128, trade padding rows against tile count (on an H200, at LLaDA2.0-mini's shape, 128 was fastest)."""
    if rows <= experts:
        return 1
    target = -(-2 * rows // experts)
    return min(128, max(8, 1 << (target - 1).bit_length()))


def default_capacity(rows: int, experts: int, max_rows: int) -> int:
    """Rows per expert for "capacity": the mean (rows / experts) plus four of its Poisson standard deviations
    plus one, in whole 8s above 8, at most max_rows (an expert's most: one row per token). An evenly loaded
    router almost never exceeds it; a skewed one pays the overflow path, never a wrong result."""
    mean = rows / experts
    capacity = int(mean + 4 * mean ** 0.5 + 1.999)
    capacity = capacity if capacity <= 8 else -(-capacity // 8) * 8
    return min(capacity, max_rows)


def _grouped_tiles(activation: str, experts: dict, rows: Float[Array, "R D"], row_expert: Int[Array, "R"],
                   rank: Int[Array, "R"], sizes: Int[Array, "E"], tile: int) -> Float[Array, "R D"]:
    """The same as _grouped_ragged with plain XLA: row r is the rank[r]-th of the sizes[e] rows of its expert
    e = row_expert[r] (rows with row_expert == E belong to no expert here, are left out and come out 0).
    Each expert's rows go to whole tiles of `tile` rows; one batched matmul over the tiles, each with its
    expert's weights gathered."""
    R, E = rows.shape[0], sizes.shape[0]
    n_tiles = (R + min(E, R) * (tile - 1)) // tile  # static bound on sum_e ceil(sizes[e] / tile)
    tiles = (sizes + tile - 1) // tile
    tile_end = jnp.cumsum(tiles)
    e = jnp.minimum(row_expert, E - 1)
    slot = jnp.where(row_expert < E, (tile_end[e] - tiles[e]) * tile + rank, n_tiles * tile)  # out of range: dropped
    padded = jnp.zeros((n_tiles * tile, rows.shape[1]), rows.dtype).at[slot].set(rows, mode="drop")
    tile_expert = jnp.minimum(jnp.searchsorted(tile_end, jnp.arange(n_tiles), side="right"), E - 1)
    weights = {name: jnp.take(experts[name].astype(rows.dtype), tile_expert, axis=0)
               for name in ("gate_proj", "up_proj", "down_proj")}  # [n_tiles, in, out]
    out = _batched_mlp(activation, weights, padded.reshape(n_tiles, tile, -1))
    return out.reshape(n_tiles * tile, -1).at[slot].get(mode="fill", fill_value=0)


def _capacity(activation: str, experts: dict, x: Float[Array, "T D"], pairs: _Pairs, capacity: int, tile: int
              ) -> Float[Array, "R D"]:
    """Each pair's expert output, in (token, slot) order (0 for pairs of experts held elsewhere). Each expert's
    first `capacity` pairs in one batched matmul over the experts ([E, capacity, D], gathered straight from x:
    each expert's weights read in place, none copied); the pairs past an expert's capacity, if any, through
    _grouped_tiles under a `lax.cond` (run only when some expert overflows; not compiled when capacity >= T,
    the most pairs an expert can get)."""
    T, R, E = x.shape[0], pairs.order.shape[0], pairs.sizes.shape[0]
    k = R // T
    starts = jnp.cumsum(pairs.sizes) - pairs.sizes
    slots = jnp.arange(capacity)
    pair = pairs.order[jnp.minimum(starts[:, None] + slots, R - 1)]  # [E, capacity]: the pair in each slot
    filled = slots < pairs.sizes[:, None]
    buffer = jnp.where(filled[:, :, None], x[pair // k], jnp.zeros((), x.dtype))
    out = _batched_mlp(activation, experts, buffer).reshape(E * capacity, -1)
    rank = pairs.rank[pairs.inverse]  # each pair's rank among its expert's pairs, in (token, slot) order
    fits = (pairs.key < E) & (rank < capacity)
    per_pair = out.at[jnp.where(fits, pairs.key * capacity + rank, E * capacity)].get(mode="fill", fill_value=0)
    if capacity >= T:
        return per_pair

    def spill():  # the pairs past their expert's capacity, as "tiles" runs them
        row_expert = pairs.key[pairs.order]
        over = jnp.where((row_expert < E) & (pairs.rank >= capacity), row_expert, E)
        out = _grouped_tiles(activation, experts, x[pairs.order // k], over, pairs.rank - capacity,
                             jnp.maximum(pairs.sizes - capacity, 0), tile)
        return out[pairs.inverse]

    return per_pair + jax.lax.cond(jnp.any(pairs.sizes > capacity), spill, lambda: jnp.zeros_like(per_pair))


def _batched_mlp(activation: str, weights: dict, x: Float[Array, "N C D"]) -> Float[Array, "N C D"]:
    """act(x gate) * (x up) @ down for N groups of rows, each group with its own [N, ...] weights."""
    act = ACTIVATIONS[activation]
    w = {name: weights[name].astype(x.dtype) for name in ("gate_proj", "up_proj", "down_proj")}
    hidden = act(jnp.einsum("ncd,ndf->ncf", x, w["gate_proj"])) * jnp.einsum("ncd,ndf->ncf", x, w["up_proj"])
    return jnp.einsum("ncf,nfd->ncd", hidden, w["down_proj"])


# ---------------------------------------------------------------- the layer


@dataclasses.dataclass(frozen=True)
class MoELayers:
    """`ModelConfig.arch` of a mixture-of-experts model of model.py's network: which layers have a MoE feed-forward
    (the others a dense SwiGLU of `ModelConfig.mlp_hidden_size`), its settings, and the experts' widths."""

    moe: MoE
    layers: tuple[bool, ...]  # per layer: True for a MoE feed-forward
    expert_hidden: int  # F: each routed expert's SwiGLU width
    shared_hidden: int = 0  # the shared experts' SwiGLU width (num_shared x F; 0: none)
    expert_bias: bool = False  # the router has an expert_bias leaf (Router.bias set)

    def __post_init__(self):
        if self.expert_hidden < 1 or self.shared_hidden < 0:
            raise ConfigError(f"expert width {self.expert_hidden} and shared width {self.shared_hidden}: expected > 0 "
                              "and >= 0")
        if self.expert_bias != (self.moe.router.bias is not None):
            raise ConfigError("an expert_bias leaf goes with a router that uses one (Router.bias), and only then")


def expert_mesh():
    """The enclosing mesh when it has an "expert" axis of size > 1 (inside the sharded decode loop's shard_map),
    else None: what `moe_layer(..., mesh=)` takes from model code that does not know where it runs."""
    mesh = jax.sharding.get_abstract_mesh()
    return mesh if dict(getattr(mesh, "shape", {}) or {}).get(EXPERT_AXIS, 1) > 1 else None


def moe_layer(moe: MoE, params: dict, x: Float[Array, "... D"], *, router_input: Float[Array, "... D"] | None = None,
              mesh=None) -> Float[Array, "... D"]:
    """The layer's output for x [..., D] (routed experts weighted, plus the shared experts if params has
    "shared"), in the dtype of x. `router_input`: what the router reads, when it is not x (DiffusionGemma).
    `mesh`: a jax Mesh (or the abstract mesh of an enclosing shard_map); with an "expert" axis of size > 1,
    the routed experts run split over it (their params["experts"] leaves split on the expert dimension, as
    `partition.param_shardings` places them); without one, on whatever devices the inputs live on."""
    lead, D = x.shape[:-1], x.shape[-1]
    flat = x.reshape(-1, D)
    r_in = flat if router_input is None else router_input.reshape(-1, D)
    if mesh is not None and dict(mesh.shape).get(EXPERT_AXIS, 1) > 1:
        routed = _expert_parallel(moe, params, flat, r_in, mesh)
    else:
        routed = _routed(moe, params, flat, r_in)
    out = routed.astype(x.dtype)
    if "shared" in params:
        out = out + dense_mlp(moe.activation, params["shared"], flat)
    return out.reshape(*lead, D)


def _routed(moe: MoE, params: dict, x: Float[Array, "T D"], router_input: Float[Array, "T D"],
            first: Int[Array, ""] | int = 0) -> Float[Array, "T D"]:
    idx, weights = route(moe.router, router_input, params["gate"]["kernel"], params.get("expert_bias"),
                         params.get("expert_scale"))
    if moe.dispatch == "all":
        if params["experts"]["gate_proj"].shape[0] != moe.router.num_experts:  # a shard of them (expert axis)
            raise ConfigError("MoE dispatch 'all' runs every expert on one device: use 'capacity', 'ragged' or "
                              "'tiles' with an expert axis")
        return routed_all(moe.activation, params["experts"], x, idx, weights)
    return routed_sparse(moe, params["experts"], x, idx, weights, first)


def _expert_parallel(moe: MoE, params: dict, x: Float[Array, "T D"], router_input: Float[Array, "T D"],
                     mesh) -> Float[Array, "T D"]:
    """The routed experts' output with the experts split over the mesh axis "expert" (module docstring)."""
    n = dict(mesh.shape)[EXPERT_AXIS]
    E = moe.router.num_experts
    if E % n:
        raise ConfigError(f"{E} experts do not split over an expert axis of {n} devices")
    # Inside an enclosing shard_map (dist's data-parallel loop) shard_map must be given the context's
    # abstract mesh, whose "data" axis is already manual; at top level, the mesh itself.
    context = jax.sharding.get_abstract_mesh()
    on = mesh if context.empty else context
    routed_params = {key: value for key, value in params.items() if key != "shared"}
    specs = {key: (jax.tree.map(lambda _: P(EXPERT_AXIS), value) if key == "experts"
                   else jax.tree.map(lambda _: P(), value)) for key, value in routed_params.items()}

    def per_device(p, x, r_in):
        first = jax.lax.axis_index(EXPERT_AXIS) * (E // n)
        return jax.lax.psum(_routed(moe, p, x, r_in, first), EXPERT_AXIS)

    return jax.shard_map(per_device, mesh=on, in_specs=(specs, P(), P()), out_specs=P(),
                         axis_names={EXPERT_AXIS}, check_vma=False)(routed_params, x, router_input)


__all__ = ["ACTIVATIONS", "DISPATCHES", "EXPERT_AXIS", "MoE", "Router", "default_capacity", "default_tile",
           "dense_mlp", "moe_layer", "route", "routed_all", "routed_sparse"]
