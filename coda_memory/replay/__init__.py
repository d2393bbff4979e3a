"""Replay an event stream through a MemoryService and measure memory's quality.

``read_events`` reads the documented event format (JSON lines or CSV), ``build_timeline``
groups it into sessions and splits it in time, ``replay_decay`` drives a real service
with a simulated clock, ``replay_baselines`` scores the methods without decay on the
same sessions, and ``tune`` searches each strategy's constants on the fitting period.
"""

from coda_memory.replay.events import Event, observation_event, read_events, write_events
from coda_memory.replay.harness import (
    PeriodScores,
    ReplayResult,
    StoreNotScratch,
    replay_baselines,
    replay_decay,
)
from coda_memory.replay.metrics import Calibration, RankingScore, hit_at, ndcg_at
from coda_memory.replay.report import markdown_table, plot_reliability
from coda_memory.replay.timeline import Session, Timeline, build_timeline
from coda_memory.replay.tuning import FAMILIES, Family, Tuned, tune

__all__ = [
    "FAMILIES",
    "Calibration",
    "Event",
    "Family",
    "PeriodScores",
    "RankingScore",
    "ReplayResult",
    "Session",
    "StoreNotScratch",
    "Timeline",
    "Tuned",
    "build_timeline",
    "hit_at",
    "markdown_table",
    "ndcg_at",
    "observation_event",
    "plot_reliability",
    "read_events",
    "replay_baselines",
    "replay_decay",
    "tune",
    "write_events",
]
