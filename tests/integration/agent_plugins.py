"""An agent loop plugin for the tests (``spec.agent.loop: agent_plugins:ObservationLoop``).

A random model never writes a tool call, so the built-in loop ends every trajectory after one
turn. This loop, like an environment, answers every model turn with an observation until
``maxTurns``, so that real jobs run trajectories of several turns with inserted tokens.
"""

from __future__ import annotations

from hybridflow.agents.loop import Finish, Insert, TurnContext
from hybridflow.agents.tools import ToolOutcome
from hybridflow.spec.agent import AgentSpec


class ObservationLoop:
    def __init__(self, spec: AgentSpec) -> None:
        self.spec = spec

    def after_turn(self, context: TurnContext) -> Finish | Insert:
        if context.final is not None:  # the last allowed turn (maxTurns or the budget): it ends here
            return Finish(context.final)
        return Insert(
            f"<|im_start|>user\nobservation {context.turn}<|im_end|>\n<|im_start|>assistant\n",
            [ToolOutcome("ok", True, 0.01, 1)],
        )


def chat_agent(base_url: str, api_key: str, row: dict) -> float:
    """A black-box agent (``spec.agent.runner``): two turns through the job's chat endpoint with the
    openai client, an observation between them; scores 1 if its last reply is not empty."""
    from openai import OpenAI

    client = OpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=300)
    messages: list[dict] = [{"role": "user", "content": str(row.get("prompt_text", "hello"))[:40]}]
    content = ""
    for turn in range(2):
        reply = client.chat.completions.create(model="hybridflow-policy", messages=messages, max_tokens=6)
        content = reply.choices[0].message.content or ""
        messages.append({"role": "assistant", "content": content})
        if turn == 0:
            messages.append({"role": "user", "content": "observation"})
    return 1.0 if content else 0.0
