"""Gated DeltaNet layers of transformers' Qwen3.5 / Qwen3-Next under the sharing plan.

The GDN module of ``qwen3_next``, ``qwen3_5_text`` and ``qwen3_5_moe_text`` is its own forward
(projections, a causal convolution, the gated delta rule, a gated RMSNorm, an output
projection); nothing in it reads a plan, and run stock on the flat layout it would carry one
sequence's state into the next segment. :func:`install_sharing_gdn` therefore switches every such
module, in place, to a subclass whose forward runs the convolution and the recurrence over the
plan's :class:`~prefix_sharing.recurrent.RecurrenceSchedule` (each reuser's tail starts from its
provider's state at the branch point, differentiably) and keeps everything else: the module's
own parameters, names and projections. transformers 4.57's decoder layers call their GDN module
without the layer's keywords, so the plan would not reach it there: each GDN's parent layer
hands the plan to it around every call (:func:`_hand_plan_to_gdn`; in 5.x the keywords reach the
module directly). Their attention layers already call transformers'
``AttentionInterface`` with the output gate, partial rotary and QK-norm applied around it, so
the sharing attention serves them unchanged. The recurrent kernels follow the forward's
``sharing_backend``: ``"torch"`` runs the torch kernels, any other choice ``"auto"`` (fla on
CUDA when installed, else torch).

Refused: a model that holds multi-token-prediction modules (transformers drops Qwen3.5's and
Nemotron-H's ``mtp.*`` weights on load, so a stock model has none; a model that trains them
would need them shared too), a stock GDN module left in place while sharing
(:func:`check_sharing_gdn`), and recurrent layers of any family but these and Nemotron-H
(:mod:`.mamba2`).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from ..recurrent import causal_conv1d_over_schedule, gated_delta_rule_over_schedule
from ..refusals import refuse
from .attention import BACKEND_KWARG, PLAN_KWARG
from .mamba2 import MAMBA_HYBRID_FAMILIES
from .switch import InPlaceSwitch, planned_mixer_inputs

__all__ = ["HYBRID_FAMILIES", "install_sharing_gdn", "check_sharing_gdn",
           "check_recurrent_layers"]

HYBRID_FAMILIES: tuple[str, ...] = ("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text")
# layer kinds whose tokens depend on earlier tokens only through attention
_ATTENTION_LAYER_TYPES = frozenset({"full_attention", "sliding_attention", "chunked_attention"})
# recurrent (state-space / linear-attention) module class names of other families
_OTHER_RECURRENT_MARKERS = ("Mamba", "GatedDeltaNet", "LinearAttention", "ShortConv")


def check_recurrent_layers(model: torch.nn.Module) -> None:
    """Refuses recurrent layers sharing cannot serve, and MTP modules in the hybrid families
    (the Gated DeltaNet ones here, the Mamba-2 ones of :mod:`.mamba2`)."""
    config = getattr(model.config, "text_config", None) or model.config  # a VLM's text model
    model_type = getattr(config, "model_type", type(model).__name__)
    if model_type in (*HYBRID_FAMILIES, *MAMBA_HYBRID_FAMILIES):
        mtp = [name for name, _ in model.named_children() if name.startswith("mtp")]
        if mtp or any(".mtp" in name for name, _ in model.named_modules()):
            raise refuse("hf.mtp", f"{model_type} holds {mtp or 'mtp.*'}")
        return
    kinds = sorted(set(getattr(config, "layer_types", None) or ()) - _ATTENTION_LAYER_TYPES)
    recurrent = sorted({type(m).__name__ for m in model.modules()
                        if any(marker in type(m).__name__ for marker in _OTHER_RECURRENT_MARKERS)})
    if kinds or recurrent:
        raise refuse("hf.recurrent_family", f"{model_type} has recurrent layers "
                     f"({', '.join(kinds + recurrent)}); the Gated DeltaNet hybrids served are "
                     f"{', '.join(HYBRID_FAMILIES)}")



def install_sharing_gdn(model: torch.nn.Module) -> int:
    """Switches every GDN module of ``model`` (in place) to its sharing subclass; returns how
    many. The modules keep their parameters; call it before wrapping the model (FSDP)."""
    count = 0
    for parent in list(model.modules()):
        for name, module in parent.named_children():
            if _SWITCH.switch(module):
                _hand_plan_to_gdn(parent, name)
                count += 1
    return count


# the plan keywords a GDN module's parent layer received, for the duration of that layer's call
_HANDED = "_prefix_sharing_handed"


def _hand_plan_to_gdn(layer: torch.nn.Module, child: str) -> None:
    """Around every call of ``layer`` (gradient-checkpoint replays included), its GDN module
    ``child`` can read the plan keywords ``layer`` was called with: transformers 4.57's decoder
    layers drop them when they call the GDN module. (The hooks find the child by name, so a
    copy of the model hands the plan to its own modules.)"""

    def before(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        handed = {k: kwargs[k] for k in (PLAN_KWARG, BACKEND_KWARG) if k in kwargs}
        setattr(getattr(module, child), _HANDED, handed)

    def after(module: torch.nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        setattr(getattr(module, child), _HANDED, None)

    layer.register_forward_pre_hook(before, with_kwargs=True)
    layer.register_forward_hook(after, with_kwargs=True, always_call=True)


def check_sharing_gdn(model: torch.nn.Module) -> None:
    """Raises when a stock GDN module is left in a model that runs the sharing plan."""
    _SWITCH.check(model)


def _sharing_forward(self: Any, hidden_states: torch.Tensor, cache: Any = None,
                     attention_mask: torch.Tensor | None = None, **kwargs: Any) -> torch.Tensor:
    """The GDN layer on the plan's flat layout: ``(1, T_flat, hidden) -> (1, T_flat, hidden)``.

    Projections, gates and norms as transformers computes them; the convolution reads each
    row's predecessors on its own path, and the gated delta rule runs bucket by bucket from
    the parents' states (:mod:`prefix_sharing.recurrent`).
    """
    kwargs = {**(getattr(self, _HANDED, None) or {}), **kwargs}  # transformers 4.57: handed over
    schedule, backend = planned_mixer_inputs(self, "Gated DeltaNet", hidden_states, cache,
                                             attention_mask, kwargs)
    x = hidden_states[0]  # [T, hidden]
    total = x.size(0)
    mixed_qkv, z, b, a = _projections(self, x)  # [T, 2*key_dim + value_dim], [T, HV, Vd], ...
    mixed_qkv = causal_conv1d_over_schedule(mixed_qkv, self.conv1d.weight.squeeze(1),
                                            self.conv1d.bias, schedule,
                                            activation=self.activation, backend=backend)
    q, k, v = torch.split(mixed_qkv, [self.key_dim, self.key_dim, self.value_dim], dim=-1)
    q = q.reshape(total, -1, self.head_k_dim)  # [T, H, K]
    k = k.reshape(total, -1, self.head_k_dim)
    v = v.reshape(total, -1, self.head_v_dim)  # [T, HV, V]
    beta = b.sigmoid()
    g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)  # [T, HV]
    core = gated_delta_rule_over_schedule(q, k, v, g, beta, schedule,
                                          use_qk_l2norm_in_kernel=True, backend=backend)
    core = self.norm(core.reshape(-1, self.head_v_dim), z.reshape(-1, self.head_v_dim))
    return self.out_proj(core.reshape(1, total, -1))


def _projections(self: Any, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``(mixed_qkv [T, 2*key_dim + value_dim], z [T, HV, Vd], b [T, HV], a [T, HV])``:
    Qwen3-Next projects q/k/v/z and b/a grouped per key head, Qwen3.5 projects each apart."""
    total = x.size(0)
    if hasattr(self, "in_proj_qkvz"):  # Qwen3-Next
        q, k, v, z, b, a = self.fix_query_key_value_ordering(self.in_proj_qkvz(x[None]),
                                                             self.in_proj_ba(x[None]))
        mixed = torch.cat([t.reshape(total, -1) for t in (q, k, v)], dim=-1)
        return mixed, z[0], b[0], a[0]
    z = self.in_proj_z(x).reshape(total, -1, self.head_v_dim)
    return self.in_proj_qkv(x), z, self.in_proj_b(x), self.in_proj_a(x)


_SWITCH = InPlaceSwitch("Gated DeltaNet modules",
                        lambda m: type(m).__name__.endswith("GatedDeltaNet"), _sharing_forward,
                        "_prefix_sharing_gdn")
