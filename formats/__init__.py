"""The packed low-bit K/V format (version 1). See FORMAT.md for the byte layout."""
from formats.packed_kv import *  # noqa: F401,F403
from formats.packed_kv import (BLOCK, CLASSES, CLASS_ID, FORMAT_VERSION, PackedKV, PackedKVMeta,
                               buffer_specs, check_packed, dequantize_reference, hadamard_rotation,
                               hadamard_signs, pack_nibbles, quantize_reference, resolve_block_classes,
                               unpack_nibbles)
