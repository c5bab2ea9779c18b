"""The three layouts the Megatron harness runs a micro-batch in, one strategy each.

A layout says how a micro-batch goes in (:meth:`Layout.prepare`), how the model is called on
it (:meth:`Layout.forward`), how the loss's quantities come out of the logits
(:meth:`Layout.read`: the packed full-vocabulary logits, per-token log-probs and entropy) and
what is left to undo or record after the schedule (:meth:`Layout.finish`: the plans'
fingerprints). See :mod:`.megatron` for what each one computes.
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Sequence
from typing import Any

import torch

from ..config import PrefixSharingConfig
from ..equivalence import plain_token_log_probs
from ..planner import PromptGroup
from .megatron_references import (
    clear_replay,
    padded_batch,
    replay_padded,
    stage_padding_mask,
    stock_thd_batch,
    stock_thd_token_stats,
)

__all__ = ["LAYOUTS", "Layout", "layout_for"]

Routes = Sequence[Sequence[torch.Tensor]]


@dataclasses.dataclass
class Layout(abc.ABC):
    """One layout's way through a pass; ``routes``: per micro-batch, the MoE routes to replay."""

    config: PrefixSharingConfig
    groups: list[Sequence[PromptGroup] | None]
    routes: Routes | None

    @abc.abstractmethod
    def prepare(self, chunks: Sequence[torch.nn.Module],
                batches: Sequence[Sequence[torch.Tensor]], device: Any) -> list[Any]:
        """Every micro-batch's model inputs (for every model chunk of this rank)."""

    @abc.abstractmethod
    def forward(self, model: torch.nn.Module, mb: Any, i: int) -> torch.Tensor:
        """The model's output on micro-batch ``i``'s inputs ``mb``."""

    @abc.abstractmethod
    def read(self, logits: torch.Tensor, seqs: Sequence[torch.Tensor],
             mb: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(packed full-vocabulary logits, log-probs, entropy)`` of the sequences ``seqs``."""

    def finish(self, chunks: Sequence[torch.nn.Module], inputs: list[Any]) -> list[str]:
        """After the schedule: the plans' fingerprints (``shared`` only)."""
        return []


class SharedLayout(Layout):
    """The prefix-sharing layer spec on each plan's flat layout."""

    def prepare(self, chunks, batches, device):
        from ..megatron_ext import check_sharing_model, prepare_micro_batch

        check_sharing_model(chunks)
        # every stage plans the MTP depths, as it plans the decoder (the last one reads them)
        mtp = chunks[0].config.mtp_num_layers
        return [prepare_micro_batch(seqs, self.config, groups=g, device=device,
                                    routes=None if self.routes is None else self.routes[i],
                                    mtp_num_layers=mtp)
                for i, (seqs, g) in enumerate(zip(batches, self.groups))]

    def forward(self, model, mb, i):
        return model(mb.input_ids, mb.position_ids, None, packed_seq_params=mb.packed_seq_params)

    def read(self, logits, seqs, mb):
        from ..megatron_ext import token_stats

        stats = token_stats(logits, mb)
        packed = mb.plan.restore(_gather_context_rows(_gather_vocab(logits)[0], mb))
        return packed, stats.log_probs, stats.entropy

    def finish(self, chunks, inputs):
        return [mb.plan.digest() for mb in inputs]


class PackedLayout(Layout):
    """The same model on megatron's stock THD layout: nothing shared."""

    def __post_init__(self) -> None:
        if self.routes is not None:
            raise ValueError("routes are replayed in the 'shared' and 'padded' layouts")

    def prepare(self, chunks, batches, device):
        return [stock_thd_batch(seqs, device, self.config.backend) for seqs in batches]

    def forward(self, model, mb, i):
        thd = mb[0]
        return model(thd.input_ids, thd.position_ids, None,
                     packed_seq_params=thd.packed_seq_params)

    def read(self, logits, seqs, mb):
        log_probs, entropy = stock_thd_token_stats(logits, *mb)
        packed = _gather_vocab(logits)[0].index_select(0, mb[0].token_rows)
        return packed, log_probs, entropy


class PaddedLayout(Layout):
    """Megatron's stock spec on right-padded ``[b, s]`` input; with routes, each stock router
    replays them as its top-k sees the padded batch."""

    def prepare(self, chunks, batches, device):
        return [padded_batch(seqs, device) for seqs in batches]

    def forward(self, model, mb, i):
        tokens, positions, padding = mb
        if self.routes is not None:
            replay_padded(model, self.routes[i], tokens.size(1))
        # the mask keeps pads out of MoE router statistics
        return model(tokens, positions, None, padding_mask=stage_padding_mask(model, padding))

    def read(self, logits, seqs, mb):
        packed = _unpad(_gather_vocab(logits), seqs)
        log_probs, entropy = plain_token_log_probs(packed, [s.to(packed.device) for s in seqs])
        return packed, log_probs, entropy

    def finish(self, chunks, inputs):
        if self.routes is not None:
            for chunk in chunks:
                clear_replay(chunk)
        return []


LAYOUTS: dict[str, type[Layout]] = {"shared": SharedLayout, "packed": PackedLayout,
                                    "padded": PaddedLayout}


def layout_for(name: str, config: PrefixSharingConfig,
               groups: list[Sequence[PromptGroup] | None], routes: Routes | None) -> Layout:
    """The strategy of the layout ``name`` (one of :data:`LAYOUTS`)."""
    return LAYOUTS[name](config, groups, routes)


def _gather_context_rows(flat: torch.Tensor, mb: Any) -> torch.Tensor:
    """The whole flat layout's rows from every context-parallel rank's slice (for the record of
    the logits; the loss reads only the local rows)."""
    if mb.cp is None:
        return flat
    from ..megatron_ext.context_parallel import gather_rows

    return gather_rows(flat.detach(), mb.cp)


def _unpad(logits: torch.Tensor, seqs: Sequence[torch.Tensor]) -> torch.Tensor:
    return torch.cat([logits[row, : len(s)] for row, s in enumerate(seqs)])


def _gather_vocab(logits: torch.Tensor) -> torch.Tensor:
    """Full-vocabulary logits from this tensor-parallel rank's slice (differentiable)."""
    from megatron.core.tensor_parallel.mappings import gather_from_tensor_model_parallel_region

    return gather_from_tensor_model_parallel_region(logits)
