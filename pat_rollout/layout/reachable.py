"""Every layout the planner can reach from a start layout, so all their groups can be built once."""

from __future__ import annotations

from collections.abc import Iterable

from pat_rollout.layout.layout import Layout


def reachable_layouts(initial: Layout, tp_sizes: Iterable[int]) -> list[Layout]:
    """Layouts reachable from `initial` by `plan_layout(..., base=initial)` transitions between `tp_sizes`, in a
    deterministic order (breadth first, TP ascending). Since plan_layout is deterministic, these are
    exactly the concrete groups a run can switch to."""
    from pat_rollout.layout.transition import plan_layout

    sizes = sorted(set(tp_sizes) | {initial.tp_size})
    seen: list[Layout] = [initial]
    frontier = [initial]
    while frontier:
        nxt: list[Layout] = []
        for layout in frontier:
            for tp in sizes:
                if tp == layout.tp_size:
                    continue
                cand = plan_layout(layout, tp, base=initial)
                if cand not in seen:
                    seen.append(cand)
                    nxt.append(cand)
        frontier = nxt
    return seen
