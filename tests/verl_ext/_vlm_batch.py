"""Vision-language batches laid out as verl's legacy trainer hands them to its engines.

Each sample: a prompt and a response of token ids, its images in verl's per-sample
``multi_modal_inputs`` layout (``pixel_values``: every patch of its images; ``image_grid_thw``:
one ``(t, h, w)`` row per image) and verl's 4-row ``position_ids``, computed as verl's agent
loop computes them (``_compute_position_ids``: the model's ``get_rope_index`` with
``mm_token_type_ids`` over the whole sequence, under a text row ``0..L-1``).

- ``grpo_images``: 2 prompts x 3 responses, one image per prompt (different images);
  ``same_tokens=True`` gives both prompts the same tokens (only their images differ);
- ``multi_turn``: 3 trajectories of an agent whose turns each bring a screenshot: all share
  turn 1 (its image and reply); two go on to a second turn, each with its own screenshot;
- ``text_only``: 2 prompts x 3 responses without images (``multi_modal_inputs`` ``None``).
"""

from __future__ import annotations

import torch

from tests.fsdp_compat._vlm import placeholder_ids, random_image

from ._batch import PRESET, legacy_batch

TEXT_VOCAB = PRESET.vocab_size - 4  # the last four ids are the vision specials
GRID = (8, 8)  # patches per image: 16 placeholder tokens after the 2x2 merge


class Samples:
    """Prompts, responses and images drawn from a seeded generator."""

    def __init__(self, config, seed: int) -> None:
        self.config, self.gen = config, torch.Generator().manual_seed(seed)
        self.prompts, self.responses, self.images, self.uids = [], [], [], []

    def text(self, n: int) -> torch.Tensor:
        return torch.randint(0, TEXT_VOCAB, (n,), generator=self.gen)

    def image(self) -> dict:
        return random_image(self.gen, *GRID, torch.float32)

    def placeholders(self, image: dict) -> torch.Tensor:
        return placeholder_ids(self.config, image)

    def add(self, prompt: list[torch.Tensor], response: list[torch.Tensor], images: list[dict],
            uid: str) -> None:
        self.prompts.append(torch.cat(prompt))
        self.responses.append(torch.cat(response))
        self.images.append({key: torch.cat([i[key] for i in images]) for key in images[0]}
                           if images else None)  # None: a text-only sample, as verl stores it
        self.uids.append(uid)


def grpo_images(s: Samples, same_tokens: bool = False) -> None:
    shared = s.text(3), s.text(4)
    for p in range(2):
        image = s.image()
        before, after = shared if same_tokens else (s.text(3), s.text(4))
        prompt = [before, s.placeholders(image), after]
        for _ in range(3):
            s.add(prompt, [s.text(int(torch.randint(3, 7, (1,), generator=s.gen)))], [image],
                  f"u{p}")


def multi_turn(s: Samples) -> None:
    first = s.image()
    prompt = [s.text(3), s.placeholders(first), s.text(2)]
    reply = s.text(4)
    for _ in range(2):  # a second turn with its own screenshot
        second = s.image()
        s.add(prompt, [reply, s.text(2), s.placeholders(second), s.text(1), s.text(3)],
              [first, second], "u0")
    s.add(prompt, [s.text(5)], [first], "u0")  # another first reply, no second turn


def text_only(s: Samples) -> None:
    """GRPO without images: a text-only micro-batch of a vision-language model."""
    for p in range(2):
        prompt = [s.text(6)]
        for _ in range(3):
            s.add(prompt, [s.text(int(torch.randint(3, 7, (1,), generator=s.gen)))], [], f"u{p}")


WORKLOADS = {"grpo_images": grpo_images, "multi_turn": multi_turn,
             "grpo_same_tokens": lambda s: grpo_images(s, same_tokens=True),
             "text_only": text_only}


def verl_positions(model, sequence: torch.Tensor,
                   image_grid_thw: torch.Tensor | None) -> torch.Tensor:
    """``(4, L)``: the text row over the mrope rows, as verl's agent loop builds them."""
    ids = sequence[None]
    types = (ids == model.config.image_token_id).long()
    rows, _ = model.model.get_rope_index(input_ids=ids, attention_mask=torch.ones_like(ids),
                                         mm_token_type_ids=types, image_grid_thw=image_grid_thw)
    return torch.cat([torch.arange(ids.size(1))[None], rows[:, 0]])


def make_vlm_batch(model, workload: str, *, seed: int = 0, temperature: float = 0.9):
    """The workload's samples as verl's legacy trainer lays them out, one micro-batch
    (``model``: a VLM of the checkpoint's config, for its ``get_rope_index``)."""
    from verl.utils import tensordict_utils as tu

    s = Samples(model.config, seed)
    WORKLOADS[workload](s)
    n = len(s.prompts)
    gen = torch.Generator().manual_seed(seed + 1)
    terms = {key: [-torch.rand(len(r), generator=gen) for r in s.responses]
             for key in ("old_log_probs", "ref_log_prob")}
    terms["advantages"] = [torch.rand(len(r), generator=gen) for r in s.responses]
    with torch.no_grad():
        positions = [verl_positions(model, torch.cat([p, r]),
                                    None if mm is None else mm["image_grid_thw"])
                     for p, r, mm in zip(s.prompts, s.responses, s.images)]
    data = legacy_batch(s.prompts, s.responses, s.uids, torch.full((n,), temperature), terms,
                        positions=positions, multi_modal_inputs=s.images)
    tu.assign_non_tensor(data, calculate_entropy=True, use_dynamic_bsz=False,
                         micro_batch_size_per_gpu=n, global_batch_size=n)
    return data


def sample_tags(data, config) -> list[list[tuple[int, int]]]:
    """Each sample's tokens as ``(token, image)`` pairs (``image``: the distinct image behind a
    placeholder, by pixel content, else -1): what sharing may treat as the same token."""
    distinct: dict[bytes, int] = {}
    out = []
    for ids, mm in zip(data["input_ids"].unbind(), data["multi_modal_inputs"]):
        mm = getattr(mm, "data", mm) or {"image_grid_thw": torch.zeros(0, 3, dtype=torch.long),
                                         "pixel_values": torch.zeros(0)}
        patches = mm["image_grid_thw"].prod(-1).tolist()
        keys = [distinct.setdefault(piece.numpy().tobytes(), len(distinct))
                for piece in torch.split(mm["pixel_values"], patches)]
        per_image = [n // 4 for n in patches]
        owner = [k for k, n in zip(keys, per_image) for _ in range(n)]
        tags, j = [], 0
        for token in ids.tolist():
            if token == config.image_token_id:
                tags.append((token, owner[j]))
                j += 1
            else:
                tags.append((token, -1))
        out.append(tags)
    return out


def distinct_prefixes(tags: list[list[tuple[int, int]]]) -> int:
    """Tokens a forward that computes every shared prefix once computes: the distinct prefixes
    (a trie's nodes) of the samples."""
    return len({tuple(t[: k + 1]) for t in tags for k in range(len(t))})
