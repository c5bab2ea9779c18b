"""Engines run a model plain and shared for ``prefix-sharing verify`` and ``bench``.

An engine is chosen by name; each says which parallel layouts it can run and runs the
:mod:`~prefix_sharing.engines.verify` and :mod:`~prefix_sharing.engines.bench` jobs in ranks
of its own (:mod:`~prefix_sharing.engines.launch`). ``megatron`` is the one engine today; the
HuggingFace engine joins with the FSDP shim.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os

import torch

from ..errors import InputError, MissingPackageError
from ..presets import ModelPreset
from ..refusals import refuse
from .bench import BenchRequest, bench_job
from .bench_cp import context_parallel_bench_job
from .hf import HFEngine
from .launch import run_distributed
from .verify import VerifyRequest, plain_runs_job, summarize, verify_cp_job, verify_job

__all__ = ["ENGINES", "Engine", "get_engine"]


@dataclasses.dataclass(frozen=True)
class Engine:
    name: str
    package: str  # what must be importable
    pip_extra: str

    def check_layout(self, model: ModelPreset, tp: int, pp: int, cp: int = 1) -> None:
        """Refuses tensor/pipeline/context-parallel sizes this model or machine cannot run."""
        if tp < 1 or pp < 1 or cp < 1:
            raise InputError(f"--tp, --pp and --cp must be at least 1; got tp={tp}, pp={pp}, "
                             f"cp={cp}")
        if torch.cuda.is_available():
            limit, unit = torch.cuda.device_count(), "GPUs"
        else:
            limit, unit = 2 * (os.cpu_count() or 1), "processes on this machine's CPU cores"
        if tp * pp * cp > limit:
            raise InputError(f"tp x pp x cp = {tp * pp * cp} ranks, but at most {limit} {unit} "
                             "can run here")
        _check_recurrent_layers(model, tp, cp)
        problems = []
        if model.num_attention_heads % tp:
            problems.append(f"its {model.num_attention_heads} attention heads")
        groups = model.num_query_groups
        if groups % tp and tp % groups:
            problems.append(f"its {groups} key/value groups")
        if model.vocab_size % tp or model.ffn_hidden_size % tp:
            problems.append("its vocabulary or MLP width")
        if problems:
            raise InputError(f"--tp {tp} does not divide the {model.name} preset: "
                             + ", ".join(problems))
        model.first_stage_layers(pp)  # refuses a split megatron cannot make

    def check_installed(self) -> None:
        if importlib.util.find_spec(self.package) is None:
            raise MissingPackageError(f"the {self.name} engine needs {self.package} "
                              f"(pip install 'prefix-sharing[{self.pip_extra}]')")

    def verify(self, request: VerifyRequest, tp: int = 1, pp: int = 1,
               cp: int = 1) -> list[dict]:
        """One report per micro-batch of the request (see :func:`verify.summarize`).

        With ``cp > 1`` the plain runs go first at context-parallel size 1 (megatron's stock
        attention refuses CP), then the shared run on ``tp x pp x cp`` ranks is compared
        with them; one step only.
        """
        self.check_installed()
        self.check_layout(request.preset, tp, pp, cp)
        if cp == 1:
            ranks = run_distributed(verify_job, tp * pp, request, tp=tp, pp=pp, timeout=3600)
        else:
            if request.steps != 1:
                raise InputError(f"--steps {request.steps} with --cp {cp}: context-parallel "
                                 "verification compares one step; use --steps 1")
            plain = run_distributed(plain_runs_job, tp * pp, request, tp=tp, pp=pp,
                                    timeout=3600)
            ranks = run_distributed(verify_cp_job, tp * pp * cp, request, plain, tp=tp, pp=pp,
                                    cp=cp, timeout=3600)
        return [summarize(ranks, i, request.dtype) for i in range(len(request.batches))]

    def bench(self, request: BenchRequest) -> list[dict]:
        self.check_installed()
        _check_recurrent_layers(request.preset)
        return run_distributed(bench_job, 1, request, timeout=3600)[0]

    def bench_context_parallel(self, request: BenchRequest, tp: int, pp: int,
                               cp: int) -> list[dict]:
        """``bench --cp N``: plain CP vs shared CP on ``tp x pp x cp`` ranks; the results of
        the first rank of the last pipeline stage (see :mod:`.bench_cp`)."""
        self.check_installed()
        self.check_layout(request.preset, tp, pp, cp)
        ranks = run_distributed(context_parallel_bench_job, tp * pp * cp, request, tp=tp, pp=pp,
                                cp=cp, timeout=3600)
        return ranks[tp * cp * (pp - 1)]


def _check_recurrent_layers(model: ModelPreset, tp: int = 1, cp: int = 1) -> None:
    """A hybrid preset's Gated DeltaNet layers: the megatron engine builds them (a HybridModel,
    :func:`~.megatron.preset_model`) on megatron-core 0.19.2, whose GDN module it shares; any
    other release would have to build them as something else, so it is refused. A Mamba-2
    hybrid preset is refused on every release (refusal ``cli.mamba_preset``, checked on 0.19.2's
    ``ssm/mamba_mixer.py``); so is a vision-language preset (``cli.vlm_preset``)."""
    if model.mamba is not None:
        raise refuse("cli.mamba_preset", f"the {model.name} preset has Mamba-2 layers")
    if model.image_grid is not None:
        raise refuse("cli.vlm_preset", f"the {model.name} preset is a vision-language model")
    if model.full_attention_every is None:
        return
    from ..megatron_ext.stock_gdn import serves_gated_delta_net

    if not serves_gated_delta_net():
        raise refuse("megatron.gdn_release",
                     f"the {model.name} preset has Gated DeltaNet layers; or use --engine hf")
    if cp > 1:
        raise refuse("megatron.gdn.context_parallel",
                     f"the {model.name} preset has Gated DeltaNet layers; cp={cp}")
    if model.linear_num_key_heads % tp:
        raise refuse("cli.gdn_key_heads", f"tp={tp} for the {model.name} preset's "
                     f"{model.linear_num_key_heads} Gated DeltaNet key heads")



ENGINES: dict[str, Engine | HFEngine] = {"megatron": Engine("megatron", "megatron.core", "megatron"),
                                       "hf": HFEngine()}


def get_engine(name: str) -> Engine:
    if name not in ENGINES:
        raise InputError(f"unknown engine {name!r}; choose from {', '.join(ENGINES)}")
    return ENGINES[name]
