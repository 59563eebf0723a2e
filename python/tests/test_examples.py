"""The examples the README and docs/python.md point to, run as a user runs them: each script in
a fresh process, with a home of its own that holds only what scripts/fetch-data brings (the
model and the novels, linked), so what a script writes (its calibration) starts from nothing."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import CACHE, MODEL

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


@pytest.fixture
def home(tmp_path):
    if not MODEL.exists():
        pytest.fail(f"{MODEL} missing: run scripts/fetch-data")
    cache = tmp_path / ".cache" / "veloq"
    cache.mkdir(parents=True)
    for name in (MODEL.name, "austen"):
        (cache / name).symlink_to(CACHE / name)
    return tmp_path


def run(script, home, timeout):
    env = {**os.environ, "HOME": str(home)}
    env.pop("VELOQ_CACHE", None)
    done = subprocess.run([sys.executable, str(EXAMPLES / script)], env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_quickstart_runs(home):
    out = run("quickstart.py", home, timeout=900)
    assert (home / ".cache" / "veloq" / "smollm2-135m-instruct.q4_1.vq-4.safetensors").exists()
    tokens, held, f16 = map(int, re.search(r"\[(\d+) tokens, [\d.]+ tok/s, cache (\d+) bytes against (\d+) in f16\]", out).groups())
    assert tokens > 0 and 0 < held < f16


def test_transformers_example_runs(home):
    pytest.importorskip("transformers")
    out = run("transformers_cache.py", home, timeout=900)
    sizes = dict(re.findall(r"^(DynamicCache|VeloqCache vq-4)\s+([\d.]+) MiB", out, re.M))
    assert set(sizes) == {"DynamicCache", "VeloqCache vq-4"}, out
    assert float(sizes["VeloqCache vq-4"]) < float(sizes["DynamicCache"]) / 3
