"""A small residual network with BatchNorm on generated 32x32 images, for the quality suite.

Real conv nets carry BatchNorm statistics, buffers that DDP broadcasts from rank 0 before
every forward, outside any comm hook; the other suite tasks have none. The images are the
``shapes`` task's patterns (:func:`commpress.workloads.synthetic.shapes_batch`) at 32x32,
seeded the same way, so nothing is downloaded.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import pairwise
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from commpress.workloads.synthetic import _CLASSES, ShapesTask

__all__ = ["BasicBlock", "ResNet", "ResNetTask"]


class BasicBlock(nn.Module):
    """Two 3x3 convolutions with BatchNorm and a skip connection (a 1x1 convolution with
    BatchNorm where the block changes width or resolution), as in ResNet-18."""

    def __init__(self, width_in: int, width: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(width_in, width, 3, stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.shortcut = nn.Sequential()
        if stride != 1 or width_in != width:
            self.shortcut = nn.Sequential(nn.Conv2d(width_in, width, 1, stride, bias=False), nn.BatchNorm2d(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(h)) + self.shortcut(x))


class ResNet(nn.Module):
    """A conv stem with BatchNorm (stride 2), one residual block per width (the later ones
    halving the resolution), global average pooling and a linear head."""

    def __init__(self, widths: tuple[int, ...] = (8, 16, 32)) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(1, widths[0], 3, 2, padding=1, bias=False), nn.BatchNorm2d(widths[0]), nn.ReLU())
        blocks = [BasicBlock(widths[0], widths[0])]
        blocks += [BasicBlock(a, b, 2) for a, b in pairwise(widths)]
        self.blocks = nn.Sequential(*blocks)
        self.head = nn.Linear(widths[-1], _CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.stem(x)).mean(dim=(2, 3)))


@dataclass(frozen=True)
class ResNetTask(ShapesTask):
    """The shapes task's images at 32x32, classified by :class:`ResNet`. With four times the
    pixels the noise is raised from 0.8 to 1.2, so ``none`` ends near the ``shapes`` task's
    held-out loss (about 0.25 after the quality suite's 200 steps) rather than near 0."""

    side: ClassVar[int] = 32
    noise: ClassVar[float] = 1.2

    def model(self) -> ResNet:  # type: ignore[override]
        torch.manual_seed(self.seed)
        return ResNet()
