"""Skippable layers: ``@skippable`` modules whose generator ``forward`` stashes and pops.

A skip connection carries a tensor from the layer that stashes it to a later layer
that pops it, over the layers in between (and over pipeline stages)::

    @skippable(stash=["skip"])
    class Down(nn.Module):
        def forward(self, x):
            yield stash("skip", x)
            return self.conv(x)

    @skippable(pop=["skip"])
    class Up(nn.Module):
        def forward(self, x):
            skip = yield pop("skip")
            return self.conv(x) + skip

Names are declared up front so that the layout (who stashes, who pops, what crosses
each stage boundary) is known without running the model.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Generator, Iterable, Iterator
from typing import Any, ClassVar, TypeVar

from torch import Tensor, nn

from pipetrain.skip.namespace import Namespace, SkipKey
from pipetrain.skip.tracker import current_skip_tracker

__all__ = ["Skippable", "pop", "skippable", "stash"]

SkippableT = TypeVar("SkippableT", bound="Skippable")


class stash:  # lower case like torchgpipe's: it reads as a verb in `yield stash(...)`
    """The command ``yield stash(name, tensor)``: hand ``tensor`` to a later ``pop``.

    Example:
        >>> import torch
        >>> command = stash("skip", torch.ones(1))
        >>> command.name
        'skip'
    """

    __slots__ = ("name", "tensor")

    def __init__(self, name: str, tensor: Tensor | None) -> None:
        self.name = name
        self.tensor = tensor


class pop:
    """The command ``tensor = yield pop(name)``: take the tensor an earlier layer stashed.

    Example:
        >>> pop("skip").name
        'skip'
    """

    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name


class Skippable(nn.Module):
    """A module with skip connections; made by :func:`skippable`, not directly.

    Wraps an instance of the decorated class as ``self.module`` (so state dict keys
    match torchgpipe's) and runs its ``forward``, serving the ``stash`` and ``pop``
    commands it yields from the current thread's skip tracker.
    """

    module_cls: ClassVar[type[nn.Module]]
    stashable_names: ClassVar[frozenset[str]]
    poppable_names: ClassVar[frozenset[str]]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__()
        self.module = self.module_cls(*args, **kwargs)
        self.namespaces: dict[str, Namespace | None] = {}

    def __repr__(self) -> str:
        return f"@skippable({self.module!r})"

    def namespaced(self, name: str) -> SkipKey:
        """The key ``(namespace, name)`` this layer uses for the skip ``name``."""
        return (self.namespaces.get(name), name)

    def stashable(self) -> Iterator[SkipKey]:
        """Keys of the skips this layer stashes, by name."""
        for name in sorted(self.stashable_names):
            yield self.namespaced(name)

    def poppable(self) -> Iterator[SkipKey]:
        """Keys of the skips this layer pops, by name."""
        for name in sorted(self.poppable_names):
            yield self.namespaced(name)

    def isolate(
        self: SkippableT, ns: Namespace | None, *, only: Iterable[str] | None = None
    ) -> SkippableT:
        """Put this layer's skips (or only those named) in namespace ``ns``; returns self.

        Two pairs of layers can then use the same skip name, each pair isolated in
        its own namespace. ``ns=None`` puts them back in the default namespace. Names
        in ``only`` that this layer does not declare change nothing; as torchgpipe
        accepts them, they are not an error, but a ``UserWarning`` names them.

        Raises:
            TypeError: ``ns`` is neither a :class:`Namespace` nor None.

        Example:
            >>> from torch import nn
            >>> @skippable(stash=["skip"])
            ... class Save(nn.Module):
            ...     def forward(self, x):
            ...         yield stash("skip", x)
            ...         return x
            >>> ns = Namespace()
            >>> Save().isolate(ns).namespaced("skip") == (ns, "skip")
            True
        """
        if not isinstance(ns, Namespace):  # None is one: the default namespace
            raise TypeError(
                f"isolate() takes a Namespace, got {ns!r}; fix: ns = Namespace(); "
                f"layer.isolate(ns)"
            )
        declared = self.stashable_names | self.poppable_names
        names = declared if only is None else set([only] if isinstance(only, str) else only)
        unknown = sorted(names - declared)
        if unknown:
            warnings.warn(
                f"{type(self).__name__}.isolate(only=...) names skips it does not declare, "
                f"{unknown} (it declares {sorted(declared)}): they are not isolated; fix: "
                f"isolate(ns, only={sorted(names & declared)}) or declare them in "
                f"@skippable(stash=..., pop=...)",
                stacklevel=2,
            )
        for name in names & declared:
            self.namespaces[name] = ns
        return self

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Run the wrapped ``forward``, serving its ``stash`` / ``pop`` commands.

        Stashed tensors reach the tracker when ``forward`` returns (all together).

        Raises:
            RuntimeError: a command for an undeclared name, a pop of a skip nothing
                stashed, or a declared skip not stashed / popped (each message holds
                torchgpipe's wording, e.g. ``'x' must be stashed but have not``).
            TypeError: a yielded value that is not a command (as torchgpipe's).
        """
        tracker = current_skip_tracker()
        result = self.module(*args, **kwargs)
        stashed: dict[str, Tensor | None] = {}
        popped: set[str] = set()
        if isinstance(result, Generator):
            output = self._serve(result, tracker.pop, stashed, popped)
        else:
            output = result
        unused = [
            f"{', '.join(repr(n) for n in sorted(names))} must be {verb} but have not"
            for names, verb in ((self.stashable_names - stashed.keys(), "stashed"),
                                (self.poppable_names - popped, "popped"))
            if names
        ]
        if unused:
            raise RuntimeError(
                f"{type(self).__name__} declares skips it did not use in this forward: "
                f"{'; '.join(unused)}; fix: yield stash(name, tensor) / pop(name) for "
                f"every declared name on every call"
            )
        for name, tensor in stashed.items():
            tracker.stash(self.namespaced(name), tensor)
        return output

    def _serve(
        self,
        generator: Generator[Any, Tensor | None, Any],
        take: Callable[[SkipKey], Tensor | None],
        stashed: dict[str, Tensor | None],
        popped: set[str],
    ) -> Any:
        layer = type(self).__name__
        reply: Tensor | None = None
        while True:
            try:
                command = generator.send(reply)  # send(None) also starts it
            except StopIteration as stop:
                return stop.value
            reply = None
            if isinstance(command, stash):
                if command.name not in self.stashable_names:
                    raise RuntimeError(
                        f"{layer} stashed {command.name!r}: {command.name!r} has not been "
                        f"declared as stashable (stash={sorted(self.stashable_names)}); "
                        f"fix: add it to @skippable(stash=[...])"
                    )
                stashed[command.name] = command.tensor
            elif isinstance(command, pop):
                if command.name not in self.poppable_names:
                    raise RuntimeError(
                        f"{layer} popped {command.name!r}: {command.name!r} has not been "
                        f"declared as poppable (pop={sorted(self.poppable_names)}); fix: "
                        f"add it to @skippable(pop=[...])"
                    )
                if command.name in popped:
                    raise RuntimeError(f"{layer} popped {command.name!r} twice in one forward")
                try:
                    tensor = take(self.namespaced(command.name))
                except KeyError as error:
                    raise RuntimeError(
                        f"{layer} pops {command.name!r} but {command.name!r} has not been "
                        f"stashed: {error.args[0]}; fix: run the layer that stashes it earlier in "
                        f"the same forward, and check the model with "
                        f"verify_skippables(model)"
                    ) from None
                popped.add(command.name)
                reply = tensor
            else:
                raise TypeError(
                    f"{command!r} is not a command from @skippable: {layer}.forward "
                    f"yielded it; fix: a skippable forward may only yield stash(name, "
                    f"tensor) or pop(name)"
                )


def skippable(
    stash: Iterable[str] = (), pop: Iterable[str] = ()
) -> Callable[[type[nn.Module]], type[Skippable]]:
    """Class decorator declaring the skips a module stashes and pops.

    The decorated class's ``forward`` may be a generator that yields
    ``stash(name, tensor)`` and ``tensor = yield pop(name)`` for the declared names,
    then returns its output. Works in a plain ``nn.Sequential`` (the current thread's
    default tracker carries the skips) and in a pipeline. Same as torchgpipe's.

    Example:
        >>> import torch
        >>> from torch import nn
        >>> from pipetrain.skip import pop as pop_, stash as stash_
        >>> @skippable(stash=["1to3"])
        ... class Layer1(nn.Module):
        ...     def forward(self, x):
        ...         yield stash_("1to3", x)
        ...         return x * 2
        >>> @skippable(pop=["1to3"])
        ... class Layer3(nn.Module):
        ...     def forward(self, x):
        ...         skip = yield pop_("1to3")
        ...         return x + skip
        >>> model = nn.Sequential(Layer1(), nn.Identity(), Layer3())
        >>> model(torch.ones(1)).tolist()
        [3.0]
    """
    stash_names = frozenset([stash] if isinstance(stash, str) else stash)
    pop_names = frozenset([pop] if isinstance(pop, str) else pop)

    def decorate(module_cls: type[nn.Module]) -> type[Skippable]:
        qualname = module_cls.__qualname__
        attrs = {
            "module_cls": module_cls,
            "stashable_names": stash_names,
            "poppable_names": pop_names,
            "__module__": module_cls.__module__,
            "__qualname__": qualname,
            "__doc__": module_cls.__doc__,
        }
        cls = type(module_cls.__name__, (Skippable,), attrs)
        # The decorated name now refers to `cls`; let pickle find the original class
        # as `cls.module_cls`, so models holding skippable layers can be pickled.
        module_cls.__qualname__ = f"{qualname}.module_cls"
        return cls

    return decorate
