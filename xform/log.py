"""The `xform` logger, and the dependencies' messages xform's use of them prints that a user can do
nothing about.

`TORCH_LOGS=xform` (info: what each transform changed and why it skipped something) or
`TORCH_LOGS=+xform` (debug: also each transformed graph) turn it on, as for torch's own logs;
`torch._logging.set_logs(modules={"xform": logging.INFO})` from Python. `XFORM_LOG=info|debug|warning` is the
same switch for scripts that set it already.
"""

from __future__ import annotations

import logging
import os
import warnings

from xform._torch.logs import register_logger

logger = logging.getLogger("xform")

LEVELS = {"info": logging.INFO, "debug": logging.DEBUG, "warning": logging.WARNING}

# Messages of xform's dependencies that xform's own imports and compiles bring out and that say
# nothing a user can act on: torchao's optional CUDA kernels absent from its CPU wheel (or built for
# another GPU), its registration of enums with torch's pytree (deprecated by torch 2.13), and
# AOTAutograd's note that torchao's tensor subclasses have no stable hash for its cache.
QUIETED = {
    "torchao": ("Failed to load",),
    "torch.utils._pytree": ("is an Enum subclass and is now natively supported",),
}
QUIETED_WARNINGS = (r"(Float8Tensor|Float8TrainingTensor|MXTensor|NVFP4Tensor) does not implement "
                    r"_stable_hash_for_caching",)


class _Dropping(logging.Filter):
    def __init__(self, starts: tuple[str, ...]) -> None:
        super().__init__()
        self.starts = starts

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not any(start in message for start in self.starts)


def quiet_dependencies() -> None:
    """Drop the dependencies' messages listed in `QUIETED` and `QUIETED_WARNINGS`, and only them."""
    for name, starts in QUIETED.items():
        dependency = logging.getLogger(name)
        if not any(isinstance(f, _Dropping) for f in dependency.filters):
            dependency.addFilter(_Dropping(starts))
    for message in QUIETED_WARNINGS:  # appended: a user's own filters come first
        warnings.filterwarnings("ignore", message=message, category=UserWarning, append=True)


def configure_from_env(environ: dict[str, str] | None = None) -> None:
    """Register xform's logger with torch's, and attach a stderr handler at the level `XFORM_LOG`
    names (nothing when it is unset; a warning, not an error, when it names no level)."""
    register_logger("xform")
    value = (environ if environ is not None else os.environ).get("XFORM_LOG", "").strip().lower()
    if not value:
        return
    if value not in LEVELS:
        warnings.warn(f"XFORM_LOG={value!r} is not a level, so it is ignored; accepted: {', '.join(LEVELS)} "
                      f"(or TORCH_LOGS=xform / +xform)", stacklevel=2)
        return
    logger.setLevel(LEVELS[value])
    if not any(getattr(h, "_xform_env_handler", False) for h in logger.handlers):
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("[xform %(levelname)s] %(message)s"))
        handler._xform_env_handler = True  # type: ignore[attr-defined]
        logger.addHandler(handler)
