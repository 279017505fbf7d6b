"""The factored output head (`model.head: factored`, docs/method.md, when the rule is exact, feature space).

The token logit is a sum of per-feature logits, ``z(v) = Σ_j a_j[D_j(v)]`` with ``a_j = A_j h``: the output
layer's weight is constrained to ``W[v] = Σ_j A_j[D_j(v)]`` (a `torch.nn.utils.parametrize` parametrization
of `lm_head.weight`), so the next-token distribution is the product of its feature marginals.

While the background trains, the tables ``A_j`` are the parameters; `merge_factored_head` then writes ``W`` back
as a plain weight, so the saved model is an ordinary HF causal LM (safetensors, `from_pretrained`) whose head
*is* factored. LoRA experts on its blocks leave the head as it is, so their distributions are factored too.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.nn.utils import parametrize
from transformers import PreTrainedModel

from lightning_modules.pipeline.config import ConfigError
from losses.features import FeatureMap


class FactoredWeight(nn.Module):
    """Parametrization ``W[v] = Σ_j A_j[D_j(v)]`` of a `[V, H]` output weight from tables `A_j [|F_j|, H]`."""

    def __init__(self, fmap: FeatureMap) -> None:
        super().__init__()
        self.sizes = fmap.sizes
        self.register_buffer("index", fmap.token_features(), persistent=False)  # [V, n]

    def forward(self, *tables: Tensor) -> Tensor:
        return sum(table[self.index[:, j]] for j, table in enumerate(tables))

    def right_inverse(self, weight: Tensor) -> tuple[Tensor, ...]:
        """The least-squares tables of `weight`: feature 1 takes its mean over the other features, each later
        feature its mean minus the grand mean (so a weight that is already factored is reproduced exactly)."""
        grid = torch.empty(*self.sizes, weight.shape[-1], dtype=weight.dtype, device=weight.device)
        grid[tuple(self.index.T)] = weight
        n, grand = len(self.sizes), grid.mean(dim=tuple(range(len(self.sizes))))
        tables = [grid.mean(dim=tuple(i for i in range(n) if i != j)) if n > 1 else grid for j in range(n)]
        return tuple(t if j == 0 else t - grand for j, t in enumerate(tables))


def factor_output_layer(model: PreTrainedModel, fmap: FeatureMap) -> PreTrainedModel:
    """Constrain `model`'s output layer to the factored head of `fmap` (in place; returns `model`).

    Raises:
        ValueError: if the output layer's vocabulary differs from the feature map's, or is tied to the input
            embeddings (a factored input table is not intended).
    """
    head = model.get_output_embeddings()
    if head.weight.shape[0] != fmap.vocab_size:
        raise ValueError(f"model.head=factored: the output layer has {head.weight.shape[0]} tokens but the task's "
                         f"feature map covers {fmap.vocab_size}")
    if head.weight is model.get_input_embeddings().weight:
        raise ValueError("model.head=factored needs untied input/output embeddings")
    parametrize.register_parametrization(head, "weight", FactoredWeight(fmap), unsafe=True)
    return model


def merge_factored_head(model: PreTrainedModel) -> PreTrainedModel:
    """Write a factored output layer back as a plain weight (in place; a model without one is left as is)."""
    head = model.get_output_embeddings()
    if parametrize.is_parametrized(head, "weight"):
        parametrize.remove_parametrizations(head, "weight", leave_parametrized=True)
    return model


@torch.no_grad()
def factorization_residual(weight: Tensor, fmap: FeatureMap) -> float:
    """Largest |W − W_factored| over the output weight `[V, H]`, ``W_factored`` its least-squares factored part
    (0 up to rounding for a factored head)."""
    param = FactoredWeight(fmap).to(weight.device)
    return float((weight - param(*param.right_inverse(weight.float()))).abs().max())


def check_factored(model: PreTrainedModel, fmap: FeatureMap, where: str, tolerance: float = 1e-4) -> None:
    """Raise a one-line `ConfigError` naming `where` unless `model`'s output layer is the factored head of `fmap`
    (e.g. a `background.path` given with `model.head=factored`)."""
    weight = model.get_output_embeddings().weight
    if weight.shape[0] != fmap.vocab_size:
        raise ConfigError(f"{where}: model.head=factored, but its output layer has {weight.shape[0]} tokens and the "
                          f"task's feature map covers {fmap.vocab_size}")
    residual = factorization_residual(weight, fmap)
    if residual > tolerance:
        raise ConfigError(f"{where}: model.head=factored, but its output layer is not a sum of per-feature rows over "
                          f"the task's feature map (largest residual {residual:.3g}): train it with model.head=factored "
                          "or set model.head=token")
