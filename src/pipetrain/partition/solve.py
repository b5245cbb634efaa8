"""The balancing problem's solver, under torchgpipe's name for its module.

An alias of :func:`pipetrain.plan.contiguous.solve`, the one min-max contiguous
partition of pipetrain (the planner uses it too).

Example:
    >>> solve([1, 1, 8, 1, 1], 3)
    [2, 1, 2]
"""

from pipetrain.plan.contiguous import solve

__all__ = ["solve"]
