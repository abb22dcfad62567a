"""PROTOTYPE: Hopper (sm_90) Mosaic-GPU flash attention over packed int4 K/V.

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
* every 64-token block int4 (``block_classes`` all 0), K scheme ``channel``, V
  scheme ``token``, head_dim D = 128, bf16 q (B, Tq, H, D) in the rotated basis;
* ``num_tokens`` a multiple of ``block_kv`` (64 or 128), so there are no padding rows;
* Tq a multiple of ``2 * block_q`` (two compute warpgroups of ``block_q`` rows each);
* no segments / masks; output in the rotated basis (``keep_rotated=True``), bf16.

Design
------
* One CTA = 3 warpgroups (as jax's ``ops/gpu/attention_mgpu.py``): warpgroups 0 and 1
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

Variants (``variant=`` keyword, see ``VARIANTS``) exist so that one GPU run can
compare a few design points; they only change code generation, never results beyond
bf16 rounding (``k_math="bf16"`` rounds s and z to bf16: cos about 0.99996 against the
float32 reference instead of 0.99999). ``DIAGNOSTIC_VARIANTS`` skip parts of the work
and give wrong results on purpose: the probe times them to split the kernel's time.

Status: every point of ``VARIANTS`` passed ``pytest -m gpu`` on an H200 (jax 0.11.2)
when it was added; after the last change to shared code (K/V scale math in
``scale_math``) the GPU run covered base, kbf16, no_overlap, shared_deq_8bit_kbf16,
vtile, vtile_bf16 and vtile_bf16_nosched (``benchmarks/results/logs/pytest_gpu_mgpu_*``).
The H200 times (T = 152,320, B = 1, H = 56) are in ``benchmarks/NOTES.md`` and
``benchmarks/results/attention_mgpu_probe*.json``: the best is ``vtile_bf16_nosched``
at about 1.45x cuDNN BF16, ``vtile`` at about 1.6x. On the CPU every variant lowers for
CUDA and matches the reference in Mosaic-GPU interpret mode with race detection
(``python -m benchmarks.probe_attention_mgpu --interpret-check``). It is not wired into
``packed_attention``: it lacks masks, varlen, ragged T, mixed int8/bf16 classes and
head_dim 64.
"""
from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
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
# Registers per thread at launch: 65536 / (3 warpgroups x 128 threads) rounded down to a
# multiple of 8 = 168, so the three setmaxnreg values may add up to 3 x 168 = 504.
_REG_POOL = 3 * (65536 // (3 * 128) // 8 * 8)


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
  diagnostic: str = ""
  # The memory warpgroup also dequantizes every K and V tile into the shared bf16 rings
  # (shared_deq + v_math="tile" only), so the compute warpgroups run plain FA3 on bf16
  # tiles and the conversion leaves their instruction stream (module doc).
  deq_wg: bool = False
  deq_slots: int = 2              # shared_deq: depth of the shared bf16 K and V rings
  compute_regs: int = 232         # setmaxnreg of each compute warpgroup
  memory_regs: int = 40           # setmaxnreg of the memory warpgroup (2 * compute + memory <= 504)

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
    if self.diagnostic not in ("", "k_noscale", "no_convert", "no_convert_no_vmath"):
      raise ValueError(f"diagnostic={self.diagnostic!r} must be '', 'k_noscale', 'no_convert' "
                       "or 'no_convert_no_vmath'")
    if self.v_math not in ("p_scale", "tile"):
      raise ValueError(f"v_math={self.v_math!r} must be 'p_scale' or 'tile'")
    if self.v_math == "tile" and not self.shared_deq:
      raise ValueError("v_math='tile' needs shared_deq=True")
    if self.shared_deq and not self.overlap:
      raise ValueError("shared_deq=True needs overlap=True (tiles are dequantized under the PV wgmma)")
    if self.deq_wg and not (self.shared_deq and self.v_math == "tile"):
      raise ValueError("deq_wg=True needs shared_deq=True and v_math='tile'")
    if self.deq_slots < 2:
      raise ValueError(f"deq_slots={self.deq_slots} must be >= 2")
    for name in ("compute_regs", "memory_regs"):
      n = getattr(self, name)
      if n % 8 or not 24 <= n <= 256:
        raise ValueError(f"{name}={n} must be a multiple of 8 in [24, 256] (setmaxnreg)")
    total = _COMPUTE_WGS * self.compute_regs + self.memory_regs
    if total > _REG_POOL:
      # setmaxnreg only moves the registers allocated at launch between warpgroups: a
      # compute warpgroup's "increase" past the pool waits forever (a hang, not an error).
      raise ValueError(f"2 * compute_regs + memory_regs = {total} exceeds {_REG_POOL}, the registers per "
                       f"thread allocated at launch for 3 warpgroups (3 x {_REG_POOL // 3}); lower one of them")


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
}


# The fastest variant whose results match the reference at f32 K/V math (H200 probes,
# benchmarks/NOTES.md); the bf16-math ones are faster but sit closer to the test bound.
DEFAULT_VARIANT = "vtile"


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


def _attention_call(q, kc, ks, kz, vc, vs, vz, *, cfg: MgpuConfig, sm_scale: float):
  """q (B,Tq,H,D) bf16; kc/vc (B,H,T,64) int8; ks/kz (B,H,NB,D) f32; vs/vz (B,H,T) f32."""
  batch, tq, heads, d = q.shape
  tkv = kc.shape[2]
  block_q, block_kv = cfg.block_q, cfg.block_kv
  nsub = block_kv // _SUB
  kv_steps = tkv // block_kv
  steps = min(cfg.max_concurrent_steps, kv_steps)
  qk_scale = sm_scale * _LOG2E
  codes_layout = _codes_layout(cfg)
  col_layout = codes_layout.reduce(0)  # (64,) per-channel vectors broadcast over rows
  row_layout = codes_layout.reduce(1)  # (64,) per-token vectors broadcast over columns
  num_q_tiles = tq // (_COMPUTE_WGS * block_q)

  def kernel(q_ref, kc_ref, ks_ref, kz_ref, vc_ref, vs_ref, vz_ref, out_ref, scoped):
    smem, loaded, consumed, schedule_barrier, *deq_bars = scoped
    deq_bars = deq_bars[0] if deq_bars else None  # shared_deq only
    qo_smem2, kc_smem, ks_smem, kz_smem, vc_smem, vs_smem, vz_smem, kdeq2, vdeq2 = smem
    k_loaded, v_loaded, q_loaded = loaded
    k_consumed, v_consumed = consumed
    b = lax.axis_index("batch")
    h = lax.axis_index("heads")
    q_tile = lax.axis_index("q_seq")
    wg_idx = lax.axis_index("wg")
    skip_convert = cfg.diagnostic.startswith("no_convert")

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

    def convert_k(slot, dst):
      """K codes + per-channel scales of TMA ring slot -> bf16 K tile dst."""
      for j in range(0 if skip_convert else nsub):
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

    def convert_v_tile(slot, dst):
      """V codes + per-token scale/zero of TMA ring slot -> bf16 V tile dst (v_math='tile')."""
      for j in range(0 if skip_convert else nsub):
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

      plgpu.copy_gmem_to_smem(q_ref.at[b, pl.ds(q_seq_base, block_q), h], qo_smem, q_loaded.at[wg_idx])

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
      qo_smem[...] = out.astype(jnp.bfloat16)
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(qo_smem, out_ref.at[b, pl.ds(q_seq_base, block_q), h])
      plgpu.wait_smem_to_gmem(0)

    @pl.when(wg_idx == _COMPUTE_WGS)
    def _memory_wg():
      plgpu.set_max_registers(cfg.memory_regs, action="decrease")

      def issue_k(step, slot):
        bar = k_loaded.at[slot]
        plgpu.copy_gmem_to_smem(kc_ref.at[b, h, pl.ds(step * block_kv, block_kv)], kc_smem.at[slot], bar)
        plgpu.copy_gmem_to_smem(ks_ref.at[b, h, pl.ds(step * nsub, nsub)], ks_smem.at[slot], bar)
        plgpu.copy_gmem_to_smem(kz_ref.at[b, h, pl.ds(step * nsub, nsub)], kz_smem.at[slot], bar)

      def issue_v(step, slot):
        bar = v_loaded.at[slot]
        keys = pl.ds(step * block_kv, block_kv)
        plgpu.copy_gmem_to_smem(vc_ref.at[b, h, keys], vc_smem.at[slot], bar)
        plgpu.copy_gmem_to_smem(vs_ref.at[b, h, keys], vs_smem.at[slot], bar)
        plgpu.copy_gmem_to_smem(vz_ref.at[b, h, keys], vz_smem.at[slot], bar)

      for i in range(steps):
        issue_k(i, i)
        issue_v(i, i)

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
          plgpu.barrier_wait(k_loaded.at[slot])
          wait_free(k_free, kv_step, dslot)
          convert_k(slot, kdeq2.at[dslot])
          plgpu.commit_smem()  # generic-proxy writes -> visible to the compute wgs' wgmma
          plgpu.barrier_arrive(k_ready.at[dslot])
          plgpu.barrier_wait(v_loaded.at[slot])
          wait_free(v_free, kv_step, dslot)
          convert_v_tile(slot, vdeq2.at[dslot])
          plgpu.commit_smem()
          plgpu.barrier_arrive(v_ready.at[dslot])

          @pl.when(kv_step + steps < kv_steps)
          def _refill():
            issue_k(kv_step + steps, slot)
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

  def entry(q_ref, kc_ref, ks_ref, kz_ref, vc_ref, vs_ref, vz_ref, out_ref):
    t16 = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))  # bf16, 128-byte rows
    t8 = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(64))    # int8, 64-byte rows
    ndeq = cfg.deq_slots if cfg.shared_deq else _COMPUTE_WGS
    smem = (
        plgpu.SMEM((_COMPUTE_WGS, block_q, d), jnp.bfloat16, transforms=t16),   # q, then out
        plgpu.SMEM((steps, block_kv, _HALF), jnp.int8, transforms=t8),          # K codes ring
        plgpu.SMEM((steps, nsub, d), jnp.float32),                              # K scales ring
        plgpu.SMEM((steps, nsub, d), jnp.float32),                              # K zeros ring
        plgpu.SMEM((steps, block_kv, _HALF), jnp.int8, transforms=t8),          # V codes ring
        plgpu.SMEM((steps, block_kv), jnp.float32),                             # V scales ring
        plgpu.SMEM((steps, block_kv), jnp.float32),                             # V zeros ring
        # K bf16 / V codes bf16: one tile per wg, or with shared_deq a ring of deq_slots tiles.
        plgpu.SMEM((ndeq, block_kv, d), jnp.bfloat16, transforms=t16),
        plgpu.SMEM((ndeq, block_kv, d), jnp.bfloat16, transforms=t16),
    )
    deq_barriers = ()
    if cfg.shared_deq:
      deq_barriers = ((
          plgpu.Barrier(num_barriers=cfg.deq_slots),  # bf16 K tile ready (producer: wg 0 or memory wg)
          plgpu.Barrier(num_barriers=cfg.deq_slots),  # bf16 V tile ready (producer: wg 1 or memory wg)
          plgpu.Barrier(num_arrivals=_COMPUTE_WGS, num_barriers=cfg.deq_slots),  # K slot read by both
          plgpu.Barrier(num_arrivals=_COMPUTE_WGS, num_barriers=cfg.deq_slots),  # V slot read by both
      ),)
    pl.run_scoped(
        lambda *args: kernel(q_ref, kc_ref, ks_ref, kz_ref, vc_ref, vs_ref, vz_ref, out_ref, args),
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

  if cfg.grid_q_fastest:
    grid, grid_names = (num_q_tiles, heads, batch), ("q_seq", "heads", "batch")
  else:
    grid, grid_names = (heads, num_q_tiles, batch), ("heads", "q_seq", "batch")
  return plgpu.kernel(
      entry,
      out_type=jax.ShapeDtypeStruct(q.shape, jnp.bfloat16),
      grid=grid,
      grid_names=grid_names,
      num_threads=_COMPUTE_WGS + 1,
      thread_name="wg",
      compiler_params=plgpu.CompilerParams(approx_math=True),
  )(q, kc, ks, kz, vc, vs, vz)


@functools.partial(jax.jit, static_argnames=("cfg", "sm_scale"))
def _packed_attention_mgpu_jit(q, packed, *, cfg: MgpuConfig, sm_scale: float):
  a = packed.arrays
  b, h = packed.meta.batch, packed.meta.heads
  t = packed.meta.num_tokens
  # Same-width bitcasts and reshapes: no data movement.
  kc = lax.bitcast_convert_type(a["k_codes4"], jnp.int8)
  vc = lax.bitcast_convert_type(a["v_codes4"], jnp.int8)
  vs = a["v_scale4"].reshape(b, h, t)
  vz = a["v_zero4"].reshape(b, h, t)
  return _attention_call(q, kc, a["k_scale4"], a["k_zero4"], vc, vs, vz, cfg=cfg, sm_scale=sm_scale)


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
