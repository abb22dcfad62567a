"""PyTorch bridge: the JAX kernels as torch custom ops, with zero-copy hand-offs.

Importing this package first sets JAX's GPU allocator policy (see
``torch_bridge.allocator``): no preallocated pool and JAX's platform allocator, unless
already set, so memory one framework frees is there for the other. Import it before
anything starts JAX's GPU backend, or the policy cannot apply (a warning then says so).

Public surface:

* The settings, as in JAX: ``QKVLayout`` (heads, QK norm, RoPE style), ``KVStorage``
  (precision classes, schemes, seeds), ``Dense`` / ``Sol`` (attention), ``QKVWeights``.
* ``streamed_qkv`` / ``packed_attention`` / ``sol_attention`` / ``attention_layer``:
  front ends over the custom ops ``torch.ops.packed_kv.*``.
* ``required_bytes``: the device memory an attention block needs above what the
  caller holds (``PackedAttention.required_bytes`` for a module's own settings).
* ``TorchPackedKV``: torch mirror of ``formats.PackedKV`` (same buffers, same meta).
* ``PackedAttention`` (any layout) / ``PackedH3Attention`` (its H3 preset) /
  ``ReferenceH3Attention``: attention blocks on the ops, and the plain BF16 torch block
  whose ``state_dict`` the H3 preset loads.

Inference only: the ops register no backward. ``auto`` choices and installs are logged
(``logging.getLogger("pallas_kernels")`` / ``"torch_bridge"``).
"""
import logging

from torch_bridge import allocator

allocator.configure()

import torch  # noqa: E402

allocator.check_jax_sees_the_gpu(torch.cuda.is_available(), allocator.jax_cuda_plugin(), torch.version.cuda)

# torch imports torch._dynamo lazily, on the first call of any custom op (its
# disable-dynamo wrapper). That import leaves a reference cycle holding the calling
# frames, so the first op call's tensors (the block's input and its Q-sized output)
# would stay allocated until Python's garbage collector next runs: a model loop with
# gc disabled ran out of memory at its second block (issue 36, H100). Importing it
# here, before any op runs, keeps that cycle away from the tensors of a call.
import torch._dynamo  # noqa: E402,F401

from torch_bridge.allocator import allocator_status, check_allocator  # noqa: E402
from torch_bridge.dlpack import BridgeError, to_jax, to_torch  # noqa: E402
from torch_bridge.packed_kv import (TorchPackedKV, meta_from_json, meta_from_tensor,  # noqa: E402
                                    meta_to_json, meta_to_tensor, torch_buffer_specs)
from torch_bridge.ops import (attention_layer, packed_attention, required_bytes,  # noqa: E402
                             segment_ids_from_cu_seqlens, sol_attention, streamed_qkv)
from torch_bridge.attention_module import PackedAttention, PackedH3Attention, ReferenceH3Attention  # noqa: E402
from formats.storage import KVStorage  # noqa: E402
from pallas_kernels.attention_config import Dense, Sol  # noqa: E402
from pallas_kernels.qkv_layout import AddedTokens, QKVLayout, QKVWeights  # noqa: E402

logging.getLogger(__name__).addHandler(logging.NullHandler())

__all__ = ["allocator_status", "check_allocator", "BridgeError", "to_jax", "to_torch", "TorchPackedKV",
           "meta_from_json", "meta_from_tensor", "meta_to_json", "meta_to_tensor", "torch_buffer_specs",
           "attention_layer", "packed_attention", "required_bytes", "segment_ids_from_cu_seqlens", "sol_attention",
           "streamed_qkv", "AddedTokens", "Dense", "KVStorage", "PackedAttention", "PackedH3Attention", "QKVLayout",
           "QKVWeights", "ReferenceH3Attention", "Sol"]
