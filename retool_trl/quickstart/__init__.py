"""The CPU quickstarts (moved from `retool_trl/quickstart.py` and `retool_trl/quickstart_multiturn.py`)."""

from .runner import (  # noqa: F401
    QUICKSTART_MODEL_DIR,
    CompactProgressCallback,
    QuickstartArguments,
    QuickstartTask,
    _rl_config,
    build_char_tokenizer,
    build_tiny_model,
    main,
    model_path,
    run_quickstart,
    train_run,
)
