"""The archive: a zarr v3 store that extends a buffer's time axis without bound, one module
per concern (see `_archive.py`)."""

from ._archive import Archive as Archive
from ._loader import (
    ArchiveLoader as ArchiveLoader,
    LoaderBatch as LoaderBatch,
    LoaderPosition as LoaderPosition,
)
from ._reader import ring_holding as ring_holding
from ._sampler import ArchiveSample as ArchiveSample, as_jax as as_jax
from ._set import ArchiveSet as ArchiveSet
from ._store import ArchiveLockedError as ArchiveLockedError
from ._writer import StepsLostError as StepsLostError, StepsLostWarning as StepsLostWarning
