"""Shared fixtures: Hugging Face checkpoints written by the tests themselves (nothing is
downloaded) and engines built on them."""
from __future__ import annotations

import os

import pytest

from engine.checkpoints import write_hf_checkpoint

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="session")
def llama_checkpoint(tmp_path_factory):
    return write_hf_checkpoint(tmp_path_factory.mktemp("llama"))
