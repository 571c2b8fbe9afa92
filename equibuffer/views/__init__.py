"""Views, the parts of a buffer that say what a sample returns for each drawn window: give
one to [`equibuffer.Buffer`][] or [`equibuffer.PrioritisedBuffer`][]. See
[Composing buffers](../composing.md)."""

from .._buffers._views import (
    AbstractView as AbstractView,
    ItemView as ItemView,
    NStepView as NStepView,
    PairView as PairView,
    WindowView as WindowView,
)
