"""Views, the parts of a buffer that say what a sample returns for each drawn window: give
one to [`equibuffer.Buffer`][] or [`equibuffer.PrioritisedBuffer`][]. See
[Composing buffers](../composing.md).

A view is static configuration only (no arrays). It says how many consecutive steps one of
its samples spans (`window_length`: the window the rule draws), gathers them from the ring,
and zeroes what lies past an episode end when the rule pads. One module per view:

- `WindowView(sequence_length)`: the window itself, leaves `(batch, sequence_length, *leaf)`.
- `PairView()`: a [`equibuffer.Transition`][] `(first, second)` of two consecutive steps.
- `NStepView(n, discount, ...)`: an [`equibuffer.NStepTransition`][] over `n + 1` steps.
- `ItemView()`: one step, leaves `(batch, *leaf)`.

Adding a view is one class with the members of `AbstractView` (`window_length`,
`window_name`, `needs`, `checked`, `gather`, `padded`); no rule and no buffer changes.
"""

from ._base import AbstractView as AbstractView
from ._item import ItemView as ItemView
from ._nstep import NStepView as NStepView
from ._pair import PairView as PairView
from ._window import WindowView as WindowView
