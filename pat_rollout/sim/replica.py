"""One simulated replica (TP group): KV capacity, waiting queue, admission, preemption with re-prefill, prefill
and decode steps, advanced in chunks between events. Pure stdlib."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from pat_rollout.planner.capacity import blocks_for
from pat_rollout.sim.hardware import SimHardware


@dataclass(slots=True, eq=False)  # identity: requests are compared as objects
class SimReq:
    """A request of the stage. `length` is its true final length: the simulator's, never the planner's."""

    rid: str
    prompt_key: str
    prompt_len: int
    length: int
    max_new: int
    g: int = 0  # tokens generated
    cached: bool = False  # its KV is on its replica (False: needs (re-)prefill of prompt + g tokens)
    alloc: int = 0  # KV tokens it holds on its replica (its own part; a shared prompt is counted per group)
    order: int = 0  # admission order (newest preempted first by the reference engine)


class Replica:
    """Replica of TP size `tp` with clock `t` (seconds) and `steps` steps run."""

    def __init__(self, hw: SimHardware, tp: int, t: float = 0.0) -> None:
        self.hw = hw
        self.sched = hw.scheduler
        self.tp = tp
        self.cap = hw.capacity(tp)
        self.running: list[SimReq] = []  # admission order
        self.waiting: deque[SimReq] = deque()
        self.t = t
        self.steps = 0
        self.used = 0  # KV tokens held
        self.groups: dict[str, int] = {}  # prompt_key -> members holding KV here (prefix sharing)
        self.ratio = self.sched.init_ratio
        self.num_preempted = 0
        self.prefill_tokens = 0
        self.decode_tokens = 0  # tokens sampled by decode steps (batch summed over steps): a poll's mean batch
        self.finished: list[tuple[float, SimReq]] = []
        self._order = 0
        self.slowdown = 1.0

    @property
    def busy(self) -> bool:
        return bool(self.running or self.waiting)

    # ---- memory --------------------------------------------------------------------------------------------
    def _own_tokens(self, r: SimReq, num_tokens: int) -> int:
        """KV tokens of r's own part when it holds `num_tokens` tokens (prompt + generated)."""
        if self.sched.prefix_sharing:
            return num_tokens - r.prompt_len
        return blocks_for(num_tokens, self.sched.block_size) * self.sched.block_size

    def _hold(self, r: SimReq, num_tokens: int) -> None:
        own = self._own_tokens(r, num_tokens)
        self.used += own - r.alloc
        r.alloc = own

    def _release(self, r: SimReq) -> None:
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

    def import_cached(self, r: SimReq) -> bool:
        """Take r with its KV (a migration); False if its KV does not fit (the caller queues it for recompute)."""
        extra = r.prompt_len if self.sched.prefix_sharing and r.prompt_key not in self.groups else 0
        if self.used + extra + self._own_tokens(r, r.prompt_len + r.g) > self.cap:
            return False
        self._admit(r, cached=True)
        return True

    def _admit(self, r: SimReq, cached: bool = False) -> None:
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

    def _prefill_tokens_of(self, r: SimReq) -> int:
        shared = self.sched.prefix_sharing and r.prompt_key in self.groups
        return r.g + (0 if shared else r.prompt_len)

    # ---- scheduling ----------------------------------------------------------------------------------------
    def _preempt(self, r: SimReq) -> None:
        """Free r's KV and queue it first for re-prefill of prompt + generated tokens (it keeps its tokens)."""
        self._release(r)
        self.waiting.appendleft(r)
        self.num_preempted += 1
        self.ratio = self.sched.init_ratio

    def _victim(self, candidates: list[SimReq]) -> SimReq:
        if self.sched.kind == "ref":
            return max(candidates, key=lambda r: r.order)
        return min(candidates, key=lambda r: (r.g, -r.prompt_len, -r.order))

    def _reserve(self, extra: SimReq | None) -> float:
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
        if any(self._own_tokens(r, r.prompt_len + r.g) > r.alloc for r in self.running) and \
                sum(self._own_tokens(r, r.prompt_len + r.g) - r.alloc for r in self.running) > free:
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
                if need > self.cap - self.used:
                    self._preempt(r)
                    preempted = True
                    continue
                self._hold(r, r.prompt_len + r.g)
                kept.append(r)
            self.running = kept
        else:
            for r in self.running:
                self._hold(r, r.prompt_len + r.g)
        num_decode = len(self.running)
        prefill = 0
        if self.sched.kind == "ref" and preempted:
            return num_decode, 0
        while self.waiting and len(self.running) < self.sched.max_num_seqs:
            r = self.waiting[0]
            n = self._prefill_tokens_of(r)
            if prefill and prefill + n > self.sched.max_prefill_tokens:
                break
            shared = self.sched.prefix_sharing and r.prompt_key in self.groups
            need = self._own_tokens(r, r.prompt_len + r.g) + (0 if shared or not self.sched.prefix_sharing
                                                               else r.prompt_len)
            if self.used + need + self._reserve(r) > self.cap:
                break
            self.waiting.popleft()
            self._admit(r)
            prefill += n
        return num_decode, prefill

    # ---- stepping ------------------------------------------------------------------------------------------
    def _chunk_len(self, limit: int) -> int:
        """Steps that can run as one chunk: no finish before its last step, no KV overflow, no admission."""
        n = min(limit, min(r.length - r.g for r in self.running))
        free = self.cap - self.used
        b = len(self.running)
        bs = self.sched.block_size
        safe = free // b - bs  # each request grows by n tokens plus at most one partly filled block
        n = min(n, safe)
        if self.waiting and self.sched.kind == "sglang":
            n = min(n, 16)  # the admission ratio decays: look again soon
        return n

    def run(self, max_steps: int, until_t: float = float("inf")) -> int:
        """Run up to max_steps steps (while the clock is before until_t); returns steps run."""
        done = 0
        step_model = self.hw.step
        while done < max_steps and self.busy and self.t < until_t:
            n = self._chunk_len(max_steps - done) if self.running and not self._admission_possible() else 0
            if n >= 2:
                b = len(self.running)
                ctx0 = sum(r.prompt_len + r.g for r in self.running) / b

                def chunk_s(k: int) -> float:  # k steps at the mean context of their midpoint
                    return k * step_model.decode_step_s(self.tp, b, ctx0 + (k - 1) / 2.0) * self.slowdown

                if self.t + chunk_s(n) > until_t:
                    # Free-running replicas are polled by time: stop at the first step that crosses until_t.
                    # Found by bisection on the chunk's own time, so where a finish would have split it (which
                    # depends on true lengths) does not move the poll.
                    lo, hi = 1, n
                    while lo < hi:
                        mid = (lo + hi) // 2
                        if self.t + chunk_s(mid) >= until_t:
                            hi = mid
                        else:
                            lo = mid + 1
                    n = lo
                dt = chunk_s(n) / n
                for r in self.running:
                    r.g += n
                    self._hold(r, r.prompt_len + r.g - 1)
                self.t += n * dt
                self.steps += n
                self.decode_tokens += n * b
                done += n
                self._decay(n)
                self._collect()
                continue
            _, prefill = self._schedule()
            if not self.running:
                raise RuntimeError(f"replica tp={self.tp}: no request fits in {self.cap} KV tokens "
                                   f"(waiting {len(self.waiting)})")
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

    def export(self, rids: set[str] | None = None) -> list[SimReq]:
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
