"""Sampling rules, the parts of a buffer that say which windows may be drawn and how: give
one to [`equibuffer.Buffer`][] (uniform rules) or [`equibuffer.PrioritisedBuffer`][]
(prioritised rules). See [Composing buffers](../composing.md)."""

from .._buffers._rules import (
    AbstractPrioritisedRule as AbstractPrioritisedRule,
    AbstractRule as AbstractRule,
    AbstractUniformRule as AbstractUniformRule,
    Episodic as Episodic,
    Prioritised as Prioritised,
    PrioritisedEpisodic as PrioritisedEpisodic,
    Uniform as Uniform,
)
from .._buffers._window import Drawn as Drawn, Request as Request, Window as Window
from .._ring import Appended as Appended
