"""The lines a run logs about itself: the config keys it was given, the mesh, BLAS threads, sync, model and
optimizer at start-up (and, packed documents under context parallelism, the cp ranks' attention work), memory
per rank, and the pipeline's measured bubble beside the schedule's theory.
"""
from __future__ import annotations

import logging
import math

from hpengine.config.load import given_keys
from hpengine.device.threads import describe as blas_threads_line
from hpengine.layout.resolve import chunks
from hpengine.layout.schedules import bubble_fraction
from hpengine.models import build_model
from hpengine.nn.context_split import document_work, imbalance, split_work
from hpengine.optim.muon import is_muon_matrix

log = logging.getLogger("hpengine")


def config_line(cfg) -> str:
    """The start-up line on the config: the keys the config file and --set gave (those at their default
    counted, not listed); for a Config built in code, the keys off their default."""
    changed, same = given_keys(cfg)
    if cfg.given is None:
        return "config (resolved; written in full to config.toml; keys not at their default): " + (
            ", ".join(changed) or "none")
    listed = ", ".join(changed) + (f" (and {same} more set to their default)" if same else "")
    if not changed:
        listed = f"{same} key{'s' * (same > 1)}, each set to its default" if same else "none"
    return f"config (resolved; written in full to config.toml; the keys you set): {listed}"


def log_start(eng, cfg) -> None:
    log.info("%s", config_line(cfg))
    log.info("%s", eng.mesh.describe())
    log.info("%s", blas_threads_line())
    sync_line, blocks = eng.describe()
    if sync_line:
        log.info("%s", sync_line)
    whole, mine = eng.param_counts()      # collective on pp: every rank runs log_start
    share = (f" (pipeline stage {eng.mesh.coords['pp']} of {eng.res.pp}: {mine:,} parameters, {blocks} "
             "blocks)" if eng.res.pp > 1 else "")
    log.info("model %s: %s parameters, %d blocks%s, dtype %s, backend %s", cfg.model.kind, f"{whole:,}",
             sum(len(c) for c in chunks(cfg.model, eng.res)), share, cfg.model.dtype, eng.be.name)
    log.info("%s", optimizer_line(cfg))
    if eng.res.cp > 1 and cfg.data.document_mask:
        log.info("%s", cp_balance_line(eng, cfg))


def optimizer_line(cfg) -> str:
    """The start-up line on the optimizer: its name, and under Muon which tensors it orthogonalises (whole model)."""
    o = cfg.optim
    if o.name != "muon":
        return f"optimizer {o.name}: lr {o.lr:g}, betas {tuple(o.betas)}, weight decay {o.weight_decay:g}"
    model = build_model(cfg.model)
    specs = [sp for b in model.blocks() for sp in model.specs(b.name)]
    mats = [sp for sp in specs if is_muon_matrix(sp)]
    count = sum(sp.global_shape[0] if len(sp.global_shape) == 3 else 1 for sp in mats)
    size = lambda group: sum(math.prod(sp.global_shape) for sp in group)  # noqa: E731
    return (f"optimizer muon: Newton-Schulz ({o.muon_ns_steps} iterations) on {count} weight matrices of the blocks "
            f"({size(mats):,} parameters; lr rule {o.muon_lr_adjust}, momentum {o.muon_momentum:g}), AdamW on the "
            f"other {len(specs) - len(mats)} tensors ({size(specs) - size(mats):,} parameters)")


def cp_balance_line(eng, cfg) -> str:
    """The cp ranks' attention work (query-key pairs their queries see under the document mask) on the first
    step's rows, from the documents alone (no token is read): with each document split head-tail over the
    ranks (the split the run uses), beside what splitting each packed row head-tail would give."""
    batch = eng.data.batch("train", 0, eng.slots[0].seed, cfg.train.global_batch, tokens=False)
    work = split_work(batch.segments, batch.positions, eng.res.cp)
    rows = document_work(batch.positions, eng.res.cp)
    return (f"context parallel over packed documents: attention work per cp rank on the first batch (query-key "
            f"pairs under the document mask), each document split head-tail: busiest / mean = "
            f"{imbalance(work):.3f}, per rank {work.tolist()}; each packed row split head-tail would give "
            f"{imbalance(rows):.3f}, per rank {rows.tolist()}")


def log_memory(eng) -> None:
    mem = eng.memory()
    mib = lambda k: mem[k] / 2**20  # noqa: E731
    log.info("memory per rank: params %.2f MiB, grads %.2f MiB, optimizer %.2f MiB, transient peak "
             "%.2f MiB, peak RSS %.0f MiB", mib("param_bytes"), mib("grad_bytes"), mib("optim_bytes"),
             mib("transient_peak_bytes"), mib("peak_rss_bytes"))


def log_pipeline(eng, cfg) -> None:
    """Measured bubble (idle share of the executor's wall time) per stage next to the theory."""
    res = eng.res
    stats = eng.pipeline_stats() if cfg.strategy.pipeline.enable else None
    if stats is None:
        return
    theory = bubble_fraction(res.schedule, res.pp, res.m, res.v)
    log.info("pipeline %s p=%d m=%d v=%d: measured bubble per stage %s (theory %.3f); peak live activation "
             "caches per stage %s", res.schedule, res.pp, res.m, res.v,
             [round(b, 3) for b, _ in stats], theory, [n for _, n in stats])
