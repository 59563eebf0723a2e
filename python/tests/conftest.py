"""Shared fixtures: the real SmolLM2 model and Jane Austen's text (scripts/fetch-data), and one
vq-4 calibration made through the binding itself for the session."""

import os
import pathlib

import pytest

import veloq

CACHE = pathlib.Path(os.environ.get("VELOQ_CACHE", pathlib.Path.home() / ".cache" / "veloq"))
MODEL = CACHE / "smollm2-135m-instruct.q4_1.gguf"
TEXT = CACHE / "austen" / "persuasion.txt"


@pytest.fixture(scope="session")
def model_path():
    if not MODEL.exists():
        pytest.fail(f"{MODEL} missing: run scripts/fetch-data")
    return MODEL


@pytest.fixture(scope="session")
def calibration_path(model_path, tmp_path_factory):
    """A vq-4 calibration on 2,048 tokens of Persuasion, with the stages it reported."""
    out = tmp_path_factory.mktemp("cal") / "smollm2.vq-4.safetensors"
    stages = []
    written = veloq.calibrate(
        model_path,
        TEXT,  # a path: read as a file
        method="vq-4",
        tokens=2048,
        window=2048,
        out=out,
        progress=lambda stage, done, total: stages.append((stage, done, total)),
    )
    assert pathlib.Path(written) == out and out.exists()
    assert stages[0][0] == "collecting" and stages[-1] == ("training", 30, 30), stages
    return out


@pytest.fixture(scope="session")
def model(model_path, calibration_path):
    return veloq.Model.open(model_path, method="vq-4", calibration=calibration_path, max_context=2048)
