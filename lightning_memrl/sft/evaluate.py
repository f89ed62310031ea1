"""The valid-operation rate of a memory manager on the manager prompts of annotated facts."""

from __future__ import annotations

from collections import Counter
from typing import Any

from lightning_memrl.memory.operations import parse_memory_operation
from lightning_memrl.rollout.base import RolloutBackend
from lightning_memrl.settings import GenerationSettings
from lightning_memrl.sft.targets import SFTExample
from lightning_memrl.types import MEMORY_TURN
from lightning_memrl.workflows.memory_r1 import MemoryR1Workflow


def valid_operation_rate(
    workflow: MemoryR1Workflow, engine: RolloutBackend, examples: list[SFTExample]
) -> dict[str, Any]:
    """Run the manager greedily on the ``manage`` examples and count the usable operations.

    An output counts as valid when :func:`parse_memory_operation` (the RL stage's parser) reads an
    operation from it that the bank can apply: UPDATE/DELETE must name a memory the prompt showed.

    Args:
        workflow: the Memory-R1 workflow (its manager's token cap and system prompt).
        engine: the model generating the manager's outputs.
        examples: examples from :func:`~lightning_memrl.sft.targets.build_sft_examples`; only ``manage`` ones are run.

    Returns:
        ``facts``, ``valid``, ``rate`` (valid / facts), ``ops`` (operations read), ``problems`` (why
        outputs were unusable), ``agree`` (outputs whose operation is the target's) and ``samples``
        (the first five outputs with their target).
    """
    manage = [e for e in examples if e.part == "manage"]
    if not manage:
        raise ValueError("valid_operation_rate needs 'manage' examples (build them with parts including 'manage')")
    turns = workflow.generate_turns(
        engine,
        [e.prompt for e in manage],
        GenerationSettings().greedy(),
        workflow.manage_max_tokens,
        MEMORY_TURN,
        False,
    )
    ops: Counter[str] = Counter()
    problems: Counter[str] = Counter()
    valid = agree = 0
    for example, turn in zip(manage, turns):
        parsed = parse_memory_operation(turn.text, set(example.meta["shown_ids"]), example.meta["fact"])
        wanted = parse_memory_operation(example.target, set(example.meta["shown_ids"]), example.meta["fact"])
        if parsed.valid:
            valid += 1
            ops[parsed.op.value] += 1
            agree += parsed.op is wanted.op
        else:
            kind = "unknown memory id" if "unknown memory id" in parsed.problem else parsed.problem.split(" '")[0]
            problems[kind] += 1
    return {
        "facts": len(manage),
        "valid": valid,
        "rate": valid / len(manage),
        "agree": agree,
        "ops": dict(ops),
        "problems": dict(problems),
        "samples": [{"output": t.text, "target": e.target} for e, t in list(zip(manage, turns))[:5]],
    }
