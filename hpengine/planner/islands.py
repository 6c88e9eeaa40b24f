"""`hpengine plan` on a cluster whose nodes sit in sites behind a slow link (cluster.site_nodes): what the best exact
layout sends across that link, and DiLoCo candidates, one island per site, each island's layout found by the usual
search on one site's ranks and the islands' exchange amortised over H steps, ranked apart from the exact layouts.
"""
from __future__ import annotations

import copy
import dataclasses
import textwrap

from hpengine.config.load import ConfigError, validate
from hpengine.layout.resolve import resolve
from hpengine.planner import model as pm
from hpengine.planner.calibrate import GB
from hpengine.planner.cluster import PlanError
from hpengine.planner.report import LAYOUT_COLS, _bytes, _cells, _secs, _unit

INNER_STEPS = (10, 50, 100)         # H tried: the papers' range starts at tens; 500 leaves the loss trade's tested side
QUANTIZE = ("none", "int8")         # int4's rounding costs more loss than its bytes save at these H
NOTE = ("DiLoCo changes the optimisation: it is not the same run as one process (docs/diloco.md; the loss against H "
        "and quantize: docs/benchmarks.md), so its candidates are ranked apart from the exact layouts above")


def island_search_inputs(cfg, cluster):
    """(config, cluster) of one island: a site's nodes and its share of the global batch; PlanError when the batch
    does not split over the sites."""
    gb, sites = cfg.train.global_batch, cluster.sites
    if gb % sites:
        raise PlanError(f"train.global_batch = {gb} does not split over {sites} sites (one island each); a multiple "
                        f"of {sites} does")
    island = copy.deepcopy(cfg)
    island.train.global_batch = gb // sites
    island.strategy.diloco.enable = False
    validate(island)
    return island, dataclasses.replace(cluster, nodes=cluster.site_nodes)


def candidate(cfg, island_cfg, island_lay, cluster, layout_config, inner_steps: int, quantize: str, docs=None):
    """One DiLoCo candidate: the island's layout (island_lay, from the search on one site) on every site, meeting
    every inner_steps steps with the exchange `quantize`; its prediction with the replica link's time per step
    added to the step, and its memory with the outer state. layout_config: search.config_for."""
    full = layout_config(island_cfg, island_lay)
    full.train.global_batch = cfg.train.global_batch
    dl = full.strategy.diloco
    dl.enable, dl.replicas, dl.inner_steps, dl.quantize = True, cluster.sites, inner_steps, quantize
    validate(full)
    lay = resolve(full, cluster.world)
    sts = pm.stage_facts(full, lay, docs)
    r = pm.predict_layout(full, lay, cluster, (0, 1, lay.pp - 1), sts=sts)
    link_s = r["replica"]["seconds_per_step"]
    mem = max(s["memory"]["total"] for s in r["stages"])      # the outer state counted (planner/model.py)
    step = r["time"]["step"] + link_s
    return {"layout": lay, "config": full, "inner_steps": inner_steps, "quantize": quantize,
            "replica_bytes": max(sum(s["traffic"]["replica"].values()) for s in r["stages"]),
            "time": {"inner": r["time"]["step"], "replica": link_s, "step": step}, "memory": mem,
            "link": r["replica"]["link"],
            "tokens_per_s": cfg.train.global_batch * cfg.model.seq_len * cfg.train.models / step}


def propose(cfg, cluster, island_rows, layout_config, docs=None) -> list[dict]:
    """DiLoCo candidates that fit, fastest first: for each H and quantize, the fastest of the island layouts of
    island_rows (search's rows on one site); ties go to less memory, then fewer bytes on the replica link."""
    island_cfg, _ = island_search_inputs(cfg, cluster)
    out = [candidate(cfg, island_cfg, r["layout"], cluster, layout_config, h, q, docs)
           for r in island_rows for h in INNER_STEPS for q in QUANTIZE]
    out = sorted((c for c in out if c["memory"] <= cluster.usable_gb * GB),
                 key=lambda c: (round(c["time"]["step"], 9), c["memory"], c["replica_bytes"]))
    first = {}
    for c in out:
        first.setdefault((c["inner_steps"], c["quantize"]), c)
    return list(first.values())


SHOWN = {"diloco": ("enable", "replicas", "inner_steps", "quantize")}     # set even where they equal the defaults


def settings(base, full) -> str:
    """The --set arguments that turn the base config's strategy tables into the candidate's (DiLoCo's own always)."""
    out = []
    for table in dataclasses.fields(full.strategy):
        was, now = getattr(base.strategy, table.name), getattr(full.strategy, table.name)
        for f in dataclasses.fields(now):
            v = getattr(now, f.name)
            if v != getattr(was, f.name) or f.name in SHOWN.get(table.name, ()):
                out.append(f"--set strategy.{table.name}.{f.name}={str(v).lower() if isinstance(v, bool) else v}")
    return " ".join(out)


def crossing(row: dict, cluster) -> list[tuple[str, float, float]]:
    """(axis, bytes per step its rank sends, exposed seconds per step) of each axis whose groups cross the slow
    link in an exact layout's prediction (the worst stage's traffic)."""
    lay = row["layout"]
    st = next(s for s in row["stages"] if s["stage"] == row["stage"])
    out = []
    for axis, deg in pm._degrees(lay).items():
        if deg > 1 and cluster.spans_sites(pm.axis_span(lay, axis)):
            sent = sum(b for op, b in st["traffic"].get(axis, {}).items() if op != "recv")
            out.append((axis, sent, row["time"][axis]))
    return out


def crossing_line(row: dict, cluster) -> str:
    """What the best exact layout's collectives cost on the slow link (already in its step time)."""
    name = cluster.site_link()[2]
    parts = [f"{axis} {_bytes(b)} per step ({_secs(t)} exposed)" for axis, b, t in crossing(row, cluster)]
    if not parts:
        return f"slow link: {name}: the best exact layout's collectives stay inside one site"
    return (f"slow link: {name}, timed in the step above: the best exact layout's collectives that cross it send "
            + ", ".join(parts) + f" of a {_secs(row['time']['step'])} step")


def table(cands: list[dict], top: int, dtype: str) -> list[str]:
    """The DiLoCo candidates: the island's layout columns, H, quantize, memory, inner step, replica bytes and link
    time per step, the step with them, tokens/s."""
    rows = cands[:top]
    used = {"ep": lambda lay: lay.ep > 1, "cp": lambda lay: lay.cp > 1, "sched": lambda lay: lay.pp > 1,
            "m": lambda lay: lay.pp > 1, "sp": lambda lay: lay.sp}       # columns shown only where a row uses them
    cols = [c for c in LAYOUT_COLS if c[0] not in used or any(used[c[0]](r["layout"]) for r in rows)]
    ms, mn = _unit(max(r["memory"] for r in rows), [(GB, "GB"), (1e6, "MB"), (1, "B")])
    ts, tn = _unit(max(r["time"]["step"] for r in rows), [(1, "s"), (1e-3, "ms"), (1e-6, "us")])
    head = (" ".join(f"{c:>{w}}" for c, w, _ in cols) + f" |   H quant | {mn:>5} | {'inner':>6} {'replica':>8} "
            f"{'link':>6} {'step':>6} {tn:<2}| {'tok/s':>9}")
    lines = [head, "-" * len(head)]
    for i, r in enumerate(rows, 1):
        t = r["time"]
        lines.append(" ".join(_cells(r["layout"], i, dtype, cols)) + f" | {r['inner_steps']:>3} {r['quantize']:>5} | "
                     f"{r['memory'] / ms:>5.1f} | {t['inner'] / ts:>6.3g} {_bytes(r['replica_bytes']):>8} "
                     f"{t['replica'] / ts:>6.3g} {t['step'] / ts:>6.3g} {'':<2}| {r['tokens_per_s']:>9,.0f}")
    return lines


def report(cfg, cluster, best: dict, top: int, search_island, layout_config, docs=None) -> list[str]:
    """The lines `hpengine plan` adds when the cluster has sites: the best exact layout's cost on the slow link, then
    the DiLoCo candidates (search_island(cfg, cluster): the search's rows for one island) and the settings of the
    first (one line, to paste)."""
    out = _wrap(crossing_line(best, cluster)) + [""]
    sites, n = cluster.sites, cluster.site_nodes
    head = (f"DiLoCo: one island per site ({sites} islands of {n} x {cluster.gpus_per_node} devices), each laid out by "
            f"the search above on its own ranks and share of the batch; the islands meet every H steps on "
            f"{cluster.site_link()[2]}, its time per step added to the step. {NOTE}")
    try:
        island_cfg, island_cluster = island_search_inputs(cfg, cluster)
        cands = propose(cfg, cluster, search_island(island_cfg, island_cluster), layout_config, docs)
    except (ConfigError, ValueError) as e:     # PlanError is a ConfigError; resolve's errors are ValueErrors
        return out + _wrap(head) + _wrap(f"no DiLoCo candidate: {e}")
    if not cands:
        return out + _wrap(head) + _wrap(f"no DiLoCo candidate fits once the outer state is counted "
                                         f"({cluster.usable_gb:.4g} GB usable per device)")
    best_c = cands[0]
    legend = ("island columns as above, for one island; H inner steps between meetings; quant the exchange; "
              "memory with the outer state; inner: the island's step; replica: bytes per step each rank sends on the "
              "link; link: their time per step; step: inner + link")
    return (out + _wrap(head) + [""] + table(cands, top, cfg.model.dtype) + _wrap(f"legend: {legend}") + [""]
            + _wrap(f"best DiLoCo: {sites} islands meeting every {best_c['inner_steps']} steps (quantize "
                    f"{best_c['quantize']}), step {_secs(best_c['time']['step'])} against "
                    f"{_secs(best['time']['step'])} for the best exact layout; its settings, to add to the command:")
            + [f"  {settings(cfg, best_c['config'])}"])


def _wrap(line: str) -> list[str]:
    return textwrap.wrap(line, 120, subsequent_indent="  ", break_on_hyphens=False) or [""]
