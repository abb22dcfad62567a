"""Hopper (sm_90) Mosaic-GPU flash attention over packed int4 K/V.

What it is
----------
``packed_attention_mgpu(q, packed)`` computes the same thing as
``pallas_kernels.attention.packed_attention(q, packed, keep_rotated=True)`` (dense,
no masks) with a Pallas **Mosaic-GPU** kernel (``jax.experimental.pallas.mosaic_gpu``)
instead of Pallas-Triton: wgmma tensor-core instructions, TMA copies and a
warp-specialized FlashAttention-3 structure. It is a prototype to measure how close a
wgmma kernel that dequantizes int4 K/V in the kernel gets to cuDNN BF16 attention.
The Triton kernel is at ~2.7x cuDNN and Pallas-Triton's own BF16 flash attention at
~1.38x, so a Triton kernel cannot get there; only wgmma can.

Scope (anything else raises ValueError / NotImplementedError)
-------------------------------------------------------------
``packed_attention_mgpu`` (the standalone entry point the probe times):
* every 64-token block int4 (``block_classes`` all 0), K scheme ``channel``, V
  scheme ``token``, head_dim D = 128, bf16 q (B, Tq, H, D) in the rotated basis;
* ``num_tokens`` a multiple of ``block_kv`` (64 or 128), so there are no padding rows;
* Tq a multiple of ``2 * block_q`` (two compute warpgroups of ``block_q`` rows each);
* no segments / masks; output in the rotated basis (``keep_rotated=True``), bf16.

``_attention_call`` (what ``attention.packed_attention`` runs on Hopper, see its
"Hopper fast path"): the first ``num_q_tiles`` q tiles, the first ``kv_steps`` steps of
the int4 store, a head range, and the lse of the covered keys, so that the Triton
kernel can continue the same online softmax over the int8 / bf16 blocks, a ragged int4
tail and the ragged q rows. ``attention_call_reference`` is its float32 reference. Any
Tq of at least one q tile: when Tq is not a multiple of 8, which TMA's 8-row tiling of
the GMEM q and output views refuses, the memory warpgroup loads the q tiles through its
registers into the same swizzled SMEM tiles, and each compute warpgroup stores its
output from registers (benchmarks/NOTES.md: as fast as TMA at T=152k; the q load in
the compute warpgroups cost 4%).

Design
------
* One CTA = 3 warpgroups (as jax's ``ops/gpu/attention_mgpu.py``; 4 with
  ``converter_wgs=2``): warpgroups 0 and 1
  each own ``block_q`` query rows; warpgroup 2 only issues TMA copies of the int4 code
  tiles (``block_kv`` x 64 bytes) and the small scale/zero rows into rings of
  ``max_concurrent_steps`` slots, guarded by "loaded" and "consumed" mbarriers.
  Grid is (q tiles, H, B): q tiles vary fastest, so the CTAs running together share
  one head's K/V in L2.
* wgmma's B operand must be in SMEM, so each compute warpgroup dequantizes the code
  tiles into its own bf16 SMEM tiles (``k_deq``, ``v_deq``: ``block_kv`` x 128,
  128-byte swizzle), ``commit_smem()``, then runs ``Q @ K^T`` and ``P @ V`` with
  wgmma exactly like the BF16 kernel. The codes ring slot is released as soon as the
  codes are in registers (earlier than in the BF16 kernel).
* Nibbles without shifts (Mosaic-GPU has no pointwise ops on 8-bit values except
  bitwise ones): the codes are read as int8 and ``c & 0x0F`` is the low nibble
  (channels [0, 64)); ``(c & 0xF0) ^ 0x80`` is, as a *signed* int8, ``16 * (hi - 8)``
  (channels [64, 128)). Both use Mosaic's fast signed int8 -> bf16 conversion (exact).
* K "channel": ``k = code * s + z`` per (block, channel) is applied to the 64 x 128
  tile in f32 (or packed bf16 with ``k_math="bf16"``) before the store to ``k_deq``;
  the high half uses ``s / 16`` and ``z + 8 s``.
* V "token": the scale multiplies p instead: ``O += (p * s_t) @ codes + p @ z_t``,
  so ``v_deq`` holds raw codes (``[lo | 16 (hi - 8)]``, exact in bf16) and the zero
  term is one number per query row, accumulated in a (block_q,) vector. With
  ``P' = bf16(p * s_t)`` the high half is ``(P' @ hi16) / 16 + 8 * rowsum(P')``;
  the correction uses the *rounded* P', so the offset cancels exactly.
* Softmax in base 2 with ``sm_scale * log2(e)`` folded into the exp2 argument (as in
  the BF16 kernel, whose m is kept pre-scaled). Row sums (l, sum p z, sum P') are
  rescaled by alpha each step and applied once at the end.
* ``overlap=True``: V codes are dequantized while the QK wgmma runs and the next
  K tile while the PV wgmma runs (both only touch the other SMEM tile), so the
  conversion work hides under the tensor core instead of lengthening the
  critical path. ``overlap=False`` dequantizes each tile right before its wgmma.
* ``shared_deq=True`` (variant ``shared_deq``, block_q 128): each tile is dequantized
  once per CTA instead of once per compute warpgroup. ``k_deq`` / ``v_deq`` become
  rings of 2 bf16 tiles (indexed by kv step, same SMEM size) read by both warpgroups:
  warpgroup 0 produces every K tile, warpgroup 1 every V-codes tile, each during its
  own PV wgmma of the previous step (the first ones before the loop). Per ring slot a
  "ready" mbarrier (1 arrival: producer, after ``commit_smem()``) and a "free" one (2
  arrivals: each warpgroup once its wgmma on the tile has completed; the producer waits
  on it before overwriting). K codes are then read by warpgroup 0 only, so the
  "K consumed" barrier has 1 arrival; warpgroup 1 waits "V loaded" once per step, when
  it dequantizes (it reads the V scales later without waiting again).
* ``v_math="tile"`` (variants ``vtile*``, the default ``vtile``; needs shared_deq):
  warpgroup 1 dequantizes the whole V tile, ``v = code * s_t + z_t`` with the per-token
  vectors broadcast along rows (the same math as K's, transposed), so the softmax is
  plain FA3 (no ``p * s_t``, no ``sum p z``, no ``sum P'`` row sums) and the epilogue is
  ``acc / l``. The V codes and scales are then read by warpgroup 1 only. On the H200 the
  V terms in the softmax were the largest single cost (diagnostics below).
* ``deq_wg=True`` (variants ``deqwg*``; needs shared_deq and v_math="tile"): the memory
  warpgroup, which only issued TMA copies, also converts every K and V code tile into the
  shared bf16 rings (``cfg.deq_slots`` deep), so the compute warpgroups run plain FA3 on
  bf16 tiles and the conversion leaves their instruction stream. It reads the code slots
  itself, so it refills a slot right after converting it (no "consumed" barriers).
  Registers move to it with setmaxnreg (``compute_regs`` / ``memory_regs``). setmaxnreg
  only moves the registers allocated at launch (168 per thread for 3 warpgroups), so the
  three values must add up to at most 504; 2 x 224 + 64 = 512 hung on the H200 (a
  compute warpgroup's increase waits forever), which the CPU interpreter does not model.
* ``bf16_scales=True`` (variants ``*_pk*``; convert="magic" with bf16 math): the wrapper
  rounds the K/V scales and group midpoints (z + 8 s) to bf16 once, so the converter loads
  them ready instead of loading f32 values and computing them per tile. The same bf16
  values as before, so the same output bits; about 3% faster at the default point, for
  bf16 copies of the scale arrays (+0.09 GiB peak in one H3 layer at T=152,263; +0.07
  since a call on a group of heads rounds only that group's scales).
* ``converter_wgs=2`` (variants ``deqwg2*``; needs deq_wg): two converting warpgroups,
  one loading and converting every K tile (and the q tiles without TMA), the other every
  V tile, in parallel. Four warpgroups get 128 registers each at launch, so
  2 x compute + 2 x memory <= 512.
* ``auto_barriers=False`` (variants ``*_nab``; needs deq_wg): compiled with Pallas'
  ``unsafe_no_auto_barriers``, without the warpgroup barrier Pallas puts before and after
  each SMEM store (8 of a converter's 9 barriers per step). The ordering these variants
  rely on instead is written out at ``MgpuConfig.auto_barriers``.
* ``cluster_share=True`` (variants ``*_cl2*``; needs converter_wgs=2 at 64 rows x 128
  keys): the grid runs in clusters of 2 CTAs on adjacent q tiles of one head, which
  need the same K/V tiles. CTA r loads and converts only keys [64 r, 64 r + 64) of each
  128-key step (its K converter that half of K, its V converter that half of V) and
  stores the bf16 rows into its own ring and, with ``plgpu.async_store_smem``
  (st.async into the peer's shared memory, completing bytes on the peer's "ready"
  mbarrier), into the peer's ring: each CTA converts half of every tile. "ready" then
  counts 3 arrivals (the local converter and the peer's two stores), "free" is a
  cluster barrier that both compute warpgroups of both CTAs arrive on (each converter
  overwrites rows in both CTAs), and the compute warpgroups fence (``commit_smem``)
  after each ready wait, since st.async writes are generic-proxy writes that wgmma
  reads through the async proxy. A last cluster barrier keeps either CTA from exiting
  while its peer may still arrive on its barriers. Needs an even number of q tiles.
  Measured slower, not faster: 1.71-1.82 s against 1.45 s without the cluster at
  T=152,320 on the H200 (``attention_mgpu_probe_19.json``); the fences cost nothing
  (``_20``). Kept as a record of the lever, not for use.

Variants (``variant=`` keyword, see ``VARIANTS``) exist so that one GPU run can
compare a few design points; they only change code generation, never results beyond
bf16 rounding (``k_math="bf16"`` rounds s and z to bf16: cos about 0.99996 against the
float32 reference instead of 0.99999). ``DIAGNOSTIC_VARIANTS`` skip parts of the work
and give wrong results on purpose: the probe times them to split the kernel's time.

* ``convert="magic"`` (variants ``*_magic*``): the code tiles are converted by inline
  PTX on 32-bit words of code bytes (``_dequant_int4_magic``: prmt + lop3 make the
  bf16 number 128 + code, one packed subtract, one FMA), instead of Mosaic's int8 ->
  bf16 conversion of masked nibbles plus the scale math. With bf16 math the codes are
  centered (code - 8) and the zero point becomes the group midpoint z + 8 s, whose bf16
  rounding is far smaller: rel L2 against the float32 reference 5.4e-3, against 1.1e-2
  before centering (``attention_mgpu_probe_9.json`` vs ``_10.json``).

Status: the fastest variant through ``packed_attention`` is ``deqwg2_bkv128_pk_nab`` (64
rows x 128 keys per compute warpgroup, one converter warpgroup for K and one for V, no
automatic barriers). At B = 1, H = 56, T = 152,263 it ran 1.428-1.440 s, 1.19x jax cuDNN
BF16 in the same processes, against 1.33x for the default (H100, ``attention_h100_v7.json``,
``_v7b.json``); it is not the default until the fast path's GPU tests have run with it
(see ``DEFAULT_VARIANT``). The default ``DEFAULT_VARIANT = "deqwg_magic_bf16_pk"``
(the memory warpgroup converts K and V with the inline PTX, bf16 math, wrapper-rounded
bf16 scales, 224/224/56 registers) ran 1.411-1.447 s in six H200 runs at T = 152,320,
B = 1, H = 56, which is 1.225-1.251x jax cuDNN BF16 timed in the same processes
(``attention_mgpu_probe_13.json`` to ``_18.json``), with cos 0.999984-5 and rel L2 5.4-5.7e-3 against the float32 reference.
The goal is 1.1x; it is not reached. Where the time goes (benchmarks/NOTES.md): at the
default's 128 rows x 64 keys the skeleton without any conversion is as slow (1.47 s; the
64-key QK^T wgmma reads both operands from SMEM at its full bandwidth), while at 64 rows x
128 keys the skeleton runs at cuDNN's speed (``diag_deqwg2_bkv128_no_convert``: 1.155 s
against 1.149 s, ``_17``) but converting the tiles, even on two warpgroups, brings it
back to 1.42-1.49 s. Every point of ``VARIANTS`` passed ``pytest -m gpu``
(``benchmarks/results/logs/pytest_gpu_mgpu_*.log``) except ``deqwg2_bkv128_pk_nosched``
and ``deqwg2_bkv128_pk_c3``, which passed the probe's checks only (``probe17.log``). On
the CPU every variant lowers for CUDA; the cast variants also run in Mosaic-GPU interpret
mode with race detection (``python -m benchmarks.probe_attention_mgpu
--interpret-check``); inline PTX has no interpreter, so the PTX's bit logic is checked
by emulation (tests/test_attention_mgpu.py). The interpreter runs each warpgroup as one
unit, so it cannot check the ``*_nab`` variants' ordering within a warpgroup.
"""
from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from formats import packed_kv as fmt
from pallas_kernels.backend import resolve_sm_scale

__all__ = ["MgpuConfig", "VARIANTS", "DIAGNOSTIC_VARIANTS", "DEFAULT_VARIANT", "packed_attention_mgpu",
           "make_config"]

_LOG2E = math.log2(math.e)
_HEAD_DIM = 128
_HALF = _HEAD_DIM // 2
_SUB = fmt.BLOCK  # rows per dequantization sub-tile == quantization block (64)
_COMPUTE_WGS = 2
_UNPACK_DIAGNOSTICS = ("unpack_only", "k_unpack_only", "v_unpack_only")


def _reg_pool(num_wgs: int) -> int:
  """Registers per thread allocated at launch for num_wgs warpgroups (65536 / (num_wgs x
  128) rounded down to a multiple of 8), times num_wgs: what their setmaxnreg values may
  add up to (3 warpgroups: 3 x 168 = 504; 4: 4 x 128 = 512)."""
  return num_wgs * (65536 // (num_wgs * 128) // 8 * 8)



@dataclasses.dataclass(frozen=True)
class MgpuConfig:
  """Static knobs of the kernel (hashable: used as a jit static argument)."""
  block_q: int = 64               # query rows per compute warpgroup (CTA: 2 * block_q)
  block_kv: int = 64              # keys per pipeline step: 64 or 128
  max_concurrent_steps: int = 2   # TMA ring depth
  codes_layout: str = "wgmma"     # register layout of the int8 code tiles: "wgmma" | "wgmma_8bit"
  k_math: str = "f32"             # K (and, with v_math="tile", V) dequant arithmetic:
                                  # "f32" (round once) | "bf16" (packed)
  overlap: bool = True            # dequantize under the other wgmma (see module doc)
  schedule_barrier: bool = True   # FA3 ping-pong between the two compute warpgroups
  grid_q_fastest: bool = True     # grid (q tiles, H, B) instead of (H, q tiles, B)
  shared_deq: bool = False        # one bf16 K/V ring per CTA, shared by both warpgroups (module doc)
  # "p_scale": V scale/zero applied to P in the softmax (v_deq holds raw codes);
  # "tile": the V producer dequantizes the whole tile (v = code * s_t + z_t), so the
  # softmax is plain (shared_deq only; module doc).
  v_math: str = "p_scale"
  # Timing diagnostics only, the output is WRONG: "k_noscale" stores K codes without the
  # per-channel scale math; "no_convert" skips every code load/convert/store (barriers stay);
  # "no_convert_no_vmath" also drops the V scale/zero math from the softmax.
  # "unpack_only" / "k_unpack_only" / "v_unpack_only" (convert="magic" with bf16_scales):
  # the converter only unpacks K and V (or only K, or only V) codes into bf16 128 + code, without loading scales
  # or applying them: the converter's share of a format whose scales factor out of the
  # dots (the extra work such a format puts on the compute warpgroups is not modelled).
  diagnostic: str = ""
  # The memory warpgroup also dequantizes every K and V tile into the shared bf16 rings
  # (shared_deq + v_math="tile" only), so the compute warpgroups run plain FA3 on bf16
  # tiles and the conversion leaves their instruction stream (module doc).
  deq_wg: bool = False
  deq_slots: int = 2              # shared_deq: depth of the shared bf16 K and V rings
  # Code -> bf16 value tiles (K, and V with v_math="tile"): "cast" = Mosaic's int8 -> bf16
  # conversion of the masked nibbles, then the scale math; "magic" = inline PTX on
  # 32-bit words of code bytes (_dequant_int4_magic), about 40-60% fewer instructions.
  convert: str = "cast"
  # The wrapper rounds every K/V scale and group midpoint (z + 8 s) to bf16 once, so the
  # converter loads them ready instead of computing them per tile (convert="magic" with
  # k_math="bf16" only; the same bf16 values, so the same output bits).
  bf16_scales: bool = False
  # deq_wg: 2 splits the memory warpgroup's work between two warpgroups, one converting
  # (and loading) every K tile, the other every V tile, in parallel (4 warpgroups).
  converter_wgs: int = 1
  # False: compile with Pallas' unsafe_no_auto_barriers, which drops the warpgroup barrier
  # Pallas puts before and after every SMEM store (8 of the converter's 9 per step at 128
  # keys; ncu, benchmarks/NOTES.md). deq_wg only, where every SMEM write is ordered by
  # hand: a converter reads code slots and writes bf16 slots (never both), commit_smem
  # (a fence and a warpgroup barrier) precedes each ready-arrive and each TMA refill of a
  # slot it read (and each q-loaded arrive when it loads q without TMA), and the compute
  # warpgroups write their out tiles only after their wgmmas on them have completed, then
  # commit_smem before the TMA store.
  auto_barriers: bool = True
  # A cluster of 2 CTAs on adjacent q tiles of one head shares the converted tiles: CTA r
  # converts keys [64 r, 64 r + 64) of every 128-key K and V tile, stores them into its own
  # bf16 ring and, with st.async (plgpu.async_store_smem), into its peer's, so each CTA
  # converts half of every tile (deqwg2 at 64 x 128 only; module doc, "cluster_share").
  cluster_share: bool = False
  # Timing diagnostic only: cluster_share without the compute warpgroups' proxy fence after
  # each ready wait (the PTX memory model does not order the peer's st.async writes before
  # wgmma's reads without it, so results are not guaranteed).
  cluster_fence: bool = True
  # convert="magic": a converter loads the codes and scales of every 64-row sub-tile of a
  # step before it stores the first converted one (a converter warp is alone on its
  # scheduler, so it hides SMEM latency only with independent work in flight).
  converter_prefetch: bool = False
  compute_regs: int = 232         # setmaxnreg of each compute warpgroup
  memory_regs: int = 40           # setmaxnreg of each memory warpgroup (the pool: __post_init__)

  def __post_init__(self):
    if self.block_q % 64 or self.block_q <= 0:
      raise ValueError(f"block_q={self.block_q} must be a positive multiple of 64")
    if self.block_kv not in (64, 128):
      raise ValueError(f"block_kv={self.block_kv} must be 64 or 128")
    if self.max_concurrent_steps < 2:
      raise ValueError(f"max_concurrent_steps={self.max_concurrent_steps} must be >= 2")
    if self.codes_layout not in ("wgmma", "wgmma_8bit"):
      raise ValueError(f"codes_layout={self.codes_layout!r} must be 'wgmma' or 'wgmma_8bit'")
    if self.k_math not in ("f32", "bf16"):
      raise ValueError(f"k_math={self.k_math!r} must be 'f32' or 'bf16'")
    if self.diagnostic not in ("", "k_noscale", "no_convert", "no_convert_no_vmath") + _UNPACK_DIAGNOSTICS:
      raise ValueError(f"diagnostic={self.diagnostic!r} must be '', 'k_noscale', 'no_convert', "
                       "'no_convert_no_vmath', 'unpack_only', 'k_unpack_only' or 'v_unpack_only'")
    if self.v_math not in ("p_scale", "tile"):
      raise ValueError(f"v_math={self.v_math!r} must be 'p_scale' or 'tile'")
    if self.v_math == "tile" and not self.shared_deq:
      raise ValueError("v_math='tile' needs shared_deq=True")
    if self.shared_deq and not self.overlap:
      raise ValueError("shared_deq=True needs overlap=True (tiles are dequantized under the PV wgmma)")
    if self.deq_wg and not (self.shared_deq and self.v_math == "tile"):
      raise ValueError("deq_wg=True needs shared_deq=True and v_math='tile'")
    if self.convert not in ("cast", "magic"):
      raise ValueError(f"convert={self.convert!r} must be 'cast' or 'magic'")
    if self.convert == "magic" and (self.codes_layout != "wgmma_8bit" or self.v_math != "tile"
                                    or self.diagnostic not in ("",) + _UNPACK_DIAGNOSTICS):
      raise ValueError("convert='magic' needs codes_layout='wgmma_8bit', v_math='tile' and no "
                       "diagnostic other than the unpack ones")
    if self.diagnostic in _UNPACK_DIAGNOSTICS and not self.bf16_scales:
      raise ValueError(f"diagnostic={self.diagnostic!r} needs convert='magic' with bf16_scales=True")
    if self.bf16_scales and not (self.convert == "magic" and self.k_math == "bf16"):
      raise ValueError("bf16_scales=True needs convert='magic' and k_math='bf16'")
    if self.converter_prefetch and self.convert != "magic":
      raise ValueError("converter_prefetch=True needs convert='magic'")
    if self.deq_slots < 2:
      raise ValueError(f"deq_slots={self.deq_slots} must be >= 2")
    if self.converter_wgs not in (1, 2):
      raise ValueError(f"converter_wgs={self.converter_wgs} must be 1 or 2")
    if self.converter_wgs == 2 and not self.deq_wg:
      raise ValueError("converter_wgs=2 needs deq_wg=True (only converters are split)")
    if not self.auto_barriers and not self.deq_wg:
      raise ValueError("auto_barriers=False needs deq_wg=True (the only structure whose SMEM "
                       "writes are ordered without Pallas' automatic barriers)")
    if self.cluster_share and not (self.converter_wgs == 2 and self.block_kv == 2 * _SUB
                                   and self.convert == "magic" and self.grid_q_fastest):
      raise ValueError("cluster_share=True needs converter_wgs=2, block_kv=128, convert='magic' and "
                       "grid_q_fastest=True (each CTA of the pair converts one 64-key half of every tile)")
    for name in ("compute_regs", "memory_regs"):
      n = getattr(self, name)
      if n % 8 or not 24 <= n <= 256:
        raise ValueError(f"{name}={n} must be a multiple of 8 in [24, 256] (setmaxnreg)")
    total = _COMPUTE_WGS * self.compute_regs + self.converter_wgs * self.memory_regs
    wgs = _COMPUTE_WGS + self.converter_wgs
    pool = _reg_pool(wgs)
    if total > pool:
      # setmaxnreg only moves the registers allocated at launch between warpgroups: a
      # compute warpgroup's "increase" past the pool waits forever (a hang, not an error).
      mem = "memory_regs" if self.converter_wgs == 1 else "2 * memory_regs"
      raise ValueError(f"2 * compute_regs + {mem} = {total} exceeds {pool}, the registers per "
                       f"thread allocated at launch for {wgs} warpgroups ({wgs} x {pool // wgs}); "
                       "lower one of them")


# The common fields of the convert="magic" points: vtile with the inline-PTX conversion,
# and the same with the memory warpgroup converting (224/224/56 registers).
_VTILE_MAGIC = {"block_q": 128, "shared_deq": True, "codes_layout": "wgmma_8bit", "v_math": "tile",
                "convert": "magic"}
_DEQWG_MAGIC = {**_VTILE_MAGIC, "deq_wg": True, "compute_regs": 224, "memory_regs": 56}
# The same with bf16 math and wrapper-rounded bf16 scales (the default's fields).
_DEQWG_PK = {**_DEQWG_MAGIC, "k_math": "bf16", "bf16_scales": True}
# 64 rows x 128 keys with bf16 scales and two converter warpgroups (2 x 200 + 2 x 56 = 512).
_DEQWG2_BKV128_PK = {**_DEQWG_PK, "block_q": 64, "block_kv": 128, "converter_wgs": 2, "compute_regs": 200,
                     "memory_regs": 56}

# Named design points for the probe. Each entry sets MgpuConfig fields; explicit
# block_q / block_kv / max_concurrent_steps arguments override them.
VARIANTS = {
    "base": {},                                 # wgmma-layout codes, f32 K math, overlap
    "codes8bit": {"codes_layout": "wgmma_8bit"},  # 32-bit code loads, 4-wide vectors
    "kbf16": {"k_math": "bf16"},                # packed bf16 K dequant (rounds s, z)
    "no_overlap": {"overlap": False},           # dequant right before each wgmma
    "bkv128": {"block_kv": 128},                # 128 keys per step (2 quant blocks)
    "bq128": {"block_q": 128},                  # 128 rows per warpgroup (more registers)
    "bq128_8bit": {"block_q": 128, "codes_layout": "wgmma_8bit"},  # the two fastest together
    "shared_deq": {"block_q": 128, "shared_deq": True},  # bq128, each tile dequantized once per CTA
    "shared_deq_8bit": {"block_q": 128, "shared_deq": True, "codes_layout": "wgmma_8bit"},
    "shared_deq_8bit_kbf16": {"block_q": 128, "shared_deq": True, "codes_layout": "wgmma_8bit",
                              "k_math": "bf16"},
    "shared_deq_8bit_s3": {"block_q": 128, "shared_deq": True, "codes_layout": "wgmma_8bit",
                           "max_concurrent_steps": 3},  # 3-deep TMA ring of code tiles
    # 64 q rows per warpgroup and 128 keys per step (half the steps, as jax's FA3 example)
    "shared_deq_bkv128": {"block_q": 64, "block_kv": 128, "shared_deq": True,
                          "codes_layout": "wgmma_8bit"},
    # V dequantized as a tile by its producer: the softmax carries no V scale/zero math.
    "vtile": {"block_q": 128, "shared_deq": True, "codes_layout": "wgmma_8bit", "v_math": "tile"},
    "vtile_bf16": {"block_q": 128, "shared_deq": True, "codes_layout": "wgmma_8bit",
                   "v_math": "tile", "k_math": "bf16"},
    # the same without the FA3 ping-pong between the two compute warpgroups
    "vtile_bf16_nosched": {"block_q": 128, "shared_deq": True, "codes_layout": "wgmma_8bit",
                           "v_math": "tile", "k_math": "bf16", "schedule_barrier": False},
    # The memory warpgroup dequantizes K and V (deq_wg); the compute warpgroups run plain
    # FA3. Registers move from the compute warpgroups to it (2 * compute + memory = 504).
    "deqwg": {"block_q": 128, "shared_deq": True, "codes_layout": "wgmma_8bit", "v_math": "tile",
              "deq_wg": True, "compute_regs": 224, "memory_regs": 56},
    "deqwg_bf16": {"block_q": 128, "shared_deq": True, "codes_layout": "wgmma_8bit", "v_math": "tile",
                   "deq_wg": True, "k_math": "bf16", "compute_regs": 224, "memory_regs": 56},
    "deqwg_r216": {"block_q": 128, "shared_deq": True, "codes_layout": "wgmma_8bit", "v_math": "tile",
                   "deq_wg": True, "compute_regs": 216, "memory_regs": 72},
    # 64 rows per compute warpgroup and 128 keys per step, as jax's FA3 example (its faster
    # point); fewer registers per compute warpgroup, so more for the converter.
    "deqwg_bkv128": {"block_q": 64, "block_kv": 128, "shared_deq": True, "codes_layout": "wgmma_8bit",
                     "v_math": "tile", "deq_wg": True, "compute_regs": 200, "memory_regs": 104},
    "deqwg_bkv128_bf16": {"block_q": 64, "block_kv": 128, "shared_deq": True, "codes_layout": "wgmma_8bit",
                          "v_math": "tile", "deq_wg": True, "k_math": "bf16", "compute_regs": 200,
                          "memory_regs": 104},
    # Inline-PTX code conversion (convert="magic") on the vtile and deqwg points.
    "vtile_magic": {**_VTILE_MAGIC},
    "vtile_magic_bf16": {**_VTILE_MAGIC, "k_math": "bf16"},
    "vtile_magic_bf16_nosched": {**_VTILE_MAGIC, "k_math": "bf16", "schedule_barrier": False},
    "vtile_magic_nosched": {**_VTILE_MAGIC, "schedule_barrier": False},
    "deqwg_magic_bf16": {**_DEQWG_MAGIC, "k_math": "bf16"},
    "deqwg_magic_bf16_nosched": {**_DEQWG_MAGIC, "k_math": "bf16", "schedule_barrier": False},
    "deqwg_magic_bf16_s3": {**_DEQWG_MAGIC, "k_math": "bf16", "deq_slots": 3},
    "deqwg_magic_r216": {**_DEQWG_MAGIC, "compute_regs": 216, "memory_regs": 72},
    "deqwg_magic_bkv128_bf16": {**_DEQWG_MAGIC, "block_q": 64, "block_kv": 128, "k_math": "bf16",
                                "compute_regs": 200, "memory_regs": 104},
    "deqwg_magic_bkv128": {**_DEQWG_MAGIC, "block_q": 64, "block_kv": 128, "compute_regs": 200,
                           "memory_regs": 104},
    "deqwg_magic": {**_DEQWG_MAGIC},
    # More registers for the compute warpgroups (ncu: the default spills in their key
    # loop), fewer for the converter; and a 3-deep code ring. On the H200 none is faster:
    # the converter then spills and the compute loop waits on it (benchmarks/NOTES.md).
    "deqwg_magic_bf16_r232": {**_DEQWG_MAGIC, "k_math": "bf16", "compute_regs": 232, "memory_regs": 40},
    "deqwg_magic_bf16_r240": {**_DEQWG_MAGIC, "k_math": "bf16", "compute_regs": 240, "memory_regs": 24},
    "deqwg_magic_bf16_c3": {**_DEQWG_MAGIC, "k_math": "bf16", "max_concurrent_steps": 3},
    # Scales and midpoints rounded to bf16 by the wrapper (fewer converter instructions),
    # at the default's point and at 128 keys per step, where the converter is the limit.
    "deqwg_magic_bf16_pk": {**_DEQWG_PK},
    "deqwg_magic_bkv128_bf16_pk": {**_DEQWG_PK, "block_q": 64, "block_kv": 128, "compute_regs": 200,
                                   "memory_regs": 104},
    # The register split, code-ring depth and bf16-ring depth again with the lighter
    # converter (it may now fit in 40 registers).
    "deqwg_magic_bf16_pk_r232": {**_DEQWG_PK, "compute_regs": 232, "memory_regs": 40},
    "deqwg_magic_bf16_pk_c3": {**_DEQWG_PK, "max_concurrent_steps": 3},
    "deqwg_magic_bf16_pk_s3": {**_DEQWG_PK, "deq_slots": 3},
    # Two converter warpgroups (K and V in parallel, 4 warpgroups, 512 registers): at 64
    # rows x 128 keys (compute 200, as deqwg_magic_bkv128_bf16_pk), where one converter is
    # the limit, and at the default's 128 x 64 (compute 216: two converters need 80).
    "deqwg2_bkv128_pk": {**_DEQWG2_BKV128_PK},
    "deqwg2_bkv128_pk_r208": {**_DEQWG2_BKV128_PK, "compute_regs": 208, "memory_regs": 48},
    "deqwg2_bkv128_pk_r192": {**_DEQWG2_BKV128_PK, "compute_regs": 192, "memory_regs": 64},
    "deqwg2_bkv128_pk_r184": {**_DEQWG2_BKV128_PK, "compute_regs": 184, "memory_regs": 72},
    "deqwg2_bkv128_pk_r176": {**_DEQWG2_BKV128_PK, "compute_regs": 176, "memory_regs": 80},
    "deqwg2_bkv128_pk_r168": {**_DEQWG2_BKV128_PK, "compute_regs": 168, "memory_regs": 88},
    "deqwg2_pk_r216": {**_DEQWG_PK, "converter_wgs": 2, "compute_regs": 216, "memory_regs": 40},
    # The same split with Mosaic's cast conversion: it runs in the CPU interpreter, which
    # checks the four warpgroups' barriers (the inline PTX has no interpreter).
    "deqwg2_bkv128": {"block_q": 64, "block_kv": 128, "shared_deq": True, "codes_layout": "wgmma_8bit",
                      "v_math": "tile", "deq_wg": True, "converter_wgs": 2, "compute_regs": 200, "memory_regs": 56},
    # 64 x 128 with two converters, without the FA3 ping-pong, and with a 3-deep code ring.
    "deqwg2_bkv128_pk_nosched": {**_DEQWG2_BKV128_PK, "schedule_barrier": False},
    "deqwg2_bkv128_pk_c3": {**_DEQWG2_BKV128_PK, "max_concurrent_steps": 3},
    # Without Pallas' automatic warpgroup barriers around every SMEM store (auto_barriers).
    "deqwg_magic_bf16_pk_nab": {**_DEQWG_PK, "auto_barriers": False},
    "deqwg2_bkv128_pk_nab": {**_DEQWG2_BKV128_PK, "auto_barriers": False},
    "deqwg2_bkv128_pk_r176_nab": {**_DEQWG2_BKV128_PK, "compute_regs": 176, "memory_regs": 80,
                                  "auto_barriers": False},
    "deqwg2_bkv128_pk_nosched_nab": {**_DEQWG2_BKV128_PK, "schedule_barrier": False, "auto_barriers": False},
    # Two CTAs on adjacent q tiles share the converted tiles (cluster_share): each converts
    # one 64-key half of every K and V tile, for itself and, through DSMEM, for its peer.
    "deqwg2_bkv128_pk_cl2": {**_DEQWG2_BKV128_PK, "cluster_share": True},
    "deqwg2_bkv128_pk_cl2_nab": {**_DEQWG2_BKV128_PK, "cluster_share": True, "auto_barriers": False},
    "deqwg2_bkv128_pk_cl2_nosched": {**_DEQWG2_BKV128_PK, "cluster_share": True, "schedule_barrier": False},
    # Each converter issues both sub-tiles' SMEM loads of a step before its first store
    # (converter_prefetch; at 64 keys per step there is one sub-tile, so nothing to move).
    "deqwg2_bkv128_pk_nab_pf": {**_DEQWG2_BKV128_PK, "auto_barriers": False, "converter_prefetch": True},
    # 3-deep bf16 rings at 64 keys: the converter may run two tiles ahead.
    "deqwg_s3": {"block_q": 128, "shared_deq": True, "codes_layout": "wgmma_8bit", "v_math": "tile",
                 "deq_wg": True, "deq_slots": 3, "compute_regs": 224, "memory_regs": 56},
}

# Timing-only points that compute a WRONG result on purpose, to split the time of the
# best variant into its parts (the probe times them without the correctness gate).
DIAGNOSTIC_VARIANTS = {
    "diag_k_noscale": {**VARIANTS["shared_deq_8bit"], "diagnostic": "k_noscale"},
    "diag_no_convert": {**VARIANTS["shared_deq_8bit"], "diagnostic": "no_convert"},
    "diag_no_convert_no_vmath": {**VARIANTS["shared_deq_8bit"], "diagnostic": "no_convert_no_vmath"},
    "diag_bkv128_no_convert": {**VARIANTS["shared_deq_bkv128"], "diagnostic": "no_convert"},
    # The default's structure (the memory warpgroup converts, 224/224/56 registers) with
    # the conversion left out: its barriers and commits stay. On the H200 it is as fast as
    # the converting kernel (1.47-1.48 s): at 64 keys per step the skeleton is the limit.
    "diag_deqwg_no_convert": {**VARIANTS["deqwg_bf16"], "diagnostic": "no_convert"},
    # The same skeletons at 64 rows x 128 keys, with one and with two converter warpgroups:
    # 1.16 s, cuDNN's speed (probe_17), so at 128 keys the conversion is the limit.
    "diag_deqwg_bkv128_no_convert": {**VARIANTS["deqwg_bkv128"], "diagnostic": "no_convert"},
    "diag_deqwg2_bkv128_no_convert": {**VARIANTS["deqwg2_bkv128"], "diagnostic": "no_convert"},
    # cluster_share without the consumers' proxy fences: what those fences cost.
    "diag_cl2_nab_nofence": {**VARIANTS["deqwg2_bkv128_pk_cl2_nab"], "cluster_fence": False},
    # The 64 x 128 two-converter kernel whose converters only unpack codes (no scale loads,
    # no subtract, no FMA): the speed a format with scales outside the dots could reach at
    # best, K and V factored (unpack_only) or only V, as V per channel over 256 keys
    # (v_unpack_only). The compute-side scale work such formats need is left out.
    "diag_deqwg2_bkv128_pk_unpack_only": {**VARIANTS["deqwg2_bkv128_pk"], "diagnostic": "unpack_only"},
    "diag_deqwg2_bkv128_pk_nab_unpack_only": {**VARIANTS["deqwg2_bkv128_pk_nab"], "diagnostic": "unpack_only"},
    "diag_deqwg2_bkv128_pk_nab_v_unpack_only": {**VARIANTS["deqwg2_bkv128_pk_nab"],
                                                "diagnostic": "v_unpack_only"},
    "diag_deqwg2_bkv128_pk_nab_k_unpack_only": {**VARIANTS["deqwg2_bkv128_pk_nab"],
                                                "diagnostic": "k_unpack_only"},
    # The same at the default's 128 x 64 with one converter.
    "diag_pk_unpack_only": {**VARIANTS["deqwg_magic_bf16_pk"], "diagnostic": "unpack_only"},
}


# bf16 K/V math with the centered zero point and wrapper-rounded scales, rel L2 5.4e-3
# against the float32 reference. deqwg2_bkv128_pk_nab is faster: 2.5-3% in the standalone
# probe (probe_18, _21, _22) and 10-11% through packed_attention at T = 152,263
# (attention_h100_v7*.json: 1.19x against 1.33x cuDNN). It is not the default yet: its
# own GPU test passes, but tests/test_fast_path.py's GPU tests (head groups, overwrite_q,
# given buffers, partial calls) have not run with it. Switch after they pass.
DEFAULT_VARIANT = "deqwg_magic_bf16_pk"


def make_config(block_q=None, block_kv=None, max_concurrent_steps=None, variant=DEFAULT_VARIANT) -> MgpuConfig:
  """MgpuConfig of a named variant; block arguments that are not None override it.

  Only the named points in VARIANTS are run by the GPU tests; other combinations are
  validated by MgpuConfig but not measured.
  """
  points = {**VARIANTS, **DIAGNOSTIC_VARIANTS}
  if variant not in points:
    raise ValueError(f"unknown variant {variant!r}; use one of {sorted(points)}")
  kw = dict(points[variant])
  explicit = dict(block_q=block_q, block_kv=block_kv, max_concurrent_steps=max_concurrent_steps)
  kw.update({k: v for k, v in explicit.items() if v is not None})
  return MgpuConfig(**kw)


def _validate(q, packed, cfg: MgpuConfig):
  meta = fmt.check_query(q, packed)
  if meta.head_dim != _HEAD_DIM:
    raise NotImplementedError(f"prototype supports head_dim {_HEAD_DIM} only, got {meta.head_dim}")
  if any(c != fmt.CLASS_ID["int4"] for c in meta.block_classes):
    raise NotImplementedError("prototype supports all-int4 packed K/V only (block_classes all 0)")
  if meta.k_scheme != "channel" or meta.v_scheme != "token":
    raise NotImplementedError(
        f"prototype supports k_scheme 'channel' / v_scheme 'token', got {meta.k_scheme!r} / {meta.v_scheme!r}")
  if meta.num_tokens % cfg.block_kv:
    raise NotImplementedError(
        f"num_tokens={meta.num_tokens} must be a multiple of block_kv={cfg.block_kv} (no padding rows)")
  tq = q.shape[1]
  if tq % (_COMPUTE_WGS * cfg.block_q):
    raise NotImplementedError(f"Tq={tq} must be a multiple of 2 * block_q = {_COMPUTE_WGS * cfg.block_q}")
  return meta


def _smem_load(ref, idx, *, layout):
  """SMEM -> registers in an explicit layout. Also a seam for interpret-mode tests
  (the CPU interpreter cannot run ``plgpu.load`` on tiled refs)."""
  return plgpu.load(ref, idx, layout=layout)


def _accumulate(body, acc):
  """Run ``body(acc_ref)`` (wgmma into acc_ref) on an accumulator initialized to
  ``acc``; returns the awaited result. Also a seam for interpret-mode tests (the
  interpreter has no ``run_state``)."""
  return pl.run_state(body)(plgpu.ACC.init(acc))


def _codes_layout(cfg: MgpuConfig):
  return plgpu.Layout.WGMMA if cfg.codes_layout == "wgmma" else plgpu.Layout.WGMMA_8BIT


def _nibbles_bf16(c):
  """int8 code bytes -> (lo, hi16) bf16: lo = code[j] (0..15), hi16 = 16 * (code[j+64] - 8).

  Only bitwise ops on 8-bit values (Mosaic-GPU has no 8-bit arithmetic/shifts); the
  int8 -> bf16 conversion is Mosaic's fast signed path and exact for these values.
  """
  lo = c & jnp.int8(0x0F)
  hi = (c & jnp.int8(-16)) ^ jnp.int8(-128)  # 0xF0, 0x80 as int8
  return lo.astype(jnp.bfloat16), hi.astype(jnp.bfloat16)


# PTX for one 32-bit word of code bytes b0..b3 (channels j..j+3 in the low nibbles,
# j+64..j+67 in the high ones) -> four bf16x2 words: lo01, lo23, hi01, hi23. prmt puts
# two bytes in the low byte of each 16-bit half; lop3 keeps their nibble and ORs in
# 0x4300, which makes the bf16 number 128 + code (exact); then either one packed
# subtract of 136 (code - 8, exact) and one packed FMA with the bf16 scale and the
# group midpoint z + 8 s (bf16 math), or two f32 FMAs with z - 128 s and one pack (f32
# math). About 2 (bf16) or 3.6 (f32) instructions per value, against about 3 and 5 for
# Mosaic's int8 -> bf16 conversion plus the scale math.
_PTX_UNPACK = """
.reg .b32 w4, t<4>, x<4>, m128;
.reg .f32 f<2>;
mov.b32 m128, 0x43004300;
shr.u32 w4, $4, 4;
prmt.b32 t0, $4, 0, 0x4140;
prmt.b32 t1, $4, 0, 0x4342;
prmt.b32 t2, w4, 0, 0x4140;
prmt.b32 t3, w4, 0, 0x4342;
lop3.b32 x0, t0, 0x000F000F, m128, 0xEA;
lop3.b32 x1, t1, 0x000F000F, m128, 0xEA;
lop3.b32 x2, t2, 0x000F000F, m128, 0xEA;
lop3.b32 x3, t3, 0x000F000F, m128, 0xEA;
"""


def dequant_ptx(math_dtype: str) -> tuple[str, str]:
  """(PTX text, LLVM constraints) of the inline asm in ``_dequant_int4_magic``.

  Operands: $0..$3 out (lo01, lo23, hi01, hi23, bf16x2); $4 the code word. bf16 math:
  $5,$6 s_lo, $7,$8 z_lo + 8 s_lo, $9,$10 s_hi, $11,$12 z_hi + 8 s_hi (bf16x2 pairs
  of channels (j, j+1), (j+2, j+3)). f32 math: $5..$8 s_lo, $9..$12 z_lo - 128 s_lo,
  $13..$16 s_hi, $17..$20 z_hi - 128 s_hi (one f32 per channel j..j+3).
  """
  body = _PTX_UNPACK
  if math_dtype == "unpack":  # timing diagnostic: 128 + code, no scale operands
    body += "mov.b32 $0, x0;\nmov.b32 $1, x1;\nmov.b32 $2, x2;\nmov.b32 $3, x3;\n"
    return "{\n" + body + "}\n", "=r,=r,=r,=r,r"
  if math_dtype == "bf16":
    body += """
mov.b32 m128, 0x43084308;
sub.bf16x2 x0, x0, m128;
sub.bf16x2 x1, x1, m128;
sub.bf16x2 x2, x2, m128;
sub.bf16x2 x3, x3, m128;
fma.rn.bf16x2 $0, x0, $5, $7;
fma.rn.bf16x2 $1, x1, $6, $8;
fma.rn.bf16x2 $2, x2, $9, $11;
fma.rn.bf16x2 $3, x3, $10, $12;
"""
    return "{\n" + body + "}\n", "=r,=r,=r,=r," + ",".join(["r"] * 9)
  for k in range(4):  # bf16x2 word k holds channels (2k, 2k + 1) mod 4 of its half
    s, z = (5, 9) if k < 2 else (13, 17)
    e = 2 * (k % 2)
    body += f"""
shl.b32 f0, x{k}, 16;
and.b32 f1, x{k}, 0xFFFF0000;
fma.rn.f32 f0, f0, ${s + e}, ${z + e};
fma.rn.f32 f1, f1, ${s + e + 1}, ${z + e + 1};
cvt.rn.bf16x2.f32 ${k}, f1, f0;
"""
  return "{\n" + body + "}\n", "=r,=r,=r,=r,r," + ",".join(["f"] * 16)


def _dequant_int4_magic(c, *scales, math_dtype, layout):
  """(64, 64) int8 code bytes and (64, 64) broadcast scale/zero arrays s_lo, z_lo, s_hi, z_hi
  (bf16 with the zero shifted to z + 8 s, or f32 with z - 128 s; see dequant_ptx) -> (lo, hi)
  bf16 value tiles [code_lo * s_lo + z_lo | code_hi * s_hi + z_hi], all in ``layout``
  (WGMMA_8BIT). math_dtype="unpack" (a timing diagnostic) takes no scales and returns
  [128 + code_lo | 128 + code_hi]."""
  from jax.experimental.mosaic import gpu as mgpu
  from jax.experimental.mosaic.gpu import utils as mgpu_utils
  from jaxlib.mlir import ir
  from jaxlib.mlir.dialects import llvm, vector

  out_t = plgpu.ShapeDtypeStruct(c.shape, jnp.bfloat16, layout=layout)

  @plgpu.inline_mgpu(arg_types=(layout,) * (1 + len(scales)), return_type=(out_t, out_t))
  def convert(_, codes, *scale_arrays):
    i32 = ir.IntegerType.get_signless(32)
    f32 = ir.F32Type.get()
    bf16 = ir.BF16Type.get()
    words = lambda reg, n, ty: [vector.extract(vector.bitcast(ir.VectorType.get((n,), ty), reg),
                                               dynamic_position=[], static_position=ir.DenseI64ArrayAttr.get([i]))
                                for i in range(n)]
    asm, cons = dequant_ptx(math_dtype)
    n, ty = (2, i32) if math_dtype == "bf16" else (4, f32)  # scale/zero words per code word
    lo_regs = np.empty_like(codes.registers)
    hi_regs = np.empty_like(codes.registers)
    for idx, reg in np.ndenumerate(codes.registers):
      w = mgpu_utils.bitcast(reg, i32)
      ops = [w] + [x for a in scale_arrays for x in words(a.registers[idx], n, ty)]
      res = llvm.inline_asm(llvm.StructType.get_literal([i32] * 4), ops, asm, cons)
      out = [llvm.extractvalue(i32, res, [k]) for k in range(4)]
      pair = lambda a, b: vector.bitcast(ir.VectorType.get((4,), bf16), mgpu_utils.vector_concat(
          [vector.broadcast(ir.VectorType.get((1,), i32), a), vector.broadcast(ir.VectorType.get((1,), i32), b)]))
      lo_regs[idx] = pair(out[0], out[1])
      hi_regs[idx] = pair(out[2], out[3])
    mk = lambda regs: mgpu.FragmentedArray(_registers=regs, _layout=codes.layout, _is_signed=None)
    return mk(lo_regs), mk(hi_regs)

  return convert(c, *scales)


def _attention_call(q, kc, ks, kz, vc, vs, vz, *, cfg: MgpuConfig, sm_scale: float, num_q_tiles=None,
                    kv_steps=None, head_offset=0, num_heads=None, save_lse=False):
  """q (B,Tq,H,D) bf16; kc/vc (B,H,T,64) int8; ks/kz (B,H,NB,D) f32; vs/vz (B,H,T) f32.

  Covers the first ``num_q_tiles`` tiles of 2 * block_q query rows (default all; rows
  past them are left unwritten), the first ``kv_steps`` steps of block_kv keys (default
  all) and heads [head_offset, head_offset + num_heads) (default all). Returns the
  output (B, Tq, num_heads, D) bf16 in the rotated basis and, with ``save_lse``, the
  log-sum-exp of the covered keys per covered row, (B, num_heads, num_q_tiles * 2 *
  block_q) f32 in raw logit units
  (log2-sum-exp2 of q.k * sm_scale * log2(e), divided by sm_scale * log2(e)): the state
  a second pass over the other keys continues from (attention.py, ``init``).
  """
  batch, tq, all_heads, d = q.shape
  heads = all_heads if num_heads is None else num_heads
  tkv = kc.shape[2]
  block_q, block_kv = cfg.block_q, cfg.block_kv
  nsub = block_kv // _SUB
  kv_steps = tkv // block_kv if kv_steps is None else kv_steps
  if kv_steps < 1 or kv_steps * block_kv > tkv:
    raise ValueError(f"kv_steps={kv_steps} of {block_kv} keys does not fit {tkv} stored keys")
  steps = min(cfg.max_concurrent_steps, kv_steps)
  qk_scale = sm_scale * _LOG2E
  codes_layout = _codes_layout(cfg)
  col_layout = codes_layout.reduce(0)  # (64,) per-channel vectors broadcast over rows
  row_layout = codes_layout.reduce(1)  # (64,) per-token vectors broadcast over columns
  # TMA tiles the GMEM view of q and of the output in 8-row units and refuses another Tq;
  # then the memory warpgroup loads the q tiles through registers (load_q_tiles) and the
  # compute warpgroups store their outputs from registers.
  q_by_tma = tq % 8 == 0
  num_q_tiles = tq // (_COMPUTE_WGS * block_q) if num_q_tiles is None else num_q_tiles
  if num_q_tiles < 1 or num_q_tiles * _COMPUTE_WGS * block_q > tq:
    raise ValueError(f"num_q_tiles={num_q_tiles} of {_COMPUTE_WGS * block_q} rows does not fit Tq={tq}")
  share = cfg.cluster_share
  if share and num_q_tiles % 2:
    raise NotImplementedError(f"cluster_share: num_q_tiles={num_q_tiles} must be even (CTA pairs)")
  load_kv = block_kv // 2 if share else block_kv  # keys each CTA loads and converts per step
  load_sub = load_kv // _SUB
  scales_sliced = False  # True: the scale operands hold only heads [head_offset, + heads)
  if cfg.bf16_scales:  # the rounding magic_math does per tile, done once here (exact 8 s in f32)
    if heads != all_heads:
      # Only this head group's scales are rounded, so a caller looping over head groups
      # holds 1/groups of the bf16 copies at a time instead of all of them.
      ks, kz, vs, vz = (lax.slice_in_dim(a, head_offset, head_offset + heads, axis=1) for a in (ks, kz, vs, vz))
      scales_sliced = True
    ks, kz = ks.astype(jnp.bfloat16), (kz + 8.0 * ks).astype(jnp.bfloat16)
    vs, vz = vs.astype(jnp.bfloat16), (vz + 8.0 * vs).astype(jnp.bfloat16)
  scale_dtype = jnp.bfloat16 if cfg.bf16_scales else jnp.float32

  def kernel(q_ref, kc_ref, ks_ref, kz_ref, vc_ref, vs_ref, vz_ref, out_ref, lse_ref, scoped):
    smem, loaded, consumed, schedule_barrier, *deq_bars = scoped
    exit_barrier = deq_bars[1] if share else None
    deq_bars = deq_bars[0] if deq_bars else None  # shared_deq only
    qo_smem2, kc_smem, ks_smem, kz_smem, vc_smem, vs_smem, vz_smem, kdeq2, vdeq2, lse_smem2 = smem
    k_loaded, v_loaded, q_loaded = loaded
    k_consumed, v_consumed = consumed
    b = lax.axis_index("batch")
    h_out = lax.axis_index("heads")  # head of the output / lse
    h = h_out + head_offset           # head of q and K/V
    h_scale = h_out if scales_sliced else h  # head of the scale operands
    if share:  # the pair of CTAs (rank 0, 1) takes q tiles 2 i and 2 i + 1
      rank = lax.axis_index("cluster")
      q_tile = 2 * lax.axis_index("q_seq") + rank
    else:
      rank, q_tile = 0, lax.axis_index("q_seq")
    wg_idx = lax.axis_index("wg")
    skip_convert = cfg.diagnostic.startswith("no_convert")
    unpack_k_only = cfg.diagnostic in ("unpack_only", "k_unpack_only")  # timing diagnostics:
    unpack_v_only = cfg.diagnostic in ("unpack_only", "v_unpack_only")  # codes without scales

    def perform_schedule_barrier():
      if cfg.schedule_barrier:
        plgpu.barrier_arrive(schedule_barrier)
        plgpu.barrier_wait(schedule_barrier)

    def ring_slot(step, depth):
      if isinstance(step, int):
        return step % depth
      return lax.rem(step, jnp.array(depth, step.dtype))

    slot_of = lambda step: ring_slot(step, steps)  # TMA ring of code tiles
    # shared_deq: the bf16 K and V rings of cfg.deq_slots tiles, indexed by kv step.
    deq_slot = lambda step: ring_slot(step, cfg.deq_slots)

    # --- Code tile -> bf16 tile conversions (no barriers): run by the compute warpgroups,
    # or with deq_wg by the memory warpgroup. Each works on 64-row sub-tiles, one
    # quantization block at a time.
    def scale_math(dst, rows, lo, hi, s_lo, s_hi, z_lo, z_hi, *, bcast_dim):
      """dst[rows] = [lo * s_lo + z_lo | hi16 * s_hi / 16 + (z_hi + 8 s_hi)] in bf16.

      hi16 = 16 * (code - 8) (see _nibbles_bf16). The scale/zero vectors run along
      columns (K, per channel: bcast_dim=1) or along rows (V, per token: bcast_dim=0).
      """
      z_hi = z_hi + 8.0 * s_hi
      s_hi = s_hi * (1.0 / 16.0)
      shape = (_SUB, _HALF)
      bc = lambda v: plgpu.layout_cast(lax.broadcast_in_dim(v, shape, [bcast_dim]), codes_layout)
      if cfg.k_math == "f32":
        v_lo = (lo.astype(jnp.float32) * bc(s_lo) + bc(z_lo)).astype(jnp.bfloat16)
        v_hi = (hi.astype(jnp.float32) * bc(s_hi) + bc(z_hi)).astype(jnp.bfloat16)
      else:
        bf = lambda v: bc(v.astype(jnp.bfloat16))
        v_lo = lo * bf(s_lo) + bf(z_lo)
        v_hi = hi * bf(s_hi) + bf(z_hi)
      dst[rows, pl.ds(0, _HALF)] = v_lo
      dst[rows, pl.ds(_HALF, _HALF)] = v_hi

    def magic_math(dst, rows, c, s_lo, s_hi, z_lo, z_hi, *, bcast_dim, remote_bar=None):
      """dst[rows] = [code_lo * s_lo + z_lo | code_hi * s_hi + z_hi] via _dequant_int4_magic;
      with remote_bar (cluster_share) also into the peer CTA's dst[rows], which completes
      two arrivals (and the bytes) of the peer's remote_bar. Scales of None (the unpack
      diagnostics): dst[rows] = [128 + code_lo | 128 + code_hi]."""
      if s_lo is None:
        lo, hi = _dequant_int4_magic(c, math_dtype="unpack", layout=codes_layout)
      else:
        shape = (_SUB, _HALF)
        dt = jnp.bfloat16 if cfg.k_math == "bf16" else jnp.float32
        if cfg.bf16_scales:  # already the bf16 scale and midpoint (_attention_call)
          pass
        elif cfg.k_math == "f32":  # the PTX works on 128 + code: take 128 s off the zero, in f32
          z_lo, z_hi = z_lo - 128.0 * s_lo, z_hi - 128.0 * s_hi
        else:  # the PTX works on code - 8: the zero becomes the group midpoint z + 8 s
          z_lo, z_hi = z_lo + 8.0 * s_lo, z_hi + 8.0 * s_hi
        bc = lambda v: plgpu.layout_cast(lax.broadcast_in_dim(v.astype(dt), shape, [bcast_dim]), codes_layout)
        lo, hi = _dequant_int4_magic(c, bc(s_lo), bc(z_lo), bc(s_hi), bc(z_hi), math_dtype=cfg.k_math,
                                     layout=codes_layout)
      dst[rows, pl.ds(0, _HALF)] = lo
      dst[rows, pl.ds(_HALF, _HALF)] = hi
      if remote_bar is not None:
        peer = 1 - rank
        for val, cols in ((lo, pl.ds(0, _HALF)), (hi, pl.ds(_HALF, _HALF))):
          plgpu.async_store_smem(val, dst.at[rows, cols], remote_bar, cluster_idx=peer, cluster_dim="cluster")

    # cluster_share: the ring slots hold this CTA's 64-key half, which goes to rows
    # [64 rank, 64 rank + 64) of the bf16 tiles (its own and the peer's).
    dst_rows = lambda j: pl.ds(rank * _SUB, _SUB) if share else pl.ds(j * _SUB, _SUB)

    def load_k_operands(slot, j):
      c = _smem_load(kc_smem.at[slot, pl.ds(j * _SUB, _SUB)], (), layout=codes_layout)
      if unpack_k_only:
        return c, None, None, None, None
      return (c,) + tuple(_smem_load(ref.at[slot, j, pl.ds(h * _HALF, _HALF)], (), layout=col_layout)
                          for ref, h in ((ks_smem, 0), (ks_smem, 1), (kz_smem, 0), (kz_smem, 1)))

    def load_v_operands(slot, j):
      rows = pl.ds(j * _SUB, _SUB)
      c = _smem_load(vc_smem.at[slot, rows], (), layout=codes_layout)
      if unpack_v_only:
        return c, None, None, None, None
      s = _smem_load(vs_smem.at[slot, rows], (), layout=row_layout)
      z = _smem_load(vz_smem.at[slot, rows], (), layout=row_layout)
      return c, s, s, z, z

    def convert_magic(load_operands, slot, dst, remote_bar, bcast_dim):
      """convert='magic': every 64-row sub-tile of a ring slot -> dst; with
      cfg.converter_prefetch all sub-tiles' SMEM loads come before the first store, so the
      loads of sub-tile j + 1 need not wait behind the stores of sub-tile j."""
      subs = range(0 if skip_convert else load_sub)
      if cfg.converter_prefetch:
        operands = [load_operands(slot, j) for j in subs]
        for j, ops in zip(subs, operands):
          magic_math(dst, dst_rows(j), *ops, bcast_dim=bcast_dim, remote_bar=remote_bar)
      else:
        for j in subs:
          magic_math(dst, dst_rows(j), *load_operands(slot, j), bcast_dim=bcast_dim, remote_bar=remote_bar)

    def convert_k(slot, dst, remote_bar=None):
      """K codes + per-channel scales of TMA ring slot -> bf16 K tile dst."""
      if cfg.convert == "magic":
        return convert_magic(load_k_operands, slot, dst, remote_bar, bcast_dim=1)
      for j in range(0 if skip_convert else load_sub):
        rows = pl.ds(j * _SUB, _SUB)
        c = _smem_load(kc_smem.at[slot, rows], (), layout=codes_layout)
        s_lo = _smem_load(ks_smem.at[slot, j, pl.ds(0, _HALF)], (), layout=col_layout)
        s_hi = _smem_load(ks_smem.at[slot, j, pl.ds(_HALF, _HALF)], (), layout=col_layout)
        z_lo = _smem_load(kz_smem.at[slot, j, pl.ds(0, _HALF)], (), layout=col_layout)
        z_hi = _smem_load(kz_smem.at[slot, j, pl.ds(_HALF, _HALF)], (), layout=col_layout)
        lo, hi = _nibbles_bf16(c)
        if cfg.diagnostic == "k_noscale":
          dst[rows, pl.ds(0, _HALF)] = lo
          dst[rows, pl.ds(_HALF, _HALF)] = hi
        else:
          scale_math(dst, rows, lo, hi, s_lo, s_hi, z_lo, z_hi, bcast_dim=1)

    def convert_v_codes(slot, dst):
      """Raw V codes of TMA ring slot -> bf16 [lo | 16 (hi - 8)] tile dst (scales stay in SMEM)."""
      for j in range(0 if skip_convert else nsub):
        rows = pl.ds(j * _SUB, _SUB)
        c = _smem_load(vc_smem.at[slot, rows], (), layout=codes_layout)
        lo, hi = _nibbles_bf16(c)
        dst[rows, pl.ds(0, _HALF)] = lo
        dst[rows, pl.ds(_HALF, _HALF)] = hi

    def convert_v_tile(slot, dst, remote_bar=None):
      """V codes + per-token scale/zero of TMA ring slot -> bf16 V tile dst (v_math='tile')."""
      if cfg.convert == "magic":
        return convert_magic(load_v_operands, slot, dst, remote_bar, bcast_dim=0)
      for j in range(0 if skip_convert else load_sub):
        rows = pl.ds(j * _SUB, _SUB)
        c = _smem_load(vc_smem.at[slot, rows], (), layout=codes_layout)
        s = _smem_load(vs_smem.at[slot, rows], (), layout=row_layout)
        z = _smem_load(vz_smem.at[slot, rows], (), layout=row_layout)
        lo, hi = _nibbles_bf16(c)
        scale_math(dst, rows, lo, hi, s, s, z, z, bcast_dim=0)

    def wait_free(free, step, dslot):
      """Before overwriting ring tile dslot with step's tile: both wgs done with step - deq_slots."""
      if isinstance(step, int):
        if step >= cfg.deq_slots:
          plgpu.barrier_wait(free.at[dslot])
      else:
        pl.when(step >= cfg.deq_slots)(lambda: plgpu.barrier_wait(free.at[dslot]))

    @pl.when(wg_idx < _COMPUTE_WGS)
    def _compute_wg():
      plgpu.set_max_registers(cfg.compute_regs, action="increase")
      qo_smem = qo_smem2.at[wg_idx]
      kdeq = kdeq2.at[wg_idx]
      vdeq = vdeq2.at[wg_idx]
      q_seq_base = q_tile * (_COMPUTE_WGS * block_q) + wg_idx * block_q

      q_rows = pl.ds(q_seq_base, block_q)
      if q_by_tma:  # else the memory warpgroup fills qo_smem (load_q_tiles)
        plgpu.copy_gmem_to_smem(q_ref.at[b, q_rows, h], qo_smem, q_loaded.at[wg_idx])

      def dequant_k(slot, kdeq=kdeq):
        """Codes + per-channel scales of ring slot -> bf16 K tile in kdeq; frees the slot."""
        plgpu.barrier_wait(k_loaded.at[slot])
        convert_k(slot, kdeq)
        plgpu.barrier_arrive(k_consumed.at[slot])
        plgpu.commit_smem()  # generic-proxy writes -> visible to wgmma (async proxy)

      def load_v_scales(slot):
        s = _smem_load(vs_smem.at[slot], (), layout=plgpu.Layout.WGMMA.reduce(0))
        z = _smem_load(vz_smem.at[slot], (), layout=plgpu.Layout.WGMMA.reduce(0))
        return s, z

      def softmax_step(qk, acc, m_i, l_i):
        """One step of the base-2 online softmax; m is kept in units of qk * sm_scale * log2(e).
        Returns (acc, m, l, p, alpha), acc and l already rescaled by alpha."""
        m_ij = jnp.maximum(m_i, qk.max(axis=1) * qk_scale)
        alpha = jnp.exp2(m_i - m_ij)
        p = jnp.exp2(qk * qk_scale - lax.broadcast_in_dim(m_ij, qk.shape, [0]))
        acc *= lax.broadcast_in_dim(alpha, acc.shape, [0])
        l_i = l_i * alpha + p.sum(axis=1)
        return acc, m_ij, l_i, p, alpha

      def online_softmax(qk, v_s, v_z, acc, m_i, l_i, z_i, ps_i):
        """softmax_step for raw V codes (v_math='p_scale'): the V scale goes into P
        (p16 = P * s_v per key) and the V zero point into z_i."""
        acc, m_i, l_i, p, alpha = softmax_step(qk, acc, m_i, l_i)
        if cfg.diagnostic == "no_convert_no_vmath":
          return lax.optimization_barrier((acc, m_i, l_i, z_i, ps_i, p.astype(jnp.bfloat16)))
        p16 = (p * lax.broadcast_in_dim(v_s, qk.shape, [1])).astype(jnp.bfloat16)
        z_i = z_i * alpha + (p * lax.broadcast_in_dim(v_z, qk.shape, [1])).sum(axis=1)
        ps_i = ps_i * alpha + p16.astype(jnp.float32).sum(axis=1)
        return lax.optimization_barrier((acc, m_i, l_i, z_i, ps_i, p16))

      def plain_softmax(qk, acc, m_i, l_i):
        """softmax_step for a dequantized V tile (v_math='tile'): no V terms."""
        acc, m_i, l_i, p, _ = softmax_step(qk, acc, m_i, l_i)
        return lax.optimization_barrier((acc, m_i, l_i, p.astype(jnp.bfloat16)))

      # --- shared_deq: one bf16 K ring and one bf16 V ring per CTA (kdeq2 / vdeq2 indexed
      # by step % deq_slots instead of by warpgroup), read by both warpgroups as wgmma B.
      # Producers: warpgroup 0 every K tile and warpgroup 1 every V tile, or with deq_wg
      # the memory warpgroup both. *_ready (1 arrival: the producer, after commit_smem) /
      # *_free (2 arrivals: each consumer once its wgmma on the tile has completed). Every
      # waiter waits every phase of the barriers it waits on, in order (phases are tracked
      # per thread).
      def produce_k(step):  # warpgroup 0 only
        k_ready, _, k_free, _ = deq_bars
        dslot = deq_slot(step)
        wait_free(k_free, step, dslot)
        dequant_k(slot_of(step), kdeq2.at[dslot])  # waits k_loaded, frees the codes, commit_smem
        plgpu.barrier_arrive(k_ready.at[dslot])

      def produce_v(step):  # warpgroup 1 only; it waits v_loaded here, once per step
        _, v_ready, _, v_free = deq_bars
        dslot = deq_slot(step)
        wait_free(v_free, step, dslot)
        slot = slot_of(step)
        plgpu.barrier_wait(v_loaded.at[slot])
        if cfg.v_math == "tile":
          convert_v_tile(slot, vdeq2.at[dslot])
          plgpu.barrier_arrive(v_consumed.at[slot])  # the only reader of this V slot
        else:
          convert_v_codes(slot, vdeq2.at[dslot])
        plgpu.commit_smem()  # generic-proxy writes -> visible to the other warpgroup's wgmma
        plgpu.barrier_arrive(v_ready.at[dslot])

      def kv_loop_shared(kv_step, carry):
        acc, m_i, l_i, z_i, ps_i = carry
        k_ready, v_ready, k_free, v_free = deq_bars
        slot = slot_of(kv_step)
        dslot = deq_slot(kv_step)
        kdeq_s, vdeq_s = kdeq2.at[dslot], vdeq2.at[dslot]

        plgpu.barrier_wait(k_ready.at[dslot])
        if share and cfg.cluster_fence:  # the peer's half came by st.async (generic proxy): order it before wgmma
          plgpu.commit_smem()

        def compute_qk(acc_ref):
          plgpu.wgmma(acc_ref, qo_smem, plgpu.transpose_ref(kdeq_s, (1, 0)))
          perform_schedule_barrier()
          return acc_ref[...]

        qk = pl.run_scoped(compute_qk, plgpu.ACC((block_q, block_kv), jnp.float32))
        plgpu.barrier_arrive(k_free.at[dslot])
        if cfg.v_math == "tile":
          acc, m_i, l_i, p16 = plain_softmax(qk, acc, m_i, l_i)
        else:
          # Warpgroup 1 already waited on v_loaded for this step in produce_v.
          pl.when(wg_idx == 0)(lambda: plgpu.barrier_wait(v_loaded.at[slot]))
          v_s, v_z = load_v_scales(slot)
          plgpu.barrier_arrive(v_consumed.at[slot])
          acc, m_i, l_i, z_i, ps_i, p16 = online_softmax(qk, v_s, v_z, acc, m_i, l_i, z_i, ps_i)

        if cfg.schedule_barrier:
          plgpu.barrier_arrive(schedule_barrier)  # done with softmax
          plgpu.barrier_wait(schedule_barrier)  # wait until the tensor core is free
        plgpu.barrier_wait(v_ready.at[dslot])
        if share and cfg.cluster_fence:
          plgpu.commit_smem()

        def compute_pv(acc_ref):
          plgpu.wgmma(acc_ref, p16, vdeq_s)
          if cfg.deq_wg:
            return

          @pl.when(kv_step + 1 < kv_steps)
          def _produce_next():  # next K (wg 0) / V (wg 1) tile while the PV wgmma runs
            pl.when(wg_idx == 0)(lambda: produce_k(kv_step + 1))
            pl.when(wg_idx == 1)(lambda: produce_v(kv_step + 1))

        acc = _accumulate(compute_pv, acc)
        plgpu.barrier_arrive(v_free.at[dslot])
        return acc, m_i, l_i, z_i, ps_i

      row_vec = lambda: plgpu.layout_cast(jnp.full((block_q,), 0, dtype=jnp.float32),
                                          plgpu.Layout.WGMMA.reduce(1))
      m_i = plgpu.layout_cast(jnp.full((block_q,), -jnp.inf, dtype=jnp.float32),
                              plgpu.Layout.WGMMA.reduce(1))
      l_i, z_i, ps_i = row_vec(), row_vec(), row_vec()
      acc = plgpu.layout_cast(jnp.full((block_q, d), 0, dtype=jnp.float32), plgpu.Layout.WGMMA)

      plgpu.barrier_wait(q_loaded.at[wg_idx])
      if cfg.deq_wg:
        pass  # the memory warpgroup produces every tile
      elif cfg.shared_deq:
        pl.when(wg_idx == 0)(lambda: produce_k(0))
        pl.when(wg_idx == 1)(lambda: produce_v(0))
      else:
        dequant_k(0)
      pl.when(wg_idx == 1)(perform_schedule_barrier)

      def kv_loop(kv_step, carry):
        acc, m_i, l_i, z_i, ps_i = carry
        slot = slot_of(kv_step)

        def compute_qk(acc_ref):
          plgpu.wgmma(acc_ref, qo_smem, plgpu.transpose_ref(kdeq, (1, 0)))
          perform_schedule_barrier()
          if cfg.overlap:  # V codes -> vdeq while the QK wgmma runs (vdeq is idle).
            plgpu.barrier_wait(v_loaded.at[slot])
            convert_v_codes(slot, vdeq)
          return acc_ref[...]

        qk = pl.run_scoped(compute_qk, plgpu.ACC((block_q, block_kv), jnp.float32))
        if not cfg.overlap:
          plgpu.barrier_wait(v_loaded.at[slot])
        v_s, v_z = load_v_scales(slot)
        if cfg.overlap:
          plgpu.barrier_arrive(v_consumed.at[slot])

        acc, m_i, l_i, z_i, ps_i, p16 = online_softmax(qk, v_s, v_z, acc, m_i, l_i, z_i, ps_i)

        if cfg.schedule_barrier:
          plgpu.barrier_arrive(schedule_barrier)  # done with softmax
        if not cfg.overlap:
          convert_v_codes(slot, vdeq)
          plgpu.barrier_arrive(v_consumed.at[slot])
        plgpu.commit_smem()  # vdeq writes -> visible to wgmma
        if cfg.schedule_barrier:
          plgpu.barrier_wait(schedule_barrier)  # wait until the tensor core is free

        def compute_pv(acc_ref):
          plgpu.wgmma(acc_ref, p16, vdeq)
          if cfg.overlap:  # next K tile -> kdeq while the PV wgmma runs (kdeq is idle).
            @pl.when(kv_step + 1 < kv_steps)
            def _next_k():
              dequant_k(slot_of(kv_step + 1))

        acc = _accumulate(compute_pv, acc)
        if not cfg.overlap:
          @pl.when(kv_step + 1 < kv_steps)
          def _next_k():
            dequant_k(slot_of(kv_step + 1))
        return acc, m_i, l_i, z_i, ps_i

      loop_body = kv_loop_shared if cfg.shared_deq else kv_loop
      acc, m_i, l_i, z_i, ps_i = lax.fori_loop(0, kv_steps, loop_body, (acc, m_i, l_i, z_i, ps_i))
      pl.when(wg_idx == 0)(perform_schedule_barrier)

      shape = (block_q, d)
      if cfg.v_math == "tile":
        out = acc
      else:
        # Columns [64, 128) hold (P' @ 16 (hi - 8)) : divide by 16, add back 8 * sum P'.
        col = plgpu.broadcasted_iota(jnp.int32, (block_q, d), 1, layout=plgpu.Layout.WGMMA)
        ps_b = lax.broadcast_in_dim(ps_i, shape, [0])
        out = jnp.where(col >= _HALF, acc * (1.0 / 16.0) + 8.0 * ps_b, acc)
        out = out + lax.broadcast_in_dim(z_i, shape, [0])
      out = out * lax.broadcast_in_dim(1.0 / l_i, shape, [0])
      if q_by_tma:
        qo_smem[...] = out.astype(jnp.bfloat16)
      else:
        out_ref[b, q_rows, h_out] = out.astype(jnp.bfloat16)
      if save_lse:
        lse_smem = lse_smem2.at[wg_idx]
        lse_smem[...] = (m_i + jnp.log(l_i) * _LOG2E) * (1.0 / qk_scale)
      plgpu.commit_smem()
      if q_by_tma:
        plgpu.copy_smem_to_gmem(qo_smem, out_ref.at[b, q_rows, h_out])
      if save_lse:
        plgpu.copy_smem_to_gmem(lse_smem, lse_ref.at[b, h_out, pl.ds(q_seq_base, block_q)])
      plgpu.wait_smem_to_gmem(0)
      if share:  # no CTA of the pair exits while its peer may still arrive on its barriers
        plgpu.barrier_arrive(exit_barrier)
        plgpu.barrier_wait(exit_barrier)

    def memory_wg(do_k, do_v):
      """TMA for the K (do_k) and / or V (do_v) code rings; with deq_wg also their
      conversion. One memory warpgroup does both, or with converter_wgs=2 one each."""
      plgpu.set_max_registers(cfg.memory_regs, action="decrease")

      # cluster_share: only this CTA's 64-key half of each step
      step_keys = lambda step: (pl.ds(step * block_kv + rank * load_kv, load_kv) if share
                                else pl.ds(step * block_kv, block_kv))
      step_blocks = lambda step: (pl.ds(step * nsub + rank * load_sub, load_sub) if share
                                  else pl.ds(step * nsub, nsub))

      def issue_k(step, slot):
        bar = k_loaded.at[slot]
        plgpu.copy_gmem_to_smem(kc_ref.at[b, h, step_keys(step)], kc_smem.at[slot], bar)
        plgpu.copy_gmem_to_smem(ks_ref.at[b, h_scale, step_blocks(step)], ks_smem.at[slot], bar)
        plgpu.copy_gmem_to_smem(kz_ref.at[b, h_scale, step_blocks(step)], kz_smem.at[slot], bar)

      def issue_v(step, slot):
        bar = v_loaded.at[slot]
        keys = step_keys(step)
        plgpu.copy_gmem_to_smem(vc_ref.at[b, h, keys], vc_smem.at[slot], bar)
        plgpu.copy_gmem_to_smem(vs_ref.at[b, h_scale, keys], vs_smem.at[slot], bar)
        plgpu.copy_gmem_to_smem(vz_ref.at[b, h_scale, keys], vz_smem.at[slot], bar)

      for i in range(steps):
        if do_k:
          issue_k(i, i)
        if do_v:
          issue_v(i, i)

      def load_q_tiles():
        """Without TMA (Tq % 8 != 0): both compute warpgroups' q tiles through this
        warpgroup's registers, in 64 x 64 pieces (its register budget is small). Done
        here, not in the compute warpgroups: there it cost 4% at T=152k, with more
        spills in their key loop."""
        for w in range(_COMPUTE_WGS):
          base = q_tile * (_COMPUTE_WGS * block_q) + w * block_q
          for r0 in range(0, block_q, 64):
            for c0 in range(0, d, 64):
              piece = plgpu.load(q_ref.at[b, pl.ds(base + r0, 64), h, pl.ds(c0, 64)], (),
                                 layout=plgpu.Layout.WGMMA, optimized=False)
              qo_smem2.at[w, pl.ds(r0, 64), pl.ds(c0, 64)][...] = piece
          plgpu.commit_smem()  # generic-proxy writes -> visible to wgmma
          plgpu.barrier_arrive(q_loaded.at[w])

      if not q_by_tma and do_k:
        load_q_tiles()

      if cfg.deq_wg:
        # This warpgroup is the only reader of the code tiles: it converts step's K and V
        # into the bf16 rings, then refills the code slot with step + steps. The code
        # loads are complete at commit_smem (it ends with a warpgroup barrier), before the
        # TMA overwrites the slot.
        k_ready, v_ready, k_free, v_free = deq_bars

        @pl.loop(0, kv_steps)
        def _deq_loop(kv_step):
          slot = slot_of(kv_step)
          dslot = deq_slot(kv_step)
          if do_k:
            plgpu.barrier_wait(k_loaded.at[slot])
            wait_free(k_free, kv_step, dslot)
            convert_k(slot, kdeq2.at[dslot], remote_bar=k_ready.at[dslot] if share else None)
            plgpu.commit_smem()  # generic-proxy writes -> visible to the compute wgs' wgmma
            plgpu.barrier_arrive(k_ready.at[dslot])
          if do_v:
            plgpu.barrier_wait(v_loaded.at[slot])
            wait_free(v_free, kv_step, dslot)
            convert_v_tile(slot, vdeq2.at[dslot], remote_bar=v_ready.at[dslot] if share else None)
            plgpu.commit_smem()
            plgpu.barrier_arrive(v_ready.at[dslot])

          @pl.when(kv_step + steps < kv_steps)
          def _refill():
            if do_k:
              issue_k(kv_step + steps, slot)
            if do_v:
              issue_v(kv_step + steps, slot)
        return

      @pl.loop(0, kv_steps - steps)
      def _kv_loop(kv_step):
        tma_step = kv_step + steps
        tma_slot = slot_of(kv_step)
        plgpu.barrier_wait(k_consumed.at[tma_slot])
        issue_k(tma_step, tma_slot)
        plgpu.barrier_wait(v_consumed.at[tma_slot])
        issue_v(tma_step, tma_slot)

    if cfg.converter_wgs == 1:
      pl.when(wg_idx == _COMPUTE_WGS)(lambda: memory_wg(True, True))
    else:
      pl.when(wg_idx == _COMPUTE_WGS)(lambda: memory_wg(True, False))
      pl.when(wg_idx == _COMPUTE_WGS + 1)(lambda: memory_wg(False, True))

  def entry(q_ref, kc_ref, ks_ref, kz_ref, vc_ref, vs_ref, vz_ref, out_ref, lse_ref=None):
    t16 = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))  # bf16, 128-byte rows
    t8 = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(64))    # int8, 64-byte rows
    ndeq = cfg.deq_slots if cfg.shared_deq else _COMPUTE_WGS
    smem = (
        plgpu.SMEM((_COMPUTE_WGS, block_q, d), jnp.bfloat16, transforms=t16),   # q, then out
        plgpu.SMEM((steps, load_kv, _HALF), jnp.int8, transforms=t8),           # K codes ring
        plgpu.SMEM((steps, load_sub, d), scale_dtype),                          # K scales ring
        plgpu.SMEM((steps, load_sub, d), scale_dtype),                          # K zeros ring
        plgpu.SMEM((steps, load_kv, _HALF), jnp.int8, transforms=t8),           # V codes ring
        plgpu.SMEM((steps, load_kv), scale_dtype),                              # V scales ring
        plgpu.SMEM((steps, load_kv), scale_dtype),                              # V zeros ring
        # K bf16 / V codes bf16: one tile per wg, or with shared_deq a ring of deq_slots tiles.
        plgpu.SMEM((ndeq, block_kv, d), jnp.bfloat16, transforms=t16),
        plgpu.SMEM((ndeq, block_kv, d), jnp.bfloat16, transforms=t16),
        plgpu.SMEM((_COMPUTE_WGS, block_q), jnp.float32) if save_lse else None,  # lse per wg
    )
    deq_barriers = ()
    if cfg.shared_deq and share:
      # ready: this CTA's converter (1 arrival) and the peer's two st.async stores (2, with
      # their bytes); free: both compute warpgroups of both CTAs (a cluster barrier: each
      # arrival lands in both CTAs), since each converter writes into both.
      ready = lambda: plgpu.Barrier(num_arrivals=1 + 2 * load_sub, num_barriers=cfg.deq_slots)
      free = lambda: plgpu.ClusterBarrier(collective_axes=("cluster",), num_arrivals=_COMPUTE_WGS,
                                          num_barriers=cfg.deq_slots)
      deq_barriers = ((ready(), ready(), free(), free()),
                      plgpu.ClusterBarrier(collective_axes=("cluster",), num_arrivals=_COMPUTE_WGS))
    elif cfg.shared_deq:
      deq_barriers = ((
          plgpu.Barrier(num_barriers=cfg.deq_slots),  # bf16 K tile ready (producer: wg 0 or memory wg)
          plgpu.Barrier(num_barriers=cfg.deq_slots),  # bf16 V tile ready (producer: wg 1 or memory wg)
          plgpu.Barrier(num_arrivals=_COMPUTE_WGS, num_barriers=cfg.deq_slots),  # K slot read by both
          plgpu.Barrier(num_arrivals=_COMPUTE_WGS, num_barriers=cfg.deq_slots),  # V slot read by both
      ),)
    pl.run_scoped(
        lambda *args: kernel(q_ref, kc_ref, ks_ref, kz_ref, vc_ref, vs_ref, vz_ref, out_ref, lse_ref, args),
        smem,
        (
            plgpu.Barrier(num_arrivals=3, num_barriers=steps),  # K codes + scale + zero
            plgpu.Barrier(num_arrivals=3, num_barriers=steps),  # V codes + scale + zero
            plgpu.Barrier(num_barriers=_COMPUTE_WGS),           # q tile per wg
        ),
        (  # K codes read by both wgs (by wg 0 only with shared_deq); V codes/scales by
           # both, except with v_math="tile" (wg 1 only)
            plgpu.Barrier(num_arrivals=1 if cfg.shared_deq else _COMPUTE_WGS, num_barriers=steps),
            plgpu.Barrier(num_arrivals=1 if cfg.v_math == "tile" else _COMPUTE_WGS, num_barriers=steps),
        ),
        plgpu.Barrier(num_arrivals=_COMPUTE_WGS),
        *deq_barriers,
        collective_axes="wg",
    )

  cluster_kw = {}
  if share:
    grid, grid_names = (num_q_tiles // 2, heads, batch), ("q_seq", "heads", "batch")
    cluster_kw = dict(cluster=(2,), cluster_names=("cluster",))
  elif cfg.grid_q_fastest:
    grid, grid_names = (num_q_tiles, heads, batch), ("q_seq", "heads", "batch")
  else:
    grid, grid_names = (heads, num_q_tiles, batch), ("heads", "q_seq", "batch")
  out_type = [jax.ShapeDtypeStruct((batch, tq, heads, d), jnp.bfloat16)]
  if save_lse:
    # seq minor-most, so each warpgroup's block_q values are one 1-D TMA copy; only the
    # covered rows (a multiple of 2 * block_q: Mosaic-GPU needs 8-aligned minor dims).
    out_type.append(jax.ShapeDtypeStruct((batch, heads, num_q_tiles * _COMPUTE_WGS * block_q), jnp.float32))
  outs = plgpu.kernel(
      entry,
      out_type=out_type,
      grid=grid,
      grid_names=grid_names,
      num_threads=_COMPUTE_WGS + cfg.converter_wgs,
      thread_name="wg",
      **cluster_kw,
      compiler_params=plgpu.CompilerParams(approx_math=True, unsafe_no_auto_barriers=not cfg.auto_barriers),
  )(q, kc, ks, kz, vc, vs, vz)
  return tuple(outs) if save_lse else outs[0]


def attention_call_reference(q, kc, ks, kz, vc, vs, vz, *, cfg: MgpuConfig, sm_scale: float, num_q_tiles=None,
                             kv_steps=None, head_offset=0, num_heads=None, save_lse=False):
  """Float32 jnp reference of ``_attention_call`` (same operands and arguments).

  Output rows past the covered q tiles, which the kernel leaves unwritten, are NaN
  here, so a pass that should overwrite them and does not shows up in tests.
  """
  batch, tq, all_heads, d = q.shape
  heads = all_heads if num_heads is None else num_heads
  kv_steps = kc.shape[2] // cfg.block_kv if kv_steps is None else kv_steps
  rows = (tq // (_COMPUTE_WGS * cfg.block_q) if num_q_tiles is None else num_q_tiles) * _COMPUTE_WGS * cfg.block_q
  keys = kv_steps * cfg.block_kv
  hs = slice(head_offset, head_offset + heads)
  codes = lambda c: fmt.unpack_nibbles(lax.bitcast_convert_type(c[:, hs, :keys], jnp.uint8)).astype(jnp.float32)
  per_block = lambda a: jnp.repeat(a[:, hs, :keys // _SUB], _SUB, axis=2)
  k = codes(kc) * per_block(ks) + per_block(kz)                                    # (B, H, keys, D)
  v = codes(vc) * vs[:, hs, :keys, None] + vz[:, hs, :keys, None]
  qf = q[:, :rows, hs].astype(jnp.float32)
  s = jnp.einsum("bqhd,bhkd->bhqk", qf, k, precision=lax.Precision.HIGHEST)
  lse = jax.nn.logsumexp(s * sm_scale, axis=-1) / sm_scale                          # raw logit units
  p = jnp.exp((s - lse[..., None]) * sm_scale)
  o = jnp.einsum("bhqk,bhkd->bqhd", p, v, precision=lax.Precision.HIGHEST)
  out = jnp.full((batch, tq, heads, d), jnp.nan, jnp.float32).at[:, :rows].set(o).astype(jnp.bfloat16)
  if not save_lse:
    return out
  return out, lse


def int4_store_operands(packed):
  """The int4 store of a PackedKV as the kernel's operands (kc, ks, kz, vc, vs, vz):
  same-width bitcasts and reshapes, no data movement."""
  a, meta = packed.arrays, packed.meta
  b, h = meta.batch, meta.heads
  rows = a["k_codes4"].shape[2]
  kc = lax.bitcast_convert_type(a["k_codes4"], jnp.int8)
  vc = lax.bitcast_convert_type(a["v_codes4"], jnp.int8)
  return (kc, a["k_scale4"], a["k_zero4"], vc, a["v_scale4"].reshape(b, h, rows),
          a["v_zero4"].reshape(b, h, rows))


@functools.partial(jax.jit, static_argnames=("cfg", "sm_scale"))
def _packed_attention_mgpu_jit(q, packed, *, cfg: MgpuConfig, sm_scale: float):
  return _attention_call(q, *int4_store_operands(packed), cfg=cfg, sm_scale=sm_scale)


def packed_attention_mgpu(q, packed, *, block_q=None, block_kv=None, max_concurrent_steps=None,
                          variant=DEFAULT_VARIANT, sm_scale=None):
  """Dense attention of bf16 ``q`` (B, Tq, H, D), rotated by R_k, over an all-int4
  ``formats.PackedKV`` (K "channel", V "token", D = 128) on a Hopper GPU.

  Returns (B, Tq, H, D) bf16 in the rotated basis, i.e. what
  ``packed_attention(q, packed, keep_rotated=True)`` returns. ``variant`` picks a
  code-generation design point from ``VARIANTS`` (default ``DEFAULT_VARIANT``); block
  arguments given explicitly override the variant's. sm_scale defaults to 1/sqrt(D).
  Jit-able (everything but q and packed arrays is static). See the module docstring for scope and design.
  """
  cfg = make_config(block_q, block_kv, max_concurrent_steps, variant)
  meta = _validate(q, packed, cfg)
  return _packed_attention_mgpu_jit(q, packed, cfg=cfg, sm_scale=resolve_sm_scale(sm_scale, meta.head_dim))
