"""CPU matmuls with weights prepacked once by oneDNN.

On CPU, `F.linear` hands a small-batch matmul (the decode step: a handful of rows against a
weight of tens of MB) to MKL, which streams the weight in a layout that wastes most of the
memory bandwidth: on the 2-core development machine a SmolLM2 decode step at 4 rows took 81 ms
in `aten::mm`. oneDNN, given the weight reordered once into its own blocked layout, does the
same matmul at 1.6-2.5x that speed for 2-16 rows and is not slower for prefill-sized batches
(`bench/cpu_ops.py` prints the table). That is what vLLM's CPU backend does too. The machine
matters: on a later one (`bench/results/cpu_ops.json`) packing lost at 1-2 rows (0.76-0.82x)
and won 1.24-1.51x at 4-16.

`pack_linears(model)` swaps every `nn.Linear` for a `PackedLinear` holding the reordered weight;
`LlamaForCausalLM.pack_weights` also packs a copy of a tied LM head (the embedding stays as it is
for the lookup). Only for float32 on CPU with oneDNN present; elsewhere `packing_supported` is False
and the model keeps its `nn.Linear`s.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

# oneDNN picks the blocked layout for this many rows; 16 was best or within noise of best for
# 1..256 rows on the development machine (a hint of 1 made 2..16 rows 1.5x slower).
_ROWS_HINT = 16
# oneDNN builds (and keeps) a primitive and buffers for every distinct row count: a prefill
# worker seeing every prompt length from 1 to 2048 grew to 3.8 GB RSS in a sweep. Row counts are
# therefore padded to a few buckets (powers of two up to 16, then multiples of 32) and longer
# batches cut into pieces of _MAX_ROWS: at most 21 shapes per weight, RSS within 30 MB of
# F.linear's in the same sweep, and no slower for a 2048-token prefill (within noise).
_MAX_ROWS = 512


def _bucket(num_rows: int) -> int:
    if num_rows <= 16:
        return 1 << (num_rows - 1).bit_length()
    return -(-num_rows // 32) * 32


def packing_supported(device: torch.device, dtype: torch.dtype) -> bool:
    return (device.type == "cpu" and dtype == torch.float32
            and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


class PackedLinear(nn.Module):
    """`y = x @ weight.T + bias` with the weight in oneDNN's layout. x: [T, in] -> [T, out]."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.in_features = weight.shape[1]
        self.out_features = weight.shape[0]
        # Buffers, not parameters: the packed tensor is opaque and never trained or saved.
        self.register_buffer("packed_weight", _reorder(weight), persistent=False)
        self.register_buffer("bias", None if bias is None else bias.detach().clone(),
                             persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        num_rows = x.shape[0]
        if num_rows > _MAX_ROWS:
            return torch.cat([self.forward(x[i : i + _MAX_ROWS])
                              for i in range(0, num_rows, _MAX_ROWS)])
        padded = _bucket(num_rows)
        if padded != num_rows:
            x = F.pad(x, (0, 0, 0, padded - num_rows))
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [],
                                                  "")[:num_rows]

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, packed=oneDNN"


def pack_linears(module: nn.Module) -> int:
    """Replace every `nn.Linear` under `module` by a `PackedLinear`; returns how many."""
    count = 0
    for name, child in list(module.named_children()):
        if isinstance(child, nn.Linear):
            setattr(module, name, PackedLinear(child.weight.detach(), child.bias))
            count += 1
        else:
            count += pack_linears(child)
    return count


def _reorder(weight: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), _ROWS_HINT)
