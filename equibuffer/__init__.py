"""equibuffer: experience-replay buffers for JAX as immutable Equinox modules."""

from ._archive import (
    Archive as Archive,
    ArchiveLockedError as ArchiveLockedError,
    ArchiveSample as ArchiveSample,
    StepsLostError as StepsLostError,
    StepsLostWarning as StepsLostWarning,
)
from ._buffers._base import (
    AbstractBuffer as AbstractBuffer,
    Sample as Sample,
    Transition as Transition,
)
from ._buffers._item import ItemBuffer as ItemBuffer
from ._buffers._trajectory import TrajectoryBuffer as TrajectoryBuffer
from ._buffers._transition import TransitionBuffer as TransitionBuffer
from ._ring import RingStorage as RingStorage


__version__ = "0.1.0"
