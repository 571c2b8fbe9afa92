"""Offline data sets in and out of an `Archive`: imports from Minari, D4RL files and
Flashbax Vaults (one module a format over `_source`, which streams any of them), and the
export to Minari."""

from ._d4rl import from_d4rl as from_d4rl
from ._export import to_minari as to_minari
from ._minari import from_minari as from_minari
from ._source import SourceError as SourceError
from ._vault import from_vault as from_vault
