"""Builds the deployable artefact of the rule-based reward Lambda function.

``python -m resources.lambda_build [--out build/lambda] [--with-deps]`` copies the handler code
(:data:`RULE_FUNCTION_FILES`) into ``OUT/rule/`` (the ``CodeUri`` of ``RuleRewardFunction`` in
``resources/lambda/template.yaml``) and zips that directory into ``OUT/rule-reward.zip``,
byte-for-byte reproducibly. Powertools and pydantic come from the public Powertools layer unless
``--with-deps`` pip-installs them into the directory (that needs PyPI). The model-based function
and the HC-PINN verification function are container images; the command only prints how to
build them and how to deploy. Reading the SAM template is :mod:`resources.lambda_template`.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import subprocess
import sys
import zipfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from resources.lambda_template import DEFAULT_TEMPLATE

log = logging.getLogger(__name__)

PROJECT_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = PROJECT_ROOT / "build" / "lambda"
_TEMPLATE_REL = DEFAULT_TEMPLATE.resolve().relative_to(PROJECT_ROOT).as_posix()
RULE_DIR_NAME = "rule"
RULE_ZIP_NAME = "rule-reward.zip"
# The container-image functions: image name -> Dockerfile (resources/lambda/template.yaml).
IMAGES: dict[str, str] = {"rollarc-reward-model": "resources/lambda/Dockerfile.model",
                          "rollarc-reward-pinn": "resources/lambda/Dockerfile.pinn"}

# What the rule-based function imports, relative to PROJECT_ROOT: the handler and the pure
# core it wraps, the rule-based rewards and the parsers they replay answers with.
RULE_FUNCTION_FILES: tuple[str, ...] = (
    "resources/__init__.py",
    "resources/lambda_handler.py",
    "tasks/__init__.py",
    "tasks/components.py",
    "tasks/rewards.py",
    "tasks/reward_service.py",
    "tasks/envs/__init__.py",
    "tasks/envs/base.py",
    "tasks/envs/frozenlake.py",
    "tasks/envs/guess_number.py",
    "tasks/envs/sokoban.py",
    "tasks/envs/tool_use.py",
    "tasks/hc_pinn/__init__.py",
    "tasks/hc_pinn/grammar.py",
)

# Installed by --with-deps; otherwise the Powertools layer provides them.
RULE_FUNCTION_DEPENDENCIES: tuple[str, ...] = (
    "aws-lambda-powertools[parser]>=3.20,<4",
    "pydantic>=2.6,<3",
)

MIB = 1024 * 1024
# Lambda's quotas: a zip uploaded directly, and a function's code plus layers once unzipped.
ZIP_LIMIT_BYTES = 50 * MIB
UNZIPPED_LIMIT_BYTES = 250 * MIB

# The earliest time a zip entry can hold; fixed so that rebuilding gives identical bytes.
_ZIP_DATE_TIME = (1980, 1, 1, 0, 0, 0)


class ArtefactTooLargeError(ValueError):
    """The built directory or zip exceeds a Lambda size limit."""


@dataclass(frozen=True)
class BuildResult:
    """Where the build put the function's directory and zip, and their sizes in bytes."""

    directory: Path
    zip_path: Path
    directory_bytes: int
    zip_bytes: int


# --- the build ----------------------------------------------------------------------------------


def _check_sources(files: Iterable[str], root: Path) -> list[str]:
    files = list(files)
    for rel in files:
        if Path(rel).is_absolute() or ".." in Path(rel).parts:
            raise ValueError(f"{rel!r}: function files must be relative paths inside {root}")
    missing = [rel for rel in files if not (root / rel).is_file()]
    if missing:
        raise FileNotFoundError(
            f"cannot build the rule-based reward function: missing {', '.join(missing)} "
            f"(under {root})")
    return files


def directory_size(directory: Path) -> int:
    """Total bytes of the regular files under ``directory``."""
    return sum(p.stat().st_size for p in directory.rglob("*") if p.is_file())


def pip_install_command(target: Path) -> list[str]:
    """The pip command that installs the function's dependencies for Lambda's platform."""
    # Wheels for Lambda's Linux/CPython 3.12, whatever this machine runs; --no-compile because
    # bytecode for this interpreter would be dead weight there.
    return [
        sys.executable, "-m", "pip", "install", "--target", str(target),
        "--platform", "manylinux2014_x86_64", "--python-version", "3.12",
        "--only-binary=:all:", "--implementation", "cp",
        "--no-compile", "--disable-pip-version-check",
        *RULE_FUNCTION_DEPENDENCIES,
    ]


def write_deterministic_zip(directory: Path, zip_path: Path) -> int:
    """Zips the files under ``directory`` (sorted, fixed timestamps); returns the zip's bytes."""
    files = sorted((p for p in directory.rglob("*") if p.is_file()),
                   key=lambda p: p.relative_to(directory).as_posix())
    zip_path.parent.mkdir(parents=True, exist_ok=True)
    partial = zip_path.with_name(zip_path.name + ".partial")
    with zipfile.ZipFile(partial, "w") as zf:
        for path in files:
            info = zipfile.ZipInfo(path.relative_to(directory).as_posix(), _ZIP_DATE_TIME)
            info.compress_type = zipfile.ZIP_DEFLATED
            info.create_system = 3  # Unix, so Lambda honours the permission bits below
            mode = 0o755 if os.access(path, os.X_OK) else 0o644
            info.external_attr = (0o100000 | mode) << 16  # regular file
            zf.writestr(info, path.read_bytes(), compresslevel=9)
    partial.replace(zip_path)
    return zip_path.stat().st_size


def build_rule_function(
    out: str | os.PathLike[str] = DEFAULT_OUT,
    *,
    files: Iterable[str] | None = None,
    root: str | os.PathLike[str] | None = None,
    with_deps: bool = False,
    zip_limit_bytes: int = ZIP_LIMIT_BYTES,
    unzipped_limit_bytes: int = UNZIPPED_LIMIT_BYTES,
) -> BuildResult:
    """Builds ``out/rule/`` and ``out/rule-reward.zip`` from ``files`` (relative to ``root``).

    ``files`` defaults to RULE_FUNCTION_FILES and ``root`` to the project root. Raises
    FileNotFoundError naming any missing file before writing anything, and
    ArtefactTooLargeError when the directory or zip is over its limit.
    """
    out = Path(out)
    # Looked up at call time, not bound as defaults, so callers and tests can repoint them.
    root = Path(PROJECT_ROOT if root is None else root)
    files = _check_sources(RULE_FUNCTION_FILES if files is None else files, root)
    directory = out / RULE_DIR_NAME
    zip_path = out / RULE_ZIP_NAME

    # A fresh directory: files left from an earlier build would be deployed too; and no stale
    # zip that a failed build would leave looking current.
    if directory.exists():
        shutil.rmtree(directory)
    zip_path.unlink(missing_ok=True)
    directory.mkdir(parents=True)
    for rel in files:
        dest = directory / rel
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(root / rel, dest)
    log.info("copied %d files into %s", len(files), directory)

    if with_deps:
        command = pip_install_command(directory)
        log.info("installing dependencies: %s", " ".join(command))
        subprocess.run(command, check=True)

    directory_bytes = directory_size(directory)
    if directory_bytes > unzipped_limit_bytes:
        raise ArtefactTooLargeError(
            f"{directory} holds {directory_bytes / MIB:.1f} MiB ({directory_bytes} bytes), over "
            f"the {unzipped_limit_bytes} byte limit for a function's unzipped code; "
            f"Lambda refuses it (250 MiB with layers included)")

    zip_bytes = write_deterministic_zip(directory, zip_path)
    if zip_bytes > zip_limit_bytes:
        zip_path.unlink()  # never leave an artefact that an upload would reject
        raise ArtefactTooLargeError(
            f"{zip_path} would be {zip_bytes / MIB:.1f} MiB ({zip_bytes} bytes), over the "
            f"{zip_limit_bytes} byte limit for a zip uploaded directly to Lambda (50 MiB); "
            f"deploy the directory through S3 (sam deploy) or drop --with-deps")
    log.info("wrote %s (%d bytes)", zip_path, zip_bytes)
    return BuildResult(directory, zip_path, directory_bytes, zip_bytes)


# --- command line -------------------------------------------------------------------------------


def _display(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m resources.lambda_build",
        description="Build the rule-based reward Lambda function (directory and zip).")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT,
                        help="output folder (default: build/lambda under the project root, "
                             "where resources/lambda/template.yaml expects it)")
    parser.add_argument("--with-deps", action="store_true",
                        help="pip-install aws-lambda-powertools[parser] and pydantic into the "
                             "function instead of relying on the Powertools layer (needs PyPI)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    try:
        result = build_rule_function(args.out, with_deps=args.with_deps)
    except (FileNotFoundError, ArtefactTooLargeError, subprocess.CalledProcessError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1

    print(f"function directory: {_display(result.directory)}  "
          f"{result.directory_bytes / MIB:.2f} MiB ({result.directory_bytes} bytes; "
          f"limit {UNZIPPED_LIMIT_BYTES / MIB:.0f} MiB unzipped)")
    print(f"function zip:       {_display(result.zip_path)}  "
          f"{result.zip_bytes / MIB:.2f} MiB ({result.zip_bytes} bytes; "
          f"limit {ZIP_LIMIT_BYTES / MIB:.0f} MiB for a direct upload)")
    if not args.with_deps:
        print("dependencies: from the Powertools layer (PowertoolsLayerVersion in the template)")
    if args.out.resolve() != DEFAULT_OUT.resolve():
        print(f"note: the template's CodeUri reads {_display(DEFAULT_OUT / RULE_DIR_NAME)}, "
              "not this --out")
    print("\nnext, from the project root:")
    for image, dockerfile in IMAGES.items():
        print(f"  docker build -f {dockerfile} -t {image} .")
    print(f"  sam deploy --guided --template-file {_TEMPLATE_REL}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
