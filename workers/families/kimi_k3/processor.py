"""Kimi K3's image processor (MoonViT3d's input), in transformers' PIL/NumPy backend: the rule of Kimi K2.5's
processor (transformers' `Kimi_K25ImageProcessor`, which needs torchvision).

- Resize: never up; down (bicubic) by the most restrictive of the total patch budget (`max_patches`) and the
  per-side limit (`size["max_height"]` patches a side), keeping the aspect ratio (int-truncated sides).
- Pad: bottom and right with zeros (before normalising) to a multiple of patch x merge pixels, so the grid splits
  into whole 2x2 windows.
- Rescale to [0, 1], normalise (mean = std = 0.5), and cut into [patches, 3, patch, patch] in raster order.
An image's tokens: rows x columns of patches / merge² (`image_grid_thw` is (1, rows, columns))."""

from __future__ import annotations

import math

import numpy as np
from transformers.image_processing_backends import PilBackend
from transformers.image_processing_utils import BatchFeature
from transformers.image_utils import IMAGENET_STANDARD_MEAN, IMAGENET_STANDARD_STD, PILImageResampling, SizeDict
from transformers.processing_utils import ImagesKwargs


class KimiK3ImageProcessorKwargs(ImagesKwargs, total=False):
    max_patches: int
    patch_size: int
    merge_size: int


def resized_and_padded(height: int, width: int, patch_size: int, merge_size: int, max_patches: int,
                       max_side_patches: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """((height, width) after the resize, (height, width) after padding) of an image of `height` x `width`."""
    patches = max(1, height // patch_size) * max(1, width // patch_size)
    limit = max_side_patches * patch_size
    scale = min(1.0, math.sqrt(max_patches / patches), limit / height, limit / width)
    new_height = min(max(1, int(height * scale)), limit)
    new_width = min(max(1, int(width * scale)), limit)
    factor = patch_size * merge_size
    return (new_height, new_width), (-(-new_height // factor) * factor, -(-new_width // factor) * factor)


class KimiK3ImageProcessor(PilBackend):
    do_resize = True
    resample = PILImageResampling.BICUBIC
    size = {"max_height": 512, "max_width": 512}  # patches a side
    max_patches = 16384
    do_rescale = True
    do_normalize = True
    image_mean = IMAGENET_STANDARD_MEAN
    image_std = IMAGENET_STANDARD_STD
    do_convert_rgb = True
    patch_size = 14
    merge_size = 2
    valid_kwargs = KimiK3ImageProcessorKwargs
    model_input_names = ["pixel_values", "image_grid_thw"]

    def _sizes(self, height: int, width: int, size, patch_size: int, merge_size: int, max_patches: int):
        max_side = size["max_height"] if isinstance(size, dict) else size.max_height
        return resized_and_padded(height, width, patch_size, merge_size, max_patches, max_side)

    def _preprocess(self, images: list[np.ndarray], do_resize: bool, size: SizeDict, resample, do_rescale: bool,
                    rescale_factor: float, do_normalize: bool, image_mean, image_std, patch_size: int,
                    merge_size: int, max_patches: int, return_tensors=None, **kwargs) -> BatchFeature:
        patches, grids = [], []
        for image in images:  # [channels, height, width]
            height, width = image.shape[-2:]
            resized, padded = self._sizes(height, width, size, patch_size, merge_size, max_patches)
            if do_resize and resized != (height, width):
                image = self.resize(image, SizeDict(height=resized[0], width=resized[1]), resample=resample)
            elif not do_resize:
                padded = tuple(-(-n // (patch_size * merge_size)) * patch_size * merge_size for n in (height, width))
            image = self.pad([image], pad_size=SizeDict(height=padded[0], width=padded[1]))[0]
            if do_rescale:
                image = self.rescale(image, rescale_factor)
            if do_normalize:
                image = self.normalize(image, image_mean, image_std)
            rows, columns = padded[0] // patch_size, padded[1] // patch_size
            cut = image.reshape(image.shape[0], rows, patch_size, columns, patch_size).transpose(1, 3, 0, 2, 4)
            patches.append(cut.reshape(rows * columns, image.shape[0], patch_size, patch_size))
            grids.append([1, rows, columns])
        return BatchFeature(data={"pixel_values": np.concatenate(patches).astype(np.float32),
                                  "image_grid_thw": np.array(grids, dtype=np.int64)}, tensor_type=return_tensors)

    def get_number_of_image_patches(self, height: int, width: int, images_kwargs: dict | None = None) -> int:
        """Patches of an image of `height` x `width` (the driver's row-length check counts tokens with it)."""
        kwargs = images_kwargs or {}
        _, (padded_height, padded_width) = self._sizes(
            height, width, kwargs.get("size", self.size), kwargs.get("patch_size", self.patch_size),
            kwargs.get("merge_size", self.merge_size), kwargs.get("max_patches", self.max_patches))
        patch = kwargs.get("patch_size", self.patch_size)
        return (padded_height // patch) * (padded_width // patch)
