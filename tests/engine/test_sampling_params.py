"""SamplingParams: what vLLM's accepts and normalises is accepted the same way; bad values are
refused with the field's name."""

from __future__ import annotations

import pytest

from shm_engine.sampling_params import SamplingParams


def test_vllm_spellings_are_normalised() -> None:
    sp = SamplingParams(
        stop=None, stop_token_ids=None, seed=-1, logprobs=True, prompt_logprobs=True
    )
    assert sp.stop == [] and sp.stop_token_ids == []
    assert sp.seed is None  # vLLM's "no seed"
    assert sp.logprobs == 1 and sp.prompt_logprobs == 1
    sp.check_types()  # and the result is what the wire format takes
    assert SamplingParams(stop="END").stop == ["END"]


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [({"n": 0}, "n"), ({"temperature": -1.0}, "temperature"), ({"top_p": 0.0}, "top_p"),
     ({"top_k": -2}, "top_k"), ({"seed": 2**63}, "seed"), ({"logprobs": 21}, "logprobs"),
     ({"repetition_penalty": 0.0}, "repetition_penalty"),
     ({"repetition_penalty": float("inf")}, "repetition_penalty"),
     ({"stop": [""]}, "stop"), ({"stop_token_ids": [-1]}, "stop_token_ids"),
     ({"stop": ["x"] * 129}, "stop"), ({"stop_token_ids": [1] * 1025}, "stop_token_ids"),
     ({"min_tokens": 5, "max_tokens": 4}, "min_tokens"),
     ({"logit_bias": {1: 100.5}}, "logit_bias"), ({"logit_bias": {-1: 1.0}}, "logit_bias"),
     ({"logit_bias": dict.fromkeys(range(1025), 1.0)}, "logit_bias"),
     ({"allowed_token_ids": []}, "allowed_token_ids"),
     ({"allowed_token_ids": [-2]}, "allowed_token_ids")],
)  # fmt: skip
def test_invalid_values_name_their_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_only_temperature_zero_is_greedy_and_tiny_ones_sample_at_vllms_floor() -> None:
    assert SamplingParams(temperature=0.0).greedy
    for t in (1e-9, 1e-6, 1e-3):
        sp = SamplingParams(temperature=t)
        assert sp.temperature == 0.01 and not sp.greedy
    assert SamplingParams(temperature=0.5).temperature == 0.5
    assert SamplingParams(temperature=1.0, top_k=1).greedy


def test_vllm_ranges_are_accepted() -> None:
    """vLLM takes any positive finite repetition penalty and any int64 seed."""
    assert SamplingParams(repetition_penalty=3.5).repetition_penalty == 3.5
    for seed in (-2, -(2**63), 2**63 - 1):
        SamplingParams(seed=seed).check_types()


def test_a_field_assigned_the_wrong_type_later_is_caught_before_sending() -> None:
    sp = SamplingParams()
    sp.logprobs = True  # after construction nothing normalises it
    with pytest.raises(ValueError, match="logprobs must be an integer"):
        sp.check_types()


def test_logit_bias_keys_may_be_strings_as_in_vllm_and_lists_are_capped() -> None:
    assert SamplingParams(logit_bias={"5": 1.0}).logit_bias == {5: 1.0}
    with pytest.raises(ValueError, match="logit_bias keys"):
        SamplingParams(logit_bias={"x": 1.0})
    with pytest.raises(ValueError, match="allowed_token_ids takes 1 to"):
        SamplingParams(allowed_token_ids=[0] * ((1 << 18) + 1))
    with pytest.raises(ValueError, match="bad_words"):
        SamplingParams(bad_words=["w"] * 129)


def test_logit_bias_and_allowed_token_ids_types_are_checked() -> None:
    sp = SamplingParams(logit_bias={5: 2}, allowed_token_ids=[1, 2])
    sp.check_types()
    assert sp.logit_bias == {5: 2.0} and type(sp.logit_bias[5]) is float
    for field, value in [
        ("logit_bias", {"5": 1.0}),
        ("logit_bias", [5]),
        ("logit_bias", {5: "x"}),
        ("allowed_token_ids", [1.5]),
        ("allowed_token_ids", 3),
    ]:
        bad = SamplingParams()
        setattr(bad, field, value)
        with pytest.raises(ValueError, match=field):
            bad.check_types()
