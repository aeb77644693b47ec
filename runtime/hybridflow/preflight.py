"""What ``hybridflow validate`` and ``hybridflow run`` check before Ray starts.

A job naming a plugin that does not import, or a parallel size its model's heads cannot take,
used to fail only once Ray and the workers were up, 10-20 s later and with a worker's
traceback. These checks read the spec, the local files it names (``config.json``, the
tokenizer) and the modules its import paths name; they start nothing and load no weights.
Each problem is one line: the field path, the value, and what is allowed.

Protocol (who calls what):

- ``file_problems(spec)``: the local paths a run reads (model and tokenizer directories and
  their ``config.json``, the train files). ``run`` refuses them; ``validate`` prints them as
  notes (a manifest is often checked before its model is on the machine, or on another one).
- ``plugin_problems(spec)``: every import path of the spec resolves here. Importing a module
  runs its top level, nothing else; an import error names the field, the path and the error,
  while any other exception of the user's module propagates (its traceback is the useful
  message, as in ``hybridflow.plugins``). Errors of ``validate`` and ``run``; with
  ``validate --in-cluster`` notes (the job's image is where they must import).
- ``model_problems(spec)``: what loading the models would refuse, for each model whose
  ``config.json`` is readable here; the others are skipped (``file_problems`` names them).
  The same functions refuse them again at load, the last word for a model no preflight read.
- ``problems(spec)``: all three, in that order: what ``run`` refuses.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from hybridflow.spec import RLHFJobSpec
from hybridflow.spec.agent import BUILTIN_LOOPS, BUILTIN_TOOLS
from hybridflow.spec.algorithm import BUILTIN_ALGORITHMS
from hybridflow.spec.models import ModelSource

__all__ = ["file_problems", "model_problems", "plugin_problems", "problems"]


def problems(spec: RLHFJobSpec) -> list[str]:
    """Everything ``hybridflow run`` refuses before Ray starts."""
    return file_problems(spec) + plugin_problems(spec) + model_problems(spec)


def _model_sources(spec: RLHFJobSpec) -> dict[str, ModelSource]:
    """The models a run loads, by their field name under ``spec.models``."""
    sources = {
        "actor": spec.models.actor,
        "reference": spec.models.reference,  # None: the actor is the reference (checked as the actor)
        "critic": spec.models.critic,
        "reward": spec.models.reward,
        "cost": spec.models.cost,
    }
    return {role: source for role, source in sources.items() if source is not None}


def file_problems(spec: RLHFJobSpec) -> list[str]:
    """The model and tokenizer directories, their ``config.json`` and the prompt files that are not here."""
    found: list[str] = []
    for role, source in _model_sources(spec).items():
        field = f"spec.models.{role}"
        if not Path(source.path).is_dir():
            found.append(f"{field}.path: {source.path} does not exist (models load from local directories)")
        elif not (Path(source.path) / "config.json").is_file():
            found.append(
                f"{field}.path: {source.path} is not a Hugging Face model directory (no config.json); "
                "models load from a local path or volume, never from a model hub"
            )
        if source.tokenizer_path is not None and not Path(source.tokenizer_path).is_dir():
            found.append(f"{field}.tokenizerPath: {source.tokenizer_path} does not exist")
    found += [
        f"spec.data.{field}[{index}]: {path} does not exist"
        for field, files in (("trainFiles", spec.data.train_files), ("valFiles", spec.data.val_files))
        for index, path in enumerate(files)
        if not Path(path).is_file()
    ]
    return found


def _import_paths(spec: RLHFJobSpec) -> list[tuple[str, str, bool]]:
    """``(field, import path, must be callable)`` for every plugin the spec names (not the built-ins).

    Callability is what every loader asks first; the rest of each plugin's shape (a loop's
    methods, a tool's ``name``) is checked where it is built. An agent loop may be an object
    with ``after_turn`` rather than a callable.
    """
    agent = spec.agent
    paths: list[tuple[str, str, bool]] = []
    if spec.algorithm.name not in BUILTIN_ALGORITHMS:
        paths.append(("spec.algorithm.name", spec.algorithm.name, True))
    if agent.loop not in BUILTIN_LOOPS:
        paths.append(("spec.agent.loop", agent.loop, False))
    if agent.loop == "endpoint" and agent.runner is not None:
        paths.append(("spec.agent.runner", agent.runner, True))
    paths += [
        (f"spec.agent.tools[{index}]", tool, True)
        for index, tool in enumerate(agent.tools)
        if tool not in BUILTIN_TOOLS
    ]
    return paths


def plugin_problems(spec: RLHFJobSpec) -> list[str]:
    """The import paths of the spec (algorithm, agent loop, runner, tools, tool parser, rewards) that do not resolve."""
    from hybridflow.plugins import import_attribute
    from hybridflow.rewards import resolve_reward_function

    found: list[str] = []
    for field, path, must_call in _import_paths(spec):
        try:
            target = import_attribute(path, field)
        except ValueError as err:
            found.append(str(err))
            continue
        if must_call and not callable(target):
            found.append(f"{field}: {path!r} names a {type(target).__name__}, not a function or class")
    if spec.agent.loop in ("tools", "endpoint"):  # the loops that parse tool calls
        from hybridflow.agents.tool_calls import load_parser

        try:
            load_parser(spec.agent.tool_parser)
        except ValueError as err:
            found.append(str(err))
    for index, reward in enumerate(spec.rewards):
        try:
            resolve_reward_function(reward.function, f"spec.rewards[{index}].function")
        except ValueError as err:
            found.append(str(err))
    return found


def _read_config(source: ModelSource) -> dict[str, Any] | None:
    """The model's ``config.json``, or ``None`` where it cannot be read here."""
    try:
        config = json.loads((Path(source.path) / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return config if isinstance(config, dict) else None


def model_problems(spec: RLHFJobSpec) -> list[str]:
    """What loading the readable models would refuse: tokenizer, heads vs parallel sizes, architecture."""
    configs = {role: _read_config(source) for role, source in _model_sources(spec).items()}
    readable = {role: config for role, config in configs.items() if config is not None}
    found: list[str] = []
    if "actor" in readable:
        found += _tokenizer_problems(spec.models.actor)
    training = spec.training
    if training.backend == "fsdp" and training.sequence_parallel_size > 1:
        found += _sequence_parallel_problems(spec, readable)
    if training.backend == "megatron":
        found += _megatron_problems(spec, readable)
    rollout = spec.rollout
    sharded_vllm = (
        rollout.engine == "vllm" and not spec.rollout_has_own_pool and rollout.tensor_parallel_size > 1
    )
    if "actor" in readable and sharded_vllm:  # trainer.roles.uses_sharded_vllm, without Ray's import
        found += _vllm_split_problems(rollout.tensor_parallel_size, readable["actor"])
    return list(dict.fromkeys(found))  # a reference at the actor's path: each problem once


def _tokenizer_problems(actor: ModelSource) -> list[str]:
    """The actor's tokenizer loads and has no token past the model's embedding rows."""
    from hybridflow.models.compat import tokenizer_model_mismatch

    tokenizer_dir = actor.tokenizer_path or actor.path
    if not Path(tokenizer_dir).is_dir():
        return []  # file_problems names it
    field = "spec.models.actor.tokenizerPath" if actor.tokenizer_path else "spec.models.actor.path"
    try:
        mismatch = tokenizer_model_mismatch(actor.path, tokenizer_dir)
    except Exception as err:  # transformers' many errors for a directory it cannot read, all the user's
        first_line = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        return [f"{field}: {tokenizer_dir} holds no tokenizer transformers can load ({first_line})"]
    return [f"spec.models.actor: {mismatch}"] if mismatch else []


def _sequence_parallel_problems(spec: RLHFJobSpec, configs: dict[str, dict[str, Any]]) -> list[str]:
    """Ulysses splits the heads of the actor and the reference (the models that run sequence-parallel)."""
    from hybridflow.backends.fsdp.ulysses import sequence_parallel_problem

    found: list[str] = []
    for role in ("actor", "reference"):
        config = configs.get(role)
        if config is None:
            continue
        if not isinstance(config.get("num_attention_heads"), int):
            continue  # not a decoder config this check reads; the backend refuses at load
        heads = int(config["num_attention_heads"])
        kv_heads = int(config.get("num_key_value_heads") or heads)
        path = _model_sources(spec)[role].path
        problem = sequence_parallel_problem(heads, kv_heads, spec.training.sequence_parallel_size, path)
        if problem is not None:
            found.append(problem)
    return found


def _megatron_problems(spec: RLHFJobSpec, configs: dict[str, dict[str, Any]]) -> list[str]:
    """The megatron backend represents the architecture, and tp/pp split its heads, MLP and layers."""
    try:  # the package imports megatron-core, which a machine that only validates may lack
        from hybridflow.backends.megatron.config import DecoderArch
    except ImportError:
        return []  # the workers, which have it, refuse at load

    training = spec.training
    tp, pp = training.tensor_parallel_size, training.pipeline_parallel_size
    found: list[str] = []
    for role in ("actor", "reference", "critic"):  # the roles megatron trains or runs (roles.job_roles)
        config = configs.get(role)
        if config is None:
            continue
        path = _model_sources(spec)[role].path
        try:
            arch = DecoderArch.from_hf_config(config)
        except (ValueError, TypeError) as err:  # TypeError: a size missing from config.json
            found.append(f"spec.models.{role}.path: {path}: {err} (spec.training.backend 'megatron')")
            continue
        for field, value, sizes in (
            ("tensorParallelSize", tp, {"tp_size": tp, "pp_size": 1}),
            ("pipelineParallelSize", pp, {"tp_size": 1, "pp_size": pp}),
        ):
            try:
                arch.check_parallel(**sizes)
            except ValueError as err:
                found.append(f"spec.training.{field}: {value} does not fit {path}: {err}")
    return found


def _vllm_split_problems(tensor_parallel_size: int, config: dict[str, Any]) -> list[str]:
    """vLLM's tensor-parallel shards of the actor are the resharding layout's (``vllm_shards``)."""
    from hybridflow.engines.vllm_shards import check_vllm_split
    from hybridflow.resharding.layout import DecoderSpec, ReshardingError

    try:
        check_vllm_split(DecoderSpec.from_hf_config(SimpleNamespace(**config)), tensor_parallel_size)
    except (
        ReshardingError,
        AttributeError,
        TypeError,
    ) as err:  # the last two: a size missing from config.json
        return [f"spec.rollout.tensorParallelSize: {tensor_parallel_size}: {err}"]
    return []
