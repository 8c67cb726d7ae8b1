"""Precompute's processing step: every raw shard's result, reused from the scratch folder when an earlier run
finished it (:mod:`.resume`), else processed by this rank's worker processes (:mod:`toolkit.core.forkpool`,
one task per raw shard, :mod:`.worker`); on several ranks rank 0 then reads every rank's results back
(:mod:`.dist`). Called by every rank of ``data precompute`` (:mod:`.stage`).
"""

from __future__ import annotations

import os
import time

from toolkit.core import forkpool
from toolkit.core.log import counter
from toolkit.data.raw.reader import promised_samples
from toolkit.data.trainset.precompute import resume, worker
from toolkit.data.trainset.precompute.dist import Ranks, check_counts
from toolkit.data.trainset.precompute.job import Job


def process_shards(
    job: Job, urls: list[str], work: str, log, ranks: Ranks
) -> tuple[list[worker.ShardResult], dict]:
    """Every raw shard's result in URL order: reused from ``work`` if finished earlier, else processed
    (this rank's share of them, then every rank's results read back from ``work``)."""
    cfg = job.cfg
    ref = (
        job.reference.identity() if job.reference is not None else None
    )  # a model folder may change in place
    key = resume.process_key(cfg)
    scratch = job.scratch_fields
    done = _resumed(urls, work, key, scratch, ref, ranks, log)
    tasks = [
        job.task(index=i, url=u, work=work) for i, u in enumerate(urls) if i not in done and ranks.owns(i)
    ]
    cores = max(1, len(os.sched_getaffinity(0)) // ranks.local_world)  # this node's cores among its ranks
    workers = max(1, min(cfg.num_workers or cores, len(tasks)))
    if job.on_device:
        workers = 1  # a CUDA tower cannot be used in forked workers: this rank's GPU encodes inline
    log.info(
        "precompute: processing %d of %d raw shards with %d workers -> %s",
        len(tasks),
        len(urls),
        workers,
        cfg.out,
    )
    start = time.monotonic()
    resumed = sum(r.num_read for i, r in done.items() if ranks.owns(i))
    mine = [u for i, u in enumerate(urls) if ranks.owns(i)]
    with counter(promised_samples(mine), desc="precompute", unit="samples") as count:
        count.advance(resumed)
        fresh = _run_tasks(job, tasks, workers, lambda r: resume.save(work, r, key, ref), count)
    if ranks.world > 1:  # every rank's counts, then rank 0 reads the others' records from the scratch folder
        gathered = ranks.gather_counts({r.index: r.num_read for r in fresh})
        if ranks.rank == 0:
            theirs = resume.load(work, urls, key, scratch, reference=ref)
            check_counts(gathered, {i: r.num_read for i, r in theirs.items()}, urls, work)
            fresh = [r for i, r in theirs.items() if i not in done]
    timing = {
        "process_s": round(time.monotonic() - start, 3),
        "num_workers": workers,
        "num_resumed_raw_shards": len(done),
        "num_resumed_samples": resumed,
    }
    return sorted([*done.values(), *fresh], key=lambda r: r.index), timing


def _resumed(urls: list[str], work: str, key, scratch, ref, ranks: Ranks, log) -> dict:
    """{raw shard index: result} of the raw shards an earlier run finished into ``work``."""
    if ranks.rank == 0:  # rank 0 prunes the scratch folder before any other rank writes into it
        done = resume.load(work, urls, key, scratch, reference=ref)
        ranks.barrier()
    else:
        ranks.barrier()
        done = resume.load(work, urls, key, scratch, prune=False, reference=ref)
    if done and ranks.rank == 0:
        log.info(
            "precompute: resuming: %d of %d raw shards were processed by an earlier run", len(done), len(urls)
        )
    return done


def _run_tasks(job: Job, tasks: list[worker.ShardTask], num_workers: int, on_done, count) -> list:
    """Run every task (in forked workers when num_workers > 1), calling ``on_done(result)`` as each finishes.

    Progress is in samples read (``count``), not in shards: one big shard would sit at 0/1 until the end.
    """
    results = []
    if num_workers <= 1:
        for task in tasks:
            results.append(worker.process_shard(job, task, count.advance))
            on_done(results[-1])
        return results
    base = count.done  # samples of resumed shards

    def done(res) -> None:
        results.append(res)
        on_done(res)

    # worker.process_shard is looked up now, in the parent: the workers run what this process would
    forkpool.run(
        worker.process_shard,
        job,
        tasks,
        num_workers,
        done,
        start=job.worker_start,
        on_progress=lambda read: count.advance(base + read - count.done),
        name="precompute",
    )
    return results
