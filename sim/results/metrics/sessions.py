"""Per-session metrics of a run whose requests are turns of sessions (`session`, `turn`
columns): how many sessions finished every turn, how long those took, and by turn its TTFT
and how much of its prompt the prefix cache held (a later turn resends the turns before)."""

from __future__ import annotations

from typing import Any

import numpy as np

from sim.results.columns import Table, column
from sim.results.metrics.summary import FINISHED, distribution, finished_distribution

MAX_TURNS_SHOWN = 16  # turns from this one on are summed into one row


def session_stats(requests: Table) -> dict[str, Any]:
    """`num_sessions`, `num_completed` (every turn finished), `duration_s` (first send to last
    finish, over completed sessions) and `by_turn`: per turn (the last row `MAX_TURNS_SHOWN`
    and beyond), requests, finished ones, their TTFT, and the prefix cache's hit rate over
    the prompt tokens of those admitted."""
    session, turn = column(requests, "session"), column(requests, "turn")
    done = column(requests, "status") == FINISHED
    ids, index = np.unique(session, return_inverse=True)
    num_turns = np.bincount(index)
    num_done = np.bincount(index, weights=done)
    completed = num_done == num_turns
    start = np.full(len(ids), np.inf)
    np.minimum.at(start, index, column(requests, "arrival_s"))
    end = np.full(len(ids), -np.inf)
    np.maximum.at(end, index, np.where(done, column(requests, "finish_s"), -np.inf))
    ttft = column(requests, "ttft_s")
    admitted = ~np.isnan(column(requests, "first_scheduled_s"))
    prompt, cached = column(requests, "num_prompt_tokens"), column(requests, "num_cached_tokens")
    shown = np.minimum(turn, MAX_TURNS_SHOWN)
    by_turn = []
    for t in np.unique(shown).tolist():
        rows = shown == t
        num_prompt = int(prompt[rows & admitted].sum())
        by_turn.append({
            "turn": t, **({"and_later": True} if t == MAX_TURNS_SHOWN else {}),
            "requests": int(rows.sum()), "finished": int((rows & done).sum()),
            "ttft_s": finished_distribution(ttft[rows & done]),
            "hit_rate_tokens": (int(cached[rows & admitted].sum()) / num_prompt
                                if num_prompt else None)})
    return {"num_sessions": len(ids), "num_completed": int(completed.sum()),
            "duration_s": distribution((end - start)[completed]), "by_turn": by_turn}
