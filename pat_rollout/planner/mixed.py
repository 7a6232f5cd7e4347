"""Mixed PAT (issue #26, simulator only): the planner over buddy layouts, where every TP group is an aligned
power-of-two block of devices and an action merges two buddy blocks or splits one (only that block pauses; the
other blocks keep decoding).

On a uniform layout it asks the uniform planner first (`Planner.decide`: its regroup or rebalance, with its own
bookkeeping) and takes a buddy action instead only when that is predicted to save more; on a mixed layout it weighs
the buddy actions against a whole-pool regroup. Every action is scored by the uniform regroup's estimate (the drain
estimator: `estimator.replica_drain_s` per block on the predictor's mean remaining lengths; the switch cost of
`planner.cost` with the planner's calibration on the block's own devices; `rebalance.rebalance_cost` for requests
handed to another block): the predicted stage end is the latest over blocks of (its pause + its drain). It never
sees true lengths: "the longest to the merged group" means the most PREDICTED remaining tokens. Pure stdlib.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from pat_rollout.planner.balance import balance
from pat_rollout.planner.estimator import drain_s, replica_drain_s
from pat_rollout.planner.policy import Planner
from pat_rollout.planner.rebalance import Move, rebalance_cost
from pat_rollout.planner.state import ClusterState, Decision, ReqProgress

Block = tuple[int, int]  # (first device, size): an aligned power-of-two block of devices, one TP group

SHARES = (1.0, 0.25)  # how many of the longest a merged group takes, as a share of its share of the devices


def is_buddy(start: int, size: int) -> bool:
    """An aligned power-of-two block: size 2^k, start a multiple of size."""
    return size >= 1 and size & (size - 1) == 0 and start >= 0 and start % size == 0


def buddy_groups(num_devices: int) -> list[Block]:
    """Every buddy block (start, size) on `num_devices` (a power of two) devices: 2N-1 of them."""
    if not is_buddy(0, num_devices):
        raise ValueError(f"num_devices={num_devices} must be a power of two for buddy layouts")
    out, size = [], 1
    while size <= num_devices:
        out += [(s, size) for s in range(0, num_devices, size)]
        size *= 2
    return out


def longest_moves(blocks: Sequence[Block], items: Sequence[tuple[str, int, float, int]], start: int, size: int,
                  num_devices: int, share: float = 1.0) -> tuple[tuple[str, ...], tuple[tuple[str, int], ...]]:
    """"The longest to the merged group" for merging (start, size) with its buddy. `items`: (request id, index of
    its block in `blocks`, remaining tokens, context tokens) of every unfinished request (remaining: the planner's
    prediction, or the truth for the oracle). The top are the ceil(len(items) * share * 2 * size / num_devices)
    requests with the most remaining tokens (share 1: the merged group's share of the devices).
    Returns (pull: the top ones on other blocks, push: the buddies' other requests, each sent to the other block
    with the fewest context tokens per device so far, longest context first)."""
    i, j = list(blocks).index((start, size)), list(blocks).index((start + size, size))
    left = sorted(((rem, rid, k, ctx) for rid, k, rem, ctx in items), reverse=True)
    n_top = math.ceil(len(left) * share * 2 * size / num_devices)
    pull = tuple(sorted(rid for _, rid, k, _ in left[:n_top] if k not in (i, j)))
    others = [k for k in range(len(blocks)) if k not in (i, j)]
    load = {k: 0.0 for k in others}
    for _, rid, k, ctx in left:
        if k in load and rid not in pull:
            load[k] += ctx
    push = []
    for _, rid, _, ctx in [] if not others else sorted((x for x in left[n_top:] if x[2] in (i, j)),
                                                       key=lambda x: (-x[3], x[1])):
        k = min(others, key=lambda k: (load[k] / blocks[k][1], k))
        load[k] += ctx
        push.append((rid, blocks[k][0]))
    return pull, tuple(sorted(push))


@dataclass(frozen=True, kw_only=True, slots=True)
class MixedState:
    """ClusterState over a buddy layout: `blocks` in device order (they tile [0, num_devices)), each request's
    `replica` the index of its block. `tp` is the layout's TP while it is uniform, 0 while it is mixed."""

    step: int
    num_devices: int
    blocks: tuple[Block, ...]
    requests: tuple[ReqProgress, ...]

    def __post_init__(self) -> None:
        at = 0
        for start, size in self.blocks:
            if start != at or not is_buddy(start, size):
                raise ValueError(f"blocks={self.blocks} must be aligned power-of-two blocks tiling "
                                 f"[0, {self.num_devices}) in order")
            at += size
        if at != self.num_devices:
            raise ValueError(f"blocks={self.blocks} cover {at} devices, not num_devices={self.num_devices}")
        bad = [r.request_id for r in self.requests if r.replica is None or not 0 <= r.replica < len(self.blocks)]
        if bad:
            raise ValueError(f"requests {bad[:5]} have no block index in [0, {len(self.blocks)})")

    @property
    def tp(self) -> int:
        sizes = {size for _, size in self.blocks}
        return sizes.pop() if len(sizes) == 1 else 0

    def uniform(self) -> ClusterState | None:
        """The same state as the uniform planner's ClusterState (None while the layout is mixed)."""
        if not self.tp:
            return None
        return ClusterState(step=self.step, num_devices=self.num_devices, tp=self.tp, requests=self.requests)


@dataclass(frozen=True, kw_only=True, slots=True)
class BuddyDecision:
    """Act now on one block: "merge" (start, size) with its buddy (start + size, size), the requests `pull` (ids on
    other blocks) joining the merged group and `push` ((id, start device of another block)) leaving it; or "split"
    (start, size) into its halves. Predictions in seconds: the stage's remaining time if we stay, and after the
    action with every pause included (the blocks that do not pause keep decoding)."""

    step: int
    action: str
    start: int
    size: int
    predicted_remaining_now_s: float
    predicted_remaining_after_s: float
    reason: str
    pull: tuple[str, ...] = ()
    push: tuple[tuple[str, int], ...] = ()

    def __post_init__(self) -> None:
        if self.action not in ("merge", "split") or (self.action == "split" and (self.pull or self.push)):
            raise ValueError(f"action={self.action!r} must be 'merge' or 'split' (a split moves no named requests)")

    @property
    def predicted_saving_s(self) -> float:
        return self.predicted_remaining_now_s - self.predicted_remaining_after_s


class MixedPlanner:
    """Mixed PAT over one `Planner` (its predictor, calibration, configuration and uniform decisions). Per stage:
    `start_stage()`; every poll `decide(state)`, state a MixedState. Buddy actions have their own cap
    (max_reconfigs_per_stage) and share min_steps_between_switches with every other action; a block made by a merge
    is not split, and a split block's halves not merged back, for no_return_steps; only_grow forbids splits."""

    def __init__(self, planner: Planner, shares: Sequence[float] = SHARES) -> None:
        if planner.config.estimator != "drain":
            raise ValueError(f"MixedPlanner scores blocks with the drain estimate; its planner must use "
                             f"estimator='drain', not {planner.config.estimator!r}")
        self.planner = planner
        self.shares = tuple(shares)
        self.start_stage(planner_too=False)

    def start_stage(self, planner_too: bool = True) -> None:
        if planner_too:
            self.planner.start_stage()
        self.actions: list[tuple[int, str, Block]] = []  # (step, "merge" | "split", the block made or split)
        self._last_eval_step: int | None = None

    # ---- scoring -----------------------------------------------------------------------------------------------
    def _drain(self, size: int, reqs: Sequence[ReqProgress], rem: dict[str, int]) -> float:
        return replica_drain_s(self.model, size, [rem[r.request_id] for r in reqs], [r.num_tokens for r in reqs])

    def _after(self, rem: dict[str, int], stay: list[float], i: int, j: int, new: list[Block],
               per: list[list[ReqProgress]], pause: list[float], moved: set[int]) -> float:
        """The stage end after replacing blocks i..j-1 by `new` (their requests `per`, pauses `pause`); blocks in
        `moved` (indices in the old layout, outside i..j-1) changed requests and are re-drained with their pause."""
        out = max((p + self._drain(b[1], reqs, rem) for b, reqs, p in zip(new, per, pause)), default=0.0)
        for k, t in enumerate(stay):
            if not i <= k < j and k not in moved:
                out = max(out, t)
        return out

    def options(self, state: MixedState) -> tuple[float, list[BuddyDecision]]:
        """Predicted remaining seconds if we stay, and every buddy action on `state`'s layout as a BuddyDecision
        (no hysteresis, no margin): each merge of two buddies as is, pulling the predicted longest in, and
        swapping (the longest in, the buddies' others out; `longest_moves` for each of `shares`); each split. None
        on a uniform layout of one or two blocks: there each is a uniform regroup, the uniform planner's to make."""
        self.model = self.planner.estimator_model()
        rem = self.planner.predict_remaining(state)  # reads state.requests only
        blocks = list(state.blocks)
        on: list[list[ReqProgress]] = [[] for _ in blocks]
        for r in state.requests:
            on[int(r.replica)].append(r)  # type: ignore[arg-type]
        stay = [self._drain(size, reqs, rem) for (_, size), reqs in zip(blocks, on)]
        now_s = max(stay, default=0.0)
        cost = self.planner._cost
        out: list[BuddyDecision] = []
        items = [(r.request_id, int(r.replica), float(rem[r.request_id]), r.num_tokens)  # type: ignore[arg-type]
                 for r in state.requests]
        whole = state.tp != 0 and len(blocks) <= 2  # a buddy action here is a uniform regroup: the planner's
        for i, (start, size) in enumerate(blocks):
            if whole:
                break
            if start % (2 * size) == 0 and i + 1 < len(blocks) and blocks[i + 1] == (start + size, size):
                moves = {((), ())}
                for share in self.shares:
                    pull, push = longest_moves(blocks, items, start, size, state.num_devices, share)
                    moves |= {(pull, ()), (pull, push)} if len(blocks) > 2 else {(pull, ())}
                for pull, push in sorted(moves):
                    out.append(self._merge(state, rem, stay, on, i, pull, push, now_s))
            if size >= 2:
                half = size // 2
                tokens = [r.num_tokens for r in on[i]]
                dest = balance(tokens, 2)  # the Reconfigurer's rule, as MixedSim splits
                halves = [[r for r, d in zip(on[i], dest) if d == k] for k in range(2)]
                pause = (cost(self.model, size, size, half, tokens).total_s
                         + cost(self.model, size, half, size, tokens).total_s)  # and back, as a uniform shrink
                after = self._after(rem, stay, i, i + 1, [(start, half), (start + half, half)], halves,
                                    [pause, pause], set())
                out.append(BuddyDecision(step=state.step, action="split", start=start, size=size,
                                         predicted_remaining_now_s=now_s, predicted_remaining_after_s=after,
                                         reason=f"split {size}@{start}: {pause:.3f}s pause incl. the way back"))
        return now_s, out

    def _merge(self, state: MixedState, rem: dict[str, int], stay: list[float], on: list[list[ReqProgress]], i: int,
               pull: tuple[str, ...], push: tuple[tuple[str, int], ...], now_s: float) -> BuddyDecision:
        start, size = state.blocks[i]
        starts = [s for s, _ in state.blocks]
        pushed, pulled = dict(push), set(pull)
        merged = [r for r in (*on[i], *on[i + 1]) if r.request_id not in pushed]
        merged += [r for r in state.requests if r.request_id in pulled]
        pause = self.planner._cost(self.model, 2 * size, size, 2 * size, [r.num_tokens for r in merged]).total_s
        new, per, pauses = [(start, 2 * size)], [merged], [pause]
        moved: set[int] = set()
        for k, reqs in enumerate(on):
            if k in (i, i + 1):
                continue
            keep = [r for r in reqs if r.request_id not in pulled]
            joins = [r for r in (*on[i], *on[i + 1]) if pushed.get(r.request_id) == starts[k]]
            if len(keep) == len(reqs) and not joins:
                continue
            moved.add(k)
            into_k = [Move(request_id=r.request_id, src=int(r.replica), dst=k) for r in joins]  # type: ignore[arg-type]
            hand = rebalance_cost(self.model, tp=state.blocks[k][1], moves=into_k,
                                  num_tokens={r.request_id: r.num_tokens for r in joins})
            new.append(state.blocks[k])
            per.append(keep + joins)
            pauses.append(hand.kv_s)
        after = self._after(rem, stay, i, i + 2, new, per, pauses, moved)
        return BuddyDecision(step=state.step, action="merge", start=start, size=size, pull=pull, push=push,
                             predicted_remaining_now_s=now_s, predicted_remaining_after_s=after,
                             reason=f"merge {size}+{size}@{start} ({len(pull)} pulled in, {len(push)} pushed out): "
                                    f"{pause:.3f}s pause of the merged block")

    # ---- hysteresis --------------------------------------------------------------------------------------------
    def _last_step(self) -> int | None:
        p = self.planner
        steps = [*(s for s, _, _ in self.actions), *(s for s, _, _ in p.switches), *p.rebalances,
                 *([] if p.start_step is None else [p.start_step])]
        return max(steps, default=None)

    def _why_not(self, state: MixedState, d: BuddyDecision) -> str:
        cfg = self.planner.config
        if d.action == "split" and cfg.only_grow:
            return "only_grow"
        if len(self.actions) >= cfg.max_reconfigs_per_stage:
            return f"max_reconfigs_per_stage={cfg.max_reconfigs_per_stage} buddy actions reached"
        last = self._last_step()
        if last is not None and state.step - last < cfg.min_steps_between_switches:
            return f"last action at step {last} < min_steps_between_switches={cfg.min_steps_between_switches} ago"
        undo = ("merge", (d.start, d.size)) if d.action == "split" else ("split", (d.start, 2 * d.size))
        for step, kind, block in self.actions:
            if (kind, block) == undo and state.step - step < cfg.no_return_steps:
                return f"{kind} of {block} at step {step} < no_return_steps={cfg.no_return_steps} ago"
        return ""

    # ---- decide ------------------------------------------------------------------------------------------------
    def decide(self, state: MixedState) -> Decision | BuddyDecision | None:
        """An action to apply now: the uniform planner's Decision (a regroup or a rebalance; on a mixed layout a
        whole-pool regroup, source_tp 0), a BuddyDecision, or None to stay. Evaluates at most once per
        eval_every_steps steps; acts only when the predicted saving beats the planner's margin."""
        p, cfg = self.planner, self.planner.config
        if not state.requests:
            return None
        if self._last_eval_step is not None and state.step - self._last_eval_step < cfg.eval_every_steps:
            return None
        self._last_eval_step = state.step
        uni = state.uniform()
        now_s, opts = self.options(state)  # buddy hysteresis first: a uniform switch below would block them
        best = min((o for o in opts if not self._why_not(state, o)),
                   key=lambda o: (o.predicted_remaining_after_s, o.action, o.start, o.size, len(o.pull), len(o.push)),
                   default=None)
        d: Decision | None = None
        if uni is None:
            d = self._regroup_from_mixed(state)
        elif not (self.actions and state.step - self.actions[-1][0] < cfg.min_steps_between_switches):
            d = p.decide(uni)  # uniform PAT's own choice and bookkeeping
        margin = max(cfg.min_gain_s, p.margin.ratio * now_s)
        if best is None or best.predicted_saving_s <= max(margin, d.predicted_saving_s if d else 0.0):
            if d is not None and uni is None:
                p.switches.append((state.step, 0, d.target_tp))
            return d
        if d is not None and uni is not None:
            p.cancel(d)
        made = (best.start, 2 * best.size) if best.action == "merge" else (best.start, best.size)
        self.actions.append((state.step, best.action, made))
        return best

    def _regroup_from_mixed(self, state: MixedState) -> Decision | None:
        """The best whole-pool regroup from a mixed layout (pausing every block), if it saves more than the margin;
        the uniform planner's scoring, the switch priced from the largest block (its devices load the most weights,
        as MixedSim prices it) or, to the largest block's TP, from the smallest (the same weights: none; a priced
        switch, not transition_cost's free one)."""
        p, cfg = self.planner, self.planner.config
        if len(p.switches) >= cfg.max_reconfigs_per_stage:
            return None
        last = self._last_step()
        if last is not None and state.step - last < cfg.min_steps_between_switches:
            return None
        model = p.estimator_model()
        rem = p.predict_remaining(state)
        remaining = [rem[r.request_id] for r in state.requests]
        tokens = [r.num_tokens for r in state.requests]
        blocks = list(state.blocks)
        now_s = max((replica_drain_s(model, size, [rem[r.request_id] for r in state.requests if r.replica == k],
                                     [r.num_tokens for r in state.requests if r.replica == k])
                     for k, (_, size) in enumerate(blocks)), default=0.0)
        sizes = [size for _, size in blocks]
        best = None
        for tp in sorted(cfg.candidate_tps):
            if state.num_devices % tp or (cfg.only_grow and tp < max(sizes)):
                continue
            src = max(sizes) if tp != max(sizes) else min(sizes)  # the largest weight load, never a zero cost
            cost = p._cost(model, state.num_devices, src, tp, tokens).total_s
            back = p._cost(model, state.num_devices, tp, src, tokens).total_s if tp < src else 0.0
            run = drain_s(model, tp=tp, num_devices=state.num_devices, remaining=remaining, num_tokens=tokens)
            if best is None or run + cost + back < best[0]:
                best = (run + cost + back, tp, run, cost)
        if best is None or now_s - best[0] <= max(cfg.min_gain_s, p.margin.ratio * now_s):
            return None
        total, tp, run, cost = best
        return Decision(step=state.step, source_tp=0, target_tp=tp, predicted_remaining_now_s=now_s,
                        predicted_remaining_target_s=run, predicted_overhead_s=cost,
                        reason=f"mixed layout {'+'.join(str(s) for _, s in blocks)} needs {now_s:.2f}s, tp={tp} "
                               f"needs {run:.2f}s + {cost:.3f}s overhead; saving {now_s - total:.2f}s")
