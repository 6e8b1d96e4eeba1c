"""torchvision.transforms.v2.functional stand-in."""

from torchvision.transforms import InterpolationMode, missing

__all__ = ["InterpolationMode"]
__getattr__ = missing("torchvision.transforms.v2.functional")
