"""torch's logging registry: `TORCH_LOGS=xform` and `torch._logging.set_logs(modules={"xform": ...})`
name xform's logger as they name Dynamo's."""

from __future__ import annotations


def register_logger(name: str) -> None:
    """Make `name` a setting of `TORCH_LOGS` / `torch._logging.set_logs` for the logger `name`."""
    from torch._logging._internal import log_registry, register_log

    if name not in log_registry.log_alias_to_log_qnames:
        register_log(name, name)
