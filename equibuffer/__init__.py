"""equibuffer: experience-replay buffers for JAX as immutable Equinox modules."""

from . import rules as rules, views as views
from ._archive import (
    Archive as Archive,
    ArchiveLoader as ArchiveLoader,
    ArchiveLockedError as ArchiveLockedError,
    ArchiveSample as ArchiveSample,
    ArchiveSet as ArchiveSet,
    as_jax as as_jax,
    LoaderBatch as LoaderBatch,
    LoaderPosition as LoaderPosition,
    StepsLostError as StepsLostError,
    StepsLostWarning as StepsLostWarning,
)
from ._buffers._base import (
    AbstractBuffer as AbstractBuffer,
    AbstractUniformBuffer as AbstractUniformBuffer,
)
from ._buffers._episode_trajectory import (
    EpisodeSample as EpisodeSample,
    EpisodeTrajectoryBuffer as EpisodeTrajectoryBuffer,
    PrioritisedEpisodeSample as PrioritisedEpisodeSample,
    PrioritisedEpisodeTrajectoryBuffer as PrioritisedEpisodeTrajectoryBuffer,
)
from ._buffers._epochs import Epoch as Epoch
from ._buffers._generic import Buffer as Buffer
from ._buffers._item import ItemBuffer as ItemBuffer
from ._buffers._prioritised import (
    AbstractPrioritisedBuffer as AbstractPrioritisedBuffer,
    PrioritisedBuffer as PrioritisedBuffer,
    PrioritisedItemBuffer as PrioritisedItemBuffer,
    PrioritisedSample as PrioritisedSample,
    PrioritisedTrajectoryBuffer as PrioritisedTrajectoryBuffer,
    PrioritisedTransitionBuffer as PrioritisedTransitionBuffer,
)
from ._buffers._queue import Queue as Queue
from ._buffers._samples import (
    AbstractPrioritisedSample as AbstractPrioritisedSample,
    AbstractSample as AbstractSample,
    Sample as Sample,
)
from ._buffers._sizes import Sizes as Sizes
from ._buffers._trajectory import TrajectoryBuffer as TrajectoryBuffer
from ._buffers._transition import TransitionBuffer as TransitionBuffer
from ._cluster import (
    AbstractClusteredBuffer as AbstractClusteredBuffer,
    ClusteredBuffer as ClusteredBuffer,
    ClusteredSample as ClusteredSample,
    PrioritisedClusteredBuffer as PrioritisedClusteredBuffer,
    PrioritisedClusteredSample as PrioritisedClusteredSample,
)
from ._errors import check as check, filter_jit as filter_jit
from ._frames import Frames as Frames
from ._mixer import MixedSample as MixedSample, Mixer as Mixer
from ._offline import (
    from_d4rl as from_d4rl,
    from_minari as from_minari,
    from_vault as from_vault,
    SourceError as SourceError,
    to_minari as to_minari,
)
from ._protocol import (
    AbstractPrioritisedSource as AbstractPrioritisedSource,
    AbstractReplayBuffer as AbstractReplayBuffer,
    AbstractSource as AbstractSource,
)
from ._ratelimit import RateLimited as RateLimited
from ._ring import RingStorage as RingStorage
from ._sharding import per_device as per_device, shard_rows as shard_rows
from ._sumtree import SumTree as SumTree
from .views._nstep import n_step_transition as n_step_transition, NStepTransition as NStepTransition
from .views._pair import Transition as Transition


__version__ = "0.1.0"
