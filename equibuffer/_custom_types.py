from typing import Any, TypeAlias

import numpy as np
from jaxtyping import Array, ArrayLike, Bool, Float, Int, PyTree, Shaped, UInt, UInt32


# An experience tree: any pytree (dict, tuple, eqx.Module, ...) of arrays.
Experience: TypeAlias = PyTree[Shaped[Array, "..."]]
# What `add` takes: leaves `(add_batch_size, *leaf)` or `(add_batch_size, T, *leaf)`.
# (Underscore dims are documentation only: `add` checks them itself, with a message that
# names the leaf and the argument to change.)
ExperienceBatch: TypeAlias = PyTree[Shaped[Array | np.ndarray, "_add_batch_size ..."]]
# What the constructor takes: one example step, leaves of any array type.
ExampleTree: TypeAlias = PyTree[Any]

Scalar: TypeAlias = Shaped[Array, ""]
# The importance-sampling exponent of a prioritised `sample`: a float, or a 0-d array so
# that it may be annealed without retracing.
Beta: TypeAlias = float | Float[ArrayLike, ""]
BoolScalar: TypeAlias = Bool[Array, ""]
IntScalar: TypeAlias = Int[Array, ""]
Count: TypeAlias = UInt32[Array, ""]
# The count of steps added per row, as `RingStorage.count()` returns it (uint32 or uint64).
StepCount: TypeAlias = UInt[Array, ""]
Indices: TypeAlias = Int[Array, " batch"]
Steps: TypeAlias = UInt32[Array, " batch"]
