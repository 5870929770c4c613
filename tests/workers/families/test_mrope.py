"""Qwen3.5's batched multimodal RoPE positions equal transformers' own row-by-row walk (get_rope_index) on
micro-batches of text runs and images of different grids, and batches it does not cover take the walk."""

import pytest
import torch

from moetune.workers.families import REGISTRY
from moetune.workers.families.qwen3_5_moe.mrope import batch_rope_index, mrope_positions
from bench.support.tiny_models import plain_model

MERGE = REGISTRY["qwen3_5_moe"].tiny_config().vision_config.spatial_merge_size


@pytest.fixture(scope="module")
def model():
    return plain_model(REGISTRY["qwen3_5_moe"]).model


def _batch(seed: int, rows: int = 6):
    """Token types [rows, T] (text runs between images, rows padded with text) and the images' grids in order."""
    g = torch.Generator().manual_seed(seed)
    types, grids = [], []
    for _ in range(rows):
        row = []
        for _ in range(int(torch.randint(0, 4, (), generator=g))):
            row += [0] * int(torch.randint(1, 6, (), generator=g))
            t = int(torch.randint(1, 3, (), generator=g))  # the walk takes any t (images have 1)
            h, w = (MERGE * int(torch.randint(1, 4, (), generator=g)) for _ in range(2))
            grids.append([t, h, w])
            row += [1] * (t * h * w // MERGE**2)
        types.append(row + [0] * int(torch.randint(0 if row else 1, 4, (), generator=g)))
    length = max(map(len, types))
    padded = torch.tensor([row + [0] * (length - len(row)) for row in types], dtype=torch.int32)
    return padded, torch.tensor(grids, dtype=torch.long).reshape(-1, 3)


@pytest.mark.parametrize("seed", range(6))
def test_batched_positions_equal_transformers(model, seed):
    types, grids = _batch(seed)
    ids = torch.zeros(types.shape, dtype=torch.long)
    want = type(model).get_rope_index(model, ids, types, image_grid_thw=grids)
    got = mrope_positions(types, grids, MERGE)
    assert got is not None and grids.shape[0] > 0
    torch.testing.assert_close(got[0], want[0], rtol=0, atol=0)
    torch.testing.assert_close(got[1], want[1], rtol=0, atol=0)


def test_the_swap_takes_the_walk_where_it_does_not_apply(model):
    types, grids = _batch(1)
    ids = torch.zeros(types.shape, dtype=torch.long)
    swapped = plain_model(REGISTRY["qwen3_5_moe"])
    assert REGISTRY["qwen3_5_moe"].apply_kernel_swaps(swapped)["batch_rope_index"] == 1
    inner = swapped.model
    assert batch_rope_index(swapped) == 0  # once
    mask = torch.ones_like(types)
    mask[0, -1] = 0  # a padded row: transformers counts positions over the unmasked tokens
    for kwargs in ({}, {"attention_mask": mask}):
        want = type(model).get_rope_index(model, ids, types, image_grid_thw=grids, **kwargs)
        got = inner.get_rope_index(ids, types, image_grid_thw=grids, **kwargs)
        torch.testing.assert_close(got[0], want[0], rtol=0, atol=0)
        torch.testing.assert_close(got[1], want[1], rtol=0, atol=0)
    short = grids.clone()
    short[0, 1] += MERGE  # the first image's run is shorter than its grid says
    assert mrope_positions(types, short, MERGE) is None
    assert mrope_positions(types, grids[:-1], MERGE) is None  # an image run without a grid
    assert mrope_positions(types, torch.cat([grids, grids[:1]]), MERGE) is None  # a grid without an image
    video = types.clone()
    video[0, 0] = 2
    assert mrope_positions(video, grids, MERGE) is None
