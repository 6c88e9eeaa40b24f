"""Pipeline schedules as data: per-stage lists of forward/backward actions (GPipe F-then-B, 1F1B,
Megatron's interleaved 1F1B, and the zero-bubble ZB-H1 and ZB-V of zero_bubble.py, whose backwards are
split into B and W), their theoretical bubble, the activations they hold, and a dataflow simulation of all
stages together that proves a schedule free of deadlock and measures its bubble. Nothing here touches MPI.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

from hpengine.layout.actions import Action, Placement, check_args
from hpengine.layout.zero_bubble import make_zero_bubble, simulate_schedule, zb_rounds


def _check_interleaved(p, m, v):
    if v < 2:
        raise ValueError(f"interleaved schedule needs v >= 2 model chunks per stage, got v={v}")
    if m % p != 0:
        raise ValueError(f"interleaved schedule needs m % p == 0 (micro-batches go through the "
                         f"chunks in groups of p), got m={m}, p={p}")


def _warmup_steady_cooldown(fwd, bwd, warmup):
    """`warmup` forwards, then alternate one forward / one backward, then the remaining backwards."""
    steady = len(fwd) - warmup
    out = list(fwd[:warmup])
    for i in range(steady):
        out += [fwd[warmup + i], bwd[i]]
    return out + list(bwd[steady:])


def fthenb(p: int, m: int, stage: int) -> list[Action]:
    """GPipe: every forward, then every backward; holds all m micro-batches' activations."""
    check_args(p, m, stage)
    return [Action("F", i) for i in range(m)] + [Action("B", i) for i in range(m)]


def one_f_one_b(p: int, m: int, stage: int) -> list[Action]:
    """1F1B (PipeDream-flush, Megatron's non-interleaved schedule). Stage s runs p - s - 1 warm-up
    forwards so the first backward reaches it just as its own pipe is full; it then holds at most
    min(p - s, m) micro-batches instead of m."""
    check_args(p, m, stage)
    warmup = min(p - stage - 1, m)
    return _warmup_steady_cooldown([Action("F", i) for i in range(m)],
                                   [Action("B", i) for i in range(m)], warmup)


def interleaved(p: int, m: int, stage: int, v: int) -> list[Action]:
    """Megatron-LM (2021) interleaved 1F1B: local chunk c is virtual stage c * p + stage. The k-th
    forward takes micro-batches in groups of p through chunk 0, then the same group through chunk 1,
    ...; backwards walk the chunks in reverse. Same ordering as Megatron's
    forward_backward_pipelining_with_interleaving (with microbatch group size p)."""
    check_args(p, m, stage)
    _check_interleaved(p, m, v)
    total = m * v

    def unit(k, forward):
        group, pos = divmod(k, p * v)
        chunk = pos // p if forward else v - 1 - pos // p
        return Action("F" if forward else "B", group * p + k % p, chunk)

    # (v - 1) * p forwards fill every chunk but the last; 2 * (p - stage - 1) more cover the round
    # trip of the first micro-batch to the pipe's end and back. Megatron also makes m == p all
    # warm-up; simulate() gives the same step time without that, and later stages then hold
    # fewer activations, so that special case is not copied.
    warmup = min((p - stage - 1) * 2 + (v - 1) * p, total)
    return _warmup_steady_cooldown([unit(k, True) for k in range(total)],
                                   [unit(k, False) for k in range(total)], warmup)


@dataclass(frozen=True)
class Schedule:
    """A pipeline schedule as the rest of the engine knows it: what it fixes and how it is built."""
    name: str
    actions: Callable[[int, int, int, int], list[Action]]   # (p, m, stage, v) -> the stage's action list
    chunks: int | None = 1          # model chunks per stage it fixes; None: a free choice (v >= 2)
    vee: bool = False               # its chunks sit as a V (stage s holds virtual stages s and 2p - 1 - s)
    splits_backward: bool = False   # each backward runs as B (input gradient) now and W (weights) later
    holds_every_microbatch: bool = False   # every forward before any backward: m micro-batches held
    min_micro_batches: Callable[[int], int] = lambda p: 1      # for p stages
    groups_of_p: bool = False       # micro-batches go through the chunks in groups of p: m a multiple of p


SCHEDULES: dict[str, Schedule] = {s.name: s for s in (
    Schedule("fthenb", lambda p, m, stage, v: fthenb(p, m, stage), holds_every_microbatch=True),
    Schedule("1f1b", lambda p, m, stage, v: one_f_one_b(p, m, stage)),
    Schedule("interleaved", interleaved, chunks=None, groups_of_p=True),
    Schedule("zb1p", lambda p, m, stage, v: make_zero_bubble("zb1p", p, m, stage), splits_backward=True),
    Schedule("zbv", lambda p, m, stage, v: make_zero_bubble("zbv", p, m, stage), chunks=2, vee=True,
             splits_backward=True, min_micro_batches=lambda p: 2 * p - 1),
)}


def schedule(name: str) -> Schedule:
    """The schedule called `name`; a ValueError naming the valid ones otherwise."""
    try:
        return SCHEDULES[name]
    except KeyError:
        raise ValueError(f"unknown pipeline schedule {name!r}; valid: {', '.join(SCHEDULES)}") from None


def chunks_per_stage(name: str) -> int | None:
    """The model chunks per stage schedule `name` fixes beyond one (zbv: its V of two), None where it is a
    free choice or one."""
    fixed = schedule(name).chunks
    return fixed if fixed and fixed > 1 else None


# The pipeline executor only walks these lists.
def make_schedule(name: str, p: int, m: int, stage: int, v: int = 1) -> list[Action]:
    """The action list of `stage` for schedule `name` (one of SCHEDULES)."""
    kind = schedule(name)
    if kind.chunks is not None and v != kind.chunks:
        raise ValueError(f"schedule {name!r} has {kind.chunks} model chunk(s) per stage, got v={v}"
                         + (" (use 'interleaved' for v >= 2)" if kind.chunks == 1 else ""))
    return kind.actions(p, m, stage, v)


def placement(name: str, p: int, v: int | None = None) -> Placement:
    """Where schedule `name` puts each stage's v chunks (v: the number it fixes, else given) in the model:
    a V, or chunk c of stage s at virtual stage c * p + s."""
    kind = schedule(name)
    return Placement(p, v or kind.chunks or 1, vee=kind.vee)


def splits_backward(name: str) -> bool:
    """Whether schedule `name` runs each backward as B now and W later (the zero-bubble ones)."""
    return schedule(name).splits_backward


def bubble_fraction(name: str, p: int, m: int, v: int = 1) -> float:
    """Theoretical idle fraction with equal forward, input-gradient and weight-gradient cost: for the fused
    schedules the p - 1 fill/drain slots over the whole step (interleaving shrinks each slot to 1/v of a
    stage's work); for the zero-bubble ones the closed forms derived in zero_bubble.py."""
    make_schedule(name, p, m, 0, v)  # validates all inputs the same way
    if splits_backward(name):
        work = 3 * m * v
        return 1 - work / zb_rounds(name, p, m)
    work = v * m
    return (p - 1) / (work + p - 1)


def peak_in_flight(actions) -> int:
    """Most (micro-batch, chunk) pairs whose forward ran and backward has not: activation caches held."""
    held, peak = set(), 0
    for a in actions:
        if a.kind == "F":
            held.add((a.mb, a.chunk))
            peak = max(peak, len(held))
        else:
            held.discard((a.mb, a.chunk))
    return peak


def _ready(a, stage, p, last, done):
    """Whether action `a` on `stage` has its inputs: they count only once produced in an earlier round."""
    g = a.chunk * p + stage
    if a.kind == "F":
        return g == 0 or ("F", a.mb, g - 1) in done
    return ("F", a.mb, g) in done and (g == last or ("B", a.mb, g + 1) in done)


def simulate(p: int, m: int, name: str, v: int = 1, *, actions=None) -> dict:
    """Run every stage's list together, one unit-time action per stage per round, each stage blocked
    on its next action until that action's input (the neighbour's forward or backward output) exists.
    `actions` (one list per stage) replaces the named schedule, e.g. to test a broken one.
    Returns {"rounds", "busy", "bubble"}; raises RuntimeError("deadlock ...") if all stages stall.
    A zero-bubble schedule runs in zero_bubble.simulate, which knows W and the V placement."""
    if actions is None and splits_backward(name):
        return simulate_schedule(name, p, m)
    if actions is None:
        actions = [make_schedule(name, p, m, s, v) for s in range(p)]
    if len(actions) != p:
        raise ValueError(f"need one action list per stage: got {len(actions)} for p={p}")
    last = p * v - 1
    pos, done, rounds = [0] * p, set(), 0
    while any(pos[s] < len(actions[s]) for s in range(p)):
        # Decide on the state at the start of the round so that no output is consumed the round it
        # is produced (one round of latency per hop, as a send/recv pair would have).
        run = [s for s in range(p)
               if pos[s] < len(actions[s]) and _ready(actions[s][pos[s]], s, p, last, done)]
        if not run:
            stuck = ", ".join(f"stage {s} waits at {actions[s][pos[s]]}"
                              for s in range(p) if pos[s] < len(actions[s]))
            raise RuntimeError(f"deadlock after {rounds} rounds ({name}, p={p}, m={m}, v={v}): {stuck}")
        for s in run:
            a = actions[s][pos[s]]
            done.add((a.kind, a.mb, a.chunk * p + s))
            pos[s] += 1
        rounds += 1
    busy = [len(acts) for acts in actions]
    return {"rounds": rounds, "busy": busy, "bubble": 1 - sum(busy) / (p * rounds) if rounds else 0.0}


def peak_live(schedule: str, p: int, m: int, v: int, stage: int, weights, stash=None) -> int:
    """Most cached bytes stage `stage` holds at once when chunk c's caches weigh weights[c] (F-then-B: m,
    1F1B: min(p - stage, m), interleaved: the worst mix of live chunks along its schedule). A zero-bubble
    schedule also holds, from each B to its W, the W stash of stash[c] bytes, which replaces the chunk's
    caches when B starts (the engine counts the same way: caches out, stash in, after each F and B)."""
    if splits_backward(schedule):
        return max(sum(n * w for n, w in zip(vec[:v], weights)) + sum(n * w for n, w in zip(vec[v:], stash))
                   for vec in _held_counts(schedule, p, m, v, stage))
    if v == 1:
        n = m if SCHEDULES[schedule].holds_every_microbatch else min(p - stage, m)
        return n * weights[0]
    return max(sum(n * w for n, w in zip(vec, weights)) for vec in _live_counts(schedule, p, m, v, stage))


@functools.lru_cache(maxsize=4096)
def _held_counts(schedule, p, m, v, stage) -> frozenset:
    """The distinct (live caches per chunk, W stashes per chunk) vectors after each F and B of a split schedule."""
    live, seen = [0] * (2 * v), set()
    for a in make_schedule(schedule, p, m, stage, v):
        if a.kind == "F":
            live[a.chunk] += 1
        elif a.kind == "B":
            live[a.chunk] -= 1
            live[v + a.chunk] += 1
        else:
            live[v + a.chunk] -= 1
        if a.kind != "W":
            seen.add(tuple(live))
    return frozenset(seen)


@functools.lru_cache(maxsize=4096)
def _live_counts(schedule, p, m, v, stage) -> frozenset:
    """The distinct (live caches per chunk) vectors after each forward of the stage's schedule."""
    live, seen = [0] * v, set()
    for a in make_schedule(schedule, p, m, stage, v):
        live[a.chunk] += 1 if a.kind == "F" else -1
        if a.kind == "F":
            seen.add(tuple(live))
    return frozenset(seen)
