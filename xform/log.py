"""The `xform` logger. `XFORM_LOG=info|debug` turns it on without touching user code."""

from __future__ import annotations

import logging
import os

logger = logging.getLogger("xform")

LEVELS = {"info": logging.INFO, "debug": logging.DEBUG, "warning": logging.WARNING}


def configure_from_env(environ: dict[str, str] | None = None) -> None:
    """Attach a stderr handler at the level `XFORM_LOG` names (no-op when it is unset)."""
    value = (environ if environ is not None else os.environ).get("XFORM_LOG", "").strip().lower()
    if not value:
        return
    if value not in LEVELS:
        raise ValueError(f"XFORM_LOG={value!r} is not a level; accepted: {', '.join(LEVELS)}")
    logger.setLevel(LEVELS[value])
    if not any(getattr(h, "_xform_env_handler", False) for h in logger.handlers):
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("[xform %(levelname)s] %(message)s"))
        handler._xform_env_handler = True  # type: ignore[attr-defined]
        logger.addHandler(handler)
