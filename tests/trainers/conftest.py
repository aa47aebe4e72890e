"""The trainer tests' shared fixtures: the embedded addition task's tokenizer and a 64-problem dataset."""

from __future__ import annotations

import pytest

from trainers.tasks import AdditionTask, make_addition_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return make_addition_tokenizer()


@pytest.fixture(scope="module")
def dataset():
    return AdditionTask(num_digits=3, seed=0).to_dataset(64)
