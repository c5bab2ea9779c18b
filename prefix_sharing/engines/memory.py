"""Peak memory of a ``verify`` or ``bench`` run, estimated before any rank starts.

A run that does not fit is killed by the kernel's out-of-memory killer part-way, after minutes,
with nothing said but a rank's exit code (and a machine others share is squeezed meanwhile). The
command estimates the run's peak from the plan and the model first and refuses, in one line, what
would not fit in the memory the machine has available now (:func:`check_fits`).

The estimate is the sum of

- the models' parameters and gradients (``verify``: the shared and the plain model in the run's
  dtype, the reference in float64 or float32, and the plain model's initial copy; ``bench``: the
  plain and the shared model, each with Adam's two moments), and
- the largest single forward+backward: per computed row the logits over the vocabulary
  (:data:`LOGIT_COPIES` live copies: logits, their log-softmax, the gradients, the float64
  reference's casts) and each layer's activations (:data:`ACTIVATION_COPIES` copies of the
  hidden and MLP widths), plus, where attention is megatron's unfused stock kernel, each
  layer's scores and probabilities for every (query, key) pair. The plain runs of ``verify``
  are that stock spec on *padded* input: every sequence takes the longest's rows and its
  attention is the full square - which is what makes a few long rows over a large vocabulary
  expensive.
- :data:`PROCESS_BYTES` per process (torch, megatron-core and the spawned ranks' own copies).

The constants are upper bounds from a measured run (``docs/cli.md``, Memory: 4 padded rows of 573
tokens over a 151k vocabulary peaked at 14.5 GiB, estimated at 17.6): the estimate should rather
refuse a run that would just fit than start one that is killed.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from ..errors import InputError
from ..flops import flops_per_token_and_pair
from ..presets import ModelPreset

__all__ = ["verify_peak_bytes", "bench_peak_bytes", "available_bytes", "check_fits", "GIB"]

GIB = 1024 ** 3
LOGIT_COPIES = 6
ACTIVATION_COPIES = 8
SCORE_COPIES = 3
PROCESS_BYTES = 600 * 1024 ** 2


def _parameters(model: ModelPreset) -> int:
    """Parameters of ``model``, from above: the multiply-adds one token takes through its
    linear layers (each weight a token passes, once) and the input embedding; an MoE model's
    scaled by its experts over the ones a token takes."""
    per_token, _ = flops_per_token_and_pair(model)
    experts = model.num_experts // model.moe_router_topk if model.num_experts else 1
    return per_token // 2 * max(1, experts) + model.vocab_size * model.hidden_size


def _step_bytes(model: ModelPreset, rows: int, pairs: int, element_bytes: int,
                tensor_parallel: int) -> int:
    """One forward+backward computing ``rows`` token rows and attending ``pairs`` (query, key)
    pairs per attention layer and head (see the module doc)."""
    width = model.hidden_size + (model.moe_ffn_hidden_size or model.ffn_hidden_size) * (
        model.moe_router_topk if model.num_experts else 1)
    per_row = (LOGIT_COPIES * model.vocab_size // tensor_parallel
               + ACTIVATION_COPIES * model.num_layers * width)
    heads = max(1, model.num_attention_heads // tensor_parallel)
    scores = SCORE_COPIES * model.num_layers * heads * pairs
    return (rows * per_row + scores) * element_bytes * tensor_parallel


def _padded(lengths: Sequence[int]) -> tuple[int, int]:
    """Rows and attended pairs per head of the padded ``[b, s]`` batch (the full square)."""
    longest = max(lengths)
    return len(lengths) * longest, len(lengths) * longest * longest


def verify_peak_bytes(model: ModelPreset, lengths: Sequence[int], element_bytes: int,
                      reference_bytes: int, world_size: int = 1,
                      tensor_parallel: int = 1) -> int:
    """The peak of ``verify`` on sequences of ``lengths`` (all ranks together). The shared run
    computes fewer rows than the padded plain runs, so these bound it."""
    params = _parameters(model) * (5 * element_bytes + 2 * reference_bytes)
    rows, pairs = _padded(lengths)
    step = _step_bytes(model, rows, pairs, max(element_bytes, reference_bytes), tensor_parallel)
    return params + step + PROCESS_BYTES * (1 + world_size)


def bench_peak_bytes(model: ModelPreset, batches: Sequence[Sequence[int]], element_bytes: int,
                     world_size: int = 1, tensor_parallel: int = 1,
                     token_budget: int | None = None) -> int:
    """The peak of ``bench`` over micro-batches of these sequence lengths (the largest one:
    they run one after another; with a ``token_budget``, micro-batches of that many rows). Its
    steps are packed and attend per segment through SDPA, whose CPU and GPU kernels keep no
    (query, key) matrix, so only rows count; the plain step's bound the shared step's."""
    params = _parameters(model) * 2 * 4 * element_bytes
    rows = max(sum(lengths) for lengths in batches)
    rows = rows if token_budget is None else min(rows, token_budget)
    step = _step_bytes(model, rows, 0, element_bytes, tensor_parallel)
    return params + step + PROCESS_BYTES * (1 + world_size)


def available_bytes() -> int:
    """Memory this process may still take: the kernel's MemAvailable, or what the cgroup's
    limit leaves when that is lower."""
    with open("/proc/meminfo") as meminfo:
        fields = dict(line.split(":", 1) for line in meminfo)
    available = int(fields["MemAvailable"].split()[0]) * 1024
    try:
        with open("/sys/fs/cgroup/memory.max") as limit_file:
            limit = limit_file.read().strip()
        with open("/sys/fs/cgroup/memory.current") as current_file:
            current = int(current_file.read())
    except OSError:
        return available
    return available if limit == "max" else min(available, int(limit) - current)


def check_fits(command: str, estimate: int, what: str, instead: str,
               available: int | None = None) -> None:
    """Refuses (one line, :class:`InputError`) a run whose estimated peak is over the memory
    available: the estimate, what it counts, the memory and what to pass instead."""
    if os.environ.get("PREFIX_SHARING_SKIP_MEMORY_CHECK") == "1":
        return
    available = available_bytes() if available is None else available
    if estimate > available:
        raise InputError(
            f"{command} would need about {estimate / GIB:.1f} GiB ({what}) but this machine has "
            f"{available / GIB:.1f} GiB available: {instead} (or set "
            "PREFIX_SHARING_SKIP_MEMORY_CHECK=1 to run anyway)")
