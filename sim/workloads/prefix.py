"""Generated conversations that share prefixes: system prompts shared by groups of
conversations, and multi-turn conversations whose every turn resends the whole history.

A conversation is one token stream: a system prompt, question 1, answer 1, question 2,
answer 2, ... Turn k is one request: its prompt is the stream up to the end of question k, its
output is answer k. A shared conversation's system prompt is one of `num_groups` prompts; the
others have a system prompt of the same length of their own, so `shared_fraction` changes what
a prefix cache can reuse, not how many tokens arrive.

Hash ids (see `Workload`): block j of the stream, tokens [j * B, (j + 1) * B) with
B = `hash_block_tokens`, gets an id that every request holding the whole block shares: the
group's id for a block entirely inside a shared system prompt, the conversation's id beyond it.
So turn k starts with every full block of turn k-1's prompt and answer. A block of which a
request holds only part (its last one) gets an id of its own, as does, by the same rule, the
block that straddles the end of a shared system prompt (it holds each conversation's own
question). A request's ids cover its prompt and its answer.

Conversations start by `arrivals`; each later turn is sent a think time after the previous
answer reaches its client (`wait_for_answer`, as a chat user and both benchmarks below do: the
prefix cache then holds that answer, unless evicted), or, with `wait_for_answer: false`,
a think time after the previous turn was sent (open-loop: a turn may come before the answer
it resends is done).

Fields and the benchmark options they mirror (no code copied):

- SGLang `bench_serving.py --dataset-name generated-shared-prefix`: `gsp_num_groups` is
  `num_groups`, `gsp_num_groups * gsp_prompts_per_group` is `num_conversations`,
  `gsp_system_prompt_len` is `system_prompt_tokens`, `gsp_question_len` is `question_tokens`,
  `gsp_output_len` is `output_tokens`, `gsp_num_turns` is `num_turns`; `gsp_range_ratio` r is
  a uniform distribution on [r * len, len] (system prompts here have one length).
- vLLM `vllm bench serve --dataset-name prefix_repetition`: `--prefix-repetition-num-prefixes`,
  `-prefix-len`, `-suffix-len`, `-output-len` are `num_groups`, `system_prompt_tokens`,
  `question_tokens`, `output_tokens`. `--dataset-name random --random-prefix-len P` is one
  group of P tokens. `benchmarks/benchmark_prefix_caching.py --num-prompts N --repeat-count R`
  is N groups, N * R conversations, `question_tokens: 1`.
- vLLM `benchmarks/multi_turn` (generate_conversations): `num_conversations`;
  `prompt_input.num_turns` counts user and assistant messages, twice `num_turns`;
  `common_prefix_num_tokens` is one group's `system_prompt_tokens`;
  `prompt_input.num_tokens` is `question_tokens`; `prompt_output.num_tokens` is
  `output_tokens`.

Balanced groups, as both benchmarks give each prefix the same number of prompts: exactly
round(shared_fraction * num_conversations) conversations, chosen at random, are dealt to the
groups in turn (group sizes differ by at most one).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

import numpy as np
from pydantic import BeforeValidator, Field, model_validator

from sim.config.errors import InputError, Problem, invalid
from sim.workloads.base import (
    FORMATS,
    MAX_REQUESTS,
    MAX_SPAN_S,
    MAX_TOKENS,
    ArrivalConfig,
    Format,
    Sessions,
    Workload,
    WorkloadConfig,
)
from sim.workloads.synthetic import TokenDist

# Prefix-block ids in one workload: each is a tuple slot (8 bytes) and a Python int (32 bytes),
# so 10**8 of them take gigabytes; a larger hash_block_tokens needs fewer.
MAX_HASH_IDS = 10**8


def _fixed(value: Any) -> Any:
    """A bare integer is a fixed distribution (`question_tokens: 128`), as the benchmarks'
    options are."""
    return {"dist": "fixed", "value": value} if type(value) is int else value


Tokens = Annotated[TokenDist, BeforeValidator(_fixed)]


class PrefixConfig(WorkloadConfig):
    num_conversations: int = Field(gt=0, le=MAX_REQUESTS)
    arrivals: ArrivalConfig  # when conversations start
    question_tokens: Tokens  # each turn's new user message (a tool's output, for an agent)
    first_question_tokens: Tokens | None = Field(
        None, description="a first turn's message, if drawn apart from later turns' (a task "
                          "with its documents, then short follow-ups); none: question_tokens")
    output_tokens: Tokens  # each turn's answer
    num_turns: Tokens = Field(default_factory=lambda: TokenDist(dist="fixed", value=1))
    think_time_s: float = Field(10.0, ge=0, description="mean gap between a conversation's turns")
    think_time: Literal["exponential", "fixed"] = "exponential"
    wait_for_answer: bool = Field(
        True, description="a later turn is sent a think time after the previous answer reaches "
                          "its client (false: after the previous turn was sent, open-loop)")
    system_prompt_tokens: int = Field(0, ge=0, le=MAX_TOKENS)
    num_groups: int = Field(1, ge=1, le=MAX_REQUESTS, description="distinct shared system prompts")
    shared_fraction: float = Field(1.0, ge=0, le=1,
                                   description="conversations starting with a shared prompt")
    # 64: a multiple of the usual KV block sizes (16, 32, 64), so a hit ends on a KV block; a
    # hit is found to within 63 tokens (vLLM's 16-token blocks: 15) with a quarter of the ids
    # that 16 would store and walk; token_scale down to 0.25 still leaves 16-token blocks.
    hash_block_tokens: int = Field(64, ge=1, le=MAX_TOKENS,
                                   description="tokens per prefix-block id")

    @model_validator(mode="after")
    def _all_used(self) -> PrefixConfig:
        problems = self._ignored()
        if 0 < self.system_prompt_tokens < self.hash_block_tokens and self.shared_fraction > 0:
            problems.append(("system_prompt_tokens", self.system_prompt_tokens,
                             f"shorter than one hash block ({self.hash_block_tokens} tokens): "
                             "no block could be shared; lower hash_block_tokens"))
        if problems:
            raise invalid(*problems)
        return self

    def _ignored(self) -> list[Problem]:
        """Fields changed from their defaults that would silently do nothing."""
        why: dict[str, str] = {}
        if self.num_turns.dist == "fixed" and self.num_turns.value == 1:
            why |= dict.fromkeys(("think_time_s", "think_time", "wait_for_answer"),
                                 "has no effect with one turn")
        if self.system_prompt_tokens == 0:
            why |= dict.fromkeys(("num_groups", "shared_fraction"),
                                 "has no effect without system_prompt_tokens")
        elif self.shared_fraction == 0:
            why["num_groups"] = "has no effect when shared_fraction is 0"
        fields = type(self).model_fields
        return [(name, getattr(self, name), problem) for name, problem in why.items()
                if getattr(self, name) != fields[name].get_default(call_default_factory=True)]


@FORMATS.register("prefix")
class Prefix(Format):
    Config = PrefixConfig

    def load(self, config: PrefixConfig, base_dir: Path, rng: np.random.Generator) -> Workload:
        n = config.num_conversations
        start_s = config.arrivals.sample(n, rng)
        group = _groups(config, rng)
        turns = config.num_turns.sample(n, rng)
        total = _num_requests(config, turns)
        question = config.question_tokens.sample(total, rng)
        output = config.output_tokens.sample(total, rng)
        first = np.cumsum(turns) - turns  # each conversation's first request
        if config.first_question_tokens is not None:
            question[first] = config.first_question_tokens.sample(n, rng)
        think_s = (np.full(total, config.think_time_s) if config.think_time == "fixed"
                   else rng.exponential(config.think_time_s, total))
        think_s[first] = 0.0
        # Stream tokens up to the end of each turn's answer; its prompt is all but the answer.
        covered = config.system_prompt_tokens + _within(question + output, first, turns)
        prompt = covered - output
        _check_prompts(config, prompt, first, turns)
        offset_s = _within(think_s, first, turns)
        _check_span(config, offset_s)
        arrival_s = np.repeat(start_s, turns) + offset_s
        hash_ids = _hash_ids(config, group, turns, covered)
        # Stable: a conversation's turns arriving together keep their order.
        order = np.argsort(arrival_s, kind="stable")
        sessions = None
        if config.wait_for_answer and total > n:
            sessions = _sessions(first, turns, think_s).take(order)
        return Workload(arrival_s[order], prompt[order], output[order],
                        [hash_ids[i] for i in order.tolist()], config.hash_block_tokens,
                        sessions=sessions)


def _sessions(first: np.ndarray, turns: np.ndarray, think_s: np.ndarray) -> Sessions:
    """Each conversation a session: turn k (k > 0) waits for the answer to turn k - 1, then
    its think time; requests in conversation order."""
    total = len(think_s)
    session = np.repeat(np.arange(len(turns)), turns)
    turn = np.arange(total) - np.repeat(first, turns)
    after = np.where(turn > 0, np.arange(total) - 1, -1)
    return Sessions(after.astype(np.int64), think_s, session, turn)


def _groups(config: PrefixConfig, rng: np.random.Generator) -> np.ndarray:
    """Each conversation's system-prompt group, or -1 for a prompt of its own."""
    n = config.num_conversations
    num_shared = round(config.shared_fraction * n) if config.system_prompt_tokens else 0
    group = np.full(n, -1, dtype=np.int64)
    group[rng.permutation(n)[:num_shared]] = np.arange(num_shared) % config.num_groups
    return group


def _within(values: np.ndarray, first: np.ndarray, turns: np.ndarray) -> np.ndarray:
    """Running sums that restart at each conversation's first request."""
    total = np.cumsum(values)
    before = total[first] - values[first]
    return total - np.repeat(before, turns)


def _num_requests(config: PrefixConfig, turns: np.ndarray) -> int:
    total = int(turns.sum())
    if total > MAX_REQUESTS:
        raise InputError(config._source, "workload.num_turns", int(turns.max()),
                         f"makes {total} requests in {config.num_conversations} conversations "
                         f"(at most {MAX_REQUESTS})")
    return total


def _check_prompts(config: PrefixConfig, prompt: np.ndarray, first: np.ndarray,
                   turns: np.ndarray) -> None:
    """Prompts within MAX_TOKENS; the error names what made one long: a first turn's system
    prompt, or a later turn's history."""
    if prompt.max() > MAX_TOKENS:
        row = int(np.argmax(prompt > MAX_TOKENS))
        field, value = "num_turns", int(turns.max())
        value_shown: Any = value
        if (first == row).any():
            field, value_shown = "system_prompt_tokens", config.system_prompt_tokens
            if config.first_question_tokens is not None:
                field = "first_question_tokens"
                value_shown = config.first_question_tokens.model_dump(exclude_none=True)
        raise InputError(config._source, f"workload.{field}", value_shown,
                         f"makes a prompt of {prompt[row]} tokens (at most {MAX_TOKENS})")


def _check_span(config: PrefixConfig, offset_s: np.ndarray) -> None:
    """Think times keep every turn within MAX_SPAN_S of its conversation's start."""
    last_s = float(offset_s.max()) if np.isfinite(offset_s).all() else float("inf")
    if last_s >= MAX_SPAN_S:
        raise InputError(config._source, "workload.think_time_s", config.think_time_s,
                         f"a conversation spans {last_s:.3g} s; simulated times keep "
                         "microsecond resolution only below 2**32 s (136 years)")


def _hash_ids(config: PrefixConfig, group: np.ndarray, turns: np.ndarray,
              covered: np.ndarray) -> list[tuple[int, ...]]:
    """Each request's ids, conversation by conversation (see the module's docstring). Group g's
    system-prompt blocks are ids g*m ... g*m + m - 1; every other id is drawn from a counter
    after them."""
    size = config.hash_block_tokens
    num_ids = int((-(-covered // size)).sum())
    if num_ids > MAX_HASH_IDS:
        raise InputError(config._source, "workload.hash_block_tokens", size,
                         f"makes {num_ids:.3g} prefix-block ids (at most {MAX_HASH_IDS:.0e}): "
                         "raise it")
    m = config.system_prompt_tokens // size  # full blocks inside one system prompt
    next_id = config.num_groups * m
    shared: dict[int, tuple[int, ...]] = {}
    ids: list[tuple[int, ...]] = []
    ends = covered.tolist()
    start = 0
    for g, num_turns in zip(group.tolist(), turns.tolist(), strict=True):
        if g >= 0 and g not in shared:
            shared[g] = tuple(range(g * m, (g + 1) * m))
        prefix = shared[g] if g >= 0 else ()
        num_own = ends[start + num_turns - 1] // size - len(prefix)
        stream = prefix + tuple(range(next_id, next_id + num_own))
        next_id += num_own
        for end in ends[start:start + num_turns]:
            if end % size:  # a part-block: its tokens are this request's alone
                ids.append(stream[:end // size] + (next_id,))
                next_id += 1
            else:
                ids.append(stream[:end // size])
        start += num_turns
    return ids
