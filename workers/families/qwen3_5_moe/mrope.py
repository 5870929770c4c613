"""Qwen3.5's multimodal RoPE positions for a whole micro-batch at once, in place of transformers' `get_rope_index`,
which walks row by row and run by run in Python (itertools.groupby over each row's token types, a few small
tensors per run): 3.3 ms of every forward at the image bench's 32 rows a rank, ~3 % of its step, and on a GPU a
host sync and a dozen launches per row.

The rule is transformers': a row is cut into runs of one token type. A text run continues the row's position
counter (the same position on the three axes) and advances it by its length. An image run takes the next grid
(t, h, w) of `image_grid_thw` in row-major order; its token j sits at the counter plus (t_j, h_j, w_j), j unravelled
over (t, h / merge, w / merge); it advances the counter by max(h, w) / merge. Here every token finds its run by
cumulative sums over the flattened batch, with fixed shapes: a few host reads for the checks, none per row. Batches
with a padding mask or with videos keep transformers' walk.
"""

from __future__ import annotations

import types

import torch


def mrope_positions(token_types: torch.Tensor, image_grid_thw: torch.Tensor, merge: int):
    """(position ids [3, B, T], deltas [B, 1]: the row's largest position + 1 − T) for text (0) and image (1)
    tokens; None where the image runs and the grids disagree, in number or in a run's length, or where a token is
    of another type (video): transformers' walk then decides."""
    rows, length = token_types.shape
    kinds = token_types.flatten()
    index = torch.arange(kinds.numel(), device=kinds.device)
    new_run = torch.ones_like(token_types, dtype=torch.bool)
    new_run[:, 1:] = token_types[:, 1:] != token_types[:, :-1]
    new_run = new_run.flatten()
    run = new_run.cumsum(0) - 1  # each token's run, numbered over the batch
    offset = index - torch.cummax(torch.where(new_run, index, 0), 0).values  # each token's place in its run
    image = kinds == 1
    image_runs = (new_run & image).cumsum(0)
    grid = image_grid_thw[(image_runs - 1).clamp(0, len(image_grid_thw) - 1)]  # each token's image grid
    height, width = grid[:, 1] // merge, grid[:, 2] // merge
    run_length = torch.zeros_like(index).index_add_(0, run, torch.ones_like(index))
    run_image_advance = torch.zeros_like(index).index_put_((run,), torch.maximum(height, width))
    run_image = torch.zeros_like(new_run).index_put_((run,), image)
    counts = grid[:, 0] * height * width
    short = run_image & (torch.zeros_like(index).index_put_((run,), counts) != run_length)
    if bool(short.any() | (image_runs[-1] != len(image_grid_thw)) | (kinds > 1).any()):
        return None
    advance = torch.where(run_image, run_image_advance, run_length)
    before = advance.cumsum(0) - advance  # every earlier run's advance, over the whole batch
    row_first_run = run.view(rows, length)[:, 0]
    start = before[run] - before[row_first_run].repeat_interleave(length)  # the row's counter at the token's run
    plane = height * width
    positions = torch.stack([
        torch.where(image, offset // plane.clamp(min=1), offset),
        torch.where(image, offset % plane.clamp(min=1) // width.clamp(min=1), offset),
        torch.where(image, offset % width.clamp(min=1), offset)]) + start
    positions = positions.view(3, rows, length)
    deltas = positions.amax(dim=(0, 2)) + 1 - length
    return positions, deltas.unsqueeze(1)


def _batched_rope_index(self, input_ids, mm_token_type_ids, image_grid_thw=None, video_grid_thw=None,
                        attention_mask=None, **kwargs):
    """get_rope_index's contract, batched where the rows are text and images only and unpadded."""
    plain = (video_grid_thw is None and image_grid_thw is not None and image_grid_thw.numel() > 0
             and (attention_mask is None or bool(attention_mask.all())))
    found = mrope_positions(mm_token_type_ids, image_grid_thw, self.config.vision_config.spatial_merge_size) \
        if plain else None
    if found is None:
        return type(self).get_rope_index(self, input_ids, mm_token_type_ids, image_grid_thw=image_grid_thw,
                                         video_grid_thw=video_grid_thw, attention_mask=attention_mask, **kwargs)
    return found[0].to(input_ids.dtype), found[1]


def batch_rope_index(model) -> int:
    """The model's multimodal RoPE positions computed for the whole batch at once; returns the modules changed."""
    changed = 0
    for module in model.modules():
        if type(module).__name__ == "Qwen3_5MoeModel" and "get_rope_index" not in vars(module):
            module.get_rope_index = types.MethodType(_batched_rope_index, module)
            changed += 1
    return changed
