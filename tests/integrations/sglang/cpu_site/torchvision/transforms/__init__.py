"""torchvision.transforms stand-in: the enum SGLang reads at import, callables that raise."""

import enum
from collections.abc import Callable


class InterpolationMode(enum.Enum):
    NEAREST = "nearest"
    NEAREST_EXACT = "nearest-exact"
    BILINEAR = "bilinear"
    BICUBIC = "bicubic"
    BOX = "box"
    HAMMING = "hamming"
    LANCZOS = "lanczos"


def missing(where: str) -> Callable[[str], Callable[..., object]]:
    def lookup(name: str) -> Callable[..., object]:
        def unavailable(*args: object, **kwargs: object) -> object:
            raise NotImplementedError(f"torchvision stub (tests only): {where}.{name}")

        return unavailable

    return lookup


__getattr__ = missing("torchvision.transforms")
