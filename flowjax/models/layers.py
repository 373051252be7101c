"""Routable ops as Flax linen modules, written to be fast on XLA's CPU backend.

Two ops carry a hand-written VJP because autodiff's version is slow on CPU inside
``lax.scan`` (``launch/bench_layers.py`` times both; README, "Speed"):

* ``conv2d``: XLA CPU canonicalizes convolution layouts only at the top level, so the
  backward convolutions autodiff emits inside a loop body fall back to a naive loop
  (jax-ml/jax#12868). Here the backward convs are explicit NHWC/HWIO convolutions. All three
  convolutions also carry a ``custom_vmap`` rule, so ``vmap`` over per-client weights runs
  one convolution per client instead of a grouped convolution.
* ``lstm``: autodiff puts a small matmul against a transposed weight inside the time loop.
  Here the input projection is one matmul before the loop, the backward loop multiplies by
  ``W_h.T`` taken once outside it, and the weight gradients are one einsum after it.

``max_pool_2x2`` carries one too, for correctness: its gradient finds each window's
maxima by comparisons within the window, not against the output as ``jnp.max``'s does.

``chain_model`` turns a tuple of modules (one per routable layer) into a ``RoutableModel``.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Mapping, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax import lax
from jax.custom_batching import custom_vmap

from flowjax.models.base import Params, PyTree, RoutableModel

Pads = tuple[tuple[int, int], tuple[int, int]]

_NHWC = ("NHWC", "HWIO", "NHWC")

# Plain modules; nothing about their autodiff is slow on CPU.
Dense = nn.Dense
Embed = nn.Embed


class MixedDense(nn.Module):
    """``nn.Dense`` (same params, names and initializers) whose product runs in
    ``compute_dtype`` with float32 accumulation and output; params stay float32.

    Under ``vmap`` over per-client kernels the product is a ``dot_general`` with the
    clients as its leading batch dimension on both operands: a batched GEMM, as are its
    two backward products.
    """

    features: int
    compute_dtype: Any = jnp.bfloat16
    kernel_init: Callable[..., jax.Array] = nn.initializers.lecun_normal()
    bias_init: Callable[..., jax.Array] = nn.initializers.zeros_init()

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        kernel = self.param("kernel", self.kernel_init, (x.shape[-1], self.features),
                            jnp.float32)  # nn.Dense's param_dtype
        bias = self.param("bias", self.bias_init, (self.features,), jnp.float32)
        x_c, kernel_c = _compute_cast(self.compute_dtype, x, kernel)
        y = lax.dot_general(x_c, kernel_c, (((x.ndim - 1,), (0,)), ((), ())),
                            preferred_element_type=jnp.float32)
        return y + bias


def dense(features: int, compute_dtype: Any = None) -> nn.Module:
    """``nn.Dense(features)`` itself for float32 compute (so its numbers stay exactly as
    they were), else ``MixedDense``."""
    if compute_dtype is None:
        return Dense(features)
    return MixedDense(features, compute_dtype)


# ----------------------------------------------------------------------------- conv


@functools.lru_cache(maxsize=None)
def _canonical_conv(pads: Pads) -> Callable[[jax.Array, jax.Array], jax.Array]:
    """Stride-1 NHWC/HWIO convolution with ``pads`` whose vmap never groups.

    Batched data folds into the batch axis, batched weights alone fold into the output
    channels, and data and weights batched together run one convolution per batch entry.
    """

    @custom_vmap
    def conv(x: jax.Array, w: jax.Array) -> jax.Array:
        return lax.conv_general_dilated(x, w, (1, 1), pads, dimension_numbers=_NHWC)

    @conv.def_vmap
    def conv_vmap(axis_size: int, in_batched: Sequence[bool], x: jax.Array,
                  w: jax.Array) -> tuple[jax.Array, bool]:
        x_batched, w_batched = in_batched
        if not w_batched:
            y = conv(x.reshape((-1,) + x.shape[2:]), w)
            return y.reshape(x.shape[:2] + y.shape[1:]), True
        if not x_batched:
            # [B, kh, kw, i, o] -> [kh, kw, i, B * o]: one wider convolution.
            y = conv(x, jnp.moveaxis(w, 0, -2).reshape(w.shape[1:-1] + (-1,)))
            y = y.reshape(y.shape[:-1] + (axis_size, w.shape[-1]))
            return jnp.moveaxis(y, -2, 0), True
        return lax.map(lambda xw: conv(*xw), (x, w)), True

    return conv


def _pads(x_shape: Sequence[int], w_shape: Sequence[int], padding: str) -> Pads:
    lo_hi = lax.padtype_to_pads(tuple(x_shape[1:3]), tuple(w_shape[:2]), (1, 1), padding)
    return tuple(tuple(p) for p in lo_hi)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def conv2d(x: jax.Array, w: jax.Array, padding: str = "VALID") -> jax.Array:
    """Stride-1 2-D convolution, NHWC input and HWIO kernel, ``"VALID"`` or ``"SAME"``.

    Same values as ``lax.conv_general_dilated``; its VJP is two explicit canonical
    convolutions, fast inside ``lax.scan`` on CPU.
    """
    return _canonical_conv(_pads(x.shape, w.shape, padding))(x, w)


def _conv2d_fwd(x: jax.Array, w: jax.Array, padding: str):
    return conv2d(x, w, padding), (x, w)


def _conv2d_bwd(padding: str, residuals: tuple[jax.Array, jax.Array], g: jax.Array):
    x, w = residuals
    ph, pw = _pads(x.shape, w.shape, padding)
    kh, kw = w.shape[:2]
    # dx: full correlation of g with the flipped kernel, inputs and outputs swapped.
    dx_pads = ((kh - 1 - ph[0], kh - 1 - ph[1]), (kw - 1 - pw[0], kw - 1 - pw[1]))
    w_flipped = jnp.swapaxes(w[::-1, ::-1], 2, 3)
    dx = _canonical_conv(dx_pads)(g, w_flipped)
    # dw: a convolution of x with g where input channels play the batch and the examples
    # play the contracted channels: [i, H, W, n] * [h, w, n, o] -> [i, kh, kw, o].
    dw = _canonical_conv((ph, pw))(jnp.transpose(x, (3, 1, 2, 0)), jnp.transpose(g, (1, 2, 0, 3)))
    return dx, jnp.transpose(dw, (1, 2, 0, 3))


conv2d.defvjp(_conv2d_fwd, _conv2d_bwd)


CONV_IMPLS = ("auto", "xla", "im2col", "im2col_slices")


def resolve_conv_impl(impl: str, backend: str | None = None) -> str:
    """``"auto"`` -> the formulation measured fastest on ``backend`` (default: JAX's).

    CPU (and any backend not measured): ``"xla"``, the hand-written VJP's convolutions
    (im2col's patch building is memory-bound there; ``docs/benchmarks/roofline.md`` counts
    the patches' bytes). GPU: ``"im2col_slices"``. On one H100 (EMNIST CNN, 100 clients x 10
    steps vmapped, ``docs/benchmarks/gpu-h100-2026-11-26.md``, call 4) its batched GEMMs ran
    the FedAvg round in 0.059 s and Flow's in 0.114 s against 0.119 s and 0.177 s for
    cuDNN's grouped convolutions (``"xla"``) in the same call; ``"im2col"``, whose patches
    are built by convolutions, had lost to ``"xla"`` (0.207 and 0.433 s vs 0.154 and 0.190).
    """
    if impl not in CONV_IMPLS:
        raise ValueError(f"unknown conv_impl {impl!r}; expected one of {CONV_IMPLS}")
    if impl != "auto":
        return impl
    backend = jax.default_backend() if backend is None else backend
    return "im2col_slices" if backend == "gpu" else "xla"


def conv2d_im2col(x: jax.Array, w: jax.Array, padding: str = "VALID", stride: int = 1,
                  preferred_element_type: Any = None) -> jax.Array:
    """The convolution as patches times a matrix: NHWC ``x``, HWIO ``w``.

    ``[N, H', W', C*kh*kw] @ [C*kh*kw, O]``: one GEMM for one client, a batched GEMM under
    ``vmap`` over per-client kernels (the patches of batched data fold the clients into
    the batch axis, since their kernel is a constant). Autodiff's backward products are
    GEMMs too; the patches' transpose is a convolution with a constant kernel.
    """
    kh, kw, c, o = w.shape
    patches = lax.conv_general_dilated_patches(x, (kh, kw), (stride, stride), padding,
                                               dimension_numbers=_NHWC)
    # The patches' feature axis is channel-major: (c, kh, kw).
    matrix = jnp.transpose(w, (2, 0, 1, 3)).reshape(c * kh * kw, o)
    return jnp.einsum("nhwk,ko->nhwo", patches, matrix,
                      preferred_element_type=preferred_element_type)


def conv2d_im2col_slices(x: jax.Array, w: jax.Array, padding: str = "VALID", stride: int = 1,
                         preferred_element_type: Any = None) -> jax.Array:
    """``conv2d_im2col`` with the patches cut by strided slices instead of a convolution.

    The ``kh * kw`` shifted views of ``x`` are concatenated on the channel axis, in the
    kernel's own (kh, kw, c) order, so the kernel reshapes to the GEMM's matrix without a
    transpose. Building the patches is a copy, and its transpose in the backward pass a
    padded sum: no convolution is left for the library to run grouped under ``vmap``.
    """
    kh, kw, c, o = w.shape
    (lo_h, hi_h), (lo_w, hi_w) = lax.padtype_to_pads(x.shape[1:3], (kh, kw), (stride, stride),
                                                     padding)
    x = jnp.pad(x, ((0, 0), (lo_h, hi_h), (lo_w, hi_w), (0, 0)))
    out_h = (x.shape[1] - kh) // stride + 1
    out_w = (x.shape[2] - kw) // stride + 1
    views = [lax.slice(x, (0, i, j, 0),
                       (x.shape[0], i + stride * (out_h - 1) + 1, j + stride * (out_w - 1) + 1,
                        c), (1, stride, stride, 1))
             for i in range(kh) for j in range(kw)]
    patches = jnp.concatenate(views, axis=-1)
    return jnp.einsum("nhwk,ko->nhwo", patches, w.reshape(kh * kw * c, o),
                      preferred_element_type=preferred_element_type)


COMPUTE_DTYPES = {"float32": None, "bfloat16": jnp.bfloat16}


def compute_dtype_of(name: str) -> Any:
    """``config.compute_dtype`` -> the layers' ``compute_dtype`` (None: float32, no casts)."""
    if name not in COMPUTE_DTYPES:
        raise ValueError(f"unknown compute_dtype {name!r}; expected one of "
                         f"{tuple(COMPUTE_DTYPES)}")
    return COMPUTE_DTYPES[name]


def _compute_cast(dtype: Any, *arrays: jax.Array) -> tuple[jax.Array, ...]:
    """``arrays`` as operands of products in the compute dtype (``_operand``); unchanged
    (no op at all) when ``dtype`` is None."""
    if dtype is None:
        return arrays
    return tuple(_operand(dtype, a) for a in arrays)


def _rounds_in_float32() -> bool:
    """Whether products in a compute dtype multiply its values in float32 (CPU) instead
    of running in that dtype. The arithmetic is the same: a product of two bf16 values is
    exact in float32, and both forms accumulate in float32. On CPU a bf16 product gains
    nothing and XLA runs it slowly or not at all: bf16 convolutions ran a Fashion-MNIST
    mini FedAvg round many times slower than float32 (seen by hand), and its dot thunk lacks
    bf16 x bf16 -> f32 in the LSTM's time-major input projection (it fails at run time).
    On CPU the float32 products of a bf16-rounded conv also take ``conv2d``'s fast VJP."""
    return jax.default_backend() == "cpu"


def _operand(dtype: Any, a: jax.Array) -> jax.Array:
    """``a`` as an operand of a product in ``dtype``: cast to it, or on CPU rounded to it
    and kept float32 (``_rounds_in_float32``); unchanged when ``dtype`` is None."""
    if dtype is None:
        return a
    a = a.astype(dtype)
    return a.astype(jnp.float32) if _rounds_in_float32() else a


class Conv2D(nn.Module):
    """2-D convolution, optionally with bias; NHWC input, HWIO ``kernel``.

    Attributes:
      features: output channels.
      kernel_size: ``(height, width)``.
      padding: ``"VALID"`` or ``"SAME"``.
      custom_grad: use ``conv2d``'s hand-written VJP; ``False`` differentiates
        ``lax.conv_general_dilated`` directly (the reference, and maybe the better choice on
        accelerators).
      stride: the same window stride on both spatial axes. The hand-written VJP is
        stride-1 only, so ``stride > 1`` needs ``custom_grad=False``.
      use_bias: add a ``bias``; ``False`` where a normalization follows and adds its own.
      impl: ``"xla"`` (``lax.conv_general_dilated``, or ``conv2d`` with ``custom_grad``),
        ``"im2col"`` (``conv2d_im2col``, autodiff; ``custom_grad`` is ignored),
        ``"im2col_slices"`` (``conv2d_im2col_slices``, likewise) or
        ``"auto"`` (``resolve_conv_impl``).
      compute_dtype: ``None`` (compute in the params' float32) or e.g. ``jnp.bfloat16``:
        input and kernel are cast to it for the product, which accumulates and returns
        float32; params (and so gradients and optimizer state) stay float32.
    """

    features: int
    kernel_size: tuple[int, int] = (3, 3)
    padding: str = "VALID"
    custom_grad: bool = True
    stride: int = 1
    use_bias: bool = True
    kernel_init: Callable[..., jax.Array] = nn.initializers.lecun_normal()
    bias_init: Callable[..., jax.Array] = nn.initializers.zeros_init()
    impl: str = "xla"
    compute_dtype: Any = None

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        impl = resolve_conv_impl(self.impl)
        if impl == "xla" and self.custom_grad and self.stride != 1:
            raise ValueError(f"stride={self.stride} needs custom_grad=False; "
                             "the hand-written conv VJP is stride-1 only")
        # float32 as Flax's Dense and Embed fix theirs: jax_enable_x64 would otherwise
        # draw float64 here and float32 there, which a convolution refuses to mix.
        kernel = self.param("kernel", self.kernel_init,
                            (*self.kernel_size, x.shape[-1], self.features), jnp.float32)
        # float32 accumulation and output whenever the product runs in another dtype.
        accumulate = None if self.compute_dtype is None else jnp.float32
        x_c, kernel_c = _compute_cast(self.compute_dtype, x, kernel)
        if impl in ("im2col", "im2col_slices"):
            im2col = conv2d_im2col if impl == "im2col" else conv2d_im2col_slices
            y = im2col(x_c, kernel_c, self.padding, self.stride, accumulate)
        elif self.custom_grad and x_c.dtype in (jnp.float32, jnp.float64):  # bf16 on CPU: f32
            y = conv2d(x_c, kernel_c, self.padding)
        else:
            y = lax.conv_general_dilated(x_c, kernel_c, (self.stride, self.stride),
                                         self.padding, dimension_numbers=_NHWC,
                                         preferred_element_type=accumulate)
        if not self.use_bias:
            return y
        return y + self.param("bias", self.bias_init, (self.features,), jnp.float32)


@jax.custom_vjp
def _max_of_windows(windows: jax.Array) -> jax.Array:
    """``max`` over axes 2 and 4 of ``[n, h, 2, w, 2, c]`` windows; its gradient is
    ``jnp.max``'s, found without comparing the windows with the result (``max_pool_2x2``)."""
    return windows.max(axis=(2, 4))


def _max_of_windows_fwd(windows: jax.Array):
    return _max_of_windows(windows), windows


def _max_of_windows_bwd(windows: jax.Array, g: jax.Array):
    # Each entry is a maximum if no entry of its window exceeds it; the cotangent is split
    # evenly among a window's maxima, as jnp.max's transposed rule computes it. The
    # comparisons only involve the window's own entries, so a window always has a maximum.
    corners = [windows[:, :, i, :, j] for i in range(2) for j in range(2)]
    is_max = [jnp.all(jnp.stack([a >= b for b in corners]), axis=0) for a in corners]
    share = g / sum(m.astype(g.dtype) for m in is_max)
    grads = [share * m.astype(g.dtype) for m in is_max]
    rows = [jnp.stack(grads[2 * i: 2 * i + 2], axis=3) for i in range(2)]  # [n, h, w, 2, c]
    return (jnp.stack(rows, axis=2),)


_max_of_windows.defvjp(_max_of_windows_fwd, _max_of_windows_bwd)


def max_pool_2x2(h: jax.Array) -> jax.Array:
    """2x2 max pooling with stride 2 on NHWC, dropping an odd last row or column.

    Written as reshape + max because the gradient of ``reduce_window`` max is slow on CPU.
    Its gradient is ``jnp.max``'s (an even split among tied maxima) but computed from
    comparisons within each window: ``jnp.max``'s own rule compares the input with the
    output and divides by the number of matches, which needs XLA to recompute the input
    bit for bit alike wherever it recomputes it. XLA CPU did not, at
    ``--xla_backend_optimization_level=0`` (the CNN's routed gradient up to 40% off or
    infinite) and under the launchers' own flag (``launch/xla_env.CPU_FLAGS``: up to 54%
    off, so their CPU Flow runs on the CNN before this rule trained on it); both are checked
    in ``tests/test_layers.py``. Where XLA is consistent the two rules give the same bits.
    """
    n, height, width, c = h.shape
    h = h[:, : height // 2 * 2, : width // 2 * 2]
    return _max_of_windows(h.reshape(n, height // 2, 2, width // 2, 2, c))


def dropout(h: jax.Array, rate: float, train: bool, key: jax.Array) -> jax.Array:
    """Inverted dropout; the identity unless ``train``."""
    if not train or rate == 0.0:
        return h
    keep = jax.random.bernoulli(key, 1.0 - rate, h.shape)
    return jnp.where(keep, h / (1.0 - rate), jnp.zeros_like(h))


# ----------------------------------------------------------------------------- LSTM


def _split_gates(z: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    return tuple(jnp.split(z, 4, axis=-1))


def lstm_cell(z: jax.Array, c: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One LSTM step from pre-activations ``z [..., 4H]`` and the previous cell state:
    ``(h, c, activated gates)``."""
    i, f, g, o = _split_gates(z)
    i, f, g, o = jax.nn.sigmoid(i), jax.nn.sigmoid(f), jnp.tanh(g), jax.nn.sigmoid(o)
    c = f * c + i * g
    return o * jnp.tanh(c), c, jnp.concatenate([i, f, g, o], axis=-1)


def _product(spec: str, a: jax.Array, b: jax.Array, dtype: Any) -> jax.Array:
    """``einsum(spec, a, b)``; with a compute ``dtype``, on operands in it (``_operand``)
    with float32 accumulation and output. ``dtype`` None is the plain einsum, unchanged."""
    if dtype is None:
        return jnp.einsum(spec, a, b)
    return jnp.einsum(spec, _operand(dtype, a), _operand(dtype, b),
                      preferred_element_type=jnp.float32)


def _matmul(a: jax.Array, b: jax.Array, dtype: Any) -> jax.Array:
    """``a @ b`` where ``b`` is already an operand (``_operand``): only ``a`` is cast."""
    if dtype is None:
        return a @ b
    return jnp.matmul(_operand(dtype, a), b, preferred_element_type=jnp.float32)


def _lstm_scan(zx: jax.Array, w_h: jax.Array, compute_dtype: Any = None,
               cast_once: bool = True, unroll: int = 1) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Runs the recurrence on time-major input projections ``zx`` ``[T, B, 4H]``.

    Returns hidden states and cell states ``[T, B, H]`` and activated gates ``[T, B, 4H]``.
    With a ``compute_dtype`` and ``cast_once``, ``w_h`` is cast once before the loop, so
    every time step reads the narrow copy. Under autodiff (``cast_once=False``) it is cast
    in the loop instead: the transposed loop then sums ``w_h``'s gradient in float32, not
    in the copy's bf16. The cell stays float32. ``unroll``: time steps per loop iteration
    (``lax.scan``'s; ``lstm``).
    """
    hidden = w_h.shape[0]
    zeros = jnp.zeros(zx.shape[1:-1] + (hidden,), zx.dtype)
    w_h_once = _operand(compute_dtype, w_h) if cast_once else w_h

    def step(carry, zx_t):
        h, c = carry
        w_h_c = w_h_once if cast_once else _operand(compute_dtype, w_h)
        h, c, gates = lstm_cell(zx_t + _matmul(h, w_h_c, compute_dtype), c)
        return (h, c), (h, c, gates)

    _, (hs, cs, gates) = lax.scan(step, (zeros, zeros), zx, unroll=unroll)
    return hs, cs, gates


def _lstm_forward(x: jax.Array, w_x: jax.Array, w_h: jax.Array, b: jax.Array,
                  compute_dtype: Any = None, cast_once: bool = True, unroll: int = 1):
    zx = _product("btf,fg->tbg", x, w_x, compute_dtype) + b
    hs, cs, gates = _lstm_scan(zx, w_h, compute_dtype, cast_once, unroll)
    return jnp.swapaxes(hs, 0, 1), (hs, cs, gates)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def lstm(x: jax.Array, w_x: jax.Array, w_h: jax.Array, b: jax.Array,
         compute_dtype: Any = None, unroll: int = 1) -> jax.Array:
    """LSTM over a whole sequence from a zero state: ``[B, T, F] -> [B, T, H]``.

    Gates are ordered ``i, f, g, o`` along the ``4H`` axis of ``w_x [F, 4H]``,
    ``w_h [H, 4H]`` and ``b [4H]``. ``compute_dtype`` (e.g. ``jnp.bfloat16``) runs every
    product, forward and backward, on operands cast to it with float32 accumulation; the
    cell's elementwise math, the saved states and the gradients stay float32. ``unroll``:
    time steps per iteration of the forward and the backward loop (1: a loop iteration
    per step; ``T``: no loop). Values equal to float32 rounding (XLA may fuse an unrolled
    body differently; on the CPU the forward is bit for bit the same, tested).
    """
    return _lstm_forward(x, w_x, w_h, b, compute_dtype, unroll=unroll)[0]


def _lstm_fwd(x: jax.Array, w_x: jax.Array, w_h: jax.Array, b: jax.Array,
              compute_dtype: Any = None, unroll: int = 1):
    out, (hs, cs, gates) = _lstm_forward(x, w_x, w_h, b, compute_dtype, unroll=unroll)
    return out, (x, w_x, w_h, hs, cs, gates)


def _cell_backward(dh: jax.Array, dc: jax.Array, gates: jax.Array, c: jax.Array,
                   c_prev: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``lstm_cell``'s backward from the gradients of its new ``h`` and ``c``: the
    pre-activations' gradient ``dz [..., 4H]`` and the previous cell state's."""
    i, f, g, o = _split_gates(gates)
    tanh_c = jnp.tanh(c)
    dc = dc + dh * o * (1.0 - tanh_c ** 2)
    dz = jnp.concatenate([dc * g * i * (1.0 - i), dc * c_prev * f * (1.0 - f),
                          dc * i * (1.0 - g ** 2), dh * tanh_c * o * (1.0 - o)], axis=-1)
    return dz, dc * f


def _previous(states: jax.Array) -> jax.Array:
    """Time-major ``states [T, ...]`` one step later: each step's previous state, zero at
    the start."""
    return jnp.concatenate([jnp.zeros_like(states[:1]), states[:-1]])


def _after_reverse_loop(x: jax.Array, h_prev: jax.Array, dz: jax.Array, w_x: jax.Array,
                        compute_dtype: Any) -> tuple[jax.Array, tuple[jax.Array, ...]]:
    """From every step's pre-activation gradients ``dz [T, B, 4H]``: the input's gradient
    and ``(w_x, w_h, b)``'s, each one product over all steps (not summed in the loop)."""
    dx = _product("tbg,fg->btf", dz, w_x, compute_dtype)
    return dx, (_product("btf,tbg->fg", x, dz, compute_dtype),
                _product("tbh,tbg->hg", h_prev, dz, compute_dtype), dz.sum(axis=(0, 1)))


def _lstm_bwd(compute_dtype: Any, unroll: int, residuals, d_out: jax.Array):
    x, w_x, w_h, hs, cs, gates = residuals
    c_prev, h_prev = _previous(cs), _previous(hs)
    # Once, so the loop body multiplies by a canonical-layout matrix (in the compute dtype).
    w_h_t = _operand(compute_dtype, w_h.T)

    def step(carry, inputs):
        dh_next, dc_next = carry
        dh_t, gates_t, c_t, c_prev_t = inputs
        dz, dc_prev = _cell_backward(dh_t + dh_next, dc_next, gates_t, c_t, c_prev_t)
        return (_matmul(dz, w_h_t, compute_dtype), dc_prev), dz

    zeros = jnp.zeros_like(hs[0])
    _, dz = lax.scan(step, (zeros, zeros), (jnp.swapaxes(d_out, 0, 1), gates, cs, c_prev),
                     reverse=True, unroll=unroll)
    dx, weight_grads = _after_reverse_loop(x, h_prev, dz, w_x, compute_dtype)
    return (dx, *weight_grads)


lstm.defvjp(_lstm_fwd, _lstm_bwd)


def _lstm_bias_init(key: jax.Array, shape: Sequence[int], dtype: Any = jnp.float32) -> jax.Array:
    """Zeros with the forget-gate quarter at 1 (Keras' ``unit_forget_bias``)."""
    del key
    hidden = shape[0] // 4
    return jnp.zeros(shape, dtype).at[hidden: 2 * hidden].set(1.0)


class LSTM(nn.Module):
    """One LSTM layer over a whole sequence, ``[B, T, F] -> [B, T, H]``, zero initial state.

    Keras initialisation: glorot-uniform ``kernel``, orthogonal ``recurrent_kernel``, zero
    ``bias`` except 1 for the forget gate.

    Attributes:
      features: hidden size ``H``.
      custom_grad: use ``lstm``'s hand-written VJP (and ``routed_lstm``'s where Flow routes
        this layer's recurrence, ``chain_model``'s ``routed_recurrence``); ``False``
        differentiates the same forward scans with autodiff.
      compute_dtype: ``None`` (float32) or e.g. ``jnp.bfloat16``: the input projection
        and the recurrent product (and their backward products) run on operands cast to
        it with float32 accumulation; params and the cell state stay float32.
      unroll: time steps per loop iteration, forward and backward (``lstm``).
    """

    features: int
    custom_grad: bool = True
    compute_dtype: Any = None
    unroll: int = 1

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        gates = 4 * self.features
        w_x = self.param("kernel", nn.initializers.glorot_uniform(), (x.shape[-1], gates),
                         jnp.float32)  # as Conv2D's, whatever jax_enable_x64 says
        w_h = self.param("recurrent_kernel", nn.initializers.orthogonal(),
                         (self.features, gates), jnp.float32)
        b = self.param("bias", _lstm_bias_init, (gates,), jnp.float32)
        if self.custom_grad:
            return lstm(x, w_x, w_h, b, self.compute_dtype, self.unroll)
        return _lstm_forward(x, w_x, w_h, b, self.compute_dtype, cast_once=False,
                             unroll=self.unroll)[0]


def lstm_weights(layer_params: PyTree) -> tuple[jax.Array, jax.Array, jax.Array] | None:
    """``(w_x, w_h, b)`` of an ``LSTM`` layer's params; None for any other layer."""
    if isinstance(layer_params, Mapping) and set(layer_params) == {"kernel", "recurrent_kernel",
                                                                     "bias"}:
        return layer_params["kernel"], layer_params["recurrent_kernel"], layer_params["bias"]
    return None


def is_embedding(layer_params: PyTree) -> bool:
    """Whether a layer's params are an ``Embed``'s (its table alone)."""
    return isinstance(layer_params, Mapping) and set(layer_params) == {"embedding"}


def torch_lstm_bias(layer_params: PyTree) -> PyTree:
    """An LSTM layer's params whose bias learns as PyTorch's (``nn.LSTM``, ``LSTMCell``).

    PyTorch's cell has two biases, ``b_ih`` and ``b_hh``, and both receive the gradient of
    their sum, so under SGD (with or without momentum, which is linear) the sum moves twice
    as far per step as one bias would. ``2 b - stop_gradient(b)`` has the value ``b``
    exactly (``2 b`` is exact and so is the subtraction) and twice its gradient.
    """
    b = layer_params["bias"]
    return {**layer_params, "bias": 2.0 * b - lax.stop_gradient(b)}


# The token models' padding id (``shakespeare_lstm.PAD_ID``, ``stackoverflow_lstm.PAD_ID``).
TORCH_PADDING_IDX = 0


def torch_padding_lookups(looked_up: jax.Array, ids: jax.Array) -> jax.Array:
    """Embedding lookups ``looked_up`` of ``ids`` as ``nn.Embedding(padding_idx=0)``'s:
    the padding row's lookups pass their value but no gradient."""
    return jnp.where((ids == TORCH_PADDING_IDX)[..., None], lax.stop_gradient(looked_up),
                     looked_up)


def with_torch_layers(model: RoutableModel) -> RoutableModel:
    """``model`` whose layers learn as the Flow authors' PyTorch ones: each LSTM layer's
    bias as PyTorch's two (``torch_lstm_bias``), and an embedding's lookups of id 0 as
    ``nn.Embedding(padding_idx=0)``'s, their value passed but no gradient to that row.
    The same outputs bit for bit; only those gradients differ; other layers as they are.
    An LSTM routed on the mixed state (``routed_recurrence``) takes both copies' biases so
    too: it never passes through ``layer_apply``."""
    apply, routed = model.layer_apply, model.routed_recurrence

    def layer_apply(j: int, layer_params: PyTree, h: jax.Array) -> jax.Array:
        if lstm_weights(layer_params) is not None:
            return apply(j, torch_lstm_bias(layer_params), h)
        out = apply(j, layer_params, h)
        if is_embedding(layer_params):
            out = torch_padding_lookups(out, h)
        return out

    def routed_recurrence(j: int, global_layer: PyTree, local_layer: PyTree, h: jax.Array,
                          q0: jax.Array, hard: bool) -> jax.Array:
        return routed(j, torch_lstm_bias(global_layer), torch_lstm_bias(local_layer), h, q0,
                      hard)

    return dataclasses.replace(model, layer_apply=layer_apply,
                               routed_recurrence=None if routed is None else routed_recurrence)


def _mix_states(hard: bool, q0_t: jax.Array, state_g: tuple[jax.Array, jax.Array],
                state_l: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
    """The routed ``(h, c)`` of one time step from both cells' (Eq. 3; ``hard``: the
    chosen cell's state exactly)."""
    if hard:
        use_global = (q0_t >= 0.5)[:, None]
        return tuple(jnp.where(use_global, g, l) for g, l in zip(state_g, state_l))
    q = q0_t[:, None].astype(state_g[0].dtype)
    return tuple(q * g + (1.0 - q) * l for g, l in zip(state_g, state_l))


def _routed_lstm_forward(x: jax.Array, global_weights: tuple[jax.Array, jax.Array, jax.Array],
                         local_weights: tuple[jax.Array, jax.Array, jax.Array], q0: jax.Array,
                         hard: bool, compute_dtype: Any, cast_once: bool, unroll: int):
    """``routed_lstm``'s forward: the output ``[B, T, H]`` and, time-major, the routed
    states ``(hs, cs)`` and each branch's ``(hs, cs, gates)`` (for the VJP; dropped by
    jit when unused). ``cast_once`` as in ``_lstm_scan``."""
    (w_x_g, w_h_g, b_g), (w_x_l, w_h_l, b_l) = global_weights, local_weights
    zx_g = _product("btf,fg->tbg", x, w_x_g, compute_dtype) + b_g
    zx_l = _product("btf,fg->tbg", x, w_x_l, compute_dtype) + b_l
    zeros = jnp.zeros(zx_g.shape[1:-1] + (w_h_g.shape[0],), zx_g.dtype)
    once = tuple(_operand(compute_dtype, w) if cast_once else w for w in (w_h_g, w_h_l))

    def step(carry, inputs):
        h, c = carry
        zx_g_t, zx_l_t, q0_t = inputs
        w_g, w_l = once if cast_once else (_operand(compute_dtype, w) for w in once)
        branch_g = lstm_cell(zx_g_t + _matmul(h, w_g, compute_dtype), c)
        branch_l = lstm_cell(zx_l_t + _matmul(h, w_l, compute_dtype), c)
        h, c = _mix_states(hard, q0_t, branch_g[:2], branch_l[:2])
        return (h, c), (h, c, branch_g, branch_l)

    _, (hs, cs, branch_g, branch_l) = lax.scan(
        step, (zeros, zeros), (zx_g, zx_l, jnp.swapaxes(q0, 0, 1)), unroll=unroll)
    return jnp.swapaxes(hs, 0, 1), (hs, cs, branch_g, branch_l)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _routed_lstm(x: jax.Array, global_weights: tuple[jax.Array, jax.Array, jax.Array],
                 local_weights: tuple[jax.Array, jax.Array, jax.Array], q0: jax.Array,
                 hard: bool, compute_dtype: Any, unroll: int) -> jax.Array:
    return _routed_lstm_forward(x, global_weights, local_weights, q0, hard, compute_dtype,
                                True, unroll)[0]


def _routed_lstm_fwd(x, global_weights, local_weights, q0, hard, compute_dtype, unroll):
    out, (hs, cs, branch_g, branch_l) = _routed_lstm_forward(
        x, global_weights, local_weights, q0, hard, compute_dtype, True, unroll)
    if hard:  # q0's gradient is zero: the branches' h are not needed for it
        branch_g, branch_l = (None,) + branch_g[1:], (None,) + branch_l[1:]
    return out, (x, global_weights, local_weights, q0, hs, cs, branch_g, branch_l)


def _routed_lstm_bwd(hard: bool, compute_dtype: Any, unroll: int, residuals, d_out: jax.Array):
    x, (w_x_g, w_h_g, _), (w_x_l, w_h_l, _), q0, hs, cs, branch_g, branch_l = residuals
    c_prev, h_prev = _previous(cs), _previous(hs)
    # Once, so the loop body multiplies by canonical-layout matrices (in the compute dtype).
    w_h_g_t, w_h_l_t = _operand(compute_dtype, w_h_g.T), _operand(compute_dtype, w_h_l.T)

    def step(carry, inputs):
        # The gradients of the routed (h, c) of step t, which both cells of t + 1 read.
        dh_next, dc_next = carry
        dh_t, q0_t, c_prev_t, (h_g, c_g, gates_g), (h_l, c_l, gates_l) = inputs
        dh, dc = dh_t + dh_next, dc_next
        if hard:  # each gradient goes whole to the chosen cell
            zero, use_global = jnp.zeros_like(dh), (q0_t >= 0.5)[:, None]
            (dh_g, dh_l), (dc_g, dc_l) = ((jnp.where(use_global, d, zero),
                                           jnp.where(use_global, zero, d)) for d in (dh, dc))
            dq0 = jnp.zeros_like(q0_t)
        else:
            q = q0_t[:, None].astype(dh.dtype)
            dh_g, dc_g, dh_l, dc_l = q * dh, q * dc, (1.0 - q) * dh, (1.0 - q) * dc
            dq0 = jnp.sum(dh * (h_g - h_l) + dc * (c_g - c_l), axis=-1).astype(q0_t.dtype)
        dz_g, dc_prev_g = _cell_backward(dh_g, dc_g, gates_g, c_g, c_prev_t)
        dz_l, dc_prev_l = _cell_backward(dh_l, dc_l, gates_l, c_l, c_prev_t)
        dh_prev = (_matmul(dz_g, w_h_g_t, compute_dtype)
                   + _matmul(dz_l, w_h_l_t, compute_dtype))
        return (dh_prev, dc_prev_g + dc_prev_l), (dz_g, dz_l, dq0)

    zeros = jnp.zeros_like(hs[0])
    _, (dz_g, dz_l, dq0) = lax.scan(
        step, (zeros, zeros),
        (jnp.swapaxes(d_out, 0, 1), jnp.swapaxes(q0, 0, 1), c_prev, branch_g, branch_l),
        reverse=True, unroll=unroll)
    dx_g, grads_g = _after_reverse_loop(x, h_prev, dz_g, w_x_g, compute_dtype)
    dx_l, grads_l = _after_reverse_loop(x, h_prev, dz_l, w_x_l, compute_dtype)
    return dx_g + dx_l, grads_g, grads_l, jnp.swapaxes(dq0, 0, 1)


_routed_lstm.defvjp(_routed_lstm_fwd, _routed_lstm_bwd)


def routed_lstm(x: jax.Array, global_weights: tuple[jax.Array, jax.Array, jax.Array],
                local_weights: tuple[jax.Array, jax.Array, jax.Array], q0: jax.Array, *,
                hard: bool = False, compute_dtype: Any = None, unroll: int = 1,
                custom_grad: bool = True) -> jax.Array:
    """A routed LSTM layer whose recurrence runs on the routed state: ``[B, T, F] ->
    [B, T, H]``.

    At every step ``t`` both cells step from the same routed state ``(h, c)_{t-1}`` and
    the routed state becomes ``q0[:, t] * cell_g + (1 - q0[:, t]) * cell_l`` for ``h`` and
    ``c`` alike (``hard``: the chosen cell's state exactly), which is the paper's Eq. 3
    applied to the cell at each time step. One ``lax.scan``; the input projections of both
    branches are one matmul each before it, as in ``lstm``. With ``q0`` all 1 (all 0) the
    output equals the global (local) ``LSTM`` to float32 rounding, not bit for bit: XLA
    fuses this loop body differently from ``lstm``'s and its vectorized ``tanh`` rounds
    differently across fusions (measured: at most 1.8e-7 on a 256-unit layer over 80 steps).

    ``custom_grad`` (the LSTM layer's): a hand-written VJP like ``lstm``'s, whose reverse
    loop carries the routed state's gradient through both cells and whose weight
    gradients are one product each after it; ``False`` differentiates the same forward
    by autodiff, whose transposed loop adds both branches' ``w_h`` gradients at every
    step. The same values either way, gradients equal to float32 rounding.

    ``compute_dtype`` and ``unroll`` are ``lstm``'s: the products on operands cast to the
    dtype with float32 accumulation, and time steps per loop iteration. With the VJP the
    recurrent weights are cast once per sequence, as in ``lstm``; under autodiff inside
    the loop, so that autodiff sums their gradient in float32 (as ``LSTM`` without
    ``custom_grad``). Their defaults give the float32 loop above, unchanged.
    """
    if custom_grad:
        return _routed_lstm(x, tuple(global_weights), tuple(local_weights), q0, hard,
                            compute_dtype, unroll)
    return _routed_lstm_forward(x, global_weights, local_weights, q0, hard, compute_dtype,
                                False, unroll)[0]


# ----------------------------------------------------------------------------- models


def chain_model(*, name: str, layer_names: Sequence[str], modules: Sequence[nn.Module],
                embed_input: Callable[[jax.Array], jax.Array],
                glue_apply: Callable[[int, jax.Array, bool, jax.Array], jax.Array],
                example_input: jax.Array | jax.ShapeDtypeStruct, **fields: Any) -> RoutableModel:
    """A ``RoutableModel`` whose routable layer ``j`` is ``modules[j]``.

    Args:
      name: registry name.
      layer_names: one name per module; keys of the params dict.
      modules: the routable layers' linen modules, in forward order.
      embed_input: parameter-free input preprocessing.
      glue_apply: ``glue_apply(j, h, train, key)``, parameter-free.
      example_input: an input ``x`` with a batch axis, or its ``ShapeDtypeStruct``; it fixes
        the shapes ``init`` creates params for.
      **fields: the remaining ``RoutableModel`` fields (``label_weights``, ...).
    """
    if len(layer_names) != len(modules):
        raise ValueError(f"{len(layer_names)} layer names for {len(modules)} modules")
    modules = tuple(modules)

    def layer_apply(j: int, layer_params: PyTree, h: jax.Array) -> jax.Array:
        return modules[j].apply({"params": layer_params}, h)

    def init(key: jax.Array) -> Params:
        params = {}
        h = jax.eval_shape(embed_input, example_input)
        keys = jax.random.split(key, len(modules))
        for j, (layer, module) in enumerate(zip(layer_names, modules)):
            # lazy_init creates the params from shapes alone, without running the layer.
            params[layer] = module.lazy_init(keys[j], h)["params"]
            h = jax.eval_shape(
                lambda p, h, j=j: glue_apply(j, layer_apply(j, p, h), False, jax.random.key(0)),
                params[layer], h)
        return params

    recurrent_layers = tuple(layer for layer, module in zip(layer_names, modules)
                             if isinstance(module, LSTM))

    def routed_recurrence(j: int, global_layer: PyTree, local_layer: PyTree, h: jax.Array,
                          q0: jax.Array, hard: bool) -> jax.Array:
        module = modules[j]
        if layer_names[j] not in recurrent_layers:
            raise ValueError(f"layer {layer_names[j]!r} is a {type(module).__name__}: only an "
                             "LSTM layer routes a recurrence")
        return routed_lstm(h, lstm_weights(global_layer), lstm_weights(local_layer), q0,
                           hard=hard, compute_dtype=module.compute_dtype, unroll=module.unroll,
                           custom_grad=module.custom_grad)

    return RoutableModel(name=name, layer_names=tuple(layer_names), init=init,
                         embed_input=embed_input, layer_apply=layer_apply,
                         glue_apply=glue_apply, routed_recurrence=routed_recurrence,
                         recurrent_layers=recurrent_layers, **fields)
