"""What a skip reason must be: read in a list of them (`pytest -rs`), one short line naming what is missing, not a
report dump. The root conftest fails a test whose skip reason is not."""

MAX_SKIP_REASON_CHARS = 240


def skip_reason_problem(reason: str) -> str | None:
    """Why a skip reason is not one short line, or None when it is."""
    if "\n" in reason.strip():
        return "a skip reason must be one line"
    if len(reason) > MAX_SKIP_REASON_CHARS:
        return f"a skip reason must be short ({len(reason)} > {MAX_SKIP_REASON_CHARS} characters)"
    return None
