"""A deterministic multi-turn trace with shared prefixes: what a chat service sends.

A few system prompts are shared by many conversations; each conversation grows turn by turn
(the next prompt is the previous one plus the reply and a new user message); a few cold
requests share nothing. Turns of different conversations interleave at random (users come
back after varied pauses), so a conversation's earlier pages may still be in the engine's
pool (L1), in host memory (L2), or only in L3 by the time its next turn arrives.
"""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class TraceOptions:
    conversations: int = 16
    turns: int = 4
    system_prompts: int = 3
    system_tokens: int = 256
    turn_tokens: int = 96  # reply + new user message added per turn
    cold_requests: int = 6
    cold_tokens: int = 320
    seed: int = 0
    vocab: int = 150_000


@dataclass(frozen=True, slots=True)
class Request:
    name: str  # "conv3/turn2", "cold1"
    tokens: tuple[int, ...]


def build_trace(opts: TraceOptions) -> list[Request]:
    rng = random.Random(opts.seed)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(opts.vocab) for _ in range(n)]

    systems = [tokens(opts.system_tokens) for _ in range(opts.system_prompts)]
    histories = [list(systems[c % opts.system_prompts]) for c in range(opts.conversations)]
    turns_left = [opts.turns] * opts.conversations
    total = opts.conversations * opts.turns
    cold_at = set(rng.sample(range(total), min(opts.cold_requests, total)))
    trace: list[Request] = []
    colds = 0
    for step in range(total):
        # users come back after varied pauses: any open conversation may be next
        conv = rng.choice([c for c, left in enumerate(turns_left) if left])
        turn = opts.turns - turns_left[conv]
        turns_left[conv] -= 1
        histories[conv] += tokens(opts.turn_tokens)
        trace.append(Request(f"conv{conv}/turn{turn}", tuple(histories[conv])))
        if step in cold_at:
            trace.append(Request(f"cold{colds}", tuple(tokens(opts.cold_tokens))))
            colds += 1
    while colds < opts.cold_requests:
        trace.append(Request(f"cold{colds}", tuple(tokens(opts.cold_tokens))))
        colds += 1
    return trace
