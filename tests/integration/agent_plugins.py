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
        if context.turn >= self.spec.max_turns:
            return Finish()
        return Insert(
            f"<|im_start|>user\nobservation {context.turn}<|im_end|>\n<|im_start|>assistant\n",
            [ToolOutcome("ok", True, 0.01, 1)],
        )
