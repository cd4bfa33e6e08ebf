import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

# Triton kernels run in the interpreter on CPU; must be set before triton is imported.
os.environ.setdefault("TRITON_INTERPRET", "1")
# The embedded tiny model is built fresh for the session (and its subprocesses), never read from a
# user's cache that an older generator may have written.
os.environ["KSERVE_CACHE_DIR"] = tempfile.mkdtemp(prefix="kserve-test-cache-")


def _make_tiny(path: Path, variant: str, seed: int = 0) -> Path:
    """Run the real CLI, as a user would."""
    subprocess.run(
        [sys.executable, "-m", "kserve.cli", "make-tiny", str(path), "--seed", str(seed), "--variant", variant],
        check=True,
        capture_output=True,
    )
    return path


@pytest.fixture(scope="session")
def tiny_k2_dir(tmp_path_factory) -> Path:
    return _make_tiny(tmp_path_factory.mktemp("tiny") / "k2", "k2")


@pytest.fixture(scope="session")
def tiny_v3_dir(tmp_path_factory) -> Path:
    return _make_tiny(tmp_path_factory.mktemp("tiny") / "v3", "v3")
