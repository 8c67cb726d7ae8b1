"""Training-time augmentation of pixel inputs: open_clip's RandomResizedCrop, replayable from ids.

open_clip trains with ``RandomResizedCrop(S, scale=(0.9, 1.0), ratio=(3/4, 4/3), bicubic)``. Here each
sample's crop is a pure function of (seed, global step, global sample id) (:func:`crop_draws`): it never
depends on the rank, the DataLoader worker or any generator state, so K ranks crop exactly as one
process does, and a run resumed at step t (at any world size) replays the same pixels. A sample occurs
at most once per global batch, so (step, id) names one crop.

The crop is taken from the stored square image (``toolkit data precompute`` stores pixels
``ceil(S / crop_scale_min)`` px wide, docs/data-format.md) and resized to S px with Pillow's bicubic
filter (antialiased). Without augmentation the whole stored square is resized to S: the centre crop
precompute made, at the model's size. Frozen-tower features are never augmented (there are no pixels),
and evaluation does not use this module. Called in the loader's workers (or the training process with
0 workers); with ``crop_on`` the device (:class:`DeviceCrop`), the workers only draw each sample's box and
the training process resizes the batch at once (:func:`resize_crops`, same taps, within 2 grey levels).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from toolkit.core.config import option

if TYPE_CHECKING:
    import numpy as np
    import torch
# numpy, torch and the decoders are imported where used: TrainConfig (and so `toolkit --help`) imports
# AugmentConfig from here.

# resize_crops works on this many samples at a time, so that its float32 temporaries stay small on the device
# (64 x 3 x 249 x 224 x 4 B = 43 MB each) whatever the batch.
RESIZE_CHUNK = 64
# Mixing constants of the per-(seed, step, id) streams: odd 64-bit numbers unrelated to order.py's keys.
_STEP_MULT, _ID_MULT, _DRAW_MULT = 0xD6E8FEB86659FD93, 0xA0761D6478BD642F, 0xE7037ED1A0B428DB


@dataclass(frozen=True)
class AugmentConfig:
    """Random crops of pixel inputs (open_clip's train transform); ignored for frozen-tower features."""

    random_crop: bool = option(
        True,
        absent_means=False,
        doc="RandomResizedCrop each training image (open_clip's train transform); "
        "off: the stored centre crop, resized to the model's size.",
    )
    scale_min: float = option(
        0.9, absent_means=0.9, gt=0, le=1, doc="Smallest crop area, as a fraction of the stored image."
    )
    scale_max: float = option(
        1.0, absent_means=1.0, gt=0, le=1, doc="Largest crop area, as a fraction of the stored image."
    )
    ratio_min: float = option(
        0.75, absent_means=0.75, gt=0, doc="Smallest crop aspect ratio (width / height), drawn log-uniformly."
    )
    ratio_max: float = option(
        4 / 3, absent_means=4 / 3, gt=0, doc="Largest crop aspect ratio (width / height)."
    )
    crop_on: Literal["auto", "loader", "device"] = option(
        "auto",
        affects_output=False,
        omit_at_default=True,
        doc="Where the crop's resize runs: 'loader' (its workers, per sample on the CPU), 'device' (the "
        "loader sends the stored pixels and crop boxes; one batched resize on the training device), "
        "'auto': the device on CUDA, the loader on the CPU and when the batch is offloaded.",
    )

    def __post_init__(self) -> None:
        if self.scale_min > self.scale_max or self.ratio_min > self.ratio_max:
            raise ValueError(
                f"augment: need scale_min <= scale_max and ratio_min <= ratio_max, got scale "
                f"({self.scale_min}, {self.scale_max}), ratio ({self.ratio_min}, {self.ratio_max})"
            )


def _uniforms(seed: int, step: int, ids: np.ndarray, count: int) -> np.ndarray:
    """[len(ids), count] float64 in [0, 1): splitmix64 streams keyed by (seed, step, id)."""
    import numpy as np

    from toolkit.core.seeds import splitmix64

    with np.errstate(over="ignore"):
        base = splitmix64(np.array([seed & 0xFFFFFFFFFFFFFFFF], np.uint64))
        base = splitmix64(base ^ (np.uint64(step & 0xFFFFFFFFFFFFFFFF) * np.uint64(_STEP_MULT)))
        keys = splitmix64(base ^ (ids.astype(np.uint64) * np.uint64(_ID_MULT)))
        draws = splitmix64(
            keys[:, None] + np.arange(1, count + 1, dtype=np.uint64)[None, :] * np.uint64(_DRAW_MULT)
        )
    return (draws >> np.uint64(11)).astype(np.float64) * 2.0**-53


def crop_draws(cfg: AugmentConfig, seed: int, step: int, ids: np.ndarray) -> np.ndarray:
    """Crop draws [n, 4] (area fraction, aspect ratio, x, y; toolkit.data.images.crop_box) for sample ids
    ``ids`` [n] of global batch ``step``: area uniform in [scale_min, scale_max], ratio log-uniform in
    [ratio_min, ratio_max], as torchvision draws them."""
    import numpy as np

    u = _uniforms(seed, step, ids, 4)
    area = cfg.scale_min + u[:, 0] * (cfg.scale_max - cfg.scale_min)
    lo, hi = math.log(cfg.ratio_min), math.log(cfg.ratio_max)
    return np.stack([area, np.exp(lo + u[:, 1] * (hi - lo)), u[:, 2], u[:, 3]], axis=1)


def crop_pixels(images: np.ndarray, size: int, draws: np.ndarray | None):
    """uint8 [n, H, W, 3] -> uint8 tensor [n, size, size, 3]: each image's crop (``draws`` [n, 4], or
    None for the whole image) resized bicubically (antialiased) to size x size.

    The crops stay channels-last views of ``images`` (no copy) and torch's resize writes channels-last,
    which measured ~25 % faster than a channels-first copy; the resize is most of the cost."""
    import numpy as np
    import torch
    from torch.nn.functional import interpolate

    from toolkit.data.images import crop_box

    n, height, width = images.shape[:3]
    hwc = torch.from_numpy(np.ascontiguousarray(images))
    if draws is None and (height, width) == (size, size):
        return hwc
    out = torch.empty((n, size, size, 3), dtype=torch.uint8)
    for i in range(n):
        left, top, cw, ch = crop_box(width, height, None if draws is None else draws[i])
        crop = (
            hwc[i, top : top + ch, left : left + cw].permute(2, 0, 1).unsqueeze(0)
        )  # [1, 3, ch, cw] channels-last
        if (ch, cw) == (size, size):
            out[i] = crop[0].permute(1, 2, 0)
            continue
        resized = interpolate(crop, size=(size, size), mode="bicubic", antialias=True)
        out[i] = resized[0].permute(1, 2, 0)
    return out


@dataclass(frozen=True)
class PixelTransform:
    """The loader's per-batch image step for pixel training data (picklable: runs in DataLoader workers).

    ``size``: the model's side; ``augment`` None: no random crop (whole image resized to ``size``)."""

    size: int
    seed: int = 0
    augment: AugmentConfig | None = None

    def __call__(self, images: np.ndarray, ids: np.ndarray, step: int):
        """images uint8 [b, H, W, 3] of global sample ids [b] in global batch ``step`` -> [b, size, size,
        3]."""
        draws = None if self.augment is None else crop_draws(self.augment, self.seed, step, ids)
        return crop_pixels(images, self.size, draws)


def crop_boxes(height: int, width: int, draws: np.ndarray | None, n: int) -> np.ndarray:
    """int64 [n, 4] (left, top, crop width, crop height) in a ``width`` x ``height`` image: the boxes
    :func:`crop_pixels` cuts for ``draws`` [n, 4] (None: the centred square, the whole of a square image)."""
    import numpy as np

    from toolkit.data.images import crop_box

    if draws is None:
        return np.tile(np.array([crop_box(width, height, None)], np.int64), (n, 1))
    return np.array([crop_box(width, height, d) for d in draws], np.int64).reshape(n, 4)


def _cubic(x: np.ndarray) -> np.ndarray:
    """Keys' cubic kernel with a = -0.5 (Pillow's and torch's antialiased bicubic filter)."""
    import numpy as np

    a, x = -0.5, np.abs(x)
    near = ((a + 2) * x - (a + 3)) * x * x + 1
    far = ((a * x - 5 * a) * x + 8 * a) * x - 4 * a
    return np.where(x < 1, near, np.where(x < 2, far, 0.0))


def resize_taps(
    starts: np.ndarray, lengths: np.ndarray, size: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(input index int64 [n, size, K], weight float64 [n, size, K], taps used int64 [n]) of output pixel i of
    sample k when the span [starts[k], starts[k] + lengths[k]) is resized to ``size`` pixels, exactly as
    torch's ``interpolate(mode="bicubic", antialias=True)`` weighs the cropped span alone: kernel widened by
    the scale when shrinking, taps clamped to the span, each row normalised. Sample k's rows use taps
    0 .. used[k]-1; the rest (K is the widest row's) have weight 0 and point inside the span. A sample's
    taps do not depend on the other samples (the padding to K does not change them)."""
    import numpy as np

    scale = (lengths / size).astype(np.float64)[:, None, None]  # [n, 1, 1]
    support = 2.0 * np.maximum(scale, 1.0)
    center = scale * (np.arange(size, dtype=np.float64)[None, :, None] + 0.5)  # [n, size, 1], span-relative
    lo = np.maximum(np.trunc(center - support + 0.5), 0)
    hi = np.minimum(np.trunc(center + support + 0.5), lengths[:, None, None])
    j = lo + np.arange(int((hi - lo).max()), dtype=np.float64)[None, None, :]  # [n, size, K], span-relative
    w = np.where(j < hi, _cubic((j - center + 0.5) / np.maximum(scale, 1.0)), 0.0)
    # Summed left to right (cumsum), not w.sum(axis=2): numpy sums 8 or more terms pairwise, so a row's total
    # (and its last bits) would depend on how many zero taps pad it, i.e. on the widest row of the other
    # samples. For K <= 7 this is the order numpy sums in.
    total = np.cumsum(w, axis=2)[:, :, -1:]
    idx = np.minimum(j, hi - 1).astype(np.int64) + starts[:, None, None]
    return idx, w / np.where(total == 0, 1.0, total), (hi - lo).max(axis=(1, 2)).astype(np.int64)


def _resize_last(x: torch.Tensor, index: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """float [n, c, h, W] -> [n, c, h, size]: sum over taps k of x[..., index[:, :, k]] * weight[:, :, k]
    (index int64, weight float32, both [n, size, K] on x's device), rounded and clipped to 0..255 (the uint8
    path stores each pass's result as uint8)."""
    import torch

    n, c, h = x.shape[:3]
    out = torch.zeros((n, c, h, index.shape[1]), dtype=torch.float32, device=x.device)
    for k in range(index.shape[2]):
        taps = x.gather(3, index[:, None, None, :, k].expand(n, c, h, index.shape[1]))
        out.addcmul_(taps, weight[:, None, None, :, k])
    return out.round_().clamp_(0, 255)


def _to_device(arrays: list[np.ndarray], device: torch.device) -> list[torch.Tensor]:
    """The host ``arrays`` as tensors on ``device``; to CUDA from pinned memory and without blocking, so the
    copies do not stall the host."""
    import torch

    cuda = device.type == "cuda"
    return [
        torch.from_numpy(a).pin_memory().to(device, non_blocking=True) if cuda else torch.from_numpy(a)
        for a in arrays
    ]


def resize_crops(images: torch.Tensor, boxes: torch.Tensor, size: int) -> torch.Tensor:
    """uint8 [n, H, W, 3] on any device, boxes int [n, 4] (:func:`crop_boxes`) -> uint8 [n, size, size, 3] on
    that device: each box resized bicubically (antialiased) as :func:`crop_pixels` does, the whole batch at
    once: a pass over the columns, then over the rows, each a few gathers and multiply-adds with per-sample
    taps (:func:`resize_taps`; elementwise float32, so no TF32 matmul can round it). Each pass is rounded and
    clipped as the uint8 path stores its intermediate image (without that, a bicubic overshoot past 0 or 255
    in the first pass differs by up to ~25 grey levels); the result equals crop_pixels' within 2 grey levels
    (torch's uint8 path uses 16-bit fixed-point weights). Called by the training process
    (``TrainData.to_device``) when the crop runs on the device.

    The taps of the whole batch are built on the host at once and moved together (:func:`_to_device`); each
    RESIZE_CHUNK-sample chunk then takes its slice, cut to the taps its own samples use."""
    import numpy as np
    import torch

    b = boxes.cpu().numpy().astype(np.int64)
    col_idx, col_w, col_used = resize_taps(b[:, 0], b[:, 2], size)
    row_idx, row_w, row_used = resize_taps(b[:, 1], b[:, 3], size)
    taps = _to_device([col_idx, row_idx, col_w.astype(np.float32), row_w.astype(np.float32)], images.device)
    col_idx, row_idx, col_w, row_w = taps
    out = torch.empty((len(b), size, size, 3), dtype=torch.uint8, device=images.device)
    for lo in range(0, len(b), RESIZE_CHUNK):  # float temporaries of a chunk only (~40 MB at 249 px)
        hi = lo + RESIZE_CHUNK
        kc, kr = int(col_used[lo:hi].max()), int(row_used[lo:hi].max())
        chw = images[lo:hi].permute(0, 3, 1, 2).float()
        cols = _resize_last(chw, col_idx[lo:hi, :, :kc], col_w[lo:hi, :, :kc])  # [c, 3, H, S]
        done = _resize_last(
            cols.transpose(2, 3), row_idx[lo:hi, :, :kr], row_w[lo:hi, :, :kr]
        )  # [c, 3, cols, rows]
        out[lo:hi] = done.to(torch.uint8).permute(0, 3, 2, 1)  # [c, rows, cols, 3]
    return out


@dataclass(frozen=True)
class DeviceCrop:
    """The loader's half of a crop done on the training device (``crop_on``): picklable, runs in DataLoader
    workers and returns the stored pixels with each sample's crop box; ``TrainData.to_device`` resizes them
    (:func:`resize_crops`). The boxes come from the same (seed, step, id) draws as
    :class:`PixelTransform`'s."""

    size: int
    seed: int = 0
    augment: AugmentConfig | None = None

    def __call__(self, images: np.ndarray, ids: np.ndarray, step: int) -> dict:
        """images uint8 [b, H, W, 3] -> {"image": the same as a tensor, "crop_box": int64 [b, 4]}."""
        import numpy as np
        import torch

        draws = None if self.augment is None else crop_draws(self.augment, self.seed, step, ids)
        boxes = crop_boxes(images.shape[1], images.shape[2], draws, len(ids))
        return {"image": torch.from_numpy(np.ascontiguousarray(images)), "crop_box": torch.from_numpy(boxes)}


def pixel_transform(
    cfg: AugmentConfig,
    image_field_shape: tuple[int, ...] | None,
    model_size: int,
    seed: int,
    on_device: bool = False,
) -> PixelTransform | DeviceCrop | None:
    """The trainer's transform for a dataset whose image field has ``image_field_shape`` (None: frozen-tower
    features, no transform); None also when nothing would change (no random crop, stored at model size).
    ``on_device``: the loader only draws the boxes (:class:`DeviceCrop`)."""
    if image_field_shape is None:
        return None
    if not cfg.random_crop and image_field_shape[0] == model_size:
        return None
    kind = DeviceCrop if on_device else PixelTransform
    return kind(model_size, seed, cfg if cfg.random_crop else None)
