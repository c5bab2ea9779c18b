"""A CPU rollout for verl's trainer: ``transformers`` token-in / token-out behind verl's
``RolloutReplica`` (the server side the agent loop calls) and ``ServerAdapter`` (the side in
each trainer worker that syncs the trained weights in before generation).

Generation is greedy and deterministic at any temperature (verl divides the trainer's logits
by ``rollout.temperature`` as well, so the tests keep it at 1 and let the rollout be greedy). The
k-th request for the same prompt since the last weight sync starts with the prompt's k-th most
likely next token and is greedy after it: a GRPO group of n requests then holds n different
responses that share exactly the prompt (plain greedy would give n identical ones, equal
rewards and zero advantages), and the group's set of responses is a function of the weights
alone. Which member of a group gets which branch follows request order, which verl's agent
loop does not fix: compare rollouts per group as sets.
"""

from __future__ import annotations

import asyncio
import json
import os
from typing import Any

import ray
import torch

from prefix_sharing.refusals import refuse


SERVER_NAME = "prefix_sharing_hf_cpu_server_{replica}"
TOKEN_LOG = "PREFIX_SHARING_CPU_ROLLOUT_LOG"  # a JSONL path: each generation's token ids


class HFGenerationServer:
    """One Ray actor per rollout replica holding a ``transformers`` copy of the policy."""

    def __init__(self, model_path: str, response_length: int) -> None:
        from transformers import AutoModelForCausalLM

        torch.set_num_threads(1)
        self.model = AutoModelForCausalLM.from_pretrained(
            model_path, dtype=torch.float32, attn_implementation="sdpa").eval()
        self.response_length = response_length
        eos = self.model.config.eos_token_id
        self.eos_ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        self.branch_counts: dict[tuple[int, ...], int] = {}
        self.lock = asyncio.Lock()
        self.global_steps = 0  # the step whose weights generate: verl's staleness metrics read it

    def load_weights(self, state: dict[str, torch.Tensor], global_steps: int | None) -> None:
        """The trained weights, HF-named; only tied weights may be absent."""
        missing, unexpected = self.model.load_state_dict(state, strict=False)
        tied = set(getattr(self.model, "_tied_weights_keys", None) or ())
        if unexpected or set(missing) - tied - {"lm_head.weight"}:
            raise RuntimeError(f"weight sync: missing {missing}, unexpected {unexpected}")
        self.branch_counts.clear()
        self.global_steps = global_steps or 0

    async def generate(self, prompt_ids: list[int], sampling_params: dict[str, Any],
                       request_id: str, **kwargs: Any):
        from verl.workers.rollout.replica import TokenOutput

        async with self.lock:  # one generation at a time: the order of branches is the order here
            key = tuple(int(t) for t in prompt_ids)
            branch = self.branch_counts.get(key, 0)
            self.branch_counts[key] = branch + 1
        tokens, log_probs = self._decode(list(key), branch)
        if os.environ.get(TOKEN_LOG):  # verl's rollout dump holds text only: the tests need ids
            with open(os.environ[TOKEN_LOG], "a") as log:
                log.write(json.dumps({"global_steps": self.global_steps, "prompt": list(key),
                                      "response": tokens}) + "\n")
        return TokenOutput(token_ids=tokens, log_probs=log_probs, stop_reason="completed",
                           extra_fields={"global_steps": self.global_steps})

    @torch.no_grad()
    def _decode(self, prompt: list[int], branch: int):
        out = self.model(torch.tensor([prompt]), use_cache=True)
        tokens: list[int] = []
        log_probs: list[float] = []
        for step in range(self.response_length):
            logp = torch.log_softmax(out.logits[0, -1].float(), dim=-1)
            if step == 0:
                token = int(logp.topk(branch % logp.numel() + 1).indices[-1])
            else:
                token = int(logp.argmax())
            tokens.append(token)
            log_probs.append(float(logp[token]))
            if token in self.eos_ids:
                break
            out = self.model(torch.tensor([[token]]), past_key_values=out.past_key_values,
                             use_cache=True)
        return tokens, log_probs

    # What verl's replica and checkpoint manager call around generation: nothing to do here.
    async def wake_up(self, tags=None): pass
    async def sleep(self): pass
    async def abort_all_requests(self, reset_prefix_cache=True, reject_request=False): return {}
    async def resume_generation(self): pass
    async def resume_engine_generation(self): pass
    async def open_submission_gate(self): pass
    async def clear_kv_cache(self): pass
    async def release_kv_cache(self): pass
    async def resume_kv_cache(self): pass
    async def start_profile(self, **kwargs): pass
    async def stop_profile(self): pass
    async def set_global_steps(self, global_steps): self.global_steps = global_steps
    async def wait_for_requests_to_drain(self): pass


def _model_path(model_config: Any) -> str:
    return getattr(model_config, "local_path", None) or model_config.path


def replica_class():
    from verl.workers.rollout.replica import RolloutReplica

    class HFReplica(RolloutReplica):
        """One generation server per replica, placed anywhere (it needs no accelerator)."""

        def rollout_worker_use_gpu(self) -> bool:
            return False

        async def launch_servers(self) -> None:
            name = SERVER_NAME.format(replica=self.replica_rank)
            server = ray.remote(HFGenerationServer).options(
                name=name, num_cpus=0, max_concurrency=self.max_concurrency,
            ).remote(_model_path(self.model_config), self.config.response_length)
            self.servers = [server]
            self._server_handle = server
            self._server_address = name

    return HFReplica


def adapter_class():
    import os

    from verl.workers.rollout.base import BaseRollout

    class HFServerAdapter(BaseRollout):
        """In each trainer worker: every rank walks the weight generator (FSDP gathers full
        tensors collectively); the replica's first rank sends them to its server."""

        def __init__(self, config, model_config, device_mesh, replica_rank: int = -1):
            super().__init__(config, model_config, device_mesh)
            world = (self.config.tensor_model_parallel_size * self.config.data_parallel_size
                     * self.config.pipeline_model_parallel_size)
            rank = int(os.environ.get("RANK", 0))
            self.replica_rank = rank // world if replica_rank == -1 else replica_rank
            self.is_sender = rank % world == 0

        async def resume(self, tags: list[str]) -> None:
            pass

        async def release(self) -> None:
            pass

        async def update_weights(self, weights, wire_format: str = "named_tensors", **kwargs):
            if wire_format != "named_tensors":
                raise refuse("verl.cpu_rollout_wire_format",
                             f"verl's checkpoint engine sent wire_format={wire_format!r}")
            state = {name: tensor.detach().to("cpu", copy=True) for name, tensor in weights}
            if self.is_sender:
                server = ray.get_actor(SERVER_NAME.format(replica=self.replica_rank))
                await server.load_weights.remote(state, kwargs.get("global_steps"))

    return HFServerAdapter


def register(name: str) -> None:
    """Put the rollout in both of verl's registries under ``name``."""
    from verl.workers.rollout import base, replica

    base._ROLLOUT_REGISTRY[(name, "async")] = f"{__name__}.HFServerAdapter"
    replica.RolloutReplicaRegistry.register(name, replica_class)


def __getattr__(attribute: str):
    # verl's get_rollout_class imports the adapter by dotted name, lazily.
    if attribute == "HFServerAdapter":
        return adapter_class()
    raise AttributeError(attribute)
