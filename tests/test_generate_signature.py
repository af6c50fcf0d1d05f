"""The generate signature has one home: both generates name the same parameters, each a GenerateOptions field or
the prompt and its mask, and submit's sampling parameters are generate's, so none is dropped without a word."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import pytest

from moirai.generation.lm import CompiledLM
from moirai.generation.requests import GenerateOptions, check_generate_signatures
from moirai.generation.server import GenerationServer


def _with(function: Callable, **added: Any) -> Callable:
    """A function whose signature is ``function``'s with ``added`` (name: default) before its ``**`` parameter."""
    parameters = list(inspect.signature(function).parameters.values())
    extra = [inspect.Parameter(name, inspect.Parameter.POSITIONAL_OR_KEYWORD, default=d) for name, d in added.items()]
    signature = inspect.signature(function).replace(parameters=[*parameters[:-1], *extra, parameters[-1]])

    def stand_in(*args: Any, **kwargs: Any) -> None: ...

    stand_in.__signature__ = signature  # type: ignore[attr-defined]
    return stand_in


def test_the_two_generates_name_every_option_and_submit_takes_their_names_and_defaults() -> None:
    check_generate_signatures(CompiledLM.generate, GenerationServer.generate, GenerationServer.submit)
    generate = inspect.signature(CompiledLM.generate)
    assert generate == inspect.signature(GenerationServer.generate)
    # Named in the signature, so that help() and IDEs show them.
    assert {"max_new_tokens", "temperature", "streamer", "generation_config"} <= set(generate.parameters)
    assert set(generate.parameters) <= {
        "self",
        "input_ids",
        "inputs",
        "attention_mask",
        "others",
        *GenerateOptions._fields,
    }


def test_a_parameter_of_one_generate_only_is_refused() -> None:
    with pytest.raises(TypeError, match="differ"):
        check_generate_signatures(
            CompiledLM.generate, _with(GenerationServer.generate, typical_p=None), GenerationServer.submit
        )


def test_a_generate_parameter_that_is_no_option_is_refused() -> None:
    generate = _with(CompiledLM.generate, typical_p=None)
    with pytest.raises(TypeError, match="typical_p, which is no GenerateOptions field"):
        check_generate_signatures(generate, generate, GenerationServer.submit)


def test_a_submit_parameter_unlike_generates_is_refused() -> None:
    with pytest.raises(TypeError, match="typical_p=None"):
        check_generate_signatures(
            CompiledLM.generate, GenerationServer.generate, _with(GenerationServer.submit, typical_p=None)
        )
    submit = inspect.signature(GenerationServer.submit)
    parameters = [p.replace(default=0.5) if p.name == "top_p" else p for p in submit.parameters.values()]

    def submit_with_a_default_of_its_own(*args: Any, **kwargs: Any) -> None: ...

    submit_with_a_default_of_its_own.__signature__ = submit.replace(parameters=parameters)  # type: ignore[attr-defined]
    with pytest.raises(TypeError, match="top_p"):
        check_generate_signatures(CompiledLM.generate, GenerationServer.generate, submit_with_a_default_of_its_own)


def test_an_option_no_generate_names_is_refused() -> None:
    generate = inspect.signature(CompiledLM.generate)
    without = generate.replace(parameters=[p for p in generate.parameters.values() if p.name != "min_p"])

    def generate_without_min_p(*args: Any, **kwargs: Any) -> None: ...

    generate_without_min_p.__signature__ = without  # type: ignore[attr-defined]
    with pytest.raises(TypeError, match="GenerateOptions has min_p, which generate does not name"):
        check_generate_signatures(generate_without_min_p, generate_without_min_p, GenerationServer.submit)
