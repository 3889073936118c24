"""Bytes a compiled program moves, counted from its optimized HLO text (`compiled.as_text()`).

    module = parse(compiled.as_text())
    cost = module.cost()                         # a tree: plain ops, while loops (with trip counts), conditionals
    cost.total(choose=CHEAPEST)                  # bytes of one run, every conditional at its cheapest branch
    cost.total(choose=dearest_from(("decode/cache.py",)), trips={"while.12": 40})
    passes = loop_passes(module)                 # the generation loop: bytes of one cached pass and one full pass

A decoder at small batch is bound by memory traffic, so the figure that matters is the bytes each executed op reads
from and writes to the device's main memory. The accounting, per top-level op of a computation that runs (the entry,
while bodies and conditions, conditional branches, called computations; never the inside of a fusion, a reduction's
scalar function or a sort's comparator):

- an op reads each distinct operand once and writes its output: bytes = sum of operand bytes + output bytes;
- free (0 bytes): parameter, constant, tuple, get-tuple-element, bitcast, and the other ops that move no data
  (`_FREE`); a fusion that only bitcasts a parameter is free too;
- a slice, dynamic-slice or gather reads only what it takes (its output), not the whole operand: so does a fusion
  whose parameter is used only by such ops (the bytes they take, at most the parameter's);
- a dynamic-update-slice or scatter writes in place: it reads and writes the update, not the buffer; so does a
  fusion whose root is one (through bitcasts, or in its root tuple) with its buffer a parameter: that parameter
  is not read, and that output counts as the update's bytes;
- an asynchronous pair (`*-start` / `*-done`): the start reads the operands, the done writes the result;
- buffers outside the device's main memory (a layout with a memory space `S(n)`, n != 0: TPU's on-chip VMEM, or
  host memory) count 0: the copy that brings them in reads main memory once;
- a while loop costs trip count x (body + condition) + one more condition; the trip count is XLA's
  `known_trip_count` (backend_config) or one the caller passes by the loop's instruction name (a data-dependent
  loop, like the generation loop); a call costs its callee; a conditional costs the branch a `choose` function
  picks (each branch's cost is kept, so "one cached pass" and "one full pass" can both be read off).

Sizes are logical: the product of the dimensions times the element size (a TPU layout's tile padding is not
counted). These are the bytes the program asks for; caches (CPU L2/L3, TPU VMEM reuse XLA did not make explicit)
may serve some of them, so it is an upper bound on traffic that the same program cannot beat by reordering alone,
and the right quantity to compare with a floor (every weight and every cached K/V read once).
"""

from __future__ import annotations

import dataclasses
import re
from typing import Callable, Iterable, Mapping

_DTYPE_BYTES = {
    "pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4, "f32": 4,
    "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16, "s4": 0.5, "u4": 0.5, "s2": 0.25, "u2": 0.25,
    "token": 0, "opaque": 0,
}
# Ops that move no data of their own (their operands' bytes are counted where they are read).
_FREE = frozenset({
    "parameter", "constant", "tuple", "get-tuple-element", "bitcast", "after-all", "partition-id", "replica-id",
    "opt-barrier", "add-dependency", "domain", "get-dimension-size", "set-dimension-size", "optimization-barrier",
})
_TAKES_PART = frozenset({"slice", "dynamic-slice", "gather"})  # read only what they take from operand 0
_IN_PLACE = frozenset({"dynamic-update-slice", "scatter"})  # write their update into operand 0's buffer


@dataclasses.dataclass(frozen=True)
class Instruction:
    name: str
    shape: str  # HLO type text: "f32[8,64]{1,0}" or a tuple "(s32[], f32[8]{0})"
    opcode: str
    operands: tuple[str, ...]
    attrs: Mapping[str, str]
    root: bool = False

    @property
    def frame(self) -> int | None:
        m = re.search(r"stack_frame_id=(\d+)", self.attrs.get("metadata", ""))
        return int(m.group(1)) if m else None

    def called(self, key: str) -> tuple[str, ...]:
        """Computation names an attribute names (calls=, body=, branch_computations={...}, ...)."""
        value = self.attrs.get(key)
        if value is None:
            return ()
        return tuple(v.strip().lstrip("%") for v in value.strip("{}").split(",") if v.strip())


@dataclasses.dataclass
class Computation:
    name: str
    instructions: list[Instruction]
    entry: bool = False

    def __post_init__(self):
        self.by_name = {i.name: i for i in self.instructions}
        self.root = next((i for i in self.instructions if i.root), self.instructions[-1] if self.instructions else None)
        self.params = {int(re.match(r"\s*(\d+)", i.attrs["_args"]).group(1)): i
                       for i in self.instructions if i.opcode == "parameter"}
        users: dict[str, list[Instruction]] = {}
        for i in self.instructions:
            for o in dict.fromkeys(i.operands):
                users.setdefault(o, []).append(i)
        self.users = users


# ---------------------------------------------------------------- sizes


def shape_bytes(shape: str, every_space: bool = False) -> int:
    """Bytes of an HLO type in main memory: arrays summed over a tuple; 0 for a buffer in another memory space
    (unless `every_space`: its logical size wherever it lives)."""
    total = 0.0
    for m in re.finditer(r"\b([a-z]+[0-9]*(?:e[0-9]m[0-9][a-z0-9]*)?)\[([^\]]*)\](\{[^}]*\})?", shape):
        dtype, dims, layout = m.group(1), m.group(2), m.group(3) or ""
        if not every_space and re.search(r"S\(([1-9]\d*)\)", layout):  # on-chip (TPU VMEM) or host memory
            continue
        size = _DTYPE_BYTES.get(dtype)
        if size is None:
            size = 1 if dtype.startswith("f8") else 4  # fp8 variants; anything unknown as 4 bytes
        n = 1
        for d in filter(None, (x.strip() for x in dims.split(","))):
            n *= int(d.lstrip("<="))
        total += n * size
    return int(total)


def tuple_elements(shape: str) -> list[str]:
    """The top-level elements of a tuple type ("(a, (b, c), d)" -> ["a", "(b, c)", "d"]); [shape] for an array."""
    shape = shape.strip()
    if not shape.startswith("("):
        return [shape]
    return _split_top(re.sub(r"/\*.*?\*/", "", shape[1:_matching(shape, 0) - 1]))


# ---------------------------------------------------------------- parsing


def _unquoted(text: str, start: int = 0):
    """(index, character, bracket depth after it) of each character of `text` from `start` outside double quotes."""
    depth, quote, i = 0, False, start
    while i < len(text):
        c = text[i]
        if quote:
            if c == "\\":
                i += 1
            elif c == '"':
                quote = False
        elif c == '"':
            quote = True
        else:
            depth += (c in "([{") - (c in ")]}")
            yield i, c, depth
        i += 1


def _split_top(text: str, sep: str = ",") -> list[str]:
    """Split at `sep` outside brackets, braces, parentheses and quotes."""
    parts, start = [], 0
    for i, c, depth in _unquoted(text):
        if c == sep and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return [p.strip() for p in parts if p.strip()]


def _matching(text: str, start: int) -> int:
    """Index just past the bracket that closes the one at `start`."""
    for i, c, depth in _unquoted(text, start):
        if c in ")}]" and depth == 0:
            return i + 1
    raise ValueError(f"unbalanced brackets in HLO text: {text[start:start + 80]!r}")


_INSTR = re.compile(r"^\s*(ROOT\s+)?%?([\w.\-]+)\s*=\s*")


def _parse_instruction(line: str) -> Instruction | None:
    m = _INSTR.match(line)
    if not m:
        return None
    rest = line[m.end():]
    if rest.startswith("("):  # a tuple type
        end = _matching(rest, 0)
    else:
        end = rest.index(" ")
    shape, rest = rest[:end], rest[end:].lstrip()
    op_end = rest.index("(")
    opcode = rest[:op_end].strip()
    close = _matching(rest, op_end)
    args = rest[op_end + 1:close - 1]
    attrs: dict[str, str] = {"_args": args}
    for item in _split_top(rest[close:].lstrip(", ")):
        key, eq, value = item.partition("=")
        if eq:
            attrs[key.strip()] = value.strip()
    bare = re.sub(r"/\*.*?\*/", "", args)  # /*index=5*/ markers in long operand lists
    operands = tuple(tok.split()[-1].lstrip("%") for tok in _split_top(bare)
                     if opcode not in ("parameter", "constant", "iota") and tok.split()[-1].startswith("%"))
    return Instruction(m.group(2), shape, opcode, operands, attrs, root=bool(m.group(1)))


@dataclasses.dataclass(frozen=True)
class Frame:
    file: str
    function: str
    line: int


class HloModule:
    """An optimized HLO module's computations and its source stack frames (for naming where an op came from)."""

    def __init__(self, text: str):
        self.computations: dict[str, Computation] = {}
        self.entry = ""
        tables: dict[str, dict[int, str]] = {}
        table = None
        current: list[Instruction] | None = None
        header = None
        for line in text.splitlines():
            stripped = line.strip()
            if current is not None:
                if stripped == "}" or stripped.startswith("},"):  # "}, execution_thread=..." on TPU
                    name, entry = header
                    self.computations[name] = Computation(name, current, entry)
                    current = None
                    continue
                instr = _parse_instruction(line)
                if instr is not None:
                    current.append(instr)
                continue
            if stripped in ("FileNames", "FunctionNames", "FileLocations", "StackFrames"):
                table = tables.setdefault(stripped, {})
                continue
            if table is not None and re.match(r"^\d+ ", stripped):
                key, _, value = stripped.partition(" ")
                table[int(key)] = value
                continue
            table = None
            m = re.match(r"^(ENTRY\s+)?%?([\w.\-]+)\s+\(.*\)\s*->\s*.*\{$", stripped)
            if m:
                header = (m.group(2), bool(m.group(1)))
                if header[1]:
                    self.entry = header[0]
                current = []
        if not self.entry:
            raise ValueError("no ENTRY computation in the HLO text")
        self._tables = tables
        self._costs: dict[str, Cost] = {}

    # ------------------------------------------------ source frames

    def stack(self, frame_id: int | None) -> tuple[Frame, ...]:
        """The source stack of an op (innermost first), from the module's StackFrames table."""
        frames, seen = [], set()
        files, functions = self._tables.get("FileNames", {}), self._tables.get("FunctionNames", {})
        locations, stack_frames = self._tables.get("FileLocations", {}), self._tables.get("StackFrames", {})
        while frame_id and frame_id not in seen and frame_id in stack_frames:
            seen.add(frame_id)
            fields = dict(re.findall(r"(\w+)=(\d+)", stack_frames[frame_id]))
            loc = dict(re.findall(r"(\w+)=(\d+)", locations.get(int(fields.get("file_location_id", 0)), "")))
            frames.append(Frame(files.get(int(loc.get("file_name_id", 0)), "").strip('"'),
                                functions.get(int(loc.get("function_name_id", 0)), "").strip('"'),
                                int(loc.get("line", 0))))
            frame_id = int(fields.get("parent_frame_id", 0)) - 1  # the table's parent ids are one past the parent's
        return tuple(frames)

    # ------------------------------------------------ costs

    def cost(self, computation: str | None = None) -> "Cost":
        """The cost tree of one run of a computation (default: the entry)."""
        name = computation or self.entry
        if name not in self._costs:
            self._costs[name] = self._cost_of(self.computations[name])
        return self._costs[name]

    def _operand_shape(self, comp: Computation, name: str) -> str:
        instr = comp.by_name.get(name)
        return instr.shape if instr is not None else ""

    def _cost_of(self, comp: Computation) -> "Cost":
        cost = Cost(comp.name)
        for instr in comp.instructions:
            op = instr.opcode
            if op in _FREE:
                continue
            if op == "while":
                body, cond = instr.called("body")[0], instr.called("condition")[0]
                trips = _trip_count(instr)
                if trips is None:
                    trips = _counted_loop_trips(comp, instr, self.computations[cond], self.computations[body])
                cost.loops.append(Loop(instr.name, trips, self.cost(body), self.cost(cond)))
                continue
            if op == "conditional":
                names = instr.called("branch_computations") or (instr.called("true_computation")
                                                                 + instr.called("false_computation"))
                cost.branches.append(Branches(instr.name, self.stack(instr.frame),
                                              tuple(self.cost(n) for n in names)))
                continue
            if op in ("call", "async-start", "call-start") and (instr.called("to_apply") or instr.called("calls")):
                for callee in instr.called("to_apply") or instr.called("calls"):
                    cost.calls.append(self.cost(callee))
                continue
            if op in ("async-done", "async-update", "call-done"):  # the callee's cost is counted at its start
                continue
            cost.ops.append(OpBytes(instr.name, op, *self._op_bytes(comp, instr)))
        return cost

    def _op_bytes(self, comp: Computation, instr: Instruction) -> tuple[int, int]:
        """(bytes read, bytes written) of one top-level op."""
        op = instr.opcode
        operand_bytes = [shape_bytes(self._operand_shape(comp, o)) for o in dict.fromkeys(instr.operands)]
        out = shape_bytes(instr.shape)
        if op in ("slice-start", "dynamic-slice-start"):  # an async slice (TPU, into on-chip memory): the part taken
            parts = tuple_elements(instr.shape)
            taken = shape_bytes(parts[1], every_space=True) if len(parts) > 1 and operand_bytes[0] else 0
            return taken + sum(operand_bytes[1:]), 0
        if op.endswith("-start"):  # an async pair: the reads here, the write at its done
            return sum(operand_bytes), 0
        if op.endswith("-done"):
            return 0, out
        if op in _TAKES_PART:  # the part taken (and the indices), read from operand 0's memory
            taken = shape_bytes(instr.shape, every_space=True) if operand_bytes[0] else 0
            return taken + sum(operand_bytes[1:]), out
        if op in _IN_PLACE:  # the update (and indices) in, the update out
            update = operand_bytes[-1] if op == "scatter" else operand_bytes[1]
            rest = sum(operand_bytes[1:])
            return rest, update
        if op == "fusion":
            return self._fusion_bytes(comp, instr)
        return sum(operand_bytes), out

    def _fusion_bytes(self, comp: Computation, instr: Instruction) -> tuple[int, int]:
        fused = self.computations[instr.called("calls")[0]]
        root = _through_bitcasts_up(fused, fused.root)
        if root.opcode == "parameter":  # a fusion that only re-views a parameter
            return 0, 0
        in_place = _in_place_params(fused)
        read = 0
        seen = set()
        for index, operand in enumerate(instr.operands):
            if operand in seen:
                continue
            seen.add(operand)
            full = shape_bytes(self._operand_shape(comp, operand))
            param = fused.params.get(index)
            read += full if param is None else _param_read(self, fused, param, full, in_place)
        written = 0
        outputs = [fused.by_name[o] for o in fused.root.operands] if fused.root.opcode == "tuple" else [fused.root]
        for out in outputs:
            target = _through_bitcasts_up(fused, out)
            if target.opcode in _IN_PLACE and _buffer_param(fused, target) is not None:
                written += _update_bytes(fused, target)
            else:
                written += shape_bytes(out.shape)
        return read, written


def _trip_count(instr: Instruction) -> int | None:
    config = instr.attrs.get("backend_config", "")
    m = re.search(r'"known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"?(\d+)', config)
    return int(m.group(1)) if m else None


def _through_copies(comp: Computation, name: str) -> Instruction | None:
    """The instruction `name` is a copy, convert or bitcast of (itself when none), or None."""
    instr = comp.by_name.get(name)
    while instr is not None and instr.opcode in ("copy", "convert", "bitcast") and instr.operands:
        instr = comp.by_name.get(instr.operands[0])
    return instr


def _constant(comp: Computation, name: str) -> int | None:
    """The integer value of a scalar constant (through copies and converts), or None."""
    instr = _through_copies(comp, name)
    if instr is None or instr.opcode != "constant":
        return None
    m = re.fullmatch(r"\s*(-?\d+)\s*", instr.attrs["_args"])
    return int(m.group(1)) if m else None


def _tuple_index(comp: Computation, name: str) -> int | None:
    """i when `name` is element i of the computation's tuple parameter (through copies and converts), else None."""
    instr = _through_copies(comp, name)
    if instr is None or instr.opcode != "get-tuple-element":
        return None
    source = comp.by_name.get(instr.operands[0])
    if source is None or source.opcode != "parameter":
        return None
    return int(instr.attrs.get("index", "-1"))


def _counted_loop_trips(comp: Computation, loop: Instruction, cond: Computation, body: Computation) -> int | None:
    """The trip count of a counted loop XLA left unannotated (TPU): the condition compares element i of the state
    with a constant, element i starts at a constant and the body adds a constant to it. None when not so."""
    root = cond.root
    if root is None or root.opcode != "compare" or len(root.operands) != 2:
        return None
    direction = re.search(r"direction=(\w+)", ",".join(f"{k}={v}" for k, v in root.attrs.items()))
    a, b = root.operands
    index, bound, flip = _tuple_index(cond, a), _constant(cond, b), False
    if index is None or bound is None:
        index, bound, flip = _tuple_index(cond, b), _constant(cond, a), True
    if index is None or bound is None or direction is None:
        return None
    state = comp.by_name.get(loop.operands[0]) if loop.operands else None
    if state is None or state.opcode != "tuple" or index >= len(state.operands):
        return None
    start = _constant(comp, state.operands[index])
    out = body.root
    if start is None or out is None or out.opcode != "tuple":
        return None
    step_op = body.by_name.get(out.operands[index])
    if step_op is None or step_op.opcode != "add":
        return None
    x, y = step_op.operands
    step = _constant(body, y) if _tuple_index(body, x) == index else _constant(body, x)
    if not step:
        return None
    d = {"LT": "GT", "GT": "LT", "LE": "GE", "GE": "LE"}.get(direction.group(1), direction.group(1)) if flip \
        else direction.group(1)
    if d == "LT" and step > 0:
        return max(0, -(-(bound - start) // step))
    if d == "LE" and step > 0:
        return max(0, (bound - start) // step + 1)
    if d == "GT" and step < 0:
        return max(0, -(-(start - bound) // -step))
    if d == "GE" and step < 0:
        return max(0, (start - bound) // -step + 1)
    return None


def _through_bitcasts_up(comp: Computation, instr: Instruction) -> Instruction:
    """Follow a bitcast (or a fusion-internal reshape, a view) to what it re-views."""
    while instr.opcode in ("bitcast", "reshape") and instr.operands:
        instr = comp.by_name[instr.operands[0]]
    return instr


def _buffer_param(comp: Computation, instr: Instruction) -> Instruction | None:
    """The fusion parameter an in-place op writes into (its operand 0, through bitcasts), or None."""
    source = _through_bitcasts_up(comp, comp.by_name[instr.operands[0]])
    return source if source.opcode == "parameter" else None


def _update_bytes(comp: Computation, instr: Instruction) -> int:
    update = instr.operands[-1] if instr.opcode == "scatter" else instr.operands[1]
    return shape_bytes(comp.by_name[update].shape)


def _in_place_params(comp: Computation) -> set[str]:
    """Parameters of a fusion that an output writes into in place (an in-place op at the root)."""
    outputs = [comp.by_name[o] for o in comp.root.operands] if comp.root.opcode == "tuple" else [comp.root]
    names = set()
    for out in outputs:
        target = _through_bitcasts_up(comp, out)
        if target.opcode in _IN_PLACE:
            param = _buffer_param(comp, target)
            if param is not None:
                names.add(param.name)
    return names


def _param_read(module: "HloModule", comp: Computation, param: Instruction, full: int, in_place: set[str]) -> int:
    """Bytes a fusion reads of one parameter: what slices/gathers take of it (also inside a nested fusion, as TPU
    nests a dynamic-slice into a matmul's operand), nothing where it is only the buffer written in place, else all
    of it."""
    taken = 0
    frontier = [param]
    outputs = {comp.root.name, *(comp.root.operands if comp.root.opcode == "tuple" else ())}
    while frontier:
        node = frontier.pop()
        if node.name in outputs:  # passed out (a nested fusion's view of it): its consumer reads it
            return full
        for user in comp.users.get(node.name, ()):
            if user.opcode in ("bitcast", "reshape"):
                frontier.append(user)
            elif user.opcode in _TAKES_PART and user.operands[0] == node.name:
                taken += shape_bytes(user.shape, every_space=True)  # read from here, wherever it is written to
            elif user.opcode in _IN_PLACE and user.operands[0] == node.name and param.name in in_place:
                continue
            elif user.opcode == "fusion" and user.called("calls"):
                nested = module.computations[user.called("calls")[0]]
                for index, operand in enumerate(user.operands):
                    if operand == node.name and index in nested.params:
                        taken += _param_read(module, nested, nested.params[index], full, _in_place_params(nested))
            else:
                return full
    return min(taken, full)


# ---------------------------------------------------------------- the cost tree


@dataclasses.dataclass(frozen=True)
class OpBytes:
    name: str
    opcode: str
    read: int
    written: int

    @property
    def total(self) -> int:
        return self.read + self.written


@dataclasses.dataclass
class Loop:
    name: str
    trips: int | None  # XLA's known trip count; None: data-dependent
    body: "Cost"
    condition: "Cost"


@dataclasses.dataclass
class Branches:
    name: str
    stack: tuple[Frame, ...]  # where the conditional was written (innermost first)
    branches: tuple["Cost", ...]


# choose(conditional, [bytes of each branch]) -> the branch counted
Chooser = Callable[[Branches, list[int]], int]


def CHEAPEST(cond: Branches, totals: list[int]) -> int:  # noqa: N802 (a constant-like function)
    return min(range(len(totals)), key=totals.__getitem__)


def DEAREST(cond: Branches, totals: list[int]) -> int:  # noqa: N802
    return max(range(len(totals)), key=totals.__getitem__)


def written_in(cond: Branches, sources: Iterable[str]) -> bool:
    """Whether a conditional was written in a source file ending with one of `sources`: its innermost frame, where
    `lax.cond` / `lax.switch` was called (not a caller: every conditional of the model runs under the cache policy's
    calls)."""
    return bool(cond.stack) and any(cond.stack[0].file.endswith(s) or s.endswith("/") and s in cond.stack[0].file
                                    for s in sources)


# A cache policy's guard: a pass run only when some row needs it, skipped (zeros) otherwise (decode/cache's `when`,
# `when_else`). With per-row refreshes a pass holds both kinds: the refreshing rows' whole-canvas lanes (a choice
# whose dearest branch is the refresh) and the other rows' cached pass under a guard. A cached pass takes the guard
# (every row's cached pass runs) and no refresh; a full pass the refresh and no guarded pass.
GUARD_FUNCTIONS = ("when", "when_else")


def is_guard(cond: Branches) -> bool:
    return bool(cond.stack) and cond.stack[0].function in GUARD_FUNCTIONS


def dearest_from(sources: Iterable[str]) -> Chooser:
    """The full pass: the dearest branch of conditionals written in `sources` (the cache policy's pass choice; its
    guards at their cheapest), the cheapest of every other (data-dependent rare paths: a MoE layer's overflow, a
    rule's corner case)."""
    sources = tuple(sources)

    def choose(cond: Branches, totals: list[int]) -> int:
        dear = written_in(cond, sources) and not is_guard(cond)
        return (DEAREST if dear else CHEAPEST)(cond, totals)
    return choose


def cached_from(sources: Iterable[str]) -> Chooser:
    """The cached pass: the cache policy's guards (conditionals written in `sources` by GUARD_FUNCTIONS) at their
    dearest (the guarded pass runs), every other conditional at its cheapest (no refresh, the narrowest window)."""
    sources = tuple(sources)

    def choose(cond: Branches, totals: list[int]) -> int:
        dear = written_in(cond, sources) and is_guard(cond)
        return (DEAREST if dear else CHEAPEST)(cond, totals)
    return choose


class UnknownTripCount(ValueError):
    pass


@dataclasses.dataclass
class Cost:
    """One run of a computation: its plain ops, its loops, its conditionals and the computations it calls."""

    computation: str
    ops: list[OpBytes] = dataclasses.field(default_factory=list)
    loops: list[Loop] = dataclasses.field(default_factory=list)
    branches: list[Branches] = dataclasses.field(default_factory=list)
    calls: list["Cost"] = dataclasses.field(default_factory=list)

    def total(self, choose: Chooser = CHEAPEST, trips: Mapping[str, int] | None = None) -> int:
        """Bytes of one run: conditionals as `choose` picks, loops times their trip count (`trips` by loop name
        for loops XLA does not know the count of; a missing one raises UnknownTripCount)."""
        return sum(op.total * n for op, n in self.flat_ops(choose, trips))

    def flat_ops(self, choose: Chooser = CHEAPEST, trips: Mapping[str, int] | None = None
                 ) -> list[tuple[OpBytes, int]]:
        """Every op that runs, with how many times (loops unrolled into counts, conditionals chosen)."""
        trips = trips or {}
        out: list[tuple[OpBytes, int]] = [(op, 1) for op in self.ops]
        for callee in self.calls:
            out += callee.flat_ops(choose, trips)
        for loop in self.loops:
            n = trips.get(loop.name, loop.trips)
            if n is None:
                raise UnknownTripCount(f"while loop {loop.name} has a data-dependent trip count: pass trips="
                                       f"{{{loop.name!r}: n}}")
            out += [(op, count * n) for op, count in loop.body.flat_ops(choose, trips)]
            out += [(op, count * (n + 1)) for op, count in loop.condition.flat_ops(choose, trips)]
        for cond in self.branches:
            totals = [b.total(choose, trips) for b in cond.branches]
            out += cond.branches[choose(cond, totals)].flat_ops(choose, trips)
        return out

    def top(self, n: int = 10, choose: Chooser = CHEAPEST, trips: Mapping[str, int] | None = None
            ) -> list[tuple[OpBytes, int]]:
        """The n ops that move the most bytes, with how many times each runs (sorted by bytes x runs)."""
        return sorted(self.flat_ops(choose, trips), key=lambda oc: -oc[0].total * oc[1])[:n]


def parse(text: str) -> HloModule:
    """An optimized HLO module from `compiled.as_text()`."""
    return HloModule(text)


# ---------------------------------------------------------------- the generation loop

PASS_SOURCES = ("localleap_jax/decode/cache.py", "localleap_jax/decode/cache/")  # where a cache policy chooses a pass's kind


@dataclasses.dataclass(frozen=True)
class LoopPasses:
    """Bytes of the generation loop's passes (one iteration of its body each), and of what runs before it."""

    loop: str  # the loop's instruction name
    cached: int  # a pass that reads the cache: no refresh, its guarded cached pass run (`cached_from`)
    full: int  # the cache policy's conditionals at their dearest (the refresh / store / encode pass)
    before: int  # the program outside the loop (prefill, setup), conditionals at their cheapest
    cache_choices: int  # conditionals of the cache policy in the body (0: every pass is the same, e.g. no cache)

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


def generation_loop(module: HloModule) -> Loop:
    """The entry's data-dependent while loop with the dearest body (the generation loop: its trip count is the
    number of passes, known only at run time)."""
    loops = [loop for loop in loops_in(module.cost()) if loop.trips is None]
    if not loops:
        raise ValueError("the program has no data-dependent while loop")
    return max(loops, key=lambda loop: loop.body.total(CHEAPEST, once_each(loop.body)))


def loops_in(cost: Cost) -> list[Loop]:
    """Every while loop of a run of `cost` (nested ones inside loops not included: see once_each)."""
    out = list(cost.loops)
    for callee in cost.calls:
        out += loops_in(callee)
    for cond in cost.branches:
        for b in cond.branches:
            out += loops_in(b)
    return out


def once_each(cost: Cost) -> dict[str, int]:
    """Trip count 1 for every data-dependent loop inside, at any depth: `trips` for a pass's cost."""
    out = {}
    for loop in loops_in(cost):
        if loop.trips is None:
            out[loop.name] = 1
        out.update(once_each(loop.body))
    return out


def _cache_choices(cost: Cost, sources) -> int:
    n = sum(written_in(c, sources) for c in cost.branches)
    for c in cost.branches:
        n += sum(_cache_choices(b, sources) for b in c.branches)
    for callee in cost.calls:
        n += _cache_choices(callee, sources)
    return n


def loop_passes(module: HloModule | str, sources: Iterable[str] = PASS_SOURCES) -> LoopPasses:
    """The generation program's bytes per cached pass and per full pass (see LoopPasses); `module`: parsed, or the
    compiled program's text."""
    module = parse(module) if isinstance(module, str) else module
    sources = tuple(sources)
    loop = generation_loop(module)
    inner = once_each(loop.body)
    before_trips = {**once_each(module.cost()), loop.name: 0}
    before = module.cost().total(CHEAPEST, before_trips)
    return LoopPasses(loop.name, loop.body.total(cached_from(sources), inner) + loop.condition.total(CHEAPEST, inner),
                      loop.body.total(dearest_from(sources), inner) + loop.condition.total(CHEAPEST, inner),
                      before, _cache_choices(loop.body, sources))


def backend_estimate(compiled) -> dict:
    """XLA's own cost analysis of a compiled program, where its backend gives one: {'bytes accessed', 'flops',
    'optimal_seconds' (TPU), ...} (numbers only; {} when the backend has none)."""
    try:
        analysis = compiled.cost_analysis()
    except Exception:  # some backends raise instead of returning nothing
        return {}
    if isinstance(analysis, (list, tuple)):
        analysis = analysis[0] if analysis else {}
    return {k: float(v) for k, v in (analysis or {}).items() if isinstance(v, (int, float)) and " " not in k
            or k in ("bytes accessed", "optimal_seconds")}


__all__ = ["CHEAPEST", "DEAREST", "Branches", "Chooser", "Cost", "HloModule", "LoopPasses", "OpBytes",
           "GUARD_FUNCTIONS", "PASS_SOURCES", "UnknownTripCount", "backend_estimate", "cached_from", "dearest_from", "generation_loop", "loop_passes",
           "loops_in", "once_each",
           "parse", "shape_bytes", "written_in"]
