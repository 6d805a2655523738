# SPDX-License-Identifier: Apache-2.0
"""One draw per row from ``softmax(logits / T_row)`` by the Gumbel-max trick, fused.

The sampler's plain case (no top-k, top-p or min-p in the batch, no seed) is
``torch.multinomial`` over the softmax: it synchronises the GPU with the host on every
call (ATen checks the probabilities before drawing) and passes over ``[rows, V]``
several times. ``argmax_v (logits[v] / T + g_v)`` with ``g_v = -log(-log(u_v))``, ``u_v``
uniform, is an exact sample from the same distribution; the kernel reads each row once
(vocabulary chunks, a running max and argmax), draws its uniforms with Philox keyed by a
seed taken from torch's CPU generator (no device RNG state, no sync), or read from a device
tensor where a CUDA graph holds the draw (drawn there by the device's generator, fresh on
every replay), and never materialises probabilities. The logits are read, not modified.

The temperatures are the requests' own (``nodes`` rows per request, row = request * nodes +
node): the kernel reads request ``row // nodes``, so a step copies no parameter per node.

``-inf`` logits (penalties, bias, grammar) stay ``-inf`` after the noise, so they are
never drawn unless the whole row is ``-inf`` (then token 0). A per-row ``floor`` (a logit
value, ``sampling_filters.logit_floors``) excludes every logit below it the same way: the
draw is then from the top-k/top-p/min-p filtered distribution, renormalised. Seeded
requests do not come here: they keep the sampler's seeded path, so a seeded request emits
the same tokens with and without speculation.

One Triton launch over ``[rows, V]`` (a program per ``ROWS`` rows: one row for a real
vocabulary, several for small ones); the torch reference beside it is the same math on
``torch.rand``.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

#: Uniforms are clamped to the smallest positive normal float32 so ``log(u)`` stays finite.
_TINY = 1.1754943508222875e-38
_TINY_C: tl.constexpr = tl.constexpr(_TINY)


def gumbel_draw(
    logits: torch.Tensor,
    temperatures: torch.Tensor,
    floors: Optional[torch.Tensor] = None,
    *,
    nodes: int = 1,
    use_triton: Optional[bool] = None,
    seed: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """``[rows]`` int64 draws from ``softmax(logits / temperatures)``, restricted to the
    logits ``>= floors`` where given.

    ``logits`` ``[rows, V]`` float32, ``floors`` ``[rows]`` float32 (``-inf``: no
    restriction); ``temperatures`` ``[rows / nodes, 1]`` float32, all > 0, one per request of
    ``nodes`` consecutive rows (1: one per row). The seed comes from torch's default CPU
    generator, so ``torch.manual_seed`` makes the draws repeatable (whatever ``nodes``: the
    uniforms are keyed by row and column). ``seed``, an int64 ``[1]`` tensor on the logits'
    device, keys them instead, read when the kernel runs: a CUDA graph that draws it on the
    device before the draw gets fresh uniforms on every replay.
    """
    if logits.dim() != 2:
        raise ValueError(f"logits must be [rows, V], got {tuple(logits.shape)}")
    rows = logits.shape[0]
    if nodes < 1 or rows % nodes:
        raise ValueError(f"nodes must be >= 1 and divide rows={rows}, got {nodes}")
    if temperatures.shape != (rows // nodes, 1):
        raise ValueError(f"temperatures must be [requests={rows // nodes}, 1], got {tuple(temperatures.shape)}")
    if floors is not None and floors.shape != (rows,):
        raise ValueError(f"floors must be [rows={rows}], got {tuple(floors.shape)}")
    if seed is not None and (seed.shape != (1,) or seed.dtype != torch.int64 or seed.device != logits.device):
        raise ValueError(f"seed must be int64 [1] on {logits.device}, got {seed.dtype} {tuple(seed.shape)} on {seed.device}")
    if use_triton is None:
        use_triton = logits.is_cuda or _interpreted()
    if use_triton:
        return _draw_triton(logits, temperatures, floors, nodes, seed)
    generator = None
    if seed is not None:
        generator = torch.Generator(device=logits.device).manual_seed(int(seed))
    return gumbel_draw_reference(logits, temperatures, floors, generator, nodes=nodes)


def gumbel_draw_reference(
    logits: torch.Tensor,
    temperatures: torch.Tensor,
    floors: Optional[torch.Tensor] = None,
    generator: Optional[torch.Generator] = None,
    *,
    nodes: int = 1,
) -> torch.Tensor:
    """The same draw in plain torch: Gumbel noise from ``torch.rand``, then the argmax."""
    u = torch.rand(logits.shape, dtype=torch.float32, device=logits.device, generator=generator)
    g = -torch.log(-torch.log(u.clamp_(min=_TINY)))
    x = logits if floors is None else logits.masked_fill(logits < floors.view(-1, 1), float("-inf"))
    return torch.argmax(x / request_rows(temperatures, logits.shape[0], nodes) + g, dim=-1)


def request_rows(t: Optional[torch.Tensor], rows: int, nodes: int = 1, first_row: int = 0) -> Optional[torch.Tensor]:
    """Per-row values of per-request ``t`` for ``rows`` rows from global row ``first_row``
    (row ``r`` is request ``r // nodes``'s): the torch paths' gather (the kernels index in place)."""
    if t is None:
        return None
    if nodes == 1:
        return t[first_row : first_row + rows]
    req = torch.arange(first_row, first_row + rows, device=t.device) // nodes
    return t.index_select(0, req)


def _interpreted() -> bool:
    return type(_gumbel_draw_kernel).__name__ == "InterpretedFunction"


#: Elements one program holds per loop step: a chunk of one row, or several short rows.
_BLOCK_V = 2048


def _draw_triton(
    logits: torch.Tensor,
    temperatures: torch.Tensor,
    floors: Optional[torch.Tensor] = None,
    nodes: int = 1,
    seed_tensor: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    rows, v = logits.shape
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    out = torch.empty((rows,), dtype=torch.int64, device=logits.device)
    if rows == 0:
        return out
    block = min(_BLOCK_V, triton.next_power_of_2(v))
    per_program = min(_BLOCK_V // block, triton.next_power_of_2(rows))
    seed = 0 if seed_tensor is not None else int(torch.randint(0, 2**31 - 1, (1,)))
    _gumbel_draw_kernel[(triton.cdiv(rows, per_program),)](
        logits,
        logits.stride(0),
        temperatures,
        temperatures.stride(0),
        logits if floors is None else floors,  # not read without a floor
        out,
        seed,
        out if seed_tensor is None else seed_tensor,  # not read without a seed tensor
        rows,
        v,
        nodes,
        ROWS=per_program,
        BLOCK=block,
        HAS_FLOOR=floors is not None,
        SEED_FROM_PTR=seed_tensor is not None,
    )
    return out


@triton.jit(do_not_specialize=["seed", "nodes"])
def _gumbel_draw_kernel(
    logits_ptr,
    stride_logits,
    temp_ptr,  # per request: row r reads request r // nodes
    stride_temp,
    floor_ptr,
    out_ptr,
    seed,
    seed_ptr,  # SEED_FROM_PTR: int64 [1], read here instead of ``seed``
    rows,
    v,
    nodes,
    ROWS: tl.constexpr,
    BLOCK: tl.constexpr,
    HAS_FLOOR: tl.constexpr,
    SEED_FROM_PTR: tl.constexpr,
):
    if SEED_FROM_PTR:
        seed = tl.load(seed_ptr).to(tl.int32)
    r = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    live = r < rows
    inv_t = 1.0 / tl.load(temp_ptr + (r // nodes) * stride_temp, mask=live, other=1.0)
    if HAS_FLOOR:
        floor = tl.load(floor_ptr + r, mask=live, other=float("-inf"))
    row_ptr = logits_ptr + r * stride_logits
    key = r * v  # Philox counter of (row, column): row * V + column
    best = tl.full((ROWS, BLOCK), float("-inf"), tl.float32)
    arg = tl.zeros((ROWS, BLOCK), tl.int32)
    for start in range(0, v, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        m = live[:, None] & (cols < v)[None, :]
        x = tl.load(row_ptr[:, None] + cols[None, :], mask=m, other=float("-inf"))
        if HAS_FLOOR:
            x = tl.where(x >= floor[:, None], x, float("-inf"))
        u = tl.maximum(tl.rand(seed, key[:, None] + cols[None, :]), _TINY_C)
        z = x * inv_t[:, None] - tl.log(-tl.log(u))
        better = z > best
        best = tl.where(better, z, best)
        arg = tl.where(better, cols[None, :], arg)
    top = tl.max(best, 1)
    # The lowest column among the maxima; a row of -inf keeps every lane at column 0.
    token = tl.min(tl.where(best == top[:, None], arg, v), 1)
    tl.store(out_ptr + r, token.to(tl.int64), mask=live)
