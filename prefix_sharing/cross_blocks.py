"""A group's live shared blocks while its steps run, and the one gradient rule.

A :class:`~prefix_sharing.group_schedule.GroupSchedule`'s steps run in order, whoever owns the
loop (megatron's schedule: :class:`~prefix_sharing.megatron_ext.cross_steps.GroupSteps`; a
plain loop of forward and backward calls: :class:`~prefix_sharing.fsdp_compat.cross_steps.
HFGroupSteps`). What a step does to the group's state is the same in every loop, and is here:

- ``("forward", b)``: block ``b``'s forward reads the blocks below it (:meth:`GroupBlocks.
  block_stack`) and records its K/V per layer (:class:`~prefix_sharing.prefix_kv.PrefixKV`)
  and its members' per-token outputs at its positions (:meth:`GroupBlocks.recorded`: log-probs
  and entropy, or a critic's values), each kept as leaves (detached, requiring grad); its
  graph kept from this step to its backward step (``keep_graph``) or not (run without grad);
- ``("suffix", j)``: a suffix micro-batch reads its blocks' leaves in place
  (:meth:`GroupBlocks.suffix_stack`, :meth:`GroupBlocks.heads`): its backward accumulates every
  reader's gradients there;
- ``("backward", b)``: after its last reader, block ``b``'s backward, once, with **one
  gradient rule**: every leaf's accumulated gradient enters the tensor it was detached from.
  With its graph kept, the backward of :meth:`GroupBlocks.kept_term`
  (:meth:`~prefix_sharing.prefix_kv.PrefixKV.gradient_term` plus the per-token outputs' term);
  otherwise the block's forward runs again with grad, its own rows reading their recorded K/V
  with the leaves' gradients injected (mode ``"record_last"``, :meth:`GroupBlocks.block_stack`
  with ``"backward"``), and the backward of :meth:`GroupBlocks.recomputed_term` (its recomputed
  per-token outputs times their leaves' gradients).

A block's backward step comes after its last reader's, so every reader's gradient is in the
leaves when it reads them; its own backward accumulates into the leaves of the blocks it
reads, whose backward steps come later. Each block's backward is an ``autograd.backward`` of
its own: no weight holds a gradient-sized buffer across several forwards' graphs. The terms'
gradients are taken as they are: the leaves' gradients were scaled by the readers' losses.
"""

from __future__ import annotations

import torch

from .group_schedule import GroupSchedule, SharedBlock
from .prefix_kv import PrefixKV, PrefixKVStack, leaves_term

__all__ = ["GroupBlocks", "Statistics", "block_store"]

# per-token outputs at a block's positions, ``(members, length)`` each: log-probs and entropy
# (or None), or values and None
Statistics = tuple[torch.Tensor, torch.Tensor | None]


class GroupBlocks:
    """One group's shared blocks while its steps run (module doc).

    Args:
        schedule: the group.
        keep_graph: keep each block's graph from its forward step to its backward step; else
            compute it again there.
        training: whether backward steps follow (else the blocks run once, without grad).
        device: where the blocks' stores live.
        stages: how many model chunks run the steps, each on its own layers with stores of its
            own (megatron's interleaved pipeline stages; 1 otherwise).
    """

    def __init__(self, schedule: GroupSchedule, *, keep_graph: bool, training: bool,
                 device: torch.device, stages: int = 1) -> None:
        self.schedule = schedule
        self.keep_graph = keep_graph and training
        self.training = training
        self.device = device
        self._kv: list[dict[int, PrefixKV]] = [{} for _ in range(stages)]
        # per stage: block -> its per-token outputs, recorded and as leaves
        self._outputs: list[dict[int, tuple[Statistics, Statistics]]] = [
            {} for _ in range(stages)]
        self.held_bytes = 0  # the most K/V leaf bytes (and gradients) live at once
        self._repeated = 0  # block rows a repeated forward step ran again

    @property
    def steps(self) -> list[tuple[str, int]]:
        """The steps to run: the schedule's (without backward steps when not training)."""
        return [s for s in self.schedule.steps if self.training or s[0] != "backward"]

    @property
    def recomputed_tokens(self) -> int:
        """Block rows computed more than once: by the backward steps (every block's, unless
        kept) and by repeated forward steps."""
        if self.keep_graph or not self.training:
            return self._repeated
        return self._repeated + sum(b.length for b in self.schedule.blocks)

    def block_stack(self, stage: int, b: int, kind: str) -> PrefixKVStack:
        """What block ``b``'s ``"forward"`` or (recomputing) ``"backward"`` step reads and
        records on ``stage``: the stores of the blocks below it, and its own - new for a
        forward step (a forward step run again records the same K/V again, counted as
        recomputed), recorded again with the leaves' gradients injected for a backward step."""
        block = self.schedule.blocks[b]
        live = self._kv[stage]
        for r in block.reads:
            live[r].mode = "read"
        if kind == "forward":
            if b in live and stage == 0:
                self._repeated += block.length
            live[b] = block_store(block, self.device)
        else:
            self._count_held()
        live[b].mode = "record" if kind == "forward" else "record_last"
        return PrefixKVStack([live[r] for r in block.reads], live[b])

    def recorded(self, stage: int, b: int, outputs: Statistics) -> None:
        """Block ``b``'s forward step read out ``outputs``: kept, and as leaves for its
        readers."""
        self._outputs[stage][b] = outputs, tuple(
            None if t is None else t.detach().requires_grad_(self.training) for t in outputs)

    def suffix_stack(self, stage: int, index: int) -> PrefixKVStack:
        """What suffix micro-batch ``index`` reads on ``stage``: its blocks' K/V leaves, in row
        order."""
        live = self._kv[stage]
        reads = self.schedule.suffixes[index].reads
        for r in reads:
            live[r].mode = "read"
        self._count_held()
        return PrefixKVStack([live[r] for r in reads])

    def heads(self, stage: int, index: int, members: list[int]) -> Statistics:
        """``(len(members), depth)`` per-token outputs of suffix ``index``'s samples
        ``members`` at the positions its blocks computed: their leaves."""
        parts = []
        for r in self.schedule.suffixes[index].reads:
            block = self.schedule.blocks[r]
            leaves = self._outputs[stage][r][1]
            rows = torch.tensor([block.members.index(m) for m in members],
                                device=leaves[0].device)
            parts.append(tuple(None if t is None else t.index_select(0, rows) for t in leaves))
        return tuple(None if p[0] is None else torch.cat(p, dim=1) for p in zip(*parts))

    def kept_term(self, stage: int, b: int) -> torch.Tensor:
        """Block ``b``'s backward step with its graph kept: a scalar whose backward carries
        its leaves' gradients into the graph; the block is released."""
        self._count_held()
        return self._kv[stage].pop(b).gradient_term() + leaves_term(*self._outputs[stage].pop(b))

    def release(self, stage: int, b: int) -> Statistics | None:
        """Block ``b``'s recomputing backward step has run its forward (which holds what its
        backward reads): the block is released; its per-token outputs' leaves (None on a
        stage that reads none out)."""
        del self._kv[stage][b]
        leaves = self._outputs[stage].pop(b, None)
        return None if leaves is None else leaves[1]

    @staticmethod
    def recomputed_term(recorded: Statistics, leaves: Statistics | None) -> torch.Tensor:
        """A recomputing backward step's per-token term: the recomputed outputs times their
        leaves' gradients (the K/V's enter through the injection)."""
        return leaves_term(recorded, leaves) if leaves is not None else torch.zeros(())

    def _count_held(self) -> None:
        self.held_bytes = max(self.held_bytes, sum(kv.held_bytes() for live in self._kv
                                                   for kv in live.values()))


def block_store(block: SharedBlock, device: torch.device) -> PrefixKV:
    """An empty K/V store for ``block``: its real rows kept (its pad rows are not), and the
    routes its rows replay (routing replay), which its readers' plain views replay too."""
    return PrefixKV(rows=block.length,
                    routes=None if block.routes is None else block.routes.to(device))
