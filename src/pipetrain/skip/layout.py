"""Skip layout: which layer stashes and pops each skip, and what crosses each stage.

Read from the ``@skippable`` declarations, without running the model. Every skip key
``(namespace, name)`` must be stashed by exactly one layer and popped by exactly one
layer at or after it. Skippable layers nested inside a child (a block holding several
layers) count as that child's.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from torch import nn

from pipetrain.skip.namespace import SkipKey
from pipetrain.skip.skippable import Skippable

__all__ = ["SkipLayout", "SkipRoute", "skip_layout", "verify_skippables"]

_FIX = """\
Every skip must be stashed by exactly one layer and popped by exactly one later layer.
To use a name more than once, isolate each stash/pop pair in its own namespace:

    from pipetrain.skip import Namespace
    ns1, ns2 = Namespace(), Namespace()
    model = nn.Sequential(
        Stash().isolate(ns1), Stash().isolate(ns2), Pop().isolate(ns2), Pop().isolate(ns1),
    )"""


@dataclasses.dataclass(frozen=True)
class SkipRoute:
    """One skip: its key and the stages (partition indexes) that stash and pop it.

    Example:
        >>> SkipRoute((None, "skip"), stash_stage=0, pop_stage=2).crosses(1)
        True
    """

    key: SkipKey
    _: dataclasses.KW_ONLY
    stash_stage: int
    pop_stage: int

    def crosses(self, j: int) -> bool:
        """Whether the skip travels over the boundary from stage ``j`` to ``j + 1``."""
        return self.stash_stage <= j < self.pop_stage


@dataclasses.dataclass(frozen=True)
class SkipLayout:
    """The skip routes of a model cut into ``num_stages`` partitions.

    ``routes`` are ordered by where the skip is stashed (layer order, then name), which
    depends only on the model's structure: two processes that build the same model
    list the same routes in the same order even though their :class:`Namespace` ids
    differ, so skips sent between processes can be matched by position in
    :meth:`crossing`.

    Example:
        >>> route = SkipRoute((None, "s"), stash_stage=0, pop_stage=2)
        >>> layout = SkipLayout(3, routes=(route,))
        >>> layout.stashes(0), layout.pops(2), layout.crossing(0), layout.crossing(1)
        (((None, 's'),), ((None, 's'),), ((None, 's'),), ((None, 's'),))
    """

    num_stages: int
    _: dataclasses.KW_ONLY
    routes: tuple[SkipRoute, ...]

    def _check(self, j: int) -> None:
        if not 0 <= j < self.num_stages:
            raise IndexError(
                f"stage index {j} is out of range for a layout of {self.num_stages} stages"
            )

    def stashes(self, j: int) -> tuple[SkipKey, ...]:
        """Keys of the skips stage ``j`` stashes."""
        self._check(j)
        return tuple(r.key for r in self.routes if r.stash_stage == j)

    def pops(self, j: int) -> tuple[SkipKey, ...]:
        """Keys of the skips stage ``j`` pops."""
        self._check(j)
        return tuple(r.key for r in self.routes if r.pop_stage == j)

    def crossing(self, j: int) -> tuple[SkipKey, ...]:
        """Keys of the skips stage ``j`` sends to stage ``j + 1`` (none from the last).

        Exactly the keys left in stage ``j``'s tracker after it ran one micro-batch:
        received and not popped at ``j``, or stashed at ``j`` and popped later.
        """
        self._check(j)
        return tuple(r.key for r in self.routes if r.crosses(j))

    def incoming(self, j: int) -> tuple[SkipKey, ...]:
        """Keys of the skips stage ``j`` receives from stage ``j - 1`` (none at 0)."""
        self._check(j)
        return self.crossing(j - 1) if j > 0 else ()

    def requires_copy(self, key: SkipKey) -> bool:
        """Whether the skip ``key`` leaves the stage that stashes it."""
        return any(r.key == key and r.stash_stage != r.pop_stage for r in self.routes)


def _in(key: SkipKey) -> str:
    """`` (in <Namespace ...>)`` for a skip outside the default namespace, else ``''``."""
    return "" if key[0] is None else f" (in {key[0]!r})"


def _scan(stages: Sequence[nn.Module]) -> tuple[list[SkipRoute], list[str]]:
    """Routes and problems of the skippable layers under each stage's children."""
    stashed_at: dict[SkipKey, tuple[int, str]] = {}
    popped_at: dict[SkipKey, str] = {}
    routes: list[SkipRoute] = []
    problems: list[str] = []
    for j, stage in enumerate(stages):
        for child_name, child in stage.named_children():
            layers = [
                (name, layer)
                for name, layer in child.named_modules(prefix=child_name)
                if isinstance(layer, Skippable)
            ]
            pops: list[tuple[str, SkipKey]] = []
            for name, layer in layers:
                both = sorted(layer.stashable_names & layer.poppable_names)
                for skip in both:
                    problems.append(
                        f"'{name}' declared {skip!r} both as stashable and as poppable"
                    )
                for key in layer.stashable():
                    if key[1] in both:
                        continue
                    if key in stashed_at:
                        problems.append(
                            f"'{name}' redeclared {key[1]!r} as stashable but not isolated "
                            f"by namespace{_in(key)}: '{stashed_at[key][1]}' stashes it "
                            f"already"
                        )
                        continue
                    stashed_at[key] = (j, name)
                pops.extend((name, key) for key in layer.poppable() if key[1] not in both)
            # Pops after the child's stashes: a block may stash and pop internally.
            for name, key in pops:
                if key in popped_at:
                    problems.append(
                        f"'{name}' redeclared {key[1]!r} as poppable but not isolated by "
                        f"namespace{_in(key)}: '{popped_at[key]}' pops it already"
                    )
                elif key not in stashed_at:
                    problems.append(
                        f"'{name}' declared {key[1]!r} as poppable but it was not stashed"
                        f"{_in(key)}: no earlier layer stashes it"
                    )
                else:
                    popped_at[key] = name
                    routes.append(SkipRoute(key, stash_stage=stashed_at[key][0], pop_stage=j))
    for key, (_, name) in stashed_at.items():
        if key not in popped_at:
            problems.append(
                f"no module declared {key[1]!r} as poppable but stashed{_in(key)}: '{name}' "
                f"stashes it and no later layer pops it"
            )
    order = {key: index for index, key in enumerate(stashed_at)}
    routes.sort(key=lambda route: order[route.key])
    return routes, problems


def _raise(problems: list[str]) -> None:
    listed = "\n".join(f"* {problem}" for problem in problems)
    raise TypeError(f"one or more pairs of stash and pop do not match:\n\n{listed}\n\n{_FIX}")


def verify_skippables(module: nn.Module) -> None:
    """Check that every stash in ``module``'s children has exactly one later pop.

    Raises:
        TypeError: listing every unmatched stash or pop and every name declared
            twice in one namespace, with the fix (:meth:`Skippable.isolate`).

    Example:
        >>> from torch import nn
        >>> from pipetrain.skip import skippable, stash
        >>> @skippable(stash=["skip"])
        ... class Save(nn.Module):
        ...     def forward(self, x):
        ...         yield stash("skip", x)
        ...         return x
        >>> try:
        ...     verify_skippables(nn.Sequential(Save()))
        ... except TypeError as error:
        ...     print(str(error).splitlines()[2])
        * no module declared 'skip' as poppable but stashed: '0' stashes it and no later layer pops it
    """
    _, problems = _scan([module])
    if problems:
        _raise(problems)


def skip_layout(partitions: Sequence[nn.Module]) -> SkipLayout:
    """The skip routes of a model cut into ``partitions`` (stage ``j`` = ``partitions[j]``).

    Raises:
        TypeError: the skips do not match, as for :func:`verify_skippables` on the
            whole model.

    Example:
        >>> from torch import nn
        >>> from pipetrain.skip import pop, skippable, stash
        >>> @skippable(stash=["skip"])
        ... class Save(nn.Module):
        ...     def forward(self, x):
        ...         yield stash("skip", x)
        ...         return x
        >>> @skippable(pop=["skip"])
        ... class Add(nn.Module):
        ...     def forward(self, x):
        ...         return x + (yield pop("skip"))
        >>> model = nn.Sequential(Save(), nn.ReLU(), nn.ReLU(), Add())
        >>> layout = skip_layout([model[:1], model[1:3], model[3:]])
        >>> layout.stashes(0), layout.crossing(0), layout.crossing(1), layout.pops(2)
        (((None, 'skip'),), ((None, 'skip'),), ((None, 'skip'),), ((None, 'skip'),))
    """
    routes, problems = _scan(partitions)
    if problems:
        _raise(problems)
    return SkipLayout(len(partitions), routes=tuple(routes))
