"""The packed low-bit K/V format (version 1). See FORMAT.md for the byte layout."""
from formats.packed_kv import *  # noqa: F401,F403
from formats.packed_kv import __all__  # noqa: F401
