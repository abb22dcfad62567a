"""Which Pallas-Triton constructs lower on the GPU's jax/triton (one tiny kernel each)."""
import json, os, traceback
import jax, jax.numpy as jnp, numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

interp = jax.default_backend() != "gpu"
res = {}

def probe(name):
  def deco(fn):
    try:
      ok = fn()
      res[name] = "ok" if ok is None or ok is True else f"WRONG: {ok}"
    except Exception as e:
      res[name] = "FAIL: " + (str(e).splitlines()[0][:300] if str(e) else repr(e))
      traceback.print_exc(limit=2)
    print(name, res[name], flush=True)
    return fn
  return deco

def call(kernel, out_shape, *args, grid=(1,), **kw):
  return pl.pallas_call(kernel, out_shape=out_shape, grid=grid, interpret=interp,
                        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=2), **kw)(*args)

@probe("scalar_load_from_ref_at_program_id")
def _():
  def k(tab_ref, o_ref):
    i = pl.program_id(0)
    o_ref[...] = jnp.full((16,), tab_ref[i] * 2, jnp.int32)
  tab = jnp.arange(4, dtype=jnp.int32) + 5
  out = call(k, jax.ShapeDtypeStruct((4, 16), jnp.int32), tab, grid=(4,),
             in_specs=[pl.BlockSpec((4,), lambda i: (0,))], out_specs=pl.BlockSpec((None, 16), lambda i: (i, 0)))
  return bool((np.asarray(out)[:, 0] == 2 * (np.arange(4) + 5)).all())

@probe("masked_dynamic_row_load_store")
def _():
  T = 100
  def k(x_ref, o_ref):
    r0 = pl.program_id(0) * 64
    rows = r0 + jnp.arange(64)
    x = plgpu.load(x_ref.at[pl.ds(r0, 64), pl.ds(0, 64)], mask=(rows < T)[:, None], other=0.0)
    plgpu.store(o_ref.at[pl.ds(r0, 64), :], x * 2, mask=(rows < T)[:, None])
  x = jnp.ones((T, 64), jnp.float32)
  out = call(k, jax.ShapeDtypeStruct((T, 64), jnp.float32), x, grid=(2,))
  return bool(np.allclose(out, 2))

@probe("uint8_nibbles_pack_unpack")
def _():
  def k(a_ref, o_ref, u_ref):
    a = a_ref[...]                                   # (64, 64) f32 codes 0..15
    lo = a_ref[:, :32].astype(jnp.int32)
    hi = a_ref[:, 32:].astype(jnp.int32)
    packed = (lo | (hi << 4)).astype(jnp.uint8)
    o_ref[...] = packed
    u_ref[:, :32] = (packed & 0xF).astype(jnp.bfloat16).astype(jnp.float32)
    u_ref[:, 32:] = (packed >> 4).astype(jnp.bfloat16).astype(jnp.float32)
  a = jnp.asarray(np.random.default_rng(0).integers(0, 16, (64, 64)), jnp.float32)
  o, u = call(k, (jax.ShapeDtypeStruct((64, 32), jnp.uint8), jax.ShapeDtypeStruct((64, 64), jnp.float32)), a)
  return bool(np.array_equal(np.asarray(u), np.asarray(a)))

@probe("f32_floor_clip_to_uint8")
def _():
  def k(a_ref, o_ref):
    o_ref[...] = jnp.clip(jnp.floor(a_ref[...] + 0.5), 0.0, 15.0).astype(jnp.uint8)
  a = jnp.linspace(-2, 20, 64 * 64).reshape(64, 64).astype(jnp.float32)
  o = call(k, jax.ShapeDtypeStruct((64, 64), jnp.uint8), a)
  return bool(np.array_equal(np.asarray(o), np.clip(np.floor(np.asarray(a) + 0.5), 0, 15).astype(np.uint8)))

@probe("reductions_axis0_axis1_keepdims")
def _():
  def k(a_ref, o_ref):
    a = a_ref[...]
    mn = jnp.min(a, axis=0)[None, :]
    mx = jnp.max(a, axis=1)[:, None]
    o_ref[...] = a - mn + mx
  a = jax.random.normal(jax.random.key(0), (64, 64))
  o = call(k, jax.ShapeDtypeStruct((64, 64), jnp.float32), a)
  an = np.asarray(a)
  return bool(np.allclose(o, an - an.min(0)[None] + an.max(1)[:, None], atol=1e-5))

@probe("dot_bf16_and_transposed")
def _():
  def k(a_ref, b_ref, o_ref, p_ref):
    a = a_ref[...]; b = b_ref[...]
    o_ref[...] = pl.dot(a, b)
    p_ref[...] = pl.dot(a, b, trans_b=True)
  a = jax.random.normal(jax.random.key(0), (64, 64)).astype(jnp.bfloat16)
  b = jax.random.normal(jax.random.key(1), (64, 64)).astype(jnp.bfloat16)
  o, p = call(k, (jax.ShapeDtypeStruct((64, 64), jnp.float32),) * 2, a, b)
  af, bf = np.asarray(a, np.float32), np.asarray(b, np.float32)
  return bool(np.allclose(o, af @ bf, atol=1e-2) and np.allclose(p, af @ bf.T, atol=1e-2))

@probe("fori_loop_dynamic_bound_from_ref")
def _():
  def k(n_ref, x_ref, o_ref):
    n = n_ref[0]
    def body(i, acc):
      return acc + x_ref[pl.ds(i * 16, 16)]
    o_ref[...] = jax.lax.fori_loop(0, n, body, jnp.zeros((16,), jnp.float32))
  x = jnp.arange(64, dtype=jnp.float32)
  o = call(k, jax.ShapeDtypeStruct((16,), jnp.float32), jnp.array([3], jnp.int32), x)
  return bool(np.allclose(o, np.asarray(x).reshape(4, 16)[:3].sum(0)))

@probe("row_vector_load_ds1")
def _():
  def k(s_ref, o_ref):
    i = pl.program_id(0)
    row = s_ref[pl.ds(i, 1), :]                        # (1, 64)
    o_ref[...] = jnp.broadcast_to(row, (64, 64)) * 1.0
  s = jax.random.normal(jax.random.key(0), (4, 64))
  o = call(k, jax.ShapeDtypeStruct((4, 64, 64), jnp.float32), s, grid=(4,),
           in_specs=[pl.BlockSpec((4, 64), lambda i: (0, 0))], out_specs=pl.BlockSpec((None, 64, 64), lambda i: (i, 0, 0)))
  return bool(np.allclose(np.asarray(o)[:, 0], s))

@probe("vector_1d_dynamic_load")
def _():
  def k(s_ref, o_ref):
    i = pl.program_id(0)
    v = s_ref[pl.ds(i * 64, 64)]
    o_ref[...] = v[None, :] * jnp.ones((64, 1), jnp.float32)
  s = jax.random.normal(jax.random.key(0), (256,))
  o = call(k, jax.ShapeDtypeStruct((4, 64, 64), jnp.float32), s, grid=(4,),
           in_specs=[pl.BlockSpec((256,), lambda i: (0,))], out_specs=pl.BlockSpec((None, 64, 64), lambda i: (i, 0, 0)))
  return bool(np.allclose(np.asarray(o)[:, 0], np.asarray(s).reshape(4, 64)))

@probe("input_output_alias")
def _():
  def k(x_ref, o_ref):
    o_ref[...] = x_ref[...] + 1
  x = jnp.zeros((64,), jnp.float32)
  o = call(k, jax.ShapeDtypeStruct((64,), jnp.float32), x, input_output_aliases={0: 0})
  return bool(np.allclose(o, 1))

@probe("exp2_where_inf")
def _():
  def k(a_ref, o_ref):
    a = a_ref[...]
    s = jnp.where(a > 0, a, -jnp.inf)
    m = jnp.maximum(jnp.max(s, axis=1), -1e30)
    o_ref[...] = jnp.exp2(s - m[:, None])
  a = jax.random.normal(jax.random.key(0), (64, 64))
  o = call(k, jax.ShapeDtypeStruct((64, 64), jnp.float32), a)
  return bool(np.isfinite(np.asarray(o)).all())

print(json.dumps(res, indent=1))
out = os.environ.get("OUT")
if out:
  json.dump({"jax": jax.__version__, "backend": jax.default_backend(), "results": res},
            open(os.path.join(out, "triton_constructs.json"), "w"), indent=1)
