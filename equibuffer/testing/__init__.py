"""Tools to property-test code that uses equibuffer: Hypothesis strategies of example trees,
buffer configurations, buffers, batches and filled buffers, and a NumPy reference model of
what a buffer holds and may sample.

Needs Hypothesis: `pip install equibuffer[testing]`.
"""

try:
    import hypothesis as _hypothesis  # noqa: F401
except ImportError as error:  # pragma: no cover (tested in a subprocess)
    raise ImportError(
        "equibuffer.testing needs Hypothesis, which is not installed: "
        "`pip install equibuffer[testing]` (or `pip install hypothesis`)."
    ) from error

from ._configs import (
    buffer_configs as buffer_configs,
    BufferConfig as BufferConfig,
    buffers as buffers,
)
from ._examples import examples as examples, leaves as leaves
from ._models import (
    EpisodeRule as EpisodeRule,
    flat_index as flat_index,
    History as History,
    ItemView as ItemView,
    n_step as n_step,
    NStepView as NStepView,
    PairView as PairView,
    Priorities as Priorities,
    rule_model as rule_model,
    UniformRule as UniformRule,
    view_model as view_model,
    window_of as window_of,
    WindowView as WindowView,
)
from ._reference import BufferReference as BufferReference, QueueReference as QueueReference
from ._strategies import batches as batches, filled_buffers as filled_buffers


__all__ = [
    "batches",
    "buffer_configs",
    "BufferConfig",
    "BufferReference",
    "buffers",
    "EpisodeRule",
    "examples",
    "filled_buffers",
    "flat_index",
    "History",
    "ItemView",
    "leaves",
    "n_step",
    "NStepView",
    "PairView",
    "Priorities",
    "QueueReference",
    "rule_model",
    "UniformRule",
    "view_model",
    "window_of",
    "WindowView",
]
