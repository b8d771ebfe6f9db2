"""hyflash: speculative decoding with the HyFlash parallel block drafter."""

__version__ = "0.1.0"


class HyflashError(ValueError):
    """A user-facing error: bad input, incompatible checkpoint, missing file.

    The CLI prints its message without a traceback.
    """
