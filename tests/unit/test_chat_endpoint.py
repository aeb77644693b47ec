"""The chat endpoint (``hybridflow.rollout.endpoint``) driven by the openai client, with a scripted engine.

The rules:

1. a session's trajectory is its first messages rendered by the chat template (the prompt), then
   the engine's tokens of each reply as generated, and between replies the template's rendering
   of the new messages (with the end of the previous assistant turn the engine did not write),
   masked out of the loss;
2. a reply is the engine's text, without its end-of-turn token; tool calls come back parsed;
3. a wrong key, a conversation that does not extend the session's, or a spent budget is refused
   with a message; the session's runner's return value is its reward.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest
from transformers import AutoTokenizer

from hybridflow.engines.base import SamplingParams
from hybridflow.engines.continuous import GenerationRequest, RequestResult, SampleResult
from hybridflow.models.tiny import write_tiny_model
from hybridflow.rollout.endpoint import EndpointDriver
from hybridflow.spec.agent import AgentSpec

openai = pytest.importorskip("openai", reason="the endpoint's test client")

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return AutoTokenizer.from_pretrained(write_tiny_model(tmp_path_factory.mktemp("model") / "tiny"))


def serve(driver: EndpointDriver, replies: list[str], tokenizer: Any) -> RequestResult:
    """The service's side: each call's turn answered with the next reply (its eos appended)."""
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    answers = iter(replies)
    while True:
        turns, done = driver.advance()
        for turn in turns:
            ids = [*tokenizer.encode(next(answers), add_special_tokens=False), eos]
            driver.turn_finished(
                RequestResult(turn, [SampleResult(ids, [-0.5] * len(ids), [3] * len(ids), "stop")])
            )
        if done:
            return done[0]
        threading.Event().wait(0.01)


def test_an_openai_client_session_is_recorded_token_exactly(tokenizer: Any) -> None:
    seen: dict[str, Any] = {}

    def agent(base_url: str, api_key: str, row: dict[str, Any]) -> float:
        client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
        with pytest.raises(openai.AuthenticationError, match="unknown API key"):
            openai.OpenAI(base_url=base_url, api_key="wrong", max_retries=0).chat.completions.create(
                model="m", messages=[{"role": "user", "content": "x"}]
            )
        messages: list[dict[str, Any]] = [{"role": "user", "content": "What is 6*7?"}]
        first = client.chat.completions.create(model="m", messages=messages)
        seen["first"] = first.choices[0].message
        messages.append(first.choices[0].message.model_dump(exclude_none=True))  # as agents send it back
        with pytest.raises(openai.BadRequestError, match="repeat this session's conversation"):
            client.chat.completions.create(
                model="m",
                messages=[
                    {"role": "user", "content": "other"},
                    *messages[1:],
                    {"role": "user", "content": "?"},
                ],
            )
        messages.append({"role": "tool", "content": "42"})
        second = client.chat.completions.create(model="m", messages=messages, max_tokens=8)
        seen["second"] = second.choices[0].message
        seen["finish"] = second.choices[0].finish_reason
        return 0.5

    driver = EndpointDriver(
        AgentSpec(loop="endpoint", runner="m:run"),
        agent,
        tokenizer=tokenizer,
        budget=160,
        max_prompt_tokens=32,
        temperature=1.0,
    )
    try:
        group = GenerationRequest(
            "g0", [1], SamplingParams(max_new_tokens=64, n=1, seed=1, return_logprobs=True)
        )
        driver.begin(group, {"prompt_text": "x"})
        result = serve(
            driver,
            ['<tool_call>{"name": "calculator", "arguments": {"expression": "6*7"}}</tool_call>', "42"],
            tokenizer,
        )
    finally:
        driver.close()
    (sample,) = result.samples
    assert seen["first"].tool_calls[0].function.name == "calculator" and seen["first"].content == ""
    assert seen["second"].content == "42" and seen["finish"] == "stop"
    encode = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    first_reply = [
        *encode('<tool_call>{"name": "calculator", "arguments": {"expression": "6*7"}}</tool_call>'),
        eos,
    ]
    inserted = encode("\n<|im_start|>tool\n42<|im_end|>\n<|im_start|>assistant\n")
    assert sample.prompt_token_ids == encode(
        "<|im_start|>user\nWhat is 6*7?<|im_end|>\n<|im_start|>assistant\n"
    )
    assert sample.token_ids == [*first_reply, *inserted, *encode("42"), eos]  # rule 1
    assert sample.loss_mask == [1] * len(first_reply) + [0] * len(inserted) + [1] * 3
    assert result.request.tag[0].reward == 0.5 and result.request.tag[0].turns == 2  # rule 3


def test_a_prompt_past_max_prompt_tokens_is_refused_and_the_session_ends_with_the_agents_error(
    tokenizer: Any,
) -> None:
    def agent(base_url: str, api_key: str, row: dict[str, Any]) -> float:
        client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x" * 100}])
        return 1.0

    driver = EndpointDriver(
        AgentSpec(loop="endpoint", runner="m:run"),
        agent,
        tokenizer=tokenizer,
        budget=16,
        max_prompt_tokens=32,
        temperature=1.0,
    )
    try:
        driver.begin(GenerationRequest("g0", [1], SamplingParams(max_new_tokens=16, n=2)), {})
        result = serve(driver, [], tokenizer)
    finally:
        driver.close()
    reasons = [stats.finish_reason for stats in result.request.tag]
    assert all("BadRequestError" in reason and "maxPromptTokens=32" in reason for reason in reasons)
    assert [s.token_ids for s in result.samples] == [[], []]
