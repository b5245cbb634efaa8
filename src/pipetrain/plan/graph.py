"""A model as the planner sees it: nodes, edges, and every cut between stages.

A pipeline stage is a set of nodes; a plan is valid when every edge points from a stage
to itself or to a later stage. The stages before any point of the pipeline therefore
form a *cut*: a set of nodes closed under predecessors (a downward-closed set, an ideal
of the DAG; PipeDream enumerates the same sets through their antichains). A plan of
``K`` stages is a chain of cuts ``{} = C_0 < C_1 < ... < C_K = all nodes``, stage ``j``
being ``C_j - C_{j-1}``. For a sequence of layers the cuts are its prefixes; for a
branching model (ResNet, GNMT) there are more, and :class:`CutGraph` lists them all, so
the planner searches every valid partition, not only the prefixes of one topological
order.

Each cut carries the sums the cost models need (compute, parameters, activations, ...)
and its *boundary*: the bytes of activations that cross it (the outputs of nodes inside
whose consumers are outside). A stage between cuts ``a < b`` sums ``b - a`` and receives
``boundary[a]`` and sends ``boundary[b]``.

Cuts are numbered in order of size (0 is the empty cut, the last one holds every node),
so a cut's supersets all have higher numbers.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

from pipetrain.plan.costs import StageLoad
from pipetrain.plan.profile import LayerProfile, Profile

__all__ = ["DEFAULT_MAX_CUTS", "CutGraph"]

DEFAULT_MAX_CUTS = 10_000
"""The most cuts :class:`CutGraph` enumerates before giving up with advice."""

_SUMS = (
    "compute_s",
    "parameter_bytes",
    "activation_bytes",
    "weight_memory_bytes",
    "saved_bytes",
    "forward_s",
    "backward_input_s",
    "backward_weight_s",
    "gradient_bytes",
    "optimizer_step_s",
)


_MAXES = ("workspace_bytes", "input_workspace_bytes", "layer_saved_bytes")
"""What a stage takes the largest of over its nodes: the temporary memory of a backward,
which runs one node at a time, and the saved activations of a node (what a ``per_layer``
backward rebuilds at once)."""


def _values(layer: LayerProfile) -> list[float]:
    """One layer's value of each of ``_SUMS``; a backward's halves not measured are half
    the backward each for a layer with parameters (all of it input gradients without),
    as the profile says."""
    weight_s = layer.backward_weight_s
    if weight_s is None:
        weight_s = layer.backward_s / 2 if layer.parameter_bytes else 0.0
    input_s = layer.backward_input_s
    if input_s is None:
        input_s = layer.backward_s - weight_s
    gradients = layer.parameter_bytes if layer.gradient_bytes is None else layer.gradient_bytes
    return [
        layer.compute_s,
        float(layer.parameter_bytes),
        float(layer.output_bytes),
        float(layer.weight_memory_bytes),
        float(layer.saved_bytes),
        layer.forward_s,
        input_s,
        weight_s,
        float(gradients),
        layer.optimizer_step_s or 0.0,
    ]


class CutGraph:
    """The DAG of a profile and all its cuts, with per-cut sums and boundaries.

    Example:
        >>> from pipetrain.plan.profile import LayerProfile, Profile
        >>> layers = tuple(LayerProfile(name=n, forward_s=1.0, backward_s=1.0, output_bytes=8)
        ...                for n in "abcd")
        >>> diamond = CutGraph(Profile(layers=layers, edges=((0, 1), (0, 2), (1, 3), (2, 3))))
        >>> diamond.num_cuts  # {}, {a}, {a,b}, {a,c}, {a,b,c}, all
        6
        >>> [diamond.boundary[c] for c in range(diamond.num_cuts)]
        [0.0, 8.0, 16.0, 16.0, 16.0, 0.0]
        >>> diamond.nodes_between(1, 4)
        [1, 2]
    """

    def __init__(self, profile: Profile, *, max_cuts: int = DEFAULT_MAX_CUTS) -> None:
        self.profile = profile
        n = profile.num_layers
        self.num_nodes = n
        self.successors = [sorted(set(targets)) for targets in profile.successors()]
        self.predecessors: list[list[int]] = [[] for _ in range(n)]
        for a, targets in enumerate(self.successors):
            for b in targets:
                self.predecessors[b].append(a)
        self.topological_order = _topological_order(self.successors, self.predecessors, profile)
        self._pred_mask = [sum(1 << p for p in preds) for preds in self.predecessors]
        self._succ_mask = [sum(1 << s for s in succs) for succs in self.successors]
        self.cuts: list[int] = []
        """Each cut as a bit mask of node indices, smallest first."""
        self._children: list[list[int]] = []
        self.sums: dict[str, list[float]] = {name: [] for name in _SUMS}
        """Per cut, the sum over its nodes of each quantity in ``_SUMS``."""
        self.boundary: list[float] = []
        """Per cut, the bytes of activations crossing it."""
        self._enumerate(max_cuts)
        self.is_chain = len(self.cuts) == n + 1
        """Whether the cuts are nested (a sequence, or a DAG with one topological order)."""
        self._supersets: list[Sequence[int]] | None = None
        layers = profile.layers
        self._maxes = {name: values if any(values) else [] for name, values in (
            ("workspace_bytes", [float(x.backward_workspace_bytes or 0) for x in layers]),
            ("input_workspace_bytes", [float(x.backward_input_workspace_bytes or 0)
                                       for x in layers]),
            ("layer_saved_bytes", [float(x.saved_bytes) for x in layers]),
        )}
        """Per node, each of :data:`_MAXES` (an empty list where no node has one)."""
        self._largest_first = {name: sorted(range(len(values)), key=lambda v: -values[v])
                               for name, values in self._maxes.items()}

    # -- construction ----------------------------------------------------------------------
    def _enumerate(self, max_cuts: int) -> None:
        layers = self.profile.layers
        values = [_values(layer) for layer in layers]
        index: dict[int, int] = {0: 0}
        self.cuts = [0]
        self._children = [[]]
        for name in _SUMS:
            self.sums[name].append(0.0)
        self.boundary = [0.0]
        frontier = [(0, frozenset(v for v in range(self.num_nodes) if not self.predecessors[v]))]
        while frontier:
            next_frontier = []
            for cut, ready in frontier:
                parent = index[cut]
                for v in sorted(ready):
                    child = cut | 1 << v
                    if child in index:
                        self._children[parent].append(index[child])
                        continue
                    if len(self.cuts) >= max_cuts:
                        raise ValueError(
                            f"the graph's {self.num_nodes} nodes have more than {max_cuts} "
                            f"cuts (sets of nodes closed under predecessors); the planner "
                            f"tries them all, which is too many here. Fix: merge parallel "
                            f"branches into single nodes in the profile (as PipeDream's "
                            f"compress_branches does), or pass a larger max_cuts"
                        )
                    k = len(self.cuts)
                    index[child] = k
                    self.cuts.append(child)
                    self._children.append([])
                    self._children[parent].append(k)
                    for name, value in zip(_SUMS, values[v]):
                        self.sums[name].append(self.sums[name][parent] + value)
                    self.boundary.append(self._boundary_after(parent, child, v))
                    grown = set(ready)
                    grown.discard(v)
                    grown.update(
                        s for s in self.successors[v] if self._pred_mask[s] & ~child == 0
                    )
                    next_frontier.append((child, frozenset(grown)))
            frontier = next_frontier

    def _boundary_after(self, parent: int, child: int, v: int) -> float:
        out = self.profile.layers
        value = self.boundary[parent]
        if self.successors[v]:
            value += out[v].output_bytes
        for u in self.predecessors[v]:
            if self._succ_mask[u] & ~child == 0:  # v was u's last consumer outside
                value -= out[u].output_bytes
        return value

    # -- queries -----------------------------------------------------------------------------
    @property
    def num_cuts(self) -> int:
        return len(self.cuts)

    @property
    def full(self) -> int:
        """The number of the cut holding every node."""
        return len(self.cuts) - 1

    def supersets(self, cut: int) -> Sequence[int]:
        """The numbers of the cuts strictly containing ``cut``, ascending."""
        if self._supersets is None:
            self._supersets = self._all_supersets()
        return self._supersets[cut]

    def _all_supersets(self) -> list[Sequence[int]]:
        count = len(self.cuts)
        if self.is_chain:
            return [range(c + 1, count) for c in range(count)]
        reach = [0] * count  # bit k set: cut k strictly contains this one
        for c in range(count - 1, -1, -1):
            bits = 0
            for child in self._children[c]:
                bits |= reach[child] | 1 << child
            reach[c] = bits
        return [_bit_indices(bits) for bits in reach]

    def nodes_between(self, a: int, b: int) -> list[int]:
        """The node indices in cut ``b`` but not in cut ``a`` (ascending)."""
        return _bit_indices(self.cuts[b] & ~self.cuts[a])

    def node_ids(self, a: int, b: int) -> tuple[str | int, ...]:
        """The ids of the nodes between cuts ``a`` and ``b`` as plans name them: layer
        indices for a layer sequence, the profile's node names for a graph."""
        nodes = self.nodes_between(a, b)
        if self.profile.is_sequence:
            return tuple(nodes)
        return tuple(self.profile.layers[v].name for v in nodes)

    def stage_max(self, name: str, a: int, b: int) -> float:
        """The largest ``name`` (:data:`_MAXES`: a node's temporary memory) of a stage's nodes."""
        values = self._maxes[name]
        if not values:  # none measured: 0 without looking at the nodes
            return 0.0
        inside = self.cuts[b] & ~self.cuts[a]
        # the largest first: a stage usually holds one of the few largest nodes
        return next((values[v] for v in self._largest_first[name] if inside >> v & 1), 0.0)

    def max_column(self, name: str, a: int, ends: Sequence[int]) -> list[float]:
        """:meth:`stage_max` from cut ``a`` to each of ``ends`` (ascending), in one pass
        where the cuts are nested; empty when no node has a value (a profile without
        them, e.g. PipeDream's: the planner's rows then cost nothing more)."""
        if not self._maxes[name]:
            return []
        if not self.is_chain:
            return [self.stage_max(name, a, b) for b in ends]
        values, order, out, best, done = self._maxes[name], self.topological_order, [], 0.0, a
        for b in ends:  # a chain's cut k holds the first k nodes of the topological order
            for v in order[done:b]:
                best = max(best, values[v])
            done = b
            out.append(best)
        return out

    def stage_sum(self, name: str, a: int, b: int) -> float:
        """The sum of ``name`` (one of ``compute_s``, ``parameter_bytes``,
        ``activation_bytes``, ``weight_memory_bytes``, ``saved_bytes``, ``forward_s``,
        ``backward_input_s``, ``backward_weight_s``, ``gradient_bytes``, ``optimizer_step_s``) over a stage."""
        values = self.sums[name]
        return values[b] - values[a]

    def load(self, a: int, b: int) -> StageLoad:
        """The stage between cuts ``a`` and ``b`` (``a`` strictly inside ``b``): its sums,
        the bytes crossing its two cuts (none after the last node), first, last."""
        return StageLoad(
            compute_s=self.stage_sum("compute_s", a, b),
            parameter_bytes=self.stage_sum("parameter_bytes", a, b),
            activation_bytes=self.stage_sum("activation_bytes", a, b),
            input_bytes=self.boundary[a],
            output_bytes=0.0 if b == self.full else self.boundary[b],
            is_first=a == 0,
            is_last=b == self.full,
            weight_memory_bytes=self.stage_sum("weight_memory_bytes", a, b),
            saved_bytes=self.stage_sum("saved_bytes", a, b),
            forward_s=self.stage_sum("forward_s", a, b),
            backward_input_s=self.stage_sum("backward_input_s", a, b),
            backward_weight_s=self.stage_sum("backward_weight_s", a, b),
            gradient_bytes=self.stage_sum("gradient_bytes", a, b),
            optimizer_step_s=self.stage_sum("optimizer_step_s", a, b),
            workspace_bytes=self.stage_max("workspace_bytes", a, b),
            input_workspace_bytes=self.stage_max("input_workspace_bytes", a, b),
            layer_saved_bytes=self.stage_max("layer_saved_bytes", a, b),
        )

    def contains(self, a: int, b: int) -> bool:
        """Whether cut ``a`` is a subset of cut ``b``."""
        return self.cuts[a] & ~self.cuts[b] == 0


_BYTE_BITS = [tuple(k for k in range(8) if byte >> k & 1) for byte in range(256)]


def _bit_indices(bits: int) -> list[int]:
    """The positions of the set bits of ``bits``, ascending (a byte at a time)."""
    out: list[int] = []
    base = 0
    for byte in bits.to_bytes((bits.bit_length() + 7) // 8, "little"):
        if byte:
            out.extend(base + k for k in _BYTE_BITS[byte])
        base += 8
    return out


def _topological_order(
    successors: list[list[int]], predecessors: list[list[int]], profile: Profile
) -> list[int]:
    """Kahn's order, lowest index first among ready nodes; a cycle is a ValueError."""
    remaining = [len(p) for p in predecessors]
    ready = [v for v, count in enumerate(remaining) if count == 0]
    heapq.heapify(ready)
    order = []
    while ready:
        v = heapq.heappop(ready)
        order.append(v)
        for s in successors[v]:
            remaining[s] -= 1
            if remaining[s] == 0:
                heapq.heappush(ready, s)
    if len(order) != len(successors):
        stuck = [profile.layers[v].name for v, count in enumerate(remaining) if count > 0]
        raise ValueError(
            f"the profile's edges have a cycle through the nodes {stuck[:10]}"
            f"{' ...' if len(stuck) > 10 else ''}; a pipeline needs a DAG: remove the edge "
            f"that points back"
        )
    return order

