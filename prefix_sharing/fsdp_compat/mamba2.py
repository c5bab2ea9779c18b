"""Mamba-2 mixers of transformers' Nemotron-H (``nemotron_h``) under the sharing plan.

A Nemotron-H layer is a Mamba-2 mixer, an attention layer, an MLP or an MoE layer (pattern
letters ``M``, ``*``, ``-``, ``E``). Its Mamba-2 mixer is its own forward (an input projection
to the gate ``z``, ``xBC`` and ``dt``; a short causal convolution over ``xBC``; the SSD scan
with a per-head scalar decay, ``B``/``C`` in ``n_groups`` groups and the ``D`` skip; a gated,
grouped RMSNorm; an output projection); nothing in it reads a plan, and run stock on the flat
layout it would carry one sequence's state into the next segment. :func:`install_sharing_mamba`
therefore switches every such mixer, in place, to a subclass whose forward runs the convolution
(a gather of each row's predecessors on its own path) and the scan over the plan's
:class:`~prefix_sharing.recurrent.RecurrenceSchedule` (each reuser's tail starts from its
provider's state at the branch point, differentiably) and keeps everything else: the mixer's
own parameters, names, projections and norm, ``dt``'s bias, softplus and floor
(``time_step_limit``) computed as transformers computes them. Its attention layers call
transformers' ``AttentionInterface`` (no rotary embedding), so the sharing attention serves
them; its MLP and MoE layers are token-local (the MoE router has no batch statistic in the
forward). The kernels follow the forward's ``sharing_backend``: ``"torch"`` runs the torch
kernels, any other choice ``"auto"`` (mamba_ssm's scan and fla's convolution on CUDA when
installed, else torch).

Refused: a stock Mamba-2 mixer left in place while sharing (:func:`check_sharing_mamba`), a
cache, a padding mask, and multi-token-prediction modules (see
:func:`~.gated_deltanet.check_recurrent_layers`).
"""

from __future__ import annotations

from typing import Any

import torch

from ..recurrent import causal_conv1d_over_schedule, ssd_over_schedule
from ..recurrent.ssd_torch import discretize_dt
from .switch import InPlaceSwitch, planned_mixer_inputs

__all__ = ["MAMBA_HYBRID_FAMILIES", "install_sharing_mamba", "check_sharing_mamba"]

MAMBA_HYBRID_FAMILIES: tuple[str, ...] = ("nemotron_h",)


def install_sharing_mamba(model: torch.nn.Module) -> int:
    """Switches every Nemotron-H Mamba-2 mixer of ``model`` (in place) to its sharing subclass;
    returns how many. The mixers keep their parameters; call it before wrapping the model."""
    return sum(_SWITCH.switch(module) for module in list(model.modules()))


def check_sharing_mamba(model: torch.nn.Module) -> None:
    """Raises when a stock Mamba-2 mixer is left in a model that runs the sharing plan."""
    _SWITCH.check(model)


def _sharing_forward(self: Any, hidden_states: torch.Tensor, cache: Any = None,
                     attention_mask: torch.Tensor | None = None, **kwargs: Any) -> torch.Tensor:
    """The Mamba-2 mixer on the plan's flat layout: ``(1, T_flat, hidden) -> (1, T_flat,
    hidden)``, computed as transformers' torch path computes it, the convolution and the scan
    over the schedule (:mod:`prefix_sharing.recurrent`)."""
    schedule, backend = planned_mixer_inputs(self, "Mamba-2 mixer", hidden_states, cache,
                                             attention_mask, kwargs)
    total = hidden_states.size(1)
    groups_dim = self.n_groups * self.ssm_state_size
    gate, xbc, dt = self.in_proj(hidden_states[0]).split(
        [self.intermediate_size, self.conv_dim, self.num_heads], dim=-1)  # [T, I], [T, xBC], [T, H]
    xbc = causal_conv1d_over_schedule(xbc, self.conv1d.weight.squeeze(1), self.conv1d.bias,
                                      schedule, activation=self.activation, backend=backend)
    dt = discretize_dt(dt, self.dt_bias, self.time_step_limit)  # [T, H], in the model's dtype
    A = -torch.exp(self.A_log.float())  # [H], float32 as in the stock mixer
    # the stock torch scan runs on float32 x, dt, B, C and hands the norm its float32 output (a
    # float64 model stays float64 here, as its float64 reference does)
    x, B, C, dt = (t.to(torch.promote_types(t.dtype, torch.float32))
                   for t in (*torch.split(xbc, [self.intermediate_size, groups_dim, groups_dim],
                                          dim=-1), dt))
    y = ssd_over_schedule(
        x.reshape(total, self.num_heads, self.head_dim), dt, A,  # [T, H, P], [T, H], [H]
        B.reshape(total, self.n_groups, self.ssm_state_size),  # [T, G, N]
        C.reshape(total, self.n_groups, self.ssm_state_size), schedule, D=self.D,
        backend=backend)
    y = self.norm(y.reshape(1, total, -1), gate[None])  # [1, T, I]
    return self.out_proj(y.to(hidden_states.dtype))


_SWITCH = InPlaceSwitch("Mamba-2 mixers", lambda m: type(m).__name__ == "NemotronHMamba2Mixer",
                        _sharing_forward, "_prefix_sharing_mamba")
