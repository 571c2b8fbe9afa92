"""The sum tree: `SumTree` (one tree) and `SumTrees` (several of one layout in one array),
built on the layout of their nodes (`_layout.py`), the search down from the top level
(`_search.py`) and the writes up from the leaves (`_writes.py`)."""

from ._tree import SumTree as SumTree
from ._trees import SumTrees as SumTrees
