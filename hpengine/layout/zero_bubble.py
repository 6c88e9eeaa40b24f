"""Zero-bubble pipeline schedules as data (Qi et al. 2023): every backward split into B (input gradient,
which the previous virtual stage waits for) and W (weight gradient, which nobody waits for), so that W's
fill the bubbles. ZB-H1 ("zb1p") and ZB-V ("zbv") as per-stage action lists, and a timed dataflow
simulation of all stages that proves a schedule free of deadlock and measures its bubble and memory.
schedules.make_schedule hands them to the executor like the fused schedules."""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from hpengine.layout.actions import Action, Placement, check_args

ZERO_BUBBLE = ("zb1p", "zbv")
KINDS = ("F", "B", "W")


@dataclass(frozen=True)
class Times:
    """Cost of one action of each kind on one chunk (the paper's T_F, T_B, T_W)."""
    F: float = 1
    B: float = 1
    W: float = 1


UNIT = Times()


def zb1p(p: int, m: int, stage: int) -> list[Action]:
    """ZB-H1: 1F1B's order of F and B, the W of micro-batch i deferred until after B of i + stage.

    Stage s runs min(p - s, m) warm-up forwards, then for each i: B_i, W_{i-s} (once i >= s), the next
    forward; the last s W's close the list. So it holds 1F1B's min(p - s, m) micro-batches between F and
    B, min(s + 1, m) between B and W, and min(p, m) between F and W on every stage: the later stages,
    which 1F1B leaves with fewer activations, are the ones that keep W inputs longer.

    Step with T_F = T_B = T_W = 1, rounds = 3m + p - 1 + max(0, p - m) = 3m + 2p - 1 - min(p, m):
    - lower bound: B_0 reaches stage s at 2p - 1 - s at the earliest (p forward hops, p - 1 - s back),
      and before it the stage can only run forwards, at most min(p - s, m) of them, so it idles at least
      2p - 1 - s - min(p - s, m), the most on stage 0: 2p - 1 - min(p, m); each stage works 3m.
    - attained: stage s idles only in the warm-up (s rounds before F_0 arrives, p - 1 - s waiting for
      B_0 when m >= p); deferring W by s iterations brings stage s's last B s slots forward, which is
      exactly the one slot per hop that B_{m-1} needs to climb to stage 0 while the s + 1 deferred W's
      fill the cool-down. For m < p the last stage's 2m alternating F/B, the p - 1 hops of B_{m-1} and
      the final W form the critical path, 2m + 2p - 1.
    Idle per stage p - 1 for m >= p, a third of 1F1B's 3(p - 1) (its B being B + W, time 2); bubble
    (p - 1) / (3m + p - 1). With other times, m >= p and T_W <= min(T_F, T_B), each stage idles the
    paper's (p - 1)(T_F + T_B - T_W)."""
    check_args(p, m, stage)
    warmup = min(p - stage, m)
    out = [Action("F", i) for i in range(warmup)]
    for i in range(m):
        out.append(Action("B", i))
        # W before the next F: its inputs are freed before the next activations are made, which is
        # what keeps F..W at min(p, m) (F first would hold one more) at no cost in the step.
        if i >= stage:
            out.append(Action("W", i - stage))
        if warmup + i < m:
            out.append(Action("F", warmup + i))
    return out + [Action("W", i) for i in range(max(m - stage, 0), m)]


def _check_zbv(p, m):
    if m < 2 * p - 1:
        raise ValueError(f"zbv needs m >= 2p - 1 = {2 * p - 1} micro-batches for p={p} (stage 0 runs "
                         f"2p - 1 chunk-0 forwards before micro-batch 0 comes back on chunk 1), got m={m}")


def zbv(p: int, m: int, stage: int) -> list[Action]:
    """ZB-V: stage r holds virtual stages r (chunk 0) and 2p - 1 - r (chunk 1); needs m >= 2p - 1.

    Phases on stage r (c0, c1: the chunks; each B of the two middle phases directly followed by its W):
      2(p - r) - 1 forwards on c0    fill the time until micro-batch 0 comes back on c1 (round 2p - 1 - r)
      r x (F c1, F c0)                c1's forwards start coming back; c0's fill the gaps between them
      p - r x (F c1, B c1, W c1)      c1's backwards start at the loss (stage 0) and travel to stage p - 1
      (F c0 while any left, B c0, W c0, F c1, B c1, W c1) until every forward has run
      r x (B c0, B c1), p - r x (B c0, W c0), then the deferred W's (c1, then c0)
    The cool-down runs B's ahead of W's so the B chain of the last micro-batches never waits.

    Memory, in chunk-units (a chunk is half of a 1F1B stage's layers): F..B peaks at 2p on every stage
    (2p - r - 1 on c0 and r on c1 after the warm-up, +1 for the F just run): p micro-batches of a
    1F1B stage, 1F1B's peak (its stage 0), now on every stage. B..W peaks at 2r + 1 (the r pairs of
    deferred B's and one more); F..W stays at 2p.

    Step with T_F = T_B = T_W = 1: rounds = 6m + p - 1, idle p - 1 on each stage, bubble
    (p - 1) / (6m + p - 1). Lower bound: stage p - 1 gets its first input (F_0 of virtual stage p - 1)
    at round p - 1 and has 6m units of work; the simulation shows no stage idles otherwise. That is a
    sixth of 1F1B's idle on the same model (6(p - 1) chunk-units, B + W taking 2 per chunk)."""
    check_args(p, m, stage)
    _check_zbv(p, m)
    r, done = stage, Counter()

    def act(kind, chunk):
        """The next action of `kind` on `chunk`: each kind walks the micro-batches in order."""
        done[kind, chunk] += 1
        return Action(kind, done[kind, chunk] - 1, chunk)

    out = [act("F", 0) for _ in range(2 * (p - r) - 1)]
    for _ in range(r):
        out += [act("F", 1), act("F", 0)]
    for _ in range(p - r):
        out += [act("F", 1), act("B", 1), act("W", 1)]
    for _ in range(m - p):
        if done["F", 0] < m:
            out.append(act("F", 0))
        out += [act("B", 0), act("W", 0), act("F", 1), act("B", 1), act("W", 1)]
    for _ in range(r):
        out += [act("B", 0), act("B", 1)]
    for _ in range(p - r):
        out += [act("B", 0), act("W", 0)]
    return out + [act("W", c) for c in (1, 0) for _ in range(m - done["W", c])]


def zb_rounds(name: str, p: int, m: int) -> int:
    """The step's length in unit actions (T_F = T_B = T_W = 1), as derived in zb1p's and zbv's docstrings."""
    return 3 * m + 2 * p - 1 - min(p, m) if name == "zb1p" else 6 * m + p - 1


def make_zero_bubble(name: str, p: int, m: int, stage: int) -> list[Action]:
    """The action list of `stage` for zero-bubble schedule `name` ("zb1p" | "zbv")."""
    if name not in ZERO_BUBBLE:
        raise ValueError(f"unknown zero-bubble schedule {name!r}; valid: {', '.join(ZERO_BUBBLE)}")
    return zb1p(p, m, stage) if name == "zb1p" else zbv(p, m, stage)


def _placement(name: str, p: int) -> Placement:
    """Where schedule `name`'s chunks sit: one per stage for zb1p, the V for zbv (schedules.placement says
    it for every schedule; this module comes first)."""
    return Placement(p, 2, vee=True) if name == "zbv" else Placement(p)


def _inputs(kind, mb, g, last):
    """The outputs action (kind, mb) on virtual stage g waits for, as (kind, mb, virtual stage)."""
    if kind == "F":
        return [] if g == 0 else [("F", mb, g - 1)]
    if kind == "B":
        return [("F", mb, g)] + ([] if g == last else [("B", mb, g + 1)])
    return [("B", mb, g)]


def _validate(actions, place, times):
    if len(actions) != place.p:
        raise ValueError(f"need one action list per stage: got {len(actions)} for p={place.p}")
    if min(times.F, times.B, times.W) <= 0:
        raise ValueError(f"action times must be > 0, got {times}")
    for s, acts in enumerate(actions):
        for a in acts:
            if a.kind not in KINDS or not 0 <= a.chunk < place.v:
                raise ValueError(f"stage {s}: action {a} must have kind in {'/'.join(KINDS)} and chunk in "
                                 f"0..{place.v - 1}, got kind={a.kind!r}, chunk={a.chunk}")


def _peaks(acts):
    """Most (mb, chunk) units held between F and B, between B and W, and between F and W, in list order."""
    has_w = {(a.mb, a.chunk) for a in acts if a.kind == "W"}  # a B with no W is a fused B + W
    live, stash, peak = set(), set(), [0, 0, 0]
    for a in acts:
        u = (a.mb, a.chunk)
        if a.kind == "F":
            live.add(u)
        elif a.kind == "B":
            live.discard(u)
            if u in has_w:
                stash.add(u)
        else:
            stash.discard(u)
        peak = [max(peak[0], len(live)), max(peak[1], len(stash)), max(peak[2], len(live | stash))]
    return peak


def simulate(actions, place: Placement, *, times: Times = UNIT, hop: float = 0, label: str = "") -> dict:
    """Run every stage's list in order, each action starting once the stage is free and its inputs exist.

    F needs the previous virtual stage's F of that micro-batch; B this virtual stage's F and the next
    one's B (the last virtual stage is the loss); W this virtual stage's B. An output can be used from
    the moment it ends, so with unit times an action of round r feeds round r + 1: exactly the rounds of
    schedules.simulate. `hop` adds that much to an input from another stage and nothing to one from
    the same stage (ZB-V's turn on stage p - 1 sends nothing). Raises RuntimeError("deadlock ...")
    naming where each stage waits and for what.

    Returns rounds (the step's length), busy (work per stage), bubble (idle share of p * rounds),
    start (per stage, each action's start time), peak_live (F..B), peak_stash (B..W; W inputs kept)
    and peak_held (F..W), the last three per stage in (micro-batch, chunk) units."""
    _validate(actions, place, times)
    p, last = place.p, place.p * place.v - 1
    cost = {"F": times.F, "B": times.B, "W": times.W}
    end, free, start = {}, [0] * p, [[] for _ in range(p)]
    progress = True
    # The start of an action depends only on its stage's previous action and its inputs, so running
    # each stage as far as it can, round robin, settles every time whatever order the stages take.
    while progress:
        progress = False
        for s in range(p):
            while len(start[s]) < len(actions[s]):
                a = actions[s][len(start[s])]
                g = place.virtual(s, a.chunk)
                need = _inputs(a.kind, a.mb, g, last)
                if any(n not in end for n in need):
                    break
                t = max([free[s]] + [end[n] + (hop if place.stage_of(n[2]) != s else 0) for n in need])
                start[s].append(t)
                free[s] = end[a.kind, a.mb, g] = t + cost[a.kind]
                progress = True
    stuck = [s for s in range(p) if len(start[s]) < len(actions[s])]
    if stuck:
        waits = []
        for s in stuck:
            a = actions[s][len(start[s])]
            g = place.virtual(s, a.chunk)
            k, mb, h = next(n for n in _inputs(a.kind, a.mb, g, last) if n not in end)
            waits.append(f"stage {s} waits at {a} for {k}{mb} of virtual stage {h} on stage {place.stage_of(h)}")
        raise RuntimeError(f"deadlock ({label or f'p={p}'}): " + "; ".join(waits))
    rounds = max(free)
    busy = [sum(cost[a.kind] for a in acts) for acts in actions]
    peaks = [_peaks(acts) for acts in actions]
    return {"rounds": rounds, "busy": busy, "bubble": 1 - sum(busy) / (p * rounds) if rounds else 0.0,
            "start": start, "peak_live": [pk[0] for pk in peaks], "peak_stash": [pk[1] for pk in peaks],
            "peak_held": [pk[2] for pk in peaks]}


def simulate_schedule(name: str, p: int, m: int, *, times: Times = UNIT, hop: float = 0) -> dict:
    """simulate() on every stage of zero-bubble schedule `name` in its own placement."""
    actions = [make_zero_bubble(name, p, m, s) for s in range(p)]
    return simulate(actions, _placement(name, p), times=times, hop=hop, label=f"{name}, p={p}, m={m}")
