"""Pallas kernels: streamed QKV projection and attention over packed low-bit K/V.

The public JAX API (each function's docstring gives shapes and dtypes):

* ``QKVLayout``: how a block makes q and k (heads, QK norm, RoPE style); ``QKVLayout.h3``.
* ``QKVWeights``: the projection's arrays (w_qkv, bias, QK-norm weights) as one value.
* ``AddedTokens``: joint text+video attention's added tokens and their own ``QKVWeights``.
* ``streamed_qkv``: x @ W_qkv -> (Q bf16 rotated, ``formats.PackedKV``), never the full QKV.
* ``Dense`` / ``Sol``: attention settings as values (method, scratch, tiles; Sol's routing).
* ``packed_attention``: dense attention of Q over a PackedKV (streamed cuDNN or fused).
* ``sol_attention``: Sol sparse attention over a PackedKV.
* ``attention_layer``: projection + attention in one call, the output over Q.
* ``required_bytes``: device memory an attention block needs, phase by phase.
* ``segment_ids_from_cu_seqlens``; ``rope`` (RoPE tables for the projection).

The storage of the packed K/V is a ``formats.KVStorage``. Every ``auto`` choice is
logged (``logging.getLogger("pallas_kernels")``, INFO) with the reasons it passed
over the other methods.
"""
import logging

from pallas_kernels import rope
from pallas_kernels.attention import (packed_attention, packed_attention_lse, packed_attention_reference,
                                      segment_ids_from_cu_seqlens)
from pallas_kernels.attention_config import DEFAULT_SCRATCH_BYTES, Dense, Sol
from pallas_kernels.layer import attention_layer, required_bytes
from pallas_kernels.qkv_layout import AddedTokens, QKVLayout, QKVWeights
from pallas_kernels.qkv_projection import ProjectionTuning, streamed_qkv, streamed_qkv_reference
from pallas_kernels.sol import sol_attention, sol_attention_reference

logging.getLogger(__name__).addHandler(logging.NullHandler())

__all__ = ["AddedTokens", "DEFAULT_SCRATCH_BYTES", "Dense", "ProjectionTuning", "QKVLayout", "QKVWeights", "Sol",
           "attention_layer", "packed_attention", "packed_attention_lse", "packed_attention_reference",
           "required_bytes", "rope", "segment_ids_from_cu_seqlens", "sol_attention", "sol_attention_reference",
           "streamed_qkv", "streamed_qkv_reference"]
