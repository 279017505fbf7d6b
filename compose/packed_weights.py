"""Linear layers on oneDNN-prepacked weights: CPU decoding of (k+1)·B rows for less than (k+1) times B's cost.

The adapters backend runs the background and k experts as one forward of ``(k+1)·B`` rows. On a GPU that
costs about what ``B`` rows cost (decoding reads the weights once, whatever the rows). On CPU, MKL's float32
GEMM does not: for a few rows its time grows almost linearly in the rows. oneDNN with the weight reordered
once for its kernels (``mkldnn._reorder_linear_weight`` + ``mkldnn._linear_pointwise``, the pair inductor's
freezing pass packs CPU linears with when the batch size is dynamic) is closer to one read of the weights per
call. SmolLM2-135M at one thread (``benchmarks/decode.py --models smollm2 --packed``): on an AVX2 EPYC 101 ms
per token on 1 row (dense; packed is slower there), on 3 rows 173 ms dense and 146 ms packed, on 9 rows 262 and
189 ms; on an AVX-512 EPYC (Zen 4) 51.8 ms on 1 row packed, 48.9 on 3 rows and 63.0 on 9 (dense: 54.5, 107.2,
105.2).

:func:`packed_linear_weights` swaps every ``nn.Linear`` of a model to such a packed weight for the duration of
a ``with`` block, for inference only, and drops the dense weights meanwhile (a weight another module also
uses, like a head tied to the input embeddings, is kept). Leaving the block restores the dense weights exactly
(the reorder is a permutation of the same values). The outputs differ from ``F.linear``'s by floating-point
rounding only (another summation order).

Memory: dropping a dense weight frees it only where nothing else holds its storage. Weights that
``from_pretrained`` memory-maps from a safetensors file stay mapped while the rest of the model (embeddings,
norms) uses the same file, so there the packed copies come on top: SmolLM2-135M's decoding peak goes from 989 to
1,916 MB of resident set (clean file pages the kernel may reclaim, but counted). Weights in anonymous memory
(trained in the process, or converted on load) are held once.
"""

from __future__ import annotations

import functools
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import Tensor, nn


@contextmanager
def packed_linear_weights(model: nn.Module, rows: int = 4) -> Iterator[int]:
    """Run ``model``'s linear layers on oneDNN-prepacked weights inside the block (CPU inference).

    Args:
        model: any module; its ``nn.Linear`` layers on CPU in float32 (and bfloat16 where the CPU has oneDNN's
            bf16 kernels: AVX-512 BF16 or AMX) are packed, except LoRA's own rank-r matrices (modules named
            ``lora_*``: too small to gain). Nothing is packed on a GPU or without oneDNN; the block then runs the
            model unchanged.
        rows: the number of input rows the packing is tuned for (oneDNN's batch-size hint), e.g. the
            ``(k+1)·B`` rows of a decoding step. Any number of rows runs correctly.

    Yields:
        The number of linear layers packed (0 when nothing could be).

    Inside the block a packed layer's dense ``weight`` is an empty tensor unless another module shares it (see
    the module docstring for when that frees memory), and the layer refuses to run with autograd on (packed
    weights have no backward). Leaving the block, also by an exception, gives every layer its dense weight and
    its own ``forward`` back.
    """
    if not torch.backends.mkldnn.is_available():
        yield 0
        return
    uses = Counter(id(p) for m in model.modules() for p in m._parameters.values() if p is not None)
    packed: list[tuple[nn.Linear, Tensor, bool]] = []
    try:
        for name, module in _linears(model):
            if not _packable(module):
                continue
            weight = module.weight.detach()
            packed_weight = torch.ops.mkldnn._reorder_linear_weight(weight, max(1, rows))
            free = uses[id(module.weight)] == 1
            packed.append((module, packed_weight, free))
            vars(module)["forward"] = _packed_forward(name, packed_weight, module.bias)
            if free:  # the packed copy replaces it: decoding holds the weights once
                module.weight.data = weight.new_empty(0)
        yield len(packed)
    finally:
        for module, packed_weight, free in reversed(packed):
            vars(module).pop("forward", None)
            if free:
                module.weight.data = packed_weight.to_dense()


def _linears(model: nn.Module) -> Iterator[tuple[str, nn.Linear]]:
    for name, module in model.named_modules():
        if type(module) is nn.Linear and ".lora_" not in f".{name}":
            yield name, module


def _packable(module: nn.Linear) -> bool:
    weight = module.weight
    return (weight.device.type == "cpu" and weight.dtype in _packable_dtypes() and weight.numel() > 0
            and type(weight.data) is torch.Tensor and "forward" not in vars(module))


@functools.cache
def _packable_dtypes() -> frozenset[torch.dtype]:
    """float32 always; bfloat16 where oneDNN has bf16 kernels for this CPU (AVX-512 BF16 or AMX)."""
    if torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return frozenset({torch.float32, torch.bfloat16})
    return frozenset({torch.float32})


def _packed_forward(name: str, packed_weight: Tensor, bias: Tensor | None):
    def forward(x: Tensor) -> Tensor:
        if torch.is_grad_enabled() and x.requires_grad:
            raise RuntimeError(f"linear layer {name!r} runs on packed weights (inference only): "
                               "call it under torch.no_grad() or outside packed_linear_weights")
        return torch.ops.mkldnn._linear_pointwise(x, packed_weight, bias, "none", [], "")

    return forward
