"""dapo_lightning.checks: a setting's choices read from its Literal type, and the one-line
error that names the setting."""

from __future__ import annotations

from typing import Literal

import pytest

from dapo_lightning.checks import ConfigError, check_choice, choices_of
from dapo_lightning.data.sampling.settings import DynamicSamplingConfig, FilterMetric


def test_choices_of_reads_a_literal_and_its_union_with_none():
    assert choices_of(Literal["sync", "one_step_off"]) == ("sync", "one_step_off")
    assert choices_of(FilterMetric) == ("acc", "score", "reward", None)
    assert choices_of(Literal["a"] | Literal["b", "c"]) == ("a", "b", "c")
    with pytest.raises(TypeError, match="not a Literal"):
        choices_of(int)


def test_a_setting_outside_its_type_names_the_setting_and_every_choice():
    with pytest.raises(ConfigError) as error:
        check_choice("data.x", "reward2", choices_of(FilterMetric))
    assert str(error.value) == "data.x must be 'acc', 'score', 'reward' or null, got 'reward2'."
    with pytest.raises(
        ConfigError, match=r"filter_metric must be 'acc', 'score', 'reward' or null"
    ):
        DynamicSamplingConfig(filter_metric="rewards")
