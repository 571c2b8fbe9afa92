"""Sampling rules, the parts of a buffer that say which windows may be drawn and how: give
one to [`equibuffer.Buffer`][] (uniform rules) or [`equibuffer.PrioritisedBuffer`][]
(prioritised rules). See [Composing buffers](../composing.md).

A rule is an `eqx.Module` built from its configuration alone (`Episodic(episode_end="done")`);
a buffer sizes it to its ring (`sized`: the arrays it keeps beside the ring, allocated, and
the configuration checked against the example). The buffer then calls it on every add
(`added`, with what the ring's write reports), after `update` (`updated`) and after its ring
was replaced (`updated(..., restored=True)`: `with_storage`, `Archive.restore`,
`Archive.load`), asks it to `draw`, and a prioritised buffer hands it every
`set_priorities` (`reprioritised`). One module per rule, beside what they share:

- `_valid.py`: the valid-window rule (layout, validity by the counters, start steps, the
    still-held test), written once: every rule, the episode rule and the archive's host-side
    sampler and loader use it.
- `_episode_ends.py`: the episode-end flag of every slot, and the episode rule on top of
    the counters' (`never_cross`: no end before a window's last step; `pad`: cut at the end).
- `_by_priority.py`: checks of `alpha`, `beta` and priorities, the draw from a `SumTree`,
    importance weights, the update of a sum tree's priorities.

| rule | validity | drawn |
|---|---|---|
| `Uniform` | counters | uniformly, from the counters alone (no tree) |
| `Prioritised` | counters | in proportion to `p ** alpha` |
| `RankPrioritised` | counters | in proportion to `rank ** -alpha` |
| `Episodic` | counters + episode rule | exactly uniformly (a tree of 0/1 leaves) |
| `PrioritisedEpisodic` | counters + episode rule | in proportion to `p ** alpha` |
"""

from .._ring import Appended as Appended
from ._base import (
    AbstractPrioritisedRule as AbstractPrioritisedRule,
    AbstractRule as AbstractRule,
    AbstractUniformRule as AbstractUniformRule,
)
from ._episodic import Episodic as Episodic
from ._prioritised import Prioritised as Prioritised
from ._prioritised_episodic import PrioritisedEpisodic as PrioritisedEpisodic
from ._ranked import RankPrioritised as RankPrioritised
from ._request import Drawn as Drawn, Request as Request, Update as Update, Window as Window
from ._uniform import Uniform as Uniform
