"""Fused elementwise work of a decoder layer: residual add with RMSNorm, and the MLP's activation-times-up.

`residual_norm(x, deltas, weight)` returns (x + sum(deltas) in x's dtype, RMSNorm of that) in one pass over the
row, where the unfused code runs some ten kernels. Arithmetic follows `model.rms_norm` and the decoder layer's
residual adds step by step (fp32 sums, rounding to the compute dtype where they round), so only the order of the
mean's reduction differs.
"""

from __future__ import annotations

import torch

from . import HAS_TRITON, Launch

if HAS_TRITON:
    import triton
    import triton.language as tl

    from .common import activate, next_pow2

ACT_CODES = {"silu": 0, "relu": 1, "gelu_pytorch_tanh": 2}


# ---- references -----------------------------------------------------------------------------------------------------


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm computed in fp32, returned in x's dtype and scaled by the weight (as the reference implementations)."""
    xf = x.float()
    return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def residual_norm_reference(x: torch.Tensor, deltas: list[torch.Tensor], weight: torch.Tensor | None,
                            eps: float) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(x + the deltas' sum rounded to x's dtype, its RMSNorm by `weight`, or None without one)."""
    if deltas:
        total = deltas[0].float() if len(deltas) > 1 else deltas[0]
        for d in deltas[1:]:
            total = total + d.float()
        x = x + total.to(x.dtype)
    return x, (rms_norm_reference(x, weight, eps) if weight is not None else None)


def act_mul_reference(gate: torch.Tensor, up: torch.Tensor, act) -> torch.Tensor:
    return act(gate) * up


# ---- kernels --------------------------------------------------------------------------------------------------------

if HAS_TRITON:

    @triton.jit
    def _residual_norm_kernel(x_ptr, d1_ptr, d2_ptr, w_ptr, x_out_ptr, out_ptr, eps, H: tl.constexpr,
                              N_DELTAS: tl.constexpr, NORM: tl.constexpr, HP: tl.constexpr):
        r = tl.program_id(0)
        cols = tl.arange(0, HP)
        on = cols < H
        x = tl.load(x_ptr + r * H + cols, mask=on, other=0.0)
        dtype = x.dtype
        if N_DELTAS > 0:
            total = tl.load(d1_ptr + r * H + cols, mask=on, other=0.0).to(tl.float32)
            if N_DELTAS > 1:
                total += tl.load(d2_ptr + r * H + cols, mask=on, other=0.0).to(tl.float32)
            x = (x.to(tl.float32) + total.to(dtype).to(tl.float32)).to(dtype)
            tl.store(x_out_ptr + r * H + cols, x, mask=on)
        if NORM:
            xf = x.to(tl.float32)
            inv = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / H + eps)
            w = tl.load(w_ptr + cols, mask=on, other=0.0).to(tl.float32)
            normed = (xf * inv).to(dtype).to(tl.float32)
            tl.store(out_ptr + r * H + cols, (w * normed).to(dtype), mask=on)

    @triton.jit
    def _act_mul_kernel(gate_ptr, up_ptr, out_ptr, n, gate_stride, up_stride, ACT: tl.constexpr,
                        BLOCK: tl.constexpr):
        r = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        on = cols < n
        gate = tl.load(gate_ptr + r * gate_stride + cols, mask=on, other=0.0)
        up = tl.load(up_ptr + r * up_stride + cols, mask=on, other=0.0)
        # the reference rounds act(gate) to the compute dtype before the product
        a = activate(gate.to(tl.float32), ACT).to(gate.dtype).to(tl.float32)
        tl.store(out_ptr + r * n + cols, (a * up.to(tl.float32)).to(gate.dtype), mask=on)


def residual_norm(x: torch.Tensor, deltas: list[torch.Tensor], weight: torch.Tensor | None, eps: float,
                  use_kernel: bool, x_out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(x + sum(deltas) rounded to x's dtype, RMSNorm of it by `weight` (None: no norm)) over rows [..., H]."""
    if not use_kernel:
        return residual_norm_reference(x, deltas, weight, eps)
    assert len(deltas) <= 2
    h = x.shape[-1]
    rows = x.numel() // h
    flat = [d.reshape(rows, h) for d in deltas]
    assert x.is_contiguous() and all(d.is_contiguous() for d in flat)
    new_x = (torch.empty_like(x) if x_out is None else x_out) if deltas else x
    out = torch.empty_like(x) if weight is not None else None
    residual_norm_launch(x, flat, weight, eps, new_x, out)()
    return new_x, out


def residual_norm_launch(x: torch.Tensor, deltas: list[torch.Tensor], weight: torch.Tensor | None, eps: float,
                         new_x: torch.Tensor, out: torch.Tensor | None) -> Launch:
    h = x.shape[-1]
    return Launch(_residual_norm_kernel, (x.numel() // h,), num_warps=4 if h <= 4096 else 8, num_stages=1, x_ptr=x,
                  d1_ptr=deltas[0] if deltas else x, d2_ptr=deltas[1] if len(deltas) > 1 else x,
                  w_ptr=weight if weight is not None else x, x_out_ptr=new_x, out_ptr=out if out is not None else x,
                  eps=eps, H=h, N_DELTAS=len(deltas), NORM=weight is not None, HP=next_pow2(h))


def act_mul(gate: torch.Tensor, up: torch.Tensor, act_name: str, act, use_kernel: bool) -> torch.Tensor:
    """act(gate) * up, elementwise, in the compute dtype (the MLP's middle). gate and up are [rows, I] with unit
    column stride (they may be the halves of one fused projection's output)."""
    if not use_kernel or act_name not in ACT_CODES:
        return act_mul_reference(gate, up, act)
    lead = gate.shape[:-1]
    gate, up = gate.reshape(-1, gate.shape[-1]), up.reshape(-1, up.shape[-1])
    assert gate.stride(1) == 1 and up.stride(1) == 1 and gate.shape == up.shape
    out = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    act_mul_launch(gate, up, ACT_CODES[act_name], out)()
    return out.view(*lead, gate.shape[-1])


def act_mul_launch(gate: torch.Tensor, up: torch.Tensor, act_code: int, out: torch.Tensor) -> Launch:
    block = 1024
    rows, n = gate.shape
    return Launch(_act_mul_kernel, (rows, triton.cdiv(n, block)), num_warps=4, num_stages=1, gate_ptr=gate, up_ptr=up,
                  out_ptr=out, n=n, gate_stride=gate.stride(0), up_stride=up.stride(0), ACT=act_code, BLOCK=block)
