"""The adapters backend's LoRA layers on row blocks ``[background | expert 1 | … | expert k]``.

Inside :func:`adapter_rows` every forward of the base model runs ``(k+1)·B`` rows, block ``i`` as component ``i``.
Plain LoRA runs on the experts' weights stacked per layer, two batched matmuls a layer (:class:`StackedLoRA`,
:func:`_stacked_lora_forward`); anything else through peft's own mixed-adapter batch. :func:`lora_blocks` lets
lazy decoding choose the blocks between forwards.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from types import SimpleNamespace
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn import functional as F

BASE_ADAPTER = "__base__"  # peft's name for the base model in a mixed-adapter batch


def row_blocks(t: Tensor | None, n: int) -> Tensor | None:
    """``t`` as ``n`` row blocks ``[t; t; …]`` (``t.repeat(n, 1)``), for the adapters backend's ``(k+1)·B`` batch.
    ``torch.cat`` records one or two ATen ops where ``repeat`` records about 30, three times in every decoding step."""
    return t if t is None or n == 1 else torch.cat([t] * n)


@contextmanager
def adapter_rows(model: nn.Module, names: Sequence[str], batch_size: int) -> Iterator[None]:
    """Every forward of ``model`` (a PeftModel) inside runs ``batch_size`` rows of each component, the background
    first, then ``names`` in order.

    Plain LoRA goes through :func:`_grouped_lora`. Otherwise peft's mixed batch: ``model(..., adapter_names=names)``
    registers a pre-forward hook on every LoRA layer that passes ``adapter_names`` to it
    (``LoraLayer._mixed_batch_forward``) and removes the hooks after the call; here the same hooks are registered
    once for the whole context, so each decoding step is one plain forward of the base model instead of a walk
    over all modules twice.
    """
    if grouped_lora_supported(model, names):
        with _grouped_lora(model, names, batch_size):
            yield
        return
    rows = [BASE_ADAPTER] * batch_size + [name for name in names for _ in range(batch_size)]
    with peft_adapter_names(model, rows):
        yield


@contextmanager
def peft_adapter_names(module: nn.Module, adapter_names: list[str]) -> Iterator[None]:
    """peft's per-row ``adapter_names`` passed to every LoRA layer of ``module`` while the context lasts (what
    ``model(..., adapter_names=)`` does for the length of one forward only)."""
    from peft.tuners.lora import LoraLayer
    from peft.utils import AuxiliaryTrainingWrapper

    hook = functools.partial(_inject_adapter_names, adapter_names=adapter_names)
    handles = [m.register_forward_pre_hook(hook, with_kwargs=True) for m in module.modules()
               if isinstance(m, (LoraLayer, AuxiliaryTrainingWrapper))]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def grouped_lora_supported(model: nn.Module, names: Sequence[str]) -> bool:
    """Plain (unmerged, non-DoRA, bias-free) LoRA on linear layers only, no trainable auxiliary modules, and no
    other code already replacing a LoRA layer's ``forward`` (e.g. accelerate's offloading hooks)."""
    from peft.tuners.lora import LoraLayer
    from peft.tuners.lora.layer import Linear as LoraLinear
    from peft.utils import AuxiliaryTrainingWrapper

    for module in model.modules():
        if isinstance(module, AuxiliaryTrainingWrapper):
            return False
        if isinstance(module, LoraLayer):
            if not isinstance(module, LoraLinear) or module.merged or "forward" in vars(module):
                return False
            for n in names:
                if n in module.lora_variant or module.use_dora.get(n, False):
                    return False
                if n in module.lora_B and module.lora_B[n].bias is not None:
                    return False
    return True


class StackedLoRA:
    """The k experts' LoRA weights of one layer, stacked for batched matmuls over the experts' row blocks.

    ``lora_a [k, r, d_in]`` and ``lora_b [k, d_out, r]`` hold expert ``i``'s ``A_i``/``B_i`` in block ``i - 1``
    (peft's own layouts); ranks below the largest and experts that do not adapt this layer are zeros (exact
    no-ops). The background has no block: its rows get the base layer alone. ``scale`` is every expert's LoRA
    scaling when they agree (a float), else ``[k, 1, 1]``.

    While it lives, the experts' peft parameters are views into these stacks instead of copies of them (their
    own storage is released), so composing k experts holds their LoRA weights once; :meth:`release` gives them
    contiguous storage of their own again. A parameter that does not own all of its storage (a view into FSDP's flat
    parameters, say) or is a tensor subclass keeps it (then it is copied).
    """

    def __init__(self, module: nn.Module, names: Sequence[str]) -> None:
        present = [n for n in names if n in module.lora_A]
        ref_a, ref_b = module.lora_A[present[0]].weight, module.lora_B[present[0]].weight
        rank = max(module.lora_A[n].weight.shape[0] for n in present)
        self.lora_a = ref_a.new_zeros(len(names), rank, ref_a.shape[1])
        self.lora_b = ref_a.new_zeros(len(names), ref_b.shape[0], rank)
        scales = {float(module.scaling[n]) for n in present}
        common = next(iter(scales))
        self.scale: float | Tensor = common
        if len(scales) > 1:
            per_block = [float(module.scaling[n]) if n in present else common for n in names]
            self.scale = torch.tensor(per_block, dtype=ref_a.dtype, device=ref_a.device).view(-1, 1, 1)
        self.shared: list[nn.Parameter] = []
        for i, name in enumerate(names):
            if name not in module.lora_A:
                continue
            weight_a, weight_b = module.lora_A[name].weight, module.lora_B[name].weight
            r = weight_a.shape[0]
            for param, view in ((weight_a, self.lora_a[i, :r]), (weight_b, self.lora_b[i, :, :r])):
                view.copy_(param.detach())
                if owns_storage(param):
                    param.data = view
                    self.shared.append(param)

    def cpu_shared_bytes(self) -> int:
        """Bytes of the stacks when they hold shared parameters in CPU memory (else 0)."""
        return self.lora_a.nbytes + self.lora_b.nbytes if self.shared and self.lora_a.device.type == "cpu" else 0

    def release(self) -> None:
        """The shared parameters get contiguous storage of their own again (same values)."""
        for param in self.shared:
            param.data = param.data.clone(memory_format=torch.contiguous_format)
        self.shared.clear()


def _return_freed_heap() -> None:
    """Give the C heap's free pages back to the OS (glibc ``malloc_trim``; a no-op elsewhere).

    The peft parameters' own storage, freed once they are views into the stacks, is many small blocks on the
    heap while the stacks are large (mmapped) ones: without this the freed blocks stay resident and composing k
    experts holds their LoRA weights twice in RSS.
    """
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def owns_storage(param: Tensor) -> bool:
    """A plain tensor that is all of its storage (not a view into a larger buffer such as FSDP's flat params)."""
    data = param.data
    return (type(data) is torch.Tensor and data.storage_offset() == 0 and data.is_contiguous()
            and data.untyped_storage().nbytes() == data.numel() * data.element_size())


def _stacked_lora_forward(module: nn.Module, batch_size: int, stacked: StackedLoRA,
                          background: bool = True) -> Callable[..., Tensor]:
    """A LoRA layer's ``forward`` for the row blocks ``[background | expert 1 | … | expert k]`` (``batch_size``
    rows each; without the background block when ``background`` is False).

    The base layer runs on all rows; then the experts' rows, viewed as ``[k, B·T, d_in]`` (the row blocks are
    contiguous), get ``s_i · x A_iᵀ B_iᵀ`` from two batched matmuls, the second accumulating into the output in
    place. Four tensor ops per layer whatever k is: decoding is dominated by per-op overhead on small models, and
    the background's block is skipped rather than multiplied by zeros (its share of the LoRA weights' reads).
    Plain ``nn.Linear`` base layers without hooks are called as ``F.linear``, and a base layer whose ``forward``
    an instance attribute replaces (:mod:`compose.packed_weights`) through it: one module call less per layer
    and step.
    """
    base = module.base_layer
    hooked = bool(base._forward_hooks or base._forward_pre_hooks)
    own_forward = None if hooked else vars(base).get("forward")
    plain = type(base) is nn.Linear and not hooked and own_forward is None
    lora_a, lora_b = stacked.lora_a.transpose(1, 2), stacked.lora_b.transpose(1, 2)  # [k, d_in, r], [k, r, d_out]
    k, cast, scale = lora_a.shape[0], lora_a.dtype, stacked.scale
    alpha = scale if isinstance(scale, float) else 1.0
    skip = int(background)
    n = k + skip
    rows = n * batch_size

    def forward(x: Tensor, *args: Any, **kwargs: Any) -> Tensor:
        if args or kwargs:
            result = base(x, *args, **kwargs)
        elif plain:
            result = F.linear(x, base.weight, base.bias)
        else:
            result = (own_forward or base)(x)
        if x.shape[0] != rows:
            raise ValueError(
                f"grouped LoRA expects {rows} rows ({n} blocks of B={batch_size}) as the first axis of a "
                f"LoRA layer's input, got shape {tuple(x.shape)}"
            )
        blocks = _expert_blocks(x, k, skip)
        hidden = torch.bmm(blocks if blocks.dtype == cast else blocks.to(cast), lora_a)  # [k, B·T, r]
        if not isinstance(scale, float):
            hidden.mul_(scale)
        if result.dtype != cast or not result.is_contiguous():
            out_dtype, result = result.dtype, result.to(cast, memory_format=torch.contiguous_format)
            _expert_blocks(result, k, skip).baddbmm_(hidden, lora_b, alpha=alpha)
            return result.to(out_dtype)
        _expert_blocks(result, k, skip).baddbmm_(hidden, lora_b, alpha=alpha)  # a view: adds into result
        return result

    return forward


def _expert_blocks(t: Tensor, k: int, skip: int) -> Tensor:
    """The last ``k`` of the equal row blocks of ``t [(skip+k)·B, ..., d]`` as a view ``[k, B·…, d]``: one op
    (``as_strided`` on contiguous memory) where a reshape and a slice are two, which counts on small models; at B = 1
    with T on its own axis the blocks are the first axis already, and a slice is cheaper still."""
    if t.dim() == 3 and t.shape[0] == skip + k:
        return t[skip:]
    if torch.compiler.is_compiling():  # storage offsets are not traceable; the compiler fuses the views anyway
        return t.reshape(skip + k, -1, t.shape[-1])[skip:]
    t = t if t.is_contiguous() else t.contiguous()
    d = t.shape[-1]
    per_block = t.numel() // ((skip + k) * d)
    return t.as_strided((k, per_block, d), (per_block * d, d, 1), t.storage_offset() + skip * per_block * d)


@contextmanager
def _grouped_lora(model: nn.Module, names: Sequence[str], batch_size: int) -> Iterator[None]:
    """The mixed-adapter batch ``[background | expert 1 | … | expert k]`` (``batch_size`` rows each), fast.

    Same arithmetic as peft's ``LoraLayer._mixed_batch_forward`` (base output, plus each adapter's
    ``B(A(x))·scaling`` on its own rows), but the rows of each component are a contiguous block, so the k
    experts' LoRA weights of a layer are stacked once per call (:class:`StackedLoRA`, sharing storage with
    the peft parameters) and applied with two batched matmuls on a view (:func:`_stacked_lora_forward`),
    instead of peft's per-step index lists, gather/scatter and a loop over adapters in every layer. Each LoRA
    layer's ``forward`` is replaced for the duration of the context (an instance attribute, removed afterwards).
    """
    from peft.tuners.lora import LoraLayer

    layers = [m for m in model.modules() if isinstance(m, LoraLayer)]
    stacks: list[StackedLoRA | None] = []
    freed = _FreedHeap()
    try:
        for m in layers:
            stacked = StackedLoRA(m, names) if any(n in m.lora_A for n in names) else None
            stacks.append(stacked)
            freed.add(0 if stacked is None else stacked.cpu_shared_bytes())  # the parameters' old storage
            # straight into the instance dict: nn.Module.__setattr__ costs ~10 µs a layer and call
            vars(m)["forward"] = (m.base_layer.__call__ if stacked is None
                                  else _stacked_lora_forward(m, batch_size, stacked))
        freed.flush()
        yield
    finally:
        _restore_layers(layers, stacks, freed)


def _restore_layers(layers: Sequence[nn.Module], stacks: list, freed: _FreedHeap,
                    forwards: Sequence[dict] | None = None) -> None:
    """Give each LoRA layer its own forward and parameter storage back, layer by layer, dropping each stack once
    its parameters own their storage again (so at most one layer's weights are held twice)."""
    for i, m in enumerate(layers):
        vars(m).pop("forward", None)
        if i < len(stacks) and stacks[i] is not None:
            nbytes = stacks[i].cpu_shared_bytes()
            stacks[i].release()
            stacks[i] = None
            if forwards is not None:
                forwards[i].clear()  # their slices of the stack
            freed.add(nbytes)  # the stack
    freed.flush()


class _FreedHeap:
    """Counts the CPU bytes the stacking frees and gives them back to the OS every 8 MiB (glibc keeps the
    parameters' many small freed blocks resident otherwise, and k experts' LoRA weights would be held twice)."""

    def __init__(self) -> None:
        self.pending = 0

    def add(self, nbytes: int) -> None:
        self.pending += nbytes
        if self.pending > 8 << 20:
            self.flush()

    def flush(self) -> None:
        if self.pending:
            _return_freed_heap()
            self.pending = 0


def _inject_adapter_names(module: nn.Module, args: tuple, kwargs: dict,
                          adapter_names: list[str]) -> tuple[tuple, dict]:
    """A forward pre-hook (``with_kwargs=True``) giving a LoRA layer peft's per-row ``adapter_names``."""
    kwargs["adapter_names"] = adapter_names
    return args, kwargs


@contextmanager
def lora_blocks(model: nn.Module, names: Sequence[str], batch_size: int) -> Iterator[Callable[[tuple[int, ...]], None]]:
    """The adapters backend's base model on a batch of row blocks chosen between forwards, for lazy decoding.

    Yields ``select(blocks)``: the next forwards take ``len(blocks)·batch_size`` rows, block ``j`` run as component
    ``blocks[j]`` (0 the background, ``i`` expert ``names[i-1]``). With plain LoRA (:func:`grouped_lora_supported`)
    ``select`` sets each LoRA layer's ``forward`` to :func:`_stacked_lora_forward` over the selected slices of its
    :class:`StackedLoRA` (built once per block tuple and kept; the base layer alone for the background alone), so
    a decoding step pays nothing for the choice; otherwise peft's mixed batch gets the blocks' adapter names.
    """
    from peft.tuners.lora import LoraLayer

    current: list[tuple[int, ...] | None] = [None]
    if not grouped_lora_supported(model, names):
        from peft.utils import AuxiliaryTrainingWrapper

        def hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
            kwargs["adapter_names"] = [BASE_ADAPTER if b == 0 else names[b - 1]
                                       for b in current[0] for _ in range(batch_size)]
            return args, kwargs

        handles = [m.register_forward_pre_hook(hook, with_kwargs=True) for m in model.modules()
                   if isinstance(m, (LoraLayer, AuxiliaryTrainingWrapper))]
        try:
            yield lambda blocks: current.__setitem__(0, tuple(blocks))
        finally:
            for handle in handles:
                handle.remove()
        return

    layers = [m for m in model.modules() if isinstance(m, LoraLayer)]
    stacks: list[StackedLoRA | None] = []
    forwards: list[dict[tuple[int, ...], Callable[..., Tensor]]] = [{} for _ in layers]

    def select(blocks: tuple[int, ...]) -> None:
        blocks = tuple(blocks)
        if blocks == current[0]:
            return
        current[0] = blocks
        for m, stacked, known in zip(layers, stacks, forwards, strict=True):
            fn = known.get(blocks)
            if fn is None:
                fn = known[blocks] = _blocks_forward(m, batch_size, stacked, blocks)
            vars(m)["forward"] = fn

    freed = _FreedHeap()  # as in `_grouped_lora`: the parameters' old storage, then the stacks, back to the OS
    try:
        for m in layers:
            stacks.append(StackedLoRA(m, names) if any(n in m.lora_A for n in names) else None)
            freed.add(0 if stacks[-1] is None else stacks[-1].cpu_shared_bytes())
        freed.flush()
        select((0,))
        yield select
    finally:
        _restore_layers(layers, stacks, freed, forwards)


def _blocks_forward(module: nn.Module, batch_size: int, stacked: StackedLoRA | None,
                    blocks: tuple[int, ...]) -> Callable[..., Tensor]:
    """A LoRA layer's ``forward`` for the row blocks ``blocks``: :func:`_stacked_lora_forward` over the selected
    experts' slices of ``stacked``, or the base layer alone where no selected expert adapts this layer."""
    if stacked is None or blocks == (0,):
        return module.base_layer.__call__
    experts = [b - 1 for b in blocks if b > 0]  # stack blocks; the background (0) comes first when selected
    # consecutive experts are a view of the stacks, others a copy (kept for the whole generation)
    index = (slice(experts[0], experts[-1] + 1) if experts == list(range(experts[0], experts[-1] + 1))
             else experts)
    scale = stacked.scale if isinstance(stacked.scale, float) else stacked.scale[index]
    return _stacked_lora_forward(module, batch_size, SimpleNamespace(
        lora_a=stacked.lora_a[index], lora_b=stacked.lora_b[index], scale=scale), background=blocks[0] == 0)
