"""The packed low-bit K/V format (version 3). See FORMAT.md for the byte layout;
``KVStorage`` says how one is stored (classes, schemes, seeds); ``formats.calibrate``
chooses precision classes by measured error."""
import logging

from formats.packed_kv import *  # noqa: F401,F403
from formats.packed_kv import __all__ as _format_all
from formats.calibration import PrecisionPolicy, calibrate  # noqa: F401
from formats.reference import attention_f32, attention_lse_f32  # noqa: F401
from formats.storage import KVStorage  # noqa: F401

logging.getLogger(__name__).addHandler(logging.NullHandler())

__all__ = list(_format_all) + ["KVStorage", "PrecisionPolicy", "attention_f32", "attention_lse_f32", "calibrate"]
