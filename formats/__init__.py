"""The packed low-bit K/V format (version 2). See FORMAT.md for the byte layout;
``formats.calibrate`` chooses precision classes by measured error."""
from formats.packed_kv import *  # noqa: F401,F403
from formats.packed_kv import __all__ as _format_all
from formats.calibration import PrecisionPolicy, calibrate  # noqa: F401

__all__ = list(_format_all) + ["PrecisionPolicy", "calibrate"]
