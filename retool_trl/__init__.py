"""retool-trl: train language models to use a Python interpreter while they reason (ReTool) with TRL's GRPO."""

from importlib import import_module
from typing import TYPE_CHECKING

__version__ = "0.1.0"

# Lazy exports: `import retool_trl.sandbox` (used inside sandbox workers) must not pull in torch and TRL.
_EXPORTS = {"ReToolConfig": ".config", "ReToolTrainer": ".trainer", "quickstart_model_path": ".models.names"}

if TYPE_CHECKING:
    from .config import ReToolConfig
    from .models.names import quickstart_model_path
    from .trainer import ReToolTrainer


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(import_module(_EXPORTS[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["ReToolConfig", "ReToolTrainer", "__version__", "quickstart_model_path"]
