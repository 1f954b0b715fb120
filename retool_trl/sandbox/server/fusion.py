"""SandboxFusion's `POST /run_code`, answered from a `LocalSandbox` cell: its request checked as its server checks it,
its response shaped as its server shapes it (`status`, `message`, `compile_result`, `run_result` with `status`,
`execution_time`, `return_code`, `stdout`, `stderr`, `executor_pod_name`, `files`), which is what verl, SkyRL and the
`sandbox-fusion` client send and read. Python only: another of SandboxFusion's languages gets its `SandboxError`
reply, a name it does not know its validation error (HTTP 422)."""

from __future__ import annotations

import base64
import re

from ..base import ExecResult

__all__ = ["FUSION_LANGUAGES", "RequestError", "parse_request", "prelude", "reply", "response", "unsupported"]

# SandboxFusion's `Language` (sandbox/runners/types.py): any other name is a validation error there.
FUSION_LANGUAGES = frozenset(
    "python python2 cpp nodejs go go_test java php csharp bash typescript sql rust cuda lua R perl D_ut ruby scala "
    "julia pytest junit kotlin_script jest verilog python_gpu lean swift racket gtest react".split()
)
PYTHON = ("python", "python3")


class RequestError(ValueError):
    """A request SandboxFusion's own validation would refuse (HTTP 422, its `detail` list)."""

    def __init__(self, kind: str, field: str, message: str, value=None):
        super().__init__(message)
        self.detail = [{"type": kind, "loc": ["body", field], "msg": message, "input": value}]


def parse_request(body) -> dict:
    """The fields of a `/run_code` body this server uses, checked (raises `RequestError` as SandboxFusion would)."""
    if not isinstance(body, dict):
        raise RequestError("model_attributes_type", "body", "Input should be a valid dictionary", body)
    if "code" not in body:
        raise RequestError("missing", "code", "Field required")
    if not isinstance(body["code"], str):
        raise RequestError("string_type", "code", "Input should be a valid string", body["code"])
    if "language" not in body:
        raise RequestError("missing", "language", "Field required")
    language = body["language"]
    if language not in FUSION_LANGUAGES and language not in PYTHON:
        raise RequestError("literal_error", "language", f"Input should be one of {sorted(FUSION_LANGUAGES)}", language)
    files, stdin = body.get("files") or {}, body.get("stdin")
    if not isinstance(files, dict) or not all(isinstance(v, str | None) for v in files.values()):
        raise RequestError("dict_type", "files", "Input should be a dict of path -> base64 text", files)
    if stdin is not None and not isinstance(stdin, str):
        raise RequestError("string_type", "stdin", "Input should be a valid string", stdin)
    return {
        "code": body["code"],
        "language": language,
        "run_timeout": body.get("run_timeout"),
        "memory_limit_MB": body.get("memory_limit_MB"),
        "stdin": stdin,
        "files": {k: v for k, v in files.items() if v is not None},
        "fetch_files": body.get("fetch_files") or [],
    }


def unsupported(language: str) -> dict:
    """SandboxFusion's reply when the run itself could not happen (`SandboxError`): here, a language not served."""
    message = f"language {language!r} is not served here: this server runs python only"
    return reply("SandboxError", message, None)


def prelude(request: dict) -> str | None:
    """A cell run before the code in the same jail: the request's `files` written, its `stdin` made readable."""
    lines = []
    if request["files"]:
        files = {path: base64.b64decode(data) for path, data in request["files"].items()}
        lines += [
            "import base64 as _b, os as _os",
            f"for _p, _d in { ({p: base64.b64encode(d).decode() for p, d in files.items()})!r}.items():",
            "    _os.makedirs(_os.path.dirname(_p) or '.', exist_ok=True)",
            "    open(_p, 'wb').write(_b.b64decode(_d))",
            "del _b, _os, _p, _d",
        ]
    if request["stdin"]:
        lines += ["import io as _io, sys as _sys", f"_sys.stdin = _io.StringIO({request['stdin']!r})", "del _io, _sys"]
    return "\n".join(lines) if lines else None


_TRACEBACK = re.compile(r"^Traceback \(most recent call last\):\n", re.M)
_EXIT = re.compile(r"^SystemExit: (.*)\n?\Z", re.M)


def response(result: ExecResult, *, prelude_error: ExecResult | None = None) -> dict:
    """The `/run_code` reply for one cell's result, as a script run by SandboxFusion would get it."""
    if prelude_error is not None and not prelude_error.ok:
        return reply("SandboxError", f"could not prepare the request's files or stdin: {prelude_error.output}", None)
    if result.infra_error:
        run = _run("Error", result, None, "", result.output)
        return reply("SandboxError", result.output, run)
    if result.timed_out:
        return reply("Failed", "", _run("TimeLimitExceeded", result, None, "", result.output))
    stdout, stderr, code = result.output, "", 0 if result.ok else 1
    exit_ = _EXIT.search(stdout)
    if exit_:  # sys.exit(n): the script's exit status, and no message on stdout
        stdout, value = stdout[: exit_.start()], exit_.group(1)
        code = 0 if value in ("0", "None") else int(value) if value.lstrip("-").isdigit() else 1
        stderr = "" if code == 0 or value.lstrip("-").isdigit() else value + "\n"
    elif not result.ok:
        # A script's traceback goes to stderr; the text before it is what the cell printed.
        split = [m.start() for m in _TRACEBACK.finditer(stdout)]
        cut = split[-1] if split else stdout.rstrip("\n").rfind("\n") + 1
        stdout, stderr = stdout[:cut], stdout[cut:]
    return reply("Success" if code == 0 else "Failed", "", _run("Finished", result, code, stdout, stderr))


def _run(status, result, return_code, stdout, stderr) -> dict:
    return {
        "status": status,
        "execution_time": result.duration_s,
        "return_code": return_code,
        "stdout": stdout,
        "stderr": stderr,
    }


def reply(status: str, message: str, run: dict | None) -> dict:
    return {
        "status": status,
        "message": message,
        "compile_result": None,
        "run_result": run,
        "executor_pod_name": None,
        "files": {},
    }
