"""The engine's mechanics, one copy for the simulator's truth and the planner's lookahead: one replica (TP group)
with its KV capacity, waiting queue, admission with the engine's reserve and max_num_seqs, preemption with
re-prefill, prefill with GRPO prefix sharing, and decode steps, advanced in chunks between events.

What differs between the two users is only what they feed it: the simulator its true lengths and true step model,
the planner lengths drawn from its predictor and its calibrated profile. Pure stdlib.
"""

from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass
from typing import Protocol

from pat_rollout.planner.capacity import blocks_for


class StepModel(Protocol):
    """Step times: a LatencyModel (a profile, calibrated or not) or profile.published.GpuStepModel."""

    def decode_step_s(self, tp: int, batch: float, context: float) -> float: ...

    def prefill_s(self, tp: int, num_tokens: int) -> float: ...


@dataclass(frozen=True, kw_only=True, slots=True)
class SchedulerModel:
    """The engine's admission and preemption rules.

    - "ref" (pat_rollout's reference engine): admit while the prompt's blocks fit, none in a step that preempted,
      at most max_prefill_tokens per step (the first admitted always); preempt the newest admitted first.
    - "sglang": admit while prompt + new_token_ratio * (clipped remaining budget of every running request and of
      the new one) fits; new_token_ratio decays from init to min over decay_steps and resets on retraction;
      retract the running request with the fewest output tokens (ties: longest prompt) first, its KV freed and
      re-prefilled later (SGLang's retract_decode). Prompts of one GRPO group share their KV (radix cache).
    - Both: a replica never idles with a queue. With nothing running it admits the head of its queue even when
      that does not fit, and it never preempts its last running request: a request larger than the KV runs alone
      past it. The reference engine rejects such a request at submission (engine.ref.config.check_request); the
      planner's lookahead meets it when a unit of m requests outgrows its 1/m of the KV (planner/lookahead.py).
    - recheck_steps: while requests wait under "sglang", a chunk of decode steps runs at most this many steps
      before admission is tested again (the ratio decays step by step); the planner's lookahead may test less
      often, for speed."""

    kind: str = "ref"
    max_num_seqs: int = 256
    max_prefill_tokens: int = 2048
    block_size: int = 16
    init_ratio: float = 0.7
    min_ratio: float = 0.098
    decay_steps: int = 600
    clip_max_new_tokens: int = 4096
    recheck_steps: int = 16

    def __post_init__(self) -> None:
        if self.kind not in ("ref", "sglang"):
            raise ValueError(f"kind={self.kind!r} must be 'ref' or 'sglang'")
        if self.max_num_seqs < 1 or self.max_prefill_tokens < 1 or self.block_size < 1 or self.decay_steps < 1 or self.recheck_steps < 1:
            raise ValueError(f"max_num_seqs={self.max_num_seqs}, max_prefill_tokens={self.max_prefill_tokens}, "
                             f"block_size={self.block_size}, decay_steps={self.decay_steps}, recheck_steps={self.recheck_steps} "
                             "must be >= 1")

    @property
    def prefix_sharing(self) -> bool:
        return self.kind == "sglang"



@dataclass(slots=True, eq=False)  # identity: requests are compared as objects
class EngineReq:
    """A request of the stage. `length` is its final length: the truth in the simulator, a draw from the predictor in the planner's lookahead."""

    rid: str
    prompt_key: str
    prompt_len: int
    length: int
    max_new: int
    g: int = 0  # tokens generated
    cached: bool = False  # its KV is on its replica (False: needs (re-)prefill of prompt + g tokens)
    alloc: int = 0  # KV tokens it holds on its replica (its own part; a shared prompt is counted per group)
    order: int = 0  # admission order (newest preempted first by the reference engine)


@dataclass(slots=True)
class _DrainCarry:
    """`_drain_chunks`' totals, kept for its next call. Valid while the key still holds (`_carried`): the running
    list object, head of the queue, steps and KV use it left behind."""

    live: list[EngineReq]  # the replica's running list when left (its identity is part of the key)
    head: EngineReq | None
    steps: int
    used: int
    # the chunk loop's state: see `_drain_chunks`
    running: list[EngineReq]
    heap: list[tuple[int, int]]
    g0: list[int]
    own0: list[int]
    deficit: int
    ctx: int
    b: int
    off: int
    # SGLang's admission reserve (None without a head of queue on an SGLang scheduler)
    clip: int | None
    budget: list[int] | None
    in_tail: list[bool] | None
    tail_n: int | None
    tail_sum: int | None
    enter: list[tuple[int, int]] | None
    head_budget: int | None
    head_own: int | None


class EngineReplica:
    """Replica of TP size `tp` holding `cap` KV tokens, stepped by `step` (decode_step_s / prefill_s) under the
    engine's rules `sched`, with clock `t` (seconds) and `steps` steps run."""

    def __init__(self, step: StepModel, sched: SchedulerModel, cap: int, tp: int, t: float = 0.0) -> None:
        self.step_model = step
        self.sched = sched
        self.tp = tp
        self.cap = cap
        self.running: list[EngineReq] = []  # admission order
        self.waiting: deque[EngineReq] = deque()
        self.t = t
        self.steps = 0
        self.used = 0  # KV tokens held
        self.groups: dict[str, int] = {}  # prompt_key -> members holding KV here (prefix sharing)
        self.ratio = self.sched.init_ratio
        self.num_preempted = 0
        self.prefill_tokens = 0
        self.decode_tokens = 0  # tokens sampled by decode steps (batch summed over steps): a poll's mean batch
        self.finished: list[tuple[float, EngineReq]] = []
        self._order = 0
        self._carry: _DrainCarry | None = None  # _drain_chunks' totals, carried to its next call (see _carried)
        self.slowdown = 1.0
        self._sharing = sched.prefix_sharing
        self._bs = sched.block_size
        blocks_for(1, self._bs)  # validates block_size

    @property
    def busy(self) -> bool:
        return bool(self.running or self.waiting)

    # ---- memory --------------------------------------------------------------------------------------------
    def _own_tokens(self, r: EngineReq, num_tokens: int) -> int:
        """KV tokens of r's own part when it holds `num_tokens` tokens (prompt + generated)."""
        if self._sharing:
            return num_tokens - r.prompt_len
        bs = self._bs
        return -(-num_tokens // bs) * bs  # planner.capacity.blocks_for, inlined: the hot path of every lookahead

    def _hold(self, r: EngineReq, num_tokens: int) -> None:
        own = self._own_tokens(r, num_tokens)
        self.used += own - r.alloc
        r.alloc = own

    def _release(self, r: EngineReq) -> None:
        self._carry = None
        self.used -= r.alloc
        r.alloc = 0
        r.cached = False
        if self.sched.prefix_sharing:
            n = self.groups[r.prompt_key] - 1
            if n:
                self.groups[r.prompt_key] = n
            else:
                del self.groups[r.prompt_key]
                self.used -= r.prompt_len

    def import_cached(self, r: EngineReq) -> bool:
        """Take r with its KV (a migration); False if its KV does not fit (the caller queues it for recompute)."""
        extra = r.prompt_len if self.sched.prefix_sharing and r.prompt_key not in self.groups else 0
        if self.used + extra + self._own_tokens(r, r.prompt_len + r.g) > self.cap:
            return False
        self._admit(r, cached=True)
        return True

    def _admit(self, r: EngineReq, cached: bool = False) -> None:
        self._carry = None
        if self.sched.prefix_sharing:
            if r.prompt_key not in self.groups:
                self.used += r.prompt_len
                self.groups[r.prompt_key] = 0
            self.groups[r.prompt_key] += 1
        self._hold(r, r.prompt_len + r.g)
        r.cached = True
        self._order += 1
        r.order = self._order
        self.running.append(r)

    def _prefill_tokens_of(self, r: EngineReq) -> int:
        shared = self.sched.prefix_sharing and r.prompt_key in self.groups
        return r.g + (0 if shared else r.prompt_len)

    # ---- scheduling ----------------------------------------------------------------------------------------
    def _preempt(self, r: EngineReq) -> None:
        """Free r's KV and queue it first for re-prefill of prompt + generated tokens (it keeps its tokens)."""
        self._release(r)
        self.waiting.appendleft(r)
        self.num_preempted += 1
        self.ratio = self.sched.init_ratio

    def _victim(self, candidates: list[EngineReq]) -> EngineReq:
        if self.sched.kind == "ref":
            return max(candidates, key=lambda r: r.order)
        return min(candidates, key=lambda r: (r.g, -r.prompt_len, -r.order))

    def _reserve(self, extra: EngineReq | None) -> float:
        if self.sched.kind == "ref":
            return 0.0
        clip = self.sched.clip_max_new_tokens
        rem = sum(min(r.max_new - r.g, clip) for r in self.running)
        if extra is not None:
            rem += min(extra.max_new - extra.g, clip)
        return self.ratio * rem

    def _schedule(self) -> tuple[int, int]:
        """One step's scheduling: room for every running request's next token (preempting), then admission.
        Returns (requests decoding, prefill tokens admitted)."""
        preempted = False
        free = self.cap - self.used
        needs = [self._own_tokens(r, r.prompt_len + r.g) - r.alloc for r in self.running]
        if any(x > 0 for x in needs) and sum(needs) > free:
            kept = []
            queue = list(self.running)  # oldest admission first
            while queue:
                r = queue.pop(0)
                need = self._own_tokens(r, r.prompt_len + r.g) - r.alloc
                while need > self.cap - self.used and queue:
                    v = self._victim(queue)
                    queue.remove(v)
                    self._preempt(v)
                    preempted = True
                if need > self.cap - self.used and kept:  # alone, it stays (SchedulerModel)
                    self._preempt(r)
                    preempted = True
                    continue
                self._hold(r, r.prompt_len + r.g)
                kept.append(r)
            self.running = kept
        else:
            for r, x in zip(self.running, needs):
                r.alloc += x
            self.used += sum(needs)
        num_decode = len(self.running)
        prefill = 0
        if self.sched.kind == "ref" and preempted:
            return num_decode, 0
        sglang, clip = self.sched.kind == "sglang", self.sched.clip_max_new_tokens
        # _reserve(r) without its O(running) sum per admitted request: the running part, kept as requests join
        rem = sum(min(r.max_new - r.g, clip) for r in self.running) if sglang and self.waiting else 0
        while self.waiting and len(self.running) < self.sched.max_num_seqs:
            r = self.waiting[0]
            n = self._prefill_tokens_of(r)
            if prefill and prefill + n > self.sched.max_prefill_tokens:
                break
            shared = self.sched.prefix_sharing and r.prompt_key in self.groups
            need = self._own_tokens(r, r.prompt_len + r.g) + (0 if shared or not self.sched.prefix_sharing
                                                               else r.prompt_len)
            own_rem = min(r.max_new - r.g, clip)
            if self.running and self.used + need + (self.ratio * (rem + own_rem) if sglang else 0.0) > self.cap:
                break
            self.waiting.popleft()
            self._admit(r)
            rem += own_rem
            prefill += n
        return num_decode, prefill

    # ---- stepping ------------------------------------------------------------------------------------------
    def _chunk_len(self, limit: int) -> int:
        """Steps that can run as one chunk: no finish before its last step, no KV overflow, no admission."""
        n = min(limit, min(r.length - r.g for r in self.running))
        free = self.cap - self.used
        b = len(self.running)
        bs = self.sched.block_size
        if b > 1:  # each request grows by n tokens plus at most one partly filled block; a lone one stays
            n = min(n, free // b - bs)
        if self.waiting and self.sched.kind == "sglang":
            n = min(n, self.sched.recheck_steps)  # the admission ratio decays: look again soon
        return n

    def run(self, max_steps: int, until_t: float = float("inf")) -> int:
        """Run up to max_steps steps (while the clock is before until_t); returns steps run."""
        done = 0
        step_model = self.step_model
        linear = self._sharing or self._bs == 1
        while done < max_steps and self.busy and self.t < until_t:
            admits = None  # _admission_possible(), once per pass (O(running) under SGLang's reserve)
            if linear and self.running and (self._carried() or not (admits := self._admission_possible())):
                k = self._drain_chunks(max_steps - done, until_t)
                done += k
                if k:
                    continue
            if admits is None and self.running:
                admits = self._admission_possible()
            n = self._chunk_len(max_steps - done) if self.running and not admits else 0
            if n >= 2:
                b = len(self.running)
                n, chunk = self._chunk(b, sum(r.prompt_len + r.g for r in self.running) / b, n, until_t)
                dt = chunk / n
                grown = 0  # self._hold(r, prompt + g - 1) for each r, inlined (the hot loop)
                if self._sharing:
                    for r in self.running:
                        r.g += n
                        own = r.g - 1
                        grown += own - r.alloc
                        r.alloc = own
                else:
                    bs = self._bs
                    for r in self.running:
                        r.g += n
                        own = -(-(r.prompt_len + r.g - 1) // bs) * bs
                        grown += own - r.alloc
                        r.alloc = own
                self.used += grown
                self.t += n * dt
                self.steps += n
                self.decode_tokens += n * b
                done += n
                self._decay(n)
                self._collect()
                continue
            _, prefill = self._schedule()
            # One forward over every running request (newly admitted ones sample their first token too) plus
            # the prefill of the admitted tokens: how profile/measure.py separates the two.
            b = len(self.running)
            ctx = sum(r.prompt_len + r.g for r in self.running) / b
            dt = (step_model.decode_step_s(self.tp, b, ctx) + step_model.prefill_s(self.tp, prefill)) * self.slowdown
            self.prefill_tokens += prefill
            self.decode_tokens += b
            for r in self.running:
                r.g += 1
            self.t += dt
            self.steps += 1
            done += 1
            self._decay(1)
            self._collect()
        return done

    def _chunk(self, b: int, ctx0: float, n: int, until_t: float) -> tuple[int, float]:
        """(steps, seconds) of a chunk of up to n decode steps of b requests from mean context ctx0, each step at
        the mean context of the chunk's midpoint. Free-running replicas are polled by time: a chunk that would
        cross until_t stops at the first step that crosses it, found by bisection on the chunk's own time, so where
        a finish would have split it (which depends on true lengths) does not move the poll."""
        step_s, tp, slowdown = self.step_model.decode_step_s, self.tp, self.slowdown

        def chunk_s(k: int) -> float:
            return k * step_s(tp, b, ctx0 + (k - 1) / 2.0) * slowdown

        out = chunk_s(n)
        if self.t + out > until_t:
            lo, hi = 1, n
            while lo < hi:
                mid = (lo + hi) // 2
                if self.t + chunk_s(mid) >= until_t:
                    hi = mid
                else:
                    lo = mid + 1
            n, out = lo, chunk_s(lo)
        return n, out

    def _drain_chunks(self, max_steps: int, until_t: float) -> int:
        """The chunk path of `run` when KV grows by one token per request per step (prefix sharing or block_size
        1): the same chunks (finish, KV room, max_steps, until_t, 16 steps while SGLang's admission ratio decays),
        the same admission test before each, the same times and order of finishes as `run`'s own chunk path, in
        O(log b) per chunk instead of O(b): finishes come off a heap; the context sum, KV use and the admission
        reserve's remaining budgets are kept as totals; the requests' g / alloc are written back on the way out.
        Returns steps run (0: the next chunk is under 2 steps or admits, the caller steps singly)."""
        sched, done, bs = self.sched, 0, self._bs
        head = self.waiting[0] if self.waiting else None
        reserve = head is not None and sched.kind == "sglang"
        if self._carried():
            c = self._carry
            running, heap, g0, own0, deficit, ctx, b, off = c.running, c.heap, c.g0, c.own0, c.deficit, c.ctx, c.b, c.off
            clip, budget, in_tail, tail_n, tail_sum = c.clip, c.budget, c.in_tail, c.tail_n, c.tail_sum
            enter, head_budget, head_own = c.enter, c.head_budget, c.head_own
        else:
            running = self.running
            heap = [(r.length - r.g, i) for i, r in enumerate(running)]
            heapq.heapify(heap)
            g0 = [r.g for r in running]
            # alloc after a chunk, less its steps: _own_tokens(r, prompt + g - 1) inlined (sharing, or blocks of 1)
            own0 = [r.g - 1 for r in running] if self._sharing else [r.prompt_len + r.g - 1 for r in running]
            deficit = sum(o - r.alloc for o, r in zip(own0, running))
            ctx = sum(r.prompt_len + r.g for r in running)
            b, off = len(running), 0
            clip = budget = in_tail = tail_n = tail_sum = enter = head_budget = head_own = None
            if reserve:  # sum of min(max_new - g, clip) over running = tail_sum - off * tail_n + clip * (b - tail_n)
                clip = sched.clip_max_new_tokens
                budget = [r.max_new - r.g for r in running]
                in_tail = [x <= clip for x in budget]
                tail_n = sum(in_tail)
                tail_sum = sum(x for x, t in zip(budget, in_tail) if t)
                enter = [(x - clip, i) for i, x in enumerate(budget) if x > clip]  # offset where each enters the tail
                heapq.heapify(enter)
                head_budget = min(head.max_new - head.g, clip)
            if head is not None:
                head_own = self._own_tokens(head, head.prompt_len + head.g)
        while done < max_steps and b and self.t < until_t:
            if head is not None and b < sched.max_num_seqs:  # _admission_possible, on the totals
                need = self.used + head_own + (head.prompt_len if self._sharing and head.prompt_key not in self.groups
                                               else 0)
                if reserve:
                    while enter and enter[0][0] <= off:
                        _, i = heapq.heappop(enter)
                        if not in_tail[i]:
                            in_tail[i] = True
                            tail_n += 1
                            tail_sum += budget[i]
                    need += self.ratio * (tail_sum - off * tail_n + clip * (b - tail_n) + head_budget)
                if need <= self.cap:
                    break
            n = min(max_steps - done, heap[0][0] - off)
            if b > 1:  # KV room, as `_chunk_len`
                n = min(n, (self.cap - self.used) // b - bs)
            if head is not None and sched.kind == "sglang":
                n = min(n, sched.recheck_steps)
            if n < 2:
                break
            n, chunk = self._chunk(b, ctx / b, n, until_t)
            dt = chunk / n
            self.used += n * b + (0 if off else deficit)
            off += n
            ctx += n * b
            self.t += n * dt
            self.steps += n
            self.decode_tokens += n * b
            done += n
            self._decay(n)
            while heap and heap[0][0] <= off:  # every finisher of this chunk has the same key: ties in queue order
                _, i = heapq.heappop(heap)
                r = running[i]
                r.g, r.alloc = g0[i] + off, own0[i] + off
                ctx -= r.prompt_len + r.g
                b -= 1
                if reserve:
                    if in_tail[i]:
                        tail_n -= 1
                        tail_sum -= budget[i]
                    else:
                        in_tail[i] = True  # never counted again: enter[] skips it
                self._release(r)
                self.finished.append((self.t, r))
        if off:
            kept = []
            for i, r in enumerate(running):
                if g0[i] + off < r.length:  # the finished were written back and released above
                    r.g, r.alloc = g0[i] + off, own0[i] + off
                    kept.append(r)
            self.running = kept
        self._carry = _DrainCarry(live=self.running, head=head, steps=self.steps, used=self.used, running=running,
                                  heap=heap, g0=g0, own0=own0, deficit=deficit, ctx=ctx, b=b, off=off, clip=clip,
                                  budget=budget, in_tail=in_tail, tail_n=tail_n, tail_sum=tail_sum, enter=enter,
                                  head_budget=head_budget, head_own=head_own)
        return done

    def _carried(self) -> bool:
        """Whether `_drain_chunks` left its totals and nothing but the clock (and the queue behind its head)
        changed since: the same running list, head of the queue, steps and KV use (`_admit` / `_release` drop
        them too)."""
        c = self._carry
        return (c is not None and c.live is self.running and c.head is (self.waiting[0] if self.waiting else None)
                and c.steps == self.steps and c.used == self.used)

    def leave_carry_behind(self, memo: dict[int, object]) -> None:
        """Make a `copy.deepcopy` through `memo` give the copy no `_drain_chunks` totals (a cache, rebuilt on need)
        while this replica keeps its own."""
        if self._carry is not None:
            memo[id(self._carry)] = None

    def _admission_possible(self) -> bool:
        if not self.waiting or len(self.running) >= self.sched.max_num_seqs:
            return False
        r = self.waiting[0]
        extra = r.prompt_len if self.sched.prefix_sharing and r.prompt_key not in self.groups else 0
        return self.used + extra + self._own_tokens(r, r.prompt_len + r.g) + self._reserve(r) <= self.cap

    def _decay(self, n: int) -> None:
        s = self.sched
        self.ratio = max(s.min_ratio, self.ratio - n * (s.init_ratio - s.min_ratio) / s.decay_steps)

    def _collect(self) -> None:
        done = [r for r in self.running if r.g >= r.length]
        if not done:
            return
        for r in done:
            self.running.remove(r)
            self._release(r)
            self.finished.append((self.t, r))

    def export(self, rids: set[str] | None = None) -> list[EngineReq]:
        """Take the unfinished requests out (all, or those in `rids`; running first, then waiting), KV freed;
        `cached` says whether each had KV here. A later action (e.g. moving some requests to another replica)
        re-adds them with `import_cached` or by queueing them in `waiting`."""
        out, keep_run, keep_wait = [], [], deque()
        for r in self.running:
            if rids is not None and r.rid not in rids:
                keep_run.append(r)
                continue
            was = r.cached
            self._release(r)
            r.cached = was
            out.append(r)
        for r in self.waiting:
            if rids is not None and r.rid not in rids:
                keep_wait.append(r)
                continue
            r.cached = False
            out.append(r)
        self.running, self.waiting = keep_run, keep_wait
        return out
