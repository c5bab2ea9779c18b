#!/usr/bin/env python
"""Peak memory of ``token_log_probs`` (forward + backward), before and after issue 7.

Counts the bytes of every tensor storage created while the computation runs and still alive
(a ``TorchDispatchMode`` that weakly references each new storage), at every aten op boundary,
and reports the peak in units of one ``(T_flat, vocab)`` fp32 buffer. The logits themselves are
not counted; their gradient is (one buffer for fp32 logits, half for bf16).

"before" is the autograd-traced implementation as it was at commit ``BEFORE`` (read from git
into memory, so the package keeps one implementation); "after" is the installed one. The
micro-batch is GRPO-shaped: one prompt (a quarter of the flat rows) shared by 4 responses.

    python scripts/bench_logprob_memory.py [--tokens 4096] [--vocab 32768] [--after-only]
"""

from __future__ import annotations

import argparse
import subprocess
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from prefix_sharing import PrefixSharingConfig, build_plan
from prefix_sharing.logprobs import token_log_probs
from prefix_sharing.plan import SharingPlan

BEFORE = "da0cd17807d31288a0d9c44179bc282735623cd8"  # last commit of the traced implementation
ROOT = Path(__file__).resolve().parents[1]


class LiveBytes(TorchDispatchMode):
    """Bytes of the storages created under this mode that are still alive; the peak of that.

    Storages of ``existing`` tensors (the inputs) are never counted, nor are views and in-place
    results, which reuse a storage already known. Frees are noticed at the next op, so the peak
    is exact at op boundaries (a kernel's internal scratch space is not seen).
    """

    def __init__(self, existing: list[torch.Tensor]) -> None:
        super().__init__()
        self._known = {t.untyped_storage()._cdata for t in existing}
        self._live: dict[int, tuple[StorageWeakRef, int]] = {}
        self.now = self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        for key, (ref, nbytes) in list(self._live.items()):
            if ref.expired():
                del self._live[key]
                self.now -= nbytes
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                if storage._cdata not in self._known and storage._cdata not in self._live:
                    self._live[storage._cdata] = (StorageWeakRef(storage), storage.nbytes())
                    self.now += storage.nbytes()
        self.peak = max(self.peak, self.now)
        return out


def grpo_plan(tokens: int, vocab: int, responses: int = 4) -> SharingPlan:
    """One prompt of ``tokens // 4`` rows read by ``responses`` sequences that own the rest."""
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, vocab, (tokens // 4,), generator=g)
    tail = (tokens - prompt.numel()) // responses
    seqs = [torch.cat([prompt, torch.randint(0, vocab, (tail,), generator=g)])
            for _ in range(responses)]
    return build_plan(seqs, PrefixSharingConfig(min_prefix_len=1))


def measure(log_probs_fn: Callable, plan: SharingPlan, vocab: int, dtype: torch.dtype) -> dict:
    """Peak extra bytes of forward, held for backward, and forward+backward, of the loss
    ``sum(w * log_probs) + sum(entropy)`` (both outputs get a gradient)."""
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(plan.num_tokens_flat, vocab, generator=g).to(dtype).requires_grad_()
    weights = torch.rand(plan.num_tokens_total, generator=g)
    plan_tensors = [plan.kv_index, plan.next_token_ids, plan.is_last_token]
    with LiveBytes([logits, weights, *plan_tensors]) as mode:
        stats = log_probs_fn(logits, plan)
        loss = (weights * stats.log_probs).sum() + stats.entropy.sum()
        forward_peak, held = mode.peak, mode.now
        loss.backward()
    return {"forward": forward_peak, "held": held, "total": mode.peak}


def before_implementation() -> Callable:
    """``token_log_probs`` as of :data:`BEFORE`, loaded from git into a throwaway module."""
    shown = subprocess.run(["git", "show", f"{BEFORE}:prefix_sharing/logprobs.py"], cwd=ROOT,
                           capture_output=True, text=True)
    if shown.returncode != 0:
        raise SystemExit(f"cannot read the 'before' implementation from git "
                         f"({shown.stderr.strip()}); run with --after-only, or in a full clone")
    source = shown.stdout
    module = ModuleType("prefix_sharing._logprobs_before")
    module.__package__ = "prefix_sharing"
    exec(compile(source, f"{BEFORE[:8]}:prefix_sharing/logprobs.py", "exec"), module.__dict__)
    return module.token_log_probs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=4096, help="flat rows T_flat")
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--after-only", action="store_true",
                        help="skip the 'before' rows (no git history needed)")
    args = parser.parse_args()
    plan = grpo_plan(args.tokens, args.vocab)
    buffer = plan.num_tokens_flat * args.vocab * 4
    impls = {"after": token_log_probs}
    if not args.after_only:
        impls = {"before": before_implementation(), **impls}
    print(f"T_flat={plan.num_tokens_flat} T_total={plan.num_tokens_total} V={args.vocab}: "
          f"one (T_flat, V) fp32 buffer = {buffer / 2**20:.1f} MiB; peaks in buffers")
    print(f"{'impl':<7} {'logits':<9} {'forward':>8} {'held':>8} {'fwd+bwd':>8}")
    for dtype in (torch.float32, torch.bfloat16):
        for name, fn in impls.items():
            m = measure(fn, plan, args.vocab, dtype)
            print(f"{name:<7} {str(dtype).removeprefix('torch.'):<9} {m['forward'] / buffer:>8.2f} "
                  f"{m['held'] / buffer:>8.2f} {m['total'] / buffer:>8.2f}")


if __name__ == "__main__":
    main()
