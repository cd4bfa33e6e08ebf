import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

# `python -m pytest` puts the repository root on sys.path, where kernels/ (installed as kserve.kernels) shadows
# Hugging Face's `kernels` package; transformers 5.25 depends on that package and imports it when it loads a
# model. Tests import the installed kserve, as users do, so the root comes off the path.
_ROOT = Path(__file__).resolve().parents[1]
sys.path[:] = [p for p in sys.path if Path(p or os.getcwd()).resolve() != _ROOT]

# Triton kernels run in the interpreter on CPU; must be set before triton is imported.
os.environ.setdefault("TRITON_INTERPRET", "1")
# The interpreter's tl.dot is numpy's matmul. OpenBLAS's FMA kernels (Haswell, Zen) round a row differently by
# its position in the matrix, which a GPU's MMA does not, so the batch-invariant kernel tests would fail on them
# for the host's sake. The Sandybridge kernel (AVX) is position-independent; it must be chosen before numpy loads.
if platform.machine() in ("x86_64", "AMD64") and "numpy" not in sys.modules:
    os.environ.setdefault("OPENBLAS_CORETYPE", "Sandybridge")


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


@pytest.fixture(scope="session")
def tiny_k25_dir(tmp_path_factory) -> Path:
    """K2.6's published layout: kimi_k25 wrapper, INT4 routed experts, `language_model.` names."""
    return _make_tiny(tmp_path_factory.mktemp("tiny") / "k25", "k25")


@pytest.fixture(scope="module")
def server():
    """A live server over the embedded tiny K2.6 model, one per test module; a module needing other settings
    defines its own `server` with `live_server.running_server(...)`."""
    # imported here: it needs the openai SDK (a test extra), which only the server tests use
    from live_server import running_server

    with running_server() as srv:
        yield srv


@pytest.fixture(scope="module")
def ctx(server):
    """The live server's context: engine, tokenizer, model name."""
    return server.app.state.server.context


@pytest.fixture
def engine_prompts(ctx):
    """The prompt ids of every request the engine is asked to generate for, in order (a tap, not a stand-in)."""
    seen: list[list[int]] = []
    generate = ctx.engine.generate

    def tap(request_id, prompt_ids, params):
        seen.append(list(prompt_ids))
        return generate(request_id, prompt_ids, params)

    ctx.engine.generate = tap
    yield seen
    del ctx.engine.generate
