"""A stand-in torchvision for SGLang's text models on a CPU (see ../README.md): imports
succeed, every use raises naming the stub."""

__version__ = "0.0.0+hicache.stub"


def __getattr__(name: str) -> object:
    raise AttributeError(f"torchvision stub (tests only): torchvision.{name} is not available")
