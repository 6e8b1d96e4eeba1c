"""torchvision.io stand-in: names import (transformers imports some when it finds
torchvision), every use raises."""

from torchvision.transforms import missing

__getattr__ = missing("torchvision.io")
