"""What a clustered buffer's `sample` returns: the sample types, with each item's cluster."""

from typing import Any

from jaxtyping import Array, Float, Int, UInt32

from .._buffers._samples import AbstractPrioritisedSample, AbstractSample, error_field
from .._custom_types import Indices, Steps


class ClusteredSample(AbstractSample):
    """What [`equibuffer.ClusteredBuffer.sample`][] returns: a [`equibuffer.Sample`][] plus
    the cluster of each item.

    - `experience`: the sampled items, leaves `(batch, *leaf)`.
    - `indices`: `(batch,)` int32, `cluster * cluster_capacity + slot` of each item.
    - `steps`: `(batch,)` uint32, each item's place in its cluster's order of arrival (the
        number of items routed to that cluster before it, mod 2**32): it tells whether the
        slot has been overwritten since.
    - `cluster`: `(batch,)` int32, the cluster each item was drawn from.

    !!! example

        ```python
        import equibuffer as eb, jax, jax.numpy as jnp

        buffer = eb.ClusteredBuffer({"x": jnp.float32(0)}, add_batch_size=4, num_clusters=2,
                                    cluster_capacity=8,
                                    cluster_fn=lambda item: (item["x"] > 0).astype(jnp.int32))
        buffer = buffer.add({"x": jnp.array([-1.0, 2.0, -3.0, 4.0])})
        sample = buffer.sample(jax.random.key(0), batch_size=8)
        assert isinstance(sample, eb.ClusteredSample) and sample.cluster.dtype == jnp.int32
        assert ((sample.experience["x"] > 0) == (sample.cluster == 1)).all()
        assert (sample.indices // 8 == sample.cluster).all()  # cluster * cluster_capacity + slot
        assert (sample.steps <= 1).all()  # each cluster received two items: numbers 0 and 1
        ```
    """

    experience: Any
    indices: Indices
    steps: Steps
    cluster: Int[Array, " batch"]
    error: UInt32[Array, ""] = error_field()


class PrioritisedClusteredSample(AbstractPrioritisedSample):
    """What [`equibuffer.PrioritisedClusteredBuffer.sample`][] returns: a
    [`equibuffer.PrioritisedSample`][] plus the cluster of each item.

    - `experience`, `indices`, `steps`, `cluster`: as in [`equibuffer.ClusteredSample`][].
    - `probabilities`: `(batch,)` float32, the probability with which each item was drawn:
        its cluster's share times its share of that cluster's `priority ** alpha` (see
        [`equibuffer.PrioritisedClusteredBuffer`][]).
    - `weights`: `(batch,)` float32 importance weights correcting the priorities' bias
        inside each cluster, `(n_c * P(i | c)) ** -beta` over their largest in the batch
        (the largest is 1); the clusters' own shares are kept, as in the uniform
        `ClusteredBuffer`.

    !!! example

        ```python
        import equibuffer as eb, jax, jax.numpy as jnp

        buffer = eb.PrioritisedClusteredBuffer(
            {"x": jnp.float32(0)}, add_batch_size=4, num_clusters=2, cluster_capacity=8,
            cluster_fn=lambda item: (item["x"] > 0).astype(jnp.int32))
        buffer = buffer.add({"x": jnp.array([-1.0, 2.0, -3.0, 4.0])})
        sample = buffer.sample(jax.random.key(0), batch_size=8, beta=0.4)
        assert isinstance(sample, eb.PrioritisedClusteredSample)
        # two clusters of two items at equal priority: each item has probability 1/2 * 1/2
        assert jnp.allclose(sample.probabilities, 0.25) and jnp.allclose(sample.weights, 1.0)
        ```
    """

    experience: Any
    indices: Indices
    steps: Steps
    probabilities: Float[Array, " batch"]
    weights: Float[Array, " batch"]
    cluster: Int[Array, " batch"]
    error: UInt32[Array, ""] = error_field()
