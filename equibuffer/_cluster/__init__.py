"""Clustered replay: items routed at `add` time to one of K clusters, each its own ring.

Split along its seams: the samples (`_samples.py`), the storage of K rings (`_storage.py`),
the rules a draw uses (`_rules.py`), the abstract buffer and its checked configuration
(`_base.py`), the two final buffers (`_buffers.py`).
"""

from ._base import AbstractClusteredBuffer as AbstractClusteredBuffer
from ._buffers import (
    ClusteredBuffer as ClusteredBuffer,
    PrioritisedClusteredBuffer as PrioritisedClusteredBuffer,
)
from ._samples import (
    ClusteredSample as ClusteredSample,
    PrioritisedClusteredSample as PrioritisedClusteredSample,
)
from ._storage import ClusterStorage as ClusterStorage
