"""megatron-core 0.19's Gated DeltaNet with prefix sharing: the state carried across prefixes.

A GDN layer (``megatron.core.ssm.gated_delta_net.GatedDeltaNet``, the ``G`` of a hybrid pattern
and Qwen3.5 / Qwen3-Next's linear-attention layers) has two parts that read earlier tokens: a
short causal convolution over the q/k/v projections and the gated delta rule (a recurrent state
per value head). Under sharing, a reuser's tail must start from its provider's convolution
inputs and state at the branch point. :class:`PrefixSharingGatedDeltaNet` runs exactly the stock
module's computation - the same input projection, split, L2 norm, decay and gate, gated output
norm and output projection (it calls the stock module's own methods) - except for those two
parts, which it runs over the micro-batch's recurrence schedule
(:mod:`prefix_sharing.recurrent`): the convolution as one gather over each row's predecessors
on its path, the rule bucket by bucket, each piece from its parent's final state (gathered
differentiably, so a reuser's gradient reaches the provider's rows). Kernels: the project's
recurrent backends (flash-linear-attention on CUDA, the torch reference anywhere).

Tensor parallelism needs nothing more: each rank holds whole sequences and its share of the
GDN heads (megatron splits the projections and the convolution channels by head), and every
rank builds the same schedule from the same plan. Sequence parallelism gathers the tokens in
the input projection and scatters them in the output projection, as in the stock module.
Refused: context parallelism (the stock module's all-to-all would split the flat layout's
segments) and inference.

Importing this module needs megatron-core 0.19's ``ssm/gated_delta_net`` package; it is the
release whose module this class was written against (0.16.1 and 0.17.1 have no packed path,
0.18.2's module has other method names), see :data:`GDN_RELEASE`.
"""

from __future__ import annotations

from functools import partial
from typing import Any

from ..refusals import refuse, refuse_all
from .stock_gdn import prepare_gated_delta_net, serves_gated_delta_net

if not serves_gated_delta_net():
    raise ImportError(
        "prefix_sharing.megatron_ext.gated_delta_net needs megatron-core 0.19.2's Gated DeltaNet "
        "(megatron.core.ssm.gated_delta_net.gdn, Python >= 3.12)"
    )

import torch  # noqa: E402
from megatron.core import tensor_parallel  # noqa: E402
from megatron.core.ssm.gated_delta_net import GatedDeltaNet  # noqa: E402

from ..recurrent import (  # noqa: E402
    causal_conv1d_over_schedule,
    gated_delta_rule_over_schedule,
    recurrence_schedule,
)
from .checks import (UnsupportedSetupError, check_sharing_allowed,  # noqa: E402
                     gdn_context_parallel_problems)
from .packed_seq import PlanPackedSeqParams  # noqa: E402

prepare_gated_delta_net()  # in a CPU process only: fla's Triton l2norm has no CPU driver

__all__ = ["GDN_RELEASE", "PrefixSharingGatedDeltaNet", "recurrent_backend"]

# The megatron-core release whose GatedDeltaNet this module shares (named by refusals elsewhere).
GDN_RELEASE = "0.19.2"


def recurrent_backend(attention_backend: str) -> str:
    """The recurrent-kernel backend for a micro-batch's attention ``backend`` setting: the torch
    reference when the attention runs on torch too (tests, CPU), else ``"auto"`` (fla on CUDA
    when installed)."""
    return "torch" if attention_backend == "torch" else "auto"


class PrefixSharingGatedDeltaNet(GatedDeltaNet):
    """``GatedDeltaNet`` whose convolution and delta rule follow the sharing plan.

    Shapes (this tensor-parallel rank's heads; ``T`` = flat rows of the micro-batch):
        hidden_states ``[T (/ TP with sequence parallelism), 1, h]`` -> output, same shape.

    With a :class:`~.packed_seq.PlanPackedSeqParams` the layer runs the plan's flat layout;
    with megatron's plain ``PackedSeqParams`` or none it is the stock module. Constructed by
    ``build_module`` with the stock module's arguments; put it in a spec with
    :func:`prefix_sharing.megatron_ext.with_prefix_sharing`.
    """

    def __init__(self, config: Any, *args: Any, **kwargs: Any) -> None:
        found = gdn_context_parallel_problems(config)
        if found:
            raise refuse_all(found, error=UnsupportedSetupError)
        super().__init__(config, *args, **kwargs)

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None,
        inference_context: Any = None,
        packed_seq_params: Any = None,
        sequence_len_offset: int | None = None,
        *,
        inference_params: Any = None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        if not isinstance(packed_seq_params, PlanPackedSeqParams):
            return super().forward(hidden_states, attention_mask, inference_context,
                                   packed_seq_params, sequence_len_offset,
                                   inference_params=inference_params, **kwargs)
        if inference_context is not None or inference_params is not None:
            raise refuse("megatron.inference_context", "in a Gated DeltaNet layer",
                         error=UnsupportedSetupError)

        if hidden_states.size(1) != 1:
            raise ValueError(f"a planned micro-batch is THD with batch 1; the GDN layer got "
                             f"hidden states of shape {tuple(hidden_states.shape)}")
        plan = packed_seq_params.plan
        check_sharing_allowed(self.config, plan, self.training)
        schedule = recurrence_schedule(plan)  # built once per micro-batch, then cached
        backend = recurrent_backend(packed_seq_params.backend)

        qkvzba, _ = self.in_proj(hidden_states)  # [T, 1, d_local] (sequence parallel: gathered)
        qkvzba = qkvzba.transpose(0, 1)  # [1, T, d_local]
        qkv, gate, beta, alpha = torch.split(qkvzba, self.feat_dim_split, dim=-1)
        rows = qkv.size(1)
        if rows != schedule.num_rows:
            raise ValueError(f"the GDN layer got {rows} rows; the plan's flat layout has "
                             f"{schedule.num_rows}")
        gate = gate.reshape(1, rows, -1, self.value_head_dim)  # [1, T, hv_local, dv]

        # the causal convolution: every row reads its path's predecessors (provider rows for a
        # reuser's first tokens); [T, conv_dim_local] -> [1, T, conv_dim_local]
        qkv = causal_conv1d_over_schedule(
            qkv[0], self.conv1d.weight.squeeze(1), self.conv1d.bias if self.conv_bias else None,
            schedule, activation=self.activation, backend=backend).unsqueeze(0)

        query, key, value, gate, beta, alpha = self._prepare_input_for_gated_delta_rule(
            qkv, gate, 1, rows, beta, alpha)  # q/k/v [1, T, hv_local, dk|dv], beta/alpha [1, T, hv]
        g, beta = self._compute_g_and_beta(self.A_log, self.dt_bias, alpha, beta)

        # the gated delta rule over the schedule: [T, hv_local, dv] -> [1, T, hv_local, dv]
        core_attn_out = gated_delta_rule_over_schedule(
            query[0], key[0], value[0], g[0], beta[0], schedule, backend=backend).unsqueeze(0)

        norm = partial(self._gated_norm_and_a2a, thd_cp_a2a_inv=None, batch=1, seq_len=rows,
                       packed_seq_params=packed_seq_params)
        if self.recompute_norm_out:
            self.norm_out_checkpoint = tensor_parallel.CheckpointWithoutOutput()
            norm_out = self.norm_out_checkpoint.checkpoint(norm, core_attn_out, gate)
        else:
            norm_out = norm(core_attn_out, gate)  # [T, 1, v_local]
        out, out_bias = self.out_proj(norm_out)
        if self.recompute_norm_out:
            self.norm_out_checkpoint.discard_output_and_register_recompute(out)
        return out, out_bias
